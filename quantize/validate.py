"""`glmq validate`: the CI gate for a converted (compressed-tensors pack-quantized) checkpoint.

Seven checks, each a function that returns a `CheckResult` (I/O stays at the edges:
`load_checkpoint` reads config, index and shard headers; `scan_shards` reads the tensor bytes;
`compare_with_source` reads the source):
  config     quantization_config parses with the installed compressed-tensors and has only the keys
             every release vLLM/SGLang may ship accepts (formats.md §2d).
  structure  every tensor the config promises, with its dtype and shape (formats.md §2a); nothing
             left over (weight_scale_inv, FP8, orphan companions, a dense weight next to its packed
             one); every expert of every MoE layer; `ignore` agrees with what is stored.
  index      index <-> shard headers, total_size, duplicates.
  serving    vLLM Marlin / Marlin-MoE shape rules at a tensor-parallel degree (formats.md §3a), per
             tensor class; failures make the checkpoint invalid (`serving=False` skips the check).
  numerics   scales finite and > 0 (all modules); for a sampled fraction, the W4A16 kernel (Triton on
             CUDA, `kernels/reference.py` on CPU) against a float64 matmul of the dequantized weight.
  source     (with a source) dequantized weights within the RTN bound of the source weights (GPTQ:
             relative error reported per layer), unquantized tensors unchanged (compared in bf16).
  integrity  each tensor's sha256 against `glmq_manifest.json` (no manifest: a warning).
Cost: after the headers, every shard is read once, front to back, by a small thread pool; each
tensor's bytes are hashed, and those the numerics need are decoded from the same buffer and checked
as soon as their module is complete, so memory stays at one module per thread and nothing is read
twice. The floor is sha256 (~1.5 GB/s per core). On the CPU the numerics cost ~25 ns per weight
(two dequantizations: float64 and the kernels' float32 reference), far more than reading 0.5 byte:
use --device cuda or --sample for large checkpoints. A source adds one pass of `iter_dense` over
the source and a second read of the compared output tensors.

Exit codes (`Report.exit_code`, `CannotValidate`): 0 valid, 1 invalid, 2 could not run.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import random
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmq.formats.families import FUSED_PARTNERS, LINEAR_CLASSES, TensorClass, classify, layer_index, mtp_layers
from glmq.formats.manifest import MANIFEST_NAME, REPORT_NAME, Manifest
from glmq.formats.safetensors_io import DTYPES, CheckpointError, TensorEntry, read_header
from glmq.formats.source import INDEX_NAME, SINGLE_NAME

INT_LEAVES = ("weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx")
COMPANIONS = ("weight_scale", "weight_scale_inv", "input_scale", *INT_LEAVES)
LEAF_DTYPES = {"weight_packed": ("I32",), "weight_scale": ("BF16", "F16", "F32"), "weight_shape": ("I64", "I32"),
               "weight_zero_point": ("I32",), "weight_g_idx": ("I32",)}
# Kernel output vs float64 reference, max|y - ref| / max|ref|, by the output dtype. The Triton kernel
# writes bf16 (bf16 activations): its rounding alone reaches u * max|ref| (u = 2^-8), fp32 accumulation
# adds ~sqrt(K) * 2^-24, so 1e-2 = 2.56 u. The CPU reference path returns float32 (error ~1e-7):
# 1e-4. Any layout mistake (nibble order, group, scale row) gives errors of order 1.
REL_ERR_BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
# RTN |w_q - w_src| in scale steps. Symmetric: 1/2 + 1/16 (tests/test_stream.py
# `assert_within_half_step`: two bf16 roundings of 1/32 step each). Asymmetric: the range is
# bf16(bf16(max - min) / 15), up to 2 u = 2^-7 short of max - min, i.e. 15 * 2^-7 < 1/8 step at the
# clamped end; the zero point's rounding is the 1/2 (measured worst: 0.616 steps).
RTN_BOUND_STEPS = {True: 0.5 + 1 / 16, False: 0.5 + 1 / 8}
ACT_ROWS = 16  # activation rows per numerics check (the CUDA path also runs row 0 alone: GEMV kernel)
READ_CHUNK = 1 << 20  # hashed while still in cache: a 64 MB buffer made read + sha256 1.6x slower
# Weight elements per row block when dequantizing on the CPU: ~8 MB float64 temporaries that the
# allocator reuses, instead of fresh 100 MB ones per expert (page faults cost more than the math).
DEQUANT_BLOCK = 1 << 20
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
# vLLM's parallel layout per module leaf (deepseek_v2.py / glm4_moe.py): q_a_proj + kv_a_proj_with_mqa
# are one replicated layer (`DeepSeekV2FusedQkvAProjLinear`, disable_tp=True); other leaves: replicated.
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
                             "lm_head", "head"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
# Layers vLLM builds without a quant_config (deepseek_v2.py), so a packed weight there cannot load.
NO_QUANT_LAYERS = {"gate": "vLLM's GateLinear router takes no quant_config",
                   "wk": "vLLM fuses indexer.wk + weights_proj with quant_config=None",
                   "weights_proj": "vLLM fuses indexer.wk + weights_proj with quant_config=None"}


class CannotValidate(Exception):
    """The checks could not run (exit code 2): not a checkpoint folder, no CUDA, unreadable source."""


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

    @property
    def valid(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks.values())

    @property
    def exit_code(self) -> int:
        return 0 if self.valid else 1

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "valid": self.valid, "exit_code": self.exit_code,
                "seconds": round(self.seconds, 3), "settings": self.settings,
                "checks": {k: c.to_dict() for k, c in self.checks.items()}}


# ----------------------------------------------------------------------------------------- loading
@dataclass
class Checkpoint:
    """What the headers say: config, index, each readable shard's tensors (no tensor data)."""

    root: Path
    config: dict | None  # None: config.json is not valid JSON (the config check says why)
    config_error: str | None
    weight_map: dict[str, str]
    shards: dict[str, dict[str, TensorEntry]]
    data_start: dict[str, int]
    index: CheckResult  # problems met while loading, completed by `check_index`
    manifest: Manifest | None
    manifest_error: str | None = None

    def entries(self) -> dict[str, TensorEntry]:
        return {n: e for es in self.shards.values() for n, e in es.items()}


