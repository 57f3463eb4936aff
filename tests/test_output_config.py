"""The output's quantization_config at its edges: long keep_fp8 target lists, the group transformers reads the experts'
scheme from, invalid `re:` patterns in validate, and the config child that cannot start.

(Its name sorts after the Triton test modules on purpose: it imports compressed-tensors at collection, which imports
triton; collected before them, they could not set TRITON_INTERPRET=1 in this process and reran in a subprocess,
conftest.triton_interpreter_guard.)"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest

from glmq.formats import compressed_tensors as ct
from glmq.quantize import config_child
from glmq.quantize.validate.config import group_for, read_quant_config
from glmq.quantize.validate.structure import check_structure

SPEC = {"num_bits": 4, "group_size": 128, "symmetric": True}


def _request(layers: int, experts: int, keep_experts: bool = False) -> dict:
    """A GLM-5-style keep_fp8 request: per layer q_b/kv_b/o_proj, indexer.wq_b and the shared experts kept FP8 (exact
    targets, one each, as output.config_request writes them), q_a/kv_a/wk/weights_proj BF16, routed experts INT4."""
    modules, keep = {}, []
    for i in range(layers):
        p = f"model.layers.{i}"
        for m in ("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj", "self_attn.indexer.wq_b",
                  "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"):
            modules[f"{p}.{m}"] = "keep_fp8"
        for m in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.indexer.wk",
                  "self_attn.indexer.weights_proj"):
            modules[f"{p}.{m}"] = "dequantize"
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                modules[f"{p}.mlp.experts.{e}.{proj}"] = "keep_fp8" if keep_experts else "quantize"
    for m, a in modules.items():
        if a == "keep_fp8":
            keep.append("re:^" + m.replace(".", "\\.") + "$")
    ignore = ["lm_head", "re:^model\\.layers\\.\\d+\\.self_attn\\.(q_a_proj|kv_a_proj_with_mqa)$",
              "re:^model\\.layers\\.\\d+\\.self_attn\\.indexer\\.(wk|weights_proj)$"]
    return {"spec": SPEC, "ignore": ignore, "keep": sorted(keep), "modules": modules}


def test_is_ignored_is_compressed_tensors_match_name():
    """is_ignored compiles the patterns once, but matches as compressed-tensors' `match_name` does (exact name, or
    `re:` + re.match, anchored at the start only)."""
    from compressed_tensors.utils.match import match_name

    names = ["lm_head", "model.lm_head", "model.layers.3.mlp.experts.7.up_proj", "model.layers.3.mlp.gate",
             "model.layers.3.mlp.gate_proj", "model.layers.12.self_attn.q_a_proj", "xmodel.layers.1.mlp.gate"]
    patterns = ["lm_head", "mlp.gate", "re:.*mlp\\.gate$", "re:model\\.layers\\.1", "re:^model\\.layers\\.3\\.",
                "re:.*experts\\.7", "re:self_attn"]
    for name in names:
        for pat in patterns:
            assert ct.is_ignored(name, [pat]) == match_name(name, pat), (name, pat)
        assert ct.is_ignored(name, patterns) == any(match_name(name, p) for p in patterns), name


def test_config_child_with_more_targets_than_re_cache_is_quick():
    """A GLM-5 keep_fp8 config lists ~550 exact FP8 targets. Matched through `re.match` (compressed-tensors'
    match_name), more patterns than re's 512-entry cache recompiled every one for every module: 2,770 modules took
    40 s and GLM-5's 59,000 over 15 minutes, past the 10 minutes ConfigJob waits for the child, after the whole
    conversion. Here 80 layers x 560 targets, 4,160 modules: old code ~45 s."""
    req = _request(80, 4)
    assert len(req["keep"]) == 560 and len(req["modules"]) == 80 * (11 + 12)
    t = time.perf_counter()
    qc = ct.config_from_request(req)
    assert time.perf_counter() - t < 8
    assert len(qc["config_groups"]["group_1"]["targets"]) == 560


def test_mixed_precision_group_0_names_the_int_experts_for_transformers():
    """transformers reads the fused experts' scheme from the first group with a `re:` target containing "experts"
    (get_experts_scheme); group_1's FP8 shared-expert targets match that. group_0 names the routed experts when
    they are INT4 beside an FP8 group, and only then (not when the experts themselves are kept FP8, nor without
    an FP8 group), and compressed-tensors still gives every module its stored scheme."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers.integrations.compressed_tensors import get_experts_scheme

    req = _request(2, 2)
    qc = ct.config_from_request(req)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear", "re:.*mlp\\.experts\\..*"]
    parsed = QuantizationConfig.model_validate(qc)
    assert get_experts_scheme(parsed).weights.type == "int"

    root = torch.nn.Module()  # the checkpoint's modules as Linears: each gets the scheme of its stored form
    for m in req["modules"]:
        parent = root
        for part in m.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(m.rpartition(".")[2], torch.nn.Linear(256, 256, bias=False, device="meta"))
    apply_quantization_config(root, parsed)
    want = {"quantize": "int", "keep_fp8": "float", "dequantize": None}
    for m, action in req["modules"].items():
        scheme = getattr(root.get_submodule(m), "quantization_scheme", None)
        assert (scheme.weights.type if scheme else None) == want[action], m

    kept = ct.config_from_request(_request(2, 2, keep_experts=True))  # experts FP8: group_1 is theirs
    assert kept["config_groups"]["group_0"]["targets"] == ["Linear"]
    plain = copy.deepcopy(req)
    plain["keep"] = []
    plain["modules"] = {m: ("dequantize" if a == "keep_fp8" else a) for m, a in req["modules"].items()}
    plain["ignore"] = plain["ignore"] + [r"re:.*self_attn\.[a-z_]*proj[a-z_]*$", r"re:.*self_attn\.indexer\..*",
                                         r"re:.*mlp\.shared_experts\..*"]
    single = ct.config_from_request(plain)  # pack-quantized: one group, "Linear" only, as before
    assert single["format"] == "pack-quantized" and single["config_groups"]["group_0"]["targets"] == ["Linear"]


