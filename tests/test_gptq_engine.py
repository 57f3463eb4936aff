"""The layer-sequential GPTQ engine (calibration/engine.py) end to end on generated checkpoints.

What is asserted:
- GPTQ output has exactly RTN's format (same tensor names, dtypes, shapes and config; compressed-
  tensors decompresses it to our weights); only the calibrated targets differ from RTN, and the MTP
  layer's experts are RTN's bytes.
- On the calibration data, GPTQ's experts give a smaller decoder-layer output error than RTN's,
  measured independently of the engine's own bookkeeping, and its report says the same per class.
- Expert coverage: token counts add up; under-covered experts are listed and get all-token Hessians
  or RTN; an expert no token reaches is an empty-Hessian fallback in the report, never silent.
- A run killed mid-layer (and one killed while writing) resumes and ends byte-identical to an
  uninterrupted run, with activations on disk (the default), in memory or in a folder of their own; the
  default's files are written in the output's cache folder and removed at the end (after a failure, all
  but the resume point), and give the same bytes as activations in memory.
- A folder holding another run (RTN, or other calibration settings) is refused.
- On the shared trained model (slow): KL and perplexity, measured and printed, beat RTN's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmq import recipes
from glmq.calibration.cache import CACHE_DIR, CalibrationCacheError
from glmq.calibration.engine import GPTQ_BATCH, CalibrationSettings, run_gptq
from glmq.calibration.layers import LayerBuilder
from glmq.formats import fixtures
from glmq.formats.dense import iter_dense
from glmq.formats.manifest import REPORT_NAME
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan
from test_stream import OLD_CT_ARGS_KEYS, ct_decompress, tensors  # tests/ is on sys.path (rootdir-less test modules)

SAMPLES, SEQ = 16, 64


def gptq_plan(src: Path, recipe: str = "int4-w4a16", max_shard_bytes: int = 300_000, **spec):
    """GPTQ of a shipped recipe; `spec` overrides QuantSpec fields. The layer-output tuning is off unless asked
    for (`tune_iters`): these tests are of GPTQ itself, tests/test_tune.py is of the tuning."""
    r = recipes.load(recipe).with_method("gptq")
    r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, **{"tune_iters": 0, **spec}))
    return make_plan(open_source(src), r, max_shard_bytes)


def rtn_plan(src: Path, recipe: str = "int4-w4a16", max_shard_bytes: int = 300_000):
    return make_plan(open_source(src), recipes.load(recipe), max_shard_bytes)


def calib_ids(vocab: int = 512, samples: int = SAMPLES, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(seed))


def settings(**kw) -> CalibrationSettings:
    return CalibrationSettings(**{"samples": SAMPLES, "seq_len": SEQ, "batch_size": 4, **kw})


@pytest.fixture(scope="module")
def glm4(make_ckpt, tmp_path_factory):
    """(source, GPTQ output, RTN output, GPTQ report) for the tiny GLM-4.x MoE, recipe int4-w4a16."""
    src = make_ckpt("glm4_moe", "fp8-block")
    tmp = tmp_path_factory.mktemp("glm4-gptq")
    report = run_gptq(gptq_plan(src), tmp / "gptq", calib_ids(), settings(), progress=False)
    stream.run(rtn_plan(src), tmp / "rtn", progress=False)
    return src, tmp / "gptq", tmp / "rtn", report


# ----------------------------------------------------------------------------------------- format


def test_gptq_output_has_exactly_the_rtn_format(glm4):
    src, gptq, rtn, _ = glm4
    tg, tr = tensors(gptq), tensors(rtn)
    assert {k: (v.dtype, v.shape) for k, v in tg.items()} == {k: (v.dtype, v.shape) for k, v in tr.items()}
    cfg_g, cfg_r = (json.loads((d / "config.json").read_text()) for d in (gptq, rtn))
    assert cfg_g == cfg_r
    (group,) = cfg_g["quantization_config"]["config_groups"].values()
    assert set(group["weights"]) == OLD_CT_ARGS_KEYS and group["format"] == "pack-quantized"
    n_layers = cfg_g["num_hidden_layers"]
    calibrated = [k for k in tg if ".experts." in k and int(k.split(".")[2]) < n_layers]
    for name, t in tg.items():
        if name not in calibrated:  # everything else, the MTP layer's experts (RTN) included, is RTN's bytes
            assert torch.equal(t, tr[name]), name
    packed = [k for k in calibrated if k.endswith("weight_packed")]
    assert len(packed) == 2 * 8 * 3 and all(not torch.equal(tg[k], tr[k]) for k in packed)
    theirs, ours = ct_decompress(gptq), dict(iter_dense(gptq, torch.bfloat16))
    assert theirs and all(torch.equal(w, ours[k]) for k, w in theirs.items())


def test_report_and_manifest(glm4):
    src, gptq, rtn, report = glm4
    assert json.loads((gptq / REPORT_NAME).read_text())["gptq"] == report["gptq"]
    man_g, man_r = (json.loads((d / "glmq_manifest.json").read_text()) for d in (gptq, rtn))
    assert man_g["identity"]["recipe"]["method"] == "gptq" and man_r["identity"]["recipe"]["method"] == "rtn"
    g = report["gptq"]
    assert g["settings"]["samples"] == SAMPLES and g["calibration_tokens"] == SAMPLES * SEQ
    assert g["mtp"]["method"] == "rtn" and g["mtp"]["tensors"] == 3 * 8
    assert [lay["layer"] for lay in g["layers"]] == [0, 1, 2]
    solved = [lay for lay in g["layers"] if lay["gptq_seconds"] is not None]  # the dense layer 0 has no target
    assert [lay["layer"] for lay in solved] == [1, 2]
    for lay in solved:  # where each layer's solve time went: the three phases, inside the solve loop's time
        ph = lay["gptq_phase_seconds"]
        assert set(ph) == {"problems", "solves", "diagnostics"} and min(ph.values()) >= 0
        assert sum(ph.values()) <= lay["gptq_seconds"] + 0.01
    assert sorted(p.name for p in (gptq / CACHE_DIR).iterdir()) == ["calibration.json", "report.json"]


def _layer_output(b: LayerBuilder, i: int, state: dict, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return b.build(i, state)(x, **b.layer_kwargs(x))


def test_gptq_layer_output_error_is_below_rtn(glm4):
    """Decoder layer 1 (the first MoE layer; layer 0 is dense and unquantized, so its input is the same in
    every model), run on the calibration data with the source's, GPTQ's and RTN's experts."""
    src, gptq, rtn, report = glm4
    b = LayerBuilder(open_source(src), torch.device("cpu"), torch.float32)
    x = _layer_output(b, 0, b.tensors.layer_state(0), b.embed(calib_ids()))
    ref = _layer_output(b, 1, b.tensors.layer_state(1), x)
    errs = {}
    for name, out in (("gptq", gptq), ("rtn", rtn)):
        state = {k[len("model.layers.1."):]: v for k, v in iter_dense(out) if k.startswith("model.layers.1.")}
        errs[name] = ((_layer_output(b, 1, state, x) - ref).norm() / (ref - x).norm()).item()
    print("layer-1 output error", errs)
    assert 0 < errs["gptq"] < 0.8 * errs["rtn"], errs
    for lay in report["gptq"]["layers"][1:]:
        row = lay["classes"]["routed_expert"]
        assert row["rel_err_gptq"] < row["rel_err_rtn"], lay
    row = report["gptq"]["by_class"]["routed_expert"]
    assert row["tensors"] == 48 and row["gptq_better"] >= 40


