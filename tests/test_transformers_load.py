"""transformers loads glmq's INT4 output through its compressed-tensors integration."""

from __future__ import annotations

import pytest
import torch

from glmq import recipes
from glmq.calibration.evaluate import load_model
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan

transformers = pytest.importorskip("transformers")


def test_transformers_loads_int4_glm4_and_logits_stay_close(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", "fp8-block")
    out = tmp_path / "int4"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16")), out, progress=False)

    # the INT4 checkpoint, loaded by transformers itself (compressed-tensors decompresses it)
    quant = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    source = load_model(src, torch.float32)  # the FP8 source, dequantized by glmq's reader
    cfg = quant.config
    ids = torch.randint(0, cfg.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, ls = quant(ids).logits, source(ids).logits
    # 1. transformers' own decompression holds exactly glmq's dequantized experts. (In a float32 model it
    #    forms q * scale in float32, which is exact; glmq's bf16 product is that value rounded to bf16.)
    from glmq.formats.dense import iter_dense

    _assert_experts_are(quant, dict(iter_dense(out, torch.bfloat16)))
    # 2. Bound against the FP8 source. Only the routed experts changed; their relative RMS weight error
    #    is measured below (about 10 % for INT4 g128 on Gaussian weights: step = absmax/7.5 ~ 0.35 sigma,
    #    RMS error = step/sqrt(12)). Errors of independent weights add in quadrature through a forward
    #    pass, so the logits' relative error stays at or below the weight error; allow 1.5x for the
    #    amplification of a random (untrained) network. A wrong packing, scale or expert order gives
    #    errors of order 100 %.
    werr = _expert_weight_error(src, out)
    rel = ((lq - ls).norm() / (ls - ls.mean(-1, keepdim=True)).norm()).item()
    assert 0 < rel < 1.5 * werr, (rel, werr)


def _assert_experts_are(quant, ours: dict) -> None:
    """transformers' fused routed experts (gate_up_proj, down_proj) equal glmq's dense reading `ours` of each
    expert's Linears, compared in `ours`' dtype."""
    cfg = quant.config
    inter = cfg.moe_intermediate_size
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        experts = quant.model.layers[i].mlp.experts
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{i}.mlp.experts.{e}"
            dt = ours[f"{p}.down_proj.weight"].dtype
            assert torch.equal(experts.gate_up_proj[e][:inter].to(dt), ours[f"{p}.gate_proj.weight"])
            assert torch.equal(experts.gate_up_proj[e][inter:].to(dt), ours[f"{p}.up_proj.weight"])
            assert torch.equal(experts.down_proj[e].to(dt), ours[f"{p}.down_proj.weight"])


def _expert_weight_error(src, out) -> float:
    from glmq.formats.dense import iter_dense

    a = {k: v for k, v in iter_dense(src, torch.float32) if ".experts." in k}
    b = {k: v for k, v in iter_dense(out, torch.float32) if ".experts." in k}
    num = sum(((a[k] - b[k]) ** 2).sum() for k in a)
    den = sum((a[k] ** 2).sum() for k in a)
    return (num / den).sqrt().item()


def test_transformers_loads_keep_fp8_int4_experts_beside_fp8_shared_experts(make_ckpt, tmp_path):
    """keep_fp8 (mixed-precision): transformers takes the first config group with a `re:` target containing "experts"
    as the fused experts' scheme (integrations/compressed_tensors.get_experts_scheme). The FP8 group's exact targets
    name `mlp.shared_experts.*`, so it took FP8 for the INT4 routed experts, found no `.weight` for them and refused
    the checkpoint ("Concatenate on tensors destined for ...experts.gate_up_proj. Ckpt contains: 0")."""
    import dataclasses
    import json

    from glmq.formats.dense import iter_dense

    src = make_ckpt("glm4_moe", "fp8-block")
    out = tmp_path / "mixed"
    stream.run(make_plan(open_source(src), dataclasses.replace(recipes.load("int4-w4a16"), keep_fp8=True)), out,
               progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert any("shared_experts" in t for t in qc["config_groups"]["group_1"]["targets"])

    quant = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = quant.config
    _assert_experts_are(quant, dict(iter_dense(out, torch.float32)))
    shared = quant.model.layers[1].mlp.shared_experts.up_proj  # kept FP8: the stored bytes and block scales
    assert shared.weight.dtype == torch.float8_e4m3fn and shared.quantization_scheme.weights.strategy == "block"
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(quant(ids).logits).all()