def _config(ignore: list[str], targets: list[str]) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ignore, "config_groups": {"group_0": {"targets": targets, "weights": weights,
                                                        "input_activations": None, "output_activations": None,
                                                        "format": "pack-quantized"}}}}


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_validate_reports_an_invalid_regex_instead_of_raising(where):
    """A `re:` entry that does not compile stops vLLM and compressed-tensors at load (re.error). validate raised it
    as a traceback (from structure's ignore matching or group_for); it is a config failure naming the entry."""
    bad = "re:.*mlp\\.(gate"
    ignore, targets = (["lm_head", bad], ["Linear"]) if where == "ignore" else (["lm_head"], ["Linear", bad])
    q = read_quant_config(_config(ignore, targets), None)
    (msg,) = q.problems
    assert repr(bad) in msg and "not a valid regex" in msg and where in msg
    assert bad not in q.ignore and all(bad not in g.targets for g in q.groups)
    assert group_for("model.layers.1.mlp.experts.0.up_proj", q.groups).name == "group_0"
    check_structure({}, q.groups, {}, q.ignore, {"n_routed_experts": 0})  # no re.error


def test_take_refuses_a_prestarted_child_that_failed(monkeypatch):
    """The child reads its request only after the conversion: a child that failed at start-up (compressed-tensors
    broken) used to be replaced by a fresh one that failed the same way hours later, after every shard was
    written. take() now raises at the start of the run with the child's error, a ValueError the CLI prints."""
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('ImportError: no ct here'); "
                             "sys.exit(1)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    dead.wait()
    monkeypatch.setattr(config_child, "_STARTED", [(dead, False)])
    with pytest.raises(config_child.ConfigChildError, match="exit code 1.*\n.*no ct here") as e:
        config_child.take(False)
    assert isinstance(e.value, ValueError) and config_child._STARTED == []


def test_take_refuses_when_compressed_tensors_is_not_installed(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(config_child, "_STARTED", [])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "compressed_tensors" else find_spec(name, *a))
    with pytest.raises(config_child.ConfigChildError, match="compressed-tensors is not installed.*pip install"):
        config_child.take(False)


@pytest.mark.parametrize("code, message", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "was killed by signal 9"),
    ("import sys; sys.stderr.write('boom'); sys.exit(3)", "failed (exit code 3)"),
    ("import time; time.sleep(60)", "did not answer in 1 s"),
])
def test_a_config_child_that_dies_or_hangs_is_one_clear_error(monkeypatch, code, message):
    """After the whole conversion, a child killed by a signal gave an empty RuntimeError message, a hung one a bare
    TimeoutExpired traceback: both are now a ConfigChildError (a ValueError: one `error:` line in the CLI) saying
    that the converted files are kept and the same command resumes."""
    from glmq.quantize import output

    job = object.__new__(output.ConfigJob)
    job.request = "{}"
    job.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    monkeypatch.setattr(output, "CONFIG_TIMEOUT_S", 1)
    with pytest.raises(config_child.ConfigChildError) as e:
        job.result()
    assert isinstance(e.value, ValueError) and message in str(e.value)
    assert "run the same command again" in str(e.value)
    assert job.proc.poll() is not None  # the hung one was killed, not left behind
