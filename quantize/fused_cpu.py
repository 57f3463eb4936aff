"""One-pass CPU kernels: FP8-block (or BF16) weight -> packed INT4/INT8 + group scales.

Why hand-written: in eager PyTorch the same conversion is eight full passes over the weight
(fp8->f32, block-scale multiply, ->bf16, group absmax, divide, round, clamp, pack), and fp8->f32 alone
runs at ~200 M elements/s on this CPU; the whole chain reached ~55 MB/s of FP8 input, far below the
disk. No library fuses "dequantize DeepSeek block FP8, then group-quantize and pack for
compressed-tensors". These numba kernels do it in one pass per row, in parallel over rows.

They reproduce the eager path (`glmq.quantize.rtn` after `glmq.formats.fp8.dequantize_block`) bit
for bit, which tests/test_fused_cpu.py asserts:
  * fp8 decode through an exact 256-entry table; block scale multiply in float32 (as
    compressed-tensors' FP8BlockDequantizer does), then round-to-nearest-even to bf16;
  * scale = bf16(absmax / 7.5) (int4) or bf16(absmax / 127.5) (int8), zero -> bf16 eps; with
    QuantSpec.full_range bf16(-max / 8) where max > |min|, else bf16(|min| / 8) (int8: 128);
  * q = rint(clamp(bf16(w / scale), q_min, q_max)), rint = round half to even = torch.round;
  * packing as compressed-tensors: u = q + 2^(b-1), LSB first into little-endian int32 words.
Only symmetric specs take this path; asymmetric ones use the eager path.
"""

from __future__ import annotations

import numpy as np
import torch

try:  # numba is a core dependency; the import guard only keeps `import glmq` light elsewhere.
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only on installs without numba
    numba = None

from glmq.formats.fp8 import NonFiniteWeightError
from glmq.quantize.spec import QuantSpec

_BF16_EPS = float(torch.finfo(torch.bfloat16).eps)


def fp8_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns (NaN for 0x7f/0xff)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def available() -> bool:
    return numba is not None


