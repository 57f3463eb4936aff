"""What the headers say: config.json, the index, every shard header, the manifest; the index check."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from glmq.formats.families import COMPANIONS, INT_LEAVES, TensorClass, classify  # noqa: F401 (re-exported)
from glmq.formats.manifest import CHECKSUM_KEYS, HEADER_KEY, MANIFEST_NAME, Manifest
from glmq.formats.safetensors_io import CheckpointError, TensorEntry, read_header
from glmq.formats.source import INDEX_NAME, SINGLE_NAME
from glmq.quantize.validate.report import CannotValidate, CheckResult


@dataclass
class Checkpoint:
    """What the headers say: config, index, each readable shard's tensors (no tensor data)."""

    root: Path
    config: dict | None  # None: config.json is not valid JSON (the config check says why)
    config_error: str | None
    weight_map: dict[str, str]
    shards: dict[str, dict[str, TensorEntry]]
    data_start: dict[str, int]
    index: CheckResult  # problems met while loading, completed by `check_index`
    manifest: Manifest | None
    manifest_error: str | None = None

    @property
    def unread(self) -> set[str]:
        """The tensor files listed (or, without an index, the one model.safetensors) whose header could not be read:
        what they hold is unknown, so no check may call their tensors missing."""
        if not (self.root / INDEX_NAME).exists():
            if not (self.root / SINGLE_NAME).exists():  # shards without their index: not read (the index check)
                return {p.name for p in self.root.glob("*.safetensors")}
            return set() if self.weight_map else {SINGLE_NAME}
        return set(self.weight_map.values()) - set(self.shards)

    def entries(self) -> dict[str, TensorEntry]:
        return {n: e for es in self.shards.values() for n, e in es.items()}


def load_checkpoint(root: Path) -> Checkpoint:
    """Read config.json, the index, every shard header and the manifest.

    Raises:
        CannotValidate: `root` is not a folder or has no config.json.
    """
    if not root.is_dir():
        raise CannotValidate(f"{root}: not a directory; glmq validate takes a checkpoint folder")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CannotValidate(f"{cfg_path}: not found, so {root} is not a checkpoint (glmq writes config.json "
                             f"last: a conversion that did not finish has none)")
    config, config_error = None, None
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as e:
        config_error = f"{cfg_path}: not valid JSON ({e})"
    except OSError as e:
        raise CannotValidate(f"{cfg_path}: unreadable ({e})") from e
    if config is not None and not isinstance(config, dict):
        kind = type(config).__name__
        config, config_error = None, f"{cfg_path}: a JSON {kind}, not an object (a model config); fix config.json"
    index = CheckResult("index")
    weight_map, total = _read_index(root, index)
    shards, starts = {}, {}
    for shard in sorted(set(weight_map.values())):
        try:
            shards[shard], _, starts[shard] = read_header(root / shard)
        except FileNotFoundError:
            index.fail(f"{shard}: listed in {INDEX_NAME} but missing from the folder", shard=shard)
        except (CheckpointError, OSError) as e:
            index.fail(str(e), shard=shard)
    check_index(weight_map, total, shards, index)
    listed = set(weight_map.values()) | ({SINGLE_NAME} if not (root / INDEX_NAME).exists() else set())
    no_index = not (root / INDEX_NAME).exists() and not (root / SINGLE_NAME).exists()  # _read_index's failure says it
    for name in sorted(p.name for p in root.glob("*.safetensors") if p.name not in listed and not no_index):
        if name == SINGLE_NAME:  # transformers looks for model.safetensors before the index
            index.fail(f"{name}: a single-file checkpoint beside {INDEX_NAME}: transformers loads it instead of the "
                       f"sharded weights the index lists (vLLM loads the index's); remove one of the two", shard=name)
        elif not (root / INDEX_NAME).exists():  # no index to filter by: vLLM loads every .safetensors file
            index.fail(f"{name}: a second .safetensors file beside {SINGLE_NAME} and no {INDEX_NAME}: vLLM and SGLang "
                       f"load every .safetensors file of the folder, this one's tensors too; remove it", shard=name)
        else:
            index.warn(f"{name}: a safetensors file the index does not reference (loaders skip it)", shard=name)
    ck = Checkpoint(root, config, config_error, weight_map, shards, starts, index, None)
    try:
        ck.manifest = Manifest.load(root)
    except ValueError as e:
        ck.manifest_error = str(e)
    except OSError as e:  # a folder or an unreadable file in its place: the integrity check fails, naming it
        ck.manifest_error = f"{root / MANIFEST_NAME}: unreadable ({e}); re-convert, or remove it to skip the " \
                            f"integrity check"
    if ck.manifest is not None and (why := _manifest_problem(ck.manifest)):
        ck.manifest = None
        ck.manifest_error = f"{root / MANIFEST_NAME}: {why}; re-convert, or remove it to skip the integrity check"
    return ck


def _manifest_problem(man: Manifest) -> str | None:
    """What makes a parsed manifest unusable by the checks (a JSON type they do not expect), or None."""
    if not isinstance(man.identity, dict):
        return "identity is not an object"
    if not isinstance(man.files, dict):
        return "files is not an object of shard -> record"
    for shard, rec in man.files.items():
        if not isinstance(rec, dict):
            return f"files.{shard} is not an object"
        sums = [rec.get(key) for key in CHECKSUM_KEYS.values()]
        if not all(x is None or (isinstance(x, dict) and all(isinstance(d, str) for d in x.values())) for x in sums):
            return f"files.{shard}: a checksum record is not an object of tensor -> hex digest"
        if rec.get("bytes") is not None and type(rec["bytes"]) is not int:
            return f"files.{shard}.bytes is not an integer"
        if rec.get(HEADER_KEY) is not None and not isinstance(rec[HEADER_KEY], str):
            return f"files.{shard}.{HEADER_KEY} is not a hex digest"
    return None


