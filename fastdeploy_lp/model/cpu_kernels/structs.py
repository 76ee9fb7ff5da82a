"""The C structs the CPU kernels take by pointer (layer.h), as ctypes, and what builds them from Paddle
tensors: a linear layer, a pass's attention inputs, a model's layers for the fused call, and a pass's
LoRA adapters. `tests/test_kernel_signatures.py` holds each field for field to its C typedef."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy_lp.block_formats import FORMATS, WeightLayout


@dataclass
class PagedAttention:
    """A pass's attention inputs for `CpuKernels.decoder_layers`, as `rotary_cache_write` and
    `paged_attention` take them for one sequence group (each layer's cache aside: `LayerStack`)."""

    cos: paddle.Tensor
    sin: paddle.Tensor
    positions: paddle.Tensor
    write_rows: paddle.Tensor
    tables: paddle.Tensor
    lens: paddle.Tensor
    seqs: int
    new_tokens: int
    heads: int
    kv_heads: int
    dim: int
    block_size: int
    max_len: int
    scale: float


class _Linear(ctypes.Structure):  # layer.h's fdlp_linear_t
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("parts", ctypes.c_int64), ("format", ctypes.c_int64 * 3), ("rows", ctypes.c_int64 * 3)]

    @classmethod
    def of(cls, weight: paddle.Tensor, scale: paddle.Tensor | None, bias: paddle.Tensor | None,
           layout: WeightLayout | None) -> "_Linear":
        """A weight held as one Paddle dtype (`_FORMATS`), or as the bytes `layout` describes."""
        parts = ([(_FORMATS[weight.dtype], weight.shape[0])] if layout is None
                 else [(FORMATS[name].code, rows) for name, rows in layout.parts])
        codes, rows = [code for code, _ in parts], [n for _, n in parts]
        return cls(weight.data_ptr(), _ptr(scale), _ptr(bias), len(parts), (ctypes.c_int64 * 3)(*codes),
                   (ctypes.c_int64 * 3)(*rows))


class _Attention(ctypes.Structure):  # layer.h's fdlp_attention_t
    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("cos", "sin", "positions", "write_rows", "tables", "lens", "k_cache", "v_cache")]
                + [(name, ctypes.c_int64) for name in ("kv_bf16", "seqs", "new_tokens", "heads", "kv_heads", "dim", "block_size",
                                                         "table_width", "max_len")]
                + [("scale", ctypes.c_float)])


_FORMATS = {paddle.float32: 0, paddle.bfloat16: 1, paddle.float16: 2, paddle.int8: 3}  # layer.h's linear_of


@dataclass
class LayerStack:
    """What `decoder_layers` reads of a model's layers and KV caches, whose tensors stay where they
    are: built once (`model/fused_layer.py` keeps it), as the C arrays layer.h takes."""

    tensors: list  # what the pointers point into, kept alive with them
    norms: ctypes.Array        # 2 per layer
    final_norm: int            # the model's norm after the last layer
    linears: ctypes.Array      # 4 per layer: q/k/v, o, gate/up, down
    caches: ctypes.Array       # 2 per layer: keys, values
    kv_bf16: bool              # the caches hold bfloat16 (else float32)
    layers: int
    hidden: int
    inter: int
    eps: float

    @classmethod
    def of(cls, norms: list[tuple], linears: list[tuple], caches: list[tuple], final_norm: paddle.Tensor, inter: int,
           eps: float) -> "LayerStack":
        """`norms` (norm1, norm2 weights), `linears` (4 (weight, scale, bias, layout) each) and
        `caches` (keys, values) per layer, all layers alike but for the weights' formats; the
        `final_norm` weight; `inter` the MLP width."""
        flat = [t for layer in linears for lin in layer for t in lin[:3]]
        return cls(tensors=[*flat, *(t for pair in norms + caches for t in pair), final_norm],
                   norms=(ctypes.c_void_p * (2 * len(norms)))(*(w.data_ptr() for pair in norms for w in pair)),
                   final_norm=final_norm.data_ptr(),
                   linears=(_Linear * (4 * len(linears)))(*(_Linear.of(*lin) for layer in linears for lin in layer)),
                   caches=(ctypes.c_void_p * (2 * len(caches)))(*(c.data_ptr() for pair in caches for c in pair)),
                   kv_bf16=caches[0][0].dtype == paddle.bfloat16, layers=len(linears), hidden=norms[0][0].shape[0], inter=inter, eps=eps)


def _ptr(tensor: paddle.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class _LoRAWeight(ctypes.Structure):  # layer.h's fdlp_lora_weight_t
    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("format", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("a_rows", ctypes.c_int64), ("column", ctypes.c_int64 * 3)]


class _LoRA(ctypes.Structure):  # layer.h's fdlp_lora_t
    _fields_ = [("adapters", ctypes.c_int64), ("stride", ctypes.c_int64), ("row_adapter", ctypes.c_void_p),
                ("weights", ctypes.c_void_p), ("shrunk", ctypes.c_void_p)]


def lora_table(updates: list[tuple[paddle.Tensor, paddle.Tensor, tuple[int, ...]] | None]) -> ctypes.Array:
    """One adapter's updates of a model's linears (4 per layer: q/k/v, o, gate/up, down), each its A
    `[a_rows, in]`, scaled B^T in panels `[panels, rank, LORA_PANEL]` (layer.h) and the first
    column each output segment reads (-1: none), or None where it does not touch the linear; float32, bfloat16 or float16 (both alike),
    contiguous, kept alive by the caller."""
    def entry(update):
        if update is None:
            return _LoRAWeight(None, None, 0, 0, 0, (ctypes.c_int64 * 3)(-1, -1, -1))
        a, bt, columns = update
        return _LoRAWeight(a.data_ptr(), bt.data_ptr(), _FORMATS[a.dtype], bt.shape[1], a.shape[0],
                           (ctypes.c_int64 * 3)(*columns, *[-1] * (3 - len(columns))))
    return (_LoRAWeight * len(updates))(*(entry(u) for u in updates))


@dataclass
class LoRAInputs:
    """A pass's adapters as `decoder_layers` and `lora_update` take them (layer.h's fdlp_lora_t):
    row m runs with adapter `row_adapter[m]` of `tables` (`lora_table`s; -1: the base)."""

    struct: _LoRA
    kept: list  # what the struct's pointers point into

    @classmethod
    def of(cls, tables: list[ctypes.Array], row_adapter: np.ndarray) -> "LoRAInputs":
        stride = max(max(w.a_rows for w in table) for table in tables)
        rows = np.ascontiguousarray(row_adapter, dtype=np.int64)
        pointers = (ctypes.POINTER(_LoRAWeight) * len(tables))(*tables)
        shrunk = paddle.empty([len(rows) * stride], dtype="float32")
        struct = _LoRA(len(tables), stride, rows.ctypes.data, ctypes.cast(pointers, ctypes.c_void_p),
                       shrunk.data_ptr())
        return cls(struct, [tables, rows, pointers, shrunk])
