"""Edge cases of the streaming engine and of resuming: scalar tensors, edited headers, a repair that dies, a full
disk, files recorded as written that are not in the output folder, and a second process into the same folder."""

from __future__ import annotations

import errno
import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glmq import recipes
from glmq.formats import safetensors_io
from glmq.formats.safetensors_io import OutSpec, StreamingWriter
from glmq.formats.source import INDEX_NAME, open_source
from glmq.quantize import stream
from glmq.quantize.output import FileBook, OutputDirError, OutputLock
from glmq.quantize.plan import make_plan
from glmq.formats.manifest import REPORT_NAME
from test_distributed import SHARD, _files, reference  # noqa: F401  (reference: a fixture)


def test_a_zero_dim_tensor_is_written(make_ckpt, tmp_path):
    """A 0-dim tensor (an FP8 checkpoint's KV-cache scale) is copied: it crashed the writer ("self.dim() cannot be 0
    to view Float as Byte")."""
    w = StreamingWriter(tmp_path / "s.safetensors", [OutSpec("k_scale", "F32", ())])
    w.write("k_scale", torch.tensor(0.5))
    w.commit()
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert f.get_tensor("k_scale").shape == () and f.get_tensor("k_scale").item() == 0.5

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-ct"), src)
    idx = json.loads((src / INDEX_NAME).read_text())
    name = "model.layers.0.self_attn.k_scale"
    shard = idx["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    t = load_file(str(src / shard))
    t[name] = torch.tensor(0.25)
    save_file(t, str(src / shard), metadata={"format": "pt"})
    idx["weight_map"][name] = shard
    (src / INDEX_NAME).write_text(json.dumps(idx))
    out = tmp_path / "out"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), SHARD), out, progress=False)
    wm = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    with safe_open(str(out / wm[name]), "pt") as f:
        got = f.get_tensor(name)
    assert got.shape == () and got.dtype == torch.float32 and got.item() == 0.25


def test_resume_redoes_a_shard_whose_header_was_edited(reference, tmp_path):
    """The tensor checksums cover the data only: a finished shard whose header was edited (lm_head's shape
    transposed, same bytes) was kept by a resume, and the checkpoint served a [256, 512] lm_head."""
    _, plan, ref = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    victim = out / plan.files[0].name
    data = victim.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2
                and v["shape"][0] != v["shape"][1])
    header[name]["shape"] = header[name]["shape"][::-1]
    raw = json.dumps(header, separators=(",", ":")).encode()
    victim.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:])
    (out / "config.json").unlink()  # as if the run had died before the end
    report = stream.run(plan, out, progress=False)
    assert report["files_skipped_resumed"] == len(plan.files) - 1
    assert _files(out) == _files(ref)


def test_a_repair_that_dies_leaves_no_config_json(reference, tmp_path, monkeypatch):
    """Re-running the command on a finished folder with a corrupt shard deletes that shard to convert it again: a
    run that died then left config.json and the index beside a missing shard, a checkpoint that looked finished."""
    _, plan, ref = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    victim = out / plan.files[2].name
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))

    def killed(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(stream, "convert_files", killed)
        with pytest.raises(KeyboardInterrupt):
            stream.run(plan, out, progress=False)
    assert not victim.exists()
    assert not (out / "config.json").exists() and not (out / INDEX_NAME).exists()
    report = stream.run(plan, out, progress=False)
    assert report["files_skipped_resumed"] == len(plan.files) - 1
    assert _files(out) == _files(ref)


def test_a_full_disk_names_the_file_and_resumes(reference, tmp_path, monkeypatch):
    """A write that fails (ENOSPC) is an OutputDirError naming the file (the CLI prints one line), not a bare OSError
    traceback; the rerun resumes to the same bytes."""
    _, plan, ref = reference
    out = tmp_path / "out"
    orig, calls = safetensors_io.StreamingWriter.write, [0]

    def write(self, name, t):
        calls[0] += 1
        if calls[0] > 30:
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(self, name, t)

    with monkeypatch.context() as m:
        m.setattr(safetensors_io.StreamingWriter, "write", write)
        with pytest.raises(OutputDirError, match=r"model-\d+-of-\d+\.safetensors: writing it failed: .*No space left"):
            stream.run(plan, out, progress=False)
    assert not (out / "config.json").exists()
    report = stream.run(plan, out, progress=False)
    assert 0 < report["files_skipped_resumed"] < len(plan.files)
    assert _files(out) == _files(ref)


def test_no_config_json_when_a_recorded_file_is_not_in_the_folder(reference, tmp_path, monkeypatch):
    """What a run over several nodes without a shared --output folder does (the other ranks' files land in their own
    folders, their records reach rank 0): rank 0 wrote the index and config.json over missing shards, exit 0."""
    _, plan, ref = reference
    out = tmp_path / "out"
    elsewhere = plan.files[3].name
    orig = FileBook.record

    def record(self, f, *a):
        orig(self, f, *a)
        if f.name == elsewhere:
            (self.out / f.name).unlink()

    with monkeypatch.context() as m:
        m.setattr(FileBook, "record", record)
        with pytest.raises(OutputDirError, match=f"1 file.* not in this folder.*{elsewhere}"):
            stream.run(plan, out, progress=False)
    assert not (out / "config.json").exists() and not (out / INDEX_NAME).exists()
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)


