"""`glmq plan` at real scale: predicted sizes, peak memory per rank and wall time (quantize/estimate.py)."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from glmq import recipes
from glmq.formats.families import classify, layer_index
from glmq.formats.safetensors_io import read_header
from glmq.formats.source import open_source
from glmq.quantize import estimate, stream
from glmq.quantize.estimate import FIGURES, NOT_MEASURED, Layer, Scale, Target
from glmq.quantize.plan import make_plan
from glmq.scripts.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "scripts" / "configs"
BENCH = REPO / "benchmarks"

# (fixture family, source format, config overrides): the three real configs' layouts, tiny.
TINY = {
    "glm-5.2": ("glm_moe_dsa", "fp8-block", {}),
    "glm-4.7": ("glm4_moe", "fp8-ct", {}),
    "kimi-k2": ("deepseek_v3", "fp8-block", {"model_type": "kimi_k2", "num_nextn_predict_layers": 0}),
}


def data_bytes_by_class(root: Path) -> Counter:
    """Tensor data bytes of every shard of a checkpoint, per tensor class, read from the files' headers."""
    out: Counter = Counter()
    for shard in sorted(root.glob("*.safetensors")):
        entries, _, data_start = read_header(shard)
        assert data_start + sum(e.nbytes for e in entries.values()) == shard.stat().st_size
        for name, e in entries.items():
            out[classify(name.rpartition(".")[0]).value] += e.nbytes
    return out


def by_class(rows: dict[str, dict]) -> Counter:
    out: Counter = Counter()
    for key, row in rows.items():
        out[key.split(":")[0]] += row["bytes_out"]
    return out


# ------------------------------------------------------------------------------------ sizes, exact
@pytest.mark.parametrize("name", sorted(TINY))
def test_config_only_prediction_is_exact_for_a_converted_tiny_checkpoint(name, make_ckpt, tmp_path):
    family, fmt, overrides = TINY[name]
    src = make_ckpt(family, fmt, config_overrides=overrides) if overrides else make_ckpt(family, fmt)
    pred = estimate.from_config_file(src / "config.json", "int4-w4a16")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"))
    stream.run(plan, tmp_path / "out", progress=False)
    assert pred["bytes_in"] == sum(data_bytes_by_class(src).values())
    assert pred["bytes_out"] == sum(data_bytes_by_class(tmp_path / "out").values())
    assert by_class(pred["by_class"]) == data_bytes_by_class(tmp_path / "out")
    assert pred["by_class"] == estimate.from_plan(plan)["by_class"]


def test_config_only_prediction_of_a_plain_fp32_checkpoint(make_ckpt, tmp_path):
    """A plain FP32 checkpoint (torch_dtype float32) reads and copies 4 bytes a weight: the config-only plan
    sized it as bf16 (half the input, the copied tensors at half their size)."""
    from safetensors.torch import load_file, save_file

    src, dst = make_ckpt("glm4_moe", "bf16"), tmp_path / "fp32"
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    pred = estimate.from_config_file(dst / "config.json", "int4-w4a16")
    assert pred["bytes_in"] == sum(data_bytes_by_class(dst).values())
    assert pred["by_class"] == estimate.from_plan(make_plan(open_source(dst), recipes.load("int4-w4a16")))["by_class"]


# ----------------------------------------------------------------------------------- real configs
@pytest.fixture(scope="module")
def real():
    """Config-only summaries of the three real configs (make_plan at real scale takes about a minute each)."""
    return {n: estimate.from_config_file(CONFIGS / f"{n}-config.json", "int4-w4a16") for n in sorted(TINY)}


def test_real_configs_name_their_source():
    for n in TINY:
        cfg = json.loads((CONFIGS / f"{n}-config.json").read_text())
        assert ("huggingface.co" if n != "glm-5.2" else "formats.md") in cfg.get("_glmq_source", ""), n


def test_glm52_prediction_matches_benchmarks(real):
    s = real["glm-5.2"]
    assert (s["tensors"], round(s["bytes_in"] / 1e9, 2), round(s["bytes_out"] / 1e9, 2)) == (59870, 756.16, 417.55)
    row = s["by_class"]["routed_expert:quantize"]
    assert (row["tensors"], round(row["bytes_in"] / 1e9, 2), round(row["bytes_out"] / 1e9, 2)) == (58368, 734.62, 378.70)


