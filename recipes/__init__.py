"""Recipes: flat YAML files that map 1:1 onto `Recipe` (and its `QuantSpec`); unknown keys are errors.

A recipe is resolved by name (a file `recipes/<name>.yaml` shipped with glmq) or by path.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from glmq.formats.families import LINEAR_CLASSES, TensorClass
from glmq.quantize.spec import FIELD_TYPES, Method, QuantSpec, type_mismatch

RECIPE_DIR = Path(__file__).resolve().parent
_SPEC_FIELDS = {f.name for f in dataclasses.fields(QuantSpec)}
# The type of every recipe key but `targets` (spec.type_mismatch's kinds), checked at load so that a wrongly typed
# value (num_bits: 4.0, keep_fp8: "false") is an error naming the file and key, not a crash half-way through.
KEY_TYPES = {"name": "str", "description": "str", "keep_fp8": "bool"} | FIELD_TYPES

# Target classes no serving engine can load quantized, whatever the tensor-parallel degree or the shapes: the
# serving check (quantize/validate/serving.py NO_QUANT_LAYERS; formats.md §3a) fails every checkpoint that has
# them quantized, so a recipe naming them is refused before a conversion is spent on it.
UNSERVABLE_TARGETS = {
    TensorClass.ROUTER: "vLLM's GateLinear router takes no quant_config (glm4_moe builds it as a float32 nn.Linear), "
                        "so a packed mlp.gate weight cannot load",
    TensorClass.INDEXER: "vLLM fuses indexer.wk + weights_proj with quant_config=None (an FP8/BF16-only load path), and "
                         "SGLang builds weights_proj without a quant_config, so a packed indexer cannot load",
    TensorClass.MTP_PROJ: "vLLM's and SGLang's MTP layers (deepseek_mtp, deepseek_nextn, glm4_moe_mtp) build eh_proj "
                          "as a plain nn.Linear, without a quant_config (SGLang's ReplicatedLinear only for Quark), so a "
                          "packed eh_proj cannot load",
}


class RecipeError(ValueError):
    pass


def _servable() -> list[str]:
    """The target classes a recipe may name (the ones an error message offers)."""
    return sorted(c.value for c in LINEAR_CLASSES - UNSERVABLE_TARGETS.keys())


@dataclass(frozen=True)
class Recipe:
    """What to quantize and how.

    Attributes:
        name: recipe name (written into the run manifest and the model card).
        targets: tensor classes whose Linear weights become INT; all other FP8 weights are
            dequantized to BF16 (or kept FP8 with keep_fp8) and listed in the config's ignore.
        spec: the weight quantization.
        keep_fp8: keep non-target FP8-block layers as FP8 in a `mixed-precision` config instead of
            dequantizing them to BF16 (smaller, but only recent vLLM/SGLang load it; formats.md §3c).
    """

    name: str
    targets: tuple[TensorClass, ...]
    spec: QuantSpec
    keep_fp8: bool = False
    description: str = ""

    def to_dict(self) -> dict:
        d = {"name": self.name, "description": self.description, "targets": [t.value for t in self.targets],
             "keep_fp8": self.keep_fp8}
        d.update({k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(self.spec).items()})
        return d

    def with_method(self, method: str | None) -> "Recipe":
        if method is None:
            return self
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, method=Method(method)))


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _example(kind: str, key: str, value: object) -> str:
    """A correct spelling of `key: value` for the fix hint: the value the user meant where that is clear."""
    if kind == "bool":
        return "false" if str(value).strip().lower() in ("false", "no", "off", "0", "n") else "true"
    try:
        number = float(value) if isinstance(value, (float, str)) else None
    except ValueError:
        number = None
    if kind == "int" and number is not None and number.is_integer():
        return str(int(number))
    if kind in ("float", "float?") and number is not None:
        return repr(number)
    if kind == "str" and value is not None:
        return f'"{value}"'  # e.g. name: 2024, which YAML reads as a number
    default = {f.name: f.default for f in dataclasses.fields(QuantSpec)}.get(key)
    return str(getattr(default, "value", default)) if default is not None else {
        "tune_lr": "0.0025", "name": "my-recipe", "description": "routed experts to INT4"}.get(key, "...")


def _check_types(d: dict, origin: str) -> None:
    for key in sorted(d):
        value = d[key]
        if key == "targets":
            if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
                raise RecipeError(f"{origin}: key 'targets' is {value!r}; expected a non-empty list of tensor class "
                                  f"names, e.g. `targets: [routed_expert]` (classes: {_servable()})")
            continue
        want = type_mismatch(KEY_TYPES[key], value)
        if want is not None:
            raise RecipeError(f"{origin}: key {key!r} is {value!r} ({type(value).__name__}); expected {want}: "
                              f"write e.g. `{key}: {_example(KEY_TYPES[key], key, value)}`")


# Keys of llm-compressor / compressed-tensors recipes (stages of modifiers, schemes, config groups, ignore lists), which
# users try as they are: the unknown-key error then says how glmq's flat recipe expresses the same thing.
_LLMC_KEYS = {"scheme", "schemes", "ignore", "config_groups", "quant_modifiers", "modifiers", "quantization_config",
              "QuantizationModifier", "GPTQModifier", "weights"}


def _llmc_hint(unknown: list[str]) -> str:
    if not any(str(k) in _LLMC_KEYS or str(k).endswith(("_stage", "_modifiers")) for k in unknown):
        return ""
    return ("; this looks like an llm-compressor recipe (stages of modifiers, `scheme`, `config_groups`, `ignore`), "
            "which glmq does not read. A glmq recipe is flat: list the tensor classes to quantize in `targets` "
            f"(every other Linear stays unquantized and is written to the config's ignore for you; classes: "
            f"{_servable()}) and set the weight format with `num_bits`, `group_size` and `symmetric`; e.g. W4A16 on "
            f"the routed experts: `targets: [routed_expert]`, `num_bits: 4`, `group_size: 128`, `symmetric: true` "
            f"(as in {RECIPE_DIR / 'int4-w4a16.yaml'})")


# Keys that only the layer tuning reads (QuantSpec.tune_iters > 0).
_TUNE_KEYS = ("tune_lr", "tune_reference", "tune_experts")


def from_dict(d: dict, origin: str) -> Recipe:
    allowed = {"name", "description", "targets", "keep_fp8"} | _SPEC_FIELDS
    unknown = sorted(set(d) - allowed, key=str)
    if unknown:
        raise RecipeError(f"{origin}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}{_llmc_hint(unknown)}")
    _check_types(d, origin)
    name = d.get("name", Path(origin).stem)
    if not name.strip() or "/" in name or "\\" in name:
        # it names the default output folder, `<model>-<name>` in the working directory: "w4/g128" wrote into a
        # sub-folder "<model>-w4/g128", "" gave "<model>-"
        fix = "-".join(x for x in name.replace("\\", "/").split("/") if x.strip(". ")) or "my-recipe"
        raise RecipeError(f"{origin}: key 'name' is {name!r}; a recipe name is part of the default output folder's "
                          f"name (<model>-<name>), so it must be a non-empty name without '/' or '\\': write e.g. "
                          f"`name: {fix}`")
    if "targets" not in d:
        raise RecipeError(f"{origin}: key 'targets' is missing; list the tensor classes to quantize, e.g. "
                          f"`targets: [routed_expert]` (classes: {_servable()})")
    try:
        targets = tuple(TensorClass(t) for t in d.get("targets", []))
    except ValueError as e:
        raise RecipeError(f"{origin}: {e}; targets are among {_servable()}") from None
    bad = [t.value for t in targets if t not in LINEAR_CLASSES]
    if bad or not targets:
        raise RecipeError(f"{origin}: targets {bad or '[]'} invalid; choose among {_servable()}")
    never = [t for t in targets if t in UNSERVABLE_TARGETS]
    if never:
        servable = _servable()
        raise RecipeError(f"{origin}: key 'targets' includes {never[0].value!r}, which cannot be served quantized at "
                          f"any tensor-parallel degree or shape: {UNSERVABLE_TARGETS[never[0]]} (glmq validate would "
                          f"fail the whole conversion). Remove it from targets (it then stays BF16, listed in the "
                          f"config's ignore); servable targets: {servable}")
    try:
        spec = QuantSpec(**{k: d[k] for k in _SPEC_FIELDS if k in d})
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{origin}: {e}") from None
    # tuning is off: a tune_* key set away from its default was read and dropped without a word (a recipe written by
    # Recipe.to_dict has every key, at its default)
    idle = [k for k in _TUNE_KEYS if k in d and getattr(spec, k) != getattr(QuantSpec, k)]
    if idle and not spec.tune_iters:
        logging.getLogger("glmq.recipes").warning(
            "%s: %s set but tune_iters is 0, so the layer tuning is off and %s no effect; set tune_iters: N (e.g. "
            "`tune_iters: 200`) to tune, or remove %s", origin, ", ".join(idle), "it has" if len(idle) == 1 else
            "they have", "it" if len(idle) == 1 else "them")
    return Recipe(name, targets, spec, d.get("keep_fp8", False), d.get("description", ""))


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: safe_load keeps the last value without a word, so
    `group_size: 32` followed later by `group_size: 128` quantized at 128."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys given after it override it on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node:
                raise _DuplicateKey(f"key {key!r} is given twice (lines {first.start_mark.line + 1} and "
                                    f"{key_node.start_mark.line + 1}); YAML would keep only the last one silently. "
                                    f"Remove one of them")
        return super().construct_mapping(node, deep)


def load(name_or_path: str) -> Recipe:
    """Resolve a recipe by shipped name or by path to a YAML file."""
    p = Path(name_or_path)
    if not (p.suffix.lower() in (".yaml", ".yml") and p.exists()):
        p = RECIPE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        shipped = ", ".join(available())
        if Path(name_or_path).is_file():  # was "no such file" for a file that is there
            raise RecipeError(f"recipe {name_or_path!r}: a recipe file's name must end in .yaml or .yml; rename it "
                              f"(shipped recipes: {shipped})")
        if Path(name_or_path).is_dir():
            raise RecipeError(f"recipe {name_or_path!r}: is a folder; pass a recipe's .yaml file in it or a shipped "
                              f"recipe's name ({shipped})")
        raise RecipeError(f"recipe {name_or_path!r}: no such file and not a shipped recipe ({shipped})")
    try:
        d = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise RecipeError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{p}: not valid YAML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, a binary file: was a traceback / a message without the file
        raise RecipeError(f"{p}: cannot read it as a recipe (a UTF-8 YAML file): {e}") from None
    if not isinstance(d, dict):
        raise RecipeError(f"{p}: a recipe is a mapping of keys to values")
    return from_dict(d, str(p))
