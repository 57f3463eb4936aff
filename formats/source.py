"""The source checkpoint: config, shard index and every shard header, read before any tensor data.

Three source formats are recognised from config.json's `quantization_config`:
  * `fp8-block`: DeepSeek/GLM `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [bn, bk]`;
    weight float8_e4m3fn + float32 `weight_scale_inv` `[ceil(N/bn), ceil(K/bk)]`, *multiplied*.
  * `fp8-ct`: compressed-tensors `float-quantized` FP8, per-channel or per-tensor `weight_scale`.
  * `dense`: plain BF16/FP16/FP32, no quantization_config.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

from glmq.formats.families import Family, family_for
from glmq.formats.manifest import MANIFEST_NAME, REPORT_NAME
from glmq.formats.safetensors_io import CheckpointError, TensorEntry, read_header, read_json_object

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# files never copied as side files: the shards and index are rewritten, glmq's own bookkeeping is ours, and the
# source's model card describes the source model (`glmq upload` writes the output's own card)
_NOT_SIDE = {INDEX_NAME, "config.json", "README.md", MANIFEST_NAME, REPORT_NAME}
# The source digest (a resumed run must be of the same source) covers config.json and the shard headers; a sample of
# every shard's data is digested per shard (Source.shard_samples): another model of the same architecture (a
# fine-tune, the next release) has the very same config and headers.
SAMPLE_WINDOWS, SAMPLE_BYTES = 17, 4096


class SourceFormat(str, enum.Enum):
    FP8_BLOCK = "fp8-block"
    FP8_CT = "fp8-ct"
    DENSE = "dense"


@dataclass
class Source:
    """Everything known about a checkpoint from its headers.

    Attributes:
        entries: every tensor by name (dtype, shape, shard, byte offsets).
        shards: shard file names in index order.
        block: FP8 block size (bn, bk) for fp8-block sources.
        side_files: other files to copy (tokenizer, generation config, chat template, custom code).
        header_digest: sha256 of config.json and every shard's name, size and header (the source in a resumed
            run's identity).
        shard_mtime_ns: each shard's modification time when the source was opened: a shard edited in place
            outside the sampled data between a crash and the resume (output.changed_shards).
        shard_samples: sha256 hex of a sample of each shard's data (`_data_sample`): a resume converts again the
            files of a shard whose data changed (downloaded again after a corrupt weight), and refuses a folder
            whose every shard changed (another model of the same layout), output._prepare_output.
        config_path: the file `config` was read from, where it is not `root / "config.json"` (a config-only
            source, `glmq plan -m model.json`); `config_file` is the one to name in messages.
    """

    root: Path
    config: dict
    family: Family
    fmt: SourceFormat
    entries: dict[str, TensorEntry]
    shards: list[str]
    shard_bytes: dict[str, int]
    block: tuple[int, int] | None = None
    side_files: list[str] = field(default_factory=list)
    header_digest: str = ""
    shard_mtime_ns: dict[str, int] = field(default_factory=dict)
    shard_samples: dict[str, str] = field(default_factory=dict)
    config_path: Path | None = None

    @property
    def config_file(self) -> Path:
        """The file the config was read from: `config_path`, else the folder's config.json."""
        return self.root / "config.json" if self.config_path is None else Path(self.config_path)

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes.values())

    def path(self, shard: str) -> Path:
        return self.root / shard


def shard_mtimes(source: Source) -> dict[str, int | None]:
    """Each shard's modification time now (None: it is gone), to compare with `Source.shard_mtime_ns`."""
    def mtime(shard: str) -> int | None:
        try:
            return source.path(shard).stat().st_mtime_ns
        except OSError:
            return None
    return {s: mtime(s) for s in source.shards}


def _load_json(path: Path) -> dict:
    return read_json_object(path, "point --model at a Hugging Face checkpoint folder", "re-download it")


def detect_format(config: dict, config_path: Path) -> tuple[SourceFormat, tuple[int, int] | None]:
    qc = config.get("quantization_config")
    if not qc:
        return SourceFormat.DENSE, None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config is a JSON {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{config_path}: FP8 fmt {qc.get('fmt')!r} is not supported (only e4m3)")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(
                f"{config_path}: quant_method 'fp8' without a weight_block_size of 2 positive integers (it has "
                f"{block!r}); glmq reads DeepSeek-style block FP8 only"
            )
        return SourceFormat.FP8_BLOCK, (int(block[0]), int(block[1]))
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise CheckpointError(
                f"{config_path}: compressed-tensors format {qc.get('format')!r} as a source is not "
                f"supported; glmq reads 'float-quantized' FP8 (it writes pack-quantized itself)"
            )
        for gname, group in (qc.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            if w.get("strategy") not in (None, "channel", "tensor"):
                # e.g. llm-compressor's FP8_BLOCK: its [N/128, K/128] weight_scale would be refused tensor by tensor
                raise CheckpointError(
                    f"{config_path}: quantization_config group {gname} has FP8 weights of strategy "
                    f"{w.get('strategy')!r}; glmq reads compressed-tensors FP8 per channel or per tensor, and block FP8 "
                    f"in DeepSeek's layout (quant_method 'fp8', weight_scale_inv)")
        return SourceFormat.FP8_CT, None
    raise CheckpointError(
        f"{config_path}: quantization_config.quant_method {method!r} is not a source glmq reads "
        f"(fp8 block, compressed-tensors float-quantized, or unquantized)"
    )


def _data_sample(path: Path, start: int, size: int) -> bytes:
    """SAMPLE_WINDOWS windows of SAMPLE_BYTES spread evenly over a shard's data section (first and last
    included): a few page reads per shard, so that two models with identical headers get different samples."""
    n = size - start
    if n <= 0:
        return b""
    w = min(SAMPLE_BYTES, n)
    offsets = sorted({start + (n - w) * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)})
    out = []
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            out.append(f.read(w))
    return b"".join(out)


