"""Benchmark: distributed RTN (`torchrun -m glmq quantize`, gloo on CPU) with 1 and 2 ranks.

One generated FP8 checkpoint with GLM-5's layout and real per-expert shapes (6144x2048, `bench`
preset; fewer layers and experts than the release so a run takes about a minute). Jobs:
  1 rank:   `python -m glmq quantize ...` (the single-process path: torch.distributed untouched)
  2 ranks:  `python -m torch.distributed.run --standalone --nproc-per-node 2 -m glmq quantize ...`
Each job runs in fresh processes, interleaved over --repeats rounds, page cache warmed first; wall time
is measured around the whole command (imports, torchrun start-up, the config child included), and
glmq's own report gives the time from the start of `run()` and the per-rank conversion time.
Scaling efficiency = t1 / (N * tN). By default the single process uses every core (torch and numba
threads) and each of the N ranks gets cores/N of them, so on one machine the ranks only win what one
process leaves idle (I/O, hashing, Python). `--threads-per-rank 1` sets OMP_NUM_THREADS and
NUMBA_NUM_THREADS to 1 for both jobs (on 2 cores the ranks get one torch thread each anyway), which
measures what an added rank with its own core buys, the proxy for another node or GPU host. The two outputs are checked to be identical (manifest of per-tensor
sha256, index, config.json, file sizes). The load average is printed next to the figures: on a shared
machine other jobs take cores from the ranks.

    python scripts/bench_dist.py --work /tmp/glmq-bench-dist --repeats 1
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

COMPARED = ("glmq_manifest.json", "model.safetensors.index.json", "config.json")


def quantize_cmd(ranks: int, src: Path, out: Path) -> list[str]:
    args = ["quantize", "--model", str(src), "--output", str(out), "--no-progress"]
    if ranks == 1:
        return [sys.executable, "-m", "glmq", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "glmq",
            *args]


def timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dt


def same_output(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != "glmq_report.json")
    if names != sorted(p.name for p in b.iterdir() if p.name != "glmq_report.json"):
        return False
    sizes = all((a / n).stat().st_size == (b / n).stat().st_size for n in names)
    return sizes and all((a / n).read_bytes() == (b / n).read_bytes() for n in COMPARED)


def warm(src: Path) -> None:
    for p in sorted(src.iterdir()):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmq-bench-dist"))
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (plus one MTP layer), all MoE")
    ap.add_argument("--experts", type=int, default=32, help="routed experts per layer (GLM-5: 256)")
    ap.add_argument("--shard-mb", type=int, default=250, help="source shard size; output shards follow them")
    ap.add_argument("--ranks", type=int, default=2, help="the distributed job's rank count (gloo, one node)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads-per-rank", type=int, default=None,
                    help="cap torch and numba threads in every process (default: all cores, shared by the ranks)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = ap.parse_args()

    from glmq.formats import fixtures

    src = args.work / "src-fp8"
    if not (src / "config.json").exists():
        fixtures.make_checkpoint(src, "glm_moe_dsa", preset="bench", max_shard_bytes=args.shard_mb * 10**6,
                                 config_overrides={"num_hidden_layers": args.layers, "n_routed_experts": args.experts})
    in_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    warm(src)
    env = dict(os.environ)
    if args.threads_per_rank:
        env.update(OMP_NUM_THREADS=str(args.threads_per_rank), NUMBA_NUM_THREADS=str(args.threads_per_rank))
    load_before = os.getloadavg()
    runs: dict[int, list[dict]] = {1: [], args.ranks: []}
    for r in range(args.repeats):
        for ranks in runs:
            out = args.work / f"out-{ranks}"
            shutil.rmtree(out, ignore_errors=True)
            wall = timed(quantize_cmd(ranks, src, out), env)
            rep = json.loads((out / "glmq_report.json").read_text())
            runs[ranks].append({"wall_seconds": round(wall, 2), "run_seconds": rep["seconds"],
                                "pipeline_seconds": rep["phase_seconds"]["pipeline"],
                                "config_wait_seconds": rep["phase_seconds"]["config_wait"],
                                "ranks": rep["ranks"], "loadavg_1min_after": os.getloadavg()[0]})
            print(f"round {r}, {ranks} rank(s): {wall:.1f} s wall, {rep['seconds']:.1f} s in run()", flush=True)
    identical = same_output(args.work / "out-1", args.work / f"out-{args.ranks}")
    n = args.ranks
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("wall_seconds", "run_seconds")} for k, v in runs.items()}
    # the conversion's own scaling: the slowest rank's pipeline against the single process's
    conv = {k: statistics.median(max(row["seconds"] for row in x["ranks"]) for x in v) for k, v in runs.items()}
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.machine()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "input_bytes": in_bytes,
        "source_shards": len(list(src.glob("*.safetensors"))), "repeats": args.repeats,
        "threads_per_rank": args.threads_per_rank or "all cores / ranks",
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "median": {f"{k}_ranks": v for k, v in med.items()},
        "conversion_seconds_slowest_rank": {f"{k}_ranks": v for k, v in conv.items()},
        "efficiency_wall": round(med[1]["wall_seconds"] / (n * med[n]["wall_seconds"]), 3),
        "efficiency_run": round(med[1]["run_seconds"] / (n * med[n]["run_seconds"]), 3),
        "efficiency_conversion": round(conv[1] / (n * conv[n]), 3),
        "outputs_identical": identical, "runs": {f"{k}_ranks": v for k, v in runs.items()},
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if not identical:
        sys.exit(f"the {n}-rank output differs from the 1-rank output")


if __name__ == "__main__":
    main()
