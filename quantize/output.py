"""The output folder of a conversion: its identity, the resume check, the finished files' records, and
the last steps that make it a checkpoint (side files, index, config.json).

A folder is either new and empty, or holds an interrupted run of the very same plan (`glmq_manifest.json`
with the same identity): then every recorded file is verified against its planned header and its recorded
tensor checksums and kept, and everything else of the interrupted run (half-written temporary files, rank
fragments) is cleaned up. The index and config.json are written last (and removed before a file of a finished
folder is converted again), so that an interrupted run never leaves them beside missing files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

from glmq import __version__
from glmq.formats.families import EXPERT_MODULE, FUSED_ALIASES, FUSED_NAMES, LINEAR_CLASSES, ignore_list
from glmq.formats import manifest
from glmq.formats.manifest import CHECKSUM_KEYS, HEADER_KEY, MANIFEST_NAME, Manifest, fragment_name
from glmq.formats.safetensors_io import (PT_METADATA, SHA256, TMP_SUFFIX, XXH3_128, CheckpointError,
                                         atomic_write_text, file_tensor_checksums, layout,
                                         read_header, replaced_atomically)
from glmq.formats.source import INDEX_NAME, shard_mtimes
from glmq.quantize import config_child
from glmq.quantize.plan import Action, OutFile, Plan
from glmq.quantize.spec import Method

log = logging.getLogger("glmq")


class OutputDirError(CheckpointError):
    pass


class OutputLock:
    """An exclusive `flock` on the output folder for the whole run, so that a second glmq process started into
    the same folder (a scheduler's retry while the first still runs, a command typed twice) is refused before it
    deletes the first one's temporary files or writes the same files; the kernel drops it when the process dies,
    so a killed run never leaves a stale lock, and nothing is written into the folder for it.

    Re-entrant within a process (GPTQ holds it around calibration and then around `stream.run`): flock conflicts
    between two open descriptions of one folder even in one process, so the descriptor is shared by path.
    Hand-written: filelock and portalocker lock a file of their own, which would be a stray file in the checkpoint.
    """

    _held: dict[str, list] = {}  # realpath -> [fd, holders]
    _guard = threading.Lock()

    def __init__(self, out: Path):
        self.out = Path(out)
        self.key: str | None = None

    def acquire(self) -> None:
        """Take the lock (the folder must exist); a no-op if this object holds it already.

        Raises:
            OutputDirError: another process holds it.
        """
        if self.key is not None:
            return
        key = os.path.realpath(self.out)
        with self._guard:
            if key in self._held:
                self._held[key][1] += 1
                self.key = key
                return
            fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except ImportError:  # no flock (Windows): the run goes on unguarded
                pass
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    # e.g. NFS without lock support: warn, do not refuse the run
                    log.warning("%s: cannot lock the output folder (%s); make sure no other glmq run writes into it",
                                self.out, e.strerror or e)
                else:
                    readers = _only_readers(fd, fcntl)
                    os.close(fd)
                    if readers:  # `glmq validate` or `glmq upload` (validate.driver.reading)
                        raise OutputDirError(
                            f"{self.out}: a glmq validate or upload is reading this folder (it holds the folder's "
                            f"shared lock); re-run once it has ended, or choose another --output") from None
                    raise OutputDirError(
                        f"{self.out}: another glmq process is writing into this folder (it holds the folder's lock); "
                        f"wait for it to end (or stop it), then re-run to resume, or choose another --output") from None
            self._held[key] = [fd, 1]
            self.key = key

    def release(self) -> None:
        if self.key is None:
            return
        with self._guard:
            held = self._held[self.key]
            held[1] -= 1
            if held[1] == 0:
                os.close(held[0])  # closing the last descriptor drops the flock
                del self._held[self.key]
        self.key = None

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _only_readers(fd: int, fcntl) -> bool:
    """Whether the folder's lock, which refused an exclusive hold, is held shared only (readers), probed with a shared
    lock of `fd` that is dropped again."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def plan_identity(plan: Plan, calibration: dict | None = None) -> dict:
    """What a folder's finished files depend on; a resume keeps them only when it is the same. `calibration`: a GPTQ
    run's settings and calibration tokens' digest (its files hold that calibration's integers)."""
    return {
        "glmq_version": __version__,
        "source_digest": plan.source.header_digest,
        "recipe": plan.recipe.to_dict(),
        "max_shard_bytes": plan.max_shard_bytes,
        "files": [f.name for f in plan.files],
    } | ({"calibration": calibration} if calibration is not None else {})


# ----------------------------------------------------------------------------------------- output dir
def prepare_output(plan: Plan, out: Path, lock: OutputLock, world=None, calibration: dict | None = None) -> Manifest:
    """Create the output folder, or resume the interrupted run of this very plan that it holds.

    Args:
        lock: the caller's lock on `out`, taken here once the folder exists (by rank 0 alone in a distributed
            run); the caller releases it when the run ends.
        world: a `dist.World`: rank 0 prepares the folder while the others wait, then every rank
            gets rank 0's manifest (whose `files` are the verified finished files).
        calibration: a GPTQ run's calibration identity (`plan_identity`).
    Raises:
        OutputDirError: the folder holds anything else, or another process is writing into it.
        RankFailure: (distributed) rank 0 could not prepare the folder.
    """
    identity = plan_identity(plan, calibration)
    if world is None:
        return _prepare_output(plan, Path(out), lock, identity)
    man = world.on_lead(f"output folder {out}", lambda: _prepare_output(plan, Path(out), lock, identity), share=True)
    if man.identity != identity:  # e.g. another glmq version or source copy on another node
        diff = _differing(man.identity, identity)
        raise world.failure("planning", f"this rank's plan differs from rank 0's in {', '.join(diff)}; every rank "
                                        f"must see the same source, recipe, options, calibration and glmq version")
    other = [s for s, h in plan.source.shard_samples.items() if man.source_samples.get(s) != h]
    if other:  # a node-local copy of another model of the same layout (rank 0 recorded its own samples)
        raise world.failure("planning", f"this rank's copy of {plan.source.path(other[0])} holds other data than rank "
                                        f"0's ({len(other)} shard(s) differ); every rank must read the same source")
    if not (Path(out) / MANIFEST_NAME).is_file():  # e.g. --output on each node's local disk
        raise world.failure(f"output folder {out}", f"{Path(out) / MANIFEST_NAME}, which rank 0 has just written, is "
                                                    f"not there: every rank must write into the same folder (across "
                                                    f"nodes: one on a shared file system)")
    return man


def _refuse_corrupt_shards(plan: Plan, out: Path, shards: list[str]) -> None:
    """Raise before a finished folder is touched where a changed source shard holds NaN or Inf in a floating-point
    tensor (which the conversion refuses too, but only after the folder's config.json, index and that shard's outputs
    were deleted: a probe lost a valid checkpoint to a shard corrupted after the run). One read of those shards."""
    import mmap

    from glmq.quantize.validate.reading import NONFINITE_DTYPES, nonfinite_rows

    for shard in shards:
        path = plan.source.path(shard)
        entries, _, start = read_header(path)  # (checks the file holds what its header says: no mapped page past it)
        ents = [e for e in entries.values() if e.dtype in NONFINITE_DTYPES]
        if not ents:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            for e in ents:
                with view[start + e.begin:start + e.end] as data:
                    rows = nonfinite_rows(data, e.dtype, e.shape)
                if rows:
                    raise OutputDirError(
                        f"{path}: tensor {e.name} holds NaN or Inf (rows {rows[:8]}); this shard changed since the "
                        f"finished conversion in {out}, which is left as it is; re-download the shard, then run again "
                        f"(or use a new --output folder)")


@contextlib.contextmanager
def _writing_into(out: Path):
    """An OSError of a write or delete in the output folder (read-only, full, not ours) as one OutputDirError."""
    try:
        yield
    except OSError as e:
        raise OutputDirError(f"{out}: cannot write into the output folder ({e.strerror or e}); fix its "
                             f"permissions or free space, or choose another --output") from None


def output_folder_problem(out: Path) -> str | None:
    """Why `out` cannot be, or become, an output folder, found without creating anything (None: no reason known
    before trying): a file in its place, a link to nothing (mkdir said only "File exists"), a file among its parents.
    The CLI asks when --output is parsed (exit 2 before any work); the writer asks again for the Python API."""
    try:
        if out.exists() and not out.is_dir():
            return "exists and is not a directory"
        if (dangling := next((p for p in (out, *out.parents) if p.is_symlink() and not p.exists()), None)) is not None:
            return f"{'' if dangling == out else f'{dangling} is '}a link to {os.readlink(dangling)}, which does not exist"
        if (blocker := next((p for p in reversed(out.parents) if p.exists() and not p.is_dir()), None)) is not None:
            return f"{blocker} is a file, not a directory"
    except OSError as e:  # a name longer than the file system's limit
        return e.strerror or str(e)
    return None


def _prepare_output(plan: Plan, out: Path, lock: OutputLock, identity: dict) -> Manifest:
    if (why := output_folder_problem(out)) is not None:
        raise OutputDirError(f"{out}: {why}; choose another --output")
    if out.exists() and os.path.samefile(out, plan.source.root):  # (was: "not empty and holds no interrupted run")
        raise OutputDirError(f"{out}: is the source checkpoint itself ({plan.source.root}); choose another --output")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. no permission
        raise OutputDirError(f"{out}: cannot create the output folder: {e.strerror or e}; choose another --output") \
            from None
    lock.acquire()  # before anything in the folder is read, deleted or written
    existing = [p for p in out.iterdir()]
    man = Manifest.load(out)
    times, samples = dict(plan.source.shard_mtime_ns), dict(plan.source.shard_samples)
    if man is None:
        first = out / (MANIFEST_NAME + TMP_SUFFIX)  # a run killed while saving its first manifest had done nothing
        if existing == [first]:
            first.unlink()
            existing = []
        if existing:
            raise OutputDirError(
                f"{out}: not empty and holds no interrupted glmq run ({len(existing)} entries, e.g. "
                f"{existing[0].name}); choose an empty or new --output folder, or remove this one"
            )
        man = Manifest(identity, source_mtime_ns=times, source_samples=samples)
        with _writing_into(out):  # the run's first write into the folder: read-only, full, or not ours
            man.save(out)
        return man
    if man.identity != identity:
        diff = _differing(man.identity, identity)
        if diff == ["calibration"] and isinstance(man.identity.get("calibration"), dict) and identity.get("calibration"):
            raise OutputDirError(
                f"{out / MANIFEST_NAME}: this folder holds a GPTQ run with other calibration settings or data (differs "
                f"in: {', '.join(_calibration_diff(man.identity['calibration'], identity['calibration']))}); use a new "
                f"--output folder, or remove this one to start over")
        if diff == ["source_digest"] and not man.source_samples:
            raise OutputDirError(  # the digest covered sampled data before the samples were recorded per shard
                f"{out / MANIFEST_NAME}: this folder holds a run of an earlier glmq, which identified the source "
                f"otherwise; finish it with that glmq, or remove this folder to start over")
        raise OutputDirError(
            f"{out / MANIFEST_NAME}: this folder holds a glmq run of a different source/recipe/settings/calibration "
            f"(differs in: {'; '.join(_diff_lines(man.identity, identity))}); use a new --output folder, or remove this "
            f"one to start over"
        )
    # a shard whose data sample changed (e.g. downloaded again after a corrupt weight): its files are converted again,
    # as those of a shard whose time moved; every shard changed: another model of this layout (a fine-tune)
    resampled = sorted(s for s, h in man.source_samples.items() if s in samples and samples[s] != h)
    if resampled and len(resampled) == len(samples) > 1:
        raise OutputDirError(
            f"{out / MANIFEST_NAME}: this folder holds a glmq run of another source: the data of every source shard "
            f"differs from that run's (the same config.json and headers: another model of this layout, e.g. a "
            f"fine-tune); use a new --output folder, or remove this one to start over")
    finished = man.complete  # (a finished run's times are beside its manifest: manifest.SOURCE_TIMES_NAME)
    recorded = man.source_mtime_ns or (manifest.load_source_times(out) if finished else {})
    changed = changed_shards(recorded, times)
    gptq = plan.recipe.spec.method is Method.GPTQ
    if resampled and gptq:
        raise OutputDirError(
            f"{plan.source.path(resampled[0])}: its data differs from the GPTQ run's in {out} (a sample of its bytes"
            f"{_in_all(resampled)}): the layers calibrated so far rest on its old contents; use a new --output "
            f"folder, or remove this one to start over")
    if changed and gptq:
        raise OutputDirError(_changed_under_gptq(out, plan, changed, finished))
    for shard, (was, now) in changed.items():
        log.warning("%s: modified since the %s in %s (its modification time moved from %s to %s); the output files "
                    "read from it are converted again", plan.source.path(shard),
                    "run that finished" if finished else "interrupted run began", out, _when(was), _when(now))
    for shard in resampled:
        if shard not in changed:
            log.warning("%s: its data differs from the run's in %s (a sample of its bytes); the output files read "
                        "from it are converted again", plan.source.path(shard), out)
    redo_shards = set(changed) | set(resampled)
    if man.complete and redo_shards:  # a finished checkpoint is about to be taken apart for the new data: not for bad
        _refuse_corrupt_shards(plan, out, sorted(redo_shards))  # data, which would fail the run after the deletes
    fragments = man.absorb_fragments(out)  # records of the ranks of an interrupted distributed run
    with _writing_into(out):
        for p in existing:  # half-written files of the interrupted run
            if p.name.endswith(TMP_SUFFIX):
                p.unlink()
    planned = {f.name: f for f in plan.files}
    kept, redo = {}, []
    for name, rec in man.files.items():
        path = out / name
        if name not in planned:  # an edited manifest (the plan's file names are in its identity): never delete by it
            log.warning("%s: records %r, which this run does not write; the record is dropped", out / MANIFEST_NAME,
                        name)
            continue
        if planned[name].source_shards() & redo_shards:
            redo.append(path)
            continue
        try:
            sums = file_tensor_checksums(path) if _planned_header(path, planned[name]) else None
        except (CheckpointError, OSError):
            sums = None
        # a record written before the fast checksum gets it here, from the bytes its sha256 just verified
        ok = sums is not None and all(rec.get(CHECKSUM_KEYS[a], sums[a]) == sums[a] for a in (SHA256, XXH3_128))
        if ok:
            kept[name] = {**rec, CHECKSUM_KEYS[XXH3_128]: sums[XXH3_128]}
        else:
            log.warning("%s: recorded as finished but does not check out; converting it again", path)
            redo.append(path)
    man.files = kept
    man.complete = man.complete and len(kept) == len(plan.files)
    man.source_mtime_ns = {} if man.complete else times  # the times of the shards this run reads
    man.source_samples = samples
    with _writing_into(out):
        if len(kept) < len(plan.files):  # a finished folder being repaired is no checkpoint until its end again
            for name in ("config.json", INDEX_NAME):
                (out / name).unlink(missing_ok=True)
        for path in redo:
            path.unlink(missing_ok=True)
        man.save(out)
    for p in fragments:  # now in the manifest
        manifest.remove(out, p.name)
    return man


_ABSENT = object()


def _differing(old: dict, new: dict) -> list:
    """The keys whose values differ, a key one side lacks included (also where the other holds None)."""
    return sorted((k for k in old.keys() | new.keys() if old.get(k, _ABSENT) != new.get(k, _ABSENT)), key=str)


def _diff_lines(old: dict, new: dict) -> list[str]:
    """What differs between two run identities, a dict's keys one by one with their values where short (`recipe.name:
    'int4-w4a16' then, 'mine' now`; a key one side lacks: `absent`), so that a user sees which setting to put back;
    digests and lists by name alone."""
    def value(v) -> str | None:
        text = "absent" if v is _ABSENT else repr(v)
        return text if (v is None or v is _ABSENT or isinstance(v, (str, int, float))) and len(text) <= 40 else None

    out = []
    for k in _differing(old, new):
        a, b = old.get(k, _ABSENT), new.get(k, _ABSENT)
        subs = [(f"{k}.{s}", a.get(s, _ABSENT), b.get(s, _ABSENT)) for s in _differing(a, b)] \
            if isinstance(a, dict) and isinstance(b, dict) else [(k, a, b)]
        for name, x, y in subs:
            then, now = value(x), value(y)
            out.append(f"{name}: {then} then, {now} now" if then is not None and now is not None else name)
    return out


def _calibration_diff(old: dict, new: dict) -> list[str]:
    """The calibration keys that differ, a setting by its name (`settings.seed`)."""
    out = []
    for k in _differing(old, new):
        a, b = old.get(k), new.get(k)
        out += ([f"{k}.{s}" for s in _differing(a, b)] if isinstance(a, dict) and isinstance(b, dict) else [k])
    return out


def changed_shards(recorded: dict[str, int], times: dict[str, int | None]) -> dict[str, tuple[int, int | None]]:
    """Source shards whose modification time moved since it was `recorded`: shard -> (then, now).

    The run's identity covers the source's config, headers and sizes, and the manifest a sample of every shard's
    data, not every byte (reading the whole source again to resume would cost as much as converting it); a shard edited in place
    elsewhere between a crash and the resume would have left files of its old contents beside files of its new.
    The time is the check for that. A finished run keeps its times beside its manifest (manifest.SOURCE_TIMES_NAME);
    a folder of glmq before that records none."""
    # (a recorded name the source does not have was hand-edited in: the source's shard names are in the identity)
    return {s: (t, times[s]) for s, t in sorted(recorded.items()) if s in times and times[s] != t}


def _when(ns: int | None) -> str:
    if ns is None:
        return "(missing)"
    try:
        return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, OSError, ValueError):  # beyond the platform's dates
        return f"{_seconds(ns)} s since 1970"


