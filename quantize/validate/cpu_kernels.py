"""numba kernels of the checks on the CPU, each written from formats.md rather than through the code
it checks, each one pass over the stored bytes with no full-size temporaries.

`w4a16_matmul_f64`: the numerics check's float64 reference, `x @ dequant(W).T`. In PyTorch it was two
passes of unpacking plus a float64 `[N, K]` temporary per row block (~50 ns per weight on a busy core,
more than the kernel it checks); this decodes one row at a time into an L1-resident float64 vector
and takes the M dot products from it (~2 ns of CPU per weight at M = 4). Not through `glmq.quantize.pack`, so the
kernels' reference (`glmq.kernels.reference`, which unpacks with it) is checked against an
independent reading of the format (§2c):
    weight_packed int32 [N, ceil(K*4/32)], little-endian: byte j of a row holds elements 2j (bits 0-3)
    and 2j+1 (bits 4-7) as u = q + 8;   w[n, k] = (u - 8 - zp[n, k // g]) * scale[n, k // g].
Every product x * w is exact in float64 (bf16 x, 4-bit q, bf16/f16/f32 scale); the sums use the
`reassoc` fast-math flag only, so they vectorize, with an error of about K * 2^-53 relative, far
below the 1e-4 bound they are compared at. NaN and Inf propagate (no `nnan`/`ninf`).

`fp8_block_mismatches`: the source check's "unquantized tensors unchanged" for a BF16 tensor that the
converter dequantized from block FP8: `torch.equal(out, fp8.dequantize_block(w8, scale_inv))`
without building the bf16 tensor (8.5 -> 1.6 ns of CPU per weight). Not the converter's fused kernel
(`glmq.quantize.fused_cpu`): the float32 product of each FP8 value (a table of torch's own cast) and
its block scale, rounded to bf16 to nearest-even as c10::BFloat16 does, compared by value (so
+0 == -0 and NaN never equal, as torch.equal).
"""

from __future__ import annotations

import numpy as np
import torch

from glmq.quantize.pack import unpack_zero_point

try:  # numba is a core dependency; without it (a bare GPU image) the same float64 values come from torch
    from numba import njit
except ImportError:  # pragma: no cover - exercised only on installs without numba
    njit = None


def _jit(**options):
    return (lambda f: f) if njit is None else njit(nogil=True, cache=True, **options)


@_jit(fastmath={"reassoc", "contract"})
def _dot(a, b):
    acc = 0.0
    for c in range(a.shape[0]):
        acc += a[c] * b[c]
    return acc


@_jit()
def _matmul_kernel(x, packed_u8, scale, zp, group, out):
    m, k = x.shape
    n = packed_u8.shape[0]
    w = np.empty(k, dtype=np.float64)
    for r in range(n):
        row = packed_u8[r]
        for j in range(k // 2):  # decode u - 8 for the whole row
            b = row[j]
            w[2 * j] = np.float64(b & 15) - 8.0
            w[2 * j + 1] = np.float64(b >> 4) - 8.0
        if k % 2:
            w[k - 1] = np.float64(row[k // 2] & 15) - 8.0
        for gi in range(scale.shape[1]):
            s = scale[r, gi]
            z = zp[r, gi] if zp.shape[0] else 0.0
            for c in range(gi * group, min((gi + 1) * group, k)):
                w[c] = (w[c] - z) * s
        for i in range(m):
            out[i, r] = _dot(x[i], w)


def w4a16_matmul_f64(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                     shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """float64 `x @ dequant(W).T` of a stored 4-bit pack-quantized weight (CPU, one thread, no GIL).

    Args:
        x: float `[M, K]` activations (CPU).
        packed: int32 `[N, ceil(K/8)]` as stored; scale `[N, ceil(K/g)]` bf16/f16/f32; zp None
            (symmetric) or the stored int32 `[ceil(N/8), ceil(K/g)]`; shape `(N, K)`; group_size g
            (K for one scale per row).
    Returns:
        float64 `[M, N]`.
    Raises:
        ValueError: the tensors do not have the shapes `shape` and `group_size` give.
    """
    n, k = shape
    groups = -(-k // group_size)
    if tuple(packed.shape) != (n, -(-k // 8)) or packed.dtype != torch.int32 or tuple(scale.shape) != (n, groups):
        raise ValueError(f"weight_packed {list(packed.shape)} {packed.dtype} / weight_scale {list(scale.shape)} do not "
                         f"fit weight_shape [{n}, {k}] with group_size {group_size}")
    if njit is None:
        from glmq.formats.dense import dequantize_packed

        return x.double() @ dequantize_packed(packed, scale.double(), shape, 4, group_size, zp).T
    z = np.empty((0, 0)) if zp is None else unpack_zero_point(zp, n).double().numpy()
    out = np.empty((x.shape[0], n), dtype=np.float64)
    _matmul_kernel(x.double().contiguous().numpy(), packed.contiguous().view(torch.uint8).numpy(),
                   scale.double().contiguous().numpy(), np.ascontiguousarray(z), group_size, out)
    return torch.from_numpy(out)


@_jit()
def _fp8_block_kernel(w8, scale_inv, lut, bn, bk, out_bits):
    n, k = w8.shape
    vals = np.empty(k, dtype=np.float32)
    want = np.empty(k, dtype=np.float32)
    got = np.empty(k, dtype=np.float32)
    vb, wb, gb = vals.view(np.uint32), want.view(np.uint32), got.view(np.uint32)
    bad = 0
    for r in range(n):
        srow = scale_inv[r // bn]
        for j in range(srow.shape[0]):
            s = srow[j]
            for c in range(j * bk, min((j + 1) * bk, k)):
                vals[c] = lut[w8[r, c]] * s  # float32 * float32, as fp8.dequantize_block
        for c in range(k):  # round to nearest even (a NaN's bits may carry: it is counted below)
            b = vb[c]
            wb[c] = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)
            gb[c] = np.uint32(out_bits[r, c]) << np.uint32(16)
        for c in range(k):
            bad += (got[c] != want[c]) | (vals[c] != vals[c])
    return bad


def fp8_block_mismatches(out: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> int:
    """How many elements of a stored bf16 `[N, K]` tensor differ from bf16(fp8 * block scale).

    Args:
        out: bf16 `[N, K]` as stored; w8 float8_e4m3fn `[N, K]` and scale_inv float32
            `[ceil(N/bn), ceil(K/bk)]` of the source; block (bn, bk).
    Returns:
        the number of unequal elements (by value, as torch.equal); every element if the shapes differ.
    Raises:
        ValueError: scale_inv does not fit the weight and block.
    """
    (n, k), (bn, bk) = w8.shape, block
    if tuple(scale_inv.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"scale_inv shape {list(scale_inv.shape)} does not fit weight {[n, k]} with blocks {block}")
    if out.shape != w8.shape or out.dtype != torch.bfloat16:
        return max(out.numel(), w8.numel())
    if njit is None:
        from glmq.formats import fp8

        want = fp8.dequantize_block(w8, scale_inv, block)
        return int((out != want).sum())
    return int(_fp8_block_kernel(w8.contiguous().view(torch.uint8).numpy(), scale_inv.float().contiguous().numpy(),
                                 _FP8_VALUES, bn, bk, out.contiguous().view(torch.int16).numpy().view(np.uint16)))


# float32 value of each float8_e4m3fn bit pattern, from torch's own cast
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
