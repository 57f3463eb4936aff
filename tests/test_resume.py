"""Killing a run at random points and re-running gives output byte-identical to an uninterrupted run."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from glmq import recipes
from glmq.formats.manifest import REPORT_NAME, SOURCE_TIMES_NAME
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan

# Runs the real CLI in a child process whose StreamingWriter dies with SIGKILL-like abruptness
# (os._exit: no cleanup, no finally blocks) after a given number of tensor writes.
_CHILD = r"""
import os, sys
from glmq.formats import safetensors_io
limit = int(sys.argv[1]); calls = [0]
orig = safetensors_io.StreamingWriter.write
def write(self, name, t):
    calls[0] += 1
    if calls[0] > limit:
        os._exit(137)
    return orig(self, name, t)
safetensors_io.StreamingWriter.write = write
from glmq.scripts.cli import main
sys.argv = ["glmq", "quantize", "--model", sys.argv[2], "--output", sys.argv[3], "--max-shard-size", "300KB", "--no-progress"]
main()
"""


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name not in (REPORT_NAME, SOURCE_TIMES_NAME)}


def test_kill_and_resume_is_byte_identical(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    ref = tmp_path / "ref"
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    stream.run(plan, ref, progress=False)
    total_writes = sum(len(it.outputs) for f in plan.files for it in f.items)
    rng = random.Random(1234)
    out = tmp_path / "killed"
    kills = sorted(rng.sample(range(1, total_writes), 3))
    done_before = 0
    for k in kills:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(k - done_before), str(src), str(out)],
                           capture_output=True, text=True)
        assert r.returncode == 137, r.stderr[-2000:]
        assert not (out / "config.json").exists(), "an interrupted run left a complete-looking checkpoint"
        done_before = k if k > done_before else done_before
    r = subprocess.run([sys.executable, "-c", _CHILD, str(10**9), str(src), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed" in r.stdout
    assert _files(out) == _files(ref)


def test_resume_redoes_a_corrupted_finished_shard(make_ckpt, tmp_path):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    ref, out = tmp_path / "ref", tmp_path / "out"
    stream.run(plan, ref, progress=False)
    stream.run(plan, out, progress=False)
    victim = out / plan.files[1].name
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    (out / "config.json").unlink()  # as if the run had died before the end
    report = stream.run(plan, out, progress=False)
    assert report["files_skipped_resumed"] == len(plan.files) - 1
    assert _files(out) == _files(ref)


def test_manifest_journal_survives_a_torn_last_line(tmp_path):
    """Finished files are appended to the manifest's journal; load folds it in and drops a line torn by a crash
    (that file is converted again); an unreadable line before the last is an error; save drops the journal."""
    import json

    import pytest

    from glmq.formats.manifest import MANIFEST_NAME, Manifest, journal_name

    man = Manifest({"recipe": "x"})
    man.save(tmp_path)
    for i in range(3):
        man.append(tmp_path, f"model-{i:05d}.safetensors", {"bytes": i, "tensors": {"t": f"{i:064x}"}})
    assert Manifest.load(tmp_path).files == man.files
    journal = tmp_path / journal_name(MANIFEST_NAME)
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["files"] == {}  # not rewritten per file
    text = journal.read_text()
    journal.write_text(text[:-10])  # the last record torn
    assert sorted(Manifest.load(tmp_path).files) == ["model-00000.safetensors", "model-00001.safetensors"]
    lines = text.split("\n")
    journal.write_text("\n".join([lines[0], lines[1][:20], lines[2], ""]))
    with pytest.raises(ValueError, match="unreadable line 2"):
        Manifest.load(tmp_path)
    journal.write_text(text)
    loaded = Manifest.load(tmp_path)
    loaded.save(tmp_path)
    assert not journal.exists() and Manifest.load(tmp_path).files == man.files


def _edit_unsampled_byte(src: Path, f) -> str:
    """Set one FP8 code of a quantized weight that output file `f` reads to the format's largest value (so its
    group's scale moves), at a byte outside the source digest's sampled windows and with the size unchanged:
    an edit the run's identity cannot see. Returns the edited shard's name."""
    from glmq.formats.safetensors_io import read_header
    from glmq.formats.source import SAMPLE_BYTES, SAMPLE_WINDOWS
    from glmq.quantize.plan import Action

    it = next(i for i in f.items if i.action is Action.QUANTIZE and i.src.dtype == "F8_E4M3")
    path = src / it.src.shard
    _, _, start = read_header(path)
    n = path.stat().st_size - start
    windows = [start + (n - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
    data = bytearray(path.read_bytes())
    at = next(o for o in range(start + it.src.begin, start + it.src.end)
              if data[o] != 0x7E and not any(w <= o < w + SAMPLE_BYTES for w in windows))
    data[at] = 0x7E
    path.write_bytes(bytes(data))
    return it.src.shard


def test_resume_redoes_the_files_of_a_source_shard_edited_in_place(make_ckpt, tmp_path):
    """A source shard edited in place between a crash and the resume, where neither its header, its size nor the
    sampled windows of the run's identity see it: the finished files read from it are converted again (their
    modification time moved), so the checkpoint equals a conversion of the edited source, not a mix of both; a
    shard only touched is redone too. The finished manifest keeps no times."""
    import json
    import os
    import shutil

    from glmq.formats.manifest import MANIFEST_NAME, Manifest
    from glmq.quantize.plan import Action

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    before = open_source(src)
    plan = make_plan(before, recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    total_writes = sum(len(it.outputs) for f in plan.files for it in f.items)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(total_writes * 2 // 3), str(src), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 137, r.stderr[-2000:]
    man = Manifest.load(out)
    assert man.source_mtime_ns == before.shard_mtime_ns and len(man.source_mtime_ns) == len(before.shards)
    done = [f for f in plan.files if f.name in man.files]
    assert len(done) >= 3
    victim = next(f for f in done if any(i.action is Action.QUANTIZE and i.src.dtype == "F8_E4M3" for i in f.items))
    edited = _edit_unsampled_byte(src, victim)
    after = open_source(src)
    assert after.header_digest == before.header_digest  # the premise: the identity cannot see the edit
    touched = next(s for f in done for s in sorted(f.source_shards()) if s != edited)
    st = (src / touched).stat()
    os.utime(src / touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    redo = {f.name for f in plan.files if f.source_shards() & {edited, touched}}
    kept = {f.name for f in done} - redo
    assert kept and {f.name for f in done} & redo

    ref = tmp_path / "ref"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), ref, progress=False)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(10**9), str(src), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{src / edited}: modified since the interrupted run" in r.stderr
    assert f"{src / touched}: modified since the interrupted run" in r.stderr
    assert "does not check out" not in r.stderr
    rep = json.loads((out / REPORT_NAME).read_text())
    assert rep["files_skipped_resumed"] == len(kept)
    assert _files(out) == _files(ref)  # the manifests too: a finished one holds no source times
    assert "source_mtime_ns" not in json.loads((out / MANIFEST_NAME).read_text())


def test_manifest_source_times_load_and_save(tmp_path):
    import json

    import pytest

    from glmq.formats.manifest import MANIFEST_NAME, Manifest

    Manifest({"recipe": "x"}, source_mtime_ns={"a.safetensors": 5}).save(tmp_path)
    assert Manifest.load(tmp_path).source_mtime_ns == {"a.safetensors": 5}
    Manifest({"recipe": "x"}).save(tmp_path)
    assert "source_mtime_ns" not in json.loads((tmp_path / MANIFEST_NAME).read_text())
    d = json.loads((tmp_path / MANIFEST_NAME).read_text())
    for bad in ({"a.safetensors": "5"}, [5], {"a.safetensors": True}, {"a.safetensors": 10**30}):
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({**d, "source_mtime_ns": bad}))
        with pytest.raises(ValueError, match="unreadable glmq manifest.*source_mtime_ns"):
            Manifest.load(tmp_path)


def test_a_source_shard_modified_during_the_run_leaves_no_checkpoint_and_the_rerun_redoes_its_files(
        make_ckpt, tmp_path, monkeypatch, caplog):
    """A shard whose time moves while the run reads the source: the run ends with an error naming it before the index
    and config.json are written, and the same command then converts the files read from it again."""
    import os
    import shutil

    import pytest

    from glmq.formats import safetensors_io
    from glmq.quantize.output import OutputDirError

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    shard = sorted(plan.source.shards)[2]
    orig, calls = safetensors_io.StreamingWriter.write, [0]

    def write(self, name, t):
        calls[0] += 1
        if calls[0] == 5:  # the contents stay; a copy over it would move the time the same way
            st = (src / shard).stat()
            os.utime(src / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return orig(self, name, t)

    monkeypatch.setattr(safetensors_io.StreamingWriter, "write", write)
    out = tmp_path / "out"
    with pytest.raises(OutputDirError, match=f"{src / shard}: modified while this run read the source"):
        stream.run(plan, out, progress=False)
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    monkeypatch.setattr(safetensors_io.StreamingWriter, "write", orig)
    ref = tmp_path / "ref"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), ref, progress=False)
    with caplog.at_level("WARNING", logger="glmq"):
        rep = stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), out, progress=False)
    assert f"{src / shard}: modified since the interrupted run" in caplog.text
    assert rep["files_skipped_resumed"] == sum(1 for f in plan.files if shard not in f.source_shards())
    assert _files(out) == _files(ref)


def test_the_touch_command_restores_the_exact_time(tmp_path):
    """The GPTQ refusal's `touch -m -d @S.N` gives back the recorded nanoseconds, before 1970 too (floor division
    wrote -1 ns as @-1.999999999); a time beyond the platform's dates is shown, not a traceback."""
    import os
    import shutil

    import pytest

    from glmq.quantize.output import _seconds, _when

    assert _seconds(-1) == "-0.000000001" and _seconds(1_700_000_000_123_456_789) == "1700000000.123456789"
    assert _when(10**30).endswith("s since 1970")
    if shutil.which("touch") is None:
        pytest.skip("no touch command")
    f = tmp_path / "f"
    f.write_bytes(b"")
    for ns in (-1, -1_999_999_999, 0, 1, 1_700_000_000_123_456_789):
        subprocess.run(["touch", "-m", "-d", f"@{_seconds(ns)}", str(f)], check=True)
        assert os.stat(f).st_mtime_ns == ns


