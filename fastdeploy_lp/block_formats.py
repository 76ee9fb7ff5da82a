"""Weights kept in GGML's block formats: what a GGUF file stores (Q4_0, Q4_K, Q6_K, ...) and what
`--quantization wint4` makes of a safetensors checkpoint.

A block holds `elems` consecutive weights of one row in `bytes` bytes (scales and packed quants);
a row of K weights is K / elems blocks. The CPU kernels (`cpu_kernels/blocks.h`) multiply the blocks
as stored, so a linear layer's weight is the file's bytes, in one uint8 tensor. A `WeightLayout`
says how to read them: row ranges (`parts`), each in one format, one after the other. A GGUF q/k/v
projection fused into one weight may mix formats (a Q4_K_M file keeps some layers' v rows in Q6_K);
parts may also be F32, F16 or BF16 rows, as a GGUF file can store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    name: str   # GGML's name
    code: int   # the kernels' format id (blocks.h FMT_*; 0-2 for the float formats)
    elems: int  # weights per block
    bytes: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        if k % self.elems:
            raise ValueError(f"{self.name} stores rows of whole {self.elems}-weight blocks, not {k} weights")
        return k // self.elems * self.bytes


FORMATS = {f.name: f for f in (
    BlockFormat("F32", 0, 1, 4), BlockFormat("BF16", 1, 1, 2), BlockFormat("F16", 2, 1, 2),
    BlockFormat("Q4_0", 102, 32, 18), BlockFormat("Q4_1", 103, 32, 20), BlockFormat("Q5_0", 106, 32, 22),
    BlockFormat("Q5_1", 107, 32, 24), BlockFormat("Q8_0", 108, 32, 34), BlockFormat("Q4_K", 112, 256, 144),
    BlockFormat("Q5_K", 113, 256, 176), BlockFormat("Q6_K", 114, 256, 210),
    # wint4 with groups of 128 (no GGML type): a float16 scale, then Q4_0's nibbles for each 32.
    BlockFormat("W4G128", 200, 128, 66),
)}
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
WINT4_GROUPS = (32, 128)


def wint4_format(group: int) -> str:
    """`--quantization wint4`'s format for linear layers: symmetric 4-bit, a float16 scale per
    `group` weights. Groups of 32 are GGML's Q4_0 (a llama.cpp file of the same weights holds the
    same bytes); groups of 128 are W4G128, 4.125 bits a weight instead of 4.5."""
    if group not in WINT4_GROUPS:
        raise ValueError(f"wint4_group_size: {group!r}; use 32 or 128")
    return "Q4_0" if group == 32 else "W4G128"


@dataclass(frozen=True)
class WeightLayout:
    """A weight `[rows, in_features]` stored as `parts`: `(format name, rows)` in row order."""

    parts: tuple[tuple[str, int], ...]
    in_features: int

    def __post_init__(self):
        if not 1 <= len(self.parts) <= 3:  # layer.h's FDLP_PARTS
            raise ValueError(f"a weight of 1 to 3 formats, not {len(self.parts)}")
        for name, _ in self.parts:
            FORMATS[name].row_bytes(self.in_features)

    @classmethod
    def of(cls, parts: list[tuple[str, int]], in_features: int) -> "WeightLayout":
        """Adjacent parts of one format merged (q, k and v all Q4_K: one part)."""
        merged: list[list] = []
        for name, rows in parts:
            if merged and merged[-1][0] == name:
                merged[-1][1] += rows
            else:
                merged.append([name, rows])
        return cls(tuple((name, rows) for name, rows in merged), in_features)

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(i) for i in range(len(self.parts)))

    def part_bytes(self, i: int) -> int:
        name, rows = self.parts[i]
        return rows * FORMATS[name].row_bytes(self.in_features)

    def describe(self) -> str:
        return " + ".join(f"{rows} rows {name}" for name, rows in self.parts) if len(self.parts) > 1 else self.parts[0][0]


def split_rows(data: np.ndarray, layout: WeightLayout, start: int, end: int) -> tuple[np.ndarray, WeightLayout]:
    """Rows `[start, end)` of a weight's bytes (a tensor-parallel rank's share) and their layout."""
    parts, pieces, row, offset = [], [], 0, 0
    for i, (name, rows) in enumerate(layout.parts):
        row_bytes = FORMATS[name].row_bytes(layout.in_features)
        lo, hi = max(start, row), min(end, row + rows)
        if lo < hi:
            pieces.append(data[offset + (lo - row) * row_bytes: offset + (hi - row) * row_bytes])
            parts.append((name, hi - lo))
        row += rows
        offset += layout.part_bytes(i)
    return np.concatenate(pieces), WeightLayout.of(parts, layout.in_features)
