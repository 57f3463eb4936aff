"""Edge cases of GPTQ calibration (calibration/data.py, engine.py, layers.py, tune.py).

What is asserted:
- A `.json` calibration file (JSON Lines, as `datasets`' `to_json` writes them, or one JSON array) gives the
  documents' text, the same tokens as the `.jsonl` file, never its JSON syntax; a folder, or a `.jsonl` with a
  line that is not UTF-8, is a CalibrationDataError naming the input (and the line), not a traceback.
- Calibration windows longer than the model's `max_position_embeddings` are refused before anything is written.
- A bf16 compute dtype (`CalibrationSettings.dtype`): ChunkedExperts returns transformers' grouped_mm output bit for
  bit, and a GPTQ run with layer-output tuning completes with finite losses.
- A NaN in a BF16 source tensor (a target, a Linear kept BF16, a norm) stops a GPTQ run with an error naming its
  shard and tensor, as an FP8 one does, not a Hessian error naming nothing.
- A true-sequential layer reports the tokens its all-token down Hessians took (the down stage's), as a one-pass
  layer does.
- A tokenizer whose class is code in the model folder (Kimi K2's) is refused with a hint to pass
  --trust-remote-code (never an interactive prompt), and loads with it, in calibration and in `glmq eval`.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmq.calibration.data import CalibrationDataError, calibration_tokens, load_tokenizer
from glmq.calibration.engine import run_gptq
from glmq.calibration.layers import ChunkedExperts, LayerBuilder
from glmq.formats import fixtures
from glmq.formats.source import open_source
from glmq.formats.safetensors_io import CheckpointError
from test_gptq_engine import calib_ids, gptq_plan, settings
from test_stream import tensors

DOCS = ["The router sends each token to two experts.\nEach expert is a gated MLP.",
        "Group-wise INT4 keeps one scale per 128 weights; \"quotes\" and \\ slashes stay text.",
        "A third document, with unicode: caf\u00e9 \u2014 na\u00efve."] * 20


@pytest.fixture(scope="module")
def tok_src(make_ckpt, tmp_path_factory):
    """A generated GLM-4.x checkpoint (max_position_embeddings 16) with a byte-level tokenizer."""
    src = tmp_path_factory.mktemp("edge") / "src"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-block", config_overrides={"max_position_embeddings": 16}), src)
    fixtures.write_byte_tokenizer(src)
    return src


def test_json_file_is_read_as_json_lines_or_an_array(tok_src, tmp_path):
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "c.jsonl").write_text(lines)
    (tmp_path / "lines.json").write_text(lines)  # what datasets.Dataset.to_json("lines.json") writes
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    want = calibration_tokens(tok_src, str(tmp_path / "c.jsonl"), samples=8, seq_len=16, seed=0)
    for name in ("lines.json", "array.json"):
        got = calibration_tokens(tok_src, str(tmp_path / name), samples=8, seq_len=16, seed=0)
        assert torch.equal(got, want), name
    text = load_tokenizer(tok_src).decode(calibration_tokens(tok_src, str(tmp_path / "lines.json"), 40, 16).flatten())
    assert '"text"' not in text and "\\n" not in text
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "a"}, {"body": "b"}]))
    with pytest.raises(CalibrationDataError, match="item 1"):
        calibration_tokens(tok_src, str(tmp_path / "bad.json"), samples=1, seq_len=2)


def test_a_folder_or_non_utf8_jsonl_is_a_clear_error(tok_src, tmp_path):
    (tmp_path / "texts").mkdir()
    with pytest.raises(CalibrationDataError, match="texts is a folder: give one text file"):
        calibration_tokens(tok_src, str(tmp_path / "texts"), samples=1, seq_len=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # latin-1 on line 2
    with pytest.raises(CalibrationDataError, match=r"bad\.jsonl:2: not UTF-8"):
        calibration_tokens(tok_src, str(bad), samples=1, seq_len=2)


def test_seq_len_longer_than_the_models_positions_is_refused(tok_src, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"max_position_embeddings \(16\)"):
        run_gptq(gptq_plan(tok_src), out, calib_ids(samples=2, seq=32), settings(samples=2, seq_len=32),
                 progress=False)
    assert not out.exists()


def test_chunked_experts_match_transformers_in_bf16(make_ckpt):
    b = LayerBuilder(open_source(make_ckpt("glm4_moe", "fp8-block")), torch.device("cpu"), torch.bfloat16)
    i = b.config.first_k_dense_replace
    state = b.tensors.layer_state(i)
    ref = b.build(i, state).mlp.experts
    ex = b.build(i, state, chunked_experts=True).mlp.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, b.config.hidden_size, generator=g).bfloat16()
    top_w, top_i = (torch.rand(200, b.config.n_routed_experts, generator=g) ** 3).topk(b.config.num_experts_per_tok, -1)
    with torch.no_grad():
        want = ref(x, top_i, top_w)  # float32 routing weights, as the router returns them
        for rows in (1, 100, 10**9):
            got = ChunkedExperts(ex, rows)(x, top_i, top_w)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), rows


def test_bf16_compute_dtype_with_layer_output_tuning(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", "fp8-block")
    rep = run_gptq(gptq_plan(src, "int4-w4a16-all-linear", tune_iters=2), tmp_path / "o", calib_ids(samples=4, seq=32),
                   settings(samples=4, seq_len=32, dtype="bfloat16"), progress=False)["gptq"]
    tunes = [lay["tune"] for lay in rep["layers"]]
    assert len(tunes) == 3 and all(t["tensors"] and math.isfinite(t["loss_gptq"]) and math.isfinite(t["loss_tuned"])
                                   for t in tunes), tunes
    assert any(k.endswith("experts.0.down_proj.weight_packed") for k in tensors(tmp_path / "o"))


def test_true_sequential_reports_the_all_token_hessian_tokens(make_ckpt, tmp_path):
    src = make_ckpt("glm4_moe", "fp8-block")
    rep = run_gptq(gptq_plan(src), tmp_path / "o", calib_ids(samples=2, seq=32),
                   settings(samples=2, seq_len=32, sequential=True, clip_search=False), progress=False)["gptq"]
    moe = [lay for lay in rep["layers"] if lay["tokens_per_expert"]]
    assert moe and all(lay["all_token_hessian_tokens"] == 64 for lay in moe), \
        [lay["all_token_hessian_tokens"] for lay in moe]  # 2 x 32 tokens, fewer than 4 x I


def _with_nan(src, dst, name):
    """A copy of checkpoint `src` in `dst` with one NaN in tensor `name`; returns (dst, the tensor's shard)."""
    shutil.copytree(src, dst)
    shard = dst / open_source(dst).entries[name].shard
    with safe_open(str(shard), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t[name].view(-1)[7] = float("nan")
    save_file(t, str(shard), metadata={"format": "pt"})
    return dst, shard


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
                                  "model.layers.1.post_attention_layernorm.weight"])