def test_a_rerun_into_a_finished_folder_redoes_the_files_of_a_source_shard_edited_since(make_ckpt, tmp_path):
    """A source shard edited in place after the run finished (downloaded again, say), where neither its header, its
    size nor the sampled windows see it: a rerun into the finished folder converted nothing ("7 resumed") and kept the
    old tensors, since the finished manifest keeps no times. The times now wait beside it, in a local file the upload
    leaves out, so the files read from that shard are converted again, as after an interrupted run."""
    import fnmatch
    import json
    import shutil

    from glmq.formats.manifest import MANIFEST_NAME, SOURCE_TIMES_NAME
    from glmq.quantize.plan import Action
    from glmq.scripts.upload import ignore_patterns

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    before = open_source(src)
    plan = make_plan(before, recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    stream.run(plan, out, progress=False)
    assert json.loads((out / SOURCE_TIMES_NAME).read_text())["source_mtime_ns"] == before.shard_mtime_ns
    assert "source_mtime_ns" not in json.loads((out / MANIFEST_NAME).read_text())
    assert any(fnmatch.fnmatch(SOURCE_TIMES_NAME, p) for p in ignore_patterns())  # never uploaded
    victim = next(f for f in plan.files if any(i.action is Action.QUANTIZE and i.src.dtype == "F8_E4M3"
                                               for i in f.items))
    edited = _edit_unsampled_byte(src, victim)
    after = open_source(src)
    assert after.header_digest == before.header_digest and after.shard_samples == before.shard_samples  # unseen
    ref = tmp_path / "ref"
    stream.run(make_plan(after, recipes.load("int4-w4a16"), 300_000), ref, progress=False)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(10**9), str(src), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{src / edited}: modified since the run that finished in {out}" in r.stderr
    redone = {f.name for f in plan.files if edited in f.source_shards()}
    assert json.loads((out / REPORT_NAME).read_text())["files_skipped_resumed"] == len(plan.files) - len(redone)
    assert _files(out) == _files(ref)
    assert json.loads((out / SOURCE_TIMES_NAME).read_text())["source_mtime_ns"] == after.shard_mtime_ns
    r = subprocess.run([sys.executable, "-c", _CHILD, str(10**9), str(src), str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "modified since" not in r.stderr  # the new times were kept: nothing more to redo
    # a finished folder of a glmq before the file: its first rerun records the times it finds
    (out / SOURCE_TIMES_NAME).unlink()
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), out, progress=False)
    assert json.loads((out / SOURCE_TIMES_NAME).read_text())["source_mtime_ns"] == open_source(src).shard_mtime_ns


def test_a_gptq_rerun_into_a_finished_folder_over_a_touched_source_is_refused_with_the_restore(make_ckpt, tmp_path):
    """The finished GPTQ checkpoint is left as it is, and the one command printed restores the times kept beside it,
    after which the rerun goes on."""
    import os
    import re
    import shutil

    import pytest

    from glmq.formats import manifest
    from glmq.formats.manifest import Manifest
    from glmq.quantize.output import OutputDirError, OutputLock, prepare_output
    from glmq.recipes import load

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    gptq = load("int4-w4a16").with_method("gptq")
    out = tmp_path / "out"
    with OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)
    man = Manifest.load(out)  # finished as finish_checkpoint leaves it
    times = man.source_mtime_ns
    manifest.save_source_times(out, times)
    man.complete, man.source_mtime_ns = True, {}
    man.save(out)
    for shard in times:
        st = (src / shard).stat()
        os.utime(src / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(OutputDirError) as e, OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)
    msg = str(e.value)
    assert f"modified since the GPTQ run that finished in {out}" in msg and "left as it is" in msg, msg
    subprocess.run(re.search(r"run the same command again: (python3 -c .*)$", msg).group(1), shell=True, check=True)
    assert {s: (src / s).stat().st_mtime_ns for s in times} == times
    with OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)


