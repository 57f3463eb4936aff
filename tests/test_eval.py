"""`glmq eval` and the dense reader under it: the checkpoints it must refuse with one clear line instead of a
traceback or figures of another model, and the pack-quantized variants it must read as compressed-tensors does."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from glmq import recipes
from glmq.calibration.evaluate import load_model
from glmq.formats import fixtures
from glmq.formats.dense import iter_dense
from glmq.formats.safetensors_io import CheckpointError
from glmq.formats.manifest import fingerprint
from glmq.formats.source import INDEX_NAME, open_source
from glmq.quantize import stream
from glmq.quantize.pack import pack_int32
from glmq.quantize.plan import make_plan
from glmq.scripts.cli import main


@pytest.fixture(scope="module")
def glm4(make_ckpt, tmp_path_factory):
    """(source with a byte tokenizer, its int4-w4a16 RTN output, an evaluation text)."""
    tmp = tmp_path_factory.mktemp("eval")
    src = tmp / "src"
    shutil.copytree(make_ckpt("glm4_moe", "fp8-block"), src)
    fixtures.write_byte_tokenizer(src)
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), tmp / "rtn", progress=False)
    rng = random.Random(0)
    (tmp / "eval.txt").write_text(" ".join(rng.choice(["expert", "router", "the", "of", "scale"]) for _ in range(300)))
    return src, tmp / "rtn", tmp / "eval.txt"


def _eval(*args) -> tuple[int, str, BaseException | None]:
    r = CliRunner().invoke(main, ["eval", *map(str, args)])
    return r.exit_code, r.output, None if isinstance(r.exception, SystemExit) else r.exception


def _drop(ckpt: Path, out: Path, prefix: str) -> Path:
    """A copy of `ckpt` whose index no longer lists the tensors named `prefix*`."""
    shutil.copytree(ckpt, out)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(prefix)}
    (out / INDEX_NAME).write_text(json.dumps(index))
    return out


def test_eval_source_and_quantized(glm4, tmp_path):
    src, rtn, text = glm4
    code, out, exc = _eval(src, rtn, "--text", text, "--seq-len", "32", "--windows", "3", "--json", tmp_path / "e.json")
    assert code == 0 and exc is None, out
    assert str(rtn)[-60:] in out
    # each row names the weights it evaluated (upload matches the report to the folder it publishes by them)
    rows = json.loads((tmp_path / "e.json").read_text())["models"]
    assert [r["fingerprint"] for r in rows] == [fingerprint(src), fingerprint(rtn)]
    assert len({fingerprint(src), fingerprint(rtn)}) == 2


@pytest.mark.parametrize("family,overrides,key", [("glm_moe_dsa", {}, "model_type"),
                                                  ("glm4_moe", {"num_hidden_layers": 4}, "num_hidden_layers")])
def test_eval_refuses_a_checkpoint_of_another_model(glm4, tmp_path, family, overrides, key):
    """Another architecture with the same vocabulary gave a KL and layer errors between unrelated models; one
    more layer crashed in the table (None error); a smaller vocabulary an IndexError traceback."""
    src, _, text = glm4
    other = fixtures.make_checkpoint(tmp_path / "other", family, preset="tiny", config_overrides=overrides)
    code, out, exc = _eval(src, other, "--text", text, "--seq-len", "32", "--windows", "3")
    assert exc is None and code == 2, out
    assert f"{other}: not a checkpoint of the source's model" in out and key in out


def test_eval_refuses_a_checkpoint_with_a_weight_missing(glm4, tmp_path):
    """A parameter without a tensor was left randomly initialised by transformers, and eval reported figures."""
    src, rtn, text = glm4
    broken = _drop(rtn, tmp_path / "broken", "model.layers.1.self_attn.o_proj.")
    code, out, exc = _eval(src, broken, "--text", text, "--seq-len", "32", "--windows", "3")
    assert exc is None and code == 2, out
    assert f"error: {broken}: 1 parameter(s)" in out and "model.layers.1.self_attn.o_proj.weight" in out
    with pytest.raises(CheckpointError, match="transformers would leave them random"):
        load_model(broken)


def test_eval_names_a_truncated_shard_and_a_missing_companion(glm4, tmp_path):
    src, rtn, text = glm4
    trunc = tmp_path / "trunc"
    shutil.copytree(rtn, trunc)
    shard = sorted(trunc.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, out, exc = _eval(src, trunc, "--text", text, "--seq-len", "32", "--windows", "3")
    assert exc is None and code == 2, out  # was SafetensorError's traceback
    assert f"{shard}: file is" in out and "truncated" in out
    module = "model.layers.1.mlp.experts.0.down_proj"
    noshape = _drop(rtn, tmp_path / "noshape", f"{module}.weight_shape")
    with pytest.raises(CheckpointError, match=rf"{module}\.weight_shape is not in the checkpoint.*{module}\.weight_packed"):
        list(iter_dense(noshape))  # was a KeyError
    badshape = tmp_path / "badshape"
    shutil.copytree(rtn, badshape)
    shard = badshape / json.loads((badshape / INDEX_NAME).read_text())["weight_map"][f"{module}.weight_shape"]
    t = load_file(shard)
    t[f"{module}.weight_shape"] = t[f"{module}.weight_shape"] * torch.tensor([1, 2])
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{module}: weight_packed \[256, 16\], weight_scale \[256, 1\] and "
                                              r"weight_shape \[256, 256\] do not fit 4-bit groups of 128"):
        list(iter_dense(badshape))  # was a RuntimeError from view()


def test_eval_names_a_folder_without_config_or_tokenizer(glm4, tmp_path):
    src, rtn, text = glm4
    (tmp_path / "empty").mkdir()
    code, out, exc = _eval(src, tmp_path / "empty", "--text", text)
    assert exc is None and code == 2 and f"{tmp_path / 'empty'}: no config.json" in out, out
    notok = tmp_path / "notok"
    shutil.copytree(rtn, notok, ignore=shutil.ignore_patterns("tokenizer*"))
    code, out, exc = _eval(notok, "--text", text, "--seq-len", "32")
    assert exc is None and code == 2 and f"{notok}: cannot load its tokenizer" in out, out
    listcfg = tmp_path / "listcfg"  # a config.json that is JSON but no object was an AttributeError traceback
    shutil.copytree(rtn, listcfg)
    (listcfg / "config.json").write_text("[]")
    code, out, exc = _eval(src, listcfg, "--text", text)
    assert exc is None and code == 2 and f"{listcfg / 'config.json'}: holds a JSON list, not an object" in out, out


def _packed_checkpoint(out: Path, tensors: dict, weights: dict) -> Path:
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}}}
    (out / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return out


def test_activation_ordered_groups_use_g_idx(tmp_path):
    """weight_g_idx (actorder "group"): column k takes the scale of group g_idx[k], as compressed-tensors before
    0.19 and vLLM read it; it was ignored (contiguous groups assumed), 63 % of the largest weight off."""
    n, k, g = 16, 256, 64
    gen = torch.Generator().manual_seed(0)
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)].to(torch.int32)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // g, generator=gen) + 0.5).bfloat16()
    zp = torch.randint(-8, 8, (n, k // g), generator=gen, dtype=torch.int8)
    from glmq.quantize.pack import pack_zero_point

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": g,
               "actorder": "group", "dynamic": False}
    sym = _packed_checkpoint(tmp_path / "sym", {"m.weight_packed": pack_int32(q), "m.weight_scale": scale,
                                                "m.weight_shape": torch.tensor([n, k]), "m.weight_g_idx": g_idx}, weights)
    want = q.to(torch.bfloat16) * scale[:, g_idx.long()]
    assert torch.equal(dict(iter_dense(sym, torch.bfloat16))["m.weight"], want)
    asym = _packed_checkpoint(tmp_path / "asym", {"m.weight_packed": pack_int32(q), "m.weight_scale": scale,
                                                  "m.weight_zero_point": pack_zero_point(zp),
                                                  "m.weight_shape": torch.tensor([n, k]), "m.weight_g_idx": g_idx},
                              weights | {"symmetric": False})
    want = (q.to(torch.bfloat16) - zp.to(torch.bfloat16)[:, g_idx.long()]) * scale[:, g_idx.long()]
    assert torch.equal(dict(iter_dense(asym, torch.bfloat16))["m.weight"], want)


def test_channel_strategy_reads_as_compressed_tensors(tmp_path):
    """strategy "channel" (group_size null, e.g. compressed-tensors' W8A16 preset): was int(None), a TypeError."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    for bits in (4, 8):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        scale = (w.float().abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 0.5)).bfloat16()
        comp = BaseCompressor.load_from_registry("pack-quantized")
        packed = comp.compress({"weight": w, "weight_scale": scale}, scheme)
        theirs = comp.decompress(dict(packed), scheme)["weight"]
        ck = _packed_checkpoint(tmp_path / f"c{bits}", {f"m.{k}": v.contiguous() for k, v in packed.items()},
                                json.loads(args.model_dump_json()))
        assert torch.equal(dict(iter_dense(ck, torch.bfloat16))["m.weight"], theirs)


def test_plot_folder_is_checked_before_the_work(glm4, tmp_path):
    """--plot in a folder that does not exist: refused when the options are parsed, as --json is; it was found
    only by matplotlib's savefig after the evaluation, a FileNotFoundError traceback (without matplotlib: exit 0)."""
    src, _, text = glm4
    code, out, exc = _eval(src, "--text", text, "--plot", tmp_path / "nodir" / "layers.png")
    assert code == 2 and f"folder {tmp_path / 'nodir'} does not exist" in out, out


def test_plot_without_matplotlib_is_refused_before_the_work(glm4, tmp_path, monkeypatch):
    """--plot without matplotlib evaluated, said "no plot written" and exited 0: a CI step that asked for the PNG
    found none. It is refused when the options are parsed (exit 2, could not run), and no JSON is written."""
    src, rtn, text = glm4
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    code, out, exc = _eval(src, rtn, "--text", text, "--json", tmp_path / "e.json", "--plot", tmp_path / "p.png")
    assert exc is None and code == 2 and "the plot needs matplotlib" in out and "pip install matplotlib" in out, out
    assert not (tmp_path / "e.json").exists() and "perplexity" not in out


def test_plot_replaces_a_link_and_a_full_disk_is_one_line(glm4, tmp_path, monkeypatch):
    """--plot was written by matplotlib's savefig: through a link in its place (into a model's blobs/), and a full disk
    was an OSError traceback with a half PNG left. It goes through the reports' temporary name and rename, as --json
    does, in the format its name asks for (a stand-in matplotlib and plot writer: CI has no matplotlib)."""
    import types

    from glmq.calibration import compare

    src, rtn, text = glm4
    backend_bases = types.ModuleType("matplotlib.backend_bases")

    class FigureCanvasBase:
        @staticmethod
        def get_supported_filetypes():
            return {"png": "Portable Network Graphics", "svg": "Scalable Vector Graphics", "jpg": "JPEG",
                    "pgf": "PGF code for LaTeX"}

    backend_bases.FigureCanvasBase = FigureCanvasBase
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", backend_bases)
    formats = []

    def plot(result, path, fmt="png"):
        formats.append(fmt)
        Path(path).write_bytes(b"PLOT " + fmt.encode())

    monkeypatch.setattr(compare, "plot_layer_errors", plot)
    blob = tmp_path / "blob"
    blob.write_bytes(b"a model's bytes")
    (tmp_path / "p.svg").symlink_to(blob)
    code, out, exc = _eval(src, rtn, "--text", text, "--windows", "1", "--plot", tmp_path / "p.svg")
    assert exc is None and code == 0 and f"plot written to {tmp_path / 'p.svg'}" in out, out
    assert blob.read_bytes() == b"a model's bytes" and not (tmp_path / "p.svg").is_symlink()
    assert (tmp_path / "p.svg").read_bytes() == b"PLOT svg" and formats == ["svg"]
    code, out, exc = _eval(src, rtn, "--text", text, "--windows", "1", "--plot", tmp_path / "p.JPG")
    assert code == 0 and (tmp_path / "p.JPG").read_bytes() == b"PLOT jpg"  # the format its name asks for
    (tmp_path / "p.JPG").unlink()
    code, out, exc = _eval(src, rtn, "--text", text, "--plot", tmp_path / "p.tiff")  # refused before the work
    assert code == 2 and "p.tiff: matplotlib writes no .tiff files; name it .png, or one of .jpg, .svg" in out, out
    code, out, exc = _eval(src, rtn, "--text", text, "--plot", tmp_path / "p.pgf")  # needs LaTeX: failed at the end
    assert code == 2 and "p.pgf: matplotlib writes no .pgf files" in out, out

    def full(result, path, fmt="png"):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compare, "plot_layer_errors", full)
    code, out, exc = _eval(src, rtn, "--text", text, "--windows", "1", "--plot", tmp_path / "q.png")
    assert exc is None and code == 2 and f"{tmp_path / 'q.png'}: could not be written (No space left on device)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob", "p.svg"]


