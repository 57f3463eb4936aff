"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): error-compensating group-wise quantization.

`quantize_gptq(w, h, spec)` is a pure function: a weight `[N, K]` and the layer-input Hessian
`H = 2/n sum x x^T` `[K, K]` (glmq.calibration.hessian) in, integers and group scales out, in exactly the
format `quantize_rtn` produces, so the same packer and writer apply.

Choices (each also noted where it is made):
- Group scales are computed from the *current* (error-updated) weights when the loop reaches a group's
  first column, as the reference implementation does with `static_groups=False`, and with the same
  compressed-tensors math as RTN (`compute_qparams` on group min/max in the weight dtype). Columns are
  quantized with compressed-tensors' own rounding too, so a Hessian without cross terms (diagonal H)
  reproduces `quantize_rtn` bit for bit (without the descent and the scale refit below), and `rtn.dequantize` of the result is exactly the weight GPTQ
  compensated for.
- act_order ("static", no g_idx): columns are processed by decreasing diag(H), but groups stay the
  contiguous *original* columns, because the written format has no g_idx. A group's scale is fixed when
  the permuted order first reaches any of its columns, from the current values of all its columns
  (none of which is quantized yet at that moment). Without act_order this is exactly the rule above.
  llm-compressor's static act-order instead computes every group's scale up front from the unmodified
  weight (as the reference's `static_groups=True`); that is also consistent, but its scales never see
  the compensation GPTQ applies to a group before reaching it, which with act_order is most groups.
  Either way every column of a group is quantized with the one scale that is written. On synthetic
  correlated-activation problems like those in tests/test_gptq.py (3 seeds, g32/g128, sym/asym) the
  two rules gave Hessian errors within +-3% of each other with neither ahead; first-touch is kept
  because it is one rule for both modes.
- "Current" includes the lazy-batch updates still pending inside the block (the reference gptq.py reads
  the stale `W` there when group_size < block_size), so the blocked loop makes exactly the decisions of
  the unblocked Algorithm 1; tests compare against a float64 column-by-column transcription.
- Clip search (`clip_search=True`): when a group's scale is fixed, it is chosen per row among shrinks of
  [min, max] (CLIP_GRID). `spec.clip_objective` says how a candidate is scored: "propagated" quantizes
  the group's columns one by one with GPTQ's own error feedback inside the group and scores the GPTQ loss
  that group adds (`_propagated_clip_search`); "block" rounds the group in isolation and scores it with
  H's diagonal block (`_clip_search`).
- Coordinate descent (`spec.cd_sweeps` > 0): after the column loop, with every scale fixed, cyclic sweeps
  over the columns move each integer to its best value given all the others, on the damped objective
  (`_coordinate_descent`). GPTQ decides each column once, from columns it has not quantized yet; the
  sweeps revisit those decisions with the whole rounding known. Each accepted move lowers its row's
  objective, so the result is never worse on it than GPTQ's (tests/test_gptq.py asserts it).
- Scale refit (`spec.scale_refit` rounds, symmetric specs): a group's scale is fixed before GPTQ knows
  the group's integers, and the descent then moves them with the scale fixed. With the integers fixed
  the damped objective is quadratic in a row's group scales, so after the descent each row's scales are
  refitted by least squares (G x G normal equations; `glmq.quantize.scale_refit`, torch GEMMs after
  whichever backend solved), kept per row only where they lower the objective with their dtype-rounded
  values, and followed by one more descent sweep for the new scales (when cd_sweeps > 0). Asymmetric
  specs keep GPTQ's scales.
- Dead columns (diag(H) == 0: the input channel never fired) get H[i, i] = 1 and W[:, i] = 0, as in the
  reference code. An all-zero Hessian (no tokens) and one that stays non-positive-definite after the
  dampening retries fall back to RTN; both are recorded in `GPTQResult.fallback`, never silent.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass

import torch

from glmq.quantize import gptq_cpu
from glmq.quantize.ops import check_finite
from glmq.quantize.rtn import QWeight, compute_qparams, dequantize, group_minmax, quantize_rtn
from glmq.quantize.scale_refit import refit_scales
from glmq.quantize.spec import QuantSpec

logger = logging.getLogger(__name__)

# Dampening retries multiply the fraction by 10 up to this fraction of mean(diag(H)); beyond it the
# Hessian carries little information anyway and RTN is the honest answer.
MAX_DAMP = 1.0
# Clip-search shrink factors for the optional `clip_search` (1.0 = plain min/max).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


class Fallback(str, enum.Enum):
    """Why GPTQ returned RTN's result instead."""

    EMPTY_HESSIAN = "empty_hessian"  # H == 0: no calibration tokens reached this layer, or all its inputs were zero
    NOT_POSITIVE_DEFINITE = "not_positive_definite"  # Cholesky failed even at MAX_DAMP


@dataclass(frozen=True)
class GPTQResult:
    """GPTQ's output and what happened on the way.

    Attributes:
        qweight: QWeight(q int8 [N, K], scale [N, K/g] w.dtype, zero_point int8 [N, K/g] | None),
            the same format as `quantize_rtn`.
        error_gptq: tr((W - Wq) H (W - Wq)^T) of `qweight`, with the Hessian as passed (float64 sum);
            None when the caller asked for no errors (`quantize_gptq_batch(errors=False)`).
        error_rtn: the same for `quantize_rtn(w, spec)`, or None likewise.
        damp: dampening fraction of mean(diag(H)) that was used (the last one tried on a fallback).
        damp_increased: True when Cholesky failed at `spec.damp` and a larger fraction was needed.
        fallback: None, or why the result is RTN's.
        dead_columns: input columns with diag(H) == 0, zeroed before quantization.
    """

    qweight: QWeight
    error_gptq: float | None
    error_rtn: float | None
    damp: float
    damp_increased: bool
    fallback: Fallback | None
    dead_columns: int


def hessian_error(w: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Wq) H (W - Wq)^T), the layer-output error GPTQ minimizes (paper eq. 1), in float64.

    Args:
        w, w_q: `[N, K]` original and dequantized weight, any float dtype.
        h: `[K, K]` Hessian on the same device.
    """
    d = w.double() - w_q.double()
    return float(((d @ h.double()) * d).sum())


def quantize_gptq(
    w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, *, clip_search: bool = False
) -> GPTQResult:
    """Quantize one Linear weight with GPTQ (paper Alg. 1 with the §4 lazy-batch and Cholesky steps).

    Args:
        w: `[N, K]` float weight (bf16 for GLM); its dtype becomes the scale dtype, its device is where
            the work runs (CPU or CUDA; float32 internally).
        h: `[K, K]` float Hessian `2/n sum x x^T` of the layer input; moved to w's device.
        spec: bits, group size, symmetry, act_order, damp, block_size, clip_objective, cd_sweeps,
            scale_refit.
        clip_search: per group and row, pick the min/max shrink factor from `CLIP_GRID` that minimizes
            the error `spec.clip_objective` defines. Off by default.
    Returns:
        GPTQResult with the QWeight and diagnostics (errors, dampening, fallback).
    Raises:
        ValueError: if the shapes do not fit the spec, `w` is not floating point, or `h` is not a
            finite `[K, K]` matrix.
    """
    return quantize_gptq_batch(w.unsqueeze(0), h.unsqueeze(0), spec, clip_search=clip_search)[0]


def quantize_gptq_batch(
    w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, *, clip_search: bool = False, errors: bool = True
) -> list[GPTQResult]:
    """`quantize_gptq` of B weights of one shape, each with its own Hessian, in one column loop.

    The routed experts of a layer are B same-shape problems; looping over columns once for all of them
    instead of once per expert divides the Python and kernel-launch overhead of Alg. 1 by B, which
    dominates for GLM-5's 256 experts on a GPU. Every operation of the loop is row-wise or per batch
    element, so element b gets the decisions `quantize_gptq(w[b], h[b])` makes. With act_order the
    column order differs per element, so the elements run one at a time.

    Args:
        w: `[B, N, K]` float weights; h: `[B, K, K]` Hessians. Other arguments as `quantize_gptq`.
        errors: compute `error_gptq` / `error_rtn` (two float64 `[N, K] x [K, K]` products and an RTN per
            element). A caller that measures its own errors (calibration/layer_gptq.py, against the
            Hessian of the tokens the Linear saw) passes False and gets None there; RTN is then only
            computed for the elements that fall back to it.
    Returns:
        one GPTQResult per element, in order.
    """
    if w.ndim != 3 or h.ndim != 3 or h.shape[0] != w.shape[0]:
        raise ValueError(f"quantize_gptq_batch needs w [B, N, K] and h [B, K, K], got {list(w.shape)} and {list(h.shape)}")
    if spec.act_order and w.shape[0] > 1:
        return [r for b in range(w.shape[0]) for r in quantize_gptq_batch(w[b:b + 1], h[b:b + 1], spec,
                                                                          clip_search=clip_search, errors=errors)]
    for b in range(w.shape[0]):
        _check_inputs(w[b], h[b], spec)
    h = h.to(device=w.device, dtype=torch.float32)
    rtn_cache: dict[int, tuple[QWeight, float | None]] = {}

    def rtn(b: int) -> tuple[QWeight, float | None]:  # RTN of element b and its error, computed once
        if b not in rtn_cache:
            qw = quantize_rtn(w[b], spec)
            rtn_cache[b] = qw, hessian_error(w[b], dequantize(qw, spec.group_size), h[b]) if errors else None
        return rtn_cache[b]

    dead = torch.diagonal(h, dim1=-2, dim2=-1) == 0  # (B, K)
    n_dead = dead.sum(1).tolist()
    out: list[GPTQResult | None] = [None] * w.shape[0]
    for b in range(w.shape[0]):
        if n_dead[b] == h.shape[-1]:
            logger.warning("GPTQ: empty Hessian (no calibration tokens); falling back to RTN")
            qw, e = rtn(b)
            out[b] = GPTQResult(qw, e, e, spec.damp, False, Fallback.EMPTY_HESSIAN, n_dead[b])

    live = [b for b in range(w.shape[0]) if out[b] is None]
    if live:
        H = h[live].clone()
        torch.diagonal(H, dim1=-2, dim2=-1).masked_fill_(dead[live], 1)  # dead inputs: weight 0 (reference gptq.py)
        # Static act-order (paper §4 note / reference `--act-order`): largest diag(H) first; stable sort
        # so ties keep their original order and the permutation is reproducible across devices. B == 1 here.
        perm = (torch.argsort(torch.diagonal(H[0]), descending=True, stable=True) if spec.act_order
                else torch.arange(w.shape[-1], device=w.device))
        if spec.act_order:
            H = H[:, perm][:, :, perm]
        hinv, damps = _inverse_hessian_cholesky(H, spec.damp)
        ok = [j for j in range(len(live)) if hinv[j] is not None]
        for j, b in enumerate(live):
            if damps[j] != spec.damp and hinv[j] is not None:
                logger.warning("GPTQ: Hessian not positive definite at damp=%g; used damp=%g", spec.damp, damps[j])
            if hinv[j] is None:
                logger.warning("GPTQ: Hessian not positive definite even at damp=%g; falling back to RTN", damps[j])
                qw, e = rtn(b)
                out[b] = GPTQResult(qw, e, e, damps[j], damps[j] != spec.damp, Fallback.NOT_POSITIVE_DEFINITE, n_dead[b])
        if ok:
            def weights() -> torch.Tensor:  # float32 [len(ok), N, K], dead columns zeroed, processing order
                x = w[[live[j] for j in ok]].float()
                x.masked_fill_(dead[[live[j] for j in ok]].unsqueeze(1), 0)
                return x if not spec.act_order else x[:, :, perm]

            def weights_t() -> torch.Tensor:  # the same, transposed ([len(ok), K, N] contiguous): the kernels' layout
                sel = [live[j] for j in ok]
                x = torch.empty(len(ok), w.shape[2], w.shape[1], device=w.device)
                x.copy_(w[sel].transpose(1, 2))
                return x.masked_fill_(dead[sel].unsqueeze(2), 0)

            clip = spec.clip_objective if clip_search else None
            clip_h = H[ok] if clip == "block" else None
            # the loop updates its weights in place; the descent gets a fresh copy, built only once the
            # loop's is freed (a float32 copy of the batch's weights is the solve's largest tensor)
            Hinv = torch.stack([hinv[j] for j in ok])
            del hinv  # the factors are held once, stacked
            # the kernels where they cover the case: numba on a CPU (gptq_cpu.py), Triton on CUDA (gptq_triton.py)
            fast = _kernels(w, spec, clip)
            if fast is not None:
                q, scale = fast.gptq_loop(weights_t(), Hinv, spec, w.dtype, clip)
                zp = None
            else:
                q, scale, zp = _gptq_loop(weights(), Hinv, perm, spec, w.dtype, clip, clip_h)
            del Hinv
            # (scale_refit is 0 for an asymmetric spec: QuantSpec refuses the pair)
            if spec.cd_sweeps or spec.scale_refit:
                Hd = _damped(H[ok], [damps[j] for j in ok])

                def descent(sweeps: int) -> torch.Tensor:
                    sp = dataclasses.replace(spec, cd_sweeps=sweeps)
                    return (fast.coordinate_descent(weights_t(), q, scale, Hd, sp, w.dtype) if fast is not None else
                            _coordinate_descent(weights(), q, scale, zp, Hd, (perm // spec.group_size), sp, w.dtype))

                if spec.cd_sweeps:
                    q = descent(spec.cd_sweeps)
                for _ in range(spec.scale_refit):  # scales refitted to the integers, then a sweep for the new scales
                    scale = _refit(weights(), q, scale, Hd, perm, spec, w.dtype)
                    if spec.cd_sweeps:
                        q = descent(1)
                del Hd
            if spec.act_order:
                q = q[:, :, torch.argsort(perm)]
            for i, j in enumerate(ok):
                b = live[j]
                qw = QWeight(q[i].contiguous(), scale[i], None if zp is None else zp[i])
                err = hessian_error(w[b], dequantize(qw, spec.group_size), h[b]) if errors else None
                out[b] = GPTQResult(qw, err, rtn(b)[1] if errors else None, damps[j], damps[j] != spec.damp, None,
                                    n_dead[b])
    return out


def _refit(W: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, Hd: torch.Tensor, perm: torch.Tensor,
           spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """`scale_refit.refit_scales` on tensors in processing order (`perm`): it needs each group's columns
    contiguous, i.e. the original order, so act_order's permutation is undone for it."""
    if spec.act_order:
        inv = torch.argsort(perm)
        W, q, Hd = W[:, :, inv], q[:, :, inv], Hd[:, inv][:, :, inv]
    return refit_scales(W, q, scale, Hd, spec, dtype)