def test_the_gptq_refusal_over_many_changed_shards_gives_one_command_that_restores_them_all(make_ckpt, tmp_path):
    """A whole source copied without its times (here: every shard's time moved) is refused with one command, not a
    touch per shard; run as printed, it restores every recorded time, and the folder then resumes."""
    import os
    import re
    import shutil

    import pytest

    from glmq.formats.manifest import Manifest
    from glmq.quantize.output import OutputDirError, OutputLock, prepare_output
    from glmq.recipes import load

    src = tmp_path / "src dir"  # a space: the command quotes its paths
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    gptq = load("int4-w4a16").with_method("gptq")  # as --scheme gptq
    out = tmp_path / "out"
    with OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)
    times = Manifest.load(out).source_mtime_ns
    for shard in times:
        st = (src / shard).stat()
        os.utime(src / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(OutputDirError) as e, OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)
    msg = str(e.value)
    assert f"{len(times)} source shards in all" in msg and "touch" not in msg
    subprocess.run(re.search(r"resume: (python3 -c .*)$", msg).group(1), shell=True, check=True)
    assert {s: (src / s).stat().st_mtime_ns for s in times} == times
    with OutputLock(out) as lock:
        prepare_output(make_plan(open_source(src), gptq, 300_000), out, lock)


def _open_under(folder: Path) -> list[str]:
    """Paths under `folder` this process holds open (Linux /proc)."""
    import os

    fds = Path("/proc/self/fd")
    held = []
    for fd in fds.iterdir() if fds.is_dir() else ():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder) + "/"):
            held.append(target)
    return held


