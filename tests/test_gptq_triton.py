"""The Triton kernels of GPTQ (glmq.quantize.gptq_triton) against the CPU kernels (glmq.quantize.gptq_cpu).

Both transcribe the same algorithm (the torch path's, tests/test_gptq_cpu.py); here the Triton kernels run
on CPU tensors in Triton's interpreter (as the W4A16 kernel tests do, tests/test_kernels.py: the flag must
be set before anything imports triton, and a subprocess reruns this file when it could not be), and with a
GPU compiled on CUDA as well. The interpreter does no fused multiply-add, so at group 128, where the
group's errors reach later columns in the same 128-column steps as in the CPU kernel, the arithmetic is the
same and the results are asserted equal; at groups 32/64 the CPU kernel adds later groups' updates inside its
128-column block one by one and the Triton loop by one GEMM per group, so float32 sums differ in the last
bits and a few integers may flip through the error feedback (bound asserted, and the objective compared).
"""

from __future__ import annotations


import pytest
import torch
from conftest import run_in_fresh_interpreter, skip_if_triton_too_early, triton_interpreter_guard  # tests/ is on sys.path

TRITON_TOO_EARLY = triton_interpreter_guard()  # before anything here imports triton
pytest.importorskip("triton")

from glmq.quantize import gptq, gptq_cpu, gptq_triton  # noqa: E402
from glmq.quantize.gptq import quantize_gptq_batch  # noqa: E402
from glmq.quantize.spec import QuantSpec  # noqa: E402

from test_gptq_cpu import problems  # noqa: E402  (tests/ is on sys.path: pytest prepends it)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


_kernels_runnable = skip_if_triton_too_early(TRITON_TOO_EARLY, "test_suite_in_fresh_interpreter")


@pytest.mark.skipif(not TRITON_TOO_EARLY, reason="the kernel tests run in this process")
def test_suite_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


def objective(w, q, scale, h, gs):
    """tr((W - Wq) H (W - Wq)^T) in float64."""
    wq = (q.double().unflatten(-1, (-1, gs)) * scale.double().unsqueeze(-1)).flatten(-2)
    d = w.double() - wq
    return float(torch.einsum("bnk,bkl,bnl->", d, h.double(), d))


def solve_cpu(w, h, spec, clip):
    return quantize_gptq_batch(w.cpu(), h.cpu(), spec, clip_search=clip, errors=False)


def solve_triton(monkeypatch, w, h, spec, clip):
    """quantize_gptq_batch with the Triton kernels on DEV (on a CPU: through the interpreter)."""
    with monkeypatch.context() as m:
        m.setattr(gptq, "_kernels", lambda *a: gptq_triton)
        return quantize_gptq_batch(w.to(DEV), h.to(DEV), spec, clip_search=clip, errors=False)


# The interpreter runs a kernel op by op in Python (~7 ms per column step of a row tile), so on a CPU the
# cases are few and small, with a 3-point clip grid; on a GPU every combination runs at a larger size.
GPU_CASES = [(dt, gs, clip, cd, 2, 40, 256, full) for dt in (torch.bfloat16, torch.float32) for gs in (32, 64, 128)
             for clip, cd in ((True, 2), (False, 0), (True, 0), (False, 3)) for full in (False, True)]
CPU_CASES = [  # dtype, group, clip search, descent sweeps, problems, rows, K, full range
    (torch.bfloat16, 128, True, 1, 1, 12, 128, False),  # 12 rows: a full tile of 8 and a partial one
    (torch.bfloat16, 32, True, 2, 2, 12, 64, False),  # two problems: the batch strides
    (torch.float32, 64, False, 0, 1, 12, 128, False),
    (torch.bfloat16, 64, False, 3, 1, 12, 128, False),
    (torch.bfloat16, 128, True, 1, 1, 12, 128, True),  # signed scales
]


@pytest.mark.parametrize("dtype, group_size, clip, cd_sweeps, b, n, k, full",
                         GPU_CASES if DEV.type == "cuda" else CPU_CASES)
def test_triton_kernels_make_the_cpu_kernels_decisions(monkeypatch, dtype, group_size, clip, cd_sweeps, b, n, k, full):
    if DEV.type == "cpu":
        monkeypatch.setattr(gptq, "CLIP_GRID", (1.0, 0.9, 0.8))  # read by both kernels at call time
    spec = QuantSpec(group_size=group_size, cd_sweeps=cd_sweeps, full_range=full)
    w, h = problems(b, n, k, dtype, seed=group_size)
    assert gptq_cpu.applies(w, spec, "propagated" if clip else None)
    ref = solve_cpu(w, h, spec, clip)
    got = solve_triton(monkeypatch, w, h, spec, clip)
    exact = group_size == 128 and DEV.type == "cpu"
    for i, (a, r) in enumerate(zip(got, ref)):
        q, s = a.qweight.q.cpu(), a.qweight.scale.cpu()
        assert q.dtype == torch.int8 and s.dtype == dtype and a.qweight.zero_point is None
        assert q.shape == r.qweight.q.shape and s.shape == r.qweight.scale.shape
        assert int(q.min()) >= spec.q_min and int(q.max()) <= spec.q_max
        if full:
            assert (s < 0).any() and (s > 0).any()
        if exact:
            assert torch.equal(q, r.qweight.q), int((q != r.qweight.q).sum())
            assert torch.equal(s, r.qweight.scale)
        else:
            differ = int((q != r.qweight.q).sum())
            assert differ <= q.numel() // 100, differ
            o_t = objective(w[i:i + 1], q[None], s[None], h[i:i + 1], group_size)
            o_c = objective(w[i:i + 1], r.qweight.q[None], r.qweight.scale[None], h[i:i + 1], group_size)
            assert o_t <= o_c * 1.01, (o_t, o_c)


def test_triton_descent_never_raises_the_objective(monkeypatch):
    """The descent's accepted moves each lower their row's objective: with sweeps it is at most without."""
    monkeypatch.setattr(gptq, "CLIP_GRID", (1.0,))
    w, h = problems(2, 12, 64, torch.bfloat16, seed=5)
    plain = solve_triton(monkeypatch, w, h, QuantSpec(group_size=32, cd_sweeps=0, scale_refit=0), True)
    swept = solve_triton(monkeypatch, w, h, QuantSpec(group_size=32, cd_sweeps=2, scale_refit=0), True)
    hd = gptq._damped(h, [QuantSpec().damp] * 2)
    for b in range(2):
        o0 = objective(w[b:b + 1], plain[b].qweight.q.cpu()[None], plain[b].qweight.scale.cpu()[None], hd[b:b + 1], 32)
        o2 = objective(w[b:b + 1], swept[b].qweight.q.cpu()[None], swept[b].qweight.scale.cpu()[None], hd[b:b + 1], 32)
        assert o2 < o0, (o2, o0)


def test_applies_only_where_covered():
    w = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    assert not gptq_triton.applies(w, QuantSpec(), "propagated")  # CPU tensors: the numba kernels' case
    if torch.cuda.is_available():
        wc = w.cuda()
        assert gptq_triton.applies(wc, QuantSpec(), "propagated")
        assert not gptq_triton.applies(wc, QuantSpec(symmetric=False), "propagated")
        assert not gptq_triton.applies(wc, QuantSpec(act_order=True), "propagated")
        assert not gptq_triton.applies(wc, QuantSpec(), "block")
        assert not gptq_triton.applies(wc.half(), QuantSpec(), "propagated")
