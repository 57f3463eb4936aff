"""A/B of the toolchain under the kernels: the same launches compiled by Triton's bundled ptxas and by another one
(e.g. the CUDA toolkit's), or with other compile-time settings, or from another copy of the package, timed in
alternating processes on one GPU.

    python scripts/ab_ptxas.py --out DIR [--variant cuda13:TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas]
                               [--variant noline:TRITON_DISABLE_LINE_INFO=1] [--rounds 2] [--m 1 4 16] [--only 12288]
    python scripts/ab_ptxas.py --out DIR --base old:PYTHONPATH=/tmp/old --variant new:PYTHONPATH=/tmp/new --m 16

Why a separate process per variant: Triton reads TRITON_PTXAS_PATH and TRITON_DISABLE_LINE_INFO when it compiles,
and its cache is keyed by the toolchain, so each variant gets its own cache directory and process. Each process is
`probe_decode.py --triton-only --no-check`: what `w4a16_matmul_packed` dispatches (the launch table's picks, plain
and as PDL chains), the Triton kernel and cuBLAS fp16, each launch first checked against the float64 reference.
The variants are compiled first (concurrently), then timed round by round, the order of the variants rotating
each round. Writes DIR/ab_ptxas.json and prints, per launch, each variant's median over rounds and its ratio to
the base's (`--base`, by default Triton's own toolchain; < 1: faster; the JSON calls it `vs_bundled`), and the
ratio to cuBLAS fp16 timed in the same process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:KEY=VAL,KEY=VAL' -> (name, env)."""
    name, _, spec = text.partition(":")
    env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    return name, env


def medians(rows_of_rounds: list[list[dict]]) -> dict[tuple, tuple[float, list[float]]]:
    """probe_decode.py result rows, one list per round -> {(shape, m, impl): (median µs, the rounds' µs)}."""
    us: dict[tuple, list[float]] = {}
    for rows in rows_of_rounds:
        for x in rows:
            if x.get("us") is not None and x["impl"] not in ("floor", "read-floor"):
                us.setdefault((x["shape"], x["m"], x["impl"]), []).append(x["us"])
    return {k: (statistics.median(v), v) for k, v in us.items()}


def summarize(runs: dict[str, list[list[dict]]], base: str = "bundled") -> list[dict]:
    """Each variant's launches: median µs over rounds, its ratio to `base`'s median (< 1: faster) and cuBLAS fp16's
    median in the same variant's processes over it (the speed-up, None for cuBLAS itself)."""
    med_of = {name: medians(rounds) for name, rounds in runs.items()}
    ref = med_of[base]
    out = []
    for name, med in med_of.items():
        for key, (us, each) in med.items():
            cub = med.get((key[0], key[1], "cublas-fp16"))
            out.append(dict(variant=name, shape=key[0], m=key[1], impl=key[2], us=us,
                            vs_bundled=us / ref[key][0] if key in ref else None,
                            vs_cublas=cub[0] / us if cub and key[2] != "cublas-fp16" else None, rounds=each))
    return out


def ratios_by_impl(summary: list[dict], base: str = "bundled") -> dict[tuple[str, str], list[float]]:
    """{(variant, impl): its launches' ratios to `base`} for every variant but `base`, cuBLAS left out."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for s in summary:
        if s["variant"] != base and s["impl"] != "cublas-fp16" and s["vs_bundled"] is not None:
            ratios.setdefault((s["variant"], s["impl"]), []).append(s["vs_bundled"])
    return ratios


def probe(variant: tuple[str, dict], unset: set[str], out: Path, log: Path, cache: Path, extra: list[str],
          compile_only: bool) -> int:
    """Run probe_decode.py for one variant (its env over this one's, less `unset`) and return its exit code."""
    name, env = variant
    full = {k: v for k, v in os.environ.items() if k not in unset} | env | {"TRITON_CACHE_DIR": str(cache / name)}
    cmd = [sys.executable, str(HERE / "probe_decode.py"), "--triton-only", "--no-check", "--out", str(out), *extra]
    if compile_only:
        cmd += ["--compile-only", "--workers", "8"]
    with open(log, "w") as f:
        return subprocess.run(cmd, env=full, stdout=f, stderr=subprocess.STDOUT).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VAL,... (repeatable)")
    ap.add_argument("--base", default="bundled:", help="NAME:KEY=VAL,... the reference (default: this environment "
                    "less every variant's keys, i.e. Triton's own toolchain)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--m", nargs="+", default=["1", "4", "16"])
    ap.add_argument("--only", default="")
    ap.add_argument("--cache", default=".glmq-cache/ab-ptxas", help="parent of the variants' Triton caches")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(a.cache).resolve()
    variants = [parse_variant(a.base)] + [parse_variant(v) for v in a.variant]
    extra = ["--m", *a.m] + (["--only", a.only] if a.only else [])

    unset = {k for _, env in variants for k in env}  # each variant runs with its own settings only
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:  # the variants compile side by side
        codes = list(pool.map(lambda v: probe(v, unset, out / f"compile-{v[0]}", out / f"compile-{v[0]}.log", cache,
                                              extra, True), variants))
    for v, code in zip(variants, codes):
        if code != 0:
            sys.exit(f"compiling variant {v[0]} failed: see {out}/compile-{v[0]}.log")
    print(f"compiled {len(variants)} variants in {time.time() - t0:.0f} s", flush=True)

    runs: dict[str, list[list[dict]]] = {v[0]: [] for v in variants}
    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            d = out / f"{v[0]}-{r}"
            t1 = time.time()
            if probe(v, unset, d, out / f"{v[0]}-{r}.log", cache, extra, False) != 0:
                sys.exit(f"variant {v[0]} round {r} failed: see {d}.log")
            runs[v[0]].append(json.loads((d / "probe_decode.json").read_text())["results"])
            print(f"round {r} {v[0]}: {time.time() - t1:.0f} s", flush=True)

    summary = summarize(runs, variants[0][0])
    (out / "ab_ptxas.json").write_text(json.dumps(dict(variants=[dict(name=n, env=e) for n, e in variants],
                                                       rounds=a.rounds, summary=summary), indent=1))
    for s in sorted(summary, key=lambda s: (s["shape"], s["m"], s["impl"], s["variant"])):
        if s["impl"] == "cublas-fp16" or s["vs_bundled"] is None or s["vs_cublas"] is None:
            continue
        print(f"{s['shape']:26} M={s['m']:<3} {s['impl']:12} {s['variant']:9} {s['us']:7.2f} us  "
              f"{s['vs_bundled']:.3f}x base  {s['vs_cublas']:.2f}x cuBLAS  rounds {s['rounds']}")
    for (v, impl), rs in sorted(ratios_by_impl(summary, variants[0][0]).items()):
        print(f"{v} {impl}: median {statistics.median(rs):.3f}x base over {len(rs)} launches "
              f"({min(rs):.3f}-{max(rs):.3f})")


if __name__ == "__main__":
    main()
