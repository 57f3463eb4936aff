"""`glmq quantize` and `glmq plan` warn, before any work, when vLLM/SGLang will refuse the output: the warning is
`glmq validate`'s serving check at tp 1, predicted from the plan (quantize/validate/serving.planned_problems)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from glmq import recipes
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan
from glmq.quantize.validate.serving import planned_problems
from glmq.scripts.cli import main

ASYM = "name: asym\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 64\nsymmetric: false\n"


def _rule_counts(lines: list[str]) -> set[str]:
    """'<class>: <rule> fails for N module(s)' of each message (the example module may differ)."""
    return {re.match(r"(.*? fails for \d+ module\(s\))", m).group(1) for m in lines}


@pytest.mark.parametrize("case", ["default", "asym", "all-linear-160-rows"])
def test_planned_problems_are_what_validate_fails(case, make_ckpt, tmp_path):
    """For servable and unservable outputs alike, the prediction names exactly the (class, rule, count) that
    `glmq validate`'s serving check fails on the written checkpoint."""
    src = make_ckpt("glm_moe_dsa")
    recipe = {"default": "int4-w4a16", "all-linear-160-rows": "int4-w4a16-all-linear"}.get(case)
    if recipe is None:
        (tmp_path / f"{case}.yaml").write_text(ASYM)
        recipe = str(tmp_path / f"{case}.yaml")
    plan = make_plan(open_source(src), recipes.load(recipe), 400_000)
    predicted = planned_problems(plan)
    stream.run(plan, tmp_path / "out", progress=False)
    rep = v.validate(tmp_path / "out", sample=0.05)
    found = [f.message for f in rep.checks["serving"].failures]
    assert _rule_counts(predicted) == _rule_counts(found)
    assert bool(predicted) == (case != "default"), predicted  # each unservable case is caught


