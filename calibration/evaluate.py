"""Perplexity and KL divergence of next-token distributions, source vs quantized checkpoints.

Models are read through glmq's own readers (formats/dense.py), written as a plain float copy in a
temporary folder and loaded with transformers' own model class for the config, so no serving engine
is needed and every format goes through the same forward code.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from glmq.formats.dense import dense_config, iter_dense
from glmq.formats.safetensors_io import CheckpointError, read_json_object, save_safetensors


def load_model(checkpoint: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers CausalLM holding the checkpoint's weights, dequantized to `dtype`.

    Raises:
        CheckpointError: a parameter of the model has no tensor in the checkpoint (transformers would leave it
            randomly initialised and every figure would be wrong) or transformers cannot build one from them.
        ValueError: config.json asks for what transformers' classes do not run (`check_transformers_config`).
    """
    import json

    from transformers import AutoModelForCausalLM

    from glmq.calibration.layers import check_transformers_config
    from glmq.formats.families import family_for, layer_index, mtp_layers

    config = dense_config(checkpoint)
    check_transformers_config(checkpoint, config)  # a model transformers' classes do not run as served
    mtp = set(mtp_layers(config))  # transformers' model has no MTP layer: its tensors would be reported unexpected
    # transformers' own class of the family, as the GPTQ layers use (calibration/layers.hf_config): Kimi K2's
    # model_type "kimi_k2" and auto_map name custom code that the temporary folder below does not hold
    config = {k: v for k, v in config.items() if k != "auto_map"} | {
        "model_type": family_for(config, str(Path(checkpoint) / "config.json")).name}
    with tempfile.TemporaryDirectory(prefix="glmq-eval-") as tmp:
        tensors = {k: t for k, t in iter_dense(checkpoint, dtype) if layer_index(k) not in mtp}
        size = sum(t.nbytes for t in tensors.values())
        try:
            save_safetensors(tensors, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
            del tensors
            (Path(tmp) / "config.json").write_text(json.dumps(config))
        except OSError as e:  # a full /tmp: say what the copy is and where it can go instead
            raise OSError(e.errno, f"{e.strerror or e} (the model's temporary copy for transformers, {size / 1e9:.2f} GB "
                                   f"in {tempfile.gettempdir()}; set TMPDIR to a folder with room for it)",
                          e.filename) from e
        try:
            model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, output_loading_info=True)
        except RuntimeError as e:
            raise CheckpointError(f"{checkpoint}: transformers cannot build the model from its tensors ({e}); the "
                                  f"checkpoint is incomplete or of another layout") from e
    bad = sorted(info["missing_keys"]) + sorted(k if isinstance(k, str) else k[0] for k in info["mismatched_keys"])
    if bad:
        raise CheckpointError(f"{checkpoint}: {len(bad)} parameter(s) of {type(model).__name__} have no tensor of "
                              f"their shape in the checkpoint (e.g. {', '.join(bad[:3])}); transformers would leave "
                              f"them random. The checkpoint is incomplete: re-write or re-download it")
    return model.eval()


def token_windows(tokenizer_dir: str | Path, text_file: str | Path, seq_len: int, count: int,
                  trust_remote_code: bool = False) -> torch.Tensor:
    """The first `count` non-overlapping windows of `seq_len` tokens of a text file, `[count, seq_len]`, read as the
    calibration text is (`calibration.data.iter_file`: plain text, or the "text" of .jsonl/.json/.parquet documents
    joined by EOS; `trust_remote_code`: as `calibration.data.load_tokenizer`). The ids are checked against the
    model's vocab_size (config.json in `tokenizer_dir`)."""
    from glmq.calibration.data import check_token_ids, iter_file, load_tokenizer, token_stream

    tok = load_tokenizer(tokenizer_dir, trust_remote_code, error=CheckpointError,
                         fix="the text is tokenized with the source checkpoint's tokenizer: copy tokenizer.json and "
                             "tokenizer_config.json from the original model into it")
    ids = token_stream(tok, iter_file(Path(text_file)), None, prefix=count * seq_len)  # (only what the windows need)
    config = Path(tokenizer_dir) / "config.json"
    cfg = read_json_object(config, "", "re-download it") if config.is_file() else {}
    tokens = ids.numel()
    n = min(count, tokens // seq_len)
    ids = ids[: n * seq_len]
    check_token_ids(ids, tokenizer_dir, cfg, CheckpointError)
    if n == 0:
        raise ValueError(f"{text_file}: {tokens} tokens, shorter than one window of {seq_len} tokens; give more text "
                         f"or a shorter --seq-len")
    if n < count:
        logging.getLogger("glmq").warning("%s: %d tokens make %d windows of %d, fewer than the %d asked for "
                                          "(--windows); the figures are over those %d", text_file, tokens, n, seq_len,
                                          count, n)
    return ids.view(n, seq_len)


@torch.no_grad()
def log_probs(model, windows: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """Next-token log-probabilities `[W, T-1, V]` (float32) for every window."""
    out = []
    for i in range(0, windows.shape[0], batch):
        logits = model(windows[i:i + batch]).logits[:, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


@dataclass
class Scores:
    perplexity: float
    kl_to_source: float | None  # mean per-token KL(source || this)


def perplexity(lp: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean NLL); inf where that overflows a float (a mean NLL above ~709.78: a broken model), nan for NaN
    log-probs."""
    nll = -lp.gather(-1, windows[:, 1:].unsqueeze(-1)).squeeze(-1)
    try:
        return math.exp(nll.double().mean().item())  # nan stays nan
    except OverflowError:  # a mean NLL past ~709.78
        return math.inf


def mean_kl(lp_source: torch.Tensor, lp_other: torch.Tensor) -> float:
    return (lp_source.exp() * (lp_source - lp_other)).sum(-1).double().mean().item()
