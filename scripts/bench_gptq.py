"""GPTQ against llm-compressor, in one run: quality on the shared trained model, time and memory at scale.

    python -m glmq.scripts.bench_gptq quality --shared ../shared/models [--peer-python /tmp/peer-venv/bin/python]
    python -m glmq.scripts.bench_gptq scaling --layers 4 8 16
    python -m glmq.scripts.bench_gptq quality --peers --seeds 0 1 2 --set cd_sweeps=0 --tag cd0 --name solver

quality: the shared GLM-4.x MoE (FP8), calibration 128 x 256 tokens of prose-calib.txt (seed 0 by default;
    `--seeds` repeats glmq's GPTQ for other calibration draws, `--peer-seeds` the peers'), evaluation
    the first 96 windows of 256 tokens of prose-eval.txt in float32 (`glmq eval`'s protocol). For each recipe
    (routed experts only; every FP8 linear) it runs glmq RTN, glmq GPTQ, and the peer's GPTQ (default,
    routed-only Hessians, no act-order) and AutoRound on the model dequantized to BF16 (the peer cannot read
    block FP8), all on the same token windows, then evaluates every output through the same reader.
    `--set KEY=VALUE` overrides QuantSpec fields of glmq's GPTQ recipe (a copy of the shipped recipe in the
    work folder) and `--tag` names that variant; `--no-rtn` skips glmq RTN.
scaling: a generated random-weight GLM-4.x MoE (hidden 1024, 16 routed experts top-4, the shared model's
    tokenizer and vocabulary), 64 x 256 calibration tokens, at several layer counts: wall time and peak RSS
    of `glmq quantize --scheme gptq` against the peer's default GPTQ.

Each tool runs as its own process under a small launcher (bench_rtn.measure: its children's ru_maxrss), so
the peak RSS is that of the job's largest process and the wall time includes imports and writing.
Results go to benchmarks/bench_gptq_<mode>[_<name>].json and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from glmq.scripts.bench_rtn import measure

RECIPES = {"experts": "int4-w4a16", "all-linear": "int4-w4a16-all-linear"}
PEER_VARIANTS = ("gptq", "gptq-routed", "gptq-noact", "autoround", "autoround-asis")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def timed(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run `cmd` to completion (bench_rtn.measure: a small launcher, so the peak RSS is the job's own)."""
    r = measure(cmd, log, env)
    return {"seconds": round(r["seconds"], 2), "peak_rss_bytes": r["peak_rss"]}


