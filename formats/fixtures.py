"""Random checkpoints with the exact on-disk layouts of the GLM-5, GLM-4.x and DeepSeek-V3 releases.

Used by the test-suite, by the benchmarks and as the README's built-in demo. The layouts follow
formats.md §1 and transformers 5.17's modeling files: per-expert 2-D tensors
(`mlp.experts.E.{gate,up,down}_proj.weight`), BF16 routers / norms / embeddings / `eh_proj` /
`indexer.weights_proj`, an F32 `e_score_correction_bias`, and one MTP layer at index
`num_hidden_layers`. The generator is deliberately independent of glmq's reader code, so tests that
read these checkpoints check that code against the published layout rather than against itself.

Source formats (`source_format`):
    "fp8-block"  DeepSeek/GLM: `float8_e4m3fn` weight + float32 `weight_scale_inv`
                 `[ceil(N/128), ceil(K/128)]`; `w = fp8.float() * scale` per 128x128 block.
    "fp8-ct"     compressed-tensors `float-quantized`: `float8_e4m3fn` weight + float32
                 `weight_scale` `[N, 1]` (per channel) or `[1]` (per tensor).
    "bf16"       plain BF16, no `quantization_config`.

Presets (`preset`; any config key can be overridden):
    "tiny"   hidden 256, moe_intermediate 128, dense intermediate 512, 8 routed experts (top-2) + 1
             shared, 3 decoder layers (first 1 dense) + 1 MTP layer, vocab 512. MLA: 4 heads, q_lora 128,
             kv_lora 128, qk_nope 64, qk_rope 32, v_head 64 (GLM-5 indexer: 4 heads x 64); GLM-4.x: 4 heads,
             2 kv heads, head_dim 64. About 5 MB (FP8) in 1 MB shards; well under a second to write.
    "bench"  the real per-layer shapes of GLM-5 (hidden 6144, moe_intermediate 2048, 64 heads, q_lora
             2048, kv_lora 512, qk_nope 192, qk_rope 64, v_head 256, indexer 32 x 128), GLM-4.7 or
             DeepSeek-V3, with 32 routed experts (top-8), no dense layer, 3 decoder layers + 1 MTP layer
             and vocab 1024, in 500 MB shards. GLM-5 FP8: 5.9 GB (4 MoE layers of 1.4 GB), written
             from random FP8 bytes in about half a minute, mostly disk time.

Everything is deterministic: each tensor draws from its own generator seeded by
sha256(seed, tensor name), so the same arguments give byte-identical files. A checkpoint appears whole
or not at all: it is written in a hidden folder beside out_dir and renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import secrets
import shutil
from typing import Iterator

import torch
from glmq.formats.safetensors_io import save_safetensors

FAMILIES = ("glm_moe_dsa", "glm4_moe", "deepseek_v3")  # kimi_k2 = deepseek_v3 with model_type "kimi_k2"
PRESETS = ("tiny", "bench")
SOURCE_FORMATS = ("fp8-block", "fp8-ct", "bf16")
FP8_CT_STRATEGIES = ("channel", "tensor")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # DeepSeek/GLM weight_block_size
DEFAULT_MAX_SHARD_BYTES = {"tiny": 1_000_000, "bench": 500_000_000}

_ARCHITECTURES = {
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_TRANSFORMERS_CONFIG = {  # (module, class) of the config a custom-code file subclasses
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa", "GlmMoeDsaConfig"),
    "glm4_moe": ("transformers.models.glm4_moe", "Glm4MoeConfig"),
    "deepseek_v3": ("transformers.models.deepseek_v3", "DeepseekV3Config"),
}
CUSTOM_CODE_FILE = "configuration_fixture.py"

# ---------------------------------------------------------------------------------------------
# Configs. "tiny": every projection input dim is a multiple of 128 (group-128 friendly) while some
# output dims are not (kv_a_proj_with_mqa: 160 rows), so block padding is exercised, like GLM-5's 576.
# "bench": the real per-layer shapes (GLM-5, GLM-4.7, DeepSeek-V3) with few layers/experts.
# ---------------------------------------------------------------------------------------------
_COMMON = {
    "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
    "tie_word_embeddings": False, "attention_dropout": 0.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
    "torch_dtype": "bfloat16",
}
_TINY_MOE = {
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
}
_BENCH_MOE = {
    "vocab_size": 1024, "num_hidden_layers": 3, "first_k_dense_replace": 0, "n_routed_experts": 32,
    "num_experts_per_tok": 8,
}
_TINY_MLA = {
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
}
_FAMILY_CONFIGS = {
    "glm_moe_dsa": {
        "base": {"attention_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "rope_interleave": True, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
        "tiny": {**_TINY_MOE, **_TINY_MLA, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 32},
        "bench": {**_BENCH_MOE, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
                  "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
                  "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
                  "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
                  "max_position_embeddings": 202752},
    },
    "glm4_moe": {
        "base": {"attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
                 "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "rope_type": "default"}},
        "tiny": {**_TINY_MOE, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
        "bench": {**_BENCH_MOE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "use_qk_norm": True,
                  "max_position_embeddings": 202752},
    },
    "deepseek_v3": {
        "base": {"attention_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "rope_interleave": True, "rms_norm_eps": 1e-6,
                 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
        "tiny": {**_TINY_MOE, **_TINY_MLA},
        "bench": {**_BENCH_MOE, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                  "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                  "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                  "max_position_embeddings": 163840},
    },
}


def make_config(family: str, preset: str = "tiny", *, source_format: str = "fp8-block",
                fp8_ct_strategy: str = "channel", **overrides) -> dict:
    """Build the full config.json dict of a fixture checkpoint.

    Args:
        family: one of FAMILIES (the tensor layout).
        preset: "tiny" or "bench" (see the module's preset tables).
        source_format: decides `quantization_config` ("bf16": none).
        fp8_ct_strategy: "channel" or "tensor", for source_format "fp8-ct".
        **overrides: config keys set after the preset (e.g. `n_routed_experts=16`,
            `model_type="kimi_k2"`). `quantization_config` given here is used as is.

    Returns:
        The config dict; a `model_type` that transformers does not know (kimi_k2) gets an `auto_map`
        to the custom-code file that make_checkpoint writes.

    Raises:
        ValueError: unknown family, preset, source format or strategy.
    """
    _check_choice("family", family, FAMILIES)
    _check_choice("preset", preset, PRESETS)
    _check_choice("source_format", source_format, SOURCE_FORMATS)
    _check_choice("fp8_ct_strategy", fp8_ct_strategy, FP8_CT_STRATEGIES)
    table = _FAMILY_CONFIGS[family]
    cfg = {"architectures": [_ARCHITECTURES[family]], "model_type": family,
           **_COMMON, **table["base"], **table[preset]}
    cfg.update({k: v for k, v in overrides.items() if k != "quantization_config"})
    if cfg["model_type"] not in FAMILIES:
        cfg["auto_map"] = {"AutoConfig": f"{CUSTOM_CODE_FILE[:-3]}.FixtureConfig"}
    if "quantization_config" in overrides:
        cfg["quantization_config"] = overrides["quantization_config"]
    elif source_format != "bf16":
        unquantized = bf16_linear_modules(cfg, family)
        cfg["quantization_config"] = (_fp8_block_qconfig(unquantized) if source_format == "fp8-block"
                                      else _fp8_ct_qconfig(unquantized, fp8_ct_strategy))
    return cfg


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}")


def _fp8_block_qconfig(unquantized: list[str]) -> dict:
    """DeepSeek/GLM-style block-FP8 quantization_config (formats.md §1c)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": unquantized}


def _fp8_ct_qconfig(unquantized: list[str], strategy: str) -> dict:
    """compressed-tensors `float-quantized` FP8 config, built with CT's own pydantic models."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                               dynamic=False, observer="minmax")
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts,
                                format="float-quantized")
    qc = QuantizationConfig(config_groups={"group_0": scheme}, quant_method="compressed-tensors",
                            format="float-quantized", quantization_status="compressed", ignore=unquantized)
    return _drop_keys(qc.model_dump(mode="json"), {"scale_dtype", "zp_dtype"})


def _drop_keys(obj, keys: set[str]):
    """Recursively remove `keys` (CT >= 0.13 fields that older CT's extra="forbid" rejects)."""
    if isinstance(obj, dict):
        return {k: _drop_keys(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_drop_keys(v, keys) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# Layout: the logical tensors of a family, then the stored tensors for a source format.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One logical tensor. kind: "linear" (an FP8 projection in the releases), "bf16_linear"
    (embeddings, lm_head, routers, eh_proj, weights_proj: BF16 even in FP8 releases),
    "norm" / "bias" (BF16 1-D) or "f32" (e_score_correction_bias)."""

    name: str
    shape: tuple[int, ...]
    kind: str


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as written: name, shape, dtype, its logical owner and whether it is a scale."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: TensorSpec
    is_scale: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def family_of(config: dict) -> str:
    """The layout family of a config, from its `architectures` (kimi_k2 -> deepseek_v3)."""
    by_arch = {arch: fam for fam, arch in _ARCHITECTURES.items()}
    for arch in config.get("architectures", []):
        if arch in by_arch:
            return by_arch[arch]
    raise ValueError(f"no fixture family for architectures {config.get('architectures')}")


def logical_tensors(config: dict, family: str | None = None) -> Iterator[list[TensorSpec]]:
    """Yield the logical tensors group by group in write order: the top-level ones (lm_head, embed,
    final norm), then each decoder layer, then the MTP layer(s) at index num_hidden_layers."""
    family = family or family_of(config)
    h, vocab = config["hidden_size"], config["vocab_size"]
    # (a tied head is embed_tokens: loaders store and read no lm_head.weight)
    head = [] if config.get("tie_word_embeddings") is True else [TensorSpec("lm_head.weight", (vocab, h), "bf16_linear")]
    yield [*head, TensorSpec("model.embed_tokens.weight", (vocab, h), "bf16_linear"),
           TensorSpec("model.norm.weight", (h,), "norm")]
    n_layers = config["num_hidden_layers"]
    dense = _dense_layers(config)
    indexed = _indexer_layers(config)
    for i in range(n_layers + (config.get("num_nextn_predict_layers") or 0)):  # null: none, as mtp_layers reads it
        p, mtp = f"model.layers.{i}.", i >= n_layers
        specs = [TensorSpec(p + "input_layernorm.weight", (h,), "norm"),
                 TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm")]
        specs += _attention_specs(config, family, p, indexer=family == "glm_moe_dsa" and (mtp or i in indexed))
        specs += _mlp_specs(config, p, dense=not mtp and i in dense)
        if mtp:
            specs += _mtp_specs(config, family, p)
        yield specs


def _dense_layers(config: dict) -> set[int]:
    types = config.get("mlp_layer_types")
    if types:
        return {i for i, t in enumerate(types) if t == "dense"}
    return set(range(config.get("first_k_dense_replace", 0)))


def _indexer_layers(config: dict) -> set[int]:
    """Decoder layers that carry indexer weights: the "full" ones of transformers' `indexer_types`
    (GLM-5.2 runs the indexer on some layers only); by default every layer."""
    n = config["num_hidden_layers"]
    types = config.get("indexer_types") or config.get("index_topk_pattern")
    if isinstance(types, str):
        types = [{"F": "full", "S": "shared"}[c] for c in types]
    if types is None:
        freq, offset = max(config.get("index_topk_freq", 1), 1), config.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return {i for i, t in enumerate(types) if t == "full"}


def _attention_specs(c: dict, family: str, p: str, indexer: bool) -> list[TensorSpec]:
    """q/k/v/o (+bias, +qk-norm) for GLM-4.x; MLA (+ the DSA indexer on GLM-5) otherwise."""
    if family == "glm4_moe":
        return _gqa_specs(c, p + "self_attn.")
    return _mla_specs(c, p + "self_attn.") + (_indexer_specs(c, p + "self_attn.indexer.") if indexer else [])


def _gqa_specs(c: dict, a: str) -> list[TensorSpec]:
    h = c["hidden_size"]
    # without head_dim, transformers' and vLLM's Glm4Moe layers take hidden / heads (Glm4MoeConfig has no default)
    hd = c["head_dim"] if "head_dim" in c else h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    specs = [TensorSpec(a + "q_proj.weight", (q, h), "linear"), TensorSpec(a + "k_proj.weight", (kv, h), "linear"),
             TensorSpec(a + "v_proj.weight", (kv, h), "linear"), TensorSpec(a + "o_proj.weight", (h, q), "linear")]
    if c.get("attention_bias"):
        specs += [TensorSpec(a + f"{x}_proj.bias", (n,), "bias") for x, n in (("q", q), ("k", kv), ("v", kv))]
    if c.get("use_qk_norm"):
        specs += [TensorSpec(a + f"{x}_norm.weight", (hd,), "norm") for x in ("q", "k")]
    return specs


def _mla_specs(c: dict, a: str) -> list[TensorSpec]:
    """Multi-head latent attention; shapes as in transformers' DeepseekV3/GlmMoeDsa attention."""
    h, heads, q_lora, kv_lora = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    if q_lora:
        specs = [TensorSpec(a + "q_a_proj.weight", (q_lora, h), "linear"),
                 TensorSpec(a + "q_a_layernorm.weight", (q_lora,), "norm"),
                 TensorSpec(a + "q_b_proj.weight", (heads * (nope + rope), q_lora), "linear")]
    else:  # DeepSeek-V2-Lite style: no query compression
        specs = [TensorSpec(a + "q_proj.weight", (heads * (nope + rope), h), "linear")]
    return specs + [TensorSpec(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "linear"),
                    TensorSpec(a + "kv_a_layernorm.weight", (kv_lora,), "norm"),
                    TensorSpec(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora), "linear"),
                    TensorSpec(a + "o_proj.weight", (h, heads * v), "linear")]


def _indexer_specs(c: dict, x: str) -> list[TensorSpec]:
    """GLM-5's DSA indexer: FP8 wq_b / wk, BF16 weights_proj and LayerNorm k_norm."""
    h, heads, dim = c["hidden_size"], c["index_n_heads"], c["index_head_dim"]
    return [TensorSpec(x + "wq_b.weight", (heads * dim, c["q_lora_rank"]), "linear"),
            TensorSpec(x + "wk.weight", (dim, h), "linear"),
            TensorSpec(x + "k_norm.weight", (dim,), "norm"),
            TensorSpec(x + "k_norm.bias", (dim,), "bias"),
            TensorSpec(x + "weights_proj.weight", (heads, h), "bf16_linear")]


def _ffn(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, hidden), "linear"),
            TensorSpec(prefix + "up_proj.weight", (inter, hidden), "linear"),
            TensorSpec(prefix + "down_proj.weight", (hidden, inter), "linear")]


def _mlp_specs(c: dict, p: str, dense: bool) -> list[TensorSpec]:
    h, m = c["hidden_size"], p + "mlp."
    if dense:
        return _ffn(m, h, c["intermediate_size"])
    n_exp, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    specs = [s for e in range(n_exp) for s in _ffn(f"{m}experts.{e}.", h, inter)]
    if c.get("n_shared_experts"):
        specs += _ffn(m + "shared_experts.", h, inter * c["n_shared_experts"])
    return specs + [TensorSpec(m + "gate.weight", (n_exp, h), "bf16_linear"),
                    TensorSpec(m + "gate.e_score_correction_bias", (n_exp,), "f32")]


def _mtp_specs(c: dict, family: str, p: str) -> list[TensorSpec]:
    """The MTP layer's extras. GLM-5.2 ties shared_head.head / embed_tokens to the main model."""
    h, vocab = c["hidden_size"], c["vocab_size"]
    specs = [TensorSpec(p + "enorm.weight", (h,), "norm"), TensorSpec(p + "hnorm.weight", (h,), "norm"),
             TensorSpec(p + "eh_proj.weight", (h, 2 * h), "bf16_linear"),
             TensorSpec(p + "shared_head.norm.weight", (h,), "norm")]
    if family != "glm_moe_dsa":
        specs += [TensorSpec(p + "shared_head.head.weight", (vocab, h), "bf16_linear"),
                  TensorSpec(p + "embed_tokens.weight", (vocab, h), "bf16_linear")]
    return specs


def bf16_linear_modules(config: dict, family: str | None = None) -> list[str]:
    """Sorted module names of the linear-like weights kept BF16 (`modules_to_not_convert` / `ignore`)."""
    return sorted(s.name[: -len(".weight")] for specs in logical_tensors(config, family)
                  for s in specs if s.kind == "bf16_linear")


def stored_tensors(spec: TensorSpec, source_format: str, fp8_ct_strategy: str = "channel") -> list[StoredTensor]:
    """The tensors written for one logical tensor: the weight and, for FP8 projections, its scale."""
    if spec.kind == "f32":
        return [StoredTensor(spec.name, spec.shape, torch.float32, spec)]
    if spec.kind != "linear" or source_format == "bf16":
        return [StoredTensor(spec.name, spec.shape, torch.bfloat16, spec)]
    n, k = spec.shape
    if source_format == "fp8-block":
        scale = StoredTensor(spec.name + "_scale_inv", (-(-n // BLOCK), -(-k // BLOCK)), torch.float32, spec, True)
    else:
        scale = StoredTensor(spec.name + "_scale", (n, 1) if fp8_ct_strategy == "channel" else (1,),
                             torch.float32, spec, True)
    return [StoredTensor(spec.name, spec.shape, torch.float8_e4m3fn, spec), scale]


def tensor_layout(config: dict, source_format: str = "fp8-block", *, family: str | None = None,
                  fp8_ct_strategy: str = "channel", split_partners: bool = True) -> list[list[StoredTensor]]:
    """All stored tensors of a checkpoint, in write order, as units the sharder never splits.

    With split_partners, each group (the top tensors, each layer) lists its weights first and its
    scales last, one tensor per unit, so shard boundaries separate weights from their scales as in the
    real releases; otherwise each weight and its scale form one unit. Reads no data.
    """
    units: list[list[StoredTensor]] = []
    for specs in logical_tensors(config, family):
        pairs = [stored_tensors(s, source_format, fp8_ct_strategy) for s in sorted(specs, key=lambda s: s.name)]
        if split_partners:
            units += [[t] for pair in pairs for t in pair if not t.is_scale]
            units += [[t] for pair in pairs for t in pair if t.is_scale]
        else:
            units += pairs
    return units


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def draw_weight(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A BF16 weight ~ N(0, 0.02^2) with log-normal row gains and a few 10x outliers, so that the
    per-block / per-channel FP8 scales differ."""
    w = torch.randn(shape, generator=gen) * 0.02
    w *= torch.exp(0.5 * torch.randn(shape[0], 1, generator=gen))
    idx = torch.randint(w.numel(), (max(1, w.numel() // 4096),), generator=gen)
    w.view(-1)[idx] *= 10.0
    return w.to(torch.bfloat16)


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantize `w` [N, K] -> (fp8 [N, K] float8_e4m3fn, scale_inv [ceil(N/b), ceil(K/b)] f32).

    scale = absmax(block) / 448, so `fp8.float() * scale` (per block) reconstructs w; the edge blocks
    of dims that are not a multiple of `block` are zero-padded before taking the absmax.
    """
    n, k = w.shape
    rb, cb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, cb * block - k, 0, rb * block - n))
    blocks = padded.view(rb, block, cb, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rb * block, cb * block)[:n, :k].contiguous(), scale


def quantize_fp8_channel(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors FP8: (fp8 [N, K], weight_scale [N, 1] f32, or [1] when per_tensor)."""
    wf = w.float()
    amax = wf.abs().amax().reshape(1) if per_tensor else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# Every byte 0xFE: clearing the mantissa LSB maps the NaN codes 0x7f / 0xff to 0x7e / 0xfe (+-448).
_NO_NAN_MASK = -0x0101010101010102


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random valid float8_e4m3fn values drawn as raw bytes (64 random bits at a time; fast).

    Every code but NaN can occur except those with an odd mantissa (the LSB is cleared to exclude NaN).
    """
    n = math.prod(shape)
    words = torch.empty(-(-n // 8), dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=gen)
    words &= _NO_NAN_MASK
    raw = words.view(torch.uint8)
    raw = raw if raw.numel() == n else raw[:n].clone()  # own storage, as safetensors wants
    return raw.view(torch.float8_e4m3fn).reshape(shape)


def materialize(spec: TensorSpec, source_format: str, seed: int, *, fp8_ct_strategy: str = "channel",
                random_fp8_bytes: bool = False) -> dict[str, torch.Tensor]:
    """The data of one logical tensor: {name: tensor} incl. the scale partner of an FP8 projection.

    random_fp8_bytes draws FP8 bytes and positive scales directly (bench speed) instead of
    quantizing a drawn BF16 weight.
    """
    gen = _generator(seed, spec.name)
    if spec.kind == "f32":
        return {spec.name: torch.randn(spec.shape, generator=gen) * 0.1}
    if spec.kind == "norm":
        return {spec.name: (1.0 + 0.05 * torch.randn(spec.shape, generator=gen)).to(torch.bfloat16)}
    if spec.kind in ("bias", "bf16_linear"):
        return {spec.name: (0.02 * torch.randn(spec.shape, generator=gen)).to(torch.bfloat16)}
    if source_format == "bf16":
        return {spec.name: draw_weight(spec.shape, gen)}
    scale_t = stored_tensors(spec, source_format, fp8_ct_strategy)[1]
    if random_fp8_bytes:
        fp8 = random_fp8(spec.shape, gen)
        scale = (0.5 + torch.rand(scale_t.shape, generator=gen)) * 2e-4
    elif source_format == "fp8-block":
        fp8, scale = quantize_fp8_block(draw_weight(spec.shape, gen))
    else:
        fp8, scale = quantize_fp8_channel(draw_weight(spec.shape, gen), per_tensor=fp8_ct_strategy == "tensor")
    return {spec.name: fp8, scale_t.name: scale}


# ---------------------------------------------------------------------------------------------
# Sharding and writing
# ---------------------------------------------------------------------------------------------
def plan_shards(units: list[list[StoredTensor]], max_shard_bytes: int,
                break_before: set[int] = frozenset()) -> list[list[StoredTensor]]:
    """Greedy: append units to the current shard until the next would exceed max_shard_bytes (a unit
    larger than that gets a shard of its own); the unit indices in `break_before` start a new shard."""
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for i, unit in enumerate(units):
        unit_bytes = sum(t.nbytes for t in unit)
        if shards[-1] and (size + unit_bytes > max_shard_bytes or i in break_before):
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += unit_bytes
    return shards


def _mtp_scale_break(units: list[list[StoredTensor]]) -> set[int]:
    """Index of the last layer's (the MTP layer's) first scale unit: starting a shard there keeps its
    scales apart from their weights however large max_shard_bytes is. Empty when there are no scales."""
    last = units[-1][0].name
    prefix = ".".join(last.split(".")[:3]) + "."
    for i, unit in enumerate(units):
        if unit[0].is_scale and len(unit) == 1 and unit[0].name.startswith(prefix):
            return {i}
    return set()


def write_shards(out_dir: pathlib.Path, shards: list[list[StoredTensor]], source_format: str, seed: int,
                 **materialize_kwargs) -> dict:
    """Write `model-0000K-of-0000N.safetensors` one shard at a time and return the index dict.

    A partner tensor made alongside one of this shard (a scale whose weight is here) waits in a small
    pending dict until its own shard is written, so only one shard's tensors are held at a time.
    (A writer thread overlapping drawing and writing was tried: no faster, the disk is the limit.)
    """
    pending: dict[str, torch.Tensor] = {}
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for t in shard:
            if t.name not in pending:
                pending.update(materialize(t.owner, source_format, seed, **materialize_kwargs))
            tensors[t.name] = pending.pop(t.name)
            weight_map[t.name] = fname
            total += t.nbytes
        save_safetensors(tensors, out_dir / fname, metadata={"format": "pt"})
        del tensors
    if pending:
        raise RuntimeError(f"fixture bug: tensors made but never written: {sorted(pending)[:5]}")
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def make_checkpoint(out_dir, family: str = "glm_moe_dsa", *, preset: str = "tiny",
                    source_format: str = "fp8-block", seed: int = 0, max_shard_bytes: int | None = None,
                    split_partners: bool = True, config_overrides: dict | None = None,
                    side_files: bool = True, fp8_ct_strategy: str = "channel",
                    random_fp8_bytes: bool | None = None) -> pathlib.Path:
    """Write a random checkpoint with the real on-disk layout of `family` and return its directory.

    Args:
        out_dir: new or empty directory (created). Everything is written in a hidden folder beside it,
            `.<name>.<pid>.<random>.partial`, renamed to out_dir at the end: an interrupted run leaves no
            half checkpoint (callers take an existing config.json for a whole one), nor, unless killed
            outright, the hidden folder.
        family: one of FAMILIES; `config_overrides={"model_type": "kimi_k2"}` gives Kimi K2.
        preset: "tiny" (few MB, < 1 s) or "bench" (real GLM-5 expert shapes, GBs).
        source_format: "fp8-block", "fp8-ct" or "bf16" (module docstring).
        seed: data seed; the same arguments give byte-identical files.
        max_shard_bytes: shard size limit; default 1 MB (tiny, so several shards) or 500 MB (bench).
        split_partners: put some FP8 weights in another shard than their scale, as the real releases do
            (always at least the MTP layer's scales); False keeps every weight with its scale.
        config_overrides: config.json keys (make_config's **overrides).
        side_files: write generation_config.json, tokenizer_config.json, chat_template.jinja and a
            custom-code file (the latter also whenever the config has an auto_map).
        fp8_ct_strategy: "channel" ([N, 1] weight_scale) or "tensor" ([1]) for "fp8-ct".
        random_fp8_bytes: draw FP8 bytes and scales directly instead of quantizing BF16 draws;
            default True for "bench", False for "tiny".

    Raises:
        ValueError: unknown choices, or a non-empty out_dir.
    """
    out = pathlib.Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; make_checkpoint writes into a new or empty directory")
    config = make_config(family, preset, source_format=source_format, fp8_ct_strategy=fp8_ct_strategy,
                         **(config_overrides or {}))
    units = tensor_layout(config, source_format, family=family, fp8_ct_strategy=fp8_ct_strategy,
                          split_partners=split_partners)
    breaks = _mtp_scale_break(units) if split_partners else set()
    shards = plan_shards(units, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES[preset], breaks)
    fast = preset == "bench" if random_fp8_bytes is None else random_fp8_bytes
    # Written aside and renamed whole: Ctrl-C in the middle of a (bench: 6 GB) generation left out_dir with some
    # shards, which the next run refused as "not empty", or with config.json but no side files, which the bench
    # scripts' `config.json exists` check took for a whole checkpoint. (Path.mkdir, not mkdtemp: the umask's mode.)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    tmp.mkdir()
    try:
        index = write_shards(tmp, shards, source_format, seed, fp8_ct_strategy=fp8_ct_strategy, random_fp8_bytes=fast)
        _write_json(tmp / "model.safetensors.index.json", index)
        _write_json(tmp / "config.json", config)
        if side_files or "auto_map" in config:
            (tmp / CUSTOM_CODE_FILE).write_text(_custom_code(family, config["model_type"]))
        if side_files:
            _write_side_files(tmp, config)
        try:
            os.rename(tmp, out)  # POSIX: replaces an empty out_dir, refuses one another writer filled meanwhile
        except OSError as e:
            if not (out.is_dir() and any(out.iterdir())):
                raise
            raise ValueError(f"{out} is not empty (another process wrote into it meanwhile); make_checkpoint "
                             f"writes into a new or empty directory") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _custom_code(family: str, model_type: str) -> str:
    module, cls = _TRANSFORMERS_CONFIG[family]
    return (f'"""Custom config code shipped with a glmq fixture checkpoint (like Kimi K2\'s '
            f'configuration_deepseek.py)."""\n\nfrom {module} import {cls}\n\n\n'
            f"class FixtureConfig({cls}):\n    model_type = {model_type!r}\n")


_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _write_side_files(out: pathlib.Path, config: dict) -> None:
    """Small generation/tokenizer configs and a chat template, so side-file copying can be tested."""
    _write_json(out / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"], "do_sample": True, "temperature": 1.0, "top_p": 0.95})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False})
    (out / "chat_template.jinja").write_text(_CHAT_TEMPLATE + "\n")


def write_byte_tokenizer(folder) -> None:
    """A byte-level tokenizer (256 byte tokens + <|endoftext|>) that loads with AutoTokenizer, so a
    generated checkpoint can be calibrated from text (ids < 257 fit every preset's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # sorted: alphabet() comes out of a hash set, in another order at every call, so the ids (and the calibration
    # tokens drawn with them) would differ between two checkpoints generated with the same arguments
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(pathlib.Path(folder) / "tokenizer.json"))
