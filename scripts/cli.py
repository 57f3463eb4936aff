"""`glmq` command line: parse options, build the objects, call one function per command."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from glmq import __version__

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "builtin:glm5-tiny"
DEFAULT_CACHE = Path(".glmq-cache")
# The built-in models are servable at tp 1 under every shipped recipe: rope 64 gives the MLA's kv_a_proj_with_mqa
# 128 + 64 = 192 rows (the tiny preset's 160 fails Marlin's 64-row rule under int4-w4a16-all-linear; GLM-5's is 576)
BUILTIN_OVERRIDES = {"glm_moe_dsa": {"qk_rope_head_dim": 64}, "deepseek_v3": {"qk_rope_head_dim": 64}}


def _out_file(ctx, param, value):
    """--json FILE, --plot FILE: the folder must exist, checked when the options are parsed (exit 2, one line),
    not when the file is written at the end of a run (a traceback after the work was done)."""
    if value is not None:
        import os

        if not value:  # `--json "$REPORT"` with the variable unset: no report would be written, and exit 0
            raise click.BadParameter("an empty file name; give the path of the file to write")
        if value == "-":  # not standard output: the terminal report goes there; a file named "-" would be a surprise
            raise click.BadParameter("- (standard output) is not supported: the terminal report goes there; give a "
                                     "file path, e.g. report.json (then `cat report.json`)")
        parent = Path(value).resolve().parent
        if not parent.is_dir():
            raise click.BadParameter(f"{value}: folder {parent} does not exist; create it or choose another path")
        if (why := replaces_model_file(value)) is not None:
            raise click.BadParameter(f"{value}: {why}; choose another path")
        own = Path(os.path.abspath(value)).parent  # where the file is written: a link is replaced in its own folder
        try:  # a name the file system refuses (longer than its limit): refused here too, not after the run
            os.stat(value)
        except FileNotFoundError:  # (a dangling link too)
            if not os.access(own, os.W_OK):  # a read-only mount or folder: refused before the work, not after it
                raise click.BadParameter(f"{value}: folder {own} is not writable; choose another path") from None
        except OSError as e:
            raise click.BadParameter(f"{value}: {e.strerror}; choose another path") from e
        else:
            if not os.access(value, os.W_OK):
                raise click.BadParameter(f"{value}: the file is not writable; choose another path")
            if not _special_path(value) and not os.access(own, os.W_OK):
                raise click.BadParameter(f"{value}: folder {own} is not writable, and the file is replaced "
                                         f"through a temporary name there; choose another path")
    return value


def _special_path(path: str) -> bool:
    """A device, pipe or /proc path (`--json /dev/stdout`, which leads to a regular file when stdout is redirected to
    one): written as it is, not replaced through a temporary name."""
    import os
    import stat

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True
    except FileNotFoundError:
        pass
    return any(p.startswith(("/dev/", "/proc/")) for p in (os.path.abspath(path), os.path.realpath(path)))


def _output_folder(ctx, param, value):
    """quantize's --output: not empty (`-o "$OUT"` with the variable unset would resume, or write into, the default
    folder), and not an existing file (refused here, exit 2, not by the writer after planning)."""
    if value is not None:
        if not value:
            raise click.BadParameter("an empty folder name; give the output folder, or leave --output out for the "
                                     "default")
        from glmq.quantize.output import output_folder_problem

        if (why := output_folder_problem(Path(value))) is not None:
            raise click.BadParameter(f"{value}: {why}; choose another --output")
    return value


def reject_nan(ctx, param, value):
    """click's FloatRange lets nan through (every comparison with it is false): a usage error (exit 2) here."""
    if value is not None and math.isnan(value):
        raise click.BadParameter("nan is not a number")
    return value


# Files a model folder consists of (a source, a glmq output, a Hugging Face snapshot): a report written over one of them
# destroyed the model and the command still exited 0 (`--json SRC/config.json`, or a shard through a snapshot's link
# into blobs/). glmq's own files, what vLLM/transformers read beside the weights (source.py copies them as side files)
# (exact names: a report of its own name, glmq_eval.json that `glmq upload` reads from the folder, is welcome there)
_MODEL_FILE_NAMES = {"config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json",
                     "preprocessor_config.json", "merges.txt", "README.md", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "chat_template.json",
                     "glmq_manifest.json", "glmq_manifest.journal.jsonl", "glmq_report.json"}
_MODEL_FILE_SUFFIXES = (".safetensors", ".py", ".jinja", ".model", ".tiktoken", ".bin", ".pt", ".pth")


def replaces_model_file(path: str, model_folder: Path | None = None) -> str | None:
    """Why writing a report to `path` would replace a file of a model (None if it would not): a weights file
    anywhere, or a file of a model folder's own kind (config, index, tokenizer, code, glmq's manifest and report) in
    a folder that holds a model (`_holds_model`; `model_folder`, whatever it holds now: quantize's output).
    Checked for the path as given and where a link leads."""
    import os

    for p in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):
        name = p.name
        if name.endswith(_MODEL_FILE_SUFFIXES[:1]):
            return f"{name} is a weights file (a report is JSON or PNG)" + (
                f", {path} leads to it" if p.name != Path(path).name else "")
        folder = p.parent
        output = model_folder is not None and folder in (Path(os.path.abspath(model_folder)),
                                                         Path(os.path.realpath(model_folder)))
        if not (output or _holds_model(folder)):
            continue
        if name in _MODEL_FILE_NAMES or name.endswith(_MODEL_FILE_SUFFIXES):
            return f"would replace {name}, a file of the model in {folder}"
    return None