def _params(c: dict) -> dict[str, int]:
    """Parameter counts from the config's formulas, independent of glmq's layout tables:
    routed experts, FP8 linears outside them, and BF16 tensors (embeddings, heads, routers, norms)."""
    h, v, n, heads = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_attention_heads"]
    mtp = c.get("num_nextn_predict_layers", 0)
    dense, moe = c["first_k_dense_replace"], n - c["first_k_dense_replace"] + mtp
    e, im = c["n_routed_experts"], c["moe_intermediate_size"]
    if "kv_lora_rank" in c:  # MLA
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        attn = (c["q_lora_rank"] * h + heads * qk * c["q_lora_rank"] + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * h
                + heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"] + h * heads * c["v_head_dim"])
        attn_norm = c["q_lora_rank"] + c["kv_lora_rank"]
    else:  # GQA with q/k/v biases and q/k norms (GLM-4.x)
        d, kv = c["head_dim"], c["num_key_value_heads"]
        attn, attn_norm = 2 * heads * d * h + 2 * kv * d * h, heads * d + 2 * kv * d + 2 * d
    fp8 = (n + mtp) * attn + dense * 3 * h * c["intermediate_size"] + moe * 3 * h * im * c["n_shared_experts"]
    bf16 = 2 * v * h + h + (n + mtp) * (2 * h + attn_norm) + moe * (e * h + e)
    bf16 += mtp * (2 * h * h + 3 * h + 2 * v * h)  # eh_proj, enorm/hnorm/shared_head.norm, head + embed
    return {"experts": moe * e * 3 * h * im, "fp8": fp8, "bf16": bf16}


@pytest.mark.parametrize("name, stated_params", [("kimi-k2", 1026.5e9), ("glm-4.7", 358e9)])
def test_kimi_and_glm47_totals_match_their_parameter_count(name, stated_params, real):
    cfg = json.loads((CONFIGS / f"{name}-config.json").read_text())
    p = _params(cfg)
    total = sum(p.values())
    assert abs(total - stated_params) / stated_params < 0.002, total  # HF's count (1026.5B) / 358B
    s = real[name]
    fp8_in = p["experts"] + p["fp8"] + 2 * p["bf16"]  # 1 byte per FP8 weight
    assert 1.0 <= s["bytes_in"] / fp8_in < 1.003  # FP8 scales: 4 B per 128x128 block, or per row (CT channel)
    out = p["experts"] * (0.5 + 2 / 128) + 2 * (p["fp8"] + p["bf16"])  # INT4 + g128 bf16 scales; rest BF16
    assert abs(s["bytes_out"] / out - 1) < 1e-4, (s["bytes_out"], out)


def test_rtn_projection_reproduces_the_benchmarks_glm52_figure(real):
    cpu = real["glm-5.2"]["rtn"]  # the fixture plans with Scale(): one rank, CPU
    assert cpu["rank_bytes_max"] == real["glm-5.2"]["bytes_in"] and cpu["jobs"] == real["glm-5.2"]["output_files"]
    cuda = FIGURES["rtn_cuda_fixed_s"].value + cpu["rank_bytes_max"] / (FIGURES["rtn_cuda_GBps"].value * 1e9)
    assert abs(cuda - (462 + 6)) < 10  # BENCHMARKS.md: "glmq ≈ 462 s + 6 s" for 756 GB on the H200


# ---------------------------------------------------------------------------------- measured figures
def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def test_every_figure_names_its_source_and_matches_the_raw_benchmark_data():
    for key, f in FIGURES.items():
        assert (f.value is None) == f.basis.startswith(NOT_MEASURED), key
        if key.startswith(("rtn_", "copy_", "rss_")):
            assert "BENCHMARKS.md" in f.basis and "2026-12-01" in f.basis and "bench_rtn.py" in f.basis, key
    # RTN rates, fixed costs and memory: the medians of the raw runs (CPU: benchmarks/bench_rtn_cpu.json;
    # GPU: the 13 GB run, benchmarks/bench_rtn_cuda_13GB.json, where the start-up no longer hides the rate)
    for dev, name in (("cpu", "bench_rtn_cpu.json"), ("cuda", "bench_rtn_cuda_13GB.json")):
        raw = json.loads((BENCH / name).read_text())
        runs = raw["runs"]["glmq"]
        pipeline = _median(r["phase_seconds"]["pipeline"] for r in runs)
        assert FIGURES[f"rtn_{dev}_GBps"].value == pytest.approx(raw["input_bytes"] / pipeline / 1e9, abs=0.0005), dev
        assert FIGURES[f"rtn_{dev}_fixed_s"].value == pytest.approx(raw["median"]["glmq"]["seconds"] - pipeline, abs=0.05)
        assert FIGURES[f"copy_{dev}_GBps"].value == pytest.approx(
            raw["input_bytes"] / raw["median"]["copy"]["seconds"] / 1e9, abs=0.0005), dev
        assert FIGURES[f"rss_bench_{dev}_GB"].value == pytest.approx(raw["median"]["glmq"]["peak_rss"] / 1e9, abs=0.001)
        assert FIGURES[f"rss_process_{dev}_GB"].value == pytest.approx(_median(r["rss_at_start"] for r in runs) / 1e9,
                                                                       abs=0.001)  # fmt: skip
    gpu = json.loads((BENCH / "bench_gptq_gpu_triton.json").read_text())["gptq"]  # session 6, the Triton kernels
    assert FIGURES["gptq_cuda_s_per_column"].value * 3670016 == pytest.approx(gpu["gptq_solve_seconds"][1], rel=1e-3)
    child = json.loads((BENCH / "bench_config_child.json").read_text())["median"]["config_child_peak_rss"]
    assert FIGURES["config_child_GB"].value == pytest.approx(child / 1e9, abs=1e-4)
    tune = json.loads((BENCH / "bench_gptq_gpu_session9-tune.json").read_text())["gptq"]["tune"][0]
    assert FIGURES["gptq_cuda_tune_s_per_step"].value * tune["iters"] == pytest.approx(tune["seconds"], rel=2e-3)


def test_overrides_replace_values_and_reject_unknown_keys():
    figs = estimate.with_overrides(estimate.parse_overrides(("gptq_cpu_s_per_column=0.001",)))
    assert figs["gptq_cpu_s_per_column"].value == 0.001 and "override" in figs["gptq_cpu_s_per_column"].basis
    assert FIGURES["gptq_cpu_s_per_column"].value is None  # the table itself is untouched
    with pytest.raises(ValueError, match="unknown --throughput key"):
        estimate.with_overrides({"gptq_tpu_s_per_column": 1.0})
    with pytest.raises(ValueError, match="KEY=NUMBER"):
        estimate.parse_overrides(("rtn_cpu_GBps",))


def test_scale_defaults_are_the_engines():
    engine = pytest.importorskip("glmq.calibration.engine")
    s, c = Scale(), engine.CalibrationSettings()
    assert (s.samples, s.seq_len, s.batch_size, s.dtype, s.expert_prior, s.all_token_limit) == (
        c.samples, c.seq_len, c.batch_size, c.dtype, c.expert_prior, c.all_token_limit)


# ------------------------------------------------------------------------------------- distribution
def test_balance_assigns_every_item_once_and_bounds_the_largest_rank():
    sizes = {"a": 5, "b": 4, "c": 3, "d": 3, "e": 3}
    split = estimate.balance(sizes, 2)
    assert split == [["a", "d"], ["b", "c", "e"]]  # LPT by hand: 5|4, 3->4, 3->5, 3->7
    assert max(sum(sizes[k] for k in r) for r in split) == 10  # optimum 9: LPT is within 4/3 of it
    shards = {f"s{i}": (i * 7919) % 1000 + 1 for i in range(57)}
    for ranks in (1, 3, 8, 80):
        split = estimate.balance(shards, ranks)
        assert sorted(k for r in split for k in r) == sorted(shards) and len(split) == ranks
        loads = [sum(shards[k] for k in r) for r in split]
        opt = max(max(shards.values()), math.ceil(sum(shards.values()) / ranks))
        assert opt <= max(loads) <= 4 / 3 * opt


def test_rtn_wall_is_the_largest_rank_at_the_measured_rate():
    jobs = {"x": (4_000_000_000, 1_000_000_000), "y": (2_000_000_000, 2_000_000_000), "z": (1_000_000_000, 500_000_000)}
    r = estimate.rtn_estimate(jobs, 5_000_000_000, Scale(ranks=2), FIGURES)
    # balanced by bytes read + written: x (5 GB) | y (4 GB) + z (1.5 GB); the wall follows the bytes read
    assert r["rank_bytes_max"] == 4_000_000_000 and r["rank_bytes_min"] == 3_000_000_000
    rate, fixed = FIGURES["rtn_cpu_GBps"].value, FIGURES["rtn_cpu_fixed_s"].value
    assert r["seconds"] == pytest.approx(fixed + 4e9 / (rate * 1e9))
    # not the 5 GB shard: its pages are released as it is read (stream.Reader.RELEASE_BYTES)
    assert r["peak_rss"] == FIGURES["rss_process_cpu_GB"].value * 1e9 + estimate.IN_FLIGHT
    one = estimate.rtn_estimate(jobs, 5_000_000_000, Scale(), FIGURES)
    assert one["rank_bytes_max"] == 7_000_000_000 and one["rank_jobs_max"] == 3
    for check in r["model_check"].values():
        assert check["model"] >= check["measured"]  # the RSS model is an upper bound of the measured runs


def _moe_layer(experts: int = 4, h: int = 256, inter: int = 128, plain: tuple[int, int] | None = None) -> Layer:
    ts = []
    for e in range(experts):
        p = f"model.layers.1.mlp.experts.{e}."
        ts += [Target(p + "gate_proj", inter, h, e, f"{e}.gate_up"), Target(p + "up_proj", inter, h, e, f"{e}.gate_up"),
               Target(p + "down_proj", h, inter, e, f"{e}.down")]
    if plain:
        ts.append(Target("model.layers.1.self_attn.o_proj", plain[0], plain[1], None, "model.layers.1.self_attn.o_proj"))
    return Layer(1, params=experts * 3 * h * inter + 10_000, expert_params=experts * 3 * h * inter,
                 bytes_in=experts * 3 * h * inter + 20_000, linear_flops=1_000_000, targets=tuple(ts))


def test_rank_units_keep_experts_whole_and_cover_every_target():
    layer = _moe_layer(experts=5, plain=(256, 512))
    split = estimate.rank_units(layer, 2)
    assert sorted(t.module for r in split for t in r) == sorted(t.module for t in layer.targets)
    owners = {t.expert: i for i, r in enumerate(split) for t in r if t.expert is not None}
    assert all(owners[t.expert] == i for i, r in enumerate(split) for t in r if t.expert is not None)


# ------------------------------------------------------------------------------------------- memory
def test_hessian_bytes_closed_form():
    layer = _moe_layer(experts=4, h=256, inter=128, plain=(256, 512))
    ts = list(layer.targets)
    per_expert = 256**2 + 2 * 128**2  # gate_up + down + all-token down (expert_prior)
    base = 512**2 + 256**2  # the plain site + the all-token MoE input
    assert estimate.hessian_bytes(ts, None, prior=True) == 4 * (base + 4 * per_expert)
    assert estimate.hessian_bytes(ts, 1, prior=True) == 4 * (base + per_expert)
    assert estimate.hessian_bytes(ts, None, prior=False) == 4 * (base + 4 * (256**2 + 128**2))


def test_layer_memory_closed_form_and_monotonic():
    cfg = {"hidden_size": 256, "num_experts_per_tok": 2, "n_routed_experts": 4, "index_topk": 2048,
           "index_n_heads": 4}
    layer = _moe_layer()
    sc = Scale(samples=16, seq_len=64, batch_size=4)
    mem = estimate.layer_memory(layer, list(layer.targets), cfg, sc, None, offload=False)
    assert mem["hidden"] == 16 * 64 * 256 * 4 and mem["layer"] == 4 * layer.params
    assert mem["carry"] == 2 * 16 * 64 * 64 * 4  # min(index_topk, T) = 64 indices, int32, layer input + output
    assert mem["source_bf16"] == 2 * layer.params
    off = estimate.layer_memory(layer, list(layer.targets), cfg, sc, None, offload=True)
    assert off["hidden"] == 2 * 4 * 64 * 256 * 4 < mem["hidden"]
    bf16 = estimate.layer_memory(layer, list(layer.targets), cfg, replace_scale(sc, dtype="bfloat16"), None, False)
    assert bf16["layer"] == mem["layer"] / 2

    def peak(**kw):
        s = replace_scale(sc, **kw)
        epp = kw.get("experts_per_pass")
        return estimate.peak_memory(estimate.layer_memory(layer, list(layer.targets), cfg, s, epp, False), "cuda", 1e9)

    assert peak(samples=32)["host"] > peak(samples=16)["host"]
    assert peak(seq_len=128)["host"] > peak(seq_len=64)["host"]
    assert peak(experts_per_pass=1)["device"] < peak(experts_per_pass=4)["device"]
    cpu = estimate.peak_memory(mem, "cpu", 0)
    assert cpu["device"] == 0 and cpu["host"] >= mem["source_bf16"] + mem["layer"] + mem["hessians"]


def replace_scale(s: Scale, **kw) -> Scale:
    from dataclasses import replace

    return replace(s, **kw)


def test_gptq_estimate_on_a_tiny_plan(make_ckpt):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"))
    layers = estimate.decoder_layers(plan)
    cfg = plan.source.config
    assert sorted(layers) == list(range(cfg["num_hidden_layers"]))  # the MTP layer is left to RTN
    moe = [la for la in layers.values() if la.targets]
    assert all(len(la.targets) == 3 * cfg["n_routed_experts"] for la in moe)
    g1 = estimate.gptq_estimate(plan, Scale(device="cuda"), FIGURES)
    g4 = estimate.gptq_estimate(plan, Scale(device="cuda", ranks=4), FIGURES)
    assert g1["seconds"] > 0  # measured on the H200: a projection
    assert estimate.gptq_estimate(plan, Scale(device="cpu"), FIGURES)["seconds"] is None  # not measured on CPU
    assert g4["columns"] < g1["columns"] and g4["flops"] < g1["flops"]
    assert g4["memory"]["all/memory"]["device"] < g1["memory"]["all/memory"]["device"]  # fewer Hessians per rank
    figs = estimate.with_overrides({"gptq_cuda_forward_TFLOPs": 10.0, "gptq_cuda_s_per_column": 1e-4})
    g = estimate.gptq_estimate(plan, Scale(device="cuda"), figs)
    assert g["load_seconds"] == pytest.approx(sum(la.bytes_in for la in layers.values()) / (FIGURES["rtn_cuda_GBps"].value * 1e9))
    assert g["seconds"] == pytest.approx(g["load_seconds"] + g["flops"] / 10e12 + g["columns"] * 1e-4)


def test_gptq_wall_is_quantizes_defaults_whatever_experts_per_pass(make_ckpt):
    """The wall is that of `glmq quantize`'s defaults (all of a layer's experts in one pass, as the GPTQ figures
    were measured); --experts-per-pass only adds its own, slower, variant beside it (it used to replace it)."""
    plan = make_plan(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), recipes.load("int4-w4a16"))
    every = estimate.gptq_estimate(plan, Scale(device="cuda", experts_per_pass=None), FIGURES)
    one = estimate.gptq_estimate(plan, Scale(device="cuda", experts_per_pass=1), FIGURES)
    assert one["experts"] > 1 and one["seconds"] == every["seconds"] and one["flops"] == every["flops"]
    assert one["bounded"]["experts_per_pass"] == 1 and one["bounded"]["seconds"] > one["seconds"]
    assert one["bounded"]["flops"] > one["flops"] and every["bounded"]["seconds"] == every["seconds"]
    res = CliRunner().invoke(main, ["plan", "-m", str(plan.source.root), "--device", "cuda", "--experts-per-pass", "1"])
    line = next(x for x in res.output.splitlines() if x.startswith("wall: ") and "EXTRAPOLATION" in x)
    assert f"wall: {estimate._duration(one['seconds'] + one_rtn_seconds(plan))} = " in line, line
    assert "quantize's defaults, all experts at once; with --experts-per-pass 1: " in line, line


