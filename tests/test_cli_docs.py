"""The user's path through README.md and `--help`: what they promise is what the commands do.

Each test here is a mismatch a user met following the README: an option the README names that the command
lacked, a default output name that the next command reads as options, an option silently ignored, a message
that does not say which option is wrong, a built-in model that one interrupted (or parallel) run broke for good.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from glmq.scripts import cli
from glmq.scripts.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# flags the README gives to other programs (torchrun, vLLM, SGLang, pip, the benchmark scripts)
NOT_GLMQ = {"--nproc-per-node", "--tensor-parallel-size", "--model-path", "--tune", "--heuristic", "--extra-shapes",
            "--alternates", "--ladder"}  # torchrun's, vLLM's, SGLang's, scripts/probe_decode.py's, sass_digest.py's
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def options(command: str) -> set[str]:
    cmd = main.commands[command]
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts} | {"--help"}


def readme_command_lines() -> list[tuple[str, str]]:
    """(command, line) of every `glmq <command> ...` in the README's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        m = re.search(r"(?:^|-m )glmq (\w+)", line.split("#")[0])
        if m and m[1] in main.commands:
            found.append((m[1], line.split("#")[0]))
    return found


def test_readme_command_lines_use_options_the_commands_have():
    lines = readme_command_lines()
    assert {c for c, _ in lines} >= {"quantize", "plan", "validate", "recipes", "eval", "upload"}, lines
    for command, line in lines:
        missing = set(FLAG.findall(line)) - options(command) - NOT_GLMQ
        assert not missing, f"README: `{line.strip()}` uses {sorted(missing)}, which `glmq {command}` does not have"


def test_every_flag_the_readme_names_is_an_option_of_some_command():
    known = set().union(*(options(c) for c in main.commands)) | NOT_GLMQ | {"--version", "--verbose"}
    named = set(FLAG.findall(README))
    assert "--experts-per-pass" in named  # the GPTQ memory bound the README and `glmq plan` describe
    assert not named - known, sorted(named - known)


def test_the_script_flags_the_readme_names_are_those_scripts_options():
    root = Path(__file__).resolve().parents[1]
    for script, flags in (("probe_decode.py", ("--tune", "--heuristic", "--extra-shapes")),
                          ("sass_digest.py", ("--alternates", "--ladder"))):
        text = subprocess.run([sys.executable, str(root / "scripts" / script), "--help"], capture_output=True,
                              text=True, check=True).stdout
        assert all(f in text for f in flags), (script, [f for f in flags if f not in text])


# ----------------------------------------------------------------------------------------- --max-shard-size
@pytest.mark.parametrize("text", ["5G", "abc", "0", "-5GB", "inf"])
def test_a_wrong_max_shard_size_names_the_option_and_the_spellings(tmp_path, text):
    """Was `error: invalid literal for int() with base 10: '5G'` (or `max_shard_bytes must be positive`). A usage
    error: exit 2, as click's own (it was 1, the code of a conversion that failed)."""
    out = tmp_path / "out"
    for args in (["quantize", "-o", str(out), "--no-progress"], ["plan"]):
        r = CliRunner().invoke(main, [*args, "-m", str(tmp_path / "no-model"), "--max-shard-size", text])
        assert r.exit_code == 2 and r.output.startswith("error: "), (r.output, r.exception)
        assert f"--max-shard-size {text!r}: expected a positive size such as 5GB" in r.output, r.output
    assert not out.exists()


def test_max_shard_size_spellings_the_help_and_the_card_use():
    assert cli.parse_size("5GB") == 5 * 10**9 and cli.parse_size("4 GiB") == 4 * 2**30
    assert cli.parse_size("500mb") == 500 * 10**6 and cli.parse_size("1234") == 1234 and cli.parse_size("2.5KB") == 2500


