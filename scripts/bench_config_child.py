"""Benchmark: the memory of the compressed-tensors config child that `glmq quantize`'s rank 0 keeps for the whole run.

The child (quantize/config_child.py) imports torch and compressed-tensors and builds the quantization_config while
the conversion runs; its peak RSS is the same for any model (the config it builds is a few KB), so a small run
measures it. Each round runs `glmq quantize` in a fresh process on --model (default: the built-in glm5-tiny) into
a fresh output folder and reads the report it writes (glmq_report.json): `config_child_peak_rss_bytes` and the
glmq process's own `peak_rss_bytes`. `glmq plan` quotes the median (quantize/estimate.py FIGURES
"config_child_GB"; tests/test_estimate.py checks the two agree).

    python scripts/bench_config_child.py --json benchmarks/bench_config_child.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def one_run(model: str | None, work: Path) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "glmq", "quantize", "-o", str(out), "--no-progress"]
    cmd += ["--model", model] if model else []
    subprocess.run(cmd, check=True, cwd=work, stdout=subprocess.DEVNULL)
    rep = json.loads((out / "glmq_report.json").read_text())
    return {"config_child_peak_rss": rep["config_child_peak_rss_bytes"], "peak_rss": rep["peak_rss_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="source checkpoint (default: quantize's built-in glm5-tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the raw runs and medians here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="glmq-child-") as tmp:
        runs = [one_run(args.model, Path(tmp)) for _ in range(args.repeats)]
    doc = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "command": " ".join(["python", *sys.argv]), "model": args.model or "builtin:glm5-tiny",
        "versions": {p: metadata.version(p) for p in ("torch", "compressed-tensors")},
        "runs": runs, "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
    }
    for r in runs:
        print(f"config child {r['config_child_peak_rss'] / 1e6:.1f} MB, glmq {r['peak_rss'] / 1e6:.1f} MB")
    print(f"median config child {doc['median']['config_child_peak_rss'] / 1e6:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
