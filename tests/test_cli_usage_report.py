"""`glmq validate --json FILE` when click refuses the arguments: the report is replaced by a "could not run" one."""
import json

import pytest
from click.testing import CliRunner

from glmq.scripts.cli import _json_arg, main


@pytest.mark.parametrize("args", [["nope", "--sample", "2"], ["--tp", "0", "nope"], ["--bogus", "nope"], []])
@pytest.mark.parametrize("form", ["split", "equals"])
def test_refused_arguments_replace_an_earlier_json_report(tmp_path, args, form):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"valid": True, "exit_code": 0}))  # an earlier run's verdict
    opt = ["--json", str(report)] if form == "split" else [f"--json={report}"]
    r = CliRunner().invoke(main, ["validate", *opt, *args])
    assert r.exit_code == 2, r.output
    doc = json.loads(report.read_text())
    assert doc["valid"] is None and doc["exit_code"] == 2 and doc["error"]


def test_refused_arguments_without_json_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, ["validate", "nope", "--sample", "2"]).exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_json_arg_takes_the_last_value_and_stops_at_double_dash():
    assert _json_arg(["--json", "a", "x", "--json=b"]) == "b"
    assert _json_arg(["--json=a", "--", "--json", "b"]) == "a"
    assert _json_arg(["--json"]) is None


def test_a_recipe_folder_is_named_a_folder(tmp_path):
    """`--recipe SOMEFOLDER` said "no such file" of a folder that is there."""
    from glmq import recipes

    with pytest.raises(recipes.RecipeError, match="is a folder; pass a recipe's .yaml file in it"):
        recipes.load(str(tmp_path))