def _seconds(ns: int) -> str:
    """`ns` as the exact decimal seconds `touch -d @S.N` reads (its sign applies to the whole: -1 ns is -0.000000001)."""
    s, frac = divmod(abs(ns), 10**9)
    return f"{'-' if ns < 0 else ''}{s}.{frac:09d}"


def _in_all(changed: dict | list) -> str:
    return f"; {len(changed)} source shards in all" if len(changed) > 1 else ""


def moved_during_run(plan: Plan, out: Path) -> str | None:
    """The error if a source shard's modification time moved while this run read the source (checked before the index
    and config.json are written): its files may hold a mix of old and new contents. The manifest keeps the times the
    run started with, so the next run converts those files again (RTN) or asks (GPTQ)."""
    moved = changed_shards(plan.source.shard_mtime_ns, shard_mtimes(plan.source))
    if not moved:
        return None
    shard, (was, now) = next(iter(moved.items()))
    again = ("run the same command again: it converts the files read from it again" if plan.recipe.spec.method is
             Method.RTN else "run the same command again and it says how to resume")
    return (f"{plan.source.path(shard)}: modified while this run read the source (its modification time moved from "
            f"{_when(was)} to {_when(now)}{_in_all(moved)}); no index or config.json was written to {out}; once the "
            f"source stays unchanged, {again}")


