"""`glmq upload`: publish a checkpoint that passes `glmq validate` to the Hugging Face Hub, with a model card.

Steps, in this order:
  1. arguments: the folder holds a config.json, ORG/NAME ids, a Hub token (unless --dry-run); the eval report
     is read and matched to the folder's weights (`read_eval`);
  2. the gate: `glmq validate` with the serving rules at --tp (the degree the card's serve commands
     use), the kernel check on --sample of the quantized modules and every tensor's checksum against
     glmq_manifest.json (xxh3-128 where the manifest records it, as `glmq validate` checks by default).
     An invalid checkpoint stops here (exit 1) unless --allow-invalid, which uploads it with a warning
     in red here and at the top of the card;
  3. the card (formats/model_card.py) from config.json, glmq_report.json, glmq_manifest.json, the
     eval report and the validation result;
  4. the file list (`split_files`): the same listing and filter the Hub client applies to
     `ignore_patterns()`, so --dry-run shows exactly what the upload sends; --dry-run stops here;
  5. README.md written atomically (unless a README.md glmq did not write is there, or --no-card);
  6. create_repo(exist_ok) and the upload (`upload_method` picks the call the installed
     huggingface_hub offers).

A folder without glmq_manifest.json is uploaded with a warning rather than refused: `glmq validate`
accepts any compressed-tensors pack-quantized checkpoint (it skips the checksum check with a
warning), and the gate is validate's verdict, not a second definition of "valid". The card then
says the recipe and sizes are unknown.

Exit codes: 0 uploaded (or dry run), 1 refused by the gate, 2 could not run (folder, arguments,
eval report, no token), 3 the Hub refused the upload or could not be reached.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePath

import click

README = "README.md"
# the degree the serving rules are checked at before an upload, and the model card's serve commands use (one node of
# 8 GPUs); `glmq quantize` and `glmq plan` warn before the run when the output would fail at it
SERVE_TP = 8
EVAL_NAME = "glmq_eval.json"  # `glmq eval --json` output, picked up when it lies in the checkpoint folder
MAIN = "main"


class UploadError(Exception):
    """A one-line reason naming the checkpoint and what to do, with the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# A Hub license id's spelling (the Hub's list: mit, apache-2.0, cc-by-nc-4.0, llama3.1, other, ...); the list itself
# is the Hub's and changes, so only the spelling is checked here and the Hub decides on the id
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]*")


@dataclass(frozen=True)
class UploadOptions:
    checkpoint: Path
    repo_id: str
    private: bool = False
    revision: str | None = None
    base_model: str | None = None
    license: str | None = None
    tp: int = SERVE_TP
    eval_report: Path | None = None
    sample: float = 0.01
    device: str = "cpu"
    allow_invalid: bool = False
    no_card: bool = False
    dry_run: bool = False


# ----------------------------------------------------------------------------------------- files
def ignore_patterns() -> list[str]:
    """glmq's working files, which never belong on the Hub: the GPTQ cache folder (calibration/cache.py),
    half-written files (safetensors_io.TMP_SUFFIX; `*.tmp` activation files of the GPTQ engine), the
    manifest's journal and the ranks' fragments (formats/manifest.py), which a rerun of a finished
    distributed job leaves beside the complete manifest if it is stopped, a finished run's source shard times
    (manifest.SOURCE_TIMES_NAME: local file times), and the eval report the card is
    made from (EVAL_NAME: the card has its table; the file holds the local paths of the source, of every
    checkpoint evaluated and of the text)."""
    from glmq.calibration.cache import CACHE_DIR
    from glmq.formats.manifest import FRAGMENT_GLOB, SOURCE_TIMES_NAME, journal_name
    from glmq.formats.safetensors_io import TMP_SUFFIX

    return [f"{CACHE_DIR}/*", f"*{TMP_SUFFIX}", "*.tmp", FRAGMENT_GLOB, journal_name("glmq_manifest*.json"), EVAL_NAME,
            SOURCE_TIMES_NAME]


