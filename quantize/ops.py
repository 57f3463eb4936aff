"""Per-item tensor work, one row block at a time: FP8/BF16 in, packed INT / BF16 out.

Pure functions of tensors; the engine (stream.py) does the reading and writing. On CPU the
symmetric cases run through the fused numba kernels (fused_cpu.py), everything else through the
PyTorch path, which is also the CUDA path; both give the same bits (tests/test_fused_cpu.py), and both
reject a weight holding NaN or Inf (`NonFiniteWeightError`, which the engine turns into an error naming
the file and the tensor) instead of writing NaN scales.
"""

from __future__ import annotations

import torch

from glmq.formats import fp8
from glmq.formats.fp8 import NonFiniteWeightError
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


def cuda_missing(device: str | torch.device) -> str | None:
    """The error for `device` naming CUDA where PyTorch sees none, else None: one wording for the command line,
    the engines and validate, each of which raises it as its own error type."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is visible to PyTorch; use --device cpu"
    return None


def check_finite(t: torch.Tensor) -> None:
    """Raise NonFiniteWeightError naming the rows of `t` `[r, c]` that hold NaN or Inf, as the fused kernels do.

    One reduction and no temporary when all is well (min and max propagate NaN, and both are finite only
    if every value is); the rows are located only on failure. On CUDA the answer costs a sync per row
    block, small next to reading the block from disk."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise NonFiniteWeightError.in_rows((~torch.isfinite(_rows(t)).all(1)).nonzero().flatten().tolist())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, columns] for naming the rows that hold a bad value: 1-D (a norm's weight) and 0-D tensors too."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


# FP8 bit patterns that are not finite numbers: e4m3fn has NaN only (S.1111.111), e5m2 Inf and NaN (S.11111.xx)
_FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


def check_copied(t: torch.Tensor) -> None:
    """Raise NonFiniteWeightError for a tensor written as it is read (a norm, the embeddings, a kept FP8 weight or its
    scale) that holds NaN or Inf, as for the tensors glmq converts: a corrupt source must not pass into the output
    because its tensor happened to be copied. Integer tensors pass; FP8 ones are checked by their bit patterns."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    if t.dtype in _FP8_NONFINITE:
        mask, bad = _FP8_NONFINITE[t.dtype]
        hit = (t.view(torch.uint8) & mask) == bad
        if bool(hit.any()):
            raise NonFiniteWeightError.in_rows(_rows(hit).any(1).nonzero().flatten().tolist())
        return
    check_finite(t)


def _decode(w: torch.Tensor, scale: torch.Tensor | None, fmt: str, block: tuple[int, int] | None,
            dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(`decode`'s rows, whether a fused kernel made them and so already checked them for NaN/Inf)."""
    if scale is None:
        return w, False
    if fmt == "fp8-block":
        fused = _fused(w)
        if fused is not None and dtype == torch.bfloat16:
            return fused.dequantize_fp8_block(w, scale, block), True
        return fp8.dequantize_block(w, scale, block, dtype), False
    return fp8.dequantize_channel(w, scale, dtype), False


def decode(w: torch.Tensor, scale: torch.Tensor | None, fmt: str, block: tuple[int, int] | None,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Source rows -> floating point rows (`dtype` for FP8 sources; dense weights pass through).

    Raises:
        NonFiniteWeightError: the rows hold NaN or Inf, or an FP8 weight decodes to them (a NaN code, or a
            NaN/Inf/huge scale).
    """
    x, checked = _decode(w, scale, fmt, block, dtype)
    if not checked:  # dense weights too (a BF16/FP16/FP32 source's): written as they are, they must be numbers
        check_finite(x)
    return x


def quantize_rows(w: torch.Tensor, scale: torch.Tensor | None, fmt: str, block: tuple[int, int] | None,
                  spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Row block of a source weight -> {"weight_packed", "weight_scale"[, "weight_zero_point"]} on w's device.

    Args:
        w: `[r, K]` rows, float8_e4m3fn (with `scale`) or a float dtype.
        scale: block `weight_scale_inv` rows `[ceil(r/bn), ceil(K/bk)]`, a per-channel `[r, 1]` /
            per-tensor FP8 scale, or None for dense weights.
    Raises:
        NonFiniteWeightError: the rows hold (or decode to) NaN or Inf.
    """
    if scale is None and w.dtype != torch.bfloat16:
        # F16/F32 weights are rounded to bf16 first, as FP8 ones are decoded to it: the scales are the bf16
        # `weight_scale` the plan declares, and the integers compressed-tensors' RTN of the bf16 weights.
        w = w.to(torch.bfloat16)
    fused = _fused(w) if spec.symmetric else None
    if fused is not None and scale is not None and fmt == "fp8-block":
        packed, sc = fused.quantize_fp8_block(w, scale, block, spec)
        return {"weight_packed": packed, "weight_scale": sc}
    if fused is not None and scale is None and w.dtype == torch.bfloat16:
        packed, sc = fused.quantize_bf16(w, spec)
        return {"weight_packed": packed, "weight_scale": sc}
    x, checked = _decode(w, scale, fmt, block, torch.bfloat16)
    qw = quantize_rtn(x, spec)
    if not checked:
        # Every value reaches its group's min/max, which carry NaN and Inf into the scale: checking the
        # scales checks the rows at 1/group_size of the cost.
        check_finite(qw.scale)
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
