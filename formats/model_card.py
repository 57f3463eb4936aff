"""The Hugging Face model card (README.md) of a glmq checkpoint, built from what the folder records.

Pure: every input is an already-parsed dict (config.json, glmq_report.json, glmq_manifest.json, an
optional `glmq eval` JSON and `glmq validate`'s `Report.to_dict()`); `scripts/upload.py` reads the
files and writes the result. The YAML block goes through `huggingface_hub.ModelCardData`, which
serialises the metadata the Hub reads (base_model and base_model_relation put the repo under the base
model's "Quantizations"; library_name picks the "Use this model" snippet; tags make it searchable).

Layout of the body: a title and one-line summary, a warning when the checkpoint did not pass
`glmq validate`, quantization details (config groups, what was quantized and what was kept, the
recipe, tensors and bytes by class), sizes before/after, evaluation (when an eval report is given),
the validation verdict, and the serve commands for vLLM and SGLang.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePath

import yaml
from huggingface_hub import ModelCard, ModelCardData

# The first line of the body: how `glmq upload` recognises a card it wrote (and may overwrite).
CARD_MARKER = "<!-- glmq-model-card: written by `glmq upload`; delete this line to keep your edits -->"
UNVALIDATED_WARNING = "this checkpoint was uploaded without passing glmq validate"
# transformers loads glmq's output through its compressed-tensors integration
# (tests/test_transformers_load.py), so the Hub's "Use this model" snippet for transformers works;
# vLLM and SGLang are covered by the serve commands and the `compressed-tensors` tag, as on the
# RedHatAI / neuralmagic W4A16 cards.
LIBRARY_NAME = "transformers"
# A Hub model id with its namespace (huggingface_hub's REPO_ID_REGEX, namespace required): a bare
# "name" is more often a local folder than a model on the Hub.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", re.ASCII)  # ORG/NAME, not NAME alone
# Where huggingface_hub caches a download: .../models--ORG--NAME/snapshots/<commit>
_HF_CACHE = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")

# The "Made with" command: the `glmq quantize` options (scripts/cli.py) that change the output, each printed only
# when the run's recorded value differs from the option's default, so the command stays short.
# --max-shard-size: glmq_manifest.json identity "max_shard_bytes" (the option's default "5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# GPTQ: glmq_report.json "gptq" "settings" key, option, the option's default (--calibration is always printed;
# sequential is the flag --true-sequential). --activations and --offload-activations change no bit and stay out;
# the method (--scheme) is in the recipe file.
GPTQ_OPTIONS = (("samples", "--samples", 128), ("seq_len", "--seq-len", 256), ("seed", "--seed", 0),
                ("min_expert_tokens", "--min-expert-tokens", 1), ("all_token_limit", "--all-token-limit", 4.0))
# Settings of the run's identity (CalibrationSettings) that no option sets, with their defaults: named under the
# command when a run (through the Python API) changed them.
GPTQ_API_ONLY = {"under_covered": "all_tokens", "clip_search": True, "expert_prior": 1.0, "batch_size": 8,
                 "dtype": "float32", "gptq_batch": None}


@dataclass(frozen=True)
class CardInputs:
    """Everything the card says, already read from disk.

    config: config.json. report: glmq_report.json (None: not written by glmq or removed).
    manifest: glmq_manifest.json (None likewise). eval_result: `glmq eval --json` output, i.e.
    calibration/compare.py `compare()`'s {"text", "seq_len", "windows", "models": [...]}.
    validation: `Report.to_dict()`, or {"valid": None, "error": why} when validation could not run;
    anything but valid puts UNVALIDATED_WARNING at the top of the card.
    """

    repo_id: str
    checkpoint_name: str
    config: dict
    report: dict | None = None
    manifest: dict | None = None
    eval_result: dict | None = None
    validation: dict | None = None
    base_model: str | None = None  # --base-model; None: inferred (infer_base_model)
    license: str | None = None
    tp: int = 8
    revision: str | None = None
    tokenizer_config: dict | None = None  # tokenizer_config.json (its auto_map: a tokenizer that is custom code)


def is_repo_id(text: str) -> bool:
    """True for "ORG/NAME" as the Hub spells model ids: huggingface_hub's own `validate_repo_id` (ASCII letters and
    digits, '-', '_', '.', not at either end of a part, no "--" or "..", no ".git" at the end), and an ORG part."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return bool(_REPO_ID.fullmatch(text))


