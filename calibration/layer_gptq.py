"""GPTQ of one decoder layer's targets: Hessian passes, the Hessian each target gets, diagnostics.

Called by engine.py for layer i with a builder of the layer from the source (`build`), its per-expert
source weights (`state`) and the layer's input (`src`, `carry`); `run` is engine._Run (settings,
spec, device, progress bar, and `forward`, one pass over the calibration samples).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmq.calibration import cache as cc
from glmq.calibration.collect import ALL_TOKENS, HessianCollector, Target
from glmq.calibration.hessian import symmetric_panels
from glmq.calibration.layers import share_experts
from glmq.calibration.tune import rounding_offsets
from glmq.quantize import stream
from glmq.quantize.gptq import hessian_error, quantize_gptq_batch
from glmq.quantize.rtn import QWeight, dequantize, quantize_rtn

if TYPE_CHECKING:
    from glmq.calibration.engine import _Run


def _expert_chunks(run: _Run, targets: list[Target]) -> list[set[int]]:
    experts = sorted({t.expert for t in targets if t.expert is not None})
    if not experts:
        return [set()]
    k = run.s.experts_per_pass or len(experts)
    return [set(experts[j:j + k]) for j in range(0, len(experts), k)]


# `sequential_stages`: the order in which a decoder layer's forward reaches its Linears' inputs (local names)
_STAGES = (
    re.compile(r"self_attn\.(q_b_proj|kv_b_proj)$"),  # MLA: inputs are the normed q_a / kv_a outputs
    re.compile(r"self_attn\.o_proj$"),
    re.compile(r"mlp\.(.*\.)?(gate|up)_proj$"),  # dense MLP, shared experts, routed experts
    re.compile(r"mlp\.(.*\.)?down_proj$"),
)


def sequential_stages(targets: list[Target]) -> list[list[Target]]:
    """`targets` in the stages of a true-sequential pass (CalibrationSettings.sequential), non-empty ones
    only, each in its given order: the attention's input projections (and anything not named below)
    first, then MLA's q_b/kv_b, the attention output, the MLPs' gate/up, their down projections. A stage's
    inputs depend only on the stages before it."""
    stages: list[list[Target]] = [[] for _ in range(len(_STAGES) + 1)]
    for t in targets:
        k = next((j + 1 for j, rx in enumerate(_STAGES) if rx.search(t.local)), 0)
        stages[k].append(t)
    return [st for st in stages if st]


def quantize_layer(run: _Run, i: int, build, state: dict, targets: list[Target], src, carry):
    """Collect Hessians (one pass per chunk of experts) and GPTQ every target of layer i.

    The layer (`build(experts_as_stored)`, the decoder layer in the compute dtype) is built once and
    dropped after the last chunk's passes: the solves, which hold the largest transients, do not hold it
    too. When the passes collect routed experts (collect.py's tap runs their forward), its fused experts
    stay in the source's dtype and are the state's only copy (`share_experts`): the tap casts one expert
    at a time to the compute dtype, the same values (a bf16 -> float32 cast is exact), so the same Hessians.

    Pass 0 also collects the plain Linear targets, counts the tokens routed to every expert and the
    all-token MoE-input Hessian. The all-token down-input Hessians are collected in the same pass for
    every expert of the chunk when `expert_prior` is on; otherwise only for under-covered experts,
    which are known after pass 0 (one extra pass for chunk 0).
    """
    if not targets:  # a rank that owns nothing in this layer
        return {}, {"layer": i, "targets": {}}
    all_tok = run.s.under_covered == "all_tokens"
    prior = run.s.expert_prior > 0
    qweights = cc.PackedQWeights({}, run.spec)  # module -> QWeight, packed as each batch is solved
    meta: dict = {"layer": i, "targets": {}}
    tps: list[float] = []
    under: set[int] = set()
    all_h = (None, 0)
    solve_s = 0.0
    phases = _PhaseTimer(run.device)
    chunks = _expert_chunks(run, targets)
    down_experts = {t.expert for t in targets if t.site.endswith(".down")}  # (a sequential stage may have none)
    tapped = bool(chunks[0])
    layer = build(tapped)
    if tapped:
        share_experts(layer, state)
    stream.release_free_memory()  # reading, dequantizing and fusing the weights left ~0.3 GB of free heap pages
    for p, chunk in enumerate(chunks):
        todo = [t for t in targets if (t.expert is None and p == 0) or (t.expert is not None and t.expert in chunk)]
        sites = {t.site for t in todo} | ({ALL_TOKENS} if p == 0 and chunk else set())
        down_all = (chunk if prior else (under & chunk if all_tok else set())) & down_experts
        col = _collect(run, layer, sites, chunk, down_all, src, carry, tps)
        if p == 0 and chunk:
            counts = col.tokens.tolist()
            under = {e for e, n in enumerate(counts) if n < run.s.min_expert_tokens}
            meta["tokens_per_expert"], meta["under_covered"] = counts, sorted(under)
            meta["all_token_hessian_tokens"] = None  # None: no down_all Hessian taken
            all_h = col.hessian(ALL_TOKENS)
            if all_tok and under & chunk & down_experts and not prior:  # this chunk's all-token down Hessians: one more pass
                extra = _collect(run, layer, set(), set(), under & chunk & down_experts, src, carry, tps)
                col.acc.update(extra.acc)
                col.all_token_tokens = extra.all_token_tokens
        # whichever pass took the down_all Hessians (without the prior: pass 0's extra one, or a later chunk's own
        # for its under-covered experts), they took the same first tokens
        if col.all_token_tokens:
            meta["all_token_hessian_tokens"] = col.all_token_tokens
        if p == len(chunks) - 1:
            del layer
            stream.release_free_memory()  # the passes' activations, before the solves
        t_solve = time.perf_counter()
        # problems are built (weights on the device, blended Hessians) one batch at a time, and each
        # solved expert's Hessians are dropped: the layer's Hessians are the largest thing held
        for chunk in gptq_batches(todo, state, run.gptq_batch):
            with phases.timed("problems"):
                batch = [_Problem.make(run, g, state, col, under, all_h) for g in chunk]
            with phases.timed("solves"):
                _solve(batch, run)
            with phases.timed("diagnostics"):
                for p in batch:
                    for t, qw, d in p.solve(run):
                        qweights.add(t.module, qw)
                        if p.offsets is not None:  # for the layer-output tuning (tune.py)
                            run.offsets[t.module] = p.offsets.pop(0)
                        meta["targets"][t.module] = d
                        col.acc.pop(t.site, None)
                        col.acc.pop(t.site + "_all", None)
            run.bar.update(sum(len(p.group) for p in batch))
            run.bar.set_postfix_str(_postfix(qweights, targets, tps))
            del batch
            stream.release_free_memory()  # the batch's transients and solved Hessians
        del col
        solve_s += time.perf_counter() - t_solve
    meta["calibration_tokens_per_s"] = round(statistics.fmean(tps), 1)
    meta["gptq_seconds"] = round(solve_s, 3)
    meta["gptq_phase_seconds"] = phases.rounded()
    return qweights, meta


class _PhaseTimer:
    """Seconds per phase of the solve loop ("problems": weights and blended Hessians; "solves": GPTQ; "diagnostics":
    the per-tensor errors and results), for the layer's report. On a GPU each phase ends with a synchronize, so
    its queued kernels are counted in it (a few per batch: nothing next to a batch's solve)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


def _collect(run: _Run, layer, sites: set[str], experts: set[int], all_token_experts: set[int], src, carry,
             tps: list[float]) -> HessianCollector:
    """One calibration pass of layer i over every sample, collecting `sites` (the layer's output is not
    kept, so the routed experts' down projections are skipped)."""
    col = HessianCollector(layer, sites, experts=experts, all_token_experts=all_token_experts, device=run.device,
                           all_token_limit=run.s.all_token_limit, routed_output=False)
    with col:
        tps.append(run.forward(layer, src, carry, None))
    return col


def _postfix(qweights: dict, targets: list[Target], tps: list[float]) -> str:
    experts = {t.expert for t in targets if t.expert is not None}
    pending = {t.expert for t in targets if t.expert is not None and t.module not in qweights}
    rate = f"{tps[-1]:.0f} tok/s" if tps else ""
    return (f"experts {len(experts - pending)}/{len(experts)}, " if experts else "") + rate


def _problems(todo: list[Target]) -> list[list[Target]]:
    """Targets grouped into GPTQ problems: one per plain Linear, one per expert and Hessian site.

    An expert's gate_proj and up_proj see the same inputs, so they are one problem with their rows
    stacked (GPTQ treats rows independently given H: the same result as two calls, one column loop).
    """
    groups: dict[str, list[Target]] = {}
    for t in todo:
        groups.setdefault(t.site if t.expert is not None else t.module, []).append(t)
    return [sorted(g, key=lambda t: t.local) for g in groups.values()]


def _hessian_of(run: _Run, t: Target, k: int, col: HessianCollector, under: set[int], all_h: tuple):
    """(H GPTQ uses or None for RTN, its source, H of the tokens the Linear saw or None, their count)."""
    h_seen, n = col.hessian(t.site)
    if t.expert is None:
        return h_seen, "input", h_seen, n
    h_all = all_h[0] if t.site.endswith("gate_up") else col.hessian(t.site + "_all")[0]
    if t.expert in under:
        return (None, "rtn", h_seen, n) if run.s.under_covered == "rtn" else (h_all, "all_tokens", h_seen, n)
    if run.s.expert_prior > 0 and h_all is not None:
        lam = run.s.expert_prior * k
        return (h_all if h_seen is None else (n * h_seen + lam * h_all) / (n + lam)), "routed+prior", h_seen, n
    return h_seen, "routed", h_seen, n


@dataclass
class _Problem:
    """One GPTQ problem: the targets sharing a Hessian (rows stacked), the Hessian and where it came from.

    `result` is filled by `_solve` (a GPTQResult), or stays None for round-to-nearest.
    """

    group: list[Target]
    rows: list[int]
    w: torch.Tensor  # (N, K) on the run's device, the group's weights stacked
    h: torch.Tensor | None  # (K, K) the Hessian GPTQ uses; None: RTN
    source: str
    h_seen: torch.Tensor | None
    tokens: int
    result: object = None
    offsets: list | None = None  # per target, `tune.rounding_offsets` (float16, CPU) when the spec tunes

    @classmethod
    def make(cls, run: _Run, group: list[Target], state: dict, col: HessianCollector, under: set[int],
             all_h: tuple) -> _Problem:
        # F16/F32 weights rounded to bf16, as RTN does (ops.quantize_rows) and FP8 ones decode to: bf16 scales
        ws = [_bf16(state[t.local + ".weight"]) for t in group]
        h, source, h_seen, n = _hessian_of(run, group[0], ws[0].shape[1], col, under, all_h)
        if source != "rtn" and h is None:  # no token at all: GPTQ falls back to RTN and says so
            h = torch.zeros(ws[0].shape[1], ws[0].shape[1])
        return cls(group, [w.shape[0] for w in ws], torch.cat(ws).to(run.device), h, source, h_seen, n)

    def solve(self, run: _Run) -> list[tuple[Target, QWeight, dict]]:
        """Per target (QWeight on CPU, diagnostics). Errors are measured on the tokens the Linear really
        saw (its routed Hessian), whatever Hessian GPTQ used; on that one for an expert that saw none."""
        if self.h is None:
            out = [(t, *_rtn_target(run, w, self.h_seen, self.tokens)) for t, w in zip(self.group, self._split(self.w))]
            if run.spec.tune_iters:
                self.offsets = [rounding_offsets(w, qw, None, 0.0, run.spec.group_size).half().cpu()
                                for w, (_, qw, _) in zip(self._split(self.w), out)]
            return out
        r, gs = self.result, run.spec.group_size
        if run.spec.tune_iters:
            off = rounding_offsets(self.w, r.qweight, self.h.to(self.w.device), r.damp, gs).half().cpu()
            self.offsets = self._split(off)
        measure = (self.h_seen if self.h_seen is not None and self.tokens > 0 else self.h).to(run.device)
        w = self.w.float()
        d = torch.cat([w - dequantize(r.qweight, gs).float(), w - dequantize(quantize_rtn(self.w, run.spec), gs).float(), w])
        errs = dict(zip(("err_gptq", "err_rtn", "signal"), quadratic_rows(d, measure).split(w.shape[0])))
        zp = r.qweight.zero_point
        parts = zip(self._split(r.qweight.q), self._split(r.qweight.scale),
                    self._split(zp) if zp is not None else [None] * len(self.group))
        out = []
        for j, (t, (q, sc, z)) in enumerate(zip(self.group, parts)):
            r0 = sum(self.rows[:j])
            d = {"tokens": self.tokens, "hessian": self.source,
                 **{k: float(v[r0:r0 + self.rows[j]].sum()) for k, v in errs.items()},
                 "fallback": r.fallback.value if r.fallback else None, "damp": r.damp,
                 "damp_increased": r.damp_increased, "dead_columns": r.dead_columns}
            out.append((t, QWeight(q.cpu(), sc.cpu(), None if z is None else z.cpu()), d))
        return out

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(x, self.rows))


def _bf16(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16) if w.dtype in (torch.float16, torch.float32) else w


def gptq_batches(targets: list[Target], state: dict, size: int) -> list[list[list[Target]]]:
    """`targets` as GPTQ problems (`_problems`), in batches of at most `size` problems whose stacked
    weights have one shape: in order of first appearance per shape, only each shape's last batch short.
    engine.share hands out these batches whole, which depends on exactly this rule."""
    by_shape: dict[tuple, list[list[Target]]] = {}
    for g in _problems(targets):
        ws = [state[t.local + ".weight"] for t in g]
        by_shape.setdefault((sum(w.shape[0] for w in ws), ws[0].shape[1]), []).append(g)
    return [gs[b0:b0 + size] for gs in by_shape.values() for b0 in range(0, len(gs), size)]


def _solve(batch: list[_Problem], run: _Run) -> None:
    """GPTQ of the batch's problems in one `quantize_gptq_batch` call (RTN problems are left alone).

    `errors=False`: `_Problem.solve` measures the errors itself, against the Hessian of the tokens the
    Linear saw, so the batch function's own (against the Hessian GPTQ used) would be computed for nothing.
    """
    todo = [p for p in batch if p.h is not None]
    if todo:
        rs = quantize_gptq_batch(torch.stack([p.w for p in todo]), torch.stack([p.h.to(p.w.device) for p in todo]),
                                 run.spec, clip_search=run.s.clip_search, errors=False)
        for p, r in zip(todo, rs):
            p.result = r


def quadratic_rows(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per row r of d `[M, K]`, d_r H d_r^T `[M]` float64, for a symmetric H `[K, K]`.

    A diagnostic, so the products run in float32 (about 1e-6 relative) and only the sums in float64
    (three float64 [N, K] x [K, K] products per GLM-5 expert would cost more than its GPTQ on a CPU).
    By symmetry d H d^T = sum over column panels a of d_a (H_aa d_a^T + 2 H_a,>a d_>a^T): the diagonal
    blocks and the panels below them, 56-63 % of a full product's flops (the panels of HessianAccumulator).
    """
    d, h = d.float(), h.float()
    k = d.shape[1]
    out = torch.zeros(d.shape[0], dtype=torch.float64, device=d.device)
    for i0, i1 in symmetric_panels(k):
        z = d[:, i0:i1] @ h[i0:i1, i0:i1]
        if i1 < k:
            z.addmm_(d[:, i1:], h[i1:, i0:i1], alpha=2)
        out += (z * d[:, i0:i1]).double().sum(1)
    return out


def _rtn_target(run: _Run, w: torch.Tensor, h, n: int) -> tuple[QWeight, dict]:
    """An under-covered expert under `under_covered="rtn"`: round-to-nearest, recorded as a fallback."""
    qw = quantize_rtn(w, run.spec)
    d = {"tokens": n, "hessian": "rtn", "fallback": "under_covered_rtn", "damp": None, "damp_increased": False,
         "dead_columns": 0, "err_gptq": None, "err_rtn": None, "signal": None}
    if h is not None:
        e = hessian_error(w, dequantize(qw, run.spec.group_size), h)
        d.update(err_gptq=e, err_rtn=e, signal=hessian_error(w, torch.zeros_like(w), h))
    return qw, d
