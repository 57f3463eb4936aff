"""Read every shard once: a checksum of each tensor, and the tensors the checks need from the same bytes.

The shards are cut into work units, runs of whole tensors of about UNIT_BYTES in file order, which a
pool of threads takes in turn. Each unit is mapped (mmap, read-only) and every tensor is hashed
straight from the mapped page cache, in one call: no copy into a buffer (a warm `read()` spends its
time in that copy: on the 2-core machine mapping + xxh3-128 ran at ~8 GB/s where `read()` alone ran at
1.3-3.7 GB/s). The checksum is xxh3-128 (~30 GB/s per core) by default or sha256 (~1 GB/s) when asked or
when the manifest predates xxh3 (formats/manifest.py); both release the GIL, so the threads hash in
parallel. A tensor some check needs (`keep`) is copied out of the mapping into a tensor of its own,
hashed from that copy, and handed to `sink(name, tensor)` in the same thread: the checks run on the
bytes that were hashed, and a thread busy checking leaves the remaining units to the others, so
reading and checking overlap. Nothing is read twice.

The floating-point tensors no check keeps (norms, embeddings, the router, kept FP8 weights, KV-cache scales) are
tested for NaN and Inf by their bit patterns, straight from the mapping (`nonfinite_rows`): quantize refuses such a
tensor in its source, and a checkpoint that holds one must not pass the gate because its checksum matches. Hand-written
with numpy on the mapped bytes because torch will not wrap a read-only buffer without a (thread-unsafe to silence)
warning, and a copy would double the reads; ~12 GB/s a thread on the 2-core machine, against ~30 for xxh3.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from glmq.formats.safetensors_io import CHECKSUMS, DTYPES, SHA256, TensorEntry
from glmq.quantize.validate.checkpoint import Checkpoint

# Exponent bits of each floating-point dtype, as an unsigned integer of its size: a value is NaN or Inf iff all are set
# (e4m3fn: S.1111.111 is NaN, and it has no Inf)
_NONFINITE_BITS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
                   "F64": (np.uint64, 0x7FF0000000000000), "F8_E4M3": (np.uint8, 0x7F), "F8_E5M2": (np.uint8, 0x7C)}
NONFINITE_DTYPES = frozenset(_NONFINITE_BITS)
_NONFINITE_CHUNK = 1 << 20  # elements per step: the temporary stays in L2 (measured 12.6 GB/s against 8.8 at 4M)
_NONFINITE_ROWS = 64  # rows named at most

# Work unit size: small enough that the last units of the last shard keep every thread busy (a shard
# per thread left one core hashing a 500 MB shard alone at the end), large enough that mapping and
# the read-ahead hint (MADV_WILLNEED: the kernel reads a cold unit ahead while it is hashed) pay off.
UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class Unit:
    """A run of whole tensors of one shard, in file order."""

    shard: str
    path: Path
    start: int  # the shard's data section offset
    entries: tuple[TensorEntry, ...]


@dataclass
class ScanStats:
    """Seconds spent by the reader threads, summed over threads (they overlap in wall time)."""

    read_s: float = 0.0  # mapping the units, copying out the kept tensors
    hash_s: float = 0.0  # hashing, page faults of the mapped bytes included
    check_s: float = 0.0  # in `sink`: decoding, numerics, source comparison
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read_s: float, hash_s: float, check_s: float, nbytes: int) -> None:
        with self.lock:
            self.read_s += read_s
            self.hash_s += hash_s
            self.check_s += check_s
            self.bytes += nbytes

    def to_dict(self) -> dict:
        return {"read_s": round(self.read_s, 3), "hash_s": round(self.hash_s, 3), "check_s": round(self.check_s, 3),
                "bytes": self.bytes}


def work_units(ck: Checkpoint, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every readable shard's tensors, cut at tensor boundaries into runs of about `unit_bytes`."""
    units = []
    for shard in sorted(ck.shards):
        run: list[TensorEntry] = []
        size = 0
        for e in sorted(ck.shards[shard].values(), key=lambda e: e.begin):
            run.append(e)
            size += e.nbytes
            if size >= unit_bytes:
                units.append(Unit(shard, ck.root / shard, ck.data_start[shard], tuple(run)))
                run, size = [], 0
        if run or not ck.shards[shard]:
            units.append(Unit(shard, ck.root / shard, ck.data_start[shard], tuple(run)))
    return units


