"""Run scripts/bench_kernels.py with the kernels' launch tables looked up as if this GPU were another one.

The launch tables (kernels/tuned_configs.json, tuned_decode*.json, the MoE table) are keyed by the GPU's name, so a
GPU without its own tables (an H100 against the H200's) runs on the heuristics. This measures what the other GPU's
tables would give here, against the heuristics in the same call:

    python3 scripts/bench_as_device.py "NVIDIA H200" --no-planes --out OUT/as-h200
    python3 scripts/bench_kernels.py --no-planes --out OUT/own

Only the name the tables are looked up by changes (`w4a16_dense.device_name`, as the MoE module imports it); the
multiprocessor count and compute capability stay this GPU's. The bench's own header still names this GPU and says
`tuned_table: false`.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
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
