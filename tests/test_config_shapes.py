"""The config-vs-tensor shape table (`families._layer_shapes`) against transformers' own decoder-layer classes, built
on the meta device from each family's fixture config and from the released configs in scripts/configs: every tensor
transformers builds has a row, and the row's shape is transformers' shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from glmq.formats import fixtures
from glmq.formats.families import _layer_shapes, config_shape_problems, family_for

REPO = Path(__file__).resolve().parents[1]
RELEASED = sorted((REPO / "scripts" / "configs").glob("*.json"))


def _transformers_shapes(config: dict, index: int) -> dict[str, tuple[int, ...]]:
    """Layer `index`'s tensors as transformers builds them, its fused experts as checkpoints store them (expert 0)."""
    import importlib

    from accelerate import init_empty_weights

    from glmq.calibration.layers import _DROP_CONFIG_KEYS, HF_LAYERS

    spec = HF_LAYERS[family_for(config).name]
    mod = importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}")
    hf = getattr(mod, spec.config)(**{k: v for k, v in config.items() if k not in _DROP_CONFIG_KEYS})
    with init_empty_weights(include_buffers=True):
        layer = getattr(mod, spec.layer)(hf, index)
    out = {}
    for k, v in layer.state_dict().items():
        if k == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            out["mlp.experts.0.gate_proj.weight"] = out["mlp.experts.0.up_proj.weight"] = (v.shape[1] // 2, v.shape[2])
        elif k == "mlp.experts.down_proj":  # [E, H, I]
            out["mlp.experts.0.down_proj.weight"] = tuple(v.shape[1:])
        else:
            out[k] = tuple(v.shape)
    return out


def _configs():
    for fam in ("glm_moe_dsa", "glm4_moe", "deepseek_v3"):
        for preset in ("tiny", "bench"):
            yield pytest.param(fixtures.make_config(fam, preset), id=f"{fam}-{preset}")
    for p in RELEASED:
        yield pytest.param(json.loads(p.read_text()), id=p.stem)


@pytest.mark.parametrize("config", _configs())
def test_the_shape_table_is_transformers_shapes(config):
    table = _layer_shapes(config)
    dense = config.get("first_k_dense_replace") or 0
    for index in sorted({0, dense}):
        hf = _transformers_shapes(config, index)
        rows = {re.sub(r"experts\.0\.", "experts.*.", k) for k in hf}
        assert rows <= set(table), f"layer {index}: no row for {sorted(rows - set(table))}"
        stored = {f"model.layers.{index}.{k}": v for k, v in hf.items()}
        assert config_shape_problems(stored, config) == []
        # and each row is checked, not skipped: one dimension off fails it
        for name, shape in stored.items():
            off = {name: (shape[0] + 1, *shape[1:])}
            assert [n for n, _ in config_shape_problems(off, config)] == [name], name


def test_the_fixtures_and_the_shared_model_have_no_problem(make_ckpt):
    from conftest import SHARED_MODEL

    from glmq.formats.source import open_source

    roots = [make_ckpt(fam, "fp8-block") for fam in ("glm_moe_dsa", "glm4_moe", "deepseek_v3")]
    roots += [SHARED_MODEL] if SHARED_MODEL.is_dir() else []
    for root in roots:
        src = open_source(root)
        assert config_shape_problems({n: e.shape for n, e in src.entries.items()}, src.config) == [], root
        # the MTP layer's own tensors (eh_proj, enorm, hnorm, shared_head.norm), which no transformers class builds
        assert any(".eh_proj." in n for n in src.entries) and any(".shared_head.norm." in n for n in src.entries)


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_every_fixture_layout_agrees_with_its_config(preset):
    """The generated checkpoints' tensor shapes (headers only, no data) against the table, the bench presets'
    real GLM-5 / GLM-4.7 / DeepSeek-V3 layer shapes included."""
    for fam in ("glm_moe_dsa", "glm4_moe", "deepseek_v3"):
        config = fixtures.make_config(fam, preset)
        shapes = {t.name: t.shape for group in fixtures.logical_tensors(config, fam) for t in group}
        assert len(shapes) > 100 and config_shape_problems(shapes, config) == [], fam


_SWITCHES = [("deepseek_v3", {"q_lora_rank": None}), ("deepseek_v3", {"q_lora_rank": 64}),
             ("glm4_moe", {"attention_bias": False}), ("glm4_moe", {"attention_bias": True}),
             ("glm4_moe", {"use_qk_norm": True}), ("glm4_moe", {"use_qk_norm": False}),
             ("glm4_moe", {"head_dim": None}), ("glm4_moe", {"kv_lora_rank": None}), ("glm_moe_dsa", {})]


@pytest.mark.parametrize("family, switch", _SWITCHES, ids=[f"{f}-{s}" for f, s in _SWITCHES])
def test_the_attention_switches_are_transformers_tensors(family, switch):
    """What transformers builds under each attention switch passes the shape table (head_dim absent: hidden / heads)
    and the presence rules; the tensors of the opposite switch fail them."""
    from glmq.formats.families import attention_presence_problems

    config = {**fixtures.make_config(family, "tiny"), **switch}
    if switch.get("head_dim", 0) is None:
        del config["head_dim"]
        config["num_attention_heads"] = 8  # hidden / heads = 32, not the fixture's 64
    names = {f"model.layers.1.{k}": v for k, v in _transformers_shapes(config, 1).items()}
    assert config_shape_problems(names, config) == [] and attention_presence_problems(names, config) == []
    for key, value in switch.items():
        if key == "kv_lora_rank":  # a stray MLA key in a grouped-query family: its q/k/v are still checked
            assert config_shape_problems(names, {**config, "num_key_value_heads": 4})
        elif key == "head_dim":
            assert config_shape_problems(names, {**config, "head_dim": 64})
        else:
            flipped = {"q_lora_rank": None if value is not None else 64}.get(key, not value)
            assert attention_presence_problems(names, {**config, key: flipped}), (key, flipped)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "glm4_moe", "deepseek_v3"])