_HOLD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_process_into_the_same_folder_is_refused(reference, tmp_path, monkeypatch):
    """Another process holding the folder (a scheduler's retry while the first run still writes): the second run
    deleted the first one's temporary files and wrote the same files beside it. Now it is refused before it touches
    anything, and once the other process is gone the same command resumes."""
    _, plan, ref = reference
    out = tmp_path / "out"

    def killed(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # an interrupted run: a manifest, and the other process's file being written
        m.setattr(stream, "convert_files", killed)
        with pytest.raises(KeyboardInterrupt):
            stream.run(plan, out, progress=False)
    busy = out / (plan.files[0].name + safetensors_io.TMP_SUFFIX)
    busy.write_bytes(b"being written")
    before = sorted(p.name for p in out.iterdir())
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirError, match=f"{out}: another glmq process is writing into this folder"):
            stream.run(plan, out, progress=False)
        assert sorted(p.name for p in out.iterdir()) == before and busy.read_bytes() == b"being written"
    finally:
        holder.communicate("")
    assert OutputLock._held == {}  # released after the refusal as after every run
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref) and not busy.exists()
    assert OutputLock._held == {}


def test_the_output_lock_is_reentrant_in_one_process(tmp_path):
    """GPTQ holds the folder through calibration and then runs the streaming engine, which takes it again."""
    outer, inner = OutputLock(tmp_path), OutputLock(tmp_path / ".." / tmp_path.name)
    outer.acquire()
    inner.acquire()
    assert len(OutputLock._held) == 1
    inner.release()
    assert len(OutputLock._held) == 1
    outer.release()
    assert OutputLock._held == {}


def test_a_failed_side_file_or_index_write_leaves_no_temporary_file(reference, tmp_path, monkeypatch):
    """A full disk while the side files, the index or config.json were written left `*.glmq-tmp` beside the shards
    until the next run, and the CLI printed an OSError traceback; now the temporary file is removed at once, the error
    is one line naming the folder, and the rerun finishes the same checkpoint."""
    _, plan, ref = reference
    assert plan.source.side_files
    out = tmp_path / "out"
    import glmq.quantize.output as output

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def index_fills_the_disk(path, text):  # atomic_write_text, failing half-way through the write
        with safetensors_io.replaced_atomically(path) as tmp:
            tmp.write_text(text[:100])
            full()

    from glmq.formats.manifest import Manifest

    save = Manifest.save

    def the_last_save_fills_the_disk(self, *a, **k):  # config.json is written; the complete manifest is not
        if self.complete:
            full()
        return save(self, *a, **k)

    # (the third: config.json stayed beside a manifest saying "complete: false", a folder vLLM loads)
    for target, name, fn in ((output.shutil, "copyfileobj", full), (output, "atomic_write_text", index_fills_the_disk),
                             (Manifest, "save", the_last_save_fills_the_disk)):
        with monkeypatch.context() as m:
            m.setattr(target, name, fn)
            with pytest.raises(OutputDirError,
                               match="writing the side files, index, config.json or manifest failed: .*No space"):
                stream.run(plan, out, progress=False)
        assert not list(out.glob("*" + safetensors_io.TMP_SUFFIX)) and not (out / "config.json").exists()
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)


