"""GPTQ's column loop, propagated clip search and coordinate descent as numba kernels, for the CPU.

Why hand-written: `glmq.quantize.gptq` runs Alg. 1 as a loop of whole-tensor torch operations per column.
On a GPU that is the right shape (every op covers all rows of a batch of problems); on a CPU each op
streams `[B, N, <=128]` float32 temporaries through memory for a few flops per element, and the
propagated clip search repeats that for 7 candidate scales: a GLM-4.x expert layer spent ~18 s of its
~30 s there. No library has GPTQ's loop as a kernel. Here every row is independent given H (GPTQ's
rows do not interact), so the kernels run over tiles of TILE rows in parallel, with a tile's columns
held in a small local array, the row index innermost (LLVM vectorizes it), and the cross-block
updates left to torch's GEMMs:

- `gptq_loop`: per block of BLOCK columns (transposed layout `[B, K, N]`: one column of a tile is
  TILE contiguous floats), the kernel takes the block's current columns, fixes each group's scale at
  its first column (plain min/max, or the propagated clip search of `gptq._propagated_clip_search`),
  quantizes the group column by column with GPTQ's immediate error feedback, and returns the block's
  errors; torch applies them to the later columns (§4 "Lazy Batch-Updates"). The clip search already
  runs GPTQ over the group for every candidate scale, so the winning candidate's integers and errors
  *are* the loop's: the group is not quantized a second time.
- `coordinate_descent`: `gptq._coordinate_descent`'s sweeps, with the gradient of each block of columns
  from one torch GEMM and the moves inside the block (rank-1 updates of the block's gradient) in the kernel.

The arithmetic is the torch path's, operation for operation (the dtype rounding of compressed-tensors'
fake quantization, round half to even, the same expression order, no fused multiply-add), so the
decisions are the same up to float summation order: torch's lazy updates group the sums differently.
tests/test_gptq.py checks the integers against the float64 transcription of the paper, and
tests/test_gptq_cpu.py against the torch path.

Covered: symmetric specs, no act_order, weight dtype bfloat16 or float32, clip search off or
"propagated". Everything else (and every CUDA solve) takes the torch path (`applies`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

try:  # numba is a core dependency; the guard only keeps `import glmq` light elsewhere.
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover
    numba = None

from glmq.quantize.spec import QuantSpec

if numba is not None:
    from glmq.quantize.fused_cpu import _round_bf16_inplace

# Rows per kernel tile, the vectorized axis (a kernel argument, not a constant: LLVM vectorizes a loop of
# runtime length, with alias checks, but unrolls a constant 16 into scalar code). 32 measured as fast per row
# as 64 and 2x 16 (the per-loop alias check is amortized over 4 AVX2 vectors).
TILE = 64
# Columns per kernel call of the loop and of a descent block (the lazy-update block; any multiple of the
# group size gives the same decisions up to float summation order).
BLOCK = 128
CD_BLOCK = 64


def applies(w: torch.Tensor, spec: QuantSpec, clip: str | None) -> bool:
    """Whether this module solves a `quantize_gptq_batch` call (else the torch path does)."""
    return (numba is not None and w.device.type == "cpu" and spec.symmetric and not spec.act_order
            and w.dtype in (torch.bfloat16, torch.float32) and clip in (None, "propagated"))


if numba is not None:

    @njit(inline="always")
    def _round_dtype(x, bf16):
        """x (float32 [TILE]) rounded in place to bfloat16 (the RTN kernels' round to nearest even), or left
        as it is for float32."""
        if bf16:
            _round_bf16_inplace(x.view(np.uint32))

    @njit(inline="always")
    def _rb(v, bf16):
        """A float32 scalar rounded to bfloat16 (as `_round_dtype`), or itself for float32."""
        if not bf16:
            return v
        b = np.float32(v).view(np.uint32)
        b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.uint32(b).view(np.float32)

    @njit(inline="always")
    def _update8(dst, c_lo, c_hi, e, k0, u, b, urow, ucol, t):
        """dst[c] -= e[k0 + k] * u[b, urow + k, ucol + c] for k = 0 .. 7 in that order, c in [c_lo, c_hi).

        Eight of Alg. 1's rank-1 updates in one pass over dst: each element receives the same subtractions
        in the same order as eight immediate updates (so the same float32 result), but one load and store
        serve eight of them and the loop overhead of a short row-tile loop is paid once."""
        e0, e1, e2, e3, e4, e5, e6, e7 = e[k0], e[k0 + 1], e[k0 + 2], e[k0 + 3], e[k0 + 4], e[k0 + 5], e[k0 + 6], e[k0 + 7]
        for c in range(c_lo, c_hi):
            h0, h1, h2, h3 = u[b, urow, ucol + c], u[b, urow + 1, ucol + c], u[b, urow + 2, ucol + c], u[b, urow + 3, ucol + c]
            h4, h5, h6, h7 = u[b, urow + 4, ucol + c], u[b, urow + 5, ucol + c], u[b, urow + 6, ucol + c], u[b, urow + 7, ucol + c]
            d = dst[c]
            for r in range(t):
                v = d[r]
                v -= e0[r] * h0
                v -= e1[r] * h1
                v -= e2[r] * h2
                v -= e3[r] * h3
                v -= e4[r] * h4
                v -= e5[r] * h5
                v -= e6[r] * h6
                v -= e7[r] * h7
                d[r] = v

    @njit(parallel=True, cache=True, nogil=True)
    def _loop_kernel(wt, u, qt, et, st, gs, qmin, qmax, half, eps, bf16, grid, t, full):
        """One block of the GPTQ loop for B problems.

        wt: float32 [B, C, N], the block's current columns (transposed); u: float32 [B, C, C], the block's
        part of the upper inverse-Hessian factor; out: qt int8 [B, C, N], et float32 [B, C, N] (the
        errors (w - q) / u_jj), st float32 [B, C // gs, N] (the group scales, dtype-exact).
        grid: float32 clip factors, grid[0] == 1 (one entry: no search).
        full: QuantSpec.full_range (the scale's dividend is signed: `rtn.compute_qparams`).
        """
        nb, nc, n = wt.shape
        ntile = (n + t - 1) // t
        lo, hi = np.float32(qmin), np.float32(qmax)
        half32, eps32 = np.float32(half), np.float32(eps)
        for job in prange(nb * ntile):
            b = job // ntile
            r0 = (job % ntile) * t
            nr = min(t, n - r0)
            w = np.zeros((nc, t), dtype=np.float32)
            for c in range(nc):
                for r in range(nr):
                    w[c, r] = wt[b, c, r0 + r]
            wg = np.empty((gs, t), dtype=np.float32)
            eg = np.empty((gs, t), dtype=np.float32)
            qg = np.empty((gs, t), dtype=np.float32)
            best_q = np.empty((gs, t), dtype=np.float32)
            best_e = np.empty((gs, t), dtype=np.float32)
            best_loss = np.empty(t, dtype=np.float32)
            best_s = np.empty(t, dtype=np.float32)
            loss = np.empty(t, dtype=np.float32)
            amax = np.empty(t, dtype=np.float32)
            amin = np.empty(t, dtype=np.float32)
            s = np.empty(t, dtype=np.float32)
            s2 = np.empty(t, dtype=np.float32)
            x = np.empty(t, dtype=np.float32)
            for g in range(nc // gs):
                c0 = g * gs
                # absmax of the group's current values in the weight dtype (= max(|min|, max), both clamped at 0);
                # full range: max and |min| apart
                for r in range(t):
                    amax[r] = 0.0
                    amin[r] = 0.0
                for c in range(c0, c0 + gs):
                    for r in range(t):
                        x[r] = w[c, r]
                    _round_dtype(x, bf16)
                    if full:
                        for r in range(t):
                            amax[r] = max(amax[r], x[r])
                            amin[r] = max(amin[r], -x[r])
                    else:
                        for r in range(t):
                            amax[r] = max(amax[r], abs(x[r]))
                for p in range(grid.shape[0]):
                    # compute_qparams of the shrunk range: dtype(dtype(absmax * p) / half), zero -> eps;
                    # full range: the dtype-rounded shrunk max and |min| compared, the larger signed
                    for r in range(t):
                        s[r] = amax[r] * grid[p]
                    _round_dtype(s, bf16)
                    if full:
                        for r in range(t):
                            s2[r] = amin[r] * grid[p]
                        _round_dtype(s2, bf16)
                        for r in range(t):
                            s[r] = -s[r] if s[r] > s2[r] else s2[r]
                    for r in range(t):
                        s[r] = s[r] / half32
                    _round_dtype(s, bf16)
                    for r in range(t):
                        if s[r] == 0:
                            s[r] = eps32
                        loss[r] = 0.0
                    for c in range(gs):
                        for r in range(t):
                            wg[c, r] = w[c0 + c, r]
                    # GPTQ over the group with this scale: quantize column j, feed its error forward
                    # (immediately inside each run of 8 columns, then to the rest of the group at once)
                    lost = False
                    for j0 in range(0, gs, 8):
                        for j in range(j0, j0 + 8):
                            d = u[b, c0 + j, c0 + j]
                            for r in range(t):  # `_fake_quantize`, then Alg. 1's error, in one pass
                                v = wg[j, r]
                                qv = np.rint(min(max(_rb(_rb(v, bf16) / s[r], bf16), lo), hi))
                                e = (v - _rb(qv * s[r], bf16)) / d
                                eg[j, r] = e
                                qg[j, r] = qv
                                loss[r] += e * e
                            for c in range(j + 1, j0 + 8):
                                h = u[b, c0 + j, c0 + c]
                                for r in range(t):
                                    wg[c, r] -= eg[j, r] * h
                        if p > 0:
                            # the loss only grows (a float sum of squares), so a candidate whose partial loss
                            # already reaches the best full loss on every row cannot be chosen: stop it
                            lost = True
                            for r in range(nr):
                                lost = lost and loss[r] >= best_loss[r]
                            if lost:
                                break
                        _update8(wg, j0 + 8, gs, eg, j0, u, b, c0 + j0, c0, t)
                    if lost:
                        continue
                    if p == 0:
                        best_q[:, :] = qg
                        best_e[:, :] = eg
                        for r in range(t):
                            best_loss[r] = loss[r]
                            best_s[r] = s[r]
                    else:
                        for r in range(t):
                            if loss[r] < best_loss[r]:  # ties keep the earlier factor (1.0 first)
                                best_loss[r] = loss[r]
                                best_s[r] = s[r]
                                for c in range(gs):
                                    best_q[c, r] = qg[c, r]
                                    best_e[c, r] = eg[c, r]
                # the group's errors into the block's later columns, in column order (Alg. 1's order)
                for j0 in range(0, gs, 8):
                    _update8(w, c0 + gs, nc, best_e, j0, u, b, c0 + j0, 0, t)
                for r in range(nr):
                    st[b, g, r0 + r] = best_s[r]
                for c in range(gs):
                    for r in range(nr):
                        qt[b, c0 + c, r0 + r] = np.int8(best_q[c, r])
                        et[b, c0 + c, r0 + r] = best_e[c, r]

    @njit(parallel=True, cache=True, nogil=True)
    def _cd_kernel(dt, qt, st, hd, rt, i1, gs, qmin, qmax, bf16, min_gain, moved, t):
        """Coordinate-descent moves over columns i1 .. i1 + C of B problems (`gptq._coordinate_descent`).

        dt: float32 [B, K, N] residual w - wq (transposed), updated; qt: int8 [B, K, N], updated;
        st: float32 [B, G, N] scales; hd: float32 [B, K, K] damped Hessian; rt: float32 [B, C, N] the
        block's gradient D Hd[:, block] (transposed), updated by each move; moved: int64 [B * tiles].
        """
        nb, nc, n = rt.shape
        ntile = (n + t - 1) // t
        lo, hi = np.float32(qmin), np.float32(qmax)
        two, gain = np.float32(2.0), np.float32(min_gain)  # float32 arithmetic, as the torch path's
        for job in prange(nb * ntile):
            b = job // ntile
            r0 = (job % ntile) * t
            nr = min(t, n - r0)
            q = np.zeros((nc, t), dtype=np.float32)
            s = np.ones((nc, t), dtype=np.float32)
            g = np.zeros((nc, t), dtype=np.float32)  # the block's gradient, kept current by the moves
            delta = np.zeros((nc, t), dtype=np.float32)
            for c in range(nc):
                gi = (i1 + c) // gs
                for r in range(nr):
                    q[c, r] = qt[b, i1 + c, r0 + r]
                    s[c, r] = st[b, gi, r0 + r]
                    g[c, r] = rt[b, c, r0 + r]
            any_move = False
            for c0 in range(0, nc, 8):  # moves feed the gradient immediately inside 8 columns, then at once
                moved8 = False
                for c in range(c0, c0 + 8):
                    j = i1 + c
                    hjj = hd[b, j, j]
                    m = False
                    for r in range(t):
                        qv, sv, gv = q[c, r], s[c, r], g[c, r]
                        qn = min(max(np.rint(qv + gv / (sv * hjj)), lo), hi)
                        dl = _rb(qn * sv, bf16) - _rb(qv * sv, bf16)
                        dd_h = dl * dl * hjj
                        take = two * dl * gv - dd_h > gain * dd_h  # false for a zero move
                        dl = dl if take and r < nr else np.float32(0.0)
                        q[c, r] = qn if dl != 0 else qv
                        delta[c, r] = dl
                        m = m or dl != 0
                    if m:
                        moved8 = True
                        for c2 in range(c + 1, c0 + 8):
                            h = hd[b, j, i1 + c2]
                            for r in range(t):
                                g[c2, r] -= h * delta[c, r]
                if moved8:
                    any_move = True
                    _update8(g, c0 + 8, nc, delta, c0, hd, b, i1 + c0, i1, t)  # passed columns: not read again
            if not any_move:
                continue
            for c in range(nc):
                for r in range(nr):
                    if delta[c, r] != 0:
                        qt[b, i1 + c, r0 + r] = np.int8(q[c, r])
                        dt[b, i1 + c, r0 + r] -= delta[c, r]
                        moved[job] += 1


@contextlib.contextmanager
def _torch_threads():
    """Run the kernels on as many threads as torch has, and give torch its count back afterwards.

    numba's OpenMP layer sets the process's OpenMP thread count to its own when a parallel kernel runs,
    which changed torch's too (1 -> 2 on this machine): a rank given half the cores then ran its GEMMs on
    more threads than it owns, and float sums whose grouping depends on the thread count stopped matching
    a one-process run (tests/test_distributed.py).
    """
    n = torch.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _grid(clip: str | None) -> np.ndarray:
    from glmq.quantize.gptq import CLIP_GRID

    return np.asarray(CLIP_GRID if clip else (1.0,), dtype=np.float32)


def _args(spec: QuantSpec, dtype: torch.dtype) -> tuple:
    """(q_min, q_max, half range, bf16?, full range?) as the kernels take them (floats: Triton's as fp32
    arguments)."""
    return float(spec.q_min), float(spec.q_max), spec.half_range, dtype == torch.bfloat16, spec.full_range


def gptq_loop(Wt: torch.Tensor, Hinv: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, clip: str | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq._gptq_loop` for the covered case (`applies`): identity permutation, symmetric.

    Args:
        Wt: float32 `[B, K, N]` contiguous, the weights transposed (one column of a row tile is contiguous),
            dead columns zeroed; overwritten. Hinv: float32 `[B, K, K]` upper factors.
    Returns:
        (q int8 `[B, N, K]` (a transposed view), scale `[B, N, G]` dtype).
    """
    nb, k, n = Wt.shape
    gs = spec.group_size
    Qt = torch.empty(nb, k, n, dtype=torch.int8)
    St = torch.empty(nb, k // gs, n)
    qmin, qmax, half, bf16, full = _args(spec, dtype)
    eps = float(torch.finfo(dtype).eps)
    grid = _grid(clip)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)  # k and BLOCK are multiples of gs
        Et = torch.empty(nb, i2 - i1, n)
        with _torch_threads():
            _loop_kernel(Wt[:, i1:i2].numpy(), Hinv[:, i1:i2, i1:i2].contiguous().numpy(), Qt[:, i1:i2].numpy(),
                         Et.numpy(), St[:, i1 // gs:i2 // gs].numpy(), gs, qmin, qmax, half, eps, bf16, grid, TILE, full)
        if i2 < k:  # Wt[:, i2:] -= (E Hinv[i1:i2, i2:])^T
            Wt[:, i2:].baddbmm_(Hinv[:, i1:i2, i2:].transpose(1, 2), Et, alpha=-1)
    return Qt.transpose(1, 2), St.transpose(1, 2).to(dtype)


def descent_start(Wt: torch.Tensor, Q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The descent kernels' inputs (here and in gptq_triton): integers Qt int8 `[B, K, N]`, scales St float32
    `[B, G, N]` and the residual Dt = w - wq float32 `[B, K, N]`, computed in Wt's memory."""
    k, gs = Wt.shape[1], spec.group_size
    Qt = Q.transpose(1, 2).contiguous()
    St = scale.float().transpose(1, 2).contiguous()
    deq = (Qt.float().unflatten(1, (k // gs, gs)) * St.unsqueeze(2)).to(dtype).float().flatten(1, 2)
    return Qt, St, Wt.contiguous().sub_(deq)


def coordinate_descent(Wt: torch.Tensor, Q: torch.Tensor, scale: torch.Tensor, Hd: torch.Tensor, spec: QuantSpec,
                       dtype: torch.dtype) -> torch.Tensor:
    """`gptq._coordinate_descent` for the covered case (no zero point, identity order).

    Args:
        Wt: float32 `[B, K, N]` the weights transposed, dead columns zeroed; overwritten (it becomes the
            residual). Q: int8 `[B, N, K]`; scale `[B, N, G]` dtype; Hd: float32 `[B, K, K]` damped Hessian.
    Returns the refined integers, int8 `[B, N, K]` (a transposed view; Q is not modified).
    """
    nb, k, n = Wt.shape
    gs = spec.group_size
    Qt, St, Dt = descent_start(Wt, Q, scale, spec, dtype)
    qmin, qmax, _, bf16, _ = _args(spec, dtype)
    from glmq.quantize.gptq import CD_MIN_GAIN

    for _ in range(spec.cd_sweeps):
        moved = np.zeros(nb * ((n + TILE - 1) // TILE), dtype=np.int64)
        for i1 in range(0, k, CD_BLOCK):
            i2 = min(i1 + CD_BLOCK, k)
            Rt = torch.bmm(Hd[:, i1:i2], Dt)  # [B, C, N] = (D Hd[:, block])^T, Hd symmetric
            with _torch_threads():
                _cd_kernel(Dt.numpy(), Qt.numpy(), St.numpy(), Hd.numpy(), Rt.numpy(), i1, gs, qmin, qmax, bf16,
                           CD_MIN_GAIN, moved, TILE)
        if not moved.any():
            break
    return Qt.transpose(1, 2)
