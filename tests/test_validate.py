"""`glmq validate`: passes on what glmq writes, and fails with the right message on each kind of damage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from glmq import recipes
from glmq.formats.safetensors_io import read_header
from glmq.formats.source import open_source
from glmq.quantize import output, stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan
from glmq.scripts.cli import main

EXPERT = "model.layers.1.mlp.experts.3.down_proj"
ASYM = "name: asym\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 64\nsymmetric: false\n"
KEEP_FP8 = "name: keep\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 128\nkeep_fp8: true\n"
# kv_a_proj_with_mqa has kv_lora + rope = 160 rows in the tiny preset, which no Marlin tile divides
# (GLM-5's is 576); rope 64 makes it 192, so the all-linear recipe gives a servable checkpoint.
SERVABLE_MLA = {"config_overrides": {"qk_rope_head_dim": 64}}


# ----------------------------------------------------------------------------------------- helpers
def convert(src: Path, out: Path, recipe: str) -> Path:
    stream.run(make_plan(open_source(src), recipes.load(recipe), 400_000), out, progress=False)
    return out


def index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def shard_of(root: Path, name: str) -> str:
    return index(root)["weight_map"][name]


def flip_packed_byte(root: Path, name: str = f"{EXPERT}.weight_packed") -> str:
    """Flip one bit of a packed weight in place, 100 bytes into its data (the header stays valid); returns its shard."""
    shard = shard_of(root, name)
    entries, _, start = read_header(root / shard)
    data = bytearray((root / shard).read_bytes())
    data[start + entries[name].begin + 100] ^= 0x10
    (root / shard).write_bytes(bytes(data))
    return shard


def rewrite_shard(root: Path, shard: str, edit) -> None:
    """Load a shard, let `edit(dict)` change it, save it back (and fix the index, total_size included)."""
    with safe_open(str(root / shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    old = sum(x.numel() * x.element_size() for x in t.values())
    edit(t)
    save_file(t, str(root / shard), metadata={"format": "pt"})
    idx = index(root)
    idx["weight_map"] = {k: s for k, s in idx["weight_map"].items() if s != shard or k in t}
    idx["weight_map"].update({k: shard for k in t})
    idx["metadata"]["total_size"] += sum(x.numel() * x.element_size() for x in t.values()) - old
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))


def edit_config(root: Path, edit) -> None:
    cfg = json.loads((root / "config.json").read_text())
    edit(cfg["quantization_config"])
    (root / "config.json").write_text(json.dumps(cfg))


def failures(rep: v.Report, check: str) -> list[str]:
    return [f.message for f in rep.checks[check].failures]


def failed_checks(rep: v.Report) -> set[str]:
    return {k for k, c in rep.checks.items() if c.status is v.Status.FAIL}


def assert_all_pass(rep: v.Report) -> None:
    bad = {k: c.status.value for k, c in rep.checks.items() if c.status is not v.Status.PASS}
    assert rep.valid and rep.exit_code == 0 and not bad, (bad, v.format_report(rep))


# (family, recipe, fixture kwargs) of every conversion the tests validate
JOBS = {
    "glm5": ("glm_moe_dsa", "int4-w4a16", {}),
    "glm5-all-linear": ("glm_moe_dsa", "int4-w4a16-all-linear", SERVABLE_MLA),
    "glm5-all-linear-tiny-mla": ("glm_moe_dsa", "int4-w4a16-all-linear", {}),
    "glm5-g32": ("glm_moe_dsa", "int4-w4a16-g32", {}),
    "glm5-asym": ("glm_moe_dsa", "asym", {}),
    # the real index_head_dim: the indexer's wk then has 128 rows and could stay FP8, but its fused partner
    # weights_proj is BF16 in the source
    "glm5-keep-fp8": ("glm_moe_dsa", "keep", {"config_overrides": {"index_head_dim": 128}}),
    "glm4": ("glm4_moe", "int4-w4a16", {}),
    "deepseek-v3": ("deepseek_v3", "int4-w4a16", {}),
}


class InProcessConfigJob:
    """`output.ConfigJob` (as `stream` uses it) without its child process: the same `config_from_request` on the same JSON,
    run here, where compressed-tensors is already imported (the child spends ~10 s importing it on a
    busy 2-core machine, which would dominate these tests)."""

    def __init__(self, plan, own_session: bool = False):  # own_session: the child's session, moot here
        self.request = json.dumps(output.config_request(plan))

    def result(self) -> dict:
        from glmq.formats.compressed_tensors import config_from_request

        return json.loads(json.dumps(config_from_request(json.loads(self.request))))

    def cancel(self) -> None:
        pass


@pytest.fixture(scope="module")
def converted(make_ckpt, tmp_path_factory):
    """name in JOBS -> (source, output), converted once per module."""
    base = tmp_path_factory.mktemp("converted")
    (base / "asym.yaml").write_text(ASYM)
    (base / "keep.yaml").write_text(KEEP_FP8)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        for key, (family, recipe, kw) in JOBS.items():
            src = make_ckpt(family, "fp8-block", **kw)
            path = base / f"{recipe}.yaml"
            out[key] = src, convert(src, base / key, str(path) if path.exists() else recipe)
    return out


@pytest.fixture
def damaged(converted, tmp_path):
    """A private copy of the glm_moe_dsa int4-w4a16 output, to break."""
    _, out = converted["glm5"]
    return Path(shutil.copytree(out, tmp_path / "ckpt"))


# ----------------------------------------------------------------------------------------- passes
@pytest.mark.parametrize("job", ["glm5", "glm5-all-linear", "glm5-g32", "glm4", "deepseek-v3"])
def test_passes_on_glmq_output_with_and_without_source(converted, job):
    src, out = converted[job]
    rep = v.validate(out, sample=1.0)  # every module through the matmul (the default samples them)
    assert_all_pass(rep)
    assert "source" not in rep.checks
    n = rep.settings["quantized_modules"]
    assert n > 0 and rep.checks["numerics"].details["sampled"] == n
    assert rep.checks["integrity"].checked == rep.settings["tensors"]
    rep = v.validate(out, src, sample=1.0)
    assert_all_pass(rep)
    d = rep.checks["source"].details
    assert d["method"] == "rtn" and d["compared"] == n and d["bound_steps"] == 0.5 + 1 / 16
    assert 0.25 < d["worst"][0]["error"] <= 0.5625  # RTN: about half a step, never more than the bound
    assert rep.checks["source"].checked > n  # unquantized tensors compared too (bit-identical)


def test_asymmetric_recipe_is_well_formed_but_not_servable_as_moe(converted):
    src, out = converted["glm5-asym"]
    rep = v.validate(out, src)
    assert failed_checks(rep) == {"serving"}
    (msg,) = failures(rep, "serving")
    assert "routed_expert: symmetric weights fails for 72 module(s)" in msg and "Marlin-MoE" in msg
    assert rep.checks["source"].details["bound_steps"] == 0.5 + 1 / 8
    rep = v.validate(out, src, serving=False)
    assert rep.valid and rep.checks["serving"].status is v.Status.SKIP


def test_keep_fp8_output_is_read_by_compressed_tensors_as_stored(converted, tmp_path):
    """keep_fp8 (mixed-precision): every module loads in the form it is stored in. compressed-tensors (like vLLM and
    SGLang) applies `ignore` before the config groups, so no FP8 module may match it; the BF16 members of classes
    with FP8 members (GLM-5's demoted fused partners) are ignored by their own entries. Dequantized, the kept
    blocks are the source's; validate passes, and fails once an FP8 module is ignored."""
    from accelerate import init_empty_weights
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from glmq.formats.dense import iter_dense
    from glmq.formats.families import LINEAR_CLASSES, classify

    src, out = converted["glm5-keep-fp8"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    # one target per module path across the layers, not one per module (GLM-5: ~10, not ~550, which loaders
    # match one by one with re.match, past its 512-pattern cache), and the fused layers' own names (gate_up_proj)
    fp8_targets = next(g["targets"] for g in qc["config_groups"].values() if g["weights"]["type"] == "float")
    assert len(fp8_targets) <= 14 and all(t.startswith("re:^model\\.layers\\.\\d+\\.") for t in fp8_targets)
    stored: dict[str, str] = {}  # Linear module -> "int" / "float" / "bf16", read from the tensors
    shapes: dict[str, tuple[int, int]] = {}
    for shard in sorted(set(index(out)["weight_map"].values())):
        entries, _, _ = read_header(out / shard)
        for name, e in entries.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight_packed":
                stored[module], shapes[module] = "int", (e.shape[0], 8 * e.shape[1])
            elif leaf == "weight" and len(e.shape) == 2 and classify(module) in LINEAR_CLASSES:
                stored[module] = "float" if e.dtype == "F8_E4M3" else "bf16"
                shapes[module] = tuple(e.shape)
    assert {"int", "float", "bf16"} <= set(stored.values())
    assert stored["model.layers.1.mlp.shared_experts.up_proj"] == "float"
    assert stored["model.layers.1.self_attn.q_a_proj"] == "bf16"  # fused with kv_a_proj_with_mqa (160 rows)
    assert shapes["model.layers.1.self_attn.indexer.wk"][0] == 128 and stored["model.layers.1.self_attn.indexer.wq_b"] == "float"
    assert stored["model.layers.1.self_attn.indexer.wk"] == "bf16"  # fused with weights_proj, BF16 in the source
    root = torch.nn.Module()
    with init_empty_weights():
        for module, (n, k) in shapes.items():
            parent = root
            for part in module.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(module.rpartition(".")[2], torch.nn.Linear(k, n, bias=False))
    apply_quantization_config(root, QuantizationConfig.model_validate(qc))
    read = {m: getattr(getattr(root.get_submodule(m), "quantization_scheme", None), "weights", None) for m in stored}
    assert {m: "bf16" if w is None else w.type for m, w in read.items()} == stored
    assert all(w.strategy == "block" for m, w in read.items() if stored[m] == "float")
    kept = {f"{m}.weight" for m, kind in stored.items() if kind == "float"}
    ours = {k: t for k, t in iter_dense(out) if k in kept}
    theirs = {k: t for k, t in iter_dense(src) if k in kept}
    assert ours.keys() == kept and all(torch.equal(ours[k], theirs[k]) for k in kept)
    rep = v.validate(out, src)
    assert rep.valid and rep.exit_code == 0 and not failed_checks(rep), v.format_report(rep)
    bad = Path(shutil.copytree(out, tmp_path / "ckpt"))
    edit_config(bad, lambda qc: qc["ignore"].append("re:.*mlp\\.shared_experts\\..*"))
    rep = v.validate(bad)
    assert failed_checks(rep) == {"structure"}
    msgs = failures(rep, "structure")
    assert msgs and all("is F8_E4M3 but matches ignore entry" in m and "shared_experts" in m for m in msgs)


def test_fused_members_stored_in_different_forms_fail_serving(make_ckpt, tmp_path, monkeypatch):
    """vLLM fuses indexer.wk with weights_proj (and q_a with kv_a, gate with up) into one layer of one scheme. A
    mixed-precision checkpoint whose wk stayed FP8 beside a BF16 weights_proj (what keep_fp8 wrote before the
    plan demoted wk) fails the serving check, naming the forms; the plan's own output passes."""
    from glmq.quantize import plan as plan_mod

    src = make_ckpt("glm_moe_dsa", "fp8-block", config_overrides={"index_head_dim": 128})
    (tmp_path / "keep.yaml").write_text(KEEP_FP8)
    monkeypatch.setattr(stream, "ConfigJob", InProcessConfigJob)
    good = convert(src, tmp_path / "good", str(tmp_path / "keep.yaml"))
    rep = v.validate(good)
    assert rep.valid and not failures(rep, "serving"), v.format_report(rep)
    monkeypatch.setattr(plan_mod, "_demote_unkeepable_partners", lambda items: items)
    bad = convert(src, tmp_path / "bad", str(tmp_path / "keep.yaml"))
    rep = v.validate(bad)
    assert failed_checks(rep) == {"serving"}
    msgs = [m for m in failures(rep, "serving") if "indexer" in m]
    assert any("2 fused members stored as 1 BF16 (e.g. weights_proj), 1 FP8 (e.g. wk)" in m for m in msgs), msgs
    # and the FP8 wk itself: vLLM builds the fused indexer layer without a quant_config, so FP8 blocks cannot load
    assert any(m.startswith("indexer: layer takes no quantization fails") and "quant_config=None" in m for m in msgs)


def test_serving_rules_name_the_class_rule_and_numbers(converted):
    _, out = converted["glm5-all-linear-tiny-mla"]  # kv_a_proj_with_mqa has 160 rows, fused with q_a_proj's 128
    rep = v.validate(out)
    assert failed_checks(rep) == {"serving"}
    (msg,) = failures(rep, "serving")
    assert msg.startswith("attention: output_size_per_partition % 64 == 0 fails for 8 module(s)")  # 4 layers x 2
    assert ("vLLM's fused_qkv_a_proj = q_a_proj (128) + kv_a_proj_with_mqa (160): N = 288, replicated at tp 1: "
            "288 % 64 = 32") in msg
    classes = rep.checks["serving"].details["classes"]
    assert classes["attention"]["failed"] == 8 and classes["routed_expert"]["failed"] == 0
    _, out = converted["glm5"]  # moe_intermediate 128: fine at tp 1, 128 / 2 = 64 is not a multiple of 128
    assert v.validate(out, tp=1).valid
    rep = v.validate(out, tp=2)
    assert failed_checks(rep) == {"serving"}
    assert "128 / 2 = 64, % 128 = 64" in failures(rep, "serving")[0]


def test_gptq_checkpoint_reports_error_per_layer_instead_of_a_bound(converted, damaged, make_ckpt):
    """A GPTQ checkpoint: its GPTQ modules' reconstruction error per layer (the terminal too), no bound; the modules
    glmq quantized by round-to-nearest in a GPTQ run (the MTP layer's, the report's fallbacks) held to RTN's bound."""
    src, _ = converted["glm5"]
    other = make_ckpt("glm_moe_dsa", "fp8-block", seed=1)  # same layout, other weights: far off any RTN bound
    assert failed_checks(v.validate(damaged, other)) == {"source"}
    man = json.loads((damaged / "glmq_manifest.json").read_text())
    man["identity"]["recipe"]["method"] = "gptq"  # what a GPTQ run records
    (damaged / "glmq_manifest.json").write_text(json.dumps(man))
    report = json.loads((damaged / "glmq_report.json").read_text())
    fallback = "model.layers.2.mlp.experts.5.up_proj"
    report["gptq"] = {"fallbacks": [{"module": fallback, "reason": "empty_hessian"}]}  # as a GPTQ run reports one
    (damaged / "glmq_report.json").write_text(json.dumps(report))

    rep = v.validate(damaged, src, sample=1.0)  # its own source: every weight is RTN's, so all within the bound
    assert rep.valid, rep.checks["source"].failures
    d = rep.checks["source"].details
    assert d["method"] == "gptq" and d["compared"] == 47 and d["rtn_in_gptq"]["compared"] == 25  # layer 3: MTP
    assert list(d["per_layer"]) == ["1", "2"] and all(0 < e < 0.2 for e in d["per_layer"].values())
    text = v.format_report(rep)
    assert "round-to-nearest (MTP layer, fallbacks)" in text and "GPTQ relative error" in text
    assert "\n    1 " in text and "2 " in text  # the per-layer lines

    rep = v.validate(damaged, other, sample=1.0)
    assert failed_checks(rep) == {"source"}  # unquantized tensors differ, and the RTN modules miss their bound
    steps = [m for m in failures(rep, "source") if "scale steps" in m]
    assert len(steps) == 25 and any(fallback in m for m in steps)
    assert all(m.startswith(("model.layers.3.", fallback)) for m in steps)  # the GPTQ modules: reported only
    d = rep.checks["source"].details
    assert set(d["per_layer"]) == {"1", "2"} and all(1.0 < e < 2.0 for e in d["per_layer"].values())


# ----------------------------------------------------------------------------------------- failures
def test_flipped_byte_fails_integrity_naming_tensor_and_shard(damaged):
    name = f"{EXPERT}.weight_packed"
    shard = flip_packed_byte(damaged, name)
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"integrity"}
    (msg,) = failures(rep, "integrity")
    assert shard in msg and name in msg and "sha256" in msg


def test_missing_tensor(damaged):
    name = f"{EXPERT}.weight_scale"
    rewrite_shard(damaged, shard_of(damaged, name), lambda t: t.pop(name))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"structure", "integrity"}
    assert failures(rep, "structure") == [f"{name} is missing (group_0 promises it)"]
    assert any(name in m and "not in the shard" in m for m in failures(rep, "integrity"))


