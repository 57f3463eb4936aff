"""One decoder layer at a time, built with transformers' own classes from the source shards.

The calibration engine never holds the whole model: for layer i it builds exactly transformers'
decoder-layer class for the config on the meta device (accelerate's `init_empty_weights`), reads the
layer's tensors from the shards (FP8 dequantized to bf16 with glmq's own dequantizer, the values RTN
would quantize), and loads them into it. What differs between families is data (`HF_LAYERS`).

Layout conversion: transformers 5.x keeps the routed experts of a layer fused in memory,
`mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows first, then up) and `mlp.experts.down_proj`
`[E, H, I]`, while the checkpoints store per-expert 2-D `mlp.experts.E.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import importlib
import re
import weakref
from dataclasses import dataclass

import torch
from safetensors import safe_open

from glmq.formats import fp8
from glmq.formats.safetensors_io import CheckpointError
from glmq.formats.source import Source, SourceFormat
from glmq.quantize import ops


@dataclass(frozen=True)
class HFLayer:
    """transformers' classes for one family.

    Attributes:
        module: the modeling module under `transformers.models`.
        config / layer / rotary: class names of the config, the decoder layer and the rotary embedding.
        full_mask: always materialize the causal mask (GLM-5's DSA indexer reads it; the model's own
            forward passes `allow_is_causal_skip=False` for the same reason).
        carry: keyword under which a layer's second output feeds the next layer (GLM-5 "shared" DSA
            layers reuse the previous full layer's top-k token selection), or None.
    """

    module: str
    config: str
    layer: str
    rotary: str
    full_mask: bool = False
    carry: str | None = None


HF_LAYERS: dict[str, HFLayer] = {
    "glm_moe_dsa": HFLayer("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaDecoderLayer", "GlmMoeDsaRotaryEmbedding",
                           full_mask=True, carry="prev_topk_indices"),
    "glm4_moe": HFLayer("glm4_moe", "Glm4MoeConfig", "Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding"),
    "deepseek_v3": HFLayer("deepseek_v3", "DeepseekV3Config", "DeepseekV3DecoderLayer", "DeepseekV3RotaryEmbedding"),
}

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_DROP_CONFIG_KEYS = ("quantization_config", "auto_map", "model_type", "architectures")


def transformers_config_problems(config: dict) -> list[str]:
    """Settings of config.json that transformers' classes of these families (HF_LAYERS) do not honour, so that GPTQ's
    calibration forwards and `glmq eval` would run another model than the one vLLM serves, or fail half-way: their
    routers score by sigmoid with group-limited top-k (`*TopkRouter`) whatever `scoring_func` and `topk_method` say,
    and their MoE blocks build `n_shared_experts` shared experts, which must be at least one."""
    out = []
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        out.append(f"scoring_func is {config['scoring_func']!r}: transformers' router scores by sigmoid only (vLLM "
                   f"follows scoring_func), so the calibration would route tokens as the served model does not")
    if config.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
        out.append(f"topk_method is {config['topk_method']!r}: transformers' router runs noaux_tc's group-limited "
                   f"top-k with the correction bias only (vLLM follows topk_method)")
    shared = config.get("n_shared_experts", 1)
    if not (type(shared) is int and shared > 0):
        out.append(f"n_shared_experts is {shared!r}: transformers' MoE block builds its shared experts from it and "
                   f"needs at least one")
    return out


def check_transformers_config(root, config: dict) -> None:
    """A ValueError naming what `transformers_config_problems` finds, before any work (GPTQ, `glmq eval`)."""
    if problems := transformers_config_problems(config):
        raise ValueError(f"{root}/config.json: {'; '.join(problems)}. GPTQ and `glmq eval` run the model through "
                         f"transformers' own classes, which cannot run this one; convert it with RTN (the default "
                         f"--scheme) instead")


def _hf(family: str) -> tuple[HFLayer, object]:
    spec = HF_LAYERS[family]
    return spec, importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}")


def hf_config(source: Source, attn_implementation: str = "sdpa"):
    """transformers' config object for the source (its quantization_config dropped: weights arrive dense)."""
    spec, mod = _hf(source.family.name)
    cfg = {k: v for k, v in source.config.items() if k not in _DROP_CONFIG_KEYS}
    config = getattr(mod, spec.config)(**cfg)
    config._attn_implementation = attn_implementation
    # transformers' default for a loaded model (what `glmq eval` and inference servers' references run);
    # the Hessian passes replace the experts' forward by collect.py's tap of the eager loop anyway
    config._experts_implementation = "grouped_mm"
    return config


