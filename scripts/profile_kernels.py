"""Launch the W4A16 dense kernels a few times at decode shapes, for `ncu` (scripts/gpu_kernels.sh part "ncu").

    ncu --clock-control none -k regex:_kernel -s 2 -c 6 --section SpeedOfLight ... python scripts/profile_kernels.py

Per shape (N, K) and M: the default PAIRS weights on their chosen config, then the PLANES weights on theirs
(the session-3 kernel), each launched 3 times (the first compiles); ncu skips/profiles by launch count.
"""

from __future__ import annotations

import sys

import torch

from glmq.kernels import w4a16_dense as D

CASES = [(24576, 6144, 16), (6144, 12288, 1), (24576, 6144, 1)]


def main() -> int:
    dev = torch.device("cuda")
    for n, k, m in CASES:
        wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
        ws = (torch.rand(n, k // 128, device=dev) * 0.01 + 0.002).to(torch.bfloat16)
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        for layout, cm in ((D.Layout.PAIRS, True), (D.Layout.PLANES, False)):
            w = D.prepack(wp, ws, 128, layout, cm)
            cfg = D.choose_config(m, n, k, 128, D.sm_count(dev), D.device_name(dev), layout)
            print(f"N={n} K={k} M={m} {layout.value}: {cfg}", file=sys.stderr, flush=True)
            for _ in range(3):
                D.w4a16_matmul_packed(x, w, config=cfg)
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