if numba is not None:
    # Written as short loops over one row held in L1/L2, each simple enough for LLVM to vectorize
    # (the bf16 rounding is integer arithmetic on the float32 bit pattern, c10::BFloat16's
    # round-to-nearest-even for finite values).

    @njit(inline="always")
    def _round_bf16_inplace(bits):
        for c in range(bits.shape[0]):
            b = bits[c]
            r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
            # NaN stays NaN (c10's 0x7FC0): the carry took a NaN whose payload fills the high mantissa bits (a scale
            # of ff ff ff ff bytes, an F16 NaN widened) to +-0, which then passed the NaN check as a zero block
            bits[c] = np.uint32(0x7FC00000) if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r

    @njit(inline="always")
    def _not_finite(big, total):
        """NaN or Inf seen, from a row's running max(|v|) and sum(v * 0): max() drops NaN on some paths, the
        sum does not (and Inf * 0 is NaN). Both are taken inside a pass the kernel makes anyway."""
        return not (big <= np.float32(3.4028234663852886e38)) or total != total

    @njit(inline="always")
    def _quant_row(vals, tmp, out_row, scale_row, group, qmax, half_range, eps, bits, full):
        """Quantize one row of bf16-exact float32 values group by group and pack it (u8 view).

        Returns whether the row holds a NaN or Inf (`_not_finite`, from the group max pass)."""
        k = vals.shape[0]
        offset = np.float32(qmax + 1)
        lo = np.float32(-(qmax + 1))
        hi = np.float32(qmax)
        tbits = tmp.view(np.uint32)
        ngroups = k // group
        sc = np.empty(ngroups, dtype=np.float32)
        big = np.float32(0.0)
        total = np.float32(0.0)
        for gi in range(ngroups):
            vmax = np.float32(0.0)
            nmin = np.float32(0.0)  # |min|
            for i in range(gi * group, (gi + 1) * group):
                vmax = max(vmax, vals[i])
                nmin = max(nmin, -vals[i])
                total += vals[i] * np.float32(0.0)  # NaN (or Inf * 0) makes it NaN; max() may drop NaN
            amax = max(vmax, nmin)
            big = max(big, amax)
            # full range: the maximum maps to q_min (a negative scale) where it is larger than |min|
            sc[gi] = (-vmax if full and vmax > nmin else amax) / np.float32(half_range)
        _round_bf16_inplace(sc.view(np.uint32))
        for gi in range(ngroups):
            if sc[gi] == 0:
                sc[gi] = np.float32(eps)
            scale_row[gi] = np.uint16(sc[gi:gi + 1].view(np.uint32)[0] >> np.uint32(16))
        for gi in range(ngroups):
            s = sc[gi]
            for i in range(gi * group, (gi + 1) * group):
                tmp[i] = vals[i] / s
        _round_bf16_inplace(tbits)
        for i in range(k):
            tmp[i] = np.rint(min(max(tmp[i], lo), hi)) + offset
        if bits == 4:
            for i in range(k // 2):
                out_row[i] = np.uint8(np.int32(tmp[2 * i]) | (np.int32(tmp[2 * i + 1]) << 4))
        else:
            for i in range(k):
                out_row[i] = np.uint8(np.int32(tmp[i]))
        return _not_finite(big, total)

    @njit(inline="always")
    def _fp8_row(w8row, srow, lut, bk, vals):
        """vals = lut[w8row] * its block's scale, one scale block at a time (no division per element)."""
        k = w8row.shape[0]
        for b in range((k + bk - 1) // bk):
            s = srow[b]
            for c in range(b * bk, min(k, (b + 1) * bk)):
                vals[c] = lut[w8row[c]] * s

    @njit(parallel=True, cache=True, nogil=True)
    def _fp8_block_kernel(w8, sinv, lut, bn, bk, out, scales, bad, group, qmax, half_range, eps, bits, full):
        n, k = w8.shape
        for r in prange(n):
            vals = np.empty(k, dtype=np.float32)
            tmp = np.empty(k, dtype=np.float32)
            _fp8_row(w8[r], sinv[r // bn], lut, bk, vals)
            _round_bf16_inplace(vals.view(np.uint32))
            bad[r] = _quant_row(vals, tmp, out[r], scales[r], group, qmax, half_range, eps, bits, full)

    @njit(parallel=True, cache=True, nogil=True)
    def _fp8_block_dequant_kernel(w8, sinv, lut, bn, bk, out_bits, bad):
        n, k = w8.shape
        for r in prange(n):
            vals = np.empty(k, dtype=np.float32)
            _fp8_row(w8[r], sinv[r // bn], lut, bk, vals)
            vb = vals.view(np.uint32)
            _round_bf16_inplace(vb)
            big = np.float32(0.0)
            total = np.float32(0.0)
            for c in range(k):  # the bf16 bits out, and `_not_finite`'s sums in the same pass
                big = max(big, abs(vals[c]))
                total += vals[c] * np.float32(0.0)
                out_bits[r, c] = np.uint16(vb[c] >> np.uint32(16))
            bad[r] = _not_finite(big, total)

    @njit(parallel=True, cache=True, nogil=True)
    def _bf16_kernel(w16, out, scales, bad, group, qmax, half_range, eps, bits, full):
        n, k = w16.shape
        for r in prange(n):
            vals = np.empty(k, dtype=np.float32)
            tmp = np.empty(k, dtype=np.float32)
            vb = vals.view(np.uint32)
            for c in range(k):
                vb[c] = np.uint32(w16[r, c]) << np.uint32(16)
            bad[r] = _quant_row(vals, tmp, out[r], scales[r], group, qmax, half_range, eps, bits, full)


def _outputs(n: int, k: int, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    packed = np.empty((n, k * spec.num_bits // 8), dtype=np.uint8)
    scales = np.empty((n, k // spec.group_size), dtype=np.uint16)
    return packed, scales, np.zeros(n, dtype=np.bool_)


def _args(spec: QuantSpec) -> tuple:
    return (spec.group_size, spec.q_max, spec.half_range, _BF16_EPS, spec.num_bits, spec.full_range)


def _check(bad: np.ndarray) -> None:
    if bad.any():
        raise NonFiniteWeightError.in_rows(np.flatnonzero(bad).tolist())


def _lut() -> np.ndarray:
    global _LUT
    if _LUT is None:
        _LUT = fp8_e4m3_table()
    return _LUT


_LUT = None


def _check_fp8_block(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """The kernels index without bounds checks (numba): a weight of another dtype (its bytes read as FP8 codes of a
    wider row) or a scale of the wrong shape would read and write past the buffers, so both are checked here."""
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2:
        raise ValueError(f"an FP8 block weight must be 2-D float8_e4m3fn, got {w8.dtype} {list(w8.shape)}")
    want = (-(-w8.shape[0] // block[0]), -(-w8.shape[1] // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} for rows "
                         f"{list(w8.shape)} in {block[0]}x{block[1]} blocks")


def quantize_fp8_block(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block weight -> (weight_packed int32 [N, K*b/32], weight_scale bf16 [N, K/g]).

    Args:
        w8: float8_e4m3fn `[N, K]` on CPU.
        scale_inv: float32 `[ceil(N/bn), ceil(K/bk)]`, multiplied per block.
        block: (bn, bk), usually (128, 128).
        spec: symmetric, 4 or 8 bits; K % group_size == 0.
    Raises:
        NonFiniteWeightError: the dequantized weight holds NaN or Inf.
        ValueError: w8 is not 2-D float8_e4m3fn, or scale_inv's shape does not match its blocks.
    """
    _check_fp8_block(w8, scale_inv, block)
    n, k = w8.shape
    packed, scales, bad = _outputs(n, k, spec)
    _fp8_block_kernel(
        w8.contiguous().view(torch.uint8).numpy(), scale_inv.float().contiguous().numpy(), _lut(),
        block[0], block[1], packed, scales, bad, *_args(spec),
    )
    _check(bad)
    return torch.from_numpy(packed).view(torch.int32), torch.from_numpy(scales).view(torch.bfloat16)


def dequantize_fp8_block(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 block weight `[N, K]` -> bf16 `[N, K]`, bit-identical to compressed-tensors' dequantizer."""
    _check_fp8_block(w8, scale_inv, block)
    n, k = w8.shape
    out = np.empty((n, k), dtype=np.uint16)
    bad = np.zeros(n, dtype=np.bool_)
    _fp8_block_dequant_kernel(
        w8.contiguous().view(torch.uint8).numpy(), scale_inv.float().contiguous().numpy(), _lut(),
        block[0], block[1], out, bad,
    )
    _check(bad)
    return torch.from_numpy(out).view(torch.bfloat16)


def quantize_bf16(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 weight `[N, K]` -> (weight_packed int32, weight_scale bf16), as `quantize_fp8_block`."""
    n, k = w.shape
    packed, scales, bad = _outputs(n, k, spec)
    _bf16_kernel(w.contiguous().view(torch.int16).numpy().view(np.uint16), packed, scales, bad, *_args(spec))
    _check(bad)
    return torch.from_numpy(packed).view(torch.int32), torch.from_numpy(scales).view(torch.bfloat16)