def weight_map(root: Path, read_json=_load_json, missing: str = "is this a checkpoint folder?") -> dict[str, str]:
    """Tensor name -> shard file name of the checkpoint in `root` (a source or a written one): its index's weight_map,
    else every tensor of its one model.safetensors.

    read_json: the reader of the index (whose errors say what the caller's user should do); missing: the advice when
    neither file is there.

    Raises:
        CheckpointError: naming the index and the tensor at fault (no map, a value that is no file name, a shard
        outside the index's folder), or the folder with neither file.
    """
    index = root / INDEX_NAME
    if index.exists():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: has no weight_map of tensor names to shard files; re-download or "
                                  f"re-write the index")
        bad = next((n for n, f in wm.items() if not isinstance(f, str) or not f), None)
        if bad is not None:
            raise CheckpointError(f"{index}: weight_map places tensor {bad} in {wm[bad]!r}, not a shard file name; "
                                  f"re-download or re-write the index")
        # A shard in another folder ("sub/model-1.safetensors", "../x"): the headers record bare file names, so its
        # tensors fell in no output file and the run wrote an index of none (exit 0)
        nested = next((n for n, f in wm.items() if Path(f).name != f or f in (".", "..")), None)
        if nested is not None:
            raise CheckpointError(f"{index}: weight_map places tensor {nested} in {wm[nested]!r}, outside the index's "
                                  f"folder; glmq reads the shards beside the index: move them next to it and give "
                                  f"their bare file names in the weight_map")
        return wm
    single = root / SINGLE_NAME
    if single.exists():
        entries, _, _ = read_header(single)
        return {name: SINGLE_NAME for name in entries}
    raise CheckpointError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found; {missing}")


def open_source(path: str | Path) -> Source:
    """Read config.json, the index and every shard header; check they agree.

    Raises:
        CheckpointError / UnknownArchitectureError naming the file and tensor at fault.
    """
    import hashlib

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; --model takes a checkpoint folder")
    config_path = root / "config.json"
    config = _load_json(config_path)
    family = family_for(config, str(config_path))
    fmt, block = detect_format(config, config_path)
    # shards without their index (an interrupted download, or one that took only *.safetensors): the index; config.json
    # alone (a folder made before the download): the shards, or the plan `glmq plan` makes from it
    if any(root.glob("*.safetensors")):
        missing = f"the shards are here but not their index: download {INDEX_NAME} beside them"
    else:
        missing = (f"no tensors are stored here: download the shards, or plan from the config alone with "
                   f"`glmq plan -m {config_path}`")
    wm = weight_map(root, missing=missing)
    shards = sorted(set(wm.values()))
    entries: dict[str, TensorEntry] = {}
    shard_bytes: dict[str, int] = {}
    shard_mtime_ns: dict[str, int] = {}
    shard_samples: dict[str, str] = {}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for shard in shards:
        p = root / shard
        if not p.exists():
            raise CheckpointError(f"{p}: listed in {INDEX_NAME} but missing; re-download it")
        found, _, start = read_header(p)
        st = p.stat()
        shard_bytes[shard], shard_mtime_ns[shard] = st.st_size, st.st_mtime_ns
        digest.update(f"{shard}:{shard_bytes[shard]}:".encode())
        shard_samples[shard] = hashlib.sha256(_data_sample(p, start, shard_bytes[shard])).hexdigest()
        for name, e in sorted(found.items()):
            digest.update(f"{name}:{e.dtype}:{e.shape}:{e.begin}:{e.end};".encode())
            if wm.get(name) != shard:
                where = f"places in {wm[name]}" if name in wm else "does not list"
                raise CheckpointError(
                    f"{p}: holds tensor {name}, which {INDEX_NAME} {where}; the index is stale or the shard is "
                    f"from another revision"
                )
            entries[name] = e
    missing = [n for n in wm if n not in entries]
    if missing:
        raise CheckpointError(
            f"{root / wm[missing[0]]}: tensor {missing[0]} is in {INDEX_NAME} but not in the shard "
            f"({len(missing)} such tensors); re-download the shard"
        )
    side = sorted(
        f.name for f in root.iterdir()
        if f.is_file() and f.name not in _NOT_SIDE and f.name not in shard_bytes
        and not f.name.endswith(".safetensors") and not f.name.startswith(".")
    )
    return Source(root, config, family, fmt, entries, shards, shard_bytes, block, side, digest.hexdigest(),
                  shard_mtime_ns, shard_samples, config_path)
