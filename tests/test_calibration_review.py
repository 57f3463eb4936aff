"""Review of calibration/data.py and calibration/cache.py: inputs and cache files those modules mishandled.

What is asserted:
- A calibration text, JSON Lines or JSON array file saved with a UTF-8 byte-order mark (Windows editors,
  PowerShell) gives the same tokens as the same file without one: neither an error nor the mark's bytes.
- A dataset row whose "text" is null is skipped (as in a Parquet file), not a tokenizer crash.
- A torn `calibration.json` or an unreadable layer file is a CalibrationCacheError naming the file and what to
  remove; once removed as it says, the run resumes and finishes.
- A byte changed in a layer file's tensor data (which safetensors reads without complaint) is caught by the
  checksum recorded when the file was written: every read names the file and the tensor, at a resume's
  regeneration and at the final write alike; a layer file without checksums (written before they were
  recorded) is still read.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glmq.calibration import cache as cc
from glmq.calibration.data import calibration_tokens
from glmq.formats import fixtures

BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    fixtures.write_byte_tokenizer(d)
    return d


def _docs() -> list[str]:
    return [f"document {i}: " + "the router sends each token to its experts. " * 6 for i in range(6)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json-array", "json-lines"])
def test_a_byte_order_mark_is_no_text(tok_dir, tmp_path, kind):
    docs = _docs()
    body = {"txt": "\n".join(docs),
            "jsonl": "".join(json.dumps({"text": d}) + "\n" for d in docs),
            "json-array": json.dumps([{"text": d} for d in docs]),
            "json-lines": "".join(json.dumps({"text": d}) + "\n" for d in docs)}[kind].encode()
    suffix = {"txt": ".txt", "jsonl": ".jsonl", "json-array": ".json", "json-lines": ".json"}[kind]
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_bytes(body)
    marked.write_bytes(BOM + body)
    want = calibration_tokens(tok_dir, str(plain), samples=8, seq_len=32, seed=1)
    got = calibration_tokens(tok_dir, str(marked), samples=8, seq_len=32, seed=1)
    assert torch.equal(got, want)


def test_null_text_rows_of_a_dataset_are_skipped(tok_dir, monkeypatch):
    docs = _docs()

    class Dataset:
        def __init__(self, rows):
            self.rows, self.column_names = rows, ["text"]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    def load(rows):
        fake = types.ModuleType("datasets")
        fake.load_dataset = lambda repo, config=None, split=None: Dataset(rows)
        monkeypatch.setitem(sys.modules, "datasets", fake)

    rows = [{"text": d} for d in docs]
    rows[1:1] = rows[4:4] = [{"text": None}]
    load([r if r["text"] is not None else {"text": ""} for r in rows])  # "": a document of no tokens
    want = calibration_tokens(tok_dir, "org/calib", samples=8, seq_len=32, seed=0)
    load(rows)  # the same rows in the same seeded order, null where the other has ""
    assert torch.equal(calibration_tokens(tok_dir, "org/calib", samples=8, seq_len=32, seed=0), want)


def test_a_torn_identity_file_is_a_clear_error(tmp_path):
    cc.check_identity(tmp_path, {"settings": {"seed": 0}}, "cpu")
    for torn in ('{"plan": ', "[]", b"\xff\xfe"):
        path = tmp_path / cc.IDENTITY_NAME
        path.write_bytes(torn if isinstance(torn, bytes) else torn.encode())
        with pytest.raises(cc.CalibrationCacheError, match=rf"calibration.json: unreadable .*remove .*{tmp_path.name}"):
            cc.check_identity(tmp_path, {"settings": {"seed": 0}}, "cpu")


def test_an_unreadable_layer_file_is_a_clear_error(tmp_path):
    good = {"m.weight_packed": torch.zeros(2, 1, dtype=torch.int32)}
    cc.save_layer(tmp_path, 0, good, {"layer": 0})
    assert cc.layer_meta(tmp_path, 0) == {"layer": 0}
    data = cc.layer_file(tmp_path, 0).read_bytes()
    from safetensors.torch import save_file

    for name, write in [("empty", lambda p: p.write_bytes(b"")),
                        ("truncated", lambda p: p.write_bytes(data[: len(data) - 4])),
                        ("foreign", lambda p: save_file(good, str(p)))]:
        write(cc.layer_file(tmp_path, 3))
        with pytest.raises(cc.CalibrationCacheError, match=r"layer-00003.safetensors: not a readable GPTQ layer file"
                                                           r".*remove it to calibrate decoder layer 3"):
            cc.layer_meta(tmp_path, 3)


def _run_killed_at_layer_2(make_ckpt, tmp_path, monkeypatch):
    """A GPTQ run of the tiny GLM-4.x MoE killed as it starts decoder layer 2 (layer files 0 and 1 are written), and a
    `rerun()` of the same job."""
    sys.path.insert(0, str(Path(__file__).parent))
    from glmq.calibration import engine
    from test_gptq_engine import calib_ids, gptq_plan, settings

    src, out = make_ckpt("glm4_moe", "fp8-block"), tmp_path / "out"
    orig = engine._Run.layer

    def dying(self, i, *a):
        if i == 2:
            raise KeyboardInterrupt
        return orig(self, i, *a)

    def rerun() -> dict:
        return engine.run_gptq(gptq_plan(src), out, calib_ids(), settings(), progress=False)

    monkeypatch.setattr(engine._Run, "layer", dying)
    with pytest.raises(KeyboardInterrupt):
        rerun()
    monkeypatch.setattr(engine._Run, "layer", orig)
    return out, rerun


def test_a_run_with_a_torn_layer_file_stops_and_resumes_once_it_is_removed(make_ckpt, tmp_path, monkeypatch):
    out, rerun = _run_killed_at_layer_2(make_ckpt, tmp_path, monkeypatch)
    layer1 = cc.layer_file(out / cc.CACHE_DIR, 1)
    layer1.write_bytes(layer1.read_bytes()[:100])  # as a copy or a disk that lost the file's end leaves it
    with pytest.raises(cc.CalibrationCacheError, match="layer-00001.safetensors: not a readable GPTQ layer file"):
        rerun()
    layer1.unlink()
    assert rerun()["gptq"]["resumed_from_layer"] == 1


def _flip_data_byte(path: Path, tensor: str) -> None:
    """Flip the low bit of `tensor`'s first data byte in the safetensors file at `path` (header untouched)."""
    from glmq.formats.safetensors_io import read_header

    entries, _, start = read_header(path)
    data = bytearray(path.read_bytes())
    data[start + entries[tensor].begin] ^= 1
    path.write_bytes(bytes(data))


