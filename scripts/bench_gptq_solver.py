"""Time of the GPTQ solve alone (`quantize_gptq_batch`) for the solver options, on synthetic problems.

    python -m glmq.scripts.bench_gptq_solver --shape 8 512 1024 --shape 1 2048 2048 --repeats 3

For each shape (batch B, rows N, columns K) a fixed-seed weight and a correlated-activation Hessian
(rank-64 signal plus noise, as tests/test_gptq.py) are built once; every variant (clip search off /
"block" / "propagated", coordinate-descent sweeps) is timed as the minimum over `--repeats` calls of
`quantize_gptq_batch(..., errors=False)` (what the engine calls) on the current torch threads, after one
untimed call on the first problem (kernel compilation and loading, a cost of the process, not the solve), and its
Hessian error reported relative to RTN. The end-to-end run time is `bench_gptq quality`'s; this isolates
the part the options change. Writes benchmarks/bench_gptq_solver[_<name>].json (`--name`).

    python -m glmq.scripts.bench_gptq_solver --splits 16 8 4 2 1 --shape 16 2048 1024 --name splits

`--splits`: instead, the default options only, the B problems solved in calls of that many at a time
(what the engine's `gptq_batch` chooses); the results do not depend on it on a CPU, the time and the
memory do.

    python -m glmq.scripts.bench_gptq_solver --backends --shape 4 2048 1024 --shape 4 1024 1024 --name backends

`--backends`: the default options solved by the kernels (glmq.quantize.gptq_cpu on a CPU; with `--device
cuda`, glmq.quantize.gptq_triton) and by the torch path they replace, in interleaved rounds (median), and
whether the two give the same integers and scales.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from glmq.quantize.gptq import hessian_error, quantize_gptq_batch
from glmq.quantize.rtn import dequantize, quantize_rtn
from glmq.quantize.spec import QuantSpec
from glmq.scripts.bench_rtn import positive_int

VARIANTS = {  # name: (clip_search, clip_objective, cd_sweeps, scale_refit)
    "plain": (False, "block", 0, 0),
    "clip block": (True, "block", 0, 0),
    "clip propagated": (True, "propagated", 0, 0),
    "clip block + cd4": (True, "block", 4, 0),
    "clip propagated + cd2 (default)": (True, "propagated", 2, 0),
    "clip propagated + cd4": (True, "propagated", 4, 0),
    "clip propagated + cd2 + refit1": (True, "propagated", 2, 1),
    "clip propagated + cd2 + refit2": (True, "propagated", 2, 2),
}


def problem(b: int, n: int, k: int, seed: int = 0, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """B weights and Hessians on `device` (drawn on the CPU, so the same for every device; the Gram products
    are taken on `device`)."""
    g = torch.Generator().manual_seed(seed)
    t = 4 * k
    hs = []
    for _ in range(b):
        x = torch.randn(t, 64, generator=g) @ torch.randn(64, k, generator=g) / 8 + torch.randn(t, k, generator=g)
        x[:, torch.randperm(k, generator=g)[:8]] *= 10
        x = x.to(device)
        hs.append(2 / t * x.T @ x)
    w = (torch.randn(b, n, k, generator=g) * 0.02).to(torch.bfloat16)
    return w.to(device), torch.stack(hs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs=3, type=int, action="append", metavar=("B", "N", "K"))
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="NAME",
                    help=f"time only these variants (\"plain\" is always timed: the ratios' base); among {list(VARIANTS)}")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--splits", nargs="+", type=int, help="time the default options in calls of this many problems")
    ap.add_argument("--name", default="", help="suffix of the result file name")
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--backends", action="store_true", help="the default options: the kernels against the torch path")
    ap.add_argument("--device", default="cpu", help="cpu (numba kernels) or cuda (Triton kernels)")
    ap.add_argument("--profile", action="store_true", help="the default options once under torch.profiler: top ops by time")
    ap.add_argument("--diagnostics", action="store_true",
                    help="the engine's per-problem diagnostics after a solve, timed and profiled (--device)")
    ap.add_argument("--triton-tiles", nargs="+", metavar="ROWSxWARPS",
                    help="--device cuda: time the Triton kernels at these tile rows x warps per program (e.g. 32x4 8x1)")
    args = ap.parse_args()
    if args.splits:
        return splits(args)
    if args.profile:
        return profile(args)
    if args.diagnostics:
        return diagnostics(args)
    if args.triton_tiles:
        return triton_tiles(args)
    if args.backends:
        return backends(args)
    rows = []
    for b, n, k in args.shape or [(8, 512, 1024)]:
        w, h = problem(b, n, k, device=args.device)
        spec0 = QuantSpec(method="gptq", group_size=args.group_size)
        rtn = sum(hessian_error(w[i], dequantize(quantize_rtn(w[i], spec0), args.group_size), h[i]) for i in range(b))
        for name, (clip, objective, sweeps, refit) in VARIANTS.items():
            if args.variants and name != "plain" and name not in args.variants:
                continue
            spec = QuantSpec(method="gptq", group_size=args.group_size, clip_objective=objective, cd_sweeps=sweeps,
                             scale_refit=refit)
            quantize_gptq_batch(w[:1], h[:1], spec, clip_search=clip, errors=False)  # warm-up: kernels compiled, loaded
            _sync(w.device)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = quantize_gptq_batch(w, h, spec, clip_search=clip, errors=False)
                _sync(w.device)
                times.append(time.perf_counter() - t0)
            err = sum(hessian_error(w[i], dequantize(r.qweight, args.group_size), h[i]) for i, r in enumerate(res))
            rows.append({"shape": [b, n, k], "variant": name, "seconds": round(min(times), 3),
                         "error_vs_rtn": round(err / rtn, 4)})
            print(rows[-1], flush=True)
    base = {tuple(r["shape"]): r["seconds"] for r in rows if r["variant"] == "plain"}
    for r in rows:
        r["time_vs_plain"] = round(r["seconds"] / base[tuple(r["shape"])], 2)
    path = _write(rows, args)
    for r in rows:
        print(f"{str(r['shape']):18s} {r['variant']:32s} {r['seconds']:8.3f} s  x{r['time_vs_plain']:<5} "
              f"error/RTN {r['error_vs_rtn']}")
    print(f"wrote {path}")


def splits(args) -> None:
    rows = []
    spec = QuantSpec(method="gptq", group_size=args.group_size)
    dev = torch.device(args.device)
    for b, n, k in args.shape or [(16, 2048, 1024)]:
        w, h = problem(b, n, k, device=dev)
        quantize_gptq_batch(w[:1], h[:1], spec, clip_search=True, errors=False)  # warm-up: kernels compiled, loaded
        for _ in range(args.repeats):  # interleaved rounds: every split size sees the same load
            for c in args.splits:
                _sync(dev)
                t0 = time.perf_counter()
                for b0 in range(0, b, c):
                    quantize_gptq_batch(w[b0:b0 + c], h[b0:b0 + c], spec, clip_search=True, errors=False)
                _sync(dev)
                rows.append({"shape": [b, n, k], "per_call": c, "seconds": round(time.perf_counter() - t0, 3)})
                print(rows[-1], flush=True)
    path = _write(rows, args)
    for shape in {tuple(r["shape"]) for r in rows}:
        for c in args.splits:
            ts = sorted(r["seconds"] for r in rows if tuple(r["shape"]) == shape and r["per_call"] == c)
            print(f"{list(shape)} in calls of {c:3d}: median {ts[len(ts) // 2]:.2f} s over {len(ts)} rounds")
    print(f"wrote {path}")


def backends(args) -> None:
    """The default options solved by the kernels (numba on a CPU, Triton on CUDA: `gptq._kernels`) and by
    the torch path, in interleaved rounds; whether they agree (integers and scales; on CUDA the fraction of
    integers that differ, and each one's Hessian error relative to RTN)."""
    from glmq.quantize import gptq

    dev = torch.device(args.device)
    rows, kernels = [], gptq._kernels
    spec = QuantSpec(method="gptq", group_size=args.group_size)
    for b, n, k in args.shape or [(4, 2048, 1024)]:
        w, h = problem(b, n, k, device=dev)
        quantize_gptq_batch(w[:1], h[:1], spec, clip_search=True, errors=False)  # warm-up: the kernels compiled, loaded
        out = {}
        for _ in range(args.repeats):  # interleaved rounds: both paths see the same load
            for name, pick in (("torch", lambda *a: None), ("kernels", kernels)):
                gptq._kernels = pick
                try:
                    _sync(dev)
                    t0 = time.perf_counter()
                    out[name] = quantize_gptq_batch(w, h, spec, clip_search=True, errors=False)
                    _sync(dev)
                    rows.append({"shape": [b, n, k], "backend": name, "seconds": round(time.perf_counter() - t0, 3)})
                finally:
                    gptq._kernels = kernels
                print(rows[-1], flush=True)
        pairs = list(zip(out["torch"], out["kernels"]))
        same = all(torch.equal(x.qweight.q, y.qweight.q) and torch.equal(x.qweight.scale, y.qweight.scale) for x, y in pairs)
        differ = sum(int((x.qweight.q != y.qweight.q).sum()) for x, y in pairs) / w.numel()
        rtn = sum(hessian_error(w[i], dequantize(quantize_rtn(w[i], spec), args.group_size), h[i]) for i in range(b))
        err = {name: round(sum(hessian_error(w[i], dequantize(r.qweight, args.group_size), h[i])
                               for i, r in enumerate(out[name])) / rtn, 5) for name in out}
        rows.append({"shape": [b, n, k], "same_integers_and_scales": same, "integers_differing": differ,
                     "error_vs_rtn": err})
        print(rows[-1], flush=True)
    path = _write(rows, args)
    for shape in sorted({tuple(r["shape"]) for r in rows}):
        med = {}
        for name in ("torch", "kernels"):
            ts = sorted(r["seconds"] for r in rows if tuple(r["shape"]) == shape and r.get("backend") == name)
            med[name] = ts[len(ts) // 2]
        cmp = next(r for r in rows if tuple(r["shape"]) == shape and "same_integers_and_scales" in r)
        print(f"{list(shape)}: torch {med['torch']:.2f} s, kernels {med['kernels']:.2f} s (median of {args.repeats}), "
              f"{med['torch'] / med['kernels']:.2f}x; same integers and scales: {cmp['same_integers_and_scales']} "
              f"({cmp['integers_differing']:.2e} of the integers differ); error/RTN {cmp['error_vs_rtn']}")
    print(f"wrote {path}")


def profile(args) -> None:
    """Where a default solve's time goes: one warm-up call, then one under torch.profiler, ops by device time."""
    dev = torch.device(args.device)
    spec = QuantSpec(method="gptq", group_size=args.group_size)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for b, n, k in args.shape or [(4, 2048, 1024)]:
        w, h = problem(b, n, k, device=dev)
        quantize_gptq_batch(w, h, spec, clip_search=True, errors=False)  # compiles the kernels
        _sync(dev)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            quantize_gptq_batch(w, h, spec, clip_search=True, errors=False)
            _sync(dev)
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"{[b, n, k]} on {dev}: {time.perf_counter() - t0:.3f} s under the profiler")
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def diagnostics(args) -> None:
    """The engine's per-problem diagnostics after a solve (calibration/layer_gptq.py `_Problem.solve`: RTN,
    three quadratic forms, the results moved to the host), timed for a batch and once under torch.profiler."""
    from types import SimpleNamespace

    from glmq.calibration.collect import Target
    from glmq.calibration.layer_gptq import _Problem, _solve

    dev = torch.device(args.device)
    run = SimpleNamespace(spec=QuantSpec(method="gptq", group_size=args.group_size), device=dev,
                          s=SimpleNamespace(clip_search=True))
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for b, n, k in args.shape or [(4, 2048, 1024)]:
        w, h = problem(b, n, k, device=dev)
        batch = [_Problem([Target(f"m{j}", f"m{j}", None, f"m{j}")], [n], w[j], h[j], "input", h[j], 1000)
                 for j in range(b)]
        _solve(batch, run)
        _sync(dev)
        for rep in range(2):
            t0 = time.perf_counter()
            for p in batch:
                p.solve(run)
            _sync(dev)
            print(f"{[b, n, k]} on {dev}: diagnostics of the batch {time.perf_counter() - t0:.3f} s (round {rep})")
        with torch.profiler.profile(activities=acts) as prof:
            for p in batch:
                p.solve(run)
            _sync(dev)
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))