def infer_base_model(config: dict, report: dict | None) -> tuple[str | None, str]:
    """The base model's Hub id and where it came from, or (None, why it is unknown).

    Sources, in order: config.json `_name_or_path` when it is an ORG/NAME id; the report's source
    folder when it is a huggingface_hub cache snapshot (models--ORG--NAME/snapshots/...). A plain
    local folder says nothing reliable about the Hub id, so it is not guessed from.
    """
    name = config.get("_name_or_path")
    if isinstance(name, str) and is_repo_id(name):
        return name, "config.json _name_or_path"
    source = (report or {}).get("source")
    m = _HF_CACHE.search(source) if isinstance(source, str) else None
    if m and is_repo_id(f"{m[1]}/{m[2]}"):
        return f"{m[1]}/{m[2]}", "the Hugging Face cache path of the source in glmq_report.json"
    return None, "not recorded in config.json or glmq_report.json"  # the card's words: no CLI hint for its readers


def human_bytes(n: float, digits: int = 2) -> str:
    """1234567 -> '1.23 MB' (decimal units, as the Hub shows sizes; `digits` after the point)."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.{digits}f} {unit}"
    return f"{n / 1000:.{digits}f} TB"


# ----------------------------------------------------------------------------------------- metadata
def _int_groups(config: dict) -> list[dict]:
    """The weight args of the config groups that store integers (pack-quantized)."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return [g["weights"] for g in groups.values() if (g.get("weights") or {}).get("type") == "int"]


def _method(inp: CardInputs) -> str | None:
    recipe = (inp.report or {}).get("recipe") or ((inp.manifest or {}).get("identity") or {}).get("recipe") or {}
    return recipe.get("method")


def card_tags(inp: CardInputs) -> list[str]:
    """compressed-tensors, int<b>, w<b>a16 per integer group, the method, the model_type, glmq."""
    tags = ["compressed-tensors", "quantized"]
    for bits in sorted({w.get("num_bits") for w in _int_groups(inp.config)} - {None}):
        tags += [f"int{bits}", f"w{bits}a16"]
    for extra in (_method(inp), inp.config.get("model_type"), "glmq"):
        if extra and extra not in tags:
            tags.append(extra)
    return tags


def base_model(inp: CardInputs) -> tuple[str | None, str]:
    """(Hub id or None, where it came from): --base-model first, else `infer_base_model`."""
    return (inp.base_model, "--base-model") if inp.base_model else infer_base_model(inp.config, inp.report)


def card_data(inp: CardInputs) -> ModelCardData:
    """The YAML metadata block. base_model is left out when unknown: the Hub rejects ids it cannot
    resolve, and a wrong one would file the repo under another model."""
    base = base_model(inp)[0]
    extra = {"base_model_relation": "quantized"} if base else {}
    return ModelCardData(base_model=base, library_name=LIBRARY_NAME, pipeline_tag="text-generation",
                         license=inp.license, tags=card_tags(inp), **extra)


