"""FP8 source weights -> floating point, in PyTorch (any device). The reference for fused_cpu.py.

Block FP8 (DeepSeek-V3 README_WEIGHTS.md, compressed-tensors FP8BlockDequantizer): every bn x bk
block of the float8_e4m3fn weight is *multiplied* by its float32 `weight_scale_inv`; dimensions that
are not a multiple of the block are padded. The product is formed in float32 and rounded to bf16.

Why bf16 and not float32 for the values that are then quantized: it is the dtype the released model
runs in and what compressed-tensors' dequantizer and llm-compressor's model-free path produce, so
glmq's INT4 output is bit-identical to theirs (tests assert it) and the scales come out in the
checkpoint's dtype, which is what `weight_scale` must hold. The extra rounding is 2^-9 relative,
about 1/200 of an INT4 step at the group's absmax.
"""

from __future__ import annotations

import torch


class NonFiniteWeightError(ValueError):
    """A source weight holds (or decodes to) NaN or Inf. Raised by the fused CPU kernels and the PyTorch path
    alike (quantize/ops.py); the engine (quantize/stream.py) adds the file, the tensor and what to do."""

    @classmethod
    def in_rows(cls, rows: list[int]) -> NonFiniteWeightError:
        """The error for these rows of a row block (the first eight are named)."""
        return cls(f"NaN or Inf in rows {rows[:8]}{' ...' if len(rows) > 8 else ''}")


def dequantize_block(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float8_e4m3fn `[N, K]` x float32 `[ceil(N/bn), ceil(K/bk)]` -> `[N, K]` in `dtype`."""
    n, k = w8.shape
    bn, bk = block
    rb, cb = -(-n // bn), -(-k // bk)
    if tuple(scale_inv.shape) != (rb, cb):
        raise ValueError(f"scale_inv shape {list(scale_inv.shape)} does not fit weight {[n, k]} with blocks {block}")
    w = w8.to(torch.float32)
    if (rb * bn, cb * bk) != (n, k):
        w = torch.nn.functional.pad(w, (0, cb * bk - k, 0, rb * bn - n))
    w = w.view(rb, bn, cb, bk).mul_(scale_inv.to(torch.float32)[:, None, :, None])
    return w.view(rb * bn, cb * bk)[:n, :k].to(dtype)


def dequantize_channel(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """compressed-tensors float-quantized FP8: per-channel `[N, 1]` or per-tensor scale, as its
    `dequantize` does (`x_q.to(scale.dtype) * scale`), then cast to `dtype`."""
    return (w8.to(scale.dtype) * scale.reshape(-1, 1) if scale.numel() > 1 else w8.to(scale.dtype) * scale.reshape(())).to(dtype)
