"""Calibration sets: text in, `[samples, seq_len]` token ids out, tokenized by the checkpoint's tokenizer.

Sources (`spec`):
- a local file: `.jsonl` (one JSON object per line with a "text" field), `.json` (the same JSON Lines, as
  `datasets`' `to_json` writes them, one JSON array of such objects, or one such object), `.parquet` (a "text"
  column of strings; needs pyarrow), anything else is read as plain UTF-8 text;
- otherwise a Hugging Face dataset name, `NAME` or `NAME:CONFIG`, or a local dataset folder (split "train",
  field "text"), read through the `datasets` package when it is installed (needs network or a local HF cache).

Packing: documents are tokenized without special tokens and joined into one stream, separated by the
tokenizer's EOS token when it has one (a long document, such as a plain text file, in pieces of about PIECE_CHARS
characters cut where its tokens do not change: `_pieces`); the stream is cut into non-overlapping windows of `seq_len`
tokens, and `samples` of them are drawn without replacement by a `torch.Generator` seeded with `seed`
(same inputs, same tensor). A stream shorter than `samples` windows is an error, not a silent reuse.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import torch

log = logging.getLogger("glmq")

TEXT_FIELD = "text"
FILE_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet")  # a spec ending so names a local file
# Datasets are read document by document until the stream holds this many times the tokens needed,
# so that the windows are drawn from more than the first few documents.
DATASET_TOKEN_FACTOR = 4
# A document longer than twice this is tokenized in pieces of about this many characters (`_pieces`): a tokenizer's
# call keeps ~600 bytes a token (its offsets, token strings and Python ints), so one call on a 20 MB text file took
# 3.7 GB, and a 500 MB one would have needed ~75 GB before any calibration work.
PIECE_CHARS = 1 << 20
_CUT_CONTEXT = 256  # characters on each side of a cut that `_safe_cut` tokenizes together and apart
_CUT_SEARCH = 4096  # characters after the wanted cut in which `_safe_cut` looks for a pre-token boundary
_CUT_TRIES = 8  # pre-token boundaries `_safe_cut` checks before it gives up cutting a document
_UNCUT_SAID: list = []  # `_pieces` warned once that a long document stays one call
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud83d" escape alone (half of an emoji cut off): no text


class CalibrationDataError(ValueError):
    pass


def load_tokenizer(checkpoint: str | Path, trust_remote_code: bool = False, *, error: type[Exception] = None,
                   fix: str = "GPTQ calibration tokenizes the text with the checkpoint's own tokenizer "
                              "(tokenizer.json + tokenizer_config.json in the model folder)"):
    """The checkpoint's own tokenizer. `trust_remote_code` lets a tokenizer whose class is code in the model folder
    run it (Kimi K2's tiktoken tokenizer); it is passed explicitly either way, so transformers never prompts.

    Raises:
        `error` (default CalibrationDataError) naming the folder, why, and `fix` (what to do).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=trust_remote_code)
    except Exception as e:  # (not only OSError/ValueError: a Kimi K2 folder read without its code, an AttributeError)
        why = " ".join(str(e).split()) or type(e).__name__
        remote = not trust_remote_code and ("trust_remote_code" in why or _names_remote_code(Path(checkpoint)))
        hint = ("; its tokenizer or config is code in the model folder (auto_map): if you trust that code, pass "
                "--trust-remote-code" if remote else "")
        tail = "" if isinstance(e, ImportError) else f"; {fix}"  # (a missing package: the message says what to install)
        raise (error or CalibrationDataError)(f"{checkpoint}: cannot load its tokenizer ({why}){hint}{tail}") from e


