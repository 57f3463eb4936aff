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
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmq.calibration import cache as cc
from glmq.quantize import stream
from glmq.quantize.rtn import QWeight, dequantize

if TYPE_CHECKING:
    from glmq.calibration.engine import _Run

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
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
        diag = torch.diagonal(h) + damp * torch.diagonal(h).mean()
        g = d @ ((h + h.T) / 2) + d * (diag - torch.diagonal(h))  # d Hd, Hd = H + damp mean(diag H) I
        off = g / (diag.clamp_min(torch.finfo(torch.float32).tiny) * s)
    return torch.nan_to_num(off, nan=0.0).clamp_(-OFFSET_BOUND, OFFSET_BOUND)


@dataclass
class _Tuned:
    """One target's tuned parameters (float32 on the run's device) around its GPTQ integers and scales."""

    module: str
    local: str  # layer-local weight name
    q0: torch.Tensor  # [N, K] GPTQ's integers as float32
    x: torch.Tensor  # [N, K] their continuous values, q0 + rounding_offsets
    s0: torch.Tensor  # [N, G] GPTQ's scales as float32
    dtype: torch.dtype  # the scale dtype (written)
    v: torch.Tensor  # [N, K] the tuned rounding offsets (added to x)
    a: torch.Tensor  # [N, G] relative scale changes

    @classmethod
    def start(cls, module: str, local: str, qw: QWeight, offsets: torch.Tensor, device: torch.device) -> _Tuned:
        q0, s0 = qw.q.to(device, torch.float32), qw.scale.to(device, torch.float32)
        return cls(module, local, q0, q0 + offsets.to(device, torch.float32), s0, qw.scale.dtype,
                   torch.zeros_like(q0, requires_grad=True), torch.zeros_like(s0, requires_grad=True))

    def integers(self, lo: int, hi: int, soft: bool) -> torch.Tensor:
        z = self.x + self.v
        r = torch.round(z)
        return (z + (r - z).detach() if soft else r).clamp(lo, hi)  # straight-through rounding

    def weight(self, lo: int, hi: int, gs: int) -> torch.Tensor:
        """The dequantized weight as the tuning sees it (float32, differentiable in v and a)."""
        q = self.integers(lo, hi, soft=True)
        s = self.s0 * (1 + self.a)
        return (q.unflatten(-1, (-1, gs)) * s.unsqueeze(-1)).flatten(-2)

    def result(self, lo: int, hi: int) -> QWeight:
        q = self.integers(lo, hi, soft=False).to(torch.int8)
        return QWeight(q.cpu(), (self.s0 * (1 + self.a)).detach().to(self.dtype).cpu(), None)


