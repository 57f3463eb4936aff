"""The source check: dequantized weights against the source checkpoint (RTN bound / GPTQ error), and
unquantized tensors unchanged.

It runs inside the one read of the checkpoint (reading.py): an unquantized tensor is compared while
its bytes, just hashed, are in memory, and a sampled quantized module when its tensors are all in
(numerics.ModuleScan). The source side reads each needed source tensor once, and only those: the
unquantized ones and the weights of the sampled modules. Which names exist on either side is settled
from the headers before reading. Source tensors become bf16 exactly as `glmq.formats.dense.iter_dense`
gives them (FP8 through the reference dequantizer `glmq.formats.fp8`, not the converter's fused kernel).
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import torch

from glmq.formats import fp8
from glmq.formats.dense import KEEP_DTYPE
from glmq.formats.families import layer_index, mtp_layers
from glmq.formats.manifest import REPORT_NAME
from glmq.formats.safetensors_io import DTYPE_NAMES, DTYPES, TensorEntry, read_header
from glmq.formats.source import weight_map
from glmq.quantize.validate.checkpoint import COMPANIONS, Checkpoint
from glmq.quantize.validate.config import Group
from glmq.quantize.validate.numerics import _row_blocks
from glmq.quantize.validate.report import CannotValidate, CheckResult


# RTN |w_q - w_src| in scale steps. Symmetric: 1/2 + 1/16 (tests/test_stream.py
# `assert_within_half_step`: two bf16 roundings of 1/32 step each). Asymmetric: the range is
# bf16(bf16(max - min) / 15), up to 2 u = 2^-7 short of max - min, i.e. 15 * 2^-7 < 1/8 step at the
# clamped end; the zero point's rounding is the 1/2 (measured worst: 0.616 steps).
def rtn_bound_steps(symmetric: bool, num_bits: int) -> float:
    """The bound above for `num_bits` (int4: 1/2 + 1/16 and 1/2 + 1/8): the bf16 roundings' part grows with the
    largest level, 2^(b-1) (symmetric) or 2^b - 1 (asymmetric) steps, so it is 2^(b-8) and 2^(b-7) steps (int8
    measured: 0.749 and 1.161, which the int4 bounds failed on every weight)."""
    return 0.5 + 2.0 ** (num_bits - (8 if symmetric else 7))


# Source leaves `iter_dense` folds into their weight (never compared on their own).
SOURCE_COMPANIONS = {"weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point", "input_scale",
                     "weight_g_idx"}


def recipe_method(ck: Checkpoint) -> str:
    """"rtn" or "gptq" from the manifest (or glmq_report.json); "rtn" when neither says."""
    rec = (ck.manifest.identity.get("recipe") if ck.manifest else None) or {}
    if not rec and (ck.root / REPORT_NAME).exists():
        try:
            doc = json.loads((ck.root / REPORT_NAME).read_text())
            rec = (doc.get("recipe") if isinstance(doc, dict) else None) or {}
        except ValueError:
            rec = {}
    return str(rec.get("method", "rtn")) if isinstance(rec, dict) else "rtn"


def rtn_in_gptq(ck: Checkpoint, quantized) -> set[str]:
    """The modules of a GPTQ checkpoint that glmq quantized by round-to-nearest, which the source check holds to RTN's
    bound: the MTP layer's (no calibration input reaches it) and the fallbacks the run report lists (GPTQ returned
    `quantize_rtn`'s result: an empty or indefinite Hessian, an expert too few tokens reached)."""
    mtp = set(mtp_layers(ck.config or {}))
    out = {m for m in quantized if layer_index(m) in mtp} if mtp else set()
    try:
        doc = json.loads((ck.root / REPORT_NAME).read_text())
        fallbacks = ((doc.get("gptq") or {}).get("fallbacks") or []) if isinstance(doc, dict) else []
        out |= {f["module"] for f in fallbacks if isinstance(f, dict) and isinstance(f.get("module"), str)}
    except (OSError, ValueError, AttributeError):
        pass
    return out