def scan_shards(ck: Checkpoint, keep: set[str], sink, workers: int, stats: ScanStats | None = None,
                algorithm: str | dict[str, str] = SHA256, nonfinite=None) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Read every shard once: a checksum of each tensor; tensors in `keep` go to `sink(name, tensor)`.

    `sink` runs in the reader threads and must be thread-safe; an exception it raises (other than
    OSError, which reads as a failed read) stops the scan and is re-raised here. `nonfinite(entry, rows)`, if
    given, is called (in the reader threads too) for each floating-point tensor not in `keep` that holds NaN or
    Inf, with the first rows that do.

    Args:
        algorithm: a key of safetensors_io.CHECKSUMS ("sha256", "xxh3_128"), or one per shard
            (shards it does not name: sha256).
    Returns:
        ({shard: {tensor: hex checksum}} of the shards read completely, [one read error per other shard]).
    """
    stats = stats if stats is not None else ScanStats()
    units = work_units(ck)
    algo = (lambda shard: algorithm.get(shard, SHA256)) if isinstance(algorithm, dict) else (lambda shard: algorithm)
    hashes: dict[str, dict[str, str]] = {s: {} for s in ck.shards}
    errors: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(workers, len(units) or 1)), thread_name_prefix="glmq-validate") as pool:
        futures = [pool.submit(_scan_unit, u, keep, sink, stats, algo(u.shard), nonfinite) for u in units]
        try:
            for u, fut in zip(units, futures):
                got = fut.result()
                if isinstance(got, str):
                    errors.setdefault(u.shard, f"{u.shard}: read failed ({got})")
                else:
                    hashes[u.shard].update(got)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return {s: h for s, h in hashes.items() if s not in errors}, list(errors.values())


def _scan_unit(u: Unit, keep: set[str], sink, stats: ScanStats, algorithm: str, nonfinite=None
               ) -> dict[str, str] | str:
    """Hash one unit's tensors from a mapping of its bytes; copy out and check the kept ones, test the other
    floating-point ones for NaN/Inf. An OSError -> its text."""
    if not u.entries:
        return {}
    new = CHECKSUMS[algorithm]
    out = {}
    t_read = t_hash = t_check = 0.0
    lo = u.start + u.entries[0].begin
    hi = u.start + max(e.end for e in u.entries)
    base = lo - lo % mmap.ALLOCATIONGRANULARITY
    t0 = time.perf_counter()
    try:
        with open(u.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < hi:  # shrank since its header was read: a mapped page past the end would be SIGBUS
                raise OSError(f"the file is {size} bytes, its header needs {hi}: truncated while validating")
            # (a unit of empty tensors only maps nothing: mmap refuses a length of 0)
            m = mmap.mmap(f.fileno(), hi - base, access=mmap.ACCESS_READ, offset=base) if hi > base else None
        try:
            if m is not None and hasattr(m, "madvise"):
                m.madvise(mmap.MADV_WILLNEED)  # cold files: read ahead the whole unit; warm: almost free
            t_read += time.perf_counter() - t0
            with memoryview(b"" if m is None else m) as view:
                for e in u.entries:
                    at = u.start + e.begin - base
                    with view[at:at + e.nbytes] as data:
                        t0 = time.perf_counter()
                        if e.name not in keep:
                            out[e.name] = new(data).hexdigest()
                            t1 = time.perf_counter()
                            t_hash += t1 - t0
                            if nonfinite is not None and e.dtype in _NONFINITE_BITS:
                                if rows := nonfinite_rows(data, e.dtype, e.shape):
                                    nonfinite(e, rows)
                                t_check += time.perf_counter() - t1
                            continue
                        buf = _copy_out(data)
                        t1 = time.perf_counter()
                        out[e.name] = new(buf.numpy()).hexdigest()
                        t2 = time.perf_counter()
                    sink(e.name, buf.view(DTYPES[e.dtype]).reshape(e.shape))
                    t_read, t_hash, t_check = t_read + t1 - t0, t_hash + t2 - t1, t_check + time.perf_counter() - t2
        finally:
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a view still held by a failing check's traceback: unmapped when it goes
                    pass
    except OSError as e:
        return str(e)
    finally:
        stats.add(t_read, t_hash, t_check, sum(x.nbytes for x in u.entries))
    return out


def nonfinite_rows(data, dtype: str, shape) -> list[int]:
    """The first rows (`_NONFINITE_ROWS` at most; a row is the first dimension, a 0-D or 1-D tensor's elements rows of
    one) of a tensor's raw bytes whose values include NaN or Inf; [] for a finite tensor or a dtype without them."""
    if dtype not in _NONFINITE_BITS:
        return []
    kind, bits = _NONFINITE_BITS[dtype]
    u = np.frombuffer(data, dtype=kind)
    if not u.size:
        return []
    bits = kind(bits)
    per_row = max(1, u.size // (shape[0] if len(shape) > 0 and shape[0] else 1))
    tmp = np.empty(min(_NONFINITE_CHUNK, u.size), dtype=kind)
    rows: list[int] = []
    for at in range(0, u.size, _NONFINITE_CHUNK):
        part = u[at:at + _NONFINITE_CHUNK]
        t = np.bitwise_and(part, bits, out=tmp[:part.size])
        if not (t == bits).any():
            continue
        for r in np.unique((np.flatnonzero(t == bits) + at) // per_row).tolist():
            if not rows or r > rows[-1]:
                rows.append(int(r))
        if len(rows) >= _NONFINITE_ROWS:
            break
    return rows[:_NONFINITE_ROWS]  # (u and its views go with this frame, before the caller releases `data`)


def _copy_out(data: memoryview) -> torch.Tensor:
    """The bytes of `data` in a uint8 tensor of their own (numpy's copy releases the GIL; not zero-filled)."""
    buf = torch.empty(len(data), dtype=torch.uint8)
    src = np.frombuffer(data, dtype=np.uint8)
    try:
        np.copyto(buf.numpy(), src)
    finally:
        del src  # before `data` is released
    return buf
