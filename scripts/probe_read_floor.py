"""What a plain streaming read of a GEMM's weight bytes takes at that size, beside the bench's read floor.

    python scripts/probe_read_floor.py --out DIR      # on the GPU; ~30 s

The bench's read floor (scripts/bench_kernels.py, `Bench.measure_read_rate`) divides a shape's packed + scale bytes by
the rate `torch.amax` reaches over 1 GiB: a pure bandwidth figure, with no launch, ramp-up or tail in it. A 10-40 µs
kernel pays those too. This times, the bench's way (CUDA-graph replays, buffers rotated past L2), `torch.amax` and a
device-to-device copy over exactly each dense shape's byte count, so that a kernel's time can also be read against
the best a library streaming read of its bytes does in one launch. Writes DIR/probe_read_floor.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DENSE, SQUARE, Bench, packed_bytes, random_int4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    b = Bench(dev, budget_s=300, smoke=False)
    shapes = {SQUARE[0]: (SQUARE[1], SQUARE[2]), **DENSE}
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = packed_bytes(*random_int4(n, k, device=dev, seed=0))  # the bytes the bench's floors count
        elems = nbytes // 4
        bufs = [torch.randn(elems, device=dev) for _ in range(b.copies(nbytes))]
        dsts = [torch.empty_like(t) for t in bufs]
        amax_us, _ = b.time_us([lambda t=t: torch.amax(t) for t in bufs])
        copy_us, _ = b.time_us([lambda s=s, d=d: d.copy_(s) for s, d in zip(bufs, dsts)])
        rows.append(dict(shape=name, bytes=nbytes, read_floor_us=nbytes / b.read_rate * 1e6, amax_us=amax_us,
                         copy_us=copy_us))
        del bufs, dsts
        torch.cuda.empty_cache()
    info = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, read_rate=b.read_rate,
                copy_rate=b.copy_rate, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_read_floor.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    print(json.dumps(info))
    print(f"{'shape':26} {'MB':>7} {'read floor':>10} {'amax':>8} {'copy':>8} {'floor/amax':>10}")
    for r in rows:
        print(f"{r['shape']:26} {r['bytes'] / 1e6:7.2f} {r['read_floor_us']:8.2f}us {r['amax_us']:6.2f}us "
              f"{r['copy_us']:6.2f}us {r['read_floor_us'] / r['amax_us'] * 100:9.0f}%")


if __name__ == "__main__":
    main()