def _changed_under_gptq(out: Path, plan: Plan, changed: dict[str, tuple[int, int | None]], finished: bool = False
                        ) -> str:
    """The refusal of a GPTQ resume over a changed source shard: each calibrated layer's input came from every layer
    before it, so the files of that shard are not all that would have to be redone, and a shard that was only copied
    (its times not kept) is not worth hours of calibration: the user says which it is."""
    first, (was, now) = next(iter(changed.items()))
    if len(changed) <= 3:
        restore = "; ".join(f"touch -m -d @{_seconds(t)} {shlex.quote(str(plan.source.path(s)))}"
                            for s, (t, _) in changed.items())
    else:  # e.g. a whole source copied: one command for every shard, from the times the manifest keeps
        times = out / (manifest.SOURCE_TIMES_NAME if finished else MANIFEST_NAME)
        code = (f"import json, os; r = {json.dumps(str(plan.source.root))}; [os.utime(os.path.join(r, s), ns=(t, t)) "
                f"for s, t in json.load(open({json.dumps(str(times))}))[\"source_mtime_ns\"].items()]")
        restore = f"python3 -c {shlex.quote(code)}"
    if finished:
        return (f"{plan.source.path(first)}: modified since the GPTQ run that finished in {out} (its modification "
                f"time moved from {_when(was)} to {_when(now)}{_in_all(changed)}); that checkpoint, left as it is, "
                f"was calibrated on its old contents. If its contents changed, convert into a new --output folder. If "
                f"they did not (the source was copied without its file times; cp -a and rsync -a keep them), restore "
                f"the times and run the same command again: {restore}")
    return (f"{plan.source.path(first)}: modified since the interrupted GPTQ run in {out} began (its modification "
            f"time moved from {_when(was)} to {_when(now)}{_in_all(changed)}); the layers calibrated so far may rest "
            f"on its old contents. If its contents changed, use a new --output folder or remove this one to start "
            f"over. If they did not (the source was copied without its file times; cp -a and rsync -a keep them), "
            f"restore the times and run the same command again to resume: {restore}")


