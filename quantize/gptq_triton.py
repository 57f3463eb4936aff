"""GPTQ's column loop, propagated clip search and coordinate descent as Triton kernels, for CUDA.

Why hand-written: `glmq.quantize.gptq` runs Alg. 1 as a loop of whole-tensor torch operations per column:
~140 torch calls per column for the loop and its clip search, ~290 with two sweeps of descent. On a GPU
each call is a few microseconds of host dispatch for a few microseconds of device work, so the solve is
bound by the host: ~10 s per batch of 16 GLM-5 gate/up problems (K = 6144), ~190 s of a GLM-5 layer's
~200 s on an H200. No library has GPTQ's loop as a kernel. These kernels run a whole group of columns
(the loop) or a block of 64 columns (the descent) per launch, each program (one warp) holding a tile of T = 8 rows of one
problem in registers; the updates across groups and blocks stay torch GEMMs. The algorithm is
`glmq.quantize.gptq_cpu`'s, transcribed to Triton (same transposed layout `[B, K, N]`, same rounding):

- `gptq_loop`: per group, the kernel fixes the group's scale (plain min/max, or the propagated clip search
  of `gptq._propagated_clip_search`: GPTQ over the group for every candidate scale, scored by the loss the
  group adds), quantizes the group's columns in order with Alg. 1's immediate error feedback and returns
  their errors; one `baddbmm` applies them to every later column. The winner is run once more to write
  its integers and errors (the numba kernel keeps them from the search; registers here are too few to
  hold a second copy of the tile).
- `coordinate_descent`: `gptq._coordinate_descent`'s sweeps, each block's gradient from one `bmm`, the
  moves inside the block (rank-1 updates of the gradient) in the kernel.

Numerics: the weight-dtype roundings of compressed-tensors' fake quantization are done on the bits
(round to nearest even), divisions are IEEE (`div_rn`), rounding to integers is round-half-even, the
kernels are compiled without fused multiply-add (`enable_fp_fusion=False`, as numba and torch's CPU
ops), and a column is read out of the register tile by a masked sum (exact: one term is non-zero). So
each program does the CPU kernel's float32 arithmetic in its order; what differs is the GEMMs around
the kernels (cuBLAS sums in another order than the CPU's, and the groups' errors reach later columns by
one GEMM per group where the CPU kernel takes 128-column blocks). Measured on GLM-5 expert shapes
(`bench_gptq_solver --backends --device cuda`): 1.6e-5 of the integers differ from the torch path's,
with the same Hessian error to 5 digits; tests/test_gptq_triton.py compares against the CPU kernels.

Covered (`applies`): CUDA weights, symmetric specs, no act_order, bfloat16 or float32, clip search off or
"propagated", group sizes 32/64/128. Anything else takes the torch path.
"""

from __future__ import annotations

import torch

from glmq.quantize.gptq_cpu import _args, _grid, descent_start
from glmq.quantize.spec import QuantSpec

try:  # triton is an optional extra (glmq[triton]); without it CUDA solves take the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Rows of a problem per program (the register tile is [columns, T] float32) and warps per program. One warp of
# 8 rows measured fastest (H200, `bench_gptq_solver --triton-tiles`, 8 GLM-5 problems, same integers in every
# case): gate+up 0.486 s against 0.567 s for 32 rows on 4 warps (16x2 0.548, 16x4 0.625, 8x2 0.608, 32x8 0.698),
# down 0.129 s against 0.166 s. Reading a column out of the tile is then a reduction inside one warp, with no
# barrier, and the programs are 4x as many (a column step is latency-bound, so more in flight is what pays).
T = 8
WARPS = 1  # T and WARPS: module constants read at each call, so a benchmark can sweep them
CD_BLOCK = 64  # columns per descent block (as gptq_cpu.CD_BLOCK)