def triton_tiles(args) -> None:
    """The Triton kernels' launch shape (rows per program x warps), each timed as the best of `--repeats`
    after a compiling call, with whether its integers equal the first tile's."""
    from glmq.quantize import gptq_triton as G

    dev = torch.device(args.device)
    spec = QuantSpec(method="gptq", group_size=args.group_size)
    rows, default = [], (G.T, G.WARPS)
    for b, n, k in args.shape or [(8, 4096, 6144)]:
        w, h = problem(b, n, k, device=dev)
        first = None
        for tile in args.triton_tiles:
            G.T, G.WARPS = (int(x) for x in tile.split("x"))
            try:
                res = quantize_gptq_batch(w, h, spec, clip_search=True, errors=False)  # compiles
                times = []
                for _ in range(args.repeats):
                    _sync(dev)
                    t0 = time.perf_counter()
                    res = quantize_gptq_batch(w, h, spec, clip_search=True, errors=False)
                    _sync(dev)
                    times.append(time.perf_counter() - t0)
            finally:
                G.T, G.WARPS = default
            first = first or res
            same = all(torch.equal(x.qweight.q, y.qweight.q) for x, y in zip(first, res))
            rows.append({"shape": [b, n, k], "tile": tile, "seconds": round(min(times), 4), "same_integers": same})
            print(rows[-1], flush=True)
    print(f"wrote {_write(rows, args)}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _write(rows: list[dict], args) -> Path:
    """The rows with the machine's facts, to benchmarks/bench_gptq_solver[_<name>].json."""
    gpu = torch.cuda.get_device_name() if getattr(args, "device", "cpu") == "cuda" else None
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores" + (f", {gpu}" if gpu else ""),
              "threads": torch.get_num_threads(), "load_before": os.getloadavg(), "torch": torch.__version__,
              "rows": rows}
    Path(args.out).mkdir(exist_ok=True)
    path = Path(args.out) / f"bench_gptq_solver{'_' + args.name if args.name else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


if __name__ == "__main__":
    main()
