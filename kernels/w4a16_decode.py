"""Decode W4A16 GEMM in Gluon: warp-independent streaming, tensor cores fed from registers, no split-K fix-up.

    y[M, N] = x[M, K] @ dequant(W).T,  M <= 16 (<= 64 with `wgmma`), on `prepack`ed PAIRS or SPANS weights
    (group 128, chunk-major)

Why a second kernel, and why Gluon. At decode the Triton kernel in w4a16_dense.py (`_mma_swap_kernel`)
runs 128-row wgmma tiles: a shape has only N / 128 of them, so K is split over programs and the fp32
partials are summed through a ticket or mailbox in global memory (1.2-1.7 us of a 14-16 us GEMM on the
H200), and its words go global -> shared memory -> registers through Triton's cp.async pipeline with two
barriers per chunk (kernels/NOTES.md, session 6). Plain Triton can neither give a tile of fewer than 64
rows to the tensor cores without staging the dequantized operand in shared memory, nor split K between
the warps of one program. Gluon (Triton's explicit-layout dialect) can. Here:

  * a program owns `rows` (R = 16 or 32) weight rows and all of K, and its W warps split K between them
    (warp w takes chunks [w * CPW, (w + 1) * CPW)); the partial sums meet once, in shared memory, at the
    end: no global scratch, no ticket, no atomic, the same bits every run;
  * every thread loads exactly the words its mma.sync (m16n8k16) A fragments need, straight into
    registers (16-byte loads of PAIRS words; `_dequant` is register renaming, checked at compile time by
    `convert_layout(..., assert_trivial=True)`), and x's B fragments straight from global memory (L1/L2
    hits), or at M = 1 with `x_smem` from a copy of x each program stages once in shared memory in
    fragment order (four 16-byte shared loads per chunk instead of sixteen 4-byte global loads kept in
    flight with the words); no barrier in the main loop, so each warp streams its words on its own with
    `depth` chunks in flight;
  * on SPANS weights (`w4a16_dense.Layout.SPANS`: the same words, but the MMA's k position p holds chunk
    column `spans_column(p)`, so lane c's fragments cover the columns [32 c, 32 c + 32)) x's B fragments are
    four 16-byte global loads per chunk and 8-token tile at any M (`_x_spans`) instead of sixteen 4-byte
    ones; this is what makes M = 2-8 pay here (kernels/NOTES.md, session 13);
  * the loop over a warp's chunks is unrolled at compile time (CPW is a constexpr), so every load's
    address is a base plus an immediate.

Tokens: TOK = 8 (M <= 8) or 16 (two n8 MMAs per k16 step; the shared-x kernel's wgmma configs also 32 or 64,
`xshared_tokens`); token rows past M are not loaded (zeros); at
M = 1 every lane loads token 0 unmasked (the MMA's eight columns are then all token 0). The
dequantization is `w4a16_dense._pairs_asm` (q = u - 8 exactly, in bf16 or fp16); the group scale is
applied once per (row, chunk) to the chunk's fp32 MMA result, as in the Triton kernel (with `scaled_a`: to the
dequantized words instead, below). The scales are loaded
G = 8 (R = 16) or 4 (R = 32) chunks at a time, one 16- or 8-byte load per row (`_scale_group`): a 2-byte load
per row and chunk touched one cache line per row, twice the L1 work of the chunk's words (kernels/NOTES.md,
session 15).

A second kernel here, the shared-x kernel (`_xshared_kernel`, `DecodeConfig.split` >= 1), turns the work around:
its W warps split the program's rows (R each, so a program has W R rows) instead of K, K is split over `split`
programs (their fp32 partials summed by the last to arrive, in split order, as the Triton kernel's ticket does),
and x goes global -> shared memory once per program through a ring of `ring` chunks filled by cp.async (one
barrier per `step` chunks), from which every warp reads its B fragments: on PAIRS weights (MMA k position = column) x
stays in natural order, copied in whole 16-byte runs into a swizzled slot and read with four ldmatrix per
chunk and token tile; on SPANS weights the ring holds the layout's fragment order, read with four 16-byte
shared loads (a PAIRS ring in fragment order needed 4-byte copies, whose L1 traffic made the kernel L1-bound
at M = 16; kernels/NOTES.md, session 15). Every warp of a program
then uses the same x, so x's traffic is 1 / W of `_decode_kernel`'s, paid for with the ring's barrier and the
split-K fix-up. Two options (kernels/NOTES.md, session 16): `step` waits and synchronises once per 2 or 4 chunks
instead of every chunk, and `w_smem` copies the words into shared memory with x (cp.async, read back by the thread
that copied them) instead of prefetching them into registers: 92 instead of 144 registers at M = 16 and
`ring - step` chunks in flight. A third, `wgmma` (sm_90, PAIRS weights, 16 rows a warp, whole warpgroups), replaces
each warp's mma.sync by one warpgroup MMA chain per chunk (`wgmma.m64nTOKk16`, A = the dequantized words from
registers, B = x read by the tensor cores straight from the ring slot, NVMMA-swizzled; each thread fences its copies
for the async proxy before the barrier): no ldmatrix, a third less L1 traffic; with the words in registers chunk i is
dequantized while chunk i - 1's MMA runs. Only wgmma configs take 16 < M <= 64 (32 or 64 tokens a chunk), and
there `scaled_a` makes them pay (session 23): the group scale multiplied into the dequantized words (one rounding of
(u - 8) s to bf16 / fp16, as Marlin does) lets a program's chunks chain one warpgroup MMA accumulator, so the per-chunk
fp32 result, its wait and its scaled add go (174-216 registers at 64 tokens instead of 208-255 with spills). On the
H200 with PAIRS weights it is the fastest kernel at M = 4 and 8 on all five GLM shapes (1.2-1.3x the Triton wgmma
kernel on the large ones), at M = 16 on all five, with wgmma on three, at M = 1-2 on the three large ones
(kernels/NOTES.md, sessions 14-18), and with wgmma at M = 32 on all five (1.2-1.5x; `scaled_a` on four) and at
M = 64 on four (`scaled_a`, 1.05-1.14x; 12288->6144 stays with the Triton kernel). Its timing probes (`PROBE`:
no split-K fix-up, the memory pipeline only, no dequantization) say where the time goes (session 18).

Where it is used (kernels/NOTES.md, sessions 11-14 and 18, for the measurements). On PAIRS weights on the H200 it
wins at M = 1-4 on some shapes (the expert-sized ones most: no split-K fix-up; with x_smem at M = 1; since session
18 the shared-x kernel takes the three large GLM shapes at M = 1-2) and loses on others, and above M = 4 the x
fragment loads (16 per chunk and token tile, per 16 rows) make it slower than the wgmma kernel everywhere (x_smem
is M = 1 only: a program's x at M <= 16 would need up to K * 32 bytes of shared memory). On SPANS weights it won
against the Triton kernel (which permutes x for them) at M <= 4 on all five GLM shapes, at M = 8 on three plain
and all five as PDL chains, and at M = 16 on one. So `w4a16_matmul_packed` takes it only where the launch table of
the weight's layout (`TUNED_PATHS`: `tuned_decode.json` for PAIRS, `tuned_decode_spans.json` for SPANS; written by
scripts/probe_decode.py --tune on the GPU it names) says it was faster, or, for a shape or an sm_90 GPU the table
does not name, by `heuristic_config`'s rule (on PAIRS weights the shared-x kernel at M <= 16 as the table's picks
mostly are; on the H200 1.0-1.5x the Triton kernel on ten GLM-5, Kimi K2 and GLM-4.5 shapes, session 21); an explicit
`DecodeConfig` always takes it.

Gluon kernels cannot run under TRITON_INTERPRET=1 (Triton has no Gluon interpreter): `available()` is
False there and off-GPU, and the Triton kernels run instead. CPU CI compiles this kernel for sm_90 with
the installed Triton (tests/test_kernels.py: the trivial layout conversion, 16-byte word loads, HMMA, no
local memory, no per-chunk scale loads; for the shared-x kernel cp.async, ldmatrix or 16-byte shared loads, one
barrier per `step` chunks); their numerics are tested on the GPU against the float reference.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from glmq.kernels.w4a16_dense import (_INTERPRETED, DEFAULT_SM_COUNT, MMA_CHUNK, Layout, PackedW4, _cuda_info,
                                      _pairs_asm, _raw_words_asm, _tickets, pdl_supported, sm_count,
                                      table_serves)

log = logging.getLogger(__name__)

try:  # Gluon ships with Triton >= 3.4 as triton.experimental.gluon; its API is still moving
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    _GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

MAX_M = 16  # token rows this kernel takes (two n8 MMA tiles)
MAX_M_WGMMA = 64  # with `DecodeConfig.wgmma` the shared-x kernel takes up to this many (wgmma.m64n64k16)
X_SMEM_MAX_BYTES = 96 << 10  # x_smem's staged copy of x per program (an sm_90 SM has 227 KB); larger is refused
TIMELINE_WORDS = 8  # int64 per program that the shared-x kernel's PROBE 5 stores after out's rows
HEURISTIC_MAX_WEIGHTS = 80 << 20  # N * K up to which `direct_heuristic` takes `_decode_kernel` at M = 1
HEURISTIC_PROGRAMS_PER_SM = 3  # `xshared_split`: the shared-x kernel's launch size aimed at (programs per SM)
HEURISTIC_DIRECT_MAX_K = 2048  # `heuristic_config` at M = 1: `_decode_kernel` up to this K, the shared-x one above
HEURISTIC_M1_MIN_PROGRAMS_PER_SM = 2.5  # `heuristic_config` at M = 1: fewer shared-x programs than this: Triton
WGMMA_PROGRAMS_PER_SM = 3  # 4-warp programs of the wgmma configs (~164 registers a thread) an SM holds at once
TUNED_PATHS = {Layout.PAIRS: Path(__file__).with_name("tuned_decode.json"),  # one launch table per weight layout
               Layout.SPANS: Path(__file__).with_name("tuned_decode_spans.json")}
# What decides how many programs of a launch an sm_90 SM holds at once (CUDA C++ Programming Guide, compute capability
# 9.0): 64K 32-bit registers, given out per warp in units of 256 (a thread's count rounded up to 8), 228 KB of shared
# memory with 1 KB reserved per program, 64 warps, 32 programs. A launch table's timings hold only while its picks
# compile to the residency they were timed at (`residency_problem`).
SM90_REGISTERS, SM90_SHARED, SM90_SHARED_PER_PROGRAM, SM90_WARPS, SM90_PROGRAMS = 65536, 228 << 10, 1 << 10, 64, 32
_COMPILED: dict[tuple, tuple[int, int]] = {}  # `_compile_key` -> (registers, shared bytes) of the kernel launched
_RESIDENCY_LOST: dict[tuple, bool] = {}  # a table config's verdict once known (`_residency_lost`): warned once, then read
_SETTLED: dict[tuple, object] = {}  # what `choose` settled on for a shape and M: a DecodeConfig, or None (Triton kernel)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the Gluon decode kernel.

    Attributes:
        rows: weight rows per program, 16 or 32 (one or two m16 MMA tiles per warp, sharing each x fragment).
        warps: warps per program, 1, 2, 4 or 8; they split K, so they must divide K / 128.
        depth: chunks of words (and x) each warp has requested ahead of the one it computes, 1-4.
        pdl_early: on a `pdl=True` launch, let the next launch in right after this one's wait for the previous
            kernel instead of after the main loop.
        x_smem: at M = 1, stage x once per program in shared memory, in fragment order, and read each chunk's B
            fragments from there (four 16-byte shared loads) instead of sixteen 4-byte global loads per chunk in
            flight with the words; ignored at M > 1.
        split: 0 for the kernel above (`_decode_kernel`: warps split K). >= 1: the shared-x kernel
            (`_xshared_kernel`): each of the `warps` warps owns `rows` rows (a program `warps * rows`), K is split over
            `split` programs (it must divide K / 128), and a program's x goes through shared memory once, shared by
            its warps (x_smem and pdl_early do not apply).
        ring: the shared-x kernel's x ring in chunks, 2, 4 or 8 (ring - step chunks of x in flight).
        step: the shared-x kernel's chunks per ring barrier, 1, 2 or 4 (ring >= 2 step): a wait and a barrier per
            `step` chunks; the chunks between two barriers are independent work the compiler can interleave (their
            MMA chains, loads and dequantization).
        w_smem: the shared-x kernel's words go global -> shared memory by cp.async with x, in the same ring
            (ring - step chunks in flight, holding no registers), instead of into registers `depth` chunks ahead.
        wgmma: the shared-x kernel's MMAs as Hopper warpgroup MMAs (sm_90 only, PAIRS weights, 16 rows a warp, 4 or
            8 warps): each warpgroup's 64 rows x TOK tokens per chunk as one asynchronous chain of 8
            `wgmma.m64nTOKk16`, the dequantized words (A) from registers and x (B) read by the tensor cores straight
            from the ring slot, instead of per warp 8-16 `mma.sync` on x fragments loaded by ldmatrix. Only wgmma
            configs take 16 < M <= 64 (MAX_M_WGMMA; `xshared_tokens`: 32 or 64 tokens per chunk, one n32 or n64 MMA
            per k16 step, where mma.sync's B fragments would need 32-64 more registers).
        scaled_a: wgmma only: each row's group scale multiplied into the dequantized words (A), (u - 8) s rounded
            once to the activations' dtype (as Marlin does; fp32 scales are rounded to it first), so that a
            program's chunks chain one warpgroup MMA accumulator (`use_acc`): chunk i's MMA is issued while chunk
            i - 1's still runs, and no per-chunk fp32 result is waited for, scaled and added (its TOK / 2
            registers a thread go). Against 5 more instructions per word (a multiply per pair).
    """

    rows: int = 16
    warps: int = 4
    depth: int = 2
    pdl_early: bool = False
    x_smem: bool = False
    split: int = 0
    ring: int = 4
    step: int = 1
    w_smem: bool = False
    wgmma: bool = False
    scaled_a: bool = False

    def __post_init__(self) -> None:
        if self.rows not in (16, 32):
            raise ValueError(f"DecodeConfig.rows must be 16 or 32, got {self.rows}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"DecodeConfig.warps must be 1, 2, 4 or 8, got {self.warps}")
        if self.depth not in (1, 2, 3, 4):
            raise ValueError(f"DecodeConfig.depth must be 1-4, got {self.depth}")
        if self.split < 0:
            raise ValueError(f"DecodeConfig.split must be >= 0, got {self.split}")
        if self.ring not in (2, 4, 8):
            raise ValueError(f"DecodeConfig.ring must be 2, 4 or 8, got {self.ring}")
        if self.step not in (1, 2, 4) or self.ring < 2 * self.step:
            raise ValueError(f"DecodeConfig.step must be 1, 2 or 4 with ring >= 2 step, got step {self.step}, "
                             f"ring {self.ring}")
        if self.wgmma and not (self.split and self.rows == 16 and self.warps in (4, 8)):
            raise ValueError(f"DecodeConfig.wgmma takes the shared-x kernel (split >= 1) with 16 rows a warp and 4 or "
                             f"8 warps (whole warpgroups), got {self}")
        if self.scaled_a and not self.wgmma:
            raise ValueError(f"DecodeConfig.scaled_a needs wgmma (the chained warpgroup MMA), got {self}")

    def to_dict(self) -> dict:
        return asdict(self)


if _GLUON:
    _PAIRS_BF16 = gl.constexpr(_pairs_asm(True))
    _PAIRS_F16 = gl.constexpr(_pairs_asm(False))
    _RAW_WORDS = gl.constexpr(_raw_words_asm())
    _PAIRS_SCALED_BF16 = gl.constexpr(_pairs_asm(True, scaled=True))
    _PAIRS_SCALED_F16 = gl.constexpr(_pairs_asm(False, scaled=True))
    _TIMELINE_WORDS = gl.constexpr(TIMELINE_WORDS)
    _barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # renamed in Triton 3.7
    # cp.async global -> shared: async_copy_global_to_shared up to Triton 3.6, async_load from 3.7 (the old name raises)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def _dequant_scaled(words, s, W: gl.constexpr, R: gl.constexpr, BF16: gl.constexpr):
        """`_dequant` times the rows' scales s (`[W, R]`, the MMA's row slice): (u - 8) s rounded once to the
        activations' dtype (`DecodeConfig.scaled_a`), multiplied in the words' layout, before the elements are
        placed (the placement stays register renaming)."""
        if BF16:
            sw = gl.convert_layout(s.to(gl.bfloat16), gl.SliceLayout(2, words.type.layout), assert_trivial=True)
            sw = gl.broadcast(gl.expand_dims(sw, 2), words)[0]
            e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
                _PAIRS_SCALED_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, sw],
                dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                       gl.bfloat16), is_pure=True, pack=1)  # fmt: skip
        else:
            sw = gl.convert_layout(s.to(gl.float16), gl.SliceLayout(2, words.type.layout), assert_trivial=True)
            sw = gl.broadcast(gl.expand_dims(sw, 2), words)[0]
            e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
                _PAIRS_SCALED_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, sw],
                dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16,
                       gl.float16), is_pure=True, pack=1)  # fmt: skip
        return _place(e0, e1, e2, e3, e4, e5, e6, e7, W, R)

    @gluon.jit
    def _place(e0, e1, e2, e3, e4, e5, e6, e7, W: gl.constexpr, R: gl.constexpr):
        """Element i of every PAIRS word (`[W, R, 16]` each) -> `[W, R, 128]` in natural k order."""
        s: gl.constexpr = [W, R, 4, 4]
        w = gl.join(gl.join(gl.join(gl.reshape(e0, s), gl.reshape(e4, s)), gl.join(gl.reshape(e1, s), gl.reshape(e5, s))),
                    gl.join(gl.join(gl.reshape(e2, s), gl.reshape(e6, s)), gl.join(gl.reshape(e3, s), gl.reshape(e7, s))))
        # [W, row, c, a, i2, i0, i1] -> [W, row, a, i1, i0, c, i2] = [W, row, k]
        return gl.reshape(gl.permute(w, (0, 1, 3, 6, 5, 2, 4)), [W, R, 128])

    @gluon.jit
    def _dequant(words, W: gl.constexpr, R: gl.constexpr, BF16: gl.constexpr, RAW: gl.constexpr = False):
        """`[W, R, 16]` PAIRS words (thread (g, c) of warp w: rows g + 8j, words 4c .. 4c + 3) -> `[W, R, 128]`
        q = u - 8 in natural k order, each thread holding its own A-fragment elements (as
        `w4a16_dense._dequant_pairs`, with the warps' K ranges as the leading axis). RAW (a timing probe, wrong
        results): each word's two 16-bit halves as they are, four times over (no dequantization instructions)."""
        if RAW:
            asm: gl.constexpr = _RAW_WORDS
        elif BF16:
            asm: gl.constexpr = _PAIRS_BF16
        else:
            asm: gl.constexpr = _PAIRS_F16
        if BF16:
            e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
                asm, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                       gl.bfloat16), is_pure=True, pack=1)  # fmt: skip
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
                asm, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16,
                       gl.float16), is_pure=True, pack=1)  # fmt: skip
        return _place(e0, e1, e2, e3, e4, e5, e6, e7, W, R)

    @gluon.jit
    def _load_x(xp, x_mask, PROBE: gl.constexpr, ones, SP: gl.constexpr):
        if PROBE == 1 or PROBE == 2:
            return ones
        elif SP:
            return _x_spans(xp, x_mask, ones)
        elif x_mask is None:
            return gl.load(xp)
        else:
            return gl.load(xp, mask=x_mask, other=0.0)

    @gluon.jit
    def _x_smem(view, ld_l: gl.constexpr, W: gl.constexpr, b_like):
        """Token 0's x for one chunk of every warp from its staged copy (`view`: [W, 4, 4, 8], see `_stage_x`)
        -> [W, 128, TOK] B fragments, every token column token 0. Thread c reads its 32 elements as four
        16-byte runs; the reshape back to natural k order is register renaming (checked)."""
        t = view.load(ld_l)  # [W, jb, c, j8], j8 = (s0, h, e)
        t = gl.permute(gl.reshape(t, [W, 4, 4, 2, 2, 2]), (0, 1, 3, 4, 2, 5))  # -> [W, jb, s0, h, c, e]
        t = gl.convert_layout(gl.reshape(t, [W, 128]), gl.SliceLayout(2, b_like.type.layout), assert_trivial=True)
        return gl.broadcast(gl.expand_dims(t, 2), b_like)[0]

    @gluon.jit
    def _x_spans(xq, x_mask, b_like):
        """One chunk's x for SPANS weights: `xq` [W, TOK, 4, 32] pointers (thread (g, c): token g's columns
        [32 c, 32 c + 32) of the chunk, four 16-byte loads) -> [W, 128, TOK] B fragments in MMA k-position order
        (position 32 q + 16 s0 + 8 h + 2 c + e holds column 32 c + 8 q + 4 s0 + 2 h + e, `spans_column`); the
        reshape is register renaming (checked)."""
        if x_mask is None:
            t = gl.load(xq)
        else:
            t = gl.load(xq, mask=x_mask, other=0.0)
        W: gl.constexpr = t.shape[0]
        TOK: gl.constexpr = t.shape[1]
        t = gl.permute(gl.reshape(t, [W, TOK, 4, 4, 2, 2, 2]), (0, 3, 4, 5, 2, 6, 1))  # [W, q, s0, h, c, e, tok]
        return gl.convert_layout(gl.reshape(t, [W, 128, TOK]), b_like.type.layout, assert_trivial=True)

    @gluon.jit
    def _stage_x(x_ptr, xsm, CPW: gl.constexpr, CP2: gl.constexpr, W: gl.constexpr, SP: gl.constexpr):
        """Copy token 0's x, warp w's chunks [w CPW, (w + 1) CPW), into shared memory `xsm` ([CP2 * W, 4, 4, 8]:
        chunk i of warp w at i W + w; CP2 = CPW rounded up to a power of two) in fragment order: element
        k = 32 jb + 16 s0 + 8 h + 2 c + e of a chunk is stored at [jb, c, (s0, h, e)], so that the 32 elements
        thread c's B fragments take from a chunk are four 16-byte runs, the four c of one run adjacent (no
        bank conflict). SP (SPANS weights): column 32 c + 8 jb + j8 is stored there instead, which `_x_smem` then
        reads in `spans_column` order. One load and one store of the whole buffer: stores to parts of one buffer
        would each be fenced by a barrier (Triton's membar analysis does not tell the parts apart)."""
        st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[2, 1, 16],
                                              warps_per_cta=[1, W, 1], order=[2, 1, 0])
        ci = gl.arange(0, CP2, layout=gl.SliceLayout(1, gl.SliceLayout(2, st_l)))
        wi = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(2, st_l)))
        ki = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, st_l)))
        off = (gl.expand_dims(gl.expand_dims(ci * 128, 1), 2) + gl.expand_dims(gl.expand_dims(wi * (CPW * 128), 0), 2)
               + gl.expand_dims(gl.expand_dims(ki, 0), 1))
        if CP2 == CPW:
            t = gl.load(x_ptr + off)
        else:
            t = gl.load(x_ptr + off, mask=gl.expand_dims(gl.expand_dims(ci < CPW, 1), 2), other=0.0)
        if SP:
            t = gl.permute(gl.reshape(t, [CP2, W, 4, 4, 8]), (0, 1, 3, 2, 4))  # [.., c, jb, j8] -> [.., jb, c, j8]
        else:
            t = gl.permute(gl.reshape(t, [CP2, W, 4, 2, 2, 4, 2]), (0, 1, 2, 5, 3, 4, 6))  # [.., jb, c, s0, h, e]
        xsm.store(gl.reshape(t, [CP2 * W, 4, 4, 8]))

    @gluon.jit
    def _load_w(p):
        """A chunk's words: read once, so marked first to leave the caches (x and the scales are what stays). On
        the H200 54 of 56 same-run pairs of configs were faster so, median 1.03x (kernels/NOTES.md, session 12)."""
        return gl.load(p, eviction_policy="evict_first")

    @gluon.jit
    def _prefetch_w(wp, stride_wc, D: gl.constexpr, n: gl.constexpr):
        """The words of chunks 0 .. min(D, n) - 1 (`_load_w`), as the four slots of the depth-D rotation (`_rotate`);
        slots past D repeat chunk 0's (never used)."""
        w0 = _load_w(wp)
        w1 = w0
        w2 = w0
        w3 = w0
        if D > 1 and n > 1:
            w1 = _load_w(wp + stride_wc)
        if D > 2 and n > 2:
            w2 = _load_w(wp + 2 * stride_wc)
        if D > 3 and n > 3:
            w3 = _load_w(wp + 3 * stride_wc)
        return w0, w1, w2, w3

    @gluon.jit
    def _rotate(v0, v1, v2, v3, vn, D: gl.constexpr):
        """One step of a depth-D prefetch rotation: slot 0 is the chunk computed now, vn the one just requested."""
        if D == 1:
            v0 = vn
        elif D == 2:
            v0 = v1
            v1 = vn
        elif D == 3:
            v0 = v1
            v1 = v2
            v2 = vn
        else:
            v0 = v1
            v1 = v2
            v2 = v3
            v3 = vn
        return v0, v1, v2, v3

    @gluon.jit
    def _decode_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, stride_xm, stride_wc, stride_sn, stride_om,
                       CPW: gl.constexpr, W: gl.constexpr, R: gl.constexpr, TOK: gl.constexpr, D: gl.constexpr,
                       BF16: gl.constexpr, XB: gl.constexpr, XS: gl.constexpr, SP: gl.constexpr, PDL: gl.constexpr,
                       PDL_EARLY: gl.constexpr, PROBE: gl.constexpr):
        """grid = (cdiv(N, R),), W warps. Program p: rows [R p, R p + R) over all K; warp w: chunks [w CPW, (w+1) CPW).

        XB (M == 1): every lane loads token 0's x unmasked, so all eight token columns of the MMA are token 0.
        XS (M == 1, x_smem): token 0's x is staged once (`_stage_x`, one barrier) and each chunk's B fragments are
        read from shared memory right before its MMA (`_x_smem`); x then holds no registers while in flight.
        SP: SPANS weights (MMA k position p holds chunk column `spans_column(p)`): x's B fragments are loaded as
        four 16-byte runs per thread, token and chunk (`_x_spans`), or staged in that order (XS).
        PDL: a programmatic dependent launch: the first chunks' words and scales are requested before the
        wait for the previous kernel, x after it; the next launch is let in after the main loop, or right after
        the wait with PDL_EARLY (either way after the wait: when a program of launch N + 1 starts, every kernel
        before launch N has finished).
        PROBE (timing probes for scripts/probe_decode.py, wrong results): 1 = ones instead of x (no x loads);
        2 = words only (no x or scale loads, dequantization or MMA: the words are xor-ed); 3 = no scale loads."""
        pid = gl.program_id(0)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # the words of one chunk: thread (g, c) = lane (4g + c) holds rows g + 8j and words 4c .. 4c + 3
        w_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                             warps_per_cta=[W, 1, 1], order=[2, 1, 0])
        s_l: gl.constexpr = gl.SliceLayout(2, mma)
        o_l: gl.constexpr = gl.SliceLayout(0, mma)

        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_l)))
        ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
        vi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_l)))
        rows = gl.minimum(pid * R + ri, N - 1)  # rows past N read row N - 1; their outputs are not stored
        wp = w_ptr + (gl.expand_dims(gl.expand_dims(wi * CPW, 1), 2) * stride_wc
                      + gl.expand_dims(gl.expand_dims(rows * 16, 0), 2) + gl.expand_dims(gl.expand_dims(vi, 0), 1))
        if SP:  # [W, TOK, 4, 32]: thread (g, c) loads token g's columns [32 c, 32 c + 32) of each chunk
            xq_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 32], threads_per_warp=[1, 8, 4, 1],
                                                  warps_per_cta=[W, 1, 1, 1], order=[3, 2, 1, 0])
            wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, xq_l))))
            tq = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, xq_l))))
            cq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, xq_l))))
            jq = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, xq_l))))
            x_mask = gl.expand_dims(gl.expand_dims(gl.expand_dims(tq < M, 0), 2), 3)
            if XB:
                tq = tq * 0
            xp = x_ptr + (gl.expand_dims(gl.expand_dims(gl.expand_dims(wq * (CPW * 128), 1), 2), 3)
                          + gl.expand_dims(gl.expand_dims(gl.expand_dims(tq * stride_xm, 0), 2), 3)
                          + gl.expand_dims(gl.expand_dims(gl.expand_dims(cq * 32, 0), 1), 3)
                          + gl.expand_dims(gl.expand_dims(gl.expand_dims(jq, 0), 1), 2))
        else:  # [W, 128, TOK] in the B-fragment layout: lane c's 4-byte pairs of each k16 step
            wb = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
            kb = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
            tb = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
            x_mask = gl.expand_dims(gl.expand_dims(tb < M, 0), 1)
            if XB:
                tb = tb * 0
            xp = x_ptr + (gl.expand_dims(gl.expand_dims(wb * (CPW * 128), 1), 2)
                          + gl.expand_dims(gl.expand_dims(kb, 0), 2) + gl.expand_dims(gl.expand_dims(tb * stride_xm, 0), 1))
        if XB:
            x_mask = None
        sp = _scale_pointers(s_ptr, 0, pid * R, N, stride_sn, W, R, CPW, 0)  # warp w: chunks from w CPW
        G: gl.constexpr = sp.shape[2]
        acc = gl.zeros([W, R, TOK], gl.float32, layout=mma)
        acc_w = gl.zeros([W, R, 16], gl.int32, layout=w_l)  # PROBE 2: the words, xor-ed
        zero = gl.zeros([W, R, TOK], gl.float32, layout=mma)
        ones = gl.full([W, 128, TOK], 1.0, x_ptr.dtype.element_ty, layout=b_l)
        s_one = gl.full([W, R], 1.0, s_ptr.dtype.element_ty, layout=s_l)

        # Words and scales do not depend on the kernel launched before this one: with PDL the first chunks'
        # are requested before the wait; x only after it.
        w0, w1, w2, w3 = _prefetch_w(wp, stride_wc, D, CPW)
        sg0, sg1 = _prefetch_scales(sp, CPW)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            if PDL_EARLY:
                gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1)
        if XS:  # token 0's x, staged once in fragment order; each chunk's fragments are read right before its MMA
            CP2: gl.constexpr = 1 << (CPW - 1).bit_length()
            xsm = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [CP2 * W, 4, 4, 8],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0]))
            xs_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 1, 8], threads_per_warp=[1, 1, 4, 8],
                                                  warps_per_cta=[W, 1, 1, 1], order=[2, 3, 1, 0])
            _stage_x(x_ptr, xsm, CPW, CP2, W, SP)
            _barrier()
            x0 = ones
        else:
            x0 = _load_x(xp, x_mask, PROBE, ones, SP)
        x1 = x0
        x2 = x0
        x3 = x0
        if D > 1 and CPW > 1 and not XS:
            x1 = _load_x(xp + 128, x_mask, PROBE, ones, SP)
        if D > 2 and CPW > 2 and not XS:
            x2 = _load_x(xp + 256, x_mask, PROBE, ones, SP)
        if D > 3 and CPW > 3 and not XS:
            x3 = _load_x(xp + 384, x_mask, PROBE, ones, SP)
        for i in gl.static_range(CPW):  # unrolled: chunk i + D is requested before chunk i is computed
            wn = w0
            xn = x0
            if i + D < CPW:
                wn = _load_w(wp + (i + D) * stride_wc)
                if not XS:
                    xn = _load_x(xp + (i + D) * 128, x_mask, PROBE, ones, SP)
            sg0, sg1 = _advance_scales(sg0, sg1, sp, i, CPW)
            if XS and PROBE != 1 and PROBE != 2:
                x0 = _x_smem(xsm.slice(i * W, W), xs_l, W, ones)
            if PROBE == 2:
                acc_w = acc_w ^ w0
            else:  # a fresh fp32 accumulator per chunk, scaled by the chunk's group scales
                a = gl.convert_layout(_dequant(w0, W, R, BF16), a_l, assert_trivial=True)
                s0 = s_one
                if PROBE < 2:
                    s0 = _pick(sg0, i % G, s_one)
                acc = acc + mma_v2(a, x0, zero) * gl.expand_dims(s0.to(gl.float32), 2)
            w0, w1, w2, w3 = _rotate(w0, w1, w2, w3, wn, D)
            x0, x1, x2, x3 = _rotate(x0, x1, x2, x3, xn, D)
        if PDL and not PDL_EARLY:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        if PROBE == 2:
            acc = acc + gl.convert_layout(gl.expand_dims(gl.sum(acc_w, axis=2).to(gl.float32), 2), mma)
        y = gl.sum(acc, axis=0)  # [R, TOK]: the warps' K ranges, summed in shared memory in warp order
        ro = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, o_l))
        to = gl.arange(0, TOK, layout=gl.SliceLayout(0, o_l))
        o_mask = gl.expand_dims(ro < N, 1) & gl.expand_dims(to < M, 0)
        gl.store(out_ptr + gl.expand_dims(ro, 1) + gl.expand_dims(to * stride_om, 0), y.to(out_ptr.dtype.element_ty),
                 mask=o_mask)


    # ---- the shared-x kernel: warps split rows, programs split K, x through a ring in shared memory ---------

    @gluon.jit
    def _xs_spans_pointers(x_ptr, c0, M, stride_xm, TOK: gl.constexpr, W: gl.constexpr):
        """Pointers and mask of chunk c0's x for SPANS weights, laid out as a ring slot `[4, TOK, 4, 8]`: [q, t, c, j]
        holds token t's column 32 c + 8 q + j (16-byte runs), so that thread (g, c) reads its B fragments as four
        16-byte shared loads per token tile (`_xs_frag`). Token rows past M are masked: cp.async fills them with
        zeros without reading (a clamped row would make up to 7 lanes of each copy read one address)."""
        WQ: gl.constexpr = 4 if W >= 4 else W
        cp_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 8], threads_per_warp=[1, 8, 4, 1],
                                              warps_per_cta=[WQ, W // WQ, 1, 1], order=[3, 2, 1, 0])
        qi = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, cp_l))))
        ti = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, cp_l))))
        cj_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, cp_l))  # [c, j]
        ci = gl.arange(0, 4, layout=gl.SliceLayout(1, cj_l))
        ji = gl.arange(0, 8, layout=gl.SliceLayout(0, cj_l))
        col_cj = gl.expand_dims(ci * 32, 1) + gl.expand_dims(ji, 0)
        t2 = gl.expand_dims(gl.expand_dims(ti, 0), 2)  # [1, TOK, 1]
        off = (gl.expand_dims(gl.expand_dims(gl.expand_dims(8 * qi, 1), 2), 3)
               + gl.expand_dims(t2 * stride_xm, 3) + gl.expand_dims(gl.expand_dims(col_cj, 0), 1))
        mask = gl.expand_dims(t2 < M, 3) & (gl.expand_dims(gl.expand_dims(col_cj, 0), 1) >= 0)  # (true: full shape)
        return x_ptr + c0 * 128 + off, mask

    @gluon.jit
    def _xs_nat_pointers(x_ptr, c0, M, stride_xm, TOK: gl.constexpr, W: gl.constexpr):
        """Pointers and mask of chunk c0's x as a natural-order ring slot `[TOK, 128]` (PAIRS weights, whose MMA k
        position p is column p): 16-byte runs, a warp's copies two whole token rows, coalesced. Token rows past M
        are masked (cp.async fills them with zeros without reading)."""
        WT: gl.constexpr = W if 2 * W <= TOK else TOK // 2  # warps along the tokens; the rest along the columns
        cp_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                              warps_per_cta=[WT, W // WT], order=[1, 0])
        ti = gl.arange(0, TOK, layout=gl.SliceLayout(1, cp_l))
        ki = gl.arange(0, 128, layout=gl.SliceLayout(0, cp_l))
        off = gl.expand_dims(ti * stride_xm, 1) + gl.expand_dims(ki, 0)
        mask = gl.expand_dims(ti < M, 1) & gl.expand_dims(ki >= 0, 0)  # (true: full shape)
        return x_ptr + c0 * 128 + off, mask

    @gluon.jit
    def _ring(x_ptr, TOK: gl.constexpr, SP: gl.constexpr, XR: gl.constexpr, WORDS: gl.constexpr, W: gl.constexpr,
              R: gl.constexpr, WG: gl.constexpr):
        """The XR slots of a ring (`_ring_slot` picks one; slots past XR repeat slot 0): x's chunks, or with WORDS the
        words' ([W, R, 16] int32). One allocation per slot, so that Triton's barrier analysis sees that a copy into
        one slot and the reads of another do not overlap (one buffer of XR slots drew a second barrier per chunk)."""
        r0 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
        r1 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
        r2 = r0
        r3 = r0
        r4 = r0
        r5 = r0
        r6 = r0
        r7 = r0
        if XR > 2:
            r2 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
            r3 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
        if XR > 4:
            r4 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
            r5 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
            r6 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
            r7 = _ring_buffer(x_ptr, TOK, SP, WORDS, W, R, WG)
        return r0, r1, r2, r3, r4, r5, r6, r7

    @gluon.jit
    def _ring_buffer(x_ptr, TOK: gl.constexpr, SP: gl.constexpr, WORDS: gl.constexpr, W: gl.constexpr,
                     R: gl.constexpr, WG: gl.constexpr):
        if WORDS:  # a chunk's words, row-major: thread (g, c)'s 16 bytes of a row are where it copied them from
            return gl.allocate_shared_memory(gl.int32, [W, R, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
        elif WG:  # natural order in the swizzle wgmma reads its B operand in (K-major, 128-byte swizzle)
            return gl.allocate_shared_memory(x_ptr.dtype.element_ty, [TOK, 128],
                                             gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        elif SP:
            return gl.allocate_shared_memory(x_ptr.dtype.element_ty, [4, TOK, 4, 8],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0]))
        else:  # natural order, the 16-byte units of token row t XOR t % 8: ldmatrix's 8 rows hit 8 bank quads
            return gl.allocate_shared_memory(x_ptr.dtype.element_ty, [TOK, 128],
                                             gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))

    @gluon.jit
    def _ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i: gl.constexpr):
        if i == 0:
            return r0
        elif i == 1:
            return r1
        elif i == 2:
            return r2
        elif i == 3:
            return r3
        elif i == 4:
            return r4
        elif i == 5:
            return r5
        elif i == 6:
            return r6
        else:
            return r7

    @gluon.jit
    def _xs_nat_frag(view, b_like):
        """One chunk's B fragments from a natural-order ring slot (`view` [TOK, 128]) -> [W, 128, TOK], the same in
        every warp."""
        t = view.permute((1, 0)).load(gl.SliceLayout(0, b_like.type.layout))
        return gl.broadcast(gl.expand_dims(t, 0), b_like)[0]

    @gluon.jit
    def _xs_frag(view, ld_l: gl.constexpr, b_like):
        """One chunk's B fragments from a SPANS ring slot (`view` [4, TOK, 4, 8], `_xs_spans_pointers`) ->
        [W, 128, TOK], the same in every warp: thread (g, c) reads its four 16-byte runs per token tile (lanes 8
        apart: no bank conflict); the permute into MMA k-position order is register renaming (checked)."""
        t = gl.expand_dims(view.load(gl.SliceLayout(0, ld_l)), 0)  # [1, q, tok, c, j]
        TOK: gl.constexpr = t.shape[2]
        t = gl.permute(gl.reshape(t, [1, 4, TOK, 4, 2, 2, 2]), (0, 1, 4, 5, 3, 6, 2))  # [1, q, s0, h, c, e, tok]
        t = gl.convert_layout(gl.reshape(t, [1, 128, TOK]), b_like.type.layout, assert_trivial=True)
        return gl.broadcast(t, b_like)[0]

    @gluon.jit
    def _scale_group(sp, g: gl.constexpr, n: gl.constexpr):
        """Scales of chunks [G g, G g + G) (those < n) of the rows `sp` points at ([W, R, G], G consecutive chunks in
        one thread's registers): one 8- or 16-byte load per row instead of one 2-byte load per row and chunk. A
        warp's scale load touches 8 or 16 cache lines, one per row: per chunk that was twice the L1 work of its
        words (ncu, kernels/NOTES.md session 15)."""
        G: gl.constexpr = sp.shape[2]
        if G * g + G <= n:
            return gl.load(sp + G * g)
        else:
            j = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, sp.type.layout)))
            return gl.load(sp + G * g, mask=gl.expand_dims(gl.expand_dims(j, 0), 1) < n - G * g, other=0.0)

    @gluon.jit
    def _prefetch_scales(sp, n: gl.constexpr):
        """The first two scale groups (`_scale_group`) of a loop over n chunks: the one in use and the one after it."""
        sg0 = _scale_group(sp, 0, n)
        sg1 = sg0
        if n > sp.shape[2]:
            sg1 = _scale_group(sp, 1, n)
        return sg0, sg1

    @gluon.jit
    def _advance_scales(sg0, sg1, sp, i: gl.constexpr, n: gl.constexpr):
        """At chunk i of n: where a new group of G chunks starts, it moves into use and the one after it is
        requested (one group ahead, as `_prefetch_scales` began)."""
        G: gl.constexpr = sp.shape[2]
        if i % G == 0 and i > 0:
            sg0 = sg1
            if i + G < n:
                sg1 = _scale_group(sp, i // G + 1, n)
        return sg0, sg1

    @gluon.jit
    def _pick(t, i: gl.constexpr, like):
        """Element i of the last axis (2, 4 or 8 long, in registers) of `t` [W, R, G], in the layout of `like` [W, R];
        the splits and the conversion are register renaming (checked)."""
        W: gl.constexpr = t.shape[0]
        R: gl.constexpr = t.shape[1]
        G: gl.constexpr = t.shape[2]
        if G == 8:
            a, b = gl.split(gl.reshape(t, [W, R, 4, 2]))
            t = b if i % 2 == 1 else a
            i = i // 2
        if G >= 4:
            a, b = gl.split(gl.reshape(t, [W, R, 2, 2]))
            t = b if i % 2 == 1 else a
            i = i // 2
        a, b = gl.split(t)
        t = b if i % 2 == 1 else a
        return gl.convert_layout(t, like.type.layout, assert_trivial=True)

    @gluon.jit
    def _scale_pointers(s_ptr, k0, row0, N, stride_sn, W: gl.constexpr, R: gl.constexpr, WK: gl.constexpr,
                        WR: gl.constexpr):
        """[W, R, G] pointers to the scales of rows row0 + w WR + [0, R) (past N: row N - 1) and G chunks from
        k0 + w WK, for warp w (G = 8 for 16 rows a warp, 4 for 32): thread (g, c) holds rows g + 8j's G scales in
        registers, lanes c alike, as the MMA's row slice."""
        G: gl.constexpr = 8 if R == 16 else 4
        sg_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, G], threads_per_warp=[1, 8, 4],
                                              warps_per_cta=[W, 1, 1], order=[2, 1, 0])
        ws = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, sg_l)))
        rs = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, sg_l)))
        js = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, sg_l)))
        off = gl.expand_dims(ws * WK, 1) + gl.minimum(row0 + gl.expand_dims(ws * WR, 1) + gl.expand_dims(rs, 0),
                                                      N - 1) * stride_sn
        return s_ptr + k0 + gl.expand_dims(off, 2) + gl.expand_dims(gl.expand_dims(js, 0), 1)

    @gluon.jit
    def _wg_retire(tk, a, a_next, n: gl.constexpr, s, mma: gl.constexpr, acc):
        """acc + a chunk's warpgroup MMA result (`tk`, waited for until at most n are in flight; `a`, its A operand in
        registers, kept alive until then) times the chunk's scales `s` [W, R], and `a_next` (the next chunk's A
        operand, passed through the wait so that it is computed before it, while the MMA runs); the reshape of the
        m64 result into the mma.sync accumulator's [W, R, TOK] layout is register renaming (checked)."""
        part, a, a_next = warpgroup_mma_wait(n, deps=[tk, a, a_next])
        W: gl.constexpr = s.shape[0]
        R: gl.constexpr = s.shape[1]
        part = gl.convert_layout(gl.reshape(part, [W, R, part.shape[1]]), mma, assert_trivial=True)
        return acc + part * gl.expand_dims(s.to(gl.float32), 2), a_next

    @gluon.jit
    def _timer(asm: gl.constexpr):
        return gl.inline_asm_elementwise(asm, "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _timer_after(v):
        """%globaltimer read after `v` in program order. `v` is an operand only in name (the asm does not use it), so
        the read is ordered after v's value by what precedes it: for the ticket, the barrier of its broadcast."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [v], dtype=gl.int64,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _timeline(out_ptr, off, pid, t_start, c_start, ticket, t_loop, t_ticket):
        """PROBE 5: program (pid, k)'s [SM id, %globaltimer at start and end (ns), %clock64 at start and end, its
        ticket (-1 without a K split), %globaltimer after its last chunk's MMAs and once its ticket was back (= the
        previous without a K split)] as int64 at out_ptr's element `off` onwards (`probe_timeline`)."""
        t_end = _timer("mov.u64 $0, %globaltimer;")
        c_end = _timer("mov.u64 $0, %clock64;")
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        base = (out_ptr + off).to(gl.pointer_type(gl.int64), bitcast=True) + (
            gl.program_id(1) * gl.num_programs(0) + pid) * _TIMELINE_WORDS
        gl.store(base, sm.to(gl.int64))
        gl.store(base + 1, t_start)
        gl.store(base + 2, t_end)
        gl.store(base + 3, c_start)
        gl.store(base + 4, c_end)
        gl.store(base + 5, ticket.to(gl.int64))
        gl.store(base + 6, t_loop)
        gl.store(base + 7, t_ticket)

    @gluon.jit
    def _xshared_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wc, stride_sn,
                        stride_om, CPP: gl.constexpr, W: gl.constexpr, R: gl.constexpr, TOK: gl.constexpr,
                        D: gl.constexpr, XR: gl.constexpr, STEP: gl.constexpr, WS: gl.constexpr, WG: gl.constexpr,
                        SA: gl.constexpr, BF16: gl.constexpr, SP: gl.constexpr, SPLIT: gl.constexpr, PDL: gl.constexpr,
                        PROBE: gl.constexpr = 0):
        """grid = (cdiv(N, W R), split). Program (p, k): rows [W R p, W R (p + 1)), chunks [CPP k, CPP (k + 1));
        warp w: its R of those rows over all the program's chunks, so the W warps share one copy of x: each chunk's x
        goes global -> shared memory by cp.async into a ring of XR slots (XR - STEP chunks ahead, one barrier per
        STEP chunks) and is read as B fragments right before the chunk's MMAs: PAIRS weights (MMA k position =
        column) keep x in natural order, copied in 16-byte runs and read by ldmatrix (`_xs_nat_frag`), SPANS weights
        in fragment order (`_xs_frag`); the words stream into registers as in `_decode_kernel` (depth D) or, with WS,
        through a second ring beside x's (each thread reads back the 16-byte runs it copied itself), the scales G
        chunks at a time (`_scale_group`). WG (PAIRS, sm_90): each warpgroup's chunk is one asynchronous warpgroup
        MMA chain reading x from the ring slot itself (no B fragments in registers); with the words in registers chunk
        i is dequantized while chunk i - 1's MMA runs, which is retired (`_wg_retire`) before the barrier that frees
        its slot, or, inside a step, right after chunk i's is issued; with WS each MMA is retired at once. SA (with
        WG): the scales multiplied into A (`_dequant_scaled`) and the chunks' MMAs chained on one accumulator, words
        in registers or from their ring alike: chunk i is dequantized while chunk i - 1's MMA runs, which is waited
        for before the barrier that frees its slots, or, inside a step, right after chunk i's is issued.

        SPLIT (split > 1): each program stores its fp32 partial to `ws_ptr` ([split, M, N]) and takes a ticket
        (`cnt_ptr`, one per row block, zero on entry and on exit); the last to arrive sums the partials in split
        order (the same bits every run) and stores the output, as `w4a16_dense._write_tile` does.
        PDL: the first chunks' words and scales are requested before the wait for the previous kernel, x after
        it; the next launch is let in after the main loop.
        PROBE (timing probes for scripts/probe_decode.py, wrong results): 1 = no split-K fix-up (each program
        stores its partial and exits); 2 = the memory pipeline only (words, scales and x's ring as in the GEMM,
        the words xor-ed instead of dequantized and multiplied; with WG the mma.sync loop's structure); 3 = no
        dequantization (the words' raw halves into the MMA); 4 = x copied only into the ring's first slots (no L2
        reads of x after the start: what x's traffic costs); 5 = the GEMM as it is, and each program's timeline
        (`_timeline`) stored after out's M rows (`probe_timeline`; out must have that room)."""
        pid = gl.program_id(0)
        c0 = gl.program_id(1) * CPP
        if PROBE == 5:
            t_start = _timer("mov.u64 $0, %globaltimer;")
            c_start = _timer("mov.u64 $0, %clock64;")
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        w_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                             warps_per_cta=[W, 1, 1], order=[2, 1, 0])
        ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 1, 1, 8], threads_per_warp=[1, 1, 8, 4, 1],
                                              warps_per_cta=[W, 1, 1, 1, 1], order=[4, 3, 2, 1, 0])
        s_l: gl.constexpr = gl.SliceLayout(2, mma)
        # WG: the warpgroup MMA's layouts; warp w's 16 rows of an m64 tile are the rows its mma.sync fragments hold
        wg_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, TOK, 16])
        wg_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wg_mma, k_width=2)

        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_l)))
        ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
        vi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_l)))
        rows = gl.minimum(pid * (W * R) + gl.expand_dims(wi * R, 1) + gl.expand_dims(ri, 0), N - 1)  # past N: row N - 1
        wp = w_ptr + c0 * stride_wc + gl.expand_dims(rows * 16, 2) + gl.expand_dims(gl.expand_dims(vi, 0), 1)
        sp = _scale_pointers(s_ptr, c0, pid * (W * R), N, stride_sn, W, R, 0, R)  # warp w: its R rows
        G: gl.constexpr = sp.shape[2]
        s_like = gl.full([W, R], 0.0, gl.float32, layout=s_l)
        acc = gl.zeros([W, R, TOK], gl.float32, layout=mma)
        zero = gl.zeros([W, R, TOK], gl.float32, layout=mma)
        b_like = gl.full([W, 128, TOK], 0.0, x_ptr.dtype.element_ty, layout=b_l)

        if WS:  # the words go through a ring in shared memory with x (below), not through registers
            w0 = gl.zeros([W, R, 16], gl.int32, layout=w_l)
        else:
            w0, w1, w2, w3 = _prefetch_w(wp, stride_wc, D, CPP)
        sg0, sg1 = _prefetch_scales(sp, CPP)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        r0, r1, r2, r3, r4, r5, r6, r7 = _ring(x_ptr, TOK, SP, XR, False, W, R, WG)  # x's ring
        q0, q1, q2, q3, q4, q5, q6, q7 = r0, r1, r2, r3, r4, r5, r6, r7  # the words' ring (WS), else unused
        if WS:
            q0, q1, q2, q3, q4, q5, q6, q7 = _ring(x_ptr, TOK, SP, XR, True, W, R, WG)
        if SP:
            xp, x_mask = _xs_spans_pointers(x_ptr, c0, M, stride_xm, TOK, W)
        else:
            xp, x_mask = _xs_nat_pointers(x_ptr, c0, M, stride_xm, TOK, W)
        for j in gl.static_range(XR - STEP):  # chunks 0 .. XR - STEP - 1 in flight, one cp.async group each
            if j < CPP:
                _cp_async(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, j), xp + j * 128, mask=x_mask)
                if WS:
                    _cp_async(_ring_slot(q0, q1, q2, q3, q4, q5, q6, q7, j), wp + j * stride_wc)
                async_copy.commit_group()
        acc_w = gl.zeros([W, R, 16], gl.int32, layout=w_l)  # PROBE 2: the words, xor-ed
        tk = acc  # WG: the previous chunk's warpgroup MMA (its token), its A operand and scales, once issued
        a_prev = acc
        s_prev = s_like
        for i in gl.static_range(CPP):  # unrolled: chunk i + D is requested before chunk i is computed
            wn = w0
            if i + D < CPP and not WS:
                wn = _load_w(wp + (i + D) * stride_wc)
            sg0, sg1 = _advance_scales(sg0, sg1, sp, i, CPP)
            if WG and SA and PROBE != 2:
                if i % STEP == 0:  # this thread's copies of chunks i .. i + STEP - 1 have landed
                    async_copy.wait_group(max(0, min(i + XR - STEP - 1, CPP - 1) - (i + STEP - 1)))
                if WS:  # this thread's own copies of chunk i's words
                    w0 = _ring_slot(q0, q1, q2, q3, q4, q5, q6, q7, i % XR).load(w_l)
                if PROBE == 3:  # the words' raw halves, no dequantization and no scales
                    q = _dequant(w0, W, R, BF16, True)
                else:
                    q = _dequant_scaled(w0, _pick(sg0, i % G, s_like), W, R, BF16)
                a = gl.convert_layout(gl.reshape(q, [W * R, 128]), wg_a, assert_trivial=True)
                if i % STEP == 0:
                    if i > 0:  # chunk i - 1's MMA, done before the barrier frees its slots
                        tk, a_prev, a = warpgroup_mma_wait(0, deps=[tk, a_prev, a])
                    fence_async_shared()  # this thread's copies, complete, made visible to the async proxy's reads
                    _barrier()
                    for j in gl.static_range(XR - STEP, XR):
                        if i + j < CPP:
                            if PROBE != 4:
                                _cp_async(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, (i + j) % XR),
                                          xp + (i + j) * 128, mask=x_mask)
                            if WS:
                                _cp_async(_ring_slot(q0, q1, q2, q3, q4, q5, q6, q7, (i + j) % XR),
                                          wp + (i + j) * stride_wc)
                            async_copy.commit_group()
                xs = _ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i % XR).permute((1, 0))  # [128, TOK], K-major
                if i == 0:
                    tk = warpgroup_mma(a, xs, gl.zeros([W * R, TOK], gl.float32, layout=wg_mma), use_acc=False,
                                       is_async=True)
                else:
                    tk = warpgroup_mma(a, xs, tk, is_async=True)
                if i % STEP != 0:  # chunk i - 1's MMA retired, chunk i's in flight
                    tk, a_prev, a = warpgroup_mma_wait(1, deps=[tk, a_prev, a])
                a_prev = a
            elif WG and not WS and PROBE != 2:
                # chunk i's A operand is dequantized while chunk i - 1's warpgroup MMA runs; that MMA is retired
                # (waited for, scaled into acc) before the ring's wait and barrier when they free its x slot, else
                # right after chunk i's MMA is issued
                s0 = _pick(sg0, i % G, s_like)
                a = gl.convert_layout(gl.reshape(_dequant(w0, W, R, BF16, PROBE == 3), [W * R, 128]), wg_a,
                                      assert_trivial=True)
                if i % STEP == 0:
                    if i > 0:
                        acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)
                    async_copy.wait_group(max(0, min(i + XR - STEP - 1, CPP - 1) - (i + STEP - 1)))
                    fence_async_shared()  # this thread's copies, complete, made visible to the async proxy's reads
                    _barrier()
                    for j in gl.static_range(XR - STEP, XR):
                        if i + j < CPP:
                            if PROBE != 4:
                                _cp_async(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, (i + j) % XR),
                                          xp + (i + j) * 128, mask=x_mask)
                            async_copy.commit_group()
                xs = _ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i % XR).permute((1, 0))  # [128, TOK], K-major
                tk_i = warpgroup_mma(a, xs, gl.zeros([W * R, TOK], gl.float32, layout=wg_mma), use_acc=False,
                                     is_async=True)
                if i % STEP != 0:
                    acc, a = _wg_retire(tk, a_prev, a, 1, s_prev, mma, acc)
                tk = tk_i
                a_prev = a
                s_prev = s0
            else:  # mma.sync, or with WG and WS each chunk's warpgroup MMA retired right after it is issued
                if i % STEP == 0:
                    # chunks i .. i + STEP - 1 have landed (this thread's copies: wait, for all but the groups
                    # requested after them; everyone's: the barrier, which also tells that every warp is done with
                    # the slots of chunks i - STEP .. i - 1, where chunks i + XR - STEP .. i + XR - 1 go now)
                    async_copy.wait_group(max(0, min(i + XR - STEP - 1, CPP - 1) - (i + STEP - 1)))
                    if WG:  # this thread's copies, complete, made visible to the async proxy's reads
                        fence_async_shared()
                    _barrier()
                    for j in gl.static_range(XR - STEP, XR):
                        if i + j < CPP:
                            if PROBE != 4:
                                _cp_async(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, (i + j) % XR),
                                          xp + (i + j) * 128, mask=x_mask)
                            if WS:
                                _cp_async(_ring_slot(q0, q1, q2, q3, q4, q5, q6, q7, (i + j) % XR),
                                          wp + (i + j) * stride_wc)
                            async_copy.commit_group()
                if WS:  # this thread's own copies of chunk i's words, complete after the wait above
                    w0 = _ring_slot(q0, q1, q2, q3, q4, q5, q6, q7, i % XR).load(w_l)
                if PROBE == 2:
                    acc_w = acc_w ^ w0
                elif WG:
                    s0 = _pick(sg0, i % G, s_like)
                    a = gl.convert_layout(gl.reshape(_dequant(w0, W, R, BF16, PROBE == 3), [W * R, 128]), wg_a,
                                          assert_trivial=True)
                    xs = _ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i % XR).permute((1, 0))  # [128, TOK], K-major
                    tk = warpgroup_mma(a, xs, gl.zeros([W * R, TOK], gl.float32, layout=wg_mma), use_acc=False,
                                       is_async=True)
                    acc, a = _wg_retire(tk, a, a, 0, s0, mma, acc)
                else:
                    if SP:
                        xb = _xs_frag(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i % XR), ld_l, b_like)
                    else:
                        xb = _xs_nat_frag(_ring_slot(r0, r1, r2, r3, r4, r5, r6, r7, i % XR), b_like)
                    a = gl.convert_layout(_dequant(w0, W, R, BF16, PROBE == 3), a_l, assert_trivial=True)
                    s0 = _pick(sg0, i % G, s_like)
                    acc = acc + mma_v2(a, xb, zero) * gl.expand_dims(s0.to(gl.float32), 2)
            if not WS:
                w0, w1, w2, w3 = _rotate(w0, w1, w2, w3, wn, D)
        if WG and SA and PROBE != 2:  # the last chunk's MMA; its accumulator is the result
            tk, a_prev = warpgroup_mma_wait(0, deps=[tk, a_prev])
            acc = gl.convert_layout(gl.reshape(tk, [W, R, TOK]), mma, assert_trivial=True)
        elif WG and not WS and PROBE != 2:  # the last chunk's MMA
            acc, a = _wg_retire(tk, a_prev, a, 0, s_prev, mma, acc)
        if PROBE == 2:  # the scales of the last chunk, so that their loads are not dropped
            acc_s = gl.convert_layout(gl.sum(acc_w, axis=2).to(gl.float32), s_l) + _pick(sg0, (CPP - 1) % G, s_like)
            acc = acc + gl.expand_dims(acc_s, 2)
        if PROBE == 5:  # the main loop's end (its last MMAs retired above)
            t_loop = _timer("mov.u64 $0, %globaltimer;")
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        wo = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        ro = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        to = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
        row = pid * (W * R) + gl.expand_dims(gl.expand_dims(wo * R, 1) + gl.expand_dims(ro, 0), 2)
        tok = gl.expand_dims(gl.expand_dims(to, 0), 1)
        o_mask = (row < N) & (tok < M)
        o_ptr = out_ptr + row + tok * stride_om
        if SPLIT:
            mn = M * N
            part = ws_ptr + row + tok * N
            gl.store(part + gl.program_id(1).to(gl.int64) * mn, acc, mask=o_mask)
            if PROBE == 1:
                return
            _barrier()  # every thread's partial precedes the one-thread release below (as `_write_tile`)
            ticket = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            if PROBE == 5:
                t_ticket = _timer_after(ticket)
            if ticket == gl.num_programs(1) - 1:  # the last split of this row block: sum in split order
                total = gl.load(part, mask=o_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, gl.num_programs(1)):
                    total += gl.load(part + s * mn, mask=o_mask, other=0.0, cache_modifier=".cg")
                gl.store(o_ptr, total.to(out_ptr.dtype.element_ty), mask=o_mask)
                gl.store(cnt_ptr + pid, 0)  # re-arm for the next launch
            if PROBE == 5:
                _timeline(out_ptr, M * stride_om, pid, t_start, c_start, ticket, t_loop, t_ticket)
        else:
            gl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
            if PROBE == 5:
                _timeline(out_ptr, M * stride_om, pid, t_start, c_start, pid * 0 - 1, t_loop, t_loop)


