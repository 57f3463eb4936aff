"""Layer-sequential GPTQ: calibrate and quantize one decoder layer at a time, then stream the checkpoint.

For decoder layer i = 0 .. L-1 (calibration tokens embedded with the source's `embed_tokens` first):
  1. build layer i alone with transformers' own class, source weights loaded (calibration/layers.py);
  2. run the calibration hidden states through it while collecting the input Hessian of every target
     Linear of the recipe in this layer (calibration/collect.py; routed experts see only the tokens
     the layer's own router sends them);
  3. quantize every target with `quantize_gptq`, and write the results (cache.py, atomic);
  4. run the hidden states through the *quantized* layer (dequantized integers loaded back), which
     gives the input of layer i+1; free the layer.
Then `stream.run(plan, out, quantized=CachedQWeights(...))` writes the checkpoint: the writer, the
manifest, the index and config.json are the streaming engine's, only the integers come from here.

The MTP layer (index L, `families.mtp_layers`) is not part of transformers' forward: its targets are
quantized with RTN by the streaming engine (the provider returns None), and the report says so.

Memory: one decoder layer (compute dtype) plus its Hessians (float32 K x K per target site; bound them
with `experts_per_pass`), plus the hidden states `[S, T, H]` in the compute dtype (S*T*H*4 bytes in
float32: 0.8 GB for 128 x 256 tokens of GLM-5) and, for GLM-5's DSA, the carried top-k indices
`[S, T, index_topk]` int32; with `offload_activations` both live on disk and only one batch is in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from glmq.calibration import cache as cc
from glmq.calibration.collect import ALL_TOKENS, HessianCollector, Target, make_target
from glmq.calibration.layers import LayerBuilder
from glmq.calibration.report import summarize
from glmq.formats.families import layer_index
from glmq.formats.safetensors_io import atomic_write_text
from glmq.quantize import stream
from glmq.quantize.gptq import hessian_error, quantize_gptq
from glmq.quantize.plan import Action, Plan
from glmq.quantize.rtn import QWeight, dequantize, quantize_rtn

log = logging.getLogger("glmq.gptq")
UNDER_COVERED = ("all_tokens", "rtn")


@dataclass(frozen=True)
class CalibrationSettings:
    """How GPTQ is calibrated. Everything but `offload_activations` is part of the run's identity.

    Attributes:
        calibration: the calibration file or dataset name (provenance only; the tokens are digested).
        samples, seq_len, seed: the calibration set (calibration/data.py).
        min_expert_tokens: a routed expert that receives fewer calibration tokens than this is
            "under-covered" and gets `under_covered` instead of its routed Hessian.
        under_covered: "all_tokens" (Hessians from every token of the layer, as llm-compressor's
            moe_calibrate_all_experts) or "rtn" (round-to-nearest).
        routing_weighted: weight each routed token by its routing weight squared in the expert Hessians.
        clip_search: `quantize_gptq(clip_search=True)`.
        batch_size: calibration samples per forward.
        dtype: compute dtype of the layer forwards and of the stored hidden states.
        experts_per_pass: routed experts whose Hessians are held at once (None: all); more passes,
            less memory.
        offload_activations: folder for the hidden states between layers (None: in memory).
    """

    calibration: str = ""
    samples: int = 128
    seq_len: int = 256
    seed: int = 0
    min_expert_tokens: int = 16
    under_covered: str = "all_tokens"
    routing_weighted: bool = False
    clip_search: bool = False
    batch_size: int = 8
    dtype: str = "float32"
    experts_per_pass: int | None = None
    offload_activations: str | None = None

    def __post_init__(self) -> None:
        if self.under_covered not in UNDER_COVERED:
            raise ValueError(f"under_covered must be one of {UNDER_COVERED}, got {self.under_covered!r}")
        if self.min_expert_tokens < 0 or self.batch_size <= 0 or (self.experts_per_pass or 1) <= 0:
            raise ValueError("min_expert_tokens must be >= 0, batch_size and experts_per_pass positive")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def identity(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "offload_activations"}


def run_gptq(plan: Plan, out: str | Path, tokens: torch.Tensor, settings: CalibrationSettings,
             device: str = "cpu", progress: bool = True) -> dict:
    """Calibrate and quantize with GPTQ layer by layer, then write the checkpoint; return the run report.

    Args:
        plan: a plan whose recipe has method "gptq" (its QuantSpec gives act_order, damp, block size).
        out: output folder; a killed run resumes from its `.glmq-gptq` cache (cache.py).
        tokens: int64 `[S, T]` calibration token ids.
    Returns:
        stream.run's report with a "gptq" section (calibration_report), also in glmq_report.json.
    Raises:
        CheckpointError (OutputDirError, CalibrationCacheError): the folder holds another run.
        ValueError: bad tokens or a layer that does not match transformers' class.
    """
    out = Path(out)
    if tokens.ndim != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"calibration tokens must be an int64 [samples, seq_len] tensor, got {tokens.dtype} {list(tokens.shape)}")
    man = stream.prepare_output(plan, out)  # the manifest first: then the cache may live inside `out`
    cache = out / cc.CACHE_DIR
    cc.check_identity(cache, {"plan": stream.plan_identity(plan), "settings": settings.identity(),
                              "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
                              "tokens_shape": list(tokens.shape)})
    finished = man.complete and len(man.files) == len(plan.files) and (cache / cc.REPORT_NAME).exists()
    if finished:
        report = json.loads((cache / cc.REPORT_NAME).read_text())
        report["note"] = "output already complete: calibration not re-run"
    else:
        report = calibrate(plan, cache, tokens, settings, device, progress)
        atomic_write_text(cache / cc.REPORT_NAME, json.dumps(report, indent=1) + "\n")
    provider = cc.CachedQWeights(cache, plan.recipe.spec, plan.source.config["num_hidden_layers"])
    result = stream.run(plan, out, device, progress, quantized=provider, extra_report={"gptq": report})
    for p in cache.iterdir():  # the integers now live in the checkpoint; keep identity and report
        if p.name not in (cc.IDENTITY_NAME, cc.REPORT_NAME):
            p.unlink()
    return result


def targets_by_layer(plan: Plan) -> dict[int, list[Target]]:
    """QUANTIZE items of the decoder layers (not the MTP layer), per layer index."""
    n = plan.source.config["num_hidden_layers"]
    out: dict[int, list[Target]] = {i: [] for i in range(n)}
    for it in plan.items:
        i = layer_index(it.name)
        if it.action is Action.QUANTIZE and i is not None and i < n:
            out[i].append(make_target(it.module, i))
    return out


# ----------------------------------------------------------------------------------------- the loop
class _Run:
    """State of one calibration: builder, stores, cache folder, progress."""

    def __init__(self, plan: Plan, cache: Path, tokens: torch.Tensor, settings: CalibrationSettings,
                 device: str, progress: bool):
        self.plan, self.cache, self.tokens, self.s = plan, cache, tokens, settings
        self.spec = plan.recipe.spec
        self.device = torch.device(device)
        self.dtype = cc.dtype_of(settings.dtype)
        self.builder = LayerBuilder(plan.source, self.device, self.dtype)
        self.n_layers = plan.source.config["num_hidden_layers"]
        self.targets = targets_by_layer(plan)
        self.offload = Path(settings.offload_activations) / f"glmq-{cache.parent.resolve().name}" \
            if settings.offload_activations else None
        self.act_dir = self.offload or cache
        self.progress = progress
        self.bar = None

    # -- hidden states
    def hidden_path(self, i: int, kind: str = "hidden") -> Path:
        return self.act_dir / f"{kind}-{i:05d}.bin"

    def embeddings(self) -> cc.Activations:
        s, t = self.tokens.shape
        shape = (s, t, self.builder.config.hidden_size)
        if self.offload is None:
            return cc.Activations.in_memory(self.builder.embed(self.tokens))
        store = cc.Activations.new_file(self.hidden_path(-1).with_suffix(".tmp"), shape, self.dtype)
        for b0 in range(0, s, self.s.batch_size):
            store.write(b0, self.builder.embed(self.tokens[b0:b0 + self.s.batch_size]))
        return store

    def forward(self, layer, src: cc.Activations, carry: cc.Activations | None, dst: cc.Activations | None,
                carry_dst: list | None = None) -> float:
        """Run every batch of `src` through `layer`; write outputs to `dst` (None: discard). Returns tokens/s."""
        t0, s = time.perf_counter(), src.shape[0]
        name = self.builder.spec.carry
        with torch.no_grad():
            for b0 in range(0, s, self.s.batch_size):
                b1 = min(b0 + self.s.batch_size, s)
                x = src.read(b0, b1).to(self.device)
                kw = self.builder.layer_kwargs(x)
                if name:
                    kw[name] = None if carry is None else carry.read(b0, b1).to(self.device)
                y = layer(x, **kw)
                if isinstance(y, tuple):
                    y, extra = y
                    if carry_dst is not None:
                        if not carry_dst:
                            carry_dst.append(self._carry_store(extra, s))
                        carry_dst[0].write(b0, extra)
                if dst is not None:
                    dst.write(b0, y)
        return src.shape[0] * src.shape[1] / max(time.perf_counter() - t0, 1e-9)

    def _carry_store(self, extra: torch.Tensor, s: int) -> cc.Activations:
        shape = (s, *extra.shape[1:])
        if self.offload is None:
            return cc.Activations.in_memory(torch.empty(shape, dtype=extra.dtype))
        return cc.Activations.new_file(self.hidden_path(0, "carry-new").with_suffix(".tmp"), shape, extra.dtype)

    def output_store(self, src: cc.Activations, i: int) -> cc.Activations:
        if self.offload is None:
            return src  # in place, batch by batch: one copy in memory
        return cc.Activations.new_file(self.hidden_path(i).with_suffix(".tmp"), src.shape, src.dtype)

    # -- one layer
    def quantized_layer(self, i: int, state: dict, qweights: dict[str, QWeight]):
        """Layer i with every target replaced by its dequantized integers (what the checkpoint holds)."""
        prefix = f"model.layers.{i}."
        state = dict(state)
        for module, qw in qweights.items():
            name = module[len(prefix):] + ".weight"
            state[name] = dequantize(qw, self.spec.group_size).to(state[name].dtype)
        return self.builder.build(i, state)

    def layer(self, i: int, src: cc.Activations, carry: cc.Activations | None):
        """Calibrate, quantize and forward layer i; returns its output stores (hidden, carry)."""
        t0 = time.perf_counter()
        targets = self.targets[i]
        state = self.builder.tensors.layer_state(i)
        qweights, meta = {}, {"layer": i, "targets": {}}
        if targets:
            layer = self.builder.build(i, state)
            qweights, meta = quantize_layer(self, i, layer, state, targets, src, carry)
            del layer
        qlayer = self.quantized_layer(i, state, qweights)
        del state
        dst, carry_dst = self.output_store(src, i), []
        meta["forward_tokens_per_s"] = round(self.forward(qlayer, src, carry, dst, carry_dst), 1)
        del qlayer
        dst.save(self.hidden_path(i))
        meta["hidden"] = dst.describe()
        if carry_dst:
            carry_dst[0].save(self.hidden_path(i, "carry"))
            meta["carry"] = carry_dst[0].describe()
        meta["seconds"] = round(time.perf_counter() - t0, 3)
        meta["peak_rss_bytes"] = stream.peak_rss_bytes()
        cc.save_layer(self.cache, i, qweights, self.spec, meta)
        for p in self.act_dir.glob("*.bin"):  # only the newest states are needed from now on
            if p.name not in (self.hidden_path(i).name, self.hidden_path(i, "carry").name):
                p.unlink()
        return dst, (carry_dst[0] if carry_dst else None)

    def resume_input(self, start: int) -> tuple[cc.Activations, cc.Activations | None]:
        """The input of layer `start`: saved states if present, else regenerated from the layer files."""
        if start > 0:
            meta = cc.layer_meta(self.cache, start - 1)
            h = cc.Activations.load(self.hidden_path(start - 1), tuple(meta["hidden"]["shape"]),
                                    cc.dtype_of(meta["hidden"]["dtype"]), self.offload is None)
            c = None
            if "carry" in meta:
                c = cc.Activations.load(self.hidden_path(start - 1, "carry"), tuple(meta["carry"]["shape"]),
                                        cc.dtype_of(meta["carry"]["dtype"]), self.offload is None)
            if h is not None and (c is not None or "carry" not in meta):
                log.info("resuming at layer %d from saved hidden states", start)
                return h, c
        src, carry = self.embeddings(), None
        for j in range(start):  # regenerate: forward the finished layers from their integers
            log.info("resuming: regenerating the input of layer %d with quantized layer %d", start, j)
            qlayer = self.quantized_layer(j, self.builder.tensors.layer_state(j),
                                          cc.load_qweights(self.cache, j, self.spec))
            dst, carry_dst = self.output_store(src, j), []
            self.forward(qlayer, src, carry, dst, carry_dst)
            if self.offload is not None:
                dst.save(self.hidden_path(j))
            src, carry = dst, (carry_dst[0] if carry_dst else None)
        return src, carry


def calibrate(plan: Plan, cache: Path, tokens: torch.Tensor, settings: CalibrationSettings,
              device: str = "cpu", progress: bool = True) -> dict:
    """Steps 1-4 of the module docstring for every decoder layer not yet in `cache`; returns the report."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    run = _Run(plan, cache, tokens, settings, device, progress)
    done = [cc.layer_meta(cache, i) is not None for i in range(run.n_layers)]
    start = done.index(False) if False in done else run.n_layers
    if start < run.n_layers:
        run.bar = tqdm(total=sum(len(run.targets[i]) for i in range(start, run.n_layers)), unit="tensor",
                       desc="glmq gptq", disable=not progress, dynamic_ncols=True)
        src, carry = run.resume_input(start)
        for i in range(start, run.n_layers):
            run.bar.set_description(f"GPTQ layer {i + 1}/{run.n_layers}")
            src, carry = run.layer(i, src, carry)
        run.bar.close()
    metas = [cc.layer_meta(cache, i) for i in range(run.n_layers)]
    return summarize(plan, metas, settings, tokens, resumed_from=start, seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------- quantize
def _expert_chunks(run: _Run, targets: list[Target]) -> list[set[int]]:
    experts = sorted({t.expert for t in targets if t.expert is not None})
    if not experts:
        return [set()]
    k = run.s.experts_per_pass or len(experts)
    return [set(experts[j:j + k]) for j in range(0, len(experts), k)]


def quantize_layer(run: _Run, i: int, layer, state: dict, targets: list[Target], src, carry):
    """Collect Hessians (one pass per chunk of experts) and GPTQ every target of layer i.

    Pass 0 also collects the plain Linear targets, counts the tokens routed to every expert and the
    all-token MoE-input Hessian; experts below `min_expert_tokens` are then known, and their
    all-token down-input Hessians come from the chunk's pass (one extra pass for chunk 0).
    """
    chunks = _expert_chunks(run, targets)
    linear = {t.site for t in targets if t.expert is None}
    all_tokens = run.s.under_covered == "all_tokens"
    qweights: dict[str, QWeight] = {}
    meta: dict = {"layer": i, "targets": {}}
    tps: list[float] = []
    under: set[int] = set()
    all_h = (None, 0)
    for p, chunk in enumerate(chunks):
        sites = {t.site for t in targets if t.expert in chunk}
        if p == 0:
            sites |= linear | ({ALL_TOKENS} if chunk else set())
        col = HessianCollector(layer, sites, experts=chunk, all_token_experts=under & chunk if all_tokens else set(),
                               routing_weighted=run.s.routing_weighted, device=run.device)
        with col:
            tps.append(run.forward(layer, src, carry, None))
        if p == 0 and chunk:
            counts = col.tokens.tolist()
            under = {e for e, n in enumerate(counts) if n < run.s.min_expert_tokens}
            meta["tokens_per_expert"], meta["under_covered"] = counts, sorted(under)
            all_h = col.hessian(ALL_TOKENS)
            if all_tokens and under & chunk:
                extra = HessianCollector(layer, set(), experts=set(), all_token_experts=under & chunk, device=run.device)
                with extra:
                    run.forward(layer, src, carry, None)
                col.acc.update(extra.acc)
        for t in targets:
            if (t.expert is None and p == 0) or (t.expert is not None and t.expert in chunk):
                w = state[t.local + ".weight"]
                qweights[t.module], meta["targets"][t.module] = _quantize_target(run, t, w, col, under, all_h)
                run.bar.update(1)
                run.bar.set_postfix_str(_postfix(qweights, targets, tps))
        del col
    meta["calibration_tokens_per_s"] = round(statistics.fmean(tps), 1)
    return qweights, meta


def _postfix(qweights: dict, targets: list[Target], tps: list[float]) -> str:
    experts = {t.expert for t in targets if t.expert is not None}
    pending = {t.expert for t in targets if t.expert is not None and t.module not in qweights}
    rate = f"{tps[-1]:.0f} tok/s" if tps else ""
    return (f"experts {len(experts - pending)}/{len(experts)}, " if experts else "") + rate


def _quantize_target(run: _Run, t: Target, w: torch.Tensor, col: HessianCollector, under: set[int],
                     all_h: tuple) -> tuple[QWeight, dict]:
    """GPTQ one target with the Hessian its coverage calls for; diagnostics for the report.

    Errors are reported on the tokens the Linear really saw (the routed Hessian), also when an
    under-covered expert was quantized with the all-token Hessian; on the all-token one if it saw none.
    """
    h_seen, n = col.hessian(t.site)
    h, source = h_seen, ("routed" if t.expert is not None else "input")
    if t.expert is not None and t.expert in under:
        if run.s.under_covered == "rtn":
            return _rtn_target(run, w, h_seen, n)
        source = "all_tokens"
        h = all_h[0] if t.site.endswith("gate_up") else col.hessian(f"mlp.experts.{t.expert}.down_all")[0]
    if h is None:  # no token at all: quantize_gptq falls back to RTN and says so
        h = torch.zeros(w.shape[1], w.shape[1])
    wd, h = w.to(run.device), h.to(run.device)
    r = quantize_gptq(wd, h, run.spec, clip_search=run.s.clip_search)
    measure = h_seen.to(run.device) if n > 0 and h_seen is not None else h
    err_g, err_r = r.error_gptq, r.error_rtn
    if measure is not h:
        err_g = hessian_error(wd, dequantize(r.qweight, run.spec.group_size), measure)
        err_r = hessian_error(wd, dequantize(quantize_rtn(wd, run.spec), run.spec.group_size), measure)
    qw = QWeight(r.qweight.q.cpu(), r.qweight.scale.cpu(),
                 None if r.qweight.zero_point is None else r.qweight.zero_point.cpu())
    return qw, {"tokens": n, "hessian": source, "err_gptq": err_g, "err_rtn": err_r,
                "signal": hessian_error(wd, torch.zeros_like(wd), measure),
                "fallback": r.fallback.value if r.fallback else None, "damp": r.damp,
                "damp_increased": r.damp_increased, "dead_columns": r.dead_columns}


def _rtn_target(run: _Run, w: torch.Tensor, h, n: int) -> tuple[QWeight, dict]:
    """An under-covered expert under `under_covered="rtn"`: round-to-nearest, recorded as a fallback."""
    qw = quantize_rtn(w, run.spec)
    d = {"tokens": n, "hessian": "rtn", "fallback": "under_covered_rtn", "damp": None, "damp_increased": False,
         "dead_columns": 0, "err_gptq": None, "err_rtn": None, "signal": None}
    if h is not None:
        e = hessian_error(w, dequantize(qw, run.spec.group_size), h)
        d.update(err_gptq=e, err_rtn=e, signal=hessian_error(w, torch.zeros_like(w), h))
    return qw, d
