"""Model families as data: which tensor names are routed experts, shared experts, attention, ...

One table of name patterns serves every supported architecture; a family only says which
`model_type`s it covers, where its MTP layers sit and which parts it has (an indexer, q/k/v or MLA
attention). No per-model code: a new GLM/DeepSeek-style release is a new `Family` row.
"""

from __future__ import annotations

import ast
import enum
import json
import re
from dataclasses import dataclass


class TensorClass(str, enum.Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_MLP = "dense_mlp"
    ATTENTION = "attention"
    INDEXER = "indexer"
    ROUTER = "router"
    MTP_PROJ = "mtp_proj"  # eh_proj: the MTP layer's input projection
    LM_HEAD = "lm_head"  # lm_head and the MTP layer's shared_head.head
    EMBEDDING = "embedding"
    NORM = "norm"
    OTHER = "other"


# (class, pattern on the *module* name, i.e. the tensor name without its last component).
# First match wins; order matters (experts before dense MLP, indexer before attention, norms first).
_L = r"model\.layers\.\d+\."
CLASS_PATTERNS: tuple[tuple[TensorClass, re.Pattern[str]], ...] = tuple(
    (cls, re.compile(p))
    for cls, p in (
        (TensorClass.NORM, r".*norm$"),
        (TensorClass.ROUTED_EXPERT, _L + r"mlp\.experts\.\d+\.(gate|up|down)_proj$"),
        (TensorClass.SHARED_EXPERT, _L + r"mlp\.shared_experts\.(gate|up|down)_proj$"),
        (TensorClass.DENSE_MLP, _L + r"mlp\.(gate|up|down)_proj$"),
        (TensorClass.ROUTER, _L + r"mlp\.gate$"),
        (TensorClass.INDEXER, _L + r"self_attn\.indexer\.\w+$"),
        (TensorClass.ATTENTION, _L + r"self_attn\.\w+$"),
        (TensorClass.MTP_PROJ, _L + r"eh_proj$"),
        (TensorClass.LM_HEAD, r"(lm_head|" + _L + r"shared_head\.head)$"),
        (TensorClass.EMBEDDING, r"(model\.embed_tokens|" + _L + r"embed_tokens)$"),
    )
)

# Anchored compressed-tensors `ignore` entries for a class of Linear modules that stays unquantized
# (formats.md §3a: vLLM matches `re:` entries with re.match, SGLang also treats bare entries as
# case-insensitive substrings, so every entry but the exact `lm_head` is an anchored regex).
IGNORE_PATTERNS: dict[TensorClass, tuple[str, ...]] = {
    TensorClass.ROUTED_EXPERT: (r"re:.*mlp\.experts\..*",),
    TensorClass.SHARED_EXPERT: (r"re:.*mlp\.shared_experts\..*",),
    TensorClass.DENSE_MLP: (r"re:.*mlp\.(gate|up|gate_up|down)_proj$",),
    TensorClass.ROUTER: (r"re:.*mlp\.gate$",),
    TensorClass.INDEXER: (r"re:.*self_attn\.indexer\..*",),
    TensorClass.ATTENTION: (r"re:.*self_attn\.[a-z_]*proj[a-z_]*$",),
    TensorClass.MTP_PROJ: (r"re:.*eh_proj$",),
    TensorClass.LM_HEAD: ("lm_head", r"re:.*shared_head\.head$"),
}

def ignore_list(unquantized: set[TensorClass]) -> list[str]:
    """Anchored ignore entries for the Linear classes that stay unquantized, in a stable order."""
    return [p for cls in IGNORE_PATTERNS if cls in unquantized for p in IGNORE_PATTERNS[cls]]


# Modules a serving engine fuses into one layer; all members must share one scheme (formats.md §3a).
FUSED_PARTNERS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("gate_proj", "up_proj"),
    ("wk", "weights_proj"),
)
# The fused layer's own name in vLLM (QKVParallelLinear, MergedColumnParallelLinear, ...; formats.md §3a). vLLM's
# `find_matched_target` tries a layer's name against every target, then its class name by case-insensitive substring
# ("Linear" is in "QKVParallelLinear"), and only then its unfused parts' names: a config group that names the parts
# alone does not govern the fused layer while another group targets "Linear" (`fused_layer_group` in validate).
# (indexer.wk + weights_proj is left out: vLLM builds that fused layer without a quant_config, so no group governs it.)
FUSED_NAMES: dict[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("q_a_proj", "kv_a_proj_with_mqa"): "fused_qkv_a_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}
# The names SGLang builds the same fused layers under where they differ from vLLM's (deepseek_v2.py: a ReplicatedLinear
# `fused_qkv_a_proj_with_mqa`); its matcher is a copy of vLLM's, so they need targets of their own.
FUSED_ALIASES: dict[str, tuple[str, ...]] = {"fused_qkv_a_proj": ("fused_qkv_a_proj_with_mqa",)}

# Classes whose 2-D `.weight` is an nn.Linear-like weight a recipe may quantize.
LINEAR_CLASSES = frozenset(IGNORE_PATTERNS)


@dataclass(frozen=True)
class Family:
    """What differs between architectures, as data.

    Attributes:
        name: glmq's name for the family.
        model_types: config.json `model_type` values it covers.
        has_indexer: DSA indexer tensors (`self_attn.indexer.*`) exist.
        architectures: config.json `architectures` values (the model class vLLM and SGLang build) of the family.
    """

    name: str
    model_types: tuple[str, ...]
    has_indexer: bool = False
    latent_attention: bool = True  # multi-head latent attention (q_a/q_b, kv_a/kv_b); else grouped-query q/k/v
    architectures: tuple[str, ...] = ()


FAMILIES: tuple[Family, ...] = (
    Family("glm_moe_dsa", ("glm_moe_dsa",), has_indexer=True, architectures=("GlmMoeDsaForCausalLM",)),
    Family("glm4_moe", ("glm4_moe",), latent_attention=False, architectures=("Glm4MoeForCausalLM",)),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), architectures=("DeepseekV3ForCausalLM",)),  # (Kimi K2's too)
)


