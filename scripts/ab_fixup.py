"""A/B of the shared-x kernel's split-K fix-up on one GPU: the ticket (`WAIT_FIXUP = False`: every program stores
its partial and takes a ticket, the last to arrive sums) against the waiting last split (`WAIT_FIXUP = True`: the
row block's last split waits for the others' partials and adds its own from registers), on the launch table's
configs with a K split, same run, alternating, each launch's output compared bit for bit between the two.

    python scripts/ab_fixup.py --out DIR [--only 12288] [--m 1 4 16] [--rounds 2]

Writes DIR/ab_fixup.json and prints, per shape, M and plain / PDL, the two medians (µs) and new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from bench_kernels import Bench, random_int4
    from probe_decode import SHAPES, compile_all, packed_copies, tag

    from glmq.kernels import w4a16_decode as DK

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--hang-s", type=float, default=0, help="dump every thread's stack after this many seconds")
    a = ap.parse_args(argv)
    if a.hang_s:
        import faulthandler

        faulthandler.dump_traceback_later(a.hang_s, exit=True)
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    b = Bench(dev, 1e9, smoke=False)
    jobs = [(n, k, m, cfg, pdl, 0, "pairs") for shape, (n, k) in SHAPES.items() if a.only in shape for m in a.m
            for pdl in (False, True)
            for cfg in [DK.tuned_config(m, n, k, name, pdl)] if isinstance(cfg, DK.DecodeConfig) and cfg.split > 1]
    for wait in ("0", "1"):  # both fix-ups compiled first, in parallel (the spawned workers read the variable)
        os.environ["GLMQ_WAIT_FIXUP"] = wait
        compile_all(jobs, a.workers)
    res = []
    for shape, (n, k) in SHAPES.items():
        if a.only not in shape:
            continue
        wp, ws = random_int4(n, k, device=dev, seed=5)
        packs = packed_copies(b, wp, ws, "pairs")
        for m in a.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            for pdl in (False, True):
                cfg = DK.tuned_config(m, n, k, name, pdl)
                if not isinstance(cfg, DK.DecodeConfig) or cfg.split <= 1:
                    continue
                outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]
                got, us = {}, {False: [], True: []}
                for rnd in range(a.rounds):
                    for wait in (False, True):
                        print(f"  {shape} M={m} pdl={pdl} round {rnd} wait={wait}", flush=True)
                        DK.WAIT_FIXUP = wait
                        DK.decode_matmul(x, packs[0], outs[0], cfg, pdl=pdl)
                        torch.cuda.synchronize()
                        got.setdefault(wait, outs[0].clone())
                        t, _mode = b.time_us([lambda i=i: DK.decode_matmul(x, packs[i], outs[i], cfg, pdl=pdl)
                                              for i in range(len(packs))])
                        us[wait].append(t)
                DK.WAIT_FIXUP = False
                same = bool(torch.equal(got[False], got[True]))
                old, new = min(us[False]), min(us[True])
                row = dict(shape=shape, m=m, pdl=pdl, config=tag(cfg), old_us=us[False], new_us=us[True],
                           ratio=new / old, same_bits=same)
                res.append(row)
                print(f"{shape} M={m} {'pdl' if pdl else 'plain'} {tag(cfg)}: ticket {old:.2f} us, wait {new:.2f} us, "
                      f"new/old {new / old:.3f}, same bits {same}", flush=True)
        del packs
        torch.cuda.empty_cache()
    ratios = [r["ratio"] for r in res]
    info = dict(device=name, torch=torch.__version__, triton=__import__("triton").__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                median_ratio=statistics.median(ratios) if ratios else None,
                all_same_bits=all(r["same_bits"] for r in res))
    (a.out / "ab_fixup.json").write_text(json.dumps(dict(info=info, results=res), indent=1))
    print(json.dumps(info))
    return 0 if info["all_same_bits"] else 1


if __name__ == "__main__":
    sys.exit(main())
