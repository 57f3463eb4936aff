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