class UnknownArchitectureError(ValueError):
    pass


def _model_type(config: dict):
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    return model_type


def _family_of_model_type(config: dict) -> Family | None:
    """The family config.json's model_type names, or None."""
    model_type = _model_type(config)
    return next((fam for fam in FAMILIES if model_type in fam.model_types), None)


def architecture_problem(config: dict) -> str | None:
    """Why config.json's `architectures` and `model_type` name different families, or None. glmq and transformers read
    model_type, vLLM and SGLang build the model class `architectures` names: a checkpoint labelled with another family
    (GLM-5 tensors called Glm4MoeForCausalLM) converts and validates against one layout and is served as the other.
    An architecture glmq does not know is not judged here."""
    fam, arches = _family_of_model_type(config), config.get("architectures")
    if fam is None or not isinstance(arches, list):
        return None
    for arch in arches:
        other = next((f for f in FAMILIES if arch in f.architectures), None)
        if other is not None and other is not fam:
            return (f"architectures names {arch} (the {other.name} model class vLLM and SGLang build), but model_type "
                    f"is {_model_type(config)!r} (the {fam.name} family glmq and transformers read): they describe "
                    f"different layouts; set both as the model's published config.json has them")
    return None


def family_for(config: dict, config_path: str = "config.json") -> Family:
    """The family of a checkpoint's config.json, or a clear error (also where `architectures` names another family's
    model class: `architecture_problem`)."""
    model_type = _model_type(config)
    fam = _family_of_model_type(config)
    if fam is not None:
        if (problem := architecture_problem(config)) is not None:
            raise UnknownArchitectureError(f"{config_path}: {problem}")
        return fam
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise UnknownArchitectureError(
        f"{config_path}: model_type {model_type!r} (architectures {config.get('architectures')}) is not a "
        f"supported family; glmq knows {known}. Add a Family row in glmq/formats/families.py if this "
        f"model shares one of those layouts."
    )


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def classify(module: str) -> TensorClass:
    """The class of a module name such as `model.layers.5.mlp.experts.17.down_proj`."""
    for cls, pat in CLASS_PATTERNS:
        if pat.match(module):
            return cls
    return TensorClass.OTHER


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def mtp_layers(config: dict) -> range:
    """Indices of the multi-token-prediction layers stored after the decoder layers, as loaders count them
    (`layer_counts`: a num_nextn_predict_layers config.json lacks takes its config class's default)."""
    n = int(config.get("num_hidden_layers", 0))
    return range(n, n + int(loader_config(config)[0].get("num_nextn_predict_layers") or 0))


def layer_counts(config: dict) -> tuple[int, int, dict[str, str]]:
    """(first_k_dense_replace, num_nextn_predict_layers) as loaders read config.json, and for each count taken from
    its config class's default, how to say so (`loader_config`): where config.json lacks one, transformers and vLLM
    build the model with the class default (DeepseekV3Config: 3 dense layers and 1 MTP layer), not with none.
    GlmMoeDsaConfig has no num_nextn_predict_layers and kimi_k2 (remote code) no known defaults: 0 there. A null
    count is 0 (none). Counts of another type are `count_problems`' (the caller checks them first)."""
    cfg, defaulted = loader_config(config)
    return (int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("num_nextn_predict_layers") or 0),
            {k: why for k, why in defaulted.items() if k in _LAYER_COUNTS})


def _experts_key(config: dict) -> str:
    """The config key of the routed-expert count: n_routed_experts (GLM, DeepSeek), else num_local_experts."""
    return "n_routed_experts" if "n_routed_experts" in config else "num_local_experts"


EXPERT_MODULE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
_LAYER_COUNTS = ("num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers")