def load_checkpoint(root: Path) -> Checkpoint:
    """Read config.json, the index, every shard header and the manifest.

    Raises:
        CannotValidate: `root` is not a folder or has no config.json.
    """
    if not root.is_dir():
        raise CannotValidate(f"{root}: not a directory; glmq validate takes a checkpoint folder")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CannotValidate(f"{cfg_path}: not found, so {root} is not a checkpoint (glmq writes config.json "
                             f"last: a conversion that did not finish has none)")
    config, config_error = None, None
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as e:
        config_error = f"{cfg_path}: not valid JSON ({e})"
    except OSError as e:
        raise CannotValidate(f"{cfg_path}: unreadable ({e})") from e
    index = CheckResult("index")
    weight_map, total = _read_index(root, index)
    shards, starts = {}, {}
    for shard in sorted(set(weight_map.values())):
        try:
            shards[shard], _, starts[shard] = read_header(root / shard)
        except FileNotFoundError:
            index.fail(f"{shard}: listed in {INDEX_NAME} but missing from the folder", shard=shard)
        except (CheckpointError, OSError) as e:
            index.fail(str(e), shard=shard)
    check_index(weight_map, total, shards, index)
    listed = set(weight_map.values())
    for name in sorted(p.name for p in root.glob("*.safetensors") if p.name not in listed):
        index.warn(f"{name}: a safetensors file the index does not reference (loaders skip it)", shard=name)
    ck = Checkpoint(root, config, config_error, weight_map, shards, starts, index, None)
    try:
        ck.manifest = Manifest.load(root)
    except ValueError as e:
        ck.manifest_error = str(e)
    return ck


def _read_index(root: Path, res: CheckResult) -> tuple[dict[str, str], int | None]:
    path = root / INDEX_NAME
    if not path.exists():
        if (root / SINGLE_NAME).exists():
            try:
                return {n: SINGLE_NAME for n in read_header(root / SINGLE_NAME)[0]}, None
            except CheckpointError as e:
                res.fail(str(e), shard=SINGLE_NAME)
                return {}, None
        res.fail(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME}: the checkpoint stores no tensors")
        return {}, None
    dups: list[str] = []

    def pairs(items):  # json keeps the last of duplicate keys silently; loaders would too
        d = {}
        for k, v in items:
            if k in d:
                dups.append(k)
            d[k] = v
        return d

    try:
        idx = json.loads(path.read_text(), object_pairs_hook=pairs)
    except ValueError as e:
        res.fail(f"{INDEX_NAME}: not valid JSON ({e})")
        return {}, None
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        res.fail(f"{INDEX_NAME}: weight_map is not a mapping of tensor name -> shard file")
        return {}, None
    for name in dups:
        res.fail(f"{INDEX_NAME}: tensor {name} is listed more than once", tensor=name)
    total = (idx.get("metadata") or {}).get("total_size")
    return wm, total


def check_index(weight_map: dict[str, str], total: int | None, shards: dict[str, dict[str, TensorEntry]],
                res: CheckResult) -> CheckResult:
    """Index entries <-> shard headers, duplicates, total_size (pure; adds to `res`)."""
    res.checked = len(weight_map)
    if not weight_map and not res.failures:
        res.fail(f"{INDEX_NAME}: the weight_map lists no tensors")
    seen: dict[str, str] = {}
    for shard, entries in shards.items():
        for name in entries:
            if name in seen:
                res.fail(f"tensor {name} is stored twice, in {seen[name]} and {shard}", tensor=name, shard=shard)
            seen[name] = shard
            if weight_map.get(name) != shard:
                where = f"places it in {weight_map[name]}" if name in weight_map else "does not list it"
                res.fail(f"{shard}: holds tensor {name}, but {INDEX_NAME} {where}", tensor=name, shard=shard)
    for name, shard in weight_map.items():
        if shard in shards and name not in shards[shard]:
            res.fail(f"{INDEX_NAME}: tensor {name} is placed in {shard}, which does not hold it",
                     tensor=name, shard=shard)
    actual = sum(e.nbytes for es in shards.values() for e in es.values())
    if total is not None and total != actual:
        res.fail(f"{INDEX_NAME}: metadata.total_size is {total} but the tensors hold {actual} bytes "
                 f"({actual - total:+d})")
    res.details["total_bytes"] = actual
    return res


# ----------------------------------------------------------------------------------------- config
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


# ----------------------------------------------------------------------------------------- structure
@dataclass
class Module:
    """The tensors of one module (`model.layers.1.mlp.experts.3.down_proj`) by leaf name."""

    name: str
    cls: TensorClass
    parts: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def is_int(self) -> bool:
        p = self.parts
        return bool(set(INT_LEAVES) & p.keys()) or ("weight_scale" in p and "weight" not in p)

    @property
    def is_fp8(self) -> bool:
        return "weight" in self.parts and self.parts["weight"].dtype == "F8_E4M3"

    def shard(self) -> str | None:
        return next(iter(self.parts.values())).shard if self.parts else None


def modules_of(entries: dict[str, TensorEntry]) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for name, e in sorted(entries.items()):
        module, _, leaf = name.rpartition(".")
        mods.setdefault(module, Module(module, classify(module))).parts[leaf] = e
    return mods


