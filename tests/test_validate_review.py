"""`glmq validate` review: config values loaders read otherwise than glmq did, targets without ignore entries, and
expert projections under different schemes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from glmq import recipes
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan
from glmq.scripts.cli import main
from test_validate import InProcessConfigJob  # tests/ is on sys.path (pytest prepends it)

G64 = "name: g64\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 64\n"


@pytest.fixture(scope="module")
def outputs(make_ckpt, tmp_path_factory):
    """(int4-w4a16 output, the same source at group size 64)."""
    base = tmp_path_factory.mktemp("review")
    (base / "g64.yaml").write_text(G64)
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        for key, recipe in (("g128", "int4-w4a16"), ("g64", str(base / "g64.yaml"))):
            stream.run(make_plan(open_source(src), recipes.load(recipe), 400_000), base / key, progress=False)
            out[key] = base / key
    return out


@pytest.fixture
def ckpt(outputs, tmp_path) -> Path:
    return Path(shutil.copytree(outputs["g128"], tmp_path / "ckpt"))


def edit_qc(root: Path, edit) -> None:
    cfg = json.loads((root / "config.json").read_text())
    edit(cfg["quantization_config"])
    (root / "config.json").write_text(json.dumps(cfg))


def weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


def messages(rep: v.Report, check: str) -> list[str]:
    return [f.message for f in rep.checks[check].failures]


def test_unmodified_output_is_valid(ckpt):
    rep = v.validate(ckpt)
    assert rep.valid, v.format_report(rep)


def test_symmetric_as_a_string_fails_config(ckpt):
    """compressed-tensors (as vLLM/SGLang parse it) reads "false" as false: asymmetric, zero points expected and
    Marlin-MoE refuses it; glmq read bool("false") = True and passed the checkpoint (exit 0)."""
    from glmq.formats import compressed_tensors as ct

    edit_qc(ckpt, lambda qc: weights(qc).__setitem__("symmetric", "false"))
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert ct.QuantizationConfig.model_validate(qc).config_groups["group_0"].weights.symmetric is False
    rep = v.validate(ckpt)
    # read as loaders read it (asymmetric), with a note; the symmetric tensors then fail as asymmetric ones
    assert rep.exit_code == 1
    (w,) = rep.checks["config"].warnings
    assert w.message.startswith("config.json: quantization_config.config_groups.group_0.weights.symmetric is 'false', "
                                "not a JSON boolean: compressed-tensors ") and w.message.endswith(
        "(so vLLM and SGLang) reads it as false, as this check does; write false")
    assert "model.layers.1.mlp.experts.0.down_proj.weight_zero_point is missing (group_0 promises it)" in \
        messages(rep, "structure")


@pytest.mark.parametrize("key, value, read", [("num_bits", "4", 4), ("num_bits", 4.0, 4), ("group_size", 128.0, 128),
                                             ("symmetric", "true", True)])
def test_a_value_compressed_tensors_converts_is_read_as_converted_with_a_warning(ckpt, key, value, read):
    """vLLM and SGLang read the args with compressed-tensors (pydantic, lax): "4" is 4. validate dropped the group
    and failed every module as "stored pack-quantized but no INT config group targets it"."""
    from glmq.formats import compressed_tensors as ct

    edit_qc(ckpt, lambda qc: weights(qc).__setitem__(key, value))
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert getattr(ct.QuantizationConfig.model_validate(qc).config_groups["group_0"].weights, key) == read
    rep = v.validate(ckpt)
    assert rep.exit_code == 0, v.format_report(rep)
    (w,) = rep.checks["config"].warnings
    assert w.message.startswith(f"config.json: quantization_config.config_groups.group_0.weights.{key} is {value!r}, "
                                f"not a JSON ") and w.message.endswith(f"write {json.dumps(read)}")


@pytest.mark.parametrize("key, edit", [
    ("input_activations", lambda qc: qc["config_groups"]["group_0"].__setitem__(
        "input_activations", {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True})),
    ("weights.dynamic", lambda qc: weights(qc).__setitem__("dynamic", True)),
])
def test_int_group_that_vllm_would_not_load_as_wna16_fails_config(ckpt, tmp_path, key, edit):
    """formats.md §3a: vLLM's WNA16 schemes need static weights and no input_activations; such a config passed."""
    edit_qc(ckpt, edit)
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["checks"]["config"]["status"] == "fail"
    assert any(f"config_groups.group_0.{key} is" in f["message"] for f in doc["checks"]["config"]["failures"])


