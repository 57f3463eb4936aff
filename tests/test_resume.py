"""Killing a run at random points and re-running gives output byte-identical to an uninterrupted run."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from glmq import recipes
from glmq.formats.manifest import REPORT_NAME
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
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != REPORT_NAME}


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
