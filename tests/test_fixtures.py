"""Tests of glmq.formats.fixtures: the random checkpoints must have the real on-disk layouts
(formats.md §1), load in transformers, and be deterministic."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from glmq.formats import fixtures as fx

FORMATS = ("fp8-block", "fp8-ct", "bf16")
_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _headers(path) -> dict[str, tuple[str, list[int], str]]:
    """{tensor name: (safetensors dtype, shape, shard file)} read from the shard headers only."""
    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), s.get_shape(), shard.name)
    return out


def _tensor(path, name: str) -> torch.Tensor:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    with safe_open(path / index["weight_map"][name], "pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """One tiny checkpoint per (family, source format) with default options, shared by the tests."""
    root = tmp_path_factory.mktemp("matrix")
    return {(fam, fmt): fx.make_checkpoint(root / f"{fam}-{fmt}", fam, source_format=fmt)
            for fam in fx.FAMILIES for fmt in FORMATS}


@pytest.fixture(scope="module")
def fp8_block(matrix):
    return {fam: matrix[fam, "fp8-block"] for fam in fx.FAMILIES}


@pytest.mark.parametrize("source_format", FORMATS)
@pytest.mark.parametrize("family", fx.FAMILIES)
def test_every_family_and_format_generates_a_consistent_checkpoint(matrix, family, source_format):
    from transformers import AutoConfig

    path = matrix[family, source_format]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == family and config.architectures == [fx._ARCHITECTURES[family]]
    headers = _headers(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert {n: h[2] for n, h in headers.items()} == index["weight_map"]
    data_bytes = sum(math.prod(s) * _DTYPES[d].itemsize for d, s, _ in headers.values())
    assert index["metadata"]["total_size"] == data_bytes
    shards = sorted({h[2] for h in headers.values()})
    assert len(shards) >= 3
    assert all(SHARD_NAME.fullmatch(s) and SHARD_NAME.fullmatch(s)[2] == f"{len(shards):05d}" for s in shards)
    dtypes = {d for d, _, _ in headers.values()}
    qc = getattr(config, "quantization_config", None)
    if source_format == "bf16":
        assert dtypes == {"BF16", "F32"} and qc is None
    else:
        assert "F8_E4M3" in dtypes
        assert qc["quant_method"] == ("fp8" if source_format == "fp8-block" else "compressed-tensors")


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_fp8_block_pairs_every_fp8_weight_with_a_ceil_shaped_f32_scale_inv(fp8_block, family):
    headers = _headers(fp8_block[family])
    fp8 = [n for n, (d, _, _) in headers.items() if d == "F8_E4M3"]
    assert fp8 and all(n.endswith(".weight") for n in fp8)
    for name in fp8:
        n, k = headers[name][1]
        assert headers[name + "_scale_inv"][:2] == ("F32", [-(-n // 128), -(-k // 128)])
    scales = [n for n in headers if n.endswith("_scale_inv")]
    assert len(scales) == len(fp8)


def test_glm_moe_dsa_names_dtypes_and_shapes(fp8_block):
    h = _headers(fp8_block["glm_moe_dsa"])
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    expected = {
        "model.embed_tokens.weight": ("BF16", [512, 256]), "lm_head.weight": ("BF16", [512, 256]),
        "model.norm.weight": ("BF16", [256]),
        "model.layers.0.mlp.gate_proj.weight": ("F8_E4M3", [512, 256]),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", [2, 4]),
        a + "q_a_proj.weight": ("F8_E4M3", [128, 256]), a + "q_a_layernorm.weight": ("BF16", [128]),
        a + "q_b_proj.weight": ("F8_E4M3", [4 * 96, 128]),
        a + "kv_a_proj_with_mqa.weight": ("F8_E4M3", [160, 256]),
        a + "kv_a_proj_with_mqa.weight_scale_inv": ("F32", [2, 2]),  # 160 rows: padded edge block
        a + "kv_a_layernorm.weight": ("BF16", [128]), a + "kv_b_proj.weight": ("F8_E4M3", [4 * 128, 128]),
        a + "o_proj.weight": ("F8_E4M3", [256, 4 * 64]),
        a + "indexer.wq_b.weight": ("F8_E4M3", [4 * 64, 128]), a + "indexer.wk.weight": ("F8_E4M3", [64, 256]),
        a + "indexer.weights_proj.weight": ("BF16", [4, 256]),
        a + "indexer.k_norm.weight": ("BF16", [64]), a + "indexer.k_norm.bias": ("BF16", [64]),
        m + "experts.7.gate_proj.weight": ("F8_E4M3", [128, 256]),
        m + "experts.7.down_proj.weight": ("F8_E4M3", [256, 128]),
        m + "experts.7.down_proj.weight_scale_inv": ("F32", [2, 1]),
        m + "shared_experts.up_proj.weight": ("F8_E4M3", [128, 256]),
        m + "gate.weight": ("BF16", [8, 256]), m + "gate.e_score_correction_bias": ("F32", [8]),
        "model.layers.3.eh_proj.weight": ("BF16", [256, 512]), "model.layers.3.enorm.weight": ("BF16", [256]),
        "model.layers.3.hnorm.weight": ("BF16", [256]), "model.layers.3.shared_head.norm.weight": ("BF16", [256]),
        "model.layers.3.self_attn.indexer.wk.weight": ("F8_E4M3", [64, 256]),
        "model.layers.3.mlp.experts.0.up_proj.weight": ("F8_E4M3", [128, 256]),
    }
    assert {n: tuple(h[n][:2]) for n in expected} == {n: (d, s) for n, (d, s) in expected.items()}
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in h  # layer 0 is dense
    assert not any(n.startswith(("model.layers.3.shared_head.head", "model.layers.3.embed_tokens")) for n in h)
    assert not any(n.startswith("model.layers.4.") for n in h)
    config = json.loads((fp8_block["glm_moe_dsa"] / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    unconverted = set(config["quantization_config"]["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.1.mlp.gate", "model.layers.3.eh_proj",
            "model.layers.2.self_attn.indexer.weights_proj"} <= unconverted


def test_glm4_moe_names_dtypes_and_shapes(fp8_block):
    h = _headers(fp8_block["glm4_moe"])
    a = "model.layers.1.self_attn."
    expected = {
        a + "q_proj.weight": ("F8_E4M3", [256, 256]), a + "k_proj.weight": ("F8_E4M3", [128, 256]),
        a + "v_proj.weight_scale_inv": ("F32", [1, 2]), a + "o_proj.weight": ("F8_E4M3", [256, 256]),
        a + "q_proj.bias": ("BF16", [256]), a + "k_proj.bias": ("BF16", [128]),
        "model.layers.3.shared_head.head.weight": ("BF16", [512, 256]),
        "model.layers.3.embed_tokens.weight": ("BF16", [512, 256]),
        "model.layers.3.mlp.gate.e_score_correction_bias": ("F32", [8]),
    }
    assert {n: tuple(h[n][:2]) for n in expected} == {n: (d, s) for n, (d, s) in expected.items()}
    assert not any("q_norm" in n or "kv_a_proj" in n or "indexer" in n for n in h)


def test_deepseek_v3_is_mla_without_indexer_and_mtp_with_head(fp8_block):
    h = _headers(fp8_block["deepseek_v3"])
    assert h["model.layers.2.self_attn.kv_b_proj.weight"][:2] == ("F8_E4M3", [512, 128])
    assert h["model.layers.3.shared_head.head.weight"][:2] == ("BF16", [512, 256])
    assert not any("indexer" in n for n in h)


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_fp8_block_scale_is_block_absmax_over_448_and_varies(fp8_block, family):
    path = fp8_block[family]
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" if family != "glm4_moe" else \
        "model.layers.1.self_attn.q_proj.weight"
    q, s = _tensor(path, name).float(), _tensor(path, name + "_scale_inv")
    n, k = q.shape
    padded = torch.nn.functional.pad(q.abs(), (0, -k % 128, 0, -n % 128))
    block_max = padded.view(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3))
    assert torch.equal(block_max, torch.full_like(block_max, 448.0))
    experts = torch.stack([_tensor(path, f"model.layers.1.mlp.experts.{e}.gate_proj.weight_scale_inv")
                           for e in range(8)])
    assert experts.min() > 0 and experts.max() > 1.5 * experts.min()


def test_fp8_ct_has_per_channel_or_per_tensor_weight_scale(matrix, tmp_path):
    path = matrix["glm4_moe", "fp8-ct"]
    h = _headers(path)
    assert h["model.layers.1.mlp.experts.3.down_proj.weight_scale"][:2] == ("F32", [256, 1])
    assert not any(n.endswith("_scale_inv") for n in h)
    q = _tensor(path, "model.layers.1.mlp.experts.3.down_proj.weight").float()
    assert torch.equal(q.abs().amax(dim=1), torch.full((256,), 448.0))
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert (qc["format"], group["targets"], group["weights"]["strategy"]) == ("float-quantized", ["Linear"], "channel")
    assert group["input_activations"]["dynamic"] and "scale_dtype" not in json.dumps(qc)
    assert "model.layers.3.shared_head.head" in qc["ignore"]
    path = fx.make_checkpoint(tmp_path / "t", "glm4_moe", source_format="fp8-ct", fp8_ct_strategy="tensor")
    assert _headers(path)["model.layers.1.self_attn.o_proj.weight_scale"][:2] == ("F32", [1])


def _split_pairs(path) -> list[str]:
    """The scale tensors that sit in another shard than their weight."""
    wm = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [n for n in wm if re.search(r"\.weight_scale(_inv)?$", n)]
    return [n for n in scales if wm[n] != wm[n[: n.rindex("_scale")]]]


@pytest.mark.parametrize("source_format", ["fp8-block", "fp8-ct"])
def test_split_partners_puts_some_scales_in_another_shard(matrix, source_format):
    for family in fx.FAMILIES:
        assert _split_pairs(matrix[family, source_format])


def test_split_partners_holds_with_a_single_shard_budget(tmp_path):
    # The MTP layer's scales start a shard of their own, so even a 1 GB budget splits pairs.
    path = fx.make_checkpoint(tmp_path / "c", "deepseek_v3", max_shard_bytes=10**9)
    assert len({h[2] for h in _headers(path).values()}) == 2 and _split_pairs(path)


def test_unsplit_small_shards_without_side_files(matrix, tmp_path):
    path = fx.make_checkpoint(tmp_path / "c", "glm4_moe", max_shard_bytes=400_000, split_partners=False,
                              side_files=False)
    assert not _split_pairs(path)
    per_shard: dict[str, int] = {}
    for dtype, shape, shard in _headers(path).values():
        per_shard[shard] = per_shard.get(shard, 0) + math.prod(shape) * _DTYPES[dtype].itemsize
    assert len(per_shard) > 10 and max(per_shard.values()) <= 400_000
    side = {"generation_config.json", "tokenizer_config.json", "chat_template.jinja", fx.CUSTOM_CODE_FILE}
    assert not side & {p.name for p in path.iterdir()}
    assert side <= {p.name for p in matrix["glm4_moe", "fp8-block"].iterdir()}


def test_same_arguments_give_byte_identical_files(matrix, tmp_path):
    a = matrix["glm_moe_dsa", "fp8-block"]
    b = fx.make_checkpoint(tmp_path / "b", "glm_moe_dsa", source_format="fp8-block", seed=0)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    spec = fx.TensorSpec("model.layers.1.mlp.experts.0.up_proj.weight", (128, 256), "linear")
    one, other = (fx.materialize(spec, "fp8-block", seed)[spec.name] for seed in (0, 1))
    assert not torch.equal(one.view(torch.uint8), other.view(torch.uint8))


@pytest.mark.parametrize("where", ["shard", "side_files"])
def test_an_interrupted_generation_leaves_nothing_and_the_rerun_works(tmp_path, monkeypatch, where):
    """Ctrl-C in the third shard left two shards in out_dir (the rerun: `... is not empty`); in the side files it left
    config.json without them, which the bench scripts' `config.json exists` check takes for a whole checkpoint."""
    real_save, calls = fx.save_safetensors, []

    def save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    def side_files(out, config):
        raise KeyboardInterrupt

    if where == "shard":
        monkeypatch.setattr(fx, "save_safetensors", save)
    else:
        monkeypatch.setattr(fx, "_write_side_files", side_files)
    with pytest.raises(KeyboardInterrupt):
        fx.make_checkpoint(tmp_path / "c", "glm_moe_dsa")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    path = fx.make_checkpoint(tmp_path / "c", "glm_moe_dsa")
    assert (path / "config.json").is_file() and (path / "chat_template.jinja").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_byte_tokenizer_is_the_same_at_every_call(tmp_path):
    """Its vocabulary came from a hash set's order, another at every call: the same text got other token ids."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        fx.write_byte_tokenizer(tmp_path / d)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_glm4_moe_bf16_loads_in_transformers_with_only_mtp_keys_unexpected(matrix):
    from transformers import AutoModelForCausalLM

    path = matrix["glm4_moe", "bf16"]
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    assert torch.equal(model.model.embed_tokens.weight, _tensor(path, "model.embed_tokens.weight"))


def test_kimi_k2_override_keeps_deepseek_layout_and_loads_with_remote_code(tmp_path):
    from transformers import AutoConfig

    path = fx.make_checkpoint(tmp_path / "k", "deepseek_v3", config_overrides={"model_type": "kimi_k2"})
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert (config.model_type, config.architectures) == ("kimi_k2", ["DeepseekV3ForCausalLM"])
    assert "model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in _headers(path)


def test_indexer_only_on_full_layers_and_mtp_with_random_fp8_bytes(tmp_path):
    path = fx.make_checkpoint(tmp_path / "i", "glm_moe_dsa", random_fp8_bytes=True,
                              config_overrides={"indexer_types": ["full", "shared", "full"]})
    headers = _headers(path)
    assert {int(n.split(".")[2]) for n in headers if ".indexer." in n} == {0, 2, 3}
    unconverted = json.loads((path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.self_attn.indexer.weights_proj" not in unconverted
    assert "model.layers.2.self_attn.indexer.weights_proj" in unconverted
    q = _tensor(path, "model.layers.1.mlp.experts.0.up_proj.weight").float()
    assert not q.isnan().any() and q.abs().max() > 1.0
    assert (_tensor(path, "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv") > 0).all()


def test_bench_layout_has_glm5_expert_shapes_without_writing_data():
    config = fx.make_config("glm_moe_dsa", "bench")
    tensors = {t.name: t for unit in fx.tensor_layout(config) for t in unit}
    e = "model.layers.0.mlp.experts.31."
    assert tensors[e + "gate_proj.weight"].shape == (2048, 6144)
    assert tensors[e + "gate_proj.weight_scale_inv"].shape == (16, 48)
    assert tensors[e + "down_proj.weight_scale_inv"].shape == (48, 16)
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 48)
    assert tensors["model.layers.0.self_attn.indexer.wq_b.weight"].shape == (4096, 2048)
    assert tensors["model.layers.3.eh_proj.weight"].shape == (6144, 12288)
    assert "model.layers.0.mlp.experts.32.up_proj.weight" not in tensors
    assert 5e9 < sum(t.nbytes for t in tensors.values()) < 7e9


def test_random_fp8_bytes_are_never_nan():
    gen = torch.Generator().manual_seed(0)
    q = fx.random_fp8((1000, 131), gen)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1000, 131)
    assert not q.float().isnan().any() and q.float().abs().max() == 448.0


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="family"):
        fx.make_config("llama")
    with pytest.raises(ValueError, match="source_format"):
        fx.make_checkpoint(tmp_path / "x", source_format="int4")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "junk").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        fx.make_checkpoint(tmp_path / "full")