def test_unquantized_linear_that_no_group_targets_needs_no_ignore_entry(ckpt):
    """A group that targets the experts by name (no "Linear"): vLLM builds every other Linear unquantized, so a BF16
    lm_head without an ignore entry is what it loads; it failed as "vLLM would build it as INT"."""
    def by_name(qc):
        qc["config_groups"]["group_0"]["targets"] = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
        qc["ignore"] = []

    edit_qc(ckpt, by_name)
    rep = v.validate(ckpt)
    assert rep.checks["structure"].status is v.Status.PASS, messages(rep, "structure")[:3]
    assert rep.valid
    # with "Linear" targeted, the same missing ignore entry still fails
    edit_qc(ckpt, lambda qc: qc["config_groups"]["group_0"].__setitem__("targets", ["Linear"]))
    assert "lm_head.weight is stored unquantized (BF16) but matches no ignore entry: vLLM would build it as INT and " \
           "find no weight_packed" in messages(v.validate(ckpt), "structure")


def test_expert_projections_under_different_schemes_fail_serving(ckpt, outputs):
    """down_proj at group 64 (its own config group), gate/up at 128: vLLM raises "All MoE projections need to have
    same quantization scheme"; the serving check looked at one projection's group only and passed."""
    g64 = outputs["g64"]
    idx64 = json.loads((g64 / "model.safetensors.index.json").read_text())["weight_map"]
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(str(ckpt / shard), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        for k in [k for k in t if ".experts." in k and ".down_proj." in k]:
            with safe_open(str(g64 / idx64[k]), "pt") as f:
                t[k] = f.get_tensor(k)
        save_file(t, str(ckpt / shard), metadata={"format": "pt"})
    idx["metadata"].pop("total_size")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    (ckpt / "glmq_manifest.json").unlink()  # the shards changed on purpose

    def two_groups(qc):
        g1 = json.loads(json.dumps(qc["config_groups"]["group_0"]))
        g1["targets"], g1["weights"]["group_size"] = [r"re:.*mlp\.experts\.\d+\.down_proj$"], 64
        qc["config_groups"]["group_1"] = g1

    edit_qc(ckpt, two_groups)
    rep = v.validate(ckpt, sample=1.0)
    assert {k for k, c in rep.checks.items() if c.status is v.Status.FAIL} == {"serving"}, v.format_report(rep)
    [msg] = messages(rep, "serving")
    assert msg.startswith("routed_expert: one quantization scheme for all expert projections fails for 72 module(s)")
    assert "group_size 64" in msg and "group_size 128" in msg
    # the same args under two group names are one scheme: valid
    edit_qc(ckpt, lambda qc: qc["config_groups"]["group_1"]["weights"].__setitem__("group_size", 128))
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(str(ckpt / shard), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        src = json.loads((outputs["g128"] / "model.safetensors.index.json").read_text())["weight_map"]
        for k in [k for k in t if ".experts." in k and ".down_proj." in k]:
            with safe_open(str(outputs["g128"] / src[k]), "pt") as f:
                t[k] = f.get_tensor(k)
        save_file(t, str(ckpt / shard), metadata={"format": "pt"})
    rep = v.validate(ckpt, sample=1.0)
    assert rep.valid, v.format_report(rep)


def nan_scale(root: Path) -> tuple[str, str]:
    """Write a NaN into one expert's scale; (the scale's name, its shard)."""
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    shard = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(root / shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t[name][0, 0] = float("nan")
    save_file(t, str(root / shard), metadata={"format": "pt"})
    return name, shard


def test_json_report_of_a_nan_scale_is_standard_json(ckpt, tmp_path):
    """A NaN scale's failure carries value inf: `--json` wrote `"value": Infinity`, which is not JSON (RFC 8259)
    and which strict parsers reject, in the report of exactly the checkpoint CI must reject."""
    name, shard = nan_scale(ckpt)
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1, r.output

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    doc = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    [row] = [f for f in doc["checks"]["numerics"]["failures"] if f["tensor"] == name]
    assert row["value"] == "inf" and "1 NaN/Inf" in row["message"] and row["shard"] == shard


@pytest.mark.parametrize("name, check", [("model.safetensors.index.json", "index"),
                                         ("glmq_manifest.json", "integrity")])
def test_unreadable_index_or_manifest_fails_its_check_instead_of_a_traceback(ckpt, tmp_path, name, check):
    """An index or manifest that cannot be read (here a folder in its place: an OSError, as a permission error
    or EIO would be) ended in an IsADirectoryError traceback with exit 1 and no report."""
    (ckpt / name).unlink()
    (ckpt / name).mkdir()
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["checks"][check]["status"] == "fail"
    assert any(f["message"].startswith(f"{ckpt / name}: unreadable (") for f in doc["checks"][check]["failures"])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_rtn_output_passes_the_source_check(make_ckpt, tmp_path, symmetric):
    """The RTN bound was int4's (1/2 + 1/16 steps): every int8 weight failed it (worst 0.749 steps symmetric, 1.16
    asymmetric), so no 8-bit recipe's output could pass `validate --source`, though its rounding was right."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    r = tmp_path / "int8.yaml"
    r.write_text(f"targets: [routed_expert, shared_expert]\nnum_bits: 8\nsymmetric: {str(symmetric).lower()}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        stream.run(make_plan(open_source(src), recipes.load(str(r)), 400_000), tmp_path / "out", progress=False)
    rep = v.validate(tmp_path / "out", source=src, sample=1.0, serving=False)
    res = rep.checks["source"]
    assert res.status is v.Status.PASS and res.checked > 0, v.format_report(rep)
    # no kernel multiplies INT8 weights here: said, not passed as "0 checked" (session 43)
    num = rep.checks["numerics"]
    assert num.checked == 0 and num.details["unchecked_int8"] > 0 and num.status is v.Status.WARN
    assert "sampled INT8 module(s)" in num.warnings[0].message
    # int4's bounds as before (1/2 + 1/16, 1/2 + 1/8); int8's 1/2 + 1 and 1/2 + 2
    bounds = (v.rtn_bound_steps(symmetric, 4), v.rtn_bound_steps(symmetric, 8))
    assert bounds == ((0.5625, 1.5) if symmetric else (0.625, 2.5))


def test_a_nan_scale_fails_the_source_check_too(ckpt, make_ckpt):
    """max(worst, nan) keeps worst: a NaN scale's weight passed the source comparison (only numerics caught it)."""
    nan_scale(ckpt)
    rep = v.validate(ckpt, source=make_ckpt("glm_moe_dsa", "fp8-block"), sample=1.0, serving=False)
    assert any("experts.3.down_proj" in m for m in messages(rep, "source")), v.format_report(rep)


def test_a_crash_inside_validate_exits_2_and_replaces_an_old_json_report(ckpt, tmp_path, monkeypatch):
    """Exit codes are 0 valid, 1 invalid, 2 could not run: an unexpected exception exited 1 (read as INVALID) and left
    an earlier run's `--json` report in place, which a CI step could take for this run's verdict."""
    report = tmp_path / "r.json"
    assert CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(report)]).exit_code == 0
    assert json.loads(report.read_text())["valid"] is True

    def crash(*a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(v, "validate", crash)
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(report)])
    assert r.exit_code == 2 and "failed unexpectedly (RuntimeError: injected)" in r.output, r.output
    doc = json.loads(report.read_text())
    assert doc["valid"] is None and doc["exit_code"] == 2 and "injected" in doc["error"]