# ----------------------------------------------------------------------------------------- body
def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _kept_fp8(config: dict) -> bool:
    """A `mixed-precision` checkpoint (recipe keep_fp8): FP8 block groups beside the INT one, whose layers run with
    dynamic FP8 activations (formats.md §3c), so the checkpoint is not weight-only."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any((g.get("weights") or {}).get("type") == "float" for g in groups.values())


def _title(inp: CardInputs, base: str | None, origin: str) -> list[str]:
    version = (inp.report or {}).get("glmq_version") or ((inp.manifest or {}).get("identity") or {}).get("glmq_version")
    recipe = ((inp.report or {}).get("recipe") or {}).get("name")
    of = f"[{base}](https://huggingface.co/{base})" if base else f"an unknown base model ({origin})"
    made = f"made with glmq {version}" if version else "made with glmq"
    how = f", recipe `{recipe}`, method {(_method(inp) or '?').upper()}" if recipe else ""
    lines = [CARD_MARKER, "", f"# {inp.repo_id.split('/')[-1]}", ""]
    if (inp.validation or {}).get("valid") is not True:
        lines += [f"> [!WARNING]\n> **{UNVALIDATED_WARNING}** ({_verdict(inp.validation)}). "
                  "Check the Validation section before serving it.", ""]
    fmt = (inp.config.get("quantization_config") or {}).get("format") or "pack-quantized"
    if _kept_fp8(inp.config):  # was "Weight-only ... `pack-quantized` ... BF16 activations" for these too
        what = ("Quantization", "INT weights with BF16 activations; the layers kept in FP8 as 128×128 FP8 blocks with "
                                "dynamic FP8 activations")
    else:
        what = ("Weight-only quantization", "INT weights, BF16 activations")
    return lines + [f"{what[0]} of {of} in the compressed-tensors `{fmt}` format ({what[1]}), {made}{how}.", ""]


def _group_rows(config: dict) -> list[list]:
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    rows = []
    for name, g in sorted(groups.items()):
        w = g.get("weights") or {}
        gs = w.get("group_size") if w.get("strategy") == "group" else w.get("strategy")
        rows.append([name, ", ".join(f"`{t}`" for t in g.get("targets", [])), w.get("type"), w.get("num_bits"), gs,
                     "yes" if w.get("symmetric") else "no", w.get("actorder") or "none", g.get("format")])
    return rows


def _by_class_rows(report: dict) -> list[list]:
    rows = []
    for key, r in sorted(report.get("by_class", {}).items()):
        cls, _, action = key.partition(":")
        rows.append([cls, action, r["tensors"], human_bytes(r["bytes_in"]), human_bytes(r["bytes_out"])])
    return rows


def quantization_section(inp: CardInputs) -> list[str]:
    """Config groups, ignore list, recipe and the per-class table of the report."""
    qc = inp.config.get("quantization_config") or {}
    how = ("INT weights quantized per group with BF16 activations, FP8 weights per 128×128 block with dynamic FP8 "
           "activations" if _kept_fp8(inp.config) else "weights quantized per group, activations stay BF16")
    lines = ["## Quantization", "", f"compressed-tensors format `{qc.get('format')}` (config written with "
             f"compressed-tensors {qc.get('version', '?')}); {how}.", ""]
    lines += _table(["group", "targets", "type", "bits", "group size", "symmetric", "act order", "format"],
                    _group_rows(inp.config)) + [""]
    ignore = qc.get("ignore") or []
    if ignore:
        lines += ["Kept unquantized (the config's `ignore` list): " + ", ".join(f"`{p}`" for p in ignore) + ".", ""]
    lines += _recipe_lines(inp)
    if inp.report and inp.report.get("by_class"):
        lines += ["Tensors by class (`quantize`: to INT, `dequantize`: FP8 to BF16, `copy`: unchanged, "
                  "`keep_fp8`: FP8 blocks kept):", ""]
        lines += _table(["class", "action", "tensors", "source bytes", "output bytes"], _by_class_rows(inp.report))
        lines.append("")
    return lines


def _size_option(n: int) -> str:
    """Bytes as --max-shard-size writes them (scripts/cli.py parse_size reads them back exactly)."""
    for suffix, mult in (("GB", 10**9), ("GiB", 2**30), ("MB", 10**6), ("MiB", 2**20), ("KB", 10**3), ("KiB", 2**10)):
        if n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def _number(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


_DATA_FILES = (".txt", ".jsonl", ".json", ".parquet")  # the calibration files calibration/data.py reads


def public_path(spec: str) -> str:
    """A local path's last component, without the folders of the machine it was on (`/home/alice/data/c.jsonl` in a
    public card or report); any other string (a dataset name, free text such as a recipe's description) stays."""
    return PurePath(spec).name if spec.startswith(("/", "~", "./", "../")) or PurePath(spec).drive else spec


def public_folder(spec: str) -> str:
    """A value that is always a local folder (the source, an --offload-activations folder), however it was spelled
    (`ckpt/GLM-5-FP8` too): its last component; "." and ".." stay (they name nothing)."""
    return PurePath(spec).name or spec


def public_calibration(spec: str) -> str:
    """A --calibration value as published: a local file or folder cut to its name (`public_path`, and a relative path
    that names a data file (.txt, .jsonl, .json, .parquet) or has more folders than a Hub dataset id ORG/NAME);
    a Hub dataset name (`NAME`, `ORG/NAME[:CONFIG]`) stays."""
    p = PurePath(spec)
    return p.name if p.suffix.lower() in _DATA_FILES or len(p.parts) > 2 else public_path(spec)


def made_with(report: dict | None, manifest: dict | None) -> tuple[list[str], list[str]]:
    """(the `glmq quantize` arguments that remake this checkpoint from the recipe file, the recorded settings
    no option sets). Each option appears only when its recorded value is not the command line's default."""
    args = ["--model FP8_SOURCE_FOLDER", "--recipe recipe.yaml", "-o OUT"]
    shard = ((manifest or {}).get("identity") or {}).get("max_shard_bytes")
    if isinstance(shard, int) and shard != DEFAULT_MAX_SHARD_BYTES:
        args.append(f"--max-shard-size {_size_option(shard)}")
    s = ((report or {}).get("gptq") or {}).get("settings") or {}
    if not s:
        return args, []
    api = []
    if str((report or {}).get("device", "")).startswith("cuda"):  # GPTQ's CUDA kernels sum in another order
        args.append("--device cuda")
    args.append(f"--calibration {shlex.quote(public_calibration(str(s.get('calibration'))))}")
    for key, flag, default in GPTQ_OPTIONS:
        if key not in s or s[key] == default:
            continue
        if s[key] is None:  # e.g. all_token_limit None (every token): no value of the option says it
            api.append(f"{key}={s[key]!r}")
        else:
            args.append(f"{flag} {_number(s[key])}")
    if s.get("sequential"):
        args.append("--true-sequential")
    api += [f"{k}={s[k]!r}" for k, default in GPTQ_API_ONLY.items() if k in s and s[k] != default]
    return args, api


def _recipe_lines(inp: CardInputs) -> list[str]:
    """The recipe as the flat YAML `glmq quantize -r FILE` reads, the command, and GPTQ's calibration."""
    recipe = (inp.report or {}).get("recipe") or ((inp.manifest or {}).get("identity") or {}).get("recipe")
    if not recipe:
        return ["Recipe: unknown (no glmq_report.json or glmq_manifest.json in the folder).", ""]
    gptq = (inp.report or {}).get("gptq") or {}
    args, api = made_with(inp.report, inp.manifest)
    command = " ".join(["glmq quantize", *args])
    lines = [f"Recipe `{recipe.get('name')}` ({recipe.get('description', '')}), as a recipe file:", "", "```yaml",
             yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None).rstrip(), "```", "",
             "Made with:", "", "```bash", command, "```", ""]
    if api:
        lines += ["Also set, through glmq's Python API (no command-line option): "
                  + ", ".join(f"`{a}`" for a in api) + ".", ""]
    if gptq:
        lines += [f"GPTQ calibration: {gptq.get('calibration_tokens')} tokens; relative output error on them, "
                  "GPTQ vs round-to-nearest of the same weights:", ""]
        by_class = sorted(gptq.get("by_class", {}).items())
        rows = [[c, r["tensors"], r["rel_err_gptq"], r["rel_err_rtn"]] for c, r in by_class]
        lines += _table(["class", "tensors", "GPTQ", "RTN"], rows) + [""]
        lines += _not_gptq_lines(gptq)
    return lines


