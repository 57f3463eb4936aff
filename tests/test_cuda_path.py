"""The CUDA path writes exactly the bytes the CPU path writes (runs on the lent GPU; skipped in CI)."""

import pytest
import torch

from glmq import recipes
from glmq.formats.source import open_source
from glmq.quantize import stream
from glmq.quantize.plan import make_plan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("recipe", ["int4-w4a16", "int4-w4a16-all-linear", "int4-w4a16-g32"])
def test_cuda_output_is_byte_identical_to_cpu(make_ckpt, tmp_path, recipe):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load(recipe), 300_000)
    stream.run(plan, tmp_path / "cpu", device="cpu", progress=False)
    stream.run(plan, tmp_path / "cuda", device="cuda", progress=False)
    for f in [*plan.files]:
        assert (tmp_path / "cpu" / f.name).read_bytes() == (tmp_path / "cuda" / f.name).read_bytes(), f.name
    for name in ("config.json", "model.safetensors.index.json", "glmq_manifest.json"):
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-ct"])
def test_calibration_layer_state_dequantized_on_the_gpu_is_bit_identical(make_ckpt, fmt):
    """GPTQ on CUDA dequantizes each layer's FP8 weights on the GPU (the host never holds the BF16
    layer): the values must be the ones the CPU path, and RTN, quantize."""
    from glmq.calibration.layers import SourceTensors

    source = open_source(make_ckpt("glm_moe_dsa", fmt))
    cpu, gpu = SourceTensors(source), SourceTensors(source, "cuda")
    for i in range(source.config["num_hidden_layers"]):
        a, b = cpu.layer_state(i), gpu.layer_state(i)
        assert sorted(a) == sorted(b)
        for k in a:
            assert b[k].device.type == "cuda", k
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k].cpu()), k
    assert not gpu.handles  # the shards' memory maps are closed after each layer