def test_missing_expert(damaged):
    names = [f"{EXPERT}.{leaf}" for leaf in ("weight_packed", "weight_scale", "weight_shape")]
    rewrite_shard(damaged, shard_of(damaged, names[0]), lambda t: [t.pop(n) for n in names])
    rep = v.validate(damaged)
    assert "model.layers.1.mlp.experts: 1 of 24 expert projections missing (config n_routed_experts = 8), " \
           "e.g. experts.3.down_proj" in failures(rep, "structure")
    assert failed_checks(rep) == {"structure", "integrity"}


def test_nan_scale(damaged):
    name = f"{EXPERT}.weight_scale"
    rewrite_shard(damaged, shard_of(damaged, name), lambda t: t[name].__setitem__((0, 0), float("nan")))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"numerics", "integrity"}
    assert failures(rep, "numerics") == [f"{name}: 1 NaN/Inf and 0 zero of 256 scales"]


@pytest.mark.parametrize("name, value", [("model.layers.1.input_layernorm.weight", float("nan")),
                                         ("model.embed_tokens.weight", float("inf")),
                                         ("model.layers.1.mlp.gate.e_score_correction_bias", float("-inf"))])
def test_nonfinite_unquantized_tensor(converted, damaged, name, value):
    """A norm, the embeddings or the router's F32 bias holding NaN/Inf: no scale or matmul check reads them."""
    shard = shard_of(damaged, name)
    rewrite_shard(damaged, shard, lambda t: t[name].view(-1).__setitem__(-1, value))
    last = read_header(damaged / shard)[0][name].shape[0] - 1  # the last element is in the last row
    for source in (None, converted["glm5"][0]):
        rep = v.validate(damaged, source)  # with a source the tensor is kept for the comparison: checked there
        (f,) = rep.checks["numerics"].failures
        assert f.message.startswith(f"{name}: NaN or Inf in rows [{last}] (") and f.shard == shard
        assert "numerics" in failed_checks(rep)


