"""The CPU kernels of GPTQ (glmq.quantize.gptq_cpu) against the torch path they replace on a CPU.

The float64 transcription of the paper checks both paths (tests/test_gptq.py runs on the kernels for every
case they cover); here the two float32 implementations are compared with each other on problems of
odd sizes (rows not a multiple of the kernel's tile, K not a multiple of its block), every group size,
both weight dtypes, with and without the clip search and the descent.
"""

from __future__ import annotations

import pytest
import torch

from glmq.quantize import gptq, gptq_cpu
from glmq.quantize.gptq import quantize_gptq_batch
from glmq.quantize.spec import QuantSpec


def problems(b: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.4 * torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(b, 8 * k, k, generator=g) @ mix
    x[..., :3] *= 6  # a few outlier channels, as real activations have
    h = x.transpose(1, 2) @ x / x.shape[1]
    w = (torch.randn(b, n, k, generator=g) * 0.02).to(dtype)
    return w, h


def torch_path(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(gptq_cpu, "applies", lambda *a: False)
        return quantize_gptq_batch(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("clip, cd_sweeps, scale_refit, full_range", [
    (False, 0, 0, False), (True, 0, 0, False), (True, 2, 0, False), (False, 3, 0, False), (True, 2, 2, False),
    (False, 0, 0, True), (True, 2, 0, True)])
def test_kernels_make_the_torch_paths_decisions(monkeypatch, dtype, group_size, clip, cd_sweeps, scale_refit,
                                                full_range):
    """bf16 weights: the same integers and scales, bit for bit (measured: 0 differ in every case; the two
    paths group the lazy updates and the descent's gradients differently, but the bf16 rounding of every
    quantized value absorbs that here). float32 weights, where nothing is rounded to the weight dtype: a
    group that starts inside a block takes its scale from the block's pending updates, which the torch path
    adds as one product and the kernels one by one, so the float32 scales differ in the last bits (measured
    up to 571 of 1260 at g32) and, through GPTQ's error feedback, up to 0.5 % of the integers (134 of 26880)
    and by more than 1e-6 up to 2.4 % of the scales; the Hessian errors agree to 1e-3. With `scale_refit` the
    torch refit runs after either path's descent, and the bounds above hold as they are."""
    k = 384 if group_size != 128 else 256  # 384 = 3 blocks of 128, the last one partial for 256 at g128
    spec = QuantSpec(group_size=group_size, cd_sweeps=cd_sweeps, scale_refit=scale_refit, full_range=full_range)
    w, h = problems(3, 70, k, dtype, seed=group_size)  # 70 rows: two full tiles of 32 and a partial one
    assert gptq_cpu.applies(w, spec, "propagated" if clip else None)
    fast = quantize_gptq_batch(w, h, spec, clip_search=clip)
    ref = torch_path(monkeypatch, w, h, spec, clip_search=clip)
    for a, b in zip(fast, ref):
        assert a.qweight.scale.dtype == dtype and a.qweight.zero_point is None
        if dtype == torch.bfloat16:
            assert torch.equal(a.qweight.q, b.qweight.q), int((a.qweight.q != b.qweight.q).sum())
            assert torch.equal(a.qweight.scale, b.qweight.scale)
        else:
            differ = int((a.qweight.q != b.qweight.q).sum())
            assert differ <= a.qweight.q.numel() // 100, differ
            # a flipped integer moves the later groups' current values, hence their scales, by more
            off = ((a.qweight.scale - b.qweight.scale).abs() > 1e-6 * b.qweight.scale.abs()).float().mean()
            assert off <= 0.05, float(off)
            assert a.error_gptq == pytest.approx(b.error_gptq, rel=2e-3)
        assert a.error_gptq < a.error_rtn
        if full_range:  # both signs chosen (the scale's dividend is signed)
            assert (a.qweight.scale < 0).any() and (a.qweight.scale > 0).any()


def test_kernels_used_where_they_apply(monkeypatch):
    """The covered case never reaches the torch loop; the others never reach the kernels."""
    w, h = problems(2, 40, 128, torch.bfloat16)
    spec = QuantSpec(group_size=64, cd_sweeps=1)

    def boom(*a, **k):
        raise AssertionError("wrong path")

    with monkeypatch.context() as m:
        m.setattr(gptq, "_gptq_loop", boom)
        m.setattr(gptq, "_coordinate_descent", boom)
        quantize_gptq_batch(w, h, spec, clip_search=True)
    with monkeypatch.context() as m:
        m.setattr(gptq_cpu, "gptq_loop", boom)
        m.setattr(gptq_cpu, "coordinate_descent", boom)
        for other in (QuantSpec(group_size=64, symmetric=False), QuantSpec(group_size=64, act_order=True),
                      QuantSpec(group_size=64, clip_objective="block")):
            quantize_gptq_batch(w, h, other, clip_search=True)
        quantize_gptq_batch(w.half(), h, spec, clip_search=True)
    if torch.cuda.is_available():
        assert not gptq_cpu.applies(w.cuda(), spec, None)


def test_pruned_candidates_change_nothing(monkeypatch):
    """The clip search stops a candidate scale once it cannot win on any row of a tile; with a grid whose
    later factors are hopeless (tiny ranges clip nearly everything) that happens early, and the result is
    still the torch path's, which scores every candidate to the end."""
    monkeypatch.setattr(gptq, "CLIP_GRID", (1.0, 0.9, 0.3, 0.2, 0.1))
    w, h = problems(2, 64, 256, torch.bfloat16, seed=7)
    spec = QuantSpec(group_size=128, cd_sweeps=0)
    fast = quantize_gptq_batch(w, h, spec, clip_search=True)
    ref = torch_path(monkeypatch, w, h, spec, clip_search=True)
    for a, b in zip(fast, ref):
        assert torch.equal(a.qweight.q, b.qweight.q) and torch.equal(a.qweight.scale, b.qweight.scale)