def _names_remote_code(folder: Path) -> bool:
    """Whether the folder's config.json or tokenizer_config.json maps a class onto code in the folder (auto_map)."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            if "auto_map" in json.loads((folder / name).read_text()):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def calibration_tokens(checkpoint: str | Path, spec: str, samples: int = 128, seq_len: int = 256,
                       seed: int = 0, tokenizer=None, trust_remote_code: bool = False) -> torch.Tensor:
    """The calibration set: int64 `[samples, seq_len]` token ids.

    Args:
        checkpoint: the source checkpoint folder (its tokenizer is used unless `tokenizer` is given).
        spec: a .txt/.jsonl/.parquet path or a Hugging Face dataset name (module docstring).
        samples, seq_len: windows drawn and their length in tokens.
        seed: seeds the window draw (and the document order of a dataset).
        trust_remote_code: see `load_tokenizer`.
    Raises:
        CalibrationDataError: unreadable source, missing "text" field, too little text, no tokenizer.
    """
    if samples <= 0 or seq_len <= 1:
        raise CalibrationDataError(f"need samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")
    tok = tokenizer or load_tokenizer(checkpoint, trust_remote_code)
    need = samples * seq_len
    path = Path(spec)
    if path.exists() and not path.is_dir():  # a file, or a pipe (`--calibration <(zcat corpus.txt.gz)`)
        docs = iter_file(path)
        budget = None  # a local file is used whole
    elif path.suffix.lower() in FILE_SUFFIXES and not path.exists():  # a mistyped file, not a dataset name for the Hub
        raise CalibrationDataError(f"{spec}: no such file (the current folder is {Path.cwd()})")
    else:
        docs = iter_dataset(spec, seed)
        budget = DATASET_TOKEN_FACTOR * need
    stream = token_stream(tok, docs, budget)
    windows = stream.numel() // seq_len
    if windows < samples:
        raise CalibrationDataError(
            f"{spec}: {stream.numel()} tokens make {windows} windows of {seq_len}, fewer than the {samples} "
            f"samples asked for; use fewer --samples, a shorter --seq-len or more text")
    pick = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:samples]
    return stream[: windows * seq_len].view(windows, seq_len)[pick].clone()


def check_every_rank_reads(spec: str) -> None:
    """Raise CalibrationDataError where each rank of a distributed run cannot read `spec` whole for itself: a pipe
    (`--calibration <(zcat corpus.gz)`) would be split between the ranks, and torchrun's ranks do not inherit the
    shell's /dev/fd/N at all (it was then taken for a dataset name)."""
    path = Path(spec)
    if spec.startswith("/dev/fd/") or (path.exists() and not path.is_dir() and not path.is_file()):
        raise CalibrationDataError(f"{spec}: not a regular file (a pipe?), which the ranks of a distributed run "
                                   f"cannot each read whole; write the text to a file and pass that")


def check_token_ids(ids: torch.Tensor, model_dir: str | Path, config: dict,
                    error: type[Exception] = CalibrationDataError) -> None:
    """Raise `error` when a token id has no row in the model's embeddings (config.json's vocab_size): a tokenizer of
    another model, with a larger vocabulary, gave an IndexError traceback inside the first layer's forward."""
    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):
        vocab = config["text_config"].get("vocab_size")
    if ids.numel() == 0 or type(vocab) is not int:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise error(f"{model_dir}: the text's token ids run from {lo} to {hi}, outside the model's {vocab}-token "
                    f"vocabulary (config.json's vocab_size): its tokenizer is not this model's; copy tokenizer.json "
                    f"and tokenizer_config.json from the original model into it")


def token_stream(tok, docs, budget: int | None, prefix: int | None = None) -> torch.Tensor:
    """Tokenize `docs` into one int64 stream (EOS between documents), stopping at the end of the document that
    brings it past `budget` tokens, or, with `prefix`, once it holds that many (the stream's first `prefix` tokens
    are the same either way: `glmq eval` reads the first windows of its text only)."""
    eos = None if tok.eos_token_id is None else torch.tensor([tok.eos_token_id], dtype=torch.int64)
    parts: list[torch.Tensor] = []
    total = 0
    for doc in docs:
        first = True
        for ids in _pieces(tok, doc):
            if not ids.numel():
                continue
            if first and parts and eos is not None:
                parts.append(eos)
                total += 1
            first = False
            parts.append(ids)
            total += ids.numel()
            if prefix is not None and total >= prefix:
                return torch.cat(parts)
        if budget is not None and total >= budget:
            break
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _encode(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.int64)