def _planned_header(path: Path, f: OutFile) -> bool:
    """Whether `path` starts with the header glmq writes for `f` (names, dtypes, shapes, offsets): the tensor
    checksums cover the data only, so a file whose header was edited or written otherwise would pass them."""
    head, _ = layout([o for it in f.items for o in it.outputs], PT_METADATA)
    try:
        with open(path, "rb") as fh:
            return fh.read(len(head)) == head
    except FileNotFoundError:
        return False


class FileBook:
    """Where finished output files are recorded: the manifest itself (single process), or this rank's
    manifest fragment (distributed; rank 0 merges every rank's `files` at the end)."""

    def __init__(self, out: Path, man: Manifest, world=None):
        self.out = out
        self.book = man if world is None else Manifest(man.identity)
        self.name = MANIFEST_NAME if world is None else fragment_name(world.rank)
        self._lock = threading.Lock()
        if world is not None:  # the fragment's identity first; its records go to its journal
            self.book.save(out, self.name)

    @property
    def files(self) -> dict[str, dict]:
        return self.book.files

    def record(self, f: OutFile, size: int, hashes: dict[str, str], fast: dict[str, str], header: str) -> None:
        """Called from the commit thread once `f` is renamed into place: its tensors' sha256 and xxh3-128, and its
        header's xxh3-128."""
        with self._lock:
            self.book.append(self.out, f.name, {"source_shard": f.source_shard, "bytes": size,
                                                CHECKSUM_KEYS[SHA256]: hashes, CHECKSUM_KEYS[XXH3_128]: fast,
                                                HEADER_KEY: header}, self.name)


