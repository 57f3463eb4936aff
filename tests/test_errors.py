"""Bad input: a clear error naming file and tensor, a non-zero exit, and nothing that looks complete."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file


def glmq(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmq", *args], capture_output=True, text=True)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def rewrite_shard(root: Path, shard: str, edit) -> None:
    """Load a shard, let `edit(dict)` change it, save it back (and fix the index)."""
    with safe_open(str(root / shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(root / shard), metadata={"format": "pt"})
    idx = index(root)
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != shard or k in t}
    idx["weight_map"].update({k: shard for k in t})
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))


def shard_of(root: Path, name: str) -> str:
    return index(root)["weight_map"][name]


def assert_fails(r: subprocess.CompletedProcess, out: Path, *needles: str, fresh: bool = True) -> None:
    assert r.returncode != 0, r.stdout
    for n in needles:
        assert n in r.stderr, f"{n!r} not in: {r.stderr[-1500:]}"
    assert not (out / "config.json").exists()
    if fresh:
        assert not (out / "model.safetensors.index.json").exists()
    assert "Traceback" not in r.stderr, r.stderr[-1500:]


EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture
def ckpt(make_ckpt, tmp_path):
    return copy_ckpt(make_ckpt("glm_moe_dsa", "fp8-block"), tmp_path / "src")


def test_truncated_shard(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    p = ckpt / shard
    p.write_bytes(p.read_bytes()[:-1000])
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, shard, "truncated")


def test_shard_with_bytes_after_its_tensors(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    with open(ckpt / shard, "ab") as f:  # safetensors refuses it: "file not fully covered"
        f.write(b"\0" * 4096)
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, shard,
                 "4096 bytes after the last tensor")


def test_missing_weight_scale_inv(ckpt, tmp_path):
    name = EXPERT + "_scale_inv"
    rewrite_shard(ckpt, shard_of(ckpt, name), lambda t: t.pop(name))
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, EXPERT, "_scale_inv", "re-download")


def test_wrong_dtype(ckpt, tmp_path):
    rewrite_shard(ckpt, shard_of(ckpt, EXPERT), lambda t: t.__setitem__(EXPERT, t[EXPERT].view(torch.int8)))
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, EXPERT, "I8", shard_of(ckpt, EXPERT))


def test_an_e5m2_weight_says_which_fp8_glmq_reads(ckpt, tmp_path):
    """An F8_E5M2 weight was refused naming the file and tensor only: the message now says what to do."""
    rewrite_shard(ckpt, shard_of(ckpt, EXPERT),
                  lambda t: t.__setitem__(EXPERT, t[EXPERT].float().to(torch.float8_e5m2)))
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, shard_of(ckpt, EXPERT),
                 f"tensor {EXPERT} has dtype F8_E5M2, which glmq does not read", "float8_e4m3fn",
                 "use the released FP8 checkpoint")


def test_shape_the_group_size_does_not_divide(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "bf16", config_overrides={"moe_intermediate_size": 200})  # down_proj K: agreed
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(src), "-o", str(out), "--no-progress"), out, name, "group_size 128")


def test_unknown_architecture(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, "config.json", "llama", "families.py")


def test_output_dir_with_other_content(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, str(out), "not empty")
    assert (out / "notes.txt").read_text() == "mine"


def test_output_dir_of_another_recipe(ckpt, tmp_path):
    out = tmp_path / "out"
    assert glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "config.json").unlink()
    r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "-r", "int4-w4a16-g32", "--no-progress")
    assert_fails(r, out, "glmq_manifest.json", "different source/recipe", fresh=False)
    assert all((out / n).read_bytes() == b for n, b in before.items() if n != "config.json")


def test_nan_weight_names_the_tensor(ckpt, tmp_path):
    def poison(t):
        t[EXPERT].view(torch.uint8)[0, 0] = 0x7F

    rewrite_shard(ckpt, shard_of(ckpt, EXPERT), poison)
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, EXPERT, "NaN")


def test_nan_weight_names_the_tensor_on_the_pytorch_path(make_ckpt, tmp_path):
    """A compressed-tensors FP8 source takes the PyTorch path (as every --device cuda run does): the same
    error, not NaN scales written and a run that reports success."""
    src = copy_ckpt(make_ckpt("glm_moe_dsa", "fp8-ct"), tmp_path / "src")

    def poison(t):
        t[EXPERT].view(torch.uint8)[0, 0] = 0x7F

    rewrite_shard(src, shard_of(src, EXPERT), poison)
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(src), "-o", str(out), "--no-progress"), out, EXPERT, shard_of(src, EXPERT),
                 "NaN or Inf in rows [0]", "re-download")


@pytest.mark.parametrize("name, value", [("model.layers.1.input_layernorm.weight", float("nan")),  # copied as it is
                                         ("model.embed_tokens.weight", float("inf")),
                                         ("model.layers.1.mlp.gate.weight", float("-inf"))])
def test_nan_in_a_copied_tensor_names_it(ckpt, tmp_path, name, value):
    """A tensor written as it is read must hold numbers too: a corrupt norm or embedding used to pass into the output
    (and `glmq validate --source` passed it: the output equals the source) while the same damage in a converted
    weight was refused."""
    def poison(t):
        t[name].view(-1)[5] = value

    rewrite_shard(ckpt, shard_of(ckpt, name), poison)
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, shard_of(ckpt, name),
                 f"tensor {name}", "NaN or Inf in rows", "re-download")


def test_inf_in_a_dense_sources_unquantized_weight_names_it(make_ckpt, tmp_path):
    # a BF16 source's attention (not a target of the default recipe) is written as BF16 without a scale to decode
    src = copy_ckpt(make_ckpt("glm_moe_dsa", "bf16"), tmp_path / "src")
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(t):
        t[name][3, 7] = float("inf")

    rewrite_shard(src, shard_of(src, name), poison)
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(src), "-o", str(out), "--no-progress"), out, shard_of(src, name),
                 f"tensor {name}", "NaN or Inf in rows [3]")


def test_nan_code_in_a_kept_fp8_weight_names_it(ckpt, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(t):
        t[name].view(torch.uint8)[2, 9] = 0xFF  # e4m3fn's -NaN

    rewrite_shard(ckpt, shard_of(ckpt, name), poison)
    recipe = tmp_path / "keep.yaml"
    recipe.write_text("name: keep\ntargets: [routed_expert]\nkeep_fp8: true\n")
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "-r", str(recipe), "--no-progress"), out,
                 f"tensor {name}", "NaN or Inf in rows [2]")


def test_unknown_recipe_key(ckpt, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntargets: [routed_expert]\ngroup_sise: 64\n")
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "-r", str(bad)), out, "group_sise", "unknown key")


def test_header_length_beyond_file(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    p = ckpt / shard
    data = bytearray(p.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    p.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, shard)


def test_output_that_is_the_source_itself(ckpt, tmp_path):
    """--output naming the source (also through a link): refused naming that, nothing touched; before, the generic
    "not empty and holds no interrupted glmq run"."""
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    for out in (ckpt, link):
        r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress")
        assert r.returncode == 1 and f"{out}: is the source checkpoint itself" in r.stderr, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def test_output_whose_parent_is_a_file(ckpt, tmp_path):
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "out"
    assert_fails(glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), out, str(out),
                 f"{tmp_path / 'afile'} is a file, not a directory", "--output")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.fixture
def no_cuda(monkeypatch):
    """A host without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("scheme", ["rtn", "gptq"])
