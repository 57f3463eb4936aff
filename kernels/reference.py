"""Plain-PyTorch float32 references for the W4A16 kernels (style.md principle 5).

Every Triton kernel in this package is tested against the function here with the same name root:
    w4a16_dense.w4a16_matmul    <->  w4a16_matmul_ref
    w4a16_moe.fused_moe_w4a16   <->  moe_w4a16_ref

Layout (formats.md §2a-2c, compressed-tensors `pack-quantized`, symmetric int4):
    weight_packed  int32 [N, K/8]   element k of row n is word k // 8, bits [4*(k%8), 4*(k%8)+4), LSB
                                    first, stored unsigned as u = q + 8 (uint4b8)
    weight_scale   fp16|bf16|fp32 [N, K/group_size]
    dequant        w[n, k] = (u[n, k] - 8) * scale[n, k // group_size]
The unpacking goes through `glmq.quantize.pack.unpack_int32`, whose bit order tests/test_pack.py pins
against compressed-tensors itself, so the kernels are checked against the checkpoint format and not
against a second copy of their own bit tricks.

MoE convention (the one vLLM/SGLang use for a fused `w13`): expert e's `w13[e]` is `[2I, H/8]` packed,
rows `[0, I)` are gate_proj and rows `[I, 2I)` are up_proj; `w2[e]` is down_proj `[H, I/8]` packed;
    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j],
where an id of -1 means "expert not on this rank" (vLLM's expert parallelism): that term is dropped.
"""

from __future__ import annotations

import torch

from glmq.quantize.pack import unpack_int32, unpack_zero_point


def dequantize_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize one compressed-tensors pack-quantized int4 weight to float32.

    Args:
        weight_packed: int32 `[N, K/8]`, LSB-first nibbles holding q + 8.
        weight_scale: fp16/bf16/fp32 `[N, K/group_size]`.
        group_size: input columns per scale; K = weight_scale.shape[1] * group_size.
        zero_point: None for symmetric weights; otherwise either int8 `[N, K/group_size]` signed zero
            points (as `quantize.rtn.QWeight.zero_point`) or the checkpoint's int32 form packed along
            dim 0, `[ceil(N/8), K/group_size]` (formats.md §2a).
    Returns:
        float32 `[N, K]` = (q - zp) * scale.
    Raises:
        ValueError: if the shapes do not agree.
    """
    n, groups = weight_scale.shape
    k = groups * group_size
    if weight_packed.shape != (n, k // 8):
        raise ValueError(
            f"weight_packed {list(weight_packed.shape)} does not match weight_scale {list(weight_scale.shape)} "
            f"with group_size {group_size}: expected [{n}, {k // 8}]"
        )
    q = unpack_int32(weight_packed, k).float()  # (N, K) values in [-8, 7]
    if zero_point is not None:
        zp = zero_point
        if zero_point.dtype == torch.int32:  # packed: unpacking an int32 [N, groups] of plain values would give
            # [N, groups] of garbage that the check below lets through
            if zero_point.shape != (-(-n // 8), groups):
                raise ValueError(f"int32 zero_point {list(zero_point.shape)} is not the checkpoint's form packed along "
                                 f"dim 0, [ceil(N/8), K/group_size] = [{-(-n // 8)}, {groups}]; pass unpacked zero "
                                 f"points as int8 [{n}, {groups}]")
            zp = unpack_zero_point(zero_point, n)
        if zp.shape != (n, groups):
            raise ValueError(f"zero_point unpacks to {list(zp.shape)}, expected [{n}, {groups}]")
        q = q - zp.float().repeat_interleave(group_size, dim=1)
    return q * weight_scale.float().repeat_interleave(group_size, dim=1)


def w4a16_matmul_ref(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`x @ dequant(W).T` in float32.

    Args:
        x: fp16/bf16 `[M, K]` activations.
        weight_packed: int32 `[N, K/8]`.
        weight_scale: `[N, K/group_size]`.
        group_size: 32, 64 or 128.
    Returns:
        float32 `[M, N]`.
    """
    return x.float() @ dequantize_packed(weight_packed, weight_scale, group_size).T


def moe_w4a16_ref(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Routed SwiGLU experts over int4 weights, in float32 (see the module docstring for the layout).

    Only the experts that some token selects are dequantized, one at a time.

    Args:
        x: fp16/bf16 `[M, H]`.
        w13_packed: int32 `[E, 2I, H/8]`; rows [0, I) gate_proj, rows [I, 2I) up_proj.
        w13_scale: `[E, 2I, H/group_size]`.
        w2_packed: int32 `[E, H, I/8]` (down_proj).
        w2_scale: `[E, H, I/group_size]`.
        topk_ids: integer `[M, topk]`, expert of each (token, slot), values in [0, E), or -1 for an
            expert not on this rank: that (token, slot) contributes nothing.
        topk_weights: float `[M, topk]`, router weight of each (token, slot).
        group_size: 32, 64 or 128.
    Returns:
        float32 `[M, H]`.
    Raises:
        ValueError: on an expert id outside [0, E) other than -1 (not Python's negative indexing).
    """
    m, hidden = x.shape
    num_experts, two_i = w13_packed.shape[:2]
    inter = two_i // 2
    bad = topk_ids[(topk_ids < -1) | (topk_ids >= num_experts)]
    if bad.numel():
        raise ValueError(f"topk_ids holds expert ids in [{int(bad.min())}, {int(bad.max())}], outside [0, E) with "
                         f"E = {num_experts} (only -1, 'expert not on this rank', may lie outside)")
    xf = x.float()
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if e == -1:  # expert not on this rank: dropped
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w13 = dequantize_packed(w13_packed[e], w13_scale[e], group_size)  # (2I, H)
        w2 = dequantize_packed(w2_packed[e], w2_scale[e], group_size)  # (H, I)
        gate_up = xf[tok] @ w13.T  # (T_e, 2I)
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ w2.T) * topk_weights[tok, slot].float().unsqueeze(1)
        out.index_add_(0, tok, y)
    return out