def local_patterns(folder: Path, eval_report: Path | None) -> list[str]:
    """The files the upload leaves out beyond `ignore_patterns()`, as fnmatch patterns that each match only
    themselves: an --eval-report under another name than EVAL_NAME (itself, or a link to it in the folder), and
    every report a glmq command wrote into the folder under another name or in a sub-folder (`glmq_report_kind`;
    `glmq eval --json evals/e.json`, `glmq validate --json`, `glmq quantize --json`): each holds local paths (the
    source, the text, the checkpoint), and only the top-level run report is published, with its paths cut."""
    import glob

    from glmq.formats.manifest import REPORT_NAME

    target = eval_report.expanduser().resolve() if eval_report is not None and eval_report.is_file() else None
    return [glob.escape(n) for n, path in _listing(folder)
            if target is not None and path.resolve() == target
            or n != REPORT_NAME and n.endswith(".json") and glmq_report_kind(path) is not None]


_REPORT_MAX_BYTES = 16 << 20  # a glmq report is KB to a few MB; tokenizer.json, the index and the manifest are not read


def glmq_report_kind(path: Path) -> str | None:
    """"run", "eval" or "validate" for a JSON report a glmq command wrote (told by its keys: the names are the
    user's), None for any other file. config.json, the index and the manifest have none of these keys."""
    if path.name in ("config.json", "glmq_manifest.json") or path.name.endswith(".index.json"):
        return None
    try:
        if path.stat().st_size > _REPORT_MAX_BYTES:
            return None
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    if "glmq_version" in doc and "by_class" in doc:
        return "run"
    rows = doc.get("models")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) and "kl_to_source" in r for r in rows):
        return "eval"
    if {"checks", "valid", "exit_code"} <= doc.keys():
        return "validate"
    return None


def _listing(folder: Path) -> list[tuple[str, Path]]:
    """(path in the repo, file) of every file under the folder, as huggingface_hub lists them for an upload: `**/*`
    under the resolved folder, relative POSIX paths."""
    root = folder.expanduser().resolve()
    return sorted((p.relative_to(root).as_posix(), p) for p in root.glob("**/*") if p.is_file())


def split_files(folder: Path, local: list[str] = ()) -> tuple[dict[str, int], list[str]]:
    """({path in repo: bytes} the upload sends, [paths it leaves out]).

    The listing is huggingface_hub's own (upload_folder and upload_large_folder both glob `**/*`
    under the resolved folder and pass the relative POSIX paths through `filter_repo_objects` with
    our patterns, `local` (`local_patterns`) and DEFAULT_IGNORE_PATTERNS: .git, .cache/huggingface).
    """
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    files = dict(_listing(folder))
    kept = set(filter_repo_objects(list(files), ignore_patterns=ignore_patterns() + list(local)
                                   + list(DEFAULT_IGNORE_PATTERNS)))
    return {n: p.stat().st_size for n, p in files.items() if n in kept}, [n for n in files if n not in kept]


def files_with_card(files: dict[str, int], card: str | None) -> dict[str, int]:
    """The listing as it will be once the card is written (README.md at the card's size)."""
    return files if card is None else {**files, README: len(card.encode())}


def published_sizes(files: dict[str, int], report: bytes | None) -> dict[str, int]:
    """The listing's sizes as sent: the run report goes up as `public_report` wrote it (`report`; local paths cut to
    their names), not at its size on disk."""
    from glmq.formats.manifest import REPORT_NAME

    return files if report is None or REPORT_NAME not in files else {**files, REPORT_NAME: len(report)}