def _read_index(root: Path, res: CheckResult) -> tuple[dict[str, str], int | None]:
    path = root / INDEX_NAME
    if not path.exists():
        if (root / SINGLE_NAME).exists():
            try:
                return {n: SINGLE_NAME for n in read_header(root / SINGLE_NAME)[0]}, None
            except CheckpointError as e:
                res.fail(str(e), shard=SINGLE_NAME)
                return {}, None
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if shards:  # vLLM would read every file; transformers finds none of them
            res.fail(f"{root}: no {INDEX_NAME}, though {len(shards)} .safetensors file(s) are here (e.g. {shards[0]}): "
                     f"transformers cannot load sharded weights without it, and which file holds which tensor is "
                     f"unknown, so they are not checked; restore the index (it is written last: a conversion that "
                     f"stopped before it is unfinished, run it again)")
        else:
            res.fail(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME}: the checkpoint stores no tensors")
        return {}, None
    dups: list[str] = []

    def pairs(items):  # json keeps the last of duplicate keys silently; loaders would too
        d = {}
        for k, v in items:
            if k in d:
                dups.append(k)
            d[k] = v
        return d

    try:
        idx = json.loads(path.read_text(), object_pairs_hook=pairs)
    except ValueError as e:
        res.fail(f"{INDEX_NAME}: not valid JSON ({e})")
        return {}, None
    except OSError as e:  # a folder, or unreadable: loaders cannot read it either
        res.fail(f"{path}: unreadable ({e}); re-download or re-write the index")
        return {}, None
    if not isinstance(idx, dict):
        res.fail(f"{INDEX_NAME}: is a JSON {type(idx).__name__}, not an object with a weight_map")
        return {}, None
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        res.fail(f"{INDEX_NAME}: weight_map is not a mapping of tensor name -> shard file")
        return {}, None
    for name in dups:
        res.fail(f"{INDEX_NAME}: tensor {name} is listed more than once", tensor=name)
    # vLLM and SGLang load the folder's own `*.safetensors` files that the index names (a non-recursive glob): a tensor
    # placed in a sub-folder, outside the folder or in a file of another suffix is never loaded, so it is not read here
    # either (the structure check then names it missing); nor is a file outside the checkpoint opened
    outside = {shard for shard in set(wm.values()) if shard != Path(shard).name or shard in ("", ".", "..")
               or not shard.endswith(".safetensors")}
    for shard in sorted(outside):
        n = sum(v == shard for v in wm.values())
        res.fail(f"{INDEX_NAME}: places {n} tensor(s) in {shard!r}, not a .safetensors file of the checkpoint's own "
                 f"folder: vLLM and SGLang never load them; move the file into the folder and name it there",
                 shard=shard)
    wm = {k: v for k, v in wm.items() if v not in outside}
    meta = idx.get("metadata") or {}
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not (total is None or type(total) is int):
        res.fail(f"{INDEX_NAME}: metadata.total_size is not an integer (metadata is {meta!r:.80}); "
                 f"loaders read it as the checkpoint's byte count")
        total = None
    return wm, total


def check_index(weight_map: dict[str, str], total: int | None, shards: dict[str, dict[str, TensorEntry]],
                res: CheckResult) -> CheckResult:
    """Index entries <-> shard headers, duplicates, total_size (pure; adds to `res`)."""
    res.checked = len(weight_map)
    if not weight_map and not res.failures:
        res.fail(f"{INDEX_NAME}: the weight_map lists no tensors")
    seen: dict[str, str] = {}
    for shard, entries in shards.items():
        for name in entries:
            if name in seen:
                res.fail(f"tensor {name} is stored twice, in {seen[name]} and {shard}", tensor=name, shard=shard)
            seen[name] = shard
            if weight_map.get(name) != shard:
                where = f"places it in {weight_map[name]}" if name in weight_map else "does not list it"
                res.fail(f"{shard}: holds tensor {name}, but {INDEX_NAME} {where}", tensor=name, shard=shard)
    for name, shard in weight_map.items():
        if shard in shards and name not in shards[shard]:
            res.fail(f"{INDEX_NAME}: tensor {name} is placed in {shard}, which does not hold it",
                     tensor=name, shard=shard)
    actual = sum(e.nbytes for es in shards.values() for e in es.values())
    # a shard that could not be read is failed already: its tensors are not a second, total_size failure
    if total is not None and total != actual and set(weight_map.values()) <= set(shards):
        res.fail(f"{INDEX_NAME}: metadata.total_size is {total} but the tensors hold {actual} bytes "
                 f"({actual - total:+d})")
    res.details["total_bytes"] = actual
    return res



@dataclass
class Module:
    """The tensors of one module (`model.layers.1.mlp.experts.3.down_proj`) by leaf name."""

    name: str
    cls: TensorClass
    parts: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def is_int(self) -> bool:
        p = self.parts
        return bool(set(INT_LEAVES) & p.keys()) or ("weight_scale" in p and "weight" not in p)

    @property
    def is_fp8(self) -> bool:
        return "weight" in self.parts and self.parts["weight"].dtype == "F8_E4M3"

    def shard(self) -> str | None:
        return next(iter(self.parts.values())).shard if self.parts else None


def modules_of(entries: dict[str, TensorEntry]) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for name, e in sorted(entries.items()):
        module, _, leaf = name.rpartition(".")
        mods.setdefault(module, Module(module, classify(module))).parts[leaf] = e
    return mods