def count_problems(config: dict) -> list[tuple[str, str]]:
    """("config.json", problem) for an expert or layer count of the wrong kind: the expert count (n_routed_experts, or
    num_local_experts) and num_hidden_layers not a positive integer, first_k_dense_replace and
    num_nextn_predict_layers not a non-negative integer (null: none; absent: the class default, `layer_counts`)."""
    problems = []
    experts = _experts_key(config)
    for k in (experts, *_LAYER_COUNTS):
        least = 1 if k in (experts, "num_hidden_layers") else 0
        if config.get(k) is not None and (type(config[k]) is not int or config[k] < least):
            problems.append(("config.json", f"{k} is {json.dumps(config[k])}, not a "
                                            f"{'positive' if least else 'non-negative'} integer"))
    return problems


def expert_layout_problems(modules, config: dict, mtp_required: bool = True) -> list[tuple[str, str]]:
    """(module, problem) for every way the routed experts stored disagree with config.json, which loaders build the
    model from: an expert or layer count of the wrong kind (`count_problems`), a MoE layer without all of experts
    0..n-1 (gate, up and down), experts numbered n or above, or experts in a layer loaders build dense.

    The MoE layers are those that hold experts and, with the layer counts, every layer from first_k_dense_replace to
    num_hidden_layers, and the MTP layers too when `mtp_required` (a converter passes False: a source without its MTP
    layer serves, the layer only drafts tokens); the decoder layers below first_k_dense_replace are dense. The layer
    counts are the loader's (`layer_counts`: a count config.json lacks takes its class default, and a problem that
    depends on it says so). `modules`: the module names stored (without .weight).
    """
    key = _experts_key(config)
    n = config.get(key)
    problems = count_problems(config)
    if type(n) is not int or problems:
        return problems
    found: dict[int, set[tuple[int, str]]] = {}
    for m in modules:
        if (hit := EXPERT_MODULE.match(m)) is not None:
            found.setdefault(int(hit[1]), set()).add((int(hit[2]), hit[3]))
    layers = set(found)
    dense, nextn, defaulted = layer_counts(config)
    why: dict[int, str] = {}  # a layer that holds no expert but is MoE by a count config.json lacks: says so
    if "num_hidden_layers" in config:
        n_layers = config["num_hidden_layers"]
        moe = set(range(dense, n_layers)) | (set(mtp_layers(config)) if mtp_required else set())
        said = {"first_k_dense_replace": f"; loaders build layers {dense}..{n_layers - 1} with experts: "
                                         f"{_switch('first_k_dense_replace', dense, defaulted)}",
                "num_nextn_predict_layers": f"; loaders build the MTP layer with experts: "
                                            f"{_switch('num_nextn_predict_layers', nextn, defaulted)}"}
        for layer in moe - layers:
            count = "first_k_dense_replace" if layer < n_layers else "num_nextn_predict_layers"
            if count in defaulted:
                why[layer] = said[count]
        built_dense = set(range(min(dense, n_layers)))
        for layer in sorted(layers & built_dense):  # experts where loaders build a dense MLP (vLLM: KeyError)
            problems.append((f"model.layers.{layer}.mlp.experts",
                             f"holds experts, but {_switch('first_k_dense_replace', dense, defaulted)}: loaders "
                             f"build layers 0..{min(dense, n_layers) - 1} with a dense MLP and no experts"))
        layers = (layers | moe) - built_dense
    for layer in sorted(layers):
        have = found.get(layer, set())
        missing = [(e, p) for e in range(n) for p in ("gate", "up", "down") if (e, p) not in have]
        extra = sorted({e for e, _ in have if e >= n})
        where = f"model.layers.{layer}.mlp.experts"
        if missing:
            e, p = missing[0]
            problems.append((where, f"{len(missing)} of {3 * n} expert projections missing (config {key} = {n}), "
                                    f"e.g. experts.{e}.{p}_proj" + why.get(layer, "")))
        if extra:
            problems.append((where, f"holds experts numbered up to {extra[-1]} ({len(extra)} beyond config {key} = "
                                    f"{n}), which loaders would not build"))
    return problems


# The config.json keys the shape table, the attention switches and the layer counts (which layers are dense, MoE or
# MTP: `layer_counts`) read, with the default a loader takes where config.json lacks one: transformers 5.17's
# GlmMoeDsaConfig, Glm4MoeConfig and DeepseekV3Config (vLLM builds these model types from the same classes). Data,
# not read from transformers: importing a config class costs ~4 s a process and transformers is an optional
# dependency; tests/test_config_shapes.py compares every value with the class.
# kimi_k2 has no row: its loaders build the config from the checkpoint's own remote code, whose defaults glmq does not
# read, so a key it lacks is still skipped. Glm4MoeConfig has no head_dim: its layers take hidden_size // heads, and
# GlmMoeDsaConfig no num_nextn_predict_layers (none). Only glmq's checks read the defaults: the output's config.json
# is the source's, keys as they were.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "n_shared_experts",
               "n_routed_experts", "num_attention_heads", "num_key_value_heads", "attention_bias")
