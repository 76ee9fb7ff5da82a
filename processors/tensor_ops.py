"""Sparse, in-place edits of a `[rows, vocab]` logits tensor, each one batched indexed write.

Indices may be Python sequences, numpy arrays or Paddle tensors; processors that keep the same
edits across steps build the tensors once with `index_tensor` (on the logits' device) and pass
them in, so a step costs one kernel and no host-to-device copy. `gather_rows` moves per-row
state to a new batch's rows when requests join or leave.
"""

from __future__ import annotations

import numpy as np
import paddle


def index_tensor(values, like: paddle.Tensor, dtype: str = "int64") -> paddle.Tensor:
    """`values` as a tensor on the device of `like`."""
    if isinstance(values, paddle.Tensor):
        return values
    return paddle.to_tensor(np.asarray(values), dtype=dtype, place=like.place)


def add_at(logits: paddle.Tensor, rows, cols, values) -> paddle.Tensor:
    """logits[rows[i], cols[i]] += values[i], in place; repeated pairs add up.

    On CPU repeated pairs are summed on the host first: Paddle's CPU `index_put_(accumulate=True)`
    adds repeated indices from several threads without atomics (100 adds of 1 to one element came
    out short in 5 of 20 trials on two threads). GPU kernels add atomically.
    """
    if logits.place.is_cpu_place():
        rows, cols, values = _sum_repeated_pairs(rows, cols, values)
    if len(rows) == 0:
        return logits
    index = (index_tensor(rows, logits), index_tensor(cols, logits))
    return logits.index_put_(index, index_tensor(values, logits, logits.dtype), accumulate=True)


def _sum_repeated_pairs(rows, cols, values) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs with their values summed, each pair once; zero values are dropped (adding 0 is a
    no-op, and processors that mask with -inf/0 send mostly zeros)."""
    rows, cols, values = (np.asarray(v.numpy() if isinstance(v, paddle.Tensor) else v).reshape(-1)
                          for v in (rows, cols, values))
    keep = values != 0
    rows, cols, values = rows[keep].astype(np.int64), cols[keep].astype(np.int64), values[keep]
    if len(rows) == 0:
        return rows, cols, values
    width = int(cols.max()) + 1
    keys, inverse = np.unique(rows * width + cols, return_inverse=True)
    if len(keys) == len(rows):
        return rows, cols, values
    sums = np.zeros(len(keys), dtype=values.dtype)
    np.add.at(sums, inverse.reshape(-1), values)
    return keys // width, keys % width, sums


def fill_at(logits: paddle.Tensor, rows, cols, value: float = float("-inf")) -> paddle.Tensor:
    """logits[rows[i], cols[i]] = value, in place."""
    if len(rows) == 0:
        return logits
    index = (index_tensor(rows, logits), index_tensor(cols, logits))
    return logits.index_put_(index, paddle.full([1], value, dtype=logits.dtype))


def gather_rows(tensor: paddle.Tensor, previous_rows, fill) -> paddle.Tensor:
    """Per-row data re-indexed for a new batch (`BatchUpdate.previous_rows`): row i is the old row
    `previous_rows[i]`, or all `fill` where that is -1 (a request that joined). One gather on the
    tensor's device."""
    previous_rows = np.asarray(previous_rows, dtype=np.int64)
    joined = previous_rows < 0
    if tensor.shape[0] == 0 or joined.all():
        return paddle.full([len(previous_rows), *tensor.shape[1:]], fill, dtype=tensor.dtype)
    out = paddle.index_select(tensor, index_tensor(np.maximum(previous_rows, 0), tensor))
    if joined.any():
        out[index_tensor(np.flatnonzero(joined), tensor)] = fill
    return out
