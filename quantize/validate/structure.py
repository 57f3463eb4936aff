"""The structure check: promised tensors present and well-formed, nothing left over (pure)."""

from __future__ import annotations

import re

from glmq.formats.families import (EXPERT_MODULE, FUSED_ALIASES, FUSED_NAMES, LINEAR_CLASSES, NO_KEY,
                                   attention_presence_problems, config_shape_problems, expert_layout_problems,
                                   layout_problems, mtp_absent)
from glmq.quantize.validate.checkpoint import COMPANIONS, Module
from glmq.quantize.validate.config import (Group, _ct, float_group_for, fused_layer_group, group_for,
                                           scheme_label, scheme_of)
from glmq.quantize.validate.report import CheckResult

LEAF_DTYPES = {"weight_packed": ("I32",), "weight_scale": ("BF16", "F16", "F32"), "weight_shape": ("I64", "I32"),
               "weight_zero_point": ("I32",), "weight_g_idx": ("I32",)}


def expected_shapes(n: int, k: int, g: Group) -> dict[str, tuple[int, ...]]:
    """Shapes of the pack-quantized tensors of an `[N, K]` weight (formats.md §2a)."""
    groups = 1 if g.group_size is None else -(-k // g.group_size)
    want = {"weight_packed": (n, -(-k * g.num_bits // 32)), "weight_scale": (n, groups), "weight_shape": (2,)}
    if not g.symmetric:
        want["weight_zero_point"] = (-(-n * g.num_bits // 32), groups)
    if g.actorder == "group":
        want["weight_g_idx"] = (k,)
    return want


def int_module_problems(m: Module, g: Group, shape: tuple[int, int] | None,
                        value: tuple[int, ...] | None = None) -> list[str]:
    """What is wrong with one pack-quantized module under group `g` (pure).

    Args:
        shape: weight_shape's value as a usable `(N, K)`, or None (not read, or unusable).
        value: weight_shape's values as read, when `shape` is None: reported as unusable (None: not read).
    """
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
        if value is not None and "weight_shape" in p:
            out.append(_weight_shape_problem(m, value))
        return out
    n, k = shape
    if g.group_size and k >= g.group_size and k % g.group_size:
        out.append(f"{m.name}: K = {k} is not a multiple of group_size {g.group_size}")
    for leaf, want in expected_shapes(n, k, g).items():
        if leaf in p and tuple(p[leaf].shape) != want:
            out.append(f"{m.name}.{leaf} has shape {list(p[leaf].shape)}, expected {list(want)} for weight_shape "
                       f"[{n}, {k}] with num_bits {g.num_bits}, "
                       + (f"group_size {g.group_size}" if g.group_size else "strategy channel (one scale per row)"))
    return out


def _weight_shape_problem(m: Module, value: tuple[int, ...]) -> str:
    """Why a weight_shape that was read is not a usable [N, K] (loaders would drop or misread the module)."""
    e = m.parts["weight_shape"]
    if tuple(e.shape) != (2,):
        why = f"has shape {list(e.shape)} (holding {list(value)[:8]}), expected [2]"
    else:
        why = f"holds {list(value)}: N and K must be positive"
    return (f"{m.name}.weight_shape in {e.shard} {why}: it must be the [N, K] of the original weight, which "
            f"weight_packed and weight_scale are laid out for; loaders would drop or misread the module, re-convert it")


def check_structure(modules: dict[str, Module], groups: list[Group], shapes: dict, ignore: list[str],
                    config: dict | None, values: dict | None = None, unread: set[str] = frozenset()) -> CheckResult:
    """Promised tensors present and well-formed, nothing left over, ignore list == storage (pure).

    `shapes`: module -> usable (N, K) or None; `values`: module -> weight_shape's integers as read
    (numerics.ModuleScan), so that an unusable one is reported, not skipped. `unread`: tensor files whose header
    could not be read (the index check fails them): tensors are not called missing while they may lie there.
    """
    values = values or {}
    res = CheckResult("structure", checked=len(modules))
    ct = _ct()
    for m in modules.values():
        where = {"tensor": m.name, "shard": m.shard()}
        if "weight_scale_inv" in m.parts:
            res.fail(f"{m.name}.weight_scale_inv: an FP8-source scale left in a compressed-tensors checkpoint", **where)
        if m.is_int:
            g = group_for(m.name, groups) if groups else None
            if g is None or g.kind != "int":
                res.fail(f"{m.name} is stored pack-quantized but no INT config group targets it", **where)
                continue
            for msg in int_module_problems(m, g, shapes.get(m.name), values.get(m.name)):
                res.fail(msg, **where)
            hit = [p for p in ignore if ct.is_ignored(m.name, [p])]
            if hit:
                res.fail(f"{m.name} is quantized (weight_packed) but matches ignore entry {hit[0]!r}: loaders "
                         f"would build it unquantized and find no .weight", **where)
        elif m.is_fp8:
            fg = float_group_for(m.name, groups)
            hit = [p for p in ignore if ct.is_ignored(m.name, [p])]
            if fg is None:
                res.fail(f"{m.name}.weight is F8_E4M3 but no float-quantized config group targets it", **where)
            elif hit:  # ignore is applied before the config groups: loaders would build a BF16 Linear
                res.fail(f"{m.name}.weight is F8_E4M3 but matches ignore entry {hit[0]!r}: loaders would build it "
                         f"unquantized and read the FP8 bytes without their scales", **where)
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
                    and (g := group_for(m.name, groups)) is not None  # no group targets it: loaders build it as is
                    and not any(ct.is_ignored(m.name, [p]) for p in ignore)):
                form, leaf = ("INT", "weight_packed") if g.kind == "int" else ("FP8", "weight_scale")
                res.fail(f"{m.name}.weight is stored unquantized ({w.dtype}) but matches no ignore entry: vLLM would "
                         f"build it as {form} and find no {leaf}", **where)
    if groups:
        _check_fused_layers(modules, groups, res)
    if unread:
        res.warn(f"{len(unread)} tensor file(s) could not be read (e.g. {sorted(unread)[0]}; see the index check): "
                 f"the tensors they hold are not checked for presence here")
    else:
        _check_experts(modules, config or {}, res)
    stored = {f"{m.name}.{leaf}": e.shape for m in modules.values() for leaf, e in m.parts.items()}
    for m in modules.values():  # a pack-quantized module by its [N, K]; an unusable weight_shape is reported above
        if m.is_int:
            stored.pop(f"{m.name}.weight_shape", None)
            if shapes.get(m.name) is not None:
                stored[f"{m.name}.weight_shape"] = tuple(shapes[m.name])
    for name, problem in config_shape_problems(stored, config or {}):
        # a value of the wrong kind: a type loaders refuse, or a zero they accept and build nothing working from
        why = "no loader builds a working model from it" if name == "config.json" else "loaders would refuse it"
        res.fail(f"{name}: {problem}; {why}", tensor=name)
    attention = attention_presence_problems(stored, config or {}, missing=not unread)
    for name, problem in attention:
        res.fail(f"{name}: {problem}", tensor=name)
    parts = {name: set(m.parts) for name, m in modules.items()}
    problems, why_not = layout_problems(parts, config or {}, missing=not unread, told={n for n, _ in attention},
                                        mtp_required=False)
    if why_not and why_not.startswith(NO_KEY):  # loaders cannot build the model (glmq quantize refuses such a source)
        res.fail(f"config.json: no {why_not.removeprefix(NO_KEY).strip()} key, which loaders build the model from: "
                 f"the tensors it promises cannot be listed; use the model's complete config.json (e.g. the source's)")
    elif why_not:
        res.warn(f"the tensors config.json promises were not listed ({why_not}): only the routed experts and the "
                 f"attention switches were checked against it")
    for name, problem in problems[:_LAYOUT_SHOWN]:
        res.fail(f"{name}: {problem}", tensor=name)
    if len(problems) > _LAYOUT_SHOWN:
        res.fail(f"and {len(problems) - _LAYOUT_SHOWN} more tensor(s) that disagree with config.json's layout "
                 f"(the first {_LAYOUT_SHOWN} are listed)")
    kv = sorted(f"{m.name}.{leaf}" for m in modules.values() for leaf in m.parts if leaf in _KV_SCALES)
    if kv and ((config or {}).get("quantization_config") or {}).get("kv_cache_scheme") is None:
        res.warn(f"{len(kv)} KV-cache scale tensor(s) are stored (e.g. {kv[0]}) but quantization_config."
                 f"kv_cache_scheme is null: vLLM then creates no KV-scale parameters and skips them (an FP8 KV cache "
                 f"runs with scale 1.0); set kv_cache_scheme as the source's config has it, or remove the tensors",
                 tensor=kv[0])
    return res


def _check_fused_layers(modules: dict[str, Module], groups: list[Group], res: CheckResult) -> None:
    """Each fused layer vLLM (and SGLang, under its own names: FUSED_ALIASES) builds from stored parts (qkv_proj from
    q/k/v_proj, ...) resolves to a config group of its parts' scheme: vLLM matches the fused layer's class name
    against "Linear" before its parts' names, so an FP8 group naming only q/k/v_proj beside an INT group targeting
    "Linear" builds qkv_proj as INT4 over FP8 weights (and groups naming q_proj and k/v_proj apart, both group 128,
    beside a group-32 "Linear" build it at group 32)."""
    def stored_group(m: Module) -> Group | None:  # as check_structure reads each part
        return group_for(m.name, groups) if m.is_int else float_group_for(m.name, groups) if m.is_fp8 else None

    # (routed experts excepted: loaders build a layer's experts as one FusedMoE, not as gate_up_proj layers)
    for parent in sorted({name.rpartition(".")[0] for name in modules if not EXPERT_MODULE.match(name)}):
        for parts, fused in FUSED_NAMES.items():
            mods = [modules.get(f"{parent}.{p}") for p in parts]
            if any(m is None for m in mods):
                continue
            stored = [stored_group(m) for m in mods]
            # BF16 (ignored), or parts of two schemes: check_structure / serving's _check_partners say so
            if None in stored or len({scheme_of(g) for g in stored}) != 1:
                continue
            names = ", ".join(dict.fromkeys(g.name for g in stored))
            for name in (fused, *FUSED_ALIASES.get(fused, ())):
                g = fused_layer_group(f"{parent}.{name}", groups)
                if g is not None and scheme_of(g) != scheme_of(stored[0]):
                    res.fail(f"{parent}.{name}: {'vLLM' if name == fused else 'SGLang'} fuses {', '.join(parts)} into "
                             f"this layer and gives it {g.name} ({scheme_label(g)}), matched before its parts' names, "
                             f"but its parts are stored under {names} ({scheme_label(stored[0])}): add "
                             f"`re:^{re.escape(parent + '.' + name)}$` (or a pattern over the layers) to "
                             f"{stored[0].name}'s targets", tensor=f"{parent}.{parts[0]}", shard=mods[0].shard())


_KV_SCALES = ("k_scale", "v_scale")  # a compressed-tensors FP8 KV cache's per-layer scales (vLLM's kv_cache_scheme)


_LAYOUT_SHOWN = 20  # layout problems reported one by one; the rest as a count (a config that names another model)


def _check_experts(modules: dict[str, Module], config: dict, res: CheckResult) -> None:
    """Every MoE layer holds all n_routed_experts x (gate, up, down), and no expert beyond them. A model without any
    tensor of its MTP layer(s) is served (vLLM and SGLang build the main model and skip the layer; `glmq quantize`
    converts such a source: plan.py takes the same rule, mtp_stored), with a warning: MTP drafting cannot run."""
    note = mtp_absent(modules, config)
    absent = note is not None
    if absent:
        res.warn(note)
    for where, problem in expert_layout_problems(modules, config, mtp_required=not absent):
        res.fail(f"{where}: {problem}", tensor=where)
