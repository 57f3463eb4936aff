"""The kernels' Python wrappers, without running a kernel: the prepack cache follows the weight it was made
from; preconditions the kernels cannot handle are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from glmq.kernels import w4a16_dense as dense  # noqa: E402


def _weight(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (64, 32), dtype=torch.int32, generator=g)  # [N, K/8], K = 256
    scale = (torch.rand(64, 2, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    return packed, scale


def test_cache_follows_in_place_writes_storage_swaps_and_clears():
    packed, scale = _weight(0)
    first = dense.cached_prepack(packed, scale, 128)
    assert dense.cached_prepack(packed, scale, 128) is first  # the same weight: the cached copy
    new, _ = _weight(1)
    packed.copy_(new)  # in place through the tensor itself: its version moves
    second = dense.cached_prepack(packed, scale, 128)
    assert second is not first and torch.equal(second.qweight, dense.prepack(new, scale, 128).qweight)
    packed.data = _weight(2)[0]  # a new storage under the same tensor (a weight loader's `param.data = t`)
    third = dense.cached_prepack(packed, scale, 128)
    assert third is not second and torch.equal(third.qweight, dense.prepack(packed, scale, 128).qweight)
    packed.data.copy_(_weight(3)[0])  # through `.data`: neither storage nor version moves, so not seen ...
    assert dense.cached_prepack(packed, scale, 128) is third
    dense.clear_prepack_cache()  # ... until the cache is cleared
    assert torch.equal(dense.cached_prepack(packed, scale, 128).qweight, dense.prepack(packed, scale, 128).qweight)


def test_inference_tensors_are_cached():
    """Weights loaded under torch.inference_mode (as serving engines load them) have no version counter."""
    with torch.inference_mode():
        packed, scale = _weight(4)
    first = dense.cached_prepack(packed, scale, 128)
    assert dense.cached_prepack(packed, scale, 128) is first
    with torch.inference_mode():
        first2 = dense.cached_prepack(packed, scale, 128)
    assert first2 is first


def test_out_sharing_memory_with_x_is_refused():
    """Programs write their output tiles while others still read x: an `out` over x gave a relative error of 11."""
    big = torch.empty(4 * 256 + 4 * 64, dtype=torch.bfloat16)
    xs, inside = big[:4 * 256].view(4, 256), big[4 * 256 - 16:4 * 256 - 16 + 4 * 64].view(4, 64)
    with pytest.raises(ValueError, match="must not share memory with x"):
        dense.check_out(inside, (4, 64), xs)  # what w4a16_matmul[_packed] and fused_moe_w4a16 check `out` with
    dense.check_out(big[4 * 256:].view(4, 64), (4, 64), xs)  # the same storage, after x: fine


def test_default_config_reads_chunk_major_planes_weights(monkeypatch):
    """`prepack(..., layout="planes", chunk_major=True)` is a documented option, but at M <= 2 the default config was
    the GEMV, which cannot read chunk-major words: every decode call was a ValueError."""
    launched = []
    monkeypatch.setattr(dense, "_INTERPRETED", True)  # CPU x accepted; no kernel runs: `_launch` is recorded
    monkeypatch.setattr(dense, "_launch", lambda x, w, out, cfg, pdl=False: launched.append(cfg))
    packed, scale = _weight(5)
    w = dense.prepack(packed, scale, 128, layout="planes", chunk_major=True)
    for m in (1, 2, 16):
        dense.w4a16_matmul_packed(torch.zeros(m, 256, dtype=torch.bfloat16), w)
    assert [c.swap for c in launched] == [True] * 3
    assert dense.choose_config(1, 64, 256, 128, chunk_major=True).swap
    assert dense.choose_config(1, 64, 256, 128).kind is dense.KernelKind.GEMV  # row-major PLANES: still the GEMV


def test_chunk_major_needs_128_column_chunks():
    """Only the transposed MMA kernel reads chunk-major words, 128-column chunks: K = 192 so prepacked ran nowhere."""
    g = torch.Generator().manual_seed(6)
    packed = torch.randint(-2**31, 2**31 - 1, (64, 24), dtype=torch.int32, generator=g)  # K = 192: chunk 64
    scale = torch.rand(64, 3, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="chunk_major=True needs K to be a multiple of 128"):
        dense.prepack(packed, scale, 64, layout="planes", chunk_major=True)
    assert not dense.prepack(packed, scale, 64).chunk_major


def test_reference_refuses_int32_zero_points_not_packed():
    """An int32 zero point is the checkpoint's form, packed 8 rows a word: an int32 [N, groups] of plain values
    unpacked to garbage of the right shape (max error 18 against the truth) instead of an error."""
    from glmq.kernels import reference
    from glmq.quantize.pack import pack_int32, pack_zero_point

    g = torch.Generator().manual_seed(7)
    q = torch.randint(-8, 8, (16, 256), dtype=torch.int8, generator=g)
    zp = torch.randint(-8, 8, (16, 4), dtype=torch.int8, generator=g)
    scale = torch.rand(16, 4, generator=g) + 0.5
    want = (q.float() - zp.float().repeat_interleave(64, dim=1)) * scale.repeat_interleave(64, dim=1)
    assert torch.equal(reference.dequantize_packed(pack_int32(q), scale, 64, pack_zero_point(zp)), want)
    assert torch.equal(reference.dequantize_packed(pack_int32(q), scale, 64, zp), want)
    with pytest.raises(ValueError, match=r"int32 zero_point \[16, 4\] is not the checkpoint's form"):
        reference.dequantize_packed(pack_int32(q), scale, 64, zp.to(torch.int32))


def test_chunk_major_words_have_row_major_strides_for_one_row():
    """`.contiguous()` kept the transposed view's strides of an N = 1 weight (rows 64 words apart here), which the
    Gluon decode kernel refuses ("needs contiguous chunk-major words (as `prepack` makes them)")."""
    g = torch.Generator().manual_seed(8)
    packed = torch.randint(-2**31, 2**31 - 1, (1, 64), dtype=torch.int32, generator=g)  # N = 1, K = 512
    w = dense.prepack(packed, torch.rand(1, 4, generator=g).to(torch.bfloat16), 128)
    assert w.chunk_major and w.qweight.shape == (4, 1, 16) and w.qweight.stride() == (16, 16, 1)
    assert w.word_strides() == (16, 16)


def test_prepack_of_a_1d_weight_is_a_clear_error():
    """A 1-D weight_packed (a flattened tensor) ended in a bare 'not enough values to unpack' inside prepack."""
    with pytest.raises(ValueError, match=r"weight_packed must be \[\.\.\., N, K/8\].*got shape \[32\]"):
        dense.prepack(torch.zeros(32, dtype=torch.int32), torch.ones(2, dtype=torch.bfloat16), 128)
