"""The serving check on the FP8-block layers a keep_fp8 recipe keeps (a mixed-precision checkpoint): vLLM's and
SGLang's `validate_fp8_block_shape` and Fp8MoEMethod's block rules (quantize/validate/serving.py `fp8_dense_rules`,
`fp8_fused_rules`, `fp8_moe_rules`). A kept FP8 weight split tp ways must split into whole 128x128 blocks, or the
engine raises at load; the prediction before the run (`planned_failures`) and `glmq validate` agree."""

from __future__ import annotations

import pytest

from glmq import recipes
from glmq.formats.families import TensorClass
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import Action, make_plan
from glmq.quantize.validate import serving
from glmq.quantize.validate.config import Group
from glmq.quantize.validate.serving import FP8_K_RULE, FP8_N_RULE, fp8_dense_rules, fp8_fused_rules, fp8_moe_rules
from test_validate import InProcessConfigJob  # tests/ is on sys.path (pytest prepends it)

B = (128, 128)
FP8 = Group("fp8", ("Linear",), "float", 8, block=B)
KEEP_FP8 = "name: keep\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 128\nkeep_fp8: true\n"


# ------------------------------------------------------------------------------------------------ the rules
def test_a_column_parallel_layer_splits_into_whole_row_blocks():
    assert fp8_dense_rules("q_b_proj", 384, 128, 1, B) == []  # unsplit: no rule, whatever the rows
    assert fp8_dense_rules("q_b_proj", 512, 128, 4, B) == []  # 128 rows per rank
    assert fp8_dense_rules("q_b_proj", 384, 128, 2, B) == [
        (FP8_N_RULE, "N = 384, column-parallel at tp 2: 192 % 128 = 64")]
    assert fp8_dense_rules("q_b_proj", 384, 128, 5, B) == [
        ("tensor-parallel split", "N = 384 is not divisible by tp = 5")]


def test_a_row_parallel_layer_splits_into_whole_column_blocks():
    assert fp8_dense_rules("o_proj", 256, 512, 4, B) == []
    assert fp8_dense_rules("o_proj", 256, 256, 4, B) == [(FP8_K_RULE, "K = 256, row-parallel at tp 4: 64 % 128 = 64")]
    assert fp8_dense_rules("o_proj", 100, 1024, 8, B) == []  # its rows are not split


def test_a_replicated_layer_has_no_rule():
    assert fp8_dense_rules("wq_b", 96, 80, 8, B) == []  # the indexer's wq_b: ReplicatedLinear


def test_a_merged_layer_unsplit_exempts_its_last_part():
    """vLLM: merged but not split (tp 1, or the replicated fused_qkv_a_proj at any tp), the last part may end in a
    part block (kv_a_proj_with_mqa's 576 rows); every other part is whole blocks."""
    for tp in (1, 8):
        assert fp8_fused_rules("fused_qkv_a_proj", {"q_a_proj": 2048, "kv_a_proj_with_mqa": 576}, tp, B) == []
    ((rule, numbers),) = fp8_fused_rules("fused_qkv_a_proj", {"q_a_proj": 96, "kv_a_proj_with_mqa": 576}, 8, B)
    assert rule == FP8_N_RULE and numbers == ("vLLM's fused_qkv_a_proj = q_a_proj (96) + kv_a_proj_with_mqa (576), "
                                              "merged, not split: q_a_proj 96 % 128 = 96")
    assert fp8_fused_rules("gate_up_proj", {"gate_proj": 256, "up_proj": 96}, 1, B) == []


def test_a_merged_layer_split_checks_every_part_per_rank():
    ((rule, numbers),) = fp8_fused_rules("gate_up_proj", {"gate_proj": 256, "up_proj": 256}, 4, B)
    assert rule == FP8_N_RULE and numbers == ("vLLM's gate_up_proj = gate_proj (256) + up_proj (256), column-parallel "
                                              "at tp 4: gate_proj 64 per rank % 128 = 64, up_proj 64 per rank % 128 = 64")
    assert fp8_fused_rules("gate_up_proj", {"gate_proj": 256, "up_proj": 256}, 2, B) == []
    ((rule, numbers),) = fp8_fused_rules("gate_up_proj", {"gate_proj": 256, "up_proj": 256}, 3, B)
    assert rule == "tensor-parallel split" and "not divisible by tp = 3" in numbers


