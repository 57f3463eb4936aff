"""Session 33 review: defects found in the changes since 3e04eb9, each with a test that failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The split-K reduction of the dense kernels (`_write_tile`) read split s's fp32 partial at `ws + s * (M * N)` in
# int32: with M x max(N, K) below w4a16_dense.INDEX_LIMIT (one launch), M x N >= 2^30 and split_k >= 3 wrapped
# the offset negative and read far outside the scratch (a segfault in the interpreter; wrong bits or a fault on a
# GPU). Only output tile 0 is launched (a grid shim), so the interpreter computes one 64 x 128 tile; the
# [M, K] / [M, N] / [3, M, N] buffers are allocated but untouched (virtual memory only, ~0.4 GB resident).
_SPLIT_K_SCRIPT = r'''
import torch
from glmq.kernels import w4a16_dense as D
m, n, k, g = 131072, 8192, 1024, 128
assert D.max_rows(n, k) >= m  # one launch: below the wrapper's index limit
real = D._mma_kernel
class Shim:
    def __getitem__(self, grid):
        return real[(1, grid[1])]
D._mma_kernel = Shim()
torch.manual_seed(0)
wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32)
ws = (torch.rand(n, k // g) * 0.01 + 0.002).to(torch.bfloat16)
x = torch.empty(m, k, dtype=torch.bfloat16)
x[:64] = torch.randn(64, k).to(torch.bfloat16)
w = D.prepack(wp, ws, g, layout="planes", chunk_major=False)
def run(split_k):
    out = torch.empty(m, n, dtype=torch.bfloat16)
    out[:64, :128] = float("nan")
    D._launch(x, w, out, D.DenseConfig("mma", 64, 128, split_k=split_k, prefetch=False))
    return out[:64, :128].float().clone()
ref = run(1)
y = run(3)
assert not torch.isnan(y).any()
torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
print("SPLIT-K OK")
'''


def test_split_k_reduction_offsets_do_not_overflow_int32_below_the_index_limit():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SPLIT_K_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "SPLIT-K OK" in proc.stdout, (proc.returncode, proc.stdout[-2000:],
                                                                  proc.stderr[-3000:])
