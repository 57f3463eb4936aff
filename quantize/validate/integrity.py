"""The integrity check: recomputed tensor sha256s against glmq_manifest.json (pure)."""

from __future__ import annotations

from glmq.formats.manifest import MANIFEST_NAME, Manifest
from glmq.quantize.validate.report import CheckResult


def check_integrity(manifest: Manifest | None, error: str | None, hashes: dict[str, dict[str, str]],
                    sizes: dict[str, int]) -> CheckResult:
    """Recomputed tensor sha256s against the manifest (pure)."""
    res = CheckResult("integrity")
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
    for shard, rec in sorted(manifest.files.items()):
        got = hashes.get(shard)
        if got is None:
            res.fail(f"{shard}: recorded in {MANIFEST_NAME} but not read (missing, unreadable or not in the index)",
                     shard=shard)
            continue
        if rec.get("bytes") is not None and sizes.get(shard) != rec["bytes"]:
            res.fail(f"{shard}: {sizes.get(shard)} bytes, the manifest recorded {rec['bytes']}", shard=shard)
        want = rec.get("tensors", {})
        for name, digest in sorted(want.items()):
            res.checked += 1
            if name not in got:
                res.fail(f"{shard}: tensor {name} is in the manifest but not in the shard", tensor=name, shard=shard)
            elif got[name] != digest:
                res.fail(f"{shard}: tensor {name}: sha256 {got[name][:16]} != manifest {digest[:16]}: its bytes "
                         f"changed after glmq wrote them; re-download or re-convert this shard",
                         tensor=name, shard=shard)
        for name in sorted(got.keys() - want.keys()):
            res.fail(f"{shard}: tensor {name} is not recorded in the manifest", tensor=name, shard=shard)
    for shard in sorted(hashes.keys() - manifest.files.keys()):
        res.fail(f"{shard}: not recorded in {MANIFEST_NAME}", shard=shard)
    return res
