"""The one place that speaks compressed-tensors: recipe -> `quantization_config`, ignore lists.

The config is built with compressed-tensors' own pydantic models (so it parses with the installed
version), then reduced to the key set that every compressed-tensors release vLLM and SGLang may ship
accepts: `QuantizationArgs`/`QuantizationScheme` are `extra="forbid"`, and `scale_dtype`/`zp_dtype`
exist only from 0.13 on (formats.md §2d), so they are dropped.
"""

from __future__ import annotations

from compressed_tensors import __version__ as CT_VERSION
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

import functools
import json
import re
import sys

from glmq.formats.families import IGNORE_PATTERNS, TensorClass, ignore_list  # noqa: F401  (ignore_list re-exported)
from glmq.quantize.spec import QuantSpec

# QuantizationArgs keys present in every compressed-tensors release from 0.9 to 0.20
_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
              "actorder", "observer", "observer_kwargs")
_SCHEME_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
_TOP_KEYS = ("config_groups", "quant_method", "kv_cache_scheme", "format", "quantization_status",
             "global_compression_ratio", "ignore")
# group_0's target naming the routed experts in a mixed-precision config: transformers (get_experts_scheme) takes the
# first group with a `re:` target containing "experts" as the fused experts' scheme, and the FP8 group's exact
# targets name `mlp.shared_experts.*`; without this, transformers looked for FP8 `.weight`s of INT4 experts.
_EXPERTS_TARGET = IGNORE_PATTERNS[TensorClass.ROUTED_EXPERT][0]


def quantization_args(spec: QuantSpec) -> QuantizationArgs:
    """The single translation of a QuantSpec into compressed-tensors terms."""
    return QuantizationArgs(num_bits=spec.num_bits, type="int", symmetric=spec.symmetric, strategy="group",
                            group_size=spec.group_size, dynamic=False, actorder=None, observer="minmax")


def _fp8_block_scheme(targets: list[str], block: tuple[int, int] = (128, 128)) -> QuantizationScheme:
    """The FP8 group of kept source blocks: `block` is the source's (rows, cols), whose scales are stored as they are;
    activations quantized per token in groups of the block's columns, as the source's own (DeepSeek) scheme runs."""
    return QuantizationScheme(
        targets=targets,
        weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                 block_structure=list(block), dynamic=False, observer="static_minmax"),
        input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                           group_size=block[1], dynamic=True, observer=None),
        format="float-quantized",
    )


def _strip_args(d: dict | None) -> dict | None:
    return None if d is None else {k: d[k] for k in _ARGS_KEYS if k in d}


def _strip_scheme(d: dict) -> dict:
    out = {k: d.get(k) for k in _SCHEME_KEYS}
    for k in ("weights", "input_activations", "output_activations"):
        out[k] = _strip_args(out[k])
    return out


def build_config(spec: QuantSpec, ignore: list[str], keep_fp8_targets: list[str] | None = None,
                 int_targets: list[str] | None = None, kv_cache_scheme: dict | None = None,
                 fp8_block: tuple[int, int] = (128, 128)) -> dict:
    """The `quantization_config` dict for config.json.

    Args:
        spec: the INT weight spec of group_0 (targets "Linear": the literal target older vLLM and
            SGLang look up; everything not quantized is excluded through `ignore`).
        ignore: anchored `re:` patterns / exact names of unquantized Linear modules.
        keep_fp8_targets: module regexes kept in FP8-block form (group_1, float-quantized); the
            top-level format then becomes "mixed-precision".
        int_targets: group_0's targets after "Linear" (modules it holds, named for loaders that look a scheme up
            by name; `config_from_request`).
        kv_cache_scheme: the source's FP8 KV-cache scheme (a compressed-tensors source's), carried over with its
            `k_scale` / `v_scale` tensors: without it vLLM creates no KV-scale parameters and skips the stored ones.
    """
    groups = {"group_0": QuantizationScheme(targets=["Linear", *(int_targets or [])], weights=quantization_args(spec),
                                            format="pack-quantized")}
    if keep_fp8_targets:
        groups["group_1"] = _fp8_block_scheme(keep_fp8_targets, fp8_block)
    fmt = "mixed-precision" if keep_fp8_targets else "pack-quantized"
    kv = None if kv_cache_scheme is None else QuantizationArgs.model_validate(_strip_args(kv_cache_scheme))
    qc = QuantizationConfig(config_groups=groups, quant_method="compressed-tensors", format=fmt,
                            quantization_status="compressed", ignore=ignore, kv_cache_scheme=kv)
    d = qc.model_dump()
    out = {k: d.get(k) for k in _TOP_KEYS}
    out["config_groups"] = {name: _strip_scheme(g) for name, g in d["config_groups"].items()}
    out["kv_cache_scheme"] = _strip_args(d.get("kv_cache_scheme"))
    out["sparsity_config"] = {}
    out["transform_config"] = {}
    out["version"] = CT_VERSION
    return out