def test_experts_per_pass_changes_no_bit(glm4, tmp_path):
    """Holding the Hessians of 3 experts at a time (3 passes per layer) gives the same checkpoint."""
    src, gptq, _, _ = glm4
    run_gptq(gptq_plan(src), tmp_path / "chunked", calib_ids(), settings(experts_per_pass=3), progress=False)
    assert _files(tmp_path / "chunked") == _files(gptq)


def test_glm5_all_linear_recipe(make_ckpt, tmp_path):
    """GLM-5 layout (MLA + DSA indexer, carried top-k), attention / shared / dense targets too."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    out = tmp_path / "gptq"
    report = run_gptq(gptq_plan(src, "int4-w4a16-all-linear"), out, calib_ids(), settings(clip_search=False),
                      progress=False)
    stream.run(rtn_plan(src, "int4-w4a16-all-linear"), tmp_path / "rtn", progress=False)
    tg, tr = tensors(out), tensors(tmp_path / "rtn")
    assert {k: (v.dtype, v.shape) for k, v in tg.items()} == {k: (v.dtype, v.shape) for k, v in tr.items()}
    by_class = report["gptq"]["by_class"]
    assert set(by_class) == {"attention", "dense_mlp", "routed_expert", "shared_expert"}
    for cls, row in by_class.items():
        assert row["rel_err_gptq"] < row["rel_err_rtn"], (cls, row)
    assert not torch.equal(tg["model.layers.1.self_attn.kv_b_proj.weight_packed"],
                           tr["model.layers.1.self_attn.kv_b_proj.weight_packed"])
    assert torch.equal(tg["model.layers.1.self_attn.indexer.wk.weight"], tr["model.layers.1.self_attn.indexer.wk.weight"])


def test_sequential_stages_follow_the_forward():
    from glmq.calibration.collect import make_target
    from glmq.calibration.layer_gptq import sequential_stages

    names = ["mlp.experts.3.down_proj", "self_attn.o_proj", "mlp.experts.3.gate_proj", "self_attn.kv_b_proj",
             "mlp.shared_experts.down_proj", "self_attn.q_a_proj", "mlp.shared_experts.up_proj",
             "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "mlp.experts.3.up_proj", "mlp.gate_proj"]
    stages = sequential_stages([make_target(f"model.layers.2.{n}", 2) for n in names])
    assert [[t.local for t in st] for st in stages] == [
        ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"], ["self_attn.kv_b_proj", "self_attn.q_b_proj"],
        ["self_attn.o_proj"], ["mlp.experts.3.gate_proj", "mlp.shared_experts.up_proj", "mlp.experts.3.up_proj",
                               "mlp.gate_proj"], ["mlp.experts.3.down_proj", "mlp.shared_experts.down_proj"]]
    experts_only = [make_target(f"model.layers.2.mlp.experts.{e}.{p}_proj", 2) for e in (0, 1) for p in ("gate", "up", "down")]
    assert [len(st) for st in sequential_stages(experts_only)] == [4, 2]


def test_true_sequential_quantizes_later_stages_on_quantized_inputs(make_ckpt, tmp_path):
    """GLM-5 layout, every linear: the first stage of the first layer gets its Hessians from the same pass as
    without `sequential` (identical integers); every later stage sees the earlier stages quantized (its
    integers change), and the output keeps the RTN format."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    runs = {}
    for seq in (False, True):
        out = tmp_path / f"seq{int(seq)}"
        runs[seq] = run_gptq(gptq_plan(src, "int4-w4a16-all-linear"), out, calib_ids(),
                             settings(clip_search=False, sequential=seq), progress=False), tensors(out)
    (_, t0), (rep1, t1) = runs[False], runs[True]
    assert {k: (v.dtype, v.shape) for k, v in t0.items()} == {k: (v.dtype, v.shape) for k, v in t1.items()}
    lay = rep1["gptq"]["layers"][1]
    assert lay["sequential_stages"] == [["kv_a_proj_with_mqa", "q_a_proj"], ["kv_b_proj", "q_b_proj"], ["o_proj"],
                                        ["gate_proj", "up_proj"], ["down_proj"]], lay["sequential_stages"]
    assert lay["tokens_per_expert"] and sum(lay["tokens_per_expert"]) > 0
    for name in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"):  # layer 0's first stage: the same inputs
        assert torch.equal(t0[f"model.layers.0.{name}.weight_packed"], t1[f"model.layers.0.{name}.weight_packed"]), name
    p = "model.layers.1."
    for name in ("self_attn.kv_b_proj", "self_attn.o_proj", "mlp.shared_experts.down_proj", "mlp.experts.0.down_proj"):
        assert not torch.equal(t0[p + name + ".weight_packed"], t1[p + name + ".weight_packed"]), name
    for cls, row in rep1["gptq"]["by_class"].items():
        assert row["rel_err_gptq"] < row["rel_err_rtn"], (cls, row)
    assert "sequential" not in settings().identity() and settings(sequential=True).identity()["sequential"]


