"""Read any checkpoint glmq knows (FP8 block, compressed-tensors FP8, pack-quantized INT, dense)
back as plain floating-point tensors under the on-disk Hugging Face names.

Used by evaluation and validation: the INT weights are unpacked with glmq's own packer (which the
tests hold bit-exact against compressed-tensors), FP8 with the same dequantizer the converter uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from glmq.formats import fp8
from glmq.formats.safetensors_io import CheckpointError, read_header, read_json_object
from glmq.formats.source import weight_map
from glmq.quantize.pack import unpack_int32, unpack_zero_point


def _read_json(path: Path) -> dict:
    """A JSON object file of a checkpoint, or a CheckpointError naming it."""
    return read_json_object(path, "not a checkpoint folder, or one whose writing did not finish",
                            "re-download or re-write it")


def _weight_map(root: Path) -> dict[str, str]:
    """Tensor -> shard of a checkpoint (a written one, or a source read as one), `source.weight_map`'s checks."""
    return weight_map(root, _read_json, "not a checkpoint folder, or one whose writing did not finish")


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], num_bits: int,
                      group_size: int, zero_point: torch.Tensor | None = None,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """pack-quantized tensors of one Linear -> `[N, K]` in the scale dtype: (q - zp) * scale.

    `g_idx` (`weight_g_idx`, activation-ordered groups): column k takes the scale and zero point of group
    g_idx[k] instead of k // group_size, as compressed-tensors (before 0.19) and vLLM read it."""
    n, k = shape
    if g_idx is not None:
        gi = g_idx.to(torch.int64)
        q = unpack_int32(packed, k, num_bits).to(scale.dtype)
        if zero_point is not None:
            q = q - unpack_zero_point(zero_point, n, num_bits).to(scale.dtype)[:, gi]
        return q * scale[:, gi]
    q = unpack_int32(packed, k, num_bits).view(n, k // group_size, group_size).to(scale.dtype)
    if zero_point is not None:
        q = q - unpack_zero_point(zero_point, n, num_bits).to(scale.dtype).unsqueeze(-1)
    return (q * scale.unsqueeze(-1)).reshape(n, k)


KEEP_DTYPE = frozenset({"e_score_correction_bias"})  # tensors iter_dense never casts (its docstring says why)


def iter_dense(root: str | Path, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) with every quantized weight turned back into a `dtype` `.weight`.

    Scale/packing companions are consumed; other tensors pass through, float ones cast to `dtype` except the
    router's `e_score_correction_bias`, which keeps its dtype (float32 in the sources; transformers keeps it float32
    in a bf16 model, `_keep_in_fp32_modules_strict`, since rounding it shifts which experts are picked).
    """
    root = Path(root)
    config = _read_json(root / "config.json")
    qc = config.get("quantization_config") or {}
    wm = _weight_map(root)
    handles: dict[str, object] = {}

    def get(name: str, needed_by: str | None = None) -> torch.Tensor:
        if name not in wm:
            raise CheckpointError(f"{root}: tensor {name} is not in the checkpoint, but {needed_by} needs it; the "
                                  f"checkpoint is incomplete, re-write or re-download it")
        shard = wm[name]
        if shard not in handles:
            path = root / shard
            if not path.exists():
                raise CheckpointError(f"{path}: missing (its index lists tensor {name} in it); re-download or "
                                      f"re-write the checkpoint")
            read_header(path)  # a truncated or corrupt shard: a CheckpointError naming it
            handles[shard] = safe_open(str(path), "pt")
        try:
            return handles[shard].get_tensor(name)
        except SafetensorError as e:  # listed in the index but not in the shard
            raise CheckpointError(f"{root / shard}: cannot read tensor {name} ({e}); the index does not match the "
                                  f"shard, re-download or re-write the checkpoint") from e

    int_args = _int_args(qc)
    block = tuple(qc["weight_block_size"]) if qc.get("quant_method") == "fp8" else None
    ct_block = _float_block(qc)  # compressed-tensors FP8 blocks (glmq's keep_fp8 output), scale [N/b0, K/b1]
    float_strategies = {(g.get("weights") or {}).get("strategy") for g in (qc.get("config_groups") or {}).values()
                        if (g.get("weights") or {}).get("type") == "float"}
    # per row [N, 1] or per tensor [1] scales: compressed-tensors FP8 sources, not a block-only checkpoint
    channel_scales = block is None and (ct_block is None or bool(float_strategies - {"block"}))
    skip = {"weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point", "input_scale", "weight_g_idx"}
    for name in sorted(wm):
        module, _, leaf = name.rpartition(".")
        if leaf in skip:
            continue
        if leaf == "weight_packed":
            if int_args is None:
                raise CheckpointError(f"{root}: {name} is packed, but config.json's quantization_config has no "
                                      f"config group with int weights to say how to read it")
            bits, group = int_args
            zp = get(f"{module}.weight_zero_point") if f"{module}.weight_zero_point" in wm else None
            gi = get(f"{module}.weight_g_idx") if f"{module}.weight_g_idx" in wm else None
            shape = tuple(int(x) for x in get(f"{module}.weight_shape", name).tolist())
            group = shape[1] if group is None or group > shape[1] else group  # channel strategy: one group per row
            packed, scale = get(name), get(f"{module}.weight_scale", name)
            try:
                w = dequantize_packed(packed, scale, shape, bits, group, zp, gi)
            except (RuntimeError, ValueError, IndexError) as e:
                raise CheckpointError(f"{root}: {module}: weight_packed {list(packed.shape)}, weight_scale "
                                      f"{list(scale.shape)} and weight_shape {list(shape)} do not fit {bits}-bit "
                                      f"groups of {group} ({e}); the checkpoint is damaged, re-write it") from e
            yield f"{module}.weight", w.to(dtype)
            continue
        t = get(name)
        if t.dtype == torch.float8_e4m3fn:
            sname = f"{module}.weight_scale_inv" if block is not None else f"{module}.weight_scale"
            s = get(sname, name)
            n = t.shape[0] if t.ndim else 1
            blocks = block or ct_block
            b_shape = (-(-n // blocks[0]), -(-t.shape[1] // blocks[1])) if blocks and t.ndim == 2 else None
            channel = channel_scales and t.ndim == 2 and s.numel() in (1, n)
            if b_shape is not None and tuple(s.shape) == b_shape and not (channel and tuple(s.shape) == (n, 1)):
                t = fp8.dequantize_block(t, s, blocks)
            elif channel:
                t = fp8.dequantize_channel(t, s)
            else:
                fits = ([f"{list(b_shape)} ({blocks[0]}x{blocks[1]} blocks)"] if b_shape else []) + (
                    [f"[{n}, 1] (per row) or [1] (per tensor)"] if channel_scales else [])
                raise CheckpointError(
                    f"{root / wm[name]}: FP8 tensor {name} {list(t.shape)} has {sname} {list(s.shape)} (in "
                    f"{wm[sname]}), which does not fit it (expected {' or '.join(fits) or 'a 2-D weight'}); the "
                    f"checkpoint is damaged, re-download or re-write it")
        yield name, t.to(dtype) if t.is_floating_point() and leaf not in KEEP_DTYPE else t


def _int_args(qc: dict) -> tuple[int, int | None] | None:
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("type") == "int":  # group_size None: channel strategy, one group of K per row
            return int(w["num_bits"]), None if w.get("group_size") in (None, -1) else int(w["group_size"])
    return None


def _float_block(qc: dict) -> tuple[int, int] | None:
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("type") == "float" and w.get("strategy") == "block" and w.get("block_structure"):
            return tuple(int(x) for x in w["block_structure"])
    return None


def dense_config(root: str | Path) -> dict:
    config = _read_json(Path(root) / "config.json")
    config.pop("quantization_config", None)
    return config