def test_windows_longer_than_the_models_positions_are_refused(glm4):
    """--seq-len past max_position_embeddings scored positions the model never saw (perplexity 196 on the shared
    model, exit 0); GPTQ's calibration refuses them, and so does eval, before loading anything."""
    src, rtn, text = glm4
    limit = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    code, out, exc = _eval(src, rtn, "--text", text, "--seq-len", str(limit + 1), "--windows", "1")
    assert exc is None and code == 2, out
    assert f"--seq-len {limit + 1} is longer than the model's max_position_embeddings ({limit})" in out


def test_the_mtp_layer_is_not_handed_to_transformers(glm4, capfd):
    """transformers' model has no MTP layer: its tensors were loaded as unexpected keys, one warning line each."""
    from glmq.formats.families import mtp_layers

    src, rtn, _ = glm4
    cfg = json.loads((src / "config.json").read_text())
    (mtp,) = mtp_layers(cfg)
    assert any(f"layers.{mtp}." in k for k in json.loads((rtn / INDEX_NAME).read_text())["weight_map"])
    capfd.readouterr()
    model = load_model(rtn)
    err = capfd.readouterr().err
    assert f"layers.{mtp}." not in err and "unexpected" not in err.lower(), err
    assert len(model.model.layers) == cfg["num_hidden_layers"]


