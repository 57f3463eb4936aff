"""Review of glmq.formats.dense (reading checkpoints back as floats): damaged inputs give a CheckpointError naming
the file and the tensor, never a bare ValueError/RuntimeError/JSON error or silently wrong values."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from glmq.formats.dense import dense_config, iter_dense
from glmq.formats.safetensors_io import CheckpointError
from safetensors.torch import load_file, save_file

O_PROJ = "model.layers.0.self_attn.o_proj"


def _copy_with(src, dst, name, new):
    """A copy of checkpoint `src` in `dst` with tensor `name` replaced by `new` (in its own shard)."""
    shutil.copytree(src, dst)
    wm = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / wm[name]
    tensors = load_file(str(shard))
    tensors[name] = new
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def test_fp8_block_scale_of_wrong_shape_names_file_and_tensor(make_ckpt, tmp_path):
    bad = _copy_with(make_ckpt("glm_moe_dsa"), tmp_path / "c", f"{O_PROJ}.weight_scale_inv", torch.ones(1, 1))
    with pytest.raises(CheckpointError, match=rf"{O_PROJ}\.weight_scale_inv \[1, 1\].*re-download"):
        dict(iter_dense(bad))


def test_fp8_channel_scale_of_wrong_length_is_a_checkpoint_error(make_ckpt, tmp_path):
    bad = _copy_with(make_ckpt("glm4_moe", "fp8-ct"), tmp_path / "c", f"{O_PROJ}.weight_scale",
                     torch.ones(3, 1, dtype=torch.bfloat16))  # was a bare RuntimeError (broadcast)
    with pytest.raises(CheckpointError, match=rf"{O_PROJ}\.weight_scale \[3, 1\]"):
        dict(iter_dense(bad))


def _mixed_precision(folder, scale: torch.Tensor):
    """A keep_fp8-style output: one FP8 weight described by a compressed-tensors block group, scale `scale`."""
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    w8 = (torch.randn(256, 200, generator=g) * 50).to(torch.float8_e4m3fn)  # 200 columns: a partial block
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
          "config_groups": {"group_1": {"targets": ["re:.*o_proj$"], "format": "float-quantized",
                                        "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                                                    "block_structure": [128, 128], "symmetric": True}}}}
    (folder / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "quantization_config": qc}))
    save_file({f"{O_PROJ}.weight": w8, f"{O_PROJ}.weight_scale": scale}, str(folder / "model.safetensors"))
    return w8


def test_keep_fp8_block_weight_reads_back_blockwise(tmp_path):
    scale = torch.tensor([[0.5, 2.0], [0.25, 4.0]])
    w8 = _mixed_precision(tmp_path / "m", scale)
    got = dict(iter_dense(tmp_path / "m"))[f"{O_PROJ}.weight"]
    ref = (w8.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :200]).to(torch.bfloat16)
    assert torch.equal(got, ref)


def test_keep_fp8_block_scale_of_wrong_shape_is_refused_not_read_per_tensor(tmp_path):
    _mixed_precision(tmp_path / "m", torch.ones(1, 1) * 3)  # read as one per-tensor scale before
    with pytest.raises(CheckpointError, match=rf"{O_PROJ}\.weight_scale \[1, 1\].*\[2, 2\]"):
        dict(iter_dense(tmp_path / "m"))


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "model.safetensors.index.json").write_text("{not json"), r"index\.json: cannot be read as JSON"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"), r"index\.json: has no weight_map"),
    (lambda d: (d / "config.json").unlink(), r"config\.json: not found"),
])
def test_damaged_json_files_are_checkpoint_errors_naming_the_file(make_ckpt, tmp_path, damage, match):
    bad = tmp_path / "c"
    shutil.copytree(make_ckpt("glm_moe_dsa"), bad)
    damage(bad)
    with pytest.raises(CheckpointError, match=match):
        dense_config(bad)
        dict(iter_dense(bad))