def test_chunk_passes_run_only_their_own_routed_experts(make_ckpt):
    """--experts-per-pass N: every chunk pass but the first adds the layer's forward without its routed experts (a pass
    runs only its own chunk's, calibration/collect.py), not a whole forward, which it counted until session 31."""
    plan = make_plan(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), recipes.load("int4-w4a16"))
    cfg = plan.source.config
    layer = next(la for la in estimate.decoder_layers(plan).values() if la.targets)
    n = cfg["n_routed_experts"]
    share = cfg["num_experts_per_tok"] / n
    assert layer.routed_flops == round(sum(2 * t.n * t.k * share for t in layer.targets if t.expert is not None))
    assert 0 < layer.routed_flops < layer.linear_flops
    sc = Scale(samples=4, seq_len=32, experts_per_pass=None)
    one = estimate.layer_work(layer, list(layer.targets), cfg, sc)
    chunked = estimate.layer_work(layer, list(layer.targets), cfg, replace_scale(sc, experts_per_pass=1))
    assert (one["passes"], chunked["passes"]) == (2, n + 1)
    rest = 4 * 32 * (layer.linear_flops - layer.routed_flops + estimate.attention_flops_per_token(cfg, 32))
    assert chunked["flops"] - one["flops"] == pytest.approx((n - 1) * rest)