def _holds_model(folder: Path) -> bool:
    """Safetensors files, or a config.json of a model (model_type or architectures): not a project folder whose own
    config.json a report may replace as asked."""
    if any(folder.glob("*.safetensors")):
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config)


def _write_file(path: str, write) -> None:
    """A report file, written by `write(name)`, under a temporary name, then renamed: no half report, and a link in its
    place is replaced, not followed (into a model's blobs/). A `_special_path` is written as it is. The temporary name
    is short: a report name at the file system's length limit has no room for a suffix."""
    import os

    from glmq.formats.safetensors_io import replaced_atomically

    if _special_path(path):
        write(Path(path))
        return
    with replaced_atomically(Path(path), Path(path).parent / f".glmq-report-{os.getpid()}") as tmp:
        write(tmp)


def _write_text(path: str, text: str) -> None:
    _write_file(path, lambda p: p.write_text(text))


def _write_out(path: str, content, done: str = "") -> None:
    """Write an output file (--json's text, or --plot's figure: a function of the name to write) at the end of a
    command; a refusal the option's check could not foresee (a full disk, a mount gone read-only) is exit 2 with one
    line naming it, not a traceback."""
    try:
        _write_file(path, content) if callable(content) else _write_text(path, content)
    except OSError as e:
        _fail(f"{path}: could not be written ({e.strerror or e}); free the space or choose another path{done}", code=2)


def _plot_file(ctx, param, value):
    """--plot FILE: `_out_file`'s checks, and matplotlib installed (without it the evaluation ran, said "no plot
    written" and exited 0: a CI step that asked for the PNG found none)."""
    value = _out_file(ctx, param, value)
    if value is not None:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise click.BadParameter(f"{value}: the plot needs matplotlib, which is not installed; "
                                     f"`pip install matplotlib`, or leave --plot out") from None
        kinds = FigureCanvasBase.get_supported_filetypes()  # its formats by file suffix (png, svg, pdf, jpg, ...)
        kinds.pop("pgf", None)  # (needs a LaTeX install: it failed after the evaluation)
        if (suffix := Path(value).suffix[1:].lower()) and suffix not in kinds:
            raise click.BadParameter(f"{value}: matplotlib writes no .{suffix} files; name it .png, or one of "
                                     f"{', '.join('.' + k for k in sorted(kinds) if k != 'png')}")
    return value


def _builtin_source(ctx, param, value):
    """`glmq validate --source`: a folder (a missing one is validate's own "could not run", exit 2 with its JSON), or
    `builtin:<name>`, the generated model `glmq quantize --model builtin:<name>` converted (generated again if its
    cache is gone)."""
    if not (value and value.startswith(BUILTIN_PREFIX)):
        return value
    try:
        return str(resolve_model(value))
    except (click.BadParameter, CannotStart) as e:  # resolve_model names --model; here it is --source or eval's
        raise click.BadParameter(e.message, ctx=ctx, param=param) from e      # SOURCE (validate: its JSON report)


def _source_folder(ctx, param, value):
    """`glmq eval SOURCE`: an existing folder, or `builtin:<name>` as `_builtin_source`."""
    return click.Path(exists=True, file_okay=False).convert(_builtin_source(ctx, param, value), param, ctx)


def _human_bytes(n: float) -> str:
    from glmq.formats.model_card import human_bytes

    return human_bytes(n, 1)  # the run summary's one decimal


def resolve_model(model: str) -> Path:
    """A checkpoint folder, or `builtin:<name>`: a tiny generated checkpoint with a real layout."""
    if not model.startswith(BUILTIN_PREFIX):
        return Path(model)
    name = model[len(BUILTIN_PREFIX):]
    builtins = {"glm5-tiny": "glm_moe_dsa", "glm4-tiny": "glm4_moe", "deepseek-v3-tiny": "deepseek_v3"}
    if name not in builtins:
        raise click.BadParameter(f"unknown built-in model {name!r}; choose one of {sorted(builtins)}", param_hint="--model")
    path = DEFAULT_CACHE / f"{name}-fp8"
    try:
        _generate_builtin(name, builtins[name], path)
    except OSError as e:  # a read-only working folder, or .glmq-cache a file: a traceback before (validate: exit 1)
        raise CannotStart(f"cannot generate the built-in {name} checkpoint in {DEFAULT_CACHE.resolve()} "
                          f"({e.strerror or e}); run glmq from a folder it can write to (the built-in models are "
                          f"generated into ./{DEFAULT_CACHE} there)") from e
    return path


def _generate_builtin(name: str, family: str, path: Path) -> None:
    """`resolve_model`'s built-in `name` (of `family`) generated into `path`, with its tokenizer, unless there."""
    from glmq.formats import fixtures

    if not (path / "config.json").exists():
        import contextlib
        import os
        import shutil
        import tempfile

        click.echo(f"generating the built-in {name} FP8 checkpoint ({family} layout) in {path}", err=True)
        # Generated in a folder of this process's own and renamed into place whole: an interrupted generation
        # leaves no half checkpoint that every later run refuses ("not empty"), and the ranks of `torchrun ...
        # glmq quantize` (each resolves the default model) do not write into one folder at once.
        DEFAULT_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=DEFAULT_CACHE))
        try:
            fixtures.make_checkpoint(tmp / "ckpt", family, preset="tiny", source_format="fp8-block",
                                     config_overrides=BUILTIN_OVERRIDES.get(family))
            for _ in range(2):
                with contextlib.suppress(OSError):  # the target exists: another rank's whole checkpoint, or a
                    os.rename(tmp / "ckpt", path)   # half one that an interrupted generation left in place
                if (path / "config.json").exists():
                    break
                with contextlib.suppress(OSError):  # the half one: moved aside (atomically), removed with tmp
                    os.rename(path, tmp / "stale")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not (path / "tokenizer.json").exists():
        _add_builtin_tokenizer(path)