def _kernels(w: torch.Tensor, spec: QuantSpec, clip: str | None):
    """The kernel module that solves this case, or None for the torch path: numba on a CPU (gptq_cpu.py),
    Triton on CUDA (gptq_triton.py, imported only then: a CPU run never imports triton)."""
    if w.device.type == "cpu":
        return gptq_cpu if gptq_cpu.applies(w, spec, clip) else None
    from glmq.quantize import gptq_triton

    return gptq_triton if gptq_triton.applies(w, spec, clip) else None


def _check_inputs(w: torch.Tensor, h: torch.Tensor, spec: QuantSpec) -> None:
    if not w.is_floating_point():
        raise ValueError(f"quantize_gptq needs a floating-point weight, got {w.dtype}")
    why = spec.check_shape(tuple(w.shape))
    if why:
        raise ValueError(why)
    k = w.shape[1]
    if tuple(h.shape) != (k, k) or not h.is_floating_point():
        raise ValueError(
            f"Hessian must be a float [{k}, {k}] matrix for a weight of shape {list(w.shape)}, "
            f"got {h.dtype} {list(h.shape)}"
        )
    check_finite(w)  # NonFiniteWeightError naming the rows, as the RTN path raises; GPTQ would hide a NaN in integers
    if not torch.isfinite(h).all():
        raise ValueError(
            "Hessian has NaN/Inf entries: the calibration activations overflowed; "
            "check the calibration forward (dtype, inputs) before quantizing"
        )


