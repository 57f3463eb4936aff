"""GPTQ (glmq.quantize.gptq) and the Hessian accumulator (glmq.calibration.hessian).

What is asserted:
- GPTQ beats RTN on the Hessian-weighted error tr(D H D^T) by a clear margin on a fixed-seed problem.
- GPTQ equals a float64, unblocked, column-by-column transcription of the paper's Algorithm 1 (below).
- The output has RTN's exact format, packs, and dequantizes to what GPTQ reports.
- Dampening retries and RTN fallbacks are recorded; a Hessian without cross terms reproduces RTN.
- A batch of problems (the experts of a layer) gives each element exactly its single-problem result,
  fallbacks included, with every clip objective and with coordinate descent.
- Coordinate descent never raises any row's damped objective, lowers it clearly on correlated problems,
  keeps GPTQ's scales, and equals a float64 column-by-column transcription; after enough sweeps no single
  integer move helps.
- The propagated clip search picks, per row, the clip factor GPTQ loses least with (exact on one group),
  and beats plain GPTQ everywhere and the diagonal-block search on the fixed seeds / on average.
- The accumulator is batch-split invariant, merges exactly, and round-trips its state.
"""

from __future__ import annotations

import logging

import pytest
import torch

from glmq.calibration.hessian import HessianAccumulator
from glmq.formats.fp8 import NonFiniteWeightError
from glmq.quantize import gptq
from glmq.quantize.gptq import CD_MIN_GAIN, Fallback, GPTQResult, hessian_error, quantize_gptq, quantize_gptq_batch
from glmq.quantize.pack import pack_int32, unpack_int32
from glmq.quantize.rtn import (
    QWeight,
    compute_qparams,
    dequantize,
    group_minmax,
    quantize_rtn,
    quantize_with_qparams,
)
from glmq.quantize.spec import QuantSpec


