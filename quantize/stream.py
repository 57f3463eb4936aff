"""The streaming engine: plan -> validate -> process (one source shard at a time) -> write.

Memory is bounded by one source shard's mapped pages plus a few row blocks in flight: tensors are
read lazily with `safe_open` in row blocks of about `CHUNK_BYTES`, converted, and streamed into
output files whose headers the plan fixed in advance. A loader thread reads the next row blocks
and a writer thread writes and hashes finished ones while the main thread computes.

Crash safety: each output file is written under a temporary name and renamed when complete, then
recorded with its tensor checksums in the manifest; the index and config.json are written last. A
rerun with the same source and recipe verifies the recorded files and redoes only the rest (the output
folder's side of this lives in quantize/output.py).

Distributed (`world`, quantize/dist.py): every rank converts its share of the output files; rank 0
prepares the folder, and after every rank has finished, merges the records and writes the manifest,
the index and config.json, so the folder's bytes are those of a single-process run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import threading
import zlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from glmq import __version__
from glmq.formats import manifest
from glmq.formats.fp8 import NonFiniteWeightError
from glmq.formats.manifest import FRAGMENT_GLOB, REPORT_NAME, Manifest
from glmq.formats.safetensors_io import XXH3_128, CheckpointError, StreamingWriter, atomic_write_text
from glmq.formats.source import Source
from glmq.quantize import ops
from glmq.quantize.output import (ConfigJob, FileBook, OutputDirError, OutputLock, finish_checkpoint, moved_during_run,
                                  prepare_output)
from glmq.quantize.plan import Action, Item, OutFile, Plan

log = logging.getLogger("glmq")
CHUNK_BYTES = 64 << 20  # source bytes per row block: big enough to amortise calls, small for memory
PREFETCH = 3  # row blocks read ahead of the one being converted
PENDING_BYTES = 4 * CHUNK_BYTES  # converted rows waiting for the write lanes (`_WritePipeline`)


# ----------------------------------------------------------------------------------------- reading
class Reader:
    """Lazy row-block reads through safe_open, one handle per shard, opened on demand.

    safe_open maps the whole file, and the tensors it returns are views of that mapping: every page a
    conversion touches stays resident (and counts in this process's RSS) while the handle or any view
    lives. A handle is therefore dropped after every `RELEASE_BYTES` read through it (the next read
    opens a new one, a header parse), so that RSS holds the row blocks in flight and at most that much
    of a shard, not the whole shard.
    """

    RELEASE_BYTES = 2 * CHUNK_BYTES

    def __init__(self, source: Source):
        self.source = source
        self.handles: dict[str, object] = {}
        self.read: dict[str, int] = {}

    def _h(self, shard: str):
        if shard not in self.handles:
            self.handles[shard] = safe_open(str(self.source.path(shard)), framework="pt")
            self.read[shard] = 0
        return self.handles[shard]

    def rows(self, entry, r0: int | None = None, r1: int | None = None) -> torch.Tensor:
        h = self._h(entry.shard)
        try:
            t = h.get_tensor(entry.name) if r0 is None or len(entry.shape) == 0 else h.get_slice(entry.name)[r0:r1]
        except Exception as e:  # safetensors raises several types; name the tensor and shard
            raise CheckpointError(f"{self.source.path(entry.shard)}: reading tensor {entry.name} failed: {e}") from e
        self.read[entry.shard] += t.numel() * t.element_size()
        if self.read[entry.shard] >= self.RELEASE_BYTES:
            del self.handles[entry.shard]  # the mapping goes once the views handed out so far are freed
        return t

    def close_except(self, keep: set[str]) -> None:
        """Drop handles (and their mapped pages) of shards the current work no longer needs."""
        for shard in [s for s in self.handles if s not in keep]:
            del self.handles[shard]


@dataclass
class Unit:
    """A row block of one item: what the loader reads and the main thread converts."""

    item: Item
    r0: int
    r1: int
    data: dict | None = None


def row_blocks(item: Item, block: tuple[int, int] | None) -> list[tuple[int, int]]:
    shape = item.src.shape
    if len(shape) < 2 or item.src.nbytes <= CHUNK_BYTES:
        return [(0, shape[0] if shape else 0)]
    align = 128 if block is None else block[0]
    rows = max(align, (CHUNK_BYTES // (item.src.nbytes // shape[0])) // align * align)
    return [(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]


def load_unit(reader: Reader, u: Unit, block: tuple[int, int] | None, quantized=None,
              device: torch.device | None = None) -> Unit:
    """Read one row block (runs in the loader thread, the only user of `reader`).

    With `quantized` (module -> QWeight or None, e.g. GPTQ results), a QUANTIZE item whose integers
    are already known takes them from there instead of reading and rounding the source.
    """
    it = u.item
    if quantized is not None and it.action is Action.QUANTIZE:
        qw = quantized(it.module)
        if qw is not None:
            u.data = {"qw": qw}
            return u
    reader.close_except({it.src.shard} | {e.shard for e in it.companions.values()})
    whole = (u.r0, u.r1) == (0, it.src.shape[0] if it.src.shape else 0)
    w = reader.rows(it.src) if whole else reader.rows(it.src, u.r0, u.r1)
    data = {"w": w}
    for key, e in it.companions.items():
        if key == "weight_scale_inv" and not whole:
            bn = block[0]
            data[key] = reader.rows(e, u.r0 // bn, -(-u.r1 // bn))
        elif key == "weight_scale" and not whole and e.shape and e.shape[0] == it.src.shape[0]:
            data[key] = reader.rows(e, u.r0, u.r1)
        else:
            data[key] = reader.rows(e)
    if device is not None and device.type != "cpu" and it.action in (Action.QUANTIZE, Action.DEQUANTIZE):
        # host-to-device copies happen here, in the loader thread, off the converting thread
        data = {k: v.to(device) for k, v in data.items()}
    u.data = data
    return u


# ----------------------------------------------------------------------------------------- compute
def convert_unit(u: Unit, plan: Plan, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Turn one loaded row block into (output name, tensor rows) pairs, computed on `device`.

    Results may stay on the device: the write lanes copy them back (`tensor_bytes`), so device-to-host
    copies overlap with the next block's compute."""
    it, d = u.item, u.data
    fmt = plan.source.fmt.value
    block = plan.source.block
    scale = d.get("weight_scale_inv", d.get("weight_scale"))
    if it.action is Action.COPY:
        ops.check_copied(d["w"])
        return [(it.name, d["w"])]
    if it.action is Action.KEEP_FP8:
        ops.check_copied(d["w"])
        ops.check_copied(d["weight_scale_inv"])
        return [(it.name, d["w"]), (f"{it.module}.weight_scale", d["weight_scale_inv"])]
    if "qw" in d:  # integers computed elsewhere (GPTQ): pack this row block of them
        res = ops.pack_rows(d["qw"], u.r0, u.r1, plan.recipe.spec)
    else:
        res = _convert_source_rows(it, d, scale, fmt, block, plan, device)
        if it.action is Action.DEQUANTIZE:
            return res
    out = [(f"{it.module}.{k}", v) for k, v in res.items()]
    if u.r1 == it.src.shape[0]:
        out.append((f"{it.module}.weight_shape", torch.tensor(list(it.src.shape), dtype=torch.int64)))
    return out


def _finite(t: torch.Tensor | None) -> bool | None:
    """Whether a floating tensor holds no NaN or Inf (FP8 is widened first: torch has no isfinite for it); None for
    another dtype or none."""
    if t is None or not t.is_floating_point():
        return None
    return bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())


