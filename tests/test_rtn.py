"""RTN equals compressed-tensors' quantization bit for bit; the fused CPU kernels equal the eager path."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from glmq.formats.fp8 import dequantize_block
from glmq.quantize import fused_cpu
from glmq.quantize.pack import pack_int32
from glmq.quantize.rtn import dequantize, quantize_rtn
from glmq.quantize.spec import QuantSpec


def _weight(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, :32] = 0  # an all-zero group (zero scale -> eps)
    w[1] = w[1].abs()  # a group with min 0 (asymmetric edge)
    w[2, 5] = 0.5  # an outlier
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True), (8, False)])
def test_rtn_equals_compressed_tensors(dtype, group, bits, sym):
    w = _weight(37, group * 3, dtype)
    spec = QuantSpec(num_bits=bits, group_size=group, symmetric=sym)
    ours = quantize_rtn(w, spec)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group)
    gw = w.unflatten(-1, (w.shape[1] // group, group))
    scale, zp = calculate_qparams(gw.amin(-1), gw.amax(-1), args)
    q = ct_quantize(w, scale, zp, args, dtype=torch.int8)
    assert torch.equal(ours.scale, scale)
    assert torch.equal(ours.q, q)
    if not sym:
        assert torch.equal(ours.zero_point, zp.to(torch.int8))
    assert torch.equal(dequantize(ours, group), ct_dequantize(q, scale, zp, args))


def test_rtn_int4_scale_is_absmax_over_7_5():
    w = torch.tensor([[0.75] + [0.0] * 127], dtype=torch.bfloat16)
    qw = quantize_rtn(w, QuantSpec())
    assert qw.scale.item() == 0.1 or abs(qw.scale.item() - 0.1) < 1e-3
    assert qw.q[0, 0].item() == 7


def test_rtn_rejects_shapes_the_group_does_not_divide():
    with pytest.raises(ValueError, match="group_size 128"):
        quantize_rtn(torch.zeros(4, 200, dtype=torch.bfloat16), QuantSpec())


def _fp8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-4
    return w8, s


@pytest.mark.parametrize("shape", [(256, 384), (160, 256), (300, 128)])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 64)])
def test_fused_fp8_kernel_equals_eager_path(shape, bits, group):
    w8, s = _fp8_weight(*shape)
    spec = QuantSpec(num_bits=bits, group_size=group)
    packed, scale = fused_cpu.quantize_fp8_block(w8, s, (128, 128), spec)
    ref = quantize_rtn(dequantize_block(w8, s, (128, 128)), spec)
    assert torch.equal(scale, ref.scale)
    assert torch.equal(packed, pack_int32(ref.q, bits))
    assert torch.equal(fused_cpu.dequantize_fp8_block(w8, s, (128, 128)), dequantize_block(w8, s, (128, 128)))


def test_fused_bf16_kernel_equals_eager_path():
    w = _weight(96, 256, torch.bfloat16, seed=3)
    packed, scale = fused_cpu.quantize_bf16(w, QuantSpec())
    ref = quantize_rtn(w, QuantSpec())
    assert torch.equal(scale, ref.scale) and torch.equal(packed, pack_int32(ref.q, 4))


def test_fused_kernel_reports_nan():
    w8, s = _fp8_weight(128, 128)
    w8.view(torch.uint8)[3, 4] = 0x7F  # the e4m3fn NaN code
    with pytest.raises(fused_cpu.NonFiniteWeightError, match=r"rows \[3\]"):
        fused_cpu.quantize_fp8_block(w8, s, (128, 128), QuantSpec())


def test_block_dequantize_matches_compressed_tensors():
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    w8, s = _fp8_weight(160, 300)  # not multiples of 128: padding path
    ref = FP8BlockDequantizer()._create_dequantized_weight(w8, s)
    assert torch.equal(dequantize_block(w8, s, (128, 128)), ref)
    assert torch.equal(fused_cpu.dequantize_fp8_block(w8, s, (128, 128)), ref)
