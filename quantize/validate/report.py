"""The report: one `CheckResult` per check, the verdict, the terminal table and the JSON form."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class CannotValidate(Exception):
    """The checks could not run (exit code 2): not a checkpoint folder, no CUDA, unreadable source."""


class BeingWritten(CannotValidate):
    """A glmq process is still writing the folder (it holds the folder's lock): no checkpoint yet, whatever it holds."""


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class Finding:
    """One problem, as a line naming the tensor (and shard) and the rule with its numbers."""

    message: str
    tensor: str | None = None
    shard: str | None = None
    value: float | None = None  # how bad, for ordering the worst offenders (larger is worse)


@dataclass
class CheckResult:
    name: str
    checked: int = 0
    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    skipped: str | None = None  # why the check did not run

    @property
    def status(self) -> Status:
        if self.failures:
            return Status.FAIL
        if self.skipped is not None:
            return Status.SKIP
        return Status.WARN if self.warnings else Status.PASS

    def fail(self, message: str, tensor=None, shard=None, value=None) -> None:
        self.failures.append(Finding(message, tensor, shard, value))

    def warn(self, message: str, tensor=None, shard=None) -> None:
        self.warnings.append(Finding(message, tensor, shard))

    def worst(self, n: int) -> list[Finding]:
        return sorted(self.failures, key=lambda f: -(f.value or 0.0))[:n]

    def to_dict(self) -> dict:
        return {"status": self.status.value, "checked": self.checked, "failed": len(self.failures),
                "failures": [_row(f) for f in self.worst(len(self.failures))],
                "warnings": [_row(f) for f in self.warnings], "skipped": self.skipped, "details": self.details}


def _row(f: Finding) -> dict:
    return {k: v for k, v in vars(f).items() if v is not None}


@dataclass
class Report:
    checkpoint: str
    settings: dict
    checks: dict[str, CheckResult]
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)  # phases in seconds (driver.validate), for the benchmark

    @property
    def valid(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks.values())

    @property
    def exit_code(self) -> int:
        return 0 if self.valid else 1

    def to_dict(self) -> dict:
        """The JSON form; non-finite numbers (a NaN scale's `value`, a non-finite matmul's error) as the strings
        "inf", "-inf", "nan": `json.dumps` writes them as Infinity/NaN, which is not JSON (RFC 8259) and which
        strict parsers (JavaScript's, Go's) reject, in exactly the reports of failed checks."""
        return _finite({"checkpoint": self.checkpoint, "valid": self.valid, "exit_code": self.exit_code,
                        "seconds": round(self.seconds, 3), "settings": self.settings, "timings": self.timings,
                        "checks": {k: c.to_dict() for k, c in self.checks.items()}})


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf", "-inf", "nan"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def format_report(rep: Report, worst: int = 5) -> str:
    """The terminal table: one row per check, then the worst offenders of each failing check."""
    s = rep.settings
    lines = [f"glmq validate {rep.checkpoint}: {s['shards']} shards, {s['tensors']} tensors, "
             f"{s['quantized_modules']} quantized modules, tp {s['tp']}, {rep.seconds:.1f} s",
             f"{'check':10s} {'result':6s} {'checked':>8s} {'failed':>7s}  details"]
    for name, c in rep.checks.items():
        lines.append(f"{name:10s} {c.status.value:6s} {c.checked:8d} {len(c.failures):7d}  {_summary(c)}")
    if (src := rep.checks.get("source")) is not None and src.details.get("method") == "gptq" and (
            per_layer := src.details.get("per_layer")):  # issue 4: GPTQ's reconstruction error, reported per layer
        some = (s.get("sample") or 0) < 1
        lines.append("  source: GPTQ relative error ||w_q - w_src|| / ||w_src||, the worst " + ("sampled " if some else "")
                     + f"module of each layer ({len(per_layer)} layer(s)" + ("; --sample 1 for every module" if some
                                                                              else "") + "):")
        items = [f"{k} {v:.4f}" for k, v in per_layer.items()]
        lines += ["    " + ", ".join(items[i:i + 8]) for i in range(0, len(items), 8)]
    for name, c in rep.checks.items():
        for f in c.worst(worst):
            lines.append(f"  {name}: {f.message}")
        if len(c.failures) > worst:
            lines.append(f"  {name}: ... and {len(c.failures) - worst} more (--json for all)")
        lines += [f"  {name} (warning): {w.message}" for w in c.warnings[:worst]]
    lines.append(f"verdict: {'VALID' if rep.valid else 'INVALID'} (exit {rep.exit_code})")
    return "\n".join(lines)


def _summary(c: CheckResult) -> str:
    d = c.details
    if c.skipped:
        return c.skipped
    if c.name == "serving":
        rows = sorted(d["classes"].items())
        return "; ".join(f"{cls} {r['modules'] - r['failed']}/{r['modules']} ok" for cls, r in rows)
    if c.name == "numerics" and d.get("worst"):
        w = d["worst"][0]
        return (f"{d['sampled']}/{d['quantized']} sampled via {','.join(d['paths'])}; worst rel err {w['rel_err']:.2e} "
                f"(bound {max(d['bounds']):g}) {w['module']}")
    if c.name == "source" and (d.get("worst") or d.get("rtn_in_gptq")):
        parts = []
        if d.get("worst"):
            w = d["worst"][0]
            unit = f"steps, bound {d['bound_steps']:.4f}" if d["method"] != "gptq" else "relative, GPTQ: reported only"
            parts.append(f"{d['compared']} weights ({d['method']}); worst {w['error']:.4f} {unit} {w['module']}")
        if r := d.get("rtn_in_gptq"):
            parts.append(f"{r['compared']} round-to-nearest (MTP layer, fallbacks): worst {r['worst'][0]['error']:.4f} "
                         f"steps, bound {d['bound_steps']:.4f} {r['worst'][0]['module']}")
        return "; ".join(parts)
    if c.name == "integrity" and d.get("checksums"):
        return "; ".join(f"{algo} of {n} shard(s)" for algo, n in d["checksums"].items())
    if c.name == "index" and "total_bytes" in d:
        return f"{d['total_bytes']} bytes of tensors"
    return ""
