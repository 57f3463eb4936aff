"""Exit codes the commands share: 2 where a command could not start as asked (an option's value, a path, the working
folder), 1 where it ran and failed (validate: invalid; eval: a figure not finite; quantize/plan: the source's or the
output folder's content). A CI step reads 1 from `glmq quantize --recipe typo` as "the conversion failed"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from glmq.scripts import cli
from glmq.scripts.cli import main


@pytest.fixture
def src(make_ckpt):
    return make_ckpt("glm_moe_dsa")


def _run(args):
    return CliRunner().invoke(main, args)


def test_an_option_value_quantize_cannot_use_is_exit_2_and_nothing_is_written(src, tmp_path):
    out = tmp_path / "out"
    src = Path(shutil.copytree(src, tmp_path / "src"))
    cli._add_builtin_tokenizer(src)  # (GPTQ's checks of the text come after its tokenizer's)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "calib.txt").write_text("some text " * 200)
    cases = [
        (["-m", str(tmp_path / "nowhere")], "no such folder; --model takes a checkpoint folder"),
        (["-m", str(tmp_path / "afile")], "not a directory; --model takes a checkpoint folder"),
        (["-m", str(src), "--recipe", "nope"], "recipe 'nope': no such file and not a shipped recipe"),
        (["-m", str(src), "--max-shard-size", "5G"], "--max-shard-size '5G': expected a positive size"),
        (["-m", str(src), "-o", ""], "an empty folder name"),
        (["-m", str(src), "-o", str(tmp_path / "afile")], "exists and is not a directory; choose another --output"),
        (["-m", str(src), "--scheme", "gptq", "--calibration", str(tmp_path / "none.txt")], "none.txt: no such file"),
        (["-m", str(src), "--scheme", "gptq", "--calibration", str(tmp_path / "calib.txt"), "--seq-len", "100000"],
         "--seq-len 100000 is longer than the model's max_position_embeddings"),
        (["-m", str(src), "--scheme", "gptq", "--calibration", str(tmp_path / "calib.txt"), "--all-token-limit",
          "nan"], "nan is not a number"),
    ]
    for args, needle in cases:
        res = _run(["quantize", "--no-progress", *(["-o", str(out)] if "-o" not in args else []), *args])
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert needle in res.output, (args, res.output)
        assert "Traceback" not in res.output
        assert not out.exists(), args  # refused before any work


def test_plan_and_validate_refuse_unusable_option_values_with_2(src, tmp_path):
    for args, needle in [
        (["plan", "-m", str(tmp_path / "nowhere")], "no such folder"),
        (["plan", "-m", str(src), "--recipe", "nope"], "recipe 'nope'"),
        (["plan", "-m", str(src), "--throughput", "nope=1"], "unknown --throughput key"),
        (["validate", str(src), "--sample", "nan"], "nan is not a number"),
        (["upload", str(src), "--repo-id", "org/name", "--dry-run", "--sample", "nan"], "nan is not a number"),
    ]:
        res = _run(args)
        assert res.exit_code == 2 and needle in res.output, (args, res.output, res.exception)


def test_a_source_whose_content_fails_is_still_exit_1(src, tmp_path):
    """What the files hold is the command's own failure (1), not a usage error."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for cmd in (["quantize", "--no-progress", "-o", str(tmp_path / "out")], ["plan"]):
        res = _run([*cmd, "-m", str(bad)])
        assert res.exit_code == 1 and res.output.startswith(("error: ", "warning")), (cmd, res.output)


