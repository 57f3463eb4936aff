"""Triton W4A16 GEMM over compressed-tensors `pack-quantized` int4 weights, repacked once at load.

    y[M, N] = x[M, K] @ dequant(weight_packed[N, K/8], weight_scale[N, K/g]).T      (fp32 accumulate)

Layouts. The checkpoint stores element k of row n in nibble k % 8 of word k // 8 (formats.md §2c,
u = q + 8, LSB first). `prepack` permutes the nibbles once, inside each CHUNK of C consecutive
columns (C = 128 when K allows, else 64 or 32), in one of two orders (`Layout`, `chunk_perm`):

  PAIRS (the default for group-128 weights with 128-column chunks; what the tensor-core kernels read):
      word v = 4c + a of a chunk, nibble i  =  element  32a + 16((i >> 1) & 1) + 8(i & 1) + 2c + (i >> 2)
  Nibbles i and i + 4 of a word are the adjacent columns (k, k + 1) that one 32-bit register of the
  tensor cores' A fragment holds, and the fragment rule (lane c = lane % 4 holds columns {2c, 2c+1,
  2c+8, 2c+9} of every k16 block) is met by thread c's four consecutive words 4c .. 4c+3: one 16-byte
  load carries all 32 of its elements of a chunk for one row. One lop3 per pair turns a word (or the
  word shifted by 4, 8, 12) into two bf16/fp16 values 128 + u (`_pairs_asm`), one fma makes them
  q = u - 8 exactly: 1.4 instructions per weight. The group scale is not multiplied into the weights
  but applied once per output after each chunk's dot (`_pairs_chunk_dot`). The words are also stored
  chunk-major (`PackedW4.chunk_major`: `[K/128, N, 16]`, all rows of one chunk contiguous), so that a
  tile of 128 rows x 1 chunk is one contiguous 8 KB block of memory.
  SPANS (opt-in, `prepack(..., layout="spans")`; 2-D weights): the PAIRS words, but MMA k position p
      holds column `spans_column(p)`, so that thread c's four words hold the columns [32c, 32c + 32) of
      the chunk. The Gluon decode kernel (w4a16_decode.py) then loads x's B fragments 16 bytes at a time
      at any M (on the H200: faster than PAIRS at M <= 4), while the Triton kernel permutes x's rows of
      each chunk in registers (M <= 16, `_spans_rows`) or reads a permuted copy of x (`spans_x`): 1.03-1.3x
      slower than PAIRS from M = 16 on. A layout for weights that only see decode batches; PAIRS stays the
      default, and the MoE kernel refuses SPANS.
  PLANES (every chunk size; the GEMV, the per-plane MMA kernel, and group sizes 32 and 64):
      prepacked word w of a chunk, nibble j  =  element  j * P + w  of that chunk   (P = C / 8)
  The words keep their shape `[N, K/8]`. Nibble "plane" j of the P words of a chunk is then P
  *consecutive* columns: plane j of a word tile multiplies a contiguous slice of x (one vector load,
  shared by every row of the tile) on the CUDA cores, and is a ready `[P, BLOCK_N]` operand of a
  K = 16 tensor-core dot; a plane never straddles a quantization group (P divides g). Plane j is
  extracted with one mask (one shift of the word by 20 serves j = 5..7): `(w & 0xF << 4s) | 0x4B000000`
  read as fp32 is 2^23 + u * 16^s, exactly, and one FMA gives q = u - 8 exactly.
The scales are never touched.

`w4a16_matmul` takes the checkpoint's tensors and prepacks them on first use (in the layout its
config needs), caching the result per weight tensor (weakly referenced, invalidated by in-place
writes); `prepack` + `w4a16_matmul_packed` do the same explicitly, which is what a serving loader
should do (the cache holds a second copy).

Three kernels:
  * MMA, transposed (`_mma_swap_kernel`, `DenseConfig.swap`, C = 128 only; every M on PAIRS weights):
    y.T = dequant(W) @ x.T, so the dequantized weights are the tensor cores' *register* operand
    (Hopper wgmma reads A from registers; B, here x.T, from shared memory) and the tokens are the
    MMA's N dimension (16..256; at decode the token columns past M are zero-filled, not loaded).
    The dequantized `[BLOCK_N, 128]` tile is assembled from each word's elements by join/permute/
    reshape, pure register renaming under Triton's linear layouts, into the natural-order operand of
    ONE K = 128 dot per chunk (eight back-to-back async wgmma), without any shuffle or shared-memory
    round trip of dequantized values (no convert_layout in Triton 3.6's TTGIR for sm_90). Words and x
    tiles are pipelined by Triton's cp.async pipeliner (num_stages). The main loop of a 16 x 128 tile
    is 302 SASS instructions per chunk on PAIRS weights against 409 on PLANES (`_dequant_nat`,
    `_plane_asm`: a prmt gathers each pair of a plane from two words and the scale is folded in).
  * GEMV (`_gemv_kernel`, M <= 8 rows per program, PLANES): CUDA-core FMAs over a `[BLOCK_M, BLOCK_N,
    CPI, P]` register tile (CPI chunks per step); the word tile of the next step is loaded before the
    current one is computed; the group scale is applied once per (row, word); any chunk size, so it
    serves K that is not a multiple of 128.
  * MMA, per plane (`_mma_kernel`, BLOCK_M >= 16, PLANES, C = 128 only): per chunk and plane one
    `tl.dot` of `[BLOCK_M, 16] x [16, BLOCK_N]`. On Hopper each small dot needs its dequantized operand
    in shared memory; in the H200 tuning of 2026-11-29 it was 1.2-2.8x slower than the transposed
    kernel at every GLM-5 shape and M = 4..2048, so it stays only as the baseline the tuner compares.
All split K over programs when the output has few tiles (decode shapes on 132 SMs); the split-K
reduction is deterministic and needs no memset: every split stores its fp32 partial and takes a
ticket from a per-tile counter; the last one to arrive sums the partials in split order, writes the
output and re-arms the counter (CUDA's threadFenceReduction pattern). At M = 1 the transposed kernel takes
its ticket when it starts and reduces through a mailbox instead (`_mailbox_tile`): the last program to
start sums, the others publish their partials with a plain store and exit, with no fence or atomic on
the way out (one L2 round trip at the end instead of three; kernels/NOTES.md, session 6).

Launch parameters: `choose_config` reads a table tuned on the target GPU (`tuned_configs.json`
beside this file, written by scripts/tune_kernels.py, keyed by GPU name, weight layout, (N, K, g)
and an M bucket; a table also serves the GPUs its "also_for" names, `table_serves`) and falls back to a
deterministic heuristic for other GPUs and shapes. Nothing is
autotuned at call time. Measurements and the decisions they drove: kernels/NOTES.md.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("glmq.kernels needs Triton: pip install 'glmq[triton]'") from exc

SUPPORTED_GROUP_SIZES = (32, 64, 128)
ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MMA_CHUNK = 128  # the tensor-core kernels' chunk: planes of 16 columns = one k16 MMA block
# Heuristic (untuned shapes): M at or below which the CUDA-core GEMV is used. On H200 the transposed
# tensor-core kernel at M = 4 (16-token tiles: the same work as at M = 1) ran at 0.92-1.17x the speed
# of the GEMV at M = 1 and 1.2-1.6x faster than the previous table's M = 4 entries.
GEMV_MAX_M = 2
# Streaming multiprocessors assumed when no GPU is visible (interpreter runs): an H200's 132, so the
# heuristics take the same decisions under TRITON_INTERPRET=1 as on the target.
DEFAULT_SM_COUNT = 132
TUNED_PATH = Path(__file__).with_name("tuned_configs.json")


class KernelKind(str, enum.Enum):
    GEMV = "gemv"  # CUDA-core dot products; BLOCK_M rows share each dequantized tile
    MMA = "mma"  # tl.dot tiles


PDL_MODES = ("auto", "early", "late", "off")


@dataclass(frozen=True)
class DenseConfig:
    """Launch parameters of one W4A16 GEMM; `choose_config` picks them, tests and benchmarks may override.

    Attributes:
        kind: GEMV or MMA kernel.
        block_m: rows of x per program (GEMV: 1..8; MMA: >= 16). Powers of two.
        block_n: output columns per program (power of two, >= 16).
        split_k: number of K ranges reduced across programs (clamped so that no range is empty).
        cpi: GEMV only: chunks per loop step (power of two).
        prefetch: MMA only: load the next chunk's words into registers before computing this one.
        big_dot: MMA only, group 128, not swap: one K = 128 dot per chunk (activations gathered in
            the prepacked column order) instead of eight K = 16 dots. 2-5x slower than the per-plane
            dots in every H200 tuning (the gathered activation loads are 2-byte scalar loads); kept
            for comparison.
        swap: MMA only: the transposed product `y.T = W @ x.T` (`_mma_swap_kernel`): the dequantized
            weights are the tensor cores' register operand A (no shared-memory round trip), the
            tokens are the dot's N dimension (any BLOCK_M >= 16 fills it), one K = 128 dot per chunk
            in natural k order, pipelined by Triton (num_stages).
        asm: swap only: dequantize two weights per instruction with inline PTX (`_plane_asm`);
            False: plain Triton ops (the interpreter always takes that path).
        mailbox: swap only, one token (M = 1) with split-K: reduce the splits through the mailbox
            (`_mailbox_tile`: the reducing program is fixed when the programs start, the others publish
            their partials with a plain store, no fence or atomic at the end) instead of the
            last-arriver ticket (`_write_tile`). Same sums in the same order, so the same bits.
        group_m: MMA only: output-tile rows per L2 "super-row" in the launch order.
        pdl_mode: what a `pdl=True` call does (`pdl_plan`): "early" lets the next launch in right after
            this one's wait, "late" only after the main loop (swap kernel; the others trigger early),
            "off" launches without PDL, "auto" picks by M and the chunks per split.
        pdl_prefetch: swap only, on a PDL launch: chunks of words each program prefetches into L2 before
            it waits for the previous kernel (None: 2 when early, else 0).
        num_warps, num_stages: Triton launch options.
    """

    kind: KernelKind
    block_m: int
    block_n: int
    split_k: int = 1
    cpi: int = 1
    prefetch: bool = True
    big_dot: bool = False
    swap: bool = False
    asm: bool = True
    mailbox: bool = True
    group_m: int = 8
    pdl_mode: str = "auto"
    pdl_prefetch: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KernelKind(self.kind))
        for name in ("block_m", "block_n", "cpi"):
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
        if self.pdl_mode not in PDL_MODES:
            raise ValueError(f"pdl_mode must be one of {PDL_MODES}, got {self.pdl_mode!r}")
        if self.pdl_prefetch is not None and self.pdl_prefetch < 0:
            raise ValueError(f"pdl_prefetch must be >= 0, got {self.pdl_prefetch}")
        if self.swap and self.kind is not KernelKind.MMA:
            raise ValueError("swap applies to the MMA kernel only")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


# --------------------------------------------------------------------------------------------------
# Prepacking (host side, once per weight)
# --------------------------------------------------------------------------------------------------


def chunk_for(k: int) -> int:
    """The prepack chunk for K columns: 128, else 64, else 32 (K is a multiple of the group, >= 32)."""
    for c in (128, 64, 32):
        if k % c == 0:
            return c
    raise ValueError(f"K = {k} must be a multiple of 32")


class Layout(str, enum.Enum):
    """How `prepack` orders the nibbles inside each chunk (module docstring)."""

    PLANES = "planes"  # word w, nibble j = element j * P + w: any chunk; the GEMV and per-plane kernels
    PAIRS = "pairs"  # chunk 128 only: each word holds 4 (k, k+1) pairs of one thread's MMA fragment
    SPANS = "spans"  # PAIRS over the MMA's k positions, which hold the columns `spans_column`: thread c's 32 columns

    @property
    def mma(self) -> bool:
        """Whether the tensor-core kernels read it (PAIRS, SPANS: chunk 128, group 128, an A fragment per word)."""
        return self is not Layout.PLANES


def spans_column(p):
    """The chunk column held at MMA k position p = 16 s + 8 h + 2 c + e of a SPANS chunk: 32 c + 4 s + 2 h + e.

    So lane c of the m16n8k16 fragments (the positions 2c + e + 8h + 16s of every k16 step s) holds the columns
    [32 c, 32 c + 32) of the chunk, in order: x's B fragments of a chunk are one 64-byte run per thread and
    token. Works on ints, torch and Triton tensors (bit operations only).
    """
    return ((p >> 1) & 3) * 32 + (p >> 4) * 4 + ((p >> 3) & 1) * 2 + (p & 1)


def chunk_perm(chunk: int, layout: Layout) -> torch.Tensor:
    """int64 `[chunk]`: the chunk element that prepacked nibble slot s = 8 * word + nibble holds.

    PLANES: word w, nibble j holds element j * P + w (P = chunk / 8).
    PAIRS (chunk 128): word v = 4 c + a, nibble i holds element
        (i >> 2) + 2 c + 8 (i & 1) + 16 ((i >> 1) & 1) + 32 a,
    i.e. nibbles i and i + 4 are the adjacent columns (k, k + 1) that one 32-bit register of the
    tensor cores' A fragment holds, c = lane % 4 picks columns {2c, 2c+1, 2c+8, 2c+9} of every k16
    block (the fragment's rule), and a thread's four words v = 4c .. 4c+3 (one 16-byte load) carry
    all 32 of its elements of the chunk for one row.
    SPANS (chunk 128): the PAIRS slots, but MMA k position p holds column `spans_column(p)`, so that
    thread c's four words hold the columns [32 c, 32 c + 32): the kernels feed the MMA x's columns in
    that order (16-byte runs per thread in the Gluon decode kernel; the Triton kernel permutes each
    chunk's x tile in registers, `_spans_rows`, or reads a copy of x permuted so, `spans_x`).
    """
    s = torch.arange(chunk)
    word, nib = s // 8, s % 8
    if layout is Layout.PLANES:
        return nib * (chunk // 8) + word
    if chunk != MMA_CHUNK:
        raise ValueError(f"the {layout.value} layout needs 128-column chunks, got {chunk}")
    c, a = word // 4, word % 4
    pos = (nib >> 2) + 2 * c + 8 * (nib & 1) + 16 * ((nib >> 1) & 1) + 32 * a  # PAIRS: the MMA k position
    return spans_column(pos) if layout is Layout.SPANS else pos


@dataclass(frozen=True, eq=False)
class PackedW4:
    """A symmetric int4 weight in the kernels' layout (see the module docstring).

    Attributes:
        qweight: int32 words, nibbles permuted within each chunk (`chunk_perm`): `[..., N, K/8]`, or
            with `chunk_major` `[..., K/chunk, N, chunk/8]` (each chunk of all rows contiguous, so
            that a tile of rows of one chunk is one contiguous block of memory).
        scale: fp16/bf16/fp32 `[..., N, K/group_size]`, the checkpoint's scales (same tensor).
        group_size: 32, 64 or 128.
        chunk: 128, 64 or 32 (`chunk_for(K)`).
        layout: the nibble order inside a chunk.
        chunk_major: the word order described above (transposed-MMA kernels only).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    group_size: int
    chunk: int
    layout: Layout = Layout.PLANES
    chunk_major: bool = False

    @property
    def n(self) -> int:
        return self.qweight.shape[-2]

    @property
    def k(self) -> int:
        if self.chunk_major:
            return self.qweight.shape[-3] * self.qweight.shape[-1] * 8
        return self.qweight.shape[-1] * 8

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading (expert) dims."""
        return tuple(self.qweight.shape[:-3] if self.chunk_major else self.qweight.shape[:-2])

    def word_strides(self) -> tuple[int, int]:
        """(words between consecutive rows, words between consecutive chunks of a row)."""
        if self.chunk_major:
            return self.qweight.stride(-2), self.qweight.stride(-3)
        return self.qweight.stride(-2), self.chunk // 8

    def check(self, lead: tuple[int, ...], n: int, k: int, device, name: str = "weight") -> None:
        """ValueError unless this is a `[*lead, n, k]` weight on `device`, contiguous as prepacked."""
        if (self.lead, self.n, self.k) != (tuple(lead), n, k):
            raise ValueError(f"prepacked {name} is {[*self.lead, self.n, self.k]} (words {list(self.qweight.shape)}), "
                             f"expected {[*lead, n, k]}")
        if not self.chunk_major:
            check_packed(name, self.qweight, self.scale, (*lead, n, k), self.group_size, device)
            return
        if self.qweight.dtype != torch.int32:
            raise ValueError(f"prepacked {name} words must be int32, got {self.qweight.dtype}")
        _check_tensor(name, "packed", self.qweight, device)
        check_scale(name, self.scale, (*lead, n, k), self.group_size, device)


# How the Triton kernel takes x for SPANS weights: up to this M it loads each chunk's x tile in natural order and
# permutes its rows in registers (`_spans_rows`; Triton stages the result in shared memory for the wgmma, and the
# 16-token tile's registers go from 128 to 167); above it `spans_x` first permutes x with a separate copy kernel.
# On the H200 (kernels/NOTES.md, session 13) the in-register permutation was faster at M <= 16 on all five GLM shapes
# (12288->6144 M = 16: 18.2 against 20.6 us; PAIRS weights 16.9) and the copy at M = 64 on all five (8192^2: 28.0
# against 37.4 us; PAIRS 24.6) and at 9 of 10 shape/M pairs above. `scripts/probe_decode.py --triton-only` times both.
SPANS_PERMUTE_IN_KERNEL_MAX_M = 16


def spans_x(x: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` -> a contiguous copy whose column 128 j + p is x's column 128 j + `spans_column(p)`: the order in
    which SPANS weights' MMA k positions take x, so the Triton kernel reads it as it reads x for PAIRS weights.

    One copy kernel per call: 2-4 us more per GEMM in a CUDA graph on the H200, used above
    SPANS_PERMUTE_IN_KERNEL_MAX_M (kernels/NOTES.md, session 13; loading x's columns in `spans_column` order
    straight into the wgmma operand tile, 4-byte loads, was 1.1-4.3x slower than on PAIRS weights at every M).
    """
    m, k = x.shape
    return x.view(m, k // MMA_CHUNK, 4, 8, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)  # (c, s, h, e) -> (s, h, c, e)


def _permute_nibbles(words: torch.Tensor, chunk: int, perm: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., K/8]` -> words whose nibble slot s of each chunk holds old slot `perm[s]`.

    Re-packed 8 nibbles per word, LSB first; done in row blocks to bound the int64 temporaries.
    """
    kw = words.shape[-1]
    flat = words.reshape(-1, kw)
    rows, k = flat.shape[0], kw * 8
    out = torch.empty_like(flat)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=flat.device)
    perm = perm.to(flat.device)
    block = max(1, (1 << 22) // k)  # ~4M nibbles (32 MB of int64) per step
    for r0 in range(0, rows, block):
        w = flat[r0 : r0 + block]
        r = w.shape[0]
        nib = ((w.unsqueeze(-1) >> shifts) & 0xF).view(r, k // chunk, chunk)
        nib = nib[:, :, perm].reshape(r, kw, 8).long()
        word = (nib << shifts.long()).sum(-1)  # < 2^32, exact in int64
        out[r0 : r0 + block] = (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement
    return out.view(words.shape)


def default_layout(chunk: int, group_size: int) -> Layout:
    """PAIRS for 128-column chunks of group-128 weights, which only the tensor-core kernels read; PLANES
    otherwise (the GEMV, and the folded per-group scales of smaller groups, run on PLANES)."""
    return Layout.PAIRS if chunk == MMA_CHUNK and group_size == MMA_CHUNK else Layout.PLANES


def prepack_words(weight_packed: torch.Tensor, chunk: int, layout: Layout | str = Layout.PLANES) -> torch.Tensor:
    """compressed-tensors words `[..., N, K/8]` (element e = nibble e % 8 of word e // 8) -> prepacked words."""
    return _permute_nibbles(weight_packed, chunk, chunk_perm(chunk, Layout(layout)))


def unprepack_words(qweight: torch.Tensor, chunk: int, layout: Layout | str = Layout.PLANES) -> torch.Tensor:
    """Inverse of `prepack_words` (tests, debugging)."""
    return _permute_nibbles(qweight, chunk, torch.argsort(chunk_perm(chunk, Layout(layout))))


def prepack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
            layout: Layout | str | None = None, chunk_major: bool | None = None) -> PackedW4:
    """Repack a compressed-tensors int4 weight (`[..., N, K/8]` int32, `[..., N, K/g]` scales) once.

    The result feeds `w4a16_matmul_packed` (and, stacked over experts, `fused_moe_w4a16`). layout:
    default `default_layout(chunk_for(K), group_size)`; chunk_major: default True for PAIRS.
    Raises ValueError on a dtype/shape the kernels do not take.
    """
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if weight_packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {weight_packed.dtype}")
    if weight_packed.ndim < 2:
        raise ValueError(f"weight_packed must be [..., N, K/8] (at least 2-D), got shape {list(weight_packed.shape)}")
    if weight_scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"weight_scale must be float16, bfloat16 or float32, got {weight_scale.dtype}")
    k = weight_packed.shape[-1] * 8
    check_k(k, group_size)
    if tuple(weight_scale.shape) != (*weight_packed.shape[:-1], k // group_size):
        raise ValueError(
            f"weight_scale has shape {list(weight_scale.shape)}, expected "
            f"{[*weight_packed.shape[:-1], k // group_size]} for group_size {group_size}"
        )
    chunk = chunk_for(k)
    layout = default_layout(chunk, group_size) if layout is None else Layout(layout)
    if layout.mma and group_size != MMA_CHUNK:
        raise ValueError(f"the {layout.value} layout is for group-{MMA_CHUNK} weights (its kernels scale once per "
                         f"128-column chunk), got group_size {group_size}; use layout='planes'")
    chunk_major = layout.mma if chunk_major is None else chunk_major
    if chunk_major and chunk != MMA_CHUNK:  # only the transposed MMA kernel reads chunk-major words, 128 columns a chunk
        raise ValueError(f"chunk_major=True needs K to be a multiple of {MMA_CHUNK} (K = {k}: prepack chunk {chunk}); "
                         "no kernel reads it otherwise: use chunk_major=False")
    words = prepack_words(weight_packed.contiguous(), chunk, layout)
    if chunk_major:
        *lead, n, kw = words.shape
        words = words.view(*lead, n, kw // (chunk // 8), chunk // 8).transpose(-2, -3)
        # row-major strides even for N = 1, where `.contiguous()` keeps the transposed view's (the decode kernel
        # reads rows 16 words apart and refuses other strides)
        words = words.clone(memory_format=torch.contiguous_format)
    return PackedW4(words, weight_scale.contiguous(), group_size, chunk, layout, chunk_major)


_CACHE: dict[int, tuple] = {}
_CACHE_LOCK = threading.Lock()


def _state(t: torch.Tensor) -> tuple:
    """What tells a cached prepack is still `t`'s: its storage and, except for an inference tensor (which has no
    version counter), its version, bumped by in-place writes through `t` itself."""
    return t.data_ptr(), None if t.is_inference() else t._version


def clear_prepack_cache() -> None:
    """Forget every `cached_prepack`. Needed after a write the cache cannot see: in place through `.data`
    (`param.data.copy_(new)`, as weight loaders write) or into an inference tensor, which keep the tensor's
    storage and version."""
    with _CACHE_LOCK:
        _CACHE.clear()


def cached_prepack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                   layout: Layout | None = None, chunk_major: bool | None = None) -> PackedW4:
    """`prepack`, remembered per `weight_packed` tensor (and layout) while it lives, keeps its storage and is not
    written in place through itself; writes it cannot see are listed in `clear_prepack_cache`."""
    k = weight_packed.shape[-1] * 8
    layout = default_layout(chunk_for(k), group_size) if layout is None else Layout(layout)
    chunk_major = layout.mma if chunk_major is None else chunk_major
    key = (id(weight_packed), layout, chunk_major)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        ref, ver, sref, sver, g, packed = hit
        if ref() is weight_packed and sref() is weight_scale and g == group_size and ver == _state(weight_packed) \
                and sver == _state(weight_scale):  # fmt: skip
            return packed
    packed = prepack(weight_packed, weight_scale, group_size, layout, chunk_major)

    def drop(_, key=key):
        with _CACHE_LOCK:
            ent = _CACHE.get(key)
            if ent is not None and ent[0]() is None:
                del _CACHE[key]

    entry = (weakref.ref(weight_packed, drop), _state(weight_packed), weakref.ref(weight_scale),
             _state(weight_scale), group_size, packed)  # fmt: skip
    with _CACHE_LOCK:
        _CACHE[key] = entry
    return packed


def layout_for(cfg, chunk: int, group_size: int) -> tuple[Layout | None, bool | None]:
    """(layout, chunk_major) a launch config needs, for `cached_prepack`: the per-plane kernels (GEMV,
    non-transposed MMA) read PLANES row-major words; anything else (the transposed MMA kernel, the Gluon decode
    kernel's `DecodeConfig`) takes the defaults."""
    if cfg is not None and hasattr(cfg, "swap") and not cfg.swap:  # DenseConfig / MoeConfig (a DecodeConfig has none)
        return Layout.PLANES, False
    return None, None


# --------------------------------------------------------------------------------------------------
# Triton building blocks (shared with w4a16_moe.py)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _magic_words(words):
    """Prepacked words -> (lo, hi): lo holds nibbles 0..4 (bits 0..19), hi nibbles 5..7 (bits 0..11),
    both with bits 20..31 replaced by 0x4B0 (the exponent of 2^23), so that one AND per nibble
    (`_plane`) yields a float 2^23 + u * 16^s."""
    lo = (words & 0x000FFFFF) | 0x4B000000
    hi = ((words >> 20) & 0x00000FFF) | 0x4B000000  # arithmetic shift: the sign bits are masked off
    return lo, hi


@triton.jit
def _plane(lo, hi, J: tl.constexpr):
    """Nibble plane J of prepacked words (given as `_magic_words`) -> float32 q = u - 8, exact."""
    if J < 5:
        S: tl.constexpr = J
        w = lo
    else:
        S: tl.constexpr = J - 5
        w = hi
    # 0x4B000000 is 2^23; keeping it and nibble u at bits [4S, 4S + 4) reads as 2^23 + u * 16^S.
    v = (w & (-0x100000 | (0xF << (4 * S)))).to(tl.float32, bitcast=True)  # -0x100000 = 0xFFF00000
    return v * (1.0 / (1 << (4 * S))) - (8388608.0 / (1 << (4 * S)) + 8.0)


@triton.jit
def _dot(a, b, acc, EMULATE: tl.constexpr):
    """tl.dot(a, b, acc); EMULATE (interpreter only) feeds it float32 copies of a and b.

    Triton's interpreter runs `np.matmul` on bf16's uint16 storage, so bf16 dots come out as
    garbage there; the float32 copies hold the same values, and fp32 products of bf16 numbers are
    exact, so the emulated dot computes what the tensor cores compute.
    """
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _chunk_dots(a_ptrs, words, s_ptrs, acc, GPC: tl.constexpr, EMULATE: tl.constexpr):
    """acc += x[:, chunk] @ dequant(chunk).T for one 128-column chunk.

    a_ptrs: `[BM, 16]` pointers to plane 0's activations (plane j is 16 columns further per j);
    words: `[BN, 16]` prepacked int32; s_ptrs: `[BN]` pointers to the chunk's first group scale.
    GPC groups per chunk; each group's planes accumulate in a temporary scaled once.
    """
    PPG: tl.constexpr = 8 // GPC
    lo, hi = _magic_words(words)
    for gi in tl.static_range(GPC):
        a = tl.load(a_ptrs + gi * PPG * 16)
        tmp = _dot(a, tl.trans(_plane(lo, hi, gi * PPG).to(a.dtype)), tl.zeros_like(acc), EMULATE)
        for jj in tl.static_range(1, PPG):
            a = tl.load(a_ptrs + (gi * PPG + jj) * 16)
            tmp = _dot(a, tl.trans(_plane(lo, hi, gi * PPG + jj).to(a.dtype)), tmp, EMULATE)
        acc += tmp * tl.load(s_ptrs + gi).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dequant_chunk(words, dtype: tl.constexpr):
    """`[BN, 16]` prepacked words of one 128-column chunk -> `[BN, 128]` q in `dtype`, column c = 8 * w + j.

    Column c holds plane j = c % 8 of word w = c // 8, i.e. chunk element 16 * j + w (`chunk_perm`).
    Nested joins put their first operand at bit-reversed positions, hence the operand order.
    """
    lo, hi = _magic_words(words)
    q0 = _plane(lo, hi, 0).to(dtype)
    q1 = _plane(lo, hi, 1).to(dtype)
    q2 = _plane(lo, hi, 2).to(dtype)
    q3 = _plane(lo, hi, 3).to(dtype)
    q4 = _plane(lo, hi, 4).to(dtype)
    q5 = _plane(lo, hi, 5).to(dtype)
    q6 = _plane(lo, hi, 6).to(dtype)
    q7 = _plane(lo, hi, 7).to(dtype)
    q = tl.join(tl.join(tl.join(q0, q4), tl.join(q2, q6)), tl.join(tl.join(q1, q5), tl.join(q3, q7)))
    return tl.reshape(q, [words.shape[0], 128])


@triton.jit
def _chunk_dot(a, words, s, acc, EMULATE: tl.constexpr):
    """acc += (a @ dequant(chunk).T) * s: one K = 128 dot; a `[BM, 128]` in the `chunk_perm` column order."""
    q = _dequant_chunk(words, a.dtype)
    return acc + _dot(a, tl.trans(q), tl.zeros_like(acc), EMULATE) * s[None, :]


@triton.jit
def _cat(a, b):
    """`[R, C]`, `[R, C]` -> `[R, 2C]`: the columns of a, then those of b.

    join + permute + reshape only renumber registers under Triton's linear layouts (no data moves
    between threads: checked in the TTGIR of Triton 3.6 and 3.9 for sm_90), which is what lets
    `_dequant_nat` hand the tensor cores a natural-order tile straight from the prepacked planes.
    """
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [a.shape[0], 2 * a.shape[1]])


def _plane_asm(odd: bool, bf16: bool) -> str:
    """PTX for two elements of a nibble plane (`_plane_pair`): $1, $2 words, $3 two scales, $4 selector.

    prmt gathers the byte holding the nibble from each word into the two 16-bit halves; the nibble
    (shifted down for odd planes) ORed into the mantissa of 128.0 (bf16 0x4300; fp16: 1024.0, 0x6400)
    reads as 128 + u, exactly; one fma subtracts 136 (q = u - 8, exact) and one multiplies by the
    scale (rounded once), each on both halves: ~2.5 instructions per weight instead of ~3.5.
    """
    magic, one, nbias, t = ("0x43004300", "0x3F803F80", "0xC308C308", "bf16x2") if bf16 else \
        ("0x64006400", "0x3C003C00", "0xE408E408", "f16x2")  # fmt: skip
    shift = "shr.b32 t, t, 4; " if odd else ""
    return (
        "{ .reg .b32 t, c1, c2; prmt.b32 t, $1, $2, $4; " + shift +
        f"lop3.b32 t, t, 0x000F000F, {magic}, 0xEA; mov.b32 c1, {one}; mov.b32 c2, {nbias}; fma.rn.{t} t, t, c1, c2; "
        f"mov.b32 c2, 0x80008000; fma.rn.{t} $0, t, $3, c2; }}"
    )


_ASM_EVEN_BF16 = tl.constexpr(_plane_asm(False, True))
_ASM_ODD_BF16 = tl.constexpr(_plane_asm(True, True))
_ASM_EVEN_F16 = tl.constexpr(_plane_asm(False, False))
_ASM_ODD_F16 = tl.constexpr(_plane_asm(True, False))


@triton.jit
def _plane_pair(words, s, J: tl.constexpr, dtype: tl.constexpr):
    """`_plane(words, J) * s` rounded to `dtype` by `_plane_asm` (two weights per register); s: `[BN, 1]` in dtype."""
    sel = tl.full(words.shape, (J // 2) | ((4 + J // 2) << 8), tl.int32)  # byte J // 2 of each word
    if dtype == tl.bfloat16:
        if J % 2 == 0:
            asm: tl.constexpr = _ASM_EVEN_BF16
        else:
            asm: tl.constexpr = _ASM_ODD_BF16
    else:
        if J % 2 == 0:
            asm: tl.constexpr = _ASM_EVEN_F16
        else:
            asm: tl.constexpr = _ASM_ODD_F16
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r", [words, s, sel], dtype=s.dtype, is_pure=True, pack=2)


@triton.jit
def _scaled_plane(words, lo, hi, s0, s1, s2, s3, J: tl.constexpr, PPG: tl.constexpr, dtype: tl.constexpr,
                  ASM: tl.constexpr):  # fmt: skip
    """Plane J times the fp32 `[BN]` scale of its group (J // PPG: s0..s3), rounded once to `dtype`."""
    G: tl.constexpr = J // PPG
    if G == 0:
        s = s0
    elif G == 1:
        s = s1
    elif G == 2:
        s = s2
    else:
        s = s3
    if ASM:
        return _plane_pair(words, s.to(dtype)[:, None], J, dtype)
    else:  # fp32 product, rounded once (bf16 arithmetic is not emulated by the interpreter)
        return (_plane(lo, hi, J) * s[:, None]).to(dtype)


@triton.jit
def _dequant_nat(words, s0, s1, s2, s3, dtype: tl.constexpr, GPC: tl.constexpr, ASM: tl.constexpr):
    """`[BN, 16]` prepacked words of a 128-column chunk -> `[BN, 128]` q * scale in `dtype`, natural k order.

    Column 16 j + w is plane j of word w, i.e. chunk element 16 j + w: concatenating the eight planes
    undoes the prepack permutation. s0..s3: fp32 `[BN]` scales of the chunk's GPC groups (plane j is
    in group j // (8 // GPC); the ones past GPC are not read). ASM: dequantize with `_plane_asm`
    (CUDA only; the interpreter takes the plain Triton path, `_plane`).
    """
    PPG: tl.constexpr = 8 // GPC
    lo, hi = _magic_words(words)
    q0 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 0, PPG, dtype, ASM)
    q1 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 1, PPG, dtype, ASM)
    q2 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 2, PPG, dtype, ASM)
    q3 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 3, PPG, dtype, ASM)
    q4 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 4, PPG, dtype, ASM)
    q5 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 5, PPG, dtype, ASM)
    q6 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 6, PPG, dtype, ASM)
    q7 = _scaled_plane(words, lo, hi, s0, s1, s2, s3, 7, PPG, dtype, ASM)
    return _cat(_cat(_cat(q0, q1), _cat(q2, q3)), _cat(_cat(q4, q5), _cat(q6, q7)))


def _pairs_asm(bf16: bool, scaled: bool = False) -> str:
    """PTX for one PAIRS word ($8) -> its 8 elements q = u - 8 ($0..$7), exact, in bf16 or fp16.

    Nibbles i and i + 4 are the two halves of a 32-bit lane, so one lop3 per pair ORs them into the
    mantissa of 128.0 (bf16 0x4300; fp16 1024.0, 0x6400): each half reads as 128 + u, exactly; the
    words shifted by 4, 8 and 12 give the other three pairs (bf16's 7-bit mantissa cannot hold 16 u,
    so the odd nibbles are shifted down rather than masked in place). One fma per pair subtracts 136
    (fp16: 1032). Per 8 weights: 3 shifts + 4 lop3 + 4 fma, 1.4 instructions per weight, against ~2.5
    per weight for PLANES (`_plane_asm`: a prmt gathers each pair from two words, and the scale is
    multiplied in). scaled: a second operand ($9, 16 bits) is the row's scale, multiplied into each pair
    after the fma, so (u - 8) s is rounded once (`w4a16_decode.DecodeConfig.scaled_a`): 5 more instructions.
    """
    magic, one, nbias, t = ("0x43004300", "0x3F803F80", "0xC308C308", "bf16x2") if bf16 else \
        ("0x64006400", "0x3C003C00", "0xE408E408", "f16x2")  # fmt: skip
    s = "{ .reg .b32 s4, s8, s12, t0, t1, t2, t3, c1, c2; shr.u32 s4, $8, 4; shr.u32 s8, $8, 8; shr.u32 s12, $8, 12; "
    s += "".join(f"lop3.b32 t{j}, {src}, 0x000F000F, {magic}, 0xEA; " for j, src in enumerate(("$8", "s4", "s8", "s12")))
    s += f"mov.b32 c1, {one}; mov.b32 c2, {nbias}; " + "".join(f"fma.rn.{t} t{j}, t{j}, c1, c2; " for j in range(4))
    if scaled:  # c1 is free again: the scale in both halves
        s += "mov.b32 c1, {$9, $9}; " + "".join(f"mul.rn.{t} t{j}, t{j}, c1; " for j in range(4))
    return s + "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }"


def _raw_words_asm() -> str:
    """`_pairs_asm`'s data flow without its arithmetic: each word handed on as its own eight 'elements' (for the
    timing probes that leave the dequantization out: scripts/profile_kernels.py, `w4a16_decode`'s PROBE 3)."""
    s = "{ .reg .b32 t0, t1, t2, t3; mov.b32 t0, $8; mov.b32 t1, $8; mov.b32 t2, $8; mov.b32 t3, $8; "
    return s + "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }"


_PAIRS_BF16 = tl.constexpr(_pairs_asm(True))
_PAIRS_F16 = tl.constexpr(_pairs_asm(False))


@triton.jit
def _pair_nibble(words, I: tl.constexpr, dtype: tl.constexpr):
    """Plain-Triton element I (q = u - 8) of every PAIRS word, in dtype (the interpreter's path)."""
    return (((words >> (4 * I)) & 0xF).to(tl.float32) - 8.0).to(dtype)


@triton.jit
def _dequant_pairs(words, like, ASM: tl.constexpr):
    """`[BN, 16]` PAIRS words of a 128-column chunk -> `[BN, 128]` q = u - 8 (exact) in natural k order.

    In like's dtype. The eight elements of a word are joined and permuted into place (`chunk_perm`):
    register renaming only, since a thread holds all eight, and the result is the A-fragment layout
    the tensor cores read from registers (no convert_layout in the TTGIR of Triton 3.6 for sm_90).
    """
    BN: tl.constexpr = words.shape[0]
    if ASM:
        if like.dtype == tl.bfloat16:
            asm: tl.constexpr = _PAIRS_BF16
        else:
            asm: tl.constexpr = _PAIRS_F16
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            asm, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
            dtype=(like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype),
            is_pure=True, pack=1)  # fmt: skip
    else:
        e0 = _pair_nibble(words, 0, like.dtype)
        e1 = _pair_nibble(words, 1, like.dtype)
        e2 = _pair_nibble(words, 2, like.dtype)
        e3 = _pair_nibble(words, 3, like.dtype)
        e4 = _pair_nibble(words, 4, like.dtype)
        e5 = _pair_nibble(words, 5, like.dtype)
        e6 = _pair_nibble(words, 6, like.dtype)
        e7 = _pair_nibble(words, 7, like.dtype)
    # element of nibble i = 4 i2 + 2 i1 + i0 of word v = 4 c + a is k = 32 a + 16 i1 + 8 i0 + 2 c + i2
    w = tl.join(tl.join(tl.join(tl.reshape(e0, [BN, 4, 4]), tl.reshape(e4, [BN, 4, 4])),
                        tl.join(tl.reshape(e1, [BN, 4, 4]), tl.reshape(e5, [BN, 4, 4]))),
                tl.join(tl.join(tl.reshape(e2, [BN, 4, 4]), tl.reshape(e6, [BN, 4, 4])),
                        tl.join(tl.reshape(e3, [BN, 4, 4]), tl.reshape(e7, [BN, 4, 4]))))  # [BN, c, a, i2, i0, i1]
    return tl.reshape(tl.permute(w, (0, 2, 5, 4, 1, 3)), [BN, 128])  # [BN, a, i1, i0, c, i2] = [BN, k]


@triton.jit
def _spans_rows(xt):
    """`[128, BM]` x.T of a chunk in natural column order -> rows in SPANS position order (`spans_column`):
    row 16 s + 8 h + 2 c + e <- column 32 c + 4 s + 2 h + e."""
    BM: tl.constexpr = xt.shape[1]
    t = tl.reshape(xt, [4, 8, 2, 2, BM])  # [c, s, h, e, m]
    return tl.reshape(tl.permute(t, (1, 2, 0, 3, 4)), [128, BM])


@triton.jit
def _pairs_chunk_dot(words, s, xt, acc, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """acc + dequant(PAIRS chunk) @ xt for one 128-column chunk of a group-128 weight.

    acc `[BN, BM]` fp32, s fp32 `[BN]` the chunk's group scales. q stays exact in the dot, which gets
    a fresh accumulator, and the scale is applied once per output: no multiply per weight. (Folding
    the scale into the weights instead was slower on H200 for every tile that did not spill, and on
    Triton 3.6 gave wrong results in some pipelined configurations; see kernels/NOTES.md.)
    """
    tmp = _dot(_dequant_pairs(words, xt, ASM), xt, tl.zeros_like(acc), EMULATE)
    return acc + tmp * s[:, None]


@triton.jit
def _load_scales(s_ptrs, c, mask, GPC: tl.constexpr):
    """The fp32 `[BN]` scales of chunk c's GPC groups as a 4-tuple (entries past GPC repeat s0)."""
    s0 = tl.load(s_ptrs + c * GPC, mask=mask, other=0.0).to(tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    if GPC > 1:
        s1 = tl.load(s_ptrs + c * GPC + 1, mask=mask, other=0.0).to(tl.float32)
    if GPC > 2:
        s2 = tl.load(s_ptrs + c * GPC + 2, mask=mask, other=0.0).to(tl.float32)
        s3 = tl.load(s_ptrs + c * GPC + 3, mask=mask, other=0.0).to(tl.float32)
    return s0, s1, s2, s3


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
            part = ws  # split s's partial: stepped M x N at a time (64-bit pointers; s * M * N overflows int32)
            for s in range(1, split_k):
                part += mn
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile_id, 0)  # re-arm for the next launch


MAILBOX_EMPTY = -1  # int32 0xFFFFFFFF: a NaN that no arithmetic produces (NVIDIA's canonical NaN is 0x7FFFFFFF)
MAILBOX_GROUP = 8  # splits whose words one reducing program has in flight at once
# Heuristic: the mailbox at M = 1 only when each split runs at least this many chunks. On H200 (2026-12-01,
# same run) it won with 11-24 chunks per program (8192^2, 12288->6144, 6144->24576: 3.7-5.8 % faster) and lost
# with 3-8 (the expert shapes 2048->6144 and 6144->2x2048: 4-6 % slower), where the main loop is too short to
# hide the start ticket and the reducer more often waits on a late split.
MAILBOX_MIN_CHUNKS = 10


@triton.jit
def _start_ticket(cnt_ptr, tile_id, BLOCK_N: tl.constexpr):
    """This program's split-K ticket (0 .. split_k - 1, in start order), taken by one lane with a relaxed
    atomic; the result is only read at the end (`_ticket_value`), so its round trip overlaps the main loop."""
    rt = tl.arange(0, BLOCK_N)
    return tl.atomic_add(cnt_ptr + tile_id + rt * 0, tl.where(rt == 0, 1, 0), mask=rt == 0, sem="relaxed")


@triton.jit
def _ticket_value(tk):
    rt = tl.arange(0, tk.shape[0])
    return tl.max(tl.where(rt == 0, tk, -1), axis=0)


@triton.jit
def _pdl_wait(TRIGGER: tl.constexpr = True):
    """Programmatic dependent launch (PDL, Hopper+): wait until the kernel launched before this one has
    finished and its writes are visible; with TRIGGER, then let the next PDL launch start (its programs take
    the SM slots this grid frees and run their own prologue while this one works; else `_pdl_trigger` later).
    Triggering only after the wait keeps the chain transitive: when a program of the next launch starts,
    every kernel before this one is done. Both are no-ops for a launch without the PDL attribute."""
    tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_trigger():
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """`prefetch.global.L2` of each address (one 32-byte sector or more each): warms L2 with data this
    program will read after `_pdl_wait`, while the previous kernel is still running. No result."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def _spin_asm(g: int) -> str:
    """PTX for `_mailbox_group`: words $g..$2g-1 as loaded, their addresses $2g..$3g-1, live flags $3g..$4g-1 ->
    $0..$g-1. A live word that still holds MAILBOX_EMPTY is re-read (ld.relaxed.gpu, from L2) until its
    split has published it; every thread polls only its own elements, so no program-wide barrier is needed."""
    s = "{ .reg .pred p; .reg .b32 w; "
    for j in range(g):
        s += (f"mov.b32 w, ${g + j}; setp.eq.s32 p, ${3 * g + j}, 0; @p bra D{j}; "
              f"L{j}: setp.ne.s32 p, w, -1; @p bra D{j}; ld.relaxed.gpu.global.b32 w, [${2 * g + j}]; bra L{j}; "
              f"D{j}: mov.b32 ${j}, w; ")
    return s + "}"


_SPIN8 = tl.constexpr(_spin_asm(MAILBOX_GROUP))


@triton.jit
def _mailbox_live(mask, s, pid_k, split_k):
    sv = mask.to(tl.int32) * 0 + s  # tensor comparisons: the interpreter's mask must stay boolean
    return mask & (sv != pid_k) & (sv < split_k)


@triton.jit
def _mailbox_add(total, part, bits, s, pid_k, split_k):
    """total + partial of split s: this program's own (part) at s == pid_k, nothing past split_k."""
    return total + tl.where(s == pid_k, part, tl.where(s < split_k, bits.to(tl.float32, bitcast=True), 0.0))


@triton.jit
def _mailbox_group(total, part, mb_ptr, off, mask, n, s0, pid_k, split_k, ASM: tl.constexpr):
    """Add the partials of splits s0 .. s0 + 7 to total, in split order; all eight words are loaded before any
    is checked, so a group costs one round trip when its splits have published (the common case)."""
    p0 = mb_ptr + s0 * n + off
    p1 = p0 + n
    p2 = p1 + n
    p3 = p2 + n
    p4 = p3 + n
    p5 = p4 + n
    p6 = p5 + n
    p7 = p6 + n
    l0 = _mailbox_live(mask, s0, pid_k, split_k)
    l1 = _mailbox_live(mask, s0 + 1, pid_k, split_k)
    l2 = _mailbox_live(mask, s0 + 2, pid_k, split_k)
    l3 = _mailbox_live(mask, s0 + 3, pid_k, split_k)
    l4 = _mailbox_live(mask, s0 + 4, pid_k, split_k)
    l5 = _mailbox_live(mask, s0 + 5, pid_k, split_k)
    l6 = _mailbox_live(mask, s0 + 6, pid_k, split_k)
    l7 = _mailbox_live(mask, s0 + 7, pid_k, split_k)
    b0 = tl.load(p0, mask=l0, other=0, volatile=True)
    b1 = tl.load(p1, mask=l1, other=0, volatile=True)
    b2 = tl.load(p2, mask=l2, other=0, volatile=True)
    b3 = tl.load(p3, mask=l3, other=0, volatile=True)
    b4 = tl.load(p4, mask=l4, other=0, volatile=True)
    b5 = tl.load(p5, mask=l5, other=0, volatile=True)
    b6 = tl.load(p6, mask=l6, other=0, volatile=True)
    b7 = tl.load(p7, mask=l7, other=0, volatile=True)
    if ASM:  # poll the words still empty (the interpreter runs the programs in order: its peers are done)
        b0, b1, b2, b3, b4, b5, b6, b7 = tl.inline_asm_elementwise(
            _SPIN8, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r",
            [b0, b1, b2, b3, b4, b5, b6, b7, p0, p1, p2, p3, p4, p5, p6, p7, l0.to(tl.int32), l1.to(tl.int32),
             l2.to(tl.int32), l3.to(tl.int32), l4.to(tl.int32), l5.to(tl.int32), l6.to(tl.int32), l7.to(tl.int32)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
            pack=1)  # fmt: skip
    total = _mailbox_add(total, part, b0, s0, pid_k, split_k)
    total = _mailbox_add(total, part, b1, s0 + 1, pid_k, split_k)
    total = _mailbox_add(total, part, b2, s0 + 2, pid_k, split_k)
    total = _mailbox_add(total, part, b3, s0 + 3, pid_k, split_k)
    total = _mailbox_add(total, part, b4, s0 + 4, pid_k, split_k)
    total = _mailbox_add(total, part, b5, s0 + 5, pid_k, split_k)
    total = _mailbox_add(total, part, b6, s0 + 6, pid_k, split_k)
    total = _mailbox_add(total, part, b7, s0 + 7, pid_k, split_k)
    return total


@triton.jit
def _mailbox_tile(acc, out_ptr, mb_ptr, cnt_ptr, rn, N, stride_om, tile_id, pid_k, split_k, ticket, ASM: tl.constexpr):
    """Split-K reduction of a one-token tile (M = 1) through the mailbox, deterministic, no fence or atomic.

    acc `[BN, BM]` fp32, whose token columns past 0 are exact zeros (zero-filled x, X_MASK); mb_ptr int32
    `[split_k, N]` words, MAILBOX_EMPTY between launches; ticket from `_start_ticket`. The program that took
    the last ticket is the reducer: every other split of the tile started before it, so it only ever waits
    for programs that are running or done (no deadlock, whatever the residency). The others store their
    partial's fp32 bits (never MAILBOX_EMPTY) and exit; the reducer loads the words eight splits at a time,
    polls any still empty, sums all partials in split order (its own from registers: the bits do not depend
    on which program reduces), stores the output and empties the words and the ticket for the next launch.
    Like the tickets, not safe for two launches running concurrently on one device.
    """
    part = tl.sum(acc, axis=1)  # [BN]: token 0 (the other columns add exact zeros)
    mask = rn < N
    if ticket != split_k - 1:
        bits = part.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -1, 0x7FFFFFFF, bits)  # never the empty word (a NaN either way)
        tl.store(mb_ptr + pid_k.to(tl.int64) * N + rn, bits, mask=mask)
    else:
        total = tl.zeros_like(part)
        for s0 in range(0, split_k, 8):
            total = _mailbox_group(total, part, mb_ptr, rn, mask, N, s0, pid_k, split_k, ASM)
        tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=mask)
        for s in range(0, split_k):
            tl.store(mb_ptr + s * N + rn, tl.full(part.shape, -1, tl.int32), mask=_mailbox_live(mask, s, pid_k, split_k))
        tl.store(cnt_ptr + tile_id, 0)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, steps_per_split, num_chunks, split_k,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, GPC: tl.constexpr, CPI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k). CUDA-core y = x @ dequant(W).T.

    Each loop step covers CPI chunks of CHUNK columns; GPC = groups per chunk (CHUNK // GROUP, or 1
    when a group spans several chunks). EVEN: the chunk count is a multiple of CPI (no K mask).
    PDL: launched as a programmatic dependent (`_pdl_wait` before the first load).
    """
    if PDL:
        _pdl_wait()
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = tile // n_tiles
    pid_n = tile % n_tiles
    P: tl.constexpr = CHUNK // 8
    PPG: tl.constexpr = 8 // GPC
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # 4-D tiles [BLOCK_N, CPI, BLOCK_M, P] (rows of x in dim 2: Triton orders equally non-contiguous
    # dims by index, so this keeps the words, x and scale tiles in one register layout)
    rn4 = tl.minimum(rn, N - 1)[:, None, None, None]
    rc4 = tl.arange(0, CPI)[None, :, None, None]
    rm4 = tl.minimum(rm, M - 1)[None, None, :, None]  # rows past M compute junk, never stored
    rw4 = tl.arange(0, P)[None, None, None, :]
    w_ptrs = w_ptr + rn4 * stride_wn + rc4 * P + rw4  # [BN, CPI, 1, P]
    # x and the scales are loaded as full tiles (x replicated along N, scales along rows and P), so
    # that they share the words' register layout and need no shuffles.
    x_ptrs = x_ptr + rm4 * stride_xm + rn4 * 0 + rc4 * CHUNK + rw4  # [BN, CPI, BM, P], plane 0
    # 4 activations (8 bytes) per vector: the words' 16-byte vectors hold 4 int32, and equal
    # elements per thread let both tiles share one register layout.
    x_ptrs = tl.max_contiguous(x_ptrs, [1, 1, 1, 4])
    s_ptrs = s_ptr + rn4 * stride_sn + ((rc4 * CHUNK) // GROUP) + rw4 * 0  # [BN, CPI, 1, P], first group
    # chunk index of every element of the word and x tiles (masks must have the pointers' shape)
    kc_w = rc4 + rn4 * 0 + rw4 * 0  # [BN, CPI, 1, P]
    kc_x = rc4 + rm4 * 0 + rn4 * 0 + rw4 * 0  # [BN, CPI, BM, P]
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, tl.cdiv(num_chunks, CPI))
    acc = tl.zeros([BLOCK_N, CPI, BLOCK_M, P], dtype=tl.float32)
    if EVEN:
        words = tl.load(w_ptrs + step_lo * (CPI * P))
    else:
        words = tl.load(w_ptrs + step_lo * (CPI * P), mask=step_lo * CPI + kc_w < num_chunks, other=0)
    for step in range(step_lo, step_hi):
        c0 = step * CPI
        # the next step's words first: two word tiles in flight per program
        if EVEN:
            nxt = tl.load(w_ptrs + (c0 + CPI) * P, mask=kc_w * 0 + step + 1 < step_hi, other=0)
        else:
            nxt = tl.load(w_ptrs + (c0 + CPI) * P, mask=(c0 + CPI + kc_w < num_chunks) & (kc_w * 0 + step + 1 < step_hi),
                          other=0)  # fmt: skip
        lo, hi = _magic_words(words)
        for gi in tl.static_range(GPC):
            if EVEN:
                s = tl.load(s_ptrs + (c0 * CHUNK) // GROUP + gi).to(tl.float32)
                xv = tl.load(x_ptrs + c0 * CHUNK + gi * PPG * P).to(tl.float32)
            else:
                s = tl.load(s_ptrs + (c0 * CHUNK) // GROUP + gi, mask=c0 + kc_w < num_chunks, other=0.0).to(tl.float32)
                xv = tl.load(x_ptrs + c0 * CHUNK + gi * PPG * P, mask=c0 + kc_x < num_chunks, other=0.0).to(tl.float32)
            part = _plane(lo, hi, gi * PPG) * xv
            for jj in tl.static_range(1, PPG):
                if EVEN:
                    xv = tl.load(x_ptrs + c0 * CHUNK + (gi * PPG + jj) * P).to(tl.float32)
                else:
                    xv = tl.load(x_ptrs + c0 * CHUNK + (gi * PPG + jj) * P, mask=c0 + kc_x < num_chunks,
                                 other=0.0).to(tl.float32)  # fmt: skip
                part += _plane(lo, hi, gi * PPG + jj) * xv
            acc += part * s
        words = nxt
    y = tl.trans(tl.sum(tl.sum(acc, axis=3), axis=1))  # [BN, BM] -> [BM, BN]
    _write_tile(y, out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)


@triton.jit
def _mma_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, chunks_per_split, num_chunks, split_k,
    GPC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, PREFETCH: tl.constexpr, BIG_DOT: tl.constexpr, EMULATE_DOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k). Tensor-core y = x @ dequant(W).T, chunk 128.

    BIG_DOT (GPC == 1 only): one K = 128 dot per chunk instead of one K = 16 dot per plane.
    PDL: launched as a programmatic dependent (`_pdl_wait` before the first load).
    """
    if PDL:
        _pdl_wait()
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
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    a_ptrs = x_ptr + (rm % M)[:, None] * stride_xm + r16[None, :]  # [BM, 16]: plane 0 of chunk 0
    w_ptrs = w_ptr + (rn % N)[:, None] * stride_wn + r16[None, :]  # [BN, 16]: words of chunk 0
    s_ptrs = s_ptr + (rn % N) * stride_sn
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    if BIG_DOT:  # one K = 128 dot per chunk: activations in the chunk_perm order
        r128 = tl.arange(0, 128)
        a_ptrs = x_ptr + (rm % M)[:, None] * stride_xm + ((r128 % 8) * 16 + r128 // 8)[None, :]  # [BM, 128]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        words = tl.load(w_ptrs + c_lo * 16)
    for c in range(c_lo, c_hi):
        if PREFETCH:
            nxt = tl.load(w_ptrs + (c + 1) * 16, mask=r16[None, :] * 0 + (rn[:, None] * 0 + c + 1) < c_hi, other=0)
        else:
            words = tl.load(w_ptrs + c * 16)
        if BIG_DOT:
            acc = _chunk_dot(tl.load(a_ptrs + c * 128), words, tl.load(s_ptrs + c).to(tl.float32), acc, EMULATE_DOT)
        else:
            acc = _chunk_dots(a_ptrs + c * 128, words, s_ptrs + c * GPC, acc, GPC, EMULATE_DOT)
        if PREFETCH:
            words = nxt
    _write_tile(acc, out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)


@triton.jit
def _mma_swap_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, chunks_per_split, num_chunks, split_k, stride_wc,
    GPC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, EMULATE_DOT: tl.constexpr, PAIRS: tl.constexpr, X_MASK: tl.constexpr,
    SINGLE_M: tl.constexpr, MAILBOX: tl.constexpr, PDL: tl.constexpr, PDL_PREFETCH: tl.constexpr,
    PDL_EARLY: tl.constexpr, XPERM: tl.constexpr = False,
):  # fmt: skip
    """grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k). Tensor-core y.T = dequant(W) @ x.T, chunk 128.

    PAIRS: the weights are in the PAIRS or SPANS layout (`_pairs_chunk_dot`, group 128; XPERM: SPANS, the
    rows of each chunk's x tile permuted to its column order, `_spans_rows`); else PLANES (`_dequant_nat`,
    scales folded into the weights). X_MASK (M < BLOCK_M, decode): token columns past M are not loaded
    but zero-filled; at M = 1 a 16-token tile would otherwise copy row 0 sixteen times per chunk.
    Otherwise rows past M wrap (rm % M), which costs no predicate per load.

    The transposed product: the accumulator is `[BLOCK_N, BLOCK_M]`, the dequantized weight tile is
    the dot's first operand, which Hopper's wgmma (and mma.sync) reads from registers, and x.T the
    second, read from shared memory. Triton hoists the operand layout up to the words' shared-memory
    load (the dequantization is elementwise plus `_cat`), so each thread unpacks exactly the words its
    MMA fragment needs and no dequantized value goes through shared memory. Per 128-column chunk:
    one `[BN, 128] x [128, BM]` dot (eight k16 wgmma issued back to back), the group scales folded
    into the dequantized weights so the accumulator chains across chunks; words and x tiles are
    pipelined by Triton (cp.async, num_stages), the next chunk's scales prefetched into registers.
    Tokens are the MMA's N dimension, so small BLOCK_M (16..64) wastes no tensor-core rows.

    SINGLE_M (M <= BLOCK_M: one token tile, every decode call): program `tile` is column tile `tile`,
    without the grouped order's run-time divisions, and rows are clamped (min) rather than wrapped
    (%): ~100 fewer instructions before the first load is issued, which decode latency pays in full.
    PAIRS only: on PLANES weights (whose chunks chain one accumulator) ptxas then serialised the wgmma
    (twice the warpgroup syncs, 425 instead of 409 instructions per chunk; 10-30 % slower on H200).

    MAILBOX (SPLIT, SINGLE_M, X_MASK and M == 1; ws_ptr is then the int32 mailbox): each program takes
    its split-K ticket when it starts (the atomic's round trip hides behind the main loop) and the
    reduction goes through `_mailbox_tile` instead of `_write_tile`.

    PDL (a programmatic dependent launch, `pdl=True`): the weights and scales do not come from the kernel
    launched before (they are loaded once, at load time), so a program reads its first scales and
    prefetches its first PDL_PREFETCH chunks of words into L2 before `_pdl_wait`; x, the split-K tickets,
    the mailbox and every store come after it. The next launch is let in right after the wait (PDL_EARLY)
    or after the main loop, during the split-K fix-up and the stores.
    """
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    if SINGLE_M:
        pid_m = 0
        pid_n = tile
    else:
        n_m = tl.cdiv(M, BLOCK_M)
        n_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * n_n
        first_m = (tile // width) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    r128 = tl.arange(0, 128)
    if X_MASK or SINGLE_M:  # rm < BLOCK_M: the rows past M are masked (X_MASK) or there are none
        xt_ptrs = x_ptr + rm[None, :] * stride_xm + r128[:, None]  # [128, BM]: x.T of chunk 0
    else:
        xt_ptrs = x_ptr + (rm % M)[None, :] * stride_xm + r128[:, None]
    if SINGLE_M:
        rn_in = tl.minimum(rn, N - 1)  # columns past N read row N - 1; their outputs are not stored
    else:
        rn_in = rn % N
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + r16[None, :]  # [BN, 16]: words of chunk 0
    s_ptrs = s_ptr + rn_in * stride_sn
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    if PDL and PDL_PREFETCH > 0:  # the words of this program's first chunks into L2, two sectors per row
        pf_ptrs = w_ptr + rn_in[:, None] * stride_wn + (tl.arange(0, 2) * 8)[None, :]
        for c in range(c_lo, tl.minimum(c_hi, c_lo + PDL_PREFETCH)):
            _prefetch_l2(pf_ptrs + c * stride_wc)
    s0, s1, s2, s3 = _load_scales(s_ptrs, c_lo, rn * 0 + c_lo < c_hi, GPC)
    if PDL:
        _pdl_wait(PDL_EARLY)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if MAILBOX:
        tk = _start_ticket(cnt_ptr, tile, BLOCK_N)
    for c in range(c_lo, c_hi):
        words = tl.load(w_ptrs + c * stride_wc)
        if X_MASK:
            xt = tl.load(xt_ptrs + c * 128, mask=(rm < M)[None, :], other=0.0)
        else:
            xt = tl.load(xt_ptrs + c * 128)
        n0, n1, n2, n3 = _load_scales(s_ptrs, c + 1, rn * 0 + c + 1 < c_hi, GPC)  # in flight during this chunk
        if XPERM:
            xt = _spans_rows(xt)
        if PAIRS:
            acc = _pairs_chunk_dot(words, s0, xt, acc, ASM, EMULATE_DOT)
        else:
            acc = _dot(_dequant_nat(words, s0, s1, s2, s3, xt.dtype, GPC, ASM), xt, acc, EMULATE_DOT)
        s0, s1, s2, s3 = n0, n1, n2, n3
    if PDL and not PDL_EARLY:
        _pdl_trigger()
    if MAILBOX:
        _mailbox_tile(acc, out_ptr, ws_ptr, cnt_ptr, rn, N, stride_om, tile, pid_k, split_k, _ticket_value(tk), ASM)
    else:
        _write_tile(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)


_INTERPRETED = type(_mma_kernel).__name__ == "InterpretedFunction"

# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def _next_pow2(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


def split_for(tiles: int, steps: int, target_ctas: int, min_steps: int = 2, max_split: int = 32) -> int:
    """split_k that brings `tiles * split_k` up to about `target_ctas`, each split keeping >= `min_steps` steps."""
    if tiles >= target_ctas or steps < 2 * min_steps:
        return 1
    return max(1, min(-(-target_ctas // tiles), steps // min_steps, max_split))


def split_groups(tiles: int, num_groups: int, target_ctas: int, min_groups: int = 4) -> tuple[int, int]:
    """(split_k, groups_per_split) with no empty split (kept for callers of the old API)."""
    split = split_for(tiles, num_groups, target_ctas, min_groups)
    per = -(-num_groups // split)
    return -(-num_groups // per), per


@functools.lru_cache(maxsize=16)
def _device_info(index: int) -> tuple[int, str, tuple[int, int]]:
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.name, (p.major, p.minor)


def _cuda_info(device: torch.device) -> tuple[int, str, tuple[int, int]]:
    return _device_info(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`, or DEFAULT_SM_COUNT (H200) off-GPU."""
    return _cuda_info(device)[0] if device.type == "cuda" else DEFAULT_SM_COUNT


def device_name(device: torch.device) -> str:
    return _cuda_info(device)[1] if device.type == "cuda" else "cpu"


def table_serves(table: dict, device: str) -> bool:
    """Whether a launch table applies on the GPU named `device`: the one it was tuned on (its "device"), or one named
    in its "also_for", GPUs on which its picks were measured to run at least as fast as their untuned rules
    (kernels/NOTES.md, session 36). Any other GPU, and CPU or interpreter runs, take the heuristics."""
    return bool(table) and (table.get("device") == device or device in table.get("also_for", ()))


def table_owner(path: Path | str) -> str | None:
    """The GPU the launch table at `path` was tuned on, or None where there is no readable table. The tuners refuse to
    write one GPU's table over another's (a file holds one GPU's table; the other's tuning would be lost)."""
    try:
        return json.loads(Path(path).read_text()).get("device")
    except (OSError, ValueError, AttributeError):
        return None


def replace_refusal(path: Path | str, device: str) -> str | None:
    """The tuners' error when writing `device`'s launch table to `path` would replace another GPU's (`table_owner`),
    else None."""
    owner = table_owner(path)
    if owner in (None, device):
        return None
    return (f"{path} holds the launch table tuned on {owner}; writing {device}'s would replace it. Write elsewhere "
            f"(--write OUT/{Path(path).name}) or pass --replace")


@functools.lru_cache(maxsize=4)
def _tuned_table(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def tuned_entry(section: str, key: str, m: int, device: str, layout: Layout = Layout.PLANES) -> dict | None:
    """The tuned config for `key` (e.g. "N,K,g") at the smallest tuned M >= m (else the largest), if any.

    Only used when the table serves `device` (the GPU's name, `table_serves`), so CPU/interpreter runs and other
    GPUs always take the heuristics. PLANES entries are the table's top-level sections, PAIRS entries
    its "pairs" sub-table (each tuned on weights of that layout); SPANS weights run the same kernel as
    PAIRS (x permuted to their column order, `_spans_rows` / `spans_x`) and take the "pairs" entries.
    """
    table = _tuned_table(str(TUNED_PATH))
    if not table_serves(table, device):
        return None
    if layout.mma:
        table = table.get(Layout.PAIRS.value, {})
    rows = table.get(section, {}).get(key)
    if not rows:
        return None
    ms = sorted(int(v) for v in rows)
    pick = next((v for v in ms if v >= m), ms[-1])
    return rows[str(pick)]


def heuristic_config(m: int, n: int, k: int, group_size: int, sms: int = DEFAULT_SM_COUNT,
                     layout: Layout = Layout.PLANES, chunk_major: bool = False) -> DenseConfig:
    """Deterministic launch configuration by M bucket (no tuning table).

    M <= GEMV_MAX_M (or K not a multiple of 128): GEMV, 8 KB of words per step, split-K up to ~4
        programs per SM: decode is bandwidth-bound and needs loads in flight. Not for weights the GEMV cannot
        read (PAIRS/SPANS, or chunk-major `chunk_major`): those take the transposed tiles below at every M.
    M <= 64: transposed tensor-core tiles (`swap`) of 16..64 tokens x 128 weight rows, split-K up to
        ~2 programs per SM (still bandwidth-bound, few tiles); at M = 1 the mailbox reduction when each
        split runs >= MAILBOX_MIN_CHUNKS chunks.
    M > 64: transposed tiles, PLANES: two warpgroups, 64/128 tokens x 128 weight rows (M >= 1024:
        128 x 256, which won every GLM-5 shape at M = 2048 on H200 by 1.3-1.7x); PAIRS: 64 x 128 on one
        warpgroup below M = 1024, else 128 x 128 on two; split-K only when there are fewer tiles than SMs.
    """
    chunk = chunk_for(k)
    if (m <= GEMV_MAX_M and not (layout.mma or chunk_major)) or chunk != MMA_CHUNK:
        block_m = min(8, _next_pow2(m))
        p = chunk // 8
        block_n = 32 if block_m <= 2 else 16
        cpi = max(1, min(_next_pow2(2048 // (block_n * p)), _next_pow2(k // chunk)))  # ~8 KB of words per step
        tiles = -(-m // block_m) * -(-n // block_n)
        steps = -(-(k // chunk) // cpi)
        split = split_for(tiles, steps, 4 * sms)
        return DenseConfig(KernelKind.GEMV, block_m, block_n, split, cpi=cpi, num_warps=4)
    chunks = k // MMA_CHUNK
    if m <= 64:
        block_m = max(16, _next_pow2(m))
        tiles = -(-m // block_m) * -(-n // 128)
        split = split_for(tiles, chunks, 2 * sms)
        per = -(-chunks // split)
        return DenseConfig(KernelKind.MMA, block_m, 128, split, swap=True, num_warps=4, num_stages=4 if block_m <= 32 else 3,
                           mailbox=per >= MAILBOX_MIN_CHUNKS)  # fmt: skip
    if layout.mma:  # the tuned H200 winners at M = 256 / 2048; 128 x 256 spills (second accumulator)
        block_m, block_n, warps = (64, 128, 4) if m < 1024 else (128, 128, 8)
    else:
        block_m, block_n, warps = 128 if m >= 256 else 64, 256 if m >= 1024 else 128, 8
    tiles = -(-m // block_m) * -(-n // block_n)
    split = split_for(tiles, chunks, sms)
    return DenseConfig(KernelKind.MMA, block_m, block_n, split, swap=True, num_warps=warps, num_stages=3)


def choose_config(m: int, n: int, k: int, group_size: int, sms: int = DEFAULT_SM_COUNT, device: str = "cpu",
                  layout: Layout = Layout.PLANES, chunk_major: bool = False) -> DenseConfig:
    """The tuned configuration for this GPU, shape and weight layout if there is one, else `heuristic_config`.
    chunk_major: the weights' words are chunk-major (`PackedW4.chunk_major`), which only the transposed kernel reads."""
    ent = tuned_entry("dense", f"{n},{k},{group_size}", m, device, layout)
    if ent is not None and chunk_major and not DenseConfig(**ent).swap:
        ent = None  # a GEMV or per-plane entry: those kernels read row-major words only
    if ent is not None:
        cfg = DenseConfig(**ent)
        if cfg.kind is KernelKind.GEMV:
            if m <= 8:  # a GEMV entry tuned at a larger M than this call: fewer rows per program
                return DenseConfig(**{**ent, "block_m": min(cfg.block_m, _next_pow2(m))})
        elif chunk_for(k) == MMA_CHUNK:
            return cfg
    return heuristic_config(m, n, k, group_size, sms, layout, chunk_major)


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


_MAILBOXES: dict[torch.device, torch.Tensor] = {}


def _mailbox_words(device: torch.device, count: int) -> torch.Tensor:
    """An int32 buffer of >= `count` split-K mailbox words for `device`, all MAILBOX_EMPTY, reused across launches
    (`_mailbox_tile` leaves every word it uses empty again). Same caveat as `_tickets`."""
    buf = _MAILBOXES.get(device)
    if buf is None or buf.numel() < count:
        buf = torch.full((max(count, 1 << 16),), MAILBOX_EMPTY, dtype=torch.int32, device=device)
        _MAILBOXES[device] = buf
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
    if tuple(packed.shape) != (*lead, n, k // 8):
        raise ValueError(f"{name}_packed has shape {list(packed.shape)}, expected {[*lead, n, k // 8]}")
    _check_tensor(name, "packed", packed, device)
    check_scale(name, scale, shape, group_size, device)


def check_scale(name: str, scale: torch.Tensor, shape: tuple, group_size: int, device) -> None:
    """`scale` fp16/bf16/fp32 `[..., N, K/g]` for a `(..., N, K)` weight, contiguous, on `device`."""
    *lead, n, k = shape
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}_scale must be float16, bfloat16 or float32, got {scale.dtype}")
    if tuple(scale.shape) != (*lead, n, k // group_size):
        raise ValueError(
            f"{name}_scale has shape {list(scale.shape)}, expected {[*lead, n, k // group_size]} "
            f"for group_size {group_size}"
        )
    _check_tensor(name, "scale", scale, device)


def _check_tensor(name: str, what: str, t: torch.Tensor, device) -> None:
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
    if _overlap(out, x):  # programs write their tiles while others still read x: the result would be wrong
        raise ValueError("out must not share memory with x; pass a separate buffer")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' byte ranges intersect (within one storage)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_config(cfg: DenseConfig, w: PackedW4) -> None:
    if cfg.kind is KernelKind.MMA and w.chunk != MMA_CHUNK:
        raise ValueError(f"the MMA kernel needs K to be a multiple of {MMA_CHUNK} (prepack chunk {w.chunk}); use a GEMV config")
    if (w.layout.mma or w.chunk_major) and not cfg.swap:
        raise ValueError(f"weights prepacked in the {w.layout.value} layout or chunk-major run on the transposed MMA "
                         "kernel only (swap=True); prepack with layout='planes', chunk_major=False for the GEMV and "
                         "per-plane kernels")


def w4a16_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    config=None,
    pdl: bool = False,
) -> torch.Tensor:
    """y = x @ dequant(W).T for a symmetric compressed-tensors int4 weight, fp32 accumulation.

    The weight is prepacked on first use and the result cached per `weight_packed` tensor
    (`cached_prepack`); call `prepack` once and `w4a16_matmul_packed` to manage that copy yourself. After
    writing new weights in place through `.data` or into inference tensors, call `clear_prepack_cache()`.

    Args:
        x: float16/bfloat16 `[M, K]`, contiguous; any M (from M x max(N, K) = 2^31 on, in several launches of
            whole row slices: `INDEX_LIMIT`).
        weight_packed: int32 `[N, K/8]`, contiguous, LSB-first nibbles q + 8 (formats.md §2c).
        weight_scale: float16/bfloat16/float32 `[N, K/group_size]`, contiguous.
        group_size: 32, 64 or 128; K must be a multiple of it (and of 8).
        out: optional `[M, N]` buffer of x's dtype; every element is written.
        config: optional launch override (tests, tuning): a `DenseConfig` or a `w4a16_decode.DecodeConfig`;
            default: the Gluon decode kernel where `w4a16_decode.choose` picks it, else `choose_config`.
        pdl: launch as a programmatic dependent of the kernel before it in the stream (Hopper and later;
            ignored elsewhere and by the interpreter): its programs start while that kernel finishes,
            read the weights' scales (and may prefetch words into L2), and wait for it before reading x or
            writing anything. Needs only that the kernel before does not write this weight; a chain of
            `pdl=True` GEMMs (a decode step's layers) overlaps each launch with the previous one's tail.
            `DenseConfig.pdl_mode` (`pdl_plan`) says when the next launch is let in, or that this shape
            launches without PDL where that measured faster.
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
    packed = cached_prepack(weight_packed, weight_scale, group_size, *layout_for(config, chunk_for(k), group_size))
    return w4a16_matmul_packed(x, packed, out=out, config=config, pdl=pdl)


def w4a16_matmul_packed(
    x: torch.Tensor, w: PackedW4, *, out: torch.Tensor | None = None, config=None, pdl: bool = False,
) -> torch.Tensor:
    """`w4a16_matmul` on a `prepack`ed weight (same arguments and errors).

    config: a `DenseConfig` (the Triton kernels), a `w4a16_decode.DecodeConfig` (the Gluon decode kernel), or
    None: the Gluon decode kernel where `w4a16_decode.choose` picks it (M <= 64 where a table serving this GPU
    names it, `table_serves`; M <= 16 by the sm_90 heuristic), else `choose_config`.
    """
    check_common(x, w.group_size)
    m, k = x.shape
    if w.lead or w.k != k:
        raise ValueError(f"prepacked weight {[*w.lead, w.n, w.k]} does not take x of shape {list(x.shape)}")
    n = w.n
    w.check((), n, k, x.device)
    check_out(out, (m, n), x)
    from glmq.kernels import w4a16_decode as DK  # imports this module

    if isinstance(config, DK.DecodeConfig):  # explicit: decode_matmul refuses what the kernel does not take
        if not DK.available(x.device):
            raise ValueError(f"a DecodeConfig needs the Gluon decode kernel, which cannot run on {x.device} here "
                             "(a CUDA GPU of sm_80 or later with Triton's Gluon, not the interpreter)")
        decode = config
    else:
        decode = None if config is not None else DK.choose(m, w, x.device, device_name(x.device), pdl, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if decode is not None:
        return DK.decode_matmul(x, w, out, decode, pdl=pdl and pdl_supported(x.device))
    if m == 0 or n == 0:
        return out
    cfg = config or choose_config(m, n, k, w.group_size, sm_count(x.device), device_name(x.device), w.layout,
                                  w.chunk_major)
    check_config(cfg, w)
    rows = max_rows(n, k)
    for i in range(0, m, rows):  # one launch unless M x max(N, K) reaches int32 (M ~ 87K at 6144->24576)
        _launch(x[i:i + rows], w, out[i:i + rows], cfg, pdl)
    return out


# The kernels index rows of x, out and the split-K partials as int32 row * row-stride (program ids and aranges are
# int32, and the offsets are added to the 64-bit base pointer only after the product), so a launch must keep
# M x max(N, K) below 2^31; larger M is split into row slices of whole launches in the wrappers (as vLLM chunks its
# fused MoE), which costs nothing below the limit, where the kernels' address arithmetic stays 32-bit.
INDEX_LIMIT = 2**31


def max_rows(*widths: int) -> int:
    """Rows of one launch whose row offsets (row x width, for each width) stay below INDEX_LIMIT."""
    return max(1, (INDEX_LIMIT - 1) // max(1, *widths))


def pdl_supported(device: torch.device) -> bool:
    """Whether a launch on `device` can be a programmatic dependent (griddepcontrol: sm_90 and later)."""
    return not _INTERPRETED and device.type == "cuda" and _cuda_info(device)[2] >= (9, 0)


# `pdl_plan`'s "auto" rule, from three H200 runs of 2026-12-02 (chains of one GEMM config: bench_kernels.py's
# glmq-pdl-* columns and profile_kernels.py --pdl; kernels/NOTES.md, session 10). Short loops (<= 8 chunks per
# split: the expert shapes) gained most with the early trigger and a 2-chunk L2 prefetch (2048->6144 M = 1:
# 6.2 -> 5.1 us); long loops gained ~1 us with the late trigger and lost with prefetching (it competes with
# the running kernel's reads), except where the split-K partials go through the ticket fix-up at M <= 16:
# slower with PDL in every such case (6144->24576 M = 4: 26.5 -> 29.2 us late, 31.2 early; M = 1 with the
# ticket instead of the mailbox: 26.2 -> 28.7), while the same shapes without split-K or with the mailbox
# gained (the mechanism was not identified). Above M = 64 the difference was within +-2 %.
PDL_SHORT_LOOP = 8


def pdl_plan(cfg: DenseConfig, m: int, chunks_per_split: int, ticket: bool = False) -> tuple[str, int]:
    """(mode, L2-prefetch chunks) of a `pdl=True` launch of `cfg`: mode "early", "late" or "off".
    ticket: the launch reduces split-K partials through the last-arriver ticket (`_write_tile`)."""
    mode = cfg.pdl_mode
    if mode == "auto":
        if m > 64:
            mode = "off"
        elif chunks_per_split <= PDL_SHORT_LOOP:
            mode = "early"
        elif ticket and m <= 16:
            mode = "off"
        else:
            mode = "late"
    if mode == "late" and not cfg.swap:
        mode = "early"  # the GEMV and per-plane kernels trigger right after their wait
    prefetch = cfg.pdl_prefetch if cfg.pdl_prefetch is not None else (2 if mode == "early" else 0)
    return mode, prefetch if cfg.swap and mode != "off" else 0


def _launch(x: torch.Tensor, w: PackedW4, out: torch.Tensor, cfg: DenseConfig, pdl: bool = False) -> None:
    """Allocate the split-K scratch (if any) and launch the kernel `cfg` names; writes `out`."""
    m, k = x.shape
    n, g, chunk = w.n, w.group_size, w.chunk
    chunks = k // chunk
    gpc = max(1, chunk // g)
    if cfg.kind is KernelKind.GEMV:
        cpi = min(cfg.cpi, _next_pow2(chunks))
        steps = -(-chunks // cpi)
    else:
        cpi, steps = 1, chunks
    per = -(-steps // cfg.split_k)
    split = -(-steps // per)  # no empty splits
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    single_m = m <= cfg.block_m and w.layout.mma
    mailbox = cfg.swap and cfg.mailbox and split > 1 and m == 1 and single_m
    if pdl and pdl_supported(x.device):
        pdl_mode, pdl_prefetch = pdl_plan(cfg, m, per, ticket=split > 1 and not mailbox)
    else:
        pdl_mode, pdl_prefetch = "off", 0
    pdl = pdl_mode != "off"
    launch = {"launch_pdl": True} if pdl else {}
    if mailbox:
        scratch = _mailbox_words(x.device, split * n)
        tickets = _tickets(x.device, tiles)
    elif split > 1:
        scratch = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # fp32 partials
        tickets = _tickets(x.device, tiles)
    else:
        scratch = tickets = out  # not dereferenced without SPLIT
    stride_wn, stride_wc = w.word_strides()
    xperm = w.layout is Layout.SPANS and m <= SPANS_PERMUTE_IN_KERNEL_MAX_M
    if w.layout is Layout.SPANS and not xperm:
        x = spans_x(x)
    args = (x, w.qweight, w.scale, out, scratch, tickets, m, n, x.stride(0), stride_wn, w.scale.stride(0),
            out.stride(0), per, chunks, split)  # fmt: skip
    grid = (tiles, split)
    if cfg.kind is KernelKind.GEMV:
        _gemv_kernel[grid](
            *args, GROUP=g, CHUNK=chunk, GPC=gpc, CPI=cpi, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            SPLIT=split > 1, EVEN=chunks % cpi == 0, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch,
        )  # fmt: skip
    elif cfg.swap:
        _mma_swap_kernel[grid](
            *args, stride_wc, GPC=gpc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
            SPLIT=split > 1, ASM=cfg.asm and not _INTERPRETED, EMULATE_DOT=_INTERPRETED and x.dtype == torch.bfloat16,
            PAIRS=w.layout.mma, XPERM=xperm, X_MASK=m < cfg.block_m, SINGLE_M=single_m, MAILBOX=mailbox,
            PDL=pdl, PDL_PREFETCH=pdl_prefetch, PDL_EARLY=pdl_mode == "early", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch,
        )  # fmt: skip
    else:
        _mma_kernel[grid](
            *args, GPC=gpc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, SPLIT=split > 1,
            PREFETCH=cfg.prefetch, BIG_DOT=cfg.big_dot and gpc == 1, EMULATE_DOT=_INTERPRETED and x.dtype == torch.bfloat16,
            PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
        )  # fmt: skip
