"""Benchmark: distributed conversion (`torchrun -m glmq quantize`) with 1 rank against N ranks.

One generated FP8 checkpoint with GLM-5's layout and real per-expert shapes (6144x2048, `bench`
preset; `--layers` and `--experts` set how much of a release layer it holds). Jobs:
  1 rank:   `python -m glmq quantize ...` (the single-process path: torch.distributed untouched)
  N ranks:  `python -m torch.distributed.run --standalone --nproc-per-node N -m glmq quantize ...`
`--device cpu` uses gloo, `--device cuda` NCCL with one GPU per rank; `--scheme gptq` calibrates on a
generated text with a byte-level tokenizer (`--samples` x `--seq-len` tokens). Each job runs in fresh
processes, interleaved over --repeats rounds, page cache warmed first; wall time is measured around the
whole command (imports, torchrun start-up, the config child included), and glmq's own report gives the
time from the start of `run()`, the per-rank conversion time and each rank's peak host RSS and peak GPU
allocation. On CUDA a sampler also records each GPU's peak `memory.used` from nvidia-smi (driver,
context and allocator cache included).
Scaling efficiency = t1 / (N * tN). On CPU, by default the single process uses every core (torch and numba
threads) and each of the N ranks gets cores/N of them, so on one machine the ranks only win what one
process leaves idle (I/O, hashing, Python). `--threads-per-rank 1` sets OMP_NUM_THREADS and
NUMBA_NUM_THREADS to 1 for both jobs, which measures what an added rank with its own core buys, the
proxy for another node or GPU host. The outputs are checked to be identical (manifest of per-tensor
sha256, index, config.json, file sizes); their digests are written too, so runs made in different
calls can be compared (`--jobs` picks which rank counts this call runs). The load average is printed
next to the figures: on a shared machine other jobs take cores from the ranks.

    python scripts/bench_dist.py --work /tmp/glmq-bench-dist --repeats 1
    python scripts/bench_dist.py --device cuda --scheme gptq --layers 2 --experts 256 --jobs 1,2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from glmq.scripts.bench_rtn import positive_int

COMPARED = ("model.safetensors.index.json", "config.json")  # byte for byte; the manifest by its tensor records


def quantize_cmd(ranks: int, src: Path, out: Path, extra: list[str]) -> list[str]:
    args = ["quantize", "--model", str(src), "--output", str(out), "--no-progress", *extra]
    if ranks == 1:
        return [sys.executable, "-m", "glmq", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "glmq",
            *args]


def timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        # glmq's own message comes before torchrun's ChildFailedError block: keep the lines that are not
        # traceback frames, from both ends
        lines = [x for x in r.stderr.splitlines() if not x.startswith(("  File ", "    "))]
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({r.returncode}):\n" + "\n".join(lines[:40] + ["..."] + lines[-20:]))
    return dt


def digest(out: Path) -> dict:
    """What must match between two runs: every file's size, every output tensor's sha256 as the manifest
    records it, and the bytes of the index and config.json. (The report and the manifest's own layout,
    e.g. rank fragments merged, may differ.)"""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "glmq_report.json")
    man = json.loads((out / "glmq_manifest.json").read_text())
    tensors = {f: rec["tensors"] for f, rec in sorted(man["files"].items())}
    return {"sizes": {p.name: p.stat().st_size for p in files if p.name != "glmq_manifest.json"},
            "tensors_sha256": hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest(),
            "tensors": sum(len(t) for t in tensors.values()),
            "sha256": {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in COMPARED}}


class GpuSampler:
    """Peak `memory.used` (MiB) per GPU from `nvidia-smi -lms`, while a job runs."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                      "-lms", "200"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                i, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak[i] = max(self.peak.get(i, 0), used)

    def stop(self) -> dict[int, int]:
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=5)
        return dict(sorted(self.peak.items()))


