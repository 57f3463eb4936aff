"""The serving check: vLLM Marlin / Marlin-MoE shape rules, and the FP8-block split rules of the layers a keep_fp8
recipe keeps, at a tensor-parallel degree (pure)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import replace

from glmq.formats.families import (EXPERT_MODULE, FUSED_NAMES, FUSED_PARTNERS, LINEAR_CLASSES, TensorClass,
                                   layer_index)
from glmq.quantize.validate.checkpoint import Module
from glmq.quantize.validate.config import Group, group_for, scheme_label
from glmq.quantize.validate.report import CheckResult

# vLLM's parallel layout per module leaf (deepseek_v2.py / glm4_moe.py): q_a_proj + kv_a_proj_with_mqa
# are one replicated layer (`DeepSeekV2FusedQkvAProjLinear`, disable_tp=True); other leaves: replicated.
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
                             "lm_head", "head"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
# Layers vLLM builds without a quant_config (deepseek_v2.py), so a packed weight there cannot load.
NO_QUANT_LAYERS = {"gate": "vLLM's GateLinear router takes no quant_config",
                   "wk": "vLLM fuses indexer.wk + weights_proj with quant_config=None",
                   "weights_proj": "vLLM fuses indexer.wk + weights_proj with quant_config=None",
                   "eh_proj": "vLLM's and SGLang's MTP layers (deepseek_mtp, deepseek_nextn, glm4_moe_mtp) build eh_proj "
                              "as a plain nn.Linear, without a quant_config"}
# Checkpoint modules vLLM loads into one fused layer (formats.md §3a), by that layer's name: their Marlin shape rules
# hold for the fused layer's per-rank partition, not for each part. vllm/model_executor/layers/linear.py:
# `QKVParallelLinear`
# (qkv_proj: q heads split tp ways; KV heads split tp ways, or at tp > num_key_value_heads replicated whole, one per
# rank), `MergedColumnParallelLinear` (gate_up_proj: asserts each part % tp == 0, then each part / tp);
# vllm/model_executor/models/deepseek_v2.py `DeepSeekV2FusedQkvAProjLinear` (fused_qkv_a_proj, a
# MergedColumnParallelLinear with disable_tp=True: not split). Each hands create_weights `output_partition_sizes` (its
# parts per rank), and .../quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py
# `CompressedTensorsWNA16.create_weights` checks Marlin's shape (`verify_marlin_supports_shape`; later releases:
# `MPLinearLayerConfig(partition_weight_shape=...)` -> kernels/mixed_precision/marlin.py `check_marlin_supports_shape`)
# on output_size_per_partition = sum(output_partition_sizes): the fused width, not each part's.
# (families.FUSED_NAMES leaves out indexer.wk + weights_proj, which vLLM builds without a quant_config: NO_QUANT_LAYERS)
FUSED_LAYERS: dict[str, tuple[str, ...]] = {layer: parts for parts, layer in FUSED_NAMES.items()}
_FUSED_INTO = {leaf: layer for layer, parts in FUSED_LAYERS.items() for leaf in parts}


def attention_heads(config: dict | None) -> tuple[int, int] | None:
    """(num_attention_heads, num_key_value_heads) of a config.json (vLLM: num_key_value_heads defaults to
    num_attention_heads), or None where it does not say."""
    if not isinstance(config, dict):
        return None
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    nh, nkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (nh, nkv))
    return (nh, nkv) if ok else None


def _marlin_rules(n_p: int, k: int, k_p: int, what: str, split: str, tp: int, g: Group,
                  layer: str = "") -> list[tuple[str, str]]:
    """verify_marlin_supports_shape on one layer's per-rank partition ([n_p, k_p] of K = k), `what` saying what its
    N is, `layer` (a fused layer's name and parts) put before its K."""
    out = []
    if n_p % 64:
        out.append(("output_size_per_partition % 64 == 0", f"{what}, {split} at tp {tp}: {n_p} % 64 = {n_p % 64}"))
    if k_p % 128:
        out.append(("input_size_per_partition % 128 == 0", f"{layer}K = {k}, {split} at tp {tp}: {k_p} % 128 = {k_p % 128}"))
    gs = g.group_size
    if gs is not None and gs < k and k_p % gs:
        out.append(("input_size_per_partition % group_size == 0", f"{k_p} % {gs} = {k_p % gs}"))
    if gs is not None and gs not in (32, 64, 128):
        out.append(("group_size in {-1, 32, 64, 128}", f"group_size = {gs}"))
    return out


def dense_rules(leaf: str, n: int, k: int, tp: int, g: Group) -> list[tuple[str, str]]:
    """vLLM Marlin W4A16 rules for one dense Linear vLLM does not fuse, at `tp` (verify_marlin_supports_shape):
    (rule, numbers). The parts of a fused layer: `fused_rules`."""
    col, row = leaf in COLUMN_PARALLEL, leaf in ROW_PARALLEL
    if (col and n % tp) or (row and k % tp):
        dim, size = ("N", n) if col else ("K", k)
        return [("tensor-parallel split", f"{dim} = {size} is not divisible by tp = {tp}")]
    n_p, k_p = (n // tp if col else n), (k // tp if row else k)
    split = "column-parallel" if col else "row-parallel" if row else "replicated"
    return _marlin_rules(n_p, k, k_p, f"N = {n}", split, tp, g)


HEAD_SPLIT_RULE = "attention heads split tp ways"  # (planned_failures' rule for a model-wide head split)


def head_split_problem(heads: tuple[int, int] | None, tp: int) -> str | None:
    """Why vLLM cannot split (num_attention_heads, num_key_value_heads) `tp` ways, or None: the q heads must divide,
    and the KV heads divide tp ways or be replicated whole (tp a multiple of them)."""
    if heads is None or tp == 1:
        return None
    nh, nkv = heads
    if nh % tp:
        return f"num_attention_heads = {nh} is not divisible by tp = {tp}"
    if nkv % tp and tp % nkv:
        return f"num_key_value_heads = {nkv} neither divides nor is divisible by tp = {tp}"
    return None


def _qkv_rows_per_rank(parts: dict[str, int], heads: tuple[int, int] | None, tp: int) -> tuple[int, int, int] | None:
    """q_proj's, k_proj's and v_proj's rows per rank at `tp` under QKVParallelLinear: the q heads split tp ways, the
    KV heads too, or at tp > num_key_value_heads one whole KV head on each rank; None where `heads` (from config.json)
    do not divide the parts' rows. (Whether tp may split the heads at all: `head_split_problem`.)"""
    if heads is None:
        return None
    (nh, nkv), (nq, nk, nv) = heads, parts.values()
    if nq % nh or nk % nkv or nv % nkv:
        return None
    kv_p = max(1, nkv // tp)
    return nh // tp * (nq // nh), kv_p * (nk // nkv), kv_p * (nv // nkv)


def fused_rules(layer: str, parts: dict[str, int], k: int, tp: int, g: Group,
                heads: tuple[int, int] | None = None) -> list[tuple[str, str]]:
    """vLLM Marlin W4A16 rules for the fused layer `layer` (FUSED_LAYERS) at `tp`: `parts` is each member's N (leaf ->
    rows, in FUSED_LAYERS order), `k` their common K, `heads` (num_attention_heads, num_key_value_heads) for qkv_proj
    (None: KV heads taken as split tp ways like the q heads, exact where tp divides num_key_value_heads).
    (rule, numbers), the numbers naming the fused layer and its parts."""
    name = f"vLLM's {layer} = {' + '.join(f'{leaf} ({n})' for leaf, n in parts.items())}"
    if layer == "fused_qkv_a_proj":  # disable_tp=True: every rank holds the whole layer
        n_p = sum(parts.values())
        return _marlin_rules(n_p, k, k, f"{name}: N = {n_p}", "replicated", tp, g, f"{name}: ")
    if layer == "qkv_proj" and tp > 1 and (per_rank := _qkv_rows_per_rank(parts, heads, tp)) is not None:
        if (split := head_split_problem(heads, tp)) is not None:
            return [("tensor-parallel split", f"{name}: {split}")]
        nh, nkv = heads
        hq, hk, hv = (n // h for n, h in zip(parts.values(), (nh, nkv, nkv)))  # head_size, and v_head_size
        kv_p = max(1, nkv // tp)
        held = f"{kv_p} of {nkv} KV heads" + (f" (each replicated on {tp // nkv} ranks)" if tp > nkv else "")
        n_p = sum(per_rank)
        what = (f"{name}: N per rank = {nh // tp} of {nh} q heads x {hq} + {held} x ({hk} + {hv}) = {n_p}")
        return _marlin_rules(n_p, k, k, what, "column-parallel", tp, g, f"{name}: ")
    bad = [f"{leaf} N = {n}" for leaf, n in parts.items() if n % tp]
    if bad:  # MergedColumnParallelLinear: assert all(output_size % tp_size == 0 ...)
        return [("tensor-parallel split", f"{name}: {', '.join(bad)} not divisible by tp = {tp}")]
    n_p = sum(parts.values()) // tp
    what = f"{name}: N per rank = {' + '.join(str(n // tp) for n in parts.values())} = {n_p}"
    if layer == "qkv_proj" and heads is None and tp > 1:
        what += " (KV heads taken as split tp ways: no head counts from config.json)"
    return _marlin_rules(n_p, k, k, what, "column-parallel", tp, g, f"{name}: ")


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


# FP8-block layers (a keep_fp8 recipe's mixed-precision output): vLLM's and SGLang's `validate_fp8_block_shape`
# (quantization/utils/fp8_utils.py) on a Linear's partition, and Fp8MoEMethod.create_weights (the compressed-tensors
# W8A8 FP8 MoE scheme's twin) on a layer of experts: a weight split tp ways must split into whole 128x128 blocks.
FP8_N_RULE = "FP8 output_partition_size % block_n == 0"
FP8_K_RULE = "FP8 input_size_per_partition % block_k == 0"


def fp8_dense_rules(leaf: str, n: int, k: int, tp: int, block: tuple[int, int]) -> list[tuple[str, str]]:
    """validate_fp8_block_shape for one FP8-block Linear vLLM does not fuse, at `tp`: a column-parallel layer's rows
    per rank are whole blocks (block_n), a row-parallel layer's columns per rank (block_k); a replicated or unsplit
    (tp 1) layer has no rule. (rule, numbers)."""
    col, row = leaf in COLUMN_PARALLEL, leaf in ROW_PARALLEL
    if tp == 1 or not (col or row):
        return []
    if (col and n % tp) or (row and k % tp):
        dim, size = ("N", n) if col else ("K", k)
        return [("tensor-parallel split", f"{dim} = {size} is not divisible by tp = {tp}")]
    bn, bk = block
    if col and (n // tp) % bn:
        return [(FP8_N_RULE, f"N = {n}, column-parallel at tp {tp}: {n // tp} % {bn} = {n // tp % bn}")]
    if row and (k // tp) % bk:
        return [(FP8_K_RULE, f"K = {k}, row-parallel at tp {tp}: {k // tp} % {bk} = {k // tp % bk}")]
    return []


def fp8_fused_rules(layer: str, parts: dict[str, int], tp: int, block: tuple[int, int],
                    heads: tuple[int, int] | None = None) -> list[tuple[str, str]]:
    """validate_fp8_block_shape for the fused FP8-block layer `layer` (FUSED_LAYERS; `parts`: each member's N in
    order) at `tp`: split tp ways, every part's rows per rank are whole blocks; merged but not split (tp 1, or
    fused_qkv_a_proj, replicated), every part but the last (kv_a_proj_with_mqa's 576 rows may end in a part block).
    qkv_proj's parts per rank follow its head counts (`fused_rules`), a whole KV head on each rank at
    tp > num_key_value_heads; QKVParallelLinear's output_size is its per-rank width times tp, so vLLM checks all
    three parts as split. (rule, numbers)."""
    name = f"vLLM's {layer} = {' + '.join(f'{leaf} ({n})' for leaf, n in parts.items())}"
    split = tp > 1 and layer != "fused_qkv_a_proj"
    sizes = dict(parts)
    if split and layer == "qkv_proj" and (per_rank := _qkv_rows_per_rank(parts, heads, tp)) is not None:
        if (why := head_split_problem(heads, tp)) is not None:
            return [("tensor-parallel split", f"{name}: {why}")]
        sizes = dict(zip(parts, per_rank))
    elif split:
        if bad := [f"{leaf} N = {n}" for leaf, n in parts.items() if n % tp]:
            return [("tensor-parallel split", f"{name}: {', '.join(bad)} not divisible by tp = {tp}")]
        sizes = {leaf: n // tp for leaf, n in parts.items()}
    bn = block[0]
    checked = list(sizes.items()) if split else list(sizes.items())[:-1]
    bad = [f"{leaf} {n}{' per rank' if split else ''} % {bn} = {n % bn}" for leaf, n in checked if n % bn]
    where = f"column-parallel at tp {tp}" if split else "merged, not split"
    return [(FP8_N_RULE, f"{name}, {where}: {', '.join(bad)}")] if bad else []


def fp8_moe_rules(inter: int, tp: int, block: tuple[int, int]) -> list[tuple[str, str]]:
    """Fp8MoEMethod.create_weights (block quantization) at `tp`: the experts' intermediate width per rank is whole
    blocks as gate/up's rows (block_n) and, split, as down's columns (block_k). (rule, numbers)."""
    if inter % tp:
        return [("tensor-parallel split", f"moe_intermediate = {inter} is not divisible by tp = {tp}")]
    i_p, (bn, bk) = inter // tp, block
    out = []
    if i_p % bn:
        out.append(("FP8 (moe_intermediate / tp) % block_n == 0", f"{inter} / {tp} = {i_p}, % {bn} = {i_p % bn}"))
    if tp > 1 and i_p % bk:
        out.append(("FP8 (moe_intermediate / tp) % block_k == 0", f"{inter} / {tp} = {i_p}, % {bk} = {i_p % bk}"))
    return out


Target = tuple[TensorClass, str, tuple[int, ...], Group]  # (class, module, its [N, K] weight shape, its group)


def _failure_lines(bad: dict[tuple[str, str], list]) -> list[tuple[str, str, int]]:
    """(message, example module, count) per (class, rule) of `bad` ((class, rule) -> [first module, its numbers,
    count]), sorted. (HEAD_SPLIT_RULE is the model's, not a module's: its line names no module.)"""
    return [(f"{cls}: {rule} fails: {numbers}" if rule == HEAD_SPLIT_RULE else
             f"{cls}: {rule} fails for {count} module(s), e.g. {example}: {numbers}", example, count)
            for (cls, rule), (example, numbers, count) in sorted(bad.items())]


def _shape_rules(targets: Iterable[Target], tp: int, note, on_expert_layer=None,
                 heads: tuple[int, int] | None = None) -> None:
    """The rules of quantized modules at `tp`, each failure passed to `note(class, module, rule, numbers)`: the
    layers that take no quantization; `fused_rules` per fused layer (FUSED_LAYERS) whose parts are all quantized
    alike, noted for each part, `dense_rules` per other module; per layer of routed experts,
    `on_expert_layer(layer, [(module, shape, group)])` first, then `moe_rules` with its first expert's group. A module
    of an FP8-block group (kind "float") gets the FP8 rules instead (`fp8_fused_rules`, `fp8_dense_rules`,
    `fp8_moe_rules`). `heads`: (num_attention_heads, num_key_value_heads) from config.json, for qkv_proj."""
    experts: dict[int, list[tuple[str, tuple[int, ...], Group]]] = defaultdict(list)
    dense: list[Target] = []
    fused: dict[tuple[str, str], dict[str, Target]] = defaultdict(dict)  # (parent, fused layer) -> leaf -> target
    for t in targets:
        cls, name, shape, g = t
        parent, _, leaf = name.rpartition(".")
        if cls in (TensorClass.ROUTER, TensorClass.INDEXER, TensorClass.MTP_PROJ) and leaf in NO_QUANT_LAYERS:
            note(cls, name, "layer takes no quantization", NO_QUANT_LAYERS[leaf])
        if cls is TensorClass.ROUTED_EXPERT:
            experts[layer_index(name)].append((name, shape, g))
            continue
        dense.append(t)
        if leaf in _FUSED_INTO and len(shape) == 2:
            fused[parent, _FUSED_INTO[leaf]][leaf] = t
    done: set[str] = set()
    for cls, name, shape, g in dense:
        if name in done:
            continue
        parent, _, leaf = name.rpartition(".")
        members = fused.get((parent, _FUSED_INTO.get(leaf, "")), {})
        layer = _FUSED_INTO.get(leaf)
        if layer is not None and len(members) == len(FUSED_LAYERS[layer]) \
                and len({t[2][1] for t in members.values()}) == 1 and len({t[3].kind for t in members.values()}) == 1:
            ordered = [members[x] for x in FUSED_LAYERS[layer]]
            parts = {x: t[2][0] for x, t in zip(FUSED_LAYERS[layer], ordered)}
            rules = (fp8_fused_rules(layer, parts, tp, g.block, heads) if g.kind == "float" else
                     fused_rules(layer, parts, shape[1], tp, g, heads))
            for rule, numbers in rules:
                for m_cls, m_name, _, _ in ordered:
                    note(m_cls, m_name, rule, numbers)
            done.update(t[1] for t in ordered)
            continue
        for rule, numbers in (fp8_dense_rules(leaf, *shape, tp, g.block) if g.kind == "float" else
                              dense_rules(leaf, *shape, tp, g)):
            note(cls, name, rule, numbers)
    for layer, mods in sorted(experts.items()):
        if on_expert_layer is not None:
            on_expert_layer(layer, mods)
        gate = next((shape for name, shape, _ in mods if name.endswith(("gate_proj", "up_proj"))), None)
        inter, hidden = gate if gate else mods[0][1][::-1]
        g = mods[0][2]
        for rule, numbers in (fp8_moe_rules(inter, tp, g.block) if g.kind == "float" else
                              moe_rules(hidden, inter, tp, g)):
            for name, _, _ in mods:
                note(TensorClass.ROUTED_EXPERT, name, rule, f"layer {layer}: {numbers}")


def check_serving(modules: dict[str, Module], groups: list[Group], shapes: dict, ignore: list[str], qc: dict,
                  tp: int, config: dict | None = None) -> CheckResult:
    """Shapes and layout vLLM/SGLang serve at `tp`, reported per tensor class (pure). `config`: the checkpoint's
    config.json, whose head counts give qkv_proj's per-rank width (`fused_rules`; without it the KV heads are taken
    as split tp ways, exact where tp divides num_key_value_heads)."""
    res = CheckResult("serving", details={"tp": tp, "classes": {}})
    rows: dict[str, dict] = res.details["classes"]
    quant = {n: m for n, m in modules.items() if m.is_int and shapes.get(n)}
    bad: dict[tuple[str, str], list] = {}

    def note(cls: TensorClass, name: str, rule: str, numbers: str) -> None:
        bad.setdefault((cls.value, rule), [name, numbers, 0])[2] += 1
        rows[cls.value]["failed"].add(name)

    fp8 = {}  # the FP8-block modules of a mixed-precision checkpoint (keep_fp8), under their float group
    for name, m in modules.items():
        if m.is_fp8 and not m.is_int and len(m.parts["weight"].shape) == 2:
            g = group_for(name, groups)
            if g is not None and g.kind == "float" and g.block:
                fp8[name] = (m, g)

    def targets() -> Iterator[Target]:
        for name, m in quant.items():
            rows.setdefault(m.cls.value, {"modules": 0, "failed": set()})["modules"] += 1
            g = group_for(name, groups)
            if g is not None:
                yield m.cls, name, shapes[name], g
        for name, (m, g) in fp8.items():
            rows.setdefault(m.cls.value, {"modules": 0, "failed": set()})["modules"] += 1
            yield m.cls, name, tuple(m.parts["weight"].shape), g

    def one_scheme(layer: int, mods: list) -> None:
        first: dict[Group, tuple[Group, str]] = {}  # a scheme (a group less name and targets): its first user
        for name, _, g in mods:
            first.setdefault(replace(g, name="", targets=()), (g, name))
        if len(first) > 1:  # vLLM's get_moe_method: "All MoE projections need to have same quantization scheme"
            seen = ", ".join(f"{g.name} ({g.kind}, num_bits {g.num_bits}, group_size {g.group_size}, symmetric "
                             f"{g.symmetric}; e.g. {name})"
                             for g, name in sorted(first.values(), key=lambda gm: gm[0].name))
            for name, _, _ in mods:
                note(TensorClass.ROUTED_EXPERT, name, "one quantization scheme for all expert projections",
                     f"layer {layer}: {len(first)} schemes: {seen}; vLLM fuses the experts into one MoE layer "
                     f"and raises, SGLang reads them all with the 'Linear' group's scheme")

    heads = attention_heads(config)
    _shape_rules(targets(), tp, note, one_scheme, heads)
    _check_partners(modules, groups, res)
    split = head_split_problem(heads, tp)
    if split and not any(split in numbers for _, numbers, _ in bad.values()):  # (else a quantized qkv_proj says it)
        res.fail(f"attention heads: {split}: vLLM (ModelConfig.verify_with_parallel_config) and SGLang split them tp "
                 f"ways and refuse the model at this degree, whatever is quantized; serve it at a tp that divides them")
    for pat in (p for p in ignore if not p.startswith("re:") and p != "lm_head"):
        hit = [n for n in quant if pat.lower() in n.lower()]
        if hit:
            res.fail(f"ignore entry {pat!r} is not a regex: SGLang matches it as a case-insensitive substring and "
                     f"would leave {len(hit)} quantized module(s) (e.g. {hit[0]}) unquantized; use an anchored 're:'")
    if not any("Linear" in g.targets for g in groups if g.kind == "int"):
        res.warn("no INT group targets 'Linear': older vLLM (WNA16 Marlin-MoE) and SGLang before PR #29761 "
                 "raise KeyError")
    plain = [n for n, m in modules.items() if m.cls is TensorClass.ROUTED_EXPERT and not m.is_int and not m.is_fp8
             and "weight" in m.parts]
    if plain and quant:  # (found by a probe: transformers 5.17 with compressed-tensors 0.19; vLLM and SGLang load them)
        res.warn(f"{len(plain)} routed expert projection(s) stored unquantized (e.g. {plain[0]}) beside a "
                 f"compressed-tensors config: transformers leaves its fused experts unloaded (random) for such a "
                 f"checkpoint, reporting the stored ones as UNEXPECTED; vLLM and SGLang load them and glmq eval reads "
                 f"them as stored; quantize the routed experts to load the model with transformers")
    if quant and qc.get("format") != "pack-quantized":
        res.warn(f"top-level format {qc.get('format')!r}: older SGLang reads it for W4A16 MoE and needs "
                 f"'pack-quantized'")
    for message, example, count in _failure_lines(bad):
        res.fail(message, tensor=example, value=count)
    for cls, row in rows.items():
        row["failed"] = len(row["failed"])
        row["rules"] = [{"rule": r, "modules": c, "example": ex, "numbers": nb}
                        for (k, r), (ex, nb, c) in bad.items() if k == cls]
    res.checked = len(quant) + len(fp8)
    return res


def _check_partners(modules: dict[str, Module], groups: list[Group], res: CheckResult) -> None:
    """Modules an engine fuses (q/k/v, gate/up, q_a/kv_a, wk/weights_proj; all experts of a layer) need one
    scheme: all INT, all FP8 (a mixed-precision checkpoint) or all BF16, and INT parts of one fused layer one INT
    scheme: vLLM builds the fused layer (qkv_proj) from one config group, so a k_proj stored at another group size
    than q_proj cannot load under it, whichever group that is (`find_matched_target`: the fused layer's own name, its
    class name, then its parts' names; structure's `_check_fused_layers` checks that group against the parts' one
    scheme). (A layer's experts: `one_scheme`, per MoE layer.)"""
    by_parent: dict[str, dict[str, str]] = defaultdict(dict)
    for name, m in modules.items():
        if m.is_int or ("weight" in m.parts and m.cls in LINEAR_CLASSES):
            parent, _, leaf = name.rpartition(".")
            if (hit := EXPERT_MODULE.match(name)) is not None:
                by_parent[f"model.layers.{hit[1]}.mlp.experts"][f"{hit[2]}.{hit[3]}_proj"] = _form(m, None)
            else:
                by_parent[parent][leaf] = _form(m, groups)
    for parent, leaves in sorted(by_parent.items()):
        if parent.endswith(".mlp.experts"):
            sets = [list(leaves)]
        else:
            sets = [[x for x in grp if x in leaves] for grp in FUSED_PARTNERS]
        for members in sets:
            forms = defaultdict(list)
            for x in members:
                forms[leaves[x]].append(x)
            if len(forms) > 1:
                parts = ", ".join(f"{len(v)} {f} (e.g. {sorted(v)[0]})" for f, v in sorted(forms.items()))
                res.fail(f"{parent}: {len(members)} fused members stored as {parts}; vLLM/SGLang fuse them into "
                         f"one layer with one scheme and raise", tensor=parent)


def _form(m: Module, groups: list[Group] | None) -> str:
    """How a module is stored: INT (with `groups`, its group's scheme: `INT4, group 128`), FP8 or BF16."""
    if not m.is_int:
        return "FP8" if m.is_fp8 else "BF16"
    g = group_for(m.name, groups) if groups is not None else None
    return "INT" if g is None else scheme_label(g)


def planned_problems(plan, tp: int = 1) -> list[str]:
    """The serving rules the output of `plan` (quantize/plan.Plan) will fail at `tp`, from the source shapes and
    the recipe before anything is written (pure): `glmq quantize` and `glmq plan` warn with them, so a recipe whose
    output vLLM/SGLang will refuse (asymmetric routed experts, a width Marlin cannot split) is known before an
    hours-long run, not from `glmq validate` after it. One line per (class, rule), with a count and an example
    (`problem_lines` of `planned_failures`)."""
    return problem_lines(planned_failures(plan, tp))


def planned_failures(plan, tp: int = 1) -> dict[tuple[str, str], dict[str, str]]:
    """(class, rule) -> {module: its numbers} for every module of `plan`'s output that fails the rule at `tp`, in plan
    order. The rules of `check_serving`, through the same `_shape_rules` (one recipe is one scheme for every quantized
    module, so its one-scheme-per-MoE-layer rule cannot fail here), the kept FP8-block modules' (keep_fp8) included."""
    from glmq.quantize.plan import Action

    spec = plan.recipe.spec
    g = Group("recipe", ("Linear",), "int", spec.num_bits, spec.group_size, spec.symmetric)
    failed: dict[tuple[str, str], dict[str, str]] = {}

    def note(cls: TensorClass, name: str, rule: str, numbers: str) -> None:
        failed.setdefault((cls.value, rule), {}).setdefault(name, numbers)

    block = plan.source.block
    fp8 = Group("fp8", ("Linear",), "float", 8, block=tuple(block)) if block else None
    heads = attention_heads(plan.source.config)
    _shape_rules(((it.cls, it.module, tuple(it.src.shape), g if it.action is Action.QUANTIZE else fp8)
                  for it in plan.items if it.action is Action.QUANTIZE or (it.action is Action.KEEP_FP8 and fp8)),
                 tp, note, heads=heads)
    split = head_split_problem(heads, tp)
    if split and not any(split in nb for mods in failed.values() for nb in mods.values()):  # as check_serving
        note(TensorClass.ATTENTION, "config.json", HEAD_SPLIT_RULE, f"{split}, whatever is quantized")
    return failed


def problem_lines(failures: dict[tuple[str, str], dict[str, str]]) -> list[str]:
    """`planned_problems`' lines for `planned_failures`' modules (or a subset of them): the first module of each
    rule is its example."""
    bad = {key: [*next(iter(mods.items())), len(mods)] for key, mods in failures.items() if mods}
    return [message for message, _, _ in _failure_lines(bad)]
