"""What recording finished files costs at GLM-5 scale: the manifest rewritten after every output file (glmq up to
session 29) against one journal line per file and one rewrite at the end (`Manifest.append`, then `save`).

The plan is GLM-5.2's, from its config.json alone (`estimate.virtual_source`; 500 MB source shards assumed), so the
output file count and every tensor name are the real ones; the checksums are random hex of the real lengths. Both
ways write through the same `Manifest` code into a fresh folder, fsync included, alternating over the rounds.

    python -m glmq.scripts.bench_manifest [--rounds 3] [--work DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from glmq import recipes
from glmq.formats.manifest import MANIFEST_NAME, Manifest
from glmq.quantize.estimate import virtual_source
from glmq.quantize.plan import make_plan
from glmq.scripts.bench_rtn import positive_int

CONFIG = Path(__file__).resolve().parent / "configs" / "glm-5.2-config.json"


def records(recipe: str) -> list[tuple[str, dict]]:
    """(output file, its manifest record) for every output file of the plan, as FileBook records them."""
    plan = make_plan(virtual_source(CONFIG), recipes.load(recipe))
    out = []
    for f in plan.files:
        names = [o.name for it in f.items for o in it.outputs]
        out.append((f.name, {"source_shard": f.source_shard, "bytes": f.nbytes,
                             "tensors": {n: secrets.token_hex(32) for n in names},
                             "xxh3_128": {n: secrets.token_hex(16) for n in names}}))
    return out


def rewrite(folder: Path, recs: list[tuple[str, dict]]) -> None:
    man = Manifest({"bench": True})
    man.save(folder)
    for name, rec in recs:
        man.files[name] = rec
        man.save(folder)


def journal(folder: Path, recs: list[tuple[str, dict]]) -> None:
    man = Manifest({"bench": True})
    man.save(folder)
    for name, rec in recs:
        man.append(folder, name, rec)
    man.save(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--recipe", default="int4-w4a16")
    ap.add_argument("--work", default=None, help="folder for the manifests (default: a temporary one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    recs = records(a.recipe)
    work = Path(a.work or tempfile.mkdtemp(prefix="glmq-bench-manifest-"))
    times: dict[str, list[float]] = {"rewrite": [], "journal": []}
    size = 0
    try:
        for r in range(a.rounds):
            for way, fn in (("rewrite", rewrite), ("journal", journal)) if r % 2 == 0 else (("journal", journal),
                                                                                           ("rewrite", rewrite)):
                folder = work / way
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                t = time.perf_counter()
                fn(folder, recs)
                times[way].append(time.perf_counter() - t)
                size = (folder / MANIFEST_NAME).stat().st_size
    finally:  # a failed or interrupted run leaves no ~44 MB manifests in the temporary folder
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"recipe": a.recipe, "output_files": len(recs), "tensors": sum(len(r["tensors"]) for _, r in recs),
           "manifest_bytes": size, "rounds": a.rounds, "seconds": times, "median_s": med,
           "rewrite_over_journal": med["rewrite"] / med["journal"]}
    print(f"GLM-5.2 {a.recipe}: {res['output_files']} output files, {res['tensors']} tensors, manifest "
          f"{size / 1e6:.1f} MB; median over {a.rounds} rounds: rewrite per file {med['rewrite']:.2f} s, journal "
          f"{med['journal']:.2f} s ({res['rewrite_over_journal']:.1f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
