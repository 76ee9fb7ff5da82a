"""CPU kernels for the forward pass, in C (`kernels.c`), built with the system compiler at first use.

Why hand-written: on the bench model's shapes every CPU BLAS tried here (Paddle's MKL, PyTorch's,
numpy's OpenBLAS) reads the weight at about half its GEMV speed once a product has 2 to 16 rows,
so a batch-8 decode step spent ~145 ms in GEMMs whose weights a GEMV streams in ~73 ms; and
Paddle's CPU kernels around the GEMMs (swiglu, rotary, argmax, transposes, attention over gathered
blocks) were single-threaded or scalar.

* `linear`: `x @ W^T` for up to 32 rows, each weight row streamed once for all rows of x.
* `paged_attention`: causal attention reading the KV blocks where they are, one call per layer
  (prefill chunks and decode), instead of a gather, two matmuls, a mask add and a softmax.
* `rotary_cache_write`: rotary on q/k and the cache write, in place in the fused q/k/v rows.
* `swiglu`, `argmax`, `transpose`: Paddle's ops, vectorised (exp) and on every core.
* `decoder_layers`: every layer of a pass over one sequence group of up to 32 tokens, the kernels
  above chained in C (`layer.h`, `model/fused_layer.py`): one call per pass instead of a dozen per layer.

**Built for the CPU the process sees.** The vector ISA comes from `cpu_features.detect()` (CPUID in
this process) and becomes the compile flags (`-mavx512f ...`, `-mavx2 -mfma -mf16c`, or none), so
the library holds no instruction the CPU lacks, whatever CPU the compiler itself runs on. It is
compiled once per source, compiler and flags into `$XDG_CACHE_HOME/fastdeploy_lp` (default
`~/.cache`) and linked against the OpenMP runtime next to Paddle (`libiomp5`), so its threads are
MKL's threads; two runtimes spinning on two cores made a step several times slower.

**Used only where measured faster.** `FDLP_CPU_KERNELS` picks the mode: `auto` (the default) runs a
kernel only for the ops and row buckets where `model.cpu_dispatch` timed it faster than the Paddle
op it replaces on this machine and model (Paddle's path until then); `1` runs every kernel; `0`
none. Without a C compiler `load()` returns None and the model uses Paddle's kernels. Numerics:
float32 accumulation, only the summation order differs from MKL's.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import numpy as np
import paddle

from fastdeploy_lp import envs
from fastdeploy_lp.model import cpu_features
from fastdeploy_lp.model.cpu_kernels.build import build
from fastdeploy_lp.model.cpu_kernels.structs import LayerStack, LoRAInputs, PagedAttention, _Attention, _Linear, _ptr
from fastdeploy_lp.block_formats import FLOAT_DTYPES, FORMATS, WeightLayout

logger = logging.getLogger(__name__)

SWITCH = "FDLP_CPU_KERNELS"
MODES = ("auto", "0", "1")
_threads = 1
_loaded: CpuKernels | None | bool = False  # False: not tried yet
_mode: str | None = None  # None: read FDLP_CPU_KERNELS at first use
_off_logged = False
_plan: dict[str, bool] = {}  # "op:bucket" -> the kernel won (auto mode), see `use_plan`


def set_threads(threads: int) -> None:
    """Threads the kernels use; the runner sets it with Paddle's own CPU thread count."""
    global _threads
    _threads = max(1, int(threads))


def threads() -> int:
    return _threads


def mode() -> str:
    """`auto` (default), `0` or `1` (see the module docstring): `set_mode`'s, else `FDLP_CPU_KERNELS`."""
    if _mode is None:
        set_mode(envs.get(SWITCH).strip().lower() or "auto")
    return _mode


def set_mode(value: str) -> None:
    """Override `FDLP_CPU_KERNELS` in this process (tests and benchmarks compare the modes)."""
    global _mode
    if value not in MODES:
        raise ValueError(f"{SWITCH}={value!r}: expected one of {', '.join(MODES)}")
    _mode = value


KERNEL_ROWS = 32  # up to this many rows of x `CpuKernels.linear` runs
LINEAR_BUCKETS = ((1, "1"), (8, "2-8"), (16, "9-16"), (KERNEL_ROWS, "17-32"))


