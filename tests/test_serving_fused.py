"""The serving check's Marlin shape rules on the layers vLLM fuses (quantize/validate/serving.py `fused_rules`):
q/k/v_proj load as one QKVParallelLinear `qkv_proj` (KV heads replicated whole at tp > num_key_value_heads),
gate/up_proj as one MergedColumnParallelLinear `gate_up_proj`, MLA's q_a_proj + kv_a_proj_with_mqa as one unsplit
`fused_qkv_a_proj`; Marlin's output_size_per_partition % 64 rule holds for the fused layer's per-rank width."""

from __future__ import annotations


import pytest

from glmq import recipes
from glmq.formats.families import TensorClass
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan
from glmq.quantize.validate import serving
from glmq.quantize.validate.config import Group
from glmq.quantize.validate.serving import dense_rules, planned_problems

G128 = Group("g", ("Linear",), "int", 4, 128, True)
N_RULE = "output_size_per_partition % 64 == 0"
# the probe's GLM-4.x shapes: 16 q heads, 2 KV heads of 128; k_proj has 256 rows, 32 per rank at tp 8 if split,
# but vLLM's QKVParallelLinear keeps one whole KV head per rank there: qkv_proj is 2 x 128 + 2 x 128 wide per rank
GQA = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128, moe_intermediate_size=1024,
           intermediate_size=1024, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4)
# 8 q heads and 1 KV head of 48: q_proj 384 rows (o_proj's K 384 splits fine), qkv_proj 384 + 48 + 48 = 480 rows
ODD_HEADS = dict(num_attention_heads=8, num_key_value_heads=1, head_dim=48)


def _serving_failures(rep) -> list[str]:
    return [f.message for f in rep.checks["serving"].failures]


# ------------------------------------------------------------------------------------------------ the rules
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_qkv_replicates_whole_kv_heads_at_tp_above_their_count(tp):
    parts = {"q_proj": 2048, "k_proj": 256, "v_proj": 256}
    assert serving.fused_rules("qkv_proj", parts, 1024, tp, G128, heads=(16, 2)) == []
    if tp == 8:  # the per-tensor rule the check applied before: k_proj split 8 ways is 32 rows
        assert ("k_proj", N_RULE) in [("k_proj", r) for r, _ in dense_rules("k_proj", 256, 1024, tp, G128)]


def test_qkv_per_rank_width_counts_each_replicated_kv_head():
    """4 q heads, 2 KV heads of 32 at tp 4: 1 q head + 1 whole K and V head per rank = 96 rows, not a multiple of 64;
    splitting the KV heads 4 ways (what the head counts would not say) would have given 32 + 16 + 16 = 64."""
    parts = {"q_proj": 128, "k_proj": 64, "v_proj": 64}
    ((rule, numbers),) = serving.fused_rules("qkv_proj", parts, 256, 4, G128, heads=(4, 2))
    assert rule == N_RULE
    assert numbers == ("vLLM's qkv_proj = q_proj (128) + k_proj (64) + v_proj (64): N per rank = 1 of 4 q heads x 32 "
                       "+ 1 of 2 KV heads (each replicated on 2 ranks) x (32 + 32) = 96, column-parallel at tp 4: "
                       "96 % 64 = 32")
    assert serving.fused_rules("qkv_proj", parts, 256, 2, G128, heads=(4, 2)) == []  # 2 x 32 + 1 x 64 = 128


def test_qkv_head_counts_tp_must_split():
    parts = {"q_proj": 2048, "k_proj": 384, "v_proj": 384}
    ((rule, numbers),) = serving.fused_rules("qkv_proj", parts, 1024, 2, G128, heads=(16, 3))
    assert rule == "tensor-parallel split" and "num_key_value_heads = 3 neither divides nor is divisible by tp = 2" in numbers
    ((rule, numbers),) = serving.fused_rules("qkv_proj", {"q_proj": 1536, "k_proj": 256, "v_proj": 256}, 1024, 8, G128,
                                     heads=(12, 2))
    assert rule == "tensor-parallel split" and "num_attention_heads = 12 is not divisible by tp = 8" in numbers