def _not_gptq_lines(gptq: dict) -> list[str]:
    """What a GPTQ run quantized otherwise, which the table (GPTQ's tensors only) leaves out: the MTP layer's targets
    (round-to-nearest: no calibration inputs reach it), the tensors GPTQ fell back to RTN on, and the experts no
    calibration token reached (their Hessian borrowed, `expert_coverage`)."""
    out = []
    mtp = gptq.get("mtp") or {}
    if mtp.get("tensors"):
        out.append(f"- MTP layer(s) {mtp.get('layers')}: {mtp['tensors']} quantized tensors are "
                   f"{'round-to-nearest' if mtp.get('method') == 'rtn' else mtp.get('method')}, not GPTQ "
                   f"({mtp.get('why', 'no calibration inputs')}).")
    if fallbacks := gptq.get("fallbacks"):
        out.append(f"- {len(fallbacks)} tensor(s) fell back to round-to-nearest (e.g. `{fallbacks[0].get('module')}`: "
                   f"{fallbacks[0].get('reason')}).")
    if unreached := (gptq.get("expert_coverage") or {}).get("unreached"):
        said = {"all_tokens": "GPTQ on the Hessian of every token of their layer", "rtn": "round-to-nearest"}
        how = {u.get("hessian") for u in (gptq.get("expert_coverage") or {}).get("under_covered", [])} - {None}
        out.append(f"- {len(unreached)} routed expert(s) received no calibration token: "
                   f"{' or '.join(said.get(h, str(h)) for h in sorted(how)) or 'quantized without their own Hessian'}.")
    return out + [""] if out else []


