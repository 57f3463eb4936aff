"""Layer-output tuning after GPTQ (calibration/tune.py, `QuantSpec.tune_iters`).

What is asserted:
- `rounding_offsets` is each integer's continuous optimum given all the others under GPTQ's damped objective
  (checked against a float64 line search of that objective), clamped so that it rounds to GPTQ's integer;
  for round-to-nearest it is w / s - q.
- The engine with tuning on writes exactly the RTN format; every integer is within one step of GPTQ's, and
  only on the side of its continuous value; the report has each layer's losses, and a layer's tuned result
  is kept only when its output error over the calibration samples is lower, which an independent
  measurement of the decoder layer's output error confirms.
- Two runs give the same bytes; bad settings are refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
import torch

from glmq import recipes
from glmq.calibration.engine import run_gptq
from glmq.calibration.layers import LayerBuilder
from glmq.calibration.tune import OFFSET_BOUND, rounding_offsets
from glmq.formats.dense import iter_dense
from glmq.formats.source import open_source
from glmq.quantize.gptq import quantize_gptq
from glmq.quantize.plan import make_plan
from glmq.quantize.rtn import dequantize, quantize_rtn
from glmq.quantize.spec import Method, QuantSpec
from test_gptq_engine import _cli, _files, _layer_output, calib_ids, cli_src, gptq_plan, settings  # noqa: F401 (a fixture)
from test_stream import tensors


def _problem(n=6, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k ** 0.5)
    return torch.randn(n, k, generator=g).to(torch.bfloat16), x.T @ x / x.shape[0]


def test_rounding_offsets_are_the_coordinate_optima():
    w, h = _problem()
    spec = QuantSpec(method=Method.GPTQ)
    r = quantize_gptq(w, h, spec)
    off = rounding_offsets(w, r.qweight, h, r.damp, spec.group_size)
    assert off.shape == w.shape and off.abs().max() <= OFFSET_BOUND
    assert torch.equal(torch.round(r.qweight.q.float() + off), r.qweight.q.float())
    # float64 reference: f(t) = d(t) Hd d(t)^T with the weight's k-th dequantized value moved by t * s; its
    # minimizer over t, for a few coordinates, is the unclamped offset
    hd = h.double() + r.damp * torch.diagonal(h.double()).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    wq = dequantize(r.qweight, spec.group_size).double()
    s = r.qweight.scale.double().repeat_interleave(spec.group_size, dim=1)
    checked = 0
    for row, col in [(0, 0), (1, 37), (2, 128), (3, 200), (5, 255), (4, 99)]:
        d0 = w[row].double() - wq[row]
        e = torch.zeros_like(d0)
        e[col] = s[row, col]
        # f(t) = (d0 - t e) Hd (d0 - t e)^T is minimal at t = (e Hd d0) / (e Hd e)
        t = float(e @ hd @ d0 / (e @ hd @ e))
        if abs(t) < OFFSET_BOUND:
            assert off[row, col].item() == pytest.approx(t, abs=2e-3), (row, col)
            checked += 1
        else:
            assert off[row, col].item() == pytest.approx(OFFSET_BOUND * (1 if t > 0 else -1)), (row, col)
    assert checked >= 4
    qr = quantize_rtn(w, spec)  # no Hessian: round-to-nearest's own fractions
    off_rtn = rounding_offsets(w, qr, None, 0.0, spec.group_size)
    expect = (w.float() - dequantize(qr, spec.group_size).float()) / qr.scale.float().repeat_interleave(128, dim=1)
    assert torch.allclose(off_rtn, expect.clamp(-OFFSET_BOUND, OFFSET_BOUND))


def test_rounding_offsets_with_dead_columns_are_gptqs_coordinate_optima():
    """With dead inputs (diag(H) == 0) GPTQ sets their diag to 1 before taking the dampening's mean; the offsets are
    the optima of that objective (not of H + damp * mean(raw diag) I: up to 0.37 off with diag(H) ~ 0.01)."""
    w, h = _problem()
    h = h * 1e-2
    h[:64, :] = h[:, :64] = 0
    spec = QuantSpec(method=Method.GPTQ)
    r = quantize_gptq(w, h, spec)
    assert r.dead_columns == 64
    off = rounding_offsets(w, r.qweight, h, r.damp, spec.group_size)
    H = h.double().clone()
    dead = torch.diagonal(H) == 0
    torch.diagonal(H)[dead] = 1
    hd = H + r.damp * torch.diagonal(H).mean() * torch.eye(256, dtype=torch.float64)
    wz = w.double().masked_fill(dead, 0)  # GPTQ's weights: dead columns zeroed
    s = r.qweight.scale.double().repeat_interleave(spec.group_size, dim=1)
    t = ((wz - dequantize(r.qweight, spec.group_size).double()) @ hd) / (torch.diagonal(hd) * s)
    inside = t[:, ~dead].abs() < OFFSET_BOUND
    assert int(inside.sum()) > 0.9 * inside.numel()
    torch.testing.assert_close(off[:, ~dead].double()[inside], t[:, ~dead][inside], rtol=0, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_tuned_weight_is_the_written_one(dtype):
    """The weight the tuning optimizes is bit for bit what it writes: at the start (V = A = 0) GPTQ's result as
    the checkpoint dequantizes it, and after a move the dequantized `results` (scales rounded to their dtype, q * s
    rounded as `rtn.dequantize` rounds it; the float32 product was up to 0.4 % off at the start)."""
    from glmq.calibration.tune import _Tuned

    w, h = _problem(n=64)
    spec = QuantSpec(method=Method.GPTQ, full_range=True)
    r = quantize_gptq(w.to(dtype), h, spec)
    qws = {"m": r.qweight}
    t = _Tuned.start("m.weight", [("m", ())], qws, {"m": rounding_offsets(w.to(dtype), r.qweight, h, r.damp, 128)},
                     None, torch.device("cpu"))
    lo, hi = spec.q_min, spec.q_max
    assert torch.equal(t.weight(lo, hi, 128).detach().float(), t.dequantized(qws, 128))
    with torch.no_grad():
        t.a.uniform_(-0.01, 0.01, generator=torch.Generator().manual_seed(0))
        t.v.uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(1))
    res = t.results(lo, hi)
    assert not torch.equal(res["m"].q, r.qweight.q) and not torch.equal(res["m"].scale, r.qweight.scale)
    assert torch.equal(t.weight(lo, hi, 128).detach().float(), t.dequantized(res, 128))
    t.weight(lo, hi, 128).float().square().sum().backward()  # the gradient reaches both through the roundings
    assert t.v.grad.abs().sum() > 0 and t.a.grad.abs().sum() > 0


def _tuned_plan(src, recipe="int4-w4a16-all-linear", iters=40):
    r = recipes.load(recipe).with_method("gptq")
    r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, tune_iters=iters, tune_lr=None))
    return make_plan(open_source(src), r, 300_000)


@pytest.fixture(scope="module")
def tuned(make_ckpt, tmp_path_factory):
    """(source, GPTQ output, tuned output, tuned report): the tiny GLM-4.x MoE, every linear."""
    src = make_ckpt("glm4_moe", "fp8-block")
    tmp = tmp_path_factory.mktemp("tune")
    run_gptq(gptq_plan(src, "int4-w4a16-all-linear"), tmp / "gptq", calib_ids(), settings(), progress=False)
    rep = run_gptq(_tuned_plan(src), tmp / "tuned", calib_ids(), settings(), progress=False)
    return src, tmp / "gptq", tmp / "tuned", rep


def _unpack(t: dict, name: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(t[name + ".weight_packed"], 4, torch.Size(t[name + ".weight_shape"].tolist()))


def test_tuned_output_has_the_format_and_moves_integers_one_step(tuned):
    """Layer 0's input (the embeddings) is the same with and without tuning, so its GPTQ integers are too: the
    tuned ones are within one step of them, and equal where the tuning was not kept. (Later layers get other
    inputs from a tuned layer 0, hence other Hessians and GPTQ integers.)"""
    src, gptq, out, rep = tuned
    tg, tt = tensors(gptq), tensors(out)
    assert {k: (v.dtype, v.shape) for k, v in tg.items()} == {k: (v.dtype, v.shape) for k, v in tt.items()}
    tunes = [lay.get("tune") for lay in rep["gptq"]["layers"]]
    assert all(t is not None for t in tunes), tunes  # every layer of this recipe has targets
    for t in tunes:
        assert t["iters"] == 40 and t["lr"] == pytest.approx(1 / 40) and t["experts_not_tuned"] is None
        assert t["kept"] == (t["loss_tuned"] < t["loss_gptq"]) and 0 <= t["integers_changed"] < 0.5
    assert any(t["kept"] for t in tunes)
    names = sorted(k[:-len(".weight_packed")] for k in tt if k.startswith("model.layers.0.") and k.endswith(".weight_packed"))
    assert len(names) == 7  # q, k, v, o and the dense MLP's three
    moved = 0
    for name in names:
        qg, qt = _unpack(tg, name), _unpack(tt, name)
        assert (qt.int() - qg.int()).abs().max() <= 1, name
        moved += int((qt != qg).sum())
        if not tunes[0]["kept"]:
            assert torch.equal(qg, qt) and torch.equal(tg[name + ".weight_scale"], tt[name + ".weight_scale"])
    total = sum(_unpack(tt, n).numel() for n in names)
    assert moved / total == pytest.approx(tunes[0]["integers_changed"], abs=1e-6) if tunes[0]["kept"] else moved == 0


def test_a_kept_tuning_lowers_the_layer_output_error(tuned):
    """Decoder layer 0 (dense, attention + MLP quantized) on the calibration data: with the tuned weights its output
    error against the source layer is lower than with GPTQ's when the report says the tuning was kept."""
    src, gptq, out, rep = tuned
    t = rep["gptq"]["layers"][0]["tune"]
    b = LayerBuilder(open_source(src), torch.device("cpu"), torch.float32)
    x = b.embed(calib_ids())
    ref = _layer_output(b, 0, b.tensors.layer_state(0), x)
    errs = {}
    for name, folder in (("gptq", gptq), ("tuned", out)):
        state = {k[len("model.layers.0."):]: v for k, v in iter_dense(folder) if k.startswith("model.layers.0.")}
        errs[name] = float((_layer_output(b, 0, state, x) - ref).square().mean())
    assert errs["gptq"] == pytest.approx(t["loss_gptq"], rel=1e-3)
    assert errs["tuned"] == pytest.approx(t["loss_tuned"] if t["kept"] else t["loss_gptq"], rel=1e-3)
    assert t["kept"] and errs["tuned"] < errs["gptq"], (t, errs)