def test_gate_up_rules_hold_for_the_merged_width():
    """MergedColumnParallelLinear: each part split tp ways (vLLM asserts it), Marlin checks their sum per rank."""
    parts = {"gate_proj": 96, "up_proj": 96}
    assert serving.fused_rules("gate_up_proj", parts, 256, 1, G128) == []  # 192; each part alone (96) would fail
    assert [r for r, _ in dense_rules("gate_proj", 96, 256, 1, G128)] == [N_RULE]
    ((rule, numbers),) = serving.fused_rules("gate_up_proj", parts, 256, 2, G128)
    assert rule == N_RULE and numbers == ("vLLM's gate_up_proj = gate_proj (96) + up_proj (96): N per rank = 48 + 48 "
                                          "= 96, column-parallel at tp 2: 96 % 64 = 32")
    ((rule, numbers),) = serving.fused_rules("gate_up_proj", parts, 256, 5, G128)
    assert rule == "tensor-parallel split" and "gate_proj N = 96, up_proj N = 96 not divisible by tp = 5" in numbers


@pytest.mark.parametrize("tp", [1, 8])
def test_fused_qkv_a_proj_is_replicated_and_checked_whole(tp):
    """DeepSeekV2FusedQkvAProjLinear (disable_tp=True): q_lora + kv_lora + rope rows on every rank, whatever tp."""
    ok = serving.fused_rules("fused_qkv_a_proj", {"q_a_proj": 96, "kv_a_proj_with_mqa": 160}, 256, tp, G128)
    assert ok == []  # 256; each part alone (96, 160) would fail
    ((rule, numbers),) = serving.fused_rules("fused_qkv_a_proj", {"q_a_proj": 128, "kv_a_proj_with_mqa": 160}, 256, tp, G128)
    assert rule == N_RULE and numbers == (f"vLLM's fused_qkv_a_proj = q_a_proj (128) + kv_a_proj_with_mqa (160): N = "
                                          f"288, replicated at tp {tp}: 288 % 64 = 32")


def test_a_fused_failure_is_noted_for_each_part_and_unfused_modules_keep_their_rules():
    notes = []
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    targets = [(TensorClass.ATTENTION, f"{attn}.{leaf}", shape, G128) for leaf, shape in
               [("k_proj", (64, 256)), ("o_proj", (256, 128)), ("q_proj", (128, 256)), ("v_proj", (64, 256))]]
    targets += [(TensorClass.DENSE_MLP, f"{mlp}.{leaf}", shape, G128) for leaf, shape in
                [("down_proj", (256, 96)), ("gate_proj", (96, 256)), ("up_proj", (96, 256))]]
    serving._shape_rules(targets, 4, lambda *a: notes.append(a), heads=(4, 2))
    got = {(name.rpartition(".")[2], rule) for _, name, rule, _ in notes}
    assert {("q_proj", N_RULE), ("k_proj", N_RULE), ("v_proj", N_RULE)} <= got  # qkv_proj: 96 rows per rank
    assert ("o_proj", "input_size_per_partition % 128 == 0") in got  # row-parallel, as before: 128 / 4 = 32
    assert {("gate_proj", N_RULE), ("up_proj", N_RULE)} <= got  # gate_up_proj: 24 + 24 rows per rank
    assert ("down_proj", "input_size_per_partition % 128 == 0") in got  # row-parallel: 96 / 4 = 24
    numbers = {name.rpartition(".")[2]: nb for _, name, rule, nb in notes if rule == N_RULE}
    assert numbers["q_proj"] == numbers["k_proj"] == numbers["v_proj"] and "vLLM's qkv_proj" in numbers["k_proj"]


def test_a_fused_layer_with_a_member_not_quantized_checks_the_others_alone():
    notes = []
    targets = [(TensorClass.ATTENTION, "model.layers.0.self_attn.q_proj", (96, 256), G128)]
    serving._shape_rules(targets, 1, lambda *a: notes.append(a), heads=(16, 2))
    # q_proj by its own rule (k/v_proj not quantized: no fused layer to check), neither skipped nor fused
    assert [(rule, numbers) for _, _, rule, numbers in notes] == [
        (N_RULE, "N = 96, column-parallel at tp 1: 96 % 64 = 32")]


