"""Benchmark: glmq RTN throughput and peak RSS against the I/O floor and llm-compressor's model_free_ptq.

One run, one machine, one generated FP8 checkpoint with GLM-5's real expert shapes (6144x2048):
  (a) copy:  read every input shard and write the same bytes (64 MB chunks, fsync) -- the I/O floor;
  (b) peer:  llm-compressor `model_free_ptq(scheme="W4A16", converter=FP8BlockDequantizer(...))`,
             experts only (run in its own venv, --peer-python, since it pins its own dependencies);
  (c) glmq:  `glmq quantize --recipe int4-w4a16 --device cpu|cuda`.
Each job runs in a fresh child process; wall time is measured around it and peak RSS is the child's
ru_maxrss. Jobs are interleaved over --repeats rounds and medians are reported. With the peer, the
outputs' quantized tensors (the experts, all the peer quantizes) are compared after the last round, so that
the times are known to be of the same work: `glmq_vs_peer` (the timed glmq job; its recipe's full-range
signed scales are not the peer's absmax / 7.5, so few integers match) and `glmq_ct_rtn_vs_peer` (one more,
untimed glmq run with `full_range: false`, compressed-tensors' own RTN: every module is expected to be
bit-identical, and the script says so on stderr when one is not).

    python scripts/bench_rtn.py --work /tmp/bench --peer-python /tmp/peer-venv/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Each job runs under this small launcher, which reports its children's peak RSS. Linux carries a process's
# ru_maxrss across fork and exec (the forked copy of the parent's memory counts as the child's high-water
# mark), so a job forked straight from a benchmark script that holds a model would report at least the
# script's own RSS (found 2026-12-01 in bench_gptq: 2.65 and 4.79 GB where glmq itself peaked at 1.7-1.8 GB).
# argv: the job's log file ("" = the job's output goes to the launcher's), then the job's command.
_MEASURE = r"""
import contextlib, json, resource, subprocess, sys, time
t = time.perf_counter()
with (open(sys.argv[1], "w") if sys.argv[1] else contextlib.nullcontext()) as f:
    r = subprocess.run(sys.argv[2:], stdout=f, stderr=subprocess.STDOUT if f else None)
