"""`glmq` command line: parse options, build the objects, call one function per command."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from glmq import __version__

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "builtin:glm5-tiny"
DEFAULT_CACHE = Path(".glmq-cache")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def resolve_model(model: str) -> Path:
    """A checkpoint folder, or `builtin:<name>`: a tiny generated checkpoint with a real layout."""
    if not model.startswith(BUILTIN_PREFIX):
        return Path(model)
    from glmq.formats import fixtures

    name = model[len(BUILTIN_PREFIX):]
    builtins = {"glm5-tiny": "glm_moe_dsa", "glm4-tiny": "glm4_moe", "deepseek-v3-tiny": "deepseek_v3"}
    if name not in builtins:
        raise click.BadParameter(f"unknown built-in model {name!r}; choose one of {sorted(builtins)}", param_hint="--model")
    path = DEFAULT_CACHE / f"{name}-fp8"
    if not (path / "config.json").exists():
        click.echo(f"generating the built-in {name} FP8 checkpoint ({builtins[name]} layout) in {path}", err=True)
        fixtures.make_checkpoint(path, builtins[name], preset="tiny", source_format="fp8-block")
    return path


def _fail(e: Exception, code: int = 1) -> None:
    click.secho(f"error: {e}", fg="red", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="glmq")
@click.option("-v", "--verbose", is_flag=True, help="Log details.")
def main(verbose: bool) -> None:
    """glmq: stream GLM / DeepSeek FP8 checkpoints into INT4 (W4A16) compressed-tensors checkpoints."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _plan(model: str, recipe: str, scheme: str | None, max_shard_size: str):
    from glmq import recipes
    from glmq.formats.source import open_source
    from glmq.quantize.plan import make_plan

    rec = recipes.load(recipe).with_method(scheme)
    return make_plan(open_source(resolve_model(model)), rec, parse_size(max_shard_size))


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


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


@main.command()
@common
@click.option("--output", "-o", default=None, help="Output folder (default: <model name>-<recipe>). Resumes an interrupted run of the same job.")
@click.option("--scheme", type=click.Choice(["rtn", "gptq"]), default=None, help="Override the recipe's method.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the run report here.")
def quantize(model, recipe, max_shard_size, output, scheme, device, no_progress, json_out):
    """Convert a checkpoint, streaming one shard at a time."""
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize import stream
    from glmq.recipes import RecipeError

    try:
        plan = _plan(model, recipe, scheme, max_shard_size)
        if plan.recipe.spec.method.value != "rtn":
            raise click.UsageError("--scheme gptq needs the calibration engine, which this glmq version does not have yet")
        out = Path(output) if output else Path(f"{plan.source.root.name.removesuffix('-fp8')}-{plan.recipe.name}")
        report = stream.run(plan, out, device=device, progress=not no_progress)
    except (CheckpointError, RecipeError, ValueError) as e:
        _fail(e)
    _print_summary(report, out)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")


def _print_summary(rep: dict, out: Path) -> None:
    click.echo(f"\nwrote {out}  ({rep['files']} shards, {rep['files_skipped_resumed']} resumed)")
    click.echo(f"{'class:action':32s} {'tensors':>8s} {'in':>10s} {'out':>10s}")
    for key, row in rep["by_class"].items():
        click.echo(f"{key:32s} {row['tensors']:8d} {_human(row['bytes_in']):>10s} {_human(row['bytes_out']):>10s}")
    click.echo(f"bytes in {_human(rep['bytes_in_total'])} -> out {_human(rep['bytes_out'])}; "
               f"{rep['seconds']:.1f} s, {rep['throughput_in_GBps'] or 0:.3f} GB/s in, peak RSS {_human(rep['peak_rss_bytes'])}"
               + (f", peak GPU {_human(rep['peak_gpu_bytes'])}" if "peak_gpu_bytes" in rep else ""))


@main.command("plan")
@common
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the plan summary as JSON.")
def plan_cmd(model, recipe, max_shard_size, json_out):
    """Predict output size per tensor class and peak memory, from headers and config only."""
    from glmq.formats.safetensors_io import CheckpointError
    from glmq.quantize import estimate
    from glmq.recipes import RecipeError

    try:
        if Path(model).suffix == ".json":
            summary = estimate.from_config_file(Path(model), recipe)
        else:
            summary = estimate.from_plan(_plan(model, recipe, None, max_shard_size))
    except (CheckpointError, RecipeError, ValueError) as e:
        _fail(e)
    click.echo(estimate.format_summary(summary))
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=1) + "\n")


@main.command("recipes")
def recipes_cmd():
    """List the shipped recipes."""
    from glmq import recipes

    for name in recipes.available():
        r = recipes.load(name)
        click.echo(f"{name:28s} {r.description}")


@main.command("validate")
@click.argument("checkpoint", type=click.Path())
@click.option("--source", default=None, type=click.Path(), help="Source checkpoint: compare weights (RTN bound; GPTQ: error per layer).")
@click.option("--sample", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Fraction of quantized modules that get the matmul / source checks (deterministic with --seed).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: run the Triton W4A16 kernel; cpu: its float32 reference.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree the vLLM Marlin / Marlin-MoE shape rules are checked at.")
@click.option("--no-serving", is_flag=True, help="Skip the serving rules (a checkpoint not meant for vLLM/SGLang).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the report as JSON.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the activations and the sample.")
def validate_cmd(checkpoint, source, sample, device, tp, no_serving, json_out, seed):
    """Check a converted checkpoint: structure, index, config, serving shapes, numerics, integrity.

    Exit code 0: valid; 1: invalid (a check failed, serving rules at --tp included); 2: could not run.
    """
    from glmq.quantize import validate as v

    try:
        report = v.validate(checkpoint, source, sample=sample, device=device, tp=tp, seed=seed, serving=not no_serving)
    except v.CannotValidate as e:
        if json_out:
            Path(json_out).write_text(json.dumps({"checkpoint": checkpoint, "valid": None, "exit_code": 2, "error": str(e)}) + "\n")
        _fail(e, code=2)
    click.echo(v.format_report(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    sys.exit(report.exit_code)


if __name__ == "__main__":
    main()
