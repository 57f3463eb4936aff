"""Run scripts/bench_kernels.py with the kernels' launch tables looked up as if this GPU were another one.

The launch tables (kernels/tuned_configs.json, tuned_decode*.json, the MoE table) are keyed by the GPU's name (and
the names in their `also_for`), so a GPU no table serves runs on the heuristics. This measures what another GPU's
tables would give here against this GPU's own launch rules in the same call, or (a name no table serves, such as
"untuned") the heuristics against the tables this GPU takes:

    python3 scripts/bench_as_device.py "NVIDIA H200" --no-planes --out OUT/as-h200
    python3 scripts/bench_kernels.py --no-planes --out OUT/own

`--compare DIR_OR_TGZ` prints the median of each glmq column per shape and M over the `own-*` and `as-*` runs that
`scripts/gpu_kernels.sh` PARTS=transfer packs into transfer.tgz, and their ratio (as / own: above 1, own is faster):

    python3 scripts/bench_as_device.py --compare benchmarks/transfer_session36-h100-untuned.tgz

Only the name the tables are looked up by changes (`w4a16_dense.device_name`, as the MoE module imports it); the
multiprocessor count and compute capability stay this GPU's. The bench's own header still names this GPU, and its
`tuned_table` says whether a table serves this GPU's own name, not the one looked up.
"""

from __future__ import annotations

import json
import runpy
import statistics
import sys
import tarfile
from collections import defaultdict
from pathlib import Path


def load_runs(src: Path) -> dict[str, list[dict]]:
    """{"own-0": records, "as-0": records, ...} from a transfer folder or its .tgz."""
    runs = {}
    if src.is_dir():
        for f in sorted(src.glob("*/bench_kernels.json")):
            runs[f.parent.name] = json.loads(f.read_text())["records"]
        return runs
    with tarfile.open(src) as tar:
        for member in tar.getmembers():
            if member.name.endswith("bench_kernels.json"):
                runs[Path(member.name).parent.name] = json.load(tar.extractfile(member))["records"]
    return runs


def compare(runs: dict[str, list[dict]]) -> list[str]:
    """One line per (shape, M, glmq column): the median µs of the own runs and of the others, their ratio, the runs."""
    times: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run, records in runs.items():
        side = "own" if run.startswith("own") else "as"
        for r in records:
            if r["status"] == "ok" and r["impl"].startswith("glmq"):
                times[(r["op"], r["shape"], r["m"], r["impl"])][side].append(r["us"])
    lines = [f"{'shape':30s} {'M':>5s} {'column':16s} {'own':>8s} {'as':>8s} {'as/own':>6s}  runs"]
    for (_, shape, m, impl), t in sorted(times.items()):
        if t["own"] and t["as"]:
            own, other = statistics.median(t["own"]), statistics.median(t["as"])
            lines.append(f"{shape:30s} {m:5d} {impl:16s} {own:8.1f} {other:8.1f} {other / own:6.2f}  "
                         f"{len(t['own'])}/{len(t['as'])}")
    return lines


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == "--compare":
        print("\n".join(compare(load_runs(Path(sys.argv[2])))))
        return
    name = sys.argv[1]
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_moe as MO

    own = D.device_name

    def as_device(device):
        return name if device.type == "cuda" else own(device)

    D.device_name = MO.device_name = as_device
    sys.argv = [str(Path(__file__).with_name("bench_kernels.py")), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
