"""Calibration sets (calibration/data.py), one-layer building (layers.py) and Hessian collection (collect.py).

What is asserted:
- A calibration set is `[samples, seq_len]` int64, made of windows of the tokenized text, the same for
  the same seed and different for another; JSONL documents are joined with EOS; bad inputs fail with
  the knob to change.
- A decoder layer built alone from the shards computes exactly what transformers' whole model does.
- Routed experts' Hessians hold exactly the tokens the layer's own router sends them (checked against
  a direct computation), token counts add up to tokens x top-k, plain Linears get their own input,
  and the tapped expert loop returns transformers' own MoE output.
"""

from __future__ import annotations

import importlib.util
import json
import re
import weakref
from pathlib import Path

import pytest
import torch

from glmq.calibration import collect
from glmq.calibration.data import CalibrationDataError, calibration_tokens, load_tokenizer
from glmq.calibration.layers import LayerBuilder, fuse_experts
from glmq.formats.source import open_source

# ----------------------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def prose(shared_model):
    """(model dir, a 40k-character excerpt of the calibration text, its token ids)."""
    text = (shared_model.parent / "prose-calib.txt").read_text()[:40_000]
    tok = load_tokenizer(shared_model)
    return shared_model, text, torch.tensor(tok(text, add_special_tokens=False)["input_ids"])


def _contains(stream: torch.Tensor, row: torch.Tensor) -> bool:
    starts = (stream[: stream.numel() - row.numel() + 1] == row[0]).nonzero().flatten().tolist()
    return any(torch.equal(stream[s:s + row.numel()], row) for s in starts)