def _inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> tuple[list[torch.Tensor | None], list[float]]:
    """Upper Cholesky factors of (H + damp * mean(diag H) * I)^-1 (paper §4, "Cholesky Reformulation").

    H is `[B, K, K]`. Each element whose Cholesky fails is retried with 10x the dampening fraction
    (starting from at least 1e-3), up to MAX_DAMP. Returns (per element U float32 [K, K] or None when
    none worked, per element the fraction used).
    """
    mean_diag = torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)  # (B,)
    U: list[torch.Tensor | None] = [None] * H.shape[0]
    damps = [damp] * H.shape[0]
    todo = list(range(H.shape[0]))
    while todo:
        Hd = H[todo].clone()
        d = torch.tensor([damps[b] for b in todo], device=H.device, dtype=H.dtype) * mean_diag[todo]
        torch.diagonal(Hd, dim1=-2, dim2=-1).add_(d.unsqueeze(-1))
        # U without inverting H: with J the reversal, J H J = L' L'^T gives H = R R^T for the upper
        # R = J L' J, so H^-1 = (R^-1)^T R^-1 and U = R^-1 = J L'^-1 J (upper, positive diagonal: the
        # Cholesky factor). One factorization and one triangular solve instead of the reference's
        # Cholesky, cholesky_inverse and a second Cholesky (0.057 s against 0.076 s for two K = 1024 on a CPU).
        L, info = torch.linalg.cholesky_ex(Hd.flip(-2, -1))
        fact = (info == 0).nonzero().flatten().tolist()
        good = {}
        if fact:
            eye = torch.eye(H.shape[-1], device=H.device, dtype=H.dtype).expand(len(fact), -1, -1)
            Ub = torch.linalg.solve_triangular(L[fact], eye, upper=False).flip(-2, -1)
            fine = (torch.isfinite(Ub).flatten(1).all(1) & (torch.diagonal(Ub, dim1=-2, dim2=-1) > 0).all(1)).tolist()
            good = {fact[i]: Ub[i] for i in range(len(fact)) if fine[i]}
        retry = []
        for j, b in enumerate(todo):
            if j in good:
                U[b] = good[j]
            elif damps[b] < MAX_DAMP:
                damps[b] = min(max(damps[b], 1e-3) * 10, MAX_DAMP)
                retry.append(b)
        todo = retry
    return U, damps