CLASS_DEFAULTS: dict[str, tuple[str, dict[str, object]]] = {
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(zip(_SHAPE_KEYS, (154880, 6144, 12288, 2048, 1, 256, 64, 64, False)),
                                            q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                                            qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
                                            index_head_dim=128, first_k_dense_replace=3)),
    "glm4_moe": ("Glm4MoeConfig", dict(zip(_SHAPE_KEYS, (151552, 4096, 10944, 1408, 1, 128, 96, 8, False)),
                                       use_qk_norm=False, first_k_dense_replace=1, num_nextn_predict_layers=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(zip(_SHAPE_KEYS, (129280, 7168, 18432, 2048, 1, 256, 128, 128, False)),
                                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3,
                                             num_nextn_predict_layers=1)),
}


def loader_config(config: dict) -> tuple[dict, dict[str, str]]:
    """config.json as a loader reads it: the keys of CLASS_DEFAULTS it lacks take their class default. Returns the
    config and, for each key filled in, how to say so ("GlmMoeDsaConfig's default"). The expert count is not filled
    where config.json names it num_local_experts (the classes map that name onto n_routed_experts)."""
    model_type = config.get("model_type")
    if model_type not in CLASS_DEFAULTS:
        return config, {}
    cls, defaults = CLASS_DEFAULTS[model_type]
    filled = {k: v for k, v in defaults.items() if k not in config
              and not (k == "n_routed_experts" and "num_local_experts" in config)}
    return {**config, **filled}, {k: f"{cls}'s default; config.json has none" for k in filled}


def _switch(key: str, value, defaulted: dict[str, str]) -> str:
    """`config.json's q_lora_rank is 2048`, or where config.json lacks the key, the class default that applies."""
    v = "null" if value is None else str(value).lower() if type(value) is bool else value
    return f"{key} is {v} ({defaulted[key]})" if key in defaulted else f"config.json's {key} is {v}"


def _layer_shapes(config: dict) -> dict[str, tuple[str, ...]]:
    """Inside a decoder (or MTP) layer: tensor path -> (its shape as config keys, as transformers' layer classes build
    it; tests/test_config_shapes.py checks each against them). A key is a config key, `a*b` a product, `a+b` a sum,
    `a//b` a quotient.

    Hand-written (transformers builds the layer, but importing its modeling code costs ~5 s a process, more than a
    tiny checkpoint's whole conversion). A key missing from config.json takes its class default (`loader_config`); one
    without a known default, or not an integer, skips the tensor (`config_shape_problems`)."""
    h, i, mi = "hidden_size", "intermediate_size", "moe_intermediate_size"
    e = _experts_key(config)
    shapes = {
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "mlp.shared_experts.gate_proj.weight": (f"{mi}*n_shared_experts", h),
        "mlp.shared_experts.up_proj.weight": (f"{mi}*n_shared_experts", h),
        "mlp.shared_experts.down_proj.weight": (h, f"{mi}*n_shared_experts"),
        "mlp.experts.*.gate_proj.weight": (mi, h), "mlp.experts.*.up_proj.weight": (mi, h),
        "mlp.experts.*.down_proj.weight": (h, mi),
        "mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "eh_proj.weight": (h, f"2*{h}"), "enorm.weight": (h,), "hnorm.weight": (h,),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": ("vocab_size", h),
        "embed_tokens.weight": ("vocab_size", h),
    }
    if _latent(config):  # multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-5)
        qk = "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)"
        shapes.update({
            "self_attn.q_a_proj.weight": ("q_lora_rank", h), "self_attn.q_a_layernorm.weight": ("q_lora_rank",),
            "self_attn.q_b_proj.weight": (qk, "q_lora_rank"), "self_attn.q_proj.weight": (qk, h),
            "self_attn.kv_a_proj_with_mqa.weight": ("kv_lora_rank+qk_rope_head_dim", h),
            "self_attn.kv_a_layernorm.weight": ("kv_lora_rank",),
            "self_attn.kv_b_proj.weight": ("num_attention_heads*(qk_nope_head_dim+v_head_dim)", "kv_lora_rank"),
            "self_attn.o_proj.weight": (h, "num_attention_heads*v_head_dim"),
            "self_attn.indexer.wq_b.weight": ("index_n_heads*index_head_dim", "q_lora_rank"),
            "self_attn.indexer.wk.weight": ("index_head_dim", h), "self_attn.indexer.k_norm.weight": ("index_head_dim",),
            "self_attn.indexer.k_norm.bias": ("index_head_dim",),
            "self_attn.indexer.weights_proj.weight": ("index_n_heads", h),
        })
    else:  # grouped-query attention (GLM-4.x MoE); without head_dim, transformers and vLLM take hidden / heads
        d = "head_dim" if "head_dim" in config else "(hidden_size//num_attention_heads)"
        q, kv = f"num_attention_heads*{d}", f"num_key_value_heads*{d}"
        shapes.update({
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        })
    return shapes


