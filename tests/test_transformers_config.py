"""GPTQ and `glmq eval` run the model through transformers' own classes; config.json settings those classes do not
honour (a softmax router, greedy top-k, no shared experts) are refused before any work, naming the key: before,
GPTQ ran a sigmoid router over a softmax model (output bit-identical to the sigmoid model's), or failed after layer 0
(n_shared_experts 0), or with a raw traceback (null)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from glmq.calibration.layers import transformers_config_problems
from glmq.scripts.cli import main


@pytest.mark.parametrize("overrides, needle", [
    ({"scoring_func": "softmax"}, "scoring_func is 'softmax': transformers' router scores by sigmoid only"),
    ({"topk_method": "greedy"}, "topk_method is 'greedy'"),
    ({"n_shared_experts": 0}, "n_shared_experts is 0"),
    ({"n_shared_experts": None}, "n_shared_experts is None"),
])
def test_gptq_and_eval_refuse_a_config_transformers_cannot_run_as_served(make_ckpt, tmp_path, overrides, needle):
    src = make_ckpt("deepseek_v3", config_overrides=overrides)
    (tmp_path / "calib.txt").write_text("some text to calibrate on. " * 50)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["quantize", "-m", str(src), "-o", str(out), "--scheme", "gptq", "--calibration",
                                  str(tmp_path / "calib.txt"), "--samples", "2", "--seq-len", "16", "--no-progress"])
    assert r.exit_code == 1 and needle in r.output and "convert it with RTN" in r.output, r.output
    assert "Traceback" not in r.output and not out.exists()
    r = CliRunner().invoke(main, ["eval", str(src), str(src), "--text", str(tmp_path / "calib.txt")])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output


def test_the_shipped_families_configs_pass():
    from pathlib import Path
    import json

    configs = Path(__file__).resolve().parents[1] / "scripts" / "configs"
    for name in ("glm-5.2", "glm-4.7", "kimi-k2"):
        assert transformers_config_problems(json.loads((configs / f"{name}-config.json").read_text())) == [], name
