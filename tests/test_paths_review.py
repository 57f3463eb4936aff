"""Paths and bad input across the CLI commands (review): each test failed on the code before its fix."""

from __future__ import annotations

import json
import os
import shutil

from click.testing import CliRunner

from glmq.scripts.cli import main

LONG = "a" * 300  # longer than any file system's NAME_MAX (255)


def _nested_index_ckpt(make_ckpt, tmp_path):
    """A checkpoint whose index names its shards in a subfolder: "sub/model-00001-of-0000N.safetensors"."""
    src = tmp_path / "nested"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), src)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    (src / "sub").mkdir()
    for f in set(idx["weight_map"].values()):
        os.rename(src / f, src / "sub" / f)
    idx["weight_map"] = {k: f"sub/{v}" for k, v in idx["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    return src


def test_quantize_refuses_index_with_shards_in_a_subfolder(make_ckpt, tmp_path):
    """Before: exit 0, 'bytes out 0 B', an index and config.json of no tensors that looked complete."""
    src, out = _nested_index_ckpt(make_ckpt, tmp_path), tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", "-m", str(src), "-o", str(out), "--no-progress"])
    assert r.exit_code == 1, r.output
    assert "sub/model-00001" in r.output and "model.safetensors.index.json" in r.output
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    r = CliRunner().invoke(main, ["plan", "-m", str(src)])
    assert r.exit_code == 1 and "sub/model-00001" in r.output, r.output


def test_unknown_builtin_names_the_right_parameter(tmp_path):
    """Before: `Invalid value for --model` for eval's SOURCE and validate's --source."""
    text = tmp_path / "t.txt"
    text.write_text("hello " * 100)
    r = CliRunner().invoke(main, ["eval", "builtin:nope", "--text", str(text)])
    assert r.exit_code == 2 and "'SOURCE'" in r.output and "--model" not in r.output, r.output
    r = CliRunner().invoke(main, ["validate", str(tmp_path), "--source", "builtin:nope"])
    assert r.exit_code == 2 and "'--source'" in r.output and "--model" not in r.output, r.output


def test_json_name_too_long_refused_before_the_run(make_ckpt, tmp_path):
    """Before: the whole run, then a traceback (OSError: File name too long) when the report was written."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")), "-o", str(out),
                                  "--no-progress", "--json", str(tmp_path / f"{LONG}.json")])
    assert r.exit_code == 2 and "--json" in r.output, r.output
    assert not out.exists()


def test_model_or_output_name_too_long_is_one_error_line(make_ckpt, tmp_path):
    """Before: tracebacks (OSError: File name too long) from quantize --output, plan --model and validate."""
    r = CliRunner().invoke(main, ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")),
                                  "-o", str(tmp_path / LONG), "--no-progress"])
    assert r.exit_code == 2 and "Error:" in r.output and "File name too long" in r.output, r.output
    assert not isinstance(r.exception, OSError) or isinstance(r.exception, SystemExit)
    r = CliRunner().invoke(main, ["plan", "-m", str(tmp_path / LONG)])
    assert r.exit_code == 2 and "error:" in r.output and "File name too long" in r.output, r.output
    r = CliRunner().invoke(main, ["validate", str(tmp_path / LONG), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and "Traceback" not in r.output and "unexpectedly" not in r.output, r.output
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 2


def test_open_source_refuses_shards_outside_the_index_folder(make_ckpt, tmp_path):
    """The check sits in open_source, so `stream.run` called as a library is refused too, and `../` as well."""
    import pytest

    from glmq.formats.safetensors_io import CheckpointError
    from glmq.formats.source import open_source

    src = _nested_index_ckpt(make_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=r"'sub/model-\d+-of-\d+\.safetensors', outside the index's folder"):
        open_source(src)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: "../" + v.split("/")[-1] for k, v in idx["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"'\.\./model-.*outside the index's folder"):
        open_source(src)


def test_every_reader_takes_the_same_weight_map_checks(make_ckpt, tmp_path):
    """The source reader, the dense read-back (eval, compare) and validate's --source reader had three copies of the
    weight_map reading, with different checks (a value that is no file name went through the third as a TypeError);
    now one, `source.weight_map`."""
    import pytest

    from glmq.formats.dense import iter_dense
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize.validate.report import CannotValidate
    from glmq.quantize.validate.source import SourceReader

    src = _nested_index_ckpt(make_ckpt, tmp_path)
    with pytest.raises(CheckpointError, match=r"'sub/model-\d+-of-\d+\.safetensors', outside the index's folder"):
        next(iter_dense(src))
    with pytest.raises(CannotValidate, match=r"--source .*nested.*outside the index's folder"):
        SourceReader(src)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: 7 for k in idx["weight_map"]}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CannotValidate, match=r"places tensor .* in 7, not a shard file name; re-download or re-write"):
        SourceReader(src)
    (src / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"neither .* found; not a checkpoint folder, or one whose writing"):
        next(iter_dense(src))


def test_upload_of_a_name_too_long_is_one_error_line(tmp_path, monkeypatch):
    """Before: a traceback from Path.is_dir (ENAMETOOLONG) in upload's argument check."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(main, ["upload", str(tmp_path / LONG), "--repo-id", "a/b", "--dry-run"])
    assert r.exit_code == 2 and "File name too long" in r.output and "Traceback" not in r.output, r.output
