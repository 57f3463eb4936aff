"""Several processes on one output folder: `glmq validate` of a folder that a `glmq quantize` is still writing, and a
`glmq quantize` started into a folder that `glmq validate` or `glmq upload` is reading.

The run's lock (quantize/output.OutputLock, an flock on the folder) conflicts between two open descriptions even in
one process, so the other process is played here by this one: the run is stopped at a chosen point by a hook and
the folder validated from inside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from glmq import recipes
from glmq.formats.source import open_source
from glmq.quantize import output as output_mod
from glmq.quantize import stream
from glmq.quantize import validate as v
from glmq.quantize.plan import make_plan


def _plan(make_ckpt):
    return make_plan(open_source(make_ckpt("glm4_moe", "fp8-block")), recipes.load("int4-w4a16"))


def _run_calling_at_config_json(make_ckpt, out: Path, monkeypatch, fn) -> list:
    """Convert into `out`, calling `fn()` once config.json is written (the run still holds the lock and the manifest
    is not complete); returns what the calls returned."""
    seen = []
    orig = output_mod.atomic_write_text

    def hooked(path, text):
        orig(path, text)
        if Path(path).name == "config.json":
            seen.append(fn())

    monkeypatch.setattr(output_mod, "atomic_write_text", hooked)
    stream.run(_plan(make_ckpt), out, progress=False)
    monkeypatch.setattr(output_mod, "atomic_write_text", orig)
    return seen


def test_validate_while_quantize_finishes_cannot_run(make_ckpt, tmp_path, monkeypatch):
    """config.json is written before the manifest says complete; a validate at that moment, while the run still
    holds the folder's lock, said INVALID (exit 1: "complete is false ... re-run the same glmq quantize", which the
    lock refuses) instead of "could not run" (exit 2), as it says for every other state of a folder being written."""
    out = tmp_path / "out"
    seen = []
    orig = output_mod.atomic_write_text

    def hooked(path, text):
        orig(path, text)
        if Path(path).name == "config.json":  # the run is live and holds the lock; the manifest is not complete
            try:
                rep = v.validate(out)
                seen.append(("report", rep.exit_code))
            except v.CannotValidate as e:
                seen.append(("cannot", str(e)))

    monkeypatch.setattr(output_mod, "atomic_write_text", hooked)
    stream.run(_plan(make_ckpt), out, progress=False)
    assert len(seen) == 1
    kind, what = seen[0]
    assert kind == "cannot", f"validate of a folder being written gave a verdict (exit {what})"
    assert "is writing into this folder" in what
    # the probe leaves no lock behind: the finished folder validates, and the same command resumes (re-locks) it
    monkeypatch.setattr(output_mod, "atomic_write_text", orig)
    assert v.validate(out).exit_code == 0
    stream.run(_plan(make_ckpt), out, progress=False)
    assert v.validate(out).exit_code == 0


def test_validate_during_quantize_exits_2_via_cli(make_ckpt, tmp_path, monkeypatch):
    """The CLI's exit code for it: 2 (could not run), never 0 or 1."""
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    out = tmp_path / "out"
    codes = _run_calling_at_config_json(make_ckpt, out, monkeypatch,
                                        lambda: CliRunner().invoke(main, ["validate", str(out)]).exit_code)
    assert codes == [2]


def test_upload_refuses_a_folder_being_written_even_with_allow_invalid(make_ckpt, tmp_path, monkeypatch):
    """`--allow-invalid` uploads a checkpoint validate could not check; a folder still being written is no checkpoint
    yet (its files are not all there): refused, exit 2, nothing uploaded."""
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    out = tmp_path / "out"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (r,) = _run_calling_at_config_json(make_ckpt, out, monkeypatch, lambda: CliRunner().invoke(
        main, ["upload", str(out), "--repo-id", "org/x", "--tp", "1", "--allow-invalid", "--dry-run"]))
    assert r.exit_code == 2 and "is writing into this folder" in r.output and "nothing was uploaded" in r.output, \
        r.output


READING = "a glmq validate or upload is reading this folder"


def _finished(make_ckpt, tmp_path) -> Path:
    out = tmp_path / "out"
    stream.run(_plan(make_ckpt), out, progress=False)
    return out


def _quantize_refused(make_ckpt, out: Path) -> str:
    """Start the same conversion into `out` (a finished folder: it would resume) and return why it was refused."""
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(output_mod.OutputDirError) as e:
        stream.run(_plan(make_ckpt), out, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched
    return str(e.value)


def test_quantize_is_refused_while_validate_reads_the_folder(make_ckpt, tmp_path, monkeypatch):
    """validate holds the folder's shared lock until its verdict: a quantize started meanwhile (one that would
    rewrite files: a changed source shard) used to delete and rewrite them under the scan, which still said VALID.
    Now the quantize is refused, naming the reader, and the verdict stands."""
    from glmq.quantize.validate import driver

    out = _finished(make_ckpt, tmp_path)
    refused = []
    scan = driver.scan_shards

    def scanning(*a, **kw):
        refused.append(_quantize_refused(make_ckpt, out))  # mid-scan
        return scan(*a, **kw)

    monkeypatch.setattr(driver, "scan_shards", scanning)
    assert v.validate(out).exit_code == 0
    assert len(refused) == 1 and READING in refused[0], refused
    monkeypatch.setattr(driver, "scan_shards", scan)
    stream.run(_plan(make_ckpt), out, progress=False)  # the lock is gone with the validate: the rerun resumes
    assert v.validate(out).exit_code == 0


def test_quantize_is_refused_while_upload_reads_the_folder(make_ckpt, tmp_path, monkeypatch):
    """glmq upload holds the shared lock from its gate to the end of its push (here: the dry run's listing), so the
    files it sends are the ones its gate validated."""
    from click.testing import CliRunner

    from glmq.scripts import upload
    from glmq.scripts.cli import main

    out = _finished(make_ckpt, tmp_path)
    refused = []
    listing = upload._print_listing

    def listing_then_quantize(*a, **kw):
        listing(*a, **kw)
        refused.append(_quantize_refused(make_ckpt, out))

    monkeypatch.setattr(upload, "_print_listing", listing_then_quantize)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(main, ["upload", str(out), "--repo-id", "org/x", "--tp", "1", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert len(refused) == 1 and READING in refused[0], refused


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-x", "-q"]))
