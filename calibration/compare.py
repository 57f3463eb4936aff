"""`glmq eval`: perplexity, KL(source || quantized) and per-layer hidden-state error of checkpoints.

Every checkpoint goes through calibration/evaluate.py (glmq's readers, transformers' model class, the
same windows, batches and log-softmax as `log_probs`), so the figures are those of tests/test_quality.py.
Per-layer error: for decoder layer l, ||h_q - h_s||_F / ||h_s||_F over all windows, with h the
`output_hidden_states` entry after layer l (transformers returns the last one after the final norm).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from glmq.calibration.evaluate import load_model, mean_kl, perplexity, token_windows
from glmq.formats.manifest import fingerprint
from glmq.formats.safetensors_io import CheckpointError, read_json_object

# config.json keys that must agree between the source and a quantized checkpoint: the same token ids, the same
# hidden states layer by layer (a checkpoint of another model gives a traceback or numbers that mean nothing).
SAME_MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def _config(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint}: no config.json; not a checkpoint folder, or one whose writing did not "
                              f"finish (glmq writes config.json last)")
    return read_json_object(path, "not a checkpoint folder", "re-download or re-write it")


def check_same_model(source: str | Path, quantized: list[str | Path], seq_len: int | None = None) -> None:
    """Every checkpoint has a config.json, and each quantized one is of the source's model (SAME_MODEL_KEYS);
    checked before anything is loaded. Raises CheckpointError naming the checkpoint and the keys that differ, and
    ValueError for windows longer than the model's `max_position_embeddings` (positions it was never trained on
    or served at: the perplexity would be meaningless, as GPTQ's calibration refuses them too)."""
    from glmq.calibration.layers import check_transformers_config

    src = _config(source)
    check_transformers_config(source, src)  # before the tokenizer and the models are loaded
    limit = src.get("max_position_embeddings")
    if seq_len is not None and limit and seq_len > limit:
        raise ValueError(f"{source}: --seq-len {seq_len} is longer than the model's max_position_embeddings "
                         f"({limit}); use --seq-len {limit} or less")
    for q in quantized:
        cfg = _config(q)
        diff = [f"{k} {cfg.get(k)!r} (source: {src.get(k)!r})" for k in SAME_MODEL_KEYS if cfg.get(k) != src.get(k)]
        if diff:
            raise CheckpointError(f"{q}: not a checkpoint of the source's model {source}: {', '.join(diff)}; "
                                  f"compare only checkpoints quantized from the source")


@torch.no_grad()
def forward(model, windows: torch.Tensor, batch: int = 8, ref: list[torch.Tensor] | None = None):
    """Log-probs `[W, T-1, V]` as evaluate.log_probs, plus per-layer hidden states.

    Returns (log_probs, hidden) with hidden a list of `[W, T, H]` per decoder layer when `ref` is None,
    else (log_probs, [(sum ||h - ref||^2, sum ||ref||^2) per layer]).
    """
    lps, hidden, sums = [], [], None
    for i in range(0, windows.shape[0], batch):
        out = model(windows[i:i + batch], output_hidden_states=True)
        lps.append(torch.log_softmax(out.logits[:, :-1].float(), dim=-1))
        hs = [h.float() for h in out.hidden_states[1:]]
        if ref is None:
            hidden.append(hs)
            continue
        sums = sums or [[0.0, 0.0] for _ in hs]
        for s, h, r in zip(sums, hs, ref):
            r = r[i:i + batch]
            s[0] += float(((h - r) ** 2).sum())
            s[1] += float((r ** 2).sum())
    lp = torch.cat(lps)
    if ref is None:
        return lp, [torch.cat(layer) for layer in zip(*hidden)]
    return lp, sums