def test_a_conversion_error_aborts_the_files_waiting_for_their_commit(make_ckpt, tmp_path, monkeypatch):
    """A NaN found while finished files still wait for their commit (a slow fsync): the queued commits are cancelled,
    and those files were neither renamed nor aborted (their temporary files stayed, their descriptors open for the
    rest of the process). Every one is aborted now; the rerun is byte-identical to an uninterrupted run."""
    import threading

    import pytest

    from glmq.formats import safetensors_io
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize import ops

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    ref, out = tmp_path / "ref", tmp_path / "out"
    stream.run(plan, ref, progress=False)
    gate, commits = threading.Event(), []
    orig_commit, orig_q = safetensors_io.StreamingWriter.commit, ops.quantize_rows

    def slow_commit(self):  # every commit waits until the error: the files finished before it queue up
        commits.append(self.path.name)
        gate.wait(30)
        return orig_commit(self)

    calls = [0]

    def bad_q(*a, **k):
        calls[0] += 1
        if calls[0] == 40:
            gate.set()
            raise ValueError("NaN or Inf in rows [0]")
        return orig_q(*a, **k)

    monkeypatch.setattr(safetensors_io.StreamingWriter, "commit", slow_commit)
    monkeypatch.setattr(ops, "quantize_rows", bad_q)
    with pytest.raises(CheckpointError, match=r"NaN or Inf in rows \[0\]"):
        stream.run(plan, out, progress=False)
    assert commits  # one was running when the error came
    assert [p.name for p in out.iterdir() if p.name.endswith(safetensors_io.TMP_SUFFIX)] == []
    assert _open_under(out) == []
    monkeypatch.undo()
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)