def available(device: torch.device) -> bool:
    """Whether the Gluon decode kernel can run on `device`: a CUDA GPU of sm_80 or later (mma.sync on bf16),
    Gluon in the installed Triton, and not the interpreter."""
    if not _GLUON or _INTERPRETED or device.type != "cuda":
        return False
    return _cuda_info(device)[2] >= (8, 0)  # cached per device, as w4a16_dense's sm_count / pdl_supported


def x_smem_bytes(k: int, warps: int) -> int:
    """Shared memory a program of `warps` warps stages x in with x_smem (16-bit x): each warp's chunks rounded up
    to a power of two, 256 bytes a chunk."""
    cpw = k // MMA_CHUNK // warps
    return (1 << (cpw - 1).bit_length()) * warps * MMA_CHUNK * 2


def supports(m: int, w: PackedW4, cfg: DecodeConfig | None = None) -> bool:
    """Whether a call fits the kernel: 1 <= M <= 16 (up to MAX_M_WGMMA = 64 with `cfg.wgmma`; without a config,
    whether some config takes it), a 2-D PAIRS or SPANS weight stored chunk-major (what `prepack` gives group-128
    weights), `cfg.warps` dividing the K / 128 chunks (with `cfg.split`, the shared-x kernel's warps split rows:
    `cfg.split` dividing them instead), and with x_smem at M = 1 the staged x within X_SMEM_MAX_BYTES."""
    if not (1 <= m <= MAX_M_WGMMA) or w.lead or not w.layout.mma or not w.chunk_major or w.chunk != MMA_CHUNK:
        return False
    if m > MAX_M and not (w.layout is Layout.PAIRS and (cfg is None or cfg.wgmma)):
        return False
    if cfg is not None and cfg.split:  # wgmma reads x from the ring as it lies: natural order, PAIRS weights only
        return (w.k // MMA_CHUNK) % cfg.split == 0 and not (cfg.wgmma and w.layout is not Layout.PAIRS)
    if cfg is not None and cfg.x_smem and m == 1 and x_smem_bytes(w.k, cfg.warps) > X_SMEM_MAX_BYTES:
        return False
    return (w.k // MMA_CHUNK) % (cfg.warps if cfg is not None else 1) == 0


def heuristic_config(m: int, n: int, k: int, layout: Layout = Layout.PAIRS, sms: int = DEFAULT_SM_COUNT
                     ) -> DecodeConfig | None:
    """This kernel for a shape without a launch-table entry on an sm_90 GPU, or None (the Triton kernels).

    PAIRS weights: at M = 1 with K <= HEURISTIC_DIRECT_MAX_K `direct_heuristic` (`_decode_kernel`); otherwise
    `xshared_heuristic`, except at M = 1 when its launch has fewer than HEURISTIC_M1_MIN_PROGRAMS_PER_SM programs a
    multiprocessor. On the H200 (scripts/probe_decode.py --heuristic --extra-shapes, 2026-12-03; kernels/NOTES.md,
    session 21) this rule was at least level with the Triton kernel at every M = 1, 2, 4, 8, 16 on the five GLM-5
    shapes and five of Kimi K2 and GLM-4.5 (1.00-1.48x; the launch table's own picks are faster still on the GLM-5
    shapes). On an H100 (no table of its own; bench_kernels.py, session 35) it was 1.06-1.47x the Triton kernel at
    M = 1, 4 and 16 on the five GLM-5 shapes; the H100 80GB HBM3 has taken the H200's tables since session 36.
    SPANS weights (where the Triton kernel won at M = 8-16 on most GLM shapes, module doc, and this rule was not
    measured): `direct_heuristic` only, as before.
    """
    if layout is not Layout.PAIRS or (m == 1 and k <= HEURISTIC_DIRECT_MAX_K):
        return direct_heuristic(m, n, k)
    cfg = xshared_heuristic(m, n, k, layout, sms)
    programs = 0 if cfg is None else -(-n // (cfg.rows * cfg.warps)) * cfg.split
    if m == 1 and cfg is not None and programs < HEURISTIC_M1_MIN_PROGRAMS_PER_SM * sms:
        return None  # Kimi K2's 7168->18432 at M = 1: 288 programs, 0.94x the Triton kernel (1.29x at M = 2)
    return cfg


def direct_heuristic(m: int, n: int, k: int) -> DecodeConfig | None:
    """`_decode_kernel` (warps split K) at M = 1 and N * K <= HEURISTIC_MAX_WEIGHTS; 16 rows per program, the most
    warps (8, 4, 2, 1) that still leave each warp >= 4 chunks, two chunks in flight; on a PDL launch the next launch
    is let in early when each warp runs <= 8 chunks (the H200 tuning's winners on those loops, 2026-12-02). None
    elsewhere. On 2026-12-03 it led the shared-x kernel only at K = 2048 (`heuristic_config`).
    """
    chunks = k // MMA_CHUNK
    if m != 1 or n * k > HEURISTIC_MAX_WEIGHTS or k % MMA_CHUNK:
        return None
    warps = next(w for w in (8, 4, 2, 1) if chunks % w == 0 and (chunks // w >= 4 or w == 1))
    return DecodeConfig(rows=16, warps=warps, depth=2, pdl_early=chunks // warps <= 8)


def xshared_split(n: int, k: int, sms: int = DEFAULT_SM_COUNT, max_per_sm: int | None = None, rows: int = 64) -> int:
    """The shared-x kernel's K split for programs of `rows` rows: of the divisors of K / 128 that leave each program
    >= 4 chunks (or 1), and with `max_per_sm` make at most that many programs a multiprocessor (where any does), the
    one whose launch is nearest HEURISTIC_PROGRAMS_PER_SM programs a multiprocessor (the smaller split on a tie),
    as the H200 launch table's picks at M = 1-16 on the five GLM-5 shapes are."""
    chunks, blocks = k // MMA_CHUNK, -(-n // rows)
    splits = [s for s in range(1, max(1, chunks // 4) + 1) if chunks % s == 0]
    if max_per_sm is not None:
        splits = [s for s in splits if blocks * s <= max_per_sm * sms] or [1]
    return min(splits, key=lambda s: (abs(blocks * s - HEURISTIC_PROGRAMS_PER_SM * sms), s))


def xshared_heuristic(m: int, n: int, k: int, layout: Layout = Layout.PAIRS, sms: int = DEFAULT_SM_COUNT
                      ) -> DecodeConfig | None:
    """The shared-x kernel at 1 <= M <= 16, configured as the H200 launch table's picks mostly are: 64-row programs
    (4 warps of 16 rows), K split by `xshared_split`, a ring of 4 chunks; M <= 2: the words through the ring too
    (w_smem), one chunk ahead; M <= 8 (or on SPANS weights, not measured): words in registers three chunks ahead;
    M <= 16 on PAIRS weights: warpgroup MMAs, two chunks ahead, and at most WGMMA_PROGRAMS_PER_SM programs a
    multiprocessor (its 164 registers a thread fit three; a fourth program waits for a whole one to end: 8192^2 at
    split 4 was 0.86x the Triton kernel, at split 2 level). None where K is not a positive multiple of 128."""
    if not 1 <= m <= MAX_M or k % MMA_CHUNK or k == 0:
        return None
    if m <= 2:
        return DecodeConfig(rows=16, warps=4, depth=1, split=xshared_split(n, k, sms), ring=4, w_smem=True)
    if m <= 8 or layout is not Layout.PAIRS:
        return DecodeConfig(rows=16, warps=4, depth=3, split=xshared_split(n, k, sms), ring=4)
    return DecodeConfig(rows=16, warps=4, depth=2, split=xshared_split(n, k, sms, WGMMA_PROGRAMS_PER_SM), ring=4,
                        wgmma=True)


@functools.lru_cache(maxsize=4)
def _table(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _table_entry(m: int, n: int, k: int, device: str, layout: Layout) -> dict | None | str:
    """The launch table's entry for this GPU, weight layout, shape and M (the smallest tuned M >= m), None past the
    largest tuned M, or "untuned" (no entry, or a table tuned on weights of another layout)."""
    table = _table(str(TUNED_PATHS.get(layout, "")))
    if not table_serves(table, device) or table.get("layout", Layout.PAIRS.value) != layout.value:
        return "untuned"
    rows = table.get("decode", {}).get(f"{n},{k},{MMA_CHUNK}")
    if not rows:
        return "untuned"
    pick = next((v for v in sorted(int(v) for v in rows) if v >= m), None)
    return None if pick is None else rows[str(pick)]


def tuned_config(m: int, n: int, k: int, device: str, pdl: bool, layout: Layout = Layout.PAIRS
                 ) -> DecodeConfig | None | str:
    """The tuned choice for this GPU, weight layout, shape and M: a DecodeConfig, None (the Triton kernel measured
    faster), or "untuned" (no entry, or a table tuned on weights of another layout: fall back to
    `heuristic_config`). An entry holds the smallest tuned M >= m; past the largest tuned M the Triton kernel is
    taken."""
    entry = _table_entry(m, n, k, device, layout)
    if not isinstance(entry, dict):
        return entry
    ent = entry.get("pdl" if pdl else "plain")
    return DecodeConfig(**ent) if ent else None


def tuned_residency(m: int, n: int, k: int, device: str, pdl: bool, layout: Layout = Layout.PAIRS) -> dict | None:
    """What the launch table's pick here compiled to when it was timed: {"registers", "shared"} (the table's
    "compiled" entries, scripts/sass_digest.py --record), or None where the table does not say."""
    entry = _table_entry(m, n, k, device, layout)
    got = (entry.get("compiled") or {}).get("pdl" if pdl else "plain") if isinstance(entry, dict) else None
    return got if isinstance(got, dict) and {"registers", "shared"} <= set(got) else None


def tuned_alternates(m: int, n: int, k: int, device: str, pdl: bool, layout: Layout = Layout.PAIRS
                     ) -> list[tuple[DecodeConfig, dict]]:
    """The launch table's next-fastest Gluon configs here, fastest first, each with what it compiled to when it was
    timed (the entry's "alternates", `scripts/sass_digest.py --record --alternates`): where the pick lost its
    residency, `choose` takes the first of them that kept its own. Entries without that record are left out."""
    entry = _table_entry(m, n, k, device, layout)
    alts = ((entry.get("alternates") or {}).get("pdl" if pdl else "plain") or []) if isinstance(entry, dict) else []
    out = []
    for alt in alts:
        got = alt.get("compiled") if isinstance(alt, dict) else None
        if isinstance(got, dict) and {"registers", "shared"} <= set(got) and isinstance(alt.get("config"), dict):
            out.append((DecodeConfig(**alt["config"]), got))
    return out


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of `warps` warps, `registers` a thread and `shared` bytes of shared memory that one sm_90 SM holds at
    once (0: none; the launch would fail)."""
    by_registers = SM90_REGISTERS // (-(-max(registers, 1) // 8) * 8 * 32) // warps
    return min(by_registers, SM90_SHARED // (shared + SM90_SHARED_PER_PROGRAM), SM90_WARPS // warps, SM90_PROGRAMS)


def launch_programs(n: int, cfg: DecodeConfig) -> int:
    """Programs in a launch of `cfg` on a weight of N rows."""
    return -(-n // (cfg.warps * cfg.rows)) * cfg.split if cfg.split else -(-n // cfg.rows)


def _waves(programs: int, per_sm: int, sms: int) -> float:
    return -(-programs // (per_sm * sms)) if per_sm > 0 else float("inf")


def _compile_key(cfg: DecodeConfig, m: int, k: int, pdl: bool, spans: bool) -> tuple:
    """What a launch's compiled kernel depends on besides the activations' dtype (whose two builds are taken as
    alike here): the config, the token tile, the chunks, PDL, the layout, and for `_decode_kernel` M = 1."""
    return cfg, xshared_tokens(m) if cfg.split else decode_tokens(m), k // MMA_CHUNK, pdl, spans, m == 1 and not cfg.split


def residency_waves(n: int, cfg: DecodeConfig, timed: dict, got: tuple[int, int], sms: int
                    ) -> tuple[int, int, int, float, float]:
    """(programs, programs an SM as timed, as compiled, waves as timed, as compiled) of a launch of `cfg` on a weight
    of N rows: `timed` {"registers", "shared"} as the table recorded it, `got` (registers, shared) as compiled. What
    `residency_problem` compares (and `scripts/sass_digest.py --ladder`, from a digest instead of a launch)."""
    programs = launch_programs(n, cfg)
    want_sm = programs_per_sm(timed["registers"], timed["shared"], cfg.warps)
    have_sm = programs_per_sm(*got, cfg.warps)
    return programs, want_sm, have_sm, _waves(programs, want_sm, sms), _waves(programs, have_sm, sms)


def residency_problem(m: int, w: PackedW4, cfg: DecodeConfig, pdl: bool, timed: dict, sms: int) -> str | None:
    """Why the pick `cfg`, timed compiled to `timed` ({"registers", "shared"}), would not run as it was timed: this
    Triton compiled it (an earlier launch in this process, `_COMPILED`) to fewer programs an SM, so that its launch
    takes more waves (e.g. kernels/NOTES.md session 42: a table pick at 164-165 registers under Triton 3.6 compiles
    to 187 under Triton 3.9, two programs an SM instead of three, and ran 1.31x slower on an H100). None where it
    runs as timed, or where nothing is known yet (the first launch)."""
    got = _COMPILED.get(_compile_key(cfg, m, w.k, pdl, w.layout is Layout.SPANS))
    if got is None:
        return None
    programs, want_sm, have_sm, want, have = residency_waves(w.n, cfg, timed, got, sms)
    if have <= want:
        return None
    return (f"timed at {timed['registers']} registers and {timed['shared']} B of shared memory a program ({want_sm} "
            f"programs an SM, {want} wave(s) of its {programs}), this Triton compiles it to {got[0]} registers and "
            f"{got[1]} B ({have_sm} an SM, {have} waves)")


def choose(m: int, w: PackedW4, device: torch.device, device_name: str, pdl: bool,
           dtype: torch.dtype = torch.bfloat16) -> DecodeConfig | None:
    """The config `w4a16_matmul_packed` runs this call with on the Gluon kernel, or None for the Triton kernels.

    A launch-table pick that this process's Triton compiles to fewer programs an SM than the table timed, so that its
    launch needs more waves (`residency_problem`), is not taken: the table's next-fastest config here that kept its
    own residency runs instead (`tuned_alternates`), else the Triton kernels, with a warning once per config given up
    (kernels/NOTES.md, sessions 42 and 44: under Triton 3.9 the pick at 6144->24576 M = 16 loses a program an SM, and
    the runner-up keeps its speed). On a CUDA device each config is compiled (not launched) for activations of
    `dtype` before it is judged (`_compile_ahead`), so the first call already runs what the ladder settles on; where
    that cannot be done, a config's first call runs it, and that launch tells."""
    if not available(device) or not supports(m, w):
        return None
    cfg = tuned_config(m, w.n, w.k, device_name, pdl, w.layout)
    tuned = cfg != "untuned"
    if not tuned:
        cfg = heuristic_config(m, w.n, w.k, w.layout, sm_count(device)) if _cuda_info(device)[2] == (9, 0) else None
    if cfg is None or not supports(m, w, cfg):
        return None
    if not tuned:
        return cfg
    settled = (m, w.n, w.k, pdl, w.layout, device_name)  # once every verdict it rests on is known: one dict lookup a
    if settled in _SETTLED:  # call, as before the ladder
        return _SETTLED[settled]
    ladder = [(cfg, tuned_residency(m, w.n, w.k, device_name, pdl, w.layout))]
    ladder += [(c, t) for c, t in tuned_alternates(m, w.n, w.k, device_name, pdl, w.layout) if supports(m, w, c)]
    for i, (cand, timed) in enumerate(ladder):
        instead = f"the table's next-fastest config here, {ladder[i + 1][0]}," if i + 1 < len(ladder) else \
            "the Triton kernel"  # fmt: skip
        lost = _residency_lost(m, w, cand, pdl, device, device_name, timed, instead, dtype)
        if not lost:
            if lost is False:  # known to hold (None: this call launches it first)
                _SETTLED[settled] = cand
            return cand
    _SETTLED[settled] = None
    return None


def _residency_lost(m: int, w: PackedW4, cfg: DecodeConfig, pdl: bool, device: torch.device, device_name: str,
                    timed: dict | None, instead: str = "the Triton kernel", dtype: torch.dtype = torch.bfloat16
                    ) -> bool | None:
    """Whether the table's config `cfg`, timed compiled to `timed` (None: not recorded, nothing to hold it to), lost
    that residency (`residency_problem`), warned the first time, naming what runs `instead`; None while that is not
    known (neither compiled ahead on this CUDA device, `_compile_ahead`, nor launched yet: the caller runs it, which
    records what it compiled to). The verdict is kept once its compiled kernel is known (its registers do not change
    in a process), so later calls cost a dict lookup, not the table's record and the residency arithmetic again."""
    key = (cfg, m, w.n, w.k, pdl, w.layout, device_name)
    if (lost := _RESIDENCY_LOST.get(key)) is not None:
        return lost
    compile_key = _compile_key(cfg, m, w.k, pdl, w.layout is Layout.SPANS)
    if timed is not None and compile_key not in _COMPILED and device.type == "cuda":
        _compile_ahead(m, w, cfg, pdl, dtype, device)
    if timed is not None and compile_key not in _COMPILED:
        return None
    why = None if timed is None else residency_problem(m, w, cfg, pdl, timed, sm_count(device))
    if why:
        import triton

        log.warning("w4a16: the launch table's %s for a [%d, %d] weight at M = %d%s was %s (Triton %s); %s runs "
                    "instead. Re-tune on this Triton: python3 scripts/probe_decode.py --tune --merge --write %s", cfg,
                    w.n, w.k, m, " (PDL)" if pdl else "", why, triton.__version__, instead, TUNED_PATHS.get(w.layout))
    _RESIDENCY_LOST[key] = why is not None
    return why is not None


def _remember(key: tuple, kernel) -> None:
    """Record the registers and shared memory of a launch's compiled kernel (Triton's handle, as a launch returns it;
    its registers are read when it is loaded) for `residency_problem`."""
    if key in _COMPILED:
        return
    try:
        _COMPILED[key] = (int(kernel.n_regs), int(kernel.metadata.shared))
    except (AttributeError, TypeError, ValueError):  # another Triton's handle: nothing recorded, nothing checked
        pass


def decode_matmul(x: torch.Tensor, w: PackedW4, out: torch.Tensor, cfg: DecodeConfig, pdl: bool = False,
                  probe: int = 0) -> torch.Tensor:
    """out = x @ dequant(w).T with the Gluon kernel. The caller (`w4a16_matmul_packed`) has checked x, w and out;
    here `supports(m, w, cfg)` must hold. probe: the kernels' timing probes (`_decode_kernel`'s, or with `cfg.split`
    `_xshared_kernel`'s PROBE; wrong results), 0 for the GEMM."""
    m, k = x.shape
    if not supports(m, w, cfg):
        raise ValueError(f"the decode kernel takes 1 <= M <= {MAX_M} (<= {MAX_M_WGMMA} with wgmma, on pairs weights) "
                         f"on 2-D chunk-major pairs or spans weights with "
                         f"{cfg.warps} warps dividing K / {MMA_CHUNK}, and with x_smem at M = 1 at most "
                         f"{X_SMEM_MAX_BYTES >> 10} KB of staged x (`x_smem_bytes`); got M = {m}, weight "
                         f"{[*w.lead, w.n, w.k]} ({w.layout.value}, chunk_major={w.chunk_major}), {cfg}")
    if cfg.wgmma and _cuda_info(x.device)[2] != (9, 0):
        raise ValueError(f"DecodeConfig.wgmma needs an sm_90 GPU (Hopper's warpgroup MMA), got {cfg} on "
                         f"{torch.cuda.get_device_name(x.device)}")
    if w.n == 0:
        return out  # nothing to launch (a grid of zero programs is an error)
    stride_wn, _ = w.word_strides()
    if stride_wn != MMA_CHUNK // 8 or w.scale.stride(-1) != 1:
        raise ValueError("the decode kernel needs contiguous chunk-major words (as `prepack` makes them) and scales")
    fn, grid, args, kwargs = _launch_args(m, x.dtype, w, cfg, pdl, probe, x, out)
    _remember(_compile_key(cfg, m, k, pdl, w.layout is Layout.SPANS), fn[grid](*args, **kwargs))
    return out


def _launch_args(m: int, dtype: torch.dtype, w: PackedW4, cfg: DecodeConfig, pdl: bool, probe: int = 0,
                 x: torch.Tensor | None = None, out: torch.Tensor | None = None) -> tuple:
    """(kernel, grid, arguments, keywords) of `decode_matmul`'s launch of `x` [M, K] into `out`; `decode_matmul`'s
    checks hold. Without x and out, those of a compile for M tokens of `dtype` (`_compile_ahead`): every tensor the
    launch would take or allocate is then passed as its dtype (Triton's warmup takes a dtype for a pointer, as an
    aligned one), x's and out's row strides as a contiguous launch has them, so nothing is allocated (nor captured
    into a CUDA graph being recorded)."""
    ahead = x is None
    k = w.k
    x_arg, out_arg = (dtype, dtype) if ahead else (x, out)
    stride_xm, stride_om = (k, w.n) if ahead else (x.stride(0), out.stride(0))
    _, stride_wc = w.word_strides()
    launch = {"launch_pdl": True} if pdl else {}
    spans = w.layout is Layout.SPANS
    bf16 = dtype == torch.bfloat16
    if cfg.split:
        blocks = -(-w.n // (cfg.warps * cfg.rows))
        if cfg.split == 1:
            scratch = tickets = out_arg  # not dereferenced without SPLIT
        elif ahead:
            scratch, tickets = torch.float32, torch.int32
        else:
            scratch = torch.empty(cfg.split, m, w.n, dtype=torch.float32, device=x.device)  # fp32 partials
            tickets = _tickets(x.device, blocks)
        args = (x_arg, w.qweight, w.scale, out_arg, scratch, tickets, m, w.n, stride_xm, stride_wc, w.scale.stride(0),
                stride_om)
        consts = _xshared_args(m, k // MMA_CHUNK, cfg, bf16, spans, pdl, probe)
        return _xshared_kernel, (blocks, cfg.split), args, {**consts, "num_warps": cfg.warps, **launch}
    cpw = k // MMA_CHUNK // cfg.warps
    args = (x_arg, w.qweight, w.scale, out_arg, m, w.n, stride_xm, stride_wc, w.scale.stride(0), stride_om)
    consts = dict(CPW=cpw, W=cfg.warps, R=cfg.rows, TOK=decode_tokens(m), D=min(cfg.depth, cpw), BF16=bf16,
                  XB=m == 1, XS=m == 1 and cfg.x_smem, SP=spans, PDL=pdl, PDL_EARLY=pdl and cfg.pdl_early,
                  PROBE=probe)
    return _decode_kernel, (-(-w.n // cfg.rows),), args, {**consts, "num_warps": cfg.warps, **launch}


def _compile_ahead(m: int, w: PackedW4, cfg: DecodeConfig, pdl: bool, dtype: torch.dtype, device: torch.device
                   ) -> object | None:
    """Compile `cfg`'s kernel for a call at M tokens without launching it (Triton's `warmup`), load it and record
    its registers and shared memory (`_remember`), so that `choose` knows whether a table config kept its residency
    before its first launch: the ladder settles in the first call, and a CUDA graph captured on the first call holds
    what it settles on (before, each config given up cost one launch of it first). The launch that follows finds
    the kernel in Triton's cache. Where this Triton cannot (no `warmup`, a compile error), nothing is recorded and
    the config is launched to learn it, as before; the launch then meets any error itself. Returns Triton's handle
    of the compiled kernel, or None."""
    try:
        fn, grid, args, kwargs = _launch_args(m, dtype, w, cfg, pdl and pdl_supported(device))
        with torch.cuda.device(device):  # (Triton compiles for, and loads on, the current device)
            kernel = fn.warmup(*args, grid=grid, **kwargs)
            kernel._init_handles()  # (loads the module: what gives Triton's handle its registers)
    except Exception as e:  # noqa: BLE001 - any failure leaves the old way: learn it from the launch
        log.debug("w4a16: compiling %s ahead of its launch failed (%s: %s); its launch will tell", cfg,
                  type(e).__name__, e)
        return None
    _remember(_compile_key(cfg, m, w.k, pdl, w.layout is Layout.SPANS), kernel)
    return kernel


def decode_tokens(m: int) -> int:
    """`_decode_kernel`'s token tile for M tokens: 8 or 16."""
    return 8 if m <= 8 else 16


def xshared_tokens(m: int) -> int:
    """The shared-x kernel's token tile for M tokens: 8, 16, 32 or 64 (above 16 only with wgmma)."""
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def _xshared_args(m: int, chunks: int, cfg: DecodeConfig, bf16: bool, spans: bool, pdl: bool, probe: int = 0) -> dict:
    cpp = chunks // cfg.split
    return dict(CPP=cpp, W=cfg.warps, R=cfg.rows, TOK=xshared_tokens(m), D=min(cfg.depth, cpp), XR=cfg.ring,
                STEP=cfg.step, WS=cfg.w_smem, WG=cfg.wgmma, SA=cfg.scaled_a, BF16=bf16, SP=spans, SPLIT=cfg.split > 1,
                PDL=pdl,
                PROBE=probe)


def compile_sm90(cfg: DecodeConfig, chunks: int, tok: int = 8, bf16: bool = True, xb: bool = True,
                 pdl: bool = False, spans: bool = False, probe: int = 0) -> dict:
    """Compile `_decode_kernel` (with `cfg.split`: `_xshared_kernel`) for sm_90 without a GPU (Triton's own ptxas
    and cuobjdump) and summarise it.

    For CI and for reading the code a config produces: returns {"registers", "spills" (stack bytes),
    "local" (bytes), "shared" (bytes of shared memory a program allocates), "ops" (SASS opcode -> count), "ldg128"
    (16-byte global loads), "ldg_words" (the words': 16-byte, evict-first), "ldg_u16" and "ldg32" (2- and 4-byte
    global loads), "lds128" (16-byte shared loads), "ldsm" (ldmatrix), "loop_barriers" and "loop_lds_narrow"
    (barriers and shared loads of < 16 bytes other than ldmatrix between the first and the last MMA), "sass", "ptx"};
    TTGIR that needed a real layout conversion fails to compile (`assert_trivial`). Raises RuntimeError when this Triton
    cannot (no Gluon, no cuobjdump).
    """
    import collections
    import os
    import re
    import subprocess
    import tempfile

    if not _GLUON:
        raise RuntimeError("this Triton has no Gluon (triton.experimental.gluon)")
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as exc:  # pragma: no cover - depends on the installed Triton
        raise RuntimeError(f"this Triton cannot compile Gluon ahead of time: {exc}") from exc
    act = "*bf16" if bf16 else "*fp16"
    sig = {"x_ptr": act, "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": act, "M": "i32", "N": "i32",
           "stride_xm": "i32", "stride_wc": "i32", "stride_sn": "i32", "stride_om": "i32"}
    if cfg.split:  # the shared-x kernel: two more pointers (the split-K scratch and tickets)
        sig = {**{k: v for k, v in sig.items() if k.endswith("_ptr")}, "ws_ptr": "*fp32", "cnt_ptr": "*i32",
               **{k: v for k, v in sig.items() if not k.endswith("_ptr")}}
        consts = _xshared_args(tok, chunks, cfg, bf16, spans, pdl, probe)
        kernel_fn, ptrs = _xshared_kernel, (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11)
    else:
        consts = dict(CPW=chunks // cfg.warps, W=cfg.warps, R=cfg.rows, TOK=tok, D=min(cfg.depth, chunks // cfg.warps),
                      BF16=bf16, XB=xb, XS=xb and cfg.x_smem, SP=spans, PDL=pdl, PDL_EARLY=pdl and cfg.pdl_early,
                      PROBE=probe)
        kernel_fn, ptrs = _decode_kernel, (0, 1, 2, 3, 5, 6, 7, 8, 9)
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptrs}  # as the JIT specialises them
    src = GluonASTSource(kernel_fn, sig, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise RuntimeError(f"no cuobjdump at {tool}")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "--dump-sass", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "--dump-resource-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", res)}
    ops = collections.Counter(m.split(".")[0] for m in re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))  # fmt: skip
    wide = len(re.findall(r"LDG\.E(?:\.[A-Z]+)*\.128", sass))
    mma_op = "HMMA" if "HMMA" in sass else "HGMMA"
    body = sass[sass.find(mma_op):sass.rfind(mma_op)]  # the unrolled main loop: first to last MMA
    return {"registers": usage.get("REG"), "spills": usage.get("STACK"), "local": usage.get("LOCAL"),
            "shared": kernel.metadata.shared, "ops": dict(ops),
            "ldg128": wide, "ldg_words": len(re.findall(r"LDG\.E\.EF\.128", sass)),
            "ldg_u16": len(re.findall(r"LDG\.E\.U16", sass)),
            "ldg32": len(re.findall(r"LDG\.E(?:\.STRONG\.GPU)? ", sass)), "lds128": len(re.findall(r"LDS\.128", sass)),
            "ldsm": len(re.findall(r"\bLDSM\.", sass)), "loop_barriers": len(re.findall(r"\bBAR\.", body)),
            "loop_lds_narrow": len(re.findall(r"(?<!@!PT )\bLDS(?!\.128|M)", body)), "sass": sass,  # @!PT: never runs
            "ptx": kernel.asm["ptx"]}  # LLVM's instruction order (session 22: it sank a runtime loop's fma)
