"""A GGUF file as the loader reads a checkpoint: its tensors under their Hugging Face names
(`gguf_file.GGUFModel.hf_tensors`), checked against what the decoder needs, and read one at a time,
a tensor-parallel rank's rows or columns only."""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_lp import gguf_file
from fastdeploy_lp.block_formats import FLOAT_DTYPES, FORMATS, WeightLayout
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model_config import ModelConfig, UnsupportedCheckpointError, listing


class GGUFCheckpoint:
    """A GGUF file's tensors under their Hugging Face names (`gguf_file.GGUFModel.hf_tensors`)."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.file = gguf_file.open_model(gguf_file.gguf_files(config.model))
        self.tensors = self.file.hf_tensors()

    def type_of(self, name: str) -> str:
        return self.tensors[name].type

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Refuse, naming them, tensors the model would not use, missing ones, wrong shapes and types
        the kernels do not multiply."""
        have = {name: info.shape for name, info in self.tensors.items()}
        extra = set(have) - set(expected)
        missing = [n for n in expected if n not in have]
        wrong_shape = [n for n in expected if n in have and have[n] != expected[n]]
        wrong_type = sorted(n for n in set(expected) & set(have) if not gguf_file.supported_type(self.tensors[n].type)
                            or (len(expected[n]) == 1 and self.tensors[n].type not in FLOAT_DTYPES))
        problems = []
        if extra:
            problems.append(f"{len(extra)} tensor(s) the model does not use: "
                            + listing(extra, lambda n: repr(self.tensors[n].name)))
        if missing:
            problems.append(f"{len(missing)} tensor(s) the model needs are missing: {listing(missing)}")
        if wrong_shape:
            problems.append(f"{len(wrong_shape)} tensor(s) have the wrong shape: " + listing(
                wrong_shape, lambda n: f"{self.tensors[n].name!r} is {list(have[n])}, the metadata says {list(expected[n])}"))
        if wrong_type:
            problems.append(f"{len(wrong_type)} tensor(s) have a type the engine does not multiply (it does "
                            f"{', '.join(n for n in FORMATS if gguf_file.supported_type(n))}): "
                            + listing(wrong_type, lambda n: f"{self.tensors[n].name!r} ({self.tensors[n].type})"))
        if problems:
            raise UnsupportedCheckpointError(f"model: the GGUF file {self.config.model!r} does not fit its "
                                             f"metadata: " + "; ".join(problems))

    def take(self, names: tuple[str, ...], layout, split: dict[str, int], shard: TensorShard | None,
             dtype) -> np.ndarray:
        """The named tensors (this rank's part of split ones), rows concatenated: their bytes for a
        `layout`, else float values in `dtype`."""
        parts = []
        for name in names:
            info, axis = self.tensors[name], split.get(name, 0)
            span = shard.part(info.shape[axis]) if name in split else None
            rows = self.file.hf_rows(name, info, self.config.num_attention_heads, self.config.num_key_value_heads,
                                     axis, span)
            parts.append(rows.reshape(-1) if isinstance(layout, WeightLayout) else gguf_file.as_float32(rows, info.type))
        value = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if isinstance(layout, WeightLayout):
            return value
        return value if dtype == paddle.float32 else paddle.to_tensor(value).astype(dtype)