def expected_shapes(n: int, k: int, g: Group) -> dict[str, tuple[int, ...]]:
    """Shapes of the pack-quantized tensors of an `[N, K]` weight (formats.md §2a)."""
    groups = 1 if g.group_size is None else -(-k // g.group_size)
    want = {"weight_packed": (n, -(-k * g.num_bits // 32)), "weight_scale": (n, groups), "weight_shape": (2,)}
    if not g.symmetric:
        want["weight_zero_point"] = (-(-n * g.num_bits // 32), groups)
    if g.actorder == "group":
        want["weight_g_idx"] = (k,)
    return want


def int_module_problems(m: Module, g: Group, shape: tuple[int, int] | None) -> list[str]:
    """What is wrong with one pack-quantized module under group `g` (pure); `shape` is weight_shape's value."""
    p, out = m.parts, []
    need = ["weight_packed", "weight_scale", "weight_shape"] + ([] if g.symmetric else ["weight_zero_point"])
    need += ["weight_g_idx"] if g.actorder == "group" else []
    out += [f"{m.name}.{leaf} is missing ({g.name} promises it)" for leaf in need if leaf not in p]
    if g.symmetric and "weight_zero_point" in p:
        out.append(f"{m.name}.weight_zero_point is stored but {g.name} is symmetric")
    if g.actorder != "group" and "weight_g_idx" in p:
        out.append(f"{m.name}.weight_g_idx is stored but {g.name} has actorder {g.actorder!r}")
    if "weight" in p:
        out.append(f"{m.name}.weight ({p['weight'].dtype}) is stored next to the packed weight: a leftover")
    out += [f"{m.name}.{leaf} is {p[leaf].dtype}, expected {'/'.join(ok)}"
            for leaf, ok in LEAF_DTYPES.items() if leaf in p and p[leaf].dtype not in ok]
    if shape is None:
        return out
    n, k = shape
    if g.group_size and k >= g.group_size and k % g.group_size:
        out.append(f"{m.name}: K = {k} is not a multiple of group_size {g.group_size}")
    for leaf, want in expected_shapes(n, k, g).items():
        if leaf in p and tuple(p[leaf].shape) != want:
            out.append(f"{m.name}.{leaf} has shape {list(p[leaf].shape)}, expected {list(want)} for weight_shape "
                       f"[{n}, {k}] with num_bits {g.num_bits}, group_size {g.group_size or k}")
    return out


def check_structure(modules: dict[str, Module], groups: list[Group], shapes: dict, ignore: list[str],
                    config: dict | None) -> CheckResult:
    """Promised tensors present and well-formed, nothing left over, ignore list == storage (pure)."""
    res = CheckResult("structure", checked=len(modules))
    ct = _ct()
    float_groups = [g for g in groups if g.kind == "float"]
    for m in modules.values():
        where = {"tensor": m.name, "shard": m.shard()}
        if "weight_scale_inv" in m.parts:
            res.fail(f"{m.name}.weight_scale_inv: an FP8-source scale left in a compressed-tensors checkpoint", **where)
        if m.is_int:
            g = group_for(m.name, groups) if groups else None
            if g is None or g.kind != "int":
                res.fail(f"{m.name} is stored pack-quantized but no INT config group targets it", **where)
                continue
            for msg in int_module_problems(m, g, shapes.get(m.name)):
                res.fail(msg, **where)
            hit = [p for p in ignore if ct.is_ignored(m.name, [p])]
            if hit:
                res.fail(f"{m.name} is quantized (weight_packed) but matches ignore entry {hit[0]!r}: loaders "
                         f"would build it unquantized and find no .weight", **where)
        elif m.is_fp8:
            fg = next((g for g in float_groups if ct.is_ignored(m.name, list(g.targets))), None)
            if fg is None:
                res.fail(f"{m.name}.weight is F8_E4M3 but no float-quantized config group targets it", **where)
            elif "weight_scale" not in m.parts:
                res.fail(f"{m.name}.weight_scale is missing (FP8 weight of {fg.name})", **where)
            elif fg.block and len(w8 := m.parts["weight"].shape) == 2:
                want = (-(-w8[0] // fg.block[0]), -(-w8[1] // fg.block[1]))
                if tuple(m.parts["weight_scale"].shape) != want:
                    res.fail(f"{m.name}.weight_scale has shape {list(m.parts['weight_scale'].shape)}, expected "
                             f"{list(want)} for FP8 weight {list(w8)} in {fg.block[0]}x{fg.block[1]} blocks", **where)
        else:
            stray = [leaf for leaf in m.parts if leaf in COMPANIONS and leaf != "weight_scale_inv"]
            if stray:
                res.fail(f"{m.name}.{stray[0]} belongs to no quantized weight (orphan companion)", **where)
            w = m.parts.get("weight")
            if (w is not None and m.cls in LINEAR_CLASSES and len(w.shape) == 2
                    and not any(ct.is_ignored(m.name, [p]) for p in ignore)):
                res.fail(f"{m.name}.weight is stored unquantized ({w.dtype}) but matches no ignore entry: vLLM would "
                         f"build it as INT and find no weight_packed", **where)
    _check_experts(modules, config or {}, res)
    return res


def _check_experts(modules: dict[str, Module], config: dict, res: CheckResult) -> None:
    """Every MoE layer holds all n_routed_experts x (gate, up, down)."""
    found: dict[int, set[tuple[int, str]]] = defaultdict(set)
    for name in modules:
        if (hit := _EXPERT.match(name)) is not None:
            found[int(hit[1])].add((int(hit[2]), hit[3]))
    n = config.get("n_routed_experts") or config.get("num_local_experts")
    if not isinstance(n, int):
        return
    layers = set(found)
    if isinstance(config.get("num_hidden_layers"), int):
        dense = int(config.get("first_k_dense_replace", 0) or 0)
        layers |= set(range(dense, config["num_hidden_layers"])) | set(mtp_layers(config))
    for layer in sorted(layers):
        missing = [(e, p) for e in range(n) for p in ("gate", "up", "down") if (e, p) not in found[layer]]
        if missing:
            e, p = missing[0]
            res.fail(f"model.layers.{layer}.mlp.experts: {len(missing)} of {3 * n} expert projections missing "
                     f"(config n_routed_experts = {n}), e.g. experts.{e}.{p}_proj",
                     tensor=f"model.layers.{layer}.mlp.experts")


# ----------------------------------------------------------------------------------------- serving
def dense_rules(leaf: str, n: int, k: int, tp: int, g: Group) -> list[tuple[str, str]]:
    """vLLM Marlin W4A16 rules for one dense Linear at `tp` (verify_marlin_supports_shape): (rule, numbers)."""
    col, row = leaf in COLUMN_PARALLEL, leaf in ROW_PARALLEL
    out = []
    if (col and n % tp) or (row and k % tp):
        dim, size = ("N", n) if col else ("K", k)
        out.append(("tensor-parallel split", f"{dim} = {size} is not divisible by tp = {tp}"))
        return out
    n_p, k_p = (n // tp if col else n), (k // tp if row else k)
    split = "column-parallel" if col else "row-parallel" if row else "replicated"
    if n_p % 64:
        out.append(("output_size_per_partition % 64 == 0", f"N = {n}, {split} at tp {tp}: {n_p} % 64 = {n_p % 64}"))
    if k_p % 128:
        out.append(("input_size_per_partition % 128 == 0", f"K = {k}, {split} at tp {tp}: {k_p} % 128 = {k_p % 128}"))
    gs = g.group_size
    if gs is not None and gs < k and k_p % gs:
        out.append(("input_size_per_partition % group_size == 0", f"{k_p} % {gs} = {k_p % gs}"))
    if gs is not None and gs not in (32, 64, 128):
        out.append(("group_size in {-1, 32, 64, 128}", f"group_size = {gs}"))
    return out


def moe_rules(hidden: int, inter: int, tp: int, g: Group) -> list[tuple[str, str]]:
    """vLLM check_moe_marlin_supports_layer + the Marlin-MoE/SGLang symmetric assert: (rule, numbers)."""
    gs = g.group_size or -1
    out = []
    if hidden % 128:
        out.append(("hidden_size % 128 == 0", f"hidden = {hidden}: {hidden} % 128 = {hidden % 128}"))
    if inter % tp:
        out.append(("tensor-parallel split", f"moe_intermediate = {inter} is not divisible by tp = {tp}"))
    elif (inter // tp) % max(64, gs):
        out.append(("(moe_intermediate / tp) % max(64, group_size) == 0",
                    f"{inter} / {tp} = {inter // tp}, % {max(64, gs)} = {(inter // tp) % max(64, gs)}"))
    if gs not in (-1, 32, 64, 128):
        out.append(("group_size in {-1, 32, 64, 128}", f"group_size = {gs}"))
    if not g.symmetric:
        out.append(("symmetric weights", "symmetric: false (vLLM Marlin-MoE and SGLang assert symmetric for MoE)"))
    return out


def check_serving(modules: dict[str, Module], groups: list[Group], shapes: dict, ignore: list[str], qc: dict,
                  tp: int) -> CheckResult:
    """Shapes and layout vLLM/SGLang serve at `tp`, reported per tensor class (pure)."""
    res = CheckResult("serving", details={"tp": tp, "classes": {}})
    rows: dict[str, dict] = res.details["classes"]
    quant = {n: m for n, m in modules.items() if m.is_int and shapes.get(n)}
    bad: dict[tuple[str, str], list] = {}

    def note(m: Module, rule: str, numbers: str) -> None:
        bad.setdefault((m.cls.value, rule), [m.name, numbers, 0])[2] += 1
        rows[m.cls.value]["failed"].add(m.name)

    experts: dict[int, list[Module]] = defaultdict(list)
    for name, m in quant.items():
        rows.setdefault(m.cls.value, {"modules": 0, "failed": set()})["modules"] += 1
        g = group_for(name, groups)
        if g is None:
            continue
        leaf = name.rpartition(".")[2]
        if m.cls in (TensorClass.ROUTER, TensorClass.INDEXER) and leaf in NO_QUANT_LAYERS:
            note(m, "layer takes no quantization", NO_QUANT_LAYERS[leaf])
        if m.cls is TensorClass.ROUTED_EXPERT:
            experts[layer_index(name)].append(m)
            continue
        for rule, numbers in dense_rules(leaf, *shapes[name], tp, g):
            note(m, rule, numbers)
    for layer, mods in sorted(experts.items()):
        gate = next((m for m in mods if m.name.endswith(("gate_proj", "up_proj"))), None)
        inter, hidden = shapes[gate.name] if gate else shapes[mods[0].name][::-1]
        for rule, numbers in moe_rules(hidden, inter, tp, group_for(mods[0].name, groups)):
            for m in mods:
                note(m, rule, f"layer {layer}: {numbers}")
    _check_partners(modules, res)
    for pat in (p for p in ignore if not p.startswith("re:") and p != "lm_head"):
        hit = [n for n in quant if pat.lower() in n.lower()]
        if hit:
            res.fail(f"ignore entry {pat!r} is not a regex: SGLang matches it as a case-insensitive substring and "
                     f"would leave {len(hit)} quantized module(s) (e.g. {hit[0]}) unquantized; use an anchored 're:'")
    if not any("Linear" in g.targets for g in groups if g.kind == "int"):
        res.warn("no INT group targets 'Linear': older vLLM (WNA16 Marlin-MoE) and SGLang before PR #29761 "
                 "raise KeyError")
    if quant and qc.get("format") != "pack-quantized":
        res.warn(f"top-level format {qc.get('format')!r}: older SGLang reads it for W4A16 MoE and needs "
                 f"'pack-quantized'")
    for (cls, rule), (example, numbers, count) in sorted(bad.items()):
        res.fail(f"{cls}: {rule} fails for {count} module(s), e.g. {example}: {numbers}", tensor=example, value=count)
    for cls, row in rows.items():
        row["failed"] = len(row["failed"])
        row["rules"] = [{"rule": r, "modules": c, "example": ex, "numbers": nb}
                        for (k, r), (ex, nb, c) in bad.items() if k == cls]
    res.checked = len(quant)
    return res


def _check_partners(modules: dict[str, Module], res: CheckResult) -> None:
    """Modules an engine fuses (q/k/v, gate/up, q_a/kv_a; all experts of a layer) need one scheme."""
    by_parent: dict[str, dict[str, bool]] = defaultdict(dict)
    for name, m in modules.items():
        if m.is_int or ("weight" in m.parts and m.cls in LINEAR_CLASSES):
            parent, _, leaf = name.rpartition(".")
            by_parent[parent][leaf] = m.is_int
            if (hit := _EXPERT.match(name)) is not None:
                by_parent[f"model.layers.{hit[1]}.mlp.experts"][f"{hit[2]}.{hit[3]}_proj"] = m.is_int
    for parent, leaves in sorted(by_parent.items()):
        if parent.endswith(".mlp.experts"):
            sets = [list(leaves)]
        else:
            sets = [[x for x in grp if x in leaves] for grp in FUSED_PARTNERS]
        for members in sets:
            if len({leaves[x] for x in members}) > 1:
                q = sorted(x for x in members if leaves[x])
                res.fail(f"{parent}: {len(q)} of {len(members)} fused members quantized (e.g. {q[0]}); vLLM/SGLang "
                         f"fuse them into one layer with one scheme and raise", tensor=parent)


# ----------------------------------------------------------------------------------------- numerics
def _activations(seed: int, module: str, k: int) -> torch.Tensor:
    """Deterministic bf16 `[ACT_ROWS, K]` N(0, 1) activations for one module."""
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(ACT_ROWS, k, generator=gen).to(torch.bfloat16)


def _row_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """Row ranges of about DEQUANT_BLOCK elements, starting on multiples of 8 (zero points pack 8 rows)."""
    rows = max(8, DEQUANT_BLOCK // max(k, 1) // 8 * 8)
    return [(r, min(r + rows, n)) for r in range(0, n, rows)]


def matmul_error(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                 shape: tuple[int, int], g: Group, device: str) -> tuple[float, float, str]:
    """Relative error of the W4A16 matmul against float64 `x @ dequant(W).T`.

    Args:
        x: bf16 `[M, K]` activations (CPU); packed int32 `[N, K/8]`, scale `[N, K/g]`, zp int32
            `[ceil(N/8), K/g]` or None, as stored; shape `(N, K)`; g the module's INT group.
    Returns:
        (max|y - ref| / max|ref| (inf if y is not finite), the bound for y's dtype, "triton" | "reference").
    """
    from glmq.formats.dense import dequantize_packed
    from glmq.kernels import reference

    (n, k), gs = shape, g.group_size or shape[1]
    dev = torch.device(device)
    x, packed, scale = x.to(dev), packed.to(dev), scale.to(dev)
    zp = None if zp is None else zp.to(dev)
    triton = dev.type == "cuda" and zp is None and gs in (32, 64, 128)
    x64, ref = x.double(), torch.empty(x.shape[0], n, dtype=torch.float64, device=dev)
    y = None if triton else torch.empty(x.shape[0], n, dtype=torch.float32, device=dev)
    for r0, r1 in _row_blocks(n, k) if dev.type == "cpu" else [(0, n)]:
        p, s, z = packed[r0:r1], scale[r0:r1], None if zp is None else zp[r0 // 8:-(-r1 // 8)]
        ref[:, r0:r1] = x64 @ dequantize_packed(p, s.double(), (r1 - r0, k), g.num_bits, gs, z).T
        if y is not None:  # the kernels' float32 reference: the same layout definition, no Triton
            y[:, r0:r1] = (reference.w4a16_matmul_ref(x, p, s, gs) if z is None
                           else x.float() @ reference.dequantize_packed(p, s, gs, z).T)
    if triton:
        from glmq.kernels.w4a16_dense import w4a16_matmul

        runs = [(w4a16_matmul(x, packed, scale, gs), ref),  # MMA kernel
                (w4a16_matmul(x[:1].contiguous(), packed, scale, gs), ref[:1])]  # GEMV kernel
    else:
        runs = [(y, ref)]
    err = 0.0
    for out, r in runs:
        if not torch.isfinite(out).all():
            return math.inf, REL_ERR_BOUND[out.dtype], "triton" if triton else "reference"
        err = max(err, ((out.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return err, REL_ERR_BOUND[runs[0][0].dtype], "triton" if triton else "reference"


def scale_problem(scale: torch.Tensor) -> str | None:
    """NaN/Inf or non-positive group scales (pure)."""
    bad_f = int((~torch.isfinite(scale)).sum())
    bad_p = int((scale <= 0).sum())
    if bad_f or bad_p:
        return f"{bad_f} NaN/Inf and {bad_p} zero/negative of {scale.numel()} scales"
    return None


class ModuleScan:
    """Per-module work done while the shards are read: weight_shape values, scale checks, numerics.

    `keep` names the tensors to decode; `add` receives them from the reader threads and runs the
    checks as soon as a module's tensors are all in.
    """

    def __init__(self, modules: dict[str, Module], scheme: dict[str, Group], sampled: set[str], device: str, seed: int):
        self.modules, self.scheme, self.sampled, self.device, self.seed = modules, scheme, sampled, device, seed
        self.want: dict[str, dict[str, str]] = {}
        for name, g in scheme.items():
            leaves = ("weight_shape", "weight_scale")
            leaves += ("weight_packed", "weight_zero_point") if name in sampled else ()
            self.want[name] = {leaf: f"{name}.{leaf}" for leaf in leaves if leaf in modules[name].parts}
        self.owner = {t: (m, leaf) for m, leaves in self.want.items() for leaf, t in leaves.items()}
        self.keep = set(self.owner)
        self.got: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        self.shapes: dict[str, tuple[int, int] | None] = {}
        self.numerics = CheckResult("numerics", details={"device": device, "worst": []})
        self.errors: list[tuple[str, float, float, str]] = []
        self.lock = threading.Lock()
        self.gpu = threading.Lock()  # one kernel launch at a time (shared split-K ticket buffer)

    def add(self, name: str, t: torch.Tensor) -> None:
        module, leaf = self.owner[name]
        with self.lock:
            parts = self.got[module]
            parts[leaf] = t
            done = len(parts) == len(self.want[module])
            if done:
                del self.got[module]
        if done:
            self._check(module, parts)

    def _check(self, name: str, t: dict[str, torch.Tensor]) -> None:
        m, g = self.modules[name], self.scheme[name]
        shape = _shape_value(t.get("weight_shape"))
        self.shapes[name] = shape
        shard = m.shard()
        if "weight_scale" in t and (why := scale_problem(t["weight_scale"].float())):
            with self.lock:
                self.numerics.fail(f"{name}.weight_scale: {why}", tensor=f"{name}.weight_scale", shard=shard,
                                   value=math.inf)
            return
        if name not in self.sampled or shape is None or int_module_problems(m, g, shape) or g.num_bits != 4:
            return  # structure reports the problem; int8 has no W8A16 kernel here
        x = _activations(self.seed, name, shape[1])
        try:
            with self.gpu if self.device == "cuda" else contextlib.nullcontext():
                err, bound, path = matmul_error(x, t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                                shape, g, self.device)
        except (ValueError, RuntimeError) as e:  # a layout the kernel rejects: report it, do not crash the gate
            with self.lock:
                self.numerics.fail(f"{name}: the W4A16 matmul could not run: {e}", tensor=name, shard=shard,
                                   value=math.inf)
            return
        with self.lock:
            self.errors.append((name, err, bound, path))
            if not err <= bound:
                self.numerics.fail(f"{name}: W4A16 matmul ({path}) relative error {err:.3g} > bound {bound:g} "
                                   f"(max|y - ref| / max|ref| against float64)", tensor=name, shard=shard, value=err)

    def result(self) -> CheckResult:
        res = self.numerics
        res.checked = len(self.errors)
        res.details.update(sampled=len(self.errors), quantized=len(self.scheme),
                           paths=sorted({p for *_, p in self.errors}), bounds=sorted({b for _, _, b, _ in self.errors}),
                           worst=[{"module": n, "rel_err": e}
                                  for n, e, *_ in sorted(self.errors, key=lambda r: -r[1])[:5]])
        return res


def _shape_value(t: torch.Tensor | None) -> tuple[int, int] | None:
    if t is None or t.numel() != 2 or t.is_floating_point():
        return None
    n, k = (int(v) for v in t.tolist())
    return (n, k) if n > 0 and k > 0 else None


def sample_modules(names: list[str], fraction: float, seed: int) -> set[str]:
    """A deterministic `fraction` (at least one) of `names`."""
    if fraction >= 1.0:
        return set(names)
    k = max(1, math.ceil(fraction * len(names))) if names else 0
    return set(random.Random(seed).sample(sorted(names), k))


# ----------------------------------------------------------------------------------------- reading
def scan_shards(ck: Checkpoint, keep: set[str], sink, workers: int) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Read every shard once: sha256 of each tensor; tensors in `keep` go to `sink(name, tensor)`.

    Returns:
        ({shard: {tensor: sha256 hex}}, [read errors]).
    """
    def one(shard: str) -> tuple[str, dict[str, str] | str]:
        try:
            return shard, _scan_one(ck.root / shard, ck.shards[shard], ck.data_start[shard], keep, sink)
        except OSError as e:
            return shard, f"{shard}: read failed ({e})"

    hashes, errors = {}, []
    with ThreadPoolExecutor(max(1, min(workers, len(ck.shards) or 1)), thread_name_prefix="glmq-validate") as pool:
        for shard, got in pool.map(one, sorted(ck.shards)):
            if isinstance(got, str):
                errors.append(got)
            else:
                hashes[shard] = got
    return hashes, errors


def _scan_one(path: Path, entries: dict[str, TensorEntry], start: int, keep: set[str], sink) -> dict[str, str]:
    """Hash one shard front to back; decode the kept tensors from the bytes just hashed."""
    out = {}
    big = max((e.nbytes for e in entries.values() if e.name not in keep), default=0)
    chunk = memoryview(bytearray(min(READ_CHUNK, big)))  # reused for every tensor not kept
    with open(path, "rb", buffering=0) as f:
        for e in sorted(entries.values(), key=lambda e: e.begin):
            f.seek(start + e.begin)
            if e.name in keep:
                buf = bytearray(e.nbytes)
                _read_exact(f, memoryview(buf))
                out[e.name] = hashlib.sha256(buf).hexdigest()
                t = torch.frombuffer(buf, dtype=DTYPES[e.dtype]) if e.nbytes else torch.empty(0, dtype=DTYPES[e.dtype])
                sink(e.name, t.reshape(e.shape))
                continue
            h, left = hashlib.sha256(), e.nbytes
            while left:
                view = chunk[:min(left, len(chunk))]
                _read_exact(f, view)
                h.update(view)
                left -= len(view)
            out[e.name] = h.hexdigest()
    return out


def _read_exact(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"unexpected end of file at byte {f.tell()}")
        got += n


# ----------------------------------------------------------------------------------------- integrity
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


# ----------------------------------------------------------------------------------------- source
def recipe_method(ck: Checkpoint) -> str:
    """"rtn" or "gptq" from the manifest (or glmq_report.json); "rtn" when neither says."""
    rec = (ck.manifest.identity.get("recipe") if ck.manifest else None) or {}
    if not rec and (ck.root / REPORT_NAME).exists():
        try:
            rec = json.loads((ck.root / REPORT_NAME).read_text()).get("recipe") or {}
        except ValueError:
            rec = {}
    return str(rec.get("method", "rtn"))


def weight_error(packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, shape: tuple[int, int],
                 g: Group, w_src: torch.Tensor, method: str) -> tuple[float, float | None]:
    """Stored weight vs source weight `[N, K]`: (error, bound).

    RTN: max |w_q - w_src| in scale steps, bound RTN_BOUND_STEPS. GPTQ: relative Frobenius error
    ||w_q - w_src|| / ||w_src||, no bound. Dequantization runs in float32, which is exact here:
    |q - zp| <= 2^b - 1 times a bf16 scale needs at most b + 8 significant bits.
    """
    from glmq.formats.dense import dequantize_packed

    (n, k), gs = shape, g.group_size or shape[1]
    worst, num, den = 0.0, 0.0, 0.0
    for r0, r1 in _row_blocks(n, k):
        z = None if zp is None else zp[r0 // (32 // g.num_bits):-(-r1 // (32 // g.num_bits))]
        s = scale[r0:r1].float()
        d = dequantize_packed(packed[r0:r1], s, (r1 - r0, k), g.num_bits, gs, z) - w_src[r0:r1].float()
        if method == "gptq":
            num += d.double().square().sum().item()
            den += w_src[r0:r1].double().square().sum().item()
        else:
            worst = max(worst, (d.view(r1 - r0, -1, gs).abs() / s.unsqueeze(-1)).amax().item())
    if method == "gptq":
        return math.sqrt(num / den) if den > 0 else math.inf, None
    return worst, RTN_BOUND_STEPS[g.symmetric]


def compare_with_source(ck: Checkpoint, source: Path, modules: dict[str, Module], scheme: dict[str, Group],
                        sampled: set[str], shapes: dict) -> CheckResult:
    """Dequantized (sampled) weights vs the source; unquantized tensors must be bit-identical.

    Raises:
        CannotValidate: the source cannot be read.
    """
    from safetensors import safe_open

    method = recipe_method(ck)
    res = CheckResult("source", details={"source": str(source), "method": method, "worst": [], "per_layer": {}})
    handles: dict[str, object] = {}
    entries = ck.entries()

    def get(name: str) -> torch.Tensor:
        e = entries[name]
        if e.shard not in handles:
            handles[e.shard] = safe_open(str(ck.root / e.shard), "pt")
        return handles[e.shard].get_tensor(name)

    seen, errs = set(), []
    for name, w in _read_source(source):
        module, _, leaf = name.rpartition(".")
        seen.add(name)
        g = scheme.get(module)
        if g is not None and leaf == "weight":
            if module in sampled and shapes.get(module) and not int_module_problems(modules[module], g, shapes[module]):
                errs.append(_compare_one(module, w, g, shapes[module], get, method, res))
        elif name not in entries:
            res.fail(f"source tensor {name} has no counterpart in the checkpoint", tensor=name)
        elif entries[name].dtype != "F8_E4M3":  # FP8 kept as FP8 (mixed precision) is not compared
            res.checked += 1  # bit-identical for bf16 tensors; others (an F32 bias) compared as bf16
            if not torch.equal(get(name).to(w.dtype), w):
                res.fail(f"{name}: stored unquantized but differs from the source", tensor=name,
                         shard=entries[name].shard)
    for module in sorted(scheme.keys() - {n.rpartition(".")[0] for n in seen}):
        res.fail(f"{module}: quantized, but the source has no {module}.weight", tensor=module)
    for name in sorted(n for n in entries if n.rpartition(".")[0] not in scheme and n not in seen
                       and n.rpartition(".")[2] not in COMPANIONS):
        res.fail(f"{name}: in the checkpoint but not in the source", tensor=name, shard=entries[name].shard)
    errs = [e for e in errs if e is not None]
    per_layer: dict[str, float] = {}
    for module, err in errs:
        key = str(layer_index(module)) if layer_index(module) is not None else "other"
        per_layer[key] = max(per_layer.get(key, 0.0), err)
    res.details.update(compared=len(errs), per_layer=per_layer,
                       worst=[{"module": m, "error": e} for m, e in sorted(errs, key=lambda r: -r[1])[:5]])
    return res


def _read_source(source: Path):
    """(name, bf16 tensor) of the source, as `iter_dense` gives them: bf16 is the dtype glmq quantized
    from (FP8 sources dequantize to it exactly as the converter does). Read errors -> CannotValidate."""
    from glmq.formats.dense import iter_dense

    try:
        yield from iter_dense(source, torch.bfloat16)
    except (OSError, KeyError, ValueError) as e:
        raise CannotValidate(f"--source {source}: cannot read it ({type(e).__name__}: {e})") from e


def _compare_one(module, w_src, g, shape, get, method, res):
    """One quantized weight against its source; returns (module, error) or None."""
    res.checked += 1
    if tuple(w_src.shape) != shape:
        res.fail(f"{module}: weight_shape {list(shape)} but the source weight is {list(w_src.shape)}", tensor=module)
        return None
    zp = get(f"{module}.weight_zero_point") if not g.symmetric else None
    packed, scale = get(f"{module}.weight_packed"), get(f"{module}.weight_scale")
    err, bound = weight_error(packed, scale, zp, shape, g, w_src, method)
    if bound is not None:
        res.details["bound_steps"] = bound
    if not math.isfinite(err):
        res.fail(f"{module}: the dequantized weight is not finite", tensor=module, value=math.inf)
    elif bound is not None and err > bound:
        res.fail(f"{module}: max |w_q - w_src| = {err:.4f} scale steps > bound {bound:.4f} (RTN, "
                 f"{'symmetric' if g.symmetric else 'asymmetric'})", tensor=module, value=err)
    return module, err


# ----------------------------------------------------------------------------------------- driver
def validate(checkpoint: str | Path, source: str | Path | None = None, *, sample: float = 1.0, device: str = "cpu",
             tp: int = 1, seed: int = 0, serving: bool = True, workers: int | None = None) -> Report:
    """Run every check on a converted checkpoint folder.

    Args:
        checkpoint: the folder `glmq quantize` wrote (or any compressed-tensors pack-quantized one).
        source: optional source checkpoint folder to compare weights with.
        sample: fraction in (0, 1] of quantized modules that get the matmul / source checks.
        device: "cpu" (reference path) or "cuda" (the Triton kernel).
        tp: tensor-parallel degree for the serving rules. serving: False skips them.
        seed: activation and sampling seed. workers: reader threads (default: CPU count, at most 8).
    Returns:
        The report; `report.exit_code` is 0 (valid) or 1 (invalid).
    Raises:
        CannotValidate: the checks cannot run (exit code 2).
    """
    t0 = time.perf_counter()
    if not 0.0 < sample <= 1.0:
        raise CannotValidate(f"sample must be in (0, 1], got {sample}")
    if tp < 1:
        raise CannotValidate(f"tp must be >= 1, got {tp}")
    if device not in ("cpu", "cuda"):
        raise CannotValidate(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise CannotValidate("--device cuda: no CUDA device is visible to PyTorch; use --device cpu")
    if source is not None and not (Path(source) / "config.json").is_file():
        raise CannotValidate(f"--source {source}: no config.json there; point it at the source checkpoint folder")
    root = Path(checkpoint)
    ck = load_checkpoint(root)
    # compressed-tensors takes seconds to import (transformers); only the checks after the read need it
    ct_import = threading.Thread(target=_ct, daemon=True)
    ct_import.start()
    modules = modules_of(ck.entries())
    q = read_quant_config(ck.config, ck.config_error)
    groups, ignore = q.groups, q.ignore
    scheme = {n: g for n, m in modules.items()
              if m.is_int and (g := group_for(n, groups)) is not None and g.kind == "int"}
    sampled = sample_modules(list(scheme), sample, seed)
    scan = ModuleScan(modules, scheme, sampled, device, seed)
    with _one_intra_op_thread():
        hashes, read_errors = scan_shards(ck, scan.keep, scan.add, workers or min(8, os.cpu_count() or 1))
        source_res = (None if source is None
                      else compare_with_source(ck, Path(source), modules, scheme, sampled, scan.shapes))
    ct_import.join()
    try:
        _ct()
    except ImportError as e:
        raise CannotValidate(f"compressed-tensors cannot be imported ({e}); the config checks need it") from e
    for msg in read_errors:
        ck.index.fail(msg)
    checks = {"config": check_config(q), "structure": check_structure(modules, groups, scan.shapes, ignore, ck.config),
              "index": ck.index}
    if serving:
        checks["serving"] = check_serving(modules, groups, scan.shapes, ignore, q.qc, tp)
    else:
        checks["serving"] = CheckResult("serving", skipped="skipped (serving=False / --no-serving)")
    checks["numerics"] = scan.result()
    if source_res is not None:
        checks["source"] = source_res
    sizes = {s: (root / s).stat().st_size for s in hashes}
    checks["integrity"] = check_integrity(ck.manifest, ck.manifest_error, hashes, sizes)
    settings = {"source": str(source) if source else None, "sample": sample, "device": device, "tp": tp, "seed": seed,
                "serving": serving, "shards": len(ck.shards), "tensors": sum(len(e) for e in ck.shards.values()),
                "quantized_modules": len(scheme)}
    return Report(str(root), settings, checks, time.perf_counter() - t0)


@contextlib.contextmanager
def _one_intra_op_thread():
    """Validation parallelises over shards with its own threads (one per core); torch's intra-op
    threads on top of them oversubscribe the cores, which made element-wise ops up to 20x slower on a
    busy 2-core machine. Restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def format_report(rep: Report, worst: int = 5) -> str:
    """The terminal table: one row per check, then the worst offenders of each failing check."""
    s = rep.settings
    lines = [f"glmq validate {rep.checkpoint}: {s['shards']} shards, {s['tensors']} tensors, "
             f"{s['quantized_modules']} quantized modules, tp {s['tp']}, {rep.seconds:.1f} s",
             f"{'check':10s} {'result':6s} {'checked':>8s} {'failed':>7s}  details"]
    for name, c in rep.checks.items():
        lines.append(f"{name:10s} {c.status.value:6s} {c.checked:8d} {len(c.failures):7d}  {_summary(c)}")
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
    if c.name == "source" and d.get("worst"):
        w = d["worst"][0]
        unit = f"steps, bound {d['bound_steps']:.4f}" if d["method"] != "gptq" else "relative, GPTQ: reported only"
        return f"{d['compared']} weights ({d['method']}); worst {w['error']:.4f} {unit} {w['module']}"
    if c.name == "index" and "total_bytes" in d:
        return f"{d['total_bytes']} bytes of tensors"
    return ""
