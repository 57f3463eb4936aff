"""The run manifest: what an interrupted conversion had finished, with a checksum of every tensor.

Lives in the output folder as `glmq_manifest.json` and stays there (`glmq validate` recomputes the
checksums). Once the run is finished it holds nothing time-dependent, so an interrupted-and-resumed run
writes the same bytes as an uninterrupted one; timings go to `glmq_report.json`. While it is unfinished it
also holds each source shard's modification time (`source_mtime_ns`), the resume's check for a shard edited
in place; finished or not, a digest of a sample of each shard's data (`source_samples`), the check for a shard
downloaded again (its files are converted again) or another model of the same layout (refused). A finished run keeps
its times beside it instead, in `.glmq-source-times.json` (`SOURCE_TIMES_NAME`, a local working file: never uploaded),
so that a rerun into the finished folder also sees a shard edited in place outside the sampled bytes.

Each finished output file is recorded as
    {"source_shard": ..., "bytes": file size,
     "tensors": {tensor: sha256 hex},        # every glmq manifest
     "xxh3_128": {tensor: xxh3-128 hex},     # since the fast checksum was added; older records lack it
     "header_xxh3_128": xxh3-128 hex}        # of the file's header (session 37 on; older records lack it)
of the same bytes (formats/safetensors_io.CHECKSUMS). `checksum_record(rec, algorithm)` reads either; the header's
(safetensors_io.header_checksum) lets `glmq validate` see a header edited in place, which no tensor checksum covers.

While a run goes on, each finished file's record is appended as one line to a journal beside the manifest
(`glmq_manifest.journal.jsonl`, fsynced; `Manifest.append`) instead of rewriting the whole manifest: with a
checksum per tensor, GLM-5's manifest grows to ~44 MB, and rewriting it after each of ~140 output files cost
~50 s of JSON and fsync (BENCHMARKS.md, "Manifest journal"). `Manifest.load` folds the journal in (a line
torn by a crash is the last one, and is dropped: its file is converted again); `save` writes the whole
manifest and then drops the journal, whose records it now holds.

In a distributed run (quantize/dist.py) only rank 0 writes `glmq_manifest.json`; each rank records the
files it finishes in its own fragment, `glmq_manifest.rankNNNNN.json` (same format, its files only, with
its own journal), so no file has two writers. Records are per output file, not per rank: the next run,
whatever its world size, folds every fragment into the manifest (`absorb_fragments`) before deciding
what to redo, and a finished run leaves no fragment behind.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glmq.formats.safetensors_io import SHA256, XXH3_128, atomic_write_text

MANIFEST_NAME = "glmq_manifest.json"
REPORT_NAME = "glmq_report.json"
FRAGMENT_GLOB = "glmq_manifest.rank*.json"
SOURCE_TIMES_NAME = ".glmq-source-times.json"  # a finished run's source shard times (module docstring)


# the key of each checksum's {tensor: hex} record in a file record ("tensors" predates the fast checksum)
CHECKSUM_KEYS = {SHA256: "tensors", XXH3_128: XXH3_128}
HEADER_KEY = "header_xxh3_128"  # a file record's checksum of the file's header


def checksum_record(rec: dict, algorithm: str) -> dict[str, str] | None:
    """A file record's {tensor: hex} for `algorithm`, or None if the record predates it."""
    return rec.get(CHECKSUM_KEYS[algorithm])


def journal_name(name: str) -> str:
    """The journal of manifest `name` (not matched by FRAGMENT_GLOB)."""
    return name.removesuffix(".json") + ".journal.jsonl"


def remove(out_dir: Path, name: str) -> None:
    """Delete manifest `name` and its journal.

    The journal goes first: a run killed in between leaves the manifest, which the next run finds (FRAGMENT_GLOB)
    and removes; a journal left without its manifest would be matched by nothing and stay in the checkpoint."""
    (out_dir / journal_name(name)).unlink(missing_ok=True)
    (out_dir / name).unlink(missing_ok=True)


def save_source_times(out_dir: Path, times: dict[str, int | None]) -> None:
    """Record a finished run's source shard modification times (`SOURCE_TIMES_NAME`) beside its manifest."""
    atomic_write_text(out_dir / SOURCE_TIMES_NAME,
                      json.dumps({"source_mtime_ns": dict(sorted(times.items()))}, indent=1) + "\n")


def load_source_times(out_dir: Path) -> dict[str, int]:
    """A finished run's recorded source shard times; {} where none are (glmq before them, or an unreadable file:
    nothing to compare, as before)."""
    try:
        times = json.loads((out_dir / SOURCE_TIMES_NAME).read_text()).get("source_mtime_ns")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(times, dict):
        return {}
    return {s: t for s, t in times.items() if isinstance(s, str) and type(t) is int}


def fragment_name(rank: int) -> str:
    """The file in which rank `rank` of a distributed run records the output files it finished."""
    return f"glmq_manifest.rank{rank:05d}.json"


