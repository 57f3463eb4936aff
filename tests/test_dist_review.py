"""Review of the distributed run's records: rank fragments and their journals after a crash at the worst moment."""

from __future__ import annotations

import pathlib
import shutil
from pathlib import Path

import pytest

from glmq import recipes
from glmq.formats import manifest
from glmq.formats.manifest import REPORT_NAME, Manifest, fragment_name
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != REPORT_NAME}


def test_a_kill_while_a_fragment_is_removed_leaves_nothing_behind(make_ckpt, tmp_path, monkeypatch):
    """A run killed between the two deletions of `manifest.remove` (the rank fragment's file and its journal) must
    leave something the next run finds and removes: before, the fragment went first and its journal, which
    FRAGMENT_GLOB does not match, stayed in the finished checkpoint of every later single-process run."""
    plan = make_plan(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), recipes.load("int4-w4a16"), 2_000_000)
    ref = tmp_path / "ref"
    stream.run(plan, ref, progress=False)

    # the folder of a distributed run whose rank 0 died after converting every file: records in its fragment only
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    done = Manifest.load(out)
    for name in ("config.json", "model.safetensors.index.json", REPORT_NAME):
        (out / name).unlink()
    frag = Manifest(done.identity)
    frag.save(out, fragment_name(0))
    for name, rec in done.files.items():
        frag.append(out, name, rec, fragment_name(0))
    Manifest(done.identity).save(out)

    # the next run absorbs the fragment, saves the manifest, and is killed after the first of remove's two unlinks
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if self.name.startswith("glmq_manifest.rank"):
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        stream.run(plan, out, progress=False)
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)

    rep = stream.run(plan, out, progress=False)
    assert rep["files_skipped_resumed"] == len(plan.files)  # nothing finished is converted again
    assert not [p.name for p in out.iterdir() if p.name.startswith("glmq_manifest.rank")]
    assert _files(out) == _files(ref)  # the manifest included, byte for byte


def test_remove_deletes_the_journal_before_the_manifest(tmp_path, monkeypatch):
    """The order that makes the test above hold, on its own: what a kill in between leaves is the fragment."""
    Manifest({"a": 1}).save(tmp_path, fragment_name(3))
    Manifest({"a": 1}).append(tmp_path, "x.safetensors", {"bytes": 1}, fragment_name(3))
    gone = []
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        gone.append(self.name)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        manifest.remove(tmp_path, fragment_name(3))
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    assert gone == [manifest.journal_name(fragment_name(3))]
    assert [p.name for p in tmp_path.glob(manifest.FRAGMENT_GLOB)] == [fragment_name(3)]


def test_a_rank_that_cannot_write_its_fragment_is_named(make_ckpt, tmp_path, monkeypatch):
    """A rank other than 0 whose manifest fragment could not be written (a full disk, a read-only mount) raised a bare
    OSError: the CLI printed a traceback naming no rank. It is a RankFailure naming the rank and the step now."""
    from glmq.quantize import dist

    plan = make_plan(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), recipes.load("int4-w4a16"), 2_000_000)
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(stream, "prepare_output", lambda plan, out, lock, world, calibration: Manifest({}))

    def full(self, out, name):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Manifest, "save", full)
    world = dist.World(rank=1, size=2, local_rank=1, device="cpu")
    with pytest.raises(dist.RankFailure, match=r"rank 1 failed on writing its manifest fragment in .*No space left"):
        stream.run(plan, tmp_path / "out", progress=False, world=world)