def weight_error(packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, shape: tuple[int, int],
                 g: Group, w_src: torch.Tensor, method: str) -> tuple[float, float | None]:
    """Stored weight vs source weight `[N, K]`: (error, bound).

    RTN: max |w_q - w_src| in scale steps (symmetric: beyond the clamp's unavoidable part), bound
    `rtn_bound_steps`.
    GPTQ: relative Frobenius error
    ||w_q - w_src|| / ||w_src||, no bound. Dequantization runs in float32, which is exact here:
    |q - zp| <= 2^b - 1 times a bf16 scale needs at most b + 8 significant bits.
    """
    from glmq.formats.dense import dequantize_packed

    (n, k), gs = shape, g.group_size or shape[1]
    worst, num, den = 0.0, 0.0, 0.0
    for r0, r1 in _row_blocks(n, k):
        z = None if zp is None else zp[r0 // (32 // g.num_bits):-(-r1 // (32 // g.num_bits))]
        s = scale[r0:r1].float()
        d = dequantize_packed(packed[r0:r1], s, (r1 - r0, k), g.num_bits, gs, z) - w_src[r0:r1].float()
        if method == "gptq":
            num += d.double().square().sum().item()
            den += w_src[r0:r1].double().square().sum().item()
        else:
            steps = d.view(r1 - r0, -1, gs).abs() / s.abs().unsqueeze(-1)
            if zp is None:  # symmetric: less the distance of a source value beyond [q_min, q_max] steps, which
                # no rounding can avoid (full_range's side of fewer levels, up to 1 step; absmax / 7.5's 1/2)
                x = w_src[r0:r1].float().view(r1 - r0, -1, gs) / s.unsqueeze(-1)
                q_max = (1 << (g.num_bits - 1)) - 1
                steps = steps - (x - q_max).clamp_min(0) - (-q_max - 1 - x).clamp_min(0)
            # a NaN (from a NaN scale) would lose every comparison: max(0.0, nan) is 0.0, and the weight passed
            worst = max(worst, steps.nan_to_num(nan=math.inf).amax().item())
    if method == "gptq":
        return math.sqrt(num / den) if den > 0 else math.inf, None
    return worst, rtn_bound_steps(g.symmetric, g.num_bits)


class SourceReader:
    """A source checkpoint's tensors by name, read on demand with positional reads (thread-safe).

    Raises (constructor):
        CannotValidate: config, index or a shard header cannot be read.
    """

    def __init__(self, root: Path):
        self.root = root
        try:
            qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
            wm = weight_map(root)
            self.entries: dict[str, TensorEntry] = {}
            self.starts: dict[str, int] = {}
            for shard in sorted(set(wm.values())):
                found, _, self.starts[shard] = read_header(root / shard)
                self.entries.update(found)
            self.block = tuple(qc["weight_block_size"]) if qc.get("quant_method") == "fp8" else None
            self.int_args = next(((int(w["num_bits"]), int(w["group_size"]))
                                  for grp in (qc.get("config_groups") or {}).values()
                                  if (w := grp.get("weights") or {}).get("type") == "int"), None)
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise _cannot(root, e) from e
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()

    def names(self) -> set[str]:
        """The names `iter_dense` yields: companions folded in, `X.weight_packed` as `X.weight`."""
        out = set()
        for name in self.entries:
            module, _, leaf = name.rpartition(".")
            if leaf == "weight_packed":
                out.add(f"{module}.weight")
            elif leaf not in SOURCE_COMPANIONS:
                out.add(name)
        return out

    def dense(self, name: str) -> torch.Tensor:
        """Tensor `name` as `iter_dense` gives it: quantized weights dequantized, floats in bf16 (but the router bias).

        Raises:
            CannotValidate: a read fails or a companion is missing or malformed.
        """
        try:
            return self._dense(name)
        except (OSError, KeyError, ValueError) as e:
            raise _cannot(self.root, e) from e

    def _dense(self, name: str) -> torch.Tensor:
        module = name.rpartition(".")[0]
        if name not in self.entries and f"{module}.weight_packed" in self.entries:
            from glmq.formats.dense import dequantize_packed

            bits, group = self.int_args
            zp = self.raw(f"{module}.weight_zero_point") if f"{module}.weight_zero_point" in self.entries else None
            shape = tuple(int(x) for x in self.raw(f"{module}.weight_shape").tolist())
            w = dequantize_packed(self.raw(f"{module}.weight_packed"), self.raw(f"{module}.weight_scale"), shape,
                                  bits, group, zp)
            return w.to(torch.bfloat16)
        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn:
            if self.block is not None:
                return _dequantize_block_rows(t, self.raw(f"{module}.weight_scale_inv"), self.block)
            return fp8.dequantize_channel(t, self.raw(f"{module}.weight_scale"))
        return t.to(torch.bfloat16) if t.is_floating_point() and name.rpartition(".")[2] not in KEEP_DTYPE else t

    def unchanged(self, name: str, t: torch.Tensor) -> bool:
        """Whether `t`, stored unquantized in the checkpoint, is what glmq writes for source tensor `name`
        (`difference` is None)."""
        return self.difference(name, t) is None

    def difference(self, name: str, t: torch.Tensor) -> str | None:
        """How `t`, stored unquantized in the checkpoint, differs from what glmq writes for source tensor
        `name`, or None. As quantize/plan.py decides: an FP8 weight is dequantized to BF16
        (Action.DEQUANTIZE), compared bit for bit with the reference dequantization (a block-FP8 one in one
        pass without building it: cpu_kernels.fp8_block_mismatches); any other tensor is copied as it is
        (Action.COPY): the same dtype and the same bytes (an F32 router bias stays F32, formats.md §1d).
        A pack-quantized source's weight (which glmq does not convert) is compared dequantized, as bf16.

        Raises:
            CannotValidate: as `dense`.
        """
        e, scale = self.entries.get(name), f"{name.rpartition('.')[0]}.weight_scale_inv"
        stored = DTYPE_NAMES.get(t.dtype, str(t.dtype))
        if e is not None and e.dtype != "F8_E4M3":  # copied
            if stored != e.dtype:
                return (f"stored as {stored} but the source has {e.dtype}: glmq copies this tensor unchanged "
                        f"(same dtype, same bytes)")
            try:
                same = tuple(t.shape) == tuple(e.shape) and torch.equal(_as_bytes(t), _as_bytes(self.raw(name)))
            except OSError as err:
                raise _cannot(self.root, err) from err
            return None if same else "stored unquantized but differs from the source"
        if e is not None and t.dtype != torch.bfloat16:  # dequantized
            return f"stored as {stored}; glmq dequantizes an FP8 source weight to BF16"
        if e is None or self.block is None or len(e.shape) != 2 or scale not in self.entries:
            w = self.dense(name)
            return None if torch.equal(t.to(w.dtype), w) else "stored unquantized but differs from the source"
        from glmq.quantize.validate.cpu_kernels import fp8_block_mismatches

        try:
            same = fp8_block_mismatches(t, self.raw(name), self.raw(scale), self.block) == 0
        except (OSError, ValueError) as err:
            raise _cannot(self.root, err) from err
        return None if same else "stored unquantized but differs from the source"

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor `name` (KeyError if the source has none)."""
        e = self.entries[name]
        buf = torch.empty(e.nbytes, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
        view = memoryview(buf.numpy())
        fd, got, offset = self._fd(e.shard), 0, self.starts[e.shard] + e.begin
        while got < e.nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                raise OSError(f"{self.root / e.shard}: unexpected end of file reading {name}")
            got += n
        return buf.view(DTYPES[e.dtype]).reshape(e.shape)

    def _fd(self, shard: str) -> int:
        with self.lock:
            if shard not in self.fds:
                self.fds[shard] = os.open(self.root / shard, os.O_RDONLY)
            return self.fds[shard]

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, as uint8 (for an exact comparison: NaN payloads and signed zeros included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _cannot(root: Path, e: Exception) -> CannotValidate:
    return CannotValidate(f"--source {root}: cannot read it ({type(e).__name__}: {e})")


def _dequantize_block_rows(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`fp8.dequantize_block(w8, scale_inv, block)` to bf16, the same bits, faster: the float8 -> float32
    cast by indexing a table of torch's own cast (20 -> 3 ns per weight here), in bands of whole row
    blocks (float32 temporaries of a band, not of the weight)."""
    from glmq.quantize.validate.cpu_kernels import _FP8_VALUES

    if w8.ndim != 2:
        return fp8.dequantize_block(w8, scale_inv, block)
    (n, k), (bn, bk) = w8.shape, block
    cb = -(-k // bk)
    if tuple(scale_inv.shape) != (-(-n // bn), cb):
        raise ValueError(f"scale_inv shape {list(scale_inv.shape)} does not fit weight {[n, k]} with blocks {block}")
    out = torch.empty(n, k, dtype=torch.bfloat16)
    rows = max(bn, _row_blocks(n, k)[0][1] // bn * bn) if n else bn
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        w = torch.from_numpy(_FP8_VALUES[w8[r0:r1].view(torch.uint8).numpy()])  # (r, K) float32
        if k % bk:
            w = torch.nn.functional.pad(w, (0, cb * bk - k))
        s = scale_inv.float()[torch.arange(r0, r1) // bn]  # (r, cb): each row's block scales
        w.view(r1 - r0, cb, bk).mul_(s.unsqueeze(-1))  # the product in float32, as fp8.dequantize_block
        out[r0:r1] = w[:, :k]
    return out


class SourceCheck:
    """The source check, fed by the reader threads (`compare_tensor`) and by `ModuleScan` (`compare_module`).

    Args:
        root: the source folder; ck, scheme (quantized module -> INT group) of the checkpoint.
    Raises (constructor):
        CannotValidate: the source cannot be read.
    """

    def __init__(self, root: Path, ck: Checkpoint, scheme: dict[str, Group]):
        self.src = SourceReader(root)
        self.method = recipe_method(ck)
        self.rtn_modules = rtn_in_gptq(ck, scheme) if self.method == "gptq" else set()
        self.res = CheckResult("source", details={"source": str(root), "method": self.method, "worst": [],
                                                  "per_layer": {}})
        self.errs: list[tuple[str, float, str]] = []  # (module, error, how it was quantized)
        self.lock = threading.Lock()
        self.src_names = self.src.names()
        self.keep = self._match_names(ck.entries(), scheme)
        self.n_named = len(self.res.failures)  # failures found from the names, in name order

    def _match_names(self, entries: dict[str, TensorEntry], scheme: dict[str, Group]) -> set[str]:
        """Fail the names that have no counterpart; return the checkpoint tensors to compare as stored."""
        keep = set()
        for name in sorted(self.src_names):
            module, _, leaf = name.rpartition(".")
            if module in scheme and leaf == "weight":
                continue  # compared by compare_module when sampled
            if name not in entries:
                self.res.fail(f"source tensor {name} has no counterpart in the checkpoint", tensor=name)
            elif entries[name].dtype != "F8_E4M3":  # FP8 kept as FP8 (mixed precision) is not compared
                keep.add(name)
        for module in sorted(scheme.keys() - {n.rpartition(".")[0] for n in self.src_names}):
            self.res.fail(f"{module}: quantized, but the source has no {module}.weight", tensor=module)
        for name in sorted(n for n in entries if n.rpartition(".")[0] not in scheme and n not in self.src_names
                           and n.rpartition(".")[2] not in COMPANIONS):
            self.res.fail(f"{name}: in the checkpoint but not in the source", tensor=name, shard=entries[name].shard)
        return keep

    def compare_tensor(self, name: str, t: torch.Tensor, shard: str | None = None) -> None:
        """An unquantized checkpoint tensor: a copied one has the source's dtype and bytes, an FP8-dequantized
        one the reference dequantization's bits (SourceReader.difference)."""
        why = self.src.difference(name, t)
        with self.lock:
            self.res.checked += 1
            if why is not None:
                self.res.fail(f"{name}: {why}", tensor=name, shard=shard)

    def compare_module(self, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, int], g: Group) -> None:
        """A sampled, well-formed quantized module (its stored tensors by leaf) against its source weight."""
        if f"{module}.weight" not in self.src_names:
            return  # _match_names failed it if the source has nothing of the module
        w_src = self.src.dense(f"{module}.weight")
        with self.lock:
            self.res.checked += 1
        if tuple(w_src.shape) != shape:
            self._fail(f"{module}: weight_shape {list(shape)} but the source weight is {list(w_src.shape)}", module)
            return
        zp = parts.get("weight_zero_point") if not g.symmetric else None
        method = "rtn" if module in self.rtn_modules else self.method
        err, bound = weight_error(parts["weight_packed"], parts["weight_scale"], zp, shape, g, w_src, method)
        with self.lock:
            if bound is not None:
                self.res.details["bound_steps"] = bound
            self.errs.append((module, err, method))
        if not math.isfinite(err):
            self._fail(f"{module}: the dequantized weight is not finite", module, math.inf)
        elif bound is not None and err > bound:
            self._fail(f"{module}: max |w_q - w_src| = {err:.4f} scale steps > bound {bound:.4f} (RTN, "
                       f"{'symmetric' if g.symmetric else 'asymmetric'})", module, err)

    def _fail(self, message: str, tensor: str, value: float | None = None) -> None:
        with self.lock:
            self.res.fail(message, tensor=tensor, value=value)

    def result(self) -> CheckResult:
        res = self.res
        res.failures[self.n_named:] = sorted(res.failures[self.n_named:], key=lambda f: f.tensor or "")  # any order
        main = [(m, e) for m, e, how in self.errs if how == self.method]
        rtn = [(m, e) for m, e, how in self.errs if how != self.method]  # a GPTQ checkpoint's RTN modules
        per_layer: dict[str, float] = {}
        for module, err in main:
            key = str(layer_index(module)) if layer_index(module) is not None else "other"
            per_layer[key] = max(per_layer.get(key, 0.0), err)
        worst = sorted(main, key=lambda r: (-r[1], r[0]))[:5]
        res.details.update(compared=len(main), per_layer=dict(sorted(per_layer.items(), key=lambda kv: _layer_key(kv[0]))),
                           worst=[{"module": m, "error": e} for m, e in worst])
        if rtn:
            w = sorted(rtn, key=lambda r: (-r[1], r[0]))[:5]
            res.details["rtn_in_gptq"] = {"compared": len(rtn), "worst": [{"module": m, "error": e} for m, e in w]}
        return res


def _layer_key(key: str) -> tuple[int, int]:
    """Per-layer keys in layer order ("10" after "9"), "other" last."""
    return (0, int(key)) if key.isdigit() else (1, 0)
