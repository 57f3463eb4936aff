"""The run manifest: what an interrupted conversion had finished, with a checksum of every tensor.

Lives in the output folder as `glmq_manifest.json` and stays there (`glmq validate` recomputes the
checksums). It holds nothing time-dependent, so an interrupted-and-resumed run writes the same bytes
as an uninterrupted one; timings go to `glmq_report.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glmq.formats.safetensors_io import atomic_write_text

MANIFEST_NAME = "glmq_manifest.json"
REPORT_NAME = "glmq_report.json"


@dataclass
class Manifest:
    identity: dict  # source digest, recipe, shard size limit, planned file names: what must match to resume
    files: dict[str, dict] = field(default_factory=dict)  # name -> {"source_shard", "bytes", "tensors": {name: sha256}}
    complete: bool = False
    format_version: int = 1

    def save(self, out_dir: Path) -> None:
        atomic_write_text(out_dir / MANIFEST_NAME, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, out_dir: Path) -> "Manifest | None":
        p = out_dir / MANIFEST_NAME
        if not p.exists():
            return None
        try:
            d = json.loads(p.read_text())
            return cls(d["identity"], d.get("files", {}), bool(d.get("complete")), int(d.get("format_version", 1)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: unreadable glmq manifest ({e}); remove the output folder and start again") from e
