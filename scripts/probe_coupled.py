"""EXPERIMENT (session 28): the coupled kernel (`kernels/w4a16_coupled.py`: an SM's three 64-row wgmma tiles as the
three warpgroups of one program, sharing x's ring) against the launch table's shared-x kernel, same process,
alternating rounds, CUDA-graph replay with the weights rotated past L2 (bench_kernels.Bench).

Every variant is first checked: its output must equal the table config's bit for bit (the same chunks in the same
order per 64-row tile, the partials summed in split order) and match the float reference. A watchdog ends the
process if a launch hangs.

    python3 scripts/probe_coupled.py --out $OUT/coupled [--m 16] [--rounds 3] [--only 12288]
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"dense 12288->6144": (6144, 12288), "dense 6144->24576": (24576, 6144),
          "expert w13 6144->2x2048": (4096, 6144), "expert w2 2048->6144": (6144, 2048)}
VARIANTS = {"coupled": dict(shared=True, strip=True), "uncoupled": dict(shared=False, strip=True),
            "coupled-maxnreg": dict(shared=True, strip=False),
            "coupled-one": dict(shared=True, one=True), "uncoupled-one": dict(shared=False, one=True),
            "ms-coupled": dict(shared=True, ms=True), "ms-uncoupled": dict(shared=False, ms=True),
            "ms-coupled-one": dict(shared=True, one=True, ms=True),
            "ms-uncoupled-one": dict(shared=False, one=True, ms=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=[16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--ncu", default="", help="launch this variant (or 'table') three times at --only's shape and "
                                             "the first --m, for ncu (-s 2 -c 1), and exit")
    a = ap.parse_args()
    if a.ncu:
        return ncu_launches(a)
    faulthandler.dump_traceback_later(a.budget_s + 120, exit=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from bench_kernels import Bench, random_int4, rel_err
    from probe_decode import GROUP, packed_copies, tag

    import torch.nn.functional as F
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_coupled as C
    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels.w4a16_decode import DecodeConfig

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    b = Bench(dev, a.budget_s, smoke=False)
    res, checks = [], []
    for shape, (n, k) in SHAPES.items():
        if a.only not in shape:
            continue
        wp, ws = random_int4(n, k, device=dev, seed=1)
        w32 = R.dequantize_packed(wp, ws, GROUP)
        packs = packed_copies(b, wp, ws, "pairs")
        w16 = [w32.to(torch.float16) for _ in range(b.copies(n * k * 2))]
        for m in a.m:
            table = DK.tuned_config(m, n, k, name, False)
            if not isinstance(table, DecodeConfig) or not table.split:
                print(f"{shape} M={m}: table pick {table} is not the shared-x kernel; skipped")
                continue
            cfg = DecodeConfig(16, 4, min(table.depth, 3) if table.wgmma else 3, split=table.split,
                               ring=min(table.ring, 4), wgmma=True)
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w32.T
            outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]
            want = DK.decode_matmul(x, packs[0], torch.empty(m, n, dtype=x.dtype, device=dev), table).clone()
            cfg_ms = dataclasses.replace(cfg, wgmma=False)
            want_of = {c: DK.decode_matmul(x, packs[0], torch.empty(m, n, dtype=x.dtype, device=dev), c).clone()
                       for c in (cfg, cfg_ms)}
            fns = {f"table {tag(table)}": lambda i: DK.decode_matmul(x, packs[i], outs[i], table)}
            for c in (cfg, cfg_ms):
                if c != table and (c is cfg or any(VARIANTS[v].get("ms") for v in a.variants)):
                    fns[f"xshared {tag(c)}"] = lambda i, c=c: DK.decode_matmul(x, packs[i], outs[i], c)
            for v in a.variants:
                kw = dict(VARIANTS[v])
                vc = cfg_ms if kw.pop("ms", False) else cfg
                want_cfg = want_of[vc]
                y = C.coupled_matmul(x, packs[0], torch.full((m, n), float("nan"), dtype=x.dtype, device=dev), vc,
                                     **kw)
                torch.cuda.synchronize()
                row = dict(shape=shape, m=m, variant=v, cfg=tag(vc), rel_err=rel_err(y, ref),
                           same_bits=bool(torch.equal(y, want_cfg)))
                y2 = C.coupled_matmul(x, packs[0], torch.empty(m, n, dtype=x.dtype, device=dev), vc, **kw)
                row["repeat_same_bits"] = bool(torch.equal(y, y2))
                checks.append(row)
                print("check", json.dumps(row), flush=True)
                if row["rel_err"] < 3e-2:
                    fns[v] = lambda i, kw=kw, vc=vc: C.coupled_matmul(x, packs[i], outs[i], vc, **kw)
            xd = x.to(torch.float16)
            fns["cublas-fp16"] = None
            times = {key: [] for key in fns}
            for r in range(a.rounds):
                for key, fn in fns.items():
                    if fn is None:
                        us, _ = b.time_us([lambda w=w: F.linear(xd, w) for w in w16])
                    else:
                        us, _ = b.time_us([lambda i=i, fn=fn: fn(i) for i in range(len(packs))])
                    times[key].append(us)
                    print(f"round {r} {shape} M={m} {key}: {us:.2f} us", flush=True)
            base = statistics.median(times[f"table {tag(table)}"])
            cub = statistics.median(times["cublas-fp16"])
            for key, ts in times.items():
                med = statistics.median(ts)
                res.append(dict(shape=shape, m=m, impl=key, us=ts, median=med, vs_table=med / base,
                                x_cublas=cub / med))
                print(f"== {shape} M={m} {key:28} {med:7.2f} us  {med / base:.3f}x table  {cub / med:.2f}x cuBLAS "
                      f"fp16", flush=True)
        del packs, w16, w32
        torch.cuda.empty_cache()
    info = dict(device=name, torch=torch.__version__, triton=__import__("triton").__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rounds=a.rounds)
    (out / "probe_coupled.json").write_text(json.dumps(dict(info=info, checks=checks, results=res), indent=1))


def ncu_launches(a) -> None:
    from bench_kernels import random_int4
    from probe_decode import GROUP

    from glmq.kernels import w4a16_coupled as C
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_decode as DK

    dev = torch.device("cuda")
    (n, k), m = next(v for key, v in SHAPES.items() if a.only in key), a.m[0]
    wp, ws = random_int4(n, k, device=dev, seed=1)
    w = D.prepack(wp, ws, GROUP, "pairs")
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=x.dtype, device=dev)
    table = DK.tuned_config(m, n, k, torch.cuda.get_device_name(dev), False)
    for _ in range(3):
        if a.ncu == "table":
            DK.decode_matmul(x, w, out, table)
        elif a.ncu == "xshared-ms":
            DK.decode_matmul(x, w, out, dataclasses.replace(table, wgmma=False))
        else:
            kw = dict(VARIANTS[a.ncu])
            C.coupled_matmul(x, w, out, dataclasses.replace(table, wgmma=not kw.pop("ms", False)), **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
