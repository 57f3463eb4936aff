"""The GPTQ calibration report: per layer and per tensor class, from the diagnostics in the layer files.

Relative output error of a quantized Linear on the calibration inputs X (the tokens it saw):
    ||X (W - Wq)^T||_F / ||X W^T||_F = sqrt(tr(D H D^T) / tr(W H W^T)),  D = W - Wq, H = 2/n X^T X,
for GPTQ's Wq and for RTN's of the same weight. Aggregates over several tensors are energy-weighted:
sqrt(sum of errors / sum of signals), so they are the relative error of all those outputs together.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import torch

from glmq.formats.families import classify, layer_index, mtp_layers
from glmq.quantize import stream
from glmq.quantize.plan import Action, Plan


def _rel(err: float, signal: float) -> float | None:
    return round(math.sqrt(err / signal), 6) if signal else None


def _class_rows(targets: dict[str, dict]) -> dict[str, dict]:
    acc: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "err_gptq": 0.0, "err_rtn": 0.0, "signal": 0.0,
                                                "gptq_better": 0})
    for module, d in targets.items():
        row = acc[classify(module).value]
        row["tensors"] += 1
        if d.get("signal"):
            row["err_gptq"] += d["err_gptq"]
            row["err_rtn"] += d["err_rtn"]
            row["signal"] += d["signal"]
            row["gptq_better"] += d["err_gptq"] < d["err_rtn"]
    return {cls: {"tensors": r["tensors"], "rel_err_gptq": _rel(r["err_gptq"], r["signal"]),
                  "rel_err_rtn": _rel(r["err_rtn"], r["signal"]), "gptq_better": r["gptq_better"],
                  "_sums": (r["err_gptq"], r["err_rtn"], r["signal"])} for cls, r in sorted(acc.items())}


def summarize(plan: Plan, metas: list[dict], settings, tokens: torch.Tensor, resumed_from: int,
              seconds: float) -> dict:
    """The report merged into glmq_report.json under "gptq"."""
    layers, fallbacks, damped, under, unreached, zeroed = [], [], [], [], [], []
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
    counts_all: list[int] = []
    for meta in metas:
        rows = _class_rows(meta["targets"])
        for cls, r in rows.items():
            t = totals[cls]
            t[0] += r["tensors"]
            t[4] += r["gptq_better"]
            for j, v in enumerate(r.pop("_sums")):
                t[1 + j] += v
        for module, d in meta["targets"].items():
            if d["fallback"]:
                fallbacks.append({"module": module, "reason": d["fallback"], "damp": d["damp"], "tokens": d["tokens"]})
            if d["damp_increased"]:
                damped.append({"module": module, "damp": d["damp"]})
            if d.get("dead_columns"):  # GPTQ zeroes them (reference gptq.py): inputs nonzero when served lose them
                zeroed.append({"module": module, "columns": d["dead_columns"]})
        counts = meta.get("tokens_per_expert", [])
        counts_all += counts
        under += [{"layer": meta["layer"], "expert": e, "tokens": counts[e], "hessian": settings.under_covered}
                  for e in meta.get("under_covered", [])]
        # whatever the threshold: with --min-expert-tokens 0 they are in no list above, yet get the all-token
        # Hessian whole (expert_prior) or none (a round-to-nearest fallback)
        unreached += [{"layer": meta["layer"], "expert": e} for e, n in enumerate(counts) if n == 0]
        layers.append({"layer": meta["layer"], "seconds": meta["seconds"], "classes": rows,
                       "calibration_tokens_per_s": meta.get("calibration_tokens_per_s"),
                       "gptq_seconds": meta.get("gptq_seconds"), "gptq_phase_seconds": meta.get("gptq_phase_seconds"),
                       "forward_tokens_per_s": meta["forward_tokens_per_s"],
                       "expert_tokens": _spread(counts), "tokens_per_expert": counts,
                       "under_covered_experts": meta.get("under_covered", []),
                       "all_token_hessian_tokens": meta.get("all_token_hessian_tokens"),
                       "peak_rss_bytes": meta["peak_rss_bytes"]}
                      | ({"sequential_stages": meta["sequential_stages"]} if "sequential_stages" in meta else {})
                      | ({"tune": meta["tune"]} if "tune" in meta else {}))
    by_class = {cls: {"tensors": t[0], "rel_err_gptq": _rel(t[1], t[3]), "rel_err_rtn": _rel(t[2], t[3]),
                      "gptq_better": t[4]} for cls, t in sorted(totals.items())}
    return {
        "method": "gptq",
        "settings": settings.identity() | {"activations": settings.activations,
                                            "offload_activations": settings.offload_activations,
                                            "sequential": settings.sequential},
        "calibration_tokens": int(tokens.numel()),
        "resumed_from_layer": resumed_from,
        "seconds": round(seconds, 3),
        "layer_seconds_total": round(sum(m["seconds"] for m in metas), 3),
        # over every run of a resumed calibration: each layer recorded its process's peak when it ended
        "peak_rss_bytes": max([stream.peak_rss_bytes()] + [m["peak_rss_bytes"] for m in metas]),
        "by_class": by_class,
        "layers": layers,
        # rel_err_*: measured on the calibration tokens GPTQ was fitted to (in-sample), which flatters it most where an
        # expert saw fewer tokens than its input channels (a probe: 2 x 32 tokens, "better" on 144 of 144 tensors, and
        # a worse model than RTN by glmq eval's KL); held-out quality is glmq eval's
        "rel_err_measured_on": IN_SAMPLE,
        "expert_coverage": {"min_expert_tokens": settings.min_expert_tokens, "tokens_per_expert": _spread(counts_all),
                            "under_covered": under, "unreached": unreached,
                            "below_input_width": _below_width(counts_all, plan.source.config)},
        "fallbacks": fallbacks,
        "damp_increased": damped,
        "zeroed_columns": zeroed,
        "mtp": mtp_note(plan),
    }


IN_SAMPLE = ("the calibration tokens themselves (in-sample: GPTQ was fitted to them, so it looks better there than "
             "on other text; glmq eval measures held-out quality)")


def _below_width(counts: list[int], config: dict) -> dict | None:
    """How many routed experts saw fewer calibration tokens than their gate/up input channels (hidden_size): their
    Hessians are rank-deficient, so GPTQ can fit those few tokens closely and the in-sample error says little."""
    width = config.get("hidden_size")
    if not counts or type(width) is not int:
        return None
    return {"input_width": width, "experts": sum(c < width for c in counts), "of": len(counts)}


def _spread(counts: list[int]) -> dict | None:
    if not counts:
        return None
    return {"experts": len(counts), "min": min(counts), "median": statistics.median(counts), "max": max(counts),
            "zero": sum(c == 0 for c in counts)}


def mtp_note(plan: Plan) -> dict:
    mtp = set(mtp_layers(plan.source.config))
    n = sum(1 for it in plan.items if it.action is Action.QUANTIZE and layer_index(it.name) in mtp)
    return {"layers": sorted(mtp), "tensors": n, "method": "rtn",
            "why": "transformers' forward does not run the MTP layer, so it has no calibration inputs; its "
                   "targets are round-to-nearest by the streaming engine"}


_SHOWN = 20  # entries of each list the terminal shows; the report's JSON holds them all


def _more(items: list) -> str:
    """The line that says a list was cut on the terminal, or ""."""
    return f"\n  ... and {len(items) - _SHOWN} more (glmq_report.json lists them all)" if len(items) > _SHOWN else ""


def format_report(rep: dict) -> str:
    """Human-readable tables of the "gptq" section."""
    resumed = rep["resumed_from_layer"]
    took = (f"{rep['seconds']:.1f} s in this run (its layers {rep['layer_seconds_total']:.1f} s over all runs)"
            if resumed else f"{rep['seconds']:.1f} s")
    lines = [f"GPTQ calibration: {rep['calibration_tokens']} tokens, {took}, peak RSS {rep['peak_rss_bytes'] / 1e9:.2f} "
             f"GB" + (f", resumed at layer {resumed}" if resumed else "")]
    lines.append(f"{'layer':>5s} {'class':16s} {'tensors':>7s} {'rel.err GPTQ':>12s} {'rel.err RTN':>11s} "
                 f"{'better':>7s} {'expert tokens min/med/max':>26s} {'s':>7s}")
    for lay in rep["layers"]:
        sp = lay["expert_tokens"]
        cov = f"{sp['min']}/{sp['median']:g}/{sp['max']}" if sp else "-"
        for cls, r in lay["classes"].items():
            lines.append(f"{lay['layer']:5d} {cls:16s} {r['tensors']:7d} {_f(r['rel_err_gptq']):>12s} "
                         f"{_f(r['rel_err_rtn']):>11s} {r['gptq_better']:7d} {cov:>26s} {lay['seconds']:7.1f}")
    for cls, r in rep["by_class"].items():
        lines.append(f"{'all':>5s} {cls:16s} {r['tensors']:7d} {_f(r['rel_err_gptq']):>12s} {_f(r['rel_err_rtn']):>11s} "
                     f"{r['gptq_better']:7d}")
    for lay in rep["layers"]:
        t = lay.get("tune")
        if t and t.get("tensors"):
            lines.append(f"layer {lay['layer']} output tuning ({t['tensors']} tensors, {t['iters']} iters, reference "
                         f"{t['reference']}): loss {t['loss_gptq']:.4g} -> {t['loss_tuned']:.4g} "
                         f"({'kept' if t['kept'] else 'not kept: GPTQ result written'}), "
                         f"{100 * t['integers_changed']:.2f} % of integers {'moved' if t['kept'] else 'would have moved'}, "
                         f"{t['seconds']:.1f} s"
                         + (f"; routed experts not tuned: {t['experts_not_tuned']}" if t.get("experts_not_tuned") else ""))
    lines.append(f"(rel.err: on {rep.get('rel_err_measured_on', IN_SAMPLE)})")
    cov = rep["expert_coverage"]
    thin = cov.get("below_input_width")
    if thin and thin["experts"]:
        lines.append(f"experts that saw fewer calibration tokens than their {thin['input_width']} input channels: "
                     f"{thin['experts']} of {thin['of']} (rank-deficient Hessians: the in-sample errors above flatter "
                     f"GPTQ most there; more --samples or a longer --seq-len give them more)")
    under = cov["under_covered"]
    lines.append(f"experts under {cov['min_expert_tokens']} tokens: {len(under)}"
                 + "".join(f"\n  layer {u['layer']} expert {u['expert']}: {u['tokens']} tokens -> {u['hessian']}"
                           for u in under[:_SHOWN]) + _more(under))
    unreached = cov.get("unreached", [])
    listed = {(u["layer"], u["expert"]) for u in under[:_SHOWN]}
    rest = [u for u in unreached if (u["layer"], u["expert"]) not in listed]  # with the default threshold 1: none
    lines.append(f"experts no calibration token reached: {len(unreached)}"
                 + (" (listed above)" if unreached and not rest else
                    f" ({len(unreached) - len(rest)} listed above)" if len(rest) < len(unreached) else "")
                 + "".join(f"\n  layer {u['layer']} expert {u['expert']}" for u in rest[:_SHOWN]) + _more(rest))
    zeroed = rep.get("zeroed_columns", [])
    if zeroed:
        lines.append(f"tensors with input channels 0 in every calibration token (their weights zeroed, as reference "
                     f"GPTQ does; other calibration text may reach them): {len(zeroed)}" + "".join(
                         f"\n  {z['module']}: {z['columns']} channels" for z in zeroed[:_SHOWN]) + _more(zeroed))
    lines.append(f"fallbacks: {len(rep['fallbacks'])}" + "".join(
        f"\n  {f['module']}: {f['reason']}" for f in rep["fallbacks"][:_SHOWN]) + _more(rep["fallbacks"]))
    mtp = rep["mtp"]
    if mtp["tensors"]:
        lines.append(f"MTP layer(s) {mtp['layers']}: {mtp['tensors']} tensors round-to-nearest ({mtp['why']})")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.5f}"
