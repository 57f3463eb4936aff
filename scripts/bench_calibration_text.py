"""Peak memory and time of reading a plain-text calibration file: tokenized in pieces (calibration/data.py `_pieces`,
the default) against one tokenizer call on the whole text (PIECE_CHARS set past the text's length: glmq before
session 49), alternating, each in a fresh process, on the same file, with the same tokenizer.

    python3 scripts/bench_calibration_text.py --model ../shared/models/glm4moe-prose-fp8 \\
        --text ../shared/models/prose-calib.txt --mb 20 --rounds 3 [--json OUT.json]

The file is the given text repeated to --mb MB. Prints each run's peak RSS (ru_maxrss of the child) and seconds, the
medians, and whether both gave the same token ids (a checksum of the stream).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import hashlib, json, resource, sys, time
import torch
from glmq.calibration import data
model, text, piece = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = data.load_tokenizer(model)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if piece:
    data.PIECE_CHARS = piece
t = time.perf_counter()
ids = data.token_stream(tok, data.iter_file(__import__("pathlib").Path(text)), None)
s = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mb": peak / 1024, "before_mb": base / 1024, "seconds": s, "tokens": ids.numel(),
                  "digest": hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint folder with the tokenizer")
    ap.add_argument("--text", required=True, help="the text to repeat")
    ap.add_argument("--mb", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(args.text).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "calib.txt"
        reps = max(1, int(args.mb * 1e6 / len(base.encode())))
        f.write_text(base * reps)
        size = f.stat().st_size
        print(f"{size / 1e6:.1f} MB of text ({reps} copies of {args.text})")
        runs = {"pieces": [], "one call": []}
        for r in range(args.rounds):
            for name, piece in (("pieces", 0), ("one call", 1 << 40)):
                out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(f), str(piece)], capture_output=True,
                                     text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                runs[name].append(res)
                print(f"round {r + 1} {name:>8}: peak {res['peak_mb']:7.0f} MB (before reading {res['before_mb']:.0f}),"
                      f" {res['seconds']:6.1f} s, {res['tokens']} tokens, ids {res['digest']}")
    med = {k: {"peak_mb": statistics.median(x["peak_mb"] for x in v),
               "seconds": statistics.median(x["seconds"] for x in v)} for k, v in runs.items()}
    same = len({x["digest"] for v in runs.values() for x in v}) == 1
    print(f"median peak: pieces {med['pieces']['peak_mb']:.0f} MB, one call {med['one call']['peak_mb']:.0f} MB "
          f"({med['one call']['peak_mb'] / med['pieces']['peak_mb']:.1f}x); median time: pieces "
          f"{med['pieces']['seconds']:.1f} s, one call {med['one call']['seconds']:.1f} s "
          f"({med['one call']['seconds'] / med['pieces']['seconds']:.2f}x); same ids: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"text_bytes": size, "runs": runs, "median": med, "same_ids": same},
                                              indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
