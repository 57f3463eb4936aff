"""Triton W4A16 GEMM that reads compressed-tensors `pack-quantized` int4 weights as stored.

    y[M, N] = x[M, K] @ dequant(weight_packed[N, K/8], weight_scale[N, K/g]).T      (fp32 accumulate)

Layout: the checkpoint's own (formats.md §2c), no repacking. Row n of `weight_packed` is K/8 int32
words, K-contiguous, nibble k%8 of word k//8 = q + 8, LSB first. A program loads a `[BLOCK_N, g/8]`
word tile per quantization group: with g >= 32 that is >= 16 contiguous bytes per row, which
Triton turns into 16-byte vector loads (it specialises the row stride K/8 on divisibility by 16,
true for every GLM shape), so the weights stream at full width without a load-time `prepack()`. A repack
(Marlin-style interleave into the mma fragment order) would save the in-register shuffle between
the unpacked tile and the dot operand; whether that is worth a second weight format is a question
for GPU profiling, and this file keeps the format the converter writes.

Dequantization in registers (`_unpack_int4`): the word tile is widened with `tl.interleave` (each
thread keeps its own word and the 8 nibbles stay in that thread), shifted and masked; the nibble is
ORed into the mantissa of 2^23 so one float subtraction gives q = u - 8 exactly, with no
int->float conversion instruction. The group scale is applied once per (row, group) *after* the
group's dot product (sum_k x*q, then * scale) rather than once per weight, except on the large-M
path, where scaling the weight tile lets the tensor-core accumulator chain across groups.

Two kernels, chosen by M (`choose_config`, deterministic, no autotuning):
  * GEMV (M <= GEMV_MAX_M): CUDA-core dot products, one [BLOCK_N, g] tile per group, reduced
    along K inside each thread; split-K over groups so that decode shapes launch several CTAs per
    SM (many loads in flight is what a bandwidth-bound GEMV needs).
  * MMA (larger M): `tl.dot` tiles of [BLOCK_M, g] x [g, BLOCK_N], the same split-K for the
    mid-M shapes that have too few output tiles, grouped tile order for L2 reuse at large M.
Split-K reduction is deterministic and needs no memset: every split stores its fp32 partial, then
takes a ticket from a per-tile counter; the last one to arrive sums all partials in split order,
writes the output and resets the counter to zero (CUDA's threadFenceReduction pattern).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("glmq.kernels needs Triton: pip install 'glmq[triton]'") from exc

SUPPORTED_GROUP_SIZES = (32, 64, 128)
ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# M at or below which the CUDA-core GEMV beats a 16-row tensor-core tile (tuning knob, set on H200).
GEMV_MAX_M = 2
# Streaming multiprocessors assumed when no GPU is visible (interpreter runs): an H200's 132, so the
# heuristics take the same decisions under TRITON_INTERPRET=1 as on the target.
DEFAULT_SM_COUNT = 132


class KernelKind(str, enum.Enum):
    GEMV = "gemv"  # CUDA-core dot products; BLOCK_M rows share each dequantized tile
    MMA = "mma"  # tl.dot tiles


@dataclass(frozen=True)
class DenseConfig:
    """Launch parameters of one W4A16 GEMM; `choose_config` picks them, tests and benchmarks may override.

    Attributes:
        kind: GEMV or MMA kernel.
        block_m: rows of x per program (GEMV: 1..8; MMA: >= 16). Powers of two.
        block_n: output columns per program (power of two, >= 16).
        split_k: number of K ranges (each a whole number of groups) reduced across programs.
        scale_b: MMA only: scale the weight tile before the dot (True) or the group's dot result (False).
        group_m: MMA only: output-tile rows per L2 "super-row" in the launch order.
        num_warps, num_stages: Triton launch options.
    """

    kind: KernelKind
    block_m: int
    block_n: int
    split_k: int = 1
    scale_b: bool = False
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KernelKind(self.kind))
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"DenseConfig.{name} must be a power of two, got {v}")
        if self.kind is KernelKind.GEMV and self.block_m > 8:
            raise ValueError(f"the GEMV kernel takes block_m <= 8, got {self.block_m}")
        if self.kind is KernelKind.MMA and self.block_m < 16:
            raise ValueError(f"tl.dot needs block_m >= 16, got {self.block_m}")
        if self.block_n < 16:
            raise ValueError(f"block_n must be >= 16, got {self.block_n}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


# --------------------------------------------------------------------------------------------------
# Triton building blocks (shared with w4a16_moe.py)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _unpack_int4(words, GROUP: tl.constexpr):
    """int32 `[R, GROUP // 8]` words -> float32 `[R, GROUP]` holding q = u - 8 exactly."""
    w = tl.interleave(words, words)
    w = tl.interleave(w, w)
    w = tl.interleave(w, w)  # (R, GROUP): column k holds word k // 8, still in the loading thread
    shift = (tl.arange(0, GROUP) % 8) * 4  # nibble k % 8, LSB first (formats.md §2c)
    nib = (w >> shift[None, :]) & 0xF
    # 0x4B000000 is 2.0**23; a nibble ORed into its mantissa reads as 2**23 + u, exactly.
    return (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2**23 + 8


@triton.jit
def _dot(a, b, acc, EMULATE: tl.constexpr):
    """tl.dot(a, b, acc); EMULATE (interpreter only) feeds it float32 copies of a and b.

    Triton 3.9's interpreter runs `np.matmul` on bf16's uint16 storage, so bf16 dots come out as
    garbage there; the float32 copies hold the same values, and fp32 products of bf16 numbers are
    exact, so the emulated dot computes what the tensor cores compute.
    """
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mma_group(a, w_ptrs, s_ptrs, acc, GROUP: tl.constexpr, SCALE_B: tl.constexpr, EMULATE: tl.constexpr):
    """acc += a @ dequant(one group of weights).T.

    a: `[BM, GROUP]` fp16/bf16 activations; w_ptrs: `[BN, GROUP // 8]` word pointers; s_ptrs: `[BN]`.
    """
    q = _unpack_int4(tl.load(w_ptrs), GROUP)  # (BN, GROUP) f32, small integers
    s = tl.load(s_ptrs).to(tl.float32)  # (BN,)
    if SCALE_B:
        return _dot(a, tl.trans((q * s[:, None]).to(a.dtype)), acc, EMULATE)
    else:
        # q is exact in fp16/bf16; the scale is constant over the group, so apply it to the result.
        return acc + _dot(a, tl.trans(q.to(a.dtype)), tl.zeros_like(acc), EMULATE) * s[None, :]


@triton.jit
def _write_tile(acc, out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile_id, pid_k, split_k, SPLIT: tl.constexpr):
    """Store a `[BM, BN]` fp32 tile, reducing split-K partials deterministically.

    ws_ptr: fp32 `[split_k, M, N]` scratch (unused unless SPLIT); cnt_ptr: int32 per-tile tickets,
    zero on entry and left zero on exit. split_k is a run-time value so that shapes with different
    splits share one compiled kernel; SPLIT (split_k > 1) is the compile-time switch.
    """
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if not SPLIT:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mn = M * N
        ws = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.store(ws + pid_k.to(tl.int64) * mn, acc, mask=mask)
        # All threads' partial stores precede the one-thread release below (bar.sync + acq_rel
        # atomic, as cooperative groups' grid sync does).
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if ticket == split_k - 1:
            # Last split of this tile: sum every partial in split order, so the bits do not depend
            # on which split finished first. ".cg" reads at L2, where the other SMs' stores are.
            total = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, split_k):
                total += tl.load(ws + s * mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile_id, 0)  # re-arm for the next launch


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, groups_per_split, num_groups, split_k,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k). CUDA-core y = x @ dequant(W).T."""
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = tile // n_tiles
    pid_n = tile % n_tiles
    WPG: tl.constexpr = GROUP // 8
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ld = rn % N  # in-bounds rows for the loads; the store masks the tail
    rk = tl.arange(0, GROUP)
    rows = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + rn_ld[:, None] * stride_wn + tl.arange(0, WPG)[None, :]  # (BN, WPG)
    s_ptrs = s_ptr + rn_ld * stride_sn
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        q = _unpack_int4(tl.load(w_ptrs + g * WPG), GROUP)  # (BN, GROUP) f32, q = u - 8
        s = tl.load(s_ptrs + g).to(tl.float32)  # (BN,)
        for i in tl.static_range(BLOCK_M):
            row = tl.minimum(pid_m * BLOCK_M + i, M - 1)  # rows past M compute junk, never stored
            xv = tl.load(x_ptr + row * stride_xm + g * GROUP + rk).to(tl.float32)  # (GROUP,)
            part = tl.sum(q * xv[None, :], axis=1) * s  # (BN,): one group of row i
            if BLOCK_M == 1:
                acc += part[None, :]
            else:
                acc = tl.where(rows[:, None] == i, acc + part[None, :], acc)
    rm = pid_m * BLOCK_M + rows
    _write_tile(acc, out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)