def _exact(module: str) -> str:
    """An ignore/target entry matching exactly one module name (anchored regex: SGLang reads a bare name as a
    substring, formats.md §3)."""
    return f"re:^{module.replace('.', chr(92) + '.')}$"


def _member_patterns(names: set[str], every: set[str]) -> list[str]:
    """Ignore (or target) entries matching exactly `names` among `every` module: one `re:^model\\.layers\\.\\d+\\.<path>$` for a
    path whose modules in all layers are in `names` (e.g. every `self_attn.q_a_proj`), else the modules one by one."""
    def path(m: str) -> str:
        return re.sub(r"^model\.layers\.\d+\.", "", m)
    members = defaultdict(set)
    for m in every:
        members[path(m)].add(m)
    out = []
    for suffix in sorted({path(m) for m in names}):
        if members[suffix] <= names and suffix not in members[suffix]:  # in every layer, and inside the layers
            out.append(f"re:^model\\.layers\\.\\d+\\.{re.escape(suffix)}$")
        else:
            out += sorted(_exact(m) for m in members[suffix] & names)
    return out


def _fused_layers(actions: dict) -> tuple[set[str], set[str]]:
    """(fused layers whose parts are all kept FP8, every fused layer whose parts are all present): the names vLLM
    builds them under, e.g. `model.layers.3.self_attn.qkv_proj` from its q/k/v_proj."""
    kept, every = set(), set()
    # (routed experts excepted: loaders build a layer's experts as one FusedMoE, not as gate_up_proj layers)
    for parent in {m.rpartition(".")[0] for m in actions if not EXPERT_MODULE.match(m)}:
        for parts, fused in FUSED_NAMES.items():
            acts = [actions.get(f"{parent}.{p}") for p in parts]
            if all(a is not None for a in acts):
                names = {f"{parent}.{x}" for x in (fused, *FUSED_ALIASES.get(fused, ()))}  # vLLM's, SGLang's
                every |= names
                if all(a is Action.KEEP_FP8 for a in acts):
                    kept |= names
    return kept, every