def _corrupt_source(plan: Plan, u: Unit, e: ValueError) -> str:
    """The message for a row block that failed to convert: it names the scale and the scale's shard when the scale
    itself holds NaN or Inf, or when weight and scale are finite but their product is not (a huge scale element: the
    weight's FP8 codes are at most 448); the scale may sit in another shard than the weight. Else the weight and its
    shard."""
    rows = f"(rows {u.r0}-{u.r1}): {e}"
    data = u.data or {}
    scales = [(entry, data[leaf], ok) for leaf, entry in u.item.companions.items()
              if leaf != "input_scale" and (ok := _finite(data.get(leaf))) is not None]
    for entry, _, ok in scales:
        if not ok:
            return (f"{plan.source.path(entry.shard)}: tensor {entry.name} holds NaN or Inf, so weight {u.item.name} "
                    f"{rows}; the scale is corrupt, re-download its shard")
    if scales and isinstance(e, NonFiniteWeightError) and _finite(data.get("w")):
        entry, t, _ = scales[0]
        return (f"{plan.source.path(entry.shard)}: tensor {entry.name} holds {t.abs().max().item():.3g}, so weight "
                f"{u.item.name} x it overflows {rows}; the scale is corrupt, re-download its shard")
    return f"{plan.source.path(u.item.src.shard)}: tensor {u.item.name} {rows}; the source weight is corrupt, " \
           f"re-download the shard"