def _fused(layer: torch.nn.Module, experts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameters with the given experts' (gate, up, down) weights in place."""
    ex = layer.get_submodule("mlp.experts")
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    n = gu.shape[1] // 2
    rows, downs = [], []
    for e in range(gu.shape[0]):
        d = experts.get(e, {})
        rows.append(torch.cat([d.get("gate", gu[e, :n]), d.get("up", gu[e, n:])]))
        downs.append(d.get("down", dn[e]))
    return {"mlp.experts.gate_up_proj": torch.stack(rows), "mlp.experts.down_proj": torch.stack(downs)}


def _weights(layer: torch.nn.Module, tuned: list[_Tuned], lo: int, hi: int, gs: int,
             fixed: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Parameter name -> tensor for `torch.func.functional_call`: the tuned weights (or `fixed` ones, by local name)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for t in tuned:
        w = fixed[t.local] if fixed is not None else t.weight(lo, hi, gs)
        m = _EXPERT.search(t.local)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = w
        else:
            out[t.local] = w
    if experts:
        out.update(_fused(layer, experts))
    return out


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
    """Tune layer i's quantized targets on its output error; returns (qweights to keep, the report's "tune" entry).

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
        return dict(qweights), {"iters": 0, "tensors": 0, "reference": spec.tune_reference, "experts_not_tuned": skipped}
    ref = _reference(run, i, fp_state, src, carry)
    qws = {m: qweights[m] for m in qweights}  # unpacked once
    deq = {m[len(prefix):] + ".weight": dequantize(qw, gs).to(run.dtype) for m, qw in qws.items()}
    layer = run.builder.build(i, {**fp_state, **deq})
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None and hasattr(experts, "config"):  # transformers' eager loop: differentiable
        experts.config = copy.copy(experts.config)
        experts.config._experts_implementation = "eager"
    for p in layer.parameters():
        p.requires_grad_(False)
    tuned = [_Tuned.start(m, m[len(prefix):] + ".weight", qws[m], offsets[m], run.device) for m in names]
    deq = {t.local: deq[t.local] for t in tuned}  # the others are the layer's own parameters
    data = _Batches(run, src, carry, ref)
    n, bs = src.shape[0], s.batch_size
    gptq_w = _weights(layer, tuned, lo, hi, gs, fixed={k: v.to(run.device, torch.float32) for k, v in deq.items()})
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
        loss = (_output(layer, _weights(layer, tuned, lo, hi, gs), x, kw).float() - y.float()).square().mean()
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
        results = {**qws, **{t.module: t.result(lo, hi) for t in tuned}}
        changed = sum(int((results[t.module].q.float() != t.q0.cpu()).sum()) for t in tuned)
        total = sum(t.q0.numel() for t in tuned)
        final_w = {t.local: dequantize(results[t.module], gs).to(run.device, torch.float32) for t in tuned}
        loss1 = _loss_all(layer, _weights(layer, tuned, lo, hi, gs, fixed=final_w), data, bs)
    kept = loss1 < loss0
    meta = {"iters": iters, "lr": lr0, "tensors": len(tuned), "reference": spec.tune_reference,
            "experts_not_tuned": skipped, "loss_gptq": loss0, "loss_tuned": loss1, "kept": kept,
            "integers_changed": round(changed / max(total, 1), 6), "first_batch_loss": first,
            "last_batch_loss": last, "seconds": round(time.perf_counter() - t0, 3)}
    del layer, tuned, data, final_w
    _drop_reference(run, ref)
    return (results if kept else qws), meta


def _reference(run: _Run, i: int, fp_state: dict, src: cc.Activations, carry: cc.Activations | None) -> cc.Activations:
    """The tuning's target on every calibration sample, stored as `src` is: the unquantized layer's output on the
    layer's input (`tune_reference: layer`), or on the unquantized model's own hidden states (`source`: the
    unquantized model's output of layer i, `run.source_stream`, which this advances)."""
    layer = run.builder.build(i, fp_state, chunked_experts=True)
    if run.spec.tune_reference == "layer":
        ref = _new_store(run, src, run.hidden_path(i, "reference"))
        run.forward(layer, src, carry, ref)
        return ref
    h, c = _source_input(run, i)
    ref, cdst = _new_store(run, h, run.hidden_path(i, "reference")), []
    run.forward(layer, h, c, ref, cdst, i, carry_kind="reference-carry")
    _drop(h, c)
    run.source_stream = (i + 1, ref, cdst[0] if cdst else None)
    return ref


def _numel(qweights, module: str) -> int:
    """A target's weight count, without unpacking a `cache.PackedQWeights` entry."""
    shape = getattr(qweights, "tensors", {}).get(f"{module}.weight_shape")
    return int(torch.prod(shape.long())) if shape is not None else qweights[module].q.numel()


def _drop_reference(run: _Run, ref: cc.Activations) -> None:
    if run.spec.tune_reference == "layer":  # ("source": the next layer's input of the unquantized model, kept)
        ref.drop()
    stream.release_free_memory()


def _new_store(run: _Run, like: cc.Activations, path) -> cc.Activations:
    if run.on_disk:
        return cc.Activations.new_file(path.with_suffix(".tmp"), like.shape, like.dtype)
    return cc.Activations.in_memory(torch.empty(like.shape, dtype=like.dtype))


def _drop(*stores: cc.Activations | None) -> None:
    for a in stores:
        if a is not None:
            a.drop()


def _source_input(run: _Run, i: int) -> tuple[cc.Activations, cc.Activations | None]:
    """The unquantized model's input of layer i: `run.source_stream` moved on through the source's layers from
    where it is (the embeddings when there is none yet: the first tuned layer, or a resumed run)."""
    j, h, c = run.source_stream if run.source_stream is not None else (0, run.embeddings("reference-embeddings"), None)
    run.source_stream = None
    while j < i:
        layer = run.builder.build(j, None, chunked_experts=True)
        nh, cdst = _new_store(run, h, run.hidden_path(j, "reference")), []
        run.forward(layer, h, c, nh, cdst, j, carry_kind="reference-carry")
        del layer
        _drop(h, c)
        j, h, c = j + 1, nh, (cdst[0] if cdst else None)
    return h, c
