"""Triton W4A16 kernels (dense GEMM, fused MoE) against the float32 references in kernels/reference.py.

Without a GPU the kernels run in Triton's interpreter on CPU. Triton reads TRITON_INTERPRET when a
`@triton.jit` decorator runs, and triton.language's own helpers (tl.zeros, ...) are decorated when
triton is first imported, so the flag must be set before anything imports triton: this module sets
it at collection. If triton was already imported without it (compressed_tensors imports triton, so a
test module collected earlier could do that), the in-process tests skip and
`test_kernel_suite_in_fresh_interpreter` runs this file again in a subprocess with the flag set, so
failures still fail. With a GPU the same tests run compiled on cuda, plus the `gpu`-marked tests at
GLM-5 shapes.

Error bounds. The kernels accumulate in fp32 (K-dependent error ~1e-6, negligible) and round their
output, and for the MoE also the gated activation h and each expert's weighted output, to the
activation dtype. The error is therefore a few ulps of that dtype: fp16 has an ulp of 2^-10
relative; bf16 2^-7 (the interpreter truncates fp32 -> bf16, where GPUs round to nearest, which
halves it). We assert max|y - ref| / max|ref| below 4 ulps (fp16 4e-3, bf16 3e-2) and an SQNR floor
(fp16 55 dB, bf16 35 dB; measured ~68 and ~39-45 dB). A bit-order, group or scale bug produces
errors of order 1 (SQNR < 20 dB) and fails both. Outputs are pre-filled with NaN, so a tile the
kernel forgets to write fails the NaN check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from conftest import run_in_fresh_interpreter, skip_if_triton_too_early, triton_interpreter_guard  # tests/ is on sys.path

TRITON_TOO_EARLY = triton_interpreter_guard()  # before anything here imports triton
pytest.importorskip("triton")

from glmq.kernels import reference as R  # noqa: E402
from glmq.kernels import w4a16_decode as DK  # noqa: E402
from glmq.kernels import w4a16_dense as D  # noqa: E402
from glmq.kernels import w4a16_moe as MO  # noqa: E402
from glmq.quantize.pack import pack_int32, pack_zero_point, unpack_int32  # noqa: E402
from glmq.quantize.rtn import QWeight, dequantize, quantize_rtn  # noqa: E402
from glmq.quantize.spec import QuantSpec  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float16, torch.bfloat16)
GROUPS = (32, 64, 128)
REL_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
SQNR_DB = {torch.float16: 55.0, torch.bfloat16: 35.0}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
both_mma_layouts = pytest.mark.parametrize("layout", [D.Layout.PAIRS, D.Layout.SPANS], ids=lambda v: v.value)


_kernels_runnable = skip_if_triton_too_early(TRITON_TOO_EARLY, "test_kernel_suite_in_fresh_interpreter")


@pytest.mark.skipif(not TRITON_TOO_EARLY, reason="the kernel tests run in this process")
def test_kernel_suite_in_fresh_interpreter():
    run_in_fresh_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def quantized(*shape: int, group_size: int, scale_dtype=torch.bfloat16, seed: int = 0):
    """A random `[..., N, K]` int4 weight: (packed int32 [..., N, K/8], scale [..., N, K/g]).

    RTN-quantized from a Gaussian weight (realistic scales), except for GPU-sized tensors (the 256
    GLM-5 experts), whose nibbles and scales are drawn directly on the device.
    """
    *lead, n, k = shape
    rows = math.prod(lead) * n
    if rows * k > 1 << 28:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        packed = torch.randint(-(2**31), 2**31 - 1, (*lead, n, k // 8), dtype=torch.int32, device=DEV, generator=gen)
        scale = torch.rand(*lead, n, k // group_size, device=DEV, generator=gen) * 0.01 + 0.002
        return packed, scale.to(scale_dtype)
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    qw = quantize_rtn(w.to(DEV, scale_dtype), QuantSpec(group_size=group_size))
    return pack_int32(qw.q).reshape(*lead, n, k // 8), qw.scale.reshape(*lead, n, k // group_size)


def acts(m: int, k: int, dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def routing(m: int, num_experts: int, topk: int, seed: int = 2):
    logits = torch.randn(m, num_experts, generator=torch.Generator().manual_seed(seed))
    weights, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    return weights.to(DEV), ids.to(DEV)


def assert_close(y: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert not torch.isnan(y).any(), "output still holds NaN poison: some tile was not written"
    err = (y.float() - ref).abs().max() / ref.abs().max()
    sqnr = 20 * torch.log10(ref.norm() / (y.float() - ref).norm())
    assert err < REL_TOL[dtype], f"max rel err {err:.3e} >= {REL_TOL[dtype]}"
    assert sqnr > SQNR_DB[dtype], f"SQNR {sqnr:.1f} dB <= {SQNR_DB[dtype]}"


def poisoned(m: int, n: int, dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


def run_dense(m, n, k, g, dtype, config=None, scale_dtype=torch.bfloat16):
    wp, ws = quantized(n, k, group_size=g, scale_dtype=scale_dtype)
    x = acts(m, k, dtype)
    out = poisoned(m, n, dtype)
    y = D.w4a16_matmul(x, wp, ws, g, out=out, config=config)
    assert y is out and y.dtype == dtype and y.shape == (m, n)
    assert_close(y, R.w4a16_matmul_ref(x, wp, ws, g), dtype)
    return y


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------


def test_dequantize_packed_golden_words():
    # formats.md §2c worked example: q = [1..7, -8] packs to 0x0FEDCBA9; q = [0]*8 to 0x88888888.
    packed = torch.tensor([[267242409, -2004318072, 0, 0]], dtype=torch.int32)
    w = R.dequantize_packed(packed, torch.tensor([[2.0]]), group_size=32)
    expect = torch.tensor([1, 2, 3, 4, 5, 6, 7, -8] + [0] * 8 + [-8] * 16, dtype=torch.float32) * 2
    assert torch.equal(w, expect[None])


@pytest.mark.parametrize("g", GROUPS)
def test_dequantize_packed_matches_rtn(g):
    w = torch.randn(40, 384)
    qw = quantize_rtn(w, QuantSpec(group_size=g))
    assert torch.equal(R.dequantize_packed(pack_int32(qw.q), qw.scale, g), dequantize(qw, g))
    aq = quantize_rtn(w, QuantSpec(group_size=g, symmetric=False))
    want = dequantize(QWeight(aq.q, aq.scale, aq.zero_point), g)
    assert torch.equal(R.dequantize_packed(pack_int32(aq.q), aq.scale, g, aq.zero_point), want)
    assert torch.equal(R.dequantize_packed(pack_int32(aq.q), aq.scale, g, pack_zero_point(aq.zero_point)), want)


# ------------------------------------------------------------------------------------------------
# dense GEMM
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("m", [1, 3, 17, 118])
def test_dense_default_config(m, g, dtype):
    run_dense(m, 200, 384, g, dtype)  # N = 200: not a multiple of any block_n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [32, 128])
def test_dense_m1024(g, dtype):
    run_dense(1024, 96, 256, g, dtype)


@pytest.mark.parametrize(
    "m, config, g",
    [
        (1, D.DenseConfig("gemv", 1, 32, split_k=1, cpi=1), 32),
        (3, D.DenseConfig("gemv", 4, 64, split_k=3, cpi=1), 32),  # masked 4th row; 3 chunks in 3 splits
        (2, D.DenseConfig("gemv", 2, 16, split_k=2, cpi=2), 32),  # 2 steps, the last one half empty (K mask)
        (5, D.DenseConfig("gemv", 8, 16, split_k=1, cpi=4, num_warps=8), 32),
        (1, D.DenseConfig("mma", 16, 64, split_k=2), 32),
        (17, D.DenseConfig("mma", 32, 32, split_k=1, prefetch=False), 32),
        (17, D.DenseConfig("mma", 16, 128, split_k=3, big_dot=True), 128),  # 2 row tiles x 2 col tiles x 3
        (118, D.DenseConfig("mma", 64, 64, split_k=2, big_dot=True, group_m=2), 128),
        # transposed kernel: 16-token tiles, split-K over 3 chunks, group 32 (4 scales per chunk)
        (17, D.DenseConfig("mma", 16, 64, split_k=3, swap=True), 32),
        (118, D.DenseConfig("mma", 64, 128, split_k=1, swap=True, group_m=2, num_warps=8), 128),  # column tail
        (5, D.DenseConfig("mma", 32, 64, split_k=2, swap=True, asm=False), 64),  # plain-Triton dequantization
    ],
    ids=lambda v: str(v) if isinstance(v, int) else f"{v.kind.value}-{v.block_m}x{v.block_n}-s{v.split_k}-c{v.cpi}"
    f"-p{int(v.prefetch)}-b{int(v.big_dot)}-t{int(v.swap)}{'' if v.asm else '-noasm'}",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_forced_configs(m, config, g, dtype):
    run_dense(m, 136, 384, g, dtype, config=config)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [32, 128])
def test_swap_asm_dequant_is_bit_exact_gpu(g, dtype):
    # The inline-PTX dequantization rounds (u - 8) * scale to the activation dtype once, as the
    # plain path does (fp32 product, one rounding): same dot operands, so the same bits out.
    wp, ws = quantized(320, 512, group_size=g)
    x = acts(70, 512, dtype)
    cfg = D.DenseConfig("mma", 64, 128, split_k=2, swap=True, num_warps=8, num_stages=3)
    y_asm = D.w4a16_matmul(x, wp, ws, g, config=cfg)
    y_plain = D.w4a16_matmul(x, wp, ws, g, config=D.DenseConfig(**{**cfg.to_dict(), "asm": False}))
    assert torch.equal(y_asm, y_plain)
    assert_close(y_asm, R.w4a16_matmul_ref(x, wp, ws, g), dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
def test_dense_scale_dtypes_and_short_k(scale_dtype):
    run_dense(5, 136, 96, 32, torch.float16, scale_dtype=scale_dtype)  # K = 96: three groups of 32


def test_dense_split_k_is_deterministic_and_rearms_tickets():
    wp, ws = quantized(200, 384, group_size=32)
    x = acts(2, 384, torch.bfloat16)
    cfg = D.DenseConfig("gemv", 2, 64, split_k=4)
    y1 = D.w4a16_matmul(x, wp, ws, 32, config=cfg)
    y2 = D.w4a16_matmul(x, wp, ws, 32, config=cfg)
    assert torch.equal(y1, y2)
    assert not D._tickets(DEV, 1).any(), "split-K tickets must be left at zero for the next launch"


def test_dense_empty_m():
    wp, ws = quantized(64, 128, group_size=128)
    y = D.w4a16_matmul(torch.empty(0, 128, dtype=torch.float16, device=DEV), wp, ws, 128)
    assert y.shape == (0, 64)


def test_choose_config_buckets():
    decode = D.choose_config(1, 24576, 6144, 128)
    assert decode.kind is D.KernelKind.GEMV and decode.block_m == 1
    assert D.choose_config(1, 6144, 12288, 128).split_k > 1  # few column tiles for 132 SMs
    mid = D.choose_config(16, 6144, 12288, 128)
    assert mid.kind is D.KernelKind.MMA and mid.block_m == 16 and mid.split_k > 1
    assert mid.swap and D.choose_config(64, 4096, 6144, 128).swap  # transposed tensor-core kernel from M = 5
    big = D.choose_config(2048, 24576, 6144, 128)
    assert big.kind is D.KernelKind.MMA and big.block_m == 128 and big.split_k == 1 and big.swap
    assert D.choose_config(64, 256, 96, 32).kind is D.KernelKind.GEMV  # K = 96: chunk 32, no tensor-core path
    assert D.split_groups(tiles=10, num_groups=12, target_ctas=1000) == (3, 4)  # >= 4 groups per split


def test_tuned_table_lookup(tmp_path, monkeypatch):
    table = {
        "device": "GPU-X",
        "dense": {"256,384,128": {"4": {"kind": "gemv", "block_m": 4, "block_n": 64, "split_k": 3, "cpi": 1},
                                   "64": {"kind": "mma", "block_m": 32, "block_n": 64, "big_dot": True}}},
        "moe": {"8,256,128,3,128": {"1": {"block_m": 16, "block_n_up": 32, "block_n_down": 64, "big_dot": True}}},
    }  # fmt: skip
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(D, "TUNED_PATH", path)
    pick = functools.partial(D.choose_config, n=256, k=384, group_size=128, device="GPU-X")
    assert pick(3) == D.DenseConfig("gemv", 4, 64, split_k=3)  # smallest tuned M >= 3
    assert pick(2) == D.DenseConfig("gemv", 2, 64, split_k=3)  # fewer rows per program than tuned
    assert pick(17) == D.DenseConfig("mma", 32, 64, big_dot=True)
    assert pick(5000) == pick(64)  # past the table: its largest M
    assert D.choose_config(3, 256, 384, 128, device="GPU-Y") == D.heuristic_config(3, 256, 384, 128)
    assert D.choose_config(3, 512, 384, 128, device="GPU-X") == D.heuristic_config(3, 512, 384, 128)
    assert MO.choose_moe_config(1, 3, 8, 128, 256, device="GPU-X") == MO.MoeConfig(16, 32, 64, big_dot=True)
    assert MO.choose_moe_config(1, 3, 8, 128, 256) == MO.choose_moe_config(1, 3, 8, 128, 256, device="cpu")
    assert D.table_owner(path) == "GPU-X" and D.table_owner(tmp_path / "none.json") is None  # the tuners' guard
    assert D.table_owner(D.TUNED_PATH) == "GPU-X"
    assert D.replace_refusal(path, "GPU-X") is None and D.replace_refusal(tmp_path / "none.json", "GPU-Y") is None
    assert D.replace_refusal(path, "GPU-Y") == (f"{path} holds the launch table tuned on GPU-X; writing GPU-Y's would "
                                                f"replace it. Write elsewhere (--write OUT/tuned.json) or pass --replace")
    # a GPU the table names in "also_for" takes its entries too; others still take the heuristics
    path.write_text(json.dumps({**table, "also_for": {"GPU-Z": "measured"}}))
    D._tuned_table.cache_clear()
    assert D.choose_config(3, 256, 384, 128, device="GPU-Z") == pick(3)
    assert MO.choose_moe_config(1, 3, 8, 128, 256, device="GPU-Z") == MO.MoeConfig(16, 32, 64, big_dot=True)
    assert D.choose_config(3, 256, 384, 128, device="GPU-Y") == D.heuristic_config(3, 256, 384, 128)
    if DEV.type == "cuda" or D._INTERPRETED:
        run_dense(3, 256, 384, 128, torch.bfloat16, config=pick(3))


# ------------------------------------------------------------------------------------------------
# prepacking
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [384, 192, 96])
def test_prepack_layout_is_the_documented_permutation(k):
    wp, _ = quantized(24, k, group_size=32)
    chunk = D.chunk_for(k)
    assert chunk == {384: 128, 192: 64, 96: 32}[k]
    q = D.prepack_words(wp.cpu(), chunk)
    assert q.shape == wp.shape and q.dtype == torch.int32
    assert torch.equal(D.unprepack_words(q, chunk), wp.cpu())
    p = chunk // 8
    # prepacked word w of a chunk, nibble j = checkpoint element j * P + w of that chunk
    orig = unpack_int32(wp.cpu(), k).view(24, k // chunk, 8, p)  # [chunk, j, w]
    new = unpack_int32(q, k).view(24, k // chunk, p, 8)  # [chunk, w, j]
    assert torch.equal(new.transpose(-1, -2), orig)


def test_prepack_golden_word():
    # One 32-column chunk (P = 4): checkpoint elements e = 0..31 hold u = e % 16. Prepacked word w
    # nibble j holds element 4 * j + w, i.e. u = (4 * j + w) % 16.
    u = torch.arange(32) % 16
    packed = pack_int32((u - 8).to(torch.int8)[None])
    q = D.prepack_words(packed, 32)[0].tolist()
    want = [sum(((4 * j + w) % 16) << (4 * j) for j in range(8)) for w in range(4)]
    assert [v & 0xFFFFFFFF for v in q] == want


def test_prepack_dequantizes_bit_exactly_and_is_cached():
    wp, ws = quantized(3, 40, 256, group_size=64)  # leading expert dim
    packed = D.prepack(wp, ws, 64)
    assert packed.chunk == 128 and torch.equal(packed.scale, ws)
    back = D.unprepack_words(packed.qweight, packed.chunk)
    assert torch.equal(R.dequantize_packed(back[1], packed.scale[1], 64), R.dequantize_packed(wp[1], ws[1], 64))
    a = D.cached_prepack(wp[0].contiguous(), ws[0].contiguous(), 64)
    w0, s0 = wp[0].clone(), ws[0].clone()
    first = D.cached_prepack(w0, s0, 64)
    assert D.cached_prepack(w0, s0, 64) is first  # same tensors: cached
    assert D.cached_prepack(w0, s0.clone(), 64) is not first  # another scale tensor
    w0.add_(0)  # an in-place write bumps the version counter
    assert D.cached_prepack(w0, s0, 64) is not first
    assert torch.equal(a.qweight, first.qweight)


def test_pairs_layout_is_the_documented_permutation():
    # PAIRS (chunk 128): word v = 4c + a, nibble i holds element (i>>2) + 2c + 8(i&1) + 16((i>>1)&1) + 32a;
    # nibbles i and i + 4 are adjacent columns (k, k + 1), and thread c's words 4c..4c+3 hold the
    # columns {2c, 2c+1, 2c+8, 2c+9} of every k16 block (the tensor cores' A-fragment rule).
    perm = D.chunk_perm(128, D.Layout.PAIRS)
    assert sorted(perm.tolist()) == list(range(128))
    for v in range(16):
        c, a = v // 4, v % 4
        for i in range(4):
            assert perm[8 * v + i + 4] == perm[8 * v + i] + 1
        for i in range(8):
            col = int(perm[8 * v + i]) % 16
            assert col in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9) and int(perm[8 * v + i]) // 32 == a
    wp, ws = quantized(24, 384, group_size=128)
    q = D.prepack_words(wp.cpu(), 128, D.Layout.PAIRS)
    assert torch.equal(D.unprepack_words(q, 128, D.Layout.PAIRS), wp.cpu())
    orig = unpack_int32(wp.cpu(), 384).view(24, 3, 128)
    new = unpack_int32(q, 384).view(24, 3, 128)
    assert torch.equal(new, orig[:, :, perm])


def test_spans_layout_is_the_documented_permutation():
    # SPANS: the PAIRS slots over MMA k positions p, position p holding chunk column spans_column(p) = 32c + 4s + 2h + e
    # (p = 16s + 8h + 2c + e): thread c's words 4c..4c+3 hold the columns [32c, 32c + 32), nibbles i and i + 4 are
    # still adjacent columns, and position order is the order x's columns are fed to the MMA
    pairs, spans = D.chunk_perm(128, D.Layout.PAIRS), D.chunk_perm(128, D.Layout.SPANS)
    cols = D.spans_column(torch.arange(128))
    assert sorted(cols.tolist()) == list(range(128)) and torch.equal(spans, cols[pairs])
    assert [D.spans_column(p) for p in (0, 1, 2, 8, 16, 127)] == [0, 1, 32, 2, 4, 127]
    for c in range(4):
        assert sorted(spans[32 * c: 32 * c + 32].tolist()) == list(range(32 * c, 32 * c + 32))
        for s_ in range(8):  # k16 step s: thread c's B fragment is four consecutive columns of x
            assert [int(D.spans_column(16 * s_ + 8 * h + 2 * c + e)) for h in (0, 1) for e in (0, 1)] == \
                list(range(32 * c + 4 * s_, 32 * c + 4 * s_ + 4))
    for v in range(16):
        for i in range(4):
            assert spans[8 * v + i + 4] == spans[8 * v + i] + 1
    wp, ws = quantized(24, 384, group_size=128)
    q = D.prepack_words(wp.cpu(), 128, D.Layout.SPANS)
    assert torch.equal(D.unprepack_words(q, 128, D.Layout.SPANS), wp.cpu())
    new = unpack_int32(q, 384).view(24, 3, 128)
    assert torch.equal(new, unpack_int32(wp.cpu(), 384).view(24, 3, 128)[:, :, spans])
    packed = D.prepack(wp, ws, 128, layout="spans")
    assert packed.layout is D.Layout.SPANS and packed.layout.mma and packed.chunk_major
    x = acts(3, 384, torch.bfloat16)  # the Triton kernel reads x in this order on SPANS weights
    xs = D.spans_x(x)
    for j in range(3):
        assert torch.equal(xs[:, 128 * j: 128 * j + 128], x[:, 128 * j + cols])
    with pytest.raises(ValueError, match="spans layout is for group-128"):
        D.prepack(*quantized(64, 256, group_size=64), 64, layout="spans")


@pytest.mark.parametrize("chunk_major", [True, False])
def test_prepack_pairs_chunk_major(chunk_major):
    wp, ws = quantized(2, 40, 384, group_size=128)
    packed = D.prepack(wp, ws, 128, chunk_major=chunk_major)
    assert packed.layout is D.Layout.PAIRS and packed.chunk_major is chunk_major
    assert (packed.lead, packed.n, packed.k) == ((2,), 40, 384)
    words = packed.qweight.transpose(-2, -3).reshape(2, 40, 48) if chunk_major else packed.qweight
    assert torch.equal(D.unprepack_words(words, 128, D.Layout.PAIRS), wp)
    assert packed.word_strides() == ((16, 40 * 16) if chunk_major else (48, 16))
    assert D.prepack(*quantized(40, 384, group_size=64), 64).layout is D.Layout.PLANES  # smaller groups: PLANES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m, cfg, chunk_major",
    [
        (1, D.DenseConfig("mma", 16, 64, split_k=3, swap=True), True),  # token columns past M are zero-filled
        (17, D.DenseConfig("mma", 32, 64, split_k=2, swap=True), False),
        (70, D.DenseConfig("mma", 64, 128, split_k=1, swap=True, num_warps=8, num_stages=3), True),
        (118, D.DenseConfig("mma", 128, 64, split_k=2, swap=True, group_m=2, num_warps=8, num_stages=3), True),
        (5, D.DenseConfig("mma", 16, 64, split_k=1, swap=True, asm=False), False),
        # one full token tile (M == block_m): no row wrapping, column rows clamped past N = 136
        (16, D.DenseConfig("mma", 16, 64, split_k=2, swap=True), True),
        (32, D.DenseConfig("mma", 32, 128, split_k=1, swap=True, asm=False), True),
    ],
    ids=lambda v: str(v) if isinstance(v, (int, bool)) else f"{v.block_m}x{v.block_n}-s{v.split_k}-w{v.num_warps}"
    f"{'' if v.asm else '-noasm'}",
)
@pytest.mark.parametrize("layout", ["pairs", "spans", "spans-registers", "spans-copy"])
def test_dense_pairs_layout(m, cfg, chunk_major, dtype, layout, monkeypatch):
    # SPANS: the same kernel with each chunk's x tile permuted to spans_column order in registers (_spans_rows), or
    # on a copy of x permuted so (spans_x); "spans" leaves the choice to SPANS_PERMUTE_IN_KERNEL_MAX_M (by M)
    if layout != "spans":
        monkeypatch.setattr(D, "SPANS_PERMUTE_IN_KERNEL_MAX_M", 1 << 30 if layout == "spans-registers" else 0)
    layout = layout.split("-")[0]
    wp, ws = quantized(136, 384, group_size=128)
    x = acts(m, 384, dtype)
    out = poisoned(m, 136, dtype)
    packed = D.prepack(wp, ws, 128, layout, chunk_major)
    y = D.w4a16_matmul_packed(x, packed, out=out, config=cfg)
    assert_close(y, R.w4a16_matmul_ref(x, wp, ws, 128), dtype)


def _mailbox_clean() -> bool:
    box = D._MAILBOXES.get(DEV)
    return (box is None or bool((box == D.MAILBOX_EMPTY).all())) and not D._tickets(DEV, 1).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, block_n, split", [(384, 64, 3), (1280, 64, 10), (512, 128, 2)],
                         ids=["3-splits", "10-splits-two-groups", "2-splits-bn128"])
def test_dense_m1_mailbox_split_k(k, block_n, split, dtype):
    # M = 1 with split-K reduces through the mailbox (ticket taken at the start, last starter sums): right
    # values with a poisoned output and N = 136 (a masked column tail), deterministic, the mailbox words and
    # tickets left empty, and the same values as the ticket fix-up (same sums in the same order; an exact
    # zero may differ in sign only).
    wp, ws = quantized(136, k, group_size=128)
    x = acts(1, k, dtype)
    packed = D.prepack(wp, ws, 128)
    cfg = D.DenseConfig("mma", 16, block_n, split_k=split, swap=True)
    y1 = D.w4a16_matmul_packed(x, packed, out=poisoned(1, 136, dtype), config=cfg)
    assert_close(y1, R.w4a16_matmul_ref(x, wp, ws, 128), dtype)
    assert _mailbox_clean(), "the mailbox words and tickets must be left empty for the next launch"
    y2 = D.w4a16_matmul_packed(x, packed, out=poisoned(1, 136, dtype), config=cfg)
    assert torch.equal(y1, y2)
    ticket = D.w4a16_matmul_packed(x, packed, config=D.DenseConfig(**{**cfg.to_dict(), "mailbox": False}))
    assert torch.equal(y1 + 0, ticket + 0)
    assert _mailbox_clean()


@pytest.mark.parametrize(
    "m, cfg",
    [
        (1, D.DenseConfig("gemv", 1, 64, split_k=2)),
        (3, D.DenseConfig("mma", 16, 64, split_k=2)),
        (1, D.DenseConfig("mma", 16, 64, split_k=3, swap=True)),  # mailbox
        (1, D.DenseConfig("mma", 16, 64, split_k=3, swap=True, pdl_prefetch=2, pdl_mode="early")),
        (5, D.DenseConfig("mma", 16, 128, split_k=2, swap=True, pdl_prefetch=1, pdl_mode="late")),  # ticket
    ],
    ids=["gemv", "mma", "swap-mailbox", "swap-prefetch-early", "swap-ticket"],
)
def test_dense_pdl_flag_same_values(m, cfg):
    # pdl=True makes each launch a programmatic dependent on Hopper (and is ignored by the interpreter and
    # older GPUs): the same sums in the same order, so the same bits, and the split-K state left re-armed
    assert D.pdl_supported(DEV) == (DEV.type == "cuda" and torch.cuda.get_device_capability(DEV) >= (9, 0))
    wp, ws = quantized(136, 384, group_size=128)
    x = acts(m, 384, torch.bfloat16)
    plain = D.w4a16_matmul(x, wp, ws, 128, config=cfg)
    y = D.w4a16_matmul(x, wp, ws, 128, out=poisoned(m, 136, torch.bfloat16), config=cfg, pdl=True)
    assert_close(y, R.w4a16_matmul_ref(x, wp, ws, 128), torch.bfloat16)
    assert torch.equal(y + 0, plain + 0)
    assert _mailbox_clean()


def test_pdl_plan():
    swap = D.DenseConfig("mma", 16, 128, split_k=6, swap=True)
    assert D.pdl_plan(swap, 1, 11) == ("late", 0)  # long decode loop (8192^2, mailbox): next launch after the loop
    assert D.pdl_plan(swap, 1, 4, ticket=True) == ("early", 2)  # short loop (expert w2): early, 2 chunks prefetched
    assert D.pdl_plan(swap, 4, 24, ticket=True) == ("off", 0)  # measured slower with PDL (6144->24576 M = 4)
    assert D.pdl_plan(swap, 1, 24, ticket=True) == ("off", 0)
    assert D.pdl_plan(swap, 4, 24, ticket=False) == ("late", 0)  # no split-K: gained
    assert D.pdl_plan(swap, 64, 12, ticket=True) == ("late", 0)
    assert D.pdl_plan(swap, 256, 2) == ("off", 0)
    assert D.pdl_plan(D.DenseConfig("mma", 16, 128, swap=True, pdl_mode="early", pdl_prefetch=0), 4, 24) == ("early", 0)
    assert D.pdl_plan(D.DenseConfig("mma", 16, 128, swap=True, pdl_mode="off"), 1, 4) == ("off", 0)
    assert D.pdl_plan(D.DenseConfig("gemv", 1, 64, pdl_mode="late"), 1, 11) == ("early", 0)  # no late trigger there
    with pytest.raises(ValueError, match="pdl_mode must be one of"):
        D.DenseConfig("mma", 16, 128, pdl_mode="sometimes")


def test_mailbox_choice():
    # the mailbox where it measured faster on H200 (long loops per split), the ticket elsewhere
    pairs = D.Layout.PAIRS
    assert D.heuristic_config(1, 8192, 8192, 128, layout=pairs).mailbox
    assert not D.heuristic_config(1, 6144, 2048, 128, layout=pairs).mailbox
    assert D.choose_config(1, 8192, 8192, 128, device="NVIDIA H200", layout=pairs).mailbox
    assert not D.choose_config(1, 6144, 2048, 128, device="NVIDIA H200", layout=pairs).mailbox
    assert not D.choose_config(1, 4096, 6144, 128, device="NVIDIA H200", layout=pairs).mailbox


def test_pairs_layout_rejects_the_per_plane_kernels():
    wp, ws = quantized(64, 256, group_size=128)
    packed = D.prepack(wp, ws, 128)
    for cfg in (D.DenseConfig("gemv", 1, 64), D.DenseConfig("mma", 16, 64)):
        with pytest.raises(ValueError, match="transposed MMA kernel only"):
            D.w4a16_matmul_packed(acts(1, 256, torch.float16), packed, config=cfg)
    # the raw-tensor entry point prepacks in the layout the config needs
    run_dense(1, 64, 256, 128, torch.float16, config=D.DenseConfig("gemv", 1, 64))
    assert D.choose_config(1, 24576, 6144, 128, layout=D.Layout.PAIRS).swap  # decode too: tensor cores
    with pytest.raises(ValueError, match="pairs layout is for group-128"):
        D.prepack(*quantized(64, 256, group_size=64), 64, layout=D.Layout.PAIRS)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_m, warps, stages, split", [(16, 4, 4, 3), (64, 4, 3, 1), (128, 8, 3, 2)])
def test_pairs_asm_dequant_is_bit_exact_gpu(block_m, warps, stages, split, dtype):
    # The inline PTX yields q exactly, as the plain path does: same dot operands, so the same bits out.
    wp, ws = quantized(320, 768, group_size=128)
    x = acts(block_m, 768, dtype)  # full token tiles
    cfg = D.DenseConfig("mma", block_m, 128, split_k=split, swap=True, num_warps=warps, num_stages=stages)
    packed = D.prepack(wp, ws, 128)
    y_asm = D.w4a16_matmul_packed(x, packed, config=cfg)
    y_plain = D.w4a16_matmul_packed(x, packed, config=D.DenseConfig(**{**cfg.to_dict(), "asm": False}))
    assert torch.equal(y_asm, y_plain)
    assert_close(y_asm, R.w4a16_matmul_ref(x, wp, ws, 128), dtype)


def test_packed_entry_point_matches():
    wp, ws = quantized(72, 256, group_size=128)
    x = acts(2, 256, torch.float16)
    y1 = D.w4a16_matmul(x, wp, ws, 128)
    y2 = D.w4a16_matmul_packed(x, D.prepack(wp, ws, 128))
    assert torch.equal(y1, y2)


# ------------------------------------------------------------------------------------------------
# fused MoE
# ------------------------------------------------------------------------------------------------


def run_moe(m, hidden, inter, num_experts, topk, g, dtype, config=None):
    w13p, w13s = quantized(num_experts, 2 * inter, hidden, group_size=g, seed=3)
    w2p, w2s = quantized(num_experts, hidden, inter, group_size=g, seed=4)
    x = acts(m, hidden, dtype)
    tw, ti = routing(m, num_experts, topk)
    out = poisoned(m, hidden, dtype)
    y = MO.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, tw, ti, g, out=out, config=config)
    assert y is out
    assert_close(y, R.moe_w4a16_ref(x, w13p, w13s, w2p, w2s, ti, tw, g), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("m", [1, 3, 17, 118])
def test_moe(m, g, dtype):
    # Whole-width column tiles keep the interpreter fast; the tiling itself is covered below. M = 1 and
    # 118 take the transposed kernel (swap), 3 the gathered K = 128 dot, 17 the per-plane dots.
    swap = m in (1, 118)
    config = MO.MoeConfig(block_m=64 if m > 64 else 16, block_n_up=128, block_n_down=256, big_dot=m == 3,
                          prefetch=m != 17, swap=swap, num_warps=8 if swap and m > 64 else 4)  # fmt: skip
    run_moe(m, 256, 128, num_experts=8, topk=3, g=g, dtype=dtype, config=config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_column_tails_and_default_config(dtype):
    # I = 384 and H = 128 are not multiples of 256: the last column tile of both launches is masked.
    # (bf16: the transposed kernel; fp16: the per-plane one)
    config = MO.MoeConfig(16, 256, 256, swap=dtype == torch.bfloat16)
    run_moe(5, 128, 384, num_experts=6, topk=2, g=32, dtype=dtype, config=config)
    run_moe(2, 128, 128, num_experts=4, topk=2, g=64, dtype=dtype)  # choose_moe_config's tiles


def test_moe_packed_refuses_spans():
    # the grouped GEMM reads PAIRS expert weights; SPANS (the 2-D decode layout) is refused with a clear error
    m, hidden, inter, num_experts, topk, dtype = 3, 256, 128, 4, 2, torch.bfloat16
    w13p, w13s = quantized(num_experts, 2 * inter, hidden, group_size=128, seed=3)
    w2p, w2s = quantized(num_experts, hidden, inter, group_size=128, seed=4)
    x = acts(m, hidden, dtype)
    tw, ti = routing(m, num_experts, topk)
    w13, w2 = MO.prepack_moe(w13p, w13s, w2p, w2s, 128)
    y = MO.fused_moe_w4a16_packed(x, w13, w2, tw, ti, out=poisoned(m, hidden, dtype),
                                  config=MO.MoeConfig(16, 128, 128, swap=True))
    assert_close(y, R.moe_w4a16_ref(x, w13p, w13s, w2p, w2s, ti, tw, 128), dtype)
    with pytest.raises(ValueError, match="prepacked w2 is in the spans layout"):
        MO.fused_moe_w4a16_packed(x, w13, D.prepack(w2p, w2s, 128, "spans"), tw, ti)


ALIGN_CASES = [(1, 8, 256, 16), (37, 3, 8, 16), (50, 4, 8, 64), (3, 2, 6, 16), (40, 8, 256, 16)]


@pytest.mark.parametrize("one_launch", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("m, topk, num_experts, block_m", ALIGN_CASES)
def test_moe_align_block_size(m, topk, num_experts, block_m, one_launch):
    _, ids = routing(m, num_experts, topk)
    sorted_ids, expert_ids, num_blocks = MO.moe_align_block_size(ids, block_m, num_experts, one_launch=one_launch)
    t = m * topk
    assert sorted_ids.shape == (num_blocks * block_m,) and expert_ids.shape == (num_blocks,)
    valid = sorted_ids < t
    assert torch.equal(torch.sort(sorted_ids[valid]).values.long(), torch.arange(t, device=DEV))  # each once
    blocks = sorted_ids.view(num_blocks, block_m)
    flat = ids.reshape(-1)
    for b in range(num_blocks):
        rows = blocks[b][blocks[b] < t].long()
        if expert_ids[b] == num_experts:  # past the end: padding only
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == expert_ids[b]).all())
    used = int((expert_ids < num_experts).sum())
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m).sum())


@pytest.mark.parametrize("m, topk, num_experts, block_m", ALIGN_CASES)
def test_moe_align_paths_agree(m, topk, num_experts, block_m):
    _, ids = routing(m, num_experts, topk)
    one = MO.moe_align_block_size(ids.to(torch.int32), block_m, num_experts, one_launch=True)
    ops = MO.moe_align_block_size(ids, block_m, num_experts, one_launch=False)
    assert torch.equal(one[0], ops[0]) and torch.equal(one[1], ops[1]) and one[2] == ops[2]


# Expert ids outside [0, E): -1 ("expert not on this rank", vLLM's expert parallelism) is dropped, contributing
# nothing; any other is a ValueError from the wrapper and the reference, and is dropped like -1 where the check is
# skipped (CUDA graph capture). Alignment puts the dropped assignments after the last expert's run, in blocks of
# expert E, and never writes outside its buffers.
BAD_ALIGN_IDS = [[0, 7], [5, 2], [-1, 6], [3, -1], [-3, 1], [0, 5]]  # E = 5: 5, 6, 7 fit lanes of next_pow2(E) = 8


@pytest.mark.parametrize("one_launch", [True, False], ids=["triton", "torch"])
def test_moe_align_drops_out_of_range_ids(one_launch):
    e, bm = 5, 16
    ids = torch.tensor(BAD_ALIGN_IDS, dtype=torch.int32 if one_launch else torch.int64, device=DEV)
    sorted_ids, expert_ids, nb = MO.moe_align_block_size(ids, bm, e, one_launch=one_launch)
    flat = ids.reshape(-1).long()
    ok = (flat >= 0) & (flat < e)
    t = flat.numel()
    assert nb == MO.align_num_blocks(t, bm, e) and sorted_ids.shape == (nb * bm,)
    blocks = [x for x in range(e) for _ in range(-(-int((flat == x).sum()) // bm))]  # each expert's padded run
    used = len(blocks)
    assert expert_ids.tolist() == blocks + [e] * (nb - used)  # the dropped ones sit in blocks of expert E
    got = sorted_ids[: used * bm]
    assert got[got < t].tolist() == [i for x in range(e) for i in range(t) if flat[i] == x]  # stable, by expert
    tail = sorted_ids[used * bm:]  # the dropped ones, in flat order, then padding
    dropped = torch.nonzero(~ok).flatten()
    assert torch.equal(tail[: dropped.numel()].long(), dropped) and bool((tail[dropped.numel():] == t).all())


def test_moe_align_paths_agree_with_out_of_range_ids():
    ids = torch.tensor(BAD_ALIGN_IDS * 3, device=DEV)
    for e, bm in ((5, 16), (8, 16), (3, 64), (200, 16)):  # E = 200: CHUNK 32, so the 36 ids take two chunks
        one = MO.moe_align_block_size(ids.to(torch.int32), bm, e, one_launch=True)
        ops = MO.moe_align_block_size(ids, bm, e, one_launch=False)
        assert torch.equal(one[0], ops[0]) and torch.equal(one[1], ops[1]) and one[2] == ops[2], (e, bm)


def test_moe_align_kernel_stays_in_bounds():
    # the buffers inside a guarded arena: ids 5..7 with E = 5 match lanes of E_P2 = 8 and once got runs past the
    # static bound of sorted_ids (slot 112 of 96), overwriting expert_ids[0] and memory past both buffers
    e, bm = 5, 16
    ids = torch.arange(8, dtype=torch.int32, device=DEV)
    nb = MO.align_num_blocks(ids.numel(), bm, e)
    arena = torch.full((nb * bm + nb + 256,), -7, dtype=torch.int32, device=DEV)
    sorted_ids, expert_ids, guard = arena[: nb * bm], arena[nb * bm: nb * bm + nb], arena[nb * bm + nb:]
    MO._align_kernel[(1,)](ids, sorted_ids, expert_ids, ids.numel(), e, nb, BLOCK_M=bm, E_P2=8, CHUNK=16)
    assert bool((guard == -7).all()), "the alignment wrote past its buffers"
    ops = MO.moe_align_block_size(ids.long(), bm, e, one_launch=False)
    assert torch.equal(sorted_ids, ops[0]) and torch.equal(expert_ids, ops[1])


def _nan_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors (as a reused allocator block can hold), so a buffer row the
    kernels never write reaches the output as NaN."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@pytest.mark.parametrize("one_launch", [True, False], ids=["triton-align", "torch-align"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "planes"])
def test_moe_minus_one_ids_are_dropped(swap, one_launch, monkeypatch):
    m, hidden, inter, e, topk, g, dtype = 3, 128, 128, 4, 2, 128, torch.bfloat16
    w13p, w13s = quantized(e, 2 * inter, hidden, group_size=g, seed=3)
    w2p, w2s = quantized(e, hidden, inter, group_size=g, seed=4)
    x = acts(m, hidden, dtype)
    tw, _ = routing(m, e, topk)
    ti = torch.tensor([[0, -1], [-1, -1], [3, 1]], device=DEV)
    ref = R.moe_w4a16_ref(x, w13p, w13s, w2p, w2s, ti, tw, g)
    kept = torch.where(ti < 0, 0, ti), torch.where(ti < 0, 0.0, tw)  # the -1 slots as weight-0 slots
    torch.testing.assert_close(ref, R.moe_w4a16_ref(x, w13p, w13s, w2p, w2s, *kept, g), rtol=1e-5, atol=1e-3)
    assert not bool((ref[1] != 0).any()) and bool((ref[0] != 0).any())
    if not one_launch:
        monkeypatch.setattr(MO, "ALIGN_ONE_LAUNCH_MAX", 0)
    _nan_empty(monkeypatch)
    cfg = MO.MoeConfig(16, 128, 128, swap=swap)
    y = MO.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, tw, ti, g, out=poisoned(m, hidden, dtype), config=cfg)
    assert not bool((y[1] != 0).any()), "a token whose experts are all elsewhere must come out zero"
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("bad", [-2, 4, 7, 1 << 40])
def test_moe_rejects_out_of_range_ids(bad):
    args = _moe_inputs(m=2, num_experts=4, g=128)
    args["topk_ids"] = torch.tensor([[0, bad], [1, -1]], device=DEV)
    if DEV.type == "cpu":  # on CUDA the wrapper does not read the ids (next test: they are dropped)
        with pytest.raises(ValueError, match=rf"topk_ids holds 1 expert id\(s\) in \[{bad}, {bad}\].*E = 4"):
            MO.fused_moe_w4a16(**args)
    with pytest.raises(ValueError, match=rf"\[{bad}, {bad}\].*E = 4"):
        R.moe_w4a16_ref(**args)


def test_moe_unchecked_out_of_range_ids_are_dropped(monkeypatch):
    # unchecked (on CUDA the wrapper does not read the ids) the kernels drop an id outside [0, E) like -1: no
    # garbage, no write out of bounds
    args = _moe_inputs(m=2, num_experts=4, g=128)
    ids = torch.tensor([[0, 7], [-5, 2]], device=DEV)
    want = MO.fused_moe_w4a16(**{**args, "topk_ids": torch.where((ids < 0) | (ids >= 4), -1, ids)})
    monkeypatch.setattr(MO, "_check_expert_ids", lambda ids, e: None)  # as on CUDA
    _nan_empty(monkeypatch)
    assert torch.equal(MO.fused_moe_w4a16(**{**args, "topk_ids": ids}), want)


@pytest.mark.gpu
@gpu
def test_moe_dropped_ids_in_cuda_graph_gpu():
    args = _moe_inputs(m=5, hidden=256, inter=256, num_experts=8, topk=4, g=128)
    ids = args["topk_ids"].clone()
    ids[::2, 1:3] = -1  # experts not on this rank
    want = R.moe_w4a16_ref(**{**args, "topk_ids": ids})
    out = torch.full_like(args["x"], float("nan"))
    graph = _graph_of(lambda: MO.fused_moe_w4a16(**{**args, "topk_ids": ids}, out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, want, torch.bfloat16)


def test_choose_moe_config():
    decode = MO.choose_moe_config(1, 8, 256, 2048, 6144)
    assert decode.block_m == 16 and decode.swap
    prefill = MO.choose_moe_config(2048, 8, 256, 2048, 6144)
    assert prefill.block_m == 64 and prefill.num_warps == 8
    assert min(prefill.block_n_up, prefill.block_n_down, decode.block_n_up) >= 64  # the transposed MMA's M


# ------------------------------------------------------------------------------------------------
# preconditions
# ------------------------------------------------------------------------------------------------


def _dense_inputs(m=3, n=64, k=256, g=128):
    wp, ws = quantized(n, k, group_size=g)
    return acts(m, k, torch.float16), wp, ws


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "x": a["x"].float()}, "float16 or bfloat16"),
        (lambda a: {**a, "x": a["x"][None]}, "2-D"),
        (lambda a: {**a, "x": a["x"].repeat(1, 2)[:, ::2]}, "x must be contiguous"),
        (lambda a: {**a, "group_size": 16}, "group_size must be one of"),
        (lambda a: {**a, "group_size": 256}, "group_size must be one of"),
        (lambda a: {**a, "x": a["x"][:, :100].contiguous()}, "multiple of 8"),
        (lambda a: {**a, "x": a["x"][:, :96].contiguous()}, "multiple of group_size"),
        (lambda a: {**a, "weight_packed": a["weight_packed"].long()}, "weight_packed must be int32"),
        (lambda a: {**a, "weight_scale": a["weight_scale"].to(torch.int32)}, "weight_scale must be float16"),
        (lambda a: {**a, "weight_packed": a["weight_packed"][:, :16]}, "weight_packed has shape"),
        (lambda a: {**a, "weight_packed": a["weight_packed"][None]}, "must be 2-D"),
        (lambda a: {**a, "weight_scale": a["weight_scale"][:32]}, "weight_scale has shape"),
        (lambda a: {**a, "weight_scale": a["weight_scale"].repeat(1, 2)}, "weight_scale has shape"),
        (
            lambda a: {**a, "weight_packed": a["weight_packed"].t().contiguous().t()},
            "weight_packed must be contiguous",
        ),
        (lambda a: {**a, "weight_scale": a["weight_scale"].to("meta")}, "weight_scale is on meta"),
        (lambda a: {**a, "out": torch.empty(3, 64, dtype=torch.bfloat16, device=DEV)}, "out must be"),
        (lambda a: {**a, "out": torch.empty(3, 65, dtype=torch.float16, device=DEV)}, "out must be"),
        (lambda a: {**a, "out": torch.empty(64, 3, dtype=torch.float16, device=DEV).t()}, "out must be contiguous"),
    ],
)
def test_dense_preconditions(mutate, match):
    x, wp, ws = _dense_inputs()
    args = mutate({"x": x, "weight_packed": wp, "weight_scale": ws, "group_size": 128, "out": None})
    with pytest.raises(ValueError, match=match):
        D.w4a16_matmul(**args)


def test_dense_mma_needs_k_multiple_of_128():
    wp, ws = quantized(64, 192, group_size=64)  # K = 192: chunk 64
    with pytest.raises(ValueError, match="multiple of 128"):
        D.w4a16_matmul(acts(16, 192, torch.float16), wp, ws, 64, config=D.DenseConfig("mma", 16, 64))


def test_prepack_preconditions():
    wp, ws = quantized(64, 256, group_size=128)
    with pytest.raises(ValueError, match="group_size must be one of"):
        D.prepack(wp, ws, 16)
    with pytest.raises(ValueError, match="weight_packed must be int32"):
        D.prepack(wp.long(), ws, 128)
    with pytest.raises(ValueError, match="weight_scale has shape"):
        D.prepack(wp, ws[:, :1], 128)
    with pytest.raises(ValueError, match="does not take x"):
        D.w4a16_matmul_packed(acts(2, 128, torch.float16), D.prepack(wp, ws, 128))


def test_dense_needs_cuda_outside_interpreter(monkeypatch):
    monkeypatch.setattr(D, "_INTERPRETED", False)
    x, wp, ws = _dense_inputs()
    with pytest.raises(ValueError, match="need a CUDA device"):
        D.w4a16_matmul(x.cpu(), wp.cpu(), ws.cpu(), 128)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="mma", block_m=8, block_n=64), "block_m >= 16"),
        (dict(kind="gemv", block_m=16, block_n=64), "block_m <= 8"),
        (dict(kind="gemv", block_m=1, block_n=48), "power of two"),
        (dict(kind="gemv", block_m=1, block_n=8), "block_n must be >= 16"),
        (dict(kind="mma", block_m=16, block_n=64, split_k=0), "split_k"),
        (dict(kind="gemv", block_m=1, block_n=64, cpi=3), "cpi must be a power of two"),
        (dict(kind="wgmma", block_m=16, block_n=64), "is not a valid KernelKind"),
        (dict(kind="gemv", block_m=1, block_n=64, swap=True), "swap applies to the MMA kernel only"),
    ],
)
def test_dense_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.DenseConfig(**kwargs)


def _moe_inputs(m=3, hidden=128, inter=128, num_experts=4, topk=2, g=32):
    w13p, w13s = quantized(num_experts, 2 * inter, hidden, group_size=g)
    w2p, w2s = quantized(num_experts, hidden, inter, group_size=g)
    tw, ti = routing(m, num_experts, topk)
    return dict(
        x=acts(m, hidden, torch.bfloat16), w13_packed=w13p, w13_scale=w13s, w2_packed=w2p, w2_scale=w2s,
        topk_weights=tw, topk_ids=ti, group_size=g,
    )  # fmt: skip


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "x": a["x"].float()}, "float16 or bfloat16"),
        (lambda a: {**a, "group_size": 48}, "group_size must be one of"),
        (lambda a: {**a, "group_size": 128, "w13_packed": a["w13_packed"][:, :128].contiguous()},
         "intermediate size I = 64 must be a multiple of group_size 128"),
        (lambda a: {**a, "w13_packed": a["w13_packed"][:, :128].contiguous()},
         "intermediate size I = 64 must be a multiple of 128 for the fused MoE"),
        (lambda a: {**a, "x": a["x"][:, :96].contiguous()}, "hidden size H = 96 must be a multiple of 128"),
        (lambda a: {**a, "x": a["x"][:, :120].contiguous()}, "multiple of group_size"),
        (lambda a: {**a, "w13_packed": a["w13_packed"][0]}, "must be 3-D"),
        (lambda a: {**a, "w13_packed": a["w13_packed"][:, :127]}, "expected 2I"),
        (lambda a: {**a, "w13_packed": a["w13_packed"].float()}, "w13_packed must be int32"),
        (lambda a: {**a, "w13_scale": a["w13_scale"][:, :, :2]}, "w13_scale has shape"),
        (lambda a: {**a, "w2_packed": a["w2_packed"][:, :64]}, "w2_packed has shape"),
        (lambda a: {**a, "w2_scale": a["w2_scale"].to(torch.int8)}, "w2_scale must be float16"),
        (lambda a: {**a, "w2_scale": a["w2_scale"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be int32/int64"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:2]}, "topk_ids must be"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights must be"),
        (lambda a: {**a, "topk_weights": a["topk_weights"].to(torch.int32)}, "topk_weights must be"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].t().contiguous().t()}, "topk_ids must be contiguous"),
        (lambda a: {**a, "out": torch.empty(3, 128, dtype=torch.float16, device=DEV)}, "out must be"),
    ],
)
def test_moe_preconditions(mutate, match):
    with pytest.raises(ValueError, match=match):
        MO.fused_moe_w4a16(**mutate(_moe_inputs()))


def test_moe_config_validation():
    with pytest.raises(ValueError, match="power of two >= 16"):
        MO.MoeConfig(block_m=8, block_n_up=64, block_n_down=64)


# ------------------------------------------------------------------------------------------------
# the Gluon decode kernel (kernels/w4a16_decode.py): GPU-only numerics, CPU rules and an sm_90 compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(rows=64), "rows must be 16 or 32"), (dict(warps=3), "warps must be 1, 2, 4 or 8"),
     (dict(depth=5), "depth must be 1-4"), (dict(split=-1), "split must be >= 0"),
     (dict(ring=3), "ring must be 2, 4 or 8"), (dict(step=3), "step must be 1, 2 or 4"),
     (dict(ring=2, step=2), "ring >= 2 step"), (dict(wgmma=True), "wgmma takes the shared-x kernel"),
     (dict(split=2, rows=32, wgmma=True), "wgmma takes"), (dict(split=2, warps=2, wgmma=True), "wgmma takes"),
     (dict(split=2, scaled_a=True), "scaled_a needs wgmma")],
)  # fmt: skip
def test_decode_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DK.DecodeConfig(**kwargs)


def test_decode_supports_and_heuristic():
    wp, ws = quantized(48, 768, group_size=128)
    pairs = D.prepack(wp, ws, 128)
    # x_smem stages each warp's chunks rounded up to a power of two; past X_SMEM_MAX_BYTES the config is refused
    assert DK.x_smem_bytes(8192, 4) == 16 * 4 * 256 and DK.x_smem_bytes(12288, 8) == 16 * 8 * 256
    wide = D.prepack(*quantized(16, 392 * 128, group_size=128), 128)  # 49 chunks a warp -> 64: 128 KB
    assert DK.supports(1, wide, DK.DecodeConfig(warps=8)) and DK.supports(2, wide, DK.DecodeConfig(warps=8, x_smem=True))
    assert not DK.supports(1, wide, DK.DecodeConfig(warps=8, x_smem=True))
    assert DK.supports(1, pairs, DK.DecodeConfig(warps=2, x_smem=True))
    assert pairs.layout is D.Layout.PAIRS and pairs.chunk_major
    assert DK.supports(1, pairs) and DK.supports(16, pairs) and not DK.supports(0, pairs)
    # 16 < M <= 64: wgmma configs of the shared-x kernel only (on PAIRS weights)
    assert DK.supports(17, pairs) and DK.supports(64, pairs) and not DK.supports(65, pairs)
    assert DK.supports(64, pairs, DK.DecodeConfig(depth=1, split=2, w_smem=True, wgmma=True))
    assert not DK.supports(65, pairs, DK.DecodeConfig(depth=1, split=2, w_smem=True, wgmma=True))
    assert not DK.supports(17, pairs, DK.DecodeConfig(split=2)) and not DK.supports(17, pairs, DK.DecodeConfig(warps=2))
    assert [DK.xshared_tokens(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    assert DK.supports(5, pairs, DK.DecodeConfig(warps=2)) and not DK.supports(5, pairs, DK.DecodeConfig(warps=4))
    # the shared-x kernel: its warps split rows, so only the K split must divide the chunks (6 here)
    assert DK.supports(5, pairs, DK.DecodeConfig(warps=4, split=3)) and DK.supports(16, pairs, DK.DecodeConfig(split=6))
    assert not DK.supports(5, pairs, DK.DecodeConfig(warps=4, split=4))
    assert not DK.supports(17, pairs, DK.DecodeConfig(split=1))
    assert not DK.supports(1, D.prepack(wp, ws, 128, layout="planes", chunk_major=False))
    assert not DK.supports(17, D.prepack(wp, ws, 128, layout="spans")) and DK.supports(16, D.prepack(wp, ws, 128, layout="spans"))
    wp32, ws32 = quantized(48, 768, group_size=32)
    assert not DK.supports(1, D.prepack(wp32, ws32, 32))  # group 32: PLANES words
    # `_decode_kernel`'s rule: M = 1, up to ~80 M weights, 8 warps unless that leaves < 4 chunks each
    assert DK.direct_heuristic(1, 8192, 8192) == DK.DecodeConfig(16, 8, 2, pdl_early=True)
    assert DK.direct_heuristic(1, 6144, 12288) == DK.DecodeConfig(16, 8, 2, pdl_early=False)  # 12 chunks a warp
    assert DK.direct_heuristic(1, 24576, 6144) is None and DK.direct_heuristic(2, 8192, 8192) is None
    # what an untuned sm_90 GPU or shape gets (measured on the H200, session 21): M = 1 and K <= 2048 that rule ...
    assert DK.heuristic_config(1, 6144, 2048) == DK.DecodeConfig(16, 4, 2, pdl_early=True)
    assert DK.heuristic_config(1, 256, 384) == DK.DecodeConfig(16, 1, 2, pdl_early=True)
    # ... else the shared-x kernel, 64-row programs, K split for ~3 programs an SM (the GLM-5 table's splits)
    assert DK.heuristic_config(1, 8192, 8192) == DK.DecodeConfig(16, 4, 1, split=4, ring=4, w_smem=True)
    assert DK.heuristic_config(2, 4096, 6144) == DK.DecodeConfig(16, 4, 1, split=6, ring=4, w_smem=True)
    assert DK.heuristic_config(4, 6144, 12288) == DK.DecodeConfig(16, 4, 3, split=4, ring=4)
    assert DK.heuristic_config(8, 24576, 6144) == DK.DecodeConfig(16, 4, 3, split=1, ring=4)
    assert DK.heuristic_config(16, 6144, 12288) == DK.DecodeConfig(16, 4, 2, split=4, ring=4, wgmma=True)
    # wgmma's programs: at most three an SM (8192^2: split 2, 256 programs, not 4, 512)
    assert DK.heuristic_config(16, 8192, 8192).split == 2 and DK.heuristic_config(8, 8192, 8192).split == 4
    # SPANS weights (the rule not measured there): `_decode_kernel`'s M = 1 rule only, as before session 21
    assert DK.heuristic_config(16, 8192, 8192, D.Layout.SPANS) is None
    assert DK.heuristic_config(1, 8192, 8192, D.Layout.SPANS) == DK.direct_heuristic(1, 8192, 8192)
    assert DK.xshared_heuristic(16, 8192, 8192, D.Layout.SPANS) == DK.DecodeConfig(16, 4, 3, split=4, ring=4)
    assert DK.xshared_split(8192, 8192, sms=66) == 2 and DK.xshared_split(384, 512) == 1  # fewer SMs; 4 chunks
    # M = 1 with fewer than 2.5 programs an SM (Kimi K2's 7168->18432: 288): the Triton kernel; M > 16: always
    assert DK.heuristic_config(1, 18432, 7168) is None and DK.heuristic_config(2, 18432, 7168).split == 1
    assert DK.heuristic_config(17, 8192, 8192) is None and DK.heuristic_config(4, 256, 200) is None
    # off-GPU (and under the interpreter) the Triton kernels always run; an explicit DecodeConfig is refused
    assert DK.choose(1, pairs, torch.device("cpu"), "cpu", False) is None
    if DEV.type != "cuda":
        with pytest.raises(ValueError, match="needs the Gluon decode kernel"):
            D.w4a16_matmul_packed(acts(1, 768, torch.bfloat16), pairs, config=DK.DecodeConfig(warps=2))


def test_decode_tuned_table_lookup(tmp_path, monkeypatch):
    table = {"device": "GPU-X", "decode": {"256,768,128": {
        "1": {"plain": {"rows": 16, "warps": 2, "depth": 3, "pdl_early": False}, "pdl": None},
        "4": {"plain": None, "pdl": {"rows": 32, "warps": 1, "depth": 1}}}}}  # fmt: skip
    path = tmp_path / "tuned_decode.json"
    path.write_text(json.dumps(table))
    spans = tmp_path / "tuned_decode_spans.json"
    spans.write_text(json.dumps({**table, "layout": "spans", "decode": {"256,768,128": {"8": {"plain": {"warps": 4}}}}}))
    monkeypatch.setattr(DK, "TUNED_PATHS", {D.Layout.PAIRS: path, D.Layout.SPANS: spans})
    DK._table.cache_clear()
    try:
        look = functools.partial(DK.tuned_config, n=256, k=768, device="GPU-X")
        assert look(1, pdl=False) == DK.DecodeConfig(16, 2, 3)
        assert look(1, pdl=True) is None  # the Triton kernel won there
        assert look(3, pdl=False) is None and look(3, pdl=True) == DK.DecodeConfig(32, 1, 1)  # smallest tuned M >= 3
        assert look(5, pdl=True) is None  # past the largest tuned M: the Triton kernels
        assert DK.tuned_config(1, 256, 768, "GPU-Y", False) == "untuned"
        assert DK.tuned_config(1, 512, 768, "GPU-X", False) == "untuned"
        path.write_text(json.dumps({**table, "also_for": {"GPU-Y": "measured"}}))  # a GPU it was measured to serve
        DK._table.cache_clear()
        assert DK.tuned_config(1, 256, 768, "GPU-Y", False) == DK.DecodeConfig(16, 2, 3)
        assert DK.tuned_config(1, 256, 768, "GPU-W", False) == "untuned"
        path.write_text(json.dumps(table))
        DK._table.cache_clear()
        # each layout has its own table, tuned on weights of that layout
        assert look(5, pdl=False, layout=D.Layout.SPANS) == DK.DecodeConfig(16, 4, 2)
        assert look(9, pdl=False, layout=D.Layout.SPANS) is None and look(8, pdl=True, layout=D.Layout.SPANS) is None
        spans.write_text(json.dumps(table))  # a table without "layout" was tuned on PAIRS weights
        DK._table.cache_clear()
        assert look(1, pdl=False, layout=D.Layout.SPANS) == "untuned"
    finally:
        DK._table.cache_clear()


def test_shipped_tables_also_for_entries_say_what_was_measured():
    # a GPU named in a table's "also_for" takes that table (`table_serves`); each name comes with its measurement
    paths = [D.TUNED_PATH, *DK.TUNED_PATHS.values()]
    for path in paths:
        table = json.loads(path.read_text())
        also = table.get("also_for", {})
        assert isinstance(also, dict) and table["device"] not in also, path
        for name, note in also.items():
            assert "measured" in note and "BENCHMARKS.md" in note, (path, name)
            assert D.table_serves(table, name) and not D.table_serves(table, name + " PCIe")
    assert "NVIDIA H100 80GB HBM3" in json.loads(D.TUNED_PATH.read_text())["also_for"]


@pytest.mark.parametrize("layout", [D.Layout.PAIRS, D.Layout.SPANS], ids=lambda v: v.value)
def test_shipped_decode_tables_are_valid(layout):
    # every entry of the launch tables in the repository is a config the kernel takes for its shape and M, on weights
    # of the table's layout (a table written by an older or newer probe_decode.py must not break the dispatch)
    table = json.loads(DK.TUNED_PATHS[layout].read_text())
    assert table.get("layout", "pairs") == layout.value and table["decode"]
    for key, by_m in table["decode"].items():
        n, k, g = map(int, key.split(","))
        w = D.PackedW4(torch.zeros(k // 128, 8, 16, dtype=torch.int32), torch.ones(8, k // g), g, chunk=128,
                       layout=layout, chunk_major=True)
        for m, entry in by_m.items():
            for slot in ("plain", "pdl"):
                if entry.get(slot):
                    assert DK.supports(int(m), w, DK.DecodeConfig(**entry[slot])), (key, m, slot, entry[slot])


def test_probe_decode_tune_candidates():
    # the tuner's K splits for the shared-x kernel: smallest, middle, largest and the one nearest 3 programs per SM on
    # an H200 (12288->6144 with 128 rows a program: 48 row blocks, split 8 = 384 programs); above M = 8 the kernel
    # whose warps split K is not a candidate
    from glmq.scripts import probe_decode as P

    assert P.xshared_splits(6144, 12288, 16, 8) == [2, 6, 8, 16]  # 2-16 programs a block (96-800 in all)
    assert P.xshared_splits(6144, 12288, 16, 4) == [1, 4, 8]  # 96 blocks: split 4 = 384 programs is also nearest
    assert P.xshared_splits(256, 512, 16, 4) == []  # 4 chunks and 4 blocks: no launch of >= 96 programs
    assert all(c.split for c in P.tune_candidates(6144, 12288, 16))
    wide = P.tune_candidates(6144, 2048, 64)  # above M = 16: the shared-x kernel's wgmma configs only
    # (the words in registers only with the scales in A, which leaves them room: session 23)
    assert wide and all(c.wgmma and (c.w_smem or c.scaled_a) for c in wide) and any(c.scaled_a for c in wide)
    assert not P.tune_candidates(6144, 2048, 64, "spans")
    assert any(not c.split for c in P.tune_candidates(6144, 12288, 8))
    # at M = 1 both kernels are candidates (the shared-x one since session 18)
    m1 = P.tune_candidates(6144, 12288, 1)
    assert any(c.split for c in m1) and any(not c.split for c in m1) and any(c.x_smem for c in m1)
    # the warpgroup-MMA configs: at 16 tokens on PAIRS weights only
    assert any(c.wgmma for c in P.tune_candidates(6144, 12288, 16))
    assert not any(c.wgmma for c in P.tune_candidates(6144, 12288, 8) + P.tune_candidates(6144, 12288, 16, "spans"))


def test_probe_decode_tags_round_trip():
    # scripts/profile_kernels.py --decode names configs by probe_decode's tags: parse_tag must invert tag
    from glmq.scripts import probe_decode as P

    for cfg in (DK.DecodeConfig(16, 4, 3, split=4, ring=4), DK.DecodeConfig(16, 8, 2, pdl_early=True, x_smem=True),
                DK.DecodeConfig(32, 4, 2), DK.DecodeConfig(16, 4, 4, split=1, ring=8),
                DK.DecodeConfig(16, 4, 4, split=3, ring=8, step=2),
                DK.DecodeConfig(16, 4, 1, split=4, ring=8, w_smem=True),
                DK.DecodeConfig(16, 4, 1, split=1, ring=8, step=2, w_smem=True),
                DK.DecodeConfig(16, 8, 3, split=4, ring=8, step=2, wgmma=True),
                DK.DecodeConfig(16, 4, 1, split=2, ring=8, step=2, w_smem=True, wgmma=True, scaled_a=True)):
        assert P.parse_tag(P.tag(cfg)) == cfg, cfg
    with pytest.raises(ValueError, match="not a decode config tag"):
        P.parse_tag("R16W4")


def _compile_sm90_in_subprocess(code: str) -> list:
    """Run `code` (which compiles with `w4a16_decode.compile_sm90` and prints a JSON list last, or "SKIP ...") in a
    fresh process without TRITON_INTERPRET; the list, or a pytest skip where this Triton cannot compile Gluon."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(f"this Triton cannot compile Gluon for sm_90 here: {last}")
    return json.loads(last)


