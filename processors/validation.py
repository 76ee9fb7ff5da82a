"""Checks shared by processor args models (they receive the engine config as validation context)."""

from __future__ import annotations

from pydantic import ValidationInfo


def vocab_size(info: ValidationInfo) -> int | None:
    fd_config = (info.context or {}).get("fd_config")
    return None if fd_config is None else fd_config.model_config.vocab_size


def check_token_ids(ids, info: ValidationInfo) -> None:
    size = vocab_size(info)
    for t in ids:
        if t < 0 or (size is not None and t >= size):
            raise ValueError(f"token id {t} is outside the vocabulary (0..{(size or 0) - 1})")