def test_a_manifest_record_outside_the_plan_deletes_nothing(make_ckpt, tmp_path):
    """A record the plan does not write (an edited or foreign manifest, e.g. `../victim.txt`) failed its check and
    was unlinked as a file to redo: outside the folder too. It is dropped now, and nothing is deleted for it."""
    import json

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    stream.run(plan, out, progress=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    man = json.loads((out / "glmq_manifest.json").read_text())
    man["files"]["../victim.txt"] = next(iter(man["files"].values()))
    man["files"][str(victim)] = next(iter(man["files"].values()))
    (out / "glmq_manifest.json").write_text(json.dumps(man))
    report = stream.run(plan, out, progress=False)
    assert victim.read_text() == "keep me"
    assert report["files_skipped_resumed"] == len(plan.files)
    assert set(json.loads((out / "glmq_manifest.json").read_text())["files"]) == {f.name for f in plan.files}


def test_a_run_killed_while_saving_its_first_manifest_starts_again(make_ckpt, tmp_path):
    """Killed between writing the first manifest's temporary file and renaming it: the folder held only that file,
    and every rerun was refused as "not empty and holds no interrupted glmq run"."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    ref, out = tmp_path / "ref", tmp_path / "out"
    stream.run(plan, ref, progress=False)
    out.mkdir()
    (out / "glmq_manifest.json.glmq-tmp").write_text('{"identity": {')
    stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)


def _break_a_sampled_window(src: Path, plan, edit=lambda b: 0x7F) -> tuple[Path, bytes]:
    """Change a byte of a quantized FP8 weight inside one of its shard's sampled windows (the data sample sees it) to
    `edit(byte)`, by default 0x7F, an FP8 NaN. Returns (the shard, its bytes before)."""
    from glmq.formats.safetensors_io import read_header
    from glmq.formats.source import SAMPLE_BYTES, SAMPLE_WINDOWS
    from glmq.quantize.plan import Action

    for it in (i for i in reversed(plan.items) if i.action is Action.QUANTIZE and i.src.dtype == "F8_E4M3"):
        path = src / it.src.shard
        _, _, start = read_header(path)
        n = path.stat().st_size - start
        windows = [start + (n - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
        at = next((o for w in windows for o in range(w, w + SAMPLE_BYTES)
                   if start + it.src.begin <= o < start + it.src.end), None)
        if at is not None:
            good = path.read_bytes()
            data = bytearray(good)
            data[at] = edit(data[at])
            path.write_bytes(bytes(data))
            return path, good
    raise AssertionError("no quantized FP8 weight lies in a sampled window")


def test_a_shard_downloaded_again_after_a_corrupt_weight_resumes_redoing_only_its_files(make_ckpt, tmp_path):
    """Follow the NaN error's advice ("re-download the shard") and run again: when the corrupt byte lay in a sampled
    window, the run's identity had changed and the whole folder was refused, finished files and all; when it did not,
    the resume went on. Now either way the files of that shard alone are converted again (RTN), in a finished folder
    too; a GPTQ resume is refused naming the shard, without the `touch` advice for a copied source (its data did
    change)."""
    import os
    import shutil

    import pytest

    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize.output import OutputDirError, OutputLock, prepare_output

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    ref = tmp_path / "ref"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), ref, progress=False)
    shard, good = _break_a_sampled_window(src, make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000))
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"{shard.name}.*NaN or Inf"):
        stream.run(plan, out, progress=False)
    gptq, out_g = recipes.load("int4-w4a16").with_method("gptq"), tmp_path / "gptq"
    with OutputLock(out_g) as lock:  # a GPTQ run begun on the corrupt shard
        prepare_output(make_plan(open_source(src), gptq, 300_000), out_g, lock)
    mtime = shard.stat().st_mtime_ns
    shard.write_bytes(good)  # downloaded again
    os.utime(shard, ns=(mtime, mtime))  # its time as before: the data sample alone must tell
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    with pytest.raises(OutputDirError, match=f"{shard}: its data differs from the GPTQ run's") as e:
        with OutputLock(out_g) as lock:
            prepare_output(make_plan(open_source(src), gptq, 300_000), out_g, lock)
    assert "touch" not in str(e.value)
    report = stream.run(plan, out, progress=False)
    assert _files(out) == _files(ref)
    assert 0 < report["files_skipped_resumed"] < len(plan.files)
    # a finished folder over a shard whose data changed, its time kept: that shard's files alone are converted again
    mtime = shard.stat().st_mtime_ns
    shard, _ = _break_a_sampled_window(src, plan, edit=lambda b: b ^ 0x80)  # the sign: still finite
    os.utime(shard, ns=(mtime, mtime))
    edited = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    ref2 = tmp_path / "ref2"
    stream.run(edited, ref2, progress=False)
    report = stream.run(edited, out, progress=False)
    assert report["files_skipped_resumed"] == sum(shard.name not in f.source_shards() for f in plan.files)
    assert _files(out) == _files(ref2)


def test_an_output_folder_that_refuses_writes_gets_advice(make_ckpt, tmp_path, monkeypatch):
    """The first write into the folder (the manifest) failing, e.g. a read-only folder: a bare `[Errno 13] Permission
    denied: '.../glmq_manifest.json.glmq-tmp'` before; now the folder, the reason and what to do, and no file left."""
    import errno

    import pytest

    from glmq.quantize.output import OutputDirError

    import os

    def full(fd):  # the manifest's temporary file is written, then its fsync finds the disk full
        raise OSError(errno.ENOSPC, "No space left on device")

    plan = make_plan(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputDirError, match=r"out: cannot write into the output folder \(No space left on device\); "
                                             r"fix its permissions or free space, or choose another --output"):
        stream.run(plan, out, progress=False)
    assert list(out.iterdir()) == []  # the temporary file too
    monkeypatch.undo()
    stream.run(plan, out, progress=False)  # and the rerun starts


def test_what_the_resume_check_says_of_older_and_foreign_manifests(make_ckpt, tmp_path, monkeypatch):
    """A manifest of the glmq before the per-shard samples (its source digest covered them; it records none) is named
    as an earlier glmq's, not as another source; a GPTQ manifest without a calibration record, resumed with one, is
    refused (it was a KeyError); a rank whose copy of the source holds other data than rank 0's is refused (the data
    samples left the identity that the ranks compare)."""
    import json
    import shutil

    import pytest

    from glmq.formats.manifest import MANIFEST_NAME, Manifest
    from glmq.quantize import dist
    from glmq.quantize.output import OutputDirError, OutputLock, prepare_output

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "old"
    with OutputLock(out) as lock:
        prepare_output(plan, out, lock)
    man = json.loads((out / MANIFEST_NAME).read_text())
    del man["source_samples"]
    man["identity"]["source_digest"] = "0" * 64
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    with pytest.raises(OutputDirError, match="holds a run of an earlier glmq, which identified the source otherwise"):
        with OutputLock(out) as lock:
            prepare_output(plan, out, lock)

    gptq = make_plan(open_source(src), recipes.load("int4-w4a16").with_method("gptq"), 300_000)
    out = tmp_path / "gptq"
    with OutputLock(out) as lock:
        prepare_output(gptq, out, lock)
    with pytest.raises(OutputDirError, match=r"differs in: calibration\)"):
        with OutputLock(out) as lock:
            prepare_output(gptq, out, lock, calibration={"tokens_sha256": "a"})

    other = tmp_path / "other"  # rank 1's node-local copy: another model of the same layout
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block", seed=1), other)
    out = tmp_path / "dist"
    with OutputLock(out) as lock:  # rank 0's part
        prepare_output(plan, out, lock)
    monkeypatch.setattr(dist.World, "on_lead", lambda self, step, fn, share=False: Manifest.load(out))
    world = dist.World(rank=1, size=2, local_rank=1, device="cpu")
    with pytest.raises(dist.RankFailure, match=r"rank 1 failed on planning: this rank's copy of .*other/model-00001-of-"
                                               r".* holds other data than rank 0's \(7 shard\(s\) differ\)"):
        prepare_output(make_plan(open_source(other), recipes.load("int4-w4a16"), 300_000), out, OutputLock(out), world)
    prepare_output(plan, out, OutputLock(out), world)  # the same source: fine


def test_a_rerun_of_a_finished_folder_keeps_the_conversions_report(make_ckpt, tmp_path):
    """Re-running a finished conversion (README: it re-checks and repairs) replaced glmq_report.json with its own
    figures: 0 bytes processed, its seconds and peak memory, which `glmq upload` then published as the conversion's."""
    import json

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    first = stream.run(plan, out, progress=False)
    again = stream.run(plan, out, progress=False)  # its own figures, to the terminal and --json
    assert again["files_skipped_resumed"] == len(plan.files) and again["bytes_in_processed"] == 0
    assert "keeps the conversion's figures" in again["report_kept"]
    stored = json.loads((out / REPORT_NAME).read_text())
    assert {k: v for k, v in stored.items() if k != "rechecks"} == json.loads(json.dumps(first))
    (check,) = stored["rechecks"]
    assert check["files_rechecked"] == len(plan.files) and check["seconds"] == again["seconds"]
    (out / next(iter(json.loads((out / "glmq_manifest.json").read_text())["files"]))).unlink()
    repaired = stream.run(plan, out, progress=False)  # a file converted again: this run's figures, stored
    assert repaired["files_skipped_resumed"] == len(plan.files) - 1 and "report_kept" not in repaired
    assert json.loads((out / REPORT_NAME).read_text()) == json.loads(json.dumps(repaired))


