"""Linear layers: how a weight is held (`linear_weight`) and multiplied (`linear`), on CPU through the
C kernels where they were measured faster, MKL's GEMM, or the block-format kernels.

Weights are kept in Hugging Face's `[out, in]` layout: float32, bfloat16, float16, int8 with a
per-row scale (`wint8`), or the bytes of GGML blocks with their `WeightLayout` (GGUF, `wint4`).
"""

from __future__ import annotations

import contextlib

import paddle
from paddle import nn

from fastdeploy_lp.block_formats import WeightLayout
from fastdeploy_lp.model_config import ModelConfig
from fastdeploy_lp.model import cpu_kernels, gpu_weight_only


FEW_ROWS = 64  # up to this many tokens, a CPU GEMM streams the weight faster as weight @ x^T
_batch_invariant = False  # inside `batch_invariant_mode`


@contextlib.contextmanager
def batch_invariant_mode(on: bool):
    """`--deterministic` (docs/deterministic.md) inside the block, the mode before it restored after:
    `kernels_for` gives the kernels for every op and row count whatever `cpu_dispatch` measured,
    and their linear sums a row alike at every row count (`kernels.c`). The runner holds it over
    each pass of a deterministic engine, so engines with and without it share a process. A
    `RuntimeError` where the kernels cannot run."""
    global _batch_invariant
    before, kernels = _batch_invariant, cpu_kernels.load() if on else cpu_kernels.load_if_built()
    if on and kernels is None:
        raise RuntimeError(f"deterministic: needs the CPU kernels, which are "
                           f"{'off (' + cpu_kernels.SWITCH + '=0)' if cpu_kernels.mode() == '0' else 'not built here'}")
    try:
        if kernels is not None and bool(on) != before:
            kernels.set_batch_invariant(int(on))
        _batch_invariant = bool(on)
        yield kernels
    finally:
        if kernels is not None and bool(on) != before:
            kernels.set_batch_invariant(int(before))
        _batch_invariant = before


def batch_invariant() -> bool:
    return _batch_invariant


def kernels_for(x: paddle.Tensor, op: str, rows: int) -> cpu_kernels.CpuKernels | None:
    """The CPU kernels when `x` is a float32 CPU tensor and they run `op` over `rows` rows here
    (`cpu_kernels.for_op`: measured faster than Paddle's op, or forced on; every op in
    `batch_invariant_mode`), else None."""
    if x.dtype != paddle.float32 or not x.place.is_cpu_place():
        return None
    return cpu_kernels.load() if _batch_invariant else cpu_kernels.for_op(op, rows)


def linear_weight(layer: nn.Layer, shape: list[int], config: ModelConfig, vocabulary: bool = False,
                  key: str = "") -> tuple[paddle.Tensor, paddle.Tensor | None, WeightLayout | None]:
    """A linear weight `[out, in]` as `config` holds it, its per-row scale (None but for int8) and
    its block layout (None but for block formats). `key` is the weight's name in the model's
    `state_dict`, where `config.weight_layouts` may say how the checkpoint stores it (a GGUF file:
    its blocks as stored, or a float dtype). Otherwise `config.weight_dtype`; int8 with a scale per
    output row under `wint8` (float32 on CPU; on GPU in the compute dtype and in
    `gpu_weight_only`'s layout, which a lookup cannot read, so the `vocabulary` matrices, embedding
    and LM head, stay in `config.weight_dtype` there). `wint4`'s blocks come as layouts from the
    loader (`loader._weight_layouts`), as a GGUF file's do. Zeros until a checkpoint
    (the loader) or the trainer fills them: a random init of a 7B model would cost minutes for
    values that are overwritten."""
    zeros = nn.initializer.Constant(0.0)
    held = config.weight_layouts.get(key)
    if isinstance(held, WeightLayout):
        return layer.create_parameter([held.nbytes], dtype="uint8", default_initializer=zeros), None, held
    if held is not None:
        return layer.create_parameter(shape, dtype=held, default_initializer=zeros), None, None
    gpu = config.quantization == "wint8" and gpu_weight_only.on_gpu()
    if config.quantization == "wint8" and not (gpu and vocabulary):
        return (layer.create_parameter(shape, dtype="int8", default_initializer=zeros),
                layer.create_parameter(shape[:1], dtype=config.dtype if gpu else "float32",
                                       default_initializer=zeros), None)
    return layer.create_parameter(shape, dtype=config.weight_dtype, default_initializer=zeros), None, None


def linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None,
           scale: paddle.Tensor | None = None, layout: WeightLayout | None = None) -> paddle.Tensor:
    """`(x @ weight^T) * scale + bias` for a weight in Hugging Face's `[out, in]` layout, held as
    float32, bfloat16, float16, or int8 with its per-row `scale` (`linear_weight`), or as blocks
    (`layout`: GGUF, wint4), which only the CPU kernels multiply (at every row count).

    On CPU, timed over the bench model's weights read cold as in a decode step (2 cores, AVX-512):
    up to 32 rows may go to `cpu_kernels.linear`, which reads the weight once where MKL's GEMM reads
    it at half speed (8 rows: 77 vs 124 ms); `cpu_dispatch` keeps it per row bucket where it was
    measured faster, prefill included (bfloat16 weights on AVX-512 BF16: 169 against MKL's 88
    GMAC/s at 256 rows, Zen 4). Up to 64 rows MKL runs 1.4-1.6x faster as `(weight @ x^T)^T` than
    as `x @ weight^T`. Other devices get the plain product; an int8 weight on GPU is in
    `gpu_weight_only`'s layout, which only its op reads.
    """
    if layout is not None:
        kernels = cpu_kernels.required(layout.describe())
        if (x.shape[0] > cpu_kernels.KERNEL_ROWS and not _batch_invariant
                and cpu_kernels.for_op("blocks", x.shape[0]) is None):
            return widened_linear(kernels, x, weight, bias, layout)  # measured faster, or kernels off
        return kernels.linear(x, weight, bias, scale, layout)
    if scale is not None and x.place.is_gpu_place():
        return gpu_weight_only.linear(x, weight, bias, scale)
    rows = x.shape[0]  # batch-invariant: the kernel at every row count, never a BLAS whose blocking depends on rows
    # Past 32 rows the kernels run only where `cpu_dispatch` timed them faster (bfloat16 with AVX-512
    # BF16's dot product, float32 in panels: xpanel.h), never merely because they are forced on.
    if ((rows <= cpu_kernels.KERNEL_ROWS or _batch_invariant or cpu_kernels.mode() == "auto")
            and (kernels := kernels_for(x, "linear", rows)) is not None):
        return kernels.linear(x, weight, bias, scale)
    return paddle_linear(x, weight, bias, scale)


WIDEN_TILE_BYTES = 8 << 20  # float32 of one weight tile widened for a prefill GEMM


def widened_linear(kernels: cpu_kernels.CpuKernels, x: paddle.Tensor, weight: paddle.Tensor,
                   bias: paddle.Tensor | None, layout: WeightLayout) -> paddle.Tensor:
    """`linear` of a block-format weight over many rows of x (prefill): tiles of 8 MB of its rows
    widened to float32 one after the other, each multiplied by MKL's GEMM, never a float copy of
    the layer. Where `cpu_dispatch` timed it faster than the kernels' own: 1024 x 4864 Q4_K over 256
    rows of x, 58 against 46 GMAC/s (AVX2 EPYC, 2 threads)."""
    tile = max(64, WIDEN_TILE_BYTES // (4 * layout.in_features))
    outs = [paddle.matmul(x, kernels.widen_blocks(weight, layout, start, min(start + tile, layout.rows)),
                          transpose_y=True) for start in range(0, layout.rows, tile)]
    out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=1)
    return out if bias is None else out + bias


def paddle_widen(weight: paddle.Tensor, scale: paddle.Tensor | None, dtype) -> paddle.Tensor:
    """`weight` (times its per-row `scale`) as `dtype` in Paddle's ops. On CPU these casts ran at
    ~50M elements/s, which `CpuKernels.widen` replaces where it can."""
    weight = weight.astype(dtype)
    return weight if scale is None else weight * scale.astype(dtype).unsqueeze(1)


def paddle_linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None = None,
                  scale: paddle.Tensor | None = None) -> paddle.Tensor:
    """`linear` in Paddle's ops. A weight held in another dtype than x (Paddle's CPU matmul has no
    bfloat16, float16 or int8 kernel) is widened for this product only: one layer at a time, never
    a float32 copy of the model."""
    if weight.dtype != x.dtype:
        kernels = kernels_for(x, "widen", 0)
        weight = paddle_widen(weight, scale, x.dtype) if kernels is None else kernels.widen(weight, scale)
    rows = x.shape[0]
    if rows <= FEW_ROWS and x.place.is_cpu_place():
        out = paddle.matmul(weight, x, transpose_y=True)
        # A contiguous result: later ops copied the transposed view at ~1 GB/s.
        kernels = kernels_for(x, "transpose", rows)
        out = out.T if kernels is None else kernels.transpose(out)
    else:
        out = paddle.matmul(x, weight, transpose_y=True)
    return out if bias is None else out + bias
