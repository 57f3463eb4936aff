"""Read every shard once: sha256 of each tensor, and the tensors the checks need from the same bytes.

The shards are cut into work units, runs of whole tensors of about UNIT_BYTES in file order, which a
pool of threads takes in turn. Each tensor is read and hashed in READ_CHUNK pieces while the piece is
still in cache (hashlib and unbuffered reads release the GIL, so the threads hash in parallel). A
tensor some check needs (`keep`) is read into a buffer of its own instead, hashed, and handed to
`sink(name, tensor)` in the same thread: the checks run on the bytes that were hashed, and a thread
busy checking leaves the remaining units to the others, so reading and checking overlap. Nothing is
read twice.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmq.formats.safetensors_io import DTYPES, TensorEntry
from glmq.quantize.validate.checkpoint import Checkpoint

READ_CHUNK = 1 << 20  # hashed while still in cache: a 64 MB buffer made read + sha256 1.6x slower
# Work unit size: small enough that the last units of the last shard keep every thread busy (a shard
# per thread left one core hashing a 500 MB shard alone at the end), large enough for sequential I/O.
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

    read_s: float = 0.0
    hash_s: float = 0.0
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


def scan_shards(ck: Checkpoint, keep: set[str], sink, workers: int,
                stats: ScanStats | None = None) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Read every shard once: sha256 of each tensor; tensors in `keep` go to `sink(name, tensor)`.

    `sink` runs in the reader threads and must be thread-safe; an exception it raises (other than
    OSError, which reads as a failed read) stops the scan and is re-raised here.

    Returns:
        ({shard: {tensor: sha256 hex}} of the shards read completely, [one read error per other shard]).
    """
    stats = stats if stats is not None else ScanStats()
    units = work_units(ck)
    hashes: dict[str, dict[str, str]] = {s: {} for s in ck.shards}
    errors: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(workers, len(units) or 1)), thread_name_prefix="glmq-validate") as pool:
        futures = [pool.submit(_scan_unit, u, keep, sink, stats) for u in units]
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


def _scan_unit(u: Unit, keep: set[str], sink, stats: ScanStats) -> dict[str, str] | str:
    """Hash one unit's tensors; decode the kept ones from the bytes just hashed. An OSError -> its text."""
    out = {}
    t_read = t_hash = t_check = 0.0
    big = max((e.nbytes for e in u.entries if e.name not in keep), default=0)
    chunk = memoryview(bytearray(min(READ_CHUNK, big)))  # reused for every tensor not kept
    try:
        with open(u.path, "rb", buffering=0) as f:
            for e in u.entries:
                f.seek(u.start + e.begin)
                if e.name in keep:
                    t0 = time.perf_counter()
                    buf = torch.empty(e.nbytes, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
                    view = memoryview(buf.numpy())
                    _read_exact(f, view)
                    t1 = time.perf_counter()
                    out[e.name] = hashlib.sha256(view).hexdigest()
                    t2 = time.perf_counter()
                    sink(e.name, buf.view(DTYPES[e.dtype]).reshape(e.shape))
                    t_read, t_hash, t_check = t_read + t1 - t0, t_hash + t2 - t1, t_check + time.perf_counter() - t2
                    continue
                h, left = hashlib.sha256(), e.nbytes
                while left:
                    view = chunk[:min(left, len(chunk))]
                    t0 = time.perf_counter()
                    _read_exact(f, view)
                    t1 = time.perf_counter()
                    h.update(view)
                    t_read, t_hash = t_read + t1 - t0, t_hash + time.perf_counter() - t1
                    left -= len(view)
                out[e.name] = h.hexdigest()
    except OSError as e:
        return str(e)
    finally:
        stats.add(t_read, t_hash, t_check, sum(x.nbytes for x in u.entries))
    return out


def _read_exact(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"unexpected end of file at byte {f.tell()}")
        got += n