def test_a_gptq_run_into_a_held_folder_is_refused_before_it_tokenizes(make_ckpt, tmp_path, monkeypatch):
    """GPTQ tokenizes its calibration text first (seconds to minutes for a large set); a folder another process writes
    into was refused only after that. Now before the text is read."""
    from glmq import recipes
    from glmq.calibration import data
    from glmq.calibration.engine import CalibrationSettings, run_gptq_from_text
    from glmq.formats.source import open_source
    from glmq.quantize.plan import make_plan

    src = make_ckpt("glm4_moe", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16").with_method("gptq"))
    out = tmp_path / "out"
    out.mkdir()

    def tokenized(*a, **k):
        raise AssertionError("tokenized before the lock was checked")

    monkeypatch.setattr(data, "calibration_tokens", tokenized)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirError, match=f"{out}: another glmq process is writing into this folder"):
            run_gptq_from_text(plan, out, CalibrationSettings(calibration=str(tmp_path / "calib.txt"), samples=2,
                                                              seq_len=16), progress=False)
    finally:
        holder.communicate("")
    assert OutputLock._held == {}


def test_a_writer_whose_header_write_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk on the header write left a 0-byte `*.glmq-tmp` (and its descriptor open): the constructor raised
    before any caller held a writer to abort."""
    closed = []
    real_close = safetensors_io.os.close

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)
    monkeypatch.setattr(safetensors_io.os, "close", lambda fd: (closed.append(fd), real_close(fd)))
    with pytest.raises(OSError, match="No space"):
        StreamingWriter(tmp_path / "a.safetensors", [OutSpec("t", "F32", (4,))])
    assert list(tmp_path.iterdir()) == [] and len(closed) == 1


def test_a_resume_into_a_folder_it_cannot_write_is_one_clear_error(reference, tmp_path, monkeypatch):
    """Only a fresh run's first manifest write was turned into the one-line error; a resume into a read-only or full
    folder ended in a bare `[Errno 30] ... glmq_manifest.json.glmq-tmp`."""
    _, plan, ref = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    (out / "config.json").unlink()  # as if the run had died before its end
    import glmq.quantize.output as output

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(output.Manifest, "save", read_only)
        with pytest.raises(OutputDirError, match=r"cannot write into the output folder \(Read-only file system\)"):
            stream.run(plan, out, progress=False)
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)


def test_a_report_that_cannot_be_written_does_not_fail_a_finished_checkpoint(reference, tmp_path, monkeypatch, caplog):
    """The report is written after config.json and the index: a full disk there printed a bare `[Errno 28]` and
    exit 1 for a complete checkpoint; now a warning, and the figures still come back (the CLI prints them)."""
    _, plan, ref = reference
    out = tmp_path / "out"
    real = stream.atomic_write_text

    def write(path, text):
        if path.name == REPORT_NAME:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(stream, "atomic_write_text", write)
    with caplog.at_level("WARNING", logger="glmq"):
        report = stream.run(plan, out, progress=False)
    assert report["report_not_written"] == f"{REPORT_NAME}: No space left on device" and "report_kept" not in report
    assert "the checkpoint is complete" in caplog.text
    assert _files(out) == _files(ref) and not (out / REPORT_NAME).exists()
    assert not list(out.glob("*" + safetensors_io.TMP_SUFFIX))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_the_report_shows_the_config_childs_peak_beside_the_runs_own(reference):
    """peak_rss_bytes is this process's alone; the child building the compressed-tensors config runs alongside and
    peaked higher than the whole tiny conversion (a probe: 489 MB against the reported 377 MB), unreported."""
    _, _, ref = reference
    rep = json.loads((ref / REPORT_NAME).read_text())
    assert 50e6 < rep["config_child_peak_rss_bytes"] < 20e9 and rep["peak_rss_bytes"] > 0
    assert "_glmq_child_peak_rss_bytes" not in (ref / "config.json").read_text()


def test_the_converter_does_not_import_compressed_tensors_itself():
    """compressed-tensors (and with it transformers and triton) is imported in the config child only
    (quantize/config_child.py: seconds of start-up, and a triton imported before a test module can set
    TRITON_INTERPRET); importing a constant from glmq.formats.compressed_tensors into quantize/output.py brought it
    into every run, and 273 kernel tests of the CI suite fell back to their fresh-interpreter rerun."""
    code = ("import sys, glmq.quantize.stream, glmq.quantize.output, glmq.scripts.cli; "
            "print(sorted(m for m in ('compressed_tensors', 'transformers', 'triton') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout
