"""Reading a source checkpoint (formats/source.py): what identifies it, and clear errors for broken metadata."""

from __future__ import annotations

import json
import shutil

import pytest

from glmq import recipes
from glmq.formats.safetensors_io import CheckpointError
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.output import OutputDirError
from glmq.quantize.plan import make_plan


def test_another_model_with_the_same_config_and_headers_is_another_source(make_ckpt, tmp_path):
    """Two models of one architecture (a fine-tune, the next release) have identical config.json and shard
    headers; an interrupted run of one must not be resumed with the other's weights."""
    a, b = make_ckpt("glm_moe_dsa", "fp8-block"), make_ckpt("glm_moe_dsa", "fp8-block", seed=1)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)
    sa, sb = open_source(a), open_source(b)
    moved_src = open_source(moved)  # a copied source still resumes
    assert (moved_src.header_digest, moved_src.shard_samples) == (sa.header_digest, sa.shard_samples)
    assert sa.header_digest == sb.header_digest and all(sa.shard_samples[s] != sb.shard_samples[s] for s in sa.shards)
    rec = recipes.load("int4-w4a16")
    out = tmp_path / "out"
    stream.run(make_plan(sa, rec), out, progress=False)
    (out / "config.json").unlink()  # as if the run of `a` had died just before the end
    with pytest.raises(OutputDirError, match="the data of every source shard differs from that run's"):
        stream.run(make_plan(sb, rec), out, progress=False)


def _edit(src, tmp_path, name, edit):
    root = tmp_path / "src"
    shutil.copytree(src, root)
    obj = json.loads((root / name).read_text())
    (root / name).write_text(json.dumps(edit(obj)))
    return root


def _null_shard(index):
    index["weight_map"]["lm_head.weight"] = None
    return index


def _unlisted(index):
    del index["weight_map"]["lm_head.weight"]
    return index


def _qc(value):
    def edit(cfg):
        cfg["quantization_config"] = value(cfg["quantization_config"])
        return cfg
    return edit


@pytest.mark.parametrize("name, edit, message", [
    ("config.json", lambda c: [c], "config.json: holds a JSON list, not an object"),
    ("model.safetensors.index.json", lambda i: [i], "index.json: holds a JSON list, not an object"),
    ("model.safetensors.index.json", _null_shard, "places tensor lm_head.weight in None, not a shard file name"),
    ("model.safetensors.index.json", _unlisted, "holds tensor lm_head.weight, which model.safetensors.index.json does not list"),
    ("config.json", _qc(lambda q: "fp8"), "quantization_config is a JSON str, not an object"),
    ("config.json", _qc(lambda q: {**q, "weight_block_size": [None, 128]}), r"2 positive integers \(it has \[None, 128\]\)"),
    ("config.json", _qc(lambda q: {**q, "weight_block_size": [0, 128]}), r"2 positive integers \(it has \[0, 128\]\)"),
])
def test_malformed_config_or_index_is_a_checkpoint_error(make_ckpt, tmp_path, name, edit, message):
    """Wrongly typed JSON in config.json or the index used to surface as AttributeError / TypeError /
    ZeroDivisionError tracebacks; it is a CheckpointError naming the file (the CLI prints it on one line)."""
    root = _edit(make_ckpt("glm_moe_dsa", "fp8-block"), tmp_path, name, edit)
    with pytest.raises(CheckpointError, match=message):
        make_plan(open_source(root), recipes.load("int4-w4a16"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_an_unreadable_config_or_index_is_a_checkpoint_error(make_ckpt, tmp_path, name):
    """A config.json or index that cannot be read (here a folder of that name, as a bad copy leaves it) surfaced
    as the bare OSError ("[Errno 21] Is a directory"), without the file's role or what to do."""
    root = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), root)
    (root / name).unlink()
    (root / name).mkdir()
    with pytest.raises(CheckpointError, match=rf"{name}: cannot be read as JSON \(.*; re-download it"):
        make_plan(open_source(root), recipes.load("int4-w4a16"))


def test_compressed_tensors_block_fp8_source_is_refused_up_front(make_ckpt, tmp_path):
    """llm-compressor's FP8_BLOCK (strategy "block", weight_scale [N/128, K/128]): one line naming the config and the
    strategy, before anything is read or created; it was ~100 lines of 'neither per-channel nor per-tensor'."""
    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-ct"), src)
    cfg = json.loads((src / "config.json").read_text())
    weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] in ("channel", "tensor")
    open_source(src)  # as generated: read
    weights.update(strategy="block", block_structure=[128, 128])
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config group group_0 has FP8 weights of "
                                              r"strategy 'block'; glmq reads"):
        open_source(src)


def test_a_compressed_tensors_sources_kv_cache_scheme_goes_with_its_scales(make_ckpt, tmp_path):
    """A compressed-tensors FP8 source with an FP8 KV cache (kv_cache_scheme and per-layer k_scale / v_scale): the
    scales are copied, so the scheme must come too (it was written null: vLLM then skips the scales, and an FP8 KV
    cache runs with scale 1.0); and validate warns about scales beside a null scheme."""
    import torch
    from safetensors.torch import load_file, save_file

    from glmq.quantize.validate import validate

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-ct"), src)
    cfg = json.loads((src / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    cfg["quantization_config"]["kv_cache_scheme"] = scheme
    (src / "config.json").write_text(json.dumps(cfg))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.self_attn.o_proj.weight"]
    tensors = load_file(src / shard)
    for layer in range(cfg["num_hidden_layers"]):
        for leaf in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{leaf}"] = torch.tensor(0.5 + layer)
            index["weight_map"][f"model.layers.{layer}.self_attn.{leaf}"] = shard
    save_file(tensors, src / shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    out = tmp_path / "out"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16")), out, progress=False)
    got = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert {k: got[k] for k in scheme} == scheme
    report = validate(out)
    assert report.exit_code == 0 and not any("kv_cache_scheme" in w.message for w in report.checks["structure"].warnings)

    cfg_out = json.loads((out / "config.json").read_text())
    cfg_out["quantization_config"]["kv_cache_scheme"] = None
    (out / "config.json").write_text(json.dumps(cfg_out))
    report = validate(out)
    warned = [w.message for w in report.checks["structure"].warnings if "kv_cache_scheme is null" in w.message]
    assert len(warned) == 1 and f"{2 * cfg['num_hidden_layers']} KV-cache scale" in warned[0]


def test_a_flat_per_channel_scale_is_refused_with_the_fix(make_ckpt, tmp_path):
    """A compressed-tensors FP8 source whose per-channel weight_scale is stored [N] instead of [N, 1]: refused before
    any work, naming the file, the tensor and the reshape that makes it readable."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-ct"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.0.up_proj.weight_scale"
    shard = index["weight_map"][name]
    tensors = load_file(src / shard)
    n = tensors[name].shape[0]
    tensors[name] = tensors[name].reshape(-1)
    save_file(tensors, src / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        make_plan(open_source(src), recipes.load("int4-w4a16"))
    msg = str(err.value)
    assert f"{shard}: tensor {name} shape [{n}]" in msg and f"store it as [{n}, 1]" in msg and "reshape(-1, 1)" in msg
