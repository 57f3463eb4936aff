"""Benchmark: what `glmq validate` costs against one warm read of the checkpoint (issue #4).

One run, one machine, one converted checkpoint (by default the GLM-5 "bench" fixture, generated and
converted under --work):
  (a) read:     every file of the checkpoint read front to back by one thread into a 16 MB buffer,
                after a first read has put it in the page cache; median of 3 reads. The unit of cost.
  (h) hash:     the checksum validate checks by default (xxh3-128 where the manifest records it) of
                every tensor by validate's own reader pool (`scan_shards`, nothing kept): the floor of
                the integrity check, which hashes every byte. hash-sha256: the same with sha256.
                (With a validate that predates xxh3-128, `hash` is sha256 and hash-sha256 is left out.)
  (b) default:  `validate(checkpoint)` with the default --sample.
  (s) sha256:   `validate(checkpoint, sha256=True)`: the integrity check by sha256.
  (c) full:     `validate(checkpoint, sample=1.0)`: the matmul on every quantized module.
  (d) source:   `validate(checkpoint, source)` with the default --sample. It also reads the source
                tensors it compares, so it is given against (a) and against (a) plus a warm read of
                the source (measured like (a)).
  (e) sample-F: `validate(checkpoint, sample=F)` for each --also-sample F.
Each validate runs in a fresh child process, which imports compressed-tensors first and reports that
import apart (a fixed cost of seconds, the same for any checkpoint) before timing the call; the
numba kernels are compiled into their cache once before any timing. The timed call is the process's
first, so it includes loading numba and its cached kernels (~1 s of CPU, also the same for any
checkpoint); the child then times the same call again (`warm_seconds`, `warm_ratio`: kernels loaded,
the per-byte cost alone). Every job is preceded by its own (a), so that each ratio divides by a read
made under the same load (other work may share the cores; the 1-minute load average is recorded around
every job); jobs are interleaved over --repeats rounds, and a job's ratio is the median over rounds of
job / its (a). The CPU seconds of each job (all its threads) over those of its read are reported too
(`cpu_ratio`): on busy shared cores they move less than wall time, which penalises a job that needs
every core more than a one-thread read.

    python scripts/bench_validate.py --work /tmp/vbench --json validate.json
    python scripts/bench_validate.py --checkpoint OUT --source SRC --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from glmq.scripts.bench_rtn import positive_int

_VALIDATE = r"""
import importlib, json, sys, time
t = time.perf_counter()
import glmq.formats.compressed_tensors
ct = time.perf_counter() - t
v = importlib.import_module(sys.argv[1])
kw = json.loads(sys.argv[3])
t, c = time.perf_counter(), time.process_time()
rep = v.validate(sys.argv[2], **kw)
dt, cpu = time.perf_counter() - t, time.process_time() - c
t = time.perf_counter()
v.validate(sys.argv[2], **kw)
warm = time.perf_counter() - t
num = rep.checks["numerics"].details
print(json.dumps({"seconds": dt, "cpu_s": cpu, "warm_seconds": warm, "ct_import_s": ct, "valid": rep.valid,
                  "sampled": num.get("sampled"), "quantized": rep.settings["quantized_modules"],
                  "checksums": rep.checks["integrity"].details.get("checksums"),
                  "timings": getattr(rep, "timings", {})}))
"""

_WARM_NUMBA = r"""
import torch
from glmq.quantize.pack import pack_int32
from glmq.quantize.validate.cpu_kernels import w4a16_matmul_f64
w4a16_matmul_f64(torch.ones(2, 128), pack_int32(torch.zeros(8, 128, dtype=torch.int8)), torch.ones(8, 1), None,
                 (8, 128), 128)
