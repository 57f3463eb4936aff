"""User-written recipe files at their edges: keys given twice, keys that are not strings, llm-compressor recipes,
and recipe names that would move the default output folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from glmq import recipes


def _write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_key_given_twice_is_refused_not_silently_the_last(tmp_path):
    """safe_load kept the last value: `group_size: 32` then `group_size: 128` quantized at 128 without a word."""
    p = _write(tmp_path, "targets: [routed_expert]\ngroup_size: 32\nsymmetric: true\ngroup_size: 128\n")
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(p))
    msg = str(e.value)
    assert str(p) in msg and "'group_size' is given twice (lines 2 and 4)" in msg and "Remove one" in msg, msg


def test_yaml_merge_keys_still_override_without_error(tmp_path):
    """`<<: *anchor` followed by the same key is an override the YAML author asked for, not a duplicate."""
    p = _write(tmp_path, "targets: [routed_expert]\ngroup_size: 64\n")
    assert recipes.load(str(p)).spec.group_size == 64
    d = yaml.load("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n", Loader=recipes._UniqueKeyLoader)
    assert d["b"] == {"x": 3, "y": 2}


def test_unknown_keys_of_mixed_types_are_a_recipe_error_not_a_typeerror(tmp_path):
    """`4: bits` beside another unknown key: sorting [4, 'foo'] raised TypeError, a traceback in the CLI."""
    from glmq.scripts.cli import main

    p = _write(tmp_path, "targets: [routed_expert]\nfoo: 1\n4: bits\n")
    with pytest.raises(recipes.RecipeError, match=r"unknown key\(s\) \[4, 'foo'\]"):
        recipes.load(str(p))
    r = CliRunner().invoke(main, ["plan", "-m", str(tmp_path / "no-model"), "-r", str(p)])
    assert r.exit_code == 2 and "unknown key(s) [4, 'foo']" in r.output, (r.output, r.exception)


LLMC = {
    "stages": "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      targets: [Linear]\n"
              "      ignore: [lm_head]\n      scheme: W4A16\n",
    "flat": "targets: [Linear]\nscheme: W4A16\nignore: [lm_head]\n",
}


@pytest.mark.parametrize("kind", sorted(LLMC))
def test_an_llm_compressor_recipe_is_told_how_to_write_it_for_glmq(tmp_path, kind):
    p = _write(tmp_path, LLMC[kind])
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(p))
    msg = str(e.value)
    assert str(p) in msg and "unknown key" in msg and "llm-compressor recipe" in msg, msg
    assert "`targets: [routed_expert]`" in msg and "`num_bits: 4`" in msg and "`group_size: 128`" in msg, msg


def test_an_ordinary_unknown_key_gets_no_llm_compressor_hint(tmp_path):
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(_write(tmp_path, "targets: [routed_expert]\ngroupsize: 64\n")))
    assert "unknown key(s) ['groupsize']" in str(e.value) and "llm-compressor" not in str(e.value)


@pytest.mark.parametrize("name,fix", [("w4/g128", "w4-g128"), ("", "my-recipe"), ("  ", "my-recipe"),
                                      ("a\\b", "a-b")])
def test_a_recipe_name_that_is_not_a_folder_name_is_refused(tmp_path, name, fix):
    """`name: w4/g128` made the default output `<model>-w4/g128`, a sub-folder, not a folder in the working directory
    as --output's help says; `name: ""` made `<model>-`."""
    p = _write(tmp_path, yaml.safe_dump({"name": name, "targets": ["routed_expert"]}))
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(p))
    msg = str(e.value)
    assert str(p) in msg and f"key 'name' is {name!r}" in msg and f"`name: {fix}`" in msg, msg


def test_default_output_stays_in_the_working_directory(make_ckpt, tmp_path, monkeypatch):
    from glmq.scripts.cli import main

    src = make_ckpt("glm_moe_dsa", "fp8-block")
    monkeypatch.chdir(tmp_path)
    p = _write(tmp_path, "name: w4/g128\ntargets: [routed_expert]\n")
    r = CliRunner().invoke(main, ["quantize", "-m", str(src), "-r", str(p), "--no-progress"])
    assert r.exit_code == 2 and "key 'name' is 'w4/g128'" in r.output, (r.output, r.exception)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["mine.yaml"]
    # a plain name, and the file's stem when there is none, still load
    assert recipes.load(str(_write(tmp_path, "name: w4-g128\ntargets: [routed_expert]\n"))).name == "w4-g128"
    assert recipes.load(str(_write(tmp_path, "targets: [routed_expert]\n", "my-g128.yaml"))).name == "my-g128"