def is_ignored(module: str, ignore: list[str]) -> bool:
    """Whether a module matches an ignore entry, as compressed-tensors' `match_name` (and the loaders) match: an
    exact name, or `re:` + a regex matched at the start (`re.match`).

    The regexes are compiled once per list: `match_name` hands each to `re.match`, whose cache holds 512 patterns,
    so a list longer than that (a GLM-5 keep_fp8 config's ~550 exact FP8 targets) recompiled every pattern for
    every module, 15 minutes and more for a GLM-5 plan, past ConfigJob's 10-minute wait (and in `glmq validate`)."""
    exact, regexes = _compiled(tuple(ignore))
    return module in exact or any(r.match(module) for r in regexes)


@functools.lru_cache(maxsize=1024)
def _compiled(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[re.Pattern[str], ...]]:
    return (frozenset(p for p in patterns if not p.startswith("re:")),
            tuple(re.compile(p.removeprefix("re:")) for p in patterns if p.startswith("re:")))


def config_from_request(req: dict) -> dict:
    """Build the quantization_config and check the ignore list against every Linear module.

    Args:
        req: {"spec": QuantSpec fields, "ignore": [...], "keep": [...], "modules": {name: plan action}, and
            optionally "kv_cache_scheme": the source's, "fp8_block": the kept FP8 blocks' [rows, cols] (128x128)}.
    Raises:
        ValueError: a module's stored form disagrees with what loaders will read from the config: a quantized
            module must match neither list, a module kept FP8 the keep list only (ignore is applied first, so an
            ignored FP8 module would load as an unquantized Linear), any other module the ignore list only.
    """
    spec = QuantSpec(**req["spec"])
    ignore, keep = req["ignore"], req["keep"]
    for module, action in req["modules"].items():
        want = {"quantize": (False, False), "keep_fp8": (False, True)}.get(action, (True, False))
        got = (is_ignored(module, ignore), is_ignored(module, keep))
        if got != want:
            raise ValueError(f"internal: the config disagrees with the plan for {module} ({action}): "
                             f"ignored={got[0]}, kept FP8={got[1]}")
    # routed experts all INT4 (the ignored aside) beside an FP8 group: group_0 names them (_EXPERTS_TARGET)
    experts = {a for m, a in req["modules"].items() if is_ignored(m, [_EXPERTS_TARGET]) and not is_ignored(m, ignore)}
    int_targets = [_EXPERTS_TARGET] if keep and experts == {"quantize"} else []
    return build_config(spec, ignore, keep or None, int_targets, req.get("kv_cache_scheme"),
                        tuple(req.get("fp8_block") or (128, 128)))


def main() -> None:
    """`python -m glmq.formats.compressed_tensors`: request JSON on stdin -> config JSON on stdout.

    The converter runs this in a child process at the start of a run: importing compressed-tensors
    (which imports transformers) costs seconds of pure-Python work that would otherwise hold the GIL
    the conversion pipeline needs.
    """
    from glmq.quantize.config_child import PEAK_KEY

    doc = config_from_request(json.load(sys.stdin))
    json.dump({**doc, PEAK_KEY: _own_peak_rss()}, sys.stdout)


def _own_peak_rss() -> int | None:
    """This process's VmHWM (Linux): its own peak, where ru_maxrss would carry the parent's resident set at the fork."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


if __name__ == "__main__":
    main()