def test_a_quantized_eh_proj_is_a_layer_that_takes_no_quantization():
    """vLLM's and SGLang's MTP layers build eh_proj as a plain nn.Linear: a packed one cannot load at any tp (the
    recipe loader refuses `mtp_proj` as a target for the same reason, recipes.UNSERVABLE_TARGETS)."""
    notes = []
    serving._shape_rules([(TensorClass.MTP_PROJ, "model.layers.78.eh_proj", (6144, 12288), G128)], 1,
                         lambda *a: notes.append(a))
    assert [(rule, numbers) for _, _, rule, numbers in notes] == [
        ("layer takes no quantization", serving.NO_QUANT_LAYERS["eh_proj"])]


# ------------------------------------------------------------------------------------- on written checkpoints
@pytest.fixture(scope="module")
def gqa(make_ckpt, tmp_path_factory):
    src = make_ckpt("glm4_moe", config_overrides=GQA, max_shard_bytes=20_000_000)
    plan = make_plan(open_source(src), recipes.load("int4-w4a16-all-linear"), 20_000_000)
    out = tmp_path_factory.mktemp("gqa") / "out"
    stream.run(plan, out, progress=False)
    return plan, out


def test_the_gqa_probe_is_predicted_servable_at_every_tp(gqa):
    plan, _ = gqa
    for tp in (1, 2, 4, 8):
        assert planned_problems(plan, tp) == [], tp


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_gqa_probe_validates_at_every_tp(gqa, tp):
    _, out = gqa
    rep = v.validate(out, tp=tp, sample=0.05)
    assert rep.valid and not _serving_failures(rep), v.format_report(rep)


@pytest.mark.parametrize("tp", [8, 16])
def test_validate_reads_the_head_counts_from_config_json(gqa, tp):
    """With config.json's head counts qkv_proj's width is exact: at tp 16 each rank holds 1 q head and 1 whole K and V
    head of 128 (384 rows); splitting the 2 KV heads 16 ways would give 128 + 16 + 16 = 160."""
    _, out = gqa
    rep = v.validate(out, tp=tp, sample=0.05)
    assert not [m for m in _serving_failures(rep) if "attention" in m], v.format_report(rep)


