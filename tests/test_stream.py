"""End-to-end conversion of generated checkpoints with the real GLM-5 / GLM-4.x / DeepSeek-V3 layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmq import recipes
from glmq.formats.dense import iter_dense
from glmq.formats.fp8 import dequantize_block, dequantize_channel
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan

OLD_CT_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                    "actorder", "observer", "observer_kwargs"}


def convert(src: Path, out: Path, recipe: str = "int4-w4a16", max_shard_bytes: int = 5 * 10**9) -> dict:
    plan = make_plan(open_source(src), recipes.load(recipe), max_shard_bytes)
    return stream.run(plan, out, progress=False)


def assert_within_half_step(w_q: torch.Tensor, w_src: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """|w_q - w_src| <= step/2, up to the bf16 rounding compressed-tensors' own math applies.

    Two bf16 roundings that compressed-tensors' own math has sit on top of the half step:
    w/scale is rounded to bf16 before it is rounded to an integer (7.516 -> 7.5 -> 8 -> clamped to 7:
    up to 1/32 step past the half), and the dequantized q * scale is a bf16 product (|q| <= 8, half an
    ulp is 2^-8 relative: up to 1/32 step). So the bound is step * (1/2 + 1/16), beyond the part of a value's
    distance past [-8, 7] steps that no rounding avoids (`full_range`'s side of fewer levels: up to 1 step;
    the clamp of absmax / 7.5 at 7.5 steps: 1/2; as `glmq validate --source` counts it).
    """
    step = scale.float().repeat_interleave(w_q.shape[1] // scale.shape[1], dim=1)
    x = w_src.float() / step
    ratio = (w_q.float() - w_src.float()).abs() / step.abs() - (x - 7).clamp_min(0) - (-8 - x).clamp_min(0)
    assert ratio.max().item() <= 0.5 + 1 / 16 + 1e-6, f"{name}: error {ratio.max().item():.4f} steps"
    assert ratio.mean().item() < 0.3, f"{name}: mean error {ratio.mean().item():.3f} steps (uniform rounding gives 0.25)"


def tensors(root: Path) -> dict[str, torch.Tensor]:
    wm = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(str(root / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(wm), "index and shards disagree"
    return out


@pytest.fixture(scope="module")
def glm5(make_ckpt, tmp_path_factory):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    out = tmp_path_factory.mktemp("glm5-out") / "int4"
    report = convert(src, out, max_shard_bytes=400_000)
    return src, out, report


def test_glm5_layout_and_config(glm5):
    src, out, report = glm5
    cfg = json.loads((src / "config.json").read_text())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    t = tensors(out)
    n_layers, n_exp = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    moe_layers = [i for i in range(n_layers + 1) if i >= cfg["first_k_dense_replace"]]
    for i in moe_layers:  # MTP layer (index n_layers) included
        for e in range(n_exp):
            for p in ("gate_proj", "up_proj", "down_proj"):
                m = f"model.layers.{i}.mlp.experts.{e}.{p}"
                packed, scale, shape = t[f"{m}.weight_packed"], t[f"{m}.weight_scale"], t[f"{m}.weight_shape"]
                n, k = shape.tolist()
                assert packed.dtype == torch.int32 and tuple(packed.shape) == (n, k // 8)
                assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (n, k // 128)
                assert shape.dtype == torch.int64
                assert f"{m}.weight" not in t and f"{m}.weight_scale_inv" not in t
    assert not any(k.endswith(("weight_scale_inv", "weight_zero_point", "weight_g_idx")) for k in t)
    assert all(v.dtype != torch.float8_e4m3fn for v in t.values()), "FP8 left in a W4A16 checkpoint"
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    # config: one group targeting Linear, pack-quantized at group and top level, old-CT key set
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == "pack-quantized"
    assert set(group["weights"]) == OLD_CT_ARGS_KEYS
    assert group["weights"]["group_size"] == 128 and group["weights"]["symmetric"] is True
    assert all(p == "lm_head" or p.startswith("re:") for p in qc["ignore"])
    assert "quantization_config" not in {k for k, v in qc.items() if k == "scale_dtype"}
    # side files copied, report written
    for name in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert report["files"] > 1 and report["bytes_out"] > 0


def test_config_parses_with_compressed_tensors_and_ignore_matches_storage(glm5):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    _, out, _ = glm5
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    t = tensors(out)
    for name in t:
        module, _, leaf = name.rpartition(".")
        ignored = any(match_name(module, p) for p in qc["ignore"])
        if leaf == "weight_packed":
            assert not ignored, f"{module} is quantized but ignored"
        elif leaf == "weight" and t[name].ndim == 2 and ".embed_tokens" not in name and "norm" not in module:
            assert ignored, f"{module} is stored unquantized but not ignored"


def test_every_weight_within_half_a_scale_step_of_the_fp8_source(glm5):
    src, out, _ = glm5
    deq = dict(iter_dense(out, torch.float32))
    srcd = dict(iter_dense(src, torch.float32))
    t = tensors(out)
    checked, negative = 0, 0
    for name, w in deq.items():
        module = name.rpartition(".")[0]
        if f"{module}.weight_scale" in t:
            assert_within_half_step(w, srcd[name], t[f"{module}.weight_scale"], name)
            checked += 1
            negative += int((t[f"{module}.weight_scale"] < 0).sum())
        else:
            assert torch.equal(w, srcd[name].float()), f"{name}: unquantized tensor changed"
    assert checked > 0
    assert negative > 0  # int4-w4a16 is full_range: groups whose maximum is their largest magnitude


def ct_decompress(out: Path) -> dict[str, torch.Tensor]:
    """Decompress every packed module of a checkpoint with compressed-tensors' own compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.load_from_registry(group.get("format") or qc["format"])
    t = tensors(out)
    result = {}
    for packed_name in (k for k in t if k.endswith(".weight_packed")):
        module = packed_name.rpartition(".")[0]
        local = {k.rpartition(".")[2]: v for k, v in t.items() if k.rpartition(".")[0] == module}
        result[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"]
    return result


def test_compressed_tensors_decompression_reproduces_our_weights(glm5):
    """compressed-tensors' own decompression gives exactly our dequantized weights."""
    _, out, _ = glm5
    ours = dict(iter_dense(out, torch.bfloat16))
    theirs = ct_decompress(out)
    assert len(theirs) > 0
    for name, w in theirs.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, ours[name]), name


@pytest.mark.parametrize("family,fmt", [("glm4_moe", "fp8-block"), ("deepseek_v3", "fp8-block"),
                                        ("glm_moe_dsa", "fp8-ct"), ("glm_moe_dsa", "bf16")])
def test_other_families_and_formats_convert(make_ckpt, tmp_path, family, fmt):
    src = make_ckpt(family, fmt)
    out = tmp_path / "out"
    convert(src, out)
    t = tensors(out)
    assert any(k.endswith("experts.0.gate_proj.weight_packed") for k in t)
    assert not any(v.dtype == torch.float8_e4m3fn for v in t.values())
    deq = dict(iter_dense(out, torch.float32))
    srcd = dict(iter_dense(src, torch.float32))
    for name in deq:
        module = name.rpartition(".")[0]
        if f"{module}.weight_scale" in t:
            assert_within_half_step(deq[name], srcd[name], t[f"{module}.weight_scale"], name)


def test_all_linear_recipe_quantizes_attention_but_not_indexer(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    out = tmp_path / "out"
    convert(src, out, "int4-w4a16-all-linear")
    t = tensors(out)
    assert "model.layers.1.self_attn.q_a_proj.weight_packed" in t
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_packed" in t
    assert "model.layers.0.mlp.gate_proj.weight_packed" in t
    assert "model.layers.1.mlp.shared_experts.down_proj.weight_packed" in t
    assert t["model.layers.1.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert t["lm_head.weight"].dtype == torch.bfloat16


def test_g32_and_asymmetric_recipes(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    convert(src, tmp_path / "g32", "int4-w4a16-g32")
    t = tensors(tmp_path / "g32")
    m = "model.layers.1.mlp.experts.0.down_proj"
    assert t[f"{m}.weight_scale"].shape[1] * 32 == t[f"{m}.weight_shape"][1].item()
    asym = tmp_path / "asym.yaml"
    asym.write_text("name: asym\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 64\nsymmetric: false\n")
    convert(src, tmp_path / "asym", str(asym))
    t = tensors(tmp_path / "asym")
    assert t[f"{m}.weight_zero_point"].dtype == torch.int32
    ours = dict(iter_dense(tmp_path / "asym", torch.bfloat16))
    theirs = ct_decompress(tmp_path / "asym")
    assert torch.equal(theirs[f"{m}.weight"], ours[f"{m}.weight"])


def test_asymmetric_recipe_with_one_group_per_row(make_ckpt, tmp_path):
    """group_size == K (the routed experts' down_proj is [256, 128]): `[N, 1]` zero points, whose transpose is
    a "contiguous" [1, N] with stride (1, 1), pack as compressed-tensors unpacks them."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    asym = tmp_path / "asym.yaml"
    asym.write_text("name: asym\ntargets: [routed_expert]\nnum_bits: 4\ngroup_size: 128\nsymmetric: false\n")
    convert(src, tmp_path / "asym", str(asym))
    t = tensors(tmp_path / "asym")
    m = "model.layers.1.mlp.experts.0.down_proj"
    assert t[f"{m}.weight_shape"].tolist() == [256, 128] and t[f"{m}.weight_zero_point"].shape == (32, 1)
    ours = dict(iter_dense(tmp_path / "asym", torch.bfloat16))
    theirs = ct_decompress(tmp_path / "asym")
    assert len(theirs) > 0
    for name, w in theirs.items():
        assert torch.equal(w, ours[name]), name


def test_dense_f16_f32_sources_quantize_as_their_bf16_values(make_ckpt, tmp_path):
    """F16/F32 weights are rounded to bf16 before RTN, as FP8 ones are decoded to it, so the written scales are
    the BF16 the plan declares (the fixture's bf16 values survive the round trip: the same bytes as from bf16)."""
    from glmq.quantize import ops

    src = make_ckpt("glm_moe_dsa", "bf16")
    wide = tmp_path / "src"
    shutil.copytree(src, wide)
    for i, shard in enumerate(sorted(wide.glob("model-*.safetensors"))):  # F16 and F32 shards alternate
        with safe_open(str(shard), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        dtype = (torch.float16, torch.float32)[i % 2]
        save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}, str(shard),
                  metadata={"format": "pt"})
    convert(wide, tmp_path / "out")
    srct, wt, out = tensors(src), tensors(wide), tensors(tmp_path / "out")
    spec = recipes.load("int4-w4a16").spec
    modules = [k.removesuffix(".weight_packed") for k in out if k.endswith(".weight_packed")]
    assert {wt[f"{m}.weight"].dtype for m in modules} == {torch.float16, torch.float32}
    for m in modules:
        ref = ops.quantize_rows(srct[f"{m}.weight"], None, "dense", None, spec)
        assert out[f"{m}.weight_scale"].dtype == torch.bfloat16, m
        assert torch.equal(out[f"{m}.weight_scale"], ref["weight_scale"]), m
        assert torch.equal(out[f"{m}.weight_packed"], ref["weight_packed"]), m


def test_deterministic_output(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    convert(src, tmp_path / "a", max_shard_bytes=300_000)
    convert(src, tmp_path / "b", max_shard_bytes=300_000)
    names = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name != "glmq_report.json")
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir() if p.name != "glmq_report.json")
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n


def test_fp8_ct_per_tensor_scales(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", "fp8-ct", fp8_ct_strategy="tensor")
    convert(src, tmp_path / "o")
    with safe_open(str(next(src.glob("model-*.safetensors"))), "pt") as f:
        assert f is not None
    assert (tmp_path / "o" / "config.json").exists()


def test_dequantizers_agree_with_definition():
    w8 = (torch.randn(130, 260) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.5
    ref = w8.float() * s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :260]
    assert torch.equal(dequantize_block(w8, s, (128, 128)), ref.to(torch.bfloat16))
    sc = torch.rand(130, 1)
    assert torch.equal(dequantize_channel(w8, sc), (w8.float() * sc).to(torch.bfloat16))


def test_precomputed_integers_hook_writes_the_same_bytes(make_ckpt, tmp_path):
    """`stream.run(quantized=...)` (the GPTQ entry point) writes given QWeights in the same format."""
    from glmq.quantize.rtn import quantize_rtn

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    stream.run(plan, tmp_path / "a", progress=False)
    dense = dict(iter_dense(src, torch.bfloat16))
    asked = []

    def provider(module):
        asked.append(module)
        return quantize_rtn(dense[f"{module}.weight"], plan.recipe.spec)

    stream.run(plan, tmp_path / "b", progress=False, quantized=provider)
    assert sorted(asked) == sorted(plan.quantized_modules())
    for f in plan.files:
        assert (tmp_path / "a" / f.name).read_bytes() == (tmp_path / "b" / f.name).read_bytes()


_TRIM_CHILD = r"""
import ctypes
from glmq.quantize import stream
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
mb = 1 << 20
libc.free(libc.malloc(16 * mb))  # an mmapped block freed: the threshold rises to its size
blocks = [libc.malloc(4 * mb) for _ in range(48)]  # now from the heap
fence = libc.malloc(4 * mb)  # above them: the automatic trim of the heap's top cannot reach them
for p in blocks:
    ctypes.memset(p, 1, 4 * mb)  # resident
for p in blocks:
    libc.free(p)
before = stream.current_rss_bytes()
stream.release_free_memory()
after = stream.current_rss_bytes()
libc.free(fence)
print(before, after)
"""


def test_release_free_memory_hands_freed_heap_pages_back():
    """glibc keeps freed mid-size blocks' pages resident once its mmap threshold has grown (what a GPTQ
    layer's 4-32 MB tensors hit); the trim the engine calls between a layer's phases returns them. In a child
    process: what the heap already holds after other tests (its threshold, free chunks) decides where the blocks
    land, which made the test flaky in the test process."""
    import platform
    import subprocess
    import sys

    if stream.current_rss_bytes() is None or platform.libc_ver()[0] != "glibc":
        stream.release_free_memory()  # elsewhere it must at least be harmless
        pytest.skip("needs Linux /proc and glibc")
    r = subprocess.run([sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = (int(x) for x in r.stdout.split())
    assert before - after > 100e6, (before, after)


def test_side_files_leave_out_the_source_card_and_glmq_bookkeeping(make_ckpt, tmp_path):
    """The source's README.md is the FP8 model's card (copied, `glmq upload` would publish it as the output's), and a
    source that glmq wrote holds glmq's manifest and report: none of them is a side file; the tokenizer files are."""
    from glmq.formats.manifest import MANIFEST_NAME, REPORT_NAME

    src = Path(shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), tmp_path / "src"))
    for name in ("README.md", MANIFEST_NAME, REPORT_NAME):
        (src / name).write_text("{}\n")
    side = open_source(src).side_files
    assert {"generation_config.json", "tokenizer_config.json", "chat_template.jinja"} <= set(side)
    assert not {"README.md", MANIFEST_NAME, REPORT_NAME} & set(side)


def test_every_output_file_is_fsynced_before_config_json(make_ckpt, tmp_path, monkeypatch):
    """Shards, side files and the index reach the disk before config.json marks the folder a checkpoint: a crash
    must not leave a complete-looking folder with an empty tokenizer file."""
    import os

    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    out = tmp_path / "out"
    convert(src, out, max_shard_bytes=400_000)
    config_at = synced.index("config.json.glmq-tmp")
    before = {n.removesuffix(".glmq-tmp") for n in synced[:config_at]}
    written = {p.name for p in out.iterdir() if p.name not in ("config.json", "glmq_manifest.json", "glmq_report.json")}
    assert written and written <= before, sorted(written - before)
