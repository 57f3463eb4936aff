"""Recipe loading: every key type-checked at load, and targets that can never be served refused there.

A wrongly typed value (num_bits: 4.0, keep_fp8: "false") or an unservable target (router) used to pass the
loader and `glmq plan`, then fail part-way through `glmq quantize` or only at `glmq validate`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from glmq import recipes
from glmq.formats.families import LINEAR_CLASSES, TensorClass, classify
from glmq.quantize import spec as quant_spec
from glmq.quantize.spec import QuantSpec

BASE = yaml.safe_load((recipes.RECIPE_DIR / "int4-w4a16.yaml").read_text())


def write(tmp_path: Path, **change) -> Path:
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump({**BASE, **change}))
    return p


def test_shipped_recipes_load():
    assert recipes.available()
    for name in recipes.available():
        r = recipes.load(name)
        assert r.targets and not set(r.targets) & {TensorClass.ROUTER, TensorClass.INDEXER}
        assert isinstance(r.spec.num_bits, int) and isinstance(r.keep_fp8, bool) and isinstance(r.name, str)


def test_every_key_has_a_checked_type():
    assert set(quant_spec.FIELD_TYPES) == {f.name for f in dataclasses.fields(QuantSpec)}
    assert set(recipes.KEY_TYPES) | {"targets"} == {"name", "description", "targets", "keep_fp8"} | set(quant_spec.FIELD_TYPES)


# key, wrong value, words the error must contain (besides the file name, the key and the value)
WRONG = [
    ("num_bits", 4.0, "whole number", "`num_bits: 4`"),
    ("group_size", 128.0, "whole number", "`group_size: 128`"),
    ("block_size", 64.0, "whole number", "`block_size: 64`"),
    ("num_bits", "4", "whole number", "`num_bits: 4`"),
    ("cd_sweeps", True, "whole number", "cd_sweeps"),
    ("tune_iters", 2.5, "whole number", "tune_iters"),
    ("symmetric", "false", "true or false, without quotes", "`symmetric: false`"),
    ("full_range", "false", "true or false, without quotes", "`full_range: false`"),
    ("act_order", "no", "true or false, without quotes", "`act_order: false`"),
    ("tune_experts", 1, "true or false, without quotes", "tune_experts"),
    ("keep_fp8", "false", "true or false, without quotes", "`keep_fp8: false`"),
    ("damp", True, "a number", "damp"),
    ("damp", "0.1", "a number", "`damp: 0.1`"),
    ("tune_lr", True, "a number, or null", "tune_lr"),
    ("method", 1, "a string", "method"),
    ("clip_objective", None, "a string", "clip_objective"),
    ("name", None, "a string", "`name: my-recipe`"),
    ("name", 2024, "a string", '`name: "2024"`'),
    ("description", ["x"], "a string", "description"),
]


@pytest.mark.parametrize("key,value,expected,fix", WRONG, ids=[f"{k}={v!r}" for k, v, _, _ in WRONG])
def test_wrongly_typed_value_is_refused_at_load_naming_file_key_value_and_fix(tmp_path, key, value, expected, fix):
    p = write(tmp_path, **{key: value})
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(p))
    msg = str(e.value)
    assert str(p) in msg and repr(key) in msg and repr(value) in msg and expected in msg and fix in msg, msg


@pytest.mark.parametrize("targets", ["routed_expert", [], [1], None])
def test_targets_must_be_a_list_of_class_names(tmp_path, targets):
    with pytest.raises(recipes.RecipeError, match=r"mine\.yaml: .*targets.*\[routed_expert\]"):
        recipes.load(str(write(tmp_path, targets=targets)))


def test_well_typed_values_load(tmp_path):
    # an int where a float is documented, null for tune_lr, YAML's unquoted yes/no booleans
    p = tmp_path / "ok.yaml"
    p.write_text("name: ok\ntargets: [routed_expert]\nnum_bits: 8\ngroup_size: 64\nsymmetric: no\nfull_range: no\n"
                 "damp: 0\ntune_lr: null\nact_order: yes\nkeep_fp8: true\nmethod: gptq\n")
    r = recipes.load(str(p))
    assert (r.spec.num_bits, r.spec.group_size, r.spec.symmetric, r.spec.damp, r.spec.act_order) == (8, 64, False, 0, True)
    assert r.keep_fp8 is True and r.spec.tune_lr is None and r.spec.method.value == "gptq"
    assert recipes.load(str(write(tmp_path, tune_lr=1, tune_iters=10))).spec.tune_lr == 1


def test_quantspec_checks_types_on_construction():
    with pytest.raises(ValueError, match=r"num_bits must be a whole number .*got 4\.0 \(float\)"):
        QuantSpec(num_bits=4.0)
    with pytest.raises(ValueError, match="symmetric must be true or false"):
        QuantSpec(symmetric="false")
    with pytest.raises(ValueError, match=r"method must be one of \('rtn', 'gptq'\)"):
        QuantSpec(method="RTN")
    spec = QuantSpec(num_bits=np.int64(4), group_size=np.int32(64))  # numpy integers: accepted, stored as int
    assert type(spec.num_bits) is int and type(spec.group_size) is int


@pytest.mark.parametrize("lr", [".inf", ".nan", "-0.1", "0.0"])
def test_tune_lr_must_be_positive_and_finite(tmp_path, lr):
    p = tmp_path / "r.yaml"
    p.write_text(f"targets: [routed_expert]\ntune_iters: 4\ntune_lr: {lr}\n")
    with pytest.raises(recipes.RecipeError, match="tune_lr must be a positive finite number"):
        recipes.load(str(p))


def test_cli_refuses_a_float_num_bits_before_writing_anything(tmp_path):
    from glmq.scripts.cli import main

    p, out = write(tmp_path, num_bits=4.0), tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", "-m", str(tmp_path / "no-model"), "-r", str(p), "-o", str(out),
                                  "--no-progress"])
    assert r.exit_code == 2 and "'num_bits' is 4.0" in r.output and "Traceback" not in r.output, r.output
    assert not out.exists()
    r = CliRunner().invoke(main, ["plan", "-m", str(tmp_path / "no-model"), "-r", str(p)])
    assert r.exit_code != 0 and "'num_bits' is 4.0" in r.output, r.output


# ----------------------------------------------------------------------------------------- targets
def test_a_recipe_whose_targets_match_nothing_is_refused_before_writing(make_ckpt, tmp_path):
    """Targets present in no weight of the checkpoint (dense_mlp on a model whose every layer is MoE) wrote a
    valid-looking "pack-quantized" checkpoint of BF16 weights, larger than the FP8 source, that validate passed."""
    from glmq.scripts.cli import main

    src = make_ckpt("glm4_moe", config_overrides={"first_k_dense_replace": 0})
    p, out = tmp_path / "dense-only.yaml", tmp_path / "out"
    p.write_text("targets: [dense_mlp]\n")
    r = CliRunner().invoke(main, ["quantize", "-m", str(src), "-r", str(p), "-o", str(out), "--no-progress"])
    assert r.exit_code == 1 and "quantizes nothing" in r.output and "'dense_mlp'" in r.output, r.output
    assert "routed_expert" in r.output and "'router'" not in r.output, r.output  # offers only classes a recipe may name
    assert not out.exists()


def test_unservable_targets_are_the_layers_the_serving_check_always_refuses():
    from glmq.quantize.validate.serving import NO_QUANT_LAYERS

    # every leaf the serving check refuses at any tp and shape belongs to a refused class, and each refused class
    # has such a leaf (mlp.gate: the router; indexer.wk / weights_proj: present in every DSA indexer; eh_proj: the MTP
    # layer's input projection)
    leaf_class = {"gate": classify("model.layers.3.mlp.gate"), "wk": classify("model.layers.3.self_attn.indexer.wk"),
                  "weights_proj": classify("model.layers.3.self_attn.indexer.weights_proj"),
                  "eh_proj": classify("model.layers.78.eh_proj")}
    assert set(leaf_class) == set(NO_QUANT_LAYERS)
    assert set(leaf_class.values()) == set(recipes.UNSERVABLE_TARGETS) == UNSERVABLE


UNSERVABLE = {TensorClass.ROUTER, TensorClass.INDEXER, TensorClass.MTP_PROJ}


@pytest.mark.parametrize("cls,leaf", [("router", "gate"), ("indexer", "wk"), ("mtp_proj", "eh_proj")])
def test_router_and_indexer_targets_are_refused_at_load(tmp_path, cls, leaf):
    from glmq.quantize.validate.serving import NO_QUANT_LAYERS

    p = write(tmp_path, targets=["routed_expert", cls])
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(p))
    msg = str(e.value)
    assert str(p) in msg and "'targets'" in msg and repr(cls) in msg and "any tensor-parallel degree" in msg, msg
    assert NO_QUANT_LAYERS[leaf] in msg and "Remove it from targets" in msg, msg


@pytest.mark.parametrize("cls", sorted(c.value for c in LINEAR_CLASSES - UNSERVABLE))
def test_classes_servable_under_some_shapes_still_load(tmp_path, cls):
    # lm_head, attention, ...: the serving check only applies shape rules to them
    assert [t.value for t in recipes.load(str(write(tmp_path, targets=[cls]))).targets] == [cls]


@pytest.mark.parametrize("targets", ["routed_expert", [], ["experts"]])
def test_target_errors_offer_only_classes_a_recipe_may_name(tmp_path, targets):
    """The list of choices in a targets error held router and indexer, which the loader then refuses."""
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(write(tmp_path, targets=targets)))
    msg = str(e.value)
    assert "'routed_expert'" in msg and "'shared_expert'" in msg, msg
    assert "'router'" not in msg and "'indexer'" not in msg, msg


# ----------------------------------------------------------------------------------------- files
def test_recipe_file_without_a_yaml_suffix_is_named_as_such_not_as_missing(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(yaml.safe_dump(BASE))
    with pytest.raises(recipes.RecipeError, match=r"must end in \.yaml or \.yml; rename it") as e:
        recipes.load(str(p))
    assert "no such file" not in str(e.value)
    with pytest.raises(recipes.RecipeError, match="no such file and not a shipped recipe"):
        recipes.load(str(tmp_path / "absent.yaml"))


def test_unreadable_recipe_file_is_a_recipe_error_naming_it(tmp_path):
    """A folder named *.yaml was a traceback (IsADirectoryError), a binary file an error without the file's name."""
    from glmq.scripts.cli import main

    folder, binary = tmp_path / "d.yaml", tmp_path / "b.yaml"
    folder.mkdir()
    binary.write_bytes(b"\xff\xfe\x00")
    for p in (folder, binary):
        with pytest.raises(recipes.RecipeError, match=f"{p}: cannot read it as a recipe"):
            recipes.load(str(p))
        r = CliRunner().invoke(main, ["plan", "-m", str(tmp_path / "no-model"), "-r", str(p)])
        assert r.exit_code == 2 and f"error: {p}: cannot read it" in r.output, (r.output, r.exception)