def dense_copy(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint dequantized to BF16 (glmq's reader), with its tokenizer: what the peer reads."""
    from glmq.formats.dense import dense_config, iter_dense

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    save_file(dict(iter_dense(src, torch.bfloat16)), str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = dense_config(src)
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def glmq_run(src: Path, out: Path, recipe: str, scheme: str, calib: Path, samples: int, work: Path,
             seed: int = 0, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "glmq", "quantize", "--model", str(src), "--output", str(out), "--recipe", recipe,
           "--scheme", scheme, "--no-progress", "--json", str(work / f"{out.name}.report.json")]
    if scheme == "gptq":
        cmd += ["--calibration", str(calib), "--samples", str(samples), "--seq-len", "256", "--seed", str(seed),
                *extra]
    return timed(cmd, work / f"{out.name}.log")


def recipe_variant(recipe: str, overrides: list[str], tag: str, work: Path) -> str:
    """The shipped recipe with QuantSpec fields overridden (`KEY=VALUE`, YAML values), as a file in `work`."""
    import yaml

    from glmq import recipes

    if not overrides:
        return recipe
    d = yaml.safe_load((recipes.RECIPE_DIR / f"{recipe}.yaml").read_text())
    for kv in overrides:
        k, _, v = kv.partition("=")
        d[k] = yaml.safe_load(v)
    path = work / f"{recipe}-{tag or 'variant'}.yaml"
    path.write_text(yaml.safe_dump(d))
    recipes.load(str(path))  # fail here, not in the child, on a bad key or value
    return str(path)


def peer_run(peer_python: str, dense: Path, tokens: Path, variant: str, targets: str, out: Path, work: Path,
             peer_path: str = "") -> dict:
    """The peer in its own interpreter; PYTHONPATH is `peer_path` (default empty: glmq's path is not inherited)."""
    here = Path(__file__).with_name("peer_gptq.py")
    js = work / f"{out.name}.peer.json"
    cmd = [peer_python, str(here), "--model", str(dense), "--tokens", str(tokens), "--variant", variant,
           "--targets", targets, "--out", str(out), "--json", str(js)]
    r = timed(cmd, work / f"{out.name}.log", env={**os.environ, "PYTHONPATH": peer_path})
    pj = json.loads(js.read_text())
    return r | {"seconds_in_process": pj["seconds"], "peer_cuda": pj.get("cuda", False),
                "peer_peak_gpu_bytes": pj.get("peak_gpu_bytes", 0)}


def calibration_tokens_file(src: Path, calib: Path, samples: int, work: Path, seed: int = 0) -> Path:
    """The calibration draw `glmq quantize --seed seed` makes, as a file for the peer."""
    from glmq.calibration.data import calibration_tokens

    path = work / f"tokens-{samples}x256{f'-seed{seed}' if seed else ''}.pt"
    torch.save(calibration_tokens(src, str(calib), samples, 256, seed), path)
    return path


def quality(args) -> dict:
    from glmq.calibration.compare import compare

    shared = Path(args.shared)
    src, calib, text = shared / "glm4moe-prose-fp8", shared / "prose-calib.txt", shared / "prose-eval.txt"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokens = {s: calibration_tokens_file(src, calib, 128, work, s) for s in args.peer_seeds}
    dense = dense_copy(src, work / "bf16")
    rows = []
    for targets in args.recipes:
        recipe = RECIPES[targets]
        gptq_recipe = recipe_variant(recipe, args.set, args.tag, work)
        runs = [] if args.no_rtn else [("glmq rtn", lambda o: glmq_run(src, o, recipe, "rtn", calib, 128, work))]
        runs += [(f"glmq gptq{' ' + args.tag if args.tag else ''}{f' seed{s}' if s else ''}",
                  lambda o, s=s: glmq_run(src, o, gptq_recipe, "gptq", calib, 128, work, s, args.cli_arg) | {
                      "seed": s, "set": args.set, "cli_args": args.cli_arg}) for s in args.seeds]
        runs += [(f"llm-compressor {v}{f' seed{s}' if s else ''}",
                  lambda o, v=v, s=s: peer_run(args.peer_python, dense, tokens[s], v, targets, o, work, args.peer_path)
                  | {"seed": s}) for v in args.peers for s in args.peer_seeds]
        for label, fn in runs:
            out = work / f"{targets}-{label.replace(' ', '-')}"
            done = work / f"{out.name}.row.json"  # a rerun reuses finished runs (the peers take long)
            if done.exists() and (out / "config.json").exists():
                row = json.loads(done.read_text())
                asked = {"set": args.set, "cli_args": args.cli_arg}
                if "set" in row and {k: row.get(k) for k in asked} != asked:  # a glmq gptq row of another variant
                    raise SystemExit(f"{done}: a finished {label!r} run with --set {row.get('set')} --cli-arg "
                                     f"{row.get('cli_args')}, not this run's {args.set} {args.cli_arg}; name this "
                                     f"variant with --tag, or use another --work")
                rows.append(row)
                continue
            shutil.rmtree(out, ignore_errors=True)
            print(f"[{targets}] {label} ...", flush=True)
            rows.append({"recipe": targets, "tool": label, "checkpoint": str(out)} | fn(out))
            done.write_text(json.dumps(rows[-1]))
    print("evaluating ...", flush=True)
    ev = compare(src, [r["checkpoint"] for r in rows], text, seq_len=256, windows=96)
    for r, m in zip(rows, ev["models"][1:]):
        r |= {"perplexity": round(m["perplexity"], 4), "kl": round(m["kl_to_source"], 5),
              "layer_rel_error": m["layer_rel_error"]}
    return {"source_perplexity": round(ev["models"][0]["perplexity"], 4), "rows": rows}


def scaling(args) -> dict:
    from glmq.formats import fixtures

    shared = Path(args.shared)
    calib = shared / "prose-calib.txt"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.layers:
        src = work / f"random-{n}L-fp8"
        if not (src / "config.json").exists():
            shutil.rmtree(src, ignore_errors=True)
            fixtures.make_checkpoint(src, "glm4_moe", preset="bench", config_overrides={
                "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 1024, "n_routed_experts": 16,
                "num_experts_per_tok": 4, "num_hidden_layers": n, "first_k_dense_replace": 1, "vocab_size": 4096,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "num_nextn_predict_layers": 0})
            for name in TOKENIZER_FILES:
                shutil.copy(shared / "glm4moe-prose-fp8" / name, src / name)
        tokens = calibration_tokens_file(src, calib, 64, work)
        dense = dense_copy(src, work / f"random-{n}L-bf16")
        params = (dense / "model.safetensors").stat().st_size // 2  # bf16: two bytes a parameter
        for label in ("glmq gptq", "llm-compressor gptq"):
            out = work / f"scaling-{n}L-{label.replace(' ', '-')}"
            shutil.rmtree(out, ignore_errors=True)
            print(f"[{n} layers] {label} ...", flush=True)
            if label.startswith("glmq"):
                r = glmq_run(src, out, "int4-w4a16", "gptq", calib, 64, work)
            else:
                r = peer_run(args.peer_python, dense, tokens, "gptq", "experts", out, work, args.peer_path)
            rows.append({"layers": n, "tool": label, "parameters": params} | r)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["quality", "scaling"])
    ap.add_argument("--shared", default=os.environ.get("GLMQ_SHARED", "../shared") + "/models")
    ap.add_argument("--peer-python", default="/tmp/peer-venv/bin/python")
    ap.add_argument("--peer-path", default="", metavar="PYTHONPATH",
                    help="PYTHONPATH of the peer's interpreter (e.g. a folder of carried wheels on a machine without a venv)")
    ap.add_argument("--work", default="/tmp/glmq-bench-gptq")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--peers", nargs="*", default=list(PEER_VARIANTS[:4]), choices=list(PEER_VARIANTS),
                    help="peer variants to run (default: all but autoround-asis); none: glmq only")
    ap.add_argument("--layers", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="quality: glmq GPTQ calibration draws")
    ap.add_argument("--peer-seeds", nargs="+", type=int, default=[0],
                    help="quality: the peers' calibration draws (the same draws as glmq's --seed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="quality: QuantSpec override for glmq GPTQ (repeatable)")
    ap.add_argument("--cli-arg", action="append", default=[], metavar="ARG",
                    help="quality: an extra `glmq quantize` argument for the GPTQ runs (e.g. --cli-arg=--all-token-limit=8)")
    ap.add_argument("--tag", default="", help="quality: name of the --set variant in labels and folders")
    ap.add_argument("--no-rtn", action="store_true", help="quality: skip glmq RTN")
    ap.add_argument("--name", default="", help="suffix of the result file name")
    ap.add_argument("--out", default="benchmarks")
    args = ap.parse_args()
    result = (quality if args.mode == "quality" else scaling)(args)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    result |= {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores{gpu}",
               "load_before": os.getloadavg(), "torch": torch.__version__}
    Path(args.out).mkdir(exist_ok=True)
    path = Path(args.out) / f"bench_gptq_{args.mode}{'_' + args.name if args.name else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print({k: v for k, v in r.items() if k not in ("layer_rel_error", "checkpoint")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