dt = time.perf_counter() - t
print(json.dumps({"rc": r.returncode, "seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""

_COPY = r"""
import os, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for name in sorted(os.listdir(src)):
    with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
        while True:
            b = fi.read(64 << 20)
            if not b:
                break
            fo.write(b)
        fo.flush(); os.fsync(fo.fileno())
"""

_PEER = r"""
import sys
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from llmcompressor import model_free_ptq
ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
          "re:.*mlp\\.gate$", "re:.*eh_proj$", "re:.*embed_tokens$", "re:.*shared_head.*"]
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W4A16", ignore=ignore,
               converter=FP8BlockDequantizer(targets=["re:.*"], ignore=["lm_head", "re:.*embed_tokens$", "re:.*eh_proj$", "re:.*mlp\\.gate$", "re:.*weights_proj$", "re:.*shared_head.*", "re:.*norm$"]), device="cpu")
"""


def measure(cmd: list[str], log: Path | None = None, env: dict | None = None) -> dict:
    """Run `cmd` under `_MEASURE`: {"rc", "seconds", "peak_rss"} (bytes, its largest process); raises on rc != 0.
    With `log`, the job's stdout and stderr go to that file."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(log or ""), *cmd], capture_output=True, text=True,
                         env=env)
    line = out.stdout.strip().splitlines()[-1]
    res = json.loads(line)
    if res["rc"] != 0:
        detail = log.read_text()[-3000:] if log else out.stderr[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} failed{f'; see {log}' if log else ''}:\n{detail}")
    return res


def positive_int(text: str) -> int:
    """argparse type of --repeats: 0 rounds would end, after the setup, in a median of nothing."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer >= 1")
    return n


def check_source(src: Path, overrides: dict, preset: str = "bench") -> None:
    """Refuse a checkpoint left in `src` by an earlier run with other options: it would be benchmarked silently
    and reported under this run's --layers / --experts."""
    from glmq.formats.fixtures import make_config

    want = make_config("glm_moe_dsa", preset, **overrides)
    have = json.loads((src / "config.json").read_text())
    keys = ["hidden_size", "moe_intermediate_size", *overrides]
    diff = {k: (have.get(k), want[k]) for k in keys if have.get(k) != want[k]}
    if diff:
        raise SystemExit(f"{src}: holds a checkpoint generated with other options than this run's ("
                         + ", ".join(f"{k} {h} there, {w} asked" for k, (h, w) in diff.items())
                         + "); give another --work, or delete that folder to have it generated again")


def compare_quantized(a: Path, b: Path) -> dict:
    """How far apart two pack-quantized checkpoints' common quantized modules are: the modules stored with a
    `weight_packed` in both, the number whose packed integers and scales are bit-identical, and over the others
    the share of 4-bit integers that differ, the largest integer difference and the largest relative scale
    difference (`ints`: the 4-bit integers of all the common modules), the median |scale| ratio of the differing
    modules (min, median, max over them) and the negative scales of each side (`negative_scales`, of `scales`).
    Reads one tensor at a time (safe_open)."""
    import torch
    from safetensors import safe_open

    from glmq.formats.source import weight_map  # tensor -> shard (index or one file), with its checks
    from glmq.quantize.pack import unpack_int32

    ta, tb = ({k: folder / v for k, v in weight_map(folder).items()} for folder in (a, b))
    modules = sorted(k.removesuffix(".weight_packed") for k in ta.keys() & tb.keys() if k.endswith(".weight_packed"))
    res = {"modules": len(modules), "only_in_first": sum(k.endswith(".weight_packed") for k in ta.keys() - tb.keys()),
           "only_in_second": sum(k.endswith(".weight_packed") for k in tb.keys() - ta.keys()),
           "identical": 0, "ints_differing": 0, "ints": 0, "max_int_diff": 0, "max_scale_rel_diff": 0.0,
           "abs_scale_ratio": None, "negative_scales": [0, 0], "scales": 0, "differing_examples": []}
    ratios: list[float] = []  # per differing module: the median of |first's scale| / |second's scale|

    def get(where: dict[str, Path], name: str):
        with safe_open(str(where[name]), "pt") as f:
            return f.get_tensor(name)

    for m in modules:
        pa, pb = get(ta, m + ".weight_packed"), get(tb, m + ".weight_packed")
        sa, sb = get(ta, m + ".weight_scale"), get(tb, m + ".weight_scale")
        res["ints"] += pa.numel() * 8
        res["scales"] += sa.numel()
        res["negative_scales"][0] += int((sa < 0).sum())
        res["negative_scales"][1] += int((sb < 0).sum())
        same_layout = pa.shape == pb.shape and sa.shape == sb.shape and pa.dtype == pb.dtype
        if same_layout and sa.dtype == sb.dtype and torch.equal(pa, pb) and torch.equal(sa, sb):
            res["identical"] += 1
            continue
        if len(res["differing_examples"]) < 5:
            res["differing_examples"].append(m)
        if not same_layout:
            res["ints_differing"] += pa.numel() * 8
            continue
        k = pa.shape[1] * 8
        qa, qb = unpack_int32(pa, k).to(torch.int16), unpack_int32(pb, k).to(torch.int16)
        d = (qa - qb).abs()
        res["ints_differing"] += int((d != 0).sum())
        res["max_int_diff"] = max(res["max_int_diff"], int(d.max()))
        sa, sb = sa.double(), sb.double()
        rel = ((sa - sb).abs() / sb.abs().clamp_min(1e-30)).max().item()
        res["max_scale_rel_diff"] = max(res["max_scale_rel_diff"], rel)
        ratios.append((sa.abs() / sb.abs().clamp_min(1e-30)).median().item())
    if ratios:
        ratios.sort()
        res["abs_scale_ratio"] = {"min": ratios[0], "median": ratios[len(ratios) // 2], "max": ratios[-1]}
    return res


def ct_rtn_recipe(work: Path) -> Path:
    """The shipped int4-w4a16 recipe with `full_range: false` (compressed-tensors' absmax / 7.5 scales), in `work`."""
    from glmq import recipes

    text = (Path(recipes.__file__).parent / "int4-w4a16.yaml").read_text()
    new = text.replace("full_range: true", "full_range: false", 1)
    if new == text:
        raise SystemExit("recipes/int4-w4a16.yaml has no 'full_range: true' line to turn off; update ct_rtn_recipe")
    path = work / "int4-w4a16-ct-rtn.yaml"
    path.write_text(new)
    return path


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmq-bench"))
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (plus one MTP layer)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peer-python", default=None, help="python of a venv with llmcompressor; omit to skip the peer")
    ap.add_argument("--glmq", default=None, help="command prefix to run glmq (default: this python -m glmq)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = ap.parse_args()

    from glmq.formats import fixtures

    src = args.work / "src-fp8"
    overrides = {"num_hidden_layers": args.layers, "n_routed_experts": args.experts}
    if (src / "config.json").exists():
        check_source(src, overrides)
    else:
        t = time.perf_counter()
        # split_partners=False: llm-compressor's model_free_ptq fails on a shard that holds only scales
        # ("Could not find inverse_weight_map for shard ..."), which the split layout produces.
        fixtures.make_checkpoint(src, "glm_moe_dsa", preset="bench", max_shard_bytes=args.shard_mb * 10**6,
                                 split_partners=False,
                                 config_overrides=overrides)
        print(f"generated {dir_bytes(src) / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
    in_bytes = dir_bytes(src)
    glmq_cmd = (args.glmq.split() if args.glmq else [sys.executable, "-m", "glmq"])
    jobs = {
        "copy": lambda o: [sys.executable, "-c", _COPY, str(src), str(o)],
        "glmq": lambda o: [*glmq_cmd, "quantize", "-m", str(src), "-o", str(o), "--device", args.device, "--no-progress"],
    }
    if args.peer_python:
        jobs["peer"] = lambda o: [args.peer_python, "-c", _PEER, str(src), str(o)]
    for name in os.listdir(src):  # warm the page cache so the first job is not penalised
        with open(src / name, "rb") as f:
            while f.read(64 << 20):
                pass
    results: dict[str, list[dict]] = {k: [] for k in jobs}
    for r in range(args.repeats):
        for name, cmd in jobs.items():
            o = args.work / f"out-{name}"
            shutil.rmtree(o, ignore_errors=True)
            res = measure(cmd(o))
            res["bytes_out"] = dir_bytes(o)
            if (o / "glmq_report.json").exists():  # glmq's own timing: from the start of run(), no imports
                rep = json.loads((o / "glmq_report.json").read_text())
                res["run_seconds"] = rep["seconds"]
                res["stage_busy_seconds"] = rep.get("stage_busy_seconds")
                res["phase_seconds"] = rep.get("phase_seconds")
                res["own_peak_rss"] = rep.get("peak_rss_bytes")  # the glmq process alone (not the config child)
                res["rss_at_start"] = rep.get("rss_at_start_bytes")
            results[name].append(res)
            print(f"round {r} {name}: {res['seconds']:.2f} s, peak RSS {res['peak_rss'] / 1e9:.2f} GB", flush=True)
    med = {k: {"seconds": statistics.median(x["seconds"] for x in v),
               "peak_rss": statistics.median(x["peak_rss"] for x in v),
               "bytes_out": v[-1]["bytes_out"]} for k, v in results.items()}
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    summary = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.machine()}",
        "device": args.device, "input_bytes": in_bytes, "largest_shard": largest, "repeats": args.repeats,
        "median": med, "runs": results,
        "glmq_GBps": in_bytes / med["glmq"]["seconds"] / 1e9,
        "glmq_over_copy": med["glmq"]["seconds"] / med["copy"]["seconds"],
        "glmq_run_seconds_median": statistics.median(x["run_seconds"] for x in results["glmq"]),
        "glmq_stage_busy_last": results["glmq"][-1].get("stage_busy_seconds"),
        "glmq_phase_seconds_last": results["glmq"][-1].get("phase_seconds"),
        "glmq_rss_minus_largest_shard_GB": (med["glmq"]["peak_rss"] - largest) / 1e9,
    }
    if "peer" in med:
        summary["peer_over_copy"] = med["peer"]["seconds"] / med["copy"]["seconds"]
        summary["glmq_over_peer"] = med["glmq"]["seconds"] / med["peer"]["seconds"]
        summary["glmq_vs_peer"] = compare_quantized(args.work / "out-glmq", args.work / "out-peer")  # the last round's
        # the default recipe's full-range scales (signed, max/8) are not the peer's absmax/7.5; with `full_range: false`
        # glmq's RTN is compressed-tensors' own bit for bit (README), so this untimed run must match the peer exactly
        o = args.work / "out-glmq-ct-rtn"
        shutil.rmtree(o, ignore_errors=True)
        measure([*jobs["glmq"](o), "--recipe", str(ct_rtn_recipe(args.work))])
        same = summary["glmq_ct_rtn_vs_peer"] = compare_quantized(o, args.work / "out-peer")
        if same["identical"] != same["modules"] or same["only_in_first"] or same["only_in_second"]:
            print(f"WARNING: glmq with full_range: false is not bit-identical to the peer on "
                  f"{same['modules'] - same['identical']} of {same['modules']} common modules (and "
                  f"{same['only_in_first']} / {same['only_in_second']} only in one output; e.g. "
                  f"{same['differing_examples'][:2]}): the two did not do the same work", file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
