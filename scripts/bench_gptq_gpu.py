"""GPTQ and RTN at GLM-5's real layer shapes on one GPU: seconds per decoder layer, peak memory, projection.

    python -m glmq.scripts.bench_gptq_gpu --work /tmp/g5 --layers 2 --experts 256 --device cuda

Generates a `glm_moe_dsa` checkpoint with the real per-layer shapes of GLM-5 (hidden 6144, 256 routed
experts of 2048, MLA attention with the DSA indexer; random FP8 weights) and `--layers` MoE decoder
layers, then runs in one process:
  1. `glmq quantize --scheme rtn` (the streaming engine) on it;
  2. GPTQ (calibration/engine.py) with `--samples` x `--seq-len` random calibration tokens.
It records wall time, seconds per decoder layer, calibration tokens/s, peak GPU memory
(torch.cuda.max_memory_allocated) and peak host RSS, and projects GLM-5.2 (78 decoder layers + the MTP
layer, which GPTQ leaves to RTN) on one GPU and, splitting each layer's experts across ranks, on 8.
The projection is linear in the layer count (every GLM-5.2 layer but the first three is a MoE layer of this
shape; the three dense ones are cheaper, so it errs high). Writes JSON to `--json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

GLM52_LAYERS = 78


def make_source(work: Path, layers: int, experts: int, preset: str = "bench") -> Path:
    from glmq.formats import fixtures

    src = work / "src"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        fixtures.make_checkpoint(src, "glm_moe_dsa", preset=preset, config_overrides={
            "num_hidden_layers": layers, "first_k_dense_replace": 0, "n_routed_experts": experts,
            "num_nextn_predict_layers": 0, "num_experts_per_tok": min(8, experts)})
    return src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/glmq-g5")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gptq-batch", type=int, default=16)
    ap.add_argument("--experts-per-pass", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-rtn", action="store_true")
    ap.add_argument("--preset", default="bench", choices=["bench", "tiny"], help="tiny: a smoke test of this script")
    ap.add_argument("--json", default="bench_gptq_gpu.json")
    ap.add_argument("--recipe", default="int4-w4a16", help="GPTQ's recipe (a shipped name)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a QuantSpec field of the GPTQ recipe (YAML value syntax), e.g. tune_iters=200")
    a = ap.parse_args()

    from glmq import recipes
    from glmq.calibration.engine import CalibrationSettings, run_gptq
    from glmq.formats.source import open_source
    from glmq.quantize import stream
    from glmq.quantize.plan import make_plan

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    src = make_source(work, a.layers, a.experts, a.preset)
    result = {"layers": a.layers, "experts": a.experts, "samples": a.samples, "seq_len": a.seq_len, "dtype": a.dtype,
              "gptq_batch": a.gptq_batch, "experts_per_pass": a.experts_per_pass, "device": a.device,
              "generate_seconds": round(time.perf_counter() - t0, 1),
              "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors"))}
    cuda = a.device.startswith("cuda")
    if cuda:
        result["gpu"] = torch.cuda.get_device_name()
    source = open_source(src)
    if not a.skip_rtn:
        out = work / "rtn"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        rep = stream.run(make_plan(source, recipes.load("int4-w4a16")), out, a.device, progress=False)
        result["rtn"] = {"seconds": round(time.perf_counter() - t, 2), "throughput_in_GBps": rep["throughput_in_GBps"],
                         "phase_seconds": rep.get("phase_seconds"), "peak_gpu_bytes": rep.get("peak_gpu_bytes")}
        shutil.rmtree(out)
    vocab = source.config["vocab_size"]
    tokens = torch.randint(0, vocab, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(calibration="random tokens", samples=a.samples, seq_len=a.seq_len, dtype=a.dtype,
                                   gptq_batch=a.gptq_batch, experts_per_pass=a.experts_per_pass)
    out = work / "gptq"
    shutil.rmtree(out, ignore_errors=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    from glmq.scripts.bench_gptq import recipe_variant

    recipe = recipes.load(recipe_variant(a.recipe, a.set, "gpu", work)).with_method("gptq")
    result["recipe"] = recipe.to_dict()
    rep = run_gptq(make_plan(source, recipe), out, tokens, settings, device=a.device, progress=True)
    g = rep["gptq"]
    per_layer = [lay["seconds"] for lay in g["layers"]]
    result["gptq"] = {
        "seconds": round(time.perf_counter() - t, 2), "calibration_seconds": g["seconds"],
        "layer_seconds": per_layer, "gptq_solve_seconds": [lay["gptq_seconds"] for lay in g["layers"]],
        "gptq_phase_seconds": [lay.get("gptq_phase_seconds") for lay in g["layers"]],
        "calibration_tokens_per_s": [lay["calibration_tokens_per_s"] for lay in g["layers"]],
        "write_seconds": rep["seconds"], "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_rss_bytes": stream.peak_rss_bytes(), "fallbacks": len(g["fallbacks"]),
        "by_class": g["by_class"], "tune": [lay.get("tune") for lay in g["layers"]],
    }
    shutil.rmtree(out)
    # projection: the slowest measured layer (the first one also builds the rotary tables etc.) for every
    # GLM-5.2 decoder layer, experts scaled to 256, plus writing at the measured RTN rate
    worst = max(range(len(per_layer)), key=per_layer.__getitem__)
    s_layer = per_layer[worst] * 256 / a.experts
    s_solve = result["gptq"]["gptq_solve_seconds"][worst] * 256 / a.experts
    write_s = result["gptq"]["write_seconds"] * GLM52_LAYERS / a.layers * 256 / a.experts
    result["projection_glm52"] = {
        "basis": "slowest measured MoE layer x 256/experts for each of 78 layers, + checkpoint writing scaled alike; "
                 "8 GPUs: each layer's GPTQ solves split across 8 ranks, its calibration forwards and the writing not "
                 "(an upper bound: RTN writing splits by shard)",
        "one_gpu_hours": round((s_layer * GLM52_LAYERS + write_s) / 3600, 2),
        "eight_gpu_hours": round(((s_layer - s_solve + s_solve / 8) * GLM52_LAYERS + write_s) / 3600, 2),
    }
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