def test_a_recipe_file_with_an_upper_case_suffix_loads(tmp_path):
    """`--recipe MY.YAML` was refused: "a recipe file's name must end in .yaml or .yml; rename it"."""
    for name in ("MY.YAML", "mine.Yml"):
        p = tmp_path / name
        p.write_text((recipes.RECIPE_DIR / "int4-w4a16.yaml").read_text().replace("name: int4-w4a16", "name: mine"))
        assert recipes.load(str(p)).name == "mine"


def test_tune_keys_without_tune_iters_warn(tmp_path, caplog):
    """tune_lr / tune_reference / tune_experts do nothing while tune_iters is 0: a recipe setting one away from its
    default is told so (it was dropped without a word); at their defaults (a Recipe.to_dict dump) nothing is said."""
    base = recipes.load("int4-w4a16").to_dict()
    quiet = tmp_path / "dump.yaml"
    quiet.write_text(yaml.safe_dump(base))
    with caplog.at_level(logging.WARNING, logger="glmq.recipes"):
        recipes.load(str(quiet))
    assert not caplog.records
    idle = tmp_path / "idle.yaml"
    idle.write_text(yaml.safe_dump({**base, "tune_lr": 0.01, "tune_reference": "source"}))
    with caplog.at_level(logging.WARNING, logger="glmq.recipes"):
        r = recipes.load(str(idle))
    assert r.spec.tune_iters == 0
    (msg,) = [rec.getMessage() for rec in caplog.records]
    assert str(idle) in msg and "tune_lr, tune_reference set but tune_iters is 0" in msg and "tune_iters: 200" in msg
    caplog.clear()
    on = tmp_path / "on.yaml"
    on.write_text(yaml.safe_dump({**base, "tune_lr": 0.01, "tune_iters": 5}))
    with caplog.at_level(logging.WARNING, logger="glmq.recipes"):
        assert recipes.load(str(on)).spec.tune_iters == 5
    assert not caplog.records


def test_a_recipe_without_targets_says_the_key_is_missing(tmp_path):
    """It said "targets [] invalid", a list the file does not have."""
    f = tmp_path / "r.yaml"
    f.write_text("name: r\nnum_bits: 4\n")
    with pytest.raises(recipes.RecipeError, match=r"r\.yaml: key 'targets' is missing; .*targets: \[routed_expert\]"):
        recipes.load(str(f))
