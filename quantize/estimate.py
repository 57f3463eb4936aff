"""`glmq plan`: predicted output size per tensor class and peak memory, before anything is converted.

From a checkpoint folder the numbers come from the real plan (headers only). From a bare
config.json (no weights) the tensor list is derived from the config with the same layout tables the
fixture generator uses, and shards are assumed to be `ASSUMED_SHARD_BYTES` (GLM-5-FP8's ~5.3 GB).
"""

from __future__ import annotations

import json
from pathlib import Path

from glmq.formats.families import family_for
from glmq.formats.safetensors_io import DTYPE_NAMES, TensorEntry
from glmq.formats.source import Source, detect_format
from glmq.quantize.plan import make_plan
from glmq.quantize.stream import CHUNK_BYTES
from glmq.recipes import load as load_recipe

ASSUMED_SHARD_BYTES = int(5.3e9)
# Measured resident set of a glmq process (Python, torch, numba) before it reads any tensor.
BASELINE_RSS = 450 * 10**6
# Row blocks in flight: two prefetched, one being converted, one being written; each at most CHUNK_BYTES
# of source plus the converted copy (at most 2x for FP8 -> BF16) and float32 temporaries.
IN_FLIGHT = 4 * 3 * CHUNK_BYTES


def from_plan(plan) -> dict:
    largest = max(plan.source.shard_bytes.values())
    return summarize(plan, largest, assumed=False)


def from_config_file(config_path: Path, recipe: str) -> dict:
    """Plan a conversion from config.json alone (e.g. GLM-5.2's real dimensions)."""
    from glmq.formats import fixtures

    config = json.loads(Path(config_path).read_text())
    family = family_for(config, str(config_path))
    fmt, block = detect_format(config, Path(config_path))
    layout = fixtures.tensor_layout(config, fmt.value if fmt.value != "dense" else "bf16", family=family.name)
    entries, pos, shard, shard_bytes, shards = {}, 0, 0, {}, []
    for unit in layout:
        for st in unit:
            numel = 1
            for d in st.shape:
                numel *= d
            nbytes = numel * st.dtype.itemsize
            if pos + nbytes > ASSUMED_SHARD_BYTES and pos:
                shard, pos = shard + 1, 0
            name = f"virtual-{shard:05d}"
            entries[st.name] = TensorEntry(st.name, name, DTYPE_NAMES[st.dtype], tuple(st.shape), pos, pos + nbytes)
            pos += nbytes
            shard_bytes[name] = shard_bytes.get(name, 0) + nbytes
    shards = sorted(shard_bytes)
    src = Source(Path(config_path).parent, config, family, fmt, entries, shards, shard_bytes, block, [], "config-only")
    plan = make_plan(src, load_recipe(recipe))
    return summarize(plan, ASSUMED_SHARD_BYTES, assumed=True)


def summarize(plan, largest_shard: int, assumed: bool) -> dict:
    rows = plan.by_class()
    return {
        "source": str(plan.source.root),
        "family": plan.source.family.name,
        "source_format": plan.source.fmt.value,
        "recipe": plan.recipe.name,
        "tensors": len(plan.items),
        "bytes_in": plan.source.total_bytes,
        "bytes_out": plan.bytes_out,
        "output_files": len(plan.files),
        "by_class": rows,
        "largest_input_shard": largest_shard,
        "shards_assumed": assumed,
        "peak_rss_rtn": BASELINE_RSS + largest_shard + IN_FLIGHT,
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:9.2f} GB"


def format_summary(s: dict) -> str:
    lines = [f"{s['family']} ({s['source_format']}) with recipe {s['recipe']}: {s['tensors']} tensors",
             f"{'class:action':32s} {'tensors':>8s} {'in':>12s} {'out':>12s}"]
    for key, row in s["by_class"].items():
        lines.append(f"{key:32s} {row['tensors']:8d} {_gb(row['bytes_in']):>12s} {_gb(row['bytes_out']):>12s}")
    lines.append(f"{'total':32s} {s['tensors']:8d} {_gb(s['bytes_in']):>12s} {_gb(s['bytes_out']):>12s}"
                 f"   ({s['bytes_out'] / s['bytes_in']:.3f}x, {s['output_files']} output files)")
    note = " (shards assumed 5.3 GB: config only)" if s["shards_assumed"] else ""
    lines.append(f"peak RSS, RTN: ~{s['peak_rss_rtn'] / 1e9:.2f} GB = largest input shard {s['largest_input_shard'] / 1e9:.2f} GB"
                 f"{note} + {IN_FLIGHT / 1e9:.2f} GB row blocks in flight + {BASELINE_RSS / 1e9:.2f} GB process")
    return "\n".join(lines)