def test_the_class_defaults_are_transformers_defaults(model_type):
    """Each default glmq fills in for a key config.json lacks is the value transformers' config class takes, and a
    layer built from a config without that key has the default's shape."""
    import transformers

    from glmq.formats.families import CLASS_DEFAULTS

    cls_name, defaults = CLASS_DEFAULTS[model_type]
    cls = transformers.CONFIG_MAPPING[model_type]
    assert cls.__name__ == cls_name
    built = cls()
    assert {k: getattr(built, k) for k in defaults} == defaults
    if model_type == "glm4_moe":  # no head_dim default: its layers take hidden / heads, as the table does
        assert not hasattr(built, "head_dim")
    # the layer counts (which layers are dense, MoE, MTP) too; GlmMoeDsaConfig has no MTP count: none
    counts = {"first_k_dense_replace", "num_nextn_predict_layers"}
    assert counts & set(defaults) == {k for k in counts if hasattr(built, k)} and "first_k_dense_replace" in defaults


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "glm4_moe", "deepseek_v3"])
def test_the_layer_counts_a_config_json_lacks_are_the_transformers_models(model_type):
    """A fixture config without first_k_dense_replace and num_nextn_predict_layers, built by transformers' class:
    its dense layers and MTP count are what `layer_counts` reads, and it says which it defaulted."""
    import transformers

    from glmq.calibration.layers import _DROP_CONFIG_KEYS
    from glmq.formats.families import CLASS_DEFAULTS, layer_counts, mtp_layers

    counts = ("first_k_dense_replace", "num_nextn_predict_layers")
    config = {**fixtures.make_config(model_type, "tiny"), "num_hidden_layers": 5}
    bare = {k: v for k, v in config.items() if k not in counts}
    hf = transformers.CONFIG_MAPPING[model_type](**{k: v for k, v in bare.items() if k not in _DROP_CONFIG_KEYS})
    dense, nextn, defaulted = layer_counts(bare)
    assert (dense, nextn) == (hf.first_k_dense_replace, getattr(hf, "num_nextn_predict_layers", 0))
    assert list(mtp_layers(bare)) == list(range(5, 5 + nextn))
    cls_name = CLASS_DEFAULTS[model_type][0]
    assert defaulted == {k: f"{cls_name}'s default; config.json has none" for k in counts if hasattr(hf, k)}
    if hasattr(hf, "mlp_layer_types"):  # GlmMoeDsa builds each layer from it
        assert hf.mlp_layer_types == ["dense"] * dense + ["sparse"] * (5 - dense)
    assert layer_counts(config) == (config["first_k_dense_replace"], config["num_nextn_predict_layers"], {})


@pytest.mark.parametrize("family, key", [("glm_moe_dsa", "q_lora_rank"), ("glm_moe_dsa", "index_head_dim"),
                                         ("glm_moe_dsa", "moe_intermediate_size"), ("deepseek_v3", "kv_lora_rank"),
                                         ("glm4_moe", "num_key_value_heads"), ("glm4_moe", "vocab_size")])
