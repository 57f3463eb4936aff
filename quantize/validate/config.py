"""quantization_config: parsed without compressed-tensors, then checked with it; group lookup."""

from __future__ import annotations

from dataclasses import dataclass

from glmq.quantize.validate.report import CheckResult


@dataclass(frozen=True)
class Group:
    """One config group: INT weights written pack-quantized, or FP8 blocks (mixed-precision)."""

    name: str
    targets: tuple[str, ...]
    kind: str  # "int" | "float"
    num_bits: int = 4
    group_size: int | None = None  # None: one scale per row (strategy "channel")
    symmetric: bool = True
    actorder: str | None = None
    block: tuple[int, int] | None = None  # FP8 block_structure


def _ct():
    """compressed-tensors, through the module that owns it (it takes seconds to import)."""
    from glmq.formats import compressed_tensors

    return compressed_tensors


@dataclass
class QuantConfig:
    """config.json's quantization_config, parsed without compressed-tensors (so reading can start
    while it imports); `problems` are what that parse found."""

    qc: dict
    groups: list[Group]
    ignore: list[str]
    problems: list[str]


def read_quant_config(config: dict | None, error: str | None) -> QuantConfig:
    """Parse the quantization_config (pure)."""
    if config is None:
        return QuantConfig({}, [], [], [error or "config.json is not a JSON object"])
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return QuantConfig({}, [], [], ["config.json has no quantization_config: not a quantized checkpoint"])
    expect = {"quant_method": ("compressed-tensors",), "format": ("pack-quantized", "mixed-precision"),
              "quantization_status": ("compressed",)}
    problems = [f"quantization_config.{key} is {qc.get(key)!r}, expected {' or '.join(map(repr, ok))}"
                for key, ok in expect.items() if qc.get(key) not in ok]
    groups = _parse_groups(qc.get("config_groups") or {}, qc.get("format"), problems)
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(p, str) for p in ignore)):
        problems.append("quantization_config.ignore is not a list of strings")
        ignore = []
    return QuantConfig(qc, groups, ignore, problems)


def check_config(q: QuantConfig) -> CheckResult:
    """The parse's problems, plus compressed-tensors' own parse and the keys older releases reject."""
    res = CheckResult("config", checked=len(q.qc.get("config_groups") or {}))
    for msg in q.problems:
        res.fail(msg)
    if not q.qc:
        return res
    ct = _ct()
    try:
        ct.QuantizationConfig.model_validate(q.qc)
    except (ValueError, TypeError) as e:
        res.fail(f"quantization_config does not parse with compressed-tensors {ct.CT_VERSION}: "
                 + " | ".join(str(e).splitlines()[:3]))
    for gname, g in (q.qc.get("config_groups") or {}).items():
        for key in sorted(set(g) - set(ct._SCHEME_KEYS)):
            res.fail(f"config_groups.{gname}.{key}: a scheme key older compressed-tensors releases reject "
                     f"(extra=forbid)")
        for role in ("weights", "input_activations", "output_activations"):
            for key in sorted(set(g.get(role) or {}) - set(ct._ARGS_KEYS)):
                res.fail(f"config_groups.{gname}.{role}.{key}: compressed-tensors < 0.13 rejects this key "
                         f"(QuantizationArgs is extra=forbid; vLLM/SGLang validate with the CT they ship); remove it")
    return res


def _parse_groups(groups: dict, top_format: str | None, problems: list[str]) -> list[Group]:
    out = []
    for gname, g in groups.items():
        w, fmt = g.get("weights") or {}, g.get("format") or top_format
        targets = tuple(g.get("targets") or ())
        if w.get("type") == "float" and fmt == "float-quantized":
            bs = w.get("block_structure")
            out.append(Group(gname, targets, "float", int(w.get("num_bits", 8)), block=tuple(bs) if bs else None))
            continue
        if w.get("type") != "int" or fmt != "pack-quantized":
            problems.append(f"config_groups.{gname}: weights type {w.get('type')!r} with format {fmt!r}; glmq "
                            f"validates INT pack-quantized and FP8 float-quantized groups")
            continue
        strategy, gs = w.get("strategy"), w.get("group_size")
        if w.get("num_bits") not in (4, 8) or strategy not in ("group", "channel") or (
                strategy == "group" and not (isinstance(gs, int) and gs > 0)):
            problems.append(f"config_groups.{gname}.weights: num_bits {w.get('num_bits')}, strategy {strategy!r}, "
                            f"group_size {gs}: not a pack-quantized layout (4/8 bits; group with a size, or channel)")
            continue
        out.append(Group(gname, targets, "int", int(w["num_bits"]), gs if strategy == "group" else None,
                         bool(w.get("symmetric", True)), w.get("actorder")))
    return out


def group_for(module: str, groups: list[Group]) -> Group | None:
    """The group that governs `module`, by vLLM's priority: a name/regex target, then "Linear"."""
    for g in groups:
        names = [t for t in g.targets if t != "Linear"]
        if names and _ct().is_ignored(module, names):  # compressed-tensors' matcher, as loaders use
            return g
    return next((g for g in groups if "Linear" in g.targets), None)
