"""compressed-tensors `pack-quantized` packing: signed intB values -> int32 words.

Layout (formats.md §2c; compressed-tensors compressors/pack_quantized/helpers.py):
    u = q + 2^(B-1)                  (uint4b8 for B = 4, uint8b128 for B = 8)
    element k of a row -> word k // (32/B), bits [B*(k % (32/B)), B*(k % (32/B)) + B)   (LSB first)
    words stored as two's-complement int32; weights are packed along dim 1 (input, K).
Hand-written instead of calling compressed-tensors' `pack_to_int32`, which scatters through a
`[rows*K/32, 32]` int32 temporary (8 bytes of traffic per 4-bit value) and is the slowest step of a
conversion; on a little-endian host the same words are two nibbles per byte and a reinterpreting view.
tests/test_pack.py checks bit equality against `pack_to_int32`/`unpack_from_int32` on odd shapes.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # the byte view below assumes little-endian words
    raise ImportError("glmq's packer needs a little-endian host")


def packed_shape(shape: tuple[int, int], num_bits: int) -> tuple[int, int]:
    """`[N, K]` -> `[N, ceil(K * B / 32)]` int32."""
    n, k = shape
    return n, -(-k * num_bits // 32)


def pack_int32(q: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """Pack int8 values along the last dim into int32 words.

    Args:
        q: int8 `[N, K]` with values in [-2^(B-1), 2^(B-1) - 1]. K is zero-padded to a multiple
           of 32/B (padding values pack as the offset, as in compressed-tensors).
        num_bits: 4 or 8.
    Returns:
        int32 `[N, ceil(K * B / 32)]`, on the device of `q`.
    """
    if q.dtype != torch.int8 or q.ndim != 2:
        raise ValueError(f"pack_int32 expects a 2-D int8 tensor, got {q.dtype} {list(q.shape)}")
    n, k = q.shape
    per_word = 32 // num_bits
    pad = -k % per_word
    offset = 1 << (num_bits - 1)
    # (q + offset) fits in uint8 for B <= 8; doing it as an int8 add with wraparound then viewing as
    # uint8 gives the same bits without a wider temporary.
    u = (q + (offset - 128)).view(torch.uint8) ^ 0x80  # int8 + Python int stays int8 (wraps)
    if pad:
        # compressed-tensors pads the row with zeros *after* the offset is added: raw 0 nibbles.
        u = torch.nn.functional.pad(u, (0, pad))
    if num_bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)  # (N, K/2) uint8: two nibbles per byte, low first
    elif num_bits != 8:
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    return _row_major(u).view(torch.int32)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """2-D `t` with row-major strides `(shape[1], 1)`, copied only when it has others.

    `.contiguous()` is not enough before a dtype view: it keeps a tensor with a size-1 dim as it is, whatever
    that dim's stride (a transposed `[N, 1]` zero point is `[1, N]` with stride (1, 1)), and the view checks
    the strides (bytes -> int32 needs stride(0) % 4 == 0, int32 -> bytes stride(1) == 1)."""
    t = t.contiguous()
    return t if t.stride() == (t.shape[1], 1) else t.clone(memory_format=torch.contiguous_format)


def unpack_int32(packed: torch.Tensor, k: int, num_bits: int = 4) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 `[N, W]` -> int8 `[N, k]`."""
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError(f"unpack_int32 expects a 2-D int32 tensor, got {packed.dtype} {list(packed.shape)}")
    b = _row_major(packed).view(torch.uint8)
    if num_bits == 4:
        b = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    elif num_bits != 8:
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    return (b[:, :k].to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)


def pack_zero_point(zp: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """Zero points `[N, G]` int8 are packed along dim 0 (compressed-tensors): `[ceil(N*B/32), G]`."""
    return _row_major(pack_int32(zp.t(), num_bits).t())


def unpack_zero_point(packed: torch.Tensor, n: int, num_bits: int = 4) -> torch.Tensor:
    return _row_major(unpack_int32(packed.t(), n, num_bits).t())