def test_nan_in_a_bf16_source_tensor_names_it(make_ckpt, tmp_path, name):
    src, shard = _with_nan(make_ckpt("glm4_moe", "bf16"), tmp_path / "src", name)
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor {name}: NaN or Inf"):
        run_gptq(gptq_plan(src), tmp_path / "o", calib_ids(samples=2, seq=32), settings(samples=2, seq_len=32),
                 progress=False)


def _custom_code_tokenizer(folder):
    """A byte tokenizer whose class lives in the folder, as Kimi K2's tiktoken tokenizer does."""
    fixtures.write_byte_tokenizer(folder)
    cfg = {"tokenizer_class": "CustomByteTokenizer", "eos_token": "<|endoftext|>",
           "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomByteTokenizer"]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomByteTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")


def test_custom_code_tokenizer_needs_trust_remote_code(tmp_path):
    from click.testing import CliRunner

    from glmq.calibration.evaluate import token_windows
    from glmq.scripts.cli import main

    custom, plain = tmp_path / "custom", tmp_path / "plain"
    custom.mkdir(), plain.mkdir()
    _custom_code_tokenizer(custom)
    fixtures.write_byte_tokenizer(plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "<|endoftext|>"}))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(DOCS))
    with pytest.raises(CalibrationDataError, match="custom|trust_remote_code") as e:
        calibration_tokens(custom, str(text), 4, 32)
    assert "pass --trust-remote-code" in str(e.value)
    ours = calibration_tokens(custom, str(text), 4, 32, trust_remote_code=True)
    assert torch.equal(ours, calibration_tokens(plain, str(text), 4, 32))
    with pytest.raises(CheckpointError, match="pass --trust-remote-code"):
        token_windows(custom, text, 32, 2)
    assert torch.equal(token_windows(custom, text, 32, 2, trust_remote_code=True), token_windows(plain, text, 32, 2))
    res = CliRunner().invoke(main, ["quantize", "--help"])
    assert "--trust-remote-code" in res.output


