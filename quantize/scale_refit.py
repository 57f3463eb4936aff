"""Group scales refitted to GPTQ's final integers (`QuantSpec.scale_refit`), in torch on any device.

GPTQ fixes a group's scale when its column loop reaches the group (min/max with the clip search), and the
coordinate descent (`gptq._coordinate_descent`) then moves the integers with every scale fixed: nothing
ever re-optimizes the scales for the integers finally chosen. With the integers Q fixed, the damped
objective of a row r,
    f(s_r) = (w_r - wq_r) Hd (w_r - wq_r)^T,   wq_rk = q_rk s_{r, g(k)},
is quadratic in the row's G group scales: with A_r `[K, G]`, A_r[k, g(k)] = q_rk, its minimizer solves the
G x G normal equations
    (A_r^T Hd A_r) s_r = A_r^T Hd w_r,
i.e. M_r[g, h] = sum_{k in g, l in h} q_rk Hd_kl q_rl and b_r[g] = sum_{k in g} q_rk (w_r Hd)_k. For all
rows of a batch these are GEMMs (per group g, Q[:, g-cols] Hd[g-cols, :] reduced per group against Q)
and one batched Cholesky solve in float64 (G <= 48 for GLM-5). The solution is rounded to the scale dtype
(the written format); groups whose rounded scale is not finite and positive, or whose integers are all 0
(M's row is 0), keep the old scale. compressed-tensors dequantizes in the weight dtype, so the rounded
dequantized values differ slightly from q * s: the row's objective is therefore re-evaluated exactly with
them, and the new scales are kept only for rows where it drops by more than CD_MIN_GAIN of the change's
own curvature (the descent's acceptance rule), so no row's objective ever increases.

Symmetric specs only (no zero point); the caller leaves the other cases alone. The integers, their range
and every shape and dtype are unchanged: the result is still exactly RTN's format.
"""

from __future__ import annotations

import torch

from glmq.quantize.spec import QuantSpec

# float32 elements of each `[B, rows, K]` transient of the refit (it holds about six at once): the rows
# are taken in chunks of at most this many elements, so its memory does not grow with N: 16 MiB on a CPU
# (host memory is the engine's budget there), 256 MiB on a GPU (fewer, larger GEMMs; a GLM-5 batch of 16
# gate+up problems is 1.5 GiB per float32 copy anyway).
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


def refit_scales(W: torch.Tensor, Q: torch.Tensor, scale: torch.Tensor, Hd: torch.Tensor, spec: QuantSpec,
                 dtype: torch.dtype) -> torch.Tensor:
    """Per row, the group scales that minimize the damped objective for the integers Q, where that lowers it.

    Args:
        W: float32 `[B, N, K]` weights, original column order (groups contiguous), dead columns zeroed.
        Q: int8 `[B, N, K]` the final integers, same order; scale `[B, N, G]` dtype, their current scales.
        Hd: float32 `[B, K, K]` the damped symmetric Hessian (`gptq._damped`), same order.
        spec: symmetric (zero point None); its group size.
        dtype: the scale dtype (the weight dtype).
    Returns:
        the new scales, `[B, N, G]` dtype (a new tensor; rows where the refit does not help keep theirs).
    """
    from glmq.quantize.gptq import CD_MIN_GAIN

    nb, n, k = W.shape
    rows = max(1, CHUNK_ELEMENTS.get(W.device.type, CHUNK_ELEMENTS["cpu"]) // (nb * k))
    out = scale.clone()
    for r1 in range(0, n, rows):
        r2 = min(r1 + rows, n)
        Qf, s_old = Q[:, r1:r2].float(), scale[:, r1:r2]
        s_new = _solve(W[:, r1:r2], Qf, s_old, Hd, spec.group_size, dtype)
        deq_old = _dequantize(Qf, s_old, spec.group_size)
        delta = _dequantize(Qf, s_new, spec.group_size) - deq_old  # the change of wq: D becomes D - delta
        dh = delta @ Hd
        curv = (dh * delta).sum(-1)  # (B, rows): delta Hd delta^T
        gain = 2 * (dh * (W[:, r1:r2] - deq_old)).sum(-1) - curv  # f(D) - f(D - delta)
        take = gain > CD_MIN_GAIN * curv  # false when nothing changed (curv = gain = 0)
        out[:, r1:r2] = torch.where(take.unsqueeze(-1), s_new, s_old)
    return out


def _solve(W: torch.Tensor, Qf: torch.Tensor, s_old: torch.Tensor, Hd: torch.Tensor, gs: int,
           dtype: torch.dtype) -> torch.Tensor:
    """The normal equations' solution per row, rounded to dtype, old scales where it is unusable.

    W, Qf float32 `[B, R, K]`; s_old `[B, R, G]` dtype; Hd float32 `[B, K, K]`. Returns `[B, R, G]` dtype.
    """
    nb, rows, k = W.shape
    G = k // gs
    M = torch.empty(nb, rows, G, G, device=W.device)
    for g in range(G):  # block row g of M from its upper part (M is symmetric: Hd is)
        c = slice(g * gs, (g + 1) * gs)
        t = Qf[:, :, c] @ Hd[:, c, g * gs:]  # (B, R, K - g gs): sum_{k in g} q_k Hd_kl
        m = (t * Qf[:, :, g * gs:]).unflatten(2, (G - g, gs)).sum(-1)  # (B, R, G - g)
        M[:, :, g, g:] = m
        M[:, :, g + 1:, g] = m[:, :, 1:]
    b = ((W @ Hd) * Qf).unflatten(2, (G, gs)).sum(-1).double()  # (B, R, G): A^T Hd w
    M = M.double()
    # a group whose integers are all 0 has a zero row and column: pin its scale (M_gg = 1, b_g = s_old)
    empty = torch.diagonal(M, dim1=-2, dim2=-1) <= 0  # (B, R, G)
    torch.diagonal(M, dim1=-2, dim2=-1).masked_fill_(empty, 1)
    b = torch.where(empty, s_old.double(), b)
    L, info = torch.linalg.cholesky_ex(M)
    s = torch.cholesky_solve(b.unsqueeze(-1), L)[..., 0].to(dtype)  # rounded to the written scale dtype
    # (the sign kept: full_range's negative scales stay negative; a zero or flipped fit keeps the old scale)
    usable = torch.isfinite(s) & (s * s_old.sign() > 0) & ~empty & (info == 0).unsqueeze(-1)
    return torch.where(usable, s, s_old)


def _dequantize(Qf: torch.Tensor, s: torch.Tensor, gs: int) -> torch.Tensor:
    """Symmetric `rtn.dequantize` in float32: (q * s) rounded to the scale dtype, s `[B, R, G]` per group."""
    return (Qf.unflatten(2, (-1, gs)) * s.float().unsqueeze(-1)).to(s.dtype).float().flatten(2)
