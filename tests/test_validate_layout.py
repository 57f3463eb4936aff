"""`glmq validate` without --source: the tensors config.json promises (formats/fixtures.logical_tensors, the layout
loaders build from the config) are all stored and nothing else is, and the routing settings can run.

Before, the structure check compared the routed experts and the attention switches with config.json only: a missing
norm, router bias, dense projection or lm_head, a tensor renamed, and a config.json whose layer counts, dense layers,
tied head or activation disagreed with the tensors all passed (exit 0), though vLLM refuses or misbuilds each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from glmq import recipes
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan
from test_validate import InProcessConfigJob  # tests/ is on sys.path (pytest prepends it)

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def outputs(make_ckpt, tmp_path_factory):
    """family -> its int4-w4a16-all-linear output (the most tensors quantized), and "glm_moe_dsa-experts": the
    int4-w4a16 one (dense layers and attention kept BF16)."""
    base = tmp_path_factory.mktemp("layout")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        for key, family, recipe in (("glm_moe_dsa-experts", "glm_moe_dsa", "int4-w4a16"),
                                    ("glm_moe_dsa", "glm_moe_dsa", "int4-w4a16-all-linear"),
                                    ("glm4_moe", "glm4_moe", "int4-w4a16-all-linear"),
                                    ("deepseek_v3", "deepseek_v3", "int4-w4a16-all-linear")):
            src = make_ckpt(family, "fp8-block")
            stream.run(make_plan(open_source(src), recipes.load(recipe), 400_000), base / key, progress=False)
            out[key] = base / key
    return out


@pytest.fixture
def ckpt(outputs, tmp_path) -> Path:
    return Path(shutil.copytree(outputs["glm_moe_dsa-experts"], tmp_path / "ckpt"))


def structure(rep: v.Report) -> list[str]:
    return [f.message for f in rep.checks["structure"].failures]


def drop(root: Path, tensor: str, rename: str | None = None) -> None:
    """Remove `tensor` from its shard and the index (or store it as `rename`), as a converter that lost it would; the
    manifest goes too (its checksums would name the change)."""
    index = json.loads((root / INDEX).read_text())
    shard = root / index["weight_map"].pop(tensor)
    tensors = load_file(shard)
    value = tensors.pop(tensor)
    if rename:
        tensors[rename] = value
        index["weight_map"][rename] = shard.name
    save_file(tensors, shard, metadata={"format": "pt"})
    (root / INDEX).write_text(json.dumps(index))
    (root / "glmq_manifest.json").unlink()


def edit_config(root: Path, **changes) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(changes)
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key", ["glm_moe_dsa-experts", "glm_moe_dsa", "glm4_moe", "deepseek_v3"])
def test_every_family_and_recipe_output_has_exactly_the_promised_tensors(outputs, key):
    rep = v.validate(outputs[key], serving=False)  # (the tiny preset's MLA widths fail Marlin's rules all-linear)
    assert rep.valid and not rep.checks["structure"].warnings, v.format_report(rep)


@pytest.mark.parametrize("tensor", ["model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.weight",
                                    "model.layers.2.mlp.gate.e_score_correction_bias",
                                    "model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.3.eh_proj.weight",
                                    "model.layers.2.mlp.shared_experts.down_proj.weight"])
def test_a_missing_tensor_that_is_not_an_expert_fails_structure(ckpt, tensor):
    drop(ckpt, tensor)
    rep = v.validate(ckpt)
    assert rep.exit_code == 1 and f"{tensor}: is missing, but the model config.json describes has it" in \
        "\n".join(structure(rep)), v.format_report(rep)


def test_a_renamed_tensor_is_missing_and_left_over(ckpt):
    drop(ckpt, "model.norm.weight", rename="model.final_norm.weight")
    msgs = "\n".join(structure(v.validate(ckpt)))
    assert "model.norm.weight: is missing" in msgs
    assert "model.final_norm.weight: has no parameter in the glm_moe_dsa model config.json describes" in msgs


@pytest.mark.parametrize("changes, needle", [
    ({"num_hidden_layers": 2}, "config.json: layers 0..3 are stored, but num_hidden_layers (2) + "
                               "num_nextn_predict_layers (1) build layers 0..2"),
    ({"num_nextn_predict_layers": 0}, "model.layers.3.eh_proj.weight: belongs to layer 3, but config.json's "
                                      "num_hidden_layers (3) + num_nextn_predict_layers (0) build layers 0..2 only"),
    ({"first_k_dense_replace": 2}, "model.layers.1.mlp.gate_proj.weight: is missing"),
    ({"tie_word_embeddings": True}, "lm_head.weight: is stored but config.json's tie_word_embeddings is true"),
    ({"hidden_act": "gelu"}, "config.json: hidden_act is 'gelu'"),
    ({"num_experts_per_tok": 16}, "config.json: num_experts_per_tok is 16, more than the 8 routed experts"),
    ({"n_group": 2, "topk_group": 4}, "config.json: topk_group is 4, more than n_group (2)"),
    ({"n_group": 3, "topk_group": 1}, "config.json: n_group (3) does not divide the 8 routed experts"),
])
def test_a_config_whose_layout_disagrees_with_the_tensors_fails_structure(ckpt, changes, needle):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"], cfg["n_routed_experts"]) == (3, 1, 8)
    edit_config(ckpt, **changes)
    rep = v.validate(ckpt)
    assert rep.exit_code == 1 and needle in "\n".join(structure(rep)), v.format_report(rep)


def test_many_layout_problems_are_listed_up_to_a_count(ckpt):
    """Another model's config (here: a GQA architecture on MLA tensors) lists the first 20 and counts the rest."""
    edit_config(ckpt, architectures=["Glm4MoeForCausalLM"], head_dim=64, num_key_value_heads=2)
    msgs = structure(v.validate(ckpt))
    more = [m for m in msgs if m.startswith("and ") and "more tensor(s) that disagree with config.json's layout" in m]
    assert len(more) == 1 and len([m for m in msgs if ": is missing" in m or ": has no parameter" in m]) == 20


def test_an_unknown_architecture_warns_that_the_layout_was_not_checked(ckpt):
    edit_config(ckpt, architectures=["SomethingElseForCausalLM"])
    rep = v.validate(ckpt)
    assert any("the tensors config.json promises were not listed" in w.message
               for w in rep.checks["structure"].warnings), v.format_report(rep)