def test_qkv_follows_its_head_counts():
    """16 q heads and 2 KV heads of 128: at tp 2 each rank holds 8 q heads and 1 KV head (1024 + 128 + 128 rows, all
    whole blocks); at tp 8 a whole KV head is replicated on 4 ranks (256 + 128 + 128). QKVParallelLinear's output_size
    is its per-rank width times tp, so every part is checked as split, v_proj too (a review caught a first version
    that took the replicated case as merged and let a v_proj of 64 rows a rank pass)."""
    parts = {"q_proj": 2048, "k_proj": 256, "v_proj": 256}
    assert fp8_fused_rules("qkv_proj", parts, 2, B, heads=(16, 2)) == []
    assert fp8_fused_rules("qkv_proj", parts, 8, B, heads=(16, 2)) == []
    small = {"q_proj": 16 * 64, "k_proj": 2 * 64, "v_proj": 2 * 64}  # heads of 64: 64 rows of K per rank at tp 2
    ((rule, numbers),) = fp8_fused_rules("qkv_proj", small, 2, B, heads=(16, 2))
    assert rule == FP8_N_RULE and "k_proj 64 per rank % 128 = 64, v_proj 64 per rank % 128 = 64" in numbers
    narrow_v = {"q_proj": 2048, "k_proj": 256, "v_proj": 128}  # v heads of 64: 64 rows a rank at tp 8
    ((rule, numbers),) = fp8_fused_rules("qkv_proj", narrow_v, 8, B, heads=(16, 2))
    assert rule == FP8_N_RULE and numbers.endswith("column-parallel at tp 8: v_proj 64 per rank % 128 = 64")
    twelve = {"q_proj": 12 * 128, "k_proj": 256, "v_proj": 256}
    ((rule, numbers),) = fp8_fused_rules("qkv_proj", twelve, 8, B, heads=(12, 2))
    assert rule == "tensor-parallel split" and "num_attention_heads = 12 is not divisible by tp = 8" in numbers


def test_fp8_experts_split_into_whole_blocks():
    assert fp8_moe_rules(2048, 16, B) == []  # GLM-5's experts: 128 per rank
    assert [r for r, _ in fp8_moe_rules(2048, 32, B)] == ["FP8 (moe_intermediate / tp) % block_n == 0",
                                                          "FP8 (moe_intermediate / tp) % block_k == 0"]
    assert fp8_moe_rules(2048, 32, B)[0][1] == "2048 / 32 = 64, % 128 = 64"
    assert fp8_moe_rules(192, 1, B) == [("FP8 (moe_intermediate / tp) % block_n == 0", "192 / 1 = 192, % 128 = 64")]
    assert fp8_moe_rules(2048, 3, B) == [("tensor-parallel split", "moe_intermediate = 2048 is not divisible by tp = 3")]


def test_shape_rules_give_fp8_modules_the_fp8_rules_and_int_modules_marlins():
    """In one checkpoint: INT4 routed experts (Marlin-MoE), FP8 attention and shared experts (block rules); a fused
    layer is checked as one only when its parts are stored alike."""
    int4 = Group("g", ("Linear",), "int", 4, 128, True)
    notes = []
    attn, shared = "model.layers.1.self_attn", "model.layers.1.mlp.shared_experts"
    targets = [(TensorClass.ATTENTION, f"{attn}.q_b_proj", (384, 128), FP8),
               (TensorClass.ATTENTION, f"{attn}.o_proj", (256, 128), FP8),
               (TensorClass.SHARED_EXPERT, f"{shared}.gate_proj", (128, 256), FP8),
               (TensorClass.SHARED_EXPERT, f"{shared}.up_proj", (128, 256), int4),
               (TensorClass.ROUTED_EXPERT, "model.layers.1.mlp.experts.0.gate_proj", (128, 256), int4),
               (TensorClass.ROUTED_EXPERT, "model.layers.1.mlp.experts.0.up_proj", (128, 256), int4),
               (TensorClass.ROUTED_EXPERT, "model.layers.1.mlp.experts.0.down_proj", (256, 128), int4)]
    serving._shape_rules(targets, 2, lambda *a: notes.append(a))
    got = {(cls.value, name.rpartition(".")[2], rule) for cls, name, rule, _ in notes}
    moe = "(moe_intermediate / tp) % max(64, group_size) == 0"  # 128 / 2 = 64 per rank, groups of 128
    assert got == {("attention", "q_b_proj", FP8_N_RULE), ("attention", "o_proj", FP8_K_RULE),  # 192 rows, 64 cols
                   ("shared_expert", "gate_proj", FP8_N_RULE),  # alone (up_proj is INT4): 64 rows per rank
                   # (up_proj alone, Marlin: 64 rows and 256 columns per rank pass)
                   *(("routed_expert", leaf, moe) for leaf in ("gate_proj", "up_proj", "down_proj"))}


# ------------------------------------------------------------------------------------------------ a written checkpoint
@pytest.fixture(scope="module")
def kept(make_ckpt, tmp_path_factory):
    """(plan, output) of keep_fp8 on the tiny GLM-5 layout: INT4 routed experts, FP8-block attention (q_b_proj 384
    rows, o_proj 256 columns), shared experts (128 rows) and the dense layer's MLP."""
    tmp = tmp_path_factory.mktemp("keep")
    src = make_ckpt("glm_moe_dsa", "fp8-block", config_overrides={"index_head_dim": 128})
    (tmp / "keep.yaml").write_text(KEEP_FP8)
    plan = make_plan(open_source(src), recipes.load(str(tmp / "keep.yaml")), 400_000)
    assert {it.cls for it in plan.items if it.action is Action.KEEP_FP8} >= {TensorClass.ATTENTION,
                                                                             TensorClass.SHARED_EXPERT}
    return plan, _write(plan, tmp / "out")