# ----------------------------------------------------------------------------------------- checks
def check_arguments(o: UploadOptions) -> Path:
    """The folder is a checkpoint folder, the ids are ORG/NAME, a token is there for a real upload.

    Raises:
        UploadError (exit 2).
    """
    from glmq.formats.model_card import is_repo_id

    folder = o.checkpoint
    try:
        is_dir = folder.is_dir()
    except OSError as e:  # e.g. a name longer than the file system takes (is_dir ignores only "no such file")
        raise UploadError(f"{folder}: {e.strerror}; pass the folder `glmq quantize -o` wrote", 2) from e
    if not is_dir:
        raise UploadError(f"{folder}: no such folder; pass the folder `glmq quantize -o` wrote", 2)
    if not (folder / "config.json").is_file():
        raise UploadError(f"{folder}: no config.json, so not a checkpoint (glmq writes it last: re-run the same "
                          f"`glmq quantize` to finish an interrupted conversion)", 2)
    for flag, value in (("--repo-id", o.repo_id), ("--base-model", o.base_model)):
        if value is not None and not is_repo_id(value):
            raise UploadError(f"{flag} {value!r}: not a Hub model id; spell it ORG/NAME (ASCII letters, digits, "
                              f"'-', '_', '.'; neither part starts or ends with '-' or '.', no '--' or '..', no "
                              f"'.git' at the end; at most 96 characters each side of the '/'"
                              + (f", this one has {longest}" if (longest := max(map(len, value.split("/")))) > 96
                                 else "") + ")", 2)
    if o.revision is not None and not _branch_ok(o.revision):  # the Hub refused it after README.md was written
        raise UploadError(f"--revision {o.revision!r}: not a branch name (non-empty; no spaces, '..', '//', '~', "
                          f"'^', ':', '?', '*', '[', '\\' or '@{{'; not starting with '-' or '/', nor ending with "
                          f"'/', '.' or '.lock'); leave it out for main", 2)
    if o.license is not None and not _LICENSE.fullmatch(o.license):  # the Hub refused it after the card was written
        raise UploadError(f"--license {o.license!r}: not a Hub license id (lowercase letters, digits, '.', '-', '+'; "
                          f"e.g. mit, apache-2.0, cc-by-4.0, or other for a license the Hub does not list)", 2)
    card_only = _card_only_flags(o)
    if o.no_card and card_only:  # they only fill the card's metadata: with no card they would be dropped unsaid
        raise UploadError(f"{' and '.join(card_only)} {'go' if len(card_only) > 1 else 'goes'} into the model "
                          f"card's metadata only, and --no-card writes "
                          f"none; drop {'them' if len(card_only) > 1 else 'it'}, or drop --no-card", 2)
    if not o.dry_run:
        from huggingface_hub import get_token

        if get_token() is None:
            raise UploadError(f"no Hugging Face token to upload {folder}: run `hf auth login` or set HF_TOKEN "
                              f"(a token with write access to {o.repo_id.split('/')[0]}), or use --dry-run", 2)
    return folder


def gate(folder: Path, o: UploadOptions) -> dict:
    """Run `glmq validate`; return its report as a dict for the card.

    Raises:
        UploadError: invalid (exit 1) or validation could not run (exit 2), unless --allow-invalid.
    """
    from glmq.quantize import validate as v

    doing = "would upload" if o.dry_run else "uploading"
    try:
        rep = v.validate(folder, sample=o.sample, device=o.device, tp=o.tp, serving=True)
    except v.CannotValidate as e:
        if isinstance(e, v.BeingWritten):  # not even with --allow-invalid: the files are not all there yet
            raise UploadError(f"{e}; nothing was uploaded", 2) from e
        if not o.allow_invalid:
            raise UploadError(f"{folder}: glmq validate could not run ({e}); fix that (a --device this machine "
                              f"has, say), or pass --allow-invalid to upload it unvalidated", 2) from e
        _loud(f"{doing} {folder} although glmq validate could not run ({e}); the model card says so")
        return {"valid": None, "error": str(e)}
    click.echo(v.format_report(rep), err=True)
    failed = sorted(k for k, c in rep.checks.items() if c.status is v.Status.FAIL)
    if not rep.valid and not o.allow_invalid:
        # the serving rules depend on --tp (default 8; `glmq validate`'s is 1): a checkpoint that passes
        # `glmq validate` may fail here only because it cannot be served at this degree (said only when serving is
        # the one check that failed: not for an FP8 source, say, which fails structure and config too)
        tp = ("If you serve it at another tensor-parallel degree, pass that as --tp N (the card's serve commands "
              "use it); otherwise fix" if failed == ["serving"] else "Fix")
        raise UploadError(f"{folder} did not pass glmq validate (failed checks: {', '.join(failed)}; at --tp {o.tp}); "
                          f"nothing was uploaded. {tp} the checkpoint, or pass --allow-invalid to upload it with a "
                          f"warning in its model card", 1)
    if not rep.valid:
        _loud(f"{doing} {folder} although it did not pass glmq validate (failed checks: {', '.join(failed)}); the "
              f"model card says so")
    return rep.to_dict()


