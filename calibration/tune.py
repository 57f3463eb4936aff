"""Layer-output tuning of GPTQ's rounding and scales (`QuantSpec.tune_iters`): AutoRound's method in GPTQ's frame.

GPTQ minimizes each Linear's own output error on that Linear's inputs; nothing in it sees how a layer's errors
combine through attention's softmax, the experts' gate and the residual sum (an error in v_proj's rows matters
through o_proj, which mixes them). AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed
Gradient Descent for the Quantization of LLMs") tunes, per decoder layer, a rounding offset V in [-0.5, 0.5]
per weight and the group scales by signed gradient descent on the layer's output error against the
unquantized layer: q = round(w / s + V), so that only weights near a rounding boundary flip cheaply.

Here the same runs in GPTQ's frame. After GPTQ (and its coordinate descent), the continuous value of each
integer given all the others, under the damped layer-local objective tr((W - Wq) Hd (W - Wq)^T), is
    x_k = q_k + ((W - Wq) Hd)_k / (Hd_kk s_k)        (`rounding_offsets`: x_k - q_k, clamped to +-0.499)
and q_k = round(x_k); GPTQ's local loss changes little when an integer whose x_k is near a half step flips.
Tuned:
    q = clamp(round(x + V), q_min, q_max),   s = s_gptq * (1 + A),   V = A = 0 at the start (GPTQ's result),
rounding straight-through, the loss ||layer_q(h) - layer(h)||^2 (mean over elements) over minibatches of the
calibration hidden states h (the quantized model's, the inputs GPTQ's Hessians came from), V and A moved by
lr * sign(grad) with lr decaying linearly to 0 (AutoRound's defaults: lr = 1 / iters), |V| <= 0.5 (an integer
moves at most one step, to the other side of x), |A| <= 0.5. The tuned integers and scales (scales rounded to
the weight dtype, as written) replace GPTQ's only where the loss over every calibration sample drops; both
losses are in the layer's report.

Hand-written, not auto-round's: auto-round (and llm-compressor's wrapper of it) tunes a model it holds whole
in memory, in BF16 (a copy of the FP8 checkpoint first), from round-to-nearest; the engine holds one decoder
layer, built with transformers' own class, and has GPTQ's result and Hessians to start from.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmq.calibration import cache as cc
from glmq.calibration.layers import _EXPERT
from glmq.quantize import stream
from glmq.quantize.rtn import QWeight, dequantize

if TYPE_CHECKING:
    from glmq.calibration.engine import _Run

V_BOUND, A_BOUND = 0.5, 0.5
OFFSET_BOUND = 0.499  # |x - q| < 0.5: round(x) is GPTQ's integer
# routed-expert weights of a layer above which `tune_experts` leaves them to GPTQ (and the report says so): the
# tuning holds ~40 bytes per tuned weight (x, q, V and its gradient, the dequantized and fused copies and what
# autograd keeps of them), so 2^28 weights are ~11 GB. The shared model's layers have 1.6 M expert weights, a
# GLM-5 layer 9.7 G (its attention and shared expert, 0.2 G, are tuned).
TUNE_EXPERT_WEIGHTS = 1 << 28


def rounding_offsets(w: torch.Tensor, qw: QWeight, h: torch.Tensor | None, damp: float, group_size: int) -> torch.Tensor:
    """x - q per weight `[N, K]` float32 in [-0.499, 0.499] (module docstring), for GPTQ's integers in `qw`.

    Args:
        w: `[N, K]` the weights GPTQ quantized; qw: its result (symmetric).
        h: `[K, K]` the Hessian GPTQ used, undamped (None: round-to-nearest, x = w / s).
        damp: the dampening fraction GPTQ used (`GPTQResult.damp`).
    """
    w = w.float()
    s = qw.scale.float().repeat_interleave(group_size, dim=1)
    d = w - dequantize(qw, group_size).float()
    if h is None:
        off = d / s
    else:
        h = h.float()
        # GPTQ sets a dead input's diag(H) (0: no token reached it) to 1 before taking the dampening's mean
        # (gptq.py, as the reference): with a few dead columns and a diag(H) far from 1, the raw mean is
        # another objective's, and offsets up to 0.37 off from GPTQ's coordinate optima were measured
        hdiag = torch.diagonal(h).masked_fill(torch.diagonal(h) == 0, 1)
        diag = hdiag + damp * hdiag.mean()
        g = d @ ((h + h.T) / 2) + d * (diag - torch.diagonal(h))  # d Hd, Hd = H (dead diag 1) + damp mean I
        off = g / (diag.clamp_min(torch.finfo(torch.float32).tiny) * s)
    return torch.nan_to_num(off, nan=0.0).clamp_(-OFFSET_BOUND, OFFSET_BOUND)


@dataclass
class _Tuned:
    """The tuned parameters (float32 on the run's device) of one parameter of the layer: a Linear's weight `[N, K]`,
    or all routed experts' fused `gate_up_proj` `[E, 2I, H]` / `down_proj` `[E, H, I]` at once (one set of
    element-wise ops per step instead of one per expert: the loop is launch-bound on a GPU).

    `parts` maps each target module to its place in the tensors: `()` for a Linear, `(e, slice of rows)` for an
    expert's projection.
    """

    local: str  # the parameter's name in the layer (functional_call)
    parts: list[tuple[str, tuple]]
    q0: torch.Tensor  # GPTQ's integers as float32
    x: torch.Tensor  # their continuous values, q0 + rounding_offsets
    s0: torch.Tensor  # GPTQ's scales as float32 (`[..., G]`)
    dtype: torch.dtype  # the scale dtype (written)
    v: torch.Tensor  # the tuned rounding offsets (added to x)
    a: torch.Tensor  # relative scale changes

    @classmethod
    def start(cls, local: str, parts: list[tuple[str, tuple]], qws: dict[str, QWeight], offsets: dict[str, torch.Tensor],
              shape: tuple[int, ...] | None, device: torch.device) -> _Tuned:
        """`shape`: the stacked shape (None: one Linear, `parts` = [(module, ())])."""
        def gather(get) -> torch.Tensor:
            if shape is None:
                return get(parts[0][0]).to(device, torch.float32)
            first = get(parts[0][0])
            out = torch.empty(*shape[:-1], first.shape[-1], dtype=torch.float32, device=device)
            for m, idx in parts:
                out[idx] = get(m).to(device, torch.float32)
            return out

        q0 = gather(lambda m: qws[m].q)
        x = q0 + gather(lambda m: offsets[m])
        s0 = gather(lambda m: qws[m].scale)
        return cls(local, parts, q0, x, s0, qws[parts[0][0]].scale.dtype, torch.zeros_like(q0, requires_grad=True),
                   torch.zeros_like(s0, requires_grad=True))

    def integers(self, lo: int, hi: int, soft: bool) -> torch.Tensor:
        z = self.x + self.v
        r = torch.round(z)
        return (z + (r - z).detach() if soft else r).clamp(lo, hi)  # straight-through rounding

    def weight(self, lo: int, hi: int, gs: int) -> torch.Tensor:
        """The dequantized weight as the tuning sees it (in the scale dtype, differentiable in v and a): exactly
        what `results` would write, so V = A = 0 is GPTQ's written result. The scale is rounded to its dtype and
        q * s computed there, as `rtn.dequantize` does (the casts pass the gradient straight through); in float32
        the unrounded q * s0 moved a fixture layer's start loss 4.8x off GPTQ's (a token's routing flipped)."""
        q = self.integers(lo, hi, soft=True)
        s = (self.s0 * (1 + self.a)).to(self.dtype)
        return (q.to(self.dtype).unflatten(-1, (-1, gs)) * s.unsqueeze(-1)).flatten(-2)

    def results(self, lo: int, hi: int) -> dict[str, QWeight]:
        q = self.integers(lo, hi, soft=False).to(torch.int8).cpu()
        sc = (self.s0 * (1 + self.a)).detach().to(self.dtype).cpu()
        return {m: QWeight(q[idx].clone(), sc[idx].clone(), None) for m, idx in self.parts}

    def dequantized(self, qws: dict[str, QWeight], gs: int) -> torch.Tensor:
        """The weight as the checkpoint holds `qws` (dequantized in the scale dtype), float32, stacked like x."""
        if not self.parts[0][1]:
            return _dequantized_on(qws[self.parts[0][0]], self.x.device, gs).float()
        out = torch.empty_like(self.x)
        for m, idx in self.parts:
            out[idx] = _dequantized_on(qws[m], out.device, gs)
        return out

    def numel(self) -> int:
        return self.q0.numel()


def _targets(layer: torch.nn.Module, names: list[str], prefix: str, qws: dict, offsets: dict,
             device: torch.device) -> list[_Tuned]:
    """One `_Tuned` per Linear target, and one per fused expert parameter for the routed experts among `names`
    (all of the layer's experts, every projection: `tune_layer` checks it)."""
    out, experts = [], {}
    for m in names:
        hit = _EXPERT.search(m + ".weight")
        if hit:
            experts.setdefault(hit.group(2), {})[int(hit.group(1))] = m
        else:
            out.append(_Tuned.start(m[len(prefix):] + ".weight", [(m, ())], qws, offsets, None, device))
    if experts:
        ex = layer.get_submodule("mlp.experts")
        n = ex.gate_up_proj.shape[1] // 2
        if sorted(experts) != ["down", "gate", "up"] or any(sorted(d) != list(range(ex.num_experts)) for d in experts.values()):
            raise RuntimeError(f"{prefix}: tuning needs every routed expert's three projections as targets, got "
                               f"{ {k: len(d) for k, d in experts.items()} } of {ex.num_experts}")
        gu = [(experts["gate"][e], (e, slice(0, n))) for e in range(ex.num_experts)] + \
             [(experts["up"][e], (e, slice(n, 2 * n))) for e in range(ex.num_experts)]
        out.append(_Tuned.start("mlp.experts.gate_up_proj", gu, qws, offsets, tuple(ex.gate_up_proj.shape), device))
        dn = [(experts["down"][e], (e, slice(None))) for e in range(ex.num_experts)]
        out.append(_Tuned.start("mlp.experts.down_proj", dn, qws, offsets, tuple(ex.down_proj.shape), device))
    return out


def _weights(tuned: list[_Tuned], lo: int, hi: int, gs: int) -> dict[str, torch.Tensor]:
    """Parameter name -> the tuned weight, for `torch.func.functional_call`."""
    return {t.local: t.weight(lo, hi, gs) for t in tuned}


class _Batches:
    """Calibration samples of a layer's input and reference output, read `batch_size` at a time onto the device."""

    def __init__(self, run: _Run, src: cc.Activations, carry: cc.Activations | None, ref: cc.Activations):
        self.run, self.src, self.carry, self.ref = run, src, carry, ref
        self.name = run.builder.spec.carry

    def get(self, idx: list[int]) -> tuple[torch.Tensor, dict, torch.Tensor]:
        dev = self.run.device
        x = torch.cat([self.src.read(j, j + 1) for j in idx]).to(dev)
        y = torch.cat([self.ref.read(j, j + 1) for j in idx]).to(dev)
        kw = self.run.builder.layer_kwargs(x)
        if self.name:
            kw[self.name] = None if self.carry is None else torch.cat([self.carry.read(j, j + 1) for j in idx]).to(dev)
        return x, kw, y


def _output(layer, weights: dict, x: torch.Tensor, kw: dict) -> torch.Tensor:
    """The layer's output on `x` with `weights` (differentiable, in the scale dtype) cast to the layer's compute
    dtype, the hidden states' (a weight of another dtype than the layer's is an error)."""
    weights = {k: v.to(x.dtype) for k, v in weights.items()}
    y = torch.func.functional_call(layer, weights, (x,), kw)
    return y[0] if isinstance(y, tuple) else y


def _loss_all(layer, weights: dict, data: _Batches, bs: int) -> float:
    """Mean squared output error over every calibration sample."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b0 in range(0, data.src.shape[0], bs):
            idx = list(range(b0, min(b0 + bs, data.src.shape[0])))
            x, kw, y = data.get(idx)
            d = _output(layer, weights, x, kw).float() - y.float()
            total += float(d.square().sum())
            count += d.numel()
    return total / max(count, 1)


def tune_layer(run: _Run, i: int, fp_state: dict, qweights: dict[str, QWeight], offsets: dict[str, torch.Tensor],
               src: cc.Activations, carry: cc.Activations | None) -> tuple[dict[str, QWeight], dict]:
    """Tune layer i's quantized targets on its output error; returns (the tuned targets' new QWeights, empty when
    the tuning is not kept or tunes nothing, and the report's "tune" entry).

    Args:
        fp_state: the layer's unquantized weights (layer-local names, per-expert layout): the reference layer.
        qweights: GPTQ's result for the layer's targets (module -> QWeight, symmetric).
        offsets: module -> `rounding_offsets` of its GPTQ result.
        src, carry: the layer's calibration input (the quantized model's hidden states).
    """
    t0 = time.perf_counter()
    spec, s = run.spec, run.s
    iters = spec.tune_iters
    lr0 = spec.tune_lr or 1.0 / iters
    lo, hi, gs = spec.q_min, spec.q_max, spec.group_size
    prefix = f"model.layers.{i}."
    expert_weights = sum(_numel(qweights, m) for m in qweights if _EXPERT.search(m + ".weight"))
    tune_ex = spec.tune_experts and expert_weights <= TUNE_EXPERT_WEIGHTS
    skipped = None if tune_ex or not expert_weights else (
        "tune_experts: false" if not spec.tune_experts else
        f"{expert_weights} routed-expert weights > {TUNE_EXPERT_WEIGHTS} (calibration/tune.py TUNE_EXPERT_WEIGHTS)")
    names = [m for m in qweights if tune_ex or not _EXPERT.search(m + ".weight")]
    if not names:  # ("source": the unquantized model's stream moves on at the next tuned layer)
        return {}, {"iters": 0, "tensors": 0, "reference": spec.tune_reference, "experts_not_tuned": skipped}
    ref = _reference(run, i, fp_state, src, carry)
    qws = {m: qweights[m] for m in qweights}  # unpacked once
    # dequantized on the run's device: on the host they were a float32 copy of the layer's targets, and the layer's
    # build stacked the experts into a second one (a GLM-5 layer's 9.7 G expert weights: ~78 GB of host memory)
    deq = {m[len(prefix):] + ".weight": _dequantized_on(qw, run.device, gs).to(run.dtype) for m, qw in qws.items()}
    layer = run.builder.build(i, {**fp_state, **deq})
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None and hasattr(experts, "config"):  # transformers' eager loop: differentiable
        experts.config = copy.copy(experts.config)
        experts.config._experts_implementation = "eager"
    for p in layer.parameters():
        p.requires_grad_(False)
    del deq  # the layer holds them (the targets not tuned keep GPTQ's weights there)
    tuned = _targets(layer, names, prefix, qws, offsets, run.device)
    data = _Batches(run, src, carry, ref)
    n, bs = src.shape[0], s.batch_size
    gptq_w = {t.local: t.dequantized(qws, gs) for t in tuned}
    loss0 = _loss_all(layer, gptq_w, data, bs)
    del gptq_w
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + i)
    order: list[int] = []
    params = [p for t in tuned for p in (t.v, t.a)]
    first = last = None
    for it in range(iters):
        if len(order) < bs:
            order += torch.randperm(n, generator=gen).tolist()
        idx, order = order[:bs], order[bs:]
        x, kw, y = data.get(idx)
        loss = (_output(layer, _weights(tuned, lo, hi, gs), x, kw).float() - y.float()).square().mean()
        loss.backward()
        lr = lr0 * (1 - it / iters)
        with torch.no_grad():
            for t in tuned:
                t.v.sub_(lr * t.v.grad.sign()).clamp_(-V_BOUND, V_BOUND)
                t.a.sub_(lr * t.a.grad.sign()).clamp_(-A_BOUND, A_BOUND)
        for p in params:
            p.grad = None
        last = loss.item()
        first = last if first is None else first
        del x, kw, y, loss
    with torch.no_grad():
        results = {m: qw for t in tuned for m, qw in t.results(lo, hi).items()}
        changed = sum(int((qw.q != qws[m].q).sum()) for m, qw in results.items())
        total = sum(t.numel() for t in tuned)
        loss1 = _loss_all(layer, {t.local: t.dequantized(results, gs) for t in tuned}, data, bs)
    kept = loss1 < loss0
    meta = {"iters": iters, "lr": lr0, "tensors": sum(len(t.parts) for t in tuned), "reference": spec.tune_reference,
            "experts_not_tuned": skipped, "loss_gptq": loss0, "loss_tuned": loss1, "kept": kept,
            "integers_changed": round(changed / max(total, 1), 6), "first_batch_loss": first,
            "last_batch_loss": last, "seconds": round(time.perf_counter() - t0, 3)}
    del layer, tuned, data
    _drop_reference(run, ref)
    return (results if kept else {}), meta


def _reference(run: _Run, i: int, fp_state: dict, src: cc.Activations, carry: cc.Activations | None) -> cc.Activations:
    """The tuning's target on every calibration sample, stored as `src` is: the unquantized layer's output on the
    layer's input (`tune_reference: layer`), or on the unquantized model's own hidden states (`source`: the
    unquantized model's output of layer i, which `run.source_stream` then holds as layer i + 1's input)."""
    if run.spec.tune_reference == "source":
        return _advance_source(run, i + 1, {i: fp_state})
    ref = run.new_store(run.hidden_path(i, "reference"), src.shape, src.dtype)
    run.forward(run.builder.build(i, fp_state, chunked_experts=True), src, carry, ref)
    return ref


def _dequantized_on(qw: QWeight, device: torch.device, gs: int) -> torch.Tensor:
    """`dequantize(qw)` computed on `device` (the same bits: one rounded product per weight)."""
    return dequantize(QWeight(qw.q.to(device), qw.scale.to(device), None), gs)


def _numel(qweights, module: str) -> int:
    """A target's weight count, without unpacking a `cache.PackedQWeights` entry."""
    shape = getattr(qweights, "tensors", {}).get(f"{module}.weight_shape")
    return int(torch.prod(shape.long())) if shape is not None else qweights[module].q.numel()


def _drop_reference(run: _Run, ref: cc.Activations) -> None:
    if run.spec.tune_reference == "layer":  # ("source": the next layer's input of the unquantized model, kept)
        ref.drop()
    stream.release_free_memory()


def _advance_source(run: _Run, i: int, states: dict[int, dict]) -> cc.Activations:
    """Move `run.source_stream` on through the source's layers until it holds the unquantized model's input of
    layer i, and return those hidden states. It starts from the embeddings when there is no stream yet (the first
    tuned layer, or a resumed run); layer j is built from `states[j]` if given, else read from the source."""
    j, h, c = run.source_stream if run.source_stream is not None else (0, run.embeddings("reference-embeddings"), None)
    run.source_stream = None
    while j < i:
        layer = run.builder.build(j, states.get(j), chunked_experts=True)
        nh, cdst = run.new_store(run.hidden_path(j, "reference"), h.shape, h.dtype), []
        run.forward(layer, h, c, nh, cdst, j, carry_kind="reference-carry")
        del layer
        for a in (h, c):
            if a is not None:
                a.drop()
        j, h, c = j + 1, nh, (cdst[0] if cdst else None)
    run.source_stream = (j, h, c)
    return h