def calibration_args(src: Path, work: Path, samples: int, seq_len: int) -> list[str]:
    """A byte-level tokenizer in the source and a generated text: the CLI's own data path."""
    import random

    from glmq.formats.fixtures import write_byte_tokenizer

    if not (src / "tokenizer.json").exists():
        write_byte_tokenizer(src)
    text = work / "calib.txt"
    rng = random.Random(0)
    words = ["expert", "router", "token", "layer", "quantize", "group", "scale", "the", "of", "and", "weight",
             "shard", "stream", "cache", "kernel", "tensor"]
    text.write_text(" ".join(rng.choice(words) for _ in range(samples * seq_len)))
    return ["--scheme", "gptq", "--calibration", str(text), "--samples", str(samples), "--seq-len", str(seq_len)]


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
    ap.add_argument("--ranks", type=int, default=2, help="the distributed job's rank count (one node)")
    ap.add_argument("--jobs", default=None, help="rank counts to run in this call, e.g. '1,2' (default: 1 and --ranks)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: NCCL, a GPU per rank")
    ap.add_argument("--scheme", default="rtn", choices=["rtn", "gptq"])
    ap.add_argument("--samples", type=int, default=128, help="GPTQ calibration samples")
    ap.add_argument("--seq-len", type=int, default=256, help="GPTQ calibration sequence length")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (default: deleted once digested)")
    ap.add_argument("--repeats", type=positive_int, default=1)
    ap.add_argument("--threads-per-rank", type=int, default=None,
                    help="cap torch and numba threads in every process (default: all cores, shared by the ranks)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = ap.parse_args()

    from glmq.formats import fixtures
    from glmq.scripts.bench_rtn import check_source

    src = args.work / "src-fp8"
    overrides = {"num_hidden_layers": args.layers, "n_routed_experts": args.experts,
                 "num_experts_per_tok": min(8, args.experts)}
    if (src / "config.json").exists():
        check_source(src, overrides)  # one left by a run with other --layers / --experts: refused, not reused
    else:
        fixtures.make_checkpoint(src, "glm_moe_dsa", preset="bench", max_shard_bytes=args.shard_mb * 10**6,
                                 config_overrides=overrides)
    in_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    extra = ["--device", args.device]
    if args.scheme == "gptq":
        extra += calibration_args(src, args.work, args.samples, args.seq_len)
    warm(src)
    env = dict(os.environ)
    if args.threads_per_rank:
        env.update(OMP_NUM_THREADS=str(args.threads_per_rank), NUMBA_NUM_THREADS=str(args.threads_per_rank))
    jobs = [int(x) for x in args.jobs.split(",")] if args.jobs else [1, args.ranks]
    load_before = os.getloadavg()
    runs: dict[int, list[dict]] = {k: [] for k in jobs}
    digests: dict[int, dict] = {}
    for r in range(args.repeats):
        for ranks in runs:
            out = args.work / f"out-{ranks}"
            shutil.rmtree(out, ignore_errors=True)
            sampler = GpuSampler() if args.device == "cuda" else None
            wall = timed(quantize_cmd(ranks, src, out, extra), env)
            gpu_used = sampler.stop() if sampler else None
            rep = json.loads((out / "glmq_report.json").read_text())
            rows = rep["ranks"]
            if args.scheme == "gptq":  # the calibration's peaks, per rank (the writer's are in rep["ranks"])
                cal = {row["rank"]: row for row in rep["gptq"]["ranks"]}
                rows = [{**row, **{k: max(row.get(k, 0), cal[row["rank"]].get(k, 0))
                                   for k in ("peak_rss_bytes", "peak_gpu_bytes") if k in cal[row["rank"]]}}
                        for row in rows]
            runs[ranks].append({"wall_seconds": round(wall, 2), "run_seconds": rep["seconds"],
                                "calibration_seconds": rep["gptq"]["seconds"] if "gptq" in rep else None,
                                "pipeline_seconds": rep["phase_seconds"]["pipeline"],
                                "config_wait_seconds": rep["phase_seconds"]["config_wait"],
                                "gpu_memory_used_peak_MiB": gpu_used,
                                "ranks": rows, "loadavg_1min_after": os.getloadavg()[0]})
            print(f"round {r}, {ranks} rank(s): {wall:.1f} s wall, {rep['seconds']:.1f} s in run()", flush=True)
            digests[ranks] = digest(out)
            if args.out:  # what a killed run leaves behind
                args.out.with_suffix(".partial.json").write_text(json.dumps({"runs": runs, "digests": digests}) + "\n")
            if not args.keep:
                shutil.rmtree(out)
    first = digests[jobs[0]]
    identical = all(d == first for d in digests.values())
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("wall_seconds", "run_seconds")} for k, v in runs.items()}
    # the conversion's own scaling: the slowest rank's pipeline against the single process's
    conv = {k: statistics.median(max(row["seconds"] for row in x["ranks"]) for x in v) for k, v in runs.items()}
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.machine()}",
        "gpus": _gpu_names() if args.device == "cuda" else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": args.device, "scheme": args.scheme,
        "layers": args.layers, "experts": args.experts, "input_bytes": in_bytes,
        "source_shards": len(list(src.glob("*.safetensors"))), "repeats": args.repeats,
        "calibration": {"samples": args.samples, "seq_len": args.seq_len} if args.scheme == "gptq" else None,
        "threads_per_rank": args.threads_per_rank or "all cores / ranks",
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "median": {f"{k}_ranks": v for k, v in med.items()},
        "throughput_in_GBps": {f"{k}_ranks": round(in_bytes / v["wall_seconds"] / 1e9, 3) for k, v in med.items()},
        "conversion_seconds_slowest_rank": {f"{k}_ranks": v for k, v in conv.items()},
        "outputs_identical": identical, "digests": {f"{k}_ranks": v for k, v in digests.items()},
        "runs": {f"{k}_ranks": v for k, v in runs.items()},
    }
    if 1 in med:
        for n in (k for k in med if k > 1):
            summary[f"efficiency_wall_{n}"] = round(med[1]["wall_seconds"] / (n * med[n]["wall_seconds"]), 3)
            summary[f"efficiency_run_{n}"] = round(med[1]["run_seconds"] / (n * med[n]["run_seconds"]), 3)
            summary[f"efficiency_conversion_{n}"] = round(conv[1] / (n * conv[n]), 3)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if not identical:
        sys.exit(f"the outputs of {jobs} ranks differ")


def _gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    main()
