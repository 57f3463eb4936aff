"""Fused MoE over compressed-tensors int4 experts (W4A16), the way a serving engine runs GLM-5's MoE.

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

Weights are the checkpoint's per-expert tensors stacked on a leading expert dim (formats.md §2c,
reference.py for the w13 convention), repacked once by `w4a16_dense.prepack` (nibbles permuted
inside 128-column chunks; `fused_moe_w4a16` does it on first use and caches the result, or pass
`prepack_moe`'s result to `fused_moe_w4a16_packed`):
    w13_packed int32 [E, 2I, H/8]  rows [0, I) gate_proj, [I, 2I) up_proj;  w13_scale [E, 2I, H/g]
    w2_packed  int32 [E, H, I/8]   down_proj;                                w2_scale  [E, H, I/g]
H and I must be multiples of 128 (the tensor-core chunk; GLM-5: 6144 and 2048).

Steps (four launches at decode sizes):
  1. `moe_align_block_size`: sort the M*topk (token, slot) assignments by expert, stably, and pad
     each expert's run to a multiple of BLOCK_M; every BLOCK_M block of the sorted list then belongs
     to one expert. Assignments whose expert id is outside [0, E) (-1: an expert not on this rank, as
     in vLLM's expert parallelism) are dropped: they go after the last expert's run, in blocks whose
     expert is E, and contribute zero (step 3). Written in torch (no host sync, so it can be
     captured in a CUDA graph); that is
     ~25 tiny kernels, at ~1-2 us each even inside a graph (an estimate, not yet measured) the same
     order as the ~40 us it takes to stream 8 experts' int4 weights at decode, so up to
     ALIGN_ONE_LAUNCH_MAX assignments the same result comes from one single-program Triton launch
     (`_align_kernel`, tested for equality with the torch path).
  2. gate_up kernel: one launch over all (block, column-tile) pairs; each program computes the gate
     and the up tile of the same columns with two accumulators and writes silu(gate) * up, so the
     SiLU gating is fused and the [M*topk, 2I] pre-activation never reaches memory.
  3. down kernel: the same kernel without the gate, multiplying each row by its router weight and
     writing row (t, j) of a [M, topk, H] buffer; its programs on blocks of expert E write zero rows
     for the dropped assignments there, so every row of the buffer is written.
  4. `torch.sum` over topk (fp32 accumulation inside torch), i.e. a fixed-order, deterministic
     per-token reduction instead of atomics.
Both launches come in two variants that reuse the dense building blocks: `_moe_swap_kernel`
(`MoeConfig.swap`; the transposed product of `w4a16_dense._mma_swap_kernel`: dequantized expert
weights as the tensor cores' register operand, the block's gathered activation rows as the
shared-memory operand, one K = 128 dot per chunk, Triton's cp.async pipelining) and `_moe_kernel`
(`_chunk_dots` / `_chunk_dot`: a dot per plane or a gathered K = 128 dot, group scale applied once per
group, the next chunk's words prefetched into registers). A block of padded rows costs a 16-row
tile, which at decode sizes is cheap next to streaming the expert's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glmq.kernels.w4a16_dense import (
    _INTERPRETED,
    DEFAULT_SM_COUNT,
    MMA_CHUNK,
    Layout,
    PackedW4,
    _chunk_dot,
    _chunk_dots,
    _dequant_nat,
    _dot,
    _load_scales,
    _next_pow2,
    _pairs_chunk_dot,
    cached_prepack,
    check_common,
    check_k,
    check_out,
    check_packed,
    device_name,
    layout_for,
    max_rows,
    sm_count,
    tuned_entry,
)

# Up to this many (token, slot) assignments the alignment runs as one Triton program (O(T * E) work
# in a single CTA); above it, the torch sort (tuning knob: ~M = 128 at top-8).
ALIGN_ONE_LAUNCH_MAX = 1024


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of the fused MoE; `choose_moe_config` picks them.

    Attributes:
        block_m: sorted assignments per program (>= 16, power of two); each expert's run is padded to it.
        block_n_up: columns of I per gate_up program (it computes gate and up for these columns).
        block_n_down: columns of H per down program.
        prefetch: load the next chunk's words into registers before computing this one.
        big_dot: group 128 only, not swap: one K = 128 dot per chunk (gathered activations)
            instead of eight K = 16 dots.
        swap: the transposed product (`_moe_swap_kernel`, as `DenseConfig.swap`): dequantized
            weights as the register operand of the tensor cores, one K = 128 dot per chunk,
            pipelined by Triton (num_stages); prefetch and big_dot do not apply.
        asm: swap only: inline-PTX dequantization (CUDA; the interpreter ignores it).
        num_warps, num_stages: Triton launch options.
    """

    block_m: int
    block_n_up: int
    block_n_down: int
    prefetch: bool = True
    big_dot: bool = False
    swap: bool = False
    asm: bool = True
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n_up", "block_n_down"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name} must be a power of two >= 16, got {v}")