# Tokenizer files, one of which `vllm serve FOLDER` and SGLang read from the model folder (GLM, DeepSeek:
# tokenizer.json; Kimi K2: tiktoken.model; sentencepiece and BPE vocabularies otherwise)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "spiece.model")


def warn_without_tokenizer(files: dict[str, int]) -> None:
    """A loud warning when the files to upload hold no tokenizer: the weights pass validate, but the card's serve
    commands (which load the tokenizer from the repo) would fail."""
    if not set(files) & set(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in files):
        _loud(f"no tokenizer file among the files to upload ({', '.join(TOKENIZER_FILES)}): the model card's serve "
              f"commands load it from the repo and would fail; copy the source's tokenizer files into the folder "
              f"(glmq quantize copies them) and rerun")


def _loud(message: str) -> None:
    click.secho(f"WARNING: {message}", fg="red", bold=True, err=True)


# ----------------------------------------------------------------------------------------- card
def _read_json(path: Path, what: str) -> dict | None:
    """A JSON object from `path`, None when the file does not exist; UploadError (exit 2) when unreadable."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UploadError(f"{path}: unreadable {what} ({e}); fix or remove it", 2) from e
    if not isinstance(doc, dict):
        raise UploadError(f"{path}: {what} is not a JSON object; fix or remove it", 2)
    return doc


def read_eval(folder: Path, given: Path | None) -> dict | None:
    """--eval-report, else glmq_eval.json in the folder, else None; checked against compare()'s format and against
    the folder's weights (formats/manifest.fingerprint): this checkpoint's row is the one of its name whose fingerprint
    matches (or that has none: an older report), else, for a folder renamed since, the one whose fingerprint matches."""
    from glmq.formats.manifest import fingerprint

    path = given or folder / EVAL_NAME
    if given is not None and not given.is_file():
        raise UploadError(f"--eval-report {given}: no such file; write one with `glmq eval ... --json FILE`", 2)
    doc = _read_json(path, "glmq eval report")
    if doc is None:
        return None
    rows = doc.get("models")
    keys = ("checkpoint", "perplexity", "kl_to_source")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                         for r in rows):
        raise UploadError(f"{path}: not a `glmq eval --json` result (expected \"models\": [{{{', '.join(keys)}, "
                          f"layer_rel_error}}, ...]); pass the file `glmq eval --json` wrote", 2)
    for r in rows:  # "." names no folder (`glmq eval SOURCE . --json glmq_eval.json` run in the checkpoint folder):
        if not PurePath(str(r["checkpoint"])).name:  # taken from where the report lies; the card shows names only
            r["checkpoint"] = str((path.parent / str(r["checkpoint"])).resolve())
    name = folder.resolve().name
    names = [PurePath(str(r["checkpoint"])).name for r in rows[1:]]  # rows[0] is the source
    named = [i for i, n in enumerate(names, 1) if n == name]
    # the weights evaluated (`glmq eval` records a fingerprint per model; older reports have none): a row of this name
    # whose fingerprint differs evaluated another folder of that name, or this one before it was quantized again
    weights = fingerprint(folder)
    same = [i for i in named if rows[i].get("fingerprint") in (weights, None)]
    if not same:  # renamed or copied since it was evaluated: the fingerprint alone still tells which row is this one
        same = [i for i in range(1, len(rows)) if rows[i].get("fingerprint") == weights]
    if not same:  # the card would show other models' numbers (as this one's, by name) and none of this one's
        why = (f"{path} evaluates {', '.join(names) or 'no quantized model'}, not this checkpoint ({name})" if not named
               else f"{path} evaluates another checkpoint named {name} (its tensors differ from those in {folder}: "
                    f"another folder of that name, or this one before it was quantized again)")
        why += f"; run `glmq eval SOURCE {folder} ... --json FILE`"
        if given is not None:
            raise UploadError(f"--eval-report {why}", 2)
        click.secho(f"warning: {why}; the card leaves the evaluation out", fg="yellow", err=True)
        return None
    if rows[same[0]].get("fingerprint") is None:
        click.secho(f"warning: {path} is from a glmq eval that recorded no fingerprint of the weights, so it cannot be "
                    f"confirmed to evaluate the tensors now in {folder}; evaluate again to be sure", fg="yellow",
                    err=True)
    doc["this_checkpoint_row"] = same[0]  # the row the card labels as this checkpoint (formats/model_card.py)
    # `glmq eval` writes null for a figure that is inf or nan (and exits 1): the source's or this checkpoint's makes
    # no table; another model's shows as "-"
    from glmq.formats.model_card import finite_figure

    mine = [rows[0], rows[same[0]]]
    broken = [str(r["checkpoint"]) for r in mine if not all(finite_figure(r[k]) for k in keys[1:])]
    if broken:
        raise UploadError(f"{path}: the figures of {', '.join(broken)} are not finite numbers (`glmq eval` failed on "
                          f"{'it' if len(broken) == 1 else 'them'}: a broken model); fix it and evaluate again, or "
                          f"pass another --eval-report", 2)
    return doc


def make_card(folder: Path, o: UploadOptions, validation: dict, evaluation: dict | None):
    """The ModelCard from the folder's files, the eval report (`read_eval`) and the validation result."""
    from glmq.formats.manifest import MANIFEST_NAME, REPORT_NAME
    from glmq.formats.model_card import CardInputs, base_model, build_card

    manifest = _read_json(folder / MANIFEST_NAME, "glmq manifest")
    if manifest is None:
        click.secho(f"warning: {folder} has no {MANIFEST_NAME}: not written by glmq (or the manifest was removed), so "
                    f"tensor checksums are not verified and the card cannot name the recipe", fg="yellow", err=True)
    inp = CardInputs(repo_id=o.repo_id, checkpoint_name=folder.resolve().name,
                     config=_read_json(folder / "config.json", "config.json") or {},
                     report=_read_json(folder / REPORT_NAME, "glmq report"), manifest=manifest,
                     eval_result=evaluation, validation=validation, base_model=o.base_model,
                     license=o.license, tp=o.tp, revision=o.revision,
                     tokenizer_config=_read_json(folder / "tokenizer_config.json", "tokenizer_config.json"))
    base, origin = base_model(inp)
    if base is None:
        click.secho(f"warning: base model unknown, {origin}; the card leaves base_model out (pass --base-model "
                    f"ORG/NAME)", fg="yellow", err=True)
    else:
        click.echo(f"base model {base} (from {origin})", err=True)
    return build_card(inp)


