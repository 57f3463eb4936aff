"""A config.json without first_k_dense_replace or num_nextn_predict_layers: transformers and vLLM build the model from
transformers' config class, whose defaults apply to a missing key (DeepseekV3Config: 3 dense layers and 1 MTP layer,
Glm4MoeConfig: 1 and 1, GlmMoeDsaConfig: 3 dense layers and no MTP count). glmq took 0 for both everywhere: a
checkpoint stored as the loaders build it was refused (layers 0..2 "missed experts"), and one with experts in layer 0
was accepted though the loaders build layer 0 dense. Plan, quantize and validate read the counts as the loaders do
(`families.layer_counts`), say where a count was defaulted, and write config.json as the source has it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from glmq import recipes
from glmq.formats import fixtures
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import PlanError, make_plan
from test_validate import InProcessConfigJob  # tests/ is on sys.path (pytest prepends it)

# family -> (the config class's first_k_dense_replace, the keys to delete: GlmMoeDsaConfig has no MTP count, so its
# fixture's MTP layer needs the key). 4 decoder layers: a MoE layer after the class's 3 dense ones.
DEFAULTS = {"deepseek_v3": (3, ("first_k_dense_replace", "num_nextn_predict_layers")),
            "glm4_moe": (1, ("first_k_dense_replace", "num_nextn_predict_layers")),
            "glm_moe_dsa": (3, ("first_k_dense_replace",))}


@pytest.fixture(autouse=True)
def _in_process_config(monkeypatch):
    monkeypatch.setattr(stream, "ConfigJob", InProcessConfigJob)


def _source(tmp_path: Path, family: str, name: str, drop=(), **overrides) -> Path:
    root = fixtures.make_checkpoint(tmp_path / name, family, preset="tiny",
                                    config_overrides={"num_hidden_layers": 4, **overrides})
    cfg = json.loads((root / "config.json").read_text())
    for key in drop:
        del cfg[key]
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


def _without(root: Path, *keys: str) -> None:
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({k: val for k, val in cfg.items() if k not in keys}))
    (root / "glmq_manifest.json").unlink(missing_ok=True)  # (its record of config.json would name the edit)


@pytest.mark.parametrize("family", sorted(DEFAULTS))
def test_a_source_stored_as_the_class_defaults_build_it_converts_and_validates_without_the_keys(family, tmp_path):
    """The same tensors with the counts written out and with them left to the class: the same plan, a valid output,
    and the output's config.json keeps the source's keys (no default is written into it)."""
    dense, drop = DEFAULTS[family]
    keyed = _source(tmp_path, family, "keyed", first_k_dense_replace=dense)
    bare = _source(tmp_path, family, "bare", drop, first_k_dense_replace=dense)
    recipe = recipes.load("int4-w4a16")
    plans = [make_plan(open_source(root), recipe, 400_000) for root in (keyed, bare)]
    assert [(it.name, it.action, it.mtp) for it in plans[0].items] == [(it.name, it.action, it.mtp)
                                                                       for it in plans[1].items]
    assert any(it.mtp for it in plans[1].items)  # the MTP layer is read as one (the class's count, or the key)
    for plan, out in zip(plans, ("out-keyed", "out-bare")):
        stream.run(plan, tmp_path / out, progress=False)
        rep = v.validate(tmp_path / out, serving=False)
        assert rep.valid and not rep.checks["structure"].warnings, v.format_report(rep)
    written = json.loads((tmp_path / "out-bare" / "config.json").read_text())
    source = json.loads((bare / "config.json").read_text())
    assert not set(drop) & set(written)
    assert {k: val for k, val in written.items() if k != "quantization_config"} == \
           {k: val for k, val in source.items() if k != "quantization_config"}


def test_experts_in_a_layer_the_class_default_makes_dense_are_refused_naming_the_default(tmp_path):
    """deepseek_v3 with experts from layer 0 on and no first_k_dense_replace: the loaders build layers 0..2 dense
    (DeepseekV3Config's 3) and cannot load the experts; plan and validate refuse it and say the count was defaulted.
    Written out (0), the same tensors are fine."""
    why = "first_k_dense_replace is 3 (DeepseekV3Config's default; config.json has none)"
    ok = _source(tmp_path, "deepseek_v3", "ok", first_k_dense_replace=0)
    plan = make_plan(open_source(ok), recipes.load("int4-w4a16"), 400_000)
    bad = Path(shutil.copytree(ok, tmp_path / "bad"))
    _without(bad, "first_k_dense_replace")
    with pytest.raises(PlanError, match=re.escape(f"model.layers.0.mlp.experts (and 2 more tensors): holds experts, "
                                                  f"but {why}: loaders build layers 0..2 with a dense MLP")):
        make_plan(open_source(bad), recipes.load("int4-w4a16"), 400_000)
    stream.run(plan, tmp_path / "out", progress=False)
    assert v.validate(tmp_path / "out", serving=False).valid
    _without(tmp_path / "out", "first_k_dense_replace")
    rep = v.validate(tmp_path / "out", serving=False)
    msgs = [f.message for f in rep.checks["structure"].failures]
    assert rep.exit_code == 1 and f"model.layers.0.mlp.experts: holds experts, but {why}" in "\n".join(msgs), msgs


def test_dense_layers_the_class_default_makes_moe_are_refused_naming_the_default(tmp_path):
    """glm4_moe stored with 3 dense layers and no first_k_dense_replace: Glm4MoeConfig's 1 builds layers 1..3 with
    experts, which layers 1 and 2 lack."""
    bad = _source(tmp_path, "glm4_moe", "bad", ("first_k_dense_replace",), first_k_dense_replace=3)
    with pytest.raises(PlanError, match=re.escape(
            "model.layers.1.mlp.experts (and 1 more tensor): 24 of 24 expert projections missing (config "
            "n_routed_experts = 8), e.g. experts.0.gate_proj; loaders build layers 1..3 with experts: "
            "first_k_dense_replace is 1 (Glm4MoeConfig's default; config.json has none)")):
        make_plan(open_source(bad), recipes.load("int4-w4a16"), 400_000)


def test_an_mtp_count_the_class_default_sets_is_named(tmp_path):
    """deepseek_v3 without num_nextn_predict_layers builds one MTP layer (DeepseekV3Config's 1): a source of 2 MTP
    layers disagrees with it on the layer count, and an output without its MTP layer is valid with a warning that
    names the default (glmq took 0 MTP layers: neither was said)."""
    why = "DeepseekV3Config's default; config.json has none"
    two = _source(tmp_path, "deepseek_v3", "two", ("num_nextn_predict_layers",), first_k_dense_replace=1,
                  num_nextn_predict_layers=2)
    with pytest.raises(PlanError, match=re.escape(f"num_hidden_layers (4, config.json's) + num_nextn_predict_layers "
                                                  f"(1, {why}) build layers 0..4")):
        make_plan(open_source(two), recipes.load("int4-w4a16"), 400_000)
    none = _source(tmp_path, "deepseek_v3", "none", first_k_dense_replace=1, num_nextn_predict_layers=0)
    stream.run(make_plan(open_source(none), recipes.load("int4-w4a16"), 400_000), tmp_path / "out", progress=False)
    _without(tmp_path / "out", "num_nextn_predict_layers")
    rep = v.validate(tmp_path / "out", serving=False)
    assert rep.valid, v.format_report(rep)
    assert any(w.message.startswith(f"num_nextn_predict_layers is 1 ({why}), but no tensor of the MTP layer "
                                    f"(model.layers.4.*) is stored") for w in rep.checks["structure"].warnings), \
        v.format_report(rep)


def test_kimi_k2_takes_its_config_as_it_is(tmp_path):
    """kimi_k2's loaders build its config from the checkpoint's remote code, whose defaults glmq does not read: a
    missing count is still none."""
    from glmq.formats.families import layer_counts, mtp_layers

    cfg = fixtures.make_config("deepseek_v3", "tiny", model_type="kimi_k2")
    bare = {k: val for k, val in cfg.items() if k not in ("first_k_dense_replace", "num_nextn_predict_layers")}
    assert layer_counts(bare) == (0, 0, {}) and list(mtp_layers(bare)) == []
    assert layer_counts({**bare, "model_type": "deepseek_v3"})[:2] == (3, 1)


def test_glmq_plan_from_a_config_file_names_that_file(tmp_path):
    """`glmq plan -m model.json`: a plan error named `<folder>/config.json`, a file that need not exist."""
    from glmq.quantize.estimate import plan_from_config

    path = tmp_path / "my-model.json"
    cfg = json.loads((Path(__file__).resolve().parents[1] / "scripts" / "configs" / "glm-4.7-config.json").read_text())
    path.write_text(json.dumps({**cfg, "num_experts_per_tok": 1000}))
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: values of the wrong kind"):
        plan_from_config(path, "int4-w4a16")