def _pieces(tok, doc: str):
    """`doc`'s token ids, as one call on it would give them, in pieces of about PIECE_CHARS characters where it is
    longer than twice that (hand-written: tokenizers has no streaming encode, and a tokenizer's call on a whole
    text file kept ~600 bytes a token). Each cut is one `_safe_cut` found; where none is, the rest is one call."""
    start = 0
    while len(doc) - start > 2 * PIECE_CHARS:
        if (cut := _safe_cut(tok, doc, start + PIECE_CHARS)) is None:
            if not _UNCUT_SAID:
                _UNCUT_SAID.append(True)
                log.warning("a calibration or evaluation document of %d characters is tokenized in one call (~600 "
                            "bytes of memory a token): no cut was found where this tokenizer's ids stay the same",
                            len(doc) - start)
            break
        yield _encode(tok, doc[start:cut])
        start = cut
    yield _encode(tok, doc[start:])


def _safe_cut(tok, doc: str, near: int) -> int | None:
    """A position in `doc` at or after `near` where its ids split: a boundary between two of the tokenizer's own
    pre-tokens (its pre-tokenizer run on the text around it; BPE, WordPiece and Unigram models never merge across
    one), whose `_CUT_CONTEXT` characters on each side also tokenize to the same ids together as apart (what a
    normalizer, or a mark the tokenizer puts at the start of every text, SentencePiece's "▁", would change). None
    where the tokenizer has no pre-tokenizer to ask (a slow tokenizer; or a BPE without a word-splitting one merges
    across any cut, so nothing local shows a cut safe), or where none of the first `_CUT_TRIES` boundaries holds."""
    pre = getattr(getattr(tok, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre is None:
        return None
    lo = max(0, near - _CUT_CONTEXT)
    window = doc[lo:near + _CUT_SEARCH]
    ends = [lo + end for end in _pre_token_ends(pre, window) if lo + end >= near and end <= len(window) - _CUT_CONTEXT]
    for cut in ends[:_CUT_TRIES]:
        left, right = doc[max(0, cut - _CUT_CONTEXT):cut], doc[cut:cut + _CUT_CONTEXT]
        if len(left) in _pre_token_ends(pre, left + right) and \
                torch.equal(_encode(tok, left + right), torch.cat([_encode(tok, left), _encode(tok, right)])):
            return cut
    return None


def _pre_token_ends(pre, text: str) -> list[int]:
    """Where the pre-tokens of `text` end (character offsets), by the tokenizer's own pre-tokenizer; [] if it fails."""
    try:
        return [end for _, (_, end) in pre.pre_tokenize_str(text)]
    except Exception:  # noqa: BLE001 - a pre-tokenizer that cannot run alone: no cut, one call
        return []


def iter_file(path: Path):
    """Documents of a local file: JSONL lines' "text", a Parquet "text" column, or the whole text."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path)
    elif suffix == ".json":  # read as plain text, its JSON syntax and escapes would be calibrated on
        yield from _json(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    else:
        try:
            yield path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no text to calibrate on
        except UnicodeDecodeError as e:
            raise CalibrationDataError(f"{path}: not UTF-8 text ({e}); save it as UTF-8 (or give the text as "
                                       f".jsonl, .json or .parquet documents)") from e


def _jsonl(path: Path):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark (Windows editors) is no JSON
            except UnicodeDecodeError as e:
                raise CalibrationDataError(f"{path}:{n}: not UTF-8 text ({e})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise CalibrationDataError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get(TEXT_FIELD), str):
                raise CalibrationDataError(f"{path}:{n}: each line must be an object with a string "
                                           f"{TEXT_FIELD!r} field")
            yield _unicode(row[TEXT_FIELD], f"{path}:{n}")


def _json(path: Path):
    """A `.json` file: one JSON array of objects with a "text" field, one such object (over several lines, as
    `json.dump(..., indent=2)` writes it), else JSON Lines (`_jsonl`)."""
    with open(path, "rb") as f:
        first = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()  # past a UTF-8 byte-order mark
    if first.startswith(b"{") and _one_object(path):
        try:
            row = json.loads(path.read_bytes().decode("utf-8-sig"))
        except ValueError as e:  # (UnicodeDecodeError is one)
            raise CalibrationDataError(f"{path}: neither one JSON object nor JSON Lines ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get(TEXT_FIELD), str):
            raise CalibrationDataError(f"{path}: the object must have a string {TEXT_FIELD!r} field")
        yield _unicode(row[TEXT_FIELD], str(path))
        return
    if not first.startswith(b"["):
        yield from _jsonl(path)
        return
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except ValueError as e:  # (UnicodeDecodeError is one)
        raise CalibrationDataError(f"{path}: not a valid JSON array ({e})") from e
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get(TEXT_FIELD), str):
            raise CalibrationDataError(f"{path}: item {n} of the array must be an object with a string "
                                       f"{TEXT_FIELD!r} field")
        yield _unicode(row[TEXT_FIELD], f"{path}: item {n}")


def _unicode(text: str, where: str) -> str:
    """`text` unless it holds a lone surrogate (a JSON "\\ud83d" escape without its pair: half an emoji, cut off by a
    scraper), which no tokenizer takes (a TypeError traceback from the tokenizer, exit 1, before this check)."""
    if m := _SURROGATE.search(text):
        raise CalibrationDataError(f"{where}: the text holds a lone surrogate, \\u{ord(m.group()):04x} at "
                                   f"character {m.start()}, which is no Unicode character (half of an escaped pair, "
                                   f"e.g. an emoji cut off); fix or drop that record")
    return text


def _one_object(path: Path) -> bool:
    """Whether a `.json` file that starts with `{` is one object over several lines rather than JSON Lines: its first
    non-blank line is no whole JSON value. (Read only for such files: an array on one line would be read twice.)"""
    with open(path, "rb") as f:
        line = next((x for x in f if x.strip()), b"").removeprefix(b"\xef\xbb\xbf")
    try:
        json.loads(line)
        return False
    except ValueError:
        return True


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationDataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or give "
                                   f"the text as .txt or .jsonl") from None
    table = pq.read_table(path)
    if TEXT_FIELD not in table.column_names:
        raise CalibrationDataError(f"{path}: no {TEXT_FIELD!r} column (columns: {table.column_names})")
    kind = table.schema.field(TEXT_FIELD).type
    if str(kind) not in ("string", "large_string", "string_view", "null"):  # its values were skipped: "0 tokens"
        raise CalibrationDataError(f"{path}: the {TEXT_FIELD!r} column holds {kind}, not strings; write the text "
                                   f"as a string column")
    for value in table.column(TEXT_FIELD).to_pylist():
        if isinstance(value, str):
            yield value


def iter_dataset(name: str, seed: int):
    """Documents of a Hugging Face dataset `NAME[:CONFIG]`, split "train", shuffled with `seed`."""
    try:
        import datasets
    except ImportError:
        if Path(name).is_dir():
            raise CalibrationDataError(f"{name} is a folder: give one text file (.txt, .jsonl, .json or .parquet), or "
                                       f"install the `datasets` package (pip install datasets) to read the folder as "
                                       f"a Hugging Face dataset") from None
        raise CalibrationDataError(f"{name!r} is not a file, and reading it as a Hugging Face dataset needs "
                                   f"the `datasets` package (pip install datasets); or give a local file") from None
    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None, split="train")
    except Exception as e:  # datasets raises many types (network, missing config, ...); name the input
        raise CalibrationDataError(f"dataset {name!r}: could not be loaded ({type(e).__name__}: {e})") from e
    if TEXT_FIELD not in ds.column_names:
        raise CalibrationDataError(f"dataset {name!r}: no {TEXT_FIELD!r} column (columns: {ds.column_names})")
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    for i in order:
        text = ds[i][TEXT_FIELD]
        if isinstance(text, str):  # a null row is no document (as in a Parquet file)
            yield text
