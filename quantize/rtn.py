"""Round-to-nearest group-wise quantization, bit-identical to compressed-tensors' own math.

compressed-tensors (quantization/utils/helpers.py `calculate_qparams`, lifecycle/forward_helpers.py
`_quantize`) computes, in the weight's own dtype:
    symmetric:  scale = max(|min(g)|, |max(g)|) / ((q_max - q_min) / 2)        (absmax / 7.5 for int4)
    asymmetric: scale = (max(g) - min(g)) / (q_max - q_min);  zp = round(clamp(q_min - min/scale))
    (min is clamped to <= 0 and max to >= 0 first; a zero scale becomes the dtype's eps)
    q = round_half_even(clamp(w / scale + zp, q_min, q_max))
The divisions below run in float32 and are rounded to the weight dtype, which is exactly what
torch's bf16/fp16 kernels do on CPU and CUDA, so the integers match compressed-tensors bit for bit
(tests/test_rtn.py checks this against compressed-tensors itself).

`QuantSpec.full_range` (symmetric only) changes the scale alone, as AutoRound's full-range symmetric scheme:
    scale = -max(g) / 2^(b-1) where max(g) > |min(g)|, else |min(g)| / 2^(b-1)        (signed; / 8 for int4)
so the value of largest magnitude is exactly q_min * scale and all 2^b levels are used; the integers are
still compressed-tensors' `quantize` of w with that scale (tests/test_rtn.py), and w = q * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmq.quantize.spec import QuantSpec


@dataclass
class QWeight:
    """A quantized Linear weight before packing.

    Attributes:
        q: int8 `[N, K]`, values in [q_min, q_max].
        scale: `[N, K // group_size]` in the source weight's dtype (bf16 for GLM checkpoints).
        zero_point: int8 `[N, K // group_size]` or None when symmetric.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def group_minmax(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of `w` `[N, K]`, each `[N, K // group_size]`, clamped to include 0."""
    g = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
    lo, hi = torch.aminmax(g, dim=-1)
    return lo.clamp(max=0), hi.clamp(min=0)


def compute_qparams(
    lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and zero points) from per-group min/max, in the dtype of `lo`/`hi`.

    Args:
        lo, hi: `[..., G]` group minima (<= 0) and maxima (>= 0), in the weight dtype.
    Returns:
        scale in the same dtype; int8 zero point `[..., G]` or None (symmetric).
    """
    dtype = lo.dtype
    q_range = float(spec.q_max - spec.q_min)  # 15 for int4: exact in bf16
    if spec.symmetric:
        # full range: the side of larger magnitude maps to q_min, a negative scale when it is the maximum (ties: |min|)
        top = torch.where(hi > lo.abs(), -hi, lo.abs()) if spec.full_range else torch.maximum(lo.abs(), hi)
        scale = (top.float() / spec.half_range).to(dtype)
    else:
        scale = ((hi.float() - lo.float()).to(dtype).float() / q_range).to(dtype)
    zero = scale == 0
    zp = None
    if not spec.symmetric:
        # compressed-tensors derives the zero point from the scale *before* replacing zeros by eps. A zero
        # scale (an all-zero group, or subnormal weights whose range / (q_max - q_min) underflows) then gives
        # min / 0: -inf where min < 0, so zp = q_min + inf, clamped to q_max (and every q is q_max), which
        # the arithmetic below reproduces; but 0 / 0 = NaN where min == 0, which its int8 cast turns into 0,
        # and we write that 0 explicitly. Either way the group dequantizes to exactly 0.
        zp = (spec.q_min - (lo.float() / scale.float()).to(dtype).float()).to(dtype)
        zp = torch.round(zp.clamp(spec.q_min, spec.q_max)).masked_fill_(zero & (lo == 0), 0).to(torch.int8)
    scale = scale.masked_fill(zero, _eps(dtype))
    return scale, zp


def quantize_with_qparams(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    """Integers for `w` `[N, K]` under given group scales `[N, G]`; int8 `[N, K]`."""
    n, k = w.shape
    g = w.unflatten(-1, (k // spec.group_size, spec.group_size))
    # Division in float32 rounded to the weight dtype == torch's own bf16/fp16 division.
    x = (g.float() / scale.float().unsqueeze(-1)).to(w.dtype)
    if zero_point is not None:
        x = (x.float() + zero_point.float().unsqueeze(-1)).to(w.dtype)
    q = torch.round(x.float().clamp_(spec.q_min, spec.q_max))
    return q.to(torch.int8).reshape(n, k)


def quantize_rtn(w: torch.Tensor, spec: QuantSpec) -> QWeight:
    """Group-wise round-to-nearest quantization of one Linear weight.

    Args:
        w: `[N, K]` float weight (bf16 for GLM sources; its dtype becomes the scale dtype).
        spec: bits, group size, symmetry. K must be a multiple of `spec.group_size`.
    Returns:
        QWeight(q int8 [N, K], scale [N, K/g] w.dtype, zero_point int8 [N, K/g] | None).
    Raises:
        ValueError: if the shape does not fit the spec or `w` is not floating point.
    """
    if not w.is_floating_point():
        raise ValueError(f"quantize_rtn needs a floating-point weight, got {w.dtype}")
    why = spec.check_shape(tuple(w.shape))
    if why:
        raise ValueError(why)
    lo, hi = group_minmax(w, spec.group_size)
    scale, zp = compute_qparams(lo, hi, spec)
    return QWeight(quantize_with_qparams(w, scale, zp, spec), scale, zp)


def dequantize(qw: QWeight, group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`(q - zp) * scale` per group, the exact inverse compressed-tensors applies; `[N, K]`."""
    n, k = qw.q.shape
    dtype = dtype or qw.scale.dtype
    q = qw.q.unflatten(-1, (k // group_size, group_size)).to(qw.scale.dtype)
    if qw.zero_point is not None:
        q = q - qw.zero_point.to(qw.scale.dtype).unsqueeze(-1)
    return (q * qw.scale.unsqueeze(-1)).reshape(n, k).to(dtype)