def test_nonfinite_rows_by_bit_pattern():
    from glmq.quantize.validate.reading import nonfinite_rows

    for dtype, name in ((torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32"),
                        (torch.float64, "F64")):
        t = torch.randn(5, 7, dtype=torch.float64).to(dtype)
        assert nonfinite_rows(t.view(-1).view(torch.uint8).numpy(), name, (5, 7)) == []
        t[1, 3], t[3, 0], t[3, 6] = float("nan"), float("inf"), -float("inf")
        assert nonfinite_rows(t.view(-1).view(torch.uint8).numpy(), name, (5, 7)) == [1, 3]
        t = torch.full((), float("nan"), dtype=dtype)
        assert nonfinite_rows(t.view(-1).view(torch.uint8).numpy(), name, ()) == [0]
    codes = torch.arange(256, dtype=torch.uint8)  # every e4m3fn code: NaN only at 0x7F and 0xFF
    assert nonfinite_rows(codes.numpy(), "F8_E4M3", (256,)) == [0x7F, 0xFF]
    assert nonfinite_rows(codes.numpy(), "F8_E5M2", (256,)) == list(range(0x7C, 0x80)) + list(range(0xFC, 0x100))
    assert nonfinite_rows(codes.numpy(), "I8", (256,)) == []
    big = torch.zeros(3 << 20, dtype=torch.bfloat16)  # across the chunk boundary, rows of 1024
    big[(1 << 20) + 5] = float("nan")
    assert nonfinite_rows(big.view(torch.uint8).numpy(), "BF16", (3 << 10, 1 << 10)) == [1 << 10]


def test_edited_weight_shape(damaged):
    name = f"{EXPERT}.weight_shape"
    rewrite_shard(damaged, shard_of(damaged, name), lambda t: t.__setitem__(name, torch.tensor([256, 256])))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"structure", "integrity"}
    assert f"{EXPERT}.weight_packed has shape [256, 16], expected [256, 32] for weight_shape [256, 256] with " \
           f"num_bits 4, group_size 128" in failures(rep, "structure")