def _family_has(config: dict, part: str, key: str) -> bool:
    """The config's family's flag `part` (a Family attribute); for an unknown family, whether config.json has `key`."""
    fam = _family_of_model_type(config)  # (an `architectures` of another family is `architecture_problem`'s)
    return key in config if fam is None else getattr(fam, part)


def _latent(config: dict) -> bool:
    """Whether the config's family has multi-head latent attention (an unknown one: whether it has kv_lora_rank)."""
    return _family_has(config, "latent_attention", "kv_lora_rank")


def _has_indexer(config: dict) -> bool:
    """Whether the config's family has the DSA indexer (an unknown one: whether it has index_n_heads)."""
    return _family_has(config, "has_indexer", "index_n_heads")


_EXPERT_PATH = re.compile(r"mlp\.experts\.\d+\.")


def _dim(expr: str, config: dict) -> int | None:
    """The value of a shape expression of config keys (`a*(b+c)`, `a//b`), or None when a key is missing or no
    integer."""
    return _arith(ast.parse(expr, mode="eval").body, config)


def _arith(node, config: dict) -> int | None:
    """Config keys, integers, +, * and // (the table's own expressions); None where a key is missing or no integer."""
    if isinstance(node, ast.Name):
        v = config.get(node.id)
        return v if type(v) is int else None
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult, ast.FloorDiv)):
        a, b = _arith(node.left, config), _arith(node.right, config)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.FloorDiv):
            return a // b if b else -1  # a zero head count: no shape matches it
        return a + b if isinstance(node.op, ast.Add) else a * b
    raise ValueError(f"not a shape expression: {ast.dump(node)}")


_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_INDEXER_KEYS = ("index_n_heads", "index_head_dim")


