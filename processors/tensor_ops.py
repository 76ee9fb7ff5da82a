"""Sparse edits of a `[rows, vocab]` logits tensor, batched into one scatter each."""

from __future__ import annotations

import paddle


def _flat_index(logits: paddle.Tensor, rows, cols) -> paddle.Tensor:
    vocab = logits.shape[-1]
    rows = paddle.to_tensor(rows, dtype="int64", place=logits.place)
    cols = paddle.to_tensor(cols, dtype="int64", place=logits.place)
    return rows * vocab + cols


def add_at(logits: paddle.Tensor, rows, cols, values) -> paddle.Tensor:
    """logits[rows[i], cols[i]] += values[i] (pairs must be distinct)."""
    if len(rows) == 0:
        return logits
    flat = logits.reshape([-1])
    index = _flat_index(logits, rows, cols)
    values = paddle.to_tensor(values, dtype=logits.dtype, place=logits.place)
    return paddle.scatter(flat, index, paddle.gather(flat, index) + values, overwrite=True).reshape(logits.shape)


def fill_at(logits: paddle.Tensor, rows, cols, value: float = float("-inf")) -> paddle.Tensor:
    """logits[rows[i], cols[i]] = value."""
    if len(rows) == 0:
        return logits
    flat = logits.reshape([-1])
    index = _flat_index(logits, rows, cols)
    fill = paddle.full([len(rows)], value, dtype=logits.dtype)
    return paddle.scatter(flat, index, fill, overwrite=True).reshape(logits.shape)