def test_decode_kernel_compiles_for_sm90():
    # Compiled ahead of time with the installed Triton's ptxas (no GPU needed), in a fresh process: the
    # dequantized words must become the MMA's A fragments without any data movement (assert_trivial), the
    # words must load 16 bytes at a time, each chunk must issue its m16n8k16 MMAs, nothing may spill, and the
    # main loop may hold no barrier (the only ones are the final cross-warp sum's and, with x_smem, the one after
    # x is staged); the scales load 4 or 8 chunks at a time, never 2 bytes per chunk; with x_smem each chunk's x
    # fragments are four 16-byte shared loads; on SPANS weights without x_smem they are four 16-byte global loads per
    # chunk and 8-token tile (one tile's worth at M = 1). The shared-x kernel (split >= 1) copies x into a ring in
    # shared memory (cp.async) and reads it there with ldmatrix (PAIRS) or 16-byte loads (SPANS), one barrier per
    # `step` chunks; with w_smem the words take the same way (cp.async, then 16-byte shared loads).
    code = """
import json, sys
from glmq.kernels import w4a16_decode as DK
out = []
for cfg, chunks, tok, bf16, xb, pdl, sp in [(DK.DecodeConfig(16, 4, 2), 64, 8, True, True, False, False),
                                            (DK.DecodeConfig(32, 8, 3), 96, 8, False, False, True, False),
                                            (DK.DecodeConfig(16, 2, 1), 8, 16, True, False, False, False),
                                            (DK.DecodeConfig(16, 8, 3, x_smem=True), 96, 8, False, True, True, False),
                                            (DK.DecodeConfig(16, 4, 4, x_smem=True), 64, 8, True, True, False, False),
                                            (DK.DecodeConfig(16, 4, 2), 64, 8, True, True, False, True),
                                            (DK.DecodeConfig(16, 4, 3), 64, 8, False, False, True, True),
                                            (DK.DecodeConfig(16, 4, 2), 32, 16, True, False, False, True),
                                            (DK.DecodeConfig(16, 8, 2, x_smem=True), 96, 8, True, True, False, True),
                                            (DK.DecodeConfig(16, 8, 2, split=4), 96, 16, True, False, False, True),
                                            (DK.DecodeConfig(16, 8, 2, split=6), 96, 16, False, False, True, False),
                                            (DK.DecodeConfig(16, 4, 3, split=1), 16, 8, True, False, False, False),
                                            (DK.DecodeConfig(32, 4, 2, split=4), 96, 8, True, False, False, False),
                                            (DK.DecodeConfig(16, 4, 3, split=4, step=2), 64, 16, True, False, False,
                                             False),
                                            (DK.DecodeConfig(16, 4, 2, split=2, ring=8, step=4), 24, 8, False, False,
                                             False, True),
                                            (DK.DecodeConfig(16, 4, 1, split=4, ring=8, w_smem=True), 96, 16, True,
                                             False, False, False),
                                            (DK.DecodeConfig(32, 4, 1, split=2, ring=4, step=2, w_smem=True), 64, 8,
                                             False, False, True, True),
                                            (DK.DecodeConfig(16, 8, 1, split=8, w_smem=True), 96, 16, True, False, True,
                                             False),
                                            (DK.DecodeConfig(16, 4, 3, split=4, wgmma=True), 96, 16, True, False, False,
                                             False),
                                            (DK.DecodeConfig(16, 8, 2, split=4, ring=8, step=2, wgmma=True), 64, 8,
                                             False, False, True, False),
                                            (DK.DecodeConfig(16, 4, 1, split=4, w_smem=True, wgmma=True), 96, 16, True,
                                             False, False, False),
                                            (DK.DecodeConfig(16, 4, 1, split=1, w_smem=True, wgmma=True), 16, 64, True,
                                             False, False, False),
                                            (DK.DecodeConfig(16, 8, 1, split=3, w_smem=True, wgmma=True), 48, 32, False,
                                             False, True, False),
                                            # the scales in A, one accumulator chained across chunks
                                            (DK.DecodeConfig(16, 4, 1, split=1, w_smem=True, wgmma=True, scaled_a=True),
                                             16, 64, True, False, False, False),
                                            (DK.DecodeConfig(16, 4, 2, split=2, ring=8, step=2, wgmma=True,
                                                             scaled_a=True), 32, 64, False, False, True, False),
                                            (DK.DecodeConfig(16, 4, 3, split=4, wgmma=True, scaled_a=True), 96, 16,
                                             True, False, False, False)]:
    try:
        r = DK.compile_sm90(cfg, chunks, tok, bf16, xb, pdl, sp)
    except RuntimeError as exc:
        print("SKIP", exc); sys.exit(0)
    r.pop("sass")
    out.append(dict(r, rows=cfg.rows, warps=cfg.warps, cpw=chunks // (cfg.split or cfg.warps), tok=tok,
                    xs=cfg.x_smem and xb, sp=sp, xb=xb, split=cfg.split, step=cfg.step, ws=cfg.w_smem, wg=cfg.wgmma,
                    sa=cfg.scaled_a))
print(json.dumps(out))
"""
    for r in _compile_sm90_in_subprocess(code):
        assert r["spills"] == 0 and r["local"] == 0 and r["registers"] <= 255, r
        assert "STL" not in r["ops"] and "LDL" not in r["ops"], r
        if r["wg"]:  # a warpgroup MMA per k16 step and chunk (m64 x TOK), nothing by mma.sync
            assert r["ops"].get("HGMMA") == r["cpw"] * 8 and "HMMA" not in r["ops"], r
        else:
            assert r["ops"].get("HMMA") == r["cpw"] * 8 * (r["rows"] // 16) * (r["tok"] // 8), r
        if r["sa"]:  # the scales multiplied into A (a bf16x2 / f16x2 multiply per weight pair), none into the result
            assert r["ops"].get("HMUL2") == r["cpw"] * r["rows"] * 2 and "FFMA" not in r["ops"], r  # 4 per word
        words = r["cpw"] * r["rows"] // 8  # two 16-byte word loads (or copies) per 16 rows and chunk
        # the words into registers (evict-first), or with w_smem copied into shared memory and read back 16 bytes at
        # a time
        assert r["ldg_words"] == (0 if r["ws"] else words), r
        # the scales: one 8- or 16-byte load per row and 4 or 8 chunks, never a 2-byte load per chunk
        groups = -(-r["cpw"] // (8 if r["rows"] == 16 else 4))
        scale_max = groups * r["rows"] // 8
        assert r["ldg_u16"] == 0 and r["ldg128"] - r["ldg_words"] <= scale_max + (
            0 if r["split"] or not (r["sp"] or r["xs"]) else r["cpw"] * 4 * (1 if r["xb"] else r["tok"] // 8)), r
        if r["split"]:  # the shared-x kernel: x copied into shared memory once (cp.async, no registers), then per
            # chunk and token tile four ldmatrix (PAIRS, natural order) or four 16-byte shared loads (SPANS)
            # x: 16-byte copies per thread (8 warps at 8 tokens: 128 copies a chunk, each made by two threads)
            copies = r["cpw"] * -(-r["tok"] * 16 // (32 * r["warps"]))
            assert r["ops"].get("LDGSTS", 0) == copies + (words if r["ws"] else 0), r
            tiles = r["cpw"] * 4 * (r["tok"] // 8)
            x_lds128, x_ldsm = (0, 0) if r["wg"] else (tiles, 0) if r["sp"] else (0, tiles)  # wgmma: x read by the MMA
            assert (r["lds128"], r["ldsm"]) == (x_lds128 + (words if r["ws"] else 0), x_ldsm), r
            # one barrier per `step` chunks, no more; with wgmma up to three (Triton's barrier analysis adds one
            # before the proxy fence that orders the copies before the tensor cores' reads and, under Triton 3.9, one
            # after a mid-step MMA wait) and that fence, once per step
            steps = -(-r["cpw"] // r["step"])
            assert r["loop_lds_narrow"] == 0 and r["loop_barriers"] <= steps * (3 if r["wg"] else 1), r
            assert r["ops"].get("FENCE", 0) == (steps if r["wg"] else 0), r
        elif r["xs"]:  # x staged in shared memory: four 16-byte shared loads per chunk, x's global loads 16-byte too
            assert r["lds128"] >= r["cpw"] * 4 and r["loop_lds_narrow"] == 0 and r["ldg32"] == 0, r
        elif r["sp"]:  # then x: four 16-byte loads per chunk and token tile (at M = 1 one tile)
            assert r["ldg128"] - r["ldg_words"] >= r["cpw"] * 4 * (1 if r["xb"] else r["tok"] // 8), r
        assert r["split"] or r["loop_barriers"] == 0, r


def test_decode_heuristic_occupancy_sm90():
    # `xshared_heuristic`'s K splits count on programs an SM: up to four of the mma.sync and w_smem configs (8192^2 at
    # M <= 8: 512 programs on 132 SMs), three of the wgmma ones (WGMMA_PROGRAMS_PER_SM); a 4-warp program holds 128
    # threads, 64 K registers an SM: <= 128 registers a thread for four, <= 168 for three; and nothing may spill
    code = """
import json, sys
from glmq.kernels import w4a16_decode as DK
out = []
for m, n, k in ((1, 8192, 8192), (4, 8192, 8192), (16, 6144, 12288), (16, 4096, 6144)):
    cfg = DK.heuristic_config(m, n, k)
    try:
        r = DK.compile_sm90(cfg, k // 128, 1 if m == 1 else 8 if m <= 8 else 16, True, m == 1)
    except RuntimeError as exc:
        print("SKIP", exc); sys.exit(0)
    out.append(dict(m=m, wg=cfg.wgmma, regs=r["registers"], spills=r["spills"]))
print(json.dumps(out))
"""
    res = _compile_sm90_in_subprocess(code)
    assert [r["wg"] for r in res] == [False, False, True, True], res
    for r in res:
        per_sm = DK.WGMMA_PROGRAMS_PER_SM if r["wg"] else 4
        assert r["spills"] == 0 and r["regs"] * 128 * per_sm <= 65536, r


def test_xshared_probes_compile_for_sm90():
    # the shared-x kernel's timing probes leave out what they say (scripts/probe_decode.py times them as TAG/P<n>):
    # 1 the split-K fix-up (no ticket atomic), 2 the dequantization and MMAs (the copies, waits and barriers stay),
    # 3 the dequantization only (no fma of the -8 offset, the MMAs stay), 4 x's refills (only the ring's first
    # XR - 1 = 3 of the program's 8 chunks are copied; the MMAs stay), 5 nothing (the GEMM, and each program's start and
    # end times read from %globaltimer and %clock64 and stored)
    code = """
import json, sys
from glmq.kernels import w4a16_decode as DK
out = []
for i, cfg in enumerate((DK.DecodeConfig(16, 4, 3, split=4), DK.DecodeConfig(16, 4, 2, split=4, wgmma=True),
                         DK.DecodeConfig(16, 4, 2, split=4, wgmma=True, scaled_a=True))):
    for probe in (0, 1, 2, 3, 4, 5):
        try:
            r = DK.compile_sm90(cfg, 32, 16, True, False, False, False, probe)
        except RuntimeError as exc:
            print("SKIP", exc); sys.exit(0)
        ops = dict(r["ops"], timers=r["sass"].count("SR_GLOBALTIMER") + r["sass"].count("SR_CLOCK"))
        out.append(dict(probe=probe, cfg=i, wg=cfg.wgmma, ops=ops))
print(json.dumps(out))
"""
    got = _compile_sm90_in_subprocess(code)
    res = {(r["cfg"], r["probe"]): r["ops"] for r in got}
    for i in range(3):  # mma.sync, wgmma, wgmma with the scales in A
        mma = "HGMMA" if i else "HMMA"
        full, nofix, loads, nodeq, nox, timed = (res[i, p] for p in range(6))
        assert full.get("ATOMG") == 1 and "ATOMG" not in nofix and nofix.get(mma) == full[mma], (full, nofix)
        assert mma not in loads and loads.get("HFMA2", 0) < full["HFMA2"] // 4, loads  # 2: no dequantization, no MMA
        assert loads["LDGSTS"] == full["LDGSTS"] and loads["BAR"] == full["BAR"], (full, loads)  # the ring as it was
        assert nodeq.get(mma) == full[mma] and "HFMA2" not in nodeq and nodeq.get("LOP3", 0) < full["LOP3"] // 4, nodeq
        assert nox.get(mma) == full[mma] and nox["LDGSTS"] * 8 == full["LDGSTS"] * 3, (full, nox)
        assert all(timed.get(op) == full[op] for op in (mma, "LDGSTS", "ATOMG", "HFMA2")), (full, timed)
        assert full["timers"] == 0 and timed["timers"] >= 4 and timed["STG"] >= full["STG"] + 6, (full, timed)


def test_probe_decode_fixup_summary():
    # the timeline's split-K summary (scripts/probe_decode.py --timeline) on made-up PROBE 5 rows: two row blocks of
    # two programs; rows are [SM, start, end, clock start, clock end, ticket, main loop's end, ticket back] in ns
    from glmq.scripts.probe_decode import fixup_summary

    b0 = [[0, 100, 900, 0, 0, 0, 700, 800], [1, 100, 1200, 0, 0, 1, 1000, 1100]]  # reducer: the second (ticket 1)
    b1 = [[2, 110, 1000, 0, 0, 1, 850, 960], [3, 100, 950, 0, 0, 0, 800, 900]]  # reducer: the first
    got = fixup_summary([b0, b1], 100)
    assert got["reducer_tail_ns_max"] == 300 and got["reducer_tail_ns_p50"] == 175  # 1200 - 900, 1000 - 950
    assert got["store_ticket_ns_max"] == 110 and got["store_ticket_ns_p50"] == 100  # 100, 100, 110, 100
    assert got["reducer_sum_ns_p50"] == 70 and got["reducer_sum_ns_max"] == 100  # 1200 - 1100, 1000 - 960
    assert got["exit_ns_p50"] == 75  # 900 - 800, 950 - 900
    assert got["loops_done_ns"] == 900  # the latest main-loop end (1000) from t0
    assert got["critical"] == {"loop_end_ns": 900, "ticket_ns": 1000, "end_ns": 1100, "ticket": 1}


def test_ab_ptxas_summary():
    # scripts/ab_ptxas.py: each variant's launches as the median over rounds, its ratio to the bundled toolchain's
    # median, and cuBLAS fp16 (timed in the same variant's processes) over it; the floors are left out
    from glmq.scripts import ab_ptxas as AB

    def rows(glmq, cublas):
        return [dict(shape="s", m=16, impl="glmq", us=glmq), dict(shape="s", m=16, impl="cublas-fp16", us=cublas),
                dict(shape="s", m=16, impl="floor", us=1.0), dict(shape="s", m=16, impl="gone", status="wrong")]

    runs = {"bundled": [rows(10.0, 30.0), rows(12.0, 30.0), rows(11.0, 33.0)],
            "cuda13": [rows(9.0, 36.0), rows(10.0, 36.0)]}
    got = {(s["variant"], s["impl"]): s for s in AB.summarize(runs)}
    assert set(got) == {(v, i) for v in runs for i in ("glmq", "cublas-fp16")}
    assert got["bundled", "glmq"]["us"] == 11.0 and got["bundled", "glmq"]["vs_bundled"] == 1.0
    assert got["bundled", "glmq"]["vs_cublas"] == 30.0 / 11.0 and got["bundled", "glmq"]["rounds"] == [10.0, 12.0, 11.0]
    assert got["cuda13", "glmq"]["us"] == 9.5 and got["cuda13", "glmq"]["vs_bundled"] == 9.5 / 11.0
    assert got["cuda13", "glmq"]["vs_cublas"] == 36.0 / 9.5 and got["cuda13", "cublas-fp16"]["vs_cublas"] is None
    assert AB.ratios_by_impl(AB.summarize(runs)) == {("cuda13", "glmq"): [9.5 / 11.0]}
    assert AB.parse_variant("x:TRITON_PTXAS_PATH=/a/b=c,K=1") == ("x", {"TRITON_PTXAS_PATH": "/a/b=c", "K": "1"})


def test_sass_digest_pieces():
    # scripts/sass_digest.py: the instructions of a cuobjdump listing with both encoding words, without addresses; the
    # table's Gluon entries (null = the Triton kernel won: left out); a comparison that names what changed
    from glmq.scripts import sass_digest as SD

    listing = """
        code for sm_90
        Function : _xshared_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
                                                                                 /* 0x000fe40000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */
        .L_x_0:
        /*0020*/                   EXIT ;                                        /* 0x000000000000794d */
"""
    ins = SD.sass_instructions(listing)
    assert ins == ["LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */ /* 0x000fe40000000800 */",
                   "S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */",
                   "EXIT ;                                        /* 0x000000000000794d */"]
    # the same code at other addresses digests the same
    assert SD.sass_instructions(listing.replace("/*0010*/", "/*0110*/")) == ins
    cfg = {"rows": 16, "warps": 4, "depth": 3, "split": 4}
    table = {"layout": "pairs", "decode": {"6144,12288,128": {"16": {"plain": cfg, "pdl": None},
                                                              "4": {"plain": None, "pdl": cfg}}}}
    got = SD.table_entries(table)
    assert [(e["key"], e["m"], e["pdl"], e["spans"]) for e in got] == [("6144,12288|4|pdl", 4, True, False),
                                                                        ("6144,12288|16|plain", 16, False, False)]
    old = {"entries": {"a|1|plain": {"tag": "T", "registers": 124, "sass_sha1": "x"},
                       "b|1|plain": {"tag": "U", "registers": 90, "sass_sha1": "y"}}}
    new = {"entries": {"a|1|plain": {"tag": "T", "registers": 128, "sass_sha1": "z"},
                       "b|1|plain": {"tag": "U", "registers": 90, "sass_sha1": "y"},
                       "c|2|pdl": {"tag": "V", "registers": 80, "sass_sha1": "w"}}}
    diff = SD.compare(old, new)
    assert diff == ["a|1|plain (T): SASS differs (registers 124 -> 128)", "c|2|pdl: only in the new digest"], diff
    assert SD.compare(new, new) == []


def test_sass_digest_end_to_end(tmp_path):
    # the script on a one-entry table: digest, the same again (exit 0), then against a digest whose SASS hash differs
    # (exit 1, the entry named); a digest made under other settings is refused (exit 2). Compiles for sm_90 without a
    # GPU, so it skips where this Triton cannot compile Gluon.
    import os
    import subprocess
    import sys

    table = {"device": "x", "layout": "pairs",
             "decode": {"4096,2048,128": {"1": {"plain": {"rows": 16, "warps": 4, "depth": 2}, "pdl": None}}}}
    (tmp_path / "t.json").write_text(json.dumps(table))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DISABLE_LINE_INFO")}

    def run(*extra):
        cmd = [sys.executable, "-m", "glmq.scripts.sass_digest", "--table", str(tmp_path / "t.json"), "--workers", "1",
               *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    first = run("--out", str(tmp_path / "a.json"))
    if first.returncode == 2 and ("RuntimeError: this Triton" in first.stdout or "no cuobjdump" in first.stdout):
        pytest.skip(f"this Triton cannot compile Gluon for sm_90 here: {first.stdout[-500:]}")
    assert first.returncode == 0, first.stdout + first.stderr
    a = json.loads((tmp_path / "a.json").read_text())
    entry = a["entries"]["4096,2048|1|plain"]
    assert entry["tag"] == "R16W4D2" and entry["registers"] > 0 and entry["instructions"] > 100, entry
    same = run("--out", str(tmp_path / "b.json"), "--against", str(tmp_path / "a.json"))
    assert same.returncode == 0 and "0 of 1 entries differ" in same.stdout, same.stdout + same.stderr
    entry["sass_sha1"] = "0" * 40
    (tmp_path / "a.json").write_text(json.dumps(a))
    changed = run("--out", str(tmp_path / "b.json"), "--against", str(tmp_path / "a.json"))
    assert changed.returncode == 1 and "4096,2048|1|plain (R16W4D2): SASS differs" in changed.stdout, changed.stdout
    a["settings"]["line_info"] = not a["settings"]["line_info"]
    (tmp_path / "a.json").write_text(json.dumps(a))
    refused = run("--out", str(tmp_path / "b.json"), "--against", str(tmp_path / "a.json"))
    assert refused.returncode == 2 and "not comparable" in refused.stderr, refused.stdout + refused.stderr


def test_probe_decode_probe_tags():
    # TAG/P<n> names a config's timing probe; the correctness check runs the config itself, once
    from glmq.scripts import probe_decode as P

    got = list(P.variants(6144, 12288, 16, tags=("R16W4D3S4G4", "R16W4D3S4G4/P2", "R16W4D3S4G4H/P1")))
    assert [(P.tag(c), p) for c, p in got] == [("R16W4D3S4G4", 0), ("R16W4D3S4G4", 2), ("R16W4D3S4G4H", 1)]
    cfgs = {P.tag(c) for *_, c, _pdl in P.check_cases(tags=("R16W4D3S4G4", "R16W4D3S4G4/P2"))}
    assert cfgs == {"R16W4D3S4G4"}
    assert P.parse_probe_tag("R16W4D3S4G4H/P3") == (DK.DecodeConfig(16, 4, 3, split=4, wgmma=True), 3)
    assert P.parse_probe_tag("R16W4D2") == (DK.DecodeConfig(16, 4, 2), 0)


def _graph_of(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn()`, captured after a warm-up run of it on the capture stream."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        fn()
    return graph


def _decode_case(m, n, k, dtype, cfg, pdl=False, scale_dtype=torch.bfloat16, layout=None):
    wp, ws = quantized(n, k, group_size=128, scale_dtype=scale_dtype, seed=m + n)
    x = acts(m, k, dtype, seed=k)
    packed = D.prepack(wp, ws, 128, layout)
    out = poisoned(m, n, dtype)
    y = D.w4a16_matmul_packed(x, packed, out=out, config=cfg, pdl=pdl)
    assert y is out
    assert_close(y, R.w4a16_matmul_ref(x, wp, ws, 128), dtype)
    return x, packed, y


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", [DK.DecodeConfig(16, 1, 1), DK.DecodeConfig(32, 2, 2), DK.DecodeConfig(16, 4, 3),
                                 DK.DecodeConfig(16, 8, 2), DK.DecodeConfig(16, 1, 1, x_smem=True),
                                 DK.DecodeConfig(32, 2, 3, x_smem=True), DK.DecodeConfig(16, 8, 2, x_smem=True),
                                 DK.DecodeConfig(16, 4, 4, x_smem=True)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("m, n, k", [(1, 200, 1024), (3, 96, 1024), (8, 2048, 2048), (9, 264, 3072),
                                     (16, 128, 1024), (1, 4096, 6144), (4, 6144, 2048)])  # fmt: skip
@both_mma_layouts
def test_decode_kernel_gpu(m, n, k, cfg, dtype, layout):
    if (k // 128) % cfg.warps:
        pytest.skip("warps must divide the chunks")
    _decode_case(m, n, k, dtype, cfg, scale_dtype=torch.float32 if n == 264 else torch.bfloat16, layout=layout)


XSHARED_CFGS = [DK.DecodeConfig(16, 4, 2, split=1), DK.DecodeConfig(16, 8, 3, split=3),
                DK.DecodeConfig(32, 4, 2, split=2), DK.DecodeConfig(32, 8, 1, split=4, ring=8),
                DK.DecodeConfig(16, 4, 3, split=2, ring=2), DK.DecodeConfig(16, 4, 3, split=2, ring=4, step=2),
                DK.DecodeConfig(16, 4, 2, split=4, ring=8, step=4),  # K = 3072: 6 chunks, the last step short
                DK.DecodeConfig(16, 4, 4, split=3, ring=8, step=2),
                DK.DecodeConfig(16, 4, 1, split=2, ring=8, w_smem=True),
                DK.DecodeConfig(32, 4, 1, split=3, ring=4, step=2, w_smem=True),
                DK.DecodeConfig(16, 8, 1, split=3, ring=4, w_smem=True)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", XSHARED_CFGS, ids=str)
@pytest.mark.parametrize("m, n, k", [(1, 200, 1024), (3, 96, 1024), (8, 2048, 2048), (9, 264, 3072),
                                     (16, 128, 1024), (13, 4096, 6144), (16, 6144, 12288)])  # fmt: skip
@both_mma_layouts
def test_xshared_kernel_gpu(m, n, k, cfg, dtype, layout):
    # the shared-x kernel (warps split rows, programs split K, x through a ring in shared memory): rows past N in the
    # last block, token rows past M, every split with its ticket fix-up
    if (k // 128) % cfg.split:
        pytest.skip("the split must divide the chunks")
    _decode_case(m, n, k, dtype, cfg, scale_dtype=torch.float32 if n == 264 else torch.bfloat16, layout=layout)


XSHARED_WG_CFGS = [DK.DecodeConfig(16, 4, 3, split=4, wgmma=True), DK.DecodeConfig(16, 8, 2, split=3, wgmma=True),
                   DK.DecodeConfig(16, 4, 1, split=1, ring=2, wgmma=True),
                   DK.DecodeConfig(16, 4, 3, split=2, ring=4, step=2, wgmma=True),
                   DK.DecodeConfig(16, 8, 2, split=6, ring=8, step=4, wgmma=True),  # K = 3072: one short step
                   DK.DecodeConfig(16, 4, 1, split=2, ring=4, w_smem=True, wgmma=True),
                   DK.DecodeConfig(16, 8, 1, split=3, ring=8, step=2, w_smem=True, wgmma=True),
                   # the scales in A: one accumulator chained across chunks (words in registers, or from their ring)
                   DK.DecodeConfig(16, 4, 3, split=4, wgmma=True, scaled_a=True),
                   DK.DecodeConfig(16, 4, 2, split=2, ring=8, step=2, wgmma=True, scaled_a=True),
                   DK.DecodeConfig(16, 8, 1, split=3, ring=8, step=2, w_smem=True, wgmma=True, scaled_a=True)]


XSHARED_WG_WIDE_CFGS = [DK.DecodeConfig(16, 4, 1, split=1, ring=4, w_smem=True, wgmma=True),
                        DK.DecodeConfig(16, 4, 1, split=2, ring=2, w_smem=True, wgmma=True),
                        DK.DecodeConfig(16, 8, 1, split=3, ring=4, w_smem=True, wgmma=True),
                        DK.DecodeConfig(16, 4, 1, split=2, ring=8, step=2, w_smem=True, wgmma=True),
                        DK.DecodeConfig(16, 4, 2, split=4, ring=4, wgmma=True),  # words in registers (spills at 64)
                        DK.DecodeConfig(16, 4, 1, split=1, ring=4, w_smem=True, wgmma=True, scaled_a=True),
                        DK.DecodeConfig(16, 4, 1, split=2, ring=8, step=2, w_smem=True, wgmma=True, scaled_a=True),
                        DK.DecodeConfig(16, 4, 2, split=4, ring=4, wgmma=True, scaled_a=True),
                        DK.DecodeConfig(16, 8, 2, split=3, ring=8, step=2, wgmma=True, scaled_a=True)]
# M <= 16 (8 or 16 tokens a chunk) with the configs above; 16 < M <= 64 (32 or 64 tokens, one n32 / n64 warpgroup MMA
# per k16 step) with these
XSHARED_WG_CASES = [(mnk, cfg) for cfg in XSHARED_WG_CFGS
                    for mnk in [(1, 200, 1024), (3, 96, 1024), (9, 264, 3072), (16, 128, 1024), (13, 4096, 6144),
                                (16, 6144, 12288)]] + \
                   [(mnk, cfg) for cfg in XSHARED_WG_WIDE_CFGS
                    for mnk in [(17, 200, 1536), (32, 96, 1536), (33, 264, 3072), (47, 6144, 2048), (64, 4096, 6144),
                                (64, 128, 768)]]  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="warpgroup MMA: sm_90 only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk, cfg", XSHARED_WG_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_xshared_wgmma_gpu(mnk, cfg, dtype):
    # the shared-x kernel with warpgroup MMAs (A from registers, x from the ring by the tensor cores; PAIRS only),
    # token rows past M masked
    m, n, k = mnk
    if (k // 128) % cfg.split:
        pytest.skip("the split must divide the chunks")
    x, packed, y = _decode_case(m, n, k, dtype, cfg, scale_dtype=torch.float32 if n == 264 else torch.bfloat16,
                                layout=D.Layout.PAIRS)
    for pdl in (False, True):  # the same bits on every launch, plain or PDL
        again = D.w4a16_matmul_packed(x, packed, out=poisoned(m, n, dtype), config=cfg, pdl=pdl)
        assert torch.equal(again + 0, y + 0)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the heuristic is the sm_90 rule")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 9, 16])
@pytest.mark.parametrize("n, k", [(200, 1024), (264, 3072), (3072, 5120), (5120, 1536), (18432, 7168)])
@both_mma_layouts
def test_decode_heuristic_gpu(m, n, k, dtype, layout):
    # what an untuned shape gets on an sm_90 GPU (`heuristic_config`, this GPU's SM count): right on odd shapes, and
    # what w4a16_matmul_packed picks by itself there when no launch table names the shape
    cfg = DK.heuristic_config(m, n, k, layout, D.sm_count(DEV))
    if cfg is None:
        pytest.skip("the Triton kernel here")
    _decode_case(m, n, k, dtype, cfg, scale_dtype=torch.float32 if n == 264 else torch.bfloat16, layout=layout)
    packed = D.prepack(*quantized(n, k, group_size=128), 128, layout)
    assert DK.choose(m, packed, DEV, "untuned GPU", False) == cfg


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [4, 16])
@both_mma_layouts
def test_xshared_deterministic_gpu(m, layout):
    # the split-K partials are summed by the last program of each row block in split order: the same bits on every
    # launch, plain or PDL, whichever program arrives last; the tickets are left at zero for the next launch
    cfg = DK.DecodeConfig(16, 8, 2, split=4)
    x, packed, y = _decode_case(m, 6144, 4096, torch.bfloat16, cfg, layout=layout)
    for pdl in (False, True, False, True):
        again = D.w4a16_matmul_packed(x, packed, out=poisoned(m, 6144, torch.bfloat16), config=cfg, pdl=pdl)
        assert torch.equal(again + 0, y + 0)
    torch.cuda.synchronize()
    assert int(D._tickets(x.device, 1).count_nonzero()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", [DK.DecodeConfig(16, 4, 3, split=4), DK.DecodeConfig(16, 4, 3, split=4, wgmma=True),
                                 D.DenseConfig("mma", 16, 64, split_k=4, swap=True)], ids=str)
def test_split_k_graph_replays_gpu(cfg):
    # the split-K fix-ups under the load that once hung a waiting variant (session 26, kernels/NOTES.md): CUDA-graph
    # replays of back-to-back launches, plain and PDL alternating, as a serving engine runs them. Every launch gives
    # the eager launch's bits, and the tickets are all zero afterwards (a lost or an extra count would show there). A
    # hang ends the worker after 120 s (faulthandler) instead of stalling the run.
    import faulthandler

    if getattr(cfg, "wgmma", False) and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    m, n, k = 16, 6144, 4096  # 96 row blocks x 4 splits: one wave of the shared-x kernel on an H200, as at GLM sizes
    wp, ws = quantized(n, k, group_size=128, seed=3)
    x = acts(m, k, torch.bfloat16, seed=4)
    packed = D.prepack(wp, ws, 128, D.Layout.PAIRS)
    y = D.w4a16_matmul_packed(x, packed, config=cfg)
    outs = [poisoned(m, n, torch.bfloat16) for _ in range(8)]

    def chain():
        for i in range(48):
            D.w4a16_matmul_packed(x, packed, out=outs[i % len(outs)], config=cfg, pdl=i % 2 == 1)

    faulthandler.dump_traceback_later(120, exit=True)
    try:
        graph = _graph_of(chain)  # its warm-up runs the chain once eagerly
        for o in outs:
            o.fill_(float("nan"))
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
    finally:
        faulthandler.cancel_dump_traceback_later()
    for o in outs:
        assert torch.equal(o + 0, y + 0)
    assert int(D._tickets(x.device, 1).count_nonzero()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 5])
@both_mma_layouts
def test_decode_kernel_deterministic_and_pdl_bits_gpu(m, layout):
    # the warps' partial sums meet in shared memory in warp order: the same bits every launch, with or without PDL,
    # with x staged in shared memory or not
    cfg = DK.DecodeConfig(16, 8, 2)
    x, packed, y = _decode_case(m, 6144, 2048, torch.bfloat16, cfg, layout=layout)
    for pdl, early, xs in ((False, False, False), (True, False, False), (False, False, False), (True, True, False),
                           (False, False, True), (True, True, True)):
        again = D.w4a16_matmul_packed(x, packed, out=poisoned(m, 6144, torch.bfloat16),
                                      config=dataclasses.replace(cfg, pdl_early=early, x_smem=xs), pdl=pdl)
        assert torch.equal(again + 0, y + 0)  # x_smem: the same B fragments, from shared memory, the same MMAs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("kernel", ["split-warps", "shared-x"])
@both_mma_layouts
def test_decode_pdl_dependent_chain_gpu(m, layout, kernel):
    # as test_dense_pdl_dependent_chain_gpu, on the Gluon kernel: every launch reads the previous one's output, and a
    # chain of pdl=True launches (eager and in a graph) must equal the plain chain bit for bit
    n, k = 2048, 6144
    raw = []
    for seed, (rows, cols) in enumerate(((n, k), (k, n))):
        wp, ws = quantized(rows, cols, group_size=128, seed=seed)
        raw.append((wp, (ws.float() / math.sqrt(cols)).to(ws.dtype)))
    ws_ = [D.prepack(wp, ws, 128, layout) for wp, ws in raw]
    cfgs = ([DK.DecodeConfig(16, 8, 2, pdl_early=True, x_smem=True), DK.DecodeConfig(16, 4, 3)]  # both trigger points
            if kernel == "split-warps" else [DK.DecodeConfig(16, 8, 2, split=4), DK.DecodeConfig(32, 4, 2, split=2)])
    x0 = acts(m, k, torch.bfloat16)
    bufs = [poisoned(m, n if i % 2 == 0 else k, torch.bfloat16) for i in range(16)]

    def chain(pdl: bool):
        for b in bufs:
            b.fill_(float("nan"))
        x = x0
        for i, b in enumerate(bufs):
            x = D.w4a16_matmul_packed(x, ws_[i % 2], out=b, config=cfgs[i % 2], pdl=pdl)
        return bufs

    want = [b.clone() for b in chain(False)]
    assert torch.isfinite(want[-1]).all() and want[-1].abs().max() > 1e-3
    assert_close(want[0], R.w4a16_matmul_ref(x0, *raw[0], 128), torch.bfloat16)
    got = chain(True)
    torch.cuda.synchronize()
    assert all(torch.equal(g + 0, w + 0) for g, w in zip(got, want)), "pdl=True differs (eager)"
    graph = _graph_of(lambda: chain(True))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g + 0, w + 0) for g, w in zip(bufs, want)), "pdl=True differs (CUDA graph)"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, k", [(8192, 8192), (6144, 12288), (4096, 6144), (6144, 2048)])
@pytest.mark.parametrize("m", [1, 2, 4, 17, 64])
def test_decode_dispatch_glm_shapes_gpu(m, n, k):
    # whatever w4a16_matmul picks at decode (the Gluon kernel where its table or rule says so) is right
    run_dense(m, n, k, 128, torch.bfloat16)
    x, wp, ws = acts(m, k, torch.bfloat16), *quantized(n, k, group_size=128)
    assert_close(D.w4a16_matmul(x, wp, ws, 128, pdl=True), R.w4a16_matmul_ref(x, wp, ws, 128), torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# GLM-5 shapes on a GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, k", [(24576, 6144), (6144, 12288), (4096, 6144), (6144, 2048)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024])
def test_dense_glm_shapes_gpu(m, n, k):
    run_dense(m, n, k, 128, torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, k, split", [(8192, 8192, 6), (6144, 12288, 8), (24576, 6144, 2), (6144, 2048, 16)])
def test_dense_m1_mailbox_glm_shapes_gpu(n, k, split):
    # the mailbox at decode on the H200 launch grids (384 programs; 16 splits: two groups of eight), many
    # launches in a row: the same values as the ticket fix-up every time, and the words left empty
    wp, ws = quantized(n, k, group_size=128)
    x = acts(1, k, torch.bfloat16)
    packed = D.prepack(wp, ws, 128)
    cfg = D.DenseConfig("mma", 16, 128, split_k=split, swap=True, num_stages=4)
    ticket = D.w4a16_matmul_packed(x, packed, config=D.DenseConfig(**{**cfg.to_dict(), "mailbox": False}))
    assert_close(ticket, R.w4a16_matmul_ref(x, wp, ws, 128), torch.bfloat16)
    outs = [D.w4a16_matmul_packed(x, packed, out=poisoned(1, n, torch.bfloat16), config=cfg) for _ in range(50)]
    torch.cuda.synchronize()
    for y in outs:
        assert torch.equal(y + 0, ticket + 0)
    assert _mailbox_clean()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["late", "early", "auto"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(8192, 8192), (2048, 6144)])
def test_dense_pdl_dependent_chain_gpu(n, k, m, mode):
    # A chain in which every GEMM reads the previous one's output (W0: k -> n, W1: n -> k, alternating), as a
    # decode step's layers do. With pdl=True each launch starts while the one before still runs, so a read of
    # x, a ticket or a store issued before its wait would see a NaN-poisoned or stale buffer. Eager and in a
    # CUDA graph, every step must equal the plain launches' bits (same configs: mailbox at M = 1, tickets above).
    raw = []
    for seed, (rows, cols) in enumerate(((n, k), (k, n))):
        wp, ws = quantized(rows, cols, group_size=128, seed=seed)
        raw.append((wp, (ws.float() / math.sqrt(cols)).to(ws.dtype)))  # keeps |y| ~ |x| along the chain
    ws_ = [D.prepack(wp, ws, 128) for wp, ws in raw]
    x0 = acts(m, k, torch.bfloat16)
    steps = 24
    bufs = [poisoned(m, n if i % 2 == 0 else k, torch.bfloat16) for i in range(steps)]

    cfgs = [D.choose_config(m, w.n, w.k, 128, D.sm_count(DEV), D.device_name(DEV), w.layout) for w in ws_]
    cfgs = [dataclasses.replace(c, pdl_mode=mode) for c in cfgs]

    def chain(pdl: bool) -> list[torch.Tensor]:
        for b in bufs:
            b.fill_(float("nan"))
        x = x0
        for i in range(steps):
            x = D.w4a16_matmul_packed(x, ws_[i % 2], out=bufs[i], config=cfgs[i % 2], pdl=pdl)
        return bufs

    want = [b.clone() for b in chain(False)]
    assert torch.isfinite(want[-1]).all() and want[-1].abs().max() > 1e-3
    assert_close(want[0], R.w4a16_matmul_ref(x0, *raw[0], 128), torch.bfloat16)
    for _ in range(3):
        got = chain(True)
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g + 0, w + 0), f"step {i} differs with pdl=True (eager)"
    graph = _graph_of(lambda: chain(True))
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(bufs, want)):
            assert torch.equal(g + 0, w + 0), f"step {i} differs with pdl=True (CUDA graph)"
    assert _mailbox_clean()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 16, 256])
def test_moe_glm_shapes_gpu(m):
    run_moe(m, 6144, 2048, num_experts=256, topk=8, g=128, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# int32 row offsets: launches split by rows (a limit lowered so that small shapes cross it)
# ------------------------------------------------------------------------------------------------


def test_dense_rows_beyond_the_int32_index_limit_are_split(monkeypatch):
    """The kernels compute row offsets in int32, so M x max(N, K) >= 2^31 (M ~ 87K at 6144->24576) would address
    wrong rows; the wrapper splits such an M into launches of whole row slices, with the same result."""
    wp, ws = quantized(64, 256, group_size=128)
    x = acts(37, 256, torch.float16)
    ref = D.w4a16_matmul(x, wp, ws, 128, config=D.DenseConfig("mma", 16, 64, split_k=2))
    launched = []
    real = D._launch
    monkeypatch.setattr(D, "_launch", lambda x, *a, **k: (launched.append(x.shape[0]), real(x, *a, **k)))
    monkeypatch.setattr(D, "INDEX_LIMIT", 10 * 256 + 1)  # 10 rows of x [., 256] per launch
    out = poisoned(37, 64, torch.float16)
    y = D.w4a16_matmul(x, wp, ws, 128, out=out, config=D.DenseConfig("mma", 16, 64, split_k=2))
    assert launched == [10, 10, 10, 7] and y is out
    assert torch.equal(y, ref)  # row slices of one launch: the same bits


def test_moe_tokens_beyond_the_int32_index_limit_are_split(monkeypatch):
    """The grouped launches index assignment rows (M x topk of them) of width H or I in int32: above the limit the
    wrapper runs token slices, with the same result."""
    m, hidden, inter, e, topk, g = 21, 128, 128, 4, 2, 64
    w13p, w13s = quantized(e, 2 * inter, hidden, group_size=g, seed=3)
    w2p, w2s = quantized(e, hidden, inter, group_size=g, seed=4)
    x = acts(m, hidden, torch.bfloat16)
    tw, ti = routing(m, e, topk)
    cfg = MO.MoeConfig(16, 128, 128)
    ref = MO.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, tw, ti, g, config=cfg)
    launched = []
    real = MO._launch_experts
    monkeypatch.setattr(MO, "_launch_experts", lambda x, *a: (launched.append(x.shape[0]), real(x, *a)))
    monkeypatch.setattr(D, "INDEX_LIMIT", 8 * topk * hidden + 1)  # 8 tokens per launch pair
    out = poisoned(m, hidden, torch.bfloat16)
    y = MO.fused_moe_w4a16(x, w13p, w13s, w2p, w2s, tw, ti, g, out=out, config=cfg)
    assert launched == [8, 8, 5] and y is out
    assert torch.equal(y, ref)