def test_device_cuda_without_cuda_fails_before_creating_anything(scheme, no_cuda, ckpt, tmp_path):
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    (tmp_path / "calib.txt").write_text("some text to calibrate on. " * 50)
    out = tmp_path / "out"
    args = ["quantize", "-m", str(ckpt), "-o", str(out), "--device", "cuda", "--scheme", scheme, "--no-progress"]
    if scheme == "gptq":
        args += ["--calibration", str(tmp_path / "calib.txt"), "--samples", "2", "--seq-len", "8"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert res.output.strip() == "Error: --device cuda: no CUDA device is visible to PyTorch; use --device cpu"
    assert not out.exists()


def test_engines_refuse_cuda_without_cuda_with_a_reported_error_type(no_cuda, ckpt, tmp_path):
    """The second guard, for callers other than the CLI: a ValueError (the CLI reports it as `error: ...`)."""
    from glmq import recipes
    from glmq.calibration.layers import LayerBuilder
    from glmq.formats.source import open_source
    from glmq.quantize import stream
    from glmq.quantize.plan import make_plan

    source = open_source(ckpt)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        stream.run(make_plan(source, recipes.load("int4-w4a16")), tmp_path / "out", device="cuda", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        LayerBuilder(source, torch.device("cuda"), torch.float32)


def test_json_report_under_a_missing_folder_is_refused_before_any_work(ckpt, tmp_path):
    """--json FILE whose folder does not exist: one line naming the folder when the options are parsed, not a
    traceback when the report is written after the whole run."""
    out, report = tmp_path / "out", tmp_path / "no" / "such" / "report.json"
    for args in (("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"), ("plan", "-m", str(ckpt)),
                 ("validate", str(ckpt))):
        r = glmq(*args, "--json", str(report))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert f"folder {report.parent} does not exist" in r.stderr
    assert not out.exists() and not report.parent.exists()


# ----------------------------------------------------------------------------------------- found by probing (session 37)
ATTN = "model.layers.0.self_attn.q_a_proj.weight"


@pytest.mark.parametrize("name", [EXPERT, ATTN], ids=["expert-quantized", "attention-copied"])
def test_a_float_weight_beside_an_fp8_scale_is_refused_before_any_work(ckpt, tmp_path, name):
    """An FP8 weight stored decoded (BF16) but with its weight_scale_inv kept: the CPU kernel read its bytes as FP8
    codes of a wider row, past its buffers ("double free or corruption", SIGABRT); a copied class lost the scale."""
    rewrite_shard(ckpt, shard_of(ckpt, name), lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    out = tmp_path / "out"
    r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress")
    assert_fails(r, out, name, "has dtype BF16 but a weight_scale_inv", shard_of(ckpt, name + "_scale_inv"))
    assert r.returncode == 1 and not out.exists()


def test_an_fp8_weight_that_is_not_2d_is_a_plan_error(ckpt, make_ckpt, tmp_path):
    rewrite_shard(ckpt, shard_of(ckpt, EXPERT), lambda t: t.__setitem__(EXPERT, t[EXPERT].flatten().contiguous()))
    for cmd in ("plan", "quantize"):
        out = tmp_path / f"out-{cmd}"
        r = glmq(cmd, "-m", str(ckpt), *(["-o", str(out), "--no-progress"] if cmd == "quantize" else []))
        assert_fails(r, out, EXPERT, "shape [32768], but config.json's hidden_size x moe_intermediate_size is [256, 128]")
    # where no shape row applies, the weight's own check: a kimi_k2 config (its loader's defaults live in the
    # checkpoint's remote code, which glmq does not read) without the key
    ckpt = copy_ckpt(make_ckpt("deepseek_v3", "fp8-block", config_overrides={"model_type": "kimi_k2"}),
                     tmp_path / "kimi")
    rewrite_shard(ckpt, shard_of(ckpt, EXPERT), lambda t: t.__setitem__(EXPERT, t[EXPERT].flatten().contiguous()))
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    for cmd in ("plan", "quantize"):
        out = tmp_path / f"out2-{cmd}"
        r = glmq(cmd, "-m", str(ckpt), *(["-o", str(out), "--no-progress"] if cmd == "quantize" else []))
        assert_fails(r, out, EXPERT, "an FP8 weight must be 2-D", shard_of(ckpt, EXPERT))


def test_the_fp8_kernels_refuse_what_they_would_index_past(ckpt):
    from glmq.quantize import fused_cpu
    from glmq.quantize.spec import QuantSpec

    if not fused_cpu.available():
        pytest.skip("numba not installed")
    w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    spec = QuantSpec(num_bits=4, group_size=128)
    with pytest.raises(ValueError, match="2-D float8_e4m3fn, got torch.bfloat16"):
        fused_cpu.quantize_fp8_block(w.to(torch.bfloat16), torch.ones(2, 2), (128, 128), spec)
    with pytest.raises(ValueError, match=r"shape \[1, 2\], expected \[2, 2\]"):
        fused_cpu.dequantize_fp8_block(w, torch.ones(1, 2), (128, 128))


def test_a_nan_scale_names_the_scale_and_its_shard(ckpt, tmp_path):
    scale = EXPERT + "_scale_inv"
    rewrite_shard(ckpt, shard_of(ckpt, scale), lambda t: t[scale].__setitem__((0, 0), float("nan")))
    out = tmp_path / "out"
    r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress")
    assert_fails(r, out, f"{shard_of(ckpt, scale)}: tensor {scale} holds NaN or Inf", "re-download its shard",
                 fresh=False)


def test_a_huge_finite_scale_names_the_scale_and_its_shard(ckpt, tmp_path):
    """A finite weight_scale_inv of 1e38: weight x scale overflows, and the error blamed the weight's shard (told to
    re-download it) though the fault is the scale, here moved to a shard of its own."""
    scale = EXPERT + "_scale_inv"
    rewrite_shard(ckpt, shard_of(ckpt, scale), lambda t: t[scale].__setitem__((0, 0), 1e38))
    from safetensors.torch import load_file

    idx = index(ckpt)  # the scale alone in a shard of its own, away from its weight
    tensors = load_file(ckpt / idx["weight_map"][scale])
    save_file({scale: tensors.pop(scale)}, ckpt / "scales-only.safetensors", metadata={"format": "pt"})
    save_file(tensors, ckpt / idx["weight_map"][scale], metadata={"format": "pt"})
    idx["weight_map"][scale] = "scales-only.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert shard_of(ckpt, scale) != shard_of(ckpt, EXPERT)
    out = tmp_path / "out"
    r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress")
    assert_fails(r, out, f"scales-only.safetensors: tensor {scale} holds 1e+38", "overflows",
                 "re-download its shard", fresh=False)
    assert f"{shard_of(ckpt, EXPERT)}: tensor {EXPERT}" not in r.stderr


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_shard_that_is_not_a_regular_file_is_named_not_opened(ckpt, tmp_path, kind):
    """A named pipe blocked the header read forever (quantize and validate alike); a directory gave a bare errno."""
    import os

    shard = ckpt / shard_of(ckpt, EXPERT)
    shard.unlink()
    shard.mkdir() if kind == "directory" else os.mkfifo(shard)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "glmq", "quantize", "-m", str(ckpt), "-o", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert_fails(r, out, f"{shard}: not a regular file")


def test_a_manifest_whose_complete_flag_is_not_a_boolean_is_unreadable(tmp_path):
    """bool("false") is True: a hand-edited manifest read as a finished run, and `glmq validate` passed it."""
    from glmq.formats.manifest import MANIFEST_NAME, Manifest

    Manifest({"a": 1}, complete=True).save(tmp_path)
    assert Manifest.load(tmp_path).complete is True
    p = tmp_path / MANIFEST_NAME
    p.write_text(p.read_text().replace('"complete": true', '"complete": "false"'))
    with pytest.raises(ValueError, match=f"{MANIFEST_NAME}: unreadable glmq manifest .'complete' is 'false'"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("key, value, needle", [
    ("n_routed_experts", 16, "24 of 48 expert projections missing (config n_routed_experts = 16)"),
    ("n_routed_experts", 4, "holds experts numbered up to 7 (4 beyond config n_routed_experts = 4)"),
    ("n_routed_experts", "8", 'n_routed_experts is "8", not a positive integer'),
    ("num_hidden_layers", 0, "num_hidden_layers is 0, not a positive integer"),
    ("num_hidden_layers", 5, "model.layers.4.mlp.experts: 24 of 24 expert projections missing"),
    ("hidden_size", 512, "model.layers.1.mlp.experts.0.down_proj.weight (and 23 more tensors): shape [256, 128], but "
                         "config.json's hidden_size x moe_intermediate_size is [512, 128]"),
    ("intermediate_size", 1024, "model.layers.0.mlp.down_proj.weight: shape [256, 512], but config.json's "
                                "hidden_size x intermediate_size is [256, 1024]"),
    ("kv_lora_rank", 64, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight (and 3 more tensors): shape [160, 256], "
                         "but config.json's kv_lora_rank+qk_rope_head_dim x hidden_size is [96, 256]"),
    ("q_lora_rank", None, "q_lora_rank is null, not a positive integer (the DSA indexer reads the compressed query)"),
])
def test_a_config_that_disagrees_with_the_experts_stored_is_refused_before_any_work(ckpt, tmp_path, key, value, needle):
    """The config was copied through: exit 0 and an output `glmq validate` failed (or, for extra experts and a
    string count, passed)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = glmq("quantize", "-m", str(ckpt), "-o", str(out), "--no-progress")
    header = "values of the wrong kind" if needle.startswith(key) else "disagrees with the tensors stored"
    assert_fails(r, out, f"{ckpt / 'config.json'}: {header}", needle, "fix config.json")
    assert not out.exists()