"""


def load() -> float:
    return os.getloadavg()[0]


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file())


def read_all(files: list[Path], buf: memoryview) -> int:
    n = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def warm_read(root: Path, times: int = 3) -> tuple[float, float]:
    """(a): median (wall, CPU) seconds of `times` single-threaded reads of every file, after a warming read."""
    files, buf = files_of(root), memoryview(bytearray(16 << 20))
    read_all(files, buf)
    runs = []
    for _ in range(times):
        t, c = time.perf_counter(), time.process_time()
        read_all(files, buf)
        runs.append((time.perf_counter() - t, time.process_time() - c))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def has_fast_checksum() -> bool:
    """Whether the validate imported here checks xxh3-128 (scan_shards takes an `algorithm`)."""
    import inspect

    from glmq.quantize.validate import scan_shards

    return "algorithm" in inspect.signature(scan_shards).parameters


def hash_floor(root: Path, sha256: bool = False) -> dict:
    """(h): seconds (wall, CPU) for validate's reader pool to hash every tensor (nothing else), with the
    checksum validate checks by default (or sha256)."""
    from glmq.quantize.validate import driver, load_checkpoint, scan_shards

    ck = load_checkpoint(root)
    kw = {}
    if has_fast_checksum():
        from glmq.formats.safetensors_io import SHA256, XXH3_128
        from glmq.quantize.validate.integrity import checksum_choice

        # as validate: shards the manifest does not record get xxh3-128 too
        kw["algorithm"] = {s: SHA256 if sha256 else XXH3_128 for s in ck.shards} | checksum_choice(ck.manifest, sha256)
    t, c = time.perf_counter(), time.process_time()
    with driver._one_intra_op_thread():
        _, errors = scan_shards(ck, set(), None, min(8, driver._cores()), **kw)
    if errors:
        raise RuntimeError(f"read errors: {errors}")
    return {"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "checksums": dict(Counter(kw.get("algorithm", {}).values())) or {"sha256": len(ck.shards)}}


def run_validate(module: str, checkpoint: Path, kwargs: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _VALIDATE, module, str(checkpoint), json.dumps(kwargs)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"validate {kwargs} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["valid"]:
        raise RuntimeError(f"validate {kwargs}: the checkpoint is not valid; benchmark a valid one")
    return res


def prepare(work: Path) -> tuple[Path, Path]:
    """The GLM-5 bench fixture (FP8 block) and its int4-w4a16 conversion, made once under `work`."""
    from glmq.formats import fixtures

    src, out = work / "src", work / "out"
    if not (src / "config.json").exists():
        fixtures.make_checkpoint(src, "glm_moe_dsa", preset="bench", source_format="fp8-block")
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "glmq", "quantize", "--model", str(src), "--output", str(out),
                        "--no-progress"], check=True)
    return src, out


HASH_JOBS = {"hash": False, "hash-sha256": True}  # job -> sha256


def jobs_for(args) -> dict[str, dict]:
    jobs = {"default": {}, "sha256": {"sha256": True}, "full": {"sample": 1.0}}
    if args.source:
        jobs["source"] = {"source": str(args.source)}
    samples = {f"sample-{f:g}": {"sample": f} for f in args.also_sample}
    unknown = [k for k in args.jobs or [] if k not in jobs and k not in samples]
    if unknown:
        raise SystemExit(f"--jobs {' '.join(unknown)}: no such job here; the jobs are {' '.join(jobs)}"
                         + ("" if args.source else " (source needs --source)"))
    jobs = {k: v for k, v in jobs.items() if args.jobs is None or k in args.jobs}
    return jobs | samples  # asked for by value: run whatever --jobs picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmq-validate-bench"),
                    help="where the fixture and its conversion are made when --checkpoint is not given")
    ap.add_argument("--checkpoint", type=Path, default=None, help="a converted checkpoint to validate")
    ap.add_argument("--source", type=Path, default=None, help="its source (default with --work: the fixture)")
    ap.add_argument("--repeats", type=positive_int, default=1, help="rounds of every job (medians reported)")
    ap.add_argument("--also-sample", type=float, nargs="*", default=[], help="extra jobs at these --sample values")
    ap.add_argument("--jobs", nargs="*", default=None,
                    help="validate jobs to run (default all): default sha256 full source; --also-sample's run either way")
    ap.add_argument("--validate-module", default="glmq.quantize.validate",
                    help="module whose validate() is timed (another implementation on PYTHONPATH, for before/after)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    if args.checkpoint is None:
        src, args.checkpoint = prepare(args.work)
        args.source = args.source or src
    subprocess.run([sys.executable, "-c", _WARM_NUMBA], check=True)
    jobs = jobs_for(args)
    hashes = HASH_JOBS if has_fast_checksum() else {"hash": True}
    rounds: list[dict] = []
    for _ in range(args.repeats):
        r = {}
        for name, kwargs in {**dict.fromkeys(hashes), **jobs}.items():
            l0, (read, read_cpu) = load(), warm_read(args.checkpoint)
            read_source = warm_read(args.source)[0] if name == "source" else None
            got = (hash_floor(args.checkpoint, hashes[name]) if kwargs is None
                   else run_validate(args.validate_module, args.checkpoint, kwargs))
            r[name] = got | {"read": read, "read_cpu": read_cpu, "read_source": read_source, "load": [l0, load()]}
        rounds.append(r)
    print(json.dumps(summary(args, rounds), indent=1))


def summary(args, rounds: list[dict]) -> dict:
    med = statistics.median
    ck_bytes = sum(p.stat().st_size for p in files_of(args.checkpoint))
    out = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "cores": os.cpu_count(),
           "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
           "checkpoint": str(args.checkpoint), "checkpoint_bytes": ck_bytes, "source": str(args.source),
           "validate_module": args.validate_module, "repeats": len(rounds),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "jobs": {}}
    reads = [r[name]["read"] for r in rounds for name in r]
    out.update(read_s=med(reads), read_s_range=[min(reads), max(reads)], read_GBps=ck_bytes / med(reads) / 1e9)
    for name in rounds[0]:
        rs = [r[name] for r in rounds]
        job = out["jobs"][name] = {"seconds": med(x["seconds"] for x in rs), "read_s": med(x["read"] for x in rs),
                                   "ratio": med(x["seconds"] / x["read"] for x in rs),
                                   "ratios": [round(x["seconds"] / x["read"], 2) for x in rs],
                                   "cpu_s": med(x["cpu_s"] for x in rs),
                                   "cpu_ratio": med(x["cpu_s"] / x["read_cpu"] for x in rs),
                                   "load": [x["load"] for x in rs]}
        job["checksums"] = rs[0]["checksums"]
        if name.startswith("hash"):
            continue
        job.update(warm_seconds=med(x["warm_seconds"] for x in rs),
                   warm_ratio=med(x["warm_seconds"] / x["read"] for x in rs),
                   warm_ratios=[round(x["warm_seconds"] / x["read"], 2) for x in rs],
                   ct_import_s=med(x["ct_import_s"] for x in rs), sampled=rs[0]["sampled"],
                   quantized=rs[0]["quantized"], timings=rs[-1]["timings"])
        if name == "source":
            job["read_source_s"] = med(x["read_source"] for x in rs)
            job["ratio_to_both_reads"] = med(x["seconds"] / (x["read"] + x["read_source"]) for x in rs)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