@triton.jit
def _mma_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, groups_per_split, num_groups, split_k,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, SCALE_B: tl.constexpr, EMULATE_DOT: tl.constexpr,
):  # fmt: skip
    """grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k). Tensor-core y = x @ dequant(W).T."""
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped launch order (Triton matmul tutorial): GROUP_M row-tiles share each weight column tile.
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * n_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    WPG: tl.constexpr = GROUP // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    a_ptrs = x_ptr + (rm % M)[:, None] * stride_xm + rk[None, :]  # (BM, GROUP)
    w_ptrs = w_ptr + (rn % N)[:, None] * stride_wn + tl.arange(0, WPG)[None, :]  # (BN, WPG)
    s_ptrs = s_ptr + (rn % N) * stride_sn
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        a = tl.load(a_ptrs + g * GROUP)
        acc = _mma_group(a, w_ptrs + g * WPG, s_ptrs + g, acc, GROUP, SCALE_B, EMULATE_DOT)
    _write_tile(acc, out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)


_INTERPRETED = type(_mma_kernel).__name__ == "InterpretedFunction"

# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def _next_pow2(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


def split_groups(tiles: int, num_groups: int, target_ctas: int, min_groups: int = 4) -> tuple[int, int]:
    """(split_k, groups_per_split) that brings `tiles * split_k` up to about `target_ctas`.

    Each split keeps >= `min_groups` groups (so the fp32 partials stay a small fraction of the
    traffic), and no split is empty.
    """
    if tiles >= target_ctas or num_groups < 2 * min_groups:
        return 1, num_groups
    split = min(-(-target_ctas // tiles), num_groups // min_groups, 32)
    per = -(-num_groups // split)
    return -(-num_groups // per), per


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`, or DEFAULT_SM_COUNT (H200) off-GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def choose_config(m: int, n: int, k: int, group_size: int, sms: int = DEFAULT_SM_COUNT) -> DenseConfig:
    """Deterministic launch configuration by M bucket (no autotuning).

    M <= GEMV_MAX_M: GEMV with a [BLOCK_N, g] tile of 8192 weights (4 KB packed) per group step,
        split-K up to ~4 CTAs per SM: decode is bandwidth-bound and needs loads in flight.
    M <= 64: tensor-core tiles of 16..64 rows, scale applied after each group's dot, split-K as
        above (these shapes are still bandwidth-bound; few output tiles).
    M > 64: 64/128 x 128 tiles, weight tile scaled before the dot so the accumulator chains,
        split-K only when there are fewer tiles than SMs.
    """
    groups = k // group_size
    if m <= GEMV_MAX_M:
        block_m, block_n = _next_pow2(m), max(16, 8192 // group_size)
        tiles = -(-m // block_m) * -(-n // block_n)
        split, _ = split_groups(tiles, groups, 4 * sms)
        return DenseConfig(KernelKind.GEMV, block_m, block_n, split, num_warps=4, num_stages=3)
    if m <= 64:
        block_m, block_n = max(16, _next_pow2(m)), 64
        tiles = -(-m // block_m) * -(-n // block_n)
        split, _ = split_groups(tiles, groups, 4 * sms)
        return DenseConfig(KernelKind.MMA, block_m, block_n, split, scale_b=False, num_warps=4, num_stages=4)
    block_m = 128 if m >= 256 else 64
    tiles = -(-m // block_m) * -(-n // 128)
    split, _ = split_groups(tiles, groups, sms)
    warps = 8 if block_m == 128 else 4
    return DenseConfig(KernelKind.MMA, block_m, 128, split, scale_b=True, num_warps=warps, num_stages=3)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer of >= `count` split-K tickets for `device`, reused across launches.

    The kernels leave every ticket at zero, so the buffer is allocated (and zeroed) once instead of
    costing a memset per call. Not safe for two split-K launches running concurrently on different
    streams of one device.
    """
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = buf
    return buf


def check_common(x: torch.Tensor, group_size: int) -> None:
    """Preconditions shared by the dense and MoE wrappers on the activations and group size."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous())")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"x is on {x.device}; the Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 set before glmq.kernels is imported)"
        )


def check_packed(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: tuple, group_size: int, device) -> None:
    """`packed` int32 `[..., N, K/8]` and `scale` `[..., N, K/g]`, contiguous, on `device`.

    `shape` is the expected `(..., N, K)` of the unpacked weight.
    """
    *lead, n, k = shape
    if packed.dtype != torch.int32:
        raise ValueError(f"{name}_packed must be int32, got {packed.dtype}")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}_scale must be float16, bfloat16 or float32, got {scale.dtype}")
    if tuple(packed.shape) != (*lead, n, k // 8):
        raise ValueError(f"{name}_packed has shape {list(packed.shape)}, expected {[*lead, n, k // 8]}")
    if tuple(scale.shape) != (*lead, n, k // group_size):
        raise ValueError(
            f"{name}_scale has shape {list(scale.shape)}, expected {[*lead, n, k // group_size]} "
            f"for group_size {group_size}"
        )
    for t, what in ((packed, "packed"), (scale, "scale")):
        if t.device != device:
            raise ValueError(f"{name}_{what} is on {t.device}, x is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}_{what} must be contiguous (call .contiguous())")


def check_k(k: int, group_size: int, what: str = "K") -> None:
    if k <= 0 or k % 8:
        raise ValueError(f"{what} = {k} must be a positive multiple of 8 (int4 packs 8 values per int32)")
    if k % group_size:
        raise ValueError(f"{what} = {k} must be a multiple of group_size {group_size}")


def check_out(out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> None:
    if out is None:
        return
    if tuple(out.shape) != shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} {list(shape)}, got {out.dtype} {list(out.shape)}")
    if out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous on {x.device}")


def w4a16_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    config: DenseConfig | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T for a symmetric compressed-tensors int4 weight, fp32 accumulation.

    Args:
        x: float16/bfloat16 `[M, K]`, contiguous.
        weight_packed: int32 `[N, K/8]`, contiguous, LSB-first nibbles q + 8 (formats.md §2c).
        weight_scale: float16/bfloat16/float32 `[N, K/group_size]`, contiguous.
        group_size: 32, 64 or 128; K must be a multiple of it (and of 8).
        out: optional `[M, N]` buffer of x's dtype; every element is written.
        config: optional launch override (tests, tuning); default `choose_config(M, N, K, g)`.
    Returns:
        `[M, N]` in x's dtype (`out` if given).
    Raises:
        ValueError: on any unsupported dtype, shape, layout or device.
    """
    check_common(x, group_size)
    m, k = x.shape
    check_k(k, group_size)
    if weight_packed.ndim != 2 or weight_scale.ndim != 2:
        raise ValueError(
            f"weight_packed and weight_scale must be 2-D, got {list(weight_packed.shape)} and {list(weight_scale.shape)}"
        )
    n = weight_packed.shape[0]
    check_packed("weight", weight_packed, weight_scale, (n, k), group_size, x.device)
    check_out(out, (m, n), x)
    cfg = config or choose_config(m, n, k, group_size, sm_count(x.device))

    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    _launch(x, weight_packed, weight_scale, out, group_size, cfg)
    return out


def _launch(x, wp, ws, out, group_size: int, cfg: DenseConfig) -> None:
    """Allocate the split-K scratch (if any) and launch the kernel `cfg` names; writes `out`."""
    m, k = x.shape
    n = wp.shape[0]
    groups = k // group_size
    per = -(-groups // cfg.split_k)
    split = -(-groups // per)  # no empty splits
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if split > 1:
        scratch = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # fp32 partials
        tickets = _tickets(x.device, tiles)
    else:
        scratch = tickets = out  # not dereferenced without SPLIT
    args = (x, wp, ws, out, scratch, tickets, m, n, x.stride(0), wp.stride(0), ws.stride(0), out.stride(0), per, groups,
            split)  # fmt: skip
    grid = (tiles, split)
    if cfg.kind is KernelKind.GEMV:
        _gemv_kernel[grid](
            *args, GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=split > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        _mma_kernel[grid](
            *args, GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
            SPLIT=split > 1, SCALE_B=cfg.scale_b, EMULATE_DOT=_INTERPRETED and x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