# ----------------------------------------------------------------------------------------- default --output
def test_default_output_is_the_folder_name_without_fp8_in_any_case(tmp_path, monkeypatch):
    src = tmp_path / "GLM-5-FP8"
    src.mkdir()
    assert cli.default_output(src, "int4-w4a16") == Path("GLM-5-int4-w4a16")  # was GLM-5-FP8-int4-w4a16
    assert cli.default_output(tmp_path / "glm5-tiny-fp8", "int4-w4a16") == Path("glm5-tiny-int4-w4a16")
    (tmp_path / "Kimi-K2").symlink_to(src)  # a link's own name, as before
    assert cli.default_output(tmp_path / "Kimi-K2", "int4-w4a16") == Path("Kimi-K2-int4-w4a16")
    monkeypatch.chdir(src)
    assert cli.default_output(Path("."), "int4-w4a16") == Path("GLM-5-int4-w4a16")  # was "-int4-w4a16"
    (src / "sub").mkdir()
    monkeypatch.chdir(src / "sub")
    assert cli.default_output(Path(".."), "g32") == Path("GLM-5-g32")  # was "..-g32"


def test_quantize_dot_writes_a_folder_the_next_command_can_name(make_ckpt, tmp_path):
    """`glmq quantize -m .` inside the source folder wrote `-int4-w4a16`, which `glmq validate -int4-w4a16`
    reads as options (`No such option: -i`)."""
    src = Path(shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), tmp_path / "Tiny-FP8"))
    r = subprocess.run([sys.executable, "-m", "glmq", "quantize", "-m", ".", "--no-progress"], cwd=src,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (src / "Tiny-int4-w4a16" / "config.json").is_file() and not (src / "-int4-w4a16").exists()
    assert "wrote Tiny-int4-w4a16 " in r.stdout


# ----------------------------------------------------------------------------------------- GPTQ options
@pytest.mark.parametrize("extra", [["--calibration", "calib.txt"], ["--samples", "8", "--true-sequential"],
                                   ["--experts-per-pass", "4"]])
def test_gptq_options_with_an_rtn_recipe_are_refused_not_dropped(make_ckpt, tmp_path, extra):
    """`glmq quantize --calibration calib.txt` without --scheme gptq wrote an RTN checkpoint, exit 0."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")), "-o", str(out),
                                  "--no-progress", *extra])
    assert r.exit_code == 2, r.output
    assert "GPTQ option(s), but recipe 'int4-w4a16' (method: rtn) is round-to-nearest; add --scheme gptq" in r.output
    assert extra[0] in r.output and not out.exists()


def test_gptq_recipe_without_calibration_names_the_recipe_not_scheme(make_ckpt, tmp_path):
    recipe = tmp_path / "g.yaml"
    recipe.write_text("name: g\ntargets: [routed_expert]\nmethod: gptq\n")
    r = CliRunner().invoke(main, ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")), "-r", str(recipe),
                                  "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and "recipe 'g' (method: gptq) needs --calibration" in r.output, r.output


def test_experts_per_pass_reaches_the_calibration(make_ckpt, tmp_path, monkeypatch):
    """README and `glmq plan --experts-per-pass` describe the Hessian bound; `glmq quantize` had no such option."""
    from glmq.calibration import engine

    seen = {}

    def capture(plan, out, settings, **kw):
        seen["settings"] = settings
        raise RuntimeError("captured")

    monkeypatch.setattr(engine, "run_gptq_from_text", capture)
    (tmp_path / "calib.txt").write_text("text " * 100)
    args = ["quantize", "-m", str(make_ckpt("glm4_moe", "fp8-block")), "-o", str(tmp_path / "out"), "--scheme", "gptq",
            "--calibration", str(tmp_path / "calib.txt"), "--no-progress"]
    CliRunner().invoke(main, [*args, "--experts-per-pass", "5"])
    assert seen["settings"].experts_per_pass == 5
    assert "experts_per_pass" not in seen["settings"].identity()  # changes no bit: a resume may change it
    CliRunner().invoke(main, args)
    assert seen["settings"].experts_per_pass is None  # the default: every expert of a layer at once
    r = CliRunner().invoke(main, [*args, "--experts-per-pass", "0"])
    assert r.exit_code == 2 and "--experts-per-pass" in r.output


# ----------------------------------------------------------------------------------------- the built-in model
@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A working directory without .glmq-cache; the path the built-in glm4-tiny lands at."""
    monkeypatch.chdir(tmp_path)
    return cli.DEFAULT_CACHE / "glm4-tiny-fp8"


def test_an_interrupted_generation_of_the_builtin_leaves_nothing_half(cache, monkeypatch):
    """Ctrl-C while the first `glmq quantize` generated the built-in left a half folder without config.json, and
    every later run stopped at `... is not empty; make_checkpoint writes into a new or empty directory`."""
    from glmq.formats import fixtures

    real = fixtures.make_checkpoint

    def interrupted(out, *a, **kw):
        Path(out).mkdir(parents=True)
        (Path(out) / "model-00001-of-00007.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fixtures, "make_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.resolve_model("builtin:glm4-tiny")
    assert not cache.exists() and list(cli.DEFAULT_CACHE.iterdir()) == []
    monkeypatch.setattr(fixtures, "make_checkpoint", real)
    assert (cli.resolve_model("builtin:glm4-tiny") / "config.json").is_file()


def test_a_half_builtin_left_by_an_older_glmq_is_replaced(cache):
    cache.mkdir(parents=True)
    (cache / "model-00001-of-00007.safetensors").write_bytes(b"half")
    path = cli.resolve_model("builtin:glm4-tiny")
    assert path == cache and (path / "config.json").is_file()
    assert (path / "model-00001-of-00007.safetensors").stat().st_size > 4
    assert [p.name for p in cli.DEFAULT_CACHE.iterdir()] == [cache.name]  # nothing aside left behind


def test_ranks_generating_the_builtin_at_once_share_the_first_whole_one(cache, monkeypatch):
    """`torchrun ... -m glmq quantize` on the default model: every rank generated into the same folder, and a
    rank failed with `... is not empty` (or read a half-written checkpoint)."""
    from glmq.formats import fixtures

    real = fixtures.make_checkpoint

    def other_rank_first(out, *a, **kw):
        real(cache, *a, **kw)  # another rank's generation completes and is placed first
        (cache / "other-rank").write_text("mine")
        return real(out, *a, **kw)

    monkeypatch.setattr(fixtures, "make_checkpoint", other_rank_first)
    path = cli.resolve_model("builtin:glm4-tiny")
    assert (path / "other-rank").read_text() == "mine" and (path / "config.json").is_file()
    assert [p.name for p in cli.DEFAULT_CACHE.iterdir()] == [cache.name]


@pytest.mark.parametrize("name", ["glm5-tiny", "deepseek-v3-tiny"])
def test_builtin_mla_models_pass_validate_under_every_shipped_recipe(name, tmp_path, monkeypatch):
    """The tiny preset's kv_a_proj_with_mqa has 160 rows, which no Marlin tile divides: `glmq quantize --recipe
    int4-w4a16-all-linear` on the built-in model gave a checkpoint `glmq validate` called INVALID at tp 1."""
    from glmq import recipes

    monkeypatch.chdir(tmp_path)
    for recipe in recipes.available():
        out = tmp_path / recipe
        r = CliRunner().invoke(main, ["quantize", "-m", f"builtin:{name}", "--recipe", recipe, "-o", str(out),
                                      "--no-progress"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(main, ["validate", str(out)])
        assert r.exit_code == 0, r.output


def test_default_output_of_a_gptq_run_is_its_own_folder(tmp_path):
    """An RTN run and a `--scheme gptq` run of one recipe are different outputs: the GPTQ one defaults to
    `<model>-<recipe>-gptq` (it was the RTN folder, where the run was refused as another recipe/calibration); a
    recipe whose name says gptq keeps its name."""
    src = tmp_path / "GLM-5-FP8"
    assert cli.default_output(src, "int4-w4a16", "rtn") == Path("GLM-5-int4-w4a16")
    assert cli.default_output(src, "int4-w4a16", "gptq") == Path("GLM-5-int4-w4a16-gptq")
    assert cli.default_output(src, "int4-GPTQ-g32", "gptq") == Path("GLM-5-int4-GPTQ-g32")
