"""A/B of the shared-x kernel's split-K fix-up on one GPU: the ticket (`MAILBOX_FIXUP = False`: every program stores
its partial, then takes a ticket; the last to arrive sums) against a per-warp mailbox (`MAILBOX_FIXUP = True`: each
warp takes a start ticket; the warp that started last for its rows polls the others' partial words and sums; split
<= 4 only), on the launch table's configs with a K split.

Per config, first a watchdog pass (`--stress` replays of a CUDA graph of `--launches` launches of each variant,
the whole process killed after `--hang-s` seconds): every output must equal the ticket's bit for bit and the ticket
buffer must be all zero and the mailbox words all empty afterwards. Then the timing, alternating the two
variants in the same process for `--rounds` rounds.

    python scripts/ab_fixup.py --out DIR [--only 12288] [--m 1 4 16] [--rounds 3] [--stress 200] [--hang-s 240]

Writes DIR/ab_fixup.json and prints, per shape, M and plain / PDL, the two medians (µs) and new / old.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def stress(DK, D, x, packs, outs, cfg, pdl, launches: int, replays: int) -> tuple[bool, int]:
    """Replay a graph of `launches` launches `replays` times; (every output equals the first launch's eager output,
    the number of non-zero tickets afterwards)."""
    ref = outs[0].clone()
    calls = [lambda i=i: DK.decode_matmul(x, packs[0], outs[i % len(outs)], cfg, pdl=pdl) for i in range(launches)]
    for o in outs:
        o.fill_(float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(o, ref) for o in outs)
    bad = int(torch.count_nonzero(D._tickets(x.device, 1)))
    for buf in DK._MB_WORDS.values():
        bad += int((buf != -1).sum())
    return same, bad


def main(argv: list[str] | None = None) -> int:
    from bench_kernels import Bench, random_int4
    from probe_decode import SHAPES, compile_all, packed_copies, tag

    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels import w4a16_dense as D

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stress", type=int, default=200, help="graph replays per variant in the watchdog pass")
    ap.add_argument("--launches", type=int, default=64, help="launches per graph in the watchdog pass")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--hang-s", type=float, default=240, help="kill the process (dumping its stack) after this long")
    a = ap.parse_args(argv)
    faulthandler.dump_traceback_later(a.hang_s, exit=True)
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    b = Bench(dev, 1e9, smoke=False)
    jobs = [(n, k, m, cfg, pdl, 0, "pairs") for shape, (n, k) in SHAPES.items() if a.only in shape for m in a.m
            for pdl in (False, True)
            for cfg in [DK.tuned_config(m, n, k, name, pdl)] if isinstance(cfg, DK.DecodeConfig) and cfg.split > 1]
    for mailbox in ("0", "1"):  # both fix-ups compiled first, in parallel (the spawned workers read the variable)
        os.environ["GLMQ_MAILBOX_FIXUP"] = mailbox
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
                label = f"{shape} M={m} {'pdl' if pdl else 'plain'} {tag(cfg)}"
                outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]
                got, us, checks = {}, {False: [], True: []}, {}
                for mailbox in (False, True):
                    DK.MAILBOX_FIXUP = mailbox
                    DK.decode_matmul(x, packs[0], outs[0], cfg, pdl=pdl)
                    torch.cuda.synchronize()
                    got[mailbox] = outs[0].clone()
                    t0 = time.time()
                    checks[mailbox] = stress(DK, D, x, packs, outs, cfg, pdl, a.launches, a.stress)
                    print(f"  {label} mailbox={mailbox}: {a.stress} x {a.launches} launches in {time.time() - t0:.1f} s,"
                          f" outputs equal {checks[mailbox][0]}, non-zero tickets {checks[mailbox][1]}", flush=True)
                for rnd in range(a.rounds):
                    for mailbox in (False, True):
                        DK.MAILBOX_FIXUP = mailbox
                        t, _mode = b.time_us([lambda i=i: DK.decode_matmul(x, packs[i], outs[i], cfg, pdl=pdl)
                                              for i in range(len(packs))])
                        us[mailbox].append(t)
                DK.MAILBOX_FIXUP = False
                same = bool(torch.equal(got[False], got[True]))
                old, new = statistics.median(us[False]), statistics.median(us[True])
                row = dict(shape=shape, m=m, pdl=pdl, config=tag(cfg), old_us=us[False], new_us=us[True],
                           ratio=new / old, same_bits=same,
                           stress_ok=all(c[0] and c[1] == 0 for c in checks.values()))
                res.append(row)
                print(f"{label}: ticket {old:.2f} us, mailbox {new:.2f} us, new/old {new / old:.3f}, same bits {same},"
                      f" stress ok {row['stress_ok']}", flush=True)
        del packs
        torch.cuda.empty_cache()
    ratios = [r["ratio"] for r in res]
    info = dict(device=name, torch=torch.__version__, triton=__import__("triton").__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), stress=[a.stress, a.launches],
                median_ratio=statistics.median(ratios) if ratios else None,
                all_same_bits=all(r["same_bits"] for r in res), all_stress_ok=all(r["stress_ok"] for r in res))
    (a.out / "ab_fixup.json").write_text(json.dumps(dict(info=info, results=res), indent=1))
    print(json.dumps(info))
    return 0 if info["all_same_bits"] and info["all_stress_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