def test_a_pretty_printed_json_object_is_one_document(tok_src, tmp_path):
    """`json.dump({"text": ...}, indent=2)` was read as JSON Lines: "pretty.json:1: not valid JSON", although the
    same object on one line was accepted."""
    text = " ".join(DOCS)
    (tmp_path / "pretty.json").write_text(json.dumps({"text": text}, indent=2))
    (tmp_path / "one.txt").write_text(text)
    want = calibration_tokens(tok_src, str(tmp_path / "one.txt"), samples=8, seq_len=16, seed=0)
    assert torch.equal(calibration_tokens(tok_src, str(tmp_path / "pretty.json"), samples=8, seq_len=16), want)
    (tmp_path / "blank-first.json").write_text("\n" + "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    calibration_tokens(tok_src, str(tmp_path / "blank-first.json"), samples=8, seq_len=16)  # still JSON Lines
    (tmp_path / "nofield.json").write_text(json.dumps({"body": text}, indent=2))
    with pytest.raises(CalibrationDataError, match=r"nofield\.json: the object must have a string 'text' field"):
        calibration_tokens(tok_src, str(tmp_path / "nofield.json"), samples=1, seq_len=2)


def test_a_parquet_text_column_of_other_values_is_named(tok_src, tmp_path):
    """Integer, binary or list `text` columns were skipped value by value: "0 tokens make 0 windows ... more text"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(CalibrationDataError, match=r"ints\.parquet: the 'text' column holds int64, not strings"):
        calibration_tokens(tok_src, str(tmp_path / "ints.parquet"), samples=1, seq_len=2)
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "ok.parquet")
    calibration_tokens(tok_src, str(tmp_path / "ok.parquet"), samples=8, seq_len=16)


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_is_written(make_ckpt, tok_src, tmp_path):
    """Another model's tokenizer (a larger vocabulary) gave an IndexError traceback in the first forward, after the
    output folder and its calibration record were written (then the fixed rerun was refused); `glmq eval` too."""
    from glmq.calibration import evaluate

    vocab = json.loads((tok_src / "config.json").read_text())["vocab_size"]
    out = tmp_path / "out"
    with pytest.raises(CalibrationDataError, match=rf"token ids run from \d+ to {vocab}, outside the model's {vocab}-token "
                                                   r"vocabulary \(config.json's vocab_size\): its tokenizer is not"):
        run_gptq(gptq_plan(tok_src), out, torch.cat([calib_ids(vocab), torch.full((1, 64), vocab)])[:, :16],
                 settings(seq_len=16), progress=False)
    assert not out.exists()
    small = tmp_path / "small"
    shutil.copytree(tok_src, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 40  # the byte tokenizer's ids for letters are larger
    (small / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "t.txt").write_text(" ".join(DOCS))
    with pytest.raises(CheckpointError, match=r"small: the text's token ids run from \d+ to \d+, outside the model's 40-token"):
        evaluate.token_windows(small, tmp_path / "t.txt", 16, 2)


def test_eval_reads_documents_as_the_calibration_does(tok_src, tmp_path):
    """`glmq eval --text c.jsonl` scored the JSON syntax itself (`{"text": "...`), while --calibration read the
    documents; now both read the "text" of each, joined by EOS."""
    from glmq.calibration import evaluate
    from glmq.calibration.data import token_stream

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    want = token_stream(load_tokenizer(tok_src), iter(DOCS), None)
    got = evaluate.token_windows(tok_src, tmp_path / "c.jsonl", 16, 4)
    assert torch.equal(got.flatten(), want[:64])


def test_an_unbounded_all_token_limit(tmp_path, monkeypatch):
    """`--all-token-limit inf` (the help: "a large N takes every token") crashed mid-run with OverflowError after
    layer 0 was written, and so did 1e308 (times I: inf). inf is every token (None); the settings refuse NaN/inf;
    a huge finite limit takes every token."""
    from click.testing import CliRunner

    from glmq.calibration import collect, engine
    from glmq.scripts import cli

    with pytest.raises(ValueError, match="all_token_limit must be a positive finite number"):
        settings(all_token_limit=math.inf)
    with pytest.raises(ValueError, match="expert_prior must be a finite number >= 0"):
        settings(expert_prior=math.nan)
    col = object.__new__(collect.HessianCollector)
    col.all_token_experts, col.all_token_limit, col.all_token_tokens = {0}, 1e308, 0
    assert col._all_token_rows(torch.ones(5, 3), side=64).shape[0] == 5 and col.all_token_tokens == 5
    col.all_token_limit = 0.1  # 6.4 rows
    assert col._all_token_rows(torch.ones(5, 3), side=64).shape[0] == 2 and col.all_token_tokens == 7
    seen = {}

    def capture(plan, out, s, **kw):
        seen["settings"] = s
        raise ValueError("stop here")

    monkeypatch.setattr(engine, "run_gptq_from_text", capture)
    (tmp_path / "c.txt").write_text("text")
    r = CliRunner().invoke(cli.main, ["quantize", "--model", "builtin:glm4-tiny", "--scheme", "gptq", "--calibration",
                                      str(tmp_path / "c.txt"), "-o", str(tmp_path / "o"), "--all-token-limit", "inf"])
    assert "stop here" in r.output and seen["settings"].all_token_limit is None
    r = CliRunner().invoke(cli.main, ["quantize", "--model", "builtin:glm4-tiny", "--scheme", "gptq", "--calibration",
                                      str(tmp_path / "c.txt"), "-o", str(tmp_path / "o"), "--seed", "-1"])
    assert r.exit_code == 2 and "--seed" in r.output


def test_a_mistyped_calibration_file_is_named_as_missing(tok_src, tmp_path):
    """`--calibration calib.txt` that is not there was taken for a Hugging Face dataset name (with `datasets`
    installed, a Hub lookup)."""
    with pytest.raises(CalibrationDataError, match=r"calib\.txt: no such file \(the current folder is "):
        calibration_tokens(tok_src, str(tmp_path / "calib.txt"), samples=1, seq_len=2)


def test_a_kimi_k2_folder_read_without_its_code_is_our_error_not_a_traceback(tmp_path):
    """A Kimi K2 folder (config.json of model_type kimi_k2 mapped onto its own code, a yarn `rope_scaling` block as
    DeepSeek-V3's): AutoTokenizer without trust_remote_code falls back to a bare PreTrainedConfig and raises
    AttributeError (max_position_embeddings), which escaped as a traceback from `glmq eval` (exit 1, "a figure is
    not a finite number") and GPTQ calibration. Now it is glmq's message, with the remedy."""
    from click.testing import CliRunner

    from glmq.scripts.cli import main

    path = fixtures.make_checkpoint(tmp_path / "k", "deepseek_v3", config_overrides={"model_type": "kimi_k2"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"], cfg["rope_scaling"] = 50000.0, {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 1.0,
                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    (path / "config.json").write_text(json.dumps(cfg))
    fixtures.write_byte_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>"}))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(DOCS))
    with pytest.raises(CalibrationDataError, match="pass --trust-remote-code"):
        calibration_tokens(path, str(text), 4, 32)
    assert calibration_tokens(path, str(text), 4, 32, trust_remote_code=True).shape == (4, 32)
    res = CliRunner().invoke(main, ["eval", str(path), str(path), "--text", str(text), "--windows", "2",
                                    "--seq-len", "32"])
    assert res.exit_code == 2 and "pass --trust-remote-code" in res.output, res.output