@dataclass
class Manifest:
    identity: dict  # source digest, recipe, shard size limit, planned file names: what must match to resume
    files: dict[str, dict] = field(default_factory=dict)  # name -> file record (module docstring)
    complete: bool = False
    format_version: int = 1
    # source shard -> modification time (ns) when this run opened it, kept while the run is unfinished: a resume
    # converts again the files read from a shard whose time moved (quantize/output.py). Left out of a finished
    # manifest, which holds nothing time-dependent.
    source_mtime_ns: dict[str, int] = field(default_factory=dict)
    # source shard -> sha256 hex of a sample of its data (Source.shard_samples), kept finished or not: a resume
    # converts again the files of a shard whose data changed, and refuses a folder whose every shard changed
    source_samples: dict[str, str] = field(default_factory=dict)

    def save(self, out_dir: Path, name: str = MANIFEST_NAME) -> None:
        """Write the whole manifest (temporary name, fsync, rename), then drop the journal it now holds."""
        d = asdict(self)
        for key in ("source_mtime_ns", "source_samples"):
            if not d[key]:
                del d[key]
        atomic_write_text(out_dir / name, json.dumps(d, indent=1, sort_keys=True) + "\n")
        (out_dir / journal_name(name)).unlink(missing_ok=True)

    def append(self, out_dir: Path, file: str, record: dict, name: str = MANIFEST_NAME) -> None:
        """Record finished output file `file` here and, durably, in the journal of manifest `name` (saved before)."""
        self.files[file] = record
        with open(out_dir / journal_name(name), "a") as f:
            f.write(json.dumps({"file": file, "record": record}, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def absorb_fragments(self, out_dir: Path) -> list[Path]:
        """Add the file records of every rank fragment in `out_dir` (any world size) to this manifest.

        Returns:
            the fragment paths, to delete once this manifest is saved.
        Raises:
            ValueError: a fragment belongs to another run (different identity).
        """
        paths = sorted(out_dir.glob(FRAGMENT_GLOB))
        for p in paths:
            frag = Manifest.load(out_dir, p.name)
            if frag.identity != self.identity:
                raise ValueError(f"{p}: a rank record of a different glmq run than {out_dir / MANIFEST_NAME}; "
                                 f"use a new --output folder, or remove this one to start over")
            self.files.update(frag.files)
        return paths

    @classmethod
    def load(cls, out_dir: Path, name: str = MANIFEST_NAME) -> "Manifest | None":
        p = out_dir / name
        if not p.exists():
            return None
        try:
            d = json.loads(p.read_text())
            if not isinstance(d, dict):
                raise TypeError(f"it holds {type(d).__name__}, not an object")
            complete = d.get("complete", False)
            if not isinstance(complete, bool):  # bool("false") is True: a hand-edited record read as finished
                raise TypeError(f"'complete' is {complete!r}, not true or false")
            times = d.get("source_mtime_ns", {})
            if not (isinstance(times, dict) and all(type(t) is int and abs(t) < 2**63 for t in times.values())):
                raise TypeError(f"'source_mtime_ns' is {str(times)[:80]}, not shard names and integers")
            samples = d.get("source_samples", {})
            if not (isinstance(samples, dict) and all(isinstance(h, str) for h in samples.values())):
                raise TypeError(f"'source_samples' is {str(samples)[:80]}, not shard names and hex digests")
            man = cls(d["identity"], d.get("files", {}), complete, int(d.get("format_version", 1)), times, samples)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: unreadable glmq manifest ({e}); remove the output folder and start again") from e
        journal = out_dir / journal_name(name)
        if journal.exists():
            lines = journal.read_text().split("\n")
            for i, line in enumerate(lines):
                try:
                    entry = json.loads(line)
                    man.files[entry["file"]] = entry["record"]
                except (ValueError, KeyError, TypeError) as e:
                    if i < len(lines) - 1 and any(x.strip() for x in lines[i + 1:]):  # only the last may be torn
                        raise ValueError(f"{journal}: unreadable line {i + 1} ({e}); remove the output folder and "
                                         f"start again") from e
        return man


def fingerprint(folder: Path) -> str:
    """A sha256 hex that names a checkpoint's weights, recorded by `glmq eval` for each model and compared by `glmq
    upload`, so that a card never shows another checkpoint's figures as this one's (a folder quantized again, or
    another folder of the same name).

    With a glmq manifest: its per-tensor sha256 checksums (which `glmq validate` checks against the data, as upload
    does), so the figure follows the tensors, not the folder's name or its config.json. Without one (a source, a
    checkpoint glmq did not write): config.json and each shard's name and header checksum, which cost a few KB of
    reads per shard but do not see data rewritten in place under the same header."""
    import hashlib

    from glmq.formats.safetensors_io import header_checksum

    folder = Path(folder)
    man = None
    try:
        man = Manifest.load(folder)
    except ValueError:  # unreadable: fingerprinted as a checkpoint without one
        pass
    if man is not None and man.files and all(checksum_record(r, SHA256) for r in man.files.values()):
        what = {"tensors": {f: checksum_record(r, SHA256) for f, r in sorted(man.files.items())}}
    else:
        config = folder / "config.json"
        what = {"config": config.read_text(errors="replace") if config.is_file() else None,
                "headers": {p.name: header_checksum(p) for p in sorted(folder.glob("*.safetensors"))}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