def _card_only_flags(o: UploadOptions) -> list[str]:
    """The options given that only fill the generated card's metadata."""
    return [flag for flag, value in (("--license", o.license), ("--base-model", o.base_model)) if value is not None]


def card_action(folder: Path, no_card: bool) -> str:
    """"write" the card as README.md, "keep" a README.md glmq did not write, or "none" (--no-card)."""
    from glmq.formats.model_card import is_glmq_card

    if no_card:
        return "none"
    path = folder / README
    if path.is_file() and not is_glmq_card(path.read_text(errors="replace")):
        return "keep"
    return "write"


# ----------------------------------------------------------------------------------------- hub
def _deprecated(fn) -> bool:
    return "deprecated" in (fn.__doc__ or "").lower()


def _branch_ok(name: str) -> bool:
    """Whether `name` is a branch name git (and so the Hub) takes: `git check-ref-format --branch`'s rules, by hand
    (huggingface_hub sends the name as given and the Hub answers only after the card was written)."""
    bad = (" ", "..", "//", "~", "^", ":", "?", "*", "[", "\\", "@{")  # (tabs and other controls: isprintable)
    return (bool(name) and name.isprintable() and not any(b in name for b in bad) and name != "@"
            and not name.startswith(("-", "/", ".")) and not name.endswith(("/", ".", ".lock"))
            and "/." not in name)