def one_rtn_seconds(plan) -> float:
    return estimate.from_plan(plan, Scale(device="cuda"))["rtn"]["seconds"]


def test_gptq_host_peak_holds_a_gptq_process(make_ckpt):
    """GPTQ's host peak starts from a GPTQ process (transformers, numba, the tokenizer: 660-680 MiB with no tensor
    alive, BENCHMARKS.md session 7), not RTN's 0.24 GB: the shared model's GPTQ run (16 x 128 tokens) peaked at
    0.76 GB where the plan said 0.27 GB."""
    plan = make_plan(open_source(make_ckpt("glm4_moe", "fp8-block")), recipes.load("int4-w4a16"))
    for dev in ("cpu", "cuda"):
        g = estimate.gptq_estimate(plan, Scale(device=dev, samples=16, seq_len=128), FIGURES)
        assert all(v["host"] > 680 * 2**20 for v in g["memory"].values()), (dev, g["memory"])
        process = (FIGURES[f"rss_process_{dev}_GB"].value + FIGURES["gptq_process_extra_GB"].value) * 1e9
        assert g["process_rss"] == pytest.approx(process), dev
        for v in g["memory"].values():
            assert v["host"] == pytest.approx(estimate.peak_memory(v["parts"], dev, process)["host"]), dev
    assert FIGURES["rss_process_cpu_GB"].value + FIGURES["gptq_process_extra_GB"].value == pytest.approx(
        680 * 2**20 / 1e9, abs=0.001)