def test_the_report_says_a_rejected_tuning_moved_nothing(tuned):
    """A tuning that is not kept writes GPTQ's integers: its line said "x % of integers moved" all the same."""
    from glmq.calibration.report import format_report

    rep = json.loads(json.dumps(tuned[3]["gptq"]))
    t = rep["layers"][0]["tune"]
    assert t["kept"] and t["integers_changed"] > 0
    assert "% of integers moved" in format_report(rep)
    t["kept"] = False
    text = format_report(rep)
    assert "not kept: GPTQ result written" in text and "% of integers would have moved" in text


def test_tuning_is_deterministic(tuned, tmp_path):
    src, _, out, _ = tuned
    run_gptq(_tuned_plan(src), tmp_path / "again", calib_ids(), settings(), progress=False)
    assert _files(tmp_path / "again") == _files(out)


def test_killed_while_tuning_resumes_byte_identical(cli_src, tmp_path):
    """The CLI with a tuned every-linear recipe (the unquantized model's states as the target, so a resumed run
    must regenerate them), killed inside layer 1's tuning: the rerun resumes at layer 1 and writes the bytes of
    an uninterrupted run; the shipped every-linear recipe tunes."""
    src, text, _ = cli_src
    assert recipes.load("int4-w4a16-all-linear").spec.tune_iters > 0
    recipe = tmp_path / "tuned.yaml"
    recipe.write_text(yaml.safe_dump({**recipes.load("int4-w4a16-all-linear").to_dict(), "method": "gptq",
                                      "tune_iters": 20, "tune_reference": "source"}))
    ref, out = tmp_path / "ref", tmp_path / "out"
    r = _cli("none", 0, src, ref, text, "--recipe", str(recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "output tuning" in r.stdout
    per_layer = 1 + 20 + 1  # 8 samples in one batch: the GPTQ loss, the steps, the tuned loss
    r = _cli("tune", per_layer + 10, src, out, text, "--recipe", str(recipe))
    assert r.returncode == 137, r.stderr[-3000:]
    assert sorted(p.name for p in (out / ".glmq-gptq").glob("layer-*")) == ["layer-00000.safetensors"]
    r = _cli("none", 0, src, out, text, "--recipe", str(recipe))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref)
    rep = json.loads((out / "glmq_report.json").read_text())["gptq"]
    assert rep["resumed_from_layer"] == 1 and all(lay["tune"]["reference"] == "source" for lay in rep["layers"])


def test_tune_settings_are_validated(make_ckpt):
    with pytest.raises(ValueError, match="tune_iters"):
        QuantSpec(tune_iters=-1)
    with pytest.raises(ValueError, match="symmetric"):
        QuantSpec(tune_iters=10, symmetric=False)
    with pytest.raises(ValueError, match="tune_lr"):
        QuantSpec(tune_iters=10, tune_lr=0.0)
    src = make_ckpt("glm4_moe", "fp8-block")
    with pytest.raises(ValueError, match="one process"):
        run_gptq(_tuned_plan(src), "/nonexistent/out", calib_ids(), settings(), progress=False, world=object())


@pytest.mark.parametrize("reference", ["layer", "source"])
def test_glm5_layout_with_carried_topk(make_ckpt, tmp_path, reference):
    """GLM-5 (MLA, DSA indexer with carried top-k): tuning runs through transformers' layer with the carry, the
    states on disk (the default) for "source", in memory for "layer"; with tune_experts off it tunes exactly the
    layer's other targets, and its files are gone at the end."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    r = recipes.load("int4-w4a16-all-linear").with_method("gptq")
    r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, tune_iters=30, tune_reference=reference,
                                                        tune_experts=False))
    act = "disk" if reference == "source" else "memory"
    rep = run_gptq(make_plan(open_source(src), r, 300_000), tmp_path / "t", calib_ids(), settings(activations=act),
                   progress=False)
    run_gptq(gptq_plan(src, "int4-w4a16-all-linear"), tmp_path / "g", calib_ids(), settings(activations=act),
             progress=False)
    tg, tt = tensors(tmp_path / "g"), tensors(tmp_path / "t")
    assert {k: (v.dtype, v.shape) for k, v in tg.items()} == {k: (v.dtype, v.shape) for k, v in tt.items()}
    for lay in rep["gptq"]["layers"]:
        t = lay["tune"]
        assert t["reference"] == reference and t["kept"] == (t["loss_tuned"] < t["loss_gptq"]), t
        assert t["tensors"] == sum(r["tensors"] for c, r in lay["classes"].items() if c != "routed_expert"), (lay, t)
    assert any(lay["tune"]["kept"] for lay in rep["gptq"]["layers"])
    if rep["gptq"]["layers"][0]["tune"]["kept"]:  # layer 0's input is the embeddings in both runs
        assert any(not torch.equal(tt[k], tg[k]) for k in tt if k.startswith("model.layers.0.self_attn.")
                   and k.endswith(".weight_packed"))
    assert sorted(p.name for p in (tmp_path / "t" / ".glmq-gptq").iterdir()) == ["calibration.json", "report.json"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tuning_on_cuda(make_ckpt, tmp_path):
    """On a GPU (GLM-5 layout, every linear, routed experts tuned too): every layer's tuning lowers its loss and is
    kept on most layers, integers move at most one step from GPTQ's on the same device, and the output has the format."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    rep = run_gptq(_tuned_plan(src), tmp_path / "t", calib_ids(), settings(), device="cuda", progress=False)
    run_gptq(gptq_plan(src, "int4-w4a16-all-linear"), tmp_path / "g", calib_ids(), settings(), device="cuda",
             progress=False)
    tg, tt = tensors(tmp_path / "g"), tensors(tmp_path / "t")
    assert {k: (v.dtype, v.shape) for k, v in tg.items()} == {k: (v.dtype, v.shape) for k, v in tt.items()}
    tunes = [lay["tune"] for lay in rep["gptq"]["layers"]]
    assert all(t["kept"] == (t["loss_tuned"] < t["loss_gptq"]) and t["experts_not_tuned"] is None for t in tunes)
    assert sum(t["kept"] for t in tunes) >= len(tunes) - 1, tunes
    name = next(k[:-len(".weight_packed")] for k in tt if k.startswith("model.layers.0.") and k.endswith("weight_packed"))
    assert (_unpack(tt, name) - _unpack(tg, name)).abs().max() <= 1