@pytest.mark.parametrize("kind", ["fifo", "complete-as-a-string"])
def test_a_pipe_for_a_shard_or_a_string_complete_flag_is_invalid_not_a_hang_or_a_pass(ckpt, kind):
    """A named pipe in a shard's place blocked validate forever; `"complete": "false"` in the manifest passed."""
    import os

    if kind == "fifo":
        shard = sorted(ckpt.glob("model-*.safetensors"))[1]
        shard.unlink()
        os.mkfifo(shard)
        needle = f"{shard}: not a regular file"
    else:
        man = ckpt / "glmq_manifest.json"
        man.write_text(man.read_text().replace('"complete": true', '"complete": "false"'))
        needle = "'complete' is 'false', not true or false"
    rep = v.validate(ckpt)
    assert not rep.valid and any(needle in f.message for c in rep.checks.values() for f in c.failures), \
        v.format_report(rep)


@pytest.mark.parametrize("key, value, needle", [
    ("n_routed_experts", 4, "holds experts numbered up to 7 (4 beyond config n_routed_experts = 4)"),
    ("n_routed_experts", "8", 'n_routed_experts is "8", not a positive integer'),
    ("hidden_size", 512, "model.embed_tokens.weight: shape [512, 256], but config.json's vocab_size x hidden_size is "
                         "[512, 512]; loaders would refuse it"),
    ("moe_intermediate_size", 64, "model.layers.1.mlp.experts.0.down_proj.weight: shape [256, 128], but config.json's "
                                  "hidden_size x moe_intermediate_size is [256, 64]"),
    ("num_attention_heads", 8, "model.layers.0.self_attn.o_proj.weight: shape [256, 256], but config.json's "
                               "hidden_size x num_attention_heads*v_head_dim is [256, 512]"),
    ("q_lora_rank", None, "config.json: q_lora_rank is null, not a positive integer (the DSA indexer reads the "
                          "compressed query); no loader builds a working model from it"),
])
def test_a_config_that_disagrees_with_the_tensors_fails_structure(ckpt, key, value, needle):
    """Extra experts, a string count and a hidden_size, expert width or head count the tensors do not have passed
    (exit 0); a quantized expert is checked by its weight_shape."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    rep = v.validate(ckpt)
    assert not rep.valid and any(needle in m for m in messages(rep, "structure")), v.format_report(rep)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.mlp.experts.0.down_proj.weight_scale", lambda e: e.update(dtype="F16")),
    ("model.layers.0.self_attn.q_a_proj.weight", lambda e: e.update(shape=e["shape"][::-1])),
], ids=["scale-relabelled-f16", "attention-shape-transposed"])
def test_a_header_edited_in_place_fails_integrity(ckpt, tensor, edit):
    """Same-length header edits passed (exit 0): the tensor checksums cover data bytes only."""
    import struct

    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    b = shard.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    edit(header[tensor])
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    shard.write_bytes(b[:8] + raw + b" " * (n - len(raw)) + b[8 + n:])
    rep = v.validate(ckpt)
    assert not rep.valid and any(f"{shard.name}: its header (tensor names, dtypes, shapes, offsets) changed" in m
                                 for m in messages(rep, "integrity")), v.format_report(rep)


def test_an_unreadable_shard_is_one_index_failure_not_also_a_total_size_one(ckpt):
    """A shard whose header is garbage was reported, and then again as metadata.total_size short by its bytes."""
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.write(b"garbage!")
    rep = v.validate(ckpt)
    index = messages(rep, "index")
    assert not rep.valid and any(f"{shard}: header length" in m for m in index), v.format_report(rep)
    assert not any("total_size" in m for m in index), index
    # with every shard readable, a wrong total_size is still a failure
    shard.unlink()
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    idx["metadata"]["total_size"] += 1
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != shard.name}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert any("metadata.total_size is" in m for m in messages(v.validate(ckpt), "index"))


def test_a_single_file_checkpoint_with_a_garbage_header_is_one_index_failure(make_ckpt, tmp_path):
    """model.safetensors alone (no index) with a header that is not safetensors: the index check fails naming it;
    it was also warned about as a file 'the index does not reference', and structure called every expert missing."""
    from glmq.formats.manifest import MANIFEST_NAME

    src = make_ckpt("glm_moe_dsa", "fp8-block", max_shard_bytes=10**9)
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "ConfigJob", InProcessConfigJob)
        stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 10**9), out, progress=False)
    (only,) = out.glob("model-*.safetensors")
    only.rename(out / "model.safetensors")
    (out / "model.safetensors.index.json").unlink()
    man = json.loads((out / MANIFEST_NAME).read_text())
    man["files"] = {"model.safetensors": man["files"][only.name]}
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    assert v.validate(out).valid  # the single-file layout itself is valid
    with open(out / "model.safetensors", "r+b") as f:
        f.write(b"garbage!")
    rep = v.validate(out)
    assert not rep.valid and any(f"{out / 'model.safetensors'}: header length" in m for m in messages(rep, "index"))
    assert not messages(rep, "structure"), messages(rep, "structure")
    assert not any("does not reference" in w.message for w in rep.checks["index"].warnings)


@pytest.mark.parametrize("key, value", [("hidden_size", "256"), ("moe_intermediate_size", 0)])
def test_a_config_value_of_the_wrong_kind_fails_structure(ckpt, key, value):
    """`hidden_size: "256"` skipped every shape row it is in, and the checkpoint validated (exit 0), though no loader
    builds a model from it; a key config.json lacks is checked at its class default."""
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, key: value}))
    rep = v.validate(ckpt, sample=0.01)
    assert not rep.valid and rep.exit_code == 1
    assert [m for m in messages(rep, "structure") if m.startswith("config.json: ")] == [
        f"config.json: {key} is {json.dumps(value)}, not a positive integer; no loader builds a working model from it"]
    (ckpt / "config.json").write_text(json.dumps({k: x for k, x in cfg.items() if k != key}))
    rep = v.validate(ckpt, sample=0.01)
    assert not rep.valid and any("GlmMoeDsaConfig's default; config.json has none" in m
                                 for m in messages(rep, "structure")), messages(rep, "structure")


@pytest.mark.parametrize("order, fix", [("static", "write 'weight' or null"), ("dynamic", "write 'group'")])
def test_an_actorder_alias_older_compressed_tensors_rejects_fails_config(ckpt, order, fix):
    """actorder "static" (llm-compressor GPTQ's default) passed (exit 0): the installed compressed-tensors parses it,
    but the releases before the aliases know only "group" and "weight", so a vLLM/SGLang shipping one refuses the
    config, as with the scale_dtype key validate already fails."""
    edit_qc(ckpt, lambda qc: weights(qc).__setitem__("actorder", order))
    rep = v.validate(ckpt)
    assert rep.exit_code == 1 and any(f"group_0.weights.actorder is {order!r}: an alias of" in m and fix in m
                                      for m in messages(rep, "config")), v.format_report(rep)


def test_a_channel_or_string_group_size_config_is_named_as_it_is(ckpt, outputs, tmp_path):
    """strategy "channel" on group-wise tensors was reported "with num_bits 4, group_size 256" (K as a group size),
    and group_size "128" (a string) as "group_size 128: not a pack-quantized layout", which hid the quotes."""
    edit_qc(ckpt, lambda qc: weights(qc).update(strategy="channel", group_size=None))
    msgs = "\n".join(messages(v.validate(ckpt), "structure"))
    assert "strategy channel (one scale per row)" in msgs and "group_size 256" not in msgs, msgs
    other = Path(shutil.copytree(outputs["g128"], tmp_path / "s"))
    edit_qc(other, lambda qc: weights(qc).__setitem__("group_size", "128"))
    rep = v.validate(other)
    # compressed-tensors 0.19's own validator compares the string with an int: refused, though pydantic would convert
    assert rep.exit_code == 1 and any(f.message.startswith(
        "config.json: quantization_config.config_groups.group_0.weights.group_size is '128', not a JSON integer, and "
        "compressed-tensors") for f in rep.checks["config"].failures), v.format_report(rep)


def test_shards_without_their_index_are_one_index_failure(ckpt):
    """The index of a sharded checkpoint removed: the report led with "24 of 24 expert projections missing" per layer,
    warned that each shard was "a file the index does not reference (loaders skip it)" and failed integrity once per
    shard, for one cause. Now the index check names it; structure and integrity say why they did not look."""
    (ckpt / "model.safetensors.index.json").unlink()
    rep = v.validate(ckpt)
    assert rep.exit_code == 1
    (failure,) = rep.checks["index"].failures
    assert "no model.safetensors.index.json, though 20 .safetensors file(s) are here" in failure.message
    assert not rep.checks["index"].warnings and not rep.checks["structure"].failures
    assert rep.checks["integrity"].skipped and "see index" in rep.checks["integrity"].skipped


# ------------------------------------------------- session 43: what a probe of validate found (each failed before)
@pytest.mark.parametrize("doc", ["null", "[]", '"x"', "4"])
def test_a_manifest_that_is_json_but_not_an_object_fails_integrity(ckpt, doc):
    """`null` in glmq_manifest.json raised AttributeError: exit 2, "failed unexpectedly, please report it"."""
    (ckpt / "glmq_manifest.json").write_text(doc)
    rep = v.validate(ckpt)
    assert rep.exit_code == 1
    (f,) = rep.checks["integrity"].failures
    assert "unreadable glmq manifest (it holds" in f.message and "not an object" in f.message


@pytest.mark.parametrize("value", [5, {"a": 1}, ["x"]])
def test_a_header_checksum_that_is_not_a_string_fails_integrity(ckpt, value):
    """A file record's header_xxh3_128 was sliced as a string: TypeError, exit 2."""
    man = json.loads((ckpt / "glmq_manifest.json").read_text())
    shard = sorted(man["files"])[0]
    man["files"][shard]["header_xxh3_128"] = value
    (ckpt / "glmq_manifest.json").write_text(json.dumps(man))
    rep = v.validate(ckpt)
    assert rep.exit_code == 1
    assert any(f"files.{shard}.header_xxh3_128 is not a hex digest" in f.message
               for f in rep.checks["integrity"].failures), v.format_report(rep)


def test_json_report_that_cannot_be_written_is_exit_2(ckpt, tmp_path, monkeypatch):
    """A --json target refused at the end (a full disk, a read-only mount) gave a traceback and exit 1 ("invalid")
    after a valid verdict; an empty name wrote nothing and exited 0; an unwritable folder is refused up front."""
    import errno
    import os

    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", ""])
    assert r.exit_code == 2 and "an empty file name" in r.output
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", "-"])  # wrote a file named "-"
    assert r.exit_code == 2 and "- (standard output) is not supported" in r.output and not Path("-").exists()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and "is not writable" in r.output, r.output
    monkeypatch.setattr(os, "access", real_access)

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    r = CliRunner().invoke(main, ["validate", str(ckpt), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2, r.output
    assert "verdict: VALID" in r.output and "could not be written (No space left on device)" in r.output
    r = CliRunner().invoke(main, ["validate", str(tmp_path / "nothing"), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and "the report could not be written" in r.output, r.output


def test_a_stray_tensor_on_an_expert_projection_fails_structure(ckpt):
    """Dense modules' unknown leaves failed; an expert's passed (vLLM maps experts.3.down_proj.g_idx to w2_g_idx, which
    it has no parameter for, and raises KeyError)."""
    name = "model.layers.1.mlp.experts.3.down_proj"
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][f"{name}.weight_packed"]
    rewrite(ckpt, shard, lambda t: t.update({f"{name}.g_idx": torch.zeros(128, dtype=torch.int32),
                                            f"{name}.weight_scale_2": torch.ones(1)}))
    rep = v.validate(ckpt)
    msgs = messages(rep, "structure")
    for leaf in ("g_idx", "weight_scale_2"):
        assert any(m.startswith(f"{name}.{leaf}: has no parameter") for m in msgs), msgs


def test_an_index_entry_outside_the_folder_fails_and_is_not_read(ckpt, tmp_path):
    """A shard named `sub/x.safetensors` or `../x.safetensors` was read and passed; vLLM's non-recursive glob never
    loads it."""
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    (ckpt / "sub").mkdir()
    (ckpt / shard).rename(ckpt / "sub" / shard)
    idx["weight_map"] = {k: (f"sub/{s}" if s == shard else s) for k, s in idx["weight_map"].items()}
    idx_path.write_text(json.dumps(idx))
    (ckpt / "glmq_manifest.json").unlink()
    rep = v.validate(ckpt)
    assert rep.exit_code == 1
    assert any(m.startswith("model.safetensors.index.json: places ") and f"in 'sub/{shard}', not a .safetensors file "
               f"of the checkpoint's own folder" in m for m in messages(rep, "index")), v.format_report(rep)
    assert any("is missing" in m for m in messages(rep, "structure"))


def test_a_second_weight_file_that_loaders_would_read_fails_the_index(ckpt, tmp_path):
    """A model.safetensors beside the index (transformers loads it instead), and a second file beside a single
    model.safetensors with no index (vLLM loads every file), were warned as "loaders skip it"."""
    shard = sorted(p.name for p in ckpt.glob("model-*.safetensors"))[0]
    shutil.copy(ckpt / shard, ckpt / "model.safetensors")
    rep = v.validate(ckpt)
    assert any(m.startswith("model.safetensors: a single-file checkpoint beside model.safetensors.index.json: "
                            "transformers loads it") for m in messages(rep, "index")), v.format_report(rep)
    single = tmp_path / "single"
    single.mkdir()
    tensors = {}
    for p in sorted(ckpt.glob("model-*.safetensors")):
        with safe_open(str(p), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    save_file(tensors, str(single / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", single / "config.json")
    assert v.validate(single).exit_code == 0
    shutil.copy(ckpt / shard, single / "extra.safetensors")
    rep = v.validate(single)
    assert rep.exit_code == 1 and any(m.startswith("extra.safetensors: a second .safetensors file beside "
                                                   "model.safetensors and no model.safetensors.index.json")
                                      for m in messages(rep, "index")), v.format_report(rep)


def rewrite(root: Path, shard: str, edit) -> None:
    """Load a shard, let `edit(dict)` change it, save it back, and put its tensors in the index."""
    with safe_open(str(root / shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(root / shard), metadata={"format": "pt"})
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({k: shard for k in t})
    idx["metadata"].pop("total_size", None)
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