def _write(plan, out):
    """`stream.run` with the compressed-tensors config built in this process (test_validate.InProcessConfigJob)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        stream.run(plan, out, progress=False)
    return out


def _validated(out, tp: int) -> dict[tuple[str, str], set[str]]:
    rep = v.validate(out, tp=tp, sample=0.01)
    rows = rep.checks["serving"].details["classes"]
    return {(cls, r["rule"]): r["modules"] for cls, row in rows.items() for r in row["rules"]}


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_validate_and_the_plan_agree_on_the_kept_fp8_layers(kept, tp):
    """At tp 1 the kept layers serve; at tp 2 q_b_proj (192 rows per rank) and the shared experts (64) do not, and
    validate said "valid" for them before; the plan's warning before the run names the same rules and counts."""
    plan, out = kept
    got = _validated(out, tp)
    planned = {key: len(mods) for key, mods in serving.planned_failures(plan, tp).items()
               if key[1] != serving.HEAD_SPLIT_RULE}  # (validate's line for the model's heads names no module)
    assert got == planned
    fp8 = {key for key in got if key[1].startswith("FP8")}
    if tp == 1:
        assert not fp8
    else:
        assert {("attention", FP8_N_RULE), ("shared_expert", FP8_N_RULE), ("shared_expert", FP8_K_RULE)} <= fp8
        rep = v.validate(out, tp=tp, sample=0.01)
        assert not rep.valid
        assert any(m.startswith(f"attention: {FP8_N_RULE} fails for") and "column-parallel at tp" in m
                   for m in (f.message for f in rep.checks["serving"].failures))


def test_a_source_of_64x64_blocks_keeps_them_as_64x64(make_ckpt, tmp_path):
    """keep_fp8 stores the source's scales as they are, but the config's FP8 group always said 128x128: a 64x64-block
    source gave a checkpoint whose every kept scale had the wrong shape for its config (validate: invalid; vLLM
    reads the scales at the wrong block). The group now declares the source's block, and the serving rules use it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src64"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block", config_overrides={"index_head_dim": 128}), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    shapes = {n: t.shape for shard in src.glob("*.safetensors") for n, t in load_file(shard).items()}
    for shard in src.glob("*.safetensors"):  # each 128x128 block's scale on its four 64x64 blocks: the same weights
        tensors = load_file(shard)
        for name, t in list(tensors.items()):
            if name.endswith("_scale_inv"):
                rows, cols = shapes[name.removesuffix("_scale_inv")]
                big = t.repeat_interleave(2, 0).repeat_interleave(2, 1)
                tensors[name] = big[:-(-rows // 64), :-(-cols // 64)].contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    (tmp_path / "keep.yaml").write_text(KEEP_FP8)
    plan = make_plan(open_source(src), recipes.load(str(tmp_path / "keep.yaml")), 400_000)
    assert plan.source.block == (64, 64) and any(it.action is Action.KEEP_FP8 for it in plan.items)
    _write(plan, tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    fp8 = [g for g in qc["config_groups"].values() if g["weights"]["type"] == "float"]
    assert [g["weights"]["block_structure"] for g in fp8] == [[64, 64]]
    assert fp8[0]["input_activations"]["group_size"] == 64
    rep = v.validate(tmp_path / "out", source=src, tp=1, sample=0.05)
    assert rep.valid, v.format_report(rep)
    # q_b_proj's 384 rows split 2 ways are 192: three 64-row blocks a rank, where 128-row blocks would not divide
    assert _validated(tmp_path / "out", 2) == {
        key: len(mods) for key, mods in serving.planned_failures(plan, 2).items()}
    assert ("attention", FP8_N_RULE) not in _validated(tmp_path / "out", 2)


@pytest.mark.parametrize("fmt, says", [
    ("fp8-block", None),
    ("fp8-ct", "keeps block-FP8 weights only, so its"),
    ("bf16", "this source has no FP8 weights (dense): its other layers stay as they are, so keep_fp8 changes nothing"),
])
def test_plan_says_what_keep_fp8_does_with_each_source(fmt, says, make_ckpt, tmp_path):
    """keep_fp8 keeps block-FP8 weights: on a compressed-tensors FP8 source they are dequantized, and on a BF16 source
    there is nothing to keep; `glmq plan` (and quantize, the same warnings before the work) says which, not silence."""
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    (tmp_path / "keep.yaml").write_text(KEEP_FP8)
    res = CliRunner().invoke(main, ["plan", "-m", str(make_ckpt("glm_moe_dsa", fmt)), "-r", str(tmp_path / "keep.yaml")])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert (says is None and "keeps FP8 layers" not in said) or (says is not None and says in said), said
