"""Per-item tensor work, one row block at a time: FP8/BF16 in, packed INT / BF16 out.

Pure functions of tensors; the engine (stream.py) does the reading and writing. On CPU the
symmetric cases run through the fused numba kernels (fused_cpu.py), everything else through the
PyTorch path, which is also the CUDA path; both give the same bits (tests/test_fused_cpu.py).
"""

from __future__ import annotations

import torch

from glmq.formats import fp8
from glmq.quantize.pack import pack_int32, pack_zero_point
from glmq.quantize.rtn import quantize_rtn
from glmq.quantize.spec import QuantSpec


def _fused(t: torch.Tensor):
    """glmq.quantize.fused_cpu for a CPU tensor when numba is there, else None. Imported on first use, so
    a CUDA run never loads numba and LLVM (~0.2 s and ~60 MB of resident memory)."""
    if t.device.type != "cpu":
        return None
    from glmq.quantize import fused_cpu

    return fused_cpu if fused_cpu.available() else None


def decode(w: torch.Tensor, scale: torch.Tensor | None, fmt: str, block: tuple[int, int] | None,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Source rows -> floating point rows (`dtype` for FP8 sources; dense weights pass through)."""
    if scale is None:
        return w
    if fmt == "fp8-block":
        fused = _fused(w)
        if fused is not None and dtype == torch.bfloat16:
            return fused.dequantize_fp8_block(w, scale, block)
        return fp8.dequantize_block(w, scale, block, dtype)
    return fp8.dequantize_channel(w, scale, dtype)


def quantize_rows(w: torch.Tensor, scale: torch.Tensor | None, fmt: str, block: tuple[int, int] | None,
                  spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Row block of a source weight -> {"weight_packed", "weight_scale"[, "weight_zero_point"]} on w's device.

    Args:
        w: `[r, K]` rows, float8_e4m3fn (with `scale`) or a float dtype.
        scale: block `weight_scale_inv` rows `[ceil(r/bn), ceil(K/bk)]`, a per-channel `[r, 1]` /
            per-tensor FP8 scale, or None for dense weights.
    """
    fused = _fused(w) if spec.symmetric else None
    if fused is not None and scale is not None and fmt == "fp8-block":
        packed, sc = fused.quantize_fp8_block(w, scale, block, spec)
        return {"weight_packed": packed, "weight_scale": sc}
    if fused is not None and scale is None and w.dtype == torch.bfloat16:
        packed, sc = fused.quantize_bf16(w, spec)
        return {"weight_packed": packed, "weight_scale": sc}
    qw = quantize_rtn(decode(w, scale, fmt, block), spec)
    out = {"weight_packed": pack_int32(qw.q, spec.num_bits), "weight_scale": qw.scale}
    if qw.zero_point is not None:
        out["weight_zero_point"] = pack_zero_point(qw.zero_point, spec.num_bits)
    return out


def pack_rows(qw, r0: int, r1: int, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Rows [r0, r1) of an already-quantized weight (QWeight, CPU) in the written format."""
    out = {"weight_packed": pack_int32(qw.q[r0:r1].contiguous(), spec.num_bits),
           "weight_scale": qw.scale[r0:r1].contiguous()}
    if qw.zero_point is not None:
        out["weight_zero_point"] = pack_zero_point(qw.zero_point[r0:r1].contiguous(), spec.num_bits)
    return out