def test_tensor_resaved_with_another_shape(damaged):
    name = f"{EXPERT}.weight_scale"
    rewrite_shard(damaged, shard_of(damaged, name), lambda t: t.__setitem__(name, t[name][:128].contiguous()))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"structure", "integrity"}
    assert failures(rep, "structure") == [f"{name} has shape [128, 1], expected [256, 1] for weight_shape [256, 128] "
                                          f"with num_bits 4, group_size 128"]


def test_config_group_size_disagrees_with_tensors(damaged):
    edit_config(damaged, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("group_size", 64))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"structure"}  # the tensors themselves are intact
    msgs = failures(rep, "structure")
    assert len(msgs) == 72 and all("weight_scale has shape" in m and "group_size 64" in m for m in msgs)


def test_quantized_module_added_to_ignore(damaged):
    edit_config(damaged, lambda qc: qc["ignore"].append("re:.*experts\\.3\\.down_proj$"))
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"structure"}
    msgs = failures(rep, "structure")
    assert len(msgs) == 3 and all("matches ignore entry 're:.*experts\\\\.3\\\\.down_proj$'" in m for m in msgs)


def test_unquantized_linear_missing_from_ignore(damaged):
    edit_config(damaged, lambda qc: qc["ignore"].remove("lm_head"))
    assert failures(v.validate(damaged), "structure") == [
        "lm_head.weight is stored unquantized (BF16) but matches no ignore entry: vLLM would build it as INT and "
        "find no weight_packed"]


def test_config_keys_older_compressed_tensors_rejects(damaged):
    edit_config(damaged, lambda qc: qc["config_groups"]["group_0"]["weights"].update(scale_dtype=None, zp_dtype=None))
    msgs = failures(v.validate(damaged), "config")
    assert len(msgs) == 2 and all("compressed-tensors < 0.13 rejects this key" in m for m in msgs)
    edit_config(damaged, lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bitz=4))
    assert any("does not parse with compressed-tensors" in m for m in failures(v.validate(damaged), "config"))


def test_leftovers_fp8_and_scale_inv(damaged):
    def add(t):
        t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 2)
        o = "model.layers.0.self_attn.o_proj.weight"
        t[o] = t[o].to(torch.float8_e4m3fn)

    rewrite_shard(damaged, shard_of(damaged, "model.layers.0.self_attn.o_proj.weight"), add)
    msgs = failures(v.validate(damaged), "structure")
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv: an FP8-source scale left in a compressed-tensors " \
           "checkpoint" in msgs
    assert "model.layers.0.self_attn.o_proj.weight is F8_E4M3 but no float-quantized config group targets it" in msgs


def test_index_inconsistencies(damaged):
    idx = index(damaged)
    idx["metadata"]["total_size"] += 8
    idx["weight_map"]["model.layers.9.mlp.gate.weight"] = idx["weight_map"]["lm_head.weight"]
    text = json.dumps(idx).replace('"lm_head.weight": ', '"lm_head.weight": "x", "lm_head.weight": ', 1)
    (damaged / "model.safetensors.index.json").write_text(text)
    msgs = failures(v.validate(damaged), "index")
    assert any("total_size" in m and "(-8)" in m for m in msgs)
    assert any("model.layers.9.mlp.gate.weight is placed in" in m and "does not hold it" in m for m in msgs)
    assert "model.safetensors.index.json: tensor lm_head.weight is listed more than once" in msgs


def test_without_manifest_warns_and_passes(damaged):
    (damaged / "glmq_manifest.json").unlink()
    rep = v.validate(damaged)
    assert rep.valid and rep.checks["integrity"].status is v.Status.SKIP
    assert "cannot check integrity" in rep.checks["integrity"].warnings[0].message


def test_source_mismatch_fails(converted, make_ckpt):
    _, out = converted["glm5"]
    other = make_ckpt("glm_moe_dsa", "fp8-block", seed=1)  # same layout, other weights
    rep = v.validate(out, other, sample=1.0)  # EXPERT among the compared weights
    assert failed_checks(rep) == {"source"}
    msgs = failures(rep, "source")
    assert any(m.startswith(f"{EXPERT}: max |w_q - w_src| = ") and "> bound 0.5625 (RTN, symmetric)" in m for m in msgs)
    assert "lm_head.weight: stored unquantized but differs from the source" in msgs


def test_a_quantized_checkpoint_as_source_cannot_validate(converted):
    """`--source` pointing at a quantized output (the checkpoint itself, here) passed the source check against its
    own rounding, VALID; it is not a checkpoint glmq converts from: exit 2, naming it."""
    _, out = converted["glm5"]
    with pytest.raises(v.CannotValidate, match=r"--source .*: not a checkpoint glmq converts from .*pack-quantized"):
        v.validate(out, out)
    res = CliRunner().invoke(main, ["validate", str(out), "--source", str(out)])
    assert res.exit_code == 2 and "point it at the FP8 or BF16 checkpoint" in res.output


def test_numerics_catch_a_wrong_kernel(damaged, monkeypatch):
    from glmq.kernels import reference

    real = reference.dequantize_packed
    monkeypatch.setattr(reference, "dequantize_packed", lambda p, s, g, zp=None: real(p, s.flip(1), g, zp))
    rep = v.validate(damaged, sample=0.1, seed=1)
    assert failed_checks(rep) == {"numerics"}
    assert all("W4A16 matmul (reference) relative error" in m for m in failures(rep, "numerics"))


def test_sample_is_deterministic(damaged):
    names = [f"m{i}" for i in range(72)]
    a = v.sample_modules(names, 0.25, seed=3)
    assert len(a) == 18 and a == v.sample_modules(names, 0.25, seed=3) != v.sample_modules(names, 0.25, seed=4)
    assert v.sample_modules(names, 1e-9, seed=0) and v.sample_modules(names, 1.0, 0) == set(names)
    rep = v.validate(damaged, sample=0.25, seed=3)
    assert rep.valid and rep.checks["numerics"].details["sampled"] == 18


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_path(converted):
    src, out = converted["glm5"]
    rep = v.validate(out, src, device="cuda", sample=1.0)  # every module through the Triton kernel
    assert_all_pass(rep)
    d = rep.checks["numerics"].details
    assert d["paths"] == ["triton"] and d["bounds"] == [1e-2] and d["sampled"] == rep.settings["quantized_modules"]