# ----------------------------------------------------------------------------------------- coverage


def test_expert_token_counts_and_under_covered_rtn(glm4, tmp_path):
    src, _, rtn, report = glm4
    cfg = json.loads((src / "config.json").read_text())
    for lay in report["gptq"]["layers"][1:]:  # every routed token counted once per expert it reaches
        assert len(lay["tokens_per_expert"]) == cfg["n_routed_experts"]
        assert sum(lay["tokens_per_expert"]) == SAMPLES * SEQ * cfg["num_experts_per_tok"]
    # every expert under the threshold, handled by RTN: the experts are RTN's bytes, each one reported
    out = tmp_path / "rtn-covered"
    rep = run_gptq(gptq_plan(src), out, calib_ids(), settings(min_expert_tokens=10**9, under_covered="rtn"),
                   progress=False)["gptq"]
    assert len(rep["expert_coverage"]["under_covered"]) == 2 * cfg["n_routed_experts"]
    assert {f["reason"] for f in rep["fallbacks"]} == {"under_covered_rtn"} and len(rep["fallbacks"]) == 48
    t, tr = tensors(out), tensors(rtn)
    assert all(torch.equal(v, tr[k]) for k, v in t.items())


def _with_dead_expert(src: Path, dst: Path, layer: int, expert: int) -> Path:
    """A copy of `src` whose router never picks `expert` in `layer` (its score correction bias -1e9)."""
    shutil.copytree(src, dst)
    name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    wm = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / wm[name]
    t = load_file(str(shard))
    t[name] = t[name].clone()
    t[name][expert] = -1e9
    save_file(t, str(shard), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("min_tokens, prior", [(0, 0.0), (1, 1.0), (0, 1.0)])
def test_expert_without_tokens_is_reported(make_ckpt, tmp_path, min_tokens, prior):
    """An expert no calibration token reaches is listed whatever the settings (README: "all listed in the report");
    with --min-expert-tokens 0 and the prior (the all-token Hessian whole) it was in no list."""
    from glmq.calibration.report import format_report

    src = _with_dead_expert(make_ckpt("glm4_moe", "fp8-block"), tmp_path / "src", layer=1, expert=3)
    s = settings(min_expert_tokens=min_tokens, expert_prior=prior, clip_search=False)
    rep = run_gptq(gptq_plan(src), tmp_path / "o", calib_ids(), s, progress=False)["gptq"]
    assert rep["layers"][1]["expert_tokens"]["zero"] >= 1
    assert {"layer": 1, "expert": 3} in rep["expert_coverage"]["unreached"]
    assert "experts no calibration token reached: " in format_report(rep) and "\n  layer 1 expert 3" in format_report(rep)
    assert format_report(rep).count("layer 1 expert 3") == 1  # listed once: among the under-covered, or the unreached
    # the errors are in-sample, and the experts too thin for a full-rank Hessian are counted (a probe: 2 x 32 tokens
    # were "better on 144 of 144 tensors" for a model worse than RTN by glmq eval)
    assert rep["rel_err_measured_on"].startswith("the calibration tokens themselves (in-sample")
    width = json.loads((src / "config.json").read_text())["hidden_size"]
    counts = [c for lay in rep["layers"] for c in lay["tokens_per_expert"]]
    assert rep["expert_coverage"]["below_input_width"] == {"input_width": width, "of": len(counts),
                                                           "experts": sum(c < width for c in counts)}
    assert "(rel.err: on the calibration tokens themselves (in-sample" in format_report(rep)
    assert f"fewer calibration tokens than their {width} input channels: " in format_report(rep)
    dead = [f"model.layers.1.mlp.experts.3.{p}_proj" for p in ("gate", "up", "down")]
    if prior:
        assert not any(f["module"] in dead for f in rep["fallbacks"])
    if min_tokens == 0 and not prior:  # no threshold, no prior: no Hessian at all, so RTN, recorded per tensor
        assert {f["module"]: f["reason"] for f in rep["fallbacks"] if f["module"] in dead} == \
            {m: "empty_hessian" for m in dead}
    elif min_tokens:  # under-covered: quantized with the all-token Hessian, listed
        assert {"layer": 1, "expert": 3, "tokens": 0, "hessian": "all_tokens"} in rep["expert_coverage"]["under_covered"]


def test_input_channels_no_token_reaches_are_reported(make_ckpt, tmp_path):
    """A channel of the MLP's input that is 0 for every calibration token (its RMSNorm weight 0) has diag(H) = 0:
    GPTQ zeroes that column of every expert's gate/up (reference gptq.py), which a served input would still
    reach. The count sat in each layer file only; now the report lists the tensors."""
    from glmq.calibration.report import format_report

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), src)
    name = "model.layers.1.post_attention_layernorm.weight"
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    t = load_file(str(shard))
    t[name] = t[name].clone()
    t[name][5] = 0
    save_file(t, str(shard), metadata={"format": "pt"})
    rep = run_gptq(gptq_plan(src), tmp_path / "o", calib_ids(), settings(clip_search=False), progress=False)["gptq"]
    experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    want = {f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in range(experts) for p in ("gate", "up")}
    assert {z["module"]: z["columns"] for z in rep["zeroed_columns"]} == dict.fromkeys(want, 1)
    text = format_report(rep)
    assert "tensors with input channels 0 in every calibration token (" in text and f": {len(want)}\n" in text
    assert "\n  model.layers.1.mlp.experts.0.gate_proj: 1 channels" in text
    out = tensors(tmp_path / "o")
    assert all(not out[f"{m}.weight_packed"].eq(0).all() for m in want)  # the rest of each tensor is quantized


# ----------------------------------------------------------------------------------------- resume


