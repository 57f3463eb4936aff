"""Packing is bit-exact against compressed-tensors' own pack/unpack, with golden words."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from glmq.quantize.pack import pack_int32, pack_zero_point, packed_shape, unpack_int32, unpack_zero_point

SHAPES = [(1, 1), (3, 8), (5, 37), (17, 128), (7, 250), (64, 6144 // 8)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_matches_compressed_tensors(bits, shape):
    g = torch.Generator().manual_seed(hash((bits, shape)) % 2**31)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8, generator=g)
    ours = pack_int32(q, bits)
    assert ours.dtype == torch.int32 and tuple(ours.shape) == packed_shape(shape, bits)
    assert torch.equal(ours, pack_to_int32(q, bits))
    assert torch.equal(unpack_int32(ours, shape[1], bits), q)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size(shape)), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(8, 3), (13, 5), (64, 48), (3, 2), (8, 1), (13, 1), (256, 1), (1, 1)])
def test_zero_point_packs_along_dim0_like_compressed_tensors(bits, shape):
    """Including one group per row (`[N, 1]`, K == group_size) and one packed word per group (N <= 32 / B),
    whose transposes are "contiguous" with strides a byte view rejects."""
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8,
                      generator=torch.Generator().manual_seed(1))
    ours = pack_zero_point(q, bits)
    assert torch.equal(ours, pack_to_int32(q, bits, packed_dim=0))
    assert ours.stride() == (ours.shape[1], 1)
    back = unpack_zero_point(ours, shape[0], bits)
    assert torch.equal(back, q) and back.stride() == (shape[1], 1)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size(shape), packed_dim=0), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_accepts_any_strides(bits):
    """A `[1, K]` row with stride (1, 1) (the transpose of `[K, 1]`) counts as contiguous."""
    q = torch.randint(-8, 8, (24, 1), dtype=torch.int8, generator=torch.Generator().manual_seed(2)).t()
    assert q.is_contiguous() and q.stride() == (1, 1)
    ours = pack_int32(q, bits)
    assert torch.equal(ours, pack_to_int32(q.clone(memory_format=torch.contiguous_format), bits))
    assert torch.equal(unpack_int32(ours.t().contiguous().t(), 24, bits), q)  # [1, W] int32, stride (1, 1)


def test_golden_words():
    """formats.md §2c worked examples: +8 offset, LSB first, two's-complement int32."""
    rows = torch.tensor([[0] * 8, [1, 2, 3, 4, 5, 6, 7, -8], [-8] * 8, [7] * 8], dtype=torch.int8)
    assert pack_int32(rows, 4).flatten().tolist() == [-2004318072, 267242409, 0, -1]


def test_pack_rejects_wrong_input():
    with pytest.raises(ValueError):
        pack_int32(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError):
        pack_int32(torch.zeros(2, 8, dtype=torch.int8), num_bits=3)
