"""Edge cases of the quantization math that the main suites do not reach: the fused CPU kernels on NaN payloads."""

from __future__ import annotations

import pytest
import torch

from glmq.formats.fp8 import NonFiniteWeightError
from glmq.quantize import fused_cpu, ops
from glmq.quantize.spec import QuantSpec


def _nan_scale(dtype: torch.dtype, bits: int) -> torch.Tensor:
    """Block scales `[2, 2]` of `dtype` whose [1, 0] entry has the raw bit pattern `bits` (a NaN)."""
    s = (torch.rand(2, 2, generator=torch.Generator().manual_seed(1)) * 0.01).to(dtype)
    width = 8 * s.element_size()
    raw = s.view(torch.int32 if width == 32 else torch.int16)
    raw[1, 0] = bits - (1 << width) if bits >> (width - 1) else bits
    assert bool(s[1, 0].isnan())
    return s


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 0xFFFFFFFF), (torch.float32, 0x7FFFFFFF),
                                        (torch.float32, 0x7FFF8000), (torch.float16, 0xFFFF), (torch.float16, 0x7FFF)])
@pytest.mark.parametrize("fused", [True, False])
def test_nan_scale_of_any_payload_is_an_error(monkeypatch, dtype, bits, fused):
    """A NaN block scale whose payload fills the high mantissa bits (ff ff ff ff bytes, an F16 NaN widened to
    float32): the fused kernels' bf16 rounding carried it into the sign bit, so the block decoded to +-0 and was
    written as zeros (scale eps) with no error, where the PyTorch path (and CUDA) rejects it."""
    if not fused:
        monkeypatch.setattr(fused_cpu, "available", lambda: False)
    w8 = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 3).to(torch.float8_e4m3fn)
    s = _nan_scale(dtype, bits)
    rows = r"rows \[128, 129, 130, 131, 132, 133, 134, 135\] \.\.\.$"
    with pytest.raises(NonFiniteWeightError, match=rows):
        ops.quantize_rows(w8, s, "fp8-block", (128, 128), QuantSpec())
    with pytest.raises(NonFiniteWeightError, match=rows):
        ops.decode(w8, s, "fp8-block", (128, 128))


def test_fused_bf16_rounding_equals_torch_on_every_class_of_value():
    """The kernels' float32 -> bf16 rounding (integer arithmetic on the bits) is torch's (c10's) for finite values,
    ties, overflow to Inf, Inf, and every NaN (torch gives its canonical 0x7FC0; the carry gave +-0 or Inf)."""
    g = torch.Generator().manual_seed(2)
    special = [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFFF8000, 0x7FFF8000, 0xFFC00001, 0x7F800000,
               0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x00018000, 0x80000000, 0x00000001, 0x3F808000]
    bits = torch.cat([torch.tensor(special, dtype=torch.int64),
                      torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64)])
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    ref = x.to(torch.bfloat16)
    b = x.clone().numpy().view("uint32")
    fused_cpu._round_bf16_inplace(b)
    ours = torch.from_numpy(b).view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
    assert torch.equal(torch.from_numpy(b)[ref.isnan()], torch.full_like(torch.from_numpy(b)[ref.isnan()], 0x7FC00000))
