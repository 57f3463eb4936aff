"""`validate()`: load the headers, read the shards once with every check riding on the read, report."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sysconfig
import threading
import time
from pathlib import Path

import torch

from glmq.formats.safetensors_io import XXH3_128, header_checksum
from glmq.quantize import ops
from glmq.quantize.validate.checkpoint import load_checkpoint, modules_of
from glmq.quantize.validate.config import _ct, check_config, group_for, read_quant_config
from glmq.quantize.validate.integrity import check_integrity, checksum_choice
from glmq.quantize.validate.numerics import DEFAULT_SAMPLE, ModuleScan, sample_modules, stratum
from glmq.quantize.validate.reading import NONFINITE_DTYPES, ScanStats, nonfinite_rows, scan_shards
from glmq.quantize.validate.report import BeingWritten, CannotValidate, CheckResult, Report
from glmq.quantize.validate.serving import check_serving
from glmq.quantize.validate.source import SourceCheck
from glmq.quantize.validate.structure import check_structure


def _import_quietly() -> None:
    """`_ct()` in the background thread. Its errors are left to the main thread's own `_ct()` after the read, which
    reports them (an ImportError as CannotValidate); here they would only print a thread traceback."""
    with contextlib.suppress(BaseException):
        _ct()


def validate(checkpoint: str | Path, source: str | Path | None = None, *, sample: float = DEFAULT_SAMPLE,
             device: str = "cpu", tp: int = 1, seed: int = 0, serving: bool = True,
             workers: int | None = None, sha256: bool = False) -> Report:
    """Run every check on a converted checkpoint folder.

    Args:
        checkpoint: the folder `glmq quantize` wrote (or any compressed-tensors pack-quantized one).
        source: optional source checkpoint folder to compare weights with.
        sample: fraction in (0, 1] of the quantized modules of each stratum (numerics.stratum; at
            least one each) that get the matmul / source-weight checks. Scales, structure and
            integrity cover every module and every byte whatever the sample.
        device: "cpu" (reference path) or "cuda" (the Triton kernel).
        tp: tensor-parallel degree for the serving rules. serving: False skips them.
        seed: activation and sampling seed. workers: reader threads (default: the usable cores, at most 8).
        sha256: check every tensor's sha256 instead of its xxh3-128 (integrity.py; ~30x the hashing
            CPU). Shards whose manifest record predates xxh3-128 get sha256 regardless.
    Returns:
        The report; `report.exit_code` is 0 (valid) or 1 (invalid).
    Raises:
        CannotValidate: the checks cannot run (exit code 2).
    """
    t0 = time.perf_counter()
    _check_arguments(source, sample, device, tp)
    root = Path(checkpoint)
    with reading(root):
        return _validate(root, source, sample, device, tp, seed, serving, workers, sha256, t0)


def _validate(root: Path, source, sample: float, device: str, tp: int, seed: int, serving: bool, workers: int | None,
              sha256: bool, t0: float) -> Report:
    """`validate`'s checks, with the folder's read lock held."""
    ck = load_checkpoint(root)
    # compressed-tensors takes seconds to import (transformers); only the checks after the read need it
    # sysconfig fills its config vars lazily and not thread-safely (CPython 3.11): a thread that reads them while
    # another fills them sees a KeyError ('userbase', seen in CI in this thread's imports); fill them here first
    sysconfig.get_config_vars()
    ct_import = threading.Thread(target=_import_quietly, daemon=True)
    ct_import.start()
    modules = modules_of(ck.entries())
    q = read_quant_config(ck.config, ck.config_error)
    groups, ignore = q.groups, q.ignore
    scheme = {n: g for n, m in modules.items()
              if m.is_int and (g := group_for(n, groups)) is not None and g.kind == "int"}
    sampled = sample_modules(list(scheme), sample, seed, key=lambda n: stratum(modules[n], scheme[n]))
    src = None if source is None else SourceCheck(Path(source), ck, scheme)
    scan = ModuleScan(modules, scheme, sampled, device, seed, source=src)
    entries = ck.entries()

    def sink(name: str, t: torch.Tensor) -> None:
        if name in scan.owner:
            scan.add(name, t)
        elif (e := entries[name]).dtype in NONFINITE_DTYPES:  # kept for the source check; the scan tests the rest
            if rows := nonfinite_rows(t.reshape(-1).view(torch.uint8).numpy(), e.dtype, e.shape):
                scan.nonfinite(e, rows)
        if src is not None and name in src.keep:
            src.compare_tensor(name, t, entries[name].shard)

    # shards the manifest does not record (or no manifest): xxh3-128, only to read every byte cheaply
    algorithms = {s: XXH3_128 for s in ck.shards} | checksum_choice(ck.manifest, sha256)
    t_headers = time.perf_counter()
    stats = ScanStats()
    with _one_intra_op_thread(), _closing(src):
        hashes, read_errors = scan_shards(ck, scan.keep | (src.keep if src else set()), sink,
                                          workers or min(8, _cores()), stats, algorithms, scan.nonfinite)
    t_scan = time.perf_counter()
    ct_import.join()
    try:
        _ct()
    except ImportError as e:
        raise CannotValidate(f"compressed-tensors cannot be imported ({e}); the config checks need it") from e
    for msg in read_errors:
        ck.index.fail(msg)
    checks = {"config": check_config(q),
              "structure": check_structure(modules, groups, scan.shapes, ignore, ck.config, scan.values, ck.unread),
              "index": ck.index}
    if serving:
        checks["serving"] = check_serving(modules, groups, scan.shapes, ignore, q.qc, tp, config=ck.config)
    else:
        checks["serving"] = CheckResult("serving", skipped="skipped (serving=False / --no-serving)")
    checks["numerics"] = scan.result()
    if src is not None:
        checks["source"] = src.result()
    sizes = {s: (root / s).stat().st_size for s in hashes}
    headers = {s: header_checksum(root / s) for s in hashes}  # a few KB each: the tensor checksums skip headers
    if not hashes and ck.unread and ck.manifest is not None:  # every recorded file "not read": one cause, said once
        checks["integrity"] = CheckResult("integrity", skipped="skipped: no tensor file could be read (see index)")
    else:
        checks["integrity"] = check_integrity(ck.manifest, ck.manifest_error, hashes, sizes, algorithms, headers)
    settings = {"source": str(source) if source else None, "sample": sample, "device": device, "tp": tp, "seed": seed,
                "serving": serving, "sha256": sha256, "shards": len(ck.shards),
                "tensors": sum(len(e) for e in ck.shards.values()), "quantized_modules": len(scheme)}
    end = time.perf_counter()
    timings = {"headers_s": round(t_headers - t0, 3), "scan_s": round(t_scan - t_headers, 3),
               "checks_s": round(end - t_scan, 3), "scan_threads": stats.to_dict()}
    return Report(str(root), settings, checks, end - t0, timings)


def _check_arguments(source, sample: float, device: str, tp: int) -> None:
    if not 0.0 < sample <= 1.0:
        raise CannotValidate(f"sample must be in (0, 1], got {sample}")
    if tp < 1:
        raise CannotValidate(f"tp must be >= 1, got {tp}")
    if device not in ("cpu", "cuda"):
        raise CannotValidate(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and (missing := ops.cuda_missing(device)) is not None:
        raise CannotValidate(missing)
    if source is not None and not (Path(source) / "config.json").is_file():
        raise CannotValidate(f"--source {source}: no config.json there; point it at the source checkpoint folder")
    if source is not None:  # a format glmq converts from: a quantized output (even the checkpoint itself) passed
        # the source check against its own rounding, which says nothing about the conversion
        from glmq.formats.source import detect_format

        path = Path(source) / "config.json"
        try:
            config = json.loads(path.read_text())
            detect_format(config if isinstance(config, dict) else {}, path)
        except ValueError as e:  # CheckpointError is one; so is invalid JSON
            raise CannotValidate(f"--source {source}: not a checkpoint glmq converts from ({e}); point it at the "
                                 f"FP8 or BF16 checkpoint the output was converted from") from e


@contextlib.contextmanager
def reading(root: Path):
    """Hold a shared `flock` on the folder while it is read (`validate`; `glmq upload` from its gate to the end of the
    push), so that a `glmq quantize` cannot start to rewrite it meanwhile: its exclusive lock (quantize/output.
    OutputLock) is refused, naming the reader. Before, the lock was only probed, and a quantize started a second into a
    validate deleted and rewrote files under it, which still ended VALID (or in a traceback in upload's gate).

    Raises:
        BeingWritten (a CannotValidate): a glmq quantize holds the folder's lock: it is no checkpoint yet, whatever it
            holds at this instant (config.json is written before the manifest says complete, so the checks would call
            it INVALID, "re-run the same glmq quantize", which the lock then refuses, instead of saying that they
            cannot run).
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): quantize takes no lock there either
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # missing or not a folder: load_checkpoint says so
            pass
    if fd is None:  # (yielded out here, not in the except blocks: the body's errors would carry theirs as context)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise BeingWritten(f"{root}: a glmq process is writing into this folder (it holds the folder's lock), "
                                   f"so it is not a finished checkpoint; validate it once that run has ended") from None
            # (another error, e.g. NFS without lock support: read unguarded, as quantize then writes unguarded)
        yield
    finally:
        os.close(fd)  # drops the shared lock


def _cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def _closing(src: SourceCheck | None):
    """Close the source's files however the scan ends."""
    try:
        yield
    finally:
        if src is not None:
            src.src.close()


@contextlib.contextmanager
def _one_intra_op_thread():
    """Validation parallelises over work units with its own threads (one per core); torch's intra-op
    threads on top of them oversubscribe the cores, which made element-wise ops up to 20x slower on a
    busy 2-core machine. Restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