def activations(t: int, k: int, seed: int) -> torch.Tensor:
    """Correlated activations `[t, k]` float32: a rank-64 signal plus noise, 8 channels with 100x variance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=g) @ torch.randn(64, k, generator=g) / 8 + torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:8]] *= 10
    return x


def problem(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """(w `[n, k]` dtype, H = X^T X `[k, k]` float32) from 8k correlated tokens."""
    x = activations(8 * k, k, seed)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)) * 0.02).to(dtype)
    return w, x.T @ x


def gptq_spec(**kw) -> QuantSpec:
    """A GPTQ spec; `scale_refit` 0 unless given: these tests are about the stages before the refit (GPTQ,
    the clip search, the descent), whose decisions it would change; tests/test_scale_refit.py tests it."""
    kw.setdefault("scale_refit", 0)
    return QuantSpec(method="gptq", **kw)


# --- GPTQ beats RTN ---------------------------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_beats_rtn(group_size, symmetric, act_order):
    w, h = problem(64, 256)
    r = quantize_gptq(w, h, gptq_spec(group_size=group_size, symmetric=symmetric, act_order=act_order))
    assert r.fallback is None and not r.damp_increased and r.dead_columns == 0
    assert r.error_rtn > 0
    assert r.error_gptq < 0.8 * r.error_rtn, (r.error_gptq, r.error_rtn)
    # The reported errors are the Hessian-weighted errors of what is returned and of plain RTN.
    assert r.error_gptq == pytest.approx(hessian_error(w, dequantize(r.qweight, group_size), h), rel=1e-12)
    rtn = quantize_rtn(w, QuantSpec(group_size=group_size, symmetric=symmetric))
    assert r.error_rtn == pytest.approx(hessian_error(w, dequantize(rtn, group_size), h), rel=1e-12)


def test_act_order_helps_on_outlier_channels():
    w, h = problem(64, 256)
    plain = quantize_gptq(w, h, gptq_spec(group_size=128))
    ordered = quantize_gptq(w, h, gptq_spec(group_size=128, act_order=True))
    assert ordered.error_gptq < plain.error_gptq


@pytest.mark.parametrize("objective", ["propagated", "block"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_option(symmetric, objective):
    w, h = problem(64, 256)
    spec = gptq_spec(group_size=64, symmetric=symmetric, act_order=True, clip_objective=objective)
    plain = quantize_gptq(w, h, spec)
    clipped = quantize_gptq(w, h, spec, clip_search=True)
    assert_rtn_format(clipped.qweight, w, spec)
    assert clipped.error_gptq < plain.error_gptq < clipped.error_rtn


# --- float64 reference transcription of the paper ----------------------------------------------


def gptq_reference_f64(w: torch.Tensor, h: torch.Tensor, spec: QuantSpec) -> QWeight:
    """GPTQ Algorithm 1 (Frantar et al. 2022) in float64, one column at a time, no lazy blocks.

    Same rules as quantize_gptq: dead columns zeroed; static act-order by decreasing diag(H); a group's
    scale fixed, with RTN's math, from the current values of all its (original, contiguous) columns
    when the processing order first reaches one of them; columns quantized with RTN's functions.
    H^-1's upper Cholesky factor comes from torch.linalg.inv + cholesky in float64.
    """
    n, k = w.shape
    gs = spec.group_size
    W, H = w.double().clone(), h.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if spec.act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += spec.damp * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    Hinv = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)

    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // gs, dtype=w.dtype)
    zp = None if spec.symmetric else torch.empty(n, k // gs, dtype=torch.int8)
    group_of = perm // gs
    for j in range(k):
        g = int(group_of[j])
        cols = torch.nonzero(group_of == g).flatten()  # processing positions of group g, ascending
        if j == int(cols[0]):  # first column of group g reached: scale from its current weights
            lo, hi = group_minmax(W[:, cols].to(w.dtype), gs)
            s, z = compute_qparams(lo, hi, spec)
            scale[:, g] = s[:, 0]
            if zp is not None:
                zp[:, g] = z[:, 0]
        s, z = scale[:, g : g + 1], None if zp is None else zp[:, g : g + 1]
        # Quantize column j with RTN's own functions (the group's other columns are ignored).
        qg = quantize_with_qparams(W[:, cols].to(w.dtype), s, z, spec)[:, cols == j]  # (n, 1)
        deq = dequantize(QWeight(qg.expand(n, gs).contiguous(), s, z), gs)[:, 0].double()
        q[:, j] = qg[:, 0]
        err = (W[:, j] - deq) / Hinv[j, j]
        W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]
    return QWeight(q[:, torch.argsort(perm)], scale, zp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_float64_reference(symmetric, act_order, block_size, dtype):
    """The integers EQUAL the float64 reference's, in all 24 cases (this is what is asserted).

    float32 vs float64 rounding could in principle flip a value that sits on a rounding boundary, but
    on these fixed-seed problems none does (checked on seeds 3-5: 0 of 1024 integers differ in every
    case). bf16 scales are then equal too; float32 scales are computed from current weights that differ
    by float32 rounding, so they agree to ~1e-7 relative, and so do the errors.
    """
    w, h = problem(16, 64, seed=3, dtype=dtype)
    spec = gptq_spec(group_size=32, symmetric=symmetric, act_order=act_order, block_size=block_size, cd_sweeps=0)
    got = quantize_gptq(w, h, spec)
    ref = gptq_reference_f64(w, h, spec)
    assert torch.equal(got.qweight.q, ref.q), int((got.qweight.q != ref.q).sum())
    if dtype == torch.bfloat16:
        assert torch.equal(got.qweight.scale, ref.scale)
    else:
        torch.testing.assert_close(got.qweight.scale, ref.scale, rtol=1e-6, atol=0)
    if not symmetric:
        assert torch.equal(got.qweight.zero_point, ref.zero_point)
    assert got.error_gptq == pytest.approx(hessian_error(w, dequantize(ref, 32), h), rel=1e-6)


# --- output format ------------------------------------------------------------------------------


def assert_rtn_format(qw: QWeight, w: torch.Tensor, spec: QuantSpec) -> None:
    rtn = quantize_rtn(w, spec)
    assert qw.q.dtype == rtn.q.dtype == torch.int8 and qw.q.shape == rtn.q.shape
    assert qw.scale.dtype == rtn.scale.dtype == w.dtype and qw.scale.shape == rtn.scale.shape
    assert int(qw.q.min()) >= spec.q_min and int(qw.q.max()) <= spec.q_max
    assert bool((qw.scale > 0).all())
    if spec.symmetric:
        assert qw.zero_point is None and rtn.zero_point is None
    else:
        assert qw.zero_point.dtype == torch.int8 and qw.zero_point.shape == rtn.zero_point.shape
        assert int(qw.zero_point.min()) >= spec.q_min and int(qw.zero_point.max()) <= spec.q_max


@pytest.mark.parametrize("solver", [dict(clip=False, cd_sweeps=0), dict(clip=True, cd_sweeps=4)])
@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_output_format_packs_and_dequantizes(num_bits, symmetric, solver):
    w, h = problem(48, 128, seed=5)
    spec = gptq_spec(num_bits=num_bits, group_size=64, symmetric=symmetric, act_order=True,
                     cd_sweeps=solver["cd_sweeps"])
    r = quantize_gptq(w, h, spec, clip_search=solver["clip"])
    assert isinstance(r, GPTQResult)
    assert_rtn_format(r.qweight, w, spec)
    packed = pack_int32(r.qweight.q, num_bits)
    assert packed.dtype == torch.int32 and packed.shape == (48, 128 * num_bits // 32)
    assert torch.equal(unpack_int32(packed, 128, num_bits), r.qweight.q)
    w_q = dequantize(r.qweight, spec.group_size)
    assert w_q.dtype == w.dtype and w_q.shape == w.shape
    assert r.error_gptq == hessian_error(w, w_q, h)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_diagonal_hessian_reproduces_rtn_bit_for_bit(symmetric, act_order):
    """Without cross terms GPTQ has no error to propagate: integers, scales, zero points equal RTN's.
    (Plain GPTQ: coordinate descent would also fix compressed-tensors' double rounding, see below.)"""
    w, _ = problem(32, 128, seed=7)
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(0)) + 0.5)
    spec = gptq_spec(group_size=32, symmetric=symmetric, act_order=act_order, cd_sweeps=0)
    r, rtn = quantize_gptq(w, h, spec), quantize_rtn(w, spec)
    assert r.fallback is None
    assert torch.equal(r.qweight.q, rtn.q) and torch.equal(r.qweight.scale, rtn.scale)
    assert (r.qweight.zero_point is None) == symmetric
    if not symmetric:
        assert torch.equal(r.qweight.zero_point, rtn.zero_point)