def config_request(plan: Plan) -> dict:
    """What the compressed-tensors config depends on: spec, ignore and keep lists, every Linear module.

    Ignore is applied before any config group by compressed-tensors, vLLM and SGLang, so it must not match a module
    kept FP8 (keep_fp8): a class with kept members is not ignored by its class pattern; its members that stay BF16
    (demoted fused partners, BF16 in the source) get entries of their own instead (`_member_patterns`)."""
    present = {it.cls for it in plan.items if it.cls in LINEAR_CLASSES and it.name.endswith(".weight")}
    unquantized = present - set(plan.recipe.targets)
    actions = plan.linear_modules()
    classes = {it.module: it.cls for it in plan.items if it.module in actions}
    kept_classes = {classes[m] for m, a in actions.items() if a is Action.KEEP_FP8}
    ignore = ignore_list(unquantized - kept_classes) + _member_patterns(
        {m for m, a in actions.items() if classes[m] in kept_classes and a not in (Action.QUANTIZE, Action.KEEP_FP8)},
        set(actions))
    # per path across the layers where it can (GLM-5: ~10 entries, not ~550 exact names, which loaders match one by
    # one against every module with `re.match`, past its 512-pattern cache)
    keep = _member_patterns({m for m, a in actions.items() if a is Action.KEEP_FP8}, set(actions))
    # and the fused layers loaders build from kept parts (qkv_proj, gate_up_proj), by their own names: vLLM and SGLang
    # match a fused layer's class name against "Linear" (group_0's target) before its parts' names (FUSED_NAMES)
    fused_kept, fused_all = _fused_layers(actions)
    keep += _member_patterns(fused_kept, fused_all)
    spec = {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(plan.recipe.spec).items()}
    modules = {m: a.value for m, a in actions.items()}
    # a compressed-tensors source's FP8 KV-cache scheme goes with its k_scale / v_scale tensors, which are copied
    kv = (plan.source.config.get("quantization_config") or {}).get("kv_cache_scheme")
    req = {"spec": spec, "ignore": ignore, "keep": keep, "modules": modules,
           "kv_cache_scheme": kv if isinstance(kv, dict) else None}
    if keep and plan.source.block:  # the kept blocks' size, stored as the source's (not always 128x128)
        req["fp8_block"] = list(plan.source.block)
    return req


