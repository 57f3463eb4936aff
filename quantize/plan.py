"""Plan a conversion from headers alone: what happens to each tensor, what is written where.

The plan is the first of the engine's four steps (plan -> validate -> process -> write). It knows
every output tensor's name, dtype and shape, so output files, their headers and the total size are
fixed before any data is read; `validate_plan` checks every weight and its partners so a bad
checkpoint fails in seconds instead of hours.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from glmq.formats.families import (LINEAR_CLASSES, NO_KEY, UNKNOWN_TENSOR, TensorClass, attention_presence_problems,
                                   classify, config_shape_problems, expert_layout_problems, layer_index,
                                   layout_problems, mtp_layers, mtp_stored)
from glmq.formats.safetensors_io import CheckpointError, OutSpec, TensorEntry
from glmq.formats.source import Source, SourceFormat
from glmq.quantize.pack import packed_shape
from glmq.recipes import UNSERVABLE_TARGETS, Recipe

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
FLOAT_DTYPES = ("BF16", "F16", "F32")
_COMPANIONS = ("weight_scale_inv", "weight_scale", "input_scale")


class Action(str, enum.Enum):
    QUANTIZE = "quantize"  # -> weight_packed / weight_scale / weight_shape (+ weight_zero_point)
    DEQUANTIZE = "dequantize"  # FP8 -> BF16 weight, listed in ignore
    KEEP_FP8 = "keep_fp8"  # FP8 block weight kept, weight_scale_inv renamed weight_scale
    COPY = "copy"  # bytes copied as they are


@dataclass(frozen=True)
class Item:
    """One unit of work: a weight with its companions, or a lone tensor."""

    name: str  # primary tensor name
    module: str
    cls: TensorClass
    action: Action
    src: TensorEntry
    companions: dict[str, TensorEntry]  # e.g. {"weight_scale_inv": entry}
    outputs: tuple[OutSpec, ...]
    mtp: bool = False

    @property
    def in_bytes(self) -> int:
        return self.src.nbytes + sum(e.nbytes for e in self.companions.values())

    @property
    def out_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class OutFile:
    name: str
    source_shard: str
    items: list[Item] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(i.out_bytes for i in self.items)

    def source_shards(self) -> set[str]:
        """Every source shard this file's tensors are read from (a weight's scale may lie in another shard)."""
        return {e.shard for it in self.items for e in (it.src, *it.companions.values())}


@dataclass
class Plan:
    source: Source
    recipe: Recipe
    items: list[Item]
    files: list[OutFile]
    max_shard_bytes: int

    def by_class(self) -> dict[str, dict[str, int]]:
        """Tensor count, bytes in and bytes out per (class, action)."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes_in": 0, "bytes_out": 0})
        for it in self.items:
            row = out[f"{it.cls.value}:{it.action.value}"]
            row["tensors"] += 1
            row["bytes_in"] += it.in_bytes
            row["bytes_out"] += it.out_bytes
        return dict(sorted(out.items()))

    @property
    def bytes_out(self) -> int:
        return sum(f.nbytes for f in self.files)

    def quantized_modules(self) -> list[str]:
        return [it.module for it in self.items if it.action is Action.QUANTIZE]

    def linear_modules(self) -> dict[str, Action]:
        """Every Linear-like module (2-D weight of a Linear class) and what happens to it."""
        return {it.module: it.action for it in self.items
                if it.cls in LINEAR_CLASSES and it.name.endswith(".weight") and len(it.src.shape) == 2}


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _quantized_outputs(module: str, shape: tuple[int, ...], recipe: Recipe) -> tuple[OutSpec, ...]:
    spec = recipe.spec
    n, k = shape
    outs = [
        OutSpec(f"{module}.weight_packed", "I32", packed_shape((n, k), spec.num_bits)),
        OutSpec(f"{module}.weight_scale", "BF16", (n, k // spec.group_size)),
        OutSpec(f"{module}.weight_shape", "I64", (2,)),
    ]
    if not spec.symmetric:
        outs.append(OutSpec(f"{module}.weight_zero_point", "I32", (-(-n * spec.num_bits // 32), k // spec.group_size)))
    return tuple(outs)


class PlanError(CheckpointError):
    pass


def _and_more(n: int) -> str:
    return "" if n == 0 else f" (and {n} more tensor{'s' if n > 1 else ''})"


def _problem_list(problems: list[str]) -> str:
    more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
    return "\n  " + "\n  ".join(problems[:12]) + more


def make_items(source: Source, recipe: Recipe) -> list[Item]:
    """Classify every tensor and decide its action; raise one PlanError listing every problem."""
    ents = source.entries
    # a config that disagrees with the experts stored was copied through, and the output failed `glmq validate`; the
    # MTP layer may be absent as a whole (it serves), not in part: validate's rule (mtp_stored)
    weights = {_split(n)[0] for n in ents if _split(n)[1] == "weight"}
    layout = expert_layout_problems(weights, source.config, mtp_required=mtp_stored(weights, source.config))
    layout += config_shape_problems({n: e.shape for n, e in ents.items()}, source.config)
    attention = attention_presence_problems(ents, source.config)
    layout += attention
    # every other tensor config.json's model has, and nothing it has no parameter for (the output failed validate's
    # same check after the whole conversion); a source without its MTP layer serves, as above
    parts: dict[str, set[str]] = {}
    for module, leaf in map(_split, ents):
        parts.setdefault(module, set()).add(leaf)
    more, why_not = layout_problems(parts, source.config, told={w for w, _ in attention}, mtp_required=False)
    if why_not is not None and why_not.startswith(NO_KEY):  # converted, a layer was taken for another (layer 0: MTP)
        raise PlanError(f"{source.config_file}: no {why_not.removeprefix(NO_KEY).strip()} key, which glmq "
                        f"plan needs; use the model's complete config.json (e.g. as published with its weights)")
    unknown = [w for w, p in more if p.startswith(UNKNOWN_TENSOR)]
    if unknown:  # converted (copied) as they are: glmq's layout table may lack a tensor a loader knows
        logging.getLogger("glmq.plan").warning(
            "%s: %d tensor(s) have no parameter in the model config.json describes (e.g. %s): they are copied, but "
            "`glmq validate` fails the output unless a loader knows them (if vLLM loads this source, tell glmq's "
            "maintainers)", source.root, len(unknown), unknown[0])
    layout += [(w, p) for w, p in more if not p.startswith(UNKNOWN_TENSOR)]
    values = [p for where, p in layout if where == "config.json"]
    if values:  # not a disagreement with the tensors: no loader builds a model from these values
        raise PlanError(f"{source.config_file}: values of the wrong kind; fix config.json (e.g. take it as "
                        f"published with the weights):" + _problem_list(values))
    if layout:
        alike: dict[str, list[str]] = {}  # a wrong key repeats one problem in every layer (GLM-5: 78 x 256 experts)
        for where, problem in layout:
            alike.setdefault(problem, []).append(where)
        raise PlanError(f"{source.config_file}: disagrees with the tensors stored (config and shards of "
                        f"different revisions?); fix config.json or re-download the checkpoint:"
                        + _problem_list([f"{w[0]}{_and_more(len(w) - 1)}: {p}"
                                         for p, w in alike.items()]))
    mtp = set(mtp_layers(source.config))
    problems: list[str] = []
    items: list[Item] = []
    claimed: set[str] = set()
    targets = set(recipe.targets)
    for name in sorted(ents):
        module, leaf = _split(name)
        if leaf in _COMPANIONS:
            continue
        e = ents[name]
        where = f"{source.path(e.shard)}: tensor {name}"
        cls = classify(module)
        companions = {c: ents[f"{module}.{c}"] for c in _COMPANIONS if leaf == "weight" and f"{module}.{c}" in ents}
        claimed.update(x.name for x in companions.values())
        is_fp8 = e.dtype == "F8_E4M3"
        action, outputs = Action.COPY, (OutSpec(name, e.dtype, e.shape),)
        scales = [c for c in ("weight_scale_inv", "weight_scale") if c in companions]
        if scales and not is_fp8:
            # a weight decoded to floats but its FP8 scale kept: copied, it lost the scale (values off by it); to
            # quantize, the CPU kernel read its bytes as FP8 codes of a 2-4x wider row, past its buffers
            problems.append(f"{where} has dtype {e.dtype} but a {scales[0]} ({source.path(companions[scales[0]].shard)})"
                            f": only an F8_E4M3 weight has one; the shards are from different revisions, re-download "
                            f"them")
            continue
        if is_fp8:
            scale_key = "weight_scale_inv" if source.fmt is SourceFormat.FP8_BLOCK else "weight_scale"
            if source.fmt is SourceFormat.DENSE or leaf != "weight":
                problems.append(f"{where} is F8_E4M3 but the config declares no FP8 quantization for it; "
                                f"fix config.json's quantization_config")
                continue
            if len(e.shape) != 2:
                problems.append(f"{where} is F8_E4M3 with shape {list(e.shape)}; an FP8 weight must be 2-D [out, in]: "
                                f"the header is corrupt, re-download the shard")
                continue
            s = companions.get(scale_key)
            if s is None:
                problems.append(f"{where} is FP8 but {module}.{scale_key} is in no shard; the checkpoint is "
                                f"incomplete, re-download the shard that should hold it")
                continue
            if s.dtype not in FLOAT_DTYPES:
                problems.append(f"{source.path(s.shard)}: tensor {s.name} has dtype {s.dtype}; an FP8 scale must be F32, BF16 or F16")
                continue
            if source.fmt is SourceFormat.FP8_BLOCK:
                bn, bk = source.block
                want = (-(-e.shape[0] // bn), -(-e.shape[1] // bk))
                if tuple(s.shape) != want:
                    problems.append(f"{source.path(s.shard)}: tensor {s.name} has shape {list(s.shape)}, expected "
                                    f"{list(want)} for weight {list(e.shape)} with {bn}x{bk} blocks")
                    continue
            elif tuple(s.shape) not in ((e.shape[0], 1), (1,), ()):
                problems.append(f"{source.path(s.shard)}: tensor {s.name} shape {list(s.shape)} is neither per-channel "
                                f"[{e.shape[0]}, 1] nor per-tensor ([], [1]), as compressed-tensors stores them"
                                + (f" (a per-channel scale stored flat: store it as [{e.shape[0]}, 1], e.g. "
                                   f"t.reshape(-1, 1) before safetensors' save_file)" if tuple(s.shape) == (e.shape[0],)
                                   else "; the checkpoint is not a compressed-tensors FP8 one glmq reads"))
                continue
        elif leaf == "weight" and cls in targets and e.dtype not in FLOAT_DTYPES:
            problems.append(f"{where} has dtype {e.dtype}; a weight to quantize must be F8_E4M3 (with its scale) "
                            f"or BF16/F16/F32")
            continue
        quantize = leaf == "weight" and cls in targets and len(e.shape) == 2
        if quantize:
            why = recipe.spec.check_shape(e.shape)
            if why:
                problems.append(f"{where} {list(e.shape)}: {why}")
                continue
            action, outputs = Action.QUANTIZE, _quantized_outputs(module, e.shape, recipe)
        elif is_fp8 and recipe.keep_fp8 and source.fmt is SourceFormat.FP8_BLOCK and e.shape[0] % source.block[0] == 0:
            s = companions["weight_scale_inv"]
            action, outputs = Action.KEEP_FP8, (OutSpec(name, e.dtype, e.shape), OutSpec(f"{module}.weight_scale", s.dtype, s.shape))
        elif is_fp8:
            action, outputs = Action.DEQUANTIZE, (OutSpec(name, "BF16", e.shape),)
        if action is Action.COPY:
            companions = {}
        items.append(Item(name, module, cls, action, e, companions, outputs, layer_index(name) in mtp))
    orphans = sorted(n for n in ents if _split(n)[1] in _COMPANIONS and n not in claimed)
    for n in orphans:
        problems.append(f"{source.path(ents[n].shard)}: tensor {n} has no {_split(n)[0]}.weight to belong to; "
                        f"the checkpoint is inconsistent (a shard from another revision?)")
    if problems:
        raise PlanError(f"{source.root}: {len(problems)} problem(s) found before converting:" + _problem_list(problems))
    if not any(it.action is Action.QUANTIZE for it in items):
        # Nothing to quantize wrote a valid "pack-quantized" checkpoint of BF16 weights (every class in the ignore
        # list, FP8 dequantized: larger than the source), and validate passed it: the recipe was silently ignored.
        present = sorted({it.cls.value for it in items if it.name.endswith(".weight") and len(it.src.shape) == 2
                          and it.cls in LINEAR_CLASSES and it.cls not in UNSERVABLE_TARGETS})
        raise PlanError(f"{source.root}: recipe {recipe.name!r} quantizes nothing here: its targets "
                        f"{sorted(t.value for t in targets)} match no 2-D weight of this checkpoint, whose quantizable "
                        f"weights are of the classes {present}; add one of those to the recipe's targets")
    items = _demote_unkeepable_partners(items)
    _check_fused_partners(items, source)
    return items


def _demote_unkeepable_partners(items: list[Item]) -> list[Item]:
    """With keep_fp8, a fused partner that cannot stay FP8 drags its partners to BF16 too: one fused layer,
    one scheme. It cannot when it is FP8 but not a whole number of 128-row blocks (kv_a_proj_with_mqa, 576
    rows), or when it is BF16 in the source (GLM-5's indexer.weights_proj, fused with the FP8 wk)."""
    from dataclasses import replace

    from glmq.formats.families import FUSED_PARTNERS

    acts = {it.module: it.action for it in items if it.name.endswith(".weight")}
    demote = set()
    for module, act in acts.items():
        if act not in (Action.DEQUANTIZE, Action.COPY):
            continue
        parent, leaf = _split(module)
        for group in FUSED_PARTNERS:
            if leaf in group:
                demote.update(f"{parent}.{g}" for g in group if acts.get(f"{parent}.{g}") is Action.KEEP_FP8)
    return [replace(it, action=Action.DEQUANTIZE, outputs=(OutSpec(it.name, "BF16", it.src.shape),))
            if it.module in demote and it.action is Action.KEEP_FP8 else it for it in items]


def _check_fused_partners(items: list[Item], source: Source) -> None:
    """Modules a serving engine fuses must all be quantized or all not (formats.md §3a)."""
    from glmq.formats.families import FUSED_PARTNERS

    by_parent: dict[str, dict[str, Action]] = defaultdict(dict)
    for it in items:
        if it.name.endswith(".weight") and it.cls in LINEAR_CLASSES:
            parent, leaf = _split(it.module)
            by_parent[parent][leaf] = it.action
    for parent, leaves in by_parent.items():
        for group in FUSED_PARTNERS:
            acts = {leaves[g] is Action.QUANTIZE for g in group if g in leaves}
            if len(acts) > 1:
                raise PlanError(
                    f"{source.root}: {parent}.{{{','.join(group)}}} would be partly quantized; vLLM/SGLang fuse "
                    f"them into one layer that needs one scheme. Target all of them or none in the recipe."
                )


def assign_files(source: Source, items: list[Item], max_shard_bytes: int) -> list[OutFile]:
    """Group items into output files: never across source shards, each at most max_shard_bytes."""
    per_shard: dict[str, list[Item]] = defaultdict(list)
    for it in items:
        per_shard[it.src.shard].append(it)
    chunks: list[OutFile] = []
    for shard in source.shards:
        cur, cur_bytes = OutFile("", shard), 0  # a running sum: OutFile.nbytes re-sums (quadratic per shard)
        for it in per_shard.get(shard, []):
            if cur.items and cur_bytes + it.out_bytes > max_shard_bytes:
                chunks.append(cur)
                cur, cur_bytes = OutFile("", shard), 0
            cur.items.append(it)
            cur_bytes += it.out_bytes
        if cur.items:
            chunks.append(cur)
    n = len(chunks)
    for i, f in enumerate(chunks):
        f.name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return chunks


def make_plan(source: Source, recipe: Recipe, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Plan:
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    items = make_items(source, recipe)
    return Plan(source, recipe, items, assign_files(source, items, max_shard_bytes), max_shard_bytes)