def test_rates_from_a_layer_report_invert_the_time_model():
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "num_experts_per_tok": 2,
           "n_routed_experts": 4}
    layer, sc = _moe_layer(), Scale(samples=8, seq_len=32, experts_per_pass=2)
    w = estimate.layer_work(layer, list(layer.targets), cfg, sc)
    assert w["passes"] == 3  # two chunks of 2 experts + the output forward
    rate, per_col = 2e12, 3e-4  # FLOP/s, s per column
    tokens = 8 * 32
    fwd_s = w["flops"] / rate
    row = {"calibration_tokens_per_s": tokens / (fwd_s / w["passes"]), "forward_tokens_per_s": tokens / (fwd_s / w["passes"]),
           "seconds": fwd_s + w["columns"] * per_col + layer.bytes_in / 1e9}
    got = estimate.rates_from_layer_report(row, layer, cfg, sc, load_GBps=1.0)
    assert got["forward_TFLOPs"] == pytest.approx(2.0) and got["s_per_column"] == pytest.approx(per_col)


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_prints_every_section(make_ckpt):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    res = CliRunner().invoke(main, ["plan", "-m", str(src / "config.json"), "--ranks", "2", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for text in ("== predicted output", "routed_expert:quantize", "total", "== RTN on 2 rank(s)",
                 "output files split by bytes read + written", "peak RSS per rank",
                 "model check", "wall: ", "== GPTQ on 2 rank(s)", "largest decoder layer", "Hessians, all",
                 "Hessians, --experts-per-pass", "hidden states on disk", "carried top-k",
                 "peak per rank, quantize's defaults (all experts at once, hidden states on disk)",
                 "peak per rank, with --activations memory", "peak per rank, with --experts-per-pass 32",
                 "measured part:", "wall: not measured yet; a lower bound", "gptq_cpu_forward_TFLOPs"):
        assert text in res.output, text
    res = CliRunner().invoke(main, ["plan", "-m", str(src / "config.json"), "--device", "cpu",
                                    "--throughput", "gptq_cpu_forward_TFLOPs=20",
                                    "--throughput", "gptq_cpu_s_per_column=0.0001"])
    assert res.exit_code == 0 and "EXTRAPOLATION" in res.output and NOT_MEASURED not in res.output
    res = CliRunner().invoke(main, ["plan", "-m", str(src / "config.json"), "--throughput", "bogus=1"])
    assert res.exit_code != 0 and "unknown --throughput key" in res.output
    for dev, text in (("cuda", "at 0.354 s a step"), ("cpu", NOT_MEASURED)):  # the every-linear recipe tunes
        res = CliRunner().invoke(main, ["plan", "-m", str(src / "config.json"), "--device", dev,
                                        "-r", "int4-w4a16-all-linear"])
        line = [x for x in res.output.splitlines() if x.startswith("layer-output tuning (200 steps a layer")]
        assert res.exit_code == 0 and len(line) == 1 and text in line[0], res.output


def test_cli_config_only_plan_follows_max_shard_size(make_ckpt, tmp_path):
    """--max-shard-size cuts the output files of a config-only plan as it does a folder's (it was ignored)."""
    cfg = make_ckpt("glm_moe_dsa", "fp8-block") / "config.json"
    rec = recipes.load("int4-w4a16")
    files = {}
    for size, nbytes in (("5GB", 5 * 10**9), ("100KB", 100_000)):
        res = CliRunner().invoke(main, ["plan", "-m", str(cfg), "--max-shard-size", size, "--json", str(tmp_path / size)])
        assert res.exit_code == 0, res.output
        files[size] = json.loads((tmp_path / size).read_text())["output_files"]
        assert files[size] == len(make_plan(estimate.virtual_source(cfg), rec, nbytes).files), size
        assert estimate.from_config_file(cfg, "int4-w4a16", max_shard_bytes=nbytes)["output_files"] == files[size]
    assert files["100KB"] > 10 * files["5GB"], files


def test_cli_plan_bad_input_is_a_one_line_error(tmp_path):
    """A missing config.json, one without a key the estimate needs, a zero/negative/NaN --throughput:
    `error: ...` naming the file, key or option, no traceback; exit code 2 where the option's value cannot be used (a
    file that is not there, a --throughput), 1 where the file's content fails."""
    cfg = json.loads((CONFIGS / "glm-5.2-config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")  # was a UnicodeDecodeError that named no file
    (tmp_path / "list.json").write_text("[]")
    cases = [
        (["-m", str(tmp_path / "typo" / "config.json")], [str(tmp_path / "typo" / "config.json"), "no such file"]),
        (["-m", str(tmp_path / "config.json")], [str(tmp_path / "config.json"), "'hidden_size'"]),
        (["-m", str(tmp_path / "broken.json")], [str(tmp_path / "broken.json"), "cannot be read as JSON"]),
        (["-m", str(tmp_path / "binary.json")], [str(tmp_path / "binary.json"), "cannot be read as JSON", "utf-8"]),
        (["-m", str(tmp_path / "list.json")], [str(tmp_path / "list.json"), "holds a JSON list, not an object"]),
        (["--throughput", "rtn_cpu_GBps=0"], ["--throughput rtn_cpu_GBps=0", "> 0"]),
        (["--throughput", "gptq_cpu_forward_TFLOPs=0", "--throughput", "gptq_cpu_s_per_column=1e-5"],
         ["--throughput gptq_cpu_forward_TFLOPs=0", "> 0"]),
        (["--throughput", "rtn_cuda_GBps=-1", "--device", "cuda"], ["rtn_cuda_GBps=-1", "> 0"]),
        (["--throughput", "copy_cpu_GBps=nan"], ["copy_cpu_GBps=nan", "finite"]),
        (["--throughput", "rtn_cpu_fixed_s=-2"], ["rtn_cpu_fixed_s=-2", ">= 0"]),
    ]
    for args, needles in cases:
        res = CliRunner().invoke(main, ["plan", *args])
        code = 2 if "--throughput" in args or "typo" in args[1] else 1
        assert res.exit_code == code and isinstance(res.exception, SystemExit), (args, res.exception, res.output)
        assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1, res.output
        for n in needles:
            assert n in res.output, (n, res.output)


def test_plan_of_a_folder_whose_config_lacks_a_key(make_ckpt, tmp_path):
    src = shutil.copytree(make_ckpt("glm_moe_dsa", "fp8-block"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["hidden_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["plan", "-m", str(src)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    # the loader's default (6144) shapes nothing stored: the message says the key is missing
    assert str(src / "config.json") in res.output, res.output
    assert "(hidden_size: GlmMoeDsaConfig's default; config.json has none)" in res.output, res.output


def test_layer_index_of_the_largest_layer_is_a_moe_layer(real):
    for n, s in real.items():
        cfg = json.loads((CONFIGS / f"{n}-config.json").read_text())
        assert cfg["first_k_dense_replace"] <= s["gptq"]["largest_layer"] < cfg["num_hidden_layers"], n
        assert s["gptq"]["experts"] == cfg["n_routed_experts"]
        assert layer_index(f"model.layers.{s['gptq']['largest_layer']}.x") == s["gptq"]["largest_layer"]


def test_small_sizes_are_not_printed_as_zero_gb():
    """Every row of a small model's plan read 0.00 GB; GLM-5-scale rows keep GB."""
    assert estimate._gb(5_120).split() == ["5.12", "KB"] and estimate._gb(3_010_000).split() == ["3.01", "MB"]
    assert estimate._gb(13.04e9).split() == ["13.04", "GB"] and estimate._gb(0).split() == ["0.00", "GB"]


def test_plan_refuses_config_values_of_the_wrong_kind(make_ckpt, tmp_path):
    """`hidden_size: "256"` was a TypeError traceback (config-only: in the layout; a folder: in the GPTQ estimate), and
    `moe_intermediate_size: 0`, `vocab_size: 1.5` or `num_hidden_layers: 0` planned routed experts of 0 bytes (exit 0);
    a folder with "256" even converted and validated. Each is one line naming the file and the key, exit 1."""
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    base = json.loads((src / "config.json").read_text())
    cases = [("hidden_size", "256", 'hidden_size is "256", not a positive integer'),
             ("moe_intermediate_size", 0, "moe_intermediate_size is 0, not a positive integer"),
             ("vocab_size", 1.5, "vocab_size is 1.5, not a positive integer"),
             ("num_hidden_layers", 0, "num_hidden_layers is 0, not a positive integer"),
             ("n_routed_experts", "8", 'n_routed_experts is "8", not a positive integer'),
             ("first_k_dense_replace", -1, "first_k_dense_replace is -1, not a non-negative integer"),
             ("q_lora_rank", None, "q_lora_rank is null, not a positive integer")]
    for key, value, problem in cases:
        path = tmp_path / key / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**base, key: value}))
        res = CliRunner().invoke(main, ["plan", "-m", str(path)])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (key, res.exception, res.output)
        assert res.output.startswith(f"error: {path}: ") and problem in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
    folder = Path(shutil.copytree(src, tmp_path / "folder"))
    (folder / "config.json").write_text(json.dumps({**base, "hidden_size": "256"}))
    res = CliRunner().invoke(main, ["plan", "-m", str(folder)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert f'{folder / "config.json"}: values of the wrong kind' in res.output, res.output
    assert '\n  hidden_size is "256", not a positive integer' in res.output, res.output


def test_plan_of_a_folder_with_only_its_config_points_at_the_config_only_plan(tmp_path):
    (tmp_path / "GLM-5.2").mkdir()
    shutil.copy(CONFIGS / "glm-5.2-config.json", tmp_path / "GLM-5.2" / "config.json")
    res = CliRunner().invoke(main, ["plan", "-m", str(tmp_path / "GLM-5.2")])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert f"plan from the config alone with `glmq plan -m {tmp_path / 'GLM-5.2' / 'config.json'}`" in res.output
    assert CliRunner().invoke(main, ["plan", "-m", str(tmp_path / "GLM-5.2" / "config.json")]).exit_code == 0


# ------------------------------------------------------------- config-only plans read config.json as loaders do
def _without(src: Path, tmp_path: Path, *keys: str, **set_: object) -> Path:
    """A copy of `src`'s folder whose config.json lacks `keys` (and has `set_`)."""
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    cfg = {k: v for k, v in json.loads((dst / "config.json").read_text()).items() if k not in keys}
    (dst / "config.json").write_text(json.dumps({**cfg, **set_}))
    return dst


def test_config_only_plan_takes_the_class_default_of_a_missing_key_as_the_folder_plan_does(make_ckpt, tmp_path):
    """GlmMoeDsaConfig's n_shared_experts default is 1, which the tiny model has: without the key the folder plan
    takes the default and converts, while the config-only plan built its layout from the raw config (no shared
    expert) and then refused its own layout: "is missing ... the conversion lost it"."""
    src = _without(make_ckpt("glm_moe_dsa"), tmp_path, "n_shared_experts")
    pred = estimate.from_config_file(src / "config.json", "int4-w4a16")
    assert pred["by_class"] == estimate.from_plan(make_plan(open_source(src), recipes.load("int4-w4a16")))["by_class"]
    assert pred["bytes_in"] == sum(data_bytes_by_class(src).values())


def test_config_only_plan_of_a_tied_model_leaves_out_the_head_it_does_not_store(make_ckpt, tmp_path):
    """tie_word_embeddings: true (the head is embed_tokens, lm_head.weight not stored): the config-only plan put
    lm_head.weight in its layout and refused it ("set tie_word_embeddings to false")."""
    from safetensors.torch import load_file, save_file

    src = _without(make_ckpt("deepseek_v3"), tmp_path, tie_word_embeddings=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"].pop("lm_head.weight")
    save_file({k: v for k, v in load_file(shard).items() if k != "lm_head.weight"}, shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    pred = estimate.from_config_file(src / "config.json", "int4-w4a16")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"))
    assert pred["by_class"] == estimate.from_plan(plan)["by_class"]
    assert "lm_head.weight" not in estimate.virtual_source(src / "config.json").entries


def test_plan_reads_a_folder_named_like_a_json_file_as_a_checkpoint_and_any_file_as_a_config(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe")
    (tmp_path / "ckpt.v1.json").symlink_to(src, target_is_directory=True)
    shutil.copy(src / "config.json", tmp_path / "CONFIG.JSON")
    runner = CliRunner()
    for model, config_only in ((tmp_path / "ckpt.v1.json", False), (tmp_path / "CONFIG.JSON", True)):
        res = runner.invoke(main, ["plan", "-m", str(model)])
        assert res.exit_code == 0, res.output
        head = next(line for line in res.output.splitlines() if line.startswith("== predicted output"))
        assert ("config only" in head) == config_only, head


def test_plan_counts_the_config_child_beside_rank_0(make_ckpt):
    """quantize's rank 0 keeps the compressed-tensors config child for the whole run (its report prints it,
    ~0.49 GB); the plan's memory said nothing of it."""
    res = CliRunner().invoke(main, ["plan", "-m", str(make_ckpt("glm_moe_dsa"))])
    assert res.exit_code == 0, res.output
    assert (f"rank 0 also runs the compressed-tensors config child for the whole run, alongside: "
            f"{FIGURES['config_child_GB'].value:.2f} GB more") in res.output
