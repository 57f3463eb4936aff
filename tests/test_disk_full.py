"""A full disk (or a Ctrl-C) outside the RTN shard writer, which already named its shard: each is one line that names
the file and says what to do, with the documented exit code, where GPTQ's layer files gave a SafetensorError
traceback, its hidden states a bare "[Errno 28] No space left on device", the built-in model's generation and eval's
temporary copy a traceback and exit 1, and Ctrl-C click's "Aborted!" with exit 1 (found by a probe on small tmpfs
mounts; here the failures are made by a stand-in writer or /dev/full, as CI cannot mount)."""

from __future__ import annotations

import errno

import pytest
import torch
from click.testing import CliRunner
from safetensors import SafetensorError

from glmq.calibration import cache
from glmq.formats.safetensors_io import named_os_error, replaced_atomically, save_safetensors
from glmq.scripts import cli
from glmq.scripts.cli import main

FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _full(*args, **kwargs):
    raise SafetensorError(FULL)


def test_safetensors_io_errors_become_os_errors_naming_the_file(tmp_path, monkeypatch):
    e = named_os_error(SafetensorError(FULL), tmp_path / "x.safetensors")
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == str(tmp_path / "x.safetensors")
    assert named_os_error(SafetensorError("Error while deserializing header: invalid"), "x") is None
    bare = OSError(errno.ENOSPC, "No space left on device")  # f.write's: no file named
    assert named_os_error(bare, "y") is bare and bare.filename == "y"
    monkeypatch.setattr("safetensors.torch.save_file", _full)
    with pytest.raises(OSError, match=r"No space left on device: '.*layer\.safetensors'"):
        save_safetensors({"t": torch.zeros(2)}, tmp_path / "layer.safetensors")
    with pytest.raises(OSError, match=r"No space left on device: '.*final\.safetensors'"):
        with replaced_atomically(tmp_path / "final.safetensors"):
            _full()
    assert not list(tmp_path.iterdir())  # the temporary file is gone


def test_hidden_states_on_a_full_disk_name_their_file(tmp_path, monkeypatch):
    class Full:  # a file on a full disk: f.write's OSError names no file
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def seek(self, pos):
            pass

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    store = cache.Activations.new_file(tmp_path / "hidden-00000.bin", (4, 8), torch.float32)
    monkeypatch.setattr(cache, "open", lambda *a, **k: Full(), raising=False)  # (the module's name before builtins')
    with pytest.raises(OSError) as info:
        store.write(0, torch.ones(4, 8))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "hidden-00000.bin")


def test_an_os_error_without_an_errno_keeps_its_text(tmp_path):
    """OSError("text") (Pillow's encoder errors, under --plot) printed "[Errno None] None: 'path'" once named."""
    with pytest.raises(OSError, match="^encoder error -2$"):
        with replaced_atomically(tmp_path / "x.tif"):
            raise OSError("encoder error -2")


@pytest.fixture
def src(make_ckpt, tmp_path):
    """The tiny GLM-4.x with a byte tokenizer (GPTQ's calibration text and eval's windows need one)."""
    import shutil

    from glmq.formats import fixtures

    shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), tmp_path / "src")
    fixtures.write_byte_tokenizer(tmp_path / "src")
    return tmp_path / "src"


@pytest.fixture
def gptq_args(src, tmp_path):
    (tmp_path / "calib.txt").write_text("the expert router scale of " * 200)
    return ["quantize", "-m", str(src), "-o", str(tmp_path / "out"), "--scheme", "gptq",
            "--calibration", str(tmp_path / "calib.txt"), "--samples", "4", "--seq-len", "32", "--no-progress"]


def test_a_gptq_layer_file_on_a_full_disk_is_one_line_naming_it(gptq_args, monkeypatch):
    monkeypatch.setattr(cache, "save_file", _full)
    r = CliRunner().invoke(main, gptq_args)
    assert r.exit_code == 1 and not isinstance(r.exception, SafetensorError), (r.output, r.exception)
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and ".safetensors: No space left on device; free space on that disk" in line
    assert "re-run the same command: the finished work is kept and resumed" in line


def test_the_builtin_on_a_full_disk_could_not_start(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "DEFAULT_CACHE", tmp_path / ".glmq-cache")
    monkeypatch.setattr("safetensors.torch.save_file", _full)
    r = CliRunner().invoke(main, ["plan"])
    assert r.exit_code == 2 and not isinstance(r.exception, SafetensorError), (r.output, r.exception)
    assert "cannot generate the built-in glm5-tiny checkpoint in" in r.output and "No space left on device" in r.output


def test_evals_temporary_copy_on_a_full_disk_names_tmpdir(src, tmp_path, monkeypatch):
    (tmp_path / "eval.txt").write_text("text " * 100)
    monkeypatch.setattr("safetensors.torch.save_file", _full)
    r = CliRunner().invoke(main, ["eval", str(src), "--text", str(tmp_path / "eval.txt")])
    assert r.exit_code == 2 and not isinstance(r.exception, SafetensorError), (r.output, r.exception)
    assert "No space left on device (the model's temporary copy for transformers" in r.output
    assert "set TMPDIR to a folder with room for it" in r.output


def test_ctrl_c_is_130_and_quantize_says_it_resumes(make_ckpt, tmp_path, monkeypatch):
    from glmq.quantize import stream

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream, "run", interrupted)
    r = CliRunner().invoke(main, ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")), "-o",
                                  str(tmp_path / "out"), "--no-progress"])
    assert r.exit_code == 130 and "Aborted" not in r.output, r.output
    assert "interrupted: nothing unfinished looks complete; re-run the same command to resume" in r.output


@pytest.mark.parametrize("rank", ["0", "1"])
def test_ctrl_c_under_torchrun_leaves_through_dist_leave_and_rank_0_says_it(rank, monkeypatch, capsys):
    """Each rank gets the Ctrl-C: each printed the line, and left through the interpreter's teardown, which
    dist.leave exists to avoid (gloo/NCCL destructors may abort)."""
    from glmq.quantize import dist

    left = []
    monkeypatch.setattr(dist, "launched", lambda: True)
    monkeypatch.setattr(dist, "leave", left.append)
    monkeypatch.setenv("RANK", rank)

    def command():
        raise KeyboardInterrupt

    cli._leave_as_a_rank(command)()
    assert left == [130]
    assert ("interrupted: nothing unfinished looks complete" in capsys.readouterr().err) == (rank == "0")