def calibration_source(make_ckpt, tmp: Path, text: str) -> tuple[Path, Path]:
    """A GLM-5-layout FP8 checkpoint with a byte tokenizer in tmp/src, and `text` in tmp/calib.txt."""
    src = tmp / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    fixtures.write_byte_tokenizer(src)
    (tmp / "calib.txt").write_text(text)
    return src, tmp / "calib.txt"


@pytest.fixture(scope="module")
def cli_src(make_ckpt, tmp_path_factory):
    """A GLM-5 layout checkpoint with a tokenizer, a calibration text, and the uninterrupted CLI run."""
    tmp = tmp_path_factory.mktemp("gptq-cli")
    rng = random.Random(0)
    words = ["expert", "router", "token", "layer", "quantize", "group", "scale", "the", "of", "and"]
    src, text = calibration_source(make_ckpt, tmp, " ".join(rng.choice(words) for _ in range(2000)))
    ref = tmp / "ref"
    r = _cli("none", 0, src, ref, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GPTQ calibration" in r.stdout and "MTP layer" in r.stdout
    return src, text, ref


_CHILD = r"""
import os, sys
mode, limit = sys.argv[1], int(sys.argv[2])
calls = [0]
def dying(orig):
    def f(*a, **k):
        calls[0] += 1
        if calls[0] > limit:
            os._exit(137)
        return orig(*a, **k)
    return f
if mode == "tune":  # dies inside a layer's output tuning, after `limit` forwards of it
    from glmq.calibration import tune
    tune._output = dying(tune._output)
if mode == "gptq":  # dies inside a layer, after `limit` batched GPTQ calls
    from glmq.calibration import layer_gptq
    layer_gptq.quantize_gptq_batch = dying(layer_gptq.quantize_gptq_batch)
elif mode == "write":  # dies while writing the checkpoint, after `limit` tensor writes
    from glmq.formats import safetensors_io
    safetensors_io.StreamingWriter.write = dying(safetensors_io.StreamingWriter.write)
from glmq.scripts.cli import main
sys.argv = ["glmq", "quantize", "--model", sys.argv[3], "--output", sys.argv[4], "--scheme", "gptq",
            "--calibration", sys.argv[5], "--samples", "8", "--seq-len", "32", "--max-shard-size", "300KB",
            "--no-progress", *sys.argv[6:]]
main()
"""


def _cli(mode: str, limit: int, src: Path, out: Path, text: Path, *extra: str):
    return subprocess.run([sys.executable, "-c", _CHILD, mode, str(limit), str(src), str(out), str(text), *extra],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and p.name != REPORT_NAME}


@pytest.mark.parametrize("where", ["disk", "memory", "dir"])
def test_killed_mid_layer_resumes_byte_identical(cli_src, tmp_path, where):
    """Killed inside layer 2 (then, with the states in a folder of their own, also while writing the
    checkpoint); each rerun resumes. The reference run keeps its states on disk (the default)."""
    src, text, ref = cli_src
    out = tmp_path / "out"
    offload = where == "dir"
    extra = {"disk": (), "memory": ("--activations", "memory"),
             "dir": ("--offload-activations", str(tmp_path / "acts"))}[where]
    # layer 0 is dense (no target); layers 1 and 2 have 8 experts each, solved in batched GPTQ calls of
    # GPTQ_BATCH["cpu"] problems (gate+up, down): die in the middle of layer 2
    per_layer = 2 * math.ceil(8 / GPTQ_BATCH["cpu"])
    r = _cli("gptq", per_layer + per_layer // 2, src, out, text, *extra)  # dies at the call after
    assert r.returncode == 137, r.stderr[-3000:]
    cache = out / CACHE_DIR
    assert sorted(p.name for p in cache.glob("layer-*")) == ["layer-00000.safetensors", "layer-00001.safetensors"]
    assert not (out / "config.json").exists()
    if offload:
        r = _cli("write", 40, src, out, text, *extra)  # resumes at layer 2, then dies while writing
        assert r.returncode == 137, r.stderr[-3000:]
        assert not (out / "config.json").exists()
    r = _cli("none", 0, src, out, text, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref)
    rep = json.loads((out / REPORT_NAME).read_text())
    assert rep["gptq"]["resumed_from_layer"] == (3 if offload else 2)  # 3: calibration had finished
    # the peak is over every run (the killed runs' layers recorded theirs), and the terminal says whose seconds it gives
    g = rep["gptq"]
    assert g["peak_rss_bytes"] == max(g["peak_rss_bytes"], *(lay["peak_rss_bytes"] for lay in g["layers"]))
    assert "s in this run (its layers " in r.stdout + r.stderr
    assert rep["files_skipped_resumed"] > 0 if offload else True
    if offload:
        assert not list((tmp_path / "acts").rglob("*")), "offloaded activations left behind"


def test_a_gptq_resume_over_a_changed_source_shard_is_refused_until_its_time_is_restored(cli_src, tmp_path):
    """A source shard whose modification time moved between the crash and the resume (edited in place, or copied
    without its times): the calibrated layers may rest on its old contents, which the run cannot tell, so the
    resume is refused with nothing deleted, and the message's own `touch` command restores the time; the resume
    is then byte-identical to the uninterrupted run."""
    import os
    import re

    src0, text, ref = cli_src
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(src0, src)  # keeps the times
    per_layer = 2 * math.ceil(8 / GPTQ_BATCH["cpu"])
    r = _cli("gptq", per_layer + per_layer // 2, src, out, text)
    assert r.returncode == 137, r.stderr[-3000:]
    shard = sorted(src.glob("model-*.safetensors"))[1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9 + 7))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    r = _cli("none", 0, src, out, text)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"{shard}: modified since the interrupted GPTQ run in {out} began" in r.stderr, r.stderr[-3000:]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before  # nothing deleted or written
    touch = re.search(r"touch -m -d @\S+ \S+", r.stderr).group(0)
    subprocess.run(touch, shell=True, check=True)
    assert shard.stat().st_mtime_ns == st.st_mtime_ns
    r = _cli("none", 0, src, out, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref)
    assert json.loads((out / REPORT_NAME).read_text())["gptq"]["resumed_from_layer"] == 2


def test_a_resume_without_the_calibration_cache_keeps_the_finished_files_only_for_the_same_calibration(cli_src,
                                                                                                       tmp_path):
    """Killed while writing the checkpoint, its `.glmq-gptq` cache then deleted: the calibration was recorded only
    there, so a resume with another --seed kept the finished files of the first calibration beside files of the
    second (and validated). The manifest records it now: refused, nothing deleted; the same seed resumes."""
    src, text, ref = cli_src
    out = tmp_path / "out"
    r = _cli("write", 40, src, out, text)
    assert r.returncode == 137, r.stderr[-3000:]
    shutil.rmtree(out / CACHE_DIR)
    assert json.loads((out / "glmq_manifest.json").read_text())["identity"]["calibration"]["tokens_shape"] == [8, 32]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    r = _cli("none", 0, src, out, text, "--seed", "1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "other calibration settings or data (differs in: settings.seed, tokens_sha256)" in r.stderr, r.stderr[-3000:]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    r = _cli("none", 0, src, out, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref)
    assert json.loads((out / REPORT_NAME).read_text())["files_skipped_resumed"] > 0


def test_offload_folder_shared_by_two_runs(cli_src, tmp_path):
    """Two killed runs whose output folders have the same name share one --offload-activations DIR: each keeps its
    hidden states in a subfolder of its own, so the first resumes from its own states, byte-identical to the
    uninterrupted run; states left by another run are deleted, never taken for a layer's input."""
    from glmq.calibration.engine import OWNER_NAME, offload_dir

    src, text, ref = cli_src
    acts = tmp_path / "acts"
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    per_layer = 2 * math.ceil(8 / GPTQ_BATCH["cpu"])
    for out, seed in ((a, "0"), (b, "1")):  # b: other calibration samples
        r = _cli("gptq", per_layer + per_layer // 2, src, out, text, "--offload-activations", str(acts), "--seed", seed)
        assert r.returncode == 137, r.stderr[-3000:]
    da, db = offload_dir(acts, a / CACHE_DIR), offload_dir(acts, b / CACHE_DIR)
    assert da != db and da.name.startswith("glmq-out-")
    assert (da / "hidden-00001.bin").exists() and (db / "hidden-00001.bin").exists()
    # a run with other calibration samples for `a`'s folder is refused before it touches a's states
    r = _cli("none", 0, src, a, text, "--offload-activations", str(acts), "--seed", "1")
    assert r.returncode != 0 and "other calibration settings or data" in r.stderr, r.stderr[-3000:]
    assert (da / "hidden-00001.bin").exists()
    # b's states moved into a's folder under a's name, as if another run had left them there: deleted, not used
    b_states = (db / "hidden-00001.bin").read_bytes()
    (da / "hidden-00001.bin").write_bytes(b_states)
    (da / OWNER_NAME).write_text((db / OWNER_NAME).read_text())
    r = _cli("none", 0, src, a, text, "--offload-activations", str(acts))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hidden states of another run" in r.stderr
    assert _files(a) == _files(ref)
    assert json.loads((a / REPORT_NAME).read_text())["gptq"]["resumed_from_layer"] == 2
    assert not da.exists() and (db / "hidden-00001.bin").read_bytes() == b_states  # a's folder gone, b's untouched


@pytest.mark.parametrize("then", ["none", "elsewhere"])
def test_a_resume_that_keeps_its_states_elsewhere_deletes_the_earlier_offloaded_ones(cli_src, tmp_path, then):
    """Killed with --offload-activations A, resumed without it (or with B): the resumed run never reads A's states, and
    the end of the run used to remove only its own folder's, so A's stayed for good (GLM-5: ~0.8 GB a layer input).
    Now they are deleted at the resume, with a warning; the output is byte-identical to the uninterrupted run."""
    from glmq.calibration.engine import OFFLOAD_RECORD, offload_dir

    src, text, ref = cli_src
    acts, other, out = tmp_path / "acts", tmp_path / "other", tmp_path / "out"
    per_layer = 2 * math.ceil(8 / GPTQ_BATCH["cpu"])
    r = _cli("gptq", per_layer + per_layer // 2, src, out, text, "--offload-activations", str(acts))
    assert r.returncode == 137, r.stderr[-3000:]
    old = offload_dir(acts, out / CACHE_DIR)
    assert (old / "hidden-00001.bin").exists() and (out / CACHE_DIR / OFFLOAD_RECORD).exists()
    (acts / "mine.txt").write_text("not glmq's")  # the base folder's own files stay
    extra = ("--offload-activations", str(other)) if then == "elsewhere" else ()
    r = _cli("none", 0, src, out, text, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hidden states of this output's earlier run" in r.stderr, r.stderr[-3000:]
    assert not old.exists() and sorted(p.name for p in acts.iterdir()) == ["mine.txt"]
    assert not list(other.rglob("*.bin")) and not (out / CACHE_DIR / OFFLOAD_RECORD).exists()
    assert _files(out) == _files(ref)


def test_rerun_of_a_finished_job_and_foreign_folders(glm4, tmp_path, monkeypatch):
    from glmq.calibration import layer_gptq
    from glmq.quantize.output import OutputDirError

    src, gptq, rtn, report = glm4
    out = tmp_path / "out"
    shutil.copytree(gptq, out)

    def no_gptq(*a, **k):
        raise AssertionError("a finished job must not calibrate again")

    monkeypatch.setattr(layer_gptq, "quantize_gptq_batch", no_gptq)
    again = run_gptq(gptq_plan(src), out, calib_ids(), settings(), progress=False)
    assert again["files_skipped_resumed"] == again["files"] and "calibration not re-run" in again["gptq"]["note"]
    assert _files(out) == _files(gptq)
    # the same tokens from a calibration spec spelled otherwise (`./c.txt` after `c.txt`) are the same run
    again = run_gptq(gptq_plan(src), out, calib_ids(), settings(calibration="./elsewhere/calib.txt"), progress=False)
    assert "calibration not re-run" in again["gptq"]["note"] and _files(out) == _files(gptq)
    # refused by the manifest, which records the calibration too (the cache may be gone)
    with pytest.raises(OutputDirError, match=r"other calibration settings or data \(differs in: settings\.seed\)"):
        run_gptq(gptq_plan(src), out, calib_ids(), settings(seed=1), progress=False)
    with pytest.raises(OutputDirError, match=r"\(differs in: tokens_sha256\)"):
        run_gptq(gptq_plan(src), out, calib_ids(seed=1), settings(), progress=False)
    with pytest.raises(OutputDirError, match="differs in: calibration; recipe.method: 'rtn' then, 'gptq' now"):  # RTN's
        run_gptq(gptq_plan(src), rtn, calib_ids(), settings(), progress=False)


def test_eval_command(cli_src, tmp_path):
    """`glmq eval`: a table, JSON with perplexity / KL / per-layer error, and the plot or a note why not."""
    import importlib.util

    from click.testing import CliRunner

    from glmq.scripts.cli import main

    src, text, ref = cli_src
    js, png = tmp_path / "eval.json", tmp_path / "layers.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []  # else refused (test_eval)
    r = CliRunner().invoke(main, ["eval", str(src), str(ref), "--text", str(text), "--seq-len", "32",
                                  "--windows", "6", "--json", str(js), *plot])
    assert r.exit_code == 0, r.output
    res = json.loads(js.read_text())
    src_row, q = res["models"]
    assert res["windows"] == 6 and src_row["kl_to_source"] == 0.0 and src_row["layer_rel_error"] is None
    assert q["kl_to_source"] > 0 and q["perplexity"] > 1
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert len(q["layer_rel_error"]) == n_layers and q["layer_rel_error"][0] == 0.0  # layer 0 has no target
    assert all(e > 0 for e in q["layer_rel_error"][1:])
    assert f"{q['kl_to_source']:.5f}" in r.output
    if plot:
        assert png.stat().st_size > 0


def test_gptq_needs_calibration_text(make_ckpt):
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    r = CliRunner().invoke(main, ["quantize", "--model", str(make_ckpt("glm4_moe", "fp8-block")), "--scheme", "gptq"])
    assert r.exit_code == 2 and "--calibration" in r.output


def test_settings_are_validated():
    with pytest.raises(ValueError, match="under_covered"):
        CalibrationSettings(under_covered="skip")
    with pytest.raises(ValueError, match="dtype"):
        CalibrationSettings(dtype="int8")
    with pytest.raises(ValueError, match="activations"):
        CalibrationSettings(activations="swap")
    with pytest.raises(ValueError, match="offload_activations"):
        CalibrationSettings(activations="memory", offload_activations="/x")
    # where the activations live does not change a single bit, so it is not part of the run identity
    assert CalibrationSettings().activations == "disk"
    assert CalibrationSettings(offload_activations="/x").identity() == CalibrationSettings().identity() \
        == CalibrationSettings(activations="memory").identity()


@pytest.mark.parametrize("fail", [False, True])
def test_disk_activations_write_one_file_per_layer_and_remove_them(glm4, tmp_path, monkeypatch, fail):
    """The default keeps the hidden states in files of the output's cache folder (the layer's input is read
    from one batch at a time: no store holds them in memory); a finished run leaves none of them, a failed
    one only the newest complete layer's (its resume point), no partial file; the bytes are those of a run
    with the states in memory."""
    from glmq.calibration import cache as cc
    from glmq.calibration import layer_gptq

    src, ref, _, _ = glm4
    made, in_memory = [], []
    monkeypatch.setattr(cc.Activations, "new_file", classmethod(
        lambda cls, path, shape, dtype, f=cc.Activations.new_file.__func__: made.append(path) or f(cls, path, shape, dtype)))
    monkeypatch.setattr(cc.Activations, "in_memory", classmethod(
        lambda cls, data, f=cc.Activations.in_memory.__func__: in_memory.append(data.shape) or f(cls, data)))
    if fail:  # the second MoE layer's first solve raises
        calls, orig = [0], layer_gptq.quantize_gptq_batch

        def dying(*a, **k):
            calls[0] += 1
            if calls[0] > 2 * math.ceil(8 / GPTQ_BATCH["cpu"]):
                raise RuntimeError("solver died")
            return orig(*a, **k)
        monkeypatch.setattr(layer_gptq, "quantize_gptq_batch", dying)
    out = tmp_path / "out"
    cache = out / CACHE_DIR
    if fail:
        with pytest.raises(RuntimeError, match="solver died"):
            run_gptq(gptq_plan(src), out, calib_ids(), settings(), progress=False)
        left = sorted(p.name for p in cache.iterdir() if not p.name.startswith(("layer-", "calibration")))
        assert left == ["hidden-00001.bin", "hidden-00001.bin.xxh3"], left  # and its checksum
        return
    run_gptq(gptq_plan(src), out, calib_ids(), settings(), progress=False)
    assert made and all(p.parent == cache for p in made) and not in_memory
    assert not list(cache.glob("hidden-*")) and not list(cache.glob("*.tmp")) and not list(cache.glob("embeddings*"))
    assert _files(out) == _files(ref)
    run_gptq(gptq_plan(src), tmp_path / "memory", calib_ids(), settings(activations="memory"), progress=False)
    assert in_memory and _files(tmp_path / "memory") == _files(out)


def test_foreign_calibration_cache_is_refused(tmp_path):
    from glmq.calibration.cache import check_identity

    check_identity(tmp_path, {"settings": {"seed": 0}})
    check_identity(tmp_path, {"settings": {"seed": 0}})
    with pytest.raises(CalibrationCacheError, match="settings"):
        check_identity(tmp_path, {"settings": {"seed": 1}})


def test_a_resume_on_another_device_warns(tmp_path, caplog):
    """The device is no part of the identity (a resume on the GPU keeps the layers the CPU finished), but the
    output is then not bit-identical to one run on either device: said once, and recorded in calibration.json."""
    from glmq.calibration.cache import IDENTITY_NAME, check_identity

    ident = {"settings": {"seed": 0}}
    check_identity(tmp_path, ident, "cpu")
    with caplog.at_level("WARNING", logger="glmq"):
        check_identity(tmp_path, ident, "cpu")
        assert not caplog.records
        check_identity(tmp_path, ident, "cuda")
        assert any("calibrated on cpu so far and resumes on cuda" in r.getMessage() and "not be bit-identical"
                   in r.getMessage() for r in caplog.records)
        caplog.clear()
        check_identity(tmp_path, ident, "cuda")
        check_identity(tmp_path, ident)  # a finished run's rerun calibrates nothing
        assert not caplog.records
    assert json.loads((tmp_path / IDENTITY_NAME).read_text())["devices"] == ["cpu", "cuda"]
    with pytest.raises(CalibrationCacheError, match="settings"):
        check_identity(tmp_path, {"settings": {"seed": 1}}, "cpu")


# ----------------------------------------------------------------------------------------- quality

RTN_KL, RTN_PPL = 0.01345, 3.9317  # BENCHMARKS.md: glmq int4-w4a16 RTN on the same protocol
PEER_GPTQ_KL, AUTOROUND_KL = 0.01246, 0.01072  # the peer figures


@pytest.mark.slow
def test_shared_model_gptq_beats_rtn(shared_model, tmp_path):
    """The shipped recipe with --scheme gptq (damp 0.1, propagated clip search, 2 coordinate-descent
    sweeps: the QuantSpec defaults), and the same recipe with damp 0.3, on the README's protocol."""
    import time

    from glmq.calibration.compare import compare
    from glmq.calibration.data import calibration_tokens

    s = CalibrationSettings(calibration=str(shared_model.parent / "prose-calib.txt"))
    tokens = calibration_tokens(shared_model, s.calibration, s.samples, s.seq_len, s.seed)
    damp03 = tmp_path / "int4-w4a16-damp03.yaml"
    damp03.write_text("name: int4-w4a16-damp03\ntargets: [routed_expert]\nmethod: gptq\ndamp: 0.3\n")
    runs = {}
    for name, recipe in (("int4-w4a16", "int4-w4a16"), ("int4-w4a16 damp 0.3", str(damp03))):
        t0 = time.perf_counter()
        rep = run_gptq(gptq_plan(shared_model, recipe, 5 * 10**9), tmp_path / name.replace(" ", "-"), tokens, s,
                       progress=False)
        runs[name] = (tmp_path / name.replace(" ", "-"), time.perf_counter() - t0, rep)
    res = compare(shared_model, [out for out, _, _ in runs.values()], shared_model.parent / "prose-eval.txt", 256, 96)
    src_row, *rows = res["models"]
    print(f"\nsource perplexity {src_row['perplexity']:.4f}; RTN: KL {RTN_KL}, perplexity {RTN_PPL}; peer GPTQ KL "
          f"{PEER_GPTQ_KL}, AutoRound KL {AUTOROUND_KL}; target KL <= {min(0.9 * PEER_GPTQ_KL, AUTOROUND_KL):.5f}")
    for (name, (_, seconds, rep)), q in zip(runs.items(), rows):
        g = rep["gptq"]["by_class"]["routed_expert"]
        print(f"GPTQ {name} ({s.samples}x{s.seq_len} tokens, clip_search={s.clip_search}, expert_prior="
              f"{s.expert_prior}): KL {q['kl_to_source']:.5f}, perplexity {q['perplexity']:.4f}, layer errors "
              f"{[round(e, 4) for e in q['layer_rel_error']]}, expert output error {g['rel_err_gptq']:.4f} "
              f"(RTN {g['rel_err_rtn']:.4f}), {seconds:.0f} s, peak RSS {rep['peak_rss_bytes'] / 1e9:.2f} GB")
    assert abs(src_row["perplexity"] - 3.9115) < 0.001, "evaluation protocol differs from the README's"
    for q in rows:
        assert q["kl_to_source"] < RTN_KL
        assert q["perplexity"] <= RTN_PPL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gptq_on_cuda_is_deterministic_and_close_to_cpu(make_ckpt, tmp_path):
    """GPTQ on a GPU: two runs write the same bytes (what makes 1- and N-GPU runs comparable), the
    report has the GPU's peak, and the integers agree with the CPU run's but for float-order ties."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    runs = {}
    for name, dev in (("cuda-a", "cuda"), ("cuda-b", "cuda"), ("cpu", "cpu")):
        rep = run_gptq(gptq_plan(src), tmp_path / name, calib_ids(), settings(), device=dev, progress=False)
        runs[name] = rep
    assert _files(tmp_path / "cuda-a") == _files(tmp_path / "cuda-b")
    assert runs["cuda-a"]["gptq"]["ranks"][0]["peak_gpu_bytes"] > 0
    a, c = tensors(tmp_path / "cuda-a"), tensors(tmp_path / "cpu")
    packed = [k for k in a if k.endswith("weight_packed")]
    assert packed
    words = sum(a[k].numel() for k in packed)
    same = sum(int((a[k] == c[k]).sum()) for k in packed)  # int32 words of 8 nibbles (random: ~0)
    assert same >= 0.25 * words, f"only {same}/{words} packed words agree with the CPU run"
    g, r = runs["cuda-a"]["gptq"]["by_class"], runs["cpu"]["gptq"]["by_class"]
    for cls in g:
        assert g[cls]["rel_err_gptq"] == pytest.approx(r[cls]["rel_err_gptq"], rel=0.05), cls


def test_f32_source_gives_the_bf16_sources_integers_and_a_nan_weight_names_its_tensor(make_ckpt, tmp_path):
    """A dense F32 source (the bf16 one's values, upcast) is calibrated and quantized as its bf16 values, as RTN
    rounds F16/F32 targets (the scales were F32 and the write failed: "planned as BF16"). An FP8 weight that
    decodes to NaN stops the run with an error naming the shard and the tensor, as on the RTN path."""
    from safetensors import safe_open

    from glmq.calibration.layers import SourceTensors
    from glmq.formats.safetensors_io import CheckpointError

    bf16 = make_ckpt("glm4_moe", "bf16")
    f32 = Path(shutil.copytree(bf16, tmp_path / "f32"))
    for shard in f32.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        save_file({k: v.float() if v.is_floating_point() else v for k, v in t.items()}, str(shard),
                  metadata={"format": "pt"})
    ids, s = calib_ids(samples=4, seq=32), settings(samples=4, seq_len=32)
    for src, out in ((bf16, tmp_path / "a"), (f32, tmp_path / "b")):
        run_gptq(gptq_plan(src), out, ids, s, progress=False)
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    quantized = [k for k in a if k.endswith(("weight_packed", "weight_scale"))]
    assert quantized and all(torch.equal(a[k], b[k]) for k in quantized)

    fp8 = Path(shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), tmp_path / "fp8"))
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    src = open_source(fp8)
    shard = fp8 / src.entries[name].shard
    with safe_open(str(shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t[name].view(torch.uint8)[3, 5] = 0x7F  # an FP8 NaN code
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor {name}: NaN or Inf in rows \\[3\\]"):
        SourceTensors(open_source(fp8)).weight(name)


def test_a_cpu_resume_with_another_thread_count_is_warned(tmp_path, caplog, monkeypatch):
    """CPU sums depend on the thread count: a resume with another count than the finished layers' gives an output
    byte-identical to neither uninterrupted run, which a user comparing checksums should be told."""
    import logging

    from glmq.calibration.engine import _warn_thread_change

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with caplog.at_level(logging.WARNING):
        _warn_thread_change([{"threads": 1}, {"threads": 1}], tmp_path)
        _warn_thread_change([{"seconds": 1.0}, None], tmp_path)  # layers of an older glmq record none: no claim
        assert not caplog.records
        _warn_thread_change([{"threads": 2}, {"threads": 2}], tmp_path)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "calibrated with 2 thread(s), this run uses 1" in msg and "OMP_NUM_THREADS=2" in msg


def test_states_of_another_number_of_processes_are_deleted(tmp_path, caplog):
    """A GPTQ run resumed with another number of processes: a single process keeps its hidden states in the cache
    (or offload) folder, rank R of a distributed run in `rank-R` under it; the other layout's states were never read
    again nor removed (GLM-5: ~0.8 GB a rank). Rank 0 (or the single process) deletes them, and nothing a rank of
    this run uses, nor another output's offloaded states."""
    import json as _json
    import logging
    from types import SimpleNamespace

    from glmq.calibration.engine import OWNER_NAME, _Run

    def states(d):
        d.mkdir(parents=True, exist_ok=True)
        for name in ("hidden-00001.bin", "hidden-00001.bin.xxh3"):
            (d / name).write_bytes(b"x")

    out = tmp_path / "out"
    cache = out / ".glmq-gptq"
    (cache / "layer-00000.safetensors").parent.mkdir(parents=True)
    (cache / "layer-00000.safetensors").write_bytes(b"keep")
    states(cache / "rank-00000")
    states(cache / "rank-00001")
    single = SimpleNamespace(cache=cache, offload=None, world=None, act_dir=cache)
    with caplog.at_level(logging.WARNING):
        _Run._drop_stale_states(single, cache, own=True)  # a single process after a 2-rank run
    assert sorted(p.name for p in cache.iterdir()) == ["layer-00000.safetensors"]
    assert "another number of processes" in caplog.text

    states(cache)  # now the single process's, then 2 ranks resume (rank-00002: a 3-rank run's)
    states(cache / "rank-00000")
    states(cache / "rank-00002")
    dist = SimpleNamespace(cache=cache, offload=None, world=SimpleNamespace(rank=0, size=2), act_dir=cache / "rank-00000")
    _Run._drop_stale_states(dist, cache, own=True)
    assert sorted(p.name for p in cache.iterdir()) == ["layer-00000.safetensors", "rank-00000"]
    assert len(list((cache / "rank-00000").iterdir())) == 2  # in use by this run: untouched

    off = tmp_path / "acts" / "glmq-out-0123"
    states(off / "rank-00001")
    (off / "rank-00001" / OWNER_NAME).write_text(_json.dumps({"output": str(out.resolve())}))
    states(off / "rank-00003")
    (off / "rank-00003" / OWNER_NAME).write_text(_json.dumps({"output": "/elsewhere/out"}))  # another output's
    _Run._drop_stale_states(single, off, own=False)  # this run offloads nowhere: the old folder is stale
    assert not (off / "rank-00001").exists() and len(list((off / "rank-00003").iterdir())) == 3


def test_the_terminal_report_says_where_it_cut_a_list():
    """More than 20 under-covered experts: the terminal showed 20 and dropped the rest unsaid, and the unreached
    list left out those already shown without a count (a probe: 31 under-covered, 4 of them nowhere on screen)."""
    from glmq.calibration.report import format_report

    under = [{"layer": 1 + i // 16, "expert": i % 16, "tokens": i % 2, "hessian": "all_tokens"} for i in range(31)]
    unreached = [{"layer": u["layer"], "expert": u["expert"]} for u in under if not u["tokens"]]  # 16, 11 shown
    rep = {"calibration_tokens": 8, "seconds": 1.0, "peak_rss_bytes": 1e9, "resumed_from_layer": None, "layers": [],
           "by_class": {}, "fallbacks": [{"module": f"m{i}", "reason": "empty_hessian"} for i in range(21)],
           "expert_coverage": {"min_expert_tokens": 3, "under_covered": under, "unreached": unreached},
           "mtp": {"tensors": 0}}
    text = format_report(rep)
    assert "experts under 3 tokens: 31" in text and "\n  ... and 11 more (glmq_report.json lists them all)" in text
    assert "experts no calibration token reached: 16 (10 listed above)" in text
    assert "\n  ... and 1 more (glmq_report.json lists them all)" in text  # the 21st fallback
    shown = [ln for ln in text.splitlines() if ln.startswith("  layer ")]
    assert len(shown) == 20 + 6  # 20 under-covered, then the 6 unreached not among them
