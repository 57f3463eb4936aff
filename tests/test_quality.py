"""Quality on the shared trained GLM-4.x MoE (../shared/models/glm4moe-prose-fp8)."""

from __future__ import annotations

import pytest
import torch

from glmq import recipes
from glmq.calibration.evaluate import load_model, log_probs, mean_kl, perplexity, token_windows
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan

# shared/models/README.md: FP8 source 3.911, routed experts RTN INT4 g128 3.934 (first 96 windows of
# 256 tokens of prose-eval.txt, float32, transformers).
README_FP8_PPL = 3.911
README_RTN_EXPERTS_PPL = 3.934


@pytest.mark.slow
def test_int4_w4a16_perplexity_moves_no_more_than_the_readme_rtn_figure(shared_model, tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "int4"
    stream.run(make_plan(open_source(shared_model), recipes.load("int4-w4a16")), out, progress=False)
    windows = token_windows(shared_model, shared_model.parent / "prose-eval.txt", 256, 96)
    lp_src = log_probs(load_model(shared_model), windows)
    lp_q = log_probs(load_model(out), windows)
    ppl_src, ppl_q = perplexity(lp_src, windows), perplexity(lp_q, windows)
    kl = mean_kl(lp_src, lp_q)
    print(f"FP8 ppl {ppl_src:.4f}  INT4 experts ppl {ppl_q:.4f}  KL {kl:.5f}")
    assert abs(ppl_src - README_FP8_PPL) < 0.001, "evaluation protocol differs from the README's"
    assert ppl_q - ppl_src <= README_RTN_EXPERTS_PPL - README_FP8_PPL + 1e-4
    assert 0 < kl < 0.02