def test_text_file_windows_are_seeded_samples_of_the_tokenized_text(prose, tmp_path):
    model, text, ids = prose
    f = tmp_path / "calib.txt"
    f.write_text(text)
    a = calibration_tokens(model, str(f), samples=8, seq_len=64, seed=0)
    assert a.dtype == torch.int64 and tuple(a.shape) == (8, 64)
    assert torch.equal(a, calibration_tokens(model, str(f), samples=8, seq_len=64, seed=0))
    assert not torch.equal(a, calibration_tokens(model, str(f), samples=8, seq_len=64, seed=1))
    windows = ids[: ids.numel() // 64 * 64].view(-1, 64)
    for row in a:  # each sample is one of the non-overlapping windows, none twice
        assert any(torch.equal(row, w) for w in windows)
    assert len({tuple(r.tolist()) for r in a}) == 8


def test_jsonl_documents_are_joined_with_eos(prose, tmp_path):
    model, text, _ = prose
    tok = load_tokenizer(model)
    docs = [text[i:i + 4000] for i in range(0, 40_000, 4000)]
    f = tmp_path / "calib.jsonl"
    f.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    a = calibration_tokens(model, str(f), samples=16, seq_len=128, seed=3)
    assert tuple(a.shape) == (16, 128)
    stream = []
    for d in docs:
        stream += ([tok.eos_token_id] if stream else []) + tok(d, add_special_tokens=False)["input_ids"]
    stream = torch.tensor(stream)
    assert all(_contains(stream, row) for row in a)


def test_too_little_text_names_the_options_to_change(prose, tmp_path):
    model, text, _ = prose
    f = tmp_path / "short.txt"
    f.write_text(text[:2000])
    with pytest.raises(CalibrationDataError, match="--samples"):
        calibration_tokens(model, str(f), samples=128, seq_len=256)


def test_jsonl_without_text_field_names_the_line(prose, tmp_path):
    model, _, _ = prose
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(CalibrationDataError, match=r"bad.jsonl:2: .*'text'"):
        calibration_tokens(model, str(f), samples=1, seq_len=4)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_to_install(prose, tmp_path):
    model, _, _ = prose
    f = tmp_path / "calib.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(CalibrationDataError, match="pyarrow"):
        calibration_tokens(model, str(f), samples=1, seq_len=4)


def test_parquet_text_column(prose, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    model, text, _ = prose
    f = tmp_path / "calib.parquet"
    pq.write_table(pa.table({"text": [text[:20_000], text[20_000:]]}), f)
    assert tuple(calibration_tokens(model, str(f), samples=4, seq_len=64).shape) == (4, 64)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_dataset_name_without_datasets_package(prose):
    model, _, _ = prose
    with pytest.raises(CalibrationDataError, match="datasets"):
        calibration_tokens(model, "no-such-file-or-dataset", samples=1, seq_len=4)


def test_checkpoint_without_tokenizer_is_a_clear_error(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", "fp8-block")  # generated fixtures carry no tokenizer.json
    f = tmp_path / "t.txt"
    f.write_text("hello " * 100)
    with pytest.raises(CalibrationDataError, match="tokenizer"):
        calibration_tokens(src, str(f), samples=1, seq_len=4)


# ----------------------------------------------------------------------------------------- layers


def test_fuse_experts_puts_gate_rows_first():
    g, u, d = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4)
    state = {f"mlp.experts.{e}.{p}_proj.weight": t * (e + 1) for e in range(2) for p, t in
             (("gate", g), ("up", u), ("down", d))}
    fused = fuse_experts({**state, "mlp.gate.weight": torch.zeros(2, 8)})
    assert set(fused) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"}
    assert torch.equal(fused["mlp.experts.gate_up_proj"][1], torch.cat([g, u]) * 2)
    assert torch.equal(fused["mlp.experts.down_proj"][0], d)
    with pytest.raises(ValueError, match="incomplete"):
        fuse_experts({"mlp.experts.1.gate_proj.weight": g})


def test_a_missing_expert_projection_is_named_with_the_checkpoint_and_layer(make_ckpt):
    """An expert tensor absent from the checkpoint: the error names the checkpoint, the layer, the expert and the
    projection (it listed the first 8 indices and all three projections: every one present, to read it)."""
    src = make_ckpt("glm4_moe", "fp8-block")
    b = LayerBuilder(open_source(src), torch.device("cpu"), torch.float32)
    i = b.config.first_k_dense_replace
    state = b.tensors.layer_state(i)
    del state["mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=rf"{re.escape(str(src))}: layer {i}: routed experts are incomplete \(1 of \d+\): "
                                         r"expert 5 has no up_proj; "):
        b.build(i, state)


@pytest.mark.parametrize("family", ["glm4_moe", "glm_moe_dsa"])
def test_layers_built_alone_match_the_whole_model(make_ckpt, family):
    from glmq.calibration.evaluate import load_model

    src = make_ckpt(family, "fp8-block")
    b = LayerBuilder(open_source(src), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    x, carry = b.embed(ids), None
    with torch.no_grad():
        ref = load_model(src)(ids, output_hidden_states=True).hidden_states
        for i in range(b.config.num_hidden_layers - 1):  # the last entry of hidden_states is normed
            kw = b.layer_kwargs(x)
            if b.spec.carry:
                kw[b.spec.carry] = carry
            out = b.build(i)(x, **kw)
            x, carry = out if isinstance(out, tuple) else (out, None)
            assert torch.equal(x, ref[i + 1]), f"layer {i}"


def test_experts_as_stored_share_the_state_and_collect_bit_identical_hessians(make_ckpt):
    """A layer built with `experts_as_stored` keeps its fused experts in the source's dtype (bf16), and
    `share_experts` makes the state's per-expert tensors views of them (one copy, the same values). Its
    tapped passes, which cast one expert at a time, collect exactly (bit for bit) the Hessians of the
    layer built in float32, every site, with and without the routed output."""
    from glmq.calibration.layers import share_experts

    b = LayerBuilder(open_source(make_ckpt("glm4_moe", "fp8-block")), torch.device("cpu"), torch.float32)
    i = b.config.first_k_dense_replace  # a MoE layer
    ref = b.tensors.layer_state(i)
    state = dict(ref)
    layer = b.build(i, state, experts_as_stored=True)
    ex = layer.mlp.experts
    assert ex.gate_up_proj.dtype == ex.down_proj.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.weight.dtype == torch.float32
    share_experts(layer, state)
    base = ex.gate_up_proj.data_ptr(), ex.down_proj.data_ptr()
    for k, v in ref.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
        if ".experts." in k:
            assert state[k].untyped_storage().data_ptr() in base and not state[k].requires_grad, k
    full = b.build(i, ref)  # the float32 layer
    n_exp = b.config.n_routed_experts
    sites = {f"mlp.experts.{e}.{s}" for e in range(n_exp) for s in ("gate_up", "down")} | {collect.ALL_TOKENS}
    x = torch.randn(3, 40, b.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for routed_output in (False, True):
        cols, outs = [], []
        for lay in (full, layer):
            col = collect.HessianCollector(lay, sites, all_token_experts=set(range(n_exp)), all_token_limit=1.0,
                                           routed_output=routed_output)
            with torch.no_grad(), col:
                for b0 in (0, 2):  # two batches: sums across batches too
                    outs.append(lay(x[b0:b0 + 2], **b.layer_kwargs(x[b0:b0 + 2])))
            cols.append(col)
        assert set(cols[0].acc) == set(cols[1].acc) and len(cols[0].acc) > 2 * n_exp
        for site in cols[0].acc:
            assert torch.equal(cols[0].hessian(site)[0], cols[1].hessian(site)[0]), site
        assert torch.equal(cols[0].tokens, cols[1].tokens)
        if routed_output:
            for o_full, o_tap in zip(outs[:2], outs[2:]):
                assert torch.equal(o_full, o_tap)


def test_layer_state_keeps_no_view_of_the_shards(make_ckpt):
    """After layer_state (which closes the shards), no tensor it returned keeps a shard's memory map alive
    (a map's pages read count in the process's RSS while it is mapped)."""
    src = make_ckpt("glm4_moe", "fp8-block")
    b = LayerBuilder(open_source(src), torch.device("cpu"), torch.float32)
    state = b.tensors.layer_state(1)
    maps = open("/proc/self/maps").read() if Path("/proc/self/maps").exists() else ""
    assert state and str(Path(src).resolve()) not in maps


# ----------------------------------------------------------------------------------------- Hessians


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm4_moe", "deepseek_v3"])
def test_the_layer_skeleton_allocates_no_host_memory(make_ckpt, family):
    """transformers' classes create the fused experts with `torch.empty([E, 2I, H])` of the default device: under
    accelerate's `init_empty_weights()` alone that was float32 host memory, moved to meta afterwards (26 GB for a
    GLM-5 layer, 45 GB for Kimi K2's; a 24 GB host refused it). Now they are created on meta."""
    from torch.overrides import TorchFunctionMode

    made = []

    class Record(TorchFunctionMode):  # below the meta device's own mode: sees each call as that mode passes it on
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.empty and out.dim() == 3:  # the fused experts [E, 2I, H] and [E, H, I]
                made.append(out.device.type)
            return out

    b = LayerBuilder(open_source(make_ckpt(family, "fp8-block")), torch.device("cpu"), torch.float32)
    with Record():
        layer = b.build(1)
    assert made == ["meta", "meta"], made
    assert {p.device.type for p in layer.parameters()} == {"cpu"}  # then every weight is loaded from the source


@pytest.fixture(scope="module")
def moe_layer(make_ckpt):
    b = LayerBuilder(open_source(make_ckpt("glm_moe_dsa", "fp8-block")), torch.device("cpu"), torch.float32)
    layer = b.build(1)
    x = torch.randn(3, 40, b.config.hidden_size, generator=torch.Generator().manual_seed(1))
    return b, layer, x


def test_expert_hessians_hold_exactly_the_routed_tokens(moe_layer):
    b, layer, x = moe_layer
    n_exp, k = b.config.n_routed_experts, b.config.num_experts_per_tok
    sites = {f"mlp.experts.{e}.{s}" for e in range(n_exp) for s in ("gate_up", "down")} | {
        collect.ALL_TOKENS, "mlp.shared_experts.down_proj", "self_attn.q_a_proj"}
    captured = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: captured.update(moe_in=o)),
             layer.mlp.shared_experts.down_proj.register_forward_pre_hook(lambda m, a: captured.update(sh=a[0]))]
    with torch.no_grad():
        plain = layer(x, **b.layer_kwargs(x))[0]
        with collect.HessianCollector(layer, sites) as col:
            tapped = layer(x, **b.layer_kwargs(x))[0]
    for h in hooks:
        h.remove()
    torch.testing.assert_close(tapped, plain, rtol=1e-5, atol=1e-6)  # the tap computes transformers' MoE
    moe_in = captured["moe_in"].reshape(-1, b.config.hidden_size)
    _, _, topk = layer.mlp.gate(moe_in)
    assert int(col.tokens.sum()) == moe_in.shape[0] * k
    ex = layer.mlp.experts
    for e in range(n_exp):
        tok = (topk == e).any(-1).nonzero().flatten()
        assert int(col.tokens[e]) == tok.numel()
        h, n = col.hessian(f"mlp.experts.{e}.gate_up")
        if tok.numel() == 0:
            assert h is None and n == 0
            continue
        xe = moe_in[tok]
        torch.testing.assert_close(h, 2 / tok.numel() * xe.T @ xe, rtol=1e-4, atol=1e-6)
        g, u = (xe @ ex.gate_up_proj[e].T).chunk(2, dim=-1)
        he = torch.nn.functional.silu(g) * u
        torch.testing.assert_close(col.hessian(f"mlp.experts.{e}.down")[0], 2 / tok.numel() * he.T @ he,
                                   rtol=1e-4, atol=1e-6)
    h_all, n_all = col.hessian(collect.ALL_TOKENS)
    assert n_all == moe_in.shape[0]
    torch.testing.assert_close(h_all, 2 / n_all * moe_in.T @ moe_in, rtol=1e-4, atol=1e-6)
    sh = captured["sh"].reshape(-1, captured["sh"].shape[-1])
    torch.testing.assert_close(col.hessian("mlp.shared_experts.down_proj")[0], 2 / sh.shape[0] * sh.T @ sh,
                               rtol=1e-4, atol=1e-6)
    assert col.hessian("self_attn.q_a_proj")[1] == x.shape[0] * x.shape[1]
    assert "forward" not in vars(layer.mlp.experts), "the tap must be removed on exit"


def test_expert_chunks_and_all_token_down_hessians(moe_layer):
    b, layer, x = moe_layer
    sites = {f"mlp.experts.{e}.gate_up" for e in range(8)}
    with torch.no_grad(), collect.HessianCollector(layer, sites, experts={2, 3}, all_token_experts={5}) as col:
        layer(x, **b.layer_kwargs(x))
    routed = {f"mlp.experts.{e}.gate_up" for e in (2, 3) if col.tokens[e] > 0}
    assert routed and set(col.acc) == routed | {"mlp.experts.5.down_all"}  # only the chunk's experts
    assert col.hessian("mlp.experts.5.down_all")[1] == x.shape[0] * x.shape[1]
    assert int(col.tokens.sum()) == x.shape[0] * x.shape[1] * b.config.num_experts_per_tok  # counts all experts


def test_all_token_limit_takes_the_first_tokens_and_no_output_pass_collects_the_same(moe_layer):
    """`all_token_limit * I` tokens for the down_all Hessians, in forward order and across batches; a pass
    without the routed output (`routed_output=False`) collects exactly the Hessians of a full pass."""
    b, layer, x = moe_layer
    n_exp = b.config.n_routed_experts
    inter = layer.mlp.experts.gate_up_proj.shape[1] // 2
    sites = {f"mlp.experts.{e}.{s}" for e in range(n_exp) for s in ("gate_up", "down")} | {collect.ALL_TOKENS}
    limit = 50 / inter  # 50 tokens: the first batch's 40 and 10 of the second
    captured = []  # the MoE input of each batch
    hook = layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: captured.append(o))
    cols = {}
    with torch.no_grad():
        for name, kw in (("full", {}), ("limited", {"all_token_limit": limit}),
                         ("no_output", {"all_token_limit": limit, "routed_output": False})):
            with collect.HessianCollector(layer, sites, all_token_experts={1, 4}, **kw) as col:
                for s in range(x.shape[0]):  # three batches of one sample
                    y = layer(x[s:s + 1], **b.layer_kwargs(x[s:s + 1]))[0]
            cols[name] = col, y
    hook.remove()
    full, limited, no_output = (cols[k][0] for k in ("full", "limited", "no_output"))
    assert full.all_token_tokens == x.shape[0] * x.shape[1] and limited.all_token_tokens == 50
    moe_in = torch.cat([c.reshape(-1, c.shape[-1]) for c in captured[:3]])[:50]  # the first pass's batches
    ex = layer.mlp.experts
    for e in (1, 4):
        g, u = (moe_in @ ex.gate_up_proj[e].T).chunk(2, dim=-1)
        he = torch.nn.functional.silu(g) * u
        h, n = limited.hessian(f"mlp.experts.{e}.down_all")
        assert n == 50
        torch.testing.assert_close(h, 2 / 50 * he.T @ he, rtol=1e-4, atol=1e-6)
    for site in limited.acc:  # the same sums, bit for bit, without the routed output
        assert torch.equal(limited.acc[site].state_dict()["xxt_sum"], no_output.acc[site].state_dict()["xxt_sum"]), site
        assert limited.acc[site].num_tokens == no_output.acc[site].num_tokens
    assert set(limited.acc) == set(no_output.acc) and torch.equal(limited.tokens, no_output.tokens)
    assert not torch.equal(cols["no_output"][1], cols["limited"][1])  # that pass's output is not the layer's


@pytest.mark.parametrize("k", [64, 600])
def test_quadratic_rows_from_the_panels_equal_the_full_product(k):
    """The diagnostics' d H d^T per row, from H's diagonal blocks and the panels below them only."""
    from glmq.calibration.layer_gptq import quadratic_rows

    g = torch.Generator().manual_seed(k)
    x = torch.randn(3 * k, k, generator=g)
    h = x.T @ x / x.shape[0]
    h = (h + h.T) / 2  # exactly symmetric, as HessianAccumulator.finalize returns it
    d = torch.randn(50, k, generator=g)
    ref = ((d.double() @ h.double()) * d.double()).sum(1)
    torch.testing.assert_close(quadratic_rows(d, h), ref, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_activation_stores_round_trip(tmp_path, dtype):
    from glmq.calibration.cache import Activations

    data = (torch.randn(5, 3, 4) * 100).to(dtype)
    mem = Activations.in_memory(data.clone())
    disk = Activations.new_file(tmp_path / "h.tmp", tuple(data.shape), dtype)
    for b0 in (0, 2, 4):  # batch-wise writes, as a layer produces them
        disk.write(b0, data[b0:b0 + 2])
    assert torch.equal(disk.read(1, 4), data[1:4]) and torch.equal(mem.read(1, 4), data[1:4])
    disk.save(tmp_path / "h.bin")
    mem.save(tmp_path / "m.bin")
    assert not (tmp_path / "h.tmp").exists()
    for path in ("h.bin", "m.bin"):
        for in_memory in (True, False):
            back = Activations.load(tmp_path / path, tuple(data.shape), dtype, in_memory)
            assert torch.equal(back.read(0, 5), data)
    assert Activations.load(tmp_path / "h.bin", (6, 3, 4), dtype, True) is None  # wrong size: not a resume point


def test_chunked_experts_give_transformers_grouped_mm_output_bit_for_bit(make_ckpt):
    """ChunkedExperts (a few experts per call, bf16 weights cast per call) returns exactly what transformers'
    grouped_mm experts forward returns on the float32 layer, for runs of one expert up to all of them, with
    uneven token counts and an expert no token reaches; `build(chunked_experts=True)` installs it on a CPU."""
    from glmq.calibration.layers import ChunkedExperts

    b = LayerBuilder(open_source(make_ckpt("glm4_moe", "fp8-block")), torch.device("cpu"), torch.float32)
    i = b.config.first_k_dense_replace
    state = b.tensors.layer_state(i)
    ref = b.build(i, state).mlp.experts
    layer = b.build(i, state, chunked_experts=True)
    ex = layer.mlp.experts
    assert isinstance(vars(ex).get("forward"), ChunkedExperts) and ex.gate_up_proj.dtype == torch.bfloat16
    assert ChunkedExperts.applies(ref) and ref.config._experts_implementation == "grouped_mm"
    n_exp, k, h = b.config.n_routed_experts, b.config.num_experts_per_tok, b.config.hidden_size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, h, generator=g)
    scores = torch.rand(300, n_exp, generator=g) ** 3  # uneven counts
    scores[:, 1] = -1  # expert 1 gets no token
    top_w, top_i = scores.topk(k, dim=-1)
    with torch.no_grad():
        want = ref(x, top_i, top_w)  # transformers' class forward: grouped_mm_experts_forward
        for rows in (1, 100, 400, 10**9):
            got = ChunkedExperts(ex, rows)(x, top_i, top_w)
            assert got.dtype == want.dtype and torch.equal(got, want), rows
        assert torch.equal(layer.mlp.experts(x, top_i, top_w), want)
    gone = weakref.ref(layer.mlp.experts)
    del layer, ex
    assert gone() is None, "the installed forward keeps the layer alive (a reference cycle)"


def test_hessian_panels_hold_the_block_upper_triangle_bit_for_bit():
    """The CPU accumulator's own panel tensors (62.5 % of K x K at K = 1024) sum exactly (bit for bit) what the
    same GEMMs into views of one K x K matrix summed, over uneven batches; the whole sum is its mirror."""
    from glmq.calibration.hessian import HessianAccumulator, symmetric_panels

    k = 1024
    acc, ref = HessianAccumulator(k), torch.zeros(k, k)
    g = torch.Generator().manual_seed(4)
    for t in (700, 1, 2048, 33):
        x = torch.randn(t, k, generator=g)
        acc.add(x)
        for i0, i1 in symmetric_panels(k):
            ref[i0:i1, i0:].addmm_(x[:, i0:i1].t(), x[:, i0:])
    assert len(acc.panels) == 4 and sum(p.numel() for p in acc.panels) == k * k * 5 // 8
    full = acc.state_dict()["xxt_sum"]
    for i0, i1 in symmetric_panels(k):
        assert torch.equal(full[i0:i1, i0:], ref[i0:i1, i0:])
    assert torch.equal(full, full.T)


# ----------------------------------------------------------------------------------------- coverage report


def _gptq_report(src, out, **kw) -> dict:
    """The "gptq" report of a GPTQ run (int4-w4a16, no clip search, no layer-output tuning) on 2 x 32 random tokens."""
    import dataclasses

    from glmq import recipes
    from glmq.calibration.engine import CalibrationSettings, run_gptq
    from glmq.quantize.plan import make_plan

    r = recipes.load("int4-w4a16").with_method("gptq")
    r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, tune_iters=0))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    s = CalibrationSettings(samples=2, seq_len=32, batch_size=2, clip_search=False, **kw)
    return run_gptq(make_plan(open_source(src), r, 300_000), out, ids, s, progress=False)["gptq"]