def _damped(H: torch.Tensor, damps: list[float]) -> torch.Tensor:
    """(H + damp_b * mean(diag H_b) * I) `[B, K, K]`, symmetrized: the matrix whose inverse GPTQ factored
    (Cholesky reads one triangle of it; float32 sums leave H symmetric only up to rounding)."""
    d = torch.tensor(damps, device=H.device, dtype=H.dtype) * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)
    Hd = (H + H.transpose(-1, -2)) / 2
    torch.diagonal(Hd, dim1=-2, dim2=-1).add_(d.unsqueeze(-1))
    return Hd


def _gptq_loop(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    perm: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype,
    clip: str | None,
    clip_h: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Paper Alg. 1 over the (permuted) columns of B weights at once, with lazy batch updates of `spec.block_size`.

    Args:
        W: float32 `[B, N, K]` weights, columns in processing order (modified in place).
        Hinv: float32 `[B, K, K]` upper Cholesky factors of the damped inverse Hessians, same order.
        perm: int64 `[K]`, processing position -> original column (shared by the batch).
        clip: None (no clip search) or the `spec.clip_objective` to search with.
        clip_h: the (permuted) Hessians `[B, K, K]` for clip == "block", else None.
    Returns:
        q int8 `[B, N, K]` in processing order; scale `[B, N, G]` dtype and zero point int8 `[B, N, G]` | None,
        indexed by original group.
    """
    nb, n, k = W.shape
    gs, bs = spec.group_size, spec.block_size
    group_of = (perm // gs).tolist()  # processing position -> original group
    members = torch.argsort(perm).view(-1, gs)  # (G, gs): processing positions of each group's columns
    first = _first_positions(group_of)
    scale = torch.empty(nb, n, k // gs, dtype=dtype, device=W.device)
    zp = None if spec.symmetric else torch.empty(nb, n, k // gs, dtype=torch.int8, device=W.device)
    # Per-group scale / zero point, float32 copies of the dtype values, filled when a group starts (per group,
    # not per column: two [B, N, K] float32 tensors were the largest transient of a CPU solve).
    g_scale = torch.empty(nb, n, k // gs, device=W.device)
    g_zp = torch.zeros(nb, n, k // gs, device=W.device)
    Q = torch.empty(nb, n, k, dtype=torch.int8, device=W.device)

    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        W1, Hinv1 = W[:, :, i1:i2].clone(), Hinv[:, i1:i2, i1:i2]
        Err1 = torch.zeros(nb, n, i2 - i1, device=W.device)
        for i in range(i2 - i1):
            if i1 + i in first:  # a group's first column: fix its scale from the current weights
                g, pos = group_of[i1 + i], members[group_of[i1 + i]]
                current = W[:, :, pos] - Err1 @ Hinv[:, i1:i2, pos]  # + the block's pending lazy updates
                _set_group_qparams(current, g, pos, spec, scale, zp, g_scale, g_zp, clip, clip_h, Hinv)
            w, d = W1[:, :, i], Hinv1[:, i, i].unsqueeze(1)  # (B, N), (B, 1)
            g = group_of[i1 + i]
            q_int, q = _quantize_column(w, g_scale[:, :, g], g_zp[:, :, g], spec, dtype)
            Q[:, :, i1 + i] = q_int
            err1 = (w - q) / d  # Alg. 1: E_{:, j} = (W_{:, j} - Q_{:, j}) / [H^-1]_{jj}
            W1[:, :, i:] -= err1.unsqueeze(2) * Hinv1[:, i, i:].unsqueeze(1)  # W_{:, j:} -= E_{:, j} [H^-1]_{j, j:}
            Err1[:, :, i] = err1
        W[:, :, i2:] -= Err1 @ Hinv[:, i1:i2, i2:]  # §4 "Lazy Batch-Updates": one update per block
    return Q, scale, zp


def _first_positions(group_of: list[int]) -> set[int]:
    """Processing positions at which some group is reached for the first time."""
    seen: set[int] = set()
    first = set()
    for j, g in enumerate(group_of):
        if g not in seen:
            seen.add(g)
            first.add(j)
    return first


def _quantize_column(
    w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' fake quantization of one column, as `rtn.quantize_with_qparams`/`dequantize`.

    Args:
        w: float32 `[..., N]`; scale, zp: float32, broadcastable to w, holding dtype-exact values (zp = 0 if symmetric).
    Returns:
        (int8 `[N]` integers, float32 `[N]` dequantized values (q - zp) * scale rounded to dtype).
    """
    q, deq = _fake_quantize(w, scale, zp, spec, dtype)
    return q.to(torch.int8), deq


def _fake_quantize(
    w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_quantize_column` with the integers left as float32 (what the clip search needs)."""
    x = (w.to(dtype).float() / scale).to(dtype)
    if not spec.symmetric:  # symmetric: zp == 0, and adding 0 then rounding to dtype changes nothing
        x = (x.float() + zp).to(dtype)
    q = torch.round(x.float().clamp_(spec.q_min, spec.q_max))
    # For bf16/fp16, (q - zp) * scale is exact in float32 (<= 9-bit integer times an 8/11-bit mantissa),
    # so rounding it to dtype equals the dtype multiply compressed-tensors does on load (`dequantize`);
    # for float32 it is that multiply.
    return q, ((q if spec.symmetric else q - zp) * scale).to(dtype).float()


def _set_group_qparams(
    current: torch.Tensor,
    g: int,
    pos: torch.Tensor,
    spec: QuantSpec,
    scale: torch.Tensor,
    zp: torch.Tensor | None,
    g_scale: torch.Tensor,
    g_zp: torch.Tensor,
    clip: str | None,
    clip_h: torch.Tensor | None,
    Hinv: torch.Tensor,
) -> None:
    """Fix group g's scale (and zero point) from its columns' current values `current` float32 [B, N, gs].

    RTN's math (min/max in the weight dtype, `compute_qparams`), optionally with a clip search (`clip`:
    "block" scores with `clip_h`, "propagated" with Hinv); writes `scale[:, g]`, `zp[:, g]` and their
    float32 copies `g_scale[:, :, g]`, `g_zp[:, :, g]`.
    """
    cur = current.to(scale.dtype)
    lo, hi = group_minmax(cur, cur.shape[-1])  # (B, N, 1) each
    s, z = compute_qparams(lo, hi, spec)
    if clip == "block":
        s, z = _clip_search(cur, lo, hi, s, z, clip_h[:, pos][:, :, pos], spec)
    elif clip == "propagated":
        order = torch.argsort(pos)  # the group's columns in processing order (act_order: not ascending in pos)
        p = pos[order]
        s, z = _propagated_clip_search(current[:, :, order], lo, hi, Hinv[:, p][:, :, p], spec, scale.dtype)
    scale[:, :, g] = s[:, :, 0]
    g_scale[:, :, g] = s[:, :, 0].float()
    if zp is not None:
        zp[:, :, g] = z[:, :, 0]
        g_zp[:, :, g] = z[:, :, 0].float()


def _clip_search(
    cur: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor | None,
    h_gg: torch.Tensor,
    spec: QuantSpec,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, the shrink of [lo, hi] from CLIP_GRID minimizing d H_gg d^T, d = cur - fakequant(cur).

    Args:
        cur: `[B, N, gs]` in the weight dtype; lo, hi, s, z: `[B, N, 1]`; h_gg: float32 `[B, gs, gs]`.
    Returns:
        the chosen scale `[B, N, 1]` dtype and zero point `[B, N, 1]` int8 | None.
    """
    best_err = None
    for p in CLIP_GRID:
        s_p, z_p = compute_qparams((lo.float() * p).to(lo.dtype), (hi.float() * p).to(hi.dtype), spec)
        zf = z_p.float() if z_p is not None else torch.zeros_like(s_p, dtype=torch.float32)
        _, deq = _quantize_column(cur.float(), s_p.float(), zf, spec, cur.dtype)
        d = cur.float() - deq
        err = ((d @ h_gg) * d).sum(-1, keepdim=True)  # (B, N, 1)
        if best_err is None:
            best_err, s, z = err, s_p, z_p
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        s = torch.where(better, s_p, s)
        z = torch.where(better, z_p, z) if z is not None else None
    return s, z


def _propagated_clip_search(
    current: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    u_gg: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, the shrink of [lo, hi] from CLIP_GRID whose GPTQ pass over the group loses least.

    For every candidate scale at once (a leading grid dimension), the group's columns are quantized in
    processing order as `_gptq_loop` does (the same rounding; its updates lazily by SUB_BLOCK columns, so
    equal up to float summation order): column j's error `e_j = (w_j - q_j) / U_jj` is fed back into the
    group's later columns through the group's block `U_gg` of the inverse-Hessian factor.
    The score is the sum of `e_j^2` over the group's columns: GPTQ's loss is `||E||^2` (with H^-1 = U^T U
    and W - Wq = E U, tr((W - Wq) H (W - Wq)^T) = tr(E E^T) for the damped H), so this is the group's
    share of the objective when its scale is chosen. It ignores what the group's feedback later does to
    the columns after it, and with act_order the columns of other groups quantized between the group's
    columns (their errors are not known yet). Ties keep the earlier factor (1.0 first: plain min/max).

    Args:
        current: float32 `[B, N, gs]`, the group's current (error-updated) columns, in processing order.
        lo, hi: `[B, N, 1]` group min/max in the weight dtype; u_gg: float32 `[B, gs, gs]` (upper).
    Returns:
        the chosen scale `[B, N, 1]` dtype and zero point `[B, N, 1]` int8 | None.
    """
    cands = [compute_qparams((lo.float() * p).to(lo.dtype), (hi.float() * p).to(hi.dtype), spec) for p in CLIP_GRID]
    s = torch.stack([c[0] for c in cands])  # (P, B, N, 1)
    z = None if spec.symmetric else torch.stack([c[1] for c in cands])
    sf, zf = s[..., 0].float(), (torch.zeros_like(s[..., 0], dtype=torch.float32) if z is None else z[..., 0].float())
    # columns as the second-last axis, so that one column of every candidate and row is contiguous
    w = current.transpose(1, 2).unsqueeze(0).repeat(len(CLIP_GRID), 1, 1, 1)  # (P, B, gs, N), updated in place
    loss = torch.zeros(w.shape[0], w.shape[1], w.shape[3], device=w.device)  # (P, B, N)
    gs = w.shape[2]
    e = torch.empty_like(w)
    ut = u_gg.unsqueeze(-1)  # (B, gs, gs, 1)
    for j1 in range(0, gs, SUB_BLOCK):  # lazy updates by SUB_BLOCK columns, as `_gptq_loop` by block_size
        j2 = min(j1 + SUB_BLOCK, gs)
        for j in range(j1, j2):
            _, q = _fake_quantize(w[:, :, j], sf, zf, spec, dtype)
            e[:, :, j] = (w[:, :, j] - q) / u_gg[:, j, j].unsqueeze(1)  # (P, B, N)
            loss += e[:, :, j] * e[:, :, j]
            if j + 1 < j2:
                w[:, :, j + 1:j2] -= ut[:, j, j + 1:j2] * e[:, :, j].unsqueeze(2)
        if j2 < gs:
            w[:, :, j2:] -= u_gg[:, j1:j2, j2:].transpose(1, 2) @ e[:, :, j1:j2]
    best = torch.argmin(loss, dim=0, keepdim=True).unsqueeze(-1)  # (1, B, N, 1): the first minimum on ties
    return s.gather(0, best)[0], None if z is None else z.gather(0, best)[0]


# Columns per lazy update inside the propagated clip search and the coordinate descent: updates inside a
# sub-block are immediate rank-1 terms, the rest of the group / block gets one matmul per sub-block (the
# same result up to float rounding order; fewer passes over memory).
SUB_BLOCK = 32
# A coordinate move is taken only if it lowers the objective by more than this fraction of its own
# curvature term (delta^2 H_kk): moves whose gain is at the level of float32 rounding are left alone.
CD_MIN_GAIN = 1e-3


def _coordinate_descent(
    W: torch.Tensor,
    Q: torch.Tensor,
    scale: torch.Tensor,
    zp: torch.Tensor | None,
    Hd: torch.Tensor,
    group_of: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`spec.cd_sweeps` sweeps of cyclic coordinate descent on the integers, scales and zero points fixed.

    Per row r (rows are independent), with d = w - wq (wq = the dequantized integers) the objective is
    f(d) = d Hd d^T. Changing column k's dequantized value by Delta (d_k -= Delta) changes it by
        f(d - Delta e_k) - f(d) = -2 Delta g_k + Delta^2 Hd_kk,   g = d Hd.
    Its real minimizer is Delta = g_k / Hd_kk, i.e. q_k + g_k / (s_k Hd_kk); that is rounded to the grid
    and clamped to [q_min, q_max] (the integer minimizer of a parabola is the rounded real one; clamping
    a convex function keeps the best point of the interval). The change is then evaluated exactly with the
    dtype-rounded dequantized values (bf16 rounding makes Delta differ from s * step) and the move is kept
    only if it lowers f by more than CD_MIN_GAIN * Delta^2 Hd_kk, so f never increases (g is float32; the
    margin is far above its rounding, and tests/test_gptq.py checks every row in float64). g is kept as
    lazy products per block of SUB_BLOCK columns: R = D Hd[:, block] is computed fresh at the block's start
    (one batched matmul) and updated with a rank-1 term per move inside the block, so a sweep costs about
    one `[N, K] x [K, K]` product plus K column steps on `[N, SUB_BLOCK]`. Sweeps stop early once one
    changes nothing (the next would repeat it), which keeps every batch element's result its own.

    Args:
        W: float32 `[B, N, K]` weights in processing order (dead columns zeroed), overwritten (it becomes
            the residual D).
        Q: int8 `[B, N, K]` GPTQ's integers, processing order; scale `[B, N, G]` dtype, zp int8 | None.
        Hd: float32 `[B, K, K]` the damped symmetric Hessian (`_damped`), processing order.
        group_of: int64 `[K]`, processing position -> group.
    Returns:
        the refined integers, int8 `[B, N, K]` (a new tensor; Q is not modified).
    """
    nb, n, k = W.shape
    bs = SUB_BLOCK
    Q = Q.clone()
    sf = scale.float()
    zf = None if zp is None else zp.float()
    hdiag = torch.diagonal(Hd, dim1=-2, dim2=-1)  # (B, K)

    def block_qparams(i1: int, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = group_of[i1:i2]
        return sf[:, :, cols], (torch.zeros(1, device=W.device) if zf is None else zf[:, :, cols])

    def deq(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # as `_quantize_column`
        return ((q - z) * s).to(dtype).float()

    D = W  # the residual w - wq
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        D[:, :, i1:i2] -= deq(Q[:, :, i1:i2].float(), *block_qparams(i1, i2))
    for _ in range(spec.cd_sweeps):
        moved = torch.zeros((), dtype=torch.int64, device=W.device)  # read once per sweep: no sync per column
        for i1 in range(0, k, bs):
            i2 = min(i1 + bs, k)
            s_blk, z_blk = block_qparams(i1, i2)
            # the block's columns as rows ([B, bs, N]), so that each column step reads contiguous memory
            R = (D @ Hd[:, :, i1:i2]).transpose(1, 2).contiguous()  # g for the block's columns
            q0 = Q[:, :, i1:i2].transpose(1, 2)
            qb = q0.float().contiguous()
            s_t = s_blk.transpose(1, 2).contiguous()
            z_t = z_blk if zf is None else z_blk.transpose(1, 2).contiguous()
            dq = deq(qb, s_t, z_t)  # the block's dequantized values, kept equal to deq(qb)
            h_rows = Hd[:, i1:i2, i1:i2].unsqueeze(-1)  # (B, bs, bs, 1): row c is Hd[j, block]
            for c in range(i2 - i1):
                j = i1 + c
                s, z = s_t[:, c], (z_t if zf is None else z_t[:, c])
                h_jj = hdiag[:, j:j + 1]  # (B, 1)
                g = R[:, c]
                q_new = torch.round(qb[:, c] + g / (s * h_jj)).clamp_(spec.q_min, spec.q_max)
                dq_new = deq(q_new, s, z)
                delta = dq_new - dq[:, c]
                dd_h = delta * delta * h_jj
                take = 2 * delta * g - dd_h > CD_MIN_GAIN * dd_h  # false for delta == 0
                delta = torch.where(take, delta, 0.0)
                qb[:, c] = torch.where(take, q_new, qb[:, c])
                dq[:, c] = torch.where(take, dq_new, dq[:, c])
                D[:, :, j] -= delta
                R -= h_rows[:, c] * delta.unsqueeze(1)
            qb = qb.to(torch.int8)
            moved += (qb != q0).sum()
            Q[:, :, i1:i2] = qb.transpose(1, 2)
        if not int(moved):
            break
    return Q
