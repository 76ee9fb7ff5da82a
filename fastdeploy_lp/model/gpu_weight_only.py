"""`wint8` on GPU: Paddle's weight-only int8 ops instead of the CPU path's row-major int8.

On a GPU, `weight_quantize` lays the int8 weight out for the device's arch (rows interleaved for
the CUTLASS mixed-precision GEMM, an offset added) and `weight_only_linear` multiplies by it,
dequantizing in the kernel. The layout is opaque: nothing but these ops may read such a weight,
so the embedding (a row lookup) and the LM head (tied to it or not) stay in the compute dtype on
GPU, and `dequantize` gets the values back through `weight_only_linear` itself.

Checked on CPU only (this project's machines have no GPU): `weight_quantize`'s CPU kernel, given an
arch, returns the `[out, in]` int8 weight and a scale `[out]` in the input's dtype (not float32, as
its docstring says). The GPU calls were not run here.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.nn.quant import weight_only_linear, weight_quantize

_ALGO = "weight_only_int8"
_IDENTITY_ROWS = 4096  # dequantize in chunks: an [in, in] identity of a 7B MLP would be 0.7 GB


def on_gpu() -> bool:
    """Whether layers built now land on a GPU (`paddle.set_device`), where `wint8` uses these ops."""
    return paddle.get_device().startswith("gpu")


def quantize(weight: paddle.Tensor, dtype: str, arch: int | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A checkpoint weight `[out, in]` (this rank's shard of it) as `weight_only_linear` reads it:
    int8 `[out, in]` in `arch`'s layout (None: the current GPU's) and a scale `[out]` in `dtype`,
    which must be float16 or bfloat16 (the op takes nothing else)."""
    # weight_quantize takes `[in, out]` (x @ w) and returns the transpose.
    return weight_quantize(weight.astype(dtype).T.contiguous(), algo=_ALGO, arch=arch)


def linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None,
           scale: paddle.Tensor) -> paddle.Tensor:
    """`x @ dequantized(weight)^T + bias` for a weight from `quantize`; x in the scale's dtype."""
    return weight_only_linear(x, weight, bias=bias, weight_scale=scale, weight_dtype="int8")


def dequantize(weight: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """The `[out, in]` values a `quantize`d weight stands for, in the scale's dtype: the identity
    multiplied by it through `weight_only_linear`, so whatever the arch's layout, the values are
    the ones the model computes with (Paddle's `weight_dequantize` kernel decodes the SM80
    interleave; whether every arch's layout matches it was not checked)."""
    k = weight.shape[1]
    parts = [linear(F.one_hot(paddle.arange(a, min(a + _IDENTITY_ROWS, k)), k).astype(scale.dtype), weight, None,
                    scale) for a in range(0, k, _IDENTITY_ROWS)]
    return paddle.concat(parts).T  # row i of the product is input i's column of the weight: [in, out]
