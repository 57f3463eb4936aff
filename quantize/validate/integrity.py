"""The integrity check: recomputed tensor checksums against glmq_manifest.json (pure).

Each shard is checked with one checksum (formats/manifest.py records both of every tensor): xxh3-128 by
default, sha256 with `sha256=True` (`glmq validate --sha256`) or when the shard's record predates
xxh3-128 (`checksum_choice`).
"""

from __future__ import annotations

from collections import Counter

from glmq.formats.manifest import HEADER_KEY, MANIFEST_NAME, Manifest, checksum_record
from glmq.formats.safetensors_io import SHA256, XXH3_128
from glmq.quantize.validate.report import CheckResult


def checksum_choice(manifest: Manifest | None, sha256: bool = False) -> dict[str, str]:
    """shard -> the checksum to recompute: xxh3-128 where the manifest records it, unless `sha256`.
    Shards the manifest does not record are not listed (the scan then hashes them with sha256)."""
    if manifest is None:
        return {}
    return {shard: SHA256 if sha256 or checksum_record(rec, XXH3_128) is None else XXH3_128
            for shard, rec in manifest.files.items()}


def check_integrity(manifest: Manifest | None, error: str | None, hashes: dict[str, dict[str, str]],
                    sizes: dict[str, int], algorithms: dict[str, str] | None = None,
                    headers: dict[str, str] | None = None) -> CheckResult:
    """Recomputed tensor checksums against the manifest (pure).

    Args:
        hashes: {shard: {tensor: hex}} as recomputed, with `algorithms[shard]` (default: sha256 for all).
        headers: {shard: xxh3-128 hex of its header} as recomputed (safetensors_io.header_checksum), compared where
            the manifest records one (files written since session 37).
    """
    res = CheckResult("integrity")
    algorithms = algorithms or {}
    if error:
        res.fail(error)
        return res
    if manifest is None:
        res.warn(f"no {MANIFEST_NAME}: cannot check integrity (not written by glmq, or the manifest was removed)")
        res.skipped = "no manifest"
        return res
    if not manifest.complete:
        res.fail(f"{MANIFEST_NAME}: complete is false: the conversion did not finish; re-run the same glmq quantize "
                 f"to resume")
    used: Counter = Counter()
    for shard, rec in sorted(manifest.files.items()):
        got = hashes.get(shard)
        if got is None:
            res.fail(f"{shard}: recorded in {MANIFEST_NAME} but not read (missing, unreadable or not in the index)",
                     shard=shard)
            continue
        if rec.get("bytes") is not None and sizes.get(shard) != rec["bytes"]:
            res.fail(f"{shard}: {sizes.get(shard)} bytes, the manifest recorded {rec['bytes']}", shard=shard)
        if headers is not None and rec.get(HEADER_KEY) and headers.get(shard) != rec[HEADER_KEY]:
            res.fail(f"{shard}: its header (tensor names, dtypes, shapes, offsets) changed after glmq wrote it: "
                     f"xxh3-128 {str(headers.get(shard))[:16]} != manifest {rec[HEADER_KEY][:16]}; re-download or "
                     f"re-convert this shard", shard=shard)
        algo = algorithms.get(shard, SHA256)
        want = checksum_record(rec, algo) or {}
        used[algo] += 1
        for name, digest in sorted(want.items()):
            res.checked += 1
            if name not in got:
                res.fail(f"{shard}: tensor {name} is in the manifest but not in the shard", tensor=name, shard=shard)
            elif got[name] != digest:
                also = "" if algo == SHA256 else " (glmq validate --sha256 checks the recorded sha256 instead)"
                res.fail(f"{shard}: tensor {name}: {algo} {got[name][:16]} != manifest {digest[:16]}: its bytes "
                         f"changed after glmq wrote them; re-download or re-convert this shard{also}",
                         tensor=name, shard=shard)
        for name in sorted(got.keys() - want.keys()):
            res.fail(f"{shard}: tensor {name} is not recorded in the manifest", tensor=name, shard=shard)
    for shard in sorted(hashes.keys() - manifest.files.keys()):
        res.fail(f"{shard}: not recorded in {MANIFEST_NAME}", shard=shard)
    res.details["checksums"] = dict(sorted(used.items()))  # algorithm -> shards checked with it
    return res
