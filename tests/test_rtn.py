"""RTN equals compressed-tensors' quantization bit for bit; the fused CPU kernels equal the eager path."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from glmq.formats.fp8 import NonFiniteWeightError, dequantize_block
from glmq.quantize import fused_cpu, ops
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_zero_point_of_underflowing_groups_matches_compressed_tensors(dtype, bits):
    """Groups whose range / (2^b - 1) rounds to a zero scale (subnormal weights): compressed-tensors takes
    the zero point from min / 0 before the scale becomes eps, so min < 0 gives zp = q == q_max, and only
    0 / 0 (min == 0) gives zp = 0."""
    sub = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    w = torch.zeros(5, 64, dtype=dtype)
    w[0, :2] = torch.tensor([-1, 2]) * sub  # min < 0 < max
    w[1, 0] = -3 * sub  # max == 0
    w[2, 0] = 3 * sub  # min == 0: 0 / 0
    w[3, 32:] = torch.randn(32) * 0.02  # row 3: an all-zero group beside a normal one
    w[4] = torch.randn(64) * 0.02
    spec = QuantSpec(num_bits=bits, group_size=32, symmetric=False)
    ours = quantize_rtn(w, spec)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=32)
    gw = w.unflatten(-1, (2, 32))
    scale, zp = calculate_qparams(gw.amin(-1), gw.amax(-1), args)
    q = ct_quantize(w, scale, zp, args, dtype=torch.int8)
    assert torch.equal(ours.scale, scale)
    assert torch.equal(ours.zero_point, zp.to(torch.int8))
    assert torch.equal(ours.q, q)
    assert ours.zero_point[0, 0] == ours.zero_point[1, 0] == spec.q_max and ours.zero_point[2, 0] == 0
    assert torch.equal(dequantize(ours, 32), ct_dequantize(q, scale, zp, args))


def test_rtn_int4_scale_is_absmax_over_7_5():
    w = torch.tensor([[0.75] + [0.0] * 127], dtype=torch.bfloat16)
    qw = quantize_rtn(w, QuantSpec())
    assert qw.scale.item() == 0.1 or abs(qw.scale.item() - 0.1) < 1e-3
    assert qw.q[0, 0].item() == 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_full_range_maps_the_largest_magnitude_to_q_min(dtype, bits):
    """full_range: the value of largest magnitude is exactly q_min * scale (a negative scale where it is the
    maximum), every other value within half a step except those beyond q_max steps (the side of fewer
    levels), which clamp; compressed-tensors' own quantize/dequantize with those scales agree bit for bit."""
    w = _weight(37, 128 * 3, dtype)
    w[3, :128] = -w[3, :128].abs()  # only negative values
    w[4, :128] = w[4, :128].abs()  # only positive values
    w[5, :128] = torch.linspace(-1, 1, 128).to(dtype)  # a tie: |min| == max -> the positive scale
    spec = QuantSpec(num_bits=bits, full_range=True)
    ours = quantize_rtn(w, spec)
    g = w.float().unflatten(-1, (3, 128))
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    neg = hi > lo.abs()
    assert torch.equal(ours.scale < 0, neg & (hi > 0))
    assert neg[4, 0] and not neg[3, 0] and not neg[5, 0] and neg.any() and (~neg).any()
    deq = dequantize(ours, 128).float().unflatten(-1, (3, 128))
    extreme = torch.where(neg, hi, lo)
    nonzero = extreme != 0
    assert torch.equal(deq.gather(-1, (g - extreme.unsqueeze(-1)).abs().argmin(-1, keepdim=True))[..., 0][nonzero],
                       extreme[nonzero])  # the extreme itself is represented exactly
    x = g / ours.scale.float().unsqueeze(-1)
    excess = (x - spec.q_max).clamp_min(0)
    steps = (deq - g).abs() / ours.scale.float().abs().unsqueeze(-1)
    # the division is rounded to the weight dtype: 1/16 step at |x| <= 8, up to 1/2 at int8's |x| <= 128 in bf16
    assert (steps - excess).amax() <= 0.5 + (1 / 16 if bits == 4 else 1 / 2)
    assert excess.amax() > 0  # the tie row clamps its maximum to q_max
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=128)
    q = ct_quantize(w, ours.scale, None, args, dtype=torch.int8)
    assert torch.equal(ours.q, q)
    assert torch.equal(dequantize(ours, 128), ct_dequantize(q, ours.scale, None, args))
    plain = quantize_rtn(w, QuantSpec(num_bits=bits))
    gauss = slice(6, None)  # the normal rows: a finer grid (int4: measured -13 % squared error; the tie row loses)
    assert (deq.flatten(-2) - w.float())[gauss].square().sum() < \
        (0.95 if bits == 4 else 1.0) * (dequantize(plain, 128).float() - w.float())[gauss].square().sum()


def test_full_range_needs_a_symmetric_spec():
    with pytest.raises(ValueError, match="full_range needs a symmetric spec"):
        QuantSpec(symmetric=False, full_range=True)