def test_quantize_and_plan_warn_before_the_run(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa")
    (tmp_path / "asym.yaml").write_text(ASYM)
    runner = CliRunner()
    res = runner.invoke(main, ["plan", "-m", str(src), "--recipe", str(tmp_path / "asym.yaml")])
    assert res.exit_code == 0, res.output
    assert "warning: the output of recipe 'asym' breaks the serving rules at every tensor-parallel degree" in res.output
    assert "routed_expert: symmetric weights fails for 72 module(s)" in res.output
    assert "vLLM and SGLang refuse them" in res.output
    res = runner.invoke(main, ["quantize", "-m", str(src), "--recipe", str(tmp_path / "asym.yaml"), "-o",
                               str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert res.output.index("warning: the output of recipe") < res.output.index("wrote ")  # before the work
    res = runner.invoke(main, ["quantize", "-m", str(src), "-o", str(tmp_path / "out2"), "--no-progress"])
    assert res.exit_code == 0 and "warning" not in res.output, res.output


def test_config_only_plan_warns_too(tmp_path):
    """`glmq plan -m config.json` (GLM-5.2's real dimensions, no weights) is where a recipe is tried before a run."""
    from pathlib import Path

    (tmp_path / "asym.yaml").write_text(ASYM)
    cfg = Path(__file__).resolve().parents[1] / "scripts" / "configs" / "glm-5.2-config.json"
    res = CliRunner().invoke(main, ["plan", "-m", str(cfg), "--recipe", str(tmp_path / "asym.yaml")])
    assert res.exit_code == 0, res.output
    assert "routed_expert: symmetric weights fails for 58368 module(s)" in res.output  # 76 layers x 256 x 3
    res = CliRunner().invoke(main, ["plan", "-m", str(cfg), "--recipe", "int4-w4a16"])
    assert res.exit_code == 0 and "warning" not in res.output, res.output


def test_an_expert_width_marlin_cannot_split_warns_that_vllm_falls_back(make_ckpt, tmp_path):
    """moe_intermediate 96 at group 32: Marlin-MoE needs a multiple of 64 per rank, so vLLM takes its Triton WNA16
    MoE kernel (formats.md §3a) and SGLang refuses; the warning said neither engine would load it."""
    src = make_ckpt("glm_moe_dsa", config_overrides={"moe_intermediate_size": 96})
    res = CliRunner().invoke(main, ["plan", "-m", str(src), "--recipe", "int4-w4a16-g32"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "(moe_intermediate / tp) % max(64, group_size)" in x)
    assert "vLLM serves these experts with its slower Triton WNA16 MoE kernel" in line and "SGLang refuses" in line


def test_a_recipe_that_breaks_only_at_the_upload_degree_is_warned_before_the_run():
    """GLM-4.7's experts are 1536 wide: whole on one GPU they tile, but split 8 ways (the degree `glmq upload` checks
    by default, scripts/upload.SERVE_TP) each rank holds 192 columns, not a multiple of group 128, and vLLM leaves
    Marlin for its Triton MoE kernel while SGLang refuses them. The warning checked tp 1 only, so the run went ahead
    silently and `glmq upload` refused its output hours later."""
    from pathlib import Path

    from glmq.scripts.upload import SERVE_TP

    configs = Path(__file__).resolve().parents[1] / "scripts" / "configs"
    res = CliRunner().invoke(main, ["plan", "-m", str(configs / "glm-4.7-config.json"), "--recipe", "int4-w4a16"])
    assert res.exit_code == 0, res.output
    assert f"warning: at tp {SERVE_TP}, the degree `glmq upload` checks by default" in res.output, res.output
    assert "breaks the serving rules at every tensor-parallel degree" not in res.output, res.output
    assert "1536 / 8 = 192, % 128 = 64; vLLM serves these experts with its slower Triton WNA16 MoE kernel" in res.output
    res = CliRunner().invoke(main, ["plan", "-m", str(configs / "glm-5.2-config.json"), "--recipe", "int4-w4a16"])
    assert res.exit_code == 0 and "warning" not in res.output, res.output  # 2048 / 8 = 256


def test_a_rule_failing_at_tp_1_is_listed_again_for_the_modules_that_fail_it_only_at_the_upload_degree(make_ckpt):
    """All-linear on the tiny GLM-5: fused_qkv_a_proj (288 rows) fails Marlin's N % 64 rule on one GPU (8 modules);
    split 8 ways q_b_proj fails it too. The tp-8 list dropped every rule already warned at tp 1, so q_b_proj went
    unnamed until `glmq upload` refused the output; the tp-8 line names the new modules alone."""
    from glmq.scripts.upload import SERVE_TP

    src = make_ckpt("glm_moe_dsa")
    res = CliRunner().invoke(main, ["plan", "-m", str(src), "--recipe", "int4-w4a16-all-linear"])
    assert res.exit_code == 0, res.output
    every, _, at_tp = res.output.partition(f"warning: at tp {SERVE_TP}")
    assert "attention: output_size_per_partition % 64 == 0 fails for 8 module(s), e.g. model.layers.0.self_attn.q_a_proj" \
        in every
    (line,) = [x for x in at_tp.splitlines() if "attention: output_size_per_partition % 64 == 0" in x]
    assert "fails for 4 module(s), e.g. model.layers.0.self_attn.q_b_proj" in line, line


def test_a_source_without_the_mtp_layer_its_config_counts_is_warned_before_the_run(make_ckpt, tmp_path):
    """num_nextn_predict_layers 1, no tensor of layer N stored: plan and quantize convert it (it serves without MTP
    drafting) but said nothing, while `glmq validate` warned about the same output afterwards."""
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("deepseek_v3", config_overrides={"num_nextn_predict_layers": 0}), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    note = (f"config.json's num_nextn_predict_layers is 1, but no tensor of the MTP layer "
            f"(model.layers.{cfg['num_hidden_layers']}.*) is stored")
    runner = CliRunner()
    res = runner.invoke(main, ["plan", "-m", str(src)])
    assert res.exit_code == 0 and f"warning: {note}" in res.output, res.output
    res = runner.invoke(main, ["quantize", "-m", str(src), "-o", str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code == 0 and f"warning: {note}" in res.output, res.output
    rep = v.validate(tmp_path / "out")
    assert rep.valid and any(note in w.message for w in rep.checks["structure"].warnings), v.format_report(rep)


def test_at_the_upload_degree_the_prediction_is_what_validate_fails_there_head_split_included(make_ckpt, tmp_path):
    """The tiny model's 4 attention heads do not split 8 ways: `glmq validate --tp 8` (and so `glmq upload`) fails
    the whole model, whatever is quantized (its attention is BF16 under int4-w4a16). The plan's tp-8 prediction
    named only the experts' rule, so `glmq quantize` noted one broken rule of the two."""
    from glmq.quantize.validate.serving import HEAD_SPLIT_RULE

    src = make_ckpt("glm_moe_dsa")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 400_000)
    stream.run(plan, tmp_path / "out", progress=False)
    for tp, split in ((8, True), (4, False)):
        predicted = planned_problems(plan, tp)
        found = [f.message for f in v.validate(tmp_path / "out", sample=0.05, tp=tp).checks["serving"].failures]
        assert _rule_counts([p for p in predicted if " fails for " in p]) == _rule_counts(
            [m for m in found if " fails for " in m])
        heads = [p for p in predicted if HEAD_SPLIT_RULE in p]
        assert [m for m in found if m.startswith("attention heads: ")] == (
            [f"attention heads: num_attention_heads = 4 is not divisible by tp = {tp}: vLLM "
             f"(ModelConfig.verify_with_parallel_config) and SGLang split them tp ways and refuse the model at this "
             f"degree, whatever is quantized; serve it at a tp that divides them"] if split else [])
        assert heads == ([f"attention: {HEAD_SPLIT_RULE} fails: num_attention_heads = 4 is not divisible by tp = "
                          f"{tp}, whatever is quantized"] if split else []), predicted
    res = CliRunner().invoke(main, ["quantize", "-m", str(src), "-o", str(tmp_path / "out2"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "breaks 2 serving rule(s) (e.g. attention: attention heads split tp ways;" in res.output, res.output