def test_a_key_config_json_lacks_takes_the_loaders_default(family, key):
    """Stored tensors that fit the config's value fail once the key is gone from config.json (the loader builds the
    class default), with a message that says so; a default they fit passes; kimi_k2 (remote code) is not checked."""
    from glmq.formats.families import CLASS_DEFAULTS

    config = fixtures.make_config(family, "tiny")
    shapes = {t.name: t.shape for group in fixtures.logical_tensors(config, family) for t in group}
    assert config_shape_problems(shapes, config) == []
    lacking = {k: v for k, v in config.items() if k != key}
    problems = config_shape_problems(shapes, lacking)
    cls_name, defaults = CLASS_DEFAULTS[family]
    assert problems and all(f"({key}: {cls_name}'s default; config.json has none)" in p for _, p in problems)
    assert config[key] != defaults[key]
    # the default itself, written out, gives the same verdict as leaving the key out
    assert [n for n, _ in problems] == [n for n, _ in config_shape_problems(shapes, {**lacking, key: defaults[key]})]
    if family == "deepseek_v3":
        assert config_shape_problems(shapes, {**lacking, "model_type": "kimi_k2"}) == []


def test_a_switch_config_json_lacks_takes_the_loaders_default():
    """glm4_moe without use_qk_norm builds no q_norm/k_norm (Glm4MoeConfig's False): stored ones are reported;
    deepseek_v3 without q_lora_rank builds q_a/q_b (DeepseekV3Config's 1536): a q_proj checkpoint is reported."""
    from glmq.formats.families import attention_presence_problems

    config = {**fixtures.make_config("glm4_moe", "tiny"), "use_qk_norm": True}
    names = {f"model.layers.1.{k}" for k in _transformers_shapes(config, 1)}
    assert attention_presence_problems(names, config) == []
    problems = attention_presence_problems(names, {k: v for k, v in config.items() if k != "use_qk_norm"})
    assert sorted(n for n, _ in problems) == ["model.layers.1.self_attn.k_norm.weight",
                                              "model.layers.1.self_attn.q_norm.weight"]
    assert all("use_qk_norm is false (Glm4MoeConfig's default; config.json has none)" in p for _, p in problems)
    config = {**fixtures.make_config("deepseek_v3", "tiny"), "q_lora_rank": None}
    names = {f"model.layers.1.{k}" for k in _transformers_shapes(config, 1)}
    assert attention_presence_problems(names, config) == []
    problems = dict(attention_presence_problems(names, {k: v for k, v in config.items() if k != "q_lora_rank"}))
    why = "q_lora_rank is 1536 (DeepseekV3Config's default; config.json has none)"
    assert problems["model.layers.1.self_attn.q_proj"] == f"stored, but {why}: loaders do not build it", problems
    assert problems["model.layers.1.self_attn.q_a_proj"].startswith(f"missing, but {why}"), problems


@pytest.mark.parametrize("family, key, value, problem", [
    ("glm_moe_dsa", "hidden_size", "256", 'hidden_size is "256", not a positive integer'),
    ("glm_moe_dsa", "moe_intermediate_size", 0, "moe_intermediate_size is 0, not a positive integer"),
    ("glm_moe_dsa", "vocab_size", 1.5, "vocab_size is 1.5, not a positive integer"),
    ("glm_moe_dsa", "index_head_dim", True, "index_head_dim is true, not a positive integer"),
    ("glm_moe_dsa", "q_lora_rank", None, "q_lora_rank is null, not a positive integer (the DSA indexer"),
    ("deepseek_v3", "q_lora_rank", 0, "q_lora_rank is 0, not a positive integer or null"),
    ("deepseek_v3", "n_shared_experts", -1, "n_shared_experts is -1, not a non-negative integer or null"),
    ("glm4_moe", "attention_bias", "yes", 'attention_bias is "yes", not true or false'),
    ("glm4_moe", "head_dim", 32.0, "head_dim is 32.0, not a positive integer"),
])
def test_a_config_value_of_the_wrong_kind_is_one_problem(family, key, value, problem):
    """A value no loader builds from ("256", 1.5, 0) skipped every row it shapes, and the conversion and validate passed
    (exit 0); it is one problem on config.json, and the rows it shapes are not reported a second time."""
    from glmq.formats.families import config_value_problems

    config = fixtures.make_config(family, "tiny")
    shapes = {t.name: t.shape for group in fixtures.logical_tensors(config, family) for t in group}
    bad = {**config, key: value}
    assert [(w, p[:len(problem)]) for w, p in config_value_problems(bad)] == [("config.json", problem)]
    assert [w for w, _ in config_shape_problems(shapes, bad)] == ["config.json"]


def test_the_keys_of_the_other_attention_are_not_read():
    """glm4_moe (grouped-query) does not read an MLA key, deepseek_v3 no head_dim: nothing to report for them."""
    from glmq.formats.families import config_value_problems

    assert config_value_problems({**fixtures.make_config("glm4_moe", "tiny"), "kv_lora_rank": None}) == []
    assert config_value_problems({**fixtures.make_config("deepseek_v3", "tiny"), "head_dim": None,
                                  "q_lora_rank": None, "n_shared_experts": None}) == []