def test_rtn_rejects_shapes_the_group_does_not_divide():
    with pytest.raises(ValueError, match="group_size 128"):
        quantize_rtn(torch.zeros(4, 200, dtype=torch.bfloat16), QuantSpec())


def _fp8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-4
    return w8, s


@pytest.mark.parametrize("shape", [(256, 384), (160, 256), (300, 128)])
@pytest.mark.parametrize("bits,group,full", [(4, 128, False), (4, 32, False), (8, 64, False), (4, 128, True),
                                             (8, 32, True)])
def test_fused_fp8_kernel_equals_eager_path(shape, bits, group, full):
    w8, s = _fp8_weight(*shape)
    spec = QuantSpec(num_bits=bits, group_size=group, full_range=full)
    packed, scale = fused_cpu.quantize_fp8_block(w8, s, (128, 128), spec)
    ref = quantize_rtn(dequantize_block(w8, s, (128, 128)), spec)
    assert torch.equal(scale, ref.scale)
    assert torch.equal(packed, pack_int32(ref.q, bits))
    assert torch.equal(fused_cpu.dequantize_fp8_block(w8, s, (128, 128)), dequantize_block(w8, s, (128, 128)))


@pytest.mark.parametrize("full", [False, True])
def test_fused_bf16_kernel_equals_eager_path(full):
    w = _weight(96, 256, torch.bfloat16, seed=3)
    packed, scale = fused_cpu.quantize_bf16(w, QuantSpec(full_range=full))
    ref = quantize_rtn(w, QuantSpec(full_range=full))
    assert torch.equal(scale, ref.scale) and torch.equal(packed, pack_int32(ref.q, 4))
    assert (scale < 0).any() == full


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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _poisoned_rows(device="cpu"):
    """FP8 block rows with a NaN code in row 3 and an Inf (a huge block scale) in rows 128-255."""
    w8, s = _fp8_weight(256, 256)
    w8.view(torch.uint8)[3, 4] = 0x7F  # the e4m3fn NaN code
    s[1, 1] = 3e38  # 448 * 3e38 is Inf in float32
    return w8.to(device), s.to(device)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_every_path_rejects_nan_and_inf(monkeypatch, sym, fused):
    """The PyTorch path (every CUDA run, fp8-ct sources, asymmetric specs, and CPU without numba) rejects
    NaN/Inf as the fused kernels do, instead of writing NaN scales or BF16 weights."""
    if not fused:
        monkeypatch.setattr(fused_cpu, "available", lambda: False)
    spec = QuantSpec(symmetric=sym)
    rows = r"rows \[3, 128, 129, 130, 131, 132, 133, 134\] \.\.\.$"
    w8, s = _poisoned_rows()
    with pytest.raises(NonFiniteWeightError, match=rows):
        ops.quantize_rows(w8, s, "fp8-block", (128, 128), spec)
    with pytest.raises(NonFiniteWeightError, match=rows):
        ops.decode(w8, s, "fp8-block", (128, 128))
    sc = torch.rand(256, 1) * 0.01
    sc[7] = float("nan")  # compressed-tensors FP8 (per-channel scale): always the PyTorch path
    with pytest.raises(NonFiniteWeightError, match=r"rows \[3, 7\]$"):
        ops.quantize_rows(w8[:, :128], sc, "fp8-ct", None, spec)
    with pytest.raises(NonFiniteWeightError, match=r"rows \[3, 7\]$"):
        ops.decode(w8[:, :128], sc, "fp8-ct", None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = _weight(16, 256, dtype)
        w[5, 200] = float("nan")
        w[9, 0] = float("-inf")
        with pytest.raises(NonFiniteWeightError, match=r"rows \[5, 9\]$"):
            ops.quantize_rows(w, None, "dense", None, spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_dense_f16_f32_rows_are_quantized_as_bf16(monkeypatch, dtype, sym, fused):
    """F16/F32 weights are rounded to bf16 first, as FP8 ones are decoded to it: bf16 scales (what the plan
    declares) and compressed-tensors' RTN of the bf16 weights."""
    if not fused:
        monkeypatch.setattr(fused_cpu, "available", lambda: False)
    w = _weight(37, 256, dtype)
    spec = QuantSpec(symmetric=sym)
    out = ops.quantize_rows(w, None, "dense", None, spec)
    ref = quantize_rtn(w.to(torch.bfloat16), spec)
    assert out["weight_scale"].dtype == torch.bfloat16 and torch.equal(out["weight_scale"], ref.scale)
    assert torch.equal(out["weight_packed"], pack_int32(ref.q, 4))


@pytest.mark.gpu
@cuda
def test_cuda_path_rejects_nan_and_inf():
    w8, s = _poisoned_rows("cuda")
    with pytest.raises(NonFiniteWeightError, match=r"rows \[3, 128, "):
        ops.quantize_rows(w8, s, "fp8-block", (128, 128), QuantSpec())
    with pytest.raises(NonFiniteWeightError, match=r"rows \[3, 128, "):
        ops.decode(w8, s, "fp8-block", (128, 128))