def compare(source: str | Path, quantized: list[str | Path], text: str | Path, seq_len: int = 256,
            windows: int = 96, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> dict:
    """Evaluate the source and each quantized checkpoint on the first `windows` windows of `text`.

    Returns:
        {"text", "seq_len", "windows", "models": [{"checkpoint", "perplexity", "kl_to_source",
        "layer_rel_error": [per decoder layer] | None, "fingerprint"}]}; the source row has KL 0 and no layer
        error; "fingerprint" (formats/manifest.fingerprint) names the weights evaluated, which `glmq upload` checks
        against the folder it publishes.
    """
    check_same_model(source, quantized, seq_len)
    ids = token_windows(source, text, seq_len, windows, trust_remote_code)
    lp_src, ref = forward(load_model(source, dtype), ids)
    rows = [{"checkpoint": str(source), "perplexity": perplexity(lp_src, ids), "kl_to_source": 0.0,
             "layer_rel_error": None, "fingerprint": fingerprint(Path(source))}]
    for q in quantized:
        lp, sums = forward(load_model(q, dtype), ids, ref=ref)
        rows.append({"checkpoint": str(q), "perplexity": perplexity(lp, ids), "kl_to_source": mean_kl(lp_src, lp),
                     "layer_rel_error": [math.sqrt(e / s) if s else None for e, s in sums],
                     "fingerprint": fingerprint(Path(q))})
        del lp
    return {"text": str(text), "seq_len": seq_len, "windows": int(ids.shape[0]), "models": rows}


def non_finite(result: dict) -> list[str]:
    """"CHECKPOINT: perplexity inf" for every figure of `compare()`'s result that is not a finite number (a model
    whose log-probs overflow or are NaN; a layer error of None, a source layer that is all zeros, is no figure)."""
    bad = []
    for r in result["models"]:
        figures = {"perplexity": r["perplexity"], "kl_to_source": r["kl_to_source"],
                   **{f"layer_rel_error[{i}]": e for i, e in enumerate(r["layer_rel_error"] or [])}}
        bad += [f"{r['checkpoint']}: {k} {v}" for k, v in figures.items() if v is not None and not math.isfinite(v)]
    return bad


def json_ready(result: dict) -> dict:
    """`compare()`'s result with each non-finite figure as null: JSON has no inf or nan (Python's json would write the
    non-standard `NaN` and `Infinity` that strict parsers refuse)."""
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return [fix(x) for x in v] if isinstance(v, list) else v

    return fix(result)


def _fmt(v: float | None, spec: str) -> str:
    """`v` in `spec` ("10.4f"), or a null figure as "-" in the same width."""
    return format("-", f">{spec.partition('.')[0] or 1}") if v is None else format(v, spec)


def format_table(result: dict) -> str:
    lines = [f"{result['windows']} windows x {result['seq_len']} tokens of {result['text']}",
             f"{'checkpoint':60s} {'perplexity':>10s} {'KL(src||q)':>11s} {'layer rel. error (last after final norm)'}"]
    for r in result["models"]:
        errs = " ".join(_fmt(e, ".4f") for e in r["layer_rel_error"]) if r["layer_rel_error"] else "-"
        lines.append(f"{r['checkpoint'][-60:]:60s} {_fmt(r['perplexity'], '10.4f')} "
                     f"{_fmt(r['kl_to_source'], '11.5f')} {errs}")
    return "\n".join(lines)


def plot_layer_errors(result: dict, path: str | Path, fmt: str = "png") -> None:
    """Write a plot of the per-layer errors in `fmt` (a format matplotlib writes: png, svg, pdf, ...), whatever
    `path`'s name (a temporary one)."""
    import matplotlib  # (its absence is refused when --plot is parsed: scripts/cli._plot_file)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in result["models"]:
        if r["layer_rel_error"]:
            ax.plot(range(len(r["layer_rel_error"])), r["layer_rel_error"], marker="o",
                    label=f"{Path(r['checkpoint']).name} (KL {r['kl_to_source']:.4f})")
    ax.set_xlabel("decoder layer (last: after the final norm)")
    ax.set_ylabel("relative hidden-state error vs source")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120, format=fmt)
    finally:
        plt.close(fig)
