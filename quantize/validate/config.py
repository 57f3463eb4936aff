"""quantization_config: parsed without compressed-tensors, then checked with it; group lookup."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

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


_WHERE = "config.json: quantization_config"  # how messages name the config's keys


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
    notes: list[tuple[str, object, object]] = field(default_factory=list)  # (key, as stored, as read): `_lax`


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
    top_format = qc.get("format") if isinstance(qc.get("format"), str) else None
    notes: list[tuple[str, object, object]] = []
    groups = _parse_groups(qc.get("config_groups") or {}, top_format, problems, notes)
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(p, str) for p in ignore)):
        problems.append("quantization_config.ignore is not a list of strings")
        ignore = []
    ignore = _valid_patterns(ignore, f"{_WHERE}.ignore", problems)
    return QuantConfig(qc, groups, ignore, problems, notes)


def _lax(args: dict, key: str, kind: type, where: str, notes: list):
    """`args[key]` as pydantic's lax mode, which compressed-tensors' QuantizationArgs uses, reads it (as vLLM and
    SGLang do): "4" or 4.0 for num_bits is 4, "false" for symmetric is false. A value it converts is taken as converted
    and noted (`check_config` warns, or fails where compressed-tensors' own validators refuse it after all, as 0.19
    does a string group_size); one it refuses is returned unchanged (the checks then name it)."""
    value = args.get(key)
    if value is None or type(value) is kind:
        return value
    from pydantic import TypeAdapter, ValidationError  # compressed-tensors' own dependency; only on this rare path

    try:
        got = TypeAdapter(kind).validate_python(value)
    except ValidationError:
        return value
    notes.append((f"{where}.{key}", value, got))
    return got


def _valid_patterns(patterns: list[str], where: str, problems: list[str]) -> list[str]:
    """`patterns` without the `re:` entries that do not compile, each reported (vLLM and compressed-tensors
    `re.match` them at load and stop with re.error; matching them here raised it as a traceback)."""
    out = []
    for p in patterns:
        try:
            if p.startswith("re:"):
                re.compile(p.removeprefix("re:"))
            out.append(p)
        except re.error as e:
            problems.append(f"{where} entry {p!r} is not a valid regex ({e}); loaders stop at it: fix config.json")
    return out


# actorder values compressed-tensors added later as aliases (llm-compressor's GPTQ writes "static" by default); the
# releases before them parse only "group" and "weight" (formats.md §2d)
_ACTORDER_ALIASES = {"static": "weight", "dynamic": "group"}


def check_config(q: QuantConfig) -> CheckResult:
    """The parse's problems, plus compressed-tensors' own parse and the keys older releases reject."""
    groups = q.qc.get("config_groups") or {}
    groups = groups if isinstance(groups, dict) else {}  # the parse reported it
    res = CheckResult("config", checked=len(groups))
    for msg in q.problems:
        res.fail(msg)
    if not q.qc:
        return res
    ct = _ct()
    try:
        ct.QuantizationConfig.model_validate(q.qc)
        parsed = True
    except (ValueError, TypeError) as e:
        parsed = False
        res.fail(f"quantization_config does not parse with compressed-tensors {ct.CT_VERSION}: "
                 + " | ".join(str(e).splitlines()[:3]))
    for key, value, got in q.notes:
        kind = "boolean" if isinstance(got, bool) else "integer"
        if parsed:
            res.warn(f"{key} is {value!r}, not a JSON {kind}: compressed-tensors {ct.CT_VERSION} (so vLLM and SGLang) "
                     f"reads it as {json.dumps(got)}, as this check does; write {json.dumps(got)}")
        else:
            res.fail(f"{key} is {value!r}, not a JSON {kind}, and compressed-tensors {ct.CT_VERSION} refuses the "
                     f"config (above); write {json.dumps(got)}")
    for gname, g in groups.items():
        if not isinstance(g, dict):
            continue  # the parse reported it
        for key in sorted(set(g) - set(ct._SCHEME_KEYS)):
            res.fail(f"config_groups.{gname}.{key}: a scheme key older compressed-tensors releases reject "
                     f"(extra=forbid)")
        for role in ("weights", "input_activations", "output_activations"):
            args = g.get(role) or {}
            if not isinstance(args, dict):
                if role != "weights":  # the parse reported weights
                    res.fail(f"{_WHERE}.config_groups.{gname}.{role} is {args!r:.60}, not a mapping of quantization "
                             f"args (or null); fix config.json")
                continue
            for key in sorted(set(args) - set(ct._ARGS_KEYS)):
                res.fail(f"config_groups.{gname}.{role}.{key}: compressed-tensors < 0.13 rejects this key "
                         f"(QuantizationArgs is extra=forbid; vLLM/SGLang validate with the CT they ship); remove it")
            if (order := args.get("actorder")) in _ACTORDER_ALIASES:
                res.fail(f"config_groups.{gname}.{role}.actorder is {order!r}: an alias of "
                         f"{_ACTORDER_ALIASES[order]!r} that older compressed-tensors releases reject (their "
                         f"ActivationOrdering has only 'group' and 'weight'; vLLM/SGLang validate with the CT they "
                         f"ship); write {_ACTORDER_ALIASES[order]!r}" + (" or null (it changes calibration only)"
                                                                           if order == "static" else ""))
    return res


def _parse_groups(groups: dict, top_format: str | None, problems: list[str], notes: list) -> list[Group]:
    """The groups glmq validates; what is malformed (a type a loader would reject) goes to `problems`."""
    if not isinstance(groups, dict):
        problems.append(f"{_WHERE}.config_groups is {groups!r:.60}, not a mapping of group name -> scheme; fix "
                        f"config.json")
        return []
    out = []
    for gname, g in groups.items():
        where = f"{_WHERE}.config_groups.{gname}"
        if not isinstance(g, dict):
            problems.append(f"{where} is {g!r:.60}, not a scheme mapping (targets, weights, format); fix config.json")
            continue
        w, fmt = g.get("weights") or {}, g.get("format") or top_format
        if not isinstance(w, dict):
            problems.append(f"{where}.weights is {w!r:.60}, not a mapping of quantization args (num_bits, type, "
                            f"strategy, group_size, ...); fix config.json")
            continue
        raw_targets = g.get("targets") or []
        if not (isinstance(raw_targets, list) and all(isinstance(t, str) for t in raw_targets)):
            problems.append(f"{where}.targets is {raw_targets!r:.60}, not a list of strings; fix config.json")
            continue
        targets = tuple(_valid_patterns(raw_targets, f"{where}.targets", problems))
        if w.get("type") == "float" and fmt == "float-quantized":
            bs = w.get("block_structure")
            bits = 8 if "num_bits" not in w else _lax(w, "num_bits", int, f"{where}.weights", notes)
            if not (bs is None or (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs))
                    ) or type(bits) is not int:
                problems.append(f"{where}.weights: num_bits {bits!r}, block_structure {bs!r}: not an FP8 layout "
                                f"(an integer num_bits; block_structure null or [rows, cols]); fix config.json")
                continue
            out.append(Group(gname, targets, "float", bits, block=tuple(bs) if bs else None))
            continue
        if w.get("type") != "int" or fmt != "pack-quantized":
            problems.append(f"config_groups.{gname}: weights type {w.get('type')!r} with format {fmt!r}; glmq "
                            f"validates INT pack-quantized and FP8 float-quantized groups")
            continue
        strategy = w.get("strategy")
        gs, bits = (_lax(w, key, int, f"{where}.weights", notes) for key in ("group_size", "num_bits"))
        if type(bits) is not int or bits not in (4, 8) or strategy not in ("group", "channel") or (
                strategy == "group" and not (type(gs) is int and gs > 0)):
            problems.append(f"config_groups.{gname}.weights: num_bits {bits!r}, strategy {strategy!r}, "
                            f"group_size {gs!r}: not a pack-quantized layout (4/8 bits; group with a size, or channel)")
            continue
        symmetric = True if "symmetric" not in w else _lax(w, "symmetric", bool, f"{where}.weights", notes)
        if type(symmetric) is not bool:  # (bool("x") is True: never read it with Python's bool)
            problems.append(f"{where}.weights.symmetric is {symmetric!r}, not a boolean compressed-tensors (so vLLM "
                            f"and SGLang) can read; write true or false")
        # vLLM's WNA16 (Marlin) schemes take static weights and no activation quantization (formats.md §3a)
        if g.get("input_activations") is not None:
            problems.append(f"{where}.input_activations is {g['input_activations']!r:.80}: a W4A16 group quantizes "
                            f"no activations, and vLLM picks no WNA16 (Marlin) scheme for it; set it to null")
        if "dynamic" in w and _lax(w, "dynamic", bool, f"{where}.weights", notes) is not False:
            problems.append(f"{where}.weights.dynamic is {w.get('dynamic')!r}: pack-quantized weights are static, and "
                            f"vLLM picks no WNA16 (Marlin) scheme for dynamic ones; set it to false")
        out.append(Group(gname, targets, "int", bits, gs if strategy == "group" else None,
                         bool(symmetric), w.get("actorder")))
    return out


def _named_group(module: str, groups: list[Group]) -> Group | None:
    """The first group with a name/regex target matching `module` (compressed-tensors' matcher, as loaders use)."""
    for g in groups:
        names = [t for t in g.targets if t != "Linear"]
        if names and _ct().is_ignored(module, names):
            return g
    return None


def scheme_of(g: Group) -> Group:
    """What a loader builds from `g`: the group less its name and targets (two groups of one scheme load alike) and
    an actorder other than "group" (only "group" stores a weight_g_idx; "weight" reorders columns before packing)."""
    return replace(g, name="", targets=(), actorder="group" if g.actorder == "group" else None)


def scheme_label(g: Group) -> str:
    """`FP8`, or `INT4, group 128` (`, asymmetric` and `, actorder group` where so) for messages."""
    if g.kind == "float":
        return "FP8"
    return (f"INT{g.num_bits}, group {g.group_size or 'channel'}" + ("" if g.symmetric else ", asymmetric")
            + (", actorder group" if g.actorder == "group" else ""))


def group_for(module: str, groups: list[Group]) -> Group | None:
    """The group that governs `module`, by vLLM's priority: a name/regex target, then "Linear"."""
    return _named_group(module, groups) or next((g for g in groups if "Linear" in g.targets), None)


def float_group_for(module: str, groups: list[Group]) -> Group | None:
    """The first float-quantized (FP8) group with a target matching `module`: the one its stored FP8 weight loads by."""
    return next((g for g in groups if g.kind == "float" and _ct().is_ignored(module, list(g.targets))), None)


# The classes vLLM builds fused layers as (formats.md §3a), whose names its `find_matched_target` matches targets
# against (a case-insensitive substring, or a `re:` regex) when no target matched the layer's own name.
# (SGLang's fused_qkv_a_proj_with_mqa: a ReplicatedLinear)
FUSED_CLASSES = {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
                 "fused_qkv_a_proj": "DeepSeekV2FusedQkvAProjLinear", "fused_qkv_a_proj_with_mqa": "ReplicatedLinear"}


def fused_layer_group(fused: str, groups: list[Group]) -> Group | None:
    """The group vLLM gives the fused layer `fused` (e.g. `model.layers.3.self_attn.qkv_proj`, built from its parts
    q/k/v_proj; vllm/model_executor/layers/quantization/compressed_tensors/utils.py `find_matched_target`): a target
    matching its own name, else one matching its class name (every fused class name contains "Linear"), else None:
    its parts' names decide, as `group_for` reads them. SGLang's matcher is a copy of vLLM's."""
    if (g := _named_group(fused, groups)) is not None:
        return g
    cls = FUSED_CLASSES.get(fused.rpartition(".")[2], "")
    for g in groups:
        for t in g.targets:
            if re.match(t[3:], cls) if t.startswith("re:") else t.lower() in cls.lower():
                return g
    return None