def test_rejects_bad_inputs():
    w, h = problem(16, 64)
    spec = gptq_spec(group_size=32)
    with pytest.raises(ValueError, match="Hessian must be"):
        quantize_gptq(w, h[:32, :32], spec)
    with pytest.raises(ValueError, match="NaN"):
        quantize_gptq(w, h.clone().fill_(float("nan")), spec)
    with pytest.raises(ValueError, match="floating-point"):
        quantize_gptq(w.to(torch.int8), h, spec)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize_gptq(w[:, :48], h[:48, :48], spec)
    for bad in (float("nan"), float("inf")):  # were quantized: NaN to ordinary-looking integers, Inf to an inf scale
        wb = w.clone()
        wb[3, 7] = bad
        with pytest.raises(NonFiniteWeightError, match=r"NaN or Inf in rows \[3\]"):
            quantize_gptq(wb, h, spec)
        with pytest.raises(NonFiniteWeightError):
            quantize_gptq_batch(torch.stack([w, wb]), torch.stack([h, h]), spec)


# --- dampening and fallbacks ----------------------------------------------------------------------


def test_singular_hessian_gets_more_dampening():
    """Two identical input channels per pair: H is singular and Cholesky hits an exact zero pivot."""
    w, _ = problem(16, 64)
    h = torch.kron(torch.eye(32), torch.full((2, 2), 4.0))  # (64, 64), rank 32, exact in float32
    assert not bool(torch.linalg.cholesky_ex(h).info == 0)
    r = quantize_gptq(w, h, gptq_spec(group_size=32, damp=0.0))
    assert r.fallback is None
    assert r.damp_increased and r.damp == pytest.approx(0.01)
    assert r.error_gptq < r.error_rtn


def test_indefinite_hessian_needs_ten_times_the_damping():
    """An H whose smallest eigenvalue is -3% of mean(diag) fails at 1% and succeeds at 10%."""
    w, h = problem(16, 64)
    h = h - 0.03 * torch.diag(h).mean() * torch.eye(64) - torch.linalg.eigvalsh(h)[0] * torch.eye(64)
    r = quantize_gptq(w, h, gptq_spec(group_size=32, damp=0.01))
    assert r.fallback is None and r.damp_increased and r.damp == pytest.approx(0.1)