def test_a_finished_folder_is_not_taken_apart_for_a_shard_that_became_corrupt(make_ckpt, tmp_path):
    """A finished folder whose source shard changed is converted again for that shard's files; when the new data held
    a NaN, the run deleted config.json, the index and those files first and then stopped on the NaN: a valid
    checkpoint lost, nothing in its place. Now the changed shards are scanned first and the folder is left as it is."""
    import shutil

    import pytest

    from glmq.quantize.output import OutputDirError

    src = tmp_path / "src"
    shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), src)
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    stream.run(plan, out, progress=False)
    before = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    shard, good = _break_a_sampled_window(src, plan)  # an FP8 NaN
    edited = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    with pytest.raises(OutputDirError, match=rf"{shard.name}: tensor .* holds NaN or Inf .* which is left as it is"):
        stream.run(edited, out, progress=False)
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == before
    shard.write_bytes(good)  # downloaded again: the same data as the finished folder's, at a new time
    report = stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), out, progress=False)
    # (its time moved since the run finished: its files are converted again, to the same bytes)
    assert report["files_skipped_resumed"] == sum(shard.name not in f.source_shards() for f in plan.files)
    assert _files(out) == {n: b for n, b in before.items() if n in _files(out)} and len(_files(out)) == len(before) - 2


