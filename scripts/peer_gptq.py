"""The peer for scripts/bench_gptq.py: llm-compressor `oneshot` (GPTQ or AutoRound) on a BF16 checkpoint.

Runs in its own virtual environment (`pip install '.[peer]'` or `pip install torch==2.13.0
llmcompressor==0.14.0.1`), imports nothing from glmq, and writes a compressed-tensors checkpoint with
`save_compressed=True`. The calibration tokens come from bench_gptq.py as an int64 `[samples, seq_len]`
tensor, so both tools see exactly the same windows.

Variants (llm-compressor's own knobs, as the issue names them):
  gptq          GPTQModifier defaults (actorder static, dampening 0.01, moe_calibrate_all_experts=True)
  gptq-routed   the same with moe_calibrate_all_experts=False (each expert sees only its routed tokens)
  gptq-noact    actorder=None
  autoround     AutoRoundModifier(iters=200), quantizing only the targets (see below)
  autoround-asis  the same as llm-compressor 0.14.0.1 ships it

AutoRound and targets: llm-compressor 0.14.0.1's AutoRoundModifier tells AutoRound to leave alone only the
*targeted* modules that got no scheme (`get_unquantized_layer_names` matches `resolved_targets` first), so
AutoRound tunes and rounds every other Linear of each decoder layer too (attention, the dense MLP, the
shared experts) with the default scheme, and llm-compressor then writes those as dense weights that are
already on the 4-bit grid, while config.json lists them as ignored. Measured on the shared model with the
experts-only recipe: every such Linear comes back with a relative change of 0.095-0.101 (RTN-sized), and
even iters=0 gives KL 0.034 against glmq RTN's 0.0134. `autoround` patches that one method to name every
Linear of the block without a scheme, so the experts-only recipe quantizes the experts only; with the
every-Linear recipe both variants are the same.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

EXPERT_TARGETS = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]


def modifier(variant: str, targets: str, iters: int = 200):
    scheme = {"targets": EXPERT_TARGETS if targets == "experts" else ["Linear"], "scheme": "W4A16"}
    ignore = ["lm_head", "re:.*mlp\\.gate$"]
    if variant.startswith("gptq"):
        from llmcompressor.modifiers.quantization import GPTQModifier

        kw = {"actorder": None} if variant == "gptq-noact" else {}
        return GPTQModifier(ignore=ignore, **scheme, **kw)
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    if variant == "autoround":
        def unquantized_linears(self, block: torch.nn.Module) -> list[str]:  # AutoRound: leave these in float
            return [n for n, m in block.named_modules()
                    if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None) is None]

        AutoRoundModifier.get_unquantized_layer_names = unquantized_linears
    return AutoRoundModifier(ignore=ignore, iters=iters, enable_torch_compile=False, **scheme)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--variant", choices=["gptq", "gptq-routed", "gptq-noact", "autoround", "autoround-asis"], required=True)
    ap.add_argument("--targets", choices=["experts", "all-linear"], required=True)
    ap.add_argument("--iters", type=int, default=200, help="AutoRound's tuning steps per decoder layer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    tokens = torch.load(a.tokens)
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    oneshot(model=model, dataset=ds, recipe=modifier(a.variant, a.targets, a.iters), max_seq_length=tokens.shape[1],
            num_calibration_samples=tokens.shape[0], moe_calibrate_all_experts=a.variant != "gptq-routed",
            shuffle_calibration_samples=False)
    model.save_pretrained(a.out, save_compressed=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(a.json, "w") as f:
        json.dump({"variant": a.variant, "targets": a.targets, "iters": a.iters, "seconds": seconds, "peak_rss_bytes": peak,
                   "cuda": torch.cuda.is_available(),  # llm-compressor onloads each layer to the GPU when there is one
                   "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}, f)


if __name__ == "__main__":
    main()