def test_hopeless_hessian_falls_back_to_rtn(caplog):
    w, h = problem(16, 64)
    h = h - 3 * torch.diag(h).mean() * torch.eye(64)  # indefinite beyond MAX_DAMP
    spec = gptq_spec(group_size=32)
    with caplog.at_level(logging.WARNING, logger="glmq.quantize.gptq"):
        r = quantize_gptq(w, h, spec)
    assert r.fallback is Fallback.NOT_POSITIVE_DEFINITE and r.damp_increased and r.damp == 1.0
    # one warning, the fallback's: no damp was "used" (it said "used damp=1", then "falling back to RTN")
    assert [m for m in caplog.messages if "GPTQ" in m] == [
        "GPTQ: Hessian not positive definite even at damp=1; falling back to RTN"]
    rtn = quantize_rtn(w, spec)
    assert torch.equal(r.qweight.q, rtn.q) and torch.equal(r.qweight.scale, rtn.scale)
    assert r.error_gptq == r.error_rtn


@pytest.mark.parametrize("symmetric", [True, False])
def test_empty_hessian_falls_back_to_rtn_exactly(symmetric):
    w, _ = problem(16, 64)
    spec = gptq_spec(group_size=32, symmetric=symmetric, act_order=True)
    r = quantize_gptq(w, HessianAccumulator(64).finalize(), spec)
    rtn = quantize_rtn(w, spec)
    assert r.fallback is Fallback.EMPTY_HESSIAN and r.dead_columns == 64 and not r.damp_increased
    assert torch.equal(r.qweight.q, rtn.q) and torch.equal(r.qweight.scale, rtn.scale)
    if symmetric:
        assert r.qweight.zero_point is None
    else:
        assert torch.equal(r.qweight.zero_point, rtn.zero_point)
    assert r.error_gptq == r.error_rtn == 0.0


def test_dead_columns_are_zeroed_and_counted():
    w, h = problem(16, 64)
    dead = torch.tensor([3, 40, 41])
    h[dead, :] = 0
    h[:, dead] = 0
    r = quantize_gptq(w, h, gptq_spec(group_size=32, symmetric=False, act_order=True))
    assert r.fallback is None and r.dead_columns == 3
    assert torch.equal(dequantize(r.qweight, 32)[:, dead], torch.zeros(16, 3, dtype=w.dtype))
    assert r.error_gptq < r.error_rtn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    w, h = problem(64, 256)
    spec = gptq_spec(group_size=64, symmetric=False, act_order=True)
    cpu, gpu = quantize_gptq(w, h, spec), quantize_gptq(w.cuda(), h.cuda(), spec)
    assert gpu.qweight.q.is_cuda
    assert (gpu.qweight.q.cpu() != cpu.qweight.q).float().mean().item() <= 1 / 200
    assert gpu.error_gptq == pytest.approx(cpu.error_gptq, rel=1e-3)


# --- Hessian accumulator ----------------------------------------------------------------------------