def _one_layer() -> tuple[dict, object]:
    from glmq.quantize.rtn import QWeight
    from glmq.quantize.spec import QuantSpec

    spec = QuantSpec(group_size=32)
    q = torch.randint(-8, 8, (4, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    tensors = cc.pack_layer({"model.layers.0.mlp.down_proj": QWeight(q, torch.rand(4, 2, dtype=torch.bfloat16), None)},
                            spec)
    return tensors, spec


def test_a_changed_byte_in_a_layer_file_is_named_on_every_read(tmp_path):
    tensors, spec = _one_layer()
    cc.save_layer(tmp_path, 0, tensors, {"layer": 0})
    mod = "model.layers.0.mlp.down_proj"
    want = cc.load_qweights(tmp_path, 0, spec)[mod]
    assert torch.equal(cc.CachedQWeights(tmp_path, spec, 1)(mod).q, want.q)
    path = cc.layer_file(tmp_path, 0)
    _flip_data_byte(path, f"{mod}.weight_packed")
    msg = (rf"layer-00000.safetensors: tensor {mod}.weight_packed does not match the checksum recorded when it was "
           r"written.*remove layer-00000.safetensors to calibrate decoder layer 0 and the layers after it again")
    with pytest.raises(cc.CalibrationCacheError, match=msg):
        cc.load_qweights(tmp_path, 0, spec)
    with pytest.raises(cc.CalibrationCacheError, match=msg):
        cc.CachedQWeights(tmp_path, spec, 1)(mod)
    assert cc.layer_meta(tmp_path, 0) == {"layer": 0}  # the diagnostics alone are still readable

    from safetensors.torch import save_file

    # written before checksums were recorded: read as it is
    save_file(tensors, str(path), metadata={cc.META_KEY: json.dumps({"layer": 0})})
    assert torch.equal(cc.load_qweights(tmp_path, 0, spec)[mod].q, want.q)
    save_file(tensors, str(path), metadata={cc.META_KEY: "{}", cc.DIGESTS_KEY: "[1"})
    with pytest.raises(cc.CalibrationCacheError, match=r"layer-00000.safetensors: not a readable GPTQ layer file "
                                                       r"\(its 'glmq_digests' metadata is unreadable"):
        cc.load_qweights(tmp_path, 0, spec)


def test_a_run_stops_on_a_changed_layer_file_and_resumes_once_it_is_removed(make_ckpt, tmp_path, monkeypatch):
    out, rerun = _run_killed_at_layer_2(make_ckpt, tmp_path, monkeypatch)
    cache = out / cc.CACHE_DIR
    layer1 = cc.layer_file(cache, 1)  # (layer 0 of this model is dense and not quantized)
    with safe_open(str(layer1), "pt") as f:
        name = sorted(k for k in f.keys() if k.endswith(".weight_packed"))[0]
    _flip_data_byte(layer1, name)
    for p in cache.glob("hidden-*"):  # the resume regenerates layer 2's input from layer files 0 and 1
        p.unlink()
    with pytest.raises(cc.CalibrationCacheError, match=rf"layer-00001.safetensors: tensor {name} does not match"):
        rerun()
    layer1.unlink()
    assert rerun()["gptq"]["resumed_from_layer"] == 1


def test_hidden_states_checksum_in_order_out_of_order_and_in_place(tmp_path):
    """Activations.save records the xxh3-128 of the states beside the file, whichever way they were written."""
    import xxhash

    x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(0))
    want = xxhash.xxh3_128_hexdigest(x.numpy().tobytes())
    for order in ((0, 2, 4), (4, 0, 2)):  # in order: hashed as written; out of order: hashed at save
        store = cc.Activations.new_file(tmp_path / "a.tmp", tuple(x.shape), x.dtype)
        for b0 in order:
            store.write(b0, x[b0:b0 + 2])
        store.save(tmp_path / "hidden-00000.bin")
        assert cc.digest_path(tmp_path / "hidden-00000.bin").read_text().strip() == want
    mem = cc.Activations.in_memory(torch.zeros_like(x))
    for b0 in (0, 2, 4):
        mem.write(b0, torch.ones(2, 3, 4))
    for b0 in (0, 2, 4):  # a layer overwrites its input in place: the digest is of the new states
        mem.write(b0, x[b0:b0 + 2])
    mem.save(tmp_path / "hidden-00001.bin")
    assert cc.digest_path(tmp_path / "hidden-00001.bin").read_text().strip() == want
    for in_memory in (False, True):
        got = cc.Activations.load(tmp_path / "hidden-00001.bin", tuple(x.shape), x.dtype, in_memory)
        assert torch.equal(got.read(0, 6), x)
        cc.digest_path(tmp_path / "hidden-00001.bin").write_text("0" * 32)  # not these states: not read
        assert cc.Activations.load(tmp_path / "hidden-00001.bin", tuple(x.shape), x.dtype, in_memory) is None
        cc.digest_path(tmp_path / "hidden-00001.bin").unlink()  # saved before the checksums: not read either
        assert cc.Activations.load(tmp_path / "hidden-00001.bin", tuple(x.shape), x.dtype, in_memory) is None
        cc.digest_path(tmp_path / "hidden-00001.bin").write_text(want + "\n")


def test_a_changed_byte_in_saved_hidden_states_is_regenerated_not_read(make_ckpt, tmp_path, monkeypatch, caplog):
    """A resume read the newest hidden-state file unchecked: a byte changed on disk went into the calibration of
    every layer after it. Now the file is checked against the checksum saved with it, and regenerated from the
    (checked) layer files on a mismatch or where there is no checksum; the output is that of an unbroken run."""
    import logging

    from glmq.formats.safetensors_io import file_tensor_hashes

    out, rerun = _run_killed_at_layer_2(make_ckpt, tmp_path, monkeypatch)
    cache = out / cc.CACHE_DIR
    hidden = cache / "hidden-00001.bin"
    assert cc.digest_path(hidden).exists()
    data = bytearray(hidden.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = b"\x47" * 4096  # a block overwritten: states of ~5e4
    hidden.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="glmq"):
        rep = rerun()
    assert rep["gptq"]["resumed_from_layer"] == 2
    assert "hidden-00001.bin: does not match the checksum saved with it" in caplog.text
    assert "regenerating the input of layer 2" in caplog.text
    assert not list(cache.glob("hidden-*"))  # states and checksums are dropped once every layer is done

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gptq_engine import calib_ids, gptq_plan, settings

    from glmq.calibration import engine

    ref = tmp_path / "ref"
    engine.run_gptq(gptq_plan(make_ckpt("glm4_moe", "fp8-block")), ref, calib_ids(), settings(), progress=False)
    shards = sorted(p.name for p in ref.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shards:
        assert file_tensor_hashes(out / name) == file_tensor_hashes(ref / name), name