def sizes_section(inp: CardInputs) -> list[str]:
    r = inp.report or {}
    if "bytes_in_total" not in r or "bytes_out" not in r:
        return ["## Size", "", "Unknown: glmq_report.json is missing.", ""]
    # like with like: bytes_in_total is the source's shard files (headers included), bytes_out the output's tensors;
    # the manifest records each output file's size
    files = ((inp.manifest or {}).get("files") or {}).values()
    sizes = [f.get("bytes") for f in files if isinstance(f, dict)]
    whole = bool(sizes) and all(isinstance(b, int) for b in sizes)
    src, out = r["bytes_in_total"], sum(sizes) if whole else r["bytes_out"]
    ratio = f" ({out / src:.2f}x)" if src else ""
    rows = [[f"source ({r.get('source_format', '?')})", human_bytes(src)],
            ["this checkpoint", human_bytes(out) + ratio + ("" if whole else " (tensors only)")]]
    return ["## Size", "", *_table(["checkpoint", "safetensors files"], rows), ""]


def finite_figure(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _figure(v, spec: str) -> str:
    """A figure of the eval table; "-" for one `glmq eval` could not compute (null: the model's log-probs overflowed
    or were NaN; `upload` refuses a report where that is the source's or this checkpoint's)."""
    return format(v, spec) if finite_figure(v) else "-"


def eval_section(result: dict | None, checkpoint_name: str) -> list[str]:
    """Perplexity, KL(source || model) and per-layer error of each row of a `glmq eval` result."""
    if not result:
        return []
    rows = []
    this = result.get("this_checkpoint_row")  # upload.read_eval's match (name and weights); else by name
    for i, m in enumerate(result["models"]):
        name = PurePath(m["checkpoint"]).name
        mine = i == this if this is not None else i and name == checkpoint_name
        label = "source" if i == 0 else ("**this checkpoint**" if mine else name)
        errs = [e for e in (m.get("layer_rel_error") or []) if finite_figure(e)]
        layer = f"{sum(errs) / len(errs):.4f} / {max(errs):.4f}" if errs else "-"
        rows.append([f"{label} (`{name}`)", _figure(m["perplexity"], ".4f"), _figure(m["kl_to_source"], ".5f"), layer])
    text = PurePath(str(result.get("text", "?"))).name
    return ["## Evaluation", "", f"`glmq eval`: first {result.get('windows')} windows of {result.get('seq_len')} "
            f"tokens of `{text}`; the layer error is ||h_q - h_s|| / ||h_s|| of each decoder layer's output.", "",
            *_table(["model", "perplexity", "KL(source ‖ model)", "layer rel. error mean / max"], rows), ""]


def _verdict(validation: dict | None) -> str:
    if not validation:
        return "glmq validate was not run"
    if validation.get("valid") is None:
        return f"glmq validate could not run: {validation.get('error')}"
    failed = sorted(k for k, c in validation.get("checks", {}).items() if c.get("status") == "fail")
    return "glmq validate: VALID" if validation["valid"] else f"glmq validate: INVALID, failed {', '.join(failed)}"


def validation_section(validation: dict | None) -> list[str]:
    lines = ["## Validation", "", _verdict(validation) + "."]
    if not validation or validation.get("valid") is None:
        return lines + [""]
    s, checks = validation.get("settings", {}), validation.get("checks", {})
    sampled = (checks.get("numerics") or {}).get("details", {}).get("sampled", "?")
    integrity = checks.get("integrity") or {}
    sums = " or ".join(sorted((integrity.get("details") or {}).get("checksums") or {})) or "checksum"
    hashed = (f"every tensor's {sums} checked against glmq_manifest.json"
              if integrity.get("status") in ("pass", "fail") else "no checksums to check")
    lines += ["", f"Kernel check on {sampled} of {s.get('quantized_modules', '?')} quantized modules "
              f"({s.get('device')}), serving shape rules at tensor parallel {s.get('tp')}, {hashed}.", ""]
    rows = [[k, c["status"], c["checked"], c["failed"]] for k, c in checks.items()]
    return lines + _table(["check", "result", "checked", "failed"], rows) + [""]


def remote_code(inp: CardInputs) -> bool:
    """The checkpoint ships custom code that loading it runs: an `auto_map` in config.json or tokenizer_config.json
    (Kimi K2's configuration_deepseek.py and TikToken tokenizer; DeepSeek-V3's). transformers refuses such a folder
    without trust_remote_code (kimi_k2 is no model type it knows), so the serve commands need the flag."""
    return any((c or {}).get("auto_map") for c in (inp.config, inp.tokenizer_config))


def serve_section(repo_id: str, tp: int, revision: str | None, trust_remote_code: bool = False) -> list[str]:
    """vLLM (`--tensor-parallel-size`) and SGLang (`--tp`) commands; both take `--revision` and
    `--trust-remote-code`."""
    flags = f" --revision {revision}" if revision and revision != "main" else ""
    why = []
    if trust_remote_code:
        flags += " --trust-remote-code"
        why = ["The checkpoint ships custom code (an `auto_map` in its config files), which both engines run only with "
               "`--trust-remote-code`.", ""]
    return ["## Serving", "", *why, "vLLM:", "", "```bash", f"vllm serve {repo_id} --tensor-parallel-size {tp}{flags}",
            "```", "", "SGLang:", "", "```bash",
            f"python -m sglang.launch_server --model-path {repo_id} --tp {tp}{flags}", "```", ""]


def build_card(inp: CardInputs) -> ModelCard:
    """The whole card: YAML metadata from `card_data`, then the body sections."""
    body = _title(inp, *base_model(inp)) + quantization_section(inp) + sizes_section(inp)
    body += eval_section(inp.eval_result, inp.checkpoint_name) + validation_section(inp.validation)
    body += serve_section(inp.repo_id, inp.tp, inp.revision, remote_code(inp))
    return ModelCard(f"---\n{card_data(inp).to_yaml()}\n---\n\n" + "\n".join(body))


def is_glmq_card(text: str) -> bool:
    """True when a README.md is one `build_card` wrote (its marker line is still there)."""
    return CARD_MARKER in text