# ----------------------------------------------------------------------------------------- CLI
def test_cli_table_json_and_exit_codes(converted, tmp_path):
    src, out = converted["glm5"]
    runner = CliRunner()
    r = runner.invoke(main, ["validate", str(out), "--source", str(src), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert "verdict: VALID (exit 0)" in r.output and "integrity  pass" in r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["valid"] is True and doc["exit_code"] == 0 and set(doc["checks"]) == {
        "config", "structure", "index", "serving", "numerics", "source", "integrity"}
    r = runner.invoke(main, ["validate", str(out), "--tp", "2", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1 and "verdict: INVALID (exit 1)" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["checks"]["serving"]["status"] == "fail"
    if not torch.cuda.is_available():
        r = runner.invoke(main, ["validate", str(out), "--device", "cuda"])
        assert r.exit_code == 2 and "no CUDA device" in r.output
    assert runner.invoke(main, ["validate", str(out), "--sample", "0"]).exit_code == 2


def test_subprocess_exit_codes(damaged, tmp_path):
    name = f"{EXPERT}.weight_packed"
    shard = shard_of(damaged, name)
    entries, _, start = read_header(damaged / shard)
    with open(damaged / shard, "r+b") as f:
        f.seek(start + entries[name].begin)
        byte = f.read(1)[0]
        f.seek(start + entries[name].begin)
        f.write(bytes([byte ^ 1]))
    r = subprocess.run([sys.executable, "-m", "glmq", "validate", str(damaged)], capture_output=True, text=True)
    assert r.returncode == 1 and name in r.stdout and shard in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    (damaged / "config.json").unlink()
    r = subprocess.run([sys.executable, "-m", "glmq", "validate", str(damaged), "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "config.json: not found" in r.stderr and "Traceback" not in r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 2


# ----------------------------------------------------------------------------------------- cost
def test_default_sample_takes_each_stratum_and_integrity_still_reads_everything(converted):
    _, out = converted["glm5"]
    rep = v.validate(out)
    assert_all_pass(rep)
    d = rep.checks["numerics"].details
    projections = {m.rpartition(".")[2] for m in d["sampled_modules"]}
    assert d["sampled"] == 3 and projections == {"gate_proj", "up_proj", "down_proj"}  # 0.5% of 24: at least 1 each
    assert rep.settings["sample"] == v.DEFAULT_SAMPLE
    assert rep.checks["integrity"].checked == rep.settings["tensors"]
    assert rep.timings["scan_threads"]["bytes"] == rep.checks["index"].details["total_bytes"]
    assert v.validate(out, seed=5).checks["numerics"].details["sampled_modules"] != d["sampled_modules"]


def test_flipped_byte_outside_the_numerics_sample_fails_integrity(damaged):
    sampled = set(v.validate(damaged).checks["numerics"].details["sampled_modules"])
    module = next(f"model.layers.2.mlp.experts.{e}.up_proj" for e in range(8)
                  if f"model.layers.2.mlp.experts.{e}.up_proj" not in sampled)
    name = f"{module}.weight_packed"
    shard = shard_of(damaged, name)
    entries, _, start = read_header(damaged / shard)
    with open(damaged / shard, "r+b") as f:
        f.seek(start + entries[name].end - 1)  # the last byte: no row the matmul would have seen
        byte = f.read(1)[0]
        f.seek(start + entries[name].end - 1)
        f.write(bytes([byte ^ 0x01]))
    rep = v.validate(damaged)
    assert module not in rep.checks["numerics"].details["sampled_modules"]
    assert failed_checks(rep) == {"integrity"}
    (msg,) = failures(rep, "integrity")
    assert name in msg and shard in msg and "sha256" in msg


def test_units_split_shards_at_tensor_boundaries_and_hash_like_the_writer(converted, monkeypatch):
    from glmq.formats.safetensors_io import file_tensor_hashes
    from glmq.quantize.validate import reading

    _, out = converted["glm5"]
    ck = v.load_checkpoint(out)
    units = reading.work_units(ck, unit_bytes=50_000)
    assert len(units) > 2 * len(ck.shards)
    assert sorted(e.name for u in units for e in u.entries) == sorted(ck.entries())
    monkeypatch.setattr(reading, "UNIT_BYTES", 50_000)
    kept = []
    hashes, errors = v.scan_shards(ck, {"lm_head.weight"}, lambda n, t: kept.append((n, t.clone())), workers=3)
    assert not errors and hashes == {s: file_tensor_hashes(out / s) for s in ck.shards}
    (name, t), = kept
    with safe_open(str(out / shard_of(out, name)), "pt") as f:
        assert name == "lm_head.weight" and torch.equal(t, f.get_tensor(name))


# ----------------------------------------------------------------------------------------- checksums
def strip_fast_checksums(root: Path, shards=None) -> None:
    """Make the manifest look like one written before the fast checksum (only sha256 per tensor)."""
    man = json.loads((root / "glmq_manifest.json").read_text())
    for shard, rec in man["files"].items():
        if shards is None or shard in shards:
            del rec["xxh3_128"]
    (root / "glmq_manifest.json").write_text(json.dumps(man))


def flip_byte(root: Path, name: str) -> str:
    """Flip one bit in the middle of tensor `name`'s bytes; return its shard."""
    shard = shard_of(root, name)
    entries, _, start = read_header(root / shard)
    with open(root / shard, "r+b") as f:
        f.seek(start + (entries[name].begin + entries[name].end) // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x04]))
    return shard


def test_writer_records_sha256_and_xxh3_of_every_tensor(converted):
    import hashlib

    import xxhash

    _, out = converted["glm5"]
    man = json.loads((out / "glmq_manifest.json").read_text())
    assert set(man["files"]) == set(index(out)["weight_map"].values())
    for shard, rec in man["files"].items():
        entries, _, start = read_header(out / shard)
        data = (out / shard).read_bytes()
        raw = {n: data[start + e.begin:start + e.end] for n, e in entries.items()}
        assert rec["tensors"] == {n: hashlib.sha256(b).hexdigest() for n, b in raw.items()}
        assert rec["xxh3_128"] == {n: xxhash.xxh3_128_hexdigest(b) for n, b in raw.items()}
        assert all(len(d) == 32 for d in rec["xxh3_128"].values())


def test_default_checks_xxh3_and_sha256_on_request(converted):
    from glmq.formats.safetensors_io import XXH3_128, file_tensor_hashes

    _, out = converted["glm5"]
    rep = v.validate(out)
    assert_all_pass(rep)
    integrity = rep.checks["integrity"]
    assert integrity.details["checksums"] == {"xxh3_128": rep.settings["shards"]}
    assert integrity.checked == rep.settings["tensors"]
    rep = v.validate(out, sha256=True)
    assert_all_pass(rep)
    assert rep.checks["integrity"].details["checksums"] == {"sha256": rep.settings["shards"]}
    ck = v.load_checkpoint(out)
    hashes, errors = v.scan_shards(ck, set(), None, workers=2, algorithm=XXH3_128)
    assert not errors and hashes == {s: file_tensor_hashes(out / s, XXH3_128) for s in ck.shards}


def test_flipped_byte_fails_the_fast_checksum_and_sha256(damaged):
    name = f"{EXPERT}.weight_packed"
    shard = flip_byte(damaged, name)
    rep = v.validate(damaged)
    assert failed_checks(rep) == {"integrity"}
    (msg,) = failures(rep, "integrity")
    assert msg.startswith(f"{shard}: tensor {name}: xxh3_128 ") and "re-download or re-convert this shard" in msg
    assert rep.checks["integrity"].failures[0].tensor == name and rep.checks["integrity"].failures[0].shard == shard
    rep = v.validate(damaged, sha256=True)
    assert failed_checks(rep) == {"integrity"}
    (msg,) = failures(rep, "integrity")
    assert msg.startswith(f"{shard}: tensor {name}: sha256 ") and "xxh3" not in msg


def test_manifest_without_the_fast_checksum_validates_with_sha256(damaged):
    strip_fast_checksums(damaged)
    rep = v.validate(damaged)
    assert_all_pass(rep)
    assert rep.checks["integrity"].details["checksums"] == {"sha256": rep.settings["shards"]}
    assert rep.checks["integrity"].checked == rep.settings["tensors"]
    name = f"{EXPERT}.weight_packed"
    shard = flip_byte(damaged, name)
    rep = v.validate(damaged)
    (msg,) = failures(rep, "integrity")
    assert msg.startswith(f"{shard}: tensor {name}: sha256 ") and "xxh3" not in msg


def test_mixed_manifest_checks_each_shard_with_what_it_records(damaged):
    shards = sorted(set(index(damaged)["weight_map"].values()))
    strip_fast_checksums(damaged, shards[:1])
    rep = v.validate(damaged)
    assert_all_pass(rep)
    assert rep.checks["integrity"].details["checksums"] == {"sha256": 1, "xxh3_128": len(shards) - 1}


def test_resume_adds_the_fast_checksum_to_an_old_manifest(converted, damaged, monkeypatch):
    src, out = converted["glm5"]
    strip_fast_checksums(damaged)
    written = {p.name: p.stat().st_mtime_ns for p in damaged.glob("*.safetensors")}
    monkeypatch.setattr(stream, "ConfigJob", InProcessConfigJob)
    convert(src, damaged, "int4-w4a16")  # the same run: every file verified by sha256 and kept
    assert {p.name: p.stat().st_mtime_ns for p in damaged.glob("*.safetensors")} == written  # none redone
    assert (damaged / "glmq_manifest.json").read_bytes() == (out / "glmq_manifest.json").read_bytes()


@pytest.mark.parametrize("n,k,group,symmetric", [(1, 128, 128, True), (17, 256, 32, True), (130, 192, 64, False),
                                                 (3, 200, None, True), (9, 384, 128, False)])
def test_float64_reference_matches_the_torch_dequantization(n, k, group, symmetric):
    from glmq.formats.dense import dequantize_packed
    from glmq.quantize.pack import pack_int32, pack_zero_point
    from glmq.quantize.validate.cpu_kernels import w4a16_matmul_f64

    gen = torch.Generator().manual_seed(n * k)
    gs = group or k
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, -(-k // gs), generator=gen) + 0.01).to(torch.bfloat16)
    zp = None if symmetric else pack_zero_point(torch.randint(-8, 8, scale.shape, generator=gen, dtype=torch.int8))
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    packed = pack_int32(q)
    got = w4a16_matmul_f64(x, packed, scale, zp, (n, k), gs)
    want = x.double() @ dequantize_packed(packed, scale.double(), (n, k), 4, gs, zp).T
    assert got.dtype == torch.float64 and got.shape == (5, n)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    scale[0, 0] = float("nan")
    assert torch.isnan(w4a16_matmul_f64(x, packed, scale, zp, (n, k), gs)[:, 0]).all()
    with pytest.raises(ValueError, match="do not fit weight_shape"):
        w4a16_matmul_f64(x, packed[:, :-1], scale, zp, (n, k), gs)


def test_scale_check_reads_the_bits_like_the_float_comparisons():
    for dtype in (torch.bfloat16, torch.float16):
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        for i in range(0, every.numel(), 4099):
            one = every[i:i + 1].reshape(1, 1)
            f = one.float()
            assert (v.scale_problem(one) is None) == bool((torch.isfinite(f) & (f != 0)).all()), (dtype, one)
    s = torch.tensor([[0.5, -0.0], [float("-inf"), float("nan")]], dtype=torch.float32)
    assert v.scale_problem(s) == "2 NaN/Inf and 1 zero of 4 scales"
    assert v.scale_problem(torch.rand(64, 3) + 1e-3) is None
    assert v.scale_problem(-torch.rand(64, 3) - 1e-3) is None  # full_range writes negative scales


def test_source_reader_gives_what_iter_dense_gives(make_ckpt):
    from glmq.formats.dense import iter_dense

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    reader = v.SourceReader(src)
    seen = set()
    for name, w in iter_dense(src, torch.bfloat16):
        seen.add(name)
        got = reader.dense(name)
        assert got.dtype == w.dtype and torch.equal(got, w), name
    reader.close()
    assert seen == reader.names()


def test_source_read_error_during_the_scan_is_cannot_validate(converted, monkeypatch):
    src, out = converted["glm5"]
    real = v.SourceReader.raw

    def raw(self, name):  # the headers were read; then a source tensor cannot be
        if name == "lm_head.weight":
            raise OSError("injected: the source disk went away")
        return real(self, name)

    monkeypatch.setattr(v.SourceReader, "raw", raw)
    with pytest.raises(v.CannotValidate, match="--source .*injected"):
        v.validate(out, src)


@pytest.mark.parametrize("n,k", [(1, 1), (300, 257), (8300, 130)])  # 8300 rows: two bands of row blocks
def test_source_fp8_dequantization_is_the_reference_bits(n, k):
    from glmq.formats import fp8
    from glmq.quantize.validate.cpu_kernels import fp8_block_mismatches
    from glmq.quantize.validate.source import _dequantize_block_rows

    gen = torch.Generator().manual_seed(n)
    w8 = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)  # NaN codes too
    scale_inv = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 3
    want = fp8.dequantize_block(w8, scale_inv, (128, 128))
    assert torch.equal(_dequantize_block_rows(w8, scale_inv, (128, 128)).view(torch.int16), want.view(torch.int16))
    nan = int(torch.isnan(want).sum())  # NaN is never equal, as in torch.equal
    assert fp8_block_mismatches(want, w8, scale_inv, (128, 128)) == nan
    changed = want.clone()
    changed.view(-1)[-1] = changed.view(-1)[-1] * 2 + 1
    assert fp8_block_mismatches(changed, w8, scale_inv, (128, 128)) == nan + (not torch.isnan(want.view(-1)[-1]))
    signed_zero = torch.where(want == 0, -want, want)  # -0 == +0, as torch.equal
    assert fp8_block_mismatches(signed_zero, w8, scale_inv, (128, 128)) == nan
    assert fp8_block_mismatches(want[:, :-1], w8, scale_inv, (128, 128)) == w8.numel()


def test_changed_dequantized_attention_weight_fails_the_source_check(damaged, converted):
    src, _ = converted["glm5"]
    name = "model.layers.1.self_attn.q_b_proj.weight"  # FP8 in the source, dequantized to bf16 by glmq
    rewrite_shard(damaged, shard_of(damaged, name), lambda t: t[name].view(-1)[7:8].add_(0.5))
    rep = v.validate(damaged, src)
    assert failed_checks(rep) == {"source", "integrity"}
    assert failures(rep, "source") == [f"{name}: stored unquantized but differs from the source"]


# ----------------------------------------------------------------------------------------- malformed input
@pytest.mark.parametrize("value", [[0, 0], [-256, 128], [256, 128, 1]])
def test_unusable_weight_shape_value_fails_structure(damaged, value):
    name = f"{EXPERT}.weight_shape"
    shard = shard_of(damaged, name)
    rewrite_shard(damaged, shard, lambda t: t.__setitem__(name, torch.tensor(value)))
    rep = v.validate(damaged, sample=1.0)
    assert failed_checks(rep) == {"structure", "integrity"}
    [msg] = failures(rep, "structure")
    assert msg.startswith(f"{name} in {shard} ") and str(value) in msg and "the [N, K] of the original weight" in msg
    assert rep.checks["structure"].failures[0].shard == shard


def test_shard_safetensors_refuses_fails_index(damaged, tmp_path):
    from safetensors import SafetensorError

    from glmq.formats.safetensors_io import CheckpointError

    shard = shard_of(damaged, "lm_head.weight")
    with open(damaged / shard, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(SafetensorError, match="not fully covered"):
        safe_open(str(damaged / shard), "pt")
    rep = v.validate(damaged)
    assert "index" in failed_checks(rep)
    assert any(m.startswith(f"{damaged / shard}: file is ") and "4096 bytes after the last tensor" in m
               for m in failures(rep, "index"))

    def shard_file(header: dict, data: int, pad: bytes = b"") -> Path:
        raw = json.dumps(header).encode() + pad
        (p := tmp_path / "t.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * data)
        return p

    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    read_header(shard_file({"a": a, "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}, 8, b"    "))
    for b, why in (([4, 12], "overlap tensor a [0, 8)"), ([12, 20], "leave a gap of 4 bytes after byte 8")):
        p = shard_file({"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": b}}, b[1])
        with pytest.raises(SafetensorError, match="invalid offset"):
            safe_open(str(p), "pt")
        with pytest.raises(CheckpointError) as err:
            read_header(p)
        assert str(err.value).startswith(f"{p}: tensor b: offsets [{b[0]}, {b[1]}) {why}; ")


def test_source_copied_tensor_keeps_its_dtype_and_bytes(damaged, converted):
    src, _ = converted["glm5"]
    name = "model.layers.1.mlp.gate.e_score_correction_bias"  # F32 in the source (formats.md §1d): copied
    shard = shard_of(damaged, name)
    with safe_open(str(src / shard_of(src, name)), "pt") as f:
        orig = f.get_tensor(name)
    assert orig.dtype == torch.float32
    rewrite_shard(damaged, shard, lambda t: t.__setitem__(name, orig.to(torch.bfloat16)))
    rep = v.validate(damaged, src)
    assert failed_checks(rep) == {"source", "integrity"}
    assert failures(rep, "source") == [f"{name}: stored as BF16 but the source has F32: glmq copies this tensor "
                                       f"unchanged (same dtype, same bytes)"]
    assert rep.checks["source"].failures[0].shard == shard
    bumped = (orig.view(torch.int32) ^ 1).view(torch.float32)  # one low mantissa bit: the same value in bf16
    rewrite_shard(damaged, shard, lambda t: t.__setitem__(name, bumped))
    assert failures(v.validate(damaged, src), "source") == [f"{name}: stored unquantized but differs from the source"]


def test_malformed_json_fails_a_check_with_a_report(damaged, tmp_path):
    def run() -> tuple[list[str], dict]:
        r = CliRunner().invoke(main, ["validate", str(damaged), "--json", str(tmp_path / "r.json")])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        doc = json.loads((tmp_path / "r.json").read_text())
        assert doc["exit_code"] == 1
        return [f["message"] for c in doc["checks"].values() for f in c["failures"]], doc

    cfg = (damaged / "config.json").read_text()
    (damaged / "config.json").write_text("[]")
    msgs, doc = run()
    assert f"{damaged / 'config.json'}: a JSON list, not an object (a model config); fix config.json" in msgs
    assert doc["checks"]["config"]["status"] == "fail"
    (damaged / "config.json").write_text(cfg)
    edit_config(damaged, lambda qc: qc["config_groups"]["group_0"].__setitem__("weights", "int4"))
    msgs, _ = run()
    assert any(m.startswith("config.json: quantization_config.config_groups.group_0.weights is 'int4', not a mapping")
               for m in msgs)
    (damaged / "config.json").write_text(cfg)
    shard = shard_of(damaged, "lm_head.weight")
    data = (damaged / shard).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    del header["lm_head.weight"]["dtype"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    (damaged / shard).write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:])
    msgs, doc = run()
    assert f"{damaged / shard}: tensor lm_head.weight: header entry has no dtype; the shard is not valid " \
           f"safetensors, re-download or re-write it" in msgs
    assert doc["checks"]["index"]["status"] == "fail"


def test_activation_ordered_groups_are_not_passed_unchecked(damaged):
    """actorder "group" modules carry weight_g_idx, which glmq's kernels and references do not read: with groups in
    order the matmul check runs as usual; with any other g_idx it warns and counts the module as not checked,
    instead of passing a check that compared nothing of what the module computes."""
    def add_g_idx(order):
        for shard in sorted(set(index(damaged)["weight_map"].values())):
            def edit(t):
                for name in [k for k in t if k.endswith(".weight_packed")]:
                    k = t[name].shape[1] * 8
                    t[name.replace("weight_packed", "weight_g_idx")] = order(k).to(torch.int32)
            rewrite_shard(damaged, shard, edit)
        (damaged / "glmq_manifest.json").unlink(missing_ok=True)  # the shards changed on purpose

    def actorder(qc):
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"

    edit_config(damaged, actorder)
    add_g_idx(lambda k: torch.arange(k) // 128)
    rep = v.validate(damaged, sample=1.0)
    assert rep.checks["numerics"].status is v.Status.PASS and rep.checks["numerics"].checked == 72, v.format_report(rep)
    add_g_idx(lambda k: torch.arange(k) % max(1, k // 128))  # columns interleaved between the groups (K > 128)
    rep = v.validate(damaged, sample=1.0)
    num = rep.checks["numerics"]
    assert num.status is v.Status.WARN and num.checked + len(num.warnings) == 72
    assert 0 < len(num.warnings) < 72 and all("activation-ordered groups" in w.message for w in num.warnings)
    assert all(".down_proj" not in w.tensor for w in num.warnings)  # K = 128: one group, any g_idx is in order


def test_k_smaller_than_the_group_is_checked_as_one_group():
    """compressed-tensors stores ceil(K / g) = 1 scale per row when K < g; the matmul check reads it as such."""
    from glmq.quantize.pack import pack_int32
    from glmq.quantize.validate.config import Group
    from glmq.quantize.validate import numerics

    q = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scale = (torch.rand(16, 1) * 0.01 + 1e-3).to(torch.bfloat16)
    g = Group("group_0", ("Linear",), "int", num_bits=4, group_size=128)
    err, bound, _ = numerics.matmul_error(numerics._activations(0, "m", 64), pack_int32(q), scale, None, (16, 64), g,
                                          "cpu")
    assert err <= bound


def test_keep_fp8_fused_layers_are_targeted_by_their_own_names(converted, tmp_path):
    """vLLM's `find_matched_target` matches a fused layer (gate_up_proj, qkv_proj) by its own name, then by its class
    name, where "Linear" (the INT group's target) is a substring of MergedColumnParallelLinear, and only then by its
    parts' names: an FP8 group naming gate_proj and up_proj alone left vLLM building the fused layer as INT4 over FP8
    weights, and validate passed it. The writer names the fused layers in the FP8 group; validate fails a config
    without them, naming the fused layer and the target to add."""
    from glmq.quantize.validate.config import fused_layer_group, read_quant_config

    src, out = converted["glm5-keep-fp8"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = read_quant_config({"quantization_config": qc}, None).groups
    fused = "model.layers.0.mlp.gate_up_proj"  # GLM-5's dense MLP (first_k_dense_replace), kept FP8
    assert fused_layer_group(fused, groups).kind == "float"
    assert fused_layer_group("model.layers.1.mlp.shared_experts.gate_up_proj", groups).kind == "float"
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    for g in qc["config_groups"].values():
        g["targets"] = [t for t in g["targets"] if "gate_up_proj" not in t]
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    assert fused_layer_group(fused, read_quant_config({"quantization_config": qc}, None).groups).kind == "int"
    rep = v.validate(bad, serving=False)
    assert failed_checks(rep) == {"structure"}, failed_checks(rep)
    msgs = [f.message for f in rep.checks["structure"].failures]
    assert any(m.startswith(f"{fused}: vLLM fuses gate_proj, up_proj") and "gives it group_0 (INT4, group 128)" in m
               and "stored under group_1 (FP8)" in m
               and "re:^model\\.layers\\.0\\.mlp\\.gate_up_proj$" in m for m in msgs), msgs


def test_fused_layers_are_checked_against_their_parts_group_and_sglangs_names(make_ckpt, tmp_path):
    """Two checks vLLM's matcher needs beyond the form: (1) SGLang builds q_a_proj + kv_a_proj_with_mqa as
    `fused_qkv_a_proj_with_mqa` (kept FP8 where its rows are whole 128-row blocks), which a target anchored on vLLM's
    `fused_qkv_a_proj` does not match: the writer names both; (2) a fused layer resolved to another INT group than its
    parts' (another group size) was passed, since only INT against FP8 was compared."""
    from glmq import recipes as R
    from glmq.formats.source import open_source
    from glmq.quantize import stream
    from glmq.quantize.plan import make_plan
    from glmq.quantize.validate.config import fused_layer_group, read_quant_config

    src = make_ckpt("deepseek_v3", config_overrides={"kv_lora_rank": 96, "qk_rope_head_dim": 32})  # 128 rows
    (tmp_path / "r.yaml").write_text("name: kf\ntargets: [routed_expert]\nkeep_fp8: true\n")
    out = tmp_path / "out"
    stream.run(make_plan(open_source(src), R.load(str(tmp_path / "r.yaml")), 400_000), out, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = read_quant_config({"quantization_config": qc}, None).groups
    for name in ("fused_qkv_a_proj", "fused_qkv_a_proj_with_mqa"):
        assert fused_layer_group(f"model.layers.0.self_attn.{name}", groups).kind == "float", name
    assert v.validate(out, serving=False).valid
    for g in qc["config_groups"].values():
        g["targets"] = [t for t in g["targets"] if not t.endswith("fused_qkv_a_proj_with_mqa$")]
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    rep = v.validate(out, serving=False)
    msgs = [f.message for f in rep.checks["structure"].failures]
    assert any(m.startswith("model.layers.0.self_attn.fused_qkv_a_proj_with_mqa: SGLang fuses q_a_proj, "
                            "kv_a_proj_with_mqa") for m in msgs), msgs

    # (2): q/k/v at group 32 under a second INT group naming them; vLLM gives qkv_proj the "Linear" group's 128
    from glmq.quantize.validate.config import Group
    from glmq.quantize.validate.report import CheckResult
    from glmq.quantize.validate.structure import _check_fused_layers

    class M:
        def __init__(self, name):
            self.name, self.is_int, self.is_fp8 = name, True, False

        def shard(self):
            return "s.safetensors"

    g128 = Group("group_0", ("Linear",), "int", 4, 128)
    g32 = Group("group_1", ("re:.*\\.(q|k|v)_proj$",), "int", 4, 32)
    mods = {n: M(n) for n in (f"model.layers.0.self_attn.{x}_proj" for x in "qkv")}
    res = CheckResult("structure")
    _check_fused_layers(mods, [g128, g32], res)
    (f,) = res.failures
    assert f.message.startswith("model.layers.0.self_attn.qkv_proj: vLLM fuses q_proj, k_proj, v_proj") and \
        "gives it group_0 (INT4, group 128)" in f.message and "stored under group_1 (INT4, group 32)" in f.message
    # parts under two groups of one scheme (group 32) beside the "Linear" group's 128: still group 128 for qkv_proj
    g32q = Group("group_1", ("re:.*\\.q_proj$",), "int", 4, 32)
    g32kv = Group("group_2", ("re:.*\\.(k|v)_proj$",), "int", 4, 32)
    res = CheckResult("structure")
    _check_fused_layers(mods, [g128, g32q, g32kv], res)
    (f,) = res.failures
    assert "gives it group_0 (INT4, group 128)" in f.message and \
        "stored under group_1, group_2 (INT4, group 32)" in f.message, f.message
    res = CheckResult("structure")  # and a group of the parts' scheme for the fused layer's own name passes
    _check_fused_layers(mods, [Group("group_3", ("re:.*qkv_proj$",), "int", 4, 32), g128, g32q, g32kv], res)
    assert res.failures == []


def test_keep_fp8_experts_get_no_fused_layer_targets(make_ckpt, tmp_path):
    """With the routed experts kept FP8 (a recipe targeting attention alone), their gate/up are not fused layers of
    their own in vLLM (a layer's experts are one FusedMoE): the writer adds no `experts.N.gate_up_proj` targets (one per
    expert index, hundreds on GLM-5) and validate does not ask for them."""
    from glmq import recipes as R
    from glmq.formats.source import open_source
    from glmq.quantize import stream
    from glmq.quantize.plan import make_plan

    src = make_ckpt("glm4_moe")
    (tmp_path / "r.yaml").write_text("name: attn\ntargets: [attention]\nkeep_fp8: true\n")
    out = tmp_path / "out"
    stream.run(make_plan(open_source(src), R.load(str(tmp_path / "r.yaml")), 400_000), out, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fp8 = next(g["targets"] for g in qc["config_groups"].values() if g["weights"]["type"] == "float")
    assert any("experts\\.0\\.gate_proj" in t for t in fp8) and not any("mlp\\.experts" in t and "gate_up" in t for t in fp8)
    rep = v.validate(out, serving=False)
    assert rep.valid, v.format_report(rep)