def upload_method(api, revision: str | None) -> str:
    """"upload_large_folder" or "upload_folder", from what the installed huggingface_hub offers.

    upload_large_folder (resumable, several commits) only commits to main here. huggingface_hub 1.x
    documents it as deprecated: there upload_folder itself streams, commits in parts and resumes, but
    only through hf_xet; without hf_xet it is one commit, so the large-folder call is still the safer one.
    """
    if revision not in (None, MAIN) or not hasattr(api, "upload_large_folder"):
        return "upload_folder"
    if _deprecated(api.upload_large_folder) and importlib.util.find_spec("hf_xet") is not None:
        return "upload_folder"
    return "upload_large_folder"


def push(folder: Path, o: UploadOptions, api, method: str, report: bytes | None, local: list[str] = ()) -> None:
    """create_repo(exist_ok), the branch when --revision names one, then the upload call; `report`: the run report as
    published (`public_report`), sent in place of the local file; `local`: `local_patterns`, also left out."""
    private = True if o.private else None  # None: the namespace's default visibility
    api.create_repo(o.repo_id, repo_type="model", private=private, exist_ok=True)
    if o.revision not in (None, MAIN):
        api.create_branch(o.repo_id, branch=o.revision, repo_type="model", exist_ok=True)
    from glmq.formats.manifest import REPORT_NAME

    kw = {"repo_id": o.repo_id, "folder_path": str(folder), "repo_type": "model", "revision": o.revision,
          # a fresh list: huggingface_hub appends its defaults to it
          "ignore_patterns": ignore_patterns() + list(local) + ([REPORT_NAME] if report is not None else [])}
    if method == "upload_large_folder":
        api.upload_large_folder(private=private, **kw)
    else:
        api.upload_folder(commit_message=f"glmq upload of {folder.resolve().name}", **kw)
    if report is not None:  # after the weights: a failure here leaves a checkpoint that loads, and the rerun sends it
        api.upload_file(path_or_fileobj=report, path_in_repo=REPORT_NAME, repo_id=o.repo_id, repo_type="model",
                        revision=o.revision, commit_message=f"glmq run report of {folder.resolve().name}")


# report keys whose value is a folder on the uploader's machine, however it was spelled (`ckpt/GLM-5-FP8` too): the
# source (quantize/stream.py make_report) and GPTQ's --offload-activations (calibration/report.py)
PATH_KEYS = frozenset({"source", "offload_activations"})