def _add_builtin_tokenizer(path: Path) -> None:
    """A byte-level tokenizer.json for a built-in checkpoint (its tokenizer_config.json names
    PreTrainedTokenizerFast), so that `--scheme gptq` and `glmq eval` can tokenize text with it. Also added to a
    built-in generated by an older glmq, which had none. Written aside and renamed into place: ranks that add it at
    once write the same bytes, and an interrupted write leaves no half file."""
    import os
    import shutil
    import tempfile

    from glmq.formats import fixtures

    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=path.parent))
    try:
        fixtures.write_byte_tokenizer(tmp)
        os.replace(tmp / "tokenizer.json", path / "tokenizer.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_output(source: Path, recipe: str, method: str = "rtn") -> Path:
    """`--output`'s default: `<source folder name without a -fp8 suffix>-<recipe>`, in the working directory, with
    `-gptq` after it for a GPTQ run (unless the recipe's name says gptq already): an RTN run and a `--scheme gptq`
    run of one recipe are different outputs, and the second one was refused as "a glmq run of a different
    recipe/calibration" in the first one's folder.
    The name is the absolute path's (`-m .` is the folder's own name, not "", which made "-int4-w4a16", a name
    every later command reads as options), and the suffix is dropped in any case (the releases spell it -FP8).
    Symbolic links are not followed: a link's own name is the one the user gave."""
    import os

    name = Path(os.path.abspath(source)).name
    if name.lower().endswith("-fp8"):
        name = name[: -len("-fp8")]
    suffix = "-gptq" if method == "gptq" and "gptq" not in recipe.lower() else ""
    return Path(f"{name}-{recipe}{suffix}")


class CannotStart(click.ClickException):
    """The command cannot start as asked, for a reason no option's value shows (the working folder is read-only):
    one line `Error: ...`, exit code 2 (as click's own usage errors), not click.UsageError's usage lines."""

    exit_code = 2


class DeviceUnavailable(CannotStart):
    """`--device cuda` without a visible CUDA device."""


def _check_cuda() -> None:
    from glmq.quantize import ops

    if (missing := ops.cuda_missing("cuda")) is not None:
        raise DeviceUnavailable(missing)


def _full_disk(e: Exception) -> str | None:
    """A full disk or quota met by a write of the run's own (GPTQ's layer files and hidden states, the offload
    folder): the file and what to do, where the bare OSError said only "[Errno 28] No space left on device"."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{e.filename or 'a file of the run'}: {e.strerror}; free space on that disk (or give the run a "
                f"folder on another), then re-run the same command: the finished work is kept and resumed")
    return None


def _fail(e: Exception | str, code: int = 1) -> NoReturn:
    """`error: ...` in one line, and exit `code`: 2 where the command could not start as asked (an option's value, a
    path) or its report file could not be written, 1 where it ran and failed (the source's content, the output
    folder's, a write of the output), as validate's and eval's (README, "exit codes")."""
    click.secho(f"error: {e}", fg="red", err=True)
    sys.exit(code)


def _leave_as_a_rank(command):
    """Under torchrun, end the command's process through `dist.leave` with the exit status it would have had (click's
    usage errors printed first), so that no rank's finished work is reported failed by an abort in the interpreter's
    teardown. Any other exception propagates as usual, with its traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        import os

        from glmq.quantize import dist

        if not dist.launched():
            return command(*args, **kwargs)
        code = 0
        try:
            command(*args, **kwargs)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # a message: what Python would print on its way out, with status 1
                click.echo(e.code, err=True)
                code = 1
        except click.ClickException as e:
            e.show()
            code = e.exit_code
        except KeyboardInterrupt:  # every rank gets the Ctrl-C: rank 0 says it, once; none tears down the interpreter
            if os.environ.get("RANK", "0") == "0":
                click.secho(f"\n{_INTERRUPTED}", fg="red", err=True)
            code = 130
        dist.leave(code)

    return run


_INTERRUPTED = ("interrupted: nothing unfinished looks complete; re-run the same command to resume (finished files are "
                "kept)")


class _Glmq(click.Group):
    """Ctrl-C is exit 130 (the shell's code for SIGINT) with a line saying what was kept, where click said only
    "Aborted!" with exit 1, which the exit-code rule reads as "ran and failed"."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            resumes = ctx.invoked_subcommand == "quantize"  # (a half written file is removed; no index or config yet)
            click.secho("\n" + (_INTERRUPTED if resumes else "interrupted"), fg="red", err=True)
            ctx.exit(130)


@click.group(cls=_Glmq, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="glmq")
@click.option("-v", "--verbose", is_flag=True, help="Log details.")
def main(verbose: bool) -> None:
    """glmq: stream GLM / DeepSeek FP8 checkpoints into INT4 (W4A16) compressed-tensors checkpoints."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _plan(model: str, recipe: str, scheme: str | None, max_shard_size: str):
    """The plan of `glmq quantize` / `glmq plan` on a checkpoint folder. An option whose value cannot be used (a
    --model that is no folder, an unknown or malformed --recipe, a --max-shard-size that is no size) is `error: ...`
    with exit 2, as click's own usage errors; what the source's files hold (CheckpointError) is exit 1, the command's
    own failure."""
    from glmq.formats.source import open_source
    from glmq.quantize.plan import make_plan

    rec, shard_bytes = _recipe(recipe, scheme), _shard_size(max_shard_size)
    if not model:  # `-m "$MODEL"` with the variable unset: the working folder, which may even be a checkpoint
        _fail("--model '': an empty folder name; give the checkpoint folder, or leave --model out for the built-in",
              code=2)
    path = resolve_model(model)
    try:
        folder = path.is_dir()
    except OSError as e:  # a name longer than the file system's limit
        _fail(f"{model}: {e.strerror or e}; --model takes a checkpoint folder", code=2)
    if not folder:
        _fail(f"{model}: {'not a directory' if path.exists() else 'no such folder'}; --model takes a checkpoint folder",
              code=2)
    return make_plan(open_source(path), rec, shard_bytes)


def _recipe(recipe: str, scheme: str | None = None):
    """--recipe (and --scheme) loaded; a RecipeError is a usage error (exit 2)."""
    from glmq import recipes

    try:
        return recipes.load(recipe).with_method(scheme)
    except recipes.RecipeError as e:
        _fail(e, code=2)


def _shard_size(text: str) -> int:
    """--max-shard-size in bytes; an unreadable size is a usage error (exit 2)."""
    try:
        return parse_size(text)
    except ValueError as e:
        _fail(e, code=2)


def _warn_before_work(plan, every_line: bool = True) -> None:
    """`glmq plan`'s and `glmq quantize`'s warnings about a plan, before any work: what the source lacks, what the
    recipe cannot do here, and the serving rules its output breaks (`every_line`: `_warn_serving`)."""
    from glmq.formats.families import mtp_absent

    note = mtp_absent({name.rpartition(".")[0] for name in plan.source.entries}, plan.source.config)
    if note is not None:  # (converted all the same: the output serves, as `glmq validate` says with the same note)
        click.secho(f"warning: {note}", fg="yellow", err=True)
    _warn_keep_fp8(plan)
    _warn_serving(plan, every_line)


def _warn_keep_fp8(plan) -> None:
    """keep_fp8 keeps block-FP8 weights only (plan.py; a compressed-tensors FP8 source's per-channel or per-tensor
    scales are dequantized): say so where a recipe asks for it and the source has FP8 weights of another kind, rather
    than write a larger output without a word. (In a block-FP8 source the weights a block does not tile, and their
    fused partners, go to BF16 too, by design: README, formats.md §3c.)"""
    from glmq.formats.source import SourceFormat
    from glmq.quantize.plan import Action

    if not plan.recipe.keep_fp8 or plan.source.fmt is SourceFormat.FP8_BLOCK:
        return
    if plan.source.fmt is SourceFormat.DENSE:  # nothing FP8 to keep: the output is the recipe's without keep_fp8
        click.secho(f"note: recipe {plan.recipe.name!r} keeps FP8 layers (keep_fp8), but this source has no FP8 "
                    f"weights ({plan.source.fmt.value}): its other layers stay as they are, so keep_fp8 changes "
                    f"nothing here", fg="yellow", err=True)
        return
    lost = sum(1 for it in plan.items if it.action is Action.DEQUANTIZE)
    if lost:
        click.secho(f"warning: recipe {plan.recipe.name!r} keeps FP8 layers (keep_fp8), but this source is "
                    f"{plan.source.fmt.value}: keep_fp8 keeps block-FP8 weights only, so its {lost} other FP8 "
                    f"weight(s) are dequantized to BF16", fg="yellow", err=True)


def _warn_serving(plan, every_line: bool = True) -> None:
    """Warn, before any work, when vLLM/SGLang will refuse the output (a run of hours, then `glmq validate` fails);
    and note the rules it breaks only at SERVE_TP, line by line (`glmq plan`) or in one line (`every_line` False:
    `glmq quantize`, whose built-in tiny default is too narrow to split 8 ways)."""
    from glmq.quantize.validate.serving import planned_failures, problem_lines
    from glmq.scripts.upload import SERVE_TP

    def warn(head: str, lines: list[str]) -> None:
        click.secho(f"warning: {head}:", fg="yellow", err=True)
        for line in lines:
            click.secho(f"  {line}; {_serving_consequence(line)}", fg="yellow", err=True)

    failed = planned_failures(plan)
    problems = problem_lines(failed)
    if problems:
        warn(f"the output of recipe {plan.recipe.name!r} breaks the serving rules at every tensor-parallel degree "
             f"(`glmq validate` fails it unless given --no-serving; `glmq eval` reads it)", problems)
    # rules that hold on one GPU and break once split SERVE_TP ways (GLM-4.7's experts: 1536 / 8 = 192 columns a rank,
    # not a multiple of group 128): `glmq upload` checks that degree by default. Each line names only the modules that
    # fail at SERVE_TP and not at tp 1 (all-linear's q_b_proj beside a fused_qkv_a_proj failing the same rule at tp 1)
    more = problem_lines({key: {m: nb for m, nb in mods.items() if m not in failed.get(key, {})}
                          for key, mods in planned_failures(plan, SERVE_TP).items()})
    if more and not every_line:
        click.echo(f"note: at tp {SERVE_TP}, the degree `glmq upload` checks by default, the output of recipe "
                   f"{plan.recipe.name!r} breaks {len(more)} serving rule(s) (e.g. {_rule_of(more[0])}; `glmq plan` "
                   f"lists them); serve and upload it at a degree `glmq validate --tp N` passes", err=True)
    elif more:
        warn(f"at tp {SERVE_TP}, the degree `glmq upload` checks by default and its model card's serve commands use, "
             f"the output of recipe {plan.recipe.name!r} {'also ' if problems else ''}breaks "
             f"({'modules not listed above; ' if problems else ''}serve it at a degree "
             f"`glmq validate --tp N` passes, and upload with that --tp)", more)


def _rule_of(line: str) -> str:
    """'<class>: <rule>' of a `planned_problems` line ('<class>: <rule> fails for N module(s), e.g. ...', or
    '... fails: ...')."""
    return line.partition(" fails")[0]


def _serving_consequence(line: str) -> str:
    """What a failed serving rule means to the engines (formats.md §3a): where Marlin-MoE cannot split the experts'
    width, vLLM still serves them through its Triton WNA16 MoE kernel (slower) and only SGLang refuses them."""
    if "(moe_intermediate / tp) % max(64, group_size)" in line:
        return "vLLM serves these experts with its slower Triton WNA16 MoE kernel instead of Marlin, SGLang refuses them"
    from glmq.quantize.validate.serving import HEAD_SPLIT_RULE

    if HEAD_SPLIT_RULE in line:
        return "vLLM and SGLang refuse the model at this degree"
    return "vLLM and SGLang refuse them"


def parse_size(text: str) -> int:
    """--max-shard-size: a number of bytes with an optional unit (B, KB, MB, GB, KiB, MiB, GiB; any case).

    Raises:
        ValueError naming the option and the accepted spellings (the CLI prints it as `error: ...`).
    """
    t = text.strip().upper()
    number, mult = t, 1
    for suffix, m in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            number, mult = t[: -len(suffix)], m
            break
    try:
        n = int(float(number) * mult)
    except (ValueError, OverflowError):  # "5G", "abc"; "inf"
        n = None
    if n is None or n <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB, 4GiB or a number "
                         f"of bytes")
    return n


_common = [
    click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                 help="Source checkpoint folder (FP8 block, compressed-tensors FP8 or BF16), or builtin:glm5-tiny|glm4-tiny|deepseek-v3-tiny."),
    click.option("--recipe", "-r", default="int4-w4a16", show_default=True, help="Recipe name (see `glmq recipes`) or YAML path."),
    click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard."),
]


def common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


def _skip_triton() -> None:
    """Make `import triton` fail in this process (a CPU run), unless something imported it already.

    Why: transformers' modeling code imports torch._dynamo, which imports triton when it is installed (for
    GPU kernels; torch on a CPU never uses it); its shared library alone kept ~65 MB resident in every CPU
    run. torch and transformers treat the ImportError as "no triton"; glmq's own triton kernels run on CUDA only.
    """
    import sys

    sys.modules.setdefault("triton", None)


@main.command()
@common
@click.option("--output", "-o", default=None, callback=_output_folder,
              help="Output folder (default: <model folder name without -FP8>-<recipe>, with -gptq after it for a GPTQ "
                   "run, in the working directory). "
                   "Resumes an interrupted run of the same job.")
@click.option("--scheme", type=click.Choice(["rtn", "gptq"]), default=None, help="Override the recipe's method.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=_out_file,
              help="Also write the run report here.")
@click.option("--calibration", default=None, metavar="FILE_OR_DATASET",
              help="GPTQ calibration text: a .txt, .jsonl or .json ('text' field) or .parquet file, or a Hugging Face dataset NAME[:CONFIG] or local dataset folder (needs `datasets`).")
@click.option("--samples", default=128, show_default=True, type=click.IntRange(min=1), help="GPTQ: calibration sequences.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2), help="GPTQ: tokens per calibration sequence.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1),  # torch's generator's range
              help="GPTQ: seed of the calibration sample draw.")
@click.option("--activations", type=click.Choice(["disk", "memory"]), default="disk", show_default=True,
              help="GPTQ: where the hidden states between layers live. disk: a file in the output's .glmq-gptq/ "
                   "folder (or --offload-activations DIR), read and written one batch at a time, so memory holds "
                   "one batch (batch x seq-len x hidden x 4 bytes) instead of samples x seq-len x hidden x 4 "
                   "(0.8 GB for 128 x 256 tokens of GLM-5); removed when the run ends, except the newest "
                   "complete layer's after a failure (a rerun resumes from it). memory: all of them in RAM.")
@click.option("--offload-activations", default=None, type=click.Path(file_okay=False), metavar="DIR",
              help="GPTQ: with --activations disk, keep the hidden-state files in DIR instead of the output folder "
                   "(in a subfolder of its own per output folder, so several runs may share DIR).")
@click.option("--min-expert-tokens", default=None, type=click.IntRange(min=0),
              help="GPTQ: routed experts that receive fewer calibration tokens get the all-token Hessian only, and "
                   "are listed in the report [default: 1, i.e. experts no token reaches; rarer experts' Hessians are "
                   "blended with the all-token one anyway].")
@click.option("--all-token-limit", default=None, type=click.FloatRange(min=0, min_open=True), callback=reject_nan,
              help="GPTQ: the experts' all-token down-projection Hessians (the prior blended into every expert's, "
                   "and an under-covered expert's own) take the first N x I calibration tokens, I the experts' "
                   "intermediate size [default: 4; a large N, or inf, takes every token].")
@click.option("--experts-per-pass", default=None, type=click.IntRange(min=1),
              help="GPTQ: routed experts whose Hessians are held at once; a layer's experts are calibrated in that "
                   "many passes over its hidden states instead of one, for less memory (`glmq plan "
                   "--experts-per-pass` predicts both) [default: all of a layer's at once]. On a CPU the output is "
                   "the same bits.")
@click.option("--true-sequential", is_flag=True,
              help="GPTQ: quantize each layer's Linears in the order its forward reaches them (attention inputs, "
                   "attention output, MLP gate/up, down), each stage calibrated on the layer with the earlier "
                   "stages already quantized; one calibration pass per stage.")
@click.option("--trust-remote-code", is_flag=True,
              help="GPTQ: run the tokenizer code in the model folder when its tokenizer is a custom class (Kimi K2's); "
                   "only for checkpoints you trust.")
@click.pass_context
@_leave_as_a_rank
def quantize(ctx, model, recipe, max_shard_size, output, scheme, device, no_progress, json_out, calibration, samples,
             seq_len, seed, activations, offload_activations, min_expert_tokens, experts_per_pass, all_token_limit,
             true_sequential, trust_remote_code):
    """Convert a checkpoint, streaming one shard at a time (GPTQ: calibrated one decoder layer at a time)."""
    import os

    from glmq.quantize import config_child

    if device == "cpu":
        _skip_triton()
    else:
        _check_cuda()  # before planning, or creating the output folder

    if os.environ.get("RANK", "0") == "0":  # its import overlaps ours (GPTQ: it then waits, idle, for the writer)
        config_child.prestart(own_session=int(os.environ.get("WORLD_SIZE", "1")) > 1)
    from glmq.calibration.data import CalibrationDataError
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize import dist, stream
    from glmq.recipes import RecipeError

    try:
        plan = _plan(model, recipe, scheme, max_shard_size)
        if os.environ.get("RANK", "0") == "0":
            _warn_before_work(plan, every_line=False)
        method = plan.recipe.spec.method.value
        out = Path(output) if output else default_output(plan.source.root, plan.recipe.name, method)
        if json_out and (why := replaces_model_file(json_out, out)) is not None:  # (an output folder not yet written)
            _fail(f"--json {json_out}: {why}; choose another path", code=2)
        how = f"--scheme {scheme}" if scheme else f"recipe {plan.recipe.name!r} (method: {method})"
        given = [f"--{name.replace('_', '-')}" for name in GPTQ_ONLY
                 if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)]
        if method != "gptq" and given:  # they would be dropped without a word, and the output RTN's
            raise click.UsageError(f"{', '.join(given)}: GPTQ option(s), but {how} is round-to-nearest; add "
                                   f"--scheme gptq, or leave them out")
        if method == "gptq":
            from glmq.calibration.engine import CalibrationSettings, run_gptq_from_text

            if not calibration:
                raise click.UsageError(f"{how} needs --calibration FILE_OR_DATASET (text to calibrate on)")
            extra = {} if min_expert_tokens is None else {"min_expert_tokens": min_expert_tokens}
            if all_token_limit is not None:  # inf (the help's "a large N"): every token, CalibrationSettings' None
                extra["all_token_limit"] = None if math.isinf(all_token_limit) else all_token_limit
            if experts_per_pass is not None:
                extra["experts_per_pass"] = experts_per_pass
            if offload_activations and activations != "disk":
                raise click.UsageError("--offload-activations DIR needs --activations disk (the default)")
            settings = CalibrationSettings(calibration=calibration, samples=samples, seq_len=seq_len, seed=seed,
                                           activations=activations, offload_activations=offload_activations,
                                           sequential=true_sequential, trust_remote_code=trust_remote_code, **extra)
            world = dist.init(device) if dist.launched() else None  # torchrun: this process is one rank
            try:
                report = run_gptq_from_text(plan, out, settings, device=world.device if world else device,
                                            progress=not no_progress, world=world)
            except Exception as e:  # one rank's error names the rank; torchrun stops the others
                if world is None or isinstance(e, dist.RankFailure):
                    raise
                logging.getLogger("glmq").info("rank %d failed", world.rank, exc_info=True)  # -v: the traceback
                raise world.failure("GPTQ calibration", e) from e
            if world is not None:
                dist.shutdown()
                report = report if world.is_lead else None
        elif dist.launched():  # torchrun: this process is one rank; rank 0 gets the report
            report = dist.run_rtn(plan, out, device=device, progress=not no_progress)
        else:
            report = stream.run(plan, out, device=device, progress=not no_progress)
    except dist.RankFailure as e:
        click.echo(f"glmq: {e}", err=True)
        sys.exit(1)
    except CalibrationDataError as e:  # --calibration's text, the tokenizer, --seq-len: could not start (2)
        _fail(e, code=2)
    except (CheckpointError, RecipeError, ValueError, OSError) as e:  # OSError: e.g. an --output name too long
        _fail(_full_disk(e) or e)
    if report is None:  # a rank other than 0: rank 0 prints the summary
        return
    _print_summary(report, out)
    if "gptq" in report:
        from glmq.calibration.report import format_report

        click.echo(format_report(report["gptq"]))
    if json_out:
        _write_out(json_out, json.dumps(report, indent=1) + "\n", " (the conversion itself finished)")


# `glmq quantize` options that only GPTQ reads (their parameter names), refused with RTN: a user who gives one means
# GPTQ. --trust-remote-code is left out: harmless with RTN, and passed out of habit for models with custom code.
GPTQ_ONLY = ("calibration", "samples", "seq_len", "seed", "activations", "offload_activations", "min_expert_tokens",
             "experts_per_pass", "all_token_limit", "true_sequential")


def _print_summary(rep: dict, out: Path) -> None:
    click.echo(f"\nwrote {out}  ({rep['files']} shards, {rep['files_skipped_resumed']} resumed)")
    click.echo(f"{'class:action':32s} {'tensors':>8s} {'in':>10s} {'out':>10s}")
    for key, row in rep["by_class"].items():
        click.echo(f"{key:32s} {row['tensors']:8d} {_human_bytes(row['bytes_in']):>10s} "
                   f"{_human_bytes(row['bytes_out']):>10s}")
    click.echo(f"bytes in {_human_bytes(rep['bytes_in_total'])} -> out {_human_bytes(rep['bytes_out'])}; "
               f"{rep['seconds']:.1f} s, {rep['throughput_in_GBps'] or 0:.3f} GB/s in, "
               f"peak RSS {_human_bytes(rep['peak_rss_bytes'])}"
               + (f" (rank 0; the largest rank's {_human_bytes(rep['peak_rss_bytes_largest_rank'])})"
                  if "peak_rss_bytes_largest_rank" in rep else "")
               + (f" (+ {_human_bytes(rep['config_child_peak_rss_bytes'])} in the config child, alongside)"
                  if rep.get("config_child_peak_rss_bytes") else "")
               + (f", peak GPU {_human_bytes(rep['peak_gpu_bytes'])}" if "peak_gpu_bytes" in rep else ""))


@main.command("plan")
@common
@click.option("--ranks", default=1, show_default=True, type=click.IntRange(min=1), help="Processes (GPUs or hosts) sharing the job.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--samples", default=128, show_default=True, type=click.IntRange(min=1), help="GPTQ: calibration sequences.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2), help="GPTQ: tokens per calibration sequence.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="GPTQ: compute dtype. `glmq quantize` computes in float32; bfloat16 is the Python API's "
                   "CalibrationSettings(dtype='bfloat16').")
@click.option("--experts-per-pass", default=32, show_default=True, type=click.IntRange(min=1),
              help="GPTQ: the `glmq quantize --experts-per-pass` whose bounded Hessians and time are shown next to "
                   "'all experts at once' (quantize's default).")
@click.option("--throughput", multiple=True, metavar="KEY=VALUE",
              help="Override a measured figure of glmq/quantize/estimate.py FIGURES, e.g. gptq_cuda_s_per_column=0.002.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=_out_file,
              help="Write the plan summary as JSON.")
def plan_cmd(model, recipe, max_shard_size, ranks, device, samples, seq_len, dtype, experts_per_pass, throughput, json_out):
    """Predict output size per tensor class, peak memory per rank and wall time for RTN and GPTQ, from headers or a config.json alone."""
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize import estimate
    from glmq.recipes import RecipeError

    try:
        figures = estimate.with_overrides(estimate.parse_overrides(throughput))
    except ValueError as e:
        _fail(e, code=2)
    try:
        scale = estimate.Scale(ranks=ranks, device=device, samples=samples, seq_len=seq_len, dtype=dtype,
                               experts_per_pass=experts_per_pass)
        # (a file is a config.json whatever its name; a folder is a checkpoint even where its name ends in .json)
        try:
            is_file = Path(model).is_file()
            config_only = is_file or Path(model).suffix.lower() == ".json" and not Path(model).is_dir()
        except OSError as e:  # a name longer than the file system's limit
            _fail(f"{model}: {e.strerror or e}; --model takes a config.json or a checkpoint folder", code=2)
        if config_only and not is_file:
            _fail(f"{model}: no such file; --model takes a config.json or a checkpoint folder", code=2)
        plan = (estimate.plan_from_config(Path(model), _recipe(recipe), _shard_size(max_shard_size)) if config_only
                else _plan(model, recipe, None, max_shard_size))
        _warn_before_work(plan)
        summary = (estimate.summarize_config_plan(plan, Path(model), scale, figures) if config_only
                   else estimate.from_plan(plan, scale, figures))
    except (CheckpointError, RecipeError, ValueError, OSError) as e:  # OSError: e.g. a --model name too long
        _fail(e)
    click.echo(estimate.format_summary(summary, figures))
    if json_out:
        _write_out(json_out, json.dumps(summary, indent=1) + "\n")


@main.command("recipes")
def recipes_cmd():
    """List the shipped recipes."""
    from glmq import recipes

    for name in recipes.available():
        r = recipes.load(name)
        click.echo(f"{name:28s} {r.description}")


def _could_not_run_report(json_out: str, checkpoint: str | None, error: str) -> None:
    """validate's `--json` document for exit 2: it replaces an earlier run's report, which a CI step could read as this
    run's verdict."""
    doc = {"checkpoint": checkpoint, "valid": None, "exit_code": 2, "error": error}
    if (why := replaces_model_file(json_out)) is not None:  # (--json's own check: in click's refusal, it may not
        click.secho(f"warning: {json_out}: no report written: {why}", fg="yellow", err=True)  # have run yet)
        return
    try:
        _write_text(json_out, json.dumps(doc) + "\n")
    except OSError as e:  # the exit code (2) still says it; an earlier report left in place would not
        click.secho(f"warning: {json_out}: the report could not be written ({e.strerror or e})", fg="yellow", err=True)


def _json_arg(args: list[str]) -> str | None:
    """The value of `--json FILE` / `--json=FILE` in raw command-line arguments (the last one, as click takes it)."""
    found = None
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == "--json" and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--json="):
            found = a[len("--json="):]
    return found


class _ValidateCommand(click.Command):
    """`glmq validate`: when click refuses the arguments (exit 2 before the command runs), a `--json FILE` among them
    still gets this run's "could not run" report, so an earlier run's report is not read as this run's verdict."""

    def make_context(self, info_name, args, parent=None, **extra):
        raw = list(args)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            json_out = _json_arg(raw)
            if json_out and json_out != "-" and Path(json_out).resolve().parent.is_dir():
                _could_not_run_report(json_out, None, e.format_message())
            raise


@main.command("validate", cls=_ValidateCommand)
@click.argument("checkpoint", type=click.Path())
@click.option("--source", default=None, callback=_builtin_source,
              help="Source checkpoint folder (or builtin:<name>): compare weights (RTN: within the rounding bound; "
                   "GPTQ: error per layer).")
@click.option("--sample", type=click.FloatRange(0, 1, min_open=True), default=None, callback=reject_nan,
              help="Fraction of each kind of quantized module (class, projection, shape), at least one each, that gets "
                   "the matmul / source-weight checks (deterministic with --seed). Default 0.005 "
                   "(validate.DEFAULT_SAMPLE: cheap next to hashing every byte); 1.0 checks all. Scales, structure and "
                   "integrity always cover every module and byte.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: run the Triton W4A16 kernel; cpu: its float32 reference.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree the vLLM Marlin / Marlin-MoE shape rules are checked at.")
@click.option("--no-serving", is_flag=True, help="Skip the serving rules (a checkpoint not meant for vLLM/SGLang).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=_out_file,
              help="Also write the report as JSON.")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True,
              help="Seed of the activations and the sample.")
@click.option("--sha256", is_flag=True,
              help="Check every tensor's sha256 in the manifest instead of its xxh3-128 (the default: not "
                   "cryptographic, ~30x cheaper). Manifests without xxh3-128 are checked by sha256 anyway.")
def validate_cmd(checkpoint, source, sample, device, tp, no_serving, json_out, seed, sha256):
    """Check a converted checkpoint: structure, index, config, serving shapes, numerics, integrity.

    Exit code 0: valid; 1: invalid (a check failed, serving rules at --tp included); 2: could not run.
    """
    from glmq.quantize import validate as v

    def could_not_run(error: str) -> None:
        if json_out:
            _could_not_run_report(json_out, checkpoint, error)

    try:
        report = v.validate(checkpoint, source, sample=v.DEFAULT_SAMPLE if sample is None else sample, device=device,
                            tp=tp, seed=seed, serving=not no_serving, sha256=sha256)
    except (v.CannotValidate, OSError) as e:  # OSError: the file system refused a path (e.g. a name too long)
        could_not_run(str(e))
        _fail(e, code=2)
    except Exception as e:  # a bug in glmq or its libraries: "could not run" (2), never "invalid" (1), traceback kept
        import traceback

        traceback.print_exc()
        why = f"glmq validate failed unexpectedly ({type(e).__name__}: {e})"
        could_not_run(why)
        _fail(f"{why}; the traceback is above, please report it. Exit 2: could not run", code=2)
    click.echo(v.format_report(report))
    if json_out:
        _write_out(json_out, json.dumps(report.to_dict(), indent=1) + "\n",
                   ". The checks ran (the table above), but without the report: exit 2, could not run")
    sys.exit(report.exit_code)


@main.command("eval")
@click.argument("source", callback=_source_folder)
@click.argument("quantized", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option("--text", required=True, type=click.Path(exists=True, dir_okay=False), help="Evaluation text file.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2), help="Tokens per window.")
@click.option("--windows", default=96, show_default=True, type=click.IntRange(min=1), help="First N windows of the text.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=_out_file,
              help="Write the results as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, callback=_plot_file,
              help="PNG plot of the per-layer error (needs matplotlib).")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the tokenizer code in the model folder when its tokenizer is a custom class (Kimi K2's); only for checkpoints you trust.")
def eval_cmd(source, quantized, text, seq_len, windows, json_out, plot, trust_remote_code):
    """Perplexity and KL(source || quantized) on a text file, and per-layer hidden-state error.

    Exit code 0: evaluated; 1: a figure is not a finite number (a model whose log-probs overflow or are NaN), after the
    table and JSON (null there) are written; 2: could not run (a folder, the text or an option), as validate's 2."""
    from glmq.calibration.compare import compare, format_table, json_ready, non_finite, plot_layer_errors
    from glmq.formats.safetensors_io import CheckpointError

    seen: dict[str, str] = {}
    for q in quantized:  # (each is loaded whole and evaluated: the same folder twice cost its time twice, same row)
        if (real := os.path.realpath(q)) in seen:
            _fail(f"{q}: the same folder as {seen[real]}, given twice; give each quantized checkpoint once", code=2)
        seen[real] = q
    try:
        result = compare(source, list(quantized), text, seq_len, windows, trust_remote_code=trust_remote_code)
    except (CheckpointError, ValueError, OSError) as e:  # could not run: 2, as click's own usage errors, not a
        _fail(e, code=2)                                 # broken model's 1

    click.echo(format_table(result))
    if json_out:
        _write_out(json_out, json.dumps(json_ready(result), indent=1, allow_nan=False) + "\n")
    if plot:  # (through _write_out, as the JSON: matplotlib's savefig would follow a link and leave a half file)
        fmt = Path(plot).suffix[1:].lower() or "png"  # (one matplotlib writes: _plot_file)
        _write_out(plot, lambda p: plot_layer_errors(result, p, fmt))
        click.echo(f"plot written to {plot}")
    if bad := non_finite(result):  # a broken model is a failed evaluation, not figures to compare
        _fail(f"figures that are not finite numbers (the model's log-probs overflow or are NaN; "
              f"{'null in ' + str(json_out) if json_out else 'no JSON written'}): " + "; ".join(bad[:4])
              + (f"; and {len(bad) - 4} more" if len(bad) > 4 else ""))


from glmq.scripts.upload import upload_cmd  # noqa: E402
main.add_command(upload_cmd)

if __name__ == "__main__":
    main()
