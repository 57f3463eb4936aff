"""Input Hessians of one decoder layer's target Linears, collected during a calibration forward.

Sites (where an input is observed) are named by layer-local paths:
- a plain Linear (attention, shared expert, dense MLP): its own path, e.g. `self_attn.q_proj`; a forward
  pre-hook on the module adds its input.
- routed expert e: `mlp.experts.{e}.gate_up` (the input of gate_proj and up_proj, the same tokens) and
  `mlp.experts.{e}.down` (act(gate) * up, the input of down_proj). transformers keeps the experts fused
  (`mlp.experts.gate_up_proj` [E, 2I, H]), so there is no per-expert module to hook: while collecting,
  the experts module's forward is replaced by `_ExpertTap`, which runs the same computation as
  transformers' eager loop, with the top-k indices the layer's own router produced, and adds to expert
  e's Hessians only the tokens routed to e.

Each expert also counts its routed tokens. *All-token* Hessians, the prior blended into every
expert's Hessian and the whole Hessian of an expert too few tokens reach (engine.py), come from every
token of the layer, as llm-compressor's `moe_calibrate_all_experts` sends them: for gate_up the MoE
input (`mlp.experts.all_tokens`, shared by all experts), for down act(gate(x)) * up(x) over every
token (`mlp.experts.{e}.down_all`, per expert), or over the first `all_token_limit` x I of them: each
expert's forward over all tokens is the largest cost of a calibration pass (E / top_k times the routed
compute), and the Hessian of an I-dimensional input is well estimated from a few times I tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from glmq.calibration.hessian import HessianAccumulator

ALL_TOKENS = "mlp.experts.all_tokens"
_EXPERT_TARGET = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj$")


@dataclass(frozen=True)
class Target:
    """One Linear of the layer to quantize.

    Attributes:
        module: the checkpoint's module name (`model.layers.3.mlp.experts.5.gate_proj`).
        local: the name inside the layer (`mlp.experts.5.gate_proj`).
        expert: routed-expert index, or None.
        site: the Hessian site its input is observed at.
    """

    module: str
    local: str
    expert: int | None
    site: str


def make_target(module: str, layer_index: int) -> Target:
    prefix = f"model.layers.{layer_index}."
    if not module.startswith(prefix):
        raise ValueError(f"{module} is not in layer {layer_index}")
    local = module[len(prefix):]
    m = _EXPERT_TARGET.match(local)
    if m:
        e = int(m.group(1))
        return Target(module, local, e, f"mlp.experts.{e}.{'down' if m.group(2) == 'down' else 'gate_up'}")
    return Target(module, local, None, local)


class HessianCollector:
    """Context manager: while active, forwards of `layer` add to the Hessians of `sites`.

    Args:
        layer: a transformers decoder layer (eval mode, weights loaded).
        sites: Hessian sites to collect (see the module docstring); expert sites of experts outside
            `experts` are ignored.
        experts: expert indices whose routed Hessians this pass collects (None: all). Bounding it
            bounds memory: E experts' Hessians of GLM-5 take 43 GB in float32.
        all_token_experts: experts whose down-input Hessian is collected over *every* token
            (site `mlp.experts.{e}.down_all`).
        device: where the sums live.
        all_token_limit: the `down_all` Hessians take only the first `all_token_limit * I` tokens of the
            pass (I: the experts' intermediate size, the Hessian's side), None: every token. The tokens
            used are counted in `all_token_tokens`.
        routed_output: False for a pass whose layer output is thrown away: the routed experts' down
            projections are then not run (every Hessian is collected before them, and in a decoder layer
            nothing after the MoE reads its output) and the experts return zeros.
    """

    def __init__(self, layer: torch.nn.Module, sites: set[str], experts: set[int] | None = None,
                 all_token_experts: set[int] = frozenset(), device: torch.device | None = None,
                 all_token_limit: float | None = None, routed_output: bool = True):
        self.layer, self.device = layer, device
        # for error messages, which come after the pass (the layer is dropped at exit)
        self.layer_index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
        self.experts_module = getattr(getattr(layer, "mlp", None), "experts", None)
        n_exp = getattr(self.experts_module, "num_experts", 0)
        self.active = set(range(n_exp)) if experts is None else set(experts)
        self.all_token_experts = set(all_token_experts)
        self.linear_sites = sorted(s for s in sites if not s.startswith("mlp.experts."))
        self.expert_sites = {s for s in sites if s.startswith("mlp.experts.")}
        self.acc: dict[str, HessianAccumulator] = {}
        self.tokens = torch.zeros(n_exp, dtype=torch.int64)  # routed tokens per expert
        self.all_token_limit, self.routed_output = all_token_limit, routed_output
        self.all_token_tokens = 0  # tokens the `down_all` Hessians have taken so far
        self._handles: list = []
        self._reserved: dict[str, HessianAccumulator] = {}

    def _add(self, site: str, x: torch.Tensor) -> None:
        if site not in self.acc:
            acc = self._reserved.pop(site, None)
            self.acc[site] = acc if acc is not None else HessianAccumulator(x.shape[-1], self.device)
        self.acc[site].add(x)

    def _reserve(self) -> None:
        """Allocate every Hessian sum this pass can fill before its first batch (`acc` still gets a site only
        once a token reaches it; those no token reaches are dropped at exit).

        Why: made on first use, the 4 MB sums were interleaved on the heap with the first batch's
        activations; the later batches' activations, of other sizes (the experts' token counts vary),
        no longer fit the holes, and the heap grew by ~300 MB of free pages over the pass (scaling model).
        """
        sizes = {s: self.layer.get_submodule(s).in_features for s in self.linear_sites
                 if isinstance(self.layer.get_submodule(s), torch.nn.Linear)}
        ex = self.experts_module
        if ex is not None and (self.expert_sites or self.all_token_experts):
            h, i = ex.gate_up_proj.shape[2], ex.gate_up_proj.shape[1] // 2
            sizes |= {s: h if s == ALL_TOKENS or s.endswith(".gate_up") else i for s in self.expert_sites
                      if s == ALL_TOKENS or int(s.split(".")[2]) in self.active}
            sizes |= {f"mlp.experts.{e}.down_all": i for e in sorted(self.all_token_experts)}
        self._reserved = {s: HessianAccumulator(k, self.device) for s, k in sizes.items()}

    def __enter__(self) -> HessianCollector:
        self._reserve()
        for site in self.linear_sites:
            module = self.layer.get_submodule(site)
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, args, site=site: self._add(site, args[0].detach())))
        if self.expert_sites or self.all_token_experts:
            if self.experts_module is None:
                raise ValueError("routed-expert targets in a layer without routed experts")
            self.experts_module.forward = _ExpertTap(self)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.experts_module is not None and "forward" in vars(self.experts_module):
            del self.experts_module.forward  # back to the class's forward
        self.layer = self.experts_module = None  # the Hessians outlive the pass; the layer need not
        self._reserved.clear()

    def _all_token_rows(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """The rows of this batch's tokens `x` [T, H] that the `down_all` Hessians still take (see
        `all_token_limit`; `side` is their size I), counted."""
        if not self.all_token_experts:
            return x[:0]
        cap = math.inf if self.all_token_limit is None else self.all_token_limit * side  # inf when it overflows
        if cap < self.all_token_tokens + x.shape[0]:
            x = x[:max(0, math.ceil(cap) - self.all_token_tokens)]
        self.all_token_tokens += x.shape[0]
        return x

    def hessian(self, site: str) -> tuple[torch.Tensor | None, int]:
        """(H float32 [K, K] or None if the site saw nothing, tokens) for a site."""
        acc = self.acc.get(site)
        if acc is None:
            return None, 0
        try:
            return acc.finalize(), acc.num_tokens
        except ValueError as e:  # the accumulator knows no names: say which layer and input overflowed
            raise ValueError(f"layer {self.layer_index}, input of {site}: {e}") from e


class _ExpertTap:
    """transformers' eager expert loop (Glm4MoeExperts.forward et al.), adding to the collector.

    The fused expert weights may be stored in another dtype than the hidden states (LayerBuilder.build's
    `experts_as_stored`: bf16 source weights in a float32 layer); each expert's weights are cast to the
    hidden states' dtype once per batch, used by its routed and its all-token products, and dropped.
    """

    def __init__(self, col: HessianCollector):
        self.col = col

    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        col, ex = self.col, self.col.experts_module
        if ALL_TOKENS in col.expert_sites:
            col._add(ALL_TOKENS, hidden_states)
        out = torch.zeros_like(hidden_states)
        n_exp, dt = ex.num_experts, hidden_states.dtype
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=n_exp).permute(2, 1, 0)  # (E, k, T)
        col.tokens += mask.sum(dim=(1, 2)).cpu()
        x_all = col._all_token_rows(hidden_states, ex.gate_up_proj.shape[1] // 2)
        for e in range(n_exp):
            pos, tok = torch.where(mask[e])
            down_all = x_all.shape[0] > 0 and e in col.all_token_experts
            # an expert outside this pass's chunk, in a pass whose output is not kept (--experts-per-pass, the extra
            # all-token pass): its routed product feeds nothing (it cost 8x the routed gate/up at 32 of 256 a pass)
            routed = tok.numel() > 0 and (e in col.active or col.routed_output)
            if not routed and not down_all:
                continue
            w_gate_up = ex.gate_up_proj[e].to(dt)  # (2I, H); no copy when already in dt
            if routed:
                x = hidden_states[tok]  # (t_e, H)
                gate, up = torch.nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
                h = ex.act_fn(gate) * up  # (t_e, I)
                if e in col.active:
                    if f"mlp.experts.{e}.gate_up" in col.expert_sites:
                        col._add(f"mlp.experts.{e}.gate_up", x)
                    if f"mlp.experts.{e}.down" in col.expert_sites:
                        col._add(f"mlp.experts.{e}.down", h)
                if col.routed_output:
                    y = torch.nn.functional.linear(h, ex.down_proj[e].to(dt)) * top_k_weights[tok, pos, None]
                    out.index_add_(0, tok, y.to(out.dtype))
            if down_all:
                gate, up = torch.nn.functional.linear(x_all, w_gate_up).chunk(2, dim=-1)
                col._add(f"mlp.experts.{e}.down_all", ex.act_fn(gate) * up)
        return out