def test_accumulator_batch_split_invariance():
    x = activations(600, 64, seed=11).reshape(6, 100, 64).to(torch.bfloat16)  # (batch, seq, K)
    whole = HessianAccumulator(64)
    whole.add(x)
    split = HessianAccumulator(64)
    for chunk in (x[:1], x[1:2, :37], x[1:2, 37:], x[2:5].reshape(-1, 64), x[5]):
        split.add(chunk)
    assert whole.num_tokens == split.num_tokens == 600
    ref = 2 / 600 * (x.double().reshape(-1, 64).T @ x.double().reshape(-1, 64))
    torch.testing.assert_close(whole.finalize(), split.finalize(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    torch.testing.assert_close(whole.finalize().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert whole.finalize().dtype == torch.float32 and whole.finalize().shape == (64, 64)


def test_accumulator_merge_equals_single_accumulation():
    x = activations(900, 32, seed=12)
    single = HessianAccumulator(32)
    single.add(x)
    parts = [HessianAccumulator(32) for _ in range(3)]
    for acc, chunk in zip(parts, (x[:100], x[100:700], x[700:])):  # unequal token counts
        acc.add(chunk)
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert merged is parts[0] and merged.num_tokens == 900
    scale = single.finalize().abs().max().item()
    torch.testing.assert_close(merged.finalize(), single.finalize(), rtol=1e-5, atol=1e-6 * scale)
    # Merging an empty accumulator changes nothing, bit for bit.
    before = merged.finalize()
    assert torch.equal(merged.merge(HessianAccumulator(32)).finalize(), before)
    with pytest.raises(ValueError, match="cannot merge"):
        merged.merge(HessianAccumulator(16))


def test_accumulator_state_dict_round_trip(tmp_path):
    acc = HessianAccumulator(16)
    acc.add(activations(50, 16, seed=13))
    path = tmp_path / "h.pt"
    torch.save(acc.state_dict(), path)
    back = HessianAccumulator.from_state_dict(torch.load(path))
    assert back.num_tokens == 50
    assert torch.equal(back.state_dict()["xxt_sum"], acc.state_dict()["xxt_sum"]) and torch.equal(back.finalize(), acc.finalize())
    back.add(activations(10, 16, seed=14))  # keeps accumulating after a reload
    assert back.num_tokens == 60 and acc.num_tokens == 50


def test_accumulator_panels_hold_the_whole_symmetric_sum(tmp_path):
    """K = 600: three row panels (256, 256, 88) of the block upper triangle. finalize and state_dict give
    the whole sum, exactly symmetric, equal to the float64 product; a reloaded or merged accumulator keeps
    accumulating correctly."""
    x = activations(700, 600, seed=16)
    acc = HessianAccumulator(600)
    for chunk in x.split(300):
        acc.add(chunk)
    ref = 2 / 700 * (x.double().T @ x.double())
    h = acc.finalize()
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    torch.testing.assert_close(acc.state_dict()["xxt_sum"].double(), ref * 350, rtol=1e-5, atol=1e-3 * ref.abs().max().item())
    torch.save(acc.state_dict(), tmp_path / "h.pt")
    back = HessianAccumulator.from_state_dict(torch.load(tmp_path / "h.pt"))
    more = activations(200, 600, seed=17)
    back.add(more)
    other = HessianAccumulator(600)
    other.add(more)
    merged = acc.merge(other)
    both = torch.cat([x, more]).double()
    ref2 = 2 / 900 * (both.T @ both)
    for a in (back, merged):
        assert a.num_tokens == 900
        torch.testing.assert_close(a.finalize().double(), ref2, rtol=1e-5, atol=1e-5 * ref2.abs().max().item())


def test_accumulator_empty_and_errors():
    acc = HessianAccumulator(8)
    assert acc.num_tokens == 0 and torch.equal(acc.finalize(), torch.zeros(8, 8))
    with pytest.raises(ValueError, match="features"):
        acc.add(torch.ones(3, 7))
    acc.add(torch.full((2, 8), float("inf")))
    with pytest.raises(ValueError, match="NaN/Inf"):
        acc.finalize()


def test_accumulated_hessian_drives_gptq():
    """End to end on CPU: activations -> accumulator -> GPTQ lowers the layer's output error."""
    k = 128
    x = activations(2048, k, seed=15)
    acc = HessianAccumulator(k)
    for chunk in x.split(300):
        acc.add(chunk)
    w = (torch.randn(32, k, generator=torch.Generator().manual_seed(16)) * 0.02).to(torch.bfloat16)
    spec = gptq_spec(group_size=64, act_order=True)
    r = quantize_gptq(w, acc.finalize(), spec)

    def out_err(qw: QWeight) -> float:  # ||X W^T - X Wq^T||^2 over the calibration tokens
        return ((x @ (w.float() - dequantize(qw, 64).float()).T) ** 2).sum().item()

    assert out_err(r.qweight) < 0.8 * out_err(quantize_rtn(w, spec))


# --- batches of experts -----------------------------------------------------------------------


@pytest.mark.parametrize("cd_sweeps", [0, 4])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("clip", [False, "block", "propagated"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_batch_equals_one_at_a_time(act_order, clip, symmetric, cd_sweeps):
    spec = gptq_spec(group_size=32, symmetric=symmetric, act_order=act_order, block_size=32, cd_sweeps=cd_sweeps,
                     clip_objective=clip or "propagated")
    clip = bool(clip)
    probs = [problem(16, 96, seed=s) for s in (3, 4, 5)]
    w = torch.stack([p[0] for p in probs] + [probs[0][0]])
    h = torch.stack([p[1] for p in probs] + [torch.zeros(96, 96)])  # the last one saw no token
    h[1, :, 7] = h[1, 7, :] = 0  # a dead input channel
    h[2] = h[2] - 1.5 * torch.linalg.eigvalsh(h[2])[-1] * torch.eye(96)  # negative definite: RTN fallback
    batch = quantize_gptq_batch(w, h, spec, clip_search=clip)
    for b, got in enumerate(batch):
        one = quantize_gptq(w[b], h[b], spec, clip_search=clip)
        assert torch.equal(got.qweight.q, one.qweight.q) and torch.equal(got.qweight.scale, one.qweight.scale)
        assert (got.qweight.zero_point is None) == symmetric
        if not symmetric:
            assert torch.equal(got.qweight.zero_point, one.qweight.zero_point)
        assert (got.fallback, got.damp, got.dead_columns) == (one.fallback, one.damp, one.dead_columns)
        assert got.error_gptq == pytest.approx(one.error_gptq, rel=1e-12)
    assert batch[3].fallback is Fallback.EMPTY_HESSIAN and batch[2].fallback is Fallback.NOT_POSITIVE_DEFINITE
    assert batch[1].dead_columns == 1 and batch[0].fallback is None and batch[0].error_gptq < batch[0].error_rtn


def test_batch_without_errors_gives_the_same_weights():
    """`errors=False` (the engine measures its own) changes no bit of the result, only leaves errors out."""
    probs = [problem(16, 96, seed=s) for s in (3, 4)]
    w, h = torch.stack([p[0] for p in probs]), torch.stack([p[1] for p in probs] + [torch.zeros(96, 96)])[[0, 2]]
    spec = gptq_spec(group_size=32)
    full, lean = (quantize_gptq_batch(w, h, spec, clip_search=True, errors=e) for e in (True, False))
    for a, b in zip(full, lean):
        assert torch.equal(a.qweight.q, b.qweight.q) and torch.equal(a.qweight.scale, b.qweight.scale)
        assert (a.fallback, a.damp, a.dead_columns) == (b.fallback, b.damp, b.dead_columns)
        assert b.error_gptq is None and b.error_rtn is None and a.error_gptq is not None
    assert lean[1].fallback is Fallback.EMPTY_HESSIAN


def test_batch_shape_errors():
    w, h = problem(16, 64)
    with pytest.raises(ValueError, match=r"\[B, N, K\]"):
        quantize_gptq_batch(w, h, gptq_spec(group_size=32))
    with pytest.raises(ValueError, match=r"\[B, N, K\]"):
        quantize_gptq_batch(w[None], h[None].expand(2, -1, -1), gptq_spec(group_size=32))


# --- coordinate descent after GPTQ ------------------------------------------------------------------


def damped_row_errors(w: torch.Tensor, qw: QWeight, h: torch.Tensor, spec: QuantSpec, damp: float) -> torch.Tensor:
    """Per row (w - wq) (H + damp * mean(diag H) * I) (w - wq)^T in float64: what the descent minimizes."""
    hd = h.double() + damp * torch.diag(h.double()).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    d = w.double() - dequantize(qw, spec.group_size).double()
    return ((d @ hd) * d).sum(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_cd_never_increases_the_objective(group_size, symmetric, act_order, dtype):
    """Every sweep leaves every row's damped objective where it was or lower (float64, exactly: a move is
    only taken when it gains more than CD_MIN_GAIN of its curvature); 4 sweeps lower the total clearly;
    the scales and zero points are GPTQ's, the integers stay on the grid."""
    w, h = problem(32, 256, seed=1, dtype=dtype)
    prev, first = None, None
    for sweeps in range(5):
        spec = gptq_spec(group_size=group_size, symmetric=symmetric, act_order=act_order, cd_sweeps=sweeps)
        r = quantize_gptq(w, h, spec, clip_search=True)
        assert_rtn_format(r.qweight, w, spec)
        e = damped_row_errors(w, r.qweight, h, spec, r.damp)
        if prev is None:
            first, plain = e, r.qweight
        else:
            assert bool((e <= prev).all()), float((e - prev).max())
            assert torch.equal(r.qweight.scale, plain.scale)
            if not symmetric:
                assert torch.equal(r.qweight.zero_point, plain.zero_point)
        prev = e
    assert float(prev.sum()) < (0.99 if act_order else 0.97) * float(first.sum()), (float(prev.sum()), float(first.sum()))
    assert r.error_gptq < r.error_rtn


def cd_reference_f64(w: torch.Tensor, h: torch.Tensor, qw: QWeight, spec: QuantSpec, sweeps: int) -> torch.Tensor:
    """Cyclic coordinate descent on the integers in float64, one column at a time, g = D Hd recomputed
    for every column: the rule `_coordinate_descent` states, without its lazy block products. Columns in
    GPTQ's processing order; a move is the rounded, clamped real minimizer, kept if it gains more than
    CD_MIN_GAIN of its curvature term, evaluated with the dtype-rounded dequantized values."""
    k, gs = w.shape[1], spec.group_size
    W, H = w.double().clone(), h.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H = (H + H.T) / 2 + spec.damp * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    order = torch.argsort(torch.diag(H), descending=True, stable=True) if spec.act_order else torch.arange(k)
    q = qw.q.clone()
    s = qw.scale.float().repeat_interleave(gs, 1)
    z = torch.zeros_like(s) if qw.zero_point is None else qw.zero_point.float().repeat_interleave(gs, 1)
    D = W - dequantize(qw, gs).double()
    for _ in range(sweeps):
        for j in order.tolist():
            g = D @ H[:, j]
            q_old = q[:, j].float()
            q_new = torch.round(q_old + (g / (s[:, j].double() * H[j, j])).float()).clamp(spec.q_min, spec.q_max)
            delta = (((q_new - z[:, j]) * s[:, j]).to(w.dtype).double()
                     - ((q_old - z[:, j]) * s[:, j]).to(w.dtype).double())
            take = 2 * delta * g - delta**2 * H[j, j] > CD_MIN_GAIN * delta**2 * H[j, j]
            q[:, j] = torch.where(take, q_new, q_old).to(torch.int8)
            D[:, j] -= torch.where(take, delta, torch.zeros_like(delta))
    return q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cd_matches_float64_reference(symmetric, act_order, block_size, dtype):
    """The refined integers EQUAL the float64 transcription's, from the same GPTQ start (checked on seeds
    3-5 for all 24 cases at damp 0.01 and 0.1: 0 integers differ, while 3 sweeps move 2-27 % of them)."""
    w, h = problem(16, 64, seed=4, dtype=dtype)
    spec = gptq_spec(group_size=32, symmetric=symmetric, act_order=act_order, block_size=block_size, cd_sweeps=3)
    start = quantize_gptq(w, h, gptq_spec(group_size=32, symmetric=symmetric, act_order=act_order,
                                          block_size=block_size, cd_sweeps=0))
    got = quantize_gptq(w, h, spec)
    ref = cd_reference_f64(w, h, start.qweight, spec, 3)
    assert int((got.qweight.q != start.qweight.q).sum()) > 0  # the descent did move something
    assert torch.equal(got.qweight.q, ref), int((got.qweight.q != ref).sum())


@pytest.mark.parametrize("symmetric", [True, False])
def test_cd_converges_to_a_coordinatewise_optimum(symmetric):
    """After enough sweeps, no single integer of any row can move to another grid value and lower the
    damped objective by more than CD_MIN_GAIN of that move's curvature (checked exhaustively, float64)."""
    w, h = problem(8, 64, seed=6)
    spec = gptq_spec(group_size=32, symmetric=symmetric, cd_sweeps=50)
    r = quantize_gptq(w, h, spec)
    hd = h.double() + r.damp * torch.diag(h.double()).mean() * torch.eye(64, dtype=torch.float64)
    base = damped_row_errors(w, r.qweight, h, spec, r.damp)
    s = r.qweight.scale.float().repeat_interleave(32, 1)
    z = torch.zeros_like(s) if symmetric else r.qweight.zero_point.float().repeat_interleave(32, 1)
    d = w.double() - dequantize(r.qweight, 32).double()
    g = d @ hd
    for v in range(spec.q_min, spec.q_max + 1):  # every column of every row set to v, one at a time
        delta = ((v - z) * s).to(w.dtype).double() - dequantize(r.qweight, 32).double()  # (N, K)
        gain = 2 * delta * g - delta**2 * torch.diag(hd)
        assert bool((gain <= CD_MIN_GAIN * delta**2 * torch.diag(hd) + 1e-9 * base[:, None]).all()), v


def test_cd_improves_on_rtn_with_a_diagonal_hessian():
    """Without cross terms GPTQ is RTN; the descent then only fixes compressed-tensors' double rounding
    (w / s is rounded to bf16 before the integer rounding), which can only lower the error."""
    w, _ = problem(32, 128, seed=7)
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(0)) + 0.5)
    spec = gptq_spec(group_size=32, cd_sweeps=2)
    r, plain = quantize_gptq(w, h, spec), quantize_gptq(w, h, gptq_spec(group_size=32, cd_sweeps=0))
    assert torch.equal(r.qweight.scale, plain.qweight.scale)
    e, e0 = (damped_row_errors(w, x.qweight, h, spec, x.damp) for x in (r, plain))
    assert bool((e <= e0).all())
    moved = r.qweight.q != plain.qweight.q
    assert int(moved.sum()) <= 0.01 * moved.numel()  # only the double-rounded boundary cases move


# --- clip search: propagated objective ------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False])
def test_propagated_clip_is_the_best_factor_per_row_on_one_group(monkeypatch, symmetric):
    """With one group (K = group size, no act_order) the group's GPTQ loss is the whole damped objective
    (tr(D Hd D^T) = ||E||^2), so the propagated search must give every row the factor of CLIP_GRID whose
    plain GPTQ run (that factor alone) has the lowest damped error: compared with each factor run alone."""
    w, h = problem(64, 32, seed=8)
    spec = gptq_spec(group_size=32, symmetric=symmetric, cd_sweeps=0, clip_objective="propagated")
    grid = gptq.CLIP_GRID
    per_factor = []
    for p in grid:
        monkeypatch.setattr(gptq, "CLIP_GRID", (p,))
        r = quantize_gptq(w, h, spec, clip_search=True)
        per_factor.append(damped_row_errors(w, r.qweight, h, spec, r.damp))
    monkeypatch.setattr(gptq, "CLIP_GRID", grid)
    r = quantize_gptq(w, h, spec, clip_search=True)
    best = torch.stack(per_factor).min(0).values
    got = damped_row_errors(w, r.qweight, h, spec, r.damp)
    torch.testing.assert_close(got, best, rtol=1e-5, atol=0)
    assert (torch.stack(per_factor).argmin(0) > 0).any()  # some row does clip


@pytest.mark.parametrize("damp", [0.01, 0.1])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_propagated_clip_beats_plain_and_block(group_size, symmetric, damp):
    """Seeds 0-5, 32 x 256 problems. Against plain GPTQ (no clip search) the propagated search lowers the
    Hessian error as reported (undamped H) on every seed, by a quarter at least (measured 0.51-0.69 at damp
    0.01). Against the diagonal-block search the comparison is on the objective GPTQ minimizes, the damped
    one: lower on every seed without act_order and descent (measured 0.986-0.999), and lower on average with
    act_order or 2 sweeps of descent after it (per seed up to 0.6 % higher). On the undamped H it is lower
    on average at damp 0.01 (0.990-0.995) and level at damp 0.1 (0.998-1.005): not asserted."""
    ratio = {}
    for seed in range(6):
        w, h = problem(32, 256, seed=seed)
        for act_order, cd in ((False, 0), (True, 0), (False, 2)):
            kw = dict(group_size=group_size, symmetric=symmetric, act_order=act_order, cd_sweeps=cd, damp=damp)
            plain = quantize_gptq(w, h, gptq_spec(**kw)).error_gptq
            runs = {}
            for objective in ("block", "propagated"):
                spec = gptq_spec(clip_objective=objective, **kw)
                r = quantize_gptq(w, h, spec, clip_search=True)
                runs[objective] = r.error_gptq, float(damped_row_errors(w, r.qweight, h, spec, r.damp).sum())
            assert runs["propagated"][0] < 0.75 * plain, (seed, act_order, cd, runs, plain)
            ratio.setdefault((act_order, cd), []).append(runs["propagated"][1] / runs["block"][1])
    assert max(ratio[False, 0]) < 1.0, ratio[False, 0]
    for key, r in ratio.items():
        assert sum(r) / len(r) < 1.0, (key, r)