CONFIG_TIMEOUT_S = 600  # a GLM-5 keep_fp8 config takes ~5 s; the child's import ~10 s on a busy machine


class ConfigJob:
    """Builds the quantization_config in a child process while the conversion runs (see
    `glmq.quantize.config_child` for why, and for the child the CLI starts before anything else)."""

    def __init__(self, plan: Plan, own_session: bool = False):
        # own_session (distributed runs): torchrun starts each rank in its own session, and Linux's
        # autogroup scheduler shares CPU fairly between sessions; inside rank 0's session this child's
        # import (seconds of CPU) came out of rank 0's share alone and made it the slowest rank.
        self.proc = config_child.take(own_session)
        self.peak_rss: int | None = None
        self.request = json.dumps(config_request(plan))

    def result(self) -> dict:
        """The config the child built.

        Raises:
            ConfigChildError (a ValueError: the CLI prints it on one line): the child failed, was killed or did not
                answer in CONFIG_TIMEOUT_S. The converted files are recorded by then, so the same command resumes.
        """
        again = "; the converted files are kept: run the same command again to write the config (it resumes)"
        try:
            out, err = self.proc.communicate(self.request, timeout=CONFIG_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            config_child.kill(self.proc)
            raise config_child.ConfigChildError(f"the child building the compressed-tensors config did not answer in "
                                                f"{CONFIG_TIMEOUT_S} s{again}") from None
        code = self.proc.returncode
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"failed (exit code {code})"
            raise config_child.ConfigChildError(f"the child building the compressed-tensors config {how}{again}"
                                                + (f":\n{err[-3000:]}" if err else ""))
        doc = json.loads(out)
        self.peak_rss = doc.pop(config_child.PEAK_KEY, None)  # the report shows it beside the run's own
        return doc

    def cancel(self) -> None:
        config_child.kill(self.proc)


def output_config(plan: Plan, quantization_config: dict) -> dict:
    """The source config with its quantization_config replaced by the compressed-tensors one."""
    cfg = {k: v for k, v in plan.source.config.items() if k != "quantization_config"}
    cfg["quantization_config"] = quantization_config
    return cfg


def finish_checkpoint(plan: Plan, out: Path, man: Manifest, quantization_config: dict) -> None:
    """Side files, then the index, then config.json (the file that makes the folder a checkpoint)."""
    for name in plan.source.side_files:  # fsynced like the shards: config.json must not outlive an empty tokenizer
        with replaced_atomically(out / name) as tmp, open(plan.source.root / name, "rb") as fi, open(tmp, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
    # the times this run started with; a rerun that found every file finished keeps the file, or, in a folder of a glmq
    # before it, records the times it found
    times = man.source_mtime_ns or ({} if (out / manifest.SOURCE_TIMES_NAME).exists() else plan.source.shard_mtime_ns)
    if times:
        manifest.save_source_times(out, times)
    weight_map = {o.name: f.name for f in plan.files for it in f.items for o in it.outputs}
    index = {"metadata": {"total_size": sum(f.nbytes for f in plan.files)}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    atomic_write_text(out / "config.json", json.dumps(output_config(plan, quantization_config), indent=2) + "\n")
    man.complete = True
    man.source_mtime_ns = {}  # a finished manifest holds nothing time-dependent (its times: the file just saved)
    try:
        man.save(out)
    except BaseException:  # (a full disk): no config.json beside an incomplete manifest, a folder vLLM would load,
        try:                           # unless the complete one is in place (the journal's removal failed)
            done = (saved := Manifest.load(out)) is not None and saved.complete
        except Exception:
            done = False
        if not done:
            (out / "config.json").unlink(missing_ok=True)
        raise