def test_under_covered_all_token_down_hessians_without_prior_are_reported(make_ckpt, tmp_path):
    """Without the prior, the under-covered experts' all-token down Hessians come from an extra pass (chunk 0) or
    a later chunk's own pass; the report gives the tokens they took (it said None: "none taken")."""
    rep = _gptq_report(make_ckpt("glm4_moe", "fp8-block"), tmp_path / "o", expert_prior=0.0,
                       min_expert_tokens=10**9, experts_per_pass=3)
    moe = [lay for lay in rep["layers"] if lay["tokens_per_expert"]]
    assert moe and all(lay["under_covered_experts"] == list(range(len(lay["tokens_per_expert"]))) for lay in moe)
    assert [lay["all_token_hessian_tokens"] for lay in moe] == [64] * len(moe)  # 2 x 32 tokens, fewer than 4 x I


def test_overflowing_activations_name_the_layer_and_the_input(moe_layer):
    """A Hessian of NaN/Inf activations (float16 calibration overflowing) is an error naming the layer and the input
    (it named neither: one line about "the calibration activations" of a whole model's run)."""
    b, layer, x = moe_layer
    with torch.no_grad(), collect.HessianCollector(layer, {"self_attn.q_a_proj"}) as col:
        layer(x.clone().index_fill_(1, torch.tensor([3]), float("inf")), **b.layer_kwargs(x))
    with pytest.raises(ValueError, match=r"layer 1, input of self_attn\.q_a_proj: .*NaN/Inf"):
        col.hessian("self_attn.q_a_proj")
