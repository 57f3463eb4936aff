"""Model families as data: which tensor names are routed experts, shared experts, attention, ...

One table of name patterns serves every supported architecture; a family only says which
`model_type`s it covers, where its MTP layers sit and which parts it has (an indexer, q/k/v or MLA
attention). No per-model code: a new GLM/DeepSeek-style release is a new `Family` row.
"""

from __future__ import annotations

import enum
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

# Classes whose 2-D `.weight` is an nn.Linear-like weight a recipe may quantize.
LINEAR_CLASSES = frozenset(IGNORE_PATTERNS)


@dataclass(frozen=True)
class Family:
    """What differs between architectures, as data.

    Attributes:
        name: glmq's name for the family.
        model_types: config.json `model_type` values it covers.
        has_indexer: DSA indexer tensors (`self_attn.indexer.*`) exist.
        experts_key / dense_key: config keys for the routed-expert count / dense leading layers.
    """

    name: str
    model_types: tuple[str, ...]
    has_indexer: bool = False
    experts_key: str = "n_routed_experts"
    dense_key: str = "first_k_dense_replace"


FAMILIES: tuple[Family, ...] = (
    Family("glm_moe_dsa", ("glm_moe_dsa",), has_indexer=True),
    Family("glm4_moe", ("glm4_moe",)),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2")),
)


class UnknownArchitectureError(ValueError):
    pass


def family_for(config: dict, config_path: str = "config.json") -> Family:
    """The family of a checkpoint's config.json, or a clear error."""
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    for fam in FAMILIES:
        if model_type in fam.model_types:
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
    """Indices of the multi-token-prediction layers stored after the decoder layers."""
    n = int(config.get("num_hidden_layers", 0))
    return range(n, n + int(config.get("num_nextn_predict_layers", 0) or 0))