def public_report(path: Path) -> bytes | None:
    """The run report as published: every string that is a path on the uploader's machine (the source folder, a
    GPTQ calibration file, an --offload-activations folder) reduced to its last component, as the card shows them;
    None without a report. The local file keeps the paths (the card reads the source's Hub cache path from it)."""
    from glmq.formats.model_card import public_calibration, public_folder, public_path

    doc = _read_json(path, "glmq report")
    if doc is None:
        return None

    def clean(v, key: str | None = None):  # key: the dict key the value is under
        if isinstance(v, dict):
            return {k: clean(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if not isinstance(v, str):
            return v
        return public_folder(v) if key in PATH_KEYS else public_calibration(v) if key == "calibration" else \
            public_path(v)

    return (json.dumps(clean(doc), indent=1) + "\n").encode()


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises on refusal or no network: HfHubHTTPError, OSError (token file,
    0.x's requests errors), ValueError (bad arguments) and the HTTP client's transport errors."""
    from huggingface_hub.errors import HfHubHTTPError

    errors: list[type[BaseException]] = [HfHubHTTPError, OSError, ValueError]
    for module, name in (("httpx", "HTTPError"), ("requests", "RequestException")):
        if importlib.util.find_spec(module) is not None:
            errors.append(getattr(importlib.import_module(module), name))
    return tuple(errors)


# the request id huggingface_hub writes into its messages, on a line of its own before a 400's or 403's text
_REQUEST_ID = re.compile(r"^\([\w ]+ ID: [^)]*\)$")


def _hub_reason(e: BaseException) -> str:
    """The Hub's own reason on one line: huggingface_hub's `server_message` (the response's error text, which its
    message puts after its own lines: a 400's "Bad request for commit endpoint:" then the reason), else the first
    line of the message that is not the request id."""
    server = getattr(e, "server_message", None)
    if server:
        return " ".join(line.strip() for line in server.splitlines() if line.strip())
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not _REQUEST_ID.match(line.strip())]
    return (lines or [""])[0]


def push_or_explain(folder: Path, o: UploadOptions, api, method: str, report: bytes | None,
                    local: list[str] = ()) -> None:
    """`push`, with any Hub failure turned into one line naming the checkpoint, the Hub's reason and what to do
    (exit 3)."""
    from huggingface_hub.errors import HFValidationError

    try:
        push(folder, o, api, method, report, local)
    except _hub_errors() as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            hint = f"check that your token (`hf auth login` or HF_TOKEN) has write access to {o.repo_id.split('/')[0]}"
        elif status is not None and 400 <= status < 500 and status not in (408, 409, 429):
            # refused for what was sent (a 400 for README metadata it rejects: a --base-model it cannot resolve, a
            # --license not on its list; 413 storage quota): the same command gets the same answer
            hint = ("the Hub refused the request: fix what it says (the card's metadata comes from --base-model and "
                    "--license), then rerun the same command")
        elif isinstance(e, HFValidationError):  # refused by the client, before anything was sent
            hint = "huggingface_hub refused the arguments before sending anything: fix what it says, then rerun"
        else:
            hint = "check the network and rerun the same command: files already on the Hub are not sent again"
        raise UploadError(f"uploading {folder} to {o.repo_id} failed ({type(e).__name__}: {_hub_reason(e)}); {hint}",
                          3) from e


# ----------------------------------------------------------------------------------------- driver
def _print_listing(files: dict[str, int], skipped: list[str], o: UploadOptions, method: str) -> None:
    from glmq.formats.model_card import human_bytes

    verb = "would upload" if o.dry_run else "uploading"
    click.echo(f"{verb} {len(files)} files to {o.repo_id} (revision {o.revision or MAIN}, "
               f"{'private' if o.private else 'default visibility'}) with HfApi.{method}:")
    for name, size in sorted(files.items()):
        click.echo(f"{size:>15,d}  {name}")
    click.echo(f"{sum(files.values()):>15,d}  total ({human_bytes(sum(files.values()))})")
    for name in skipped:
        click.echo(f"{'skipped':>15s}  {name} (glmq working file, a report with local paths, or Hub client cache)")


def upload(o: UploadOptions) -> None:
    """Steps 1-6 of the module docstring, holding the folder's read lock. Raises UploadError with the exit code."""
    from glmq.quantize.validate import BeingWritten
    from glmq.quantize.validate.driver import reading

    folder = check_arguments(o)
    try:
        with reading(folder):  # from the gate to the end of the push: no glmq quantize rewrites the folder meanwhile
            _upload(folder, o)
    except BeingWritten as e:  # (raised by `reading` itself, before the gate)
        raise UploadError(f"{e}; nothing was uploaded", 2) from None


def _upload(folder: Path, o: UploadOptions) -> None:
    from huggingface_hub import HfApi

    evaluation = read_eval(folder, o.eval_report)  # before the gate: a wrong report is refused before a full validate
    card = make_card(folder, o, gate(folder, o), evaluation)
    action = card_action(folder, o.no_card)
    if action == "keep":
        dropped = _card_only_flags(o)
        click.secho(f"warning: keeping {folder / README}: glmq did not write it, so the generated card is not "
                    f"written (merge it by hand; --dry-run prints it)"
                    + (f"; {' and '.join(dropped)} reach{'' if len(dropped) > 1 else 'es'} the Hub only through that "
                       f"card" if dropped else ""),
                    fg="yellow", err=True)
    text = str(card) if action == "write" else None
    local = local_patterns(folder, o.eval_report)  # once, for the listing and the push
    files, skipped = split_files(folder, local)
    api = HfApi()
    method = upload_method(api, o.revision)
    from glmq.formats.manifest import REPORT_NAME

    report = public_report(folder / REPORT_NAME)  # read once: the listing gives its size, the push sends it
    _print_listing(files_with_card(published_sizes(files, report), text), skipped, o, method)
    warn_without_tokenizer(files)
    if o.dry_run:
        if action != "none":
            click.echo(f"\n--- {README} ({'would be written' if text else 'not written: ' + action}) ---\n{card}")
        return
    if text is not None:
        from glmq.formats.safetensors_io import atomic_write_text

        try:
            atomic_write_text(folder / README, text)
        except OSError as e:  # a full disk or a read-only folder: before anything is sent (a traceback before)
            from glmq.scripts.cli import CannotStart

            raise CannotStart(f"{folder / README}: the model card could not be written ({e.strerror or e}); "
                                       f"free space or make the folder writable, or pass --no-card") from e
    push_or_explain(folder, o, api, method, report, local)
    click.echo(f"uploaded {folder} to https://huggingface.co/{o.repo_id}"
               + (f"/tree/{o.revision}" if o.revision not in (None, MAIN) else ""))


def _reject_nan(ctx, param, value):
    """cli.reject_nan (imported when called: the CLI module imports this one)."""
    from glmq.scripts.cli import reject_nan

    return reject_nan(ctx, param, value)


@click.command("upload")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--repo-id", required=True, metavar="ORG/NAME",
              help="Hub model repo to create (if missing) and upload to.")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", default=None, metavar="BRANCH",
              help="Branch to upload to, created if missing [default: main].")
@click.option("--base-model", default=None, metavar="ORG/NAME",
              help="Base model for the card's metadata [default: config.json's _name_or_path when it is an "
                   "ORG/NAME id, or ORG/NAME of a source in the Hugging Face cache (models--ORG--NAME); a local "
                   "source folder's name is not guessed from].")
@click.option("--license", "license_", default=None, help="License id for the card's metadata (e.g. mit, apache-2.0).")
@click.option("--tp", type=click.IntRange(min=1), default=SERVE_TP, show_default=True,
              help="Tensor-parallel degree: the serving rules are validated at it and the serve commands use it.")
@click.option("--eval-report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"`glmq eval --json` output for the card's evaluation table [default: {EVAL_NAME} in the folder].")
@click.option("--sample", type=click.FloatRange(0, 1, min_open=True), default=0.01, show_default=True,
              callback=_reject_nan,
              help="Fraction of quantized modules that get validate's kernel check (all tensors are checksummed).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where validate runs the kernel check.")
@click.option("--allow-invalid", is_flag=True,
              help="Upload even when glmq validate fails or cannot run; the model card then opens with a warning.")
@click.option("--no-card", is_flag=True, help="Do not write README.md (a README.md already there is uploaded as is).")
@click.option("--dry-run", is_flag=True,
              help="Validate, list the files and sizes and print the card; no network, no writes.")
def upload_cmd(checkpoint, repo_id, private, revision, base_model, license_, tp, eval_report, sample, device,
               allow_invalid, no_card, dry_run):
    """Validate CHECKPOINT, write its model card and upload it to the Hugging Face Hub.

    Exit code 0: uploaded (or dry run); 1: glmq validate failed; 2: could not run; 3: the Hub upload failed.
    """
    opts = UploadOptions(checkpoint, repo_id, private, revision, base_model, license_, tp, eval_report, sample,
                         device, allow_invalid, no_card, dry_run)
    try:
        upload(opts)
    except UploadError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(e.code)