class SourceTensors:
    """Reads tensors of the source by name, FP8 weights dequantized exactly as the RTN path does.

    On a GPU the FP8 bytes are moved before dequantizing (the product is the same IEEE float32 multiply
    and round to bf16, so bit-identical): a layer's BF16 weights then never exist on the host, which holds
    only one raw tensor at a time. A GLM-5 layer is 9.7 GB of FP8, 19 GB of BF16.
    """

    def __init__(self, source: Source, device: torch.device | str = "cpu"):
        self.source = source
        self.device = torch.device(device)
        self.handles: dict[str, object] = {}

    def raw(self, name: str) -> torch.Tensor:
        e = self.source.entries[name]
        if e.shard not in self.handles:
            self.handles[e.shard] = safe_open(str(self.source.path(e.shard)), framework="pt")
        return self.handles[e.shard].get_tensor(name)

    def weight(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """A tensor as floating point on `device` (default: this reader's): FP8 -> bf16 (float32 product
        rounded once), others as stored."""
        dev = self.device if device is None else torch.device(device)
        t = self.raw(name).to(dev)
        if t.dtype != torch.float8_e4m3fn:
            # safetensors hands out small tensors as views of the shard's memory map: one such view (a norm,
            # the router bias) kept the whole map, and every page of the layer's FP8 bytes read through it
            # (~55 MB resident per layer of the scaling model), alive after `close()`. A copy owns its bytes.
            w = t.clone() if t.device.type == "cpu" else t
        else:
            module = name.rpartition(".")[0]
            if self.source.fmt is SourceFormat.FP8_BLOCK:
                w = fp8.dequantize_block(t, self.raw(f"{module}.weight_scale_inv").to(dev), self.source.block)
            else:
                w = fp8.dequantize_channel(t, self.raw(f"{module}.weight_scale").to(dev))
        if not w.is_floating_point():
            return w
        # as the RTN path rejects a target holding NaN/Inf (quantize/ops.py); here every tensor of the layer (BF16
        # norms, router, kept Linears, the embeddings too): NaN would spread through every later layer's states and
        # surface as a Hessian error naming nothing. Rows of a 1-D tensor are its elements.
        try:
            ops.check_finite(w.reshape(w.shape[0], -1) if w.ndim else w.reshape(1, 1))
        except ValueError as e:
            raise CheckpointError(f"{self.source.path(self.source.entries[name].shard)}: tensor {name}: {e}; the "
                                  f"source weight is corrupt, re-download the shard") from e
        return w

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """Every tensor of `model.layers.{index}.` (scales consumed), keyed by its name inside the layer,
        on this reader's device. The shards' memory maps are closed afterwards, so the pages read do not
        stay resident (and counted in RSS) while the layer is worked on."""
        prefix = f"model.layers.{index}."
        out = {}
        for name in sorted(self.source.entries):
            if not name.startswith(prefix) or name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):
                continue
            out[name[len(prefix):]] = self.weight(name)
        self.close()
        return out

    def close(self) -> None:
        self.handles.clear()


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert 2-D weights -> transformers' fused `mlp.experts.gate_up_proj` / `down_proj`.

    Args:
        state: layer-local names; `mlp.experts.E.{gate,up,down}_proj.weight` `[I, H]`/`[I, H]`/`[H, I]`.
    Returns:
        the same dict with those replaced by `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows first)
        and `mlp.experts.down_proj` `[E, H, I]`.
    Raises:
        ValueError: if the expert indices are not 0..E-1 with all three projections.
    """
    experts: dict[int, dict[str, torch.Tensor]] = {}
    rest = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            rest[k] = v
    if not experts:
        return rest
    n = max(experts) + 1
    # named per expert: the union of the projections found (all three) and the first indices said nothing of which
    # expert lacked which
    lacking = {e: [p for p in ("gate", "up", "down") if p not in experts.get(e, {})] for e in range(n)}
    lacking = {e: ps for e, ps in lacking.items() if ps}
    if lacking:
        raise ValueError(f"routed experts are incomplete ({len(lacking)} of {n}): " + ", ".join(
            f"expert {e} has no {'/'.join(ps)}_proj" for e, ps in list(lacking.items())[:8])
            + (", ..." if len(lacking) > 8 else ""))
    rest["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in range(n)])
    rest["mlp.experts.down_proj"] = torch.stack([experts[e]["down"] for e in range(n)])
    return rest


def share_experts(layer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Make `state`'s per-expert weights views of `layer`'s fused experts (in place), dropping their own copies.

    For a layer built with `build(..., experts_as_stored=True)`, whose fused experts hold exactly the
    state's values in the state's dtype: afterwards the two share one copy, which outlives the layer
    (106 MB of a scaling-model layer's 300 in float32 were this duplicate, then the float32 experts 192 MB).
    """
    ex = layer.get_submodule("mlp.experts")
    n_inter = ex.gate_up_proj.shape[1] // 2
    gate_up, down = ex.gate_up_proj.detach(), ex.down_proj.detach()  # parameters: views of them require grad
    for k in [k for k in state if _EXPERT.match(k)]:
        m = _EXPERT.match(k)
        e, proj = int(m.group(1)), m.group(2)
        v = gate_up[e, :n_inter] if proj == "gate" else gate_up[e, n_inter:] if proj == "up" else down[e]
        if v.dtype != state[k].dtype or v.shape != state[k].shape:  # a bug, not user input
            raise RuntimeError(f"{k}: the layer's fused experts are not the state's weights ({v.dtype} {list(v.shape)})")
        state[k] = v


class ChunkedExperts:
    """transformers' grouped_mm experts forward (`integrations.moe.grouped_mm_experts_forward`), the same
    arithmetic a few experts at a time: installed as the `forward` of a CPU layer's fused experts.

    Why: transformers' version holds every (token, expert) pair's activations of a batch at once, ~0.2 GB of
    temporaries at 8 x 256 tokens x top-4 of the scaling model (a third of a quantized layer's forward peak).
    Here the pairs are sorted by expert exactly as there, and each run of experts of at most `rows` pairs
    goes through the same two grouped matmuls (on a CPU, one matmul per expert of exactly its rows:
    the same bits whichever experts share a call) and the same gate; the weighted results are put straight
    into the token-major buffer transformers gathers, and summed over top-k by the same reduction. The
    experts' weights may be stored in another dtype (bf16 in a float32 layer, LayerBuilder.build's
    `experts_as_stored`): each run's weights are cast to the hidden states' dtype, exactly, as they are used.
    tests/test_calibration.py checks the output against transformers' function bit for bit.
    """

    ROWS = 1024  # (token, expert) pairs per call: a few experts; ~12 MB of activations and cast weights each

    def __init__(self, experts: torch.nn.Module, rows: int = ROWS):
        # a weak reference: as the module's own `forward`, a strong one would make a reference cycle, and the
        # layer's weights would outlive `del layer` until the garbage collector's next run
        self._experts, self.rows = weakref.ref(experts), rows

    @staticmethod
    def applies(experts: torch.nn.Module) -> bool:
        """The case this reproduces: a gated, bias-free, untransposed experts module under grouped_mm."""
        return (getattr(experts, "config", None) is not None
                and getattr(experts.config, "_experts_implementation", None) == "grouped_mm"
                and getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True)
                and not getattr(experts, "is_transposed", True) and getattr(experts, "is_concatenated", False)
                and hasattr(experts, "_apply_gate"))

    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ex, dt = self._experts(), hidden_states.dtype
        (n_tok, hidden), top_k = hidden_states.shape, top_k_index.size(-1)
        expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))  # as transformers sorts: the same order
        weights_g = top_k_weights.reshape(-1)[perm]
        ends = torch.bincount(expert_ids_g, minlength=ex.num_experts).cumsum(0).tolist()
        # (T * k, H) token-major, in the weighted products' dtype: float32 routing weights promote a bf16/f16
        # layer's outputs, summed over top-k in float32 and cast back, as transformers does
        out = torch.empty(n_tok * top_k, hidden, dtype=torch.promote_types(dt, top_k_weights.dtype),
                          device=hidden_states.device)
        e0 = r0 = 0
        while e0 < ex.num_experts:
            e1 = e0 + 1  # a run of experts: at least one, at most `rows` pairs beyond the first
            while e1 < ex.num_experts and ends[e1] - r0 <= self.rows:
                e1 += 1
            r1 = ends[e1 - 1]
            if r1 > r0:
                offs = torch.tensor(ends[e0:e1], dtype=torch.int32, device=out.device) - r0
                x = hidden_states[perm[r0:r1] // top_k]
                y = torch.nn.functional.grouped_mm(x, ex.gate_up_proj[e0:e1].to(dt).transpose(-2, -1), offs=offs)
                y = ex._apply_gate(y)
                y = torch.nn.functional.grouped_mm(y, ex.down_proj[e0:e1].to(dt).transpose(-2, -1), offs=offs)
                out[perm[r0:r1]] = y * weights_g[r0:r1].unsqueeze(-1)
            e0, r0 = e1, r1
        return out.view(n_tok, top_k, hidden).sum(dim=1).to(dt)


class LayerBuilder:
    """Builds decoder layer i of the source with transformers' class, weights loaded, on `device`."""

    def __init__(self, source: Source, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str = "sdpa"):
        if (missing := ops.cuda_missing(device)) is not None:  # the CLI checks first
            raise ValueError(missing)
        self.source = source
        self._kwargs: dict = {}  # layer_kwargs per batch shape
        self.spec, self.mod = _hf(source.family.name)
        self.config = hf_config(source, attn_implementation)
        self.device, self.dtype = device, dtype
        self.tensors = SourceTensors(source, device)
        self.rotary = getattr(self.mod, self.spec.rotary)(self.config).to(device)

    def build(self, index: int, state: dict[str, torch.Tensor] | None = None, experts_as_stored: bool = False,
              chunked_experts: bool = False) -> torch.nn.Module:
        """Layer `index` in eval mode; `state` (layer-local names, per-expert layout) defaults to the source's.

        `experts_as_stored`: the fused routed experts keep the state's dtype (e.g. bf16) instead of the
        compute dtype. Only for a layer whose experts' forward is collect.py's tap, which casts one
        expert at a time (transformers' grouped_mm would compute in the weights' dtype).
        `chunked_experts`: on a CPU, where `ChunkedExperts.applies`, the experts' forward is ChunkedExperts
        (transformers' grouped_mm result, bit for bit, with less memory) and they keep the state's dtype.
        """
        from accelerate import init_empty_weights

        state = self.tensors.layer_state(index) if state is None else state
        try:
            state = fuse_experts(state)
        except ValueError as e:
            raise ValueError(f"{self.source.root}: layer {index}: {e}; the checkpoint lacks these tensors (an "
                             "incomplete download or conversion): fetch its shards and index again") from e
        # include_buffers: the torch default device is meta too, so the fused experts' `torch.empty` allocates
        # nothing (without it, [E, 2I, H] float32 was allocated on the host before moving to meta: 26 GB for a
        # GLM-5 layer, 45 GB for Kimi K2's, which a host without that much memory refused); the layer's one
        # buffer, the router's correction bias, is in the state loaded next
        with init_empty_weights(include_buffers=True):
            layer = getattr(self.mod, self.spec.layer)(self.config, index)
        expected = layer.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{self.source.root}: layer {index} does not match transformers' "
                             f"{self.spec.layer}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        # the router's correction bias stays float32, as transformers keeps it (_keep_in_fp32_modules_strict)
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        chunked = chunked_experts and self.device.type == "cpu" and experts is not None \
            and ChunkedExperts.applies(experts)
        as_stored = experts_as_stored or chunked

        def dtype(k: str, v: torch.Tensor) -> torch.dtype:
            if k.endswith("e_score_correction_bias"):
                return torch.float32
            return v.dtype if as_stored and k.startswith("mlp.experts.") else self.dtype

        state = {k: v.to(self.device, dtype(k, v)) for k, v in state.items()}
        layer.load_state_dict(state, assign=True, strict=True)
        if chunked:
            experts.forward = ChunkedExperts(experts)
        return layer.eval()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[S, T]` token ids -> `[S, T, H]` input embeddings in the compute dtype (on CPU)."""
        table = self.tensors.weight("model.embed_tokens.weight", "cpu")
        return torch.nn.functional.embedding(tokens, table).to(self.dtype)

    def layer_kwargs(self, x: torch.Tensor) -> dict:
        """Rotary position embeddings and the causal mask for a batch `x` `[B, T, H]`, as the model builds them.

        They depend on the batch's shape, dtype and device only, and every batch of a layer pass (and every
        layer) asks for the same ones, so they are built once per shape (building the mask took ~3 ms a batch).
        """
        from transformers.masking_utils import create_causal_mask

        key = (tuple(x.shape), x.dtype, x.device)
        cache = self._kwargs
        if key not in cache:
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                      position_ids=pos, allow_is_causal_skip=not self.spec.full_mask)
            if len(cache) >= 4:  # a pass has two shapes at most (its last batch may be shorter)
                cache.clear()
            cache[key] = {"attention_mask": mask, "position_ids": pos,
                          "position_embeddings": self.rotary(x, position_ids=pos)}
        return dict(cache[key])