def test_a_builtin_that_cannot_be_generated_is_could_not_run(tmp_path, monkeypatch):
    """A working folder glmq cannot write its built-in cache into (here `.glmq-cache` under a file, as a read-only
    folder is for root): validate --source builtin:... and eval's builtin SOURCE gave a traceback and exit 1
    (validate's "invalid", eval's "a figure is not finite") and no --json report; quantize and plan a traceback's
    last line. Now exit 2 with one message naming the folder and what to do."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(cli, "DEFAULT_CACHE", tmp_path / "afile" / ".glmq-cache")
    report = tmp_path / "v.json"
    report.write_text('{"valid": true}')  # an earlier run's verdict, which must not survive
    (tmp_path / "ck").mkdir()
    (tmp_path / "eval.txt").write_text("text " * 100)
    for args in (["validate", str(tmp_path / "ck"), "--source", "builtin:glm5-tiny", "--json", str(report)],
                 ["eval", "builtin:glm5-tiny", "--text", str(tmp_path / "eval.txt")],
                 ["quantize", "--no-progress", "-o", str(tmp_path / "out")],
                 ["plan"]):
        res = _run(args)
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert "cannot generate the built-in glm5-tiny checkpoint in" in res.output, (args, res.output)
        assert "run glmq from a folder it can write to" in res.output
    assert json.loads(report.read_text())["exit_code"] == 2


def test_a_report_path_that_would_replace_a_file_of_a_model_is_refused(src, tmp_path):
    """`--json SRC/config.json` (or a shard, or a snapshot's link into blobs/) overwrote the model with the report and
    exited 0. A report may go into a model folder under a name of its own (upload leaves such reports out), and
    replaces a link in its place instead of writing through it."""
    src = Path(shutil.copytree(src, tmp_path / "src"))
    shard = sorted(src.glob("*.safetensors"))[0]
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    snap = tmp_path / "snap"
    shutil.copytree(src, snap)
    (snap / shard.name).unlink()
    shutil.copy(shard, blob)
    (snap / shard.name).symlink_to(blob)
    before = {p: p.read_bytes() for p in [*src.iterdir(), blob] if p.is_file()}
    out = tmp_path / "out"
    out.mkdir()  # (empty: the run would write config.json there before the report)
    for cmd, path in [(["plan", "-m", str(src)], src / "config.json"),
                      (["plan", "-m", str(src)], src / "tokenizer_config.json"),
                      (["plan", "-m", str(src)], snap / shard.name),
                      (["validate", str(src)], src / shard.name),
                      (["validate", str(src)], src / "model.safetensors.index.json"),
                      (["quantize", "--no-progress", "-m", str(src), "-o", str(out)], out / "config.json"),
                      (["quantize", "--no-progress", "-m", str(src), "-o", str(out)], out / "glmq_manifest.json")]:
        res = _run([*cmd, "--json", str(path)])
        assert res.exit_code == 2, (cmd, path, res.output, res.exception)
        assert "choose another path" in res.output and ("a file of the model" in res.output
                                                        or "is a weights file" in res.output), res.output
    assert {p: p.read_bytes() for p in before} == before
    assert not any(out.iterdir())
    res = _run(["plan", "-m", str(src), "--json", str(src / "plan.json")])  # a name of its own: fine
    assert res.exit_code == 0 and json.loads((src / "plan.json").read_text())
    (tmp_path / "report.json").symlink_to(blob)  # a link that leads to a blob under a name of no kind
    res = _run(["plan", "-m", str(src), "--json", str(tmp_path / "report.json")])
    assert res.exit_code == 0 and not (tmp_path / "report.json").is_symlink()  # replaced, not written through
    assert blob.read_bytes() == shard.read_bytes()


def test_an_output_that_is_a_dangling_link_is_named_as_one(src, tmp_path):
    """Was "cannot create the output folder: File exists" (mkdir of a link whose target is gone)."""
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    res = _run(["quantize", "--no-progress", "-m", str(src), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert f"out: a link to {tmp_path / 'gone'}, which does not exist; choose another --output" in res.output
    (tmp_path / "afile").write_text("x")
    res = _run(["quantize", "--no-progress", "-m", str(src), "-o", str(tmp_path / "afile" / "out")])
    assert res.exit_code == 2 and "afile is a file, not a directory" in res.output, res.output
    res = _run(["quantize", "--no-progress", "-m", "", "-o", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "--model '': an empty folder name" in res.output, res.output
    from glmq.quantize.output import _prepare_output  # the writer's own message, for the Python API
    with pytest.raises(Exception, match="out: a link to .*which does not exist"):
        _prepare_output(None, tmp_path / "out", None, {})


def test_a_report_may_replace_a_config_json_that_is_no_model_s(src, tmp_path, monkeypatch):
    """A project folder's own config.json (no model_type, no architectures, no weights beside it) is the user's to
    replace; only a model's files are kept from a report."""
    (tmp_path / "config.json").write_text('{"ci": true}')
    monkeypatch.chdir(tmp_path)
    res = _run(["plan", "-m", str(src), "--json", "config.json"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "config.json").read_text()) != {"ci": True}  # the plan's summary now


def test_reports_of_their_own_name_go_into_a_model_folder(src, tmp_path):
    """glmq_eval.json (upload's EVAL_NAME, read from the checkpoint folder) and any report name of the user's own are
    welcome in a model folder; a report name at the file system's length limit is written (the temporary name is
    short), and the file gets the umask's mode, as any file the user writes."""
    import os

    umask = os.umask(0)
    os.umask(umask)

    from glmq.scripts.upload import EVAL_NAME

    src = Path(shutil.copytree(src, tmp_path / "src"))
    for name in (EVAL_NAME, "glmq_validate.json", "tokenizer_stats.json", "r" * 250 + ".json"):
        assert cli.replaces_model_file(str(src / name)) is None, name
        res = _run(["plan", "-m", str(src), "--json", str(src / name)])
        assert res.exit_code == 0 and json.loads((src / name).read_text()), (name, res.output)
        assert (src / name).stat().st_mode & 0o777 == 0o666 & ~umask
    assert not [p for p in src.iterdir() if p.name.startswith(".glmq-report-")]
    assert cli.replaces_model_file(str(src / "tokenizer.json")) and cli.replaces_model_file(str(src / "x.safetensors"))
    assert os.path.exists(src / "config.json")


def test_a_report_over_a_file_in_a_read_only_folder_is_refused_before_the_work(src, tmp_path, monkeypatch):
    """A report replaces its file through a temporary name beside it: the folder must be writable even where the file
    is (a writable report in a read-only folder failed after the run, exit 2; os.access is stood in for, as root may
    write anywhere)."""
    import os

    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "plan.json").write_text("{}")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro" else real(p, mode))
    res = _run(["plan", "-m", str(src), "--json", str(tmp_path / "ro" / "plan.json")])
    assert res.exit_code == 2 and f"folder {tmp_path / 'ro'} is not writable, and the file is replaced" in res.output
    assert (tmp_path / "ro" / "plan.json").read_text() == "{}"


def test_a_report_through_a_link_needs_the_links_own_folder_writable(src, tmp_path, monkeypatch):
    """The link is replaced in its own folder: a link in a writable folder to a file in a read-only one is fine, a
    link in a read-only folder is refused before the work (the target's folder was checked instead)."""
    import os

    for d in ("ro", "rw"):
        (tmp_path / d).mkdir()
    (tmp_path / "ro" / "target.json").write_text("{}")
    (tmp_path / "rw" / "real.json").write_text("{}")
    (tmp_path / "rw" / "link.json").symlink_to(tmp_path / "ro" / "target.json")
    (tmp_path / "ro" / "link2.json").symlink_to(tmp_path / "rw" / "real.json")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro" else real(p, mode))
    res = _run(["plan", "-m", str(src), "--json", str(tmp_path / "rw" / "link.json")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ro" / "target.json").read_text() == "{}" and not (tmp_path / "rw" / "link.json").is_symlink()
    res = _run(["plan", "-m", str(src), "--json", str(tmp_path / "ro" / "link2.json")])
    assert res.exit_code == 2 and f"folder {tmp_path / 'ro'} is not writable" in res.output, res.output