def _convert_source_rows(it, d, scale, fmt, block, plan, device):
    w = d["w"].to(device, non_blocking=True)
    scale = None if scale is None else scale.to(device, non_blocking=True)
    if it.action is Action.DEQUANTIZE:
        return [(it.name, ops.decode(w, scale, fmt, block))]
    return ops.quantize_rows(w, scale, fmt, block, plan.recipe.spec)


# ----------------------------------------------------------------------------------------- engine
@dataclass
class RunStats:
    bytes_in: int = 0
    bytes_out: int = 0
    files_written: int = 0
    files_skipped: int = 0
    seconds: float = 0.0


def _units(plan: Plan, todo: list[OutFile]):
    for f in todo:
        for it in f.items:
            for r0, r1 in row_blocks(it, plan.source.block):
                yield f, Unit(it, r0, r1)


class _WritePipeline:
    """Writes row blocks on `lanes` threads and commits finished files on another.

    A tensor always goes to the same lane, so its row blocks arrive in order for its running sha256;
    different tensors are written and hashed in parallel (pwrite and hashlib release the GIL). A
    file's commit (fsync, rename, manifest) waits for that file's writes only, so it overlaps with
    the next file's. At most `max_pending_bytes` of converted rows wait to be written (one block
    always may): a budget in bytes, not blocks, since an FP8 -> BF16 block is 4x a packed INT4 one
    (counted in blocks, a run of attention weights made the peak RSS grow with the checkpoint).
    """

    def __init__(self, lanes: int, max_pending_bytes: int):
        self.lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"glmq-write{i}") for i in range(lanes)]
        self.committer = ThreadPoolExecutor(1, thread_name_prefix="glmq-commit")
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._budget = threading.Condition()
        self.file_futures: dict[str, list] = {}
        self.commits: list[tuple[str, object]] = []  # (file name, commit future)
        self.failed: str | None = None  # the file whose write or commit failed
        self.busy = {"write_hash": 0.0, "commit_fsync": 0.0}
        self._lock = threading.Lock()

    def _timed(self, key: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.busy[key] += time.perf_counter() - t

    def write(self, fname: str, w: StreamingWriter, name: str, t: torch.Tensor) -> None:
        self.check()
        n = t.numel() * t.element_size()
        with self._budget:
            while self.pending_bytes and self.pending_bytes + n > self.max_pending_bytes:
                self._budget.wait()
            self.pending_bytes += n
        lane = self.lanes[zlib.crc32(name.encode()) % len(self.lanes)]
        fut = lane.submit(self._timed, "write_hash", w.write, name, t)
        fut.add_done_callback(lambda _, n=n: self._release(n))
        self.file_futures.setdefault(fname, []).append(fut)

    def _release(self, n: int) -> None:
        with self._budget:
            self.pending_bytes -= n
            self._budget.notify_all()

    def commit(self, fname: str, fn) -> None:
        futures = self.file_futures.pop(fname, [])

        def job():
            for f in futures:
                f.result()  # a failed write fails the commit
            self._timed("commit_fsync", fn)

        self.commits.append((fname, self.committer.submit(job)))

    def check(self) -> None:
        for fname, f in [c for c in self.commits if c[1].done()]:
            self._result(fname, f)

    def finish(self) -> None:
        for fname, f in self.commits:
            self._result(fname, f)
        self.shutdown()

    def _result(self, fname: str, f) -> None:
        if f.exception() is not None:
            self.failed = fname
        f.result()

    def shutdown(self) -> None:
        for ex in (*self.lanes, self.committer):
            ex.shutdown(wait=True, cancel_futures=True)


def run(plan: Plan, out: str | Path, device: str = "cpu", progress: bool = True, quantized=None,
        extra_report: dict | None = None, world=None, calibration: dict | None = None) -> dict:
    """Convert the planned checkpoint into `out`; return the run report (also written to disk).

    Args:
        quantized: optional `module name -> QWeight | None`; QUANTIZE items it answers are written
            from those integers and scales (GPTQ) instead of round-to-nearest of the source.
        extra_report: merged into the run report (e.g. the GPTQ calibration report).
        world: a `dist.World` when this process is one rank of a torchrun job (`device` is then the
            rank's, e.g. "cuda:1"); None (single process) never touches torch.distributed.
        calibration: with `quantized`, the calibration's identity, part of the folder's (`output.plan_identity`).
    Returns:
        the report; in a distributed run every rank gets rank 0's.
    Raises:
        RankFailure: (distributed) this rank failed; the message names the rank and the file.
        OutputDirError: `out` holds something else, or another glmq process is writing into it.
    """
    with OutputLock(Path(out)) as lock:  # held from the folder's check to the report (rank 0's)
        return _run(plan, Path(out), lock, device, progress, quantized, extra_report, world, calibration)


def _run(plan: Plan, out: Path, lock: OutputLock, device: str, progress: bool, quantized, extra_report: dict | None,
         world, calibration: dict | None) -> dict:
    t0 = time.perf_counter()
    lead = world is None or world.is_lead
    phases: dict[str, float] = {}
    dev = torch.device(device)
    if (missing := ops.cuda_missing(dev)) is not None:  # the CLI checks first; this guards other callers
        raise ValueError(missing)
    config_job = ConfigJob(plan, own_session=world is not None) if lead else None
    phases["import"] = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # the CUDA context now, so that the start-up RSS below includes it
    rss_start = current_rss_bytes()
    try:
        man = prepare_output(plan, out, lock, world, calibration)
        phases["prepare_output"] = time.perf_counter() - t0 - phases["import"]
        t_pipe = time.perf_counter()
        todo = [f for f in plan.files if f.name not in man.files]
        mine = todo if world is None else world.mine(todo, [file_cost(f) for f in todo])
        try:
            book = FileBook(out, man, world)  # distributed: writes this rank's manifest fragment
        except OSError as e:
            if world is None:
                raise
            raise world.failure(f"writing its manifest fragment in {out}", e) from e
        stats, busy = convert_files(plan, out, mine, dev, quantized, book.record, progress and lead, world)
    except BaseException:
        if config_job is not None:
            config_job.cancel()
        raise
    stats.files_skipped = len(plan.files) - len(todo)
    stats.seconds = time.perf_counter() - t_pipe
    phases["pipeline"] = stats.seconds
    qc = None if config_job is None else _config_result(config_job, world, phases)
    ranks = [_rank_row(0, stats)]
    if world is not None:  # every rank must get here before rank 0 may write the index and config.json
        t_wait = time.perf_counter()
        parts = world.gather((_rank_row(world.rank, stats), book.files), "gathering the ranks' records")
        phases["wait_for_ranks"] = time.perf_counter() - t_wait
        if lead:
            ranks = [row for row, _ in parts]
            for _, files in parts:
                man.files.update(files)
    report = None
    if lead:
        try:
            report = _finish(plan, out, man, qc, stats, ranks, device, phases, t0)
        except Exception as e:
            if world is None and isinstance(e, OSError):  # e.g. the disk filled up with the side files
                raise OutputDirError(f"{out}: writing the side files, index, config.json or manifest failed: {e}; "
                                     f"free space or fix the output folder, then re-run the same command (the "
                                     f"converted files are kept)") from e
            if world is None:
                raise
            raise world.failure(f"finishing {out}", e) from e
        # the child that builds the compressed-tensors config runs beside the conversion (its imports alone ~0.5 GB):
        # peak_rss_bytes is this process's; the job's peak is at most their sum
        report["config_child_peak_rss_bytes"] = getattr(config_job, "peak_rss", None)
        report["stage_busy_seconds"] = {k: round(v, 3) for k, v in busy.items()}
        report["rss_at_start_bytes"] = rss_start  # after imports (and the CUDA context), before any data
        report.update(extra_report or {})
        kept = None if todo else _recheck_of(out, report)
        try:
            atomic_write_text(out / REPORT_NAME, json.dumps(report if kept is None else kept, indent=1) + "\n")
        except OSError as e:  # the checkpoint is complete (config.json and the index are written): not a failure
            log.warning("%s: could not be written (%s); the checkpoint is complete, and this run's figures are only in "
                        "what it prints (and --json)", out / REPORT_NAME, e.strerror or e)
            report["report_not_written"] = f"{REPORT_NAME}: {e.strerror or e}"
        else:
            if kept is not None:
                report["report_kept"] = f"{REPORT_NAME} keeps the conversion's figures; this re-check is in its rechecks"
    return report if world is None else world.broadcast(report, "final report")


def file_cost(f: OutFile) -> int:
    """What balances the ranks' shares: bytes read plus bytes written. Every written byte is also
    hashed and fsynced, and an FP8 -> BF16 file writes twice what it reads (an INT4 one half), so
    bytes in alone would undercount the files of attention and dense weights."""
    return sum(it.in_bytes + it.out_bytes for it in f.items)


RECHECKS_KEPT = 10  # re-runs of a finished folder a report lists


def _recheck_of(out: Path, report: dict) -> dict | None:
    """The folder's report to store after a re-run that converted nothing (every file was already written; it
    re-checked the folder and re-wrote the index, config.json and side files): the conversion's, whose time,
    throughput and peak memory are the figures that describe the checkpoint (`glmq upload` publishes them), with this
    run added to its "rechecks". None when there is no readable earlier report, which this run's then replaces. (The
    run itself still returns, prints and writes to --json its own figures.)"""
    try:
        old = json.loads((out / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or old.get("source") != report.get("source"):
        return None
    runs = old.get("rechecks") if isinstance(old.get("rechecks"), list) else []
    runs.append({"files_rechecked": report["files_skipped_resumed"], "seconds": report["seconds"],
                 "peak_rss_bytes": report["peak_rss_bytes"],
                 "glmq_version": report["glmq_version"]})
    old["rechecks"] = runs[-RECHECKS_KEPT:]
    return old


def _rank_row(rank: int, stats: RunStats) -> dict:
    return {"rank": rank, "files_written": stats.files_written, "bytes_in_processed": stats.bytes_in,
            "seconds": round(stats.seconds, 3), **peak_memory()}


def _config_result(job: "ConfigJob", world, phases: dict) -> dict:
    t = time.perf_counter()
    try:
        return job.result()
    except Exception as e:
        if world is None:
            raise
        raise world.failure("building the quantization_config", e) from e
    finally:
        phases["config_wait"] = time.perf_counter() - t


def _finish(plan: Plan, out: Path, man: Manifest, qc: dict, stats: RunStats, ranks: list[dict],
            device: str, phases: dict, t0: float) -> dict:
    """Rank 0 / single process: check every file is recorded, write index and config.json; the report."""
    missing = [f.name for f in plan.files if f.name not in man.files]
    if missing:  # an engine bug, never a user error: the ranks' shares must cover the plan
        raise RuntimeError(f"{out}: {len(missing)} planned file(s) were written by no rank, e.g. {missing[0]}")
    absent = [f.name for f in plan.files if not _on_disk(out / f.name, man.files[f.name].get("bytes"))]
    if absent:  # e.g. a run over several nodes whose --output is not one shared folder: other ranks wrote elsewhere
        raise OutputDirError(
            f"{out}: {len(absent)} file(s) recorded as written are not in this folder (or have another size), e.g. "
            f"{absent[0]}; every rank must write into the same folder (across nodes: one on a shared file system). "
            f"No index or config.json was written; re-run the same command to convert them again"
        )
    t_fin = time.perf_counter()
    man.save(out)  # the merged records first: then the ranks' fragments may go
    for p in out.glob(FRAGMENT_GLOB):
        manifest.remove(out, p.name)
    moved = moved_during_run(plan, out)
    if moved:
        raise OutputDirError(moved)
    finish_checkpoint(plan, out, man, qc)
    phases["finish"] = time.perf_counter() - t_fin
    stats = dataclasses.replace(stats, bytes_in=sum(r["bytes_in_processed"] for r in ranks), bytes_out=plan.bytes_out,
                                seconds=time.perf_counter() - t0)
    report = make_report(plan, stats, device)
    report["world_size"] = len(ranks)
    report["ranks"] = ranks
    if len(ranks) > 1:  # peak_rss_bytes is this process's (rank 0); the job's busiest rank may have peaked higher
        report["peak_rss_bytes_largest_rank"] = max(r["peak_rss_bytes"] for r in ranks)
    report["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return report


def _on_disk(path: Path, size: int | None) -> bool:
    try:
        return size is None or path.stat().st_size == size
    except FileNotFoundError:
        return False


def convert_files(plan: Plan, out: Path, files: list[OutFile], dev: torch.device, quantized, record,
                  progress: bool, world=None) -> tuple[RunStats, dict[str, float]]:
    """Convert and write `files` (this process's share of the plan), calling `record` for each finished one.

    Returns:
        (stats: bytes in, files written; busy seconds per stage).
    Raises:
        RankFailure (distributed) naming the file being converted or committed when it failed.
    """
    stats = RunStats()
    bar = _progress(sum(it.in_bytes for f in files for it in f.items), progress)
    if world is not None:
        bar.set_description(f"glmq quantize (rank 0 of {world.size})")
    reader = Reader(plan.source)
    lanes = max(1, min(4, (os.cpu_count() or 2) // 2))
    writer = _WritePipeline(lanes, max_pending_bytes=PENDING_BYTES)
    writers: dict[str, StreamingWriter] = {}
    # files whose commit is queued, until it succeeds (the committer removes them): a failure cancels the queued
    # commits, and these are aborted too
    queued: dict[str, StreamingWriter] = {}
    busy = {"load": 0.0, "convert": 0.0}
    current: OutFile | None = None

    def load(u: Unit) -> Unit:
        t = time.perf_counter()
        try:
            return load_unit(reader, u, plan.source.block, quantized, dev)
        finally:
            busy["load"] += time.perf_counter() - t

    def commit(f: OutFile, w: StreamingWriter):
        hashes = w.commit()
        record(f, w.size, hashes, w.digests(XXH3_128), w.header_digest)
        del queued[f.name]

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="glmq-load") as pool:
            units = _units(plan, files)
            pending = []
            for _ in range(PREFETCH):
                nxt = next(units, None)
                if nxt:
                    pending.append((nxt[0], pool.submit(load, nxt[1])))
            remaining = {f.name: sum(len(row_blocks(it, plan.source.block)) for it in f.items) for f in files}
            while pending:
                f, fut = pending.pop(0)
                current = f
                u = fut.result()
                nxt = next(units, None)
                if nxt:
                    pending.append((nxt[0], pool.submit(load, nxt[1])))
                if f.name not in writers:
                    specs = [o for it in f.items for o in it.outputs]
                    try:
                        writers[f.name] = StreamingWriter(out / f.name, specs)
                    except OSError:
                        writer.failed = f.name
                        raise
                t_conv = time.perf_counter()
                try:
                    results = convert_unit(u, plan, dev)
                except ValueError as e:  # e.g. NaN/Inf in a weight: name the tensor and shard
                    raise CheckpointError(_corrupt_source(plan, u, e)) from e
                busy["convert"] += time.perf_counter() - t_conv
                w = writers[f.name]
                for name, t in results:
                    writer.write(f.name, w, name, t)
                nbytes = u.item.in_bytes * (u.r1 - u.r0) // max(1, u.item.src.shape[0] if u.item.src.shape else 1)
                stats.bytes_in += nbytes
                bar.update(nbytes)
                remaining[f.name] -= 1
                if remaining[f.name] == 0:
                    queued[f.name] = writers.pop(f.name)
                    writer.commit(f.name, lambda f=f, w=queued[f.name]: commit(f, w))
                    stats.files_written += 1
        writer.finish()
    except BaseException as e:
        bar.close()
        writer.shutdown()  # waits for a running commit, cancels the queued ones
        for w in (*writers.values(), *queued.values()):  # (a file renamed but not recorded: its abort is a no-op)
            w.abort()
        if world is None and isinstance(e, OSError) and writer.failed:  # e.g. the disk is full
            raise OutputDirError(f"{out / writer.failed}: writing it failed: {e}; free space or fix the output "
                                 f"folder, then re-run the same command (finished files are kept)") from e
        if world is None or not isinstance(e, Exception):
            raise
        name = writer.failed or (current.name if current else "its first file")
        src = next((f.source_shard for f in files if f.name == name), None)
        raise world.failure(f"{name}" + (f" (source shard {src})" if src else ""), e) from e
    bar.close()
    return stats, {**busy, **writer.busy}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="glmq quantize",
                disable=not enabled, dynamic_ncols=True, smoothing=0.1)


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM (Linux), else ru_maxrss.

    ru_maxrss is carried across fork and exec (a process started by a large parent reports at least the
    parent's resident set at the fork); VmHWM belongs to the process's own address space, new at exec.
    """
    peak = _proc_status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak


def current_rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc), or None where that is not available."""
    return _proc_status_bytes("VmRSS")


def release_free_memory() -> None:
    """Hand the allocator's free heap pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Why: glibc's dynamic mmap threshold rises to the size of the largest block freed (up to 32 MB), after
    which a layer's many 4-32 MB tensors (Hessians, weights, activations of a batch) come from the heap,
    whose free pages stay resident; over a GPTQ run that held ~0.5 GB of freed memory (peak RSS 2.2-2.5 GB
    against 1.5 GB with a fixed 1 MB threshold, which made the run 25 % slower through page faults).
    Trimming between a layer's phases keeps the fast heap and drops what a phase left behind (4-layer
    scaling model: 2.2 -> 1.7-1.8 GB, no slower; trimming after every calibration batch too: 1.73 GB, ~10 %
    slower).
    """
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - not glibc: AttributeError
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def _proc_status_bytes(key: str) -> int | None:
    """A kB field of /proc/self/status in bytes, or None where that is not available."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def peak_memory() -> dict:
    """This process's peak host RSS and, once it has used CUDA, the peak the allocator handed out on its
    current device (the number `torch.cuda.max_memory_allocated` gives; the driver's own use is not in it)."""
    row = {"peak_rss_bytes": peak_rss_bytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return row


def make_report(plan: Plan, stats: RunStats, device: str) -> dict:
    rep = {
        "glmq_version": __version__,
        "source": str(plan.source.root),
        "source_format": plan.source.fmt.value,
        "family": plan.source.family.name,
        "recipe": plan.recipe.to_dict(),
        "device": device,
        "files": len(plan.files),
        "files_skipped_resumed": stats.files_skipped,
        "bytes_in_total": plan.source.total_bytes,
        "bytes_in_processed": stats.bytes_in,
        "bytes_out": stats.bytes_out,
        "seconds": round(stats.seconds, 3),
        "throughput_in_GBps": round(stats.bytes_in / stats.seconds / 1e9, 4) if stats.seconds else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "by_class": plan.by_class(),
        "mtp_tensors": sum(it.mtp for it in plan.items),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        rep["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return rep
