"""The layer-input Hessian GPTQ needs: H = (2/n) sum_t x_t x_t^T over n calibration tokens.

`HessianAccumulator` keeps the raw float32 sum S = sum x x^T and the token count n, and divides only in
`finalize()`. Keeping the sum (instead of the reference gptq.py's running average, which rescales H by
n/(n+m) on every batch) makes batching and merging plain additions: accumulators from several batches,
workers or processes combine exactly, weighted by their token counts, and `state_dict()` holds only
tensors, so a `torch.distributed.all_reduce` of both entries or a safetensors file carries it.
"""

from __future__ import annotations

import torch


def symmetric_panels(k: int) -> list[tuple[int, int]]:
    """Row panels of the block upper triangle `add` computes: at most 8 of at least 256 rows."""
    step = max(256, -(-k // 8))
    return [(i, min(i + step, k)) for i in range(0, k, step)]


class HessianAccumulator:
    """Running sum of x x^T over the tokens fed to one Linear layer.

    On a CPU only the block upper triangle of the sum is accumulated and kept: row panel [i0, i1) from
    column i0 on (`symmetric_panels`), each panel its own tensor. The sum is symmetric, and the panels'
    products take 56-63 % of a full x^T x's flops (measured 18 vs 28 ms for 4096 tokens at K = 1024 on
    this project's CPU; the calibration pass is bound by these products and the experts' forwards), and
    62.5 % of its memory at K = 1024 (a MoE layer of the scaling model holds 49 of them: 123 MB instead of
    196). The products are the same float32 GEMMs into the same shapes as when the panels were views of
    one K x K matrix (the same bits). On a GPU the one panel is the whole matrix (one launch: a GPU has
    flops to spare). `finalize` and `state_dict` mirror the panels into the whole sum; torch has no
    symmetric rank-k update to call instead.

    Attributes:
        panels: float32 `[i1 - i0, K - i0]` per row panel (`bounds`), the sum over tokens of x x^T there.
        num_tokens: tokens accumulated so far.
    """

    def __init__(self, num_columns: int, device: torch.device | str | None = None) -> None:
        """Args: num_columns: K, the layer's input size; device: where the sum lives (CPU or CUDA)."""
        if num_columns <= 0:
            raise ValueError(f"num_columns must be positive, got {num_columns}")
        device = torch.device(device if device is not None else "cpu")
        self.k = num_columns
        self.bounds = symmetric_panels(num_columns) if device.type == "cpu" else [(0, num_columns)]
        self.panels = [torch.zeros(i1 - i0, num_columns - i0, dtype=torch.float32, device=device)
                       for i0, i1 in self.bounds]
        self.num_tokens = 0

    @property
    def num_columns(self) -> int:
        return self.k

    @property
    def device(self) -> torch.device:
        return self.panels[0].device

    def add(self, x: torch.Tensor) -> None:
        """Accumulate activations `x` `[..., K]` (any leading dims, any float dtype, any device).

        Every leading index is one token. The product runs in float32 on the accumulator's device.
        """
        k = self.num_columns
        if x.shape[-1] != k:
            raise ValueError(f"activations have {x.shape[-1]} features, the accumulator expects {k}")
        x = x.reshape(-1, k).to(device=self.device, dtype=torch.float32)  # (T, K)
        for (i0, i1), p in zip(self.bounds, self.panels):
            p.addmm_(x[:, i0:i1].t(), x[:, i0:])
        self.num_tokens += x.shape[0]

    def _full_sum(self) -> torch.Tensor:
        """The whole symmetric sum `[K, K]` (a new tensor), the panels' lower parts mirrored from above."""
        full = torch.empty(self.k, self.k, dtype=torch.float32, device=self.device)
        for (i0, i1), p in zip(self.bounds, self.panels):
            full[i0:i1, i0:] = p
            full[i0:i1, :i0] = full[:i0, i0:i1].t()
        return full

    def merge(self, other: HessianAccumulator) -> HessianAccumulator:
        """Add `other`'s tokens to this accumulator (in place) and return self.

        Raises:
            ValueError: if the two have different K.
        """
        if other.num_columns != self.num_columns:
            raise ValueError(f"cannot merge Hessians of size {other.num_columns} and {self.num_columns}")
        if other.bounds == self.bounds:  # the block upper triangles add up
            for p, q in zip(self.panels, other.panels):
                p += q.to(p.device)
        else:  # a CPU and a GPU accumulator
            full = other._full_sum().to(self.device)
            for (i0, i1), p in zip(self.bounds, self.panels):
                p += full[i0:i1, i0:]
        self.num_tokens += other.num_tokens
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{"xxt_sum": float32 [K, K] (the whole symmetric sum), "num_tokens": int64 scalar}: plain tensors
        (torch.save, safetensors, all_reduce)."""
        return {"xxt_sum": self._full_sum(), "num_tokens": torch.tensor(self.num_tokens, dtype=torch.int64)}

    @classmethod
    def from_state_dict(
        cls, state: dict[str, torch.Tensor], device: torch.device | str | None = None
    ) -> HessianAccumulator:
        """Inverse of `state_dict`, optionally moving the sum to `device`."""
        xxt = state["xxt_sum"]
        if xxt.ndim != 2 or xxt.shape[0] != xxt.shape[1]:
            raise ValueError(f"xxt_sum must be a square matrix, got {list(xxt.shape)}")
        acc = cls(xxt.shape[0], device=device if device is not None else xxt.device)
        for (i0, i1), p in zip(acc.bounds, acc.panels):
            p.copy_(xxt[i0:i1, i0:])
        acc.num_tokens = int(state["num_tokens"])
        return acc

    def finalize(self) -> torch.Tensor:
        """H = (2 / n) * sum x x^T, float32 `[K, K]`; all zeros when no token was seen.

        An all-zero H makes `quantize_gptq` fall back to RTN and record it (`Fallback.EMPTY_HESSIAN`),
        which is what a MoE expert that no calibration token was routed to should get.

        Raises:
            ValueError: if the sum holds NaN/Inf (overflowing activations).
        """
        full = self._full_sum()
        if not torch.isfinite(full).all():
            raise ValueError(
                f"Hessian sum over {self.num_tokens} tokens has NaN/Inf entries: the calibration "
                "activations overflowed; check the calibration forward's dtype and inputs"
            )
        if self.num_tokens == 0:
            return full.zero_()
        return full.mul_(2.0 / self.num_tokens)
