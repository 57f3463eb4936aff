"""Recipes: flat YAML files that map 1:1 onto `Recipe` (and its `QuantSpec`); unknown keys are errors.

A recipe is resolved by name (a file `recipes/<name>.yaml` shipped with glmq) or by path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from glmq.formats.families import LINEAR_CLASSES, TensorClass
from glmq.quantize.spec import Method, QuantSpec

RECIPE_DIR = Path(__file__).resolve().parent
_SPEC_FIELDS = {f.name for f in dataclasses.fields(QuantSpec)}


class RecipeError(ValueError):
    pass


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


def from_dict(d: dict, origin: str) -> Recipe:
    allowed = {"name", "description", "targets", "keep_fp8"} | _SPEC_FIELDS
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise RecipeError(f"{origin}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}")
    try:
        targets = tuple(TensorClass(t) for t in d.get("targets", []))
    except ValueError as e:
        raise RecipeError(f"{origin}: {e}; targets are among {sorted(c.value for c in LINEAR_CLASSES)}") from None
    bad = [t.value for t in targets if t not in LINEAR_CLASSES]
    if bad or not targets:
        raise RecipeError(f"{origin}: targets {bad or '[]'} invalid; choose among {sorted(c.value for c in LINEAR_CLASSES)}")
    try:
        spec = QuantSpec(**{k: d[k] for k in _SPEC_FIELDS if k in d})
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{origin}: {e}") from None
    return Recipe(str(d.get("name", Path(origin).stem)), targets, spec, bool(d.get("keep_fp8", False)),
                  str(d.get("description", "")))


def load(name_or_path: str) -> Recipe:
    """Resolve a recipe by shipped name or by path to a YAML file."""
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") and p.exists()):
        p = RECIPE_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        raise RecipeError(f"recipe {name_or_path!r}: no such file and not a shipped recipe ({', '.join(available())})")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise RecipeError(f"{p}: a recipe is a mapping of keys to values")
    return from_dict(d, str(p))
