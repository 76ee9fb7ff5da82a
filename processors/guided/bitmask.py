"""Applying llguidance's packed token bitmasks to logits, on the logits' device.

llguidance fills an int32 bitmask `[rows, ceil(V / 32)]`: token `t` is allowed in row `r` iff bit
`t % 32` of word `t // 32` is set (little-endian bit order, bit 31 is the sign bit). `mask_logits`
sets every disallowed logit of the constrained rows to -inf, in place, with one masked fill;
columns past the bitmask (logits wider than the grammar's vocabulary) are never allowed.

Where the logits live decides how the mask gets there:
  * not on the CPU (a GPU, an XPU, ...): the packed words are uploaded (1 bit per token: 8x fewer
    bytes than a bool mask) and expanded there by `expand_banned` — one broadcast AND against the 32 bit
    values and a compare, batched over all rows;
  * on the CPU: numpy's `unpackbits` builds the bool mask, which is then handed to Paddle. Paddle's
    CPU kernels for broadcast bitwise ops are far slower than numpy's table-driven unpack (measured
    0.56 ms vs 10.5 ms for the mask at 16 x 151,936 on 2 cores; docs/benchmarks.md), and there is no
    transfer to save on the CPU.
Both give bit-for-bit the same logits (tests/test_guided_bitmask.py).
"""

from __future__ import annotations

import numpy as np
import paddle

# The int32 value of each bit (bit 31 is INT32_MIN), per place; built once per device.
_BIT_VALUES: dict[str, paddle.Tensor] = {}
_BIT_VALUES_NP = (np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32)


def words_for(width: int) -> int:
    """Bitmask words (int32) that cover `width` tokens."""
    return (width + 31) >> 5


def fit_words(bits: np.ndarray, width: int) -> np.ndarray:
    """`bits` (int32 `[rows, words]`) cut or zero-padded to exactly `words_for(width)` words, contiguous.
    Padding words are zero: tokens past the bitmask are never allowed."""
    need = words_for(width)
    if bits.shape[1] >= need:
        return np.ascontiguousarray(bits[:, :need], dtype=np.int32)
    out = np.zeros((bits.shape[0], need), dtype=np.int32)
    out[:, :bits.shape[1]] = bits
    return out


def unpack_banned_numpy(bits: np.ndarray, width: int) -> np.ndarray:
    """Host unpack: bool `[rows, width]`, True where the token is NOT allowed."""
    inverted = ~fit_words(bits, width)
    return np.unpackbits(inverted.view(np.uint8), axis=1, bitorder="little")[:, :width].view(bool)


def _bit_values(place) -> paddle.Tensor:
    key = str(place)
    values = _BIT_VALUES.get(key)
    if values is None:
        values = _BIT_VALUES[key] = paddle.to_tensor(_BIT_VALUES_NP, place=place)
    return values


def expand_banned(packed: paddle.Tensor, width: int) -> paddle.Tensor:
    """Device expansion of a packed int32 bitmask `[rows, words]`: bool `[rows, width]` on the same
    device, True where the token's bit is 0 (not allowed). Columns at or past `32 * words` are True."""
    rows, words = packed.shape
    banned = (packed.unsqueeze(-1) & _bit_values(packed.place)) == 0  # [rows, words, 32]
    banned = banned.reshape([rows, words * 32])
    if words * 32 > width:
        banned = banned[:, :width]
    elif words * 32 < width:
        banned = paddle.concat([banned, paddle.ones([rows, width - words * 32], dtype="bool").to(packed.place)],
                               axis=1)
    return banned


def banned_mask(bits: np.ndarray, width: int, place, packed: bool | None = None) -> paddle.Tensor:
    """bool `[rows, width]` on `place`, True where the token is not allowed by the host bitmask `bits`.
    `packed`: upload the packed words and expand them there (default: everywhere but the CPU)."""
    if packed is None:
        packed = not place.is_cpu_place()
    if packed:
        return expand_banned(paddle.to_tensor(fit_words(bits, width), place=place), width)
    return paddle.to_tensor(unpack_banned_numpy(bits, width), place=place)


def mask_logits(logits: paddle.Tensor, bits: np.ndarray, rows: list[int] | None = None,
                packed: bool | None = None) -> paddle.Tensor:
    """Set the disallowed logits of `rows` (all rows when None) to -inf, in place, and return `logits`.

    `bits[j]` is the bitmask of logits row `rows[j]`; rows not listed are left untouched."""
    width = logits.shape[-1]
    banned = banned_mask(bits, width, logits.place, packed)
    value = paddle.to_tensor(float("-inf"), dtype=logits.dtype, place=logits.place)
    if rows is None:
        return logits.masked_fill_(banned, value)
    index = paddle.to_tensor(np.asarray(rows, dtype=np.int64), place=logits.place)
    part = paddle.index_select(logits, index).masked_fill_(banned, value)
    return logits.scatter_(index, part, overwrite=True)