def bucket(op: str, rows: int) -> str:
    """The row bucket a choice is measured and kept for: linear layers by rows of x (1, 2-8, 9-16,
    17-32: the weight-read-bound sizes), argmax, widen and blocks (block-format weights widened
    for prefill) as one (their cost and Paddle's grow alike), the others by decode (up to 32 rows)
    or prefill."""
    if op in ("argmax", "widen", "blocks"):
        return "all"
    if op == "linear":
        return next((name for top, name in LINEAR_BUCKETS if rows <= top), "prefill")
    return "decode" if rows <= KERNEL_ROWS else "prefill"


def use_plan(plan: dict[str, bool]) -> None:
    """Set the measured choices (`cpu_dispatch.prepare` does): `{"linear:2-8": True, ...}`."""
    _plan.clear()
    _plan.update(plan)


def for_op(op: str, rows: int) -> CpuKernels | None:
    """The kernels if they should run `op` over `rows` rows here, else None (use Paddle's op)."""
    kernels = load()
    if kernels is None:
        return None
    if mode() == "1":
        return kernels
    return kernels if _plan.get(f"{op}:{bucket(op, rows)}", False) else None


class CpuKernels:
    """ctypes bindings of `kernels.c`, taking and returning float32 Paddle CPU tensors."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        self.path = path
        self._scratch: dict[tuple[int, ...], paddle.Tensor] = {}  # widen's buffers
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.lanes = library.fdlp_lanes()  # floats per vector in this build
        self._read_sum, self._read_sum.argtypes = library.fdlp_read_sum, [ptr, i64, c_int]
        self._read_sum.restype = ctypes.c_double
        # One linear entry point for every weight format (layer.h); activations, scales and bias are float32.
        self._linear, self._linear.argtypes = library.fdlp_linear, [ptr] * 3 + [i64] * 3 + [c_int]
        self._dequantize = library.fdlp_dequantize
        self._dequantize.argtypes = [c_int, ptr, ptr, i64, i64, c_int]
        self._dequantize.restype = None
        self.block_unit_rows = library.fdlp_block_unit_rows  # rows of x from which a format's unit order runs
        self.block_unit_rows.argtypes = [c_int]
        self._quantize_blocks = library.fdlp_quantize_blocks
        self._quantize_blocks.argtypes = [c_int, ptr, ptr, i64, i64, c_int]
        self._widen_blocks = library.fdlp_widen_blocks
        self._widen_blocks.argtypes = [c_int, ptr, i64, i64, i64, ptr, c_int]
        self._embed_blocks = library.fdlp_embed_blocks
        self._embed_blocks.argtypes = [c_int] + [ptr] * 3 + [i64] * 3
        self._embed_blocks.restype = i64
        self._quantizers = {dtype: getattr(library, f"fdlp_quantize_{name}") for dtype, name in
                            ((paddle.float32, "f32"), (paddle.bfloat16, "bf16"), (paddle.float16, "f16"))}
        for fn in self._quantizers.values():
            fn.argtypes = [ptr] * 3 + [i64] * 2 + [c_int]
            fn.restype = None
        self._widens = {dtype: getattr(library, f"fdlp_widen_{name}") for dtype, name in
                        ((paddle.bfloat16, "bf16"), (paddle.float16, "f16"), (paddle.int8, "i8"))}
        for fn in self._widens.values():
            fn.argtypes = [ptr] * 3 + [i64] * 2 + [c_int]
            fn.restype = None
        self._embeds = {dtype: getattr(library, f"fdlp_embed_{name}") for dtype, name in
                        ((paddle.bfloat16, "bf16"), (paddle.float16, "f16"), (paddle.int8, "i8"))}
        for fn in self._embeds.values():
            fn.argtypes = [ptr] * 4 + [i64] * 3
            fn.restype = i64
        self._attention = library.fdlp_paged_attention
        self._attention.argtypes = [ptr] * 3 + [c_int] + [ptr] * 4 + [i64] * 8 + [ctypes.c_float, c_int]
        self._swiglu = library.fdlp_swiglu
        self._swiglu.argtypes = [ptr] * 2 + [i64] * 2 + [c_int]
        self._rotary_write = library.fdlp_rotary_cache_write
        self._rotary_write.argtypes = [ptr] * 7 + [c_int] + [i64] * 4 + [c_int]
        self._transpose = library.fdlp_transpose
        self._transpose.argtypes = [ptr] * 2 + [i64] * 2 + [c_int]
        self._argmax = library.fdlp_argmax
        self._argmax.argtypes = [ptr] * 3 + [i64] * 2 + [c_int]
        self._rms_norm, self.set_batch_invariant = library.fdlp_rms_norm, library.fdlp_set_batch_invariant
        self._rms_norm.argtypes, self.set_batch_invariant.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float, c_int], [c_int]
        self._set_bf16_dot, self._set_bf16_dot.argtypes = library.fdlp_set_bf16_dot, [c_int]  # returns: built with it
        self.set_bf16_dot(envs.get("FDLP_CPU_BF16_DOT") != "0")
        self._layers = library.fdlp_decoder_layers
        self._layers.argtypes = [ptr] * 3 + [i64] * 4 + [ptr, ptr, ctypes.c_float] + [ptr] * 5 + [c_int]
        self._lora_update = library.fdlp_lora_update
        self._lora_update.argtypes = [ptr, i64, ptr, ptr] + [i64] * 3 + [ptr, i64, c_int]
        for fn in (self._attention, self._swiglu, self._rotary_write, self._transpose, self._argmax, self._rms_norm,
                   self.set_batch_invariant, self._lora_update):
            fn.restype = None
        for fn in (self._linear, self._quantize_blocks, self._widen_blocks, self._layers):
            fn.restype = c_int  # 0, or -1: no memory (or an unknown format)

    def set_bf16_dot(self, on: bool) -> None:
        """Whether bfloat16 weights multiply bfloat16-rounded activations (`vdpbf16ps`, dot_bf16.h)
        where this build targets AVX-512 BF16; `bf16_dot` says whether they now do."""
        self.bf16_dot = bool(self._set_bf16_dot(int(on))) and on

    def decoder_layers(self, x: paddle.Tensor, stack: LayerStack, attention: PagedAttention,
                       lora: LoRAInputs | None = None) -> paddle.Tensor:
        """Every layer of `stack` over the `[T, hidden]` tokens `x` of one sequence group (layer.h),
        with the pass's `attention` inputs and its rows' `lora` adapters. Returns the last layer's
        output through the final norm."""
        x = x if x.is_contiguous() else x.contiguous()
        rows, hidden = x.shape
        at = attention
        qkv_width, q_size = (at.heads + 2 * at.kv_heads) * at.dim, at.heads * at.dim
        work = paddle.empty([rows * (hidden + qkv_width + 2 * q_size + 3 * stack.inter)
                             + _threads * at.heads * at.max_len], dtype="float32")  # layer.h's sizes
        out, spare = paddle.empty([rows, hidden], dtype="float32"), paddle.empty([rows, hidden], dtype="float32")
        attention_struct = _Attention(*(_ptr(getattr(at, name)) for name, _ in _Attention._fields_[:6]), None, None,
                                      int(stack.kv_bf16), at.seqs, at.new_tokens, at.heads, at.kv_heads, at.dim, at.block_size,
                                      at.tables.shape[1], at.max_len, at.scale)
        if self._layers(x.data_ptr(), out.data_ptr(), spare.data_ptr(), stack.layers, rows, hidden, stack.inter,
                        stack.norms, stack.final_norm, stack.eps, stack.linears, stack.caches,
                        ctypes.byref(attention_struct), None if lora is None else ctypes.byref(lora.struct),
                        work.data_ptr(), _threads):
            raise MemoryError("decoder layers: no memory for a linear layer's buffers (x quantized for block "
                              "formats, or rounded to bfloat16)")
        return out

    def lora_update(self, lora: LoRAInputs, linear: int, x: paddle.Tensor, y: paddle.Tensor, widths: list[int]) -> None:
        """y += each row's adapter update of linear `linear` (4 per layer) over x, in place; float32
        `[rows, in]` and `[rows, out]`, `widths` the output's segments (layer.h's fdlp_lora_update)."""
        x = x if x.is_contiguous() else x.contiguous()
        segments = (ctypes.c_int64 * len(widths))(*widths)
        self._lora_update(ctypes.byref(lora.struct), linear, x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1],
                          y.shape[1], segments, len(widths), _threads)

    def rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        """RMSNorm over the last axis of float32 x, each row as the fused layers sum it (layer.h)."""
        x, width = x if x.is_contiguous() else x.contiguous(), x.shape[-1]
        out = paddle.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.size // width, width, eps, _threads)
        return out

    def linear(self, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None,
               scale: paddle.Tensor | None = None, layout: WeightLayout | None = None) -> paddle.Tensor:
        """`(x @ weight^T) * scale + bias` for float32 x `[M, K]` and a weight `[N, K]` in float32,
        bfloat16, float16 or int8 (int8 with its per-row float32 `scale` `[N]`), or the bytes of a
        weight in block formats as `layout` describes them: float32 `[M, N]`."""
        x = x if x.is_contiguous() else x.contiguous()
        (rows, k), n = x.shape, weight.shape[0] if layout is None else layout.rows
        out = paddle.empty([rows, n], dtype=x.dtype)
        if self._linear(x.data_ptr(), ctypes.byref(_Linear.of(weight, scale, bias, layout)), out.data_ptr(), rows, n, k,
                        _threads):
            raise MemoryError(f"linear: no memory for the buffers of a {rows} x {k} product (or a weight format "
                              f"these kernels do not know)")
        return out

    def dequantize(self, data: paddle.Tensor, layout: WeightLayout) -> paddle.Tensor:
        """The float32 `[rows, in_features]` values of a block-format weight, exactly as
        `gguf.quants.dequantize` computes them (tests, and tools that need the float weights)."""
        k, parts, offset = layout.in_features, [], 0
        for i, (name, rows) in enumerate(layout.parts):
            size = layout.part_bytes(i)
            part = data[offset:offset + size]
            if name in FLOAT_DTYPES:  # a copy first: Paddle's dtype view of a slice reads from its base's start
                parts.append(part.clone().view(FLOAT_DTYPES[name]).reshape([rows, k]).astype("float32"))
            else:
                out = paddle.empty([rows, k], dtype="float32")
                self._dequantize(FORMATS[name].code, part.data_ptr(), out.data_ptr(), rows, k, _threads)
                parts.append(out)
            offset += size
        return parts[0] if len(parts) == 1 else paddle.concat(parts)

    def widen_blocks(self, data: paddle.Tensor, layout: WeightLayout, start: int, end: int) -> paddle.Tensor:
        """Rows `[start, end)` of a block-format weight as float32 `[end - start, in_features]`, for one
        product (a tile of a prefill GEMM): in a buffer kept per shape and overwritten by the next
        call, as `widen`'s. Rows in float parts are cast."""
        k = layout.in_features
        out = self._scratch.get((end - start, k, "blocks"))
        if out is None:
            out = self._scratch[(end - start, k, "blocks")] = paddle.empty([end - start, k], dtype="float32")
        row, offset = 0, 0
        for i, (name, rows) in enumerate(layout.parts):
            lo, hi = max(start, row), min(end, row + rows)
            if lo < hi:
                part = data[offset:offset + layout.part_bytes(i)]
                if name in FLOAT_DTYPES:
                    floats = part.clone().view(FLOAT_DTYPES[name]).reshape([rows, k])[lo - row:hi - row]
                    out[lo - start:hi - start] = floats.astype("float32")
                else:
                    self._widen_blocks(FORMATS[name].code, part.data_ptr(), lo - row, hi - lo, k,
                                       out[lo - start:].data_ptr(), _threads)
            row += rows
            offset += layout.part_bytes(i)
        return out

    def quantize_blocks(self, weight: paddle.Tensor, name: str) -> paddle.Tensor:
        """A 2-D weight in blocks of `name` (Q4_0, Q8_0 or W4G128), as `gguf.quants.quantize` writes
        Q4_0 and Q8_0: its bytes, row after row. Read 4096 rows at a time as float32, so a bfloat16
        embedding of a 128k vocabulary is never widened whole."""
        rows, k = weight.shape
        fmt = FORMATS[name]
        out = paddle.empty([rows * fmt.row_bytes(k)], dtype="uint8")
        for start in range(0, rows, 4096):
            chunk = weight[start:start + 4096]
            chunk = (chunk if chunk.dtype == paddle.float32 else chunk.astype("float32")).contiguous()
            at = out[start * fmt.row_bytes(k):]
            if self._quantize_blocks(fmt.code, chunk.data_ptr(), at.data_ptr(), chunk.shape[0], k, _threads):
                raise ValueError(f"quantize_blocks: {name} is not a format weights are quantized to")
        return out

    def embed_blocks(self, ids: paddle.Tensor, data: paddle.Tensor, layout: WeightLayout) -> paddle.Tensor:
        """`weight[ids]` as float32 for an embedding held in one block format."""
        ids = ids if ids.is_contiguous() else ids.contiguous()
        (name, vocab), = layout.parts
        out = paddle.empty([ids.shape[0], layout.in_features], dtype="float32")
        outside = self._embed_blocks(FORMATS[name].code, ids.data_ptr(), data.data_ptr(), out.data_ptr(),
                                     ids.shape[0], vocab, layout.in_features)
        if outside:
            raise IndexError(f"{outside} token id(s) outside the embedding's {vocab} rows")
        return out

    def widen(self, weight: paddle.Tensor, scale: paddle.Tensor | None = None) -> paddle.Tensor:
        """A bfloat16, float16 or int8 (times its per-row `scale`) 2-D weight as float32, for one
        product: the result lives in a buffer kept per shape and overwritten by the next call (a
        fresh one cost more in page faults than the conversion itself)."""
        assert weight.is_contiguous()
        out = self._scratch.get(tuple(weight.shape))
        if out is None:
            out = self._scratch[tuple(weight.shape)] = paddle.empty(weight.shape, dtype="float32")
        self._widens[weight.dtype](weight.data_ptr(), None if scale is None else scale.data_ptr(), out.data_ptr(),
                                   weight.shape[0], weight.shape[1], _threads)
        return out

    def embed(self, ids: paddle.Tensor, weight: paddle.Tensor, scale: paddle.Tensor | None = None) -> paddle.Tensor:
        """`weight[ids]` as float32 `[len(ids), hidden]` (times `scale[ids]` for int8) for a bfloat16,
        float16 or int8 embedding `[vocab, hidden]` and int64 `ids` `[T]`."""
        ids = ids if ids.is_contiguous() else ids.contiguous()
        out = paddle.empty([ids.shape[0], weight.shape[1]], dtype="float32")
        outside = self._embeds[weight.dtype](ids.data_ptr(), weight.data_ptr(), _ptr(scale), out.data_ptr(),
                                             ids.shape[0], weight.shape[0], weight.shape[1])
        if outside:
            raise IndexError(f"{outside} token id(s) outside the embedding's {weight.shape[0]} rows")
        return out

    def quantize_rows(self, weight: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """`loader.quantize_rows` (int8 per output row, symmetric) of a float32, bfloat16 or float16
        2-D weight, read in its own format: no float32 temporaries."""
        weight = weight if weight.is_contiguous() else weight.contiguous()
        q = paddle.empty(weight.shape, dtype="int8")
        scale = paddle.empty(weight.shape[:1], dtype="float32")
        self._quantizers[weight.dtype](weight.data_ptr(), q.data_ptr(), scale.data_ptr(), weight.shape[0],
                                       weight.shape[1], _threads)
        return q, scale

    def read_sum(self, x: paddle.Tensor) -> float:
        """The sum of a contiguous float32 tensor, read by every thread: the benchmarks time it as
        the machine's memory read bandwidth."""
        assert x.is_contiguous() and x.dtype == paddle.float32
        return self._read_sum(x.data_ptr(), x.size, _threads)

    def argmax(self, x: paddle.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """`paddle.argmax(x, axis=-1)` of a 2-D float32 tensor (first index of the largest value),
        10x faster (Paddle's CPU argmax took 10 ms for 32 x 151,936 on one core), and per row
        whether nothing can be drawn from it (bool): a NaN or a +inf in it, or -inf throughout. The
        check comes with the same read of the logits; as Paddle ops it cost a batch-1 step 0.3 ms.
        Host arrays (int64, bool): the draw reads both there."""
        x = x if x.is_contiguous() else x.contiguous()
        out, unusable = np.empty(x.shape[0], dtype=np.int64), np.empty(x.shape[0], dtype=np.bool_)
        self._argmax(x.data_ptr(), out.ctypes.data, unusable.ctypes.data, x.shape[0], x.shape[1], _threads)
        return out, unusable

    def transpose(self, x: paddle.Tensor) -> paddle.Tensor:
        """`x.T` of a contiguous 2-D tensor, as a new contiguous tensor (Paddle's CPU `contiguous()`
        of a transpose copied ~1 GB/s here)."""
        assert x.is_contiguous()
        out = paddle.empty([x.shape[1], x.shape[0]], dtype=x.dtype)
        self._transpose(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _threads)
        return out

    def swiglu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        """`silu(gate) * up` for `gate_up` `[M, 2 * I]` holding gate then up, as `F.swiglu`: `[M, I]`."""
        gate_up = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = paddle.empty([rows, width], dtype=gate_up.dtype)
        self._swiglu(gate_up.data_ptr(), out.data_ptr(), rows, width, _threads)
        return out

    def rotary_cache_write(self, qkv: paddle.Tensor, cos: paddle.Tensor, signed_sin: paddle.Tensor,
                           positions: paddle.Tensor, write_rows: paddle.Tensor, k_cache: paddle.Tensor,
                           v_cache: paddle.Tensor, heads: int, kv_heads: int) -> None:
        """Rotate the q and k heads of `qkv` `[T, (H + 2 KV) * D]` in place (tables `[positions, D]`,
        the sign in `signed_sin`, as `layers.RotaryEmbedding`) and copy k and v to `write_rows` of
        the caches viewed as `[-1, D]` (token-major, as `AttentionBatch.write_rows`), float32 or
        bfloat16 (rounded to nearest even)."""
        assert qkv.is_contiguous()
        dim = cos.shape[-1]
        self._rotary_write(qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), positions.data_ptr(),
                           write_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _kv_bf16(k_cache, v_cache),
                           qkv.shape[0], heads, kv_heads, dim, _threads)

    def paged_attention(self, q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, tables: paddle.Tensor,
                        lens: paddle.Tensor, new: int, max_len: int, kv_heads: int, block_size: int,
                        scale: float) -> paddle.Tensor:
        """Causal attention of each sequence's `new` last tokens over its cached keys (already
        written): q `[S * new, H, D]` rotated, sequence-major; scores times `scale`; caches holding
        `[blocks, kv_heads, block_size, D]` (any view of that memory), float32 or bfloat16; tables `[S, width]` and lens
        `[S]` (tokens after this pass) int64, every len <= max_len. Returns `[S * new, H, D]`."""
        q = q if q.is_contiguous() else q.contiguous()
        tokens, heads, dim = q.shape
        out = paddle.empty_like(q)
        scratch = paddle.empty([_threads, heads // kv_heads, max_len], dtype="float32")
        self._attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _kv_bf16(k_cache, v_cache),
                        tables.data_ptr(), lens.data_ptr(), out.data_ptr(), scratch.data_ptr(), tokens // new, new, heads, kv_heads, dim, block_size,
                        tables.shape[1], max_len, scale, _threads)
        return out


def _kv_bf16(k_cache: paddle.Tensor, v_cache: paddle.Tensor) -> int:
    """1 if the caches hold bfloat16, 0 if float32 (what the attention kernels read and write)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (paddle.float32, paddle.bfloat16):
        raise TypeError(f"KV caches: float32 or bfloat16 for both, got {k_cache.dtype} and {v_cache.dtype}")
    return int(k_cache.dtype == paddle.bfloat16)


def load() -> CpuKernels | None:
    """The kernels, built on first call; None where they cannot be or `FDLP_CPU_KERNELS=0` (logged once)."""
    global _off_logged
    if mode() == "0":
        if not _off_logged:
            _off_logged = True
            logger.info("CPU kernels: off (%s=0); Paddle's kernels", SWITCH)
        return None
    return _built()


def required(weights: str) -> CpuKernels:
    """The kernels for weights only they can multiply (block formats: GGUF, wint4), whatever
    `FDLP_CPU_KERNELS` says; a `RuntimeError` naming `weights` where they cannot be built."""
    kernels = _built()
    if kernels is None:
        raise RuntimeError(f"{weights} weights need the CPU kernels, which could not be built here (a C compiler "
                           f"on PATH, cc or gcc, builds them at first use)")
    return kernels


def load_if_built() -> CpuKernels | None:
    """The kernels if a call before built them, else None (never builds)."""
    return _loaded or None


def _built() -> CpuKernels | None:
    global _loaded
    if _loaded is False:
        _loaded = None
        try:
            _loaded = CpuKernels(build())
            logger.info("CPU kernels: built for %s (%d floats per vector), mode %s",
                        cpu_features.detect().describe(), _loaded.lanes, mode())
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("CPU kernels unavailable (%s); using Paddle's kernels", e)
    return _loaded or None
