"""safetensors I/O at the edges: header reads for planning, lazy tensor reads, streaming atomic writes.

Reading tensors goes through `safetensors.safe_open` (lazy, mmap-backed). Two things are
hand-written because the library does not offer them:
  * `read_header`: the raw header with byte offsets, so planning can check a shard's size against
    its header (a truncated download) and count bytes without touching tensor data;
  * `StreamingWriter`: safetensors only writes a whole dict of in-memory tensors, which would make
    peak memory the size of an output shard. The header depends only on names, dtypes and shapes,
    which the plan knows, so we write it first and stream each tensor's bytes into place, hashing
    them as they go (sha256 and xxh3-128, see CHECKSUMS). The file is written under a temporary name
    and renamed when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

# safetensors dtype strings <-> torch dtypes (the subset these checkpoints use)
DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
# another FP8 encoding (F8_E5M2, ...): not what the releases glmq converts store, and read as E4M3 its values are wrong
_FP8_REMEDY = ("; glmq reads the float8_e4m3fn (F8_E4M3) block-FP8 checkpoints the model makers release: use the "
               "released FP8 checkpoint, or convert this one to F8_E4M3 with its scales, or to BF16")
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}

# The per-tensor checksums the writer records (formats/manifest.py) and `glmq validate` recomputes.
# sha256: cryptographic, ~1 GB/s per core, the record every glmq manifest has. xxh3-128: not
# cryptographic (it catches any accidental change: a flipped bit, a truncated or swapped copy; not a
# deliberate forgery, which is what sha256 is kept for), ~30 GB/s per core, so that hashing every byte
# costs less than reading it; validate checks it by default.
SHA256, XXH3_128 = "sha256", "xxh3_128"
CHECKSUMS = {SHA256: hashlib.sha256, XXH3_128: xxhash.xxh3_128}

TMP_SUFFIX = ".glmq-tmp"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    """Bad input: the message names the file, the tensor and what to do."""


def read_json_object(path: Path, missing: str, fix: str) -> dict:
    """The JSON object in `path`, or a CheckpointError naming the file: "not found; `missing`" when it does not exist,
    "...; `fix`" when it cannot be read (a folder, no permission), is not JSON or holds no object."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; {missing}") from None
    except (OSError, ValueError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise CheckpointError(f"{path}: cannot be read as JSON ({e}); {fix}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its shard's header describes it."""

    name: str
    shard: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def header_checksum(path: Path) -> str:
    """xxh3-128 of a shard's header as stored (its 8-byte length and JSON). The manifest's tensor checksums cover data
    bytes only: a header edited in place (a dtype relabelled, a shape transposed, same length) changes this alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return xxhash.xxh3_128_hexdigest(head + f.read(min(n, MAX_HEADER)))


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """Parse a shard's header, with the checks `safetensors` itself makes when it opens the file.

    The tensors, sorted by offset, must tile the data section exactly: the first begins at 0, each
    begins where the one before ends, each spans numel * itemsize bytes, and the last ends at the end
    of the file (no gap, no overlap, no trailing bytes). Spaces after the JSON header are allowed
    (glmq's writer pads the header to 8 bytes with them, as safetensors does).

    Returns:
        (entries by name, `__metadata__`, data section start offset).
    Raises:
        CheckpointError: unreadable, truncated or inconsistent header or file size.
    """
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # a directory fails to open with a bare errno; a named pipe blocks the read forever
        raise CheckpointError(f"{path}: not a regular file (a directory, pipe or device); a shard must be a "
                              f"safetensors file: replace it with the right file, or re-download it")
    size = st.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header; re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes); the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # UnicodeDecodeError included
            raise CheckpointError(f"{path}: header is not valid JSON ({e}); re-download the shard") from e
    try:
        entries, meta = _header_entries(path, header)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a JSON type the checks did not foresee
        raise CheckpointError(f"{path}: malformed header ({type(e).__name__}: {e}); the file is not a valid "
                              f"safetensors shard, re-download or re-write it") from e
    data_len, prev = 0, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != data_len:
            what = (f"overlap tensor {prev.name} [{prev.begin}, {prev.end})" if e.begin < data_len
                    else f"leave a gap of {e.begin - data_len} bytes after byte {data_len}")
            raise CheckpointError(f"{path}: tensor {e.name}: offsets [{e.begin}, {e.end}) {what}; safetensors needs "
                                  f"the tensors to tile the data section from 0 and refuses the file: the shard is "
                                  f"corrupt, re-download or re-write it")
        data_len, prev = e.end, e
    if 8 + n + data_len > size:
        missing = 8 + n + data_len - size
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header needs {8 + n + data_len} ({missing} bytes missing): "
            f"the shard is truncated; re-download it"
        )
    if 8 + n + data_len < size:
        extra = size - 8 - n - data_len
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header covers {8 + n + data_len} ({extra} bytes after the last "
            f"tensor): safetensors refuses it (file not fully covered); re-download or re-write the shard"
        )
    return entries, meta, 8 + n


def _header_entries(path: Path, header) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The entries and `__metadata__` of a parsed header, each checked for its types and size.
    Raises CheckpointError (or KeyError/TypeError/ValueError, which the caller turns into one)."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object; not a safetensors "
                              f"file")
    meta = header.pop("__metadata__", None) or {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: __metadata__ is not a mapping of strings to strings; re-write the shard")
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        lacks = [k for k in ("dtype", "shape", "data_offsets") if not isinstance(info, dict) or k not in info]
        if lacks:
            raise CheckpointError(f"{path}: tensor {name}: header entry has no {', '.join(lacks)}; the shard is "
                                  f"not valid safetensors, re-download or re-write it")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name}: shape {shape!r} is not a list of non-negative integers; "
                                  f"the header is corrupt, re-download or re-write the shard")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int and x >= 0 for x in offsets)):
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [begin, end] in bytes; "
                                  f"the header is corrupt, re-download or re-write the shard")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, which glmq does not read"
                                  + (_FP8_REMEDY if isinstance(dtype, str) and dtype.startswith("F8_") else ""))
        shape, (b, e) = tuple(shape), offsets
        numel = 1
        for d in shape:
            numel *= d
        if e - b != numel * ITEMSIZE[dtype]:
            raise CheckpointError(f"{path}: tensor {name}: offsets [{b}, {e}) do not match {dtype} {list(shape)}; "
                                  f"the header is corrupt, re-download or re-write the shard")
        entries[name] = TensorEntry(name, path.name, dtype, shape, b, e)
    return entries, meta


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    t = t.detach().contiguous().reshape(-1)  # 1-D first: a 0-dim tensor (e.g. a KV-cache scale) cannot view as bytes
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.view(torch.uint8).numpy())


@dataclass(frozen=True)
class OutSpec:
    """An output tensor planned before its data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * ITEMSIZE[self.dtype]


PT_METADATA = {"format": "pt"}  # the `__metadata__` of every file glmq writes


def layout(specs: list[OutSpec], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes and each tensor's absolute file offset for a planned file.

    Tensors are laid out by decreasing element size (then in the given order), as safetensors does,
    so that every tensor is aligned for zero-copy mmap loads.
    """
    order = sorted(range(len(specs)), key=lambda i: (-ITEMSIZE[specs[i].dtype], i))
    header: dict[str, object] = {"__metadata__": metadata}
    pos = 0
    rel: dict[str, int] = {}
    for i in order:
        s = specs[i]
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        rel[s.name] = pos
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: start + v for k, v in rel.items()}


class StreamingWriter:
    """Write one planned safetensors file tensor by tensor (row blocks allowed), atomically.

    Usage: `w = StreamingWriter(path, specs)`, then `w.write(name, tensor)` for each spec (one or
    several calls per tensor, in row order), then `w.commit()` -> per-tensor sha256, and
    `w.digests(XXH3_128)` for the fast checksum of the same bytes; `w.header_digest` is the header's
    (`header_checksum` of the file). Until `commit` the data lives in `<path>.glmq-tmp`; `abort()` removes it.
    """

    def __init__(self, path: Path, specs: list[OutSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.specs = {s.name: s for s in specs}
        head, self.offsets = layout(specs, metadata or PT_METADATA)
        self.header_digest = xxhash.xxh3_128_hexdigest(head)
        self.written = {s.name: 0 for s in specs}
        self.hashes = {s.name: hashlib.sha256() for s in specs}
        self.fast = {s.name: xxhash.xxh3_128() for s in specs}
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self.fd, head, 0)
        except BaseException:  # a full disk: no caller holds this writer to abort it
            self.abort()
            raise
        self.size = len(head) + sum(s.nbytes for s in specs)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append the bytes of `t` (the next rows of tensor `name`) at their place in the file."""
        spec = self.specs[name]
        if DTYPE_NAMES.get(t.dtype) != spec.dtype:
            raise ValueError(f"{self.path.name}: {name} planned as {spec.dtype}, got {t.dtype}")
        buf = tensor_bytes(t)
        done = self.written[name]
        if done + buf.nbytes > spec.nbytes:
            raise ValueError(f"{self.path.name}: {name} overflows its planned {spec.nbytes} bytes")
        os.pwrite(self.fd, buf, self.offsets[name] + done)
        self.hashes[name].update(buf)
        self.fast[name].update(buf)
        self.written[name] = done + buf.nbytes

    def commit(self) -> dict[str, str]:
        """Check every tensor is complete, fsync, rename into place; return name -> sha256 hex."""
        short = [n for n, s in self.specs.items() if self.written[n] != s.nbytes]
        if short:
            self.abort()
            raise ValueError(f"{self.path.name}: tensors not fully written: {short[:5]}")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        return self.digests(SHA256)

    def digests(self, algorithm: str) -> dict[str, str]:
        """name -> hex checksum (`SHA256` or `XXH3_128`) of the bytes written so far."""
        return {n: h.hexdigest() for n, h in (self.hashes if algorithm == SHA256 else self.fast).items()}

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def named_os_error(e: BaseException, path: str | Path) -> OSError | None:
    """`e` as an OSError that names `path`, where it is a write's failure naming no file: an OSError without a
    filename (`f.write` on a full disk names none; it is given `path`, in place), or safetensors' SafetensorError
    "Error while serializing: I/O error: ... (os error N)", which is no OSError and carries no errno (read from its
    text: safetensors gives no other way to tell). None: `e` is neither (a SafetensorError of another kind)."""
    if isinstance(e, OSError):
        if e.filename is None and e.errno is not None:  # (one without an errno, OSError("text"), keeps its text)
            e.filename = str(path)
        return e
    if type(e).__name__ == "SafetensorError" and (m := re.search(r"\(os error (\d+)\)", str(e))):
        return OSError(int(m[1]), os.strerror(int(m[1])), str(path))
    return None


@contextlib.contextmanager
def naming_write_errors(path: str | Path):
    """Writes to `path` inside: a failure that names no file (`named_os_error`) names `path`."""
    try:
        yield
    except Exception as e:
        if (named := named_os_error(e, path)) is None or named is e:
            raise
        raise named from e


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, whose I/O failure (a full disk) is an OSError naming `path` (`named_os_error`)."""
    from safetensors.torch import save_file

    with naming_write_errors(path):
        save_file(tensors, str(path), metadata=metadata)


@contextlib.contextmanager
def replaced_atomically(path: Path, tmp: Path | None = None):
    """Yield a temporary name beside `path` to write (`tmp`, default `path` + TMP_SUFFIX, the name a resumed run
    clears); then fsync it and rename it to `path`. On any failure (a full disk, Ctrl-C) the temporary file is
    removed: no half file is left beside the folder's real ones."""
    tmp = Path(str(path) + TMP_SUFFIX) if tmp is None else tmp
    with naming_write_errors(path):  # (a nameless write error, to the temporary name, names `path`)
        try:
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, fsync, rename."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)


def file_tensor_hashes(path: Path, algorithm: str = SHA256) -> dict[str, str]:
    """`algorithm`'s checksum of every tensor's bytes in a safetensors file (what `StreamingWriter`
    recorded: `commit()` for sha256, `digests(XXH3_128)`)."""
    return file_tensor_checksums(path, (algorithm,))[algorithm]


def file_tensor_checksums(path: Path, algorithms=(SHA256, XXH3_128)) -> dict[str, dict[str, str]]:
    """{algorithm: {tensor: hex checksum}} of every tensor of a safetensors file, in one read."""
    entries, _, start = read_header(path)
    out: dict[str, dict[str, str]] = {a: {} for a in algorithms}
    with open(path, "rb") as f:
        for e in sorted(entries.values(), key=lambda e: e.begin):
            f.seek(start + e.begin)
            hs = [CHECKSUMS[a]() for a in algorithms]
            left = e.nbytes
            while left:
                chunk = f.read(min(left, 64 << 20))
                if not chunk:
                    raise CheckpointError(f"{path}: tensor {e.name}: unexpected end of file; the file is truncated")
                for h in hs:
                    h.update(chunk)
                left -= len(chunk)
            for a, h in zip(algorithms, hs):
                out[a][e.name] = h.hexdigest()
    return out