def applies(w: torch.Tensor, spec: QuantSpec, clip: str | None) -> bool:
    """Whether these kernels solve a `quantize_gptq_batch` call (else the torch path does)."""
    return (triton is not None and w.device.type == "cuda" and spec.symmetric and not spec.act_order
            and w.dtype in (torch.bfloat16, torch.float32) and clip in (None, "propagated")
            and spec.group_size in (32, 64, 128))


if triton is not None:
    MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + MAGIC) - MAGIC rounds |x| < 2^22 to an integer, half to even

    @triton.jit
    def _rd(x, BF16: tl.constexpr):
        """float32 x rounded to bfloat16 (to nearest, ties to even, on the bits), or x for float32 weights."""
        if BF16:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            x = b.to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def _group_kernel(w_ptr, u_ptr, grid_ptr, q_ptr, e_ptr, s_ptr,
                      N, ntile, P, swb, sub, suk, sqb, seb, ssb,
                      qmin, qmax, half, eps,
                      GS: tl.constexpr, TN: tl.constexpr, BF16: tl.constexpr, FULL: tl.constexpr):
        """One group of GPTQ's loop for one tile of TN rows of problem b (`gptq_cpu._loop_kernel`'s group).

        w: float32 the group's current columns [GS, N] (row stride N, problem stride swb); u: the group's
        block of the upper inverse-Hessian factor [GS, GS] (row stride suk); grid: P clip factors (1.0 first).
        Out: q int8 [GS, N], e float32 [GS, N] (Alg. 1's errors (w - q) / u_jj), s float32 [N] the scale.
        Passes 0..P-1 score the candidates; pass P reruns the winner and stores. FULL: QuantSpec.full_range
        (the scale's dividend is signed, as `gptq_cpu._loop_kernel` computes it).
        """
        pid = tl.program_id(0)
        b = (pid // ntile).to(tl.int64)  # problem offsets pass 2^31 elements in large batches
        cols = (pid % ntile) * TN + tl.arange(0, TN)
        cm = cols < N
        rows = tl.arange(0, GS)
        offs = rows[:, None] * N + cols[None, :]
        w0 = tl.load(w_ptr + b * swb + offs, mask=cm[None, :], other=0.0)
        wr = _rd(w0, BF16)  # compute_qparams on the group's range in the weight dtype
        if FULL:  # max and |min| apart (both >= 0: the masked columns load 0)
            amax = tl.maximum(tl.max(wr, axis=0), 0.0)
            amin = tl.maximum(tl.max(-wr, axis=0), 0.0)
        else:
            amax = tl.max(tl.abs(wr), axis=0)
        ub = u_ptr + b * sub
        best_loss = tl.full([TN], float("inf"), tl.float32)
        best_s = tl.zeros([TN], tl.float32)
        for p in range(P + 1):
            final = p == P
            f = tl.load(grid_ptr + tl.minimum(p, P - 1))
            if FULL:  # the dtype-rounded shrunk max and |min| compared, the larger signed
                a = _rd(amax * f, BF16)
                a2 = _rd(amin * f, BF16)
                s = _rd(tl.math.div_rn(tl.where(a > a2, -a, a2), half), BF16)
            else:
                s = _rd(tl.math.div_rn(_rd(amax * f, BF16), half), BF16)
            s = tl.where(s == 0, eps, s)
            s = tl.where(final, best_s, s)
            w = w0
            loss = tl.zeros([TN], tl.float32)
            sm = cm & (tl.zeros([TN], tl.int32) + p == P)  # the stores of the final pass
            for j in range(GS):
                v = tl.sum(tl.where(rows[:, None] == j, w, 0.0), axis=0)  # row j of the tile (exact)
                x = tl.minimum(tl.maximum(_rd(tl.math.div_rn(_rd(v, BF16), s), BF16), qmin), qmax)
                qv = (x + MAGIC) - MAGIC
                e = tl.math.div_rn(v - _rd(qv * s, BF16), tl.load(ub + j * suk + j))
                loss += e * e
                urow = tl.load(ub + j * suk + rows, mask=rows > j, other=0.0)
                w = tl.where(rows[:, None] > j, w - urow[:, None] * e[None, :], w)
                tl.store(q_ptr + b * sqb + j * N + cols, qv.to(tl.int8), mask=sm)
                tl.store(e_ptr + b * seb + j * N + cols, e, mask=sm)
            better = loss < best_loss  # ties keep the earlier factor (1.0 first)
            best_loss = tl.where(better, loss, best_loss)
            best_s = tl.where(better, s, best_s)
        tl.store(s_ptr + b * ssb + cols, best_s, mask=cm)

    @triton.jit
    def _cd_kernel(d_ptr, q_ptr, s_ptr, h_ptr, r_ptr, moved_ptr,
                   N, K, G, ntile, i1, nc, qmin, qmax, gain,
                   CB: tl.constexpr, GS: tl.constexpr, TN: tl.constexpr, BF16: tl.constexpr):
        """Coordinate-descent moves over columns i1 .. i1 + nc (<= CB) of one tile (`gptq_cpu._cd_kernel`).

        d: float32 [B, K, N] residual w - wq, updated; q: int8 [B, K, N], updated; s: float32 [B, G, N]
        scales; h: float32 [B, K, K] damped Hessian; r: float32 [B, nc, N] the block's gradient D Hd[:, block]
        (transposed); moved: int32 [1], the count of moves.
        """
        pid = tl.program_id(0)
        b = (pid // ntile).to(tl.int64)  # problem offsets pass 2^31 elements in large batches
        cols = (pid % ntile) * TN + tl.arange(0, TN)
        cm = cols < N
        rows = tl.arange(0, CB)
        live = (rows[:, None] < nc) & cm[None, :]
        kn = (i1 + rows)[:, None] * N + cols[None, :]
        q = tl.load(q_ptr + b * K * N + kn, mask=live, other=0).to(tl.float32)
        s = tl.load(s_ptr + b * G * N + ((i1 + rows) // GS)[:, None] * N + cols[None, :], mask=live, other=1.0)
        g = tl.load(r_ptr + b * nc * N + rows[:, None] * N + cols[None, :], mask=live, other=0.0)
        delta = tl.zeros([CB, TN], tl.float32)
        hb = h_ptr + b * K * K
        for c in range(nc):
            j = i1 + c
            sel = rows[:, None] == c
            qv = tl.sum(tl.where(sel, q, 0.0), axis=0)  # row c of each tile (exact: one term is non-zero)
            sv = tl.sum(tl.where(sel, s, 0.0), axis=0)
            gv = tl.sum(tl.where(sel, g, 0.0), axis=0)
            hjj = tl.load(hb + j * K + j)
            x = tl.minimum(tl.maximum(qv + tl.math.div_rn(gv, sv * hjj), qmin), qmax)
            qn = (x + MAGIC) - MAGIC  # rint after the clamp = clamp after rint (integer bounds)
            dl = _rd(qn * sv, BF16) - _rd(qv * sv, BF16)
            dd_h = dl * dl * hjj
            take = (2.0 * dl * gv - dd_h > gain * dd_h) & cm  # false for a zero move
            dl = tl.where(take, dl, 0.0)
            q = tl.where(sel & (dl != 0)[None, :], qn[None, :], q)
            delta = tl.where(sel, dl[None, :], delta)
            hrow = tl.load(hb + j * K + i1 + rows, mask=(rows > c) & (rows < nc), other=0.0)
            g = tl.where(rows[:, None] > c, g - hrow[:, None] * dl[None, :], g)
        m = live & (delta != 0)
        tl.store(q_ptr + b * K * N + kn, q.to(tl.int8), mask=m)
        dp = d_ptr + b * K * N + kn
        tl.store(dp, tl.load(dp, mask=m, other=0.0) - delta, mask=m)
        tl.atomic_add(moved_ptr, tl.sum(tl.sum(m.to(tl.int32), axis=1), axis=0))


def gptq_loop(Wt: torch.Tensor, Hinv: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, clip: str | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq._gptq_loop` for the covered case (`applies`): identity permutation, symmetric.

    Args:
        Wt: float32 `[B, K, N]` contiguous, the weights transposed, dead columns zeroed; overwritten.
        Hinv: float32 `[B, K, K]` upper factors.
    Returns:
        (q int8 `[B, N, K]` (a transposed view), scale `[B, N, G]` dtype).
    """
    nb, k, n = Wt.shape
    gs = spec.group_size
    Wt, Hinv = Wt.contiguous(), Hinv.contiguous()
    Qt = torch.empty(nb, k, n, dtype=torch.int8, device=Wt.device)
    St = torch.empty(nb, k // gs, n, device=Wt.device)
    Et = torch.empty(nb, gs, n, device=Wt.device)
    grid = torch.from_numpy(_grid(clip)).to(Wt.device)
    qmin, qmax, half, bf16, full = _args(spec, dtype)
    eps = float(torch.finfo(dtype).eps)
    ntile = triton.cdiv(n, T)
    for g in range(k // gs):
        c0, c1 = g * gs, (g + 1) * gs
        _group_kernel[(nb * ntile,)](
            Wt[:, c0:c1], Hinv[:, c0:c1, c0:c1], grid, Qt[:, c0:c1], Et, St[:, g],
            n, ntile, grid.numel(), k * n, k * k, k, k * n, gs * n, (k // gs) * n,
            qmin, qmax, half, eps, GS=gs, TN=T, BF16=bf16, FULL=full, num_warps=WARPS, enable_fp_fusion=False)
        if c1 < k:  # Wt[:, c1:] -= (E Hinv[c0:c1, c1:])^T
            Wt[:, c1:].baddbmm_(Hinv[:, c0:c1, c1:].transpose(1, 2), Et, alpha=-1)
    return Qt.transpose(1, 2), St.transpose(1, 2).to(dtype)


def coordinate_descent(Wt: torch.Tensor, Q: torch.Tensor, scale: torch.Tensor, Hd: torch.Tensor, spec: QuantSpec,
                       dtype: torch.dtype) -> torch.Tensor:
    """`gptq._coordinate_descent` for the covered case (no zero point, identity order).

    Args:
        Wt: float32 `[B, K, N]` the weights transposed, dead columns zeroed; overwritten (the residual).
        Q: int8 `[B, N, K]`; scale `[B, N, G]` dtype; Hd: float32 `[B, K, K]` damped symmetric Hessian.
    Returns the refined integers, int8 `[B, N, K]` (a transposed view; Q is not modified).
    """
    from glmq.quantize.gptq import CD_MIN_GAIN

    nb, k, n = Wt.shape
    gs = spec.group_size
    Hd = Hd.contiguous()
    Qt, St, Dt = descent_start(Wt, Q, scale, spec, dtype)
    qmin, qmax, _, bf16, _ = _args(spec, dtype)
    ntile = triton.cdiv(n, T)
    for _ in range(spec.cd_sweeps):
        moved = torch.zeros(1, dtype=torch.int32, device=Wt.device)
        for i1 in range(0, k, CD_BLOCK):
            i2 = min(i1 + CD_BLOCK, k)
            Rt = torch.bmm(Hd[:, i1:i2], Dt)  # [B, C, N] = (D Hd[:, block])^T, Hd symmetric
            _cd_kernel[(nb * ntile,)](Dt, Qt, St, Hd, Rt, moved, n, k, k // gs, ntile, i1, i2 - i1,
                                      qmin, qmax, CD_MIN_GAIN, CB=CD_BLOCK, GS=gs, TN=T, BF16=bf16, num_warps=WARPS,
                                      enable_fp_fusion=False)
        if not int(moved.item()):
            break
    return Qt.transpose(1, 2)