def test_a_fused_qkv_width_marlin_cannot_take_fails_with_the_layer_and_parts_named(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", config_overrides=ODD_HEADS)
    plan = make_plan(open_source(src), recipes.load("int4-w4a16-all-linear"), 400_000)
    for tp, width in ((1, "384 + 48 + 48 = 480"), (2, "4 of 8 q heads x 48 + 1 of 1 KV heads (each replicated on 2 "
                                                       "ranks) x (48 + 48) = 288")):
        (line,) = [x for x in planned_problems(plan, tp) if x.startswith(f"attention: {N_RULE}")]
        assert "vLLM's qkv_proj = q_proj (384) + k_proj (48) + v_proj (48): N per rank = " + width in line, line
        assert f"{width}, column-parallel at tp {tp}: {int(width.rpartition(' ')[2])} % 64 = 32" in line
    stream.run(plan, tmp_path / "out", progress=False)
    rep = v.validate(tmp_path / "out", sample=0.05)
    assert not rep.valid
    (msg,) = [m for m in _serving_failures(rep) if N_RULE in m]
    assert "vLLM's qkv_proj = q_proj (384) + k_proj (48) + v_proj (48): N per rank = 384 + 48 + 48 = 480" in msg


def test_gate_up_checked_as_one_layer_on_a_written_checkpoint(make_ckpt, tmp_path):
    """intermediate 160 at group 32: gate/up_proj are 160 rows each (each alone not a multiple of 64), gate_up_proj's
    320 is; the down_proj's K of 160 is what Marlin refuses."""
    src = make_ckpt("glm4_moe", config_overrides={"intermediate_size": 160})
    (tmp_path / "mlp.yaml").write_text("name: mlp\ntargets: [dense_mlp]\nnum_bits: 4\ngroup_size: 32\n"
                                       "symmetric: true\n")
    plan = make_plan(open_source(src), recipes.load(str(tmp_path / "mlp.yaml")), 400_000)
    problems = planned_problems(plan)
    assert not [x for x in problems if x.startswith(f"dense_mlp: {N_RULE}")], problems
    assert [x for x in problems if x.startswith("dense_mlp: input_size_per_partition % 128 == 0") and "down_proj" in x]
    (line,) = [x for x in planned_problems(plan, 4) if x.startswith(f"dense_mlp: {N_RULE}")]
    assert "vLLM's gate_up_proj = gate_proj (160) + up_proj (160): N per rank = 40 + 40 = 80" in line, line


def test_mla_fused_qkv_a_proj_on_a_written_checkpoint(make_ckpt):
    """The tiny GLM-5's q_a_proj (128 rows) + kv_a_proj_with_mqa (kv_lora 128 + rope 32 = 160): fused 288."""
    plan = make_plan(open_source(make_ckpt("glm_moe_dsa")), recipes.load("int4-w4a16-all-linear"), 400_000)
    (line,) = [x for x in planned_problems(plan) if x.startswith(f"attention: {N_RULE}")]
    assert ("vLLM's fused_qkv_a_proj = q_a_proj (128) + kv_a_proj_with_mqa (160): N = 288, replicated at tp 1: "
            "288 % 64 = 32") in line


# ------------------------------------------------------------------------- one INT scheme per fused layer
def _int_module(name: str, rows: int, cols: int, group: int):
    from glmq.formats.safetensors_io import TensorEntry
    from glmq.quantize.validate.checkpoint import Module, classify

    m = Module(name, classify(name))
    for leaf, dtype, shape in [("weight_packed", "I32", (rows, cols // 8)), ("weight_shape", "I64", (2,)),
                               ("weight_scale", "BF16", (rows, cols // group))]:
        m.parts[leaf] = TensorEntry(f"{name}.{leaf}", "model.safetensors", dtype, shape, 0, 1)
    return m


@pytest.mark.parametrize("k_group", [128, 32])
def test_fused_parts_under_two_int_schemes_fail_and_one_scheme_passes(k_group):
    """vLLM gives qkv_proj one group (its class name's "Linear" group here, else q_proj's) and builds k/v_proj's
    scales with that group's size: a k_proj stored at group 32 beside a group-128 q_proj cannot load. Two groups of
    one scheme (a name-only split of the config) are fine."""
    attn = "model.layers.0.self_attn"
    mods = {f"{attn}.{leaf}": _int_module(f"{attn}.{leaf}", 256, 512, k_group if leaf == "k_proj" else 128)
            for leaf in ("q_proj", "k_proj", "v_proj", "o_proj")}
    groups = [Group("group_0", ("Linear",), "int", 4, 128, True),
              Group("group_1", ("re:.*k_proj$",), "int", 4, k_group, True)]
    res = serving.CheckResult("serving")
    serving._check_partners(mods, groups, res)
    msgs = [f.message for f in res.failures]
    if k_group == 128:
        assert msgs == []
    else:
        assert msgs == [f"{attn}: 3 fused members stored as 2 INT4, group 128 (e.g. q_proj), 1 INT4, group 32 (e.g. "
                        f"k_proj); vLLM/SGLang fuse them into one layer with one scheme and raise"]


def test_a_head_count_tp_does_not_divide_fails_whatever_is_quantized(make_ckpt, tmp_path):
    """Routed experts INT4, attention BF16: the heads were checked only for a quantized qkv_proj, so `validate --tp 8`
    passed a 4-head model vLLM refuses at tp 8 (and `glmq upload` would publish serve commands at that degree)."""
    src = make_ckpt("deepseek_v3", config_overrides={"moe_intermediate_size": 512})  # experts split 8 ways: 64 rows
    out = tmp_path / "out"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16-g32")), out, progress=False)
    assert v.validate(out, tp=4, sample=0.05).valid
    rep = v.validate(out, tp=8, sample=0.05)
    assert _serving_failures(rep) == [
        "attention heads: num_attention_heads = 4 is not divisible by tp = 8: vLLM "
        "(ModelConfig.verify_with_parallel_config) and SGLang split them tp ways and refuse the model at this degree, "
        "whatever is quantized; serve it at a tp that divides them"], _serving_failures(rep)
