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