def choose_moe_config(
    m: int, topk: int, num_experts: int, inter: int, hidden: int, sms: int = DEFAULT_SM_COUNT,
    group_size: int = 128, device: str = "cpu", layout: Layout = Layout.PLANES,
) -> MoeConfig:  # fmt: skip
    """The tuned configuration for this GPU and shape if any, else a deterministic heuristic.

    Heuristic: the transposed kernel (`swap`); BLOCK_M follows the mean tokens per active expert
    (16 at decode, up to 64 at prefill); the column tiles shrink (to 64, the tensor cores' M) until
    there are ~4 programs per SM, since decode MoE is bandwidth-bound.
    """
    ent = tuned_entry("moe", f"{num_experts},{hidden},{inter},{topk},{group_size}", m, device, layout)
    if ent is not None:
        return MoeConfig(**ent)
    assignments = m * topk
    active = max(1, min(num_experts, assignments))
    block_m = min(64, max(16, _next_pow2(-(-assignments // active))))
    blocks = -(-assignments // block_m) + active  # upper bound on non-empty blocks

    def cols(n: int) -> int:
        for bn in (128, 64, 32):
            if blocks * -(-n // bn) >= 4 * sms:
                return bn
        return 32

    return MoeConfig(block_m, max(64, cols(inter)), max(64, cols(hidden)), swap=True,
                     num_warps=8 if block_m >= 64 else 4, num_stages=3)  # fmt: skip


def align_num_blocks(assignments: int, block_m: int, num_experts: int) -> int:
    """Static bound on the blocks of the aligned list: non-empty experts <= min(E, T), each padded by < block_m."""
    return -(-(assignments + min(num_experts, assignments) * (block_m - 1)) // block_m)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, *, one_launch: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort (token, slot) assignments by expert, padding each expert's run to a multiple of block_m.

    Runs on the device with static shapes (no `.item()`), so it works inside a CUDA graph. Within an
    expert the assignments keep their flat order (stable), so both implementations agree exactly.

    Args:
        topk_ids: int32/int64 `[M, topk]` expert ids. Ids outside [0, num_experts) (-1: expert not on
            this rank) are not checked here (that would sync): those assignments are dropped, i.e.
            placed after the last expert's padded run, in flat order and unpadded, in blocks whose
            expert id is num_experts, which the grouped GEMM does not compute (the down launch
            writes zero rows for them). Nothing is ever written outside the returned buffers.
        block_m: block size of the grouped GEMM.
        num_experts: E.
        one_launch: force the single Triton launch (True) or the torch ops (False); default by size.
    Returns:
        sorted_ids: int32 `[P]`, flat assignment index t*topk + j, grouped by expert (the dropped
            ones last); padding slots hold M*topk (an invalid index). P = num_blocks * block_m, a
            static upper bound (dropped assignments take no padding, so it still holds).
        expert_ids: int32 `[num_blocks]`, expert of each block; num_experts for blocks past the end.
        num_blocks: host int (the grid size), `align_num_blocks(M*topk, block_m, E)`.
    """
    t = topk_ids.numel()
    if one_launch is None:
        one_launch = t <= ALIGN_ONE_LAUNCH_MAX
    if one_launch:
        return _align_one_launch(topk_ids.reshape(-1), block_m, num_experts)
    flat = topk_ids.reshape(-1).long()  # (T,)
    dev = flat.device
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped: group E, after all runs
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).index_add_(0, flat, torch.ones_like(flat))
    # (E + 1,); group E's padding lies past every slot it uses, so padding it too changes nothing
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # padded run of expert e is [ends[e] - padded[e], ends[e])
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order inside
    sorted_e = flat[order]
    rank = torch.arange(t, device=dev) - (counts.cumsum(0) - counts)[sorted_e]  # index inside its run
    num_blocks = align_num_blocks(t, block_m, num_experts)
    sorted_ids = torch.full((num_blocks * block_m,), t, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, num_blocks * block_m, block_m, device=dev)
    expert_ids = torch.searchsorted(ends[:num_experts], block_start, right=True).to(torch.int32)
    return sorted_ids, expert_ids, num_blocks


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, T, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """grid = (1,). `moe_align_block_size` in one program: counts, padded offsets, expert of each
    block, then each assignment's slot = padded start of its expert + its rank among the earlier
    assignments of that expert (a running one-hot prefix sum: stable, no sort, no atomics). Ids
    outside [0, num_experts) are dropped: a second scatter, run only when there are any, puts them
    after the last expert's run in flat order (in bounds: `align_num_blocks` counts them without
    padding); every scatter is masked to the buffer all the same."""
    ex = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)  # lanes in [E, E_P2) count ids there, and are ignored
    for c in range(0, T, CHUNK):
        r = c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < T, other=-1)
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # expert e's run is [ends[e] - padded[e], ends[e])
    for b in range(0, num_blocks, CHUNK):
        rb = b + tl.arange(0, CHUNK)
        # expert of the block starting at s = #{e < E : ends[e] <= s}  (E for blocks past the end)
        done = (ends[None, :] <= (rb * BLOCK_M)[:, None]) & (ex[None, :] < num_experts)
        tl.store(expert_ids_ptr + rb, tl.sum(done.to(tl.int32), axis=1), mask=rb < num_blocks)
    for p in range(0, num_blocks * BLOCK_M, CHUNK):
        rp = p + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + rp, T, mask=rp < num_blocks * BLOCK_M)  # padding marker
    tl.debug_barrier()  # the markers land before the scatter below overwrites the used slots
    seen = ends - padded  # next free slot of each expert
    for c in range(0, T, CHUNK):
        r = c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < T, other=-1)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)  # (CHUNK, E_P2): one 1 per row with e in [0, E_P2)
        slot = tl.sum(hit * (tl.cumsum(hit, axis=0) - 1 + seen[None, :]), axis=1)
        ok = (r < T) & (e >= 0) & (e < num_experts)
        tl.store(sorted_ids_ptr + slot, r, mask=ok & (slot < num_blocks * BLOCK_M))
        seen += tl.sum(hit, axis=0)
    in_range = ex < num_experts
    if tl.sum(tl.where(in_range, counts, 0), axis=0) < T:  # some ids outside [0, E): dropped
        nxt = tl.sum(tl.where(in_range, padded, 0), axis=0)  # their next slot, after every run
        for c in range(0, T, CHUNK):
            r = c + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + r, mask=r < T, other=0)
            drop = ((r < T) & ((e < 0) | (e >= num_experts))).to(tl.int32)
            slot = nxt + tl.cumsum(drop, axis=0) - 1
            tl.store(sorted_ids_ptr + slot, r, mask=(drop > 0) & (slot < num_blocks * BLOCK_M))
            nxt += tl.sum(drop, axis=0)


def _align_one_launch(flat_ids: torch.Tensor, block_m: int, num_experts: int):
    """`moe_align_block_size` for contiguous int32/int64 `[T]` ids, as one `_align_kernel` launch."""
    t = flat_ids.numel()
    num_blocks = align_num_blocks(t, block_m, num_experts)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat_ids.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat_ids.device)
    e_p2 = _next_pow2(num_experts)
    chunk = max(16, min(256, 8192 // e_p2))  # ~8K one-hot elements per step
    _align_kernel[(1,)](
        flat_ids, sorted_ids, expert_ids, t, num_experts, num_blocks,
        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_blocks


@triton.jit
def _zero_rows(c_ptr, sorted_ids_ptr, pid_m, pid_n, N, num_valid, stride_cm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Write zeros to the BLOCK_N-column tile pid_n of the output rows of block pid_m's valid
    assignments (a block of expert E holds the dropped ones, ids outside [0, E))."""
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (ids < num_valid)[:, None] & (rn[None, :] < N)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty)
    tl.store(c_ptr + ids[:, None] * stride_cm + rn[None, :], zero, mask=mask)


@triton.jit
def _moe_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, router_w_ptr,
    N, num_valid, num_chunks, num_experts,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr, GPC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, BIG_DOT: tl.constexpr,
    EMULATE_DOT: tl.constexpr,
):  # fmt: skip
    """grid = (num_blocks * cdiv(N, BLOCK_N),). One expert's BLOCK_M sorted rows x BLOCK_N columns.

    Row r of block b is assignment i = sorted_ids[b*BLOCK_M + r] (i >= num_valid: padding). It reads
    activation row i // A_ROW_DIV (x[token] for gate_up, h[i] for down) and writes output row i.
    GATED: weight rows [0, N) are gate and [N, 2N) up; the output is silu(gate) * up.
    ROUTED: the output row is multiplied by router_w[i]. Weights prepacked, chunk 128.
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert >= num_experts:  # block past the last expert's padded run: padding and dropped ids only
        if ROUTED:  # down launch: the dropped assignments' output rows are zero
            _zero_rows(c_ptr, sorted_ids_ptr, pid_m, pid_n, N, num_valid, stride_cm, BLOCK_M, BLOCK_N)
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_valid
    a_rows = tl.where(valid, ids // A_ROW_DIV, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    if BIG_DOT:  # activations of a chunk in the prepacked column order (`_dequant_chunk`)
        r128 = tl.arange(0, 128)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ((r128 % 8) * 16 + r128 // 8)[None, :]  # [BM, 128]
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + r16[None, :]  # [BM, 16]: plane 0 of chunk 0
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + (rn % N)[:, None] * stride_wn + r16[None, :]  # [BN, 16]
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (rn % N) * stride_sn
    up_off = N * stride_wn  # the up rows of the same columns sit N rows further down
    up_soff = N * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        words = tl.load(w_ptrs)
        if GATED:
            words_up = tl.load(w_ptrs + up_off)
    for c in range(0, num_chunks):
        if PREFETCH:
            more = r16[None, :] * 0 + (rn[:, None] * 0 + c + 1) < num_chunks
            nxt = tl.load(w_ptrs + (c + 1) * 16, mask=more, other=0)
            if GATED:
                nxt_up = tl.load(w_ptrs + up_off + (c + 1) * 16, mask=more, other=0)
        else:
            words = tl.load(w_ptrs + c * 16)
            if GATED:
                words_up = tl.load(w_ptrs + up_off + c * 16)
        if BIG_DOT:
            a = tl.load(a_ptrs + c * 128)
            acc = _chunk_dot(a, words, tl.load(s_ptrs + c).to(tl.float32), acc, EMULATE_DOT)
            if GATED:
                acc_up = _chunk_dot(a, words_up, tl.load(s_ptrs + up_soff + c).to(tl.float32), acc_up, EMULATE_DOT)
        else:
            acc = _chunk_dots(a_ptrs + c * 128, words, s_ptrs + c * GPC, acc, GPC, EMULATE_DOT)
            if GATED:
                acc_up = _chunk_dots(a_ptrs + c * 128, words_up, s_ptrs + up_soff + c * GPC, acc_up, GPC, EMULATE_DOT)
        if PREFETCH:
            words = nxt
            if GATED:
                words_up = nxt_up
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED:
        acc = acc * tl.load(router_w_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & (rn[None, :] < N)
    tl.store(c_ptr + ids[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_swap_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, router_w_ptr,
    N, num_valid, num_chunks, num_experts,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm, stride_wc,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr, GPC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, EMULATE_DOT: tl.constexpr,
    PAIRS: tl.constexpr,
):  # fmt: skip
    """`_moe_kernel` as a transposed product (see `w4a16_dense._mma_swap_kernel`): accumulators
    `[BLOCK_N, BLOCK_M]` = dequant(W_e) @ a.T, the expert's dequantized weights the tensor cores'
    register operand, the block's gathered activation rows (transposed) the shared-memory operand;
    one K = 128 dot per chunk and weight matrix. PLANES weights: scales folded into the weights;
    PAIRS: `w4a16_dense._pairs_chunk_dot`. stride_wc: words between chunks. Padding rows of a block
    are not loaded (zero-filled): at decode a block holds one valid row and 15 padding ones."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert >= num_experts:  # block past the last expert's padded run: padding and dropped ids only
        if ROUTED:  # down launch: the dropped assignments' output rows are zero
            _zero_rows(c_ptr, sorted_ids_ptr, pid_m, pid_n, N, num_valid, stride_cm, BLOCK_M, BLOCK_N)
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_valid
    a_rows = tl.where(valid, ids // A_ROW_DIV, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    r128 = tl.arange(0, 128)
    at_ptrs = a_ptr + a_rows[None, :] * stride_am + r128[:, None]  # [128, BM]: chunk 0 of the rows, transposed
    a_mask = valid[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + (rn % N)[:, None] * stride_wn + r16[None, :]  # [BN, 16]
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (rn % N) * stride_sn
    up_off = N * stride_wn  # the up rows of the same columns sit N rows further down
    up_soff = N * stride_sn
    s0, s1, s2, s3 = _load_scales(s_ptrs, 0, rn >= 0, GPC)
    if GATED:
        u0, u1, u2, u3 = _load_scales(s_ptrs + up_soff, 0, rn >= 0, GPC)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c in range(0, num_chunks):
        at = tl.load(at_ptrs + c * 128, mask=a_mask, other=0.0)
        words = tl.load(w_ptrs + c * stride_wc)
        more = rn * 0 + c + 1 < num_chunks
        n0, n1, n2, n3 = _load_scales(s_ptrs, c + 1, more, GPC)  # in flight during this chunk
        if PAIRS:
            acc = _pairs_chunk_dot(words, s0, at, acc, ASM, EMULATE_DOT)
        else:
            acc = _dot(_dequant_nat(words, s0, s1, s2, s3, at.dtype, GPC, ASM), at, acc, EMULATE_DOT)
        s0, s1, s2, s3 = n0, n1, n2, n3
        if GATED:
            words_up = tl.load(w_ptrs + up_off + c * stride_wc)
            m0, m1, m2, m3 = _load_scales(s_ptrs + up_soff, c + 1, more, GPC)
            if PAIRS:
                acc_up = _pairs_chunk_dot(words_up, u0, at, acc_up, ASM, EMULATE_DOT)
            else:
                acc_up = _dot(_dequant_nat(words_up, u0, u1, u2, u3, at.dtype, GPC, ASM), at, acc_up, EMULATE_DOT)
            u0, u1, u2, u3 = m0, m1, m2, m3
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    y = tl.trans(acc)  # [BM, BN]
    if ROUTED:
        y = y * tl.load(router_w_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & (rn[None, :] < N)
    tl.store(c_ptr + ids[:, None] * stride_cm + rn[None, :], y.to(c_ptr.dtype.element_ty), mask=mask)


def _check_moe(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size) -> None:
    """Preconditions of `fused_moe_w4a16` on the checkpoint's tensors."""
    check_common(x, group_size)
    if w13_packed.ndim != 3 or w2_packed.ndim != 3:
        raise ValueError(
            f"w13_packed and w2_packed must be 3-D [E, rows, cols/8], got {list(w13_packed.shape)} "
            f"and {list(w2_packed.shape)}"
        )
    num_experts, two_i = w13_packed.shape[:2]
    inter = _check_dims(x, group_size, two_i, "w13_packed")
    check_packed("w13", w13_packed, w13_scale, (num_experts, two_i, x.shape[1]), group_size, x.device)
    check_packed("w2", w2_packed, w2_scale, (num_experts, x.shape[1], inter), group_size, x.device)
    _check_routing(x, topk_weights, topk_ids)


def _check_moe_packed(x, w13: PackedW4, w2: PackedW4, topk_weights, topk_ids) -> None:
    """Preconditions of `fused_moe_w4a16_packed` (the same rules on `prepack_moe`'s weights)."""
    g = w13.group_size
    check_common(x, g)
    if len(w13.lead) != 1 or len(w2.lead) != 1:
        raise ValueError(f"prepacked w13 and w2 must be stacked over one expert dim, got {[*w13.lead, w13.n, w13.k]} "
                         f"and {[*w2.lead, w2.n, w2.k]}")  # fmt: skip
    if w2.group_size != g:
        raise ValueError(f"w13 and w2 have group sizes {g} and {w2.group_size}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.layout is Layout.SPANS:  # its x order suits the 2-D decode kernel; the grouped GEMM reads PAIRS
            raise ValueError(f"prepacked {name} is in the spans layout, which only the dense kernels read; prepack "
                             "expert weights with the default layout (prepack_moe)")
    num_experts, two_i = w13.lead[0], w13.n
    inter = _check_dims(x, g, two_i, "w13")
    w13.check((num_experts,), two_i, x.shape[1], x.device, "w13")
    w2.check((num_experts,), x.shape[1], inter, x.device, "w2")
    _check_routing(x, topk_weights, topk_ids)


def _check_dims(x, group_size: int, two_i: int, what13: str) -> int:
    """H (x's columns) and 2I (w13's rows) against the group size and the 128-column chunk; returns I."""
    hidden = x.shape[1]
    check_k(hidden, group_size, "hidden size H")
    if two_i % 2:
        raise ValueError(f"{what13} has {two_i} rows per expert; expected 2I (gate rows then up rows)")
    inter = two_i // 2
    check_k(inter, group_size, "intermediate size I")
    for what, v in (("hidden size H", hidden), ("intermediate size I", inter)):
        if v % MMA_CHUNK:
            raise ValueError(f"{what} = {v} must be a multiple of {MMA_CHUNK} for the fused MoE kernel")
    return inter


def _check_routing(x, topk_weights, topk_ids) -> None:
    m = x.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [M={m}, topk], got {topk_ids.dtype} {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be a float tensor of topk_ids' shape {list(topk_ids.shape)}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)}"
        )
    for t, name in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {x.device}")


def _check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """On the CPU: ids must lie in [0, E) or be -1, else a ValueError naming them. Not on CUDA: a check there costs
    a host sync (eager) or extra launches (graphs) on every decode step; the kernels drop such ids like -1 (never
    garbage, never a write out of bounds)."""
    if topk_ids.is_cuda:
        return
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bad.any():
        b = topk_ids[bad]
        raise ValueError(
            f"topk_ids holds {b.numel()} expert id(s) in [{int(b.min())}, {int(b.max())}], outside [0, E) "
            f"with E = {num_experts} experts (only -1, 'expert not on this rank', may lie outside)"
        )


def prepack_moe(w13_packed, w13_scale, w2_packed, w2_scale, group_size: int) -> tuple[PackedW4, PackedW4]:
    """Repack stacked expert weights once (`w4a16_dense.prepack`) for `fused_moe_w4a16_packed`."""
    from glmq.kernels.w4a16_dense import prepack

    return prepack(w13_packed, w13_scale, group_size), prepack(w2_packed, w2_scale, group_size)


def fused_moe_w4a16(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts with int4 weights: the MoE block of GLM-5 minus router and shared expert.

    The stacked weights are prepacked on first use and cached per tensor (`cached_prepack`); use
    `prepack_moe` + `fused_moe_w4a16_packed` to hold that copy yourself.

    Args:
        x: float16/bfloat16 `[M, H]`, contiguous; any M (from M x topk x max(H, I) = 2^31 on, GLM-5's M = 43691,
            in token slices: w4a16_dense.INDEX_LIMIT).
        w13_packed: int32 `[E, 2I, H/8]`; rows [0, I) gate_proj, [I, 2I) up_proj.
        w13_scale: float16/bfloat16/float32 `[E, 2I, H/group_size]`.
        w2_packed: int32 `[E, H, I/8]` (down_proj).
        w2_scale: float16/bfloat16/float32 `[E, H, I/group_size]`.
        topk_weights: float `[M, topk]` router weights (applied after down_proj).
        topk_ids: int32/int64 `[M, topk]`, values in [0, E), or -1 for "expert not on this rank"
            (vLLM's expert-parallel convention): a -1 assignment contributes nothing, so a row whose
            ids are all -1 comes out zero. Any other id outside [0, E) is a ValueError on the CPU; on
            CUDA it is not checked (that would cost a sync or launches per call) and is dropped like
            -1: never garbage, never a write out of bounds.
        group_size: 32, 64 or 128; H and I must be multiples of 128 (and of the group size).
        out: optional `[M, H]` buffer of x's dtype; every element is written.
        config: optional launch override (tests, tuning); default `choose_moe_config`.
    Returns:
        `[M, H]` in x's dtype (`out` if given).
    Raises:
        ValueError: on any unsupported dtype, shape, layout or device, or an expert id in topk_ids
            outside [0, E) other than -1.
    """
    _check_moe(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, group_size)
    lay = layout_for(config, MMA_CHUNK, group_size)
    w13 = cached_prepack(w13_packed, w13_scale, group_size, *lay)
    w2 = cached_prepack(w2_packed, w2_scale, group_size, *lay)
    return fused_moe_w4a16_packed(x, w13, w2, topk_weights, topk_ids, out=out, config=config)


def fused_moe_w4a16_packed(
    x: torch.Tensor,
    w13: PackedW4,
    w2: PackedW4,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """`fused_moe_w4a16` on `prepack_moe`'s weights (same arguments and errors)."""
    g = w13.group_size
    _check_moe_packed(x, w13, w2, topk_weights, topk_ids)
    m, hidden = x.shape
    num_experts, inter = w13.lead[0], w13.n // 2
    topk = topk_ids.shape[1]
    check_out(out, (m, hidden), x)
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or topk == 0:
        return out.zero_()
    rows = max_rows(topk * hidden, topk * inter)  # h and y rows are assignments: M x topk x max(H, I) < 2^31
    if m > rows:  # GLM-5: M > 43690 tokens; token slices, each its own config (w4a16_dense.INDEX_LIMIT)
        for i in range(0, m, rows):
            j = i + rows
            fused_moe_w4a16_packed(x[i:j], w13, w2, topk_weights[i:j], topk_ids[i:j], out=out[i:j], config=config)
        return out
    cfg = config or choose_moe_config(m, topk, num_experts, inter, hidden, sm_count(x.device), g, device_name(x.device),
                                      w13.layout)
    _check_expert_ids(topk_ids, num_experts)
    sorted_ids, expert_ids, num_blocks = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    h = torch.empty(m * topk, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up per assignment
    y = torch.empty(m, topk, hidden, dtype=x.dtype, device=x.device)  # weighted expert outputs
    _launch_experts(x, w13, w2, topk_weights, sorted_ids, expert_ids, num_blocks, h, y, cfg)
    return torch.sum(y, dim=1, out=out)


def _launch_experts(x, w13: PackedW4, w2: PackedW4, topk_weights, sorted_ids, expert_ids, num_blocks, h, y, cfg):
    """The two grouped GEMM launches; `h` `[T, I]` and `y` `[M, topk, H]` are written."""
    m, hidden = x.shape
    num_experts = w13.lead[0]
    topk = y.shape[1]
    _grouped_launch(cfg, "up", x, w13, h, sorted_ids, expert_ids, topk_weights, num_blocks, m * topk, num_experts, topk)
    _grouped_launch(cfg, "down", h, w2, y, sorted_ids, expert_ids, topk_weights, num_blocks, m * topk, num_experts, topk)


def _grouped_launch(cfg, which: str, a, w: PackedW4, c, sorted_ids, expert_ids, topk_weights, num_blocks: int,
                    num_valid: int, num_experts: int, topk: int) -> None:  # fmt: skip
    """One grouped GEMM launch: "up" (x -> silu(gate) * up into h `[T, I]`) or "down" (h -> y `[M, topk, H]`)."""
    up = which == "up"
    n = w.n // 2 if up else w.n
    block_n = cfg.block_n_up if up else cfg.block_n_down
    kernel, common = _kernel_and_options(cfg, w, num_valid, num_experts, a.dtype)
    stride_wn, stride_wc = w.word_strides()
    if cfg.swap:
        common["stride_wc"] = stride_wc
    kernel[(num_blocks * triton.cdiv(n, block_n),)](
        a, w.qweight, w.scale, c, sorted_ids, expert_ids, topk_weights,
        n, num_chunks=w.k // MMA_CHUNK,
        stride_am=a.stride(0), stride_we=w.qweight.stride(0), stride_wn=stride_wn,
        stride_se=w.scale.stride(0), stride_sn=w.scale.stride(1), stride_cm=c.stride(0) if up else c.shape[-1],
        A_ROW_DIV=topk if up else 1, GATED=up, ROUTED=not up, BLOCK_N=block_n, **common,
    )  # fmt: skip


def _kernel_and_options(cfg: MoeConfig, w: PackedW4, num_valid: int, num_experts: int, dtype) -> tuple:
    """The grouped-GEMM kernel `cfg` names and its launch options shared by both launches."""
    gpc = max(1, MMA_CHUNK // w.group_size)
    common = dict(num_valid=num_valid, num_experts=num_experts, GPC=gpc, BLOCK_M=cfg.block_m,
                  EMULATE_DOT=_INTERPRETED and dtype == torch.bfloat16, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip
    if cfg.swap:
        return _moe_swap_kernel, dict(common, ASM=cfg.asm and not _INTERPRETED, PAIRS=w.layout is Layout.PAIRS)
    if w.layout.mma or w.chunk_major:
        raise ValueError(f"weights prepacked in the {w.layout.value} layout or chunk-major run on the transposed MoE "
                         "kernel only (swap=True); prepack with layout='planes', chunk_major=False for the per-plane "
                         "kernel")
    return _moe_kernel, dict(common, PREFETCH=cfg.prefetch, BIG_DOT=cfg.big_dot and gpc == 1)