def test_a_resume_refused_for_another_recipe_names_the_setting_and_both_values(make_ckpt, tmp_path):
    """The refusal said "differs in: recipe" when only the recipe's name (or one setting) had changed: the user could
    not see what to put back. It names the recipe's keys with their values then and now."""
    import dataclasses

    import pytest

    from glmq.quantize.output import OutputDirError, OutputLock, prepare_output

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000)
    out = tmp_path / "out"
    with OutputLock(out) as lock:
        prepare_output(plan, out, lock)
    other = dataclasses.replace(plan.recipe, name="mine", spec=dataclasses.replace(plan.recipe.spec, group_size=64))
    with pytest.raises(OutputDirError) as e:
        with OutputLock(out) as lock:
            prepare_output(dataclasses.replace(plan, recipe=other), out, lock)
    assert "(differs in: recipe.group_size: 128 then, 64 now; recipe.name: 'int4-w4a16' then, 'mine' now)" in str(e.value)


def test_resume_diff_names_a_key_one_side_lacks():
    """A key absent on one side and None on the other (a manifest of an older glmq without `recipe.tune_lr`) made the
    identities differ while the per-key diff found nothing: "differs in: " named nothing."""
    from glmq.quantize.output import _diff_lines

    assert _diff_lines({"recipe": {"name": "a"}}, {"recipe": {"name": "a", "tune_lr": None}}) == [
        "recipe.tune_lr: absent then, None now"]
    assert _diff_lines({"x": 1}, {}) == ["x: 1 then, absent now"]
    assert _diff_lines({"recipe": {"targets": ["a"]}}, {"recipe": {"targets": ["b"]}}) == ["recipe.targets"]
    assert _diff_lines({1: "a", "b": 2}, {"b": 3}) == ["1: 'a' then, absent now", "b: 2 then, 3 now"]