def config_value_problems(config: dict, wrong: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """("config.json", problem) for every key the shape table or the attention switches read whose value is of the
    wrong kind (`wrong`: `_wrong_values(config)`, when the caller has it already)."""
    wrong = _wrong_values(config) if wrong is None else wrong
    return [("config.json", f"{k} is {json.dumps(config[k])}, not {want}") for k, want in wrong.items()]


def _wrong_values(config: dict) -> dict[str, str]:
    """Key -> what its value should be, for the keys of config.json that hold a value of the wrong kind: a dimension
    that is not a positive integer (`"256"`, `1.5`, `0`), n_shared_experts not a non-negative integer or null,
    q_lora_rank not a positive integer or null (with a DSA indexer: not a positive integer), attention_bias or
    use_qk_norm not true or false. Only the keys of the config's own attention are read (a stray MLA key in a
    grouped-query config is not); the expert and layer counts are expert_layout_problems'."""
    latent, indexer = _latent(config), _has_indexer(config)
    positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads"]
    positive += [*_MLA_KEYS, *(_INDEXER_KEYS if indexer else ())] if latent else ["num_key_value_heads", "head_dim"]
    rules = [(k, "a positive integer", lambda v: type(v) is int and v > 0) for k in positive]
    rules += [("n_shared_experts", "a non-negative integer or null", lambda v: v is None or type(v) is int and v >= 0)]
    if latent and indexer:  # the DSA indexer's wq_b reads the compressed query: GlmMoeDsaConfig takes no null
        rules += [("q_lora_rank", "a positive integer (the DSA indexer reads the compressed query)",
                   lambda v: type(v) is int and v > 0)]
    elif latent:
        rules += [("q_lora_rank", "a positive integer or null", lambda v: v is None or type(v) is int and v > 0)]
    else:
        rules += [(k, "true or false", lambda v: type(v) is bool) for k in ("attention_bias", "use_qk_norm")]
    return {k: want for k, want, ok in rules if k in config and not ok(config[k])}


def config_shape_problems(shapes: dict[str, tuple], config: dict) -> list[tuple[str, str]]:
    """("config.json", problem) for each value of the wrong kind (`config_value_problems`), then (tensor, problem)
    for every stored tensor that loaders shape from config.json alone and that has another shape: the embedding and
    lm_head [vocab_size, hidden_size], the final norm, and in each decoder and MTP layer every attention, MLP, expert,
    router and norm tensor (`_layer_shapes`). `shapes`: tensor name -> shape as stored, a pack-quantized module's
    under `<module>.weight_shape` (its [N, K])."""
    wrong = _wrong_values(config)
    bad = config_value_problems(config, wrong)
    config, defaulted = loader_config(config)
    config = config | dict.fromkeys(wrong)  # their rows are skipped, not reported a second time
    table = {"top:model.embed_tokens.weight": ("vocab_size", "hidden_size"),
             "top:lm_head.weight": ("vocab_size", "hidden_size"), "top:model.norm.weight": ("hidden_size",),
             **_layer_shapes(config)}
    wants = {path: tuple(_dim(e, config) for e in exprs) for path, exprs in table.items()}  # once, not per tensor
    problems = list(bad)
    for name, shape in sorted(shapes.items()):
        if name.endswith(".weight_shape"):
            name = name.removesuffix("_shape")
        m = _LAYER.match(name)
        path = "top:" + name if m is None else _EXPERT_PATH.sub("mlp.experts.*.", name[m.end():])
        want = wants.get(path)
        if want is not None and None not in want and tuple(shape) != want:
            said = "; ".join(f"{k}: {why}" for k, why in defaulted.items()
                             if re.search(rf"\b{k}\b", " ".join(table[path])))
            whose = "the loader's" if said else "config.json's"
            problems.append((name, f"shape {list(shape)}, but {whose} {' x '.join(table[path])} is {list(want)}"
                                   + (f" ({said})" if said else "")))
    return problems


_ATTN_LAYER = re.compile(r"model\.layers\.\d+\.self_attn\.")
# paths inside self_attn that only one kind of attention (or the DSA indexer) has
_MLA_ONLY = ("q_a_proj", "q_a_layernorm.weight", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm.weight",
             "kv_b_proj")
_GQA_ONLY = ("k_proj", "v_proj")
_INDEXER_MODULES = ("indexer.wq_b", "indexer.wk", "indexer.k_norm", "indexer.weights_proj")


def attention_presence_problems(names, config: dict, missing: bool = True) -> list[tuple[str, str]]:
    """(module or tensor, problem) where config.json's attention switches and the tensors stored disagree on which
    tensors exist: multi-head latent attention's q_lora_rank (an integer: q_a_proj and q_b_proj; null: q_proj),
    grouped-query attention's attention_bias (the q, k and v biases) and use_qk_norm (q_norm, k_norm); and for a known
    model_type, its family's attention: grouped-query's q, k and v projections, and no tensor only another
    family has (MLA's q_a/kv_a/kv_b, GQA's k/v, the DSA indexer).

    Loaders build what the switch says: a tensor stored beside it is refused (vLLM) or dropped with a warning
    (transformers), and a missing one is left unset. A switch absent from config.json
    takes its class default (`loader_config`); one of another type, or without a known default, is not checked.
    `names`: every tensor name stored; `missing`: False leaves out the tensors missing (some files could not be read:
    they may lie there)."""
    config, defaulted = loader_config(config)
    names = set(names)
    modules = {n.rpartition(".")[0] for n in names}
    rules: list[tuple[str, bool, str]] = []  # (path inside self_attn, built?, why)
    if _latent(config):
        q = config.get("q_lora_rank", "absent")
        if (q is None and not _has_indexer(config)) or type(q) is int:  # (an indexer's null: config_value_problems)
            why = _switch("q_lora_rank", q, defaulted)
            rules += [("q_a_proj", q is not None, why), ("q_a_layernorm.weight", q is not None, why),
                      ("q_b_proj", q is not None, why), ("q_proj", q is None, why)]
    else:
        for key, paths in (("attention_bias", ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
                           ("use_qk_norm", ("q_norm.weight", "k_norm.weight"))):
            if type(config.get(key)) is bool:
                rules += [(p, config[key], _switch(key, config[key], defaulted)) for p in paths]
    if (fam := _family_of_model_type(config)) is not None:
        # the family's own attention: another family's tensors (GLM-5 or DeepSeek-V3 labelled glm4_moe) are not built,
        # and grouped-query attention's q, k and v projections are (the switches above judge only their extras)
        why = (f"config.json's model_type is {_model_type(config)!r} ("
               f"{'multi-head latent' if fam.latent_attention else 'grouped-query'} attention"
               f"{'' if fam.has_indexer else ', no DSA indexer'})")
        rules += [(p, False, why) for p in (_GQA_ONLY if fam.latent_attention else _MLA_ONLY)]
        rules += [] if fam.latent_attention else [(p, True, why) for p in ("q_proj", "k_proj", "v_proj")]
        rules += [] if fam.has_indexer else [(p, False, why) for p in _INDEXER_MODULES]
    problems = []
    for layer in sorted({m.group(0) for n in names if (m := _ATTN_LAYER.match(n))}):
        for path, built, why in rules:
            name = layer + path
            stored = name in names or name in modules
            if stored and not built:
                problems.append((name, f"stored, but {why}: loaders do not build it"))
            elif built and not stored and missing:
                problems.append((name, f"missing, but {why}: loaders build it and find no weights for it"))
    return problems


# Tensors glmq's layout table (formats/fixtures.logical_tensors) does not decide on: the MTP layer's own head and
# embeddings (GLM-5.2 ties them to the main model's, DeepSeek-V3 stores them; GLM-5/5.1 unconfirmed, formats.md §1)
# rotary buffers some exports carry (loaders skip them), and an FP8 KV cache's scales (vLLM remaps and loads them).
_OPTIONAL = re.compile(r"model\.layers\.\d+\.(shared_head\.head\.(weight|weight_packed|weight_scale|weight_shape|"
                       r"weight_zero_point|weight_g_idx)|embed_tokens\.weight)$|.*\.rotary_emb\.inv_freq$"
                       r"|.*\.self_attn\.(attn\.)?(k|v|q|kv|prob)_scale$")
# A Linear's leaves besides .weight: its pack-quantized ones, and with FP8 scales (block or compressed-tensors) every
# companion a stored Linear may have (validate's checks and the layout check read these)
INT_LEAVES = ("weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx")
COMPANIONS = ("weight_scale", "weight_scale_inv", "input_scale", *INT_LEAVES)
_LINEAR_LEAVES = {"weight", *COMPANIONS}

UNKNOWN_TENSOR = "has no parameter"  # how `layout_problems` starts a stored tensor's problem that no layer has
NO_KEY = "config.json has no key"  # how `layout_problems` starts its reason when a key the layout is built from is missing


def mtp_stored(modules, config: dict) -> bool:
    """Whether any tensor of an MTP layer (`mtp_layers`) is stored; `modules`: the module names stored. This is the
    rule for `mtp_required`: a model without any MTP tensor serves (the layer only drafts tokens), one with its MTP
    layer in part lost tensors. Layer counts of another type (count_problems reports them): False."""
    if any(type(config.get(k)) not in (int, type(None)) for k in _LAYER_COUNTS) or "num_hidden_layers" not in config:
        return False
    mtp = set(mtp_layers(config))
    return any(layer_index(m + ".") in mtp for m in modules)


def mtp_absent(modules, config: dict) -> str | None:
    """The note for a model whose config.json counts MTP layers (`mtp_layers`, the loader's count) none of whose
    tensors is stored (`mtp_stored`; `modules`: the module names stored), else None: vLLM and SGLang serve it without
    the layer, but MTP drafting cannot run. `glmq plan`/`quantize` warn with it, `glmq validate` too."""
    if type(config.get("num_hidden_layers")) is not int or count_problems(config):  # (reported apart)
        return None
    mtp = list(mtp_layers(config))
    if not mtp or mtp_stored(modules, config):
        return None
    said = _switch("num_nextn_predict_layers", len(mtp), layer_counts(config)[2])
    return (f"{said}, but no tensor of the MTP layer (model.layers.{mtp[0]}.*) is stored: vLLM and SGLang serve the "
            f"model without it, but MTP speculative decoding cannot run; set num_nextn_predict_layers to 0 to say so")


def layout_problems(parts: dict[str, set[str]], config: dict, missing: bool = True, told=frozenset(),
                    mtp_required: bool = True) -> tuple[list[tuple[str, str]], str | None]:
    """(where, problem) for each tensor config.json's model has that is not stored, each tensor stored that it has no
    parameter for (vLLM's load_weights raises KeyError on such a name and leaves a missing one uninitialized), the
    layer count, and routing / activation values no loader runs; and why the list could not be made, or None.

    `parts`: module -> its leaves as stored (a source's `weight`, `weight_scale_inv`; an output's `weight_packed`, ...).
    The promised tensors are glmq's layout table (formats/fixtures.logical_tensors: the layers, dense and MoE, MLA or
    GQA attention, the DSA indexer, the MTP layer, from the config keys loaders build them from), a Linear's weight
    in any stored form. The routed experts are `expert_layout_problems`' (counted per layer there) and names in
    `told` were reported by `attention_presence_problems`. `missing`: False leaves out the tensors missing (some
    files could not be read). `mtp_required`: False accepts a model without any MTP tensor (it serves; the layer only
    drafts tokens), as `expert_layout_problems`. Where: a tensor name, "model.layers" for the layer count, or
    "config.json" for a value no loader runs or an `architecture_problem`. The reason starts with NO_KEY where
    config.json lacks a key the layout is built from (the model it describes is not known: callers refuse it)."""
    from glmq.formats.fixtures import family_of, logical_tensors

    if count_problems(config):  # reported by the expert check
        return [], None
    if (problem := architecture_problem(config)) is not None:  # which layout config.json promises is not known
        return [("config.json", problem)], None
    cfg, _ = loader_config(config)  # (the layer counts too: `layer_counts`)
    try:
        family = family_of(cfg)
        specs = [s for group in logical_tensors(cfg, family) for s in group]
    except KeyError as e:  # a key loaders build the model from: the caller refuses, not skips. Where glmq does not
        # know the loader's defaults (kimi_k2's remote code), only the layer count, which places the MTP layer
        key = e.args[0] if e.args else None
        if isinstance(key, str) and key not in cfg and (key == "num_hidden_layers" or
                                                        cfg.get("model_type") in CLASS_DEFAULTS):
            return [], f"{NO_KEY} {key!r}"
        return [], f"{type(e).__name__}: {e}"
    except (TypeError, ValueError) as e:
        return [], f"{type(e).__name__}: {e}"
    tied = cfg.get("tie_word_embeddings") is True
    n_layers, (_, nextn, defaulted) = int(cfg["num_hidden_layers"]), layer_counts(config)
    counts = (f"config.json's num_hidden_layers ({n_layers}) + num_nextn_predict_layers ({nextn})"
              if "num_nextn_predict_layers" not in defaulted else
              f"num_hidden_layers ({n_layers}, config.json's) + num_nextn_predict_layers ({nextn}, "
              f"{defaulted['num_nextn_predict_layers']})")
    layers = n_layers + (nextn if mtp_required or mtp_stored(parts, cfg) else 0)
    promised: dict[str, str] = {}  # tensor name -> kind
    for s in specs:
        hit = _LAYER.match(s.name)
        if (EXPERT_MODULE.match(s.name.rpartition(".")[0]) or _OPTIONAL.match(s.name)
                or hit and int(hit[1]) >= layers):
            continue
        promised[s.name] = s.kind
    linear = {n.rpartition(".")[0] for n, kind in promised.items() if kind in ("linear", "bf16_linear")}
    told = set(told)
    out: list[tuple[str, str]] = []
    if missing:
        for name in promised:
            module, _, leaf = name.rpartition(".")
            have = parts.get(module, set())
            here = leaf in have or module in linear and leaf == "weight" and "weight_packed" in have
            if not here and not {name, module} & told:
                out.append((name, "is missing, but the model config.json describes has it (vLLM would leave it "
                                  "uninitialized or refuse the checkpoint): the conversion lost it, or config.json "
                                  "describes another layout"))
    for module, leaves in parts.items():
        if EXPERT_MODULE.match(module):  # which experts are stored is `expert_layout_problems`'; their leaves are here
            out += [(f"{module}.{leaf}", f"{UNKNOWN_TENSOR} in the {family} model config.json describes (an expert "
                                         f"projection holds a Linear's weight and its quantization companions only; "
                                         f"vLLM raises KeyError on it)") for leaf in sorted(leaves - _LINEAR_LEAVES)]
            continue
        for leaf in leaves:
            name = f"{module}.{leaf}"
            if (name in promised or module in linear and leaf in _LINEAR_LEAVES or _OPTIONAL.match(name)
                    or {name, module} & told):
                continue
            if tied and name == "lm_head.weight":
                out.append((name, "is stored but config.json's tie_word_embeddings is true: loaders use "
                                  "embed_tokens as the head and skip this one; set tie_word_embeddings to false"))
            elif (hit := _LAYER.match(name)) and int(hit[1]) >= n_layers + nextn:
                out.append((name, f"belongs to layer {hit[1]}, but {counts} build layers 0..{n_layers + nextn - 1} "
                                  f"only"))
            else:
                out.append((name, f"{UNKNOWN_TENSOR} in the {family} model config.json describes (vLLM raises "
                                  f"KeyError on it); config.json and the tensors disagree"))
    top = max((i for m in parts if (i := layer_index(m + ".")) is not None), default=-1) + 1
    if top > n_layers + nextn or missing and 0 < top < layers:  # the cause of the tensor lines: said first
        out.insert(0, ("model.layers", f"layers 0..{top - 1} are stored, but {counts} build layers "
                                       f"0..{n_layers + nextn - 1}: config.json and the tensors disagree on the layer "
                                       f"count (the MTP layer is the last, after num_hidden_layers)"))
    out += _routing_problems(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        out.append(("config.json", f"hidden_act is {cfg['hidden_act']!r}: vLLM's and SGLang's GLM / DeepSeek MoE "
                                   f"layers (and Marlin-MoE) support only 'silu'"))
    return out, None


def _routing_problems(cfg: dict) -> list[tuple[str, str]]:
    """("config.json", problem) for routing settings no loader can run: more experts per token than routed experts,
    more groups picked than there are, or experts that do not split into the groups (torch.topk and the grouped
    top-k of vLLM / SGLang fail or index out of range on the first token)."""
    n, k = cfg.get("n_routed_experts", cfg.get("num_local_experts")), cfg.get("num_experts_per_tok")
    groups, pick = cfg.get("n_group"), cfg.get("topk_group")
    ints = lambda *v: all(type(x) is int and x > 0 for x in v)  # noqa: E731 (other types: count_problems' kind)
    out = []
    if ints(n, k) and k > n:
        out.append(("config.json", f"num_experts_per_tok is {k}, more than the {n} routed experts"))
    if ints(groups, pick) and pick > groups:
        out.append(("config.json", f"topk_group is {pick}, more than n_group ({groups})"))
    if ints(n, groups) and n % groups:
        out.append(("config.json", f"n_group ({groups}) does not divide the {n} routed experts"))
    elif ints(n, groups) and n // groups < 2 and groups > 1:
        # grouped top-k with the correction bias scores a group by its two best experts (topk(2) in vLLM, SGLang and
        # transformers' router): a group of one expert indexes out of range
        out.append(("config.json", f"n_group ({groups}) leaves {n // groups} routed expert per group; grouped top-k "
                                   f"scores each group by its two best experts"))
    elif ints(n, groups, pick, k) and pick <= groups and pick * (n // groups) < k:
        out.append(("config.json", f"topk_group ({pick}) groups of {n // groups} experts hold fewer than the "
                                   f"{k} experts each token picks (num_experts_per_tok)"))
    return out
