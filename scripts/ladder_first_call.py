"""What `w4a16_decode.choose` settles on at the first call of every decode launch-table entry, on this GPU and Triton.

Under a Triton other than the one a table was timed with, a pick may compile to more registers and lose a program an
SM (kernels/NOTES.md, sessions 42 and 44); `choose` then walks to the table's runner-ups, and since session 49 it
compiles each config ahead of its first launch (`_compile_ahead`), so the first call already settles. For each entry
this prints the pick, what the first `choose` returned, what each config on the way compiled to, and whether the walk
settled in that one call (nothing launched here). `scripts/sass_digest.py --ladder SMS` predicts the same walk from
ahead-of-time compiles, without a GPU.

    PYTHONPATH=<a folder holding the checkout as glmq> python3 scripts/ladder_first_call.py [--m 16 32] [--pdl]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=None, help="the table's M values to walk (default: all)")
    ap.add_argument("--pdl", action="store_true", help="the PDL entries instead of the plain ones")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import triton

    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels import w4a16_dense as D

    dev = torch.device("cuda")
    name = D.device_name(dev)
    table = DK._table(str(DK.TUNED_PATHS[D.Layout.PAIRS]))
    if not D.table_serves(table, name):
        print(f"no decode table serves {name}")
        return 1
    print(f"{name}, Triton {triton.__version__}, table timed with Triton {table.get('triton')}")
    rows = []
    for shape, by_m in table.get("decode", {}).items():
        n, k, _ = map(int, shape.split(","))
        w = D.prepack(torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev),
                      torch.full((n, k // 128), 0.01, dtype=torch.bfloat16, device=dev), 128)
        for m_text in by_m:
            m = int(m_text)
            if args.m and m not in args.m:
                continue
            pick = DK.tuned_config(m, n, k, name, args.pdl)
            if not isinstance(pick, DK.DecodeConfig):
                continue
            t = time.perf_counter()
            got = DK.choose(m, w, dev, name, args.pdl)
            seconds = time.perf_counter() - t
            walk = [pick, *(c for c, _ in DK.tuned_alternates(m, n, k, name, args.pdl))]
            settled = (m, n, k, args.pdl, D.Layout.PAIRS, name) in DK._SETTLED
            row = {"shape": [n, k], "m": m, "pick": str(pick), "first_call": str(got), "settled": settled,
                   "compiled": {str(c): DK._COMPILED.get(DK._compile_key(c, m, k, args.pdl, False)) for c in walk},
                   "choose_s": round(seconds, 3)}
            rows.append(row)
            print(f"{n}x{k} M={m}: {'pick' if got == pick else 'GAVE WAY -> ' + str(got)}, "
                  f"settled={settled}, {seconds:.2f} s, compiled {list(row['compiled'].values())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "triton": triton.__version__, "rows": rows}, indent=1))
    return 0 if all(r["settled"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