def test_the_router_bias_keeps_float32_in_a_dense_bf16_copy(glm4):
    """iter_dense(bf16) rounded the float32 e_score_correction_bias to bf16 (transformers keeps it float32 in a bf16
    model): the dense copy that peers calibrate on (scripts/bench_gptq.py) routed tokens to other experts."""
    src, rtn, _ = glm4
    for root in (src, rtn):
        dense = dict(iter_dense(root, torch.bfloat16))
        biases = [k for k in dense if k.endswith("e_score_correction_bias")]
        assert biases
        for k in biases:
            assert dense[k].dtype == torch.float32
        stored = {k: t for shard in sorted(Path(root).glob("*.safetensors")) for k, t in load_file(shard).items()}
        assert all(torch.equal(dense[k], stored[k]) for k in biases)
        assert dense["model.norm.weight"].dtype == torch.bfloat16


def _strict_json(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("damage", ["overflow", "nan"])
def test_a_model_whose_figures_are_not_finite_fails_with_null_in_the_json(glm4, tmp_path, damage):
    """A mean NLL above ~709 was an OverflowError traceback in math.exp (no JSON, the source's figures lost too); a NaN
    in lm_head exited 0 with `"perplexity": NaN` in the JSON, which strict parsers refuse and a CI gate read as a
    pass."""
    src, rtn, text = glm4
    broken = Path(shutil.copytree(rtn, tmp_path / "broken"))
    shard = broken / json.loads((broken / INDEX_NAME).read_text())["weight_map"]["lm_head.weight"]
    tensors = load_file(shard)
    head = tensors["lm_head.weight"].float()
    if damage == "overflow":
        head *= 1e6
    else:
        head[0, 0] = float("nan")
    tensors["lm_head.weight"] = head.to(tensors["lm_head.weight"].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    code, out, exc = _eval(src, broken, "--text", text, "--seq-len", "32", "--windows", "2", "--json",
                           tmp_path / "e.json")
    assert exc is None and code == 1, out
    assert "not finite numbers" in out and f"{broken}: perplexity {'inf' if damage == 'overflow' else 'nan'}" in out
    doc = _strict_json(tmp_path / "e.json")
    source, model = doc["models"]
    assert model["perplexity"] is None and source["perplexity"] > 1  # the source's figures are kept
    if damage == "nan":
        assert model["kl_to_source"] is None


def test_perplexity_past_a_floats_range_is_inf():
    import math

    from glmq.calibration.compare import format_table, json_ready, non_finite
    from glmq.calibration.evaluate import perplexity

    ids = torch.tensor([[0, 1, 1]])
    lp = torch.full((1, 2, 4), -800.0, dtype=torch.float64)
    assert perplexity(lp, ids) == math.inf
    assert perplexity(torch.full((1, 2, 4), -2.0), ids) == pytest.approx(math.e ** 2)
    assert math.isnan(perplexity(torch.full((1, 2, 4), math.nan), ids))
    result = {"text": "t", "seq_len": 3, "windows": 1, "models": [
        {"checkpoint": "a", "perplexity": math.inf, "kl_to_source": 0.0, "layer_rel_error": None},
        {"checkpoint": "b", "perplexity": 2.0, "kl_to_source": math.nan, "layer_rel_error": [0.1, None, math.nan]}]}
    assert non_finite(result) == ["a: perplexity inf", "b: kl_to_source nan", "b: layer_rel_error[2] nan"]
    assert json_ready(result)["models"][1]["layer_rel_error"] == [0.1, None, None]
    assert " - " in format_table(json_ready(result))  # a null figure prints as "-", not a TypeError


def test_eval_refuses_a_quantized_folder_given_twice(make_ckpt, tmp_path):
    """The same folder twice (`rtn rtn/`, or through a link) was loaded and evaluated twice, one identical row each:
    its time twice for nothing. Refused before any work (exit 2), naming both spellings."""
    from glmq.scripts.cli import main

    q = tmp_path / "q"
    q.mkdir()
    link = tmp_path / "link"
    link.symlink_to(q, target_is_directory=True)
    (tmp_path / "t.txt").write_text("text")
    for again in (f"{q}/", str(link)):
        r = CliRunner().invoke(main, ["eval", str(make_ckpt("glm4_moe")), str(q), again, "--text",
                                      str(tmp_path / "t.txt")])
        assert r.exit_code == 2 and f"{again}: the same folder as {q}, given twice" in r.output, r.output
