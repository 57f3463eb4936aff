"""The numerics check: scales finite and non-zero (every module); the W4A16 matmul (Triton on CUDA, the
kernels' float32 reference on the CPU) against a float64 reference, on a deterministic sample.

Sampling: on the CPU the check costs ~5 ns of CPU per weight (it was ~16 before cpu_kernels.py)
against ~0.34 ns to sha256 the weight's half byte (~0.06 ns to map and xxh3 it; a warm `read()` of it
took ~0.15-0.4 ns on the 2-core machine), so checking every module costs many reads (BENCHMARKS.md
"validate"). A layout mistake (nibble order, group, scale row, a kernel bug) is the same in every
module of one kind, and a changed byte anywhere is caught by the integrity check, which hashes every
byte. So the matmul runs on `fraction` of the modules of each stratum (tensor class, projection, packed
shape, config group), at least one per stratum, chosen by `seed`; DEFAULT_SAMPLE keeps it a small part
of one read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import random
import threading
from collections import defaultdict

import torch

from glmq.quantize.validate.checkpoint import Module
from glmq.quantize.validate.config import Group
from glmq.quantize.validate.report import CheckResult
from glmq.quantize.validate.structure import int_module_problems

# 0.5% of each stratum. The CPU check costs ~5 ns of CPU per weight (the kernels' reference ~3-4.5,
# the float64 reference ~2) against ~0.15-0.4 ns to read the weight's half byte once, so a fraction f
# of the weights adds about 12-33 f reads: 6-17% of one at 0.5%. On GLM-5 (~58k expert projections of 2048 x
# 6144) that is still ~290 modules, ~97 of each projection; on small checkpoints the one-per-stratum
# floor decides (bench preset: 3 of 384 modules).
DEFAULT_SAMPLE = 0.005
# Kernel output vs float64 reference, max|y - ref| / max|ref|, by the output dtype. The Triton kernel
# writes bf16 (bf16 activations): its rounding alone reaches u * max|ref| (u = 2^-8), fp32 accumulation
# adds ~sqrt(K) * 2^-24, so 1e-2 = 2.56 u. The CPU reference path returns float32 (error ~1e-7):
# 1e-4. Any layout mistake (nibble order, group, scale row) gives errors of order 1.
REL_ERR_BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
ACT_ROWS = 16  # activation rows per numerics check (the CUDA path also runs row 0 alone: GEMV kernel)
# The CPU reference has no tiles for M to exercise; its cost is the dequantization, plus M dot products
# per weight in the float64 reference. A layout mistake shows in every row.
CPU_ACT_ROWS = 4
# Weight elements per row block when dequantizing on the CPU: ~8 MB float64 temporaries that the
# allocator reuses, instead of fresh 100 MB ones per expert (page faults cost more than the math).
DEQUANT_BLOCK = 1 << 20
# The same for the kernels' float32 reference, whose five temporaries per block then stay in L2:
# ~1.4x less CPU per weight than DEQUANT_BLOCK here, and less exposed to others sharing the cache.
REF_BLOCK = 1 << 17
# Finite and not zero, read off the bits (|scale|: not zero, exponent not all ones): one pass over the
# scales instead of five tensor ops, which cost half as much as hashing the packed weights. Negative scales
# are valid: QuantSpec.full_range writes them (w = q * scale whatever its sign).
_FINITE_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7F7F), torch.float16: (torch.int16, 0x7BFF),
                          torch.float32: (torch.int32, 0x7F7FFFFF)}


def _activations(seed: int, module: str, k: int) -> torch.Tensor:
    """Deterministic bf16 `[ACT_ROWS, K]` N(0, 1) activations for one module."""
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(ACT_ROWS, k, generator=gen).to(torch.bfloat16)


def _row_blocks(n: int, k: int, elements: int = DEQUANT_BLOCK) -> list[tuple[int, int]]:
    """Row ranges of about `elements` weights, starting on multiples of 8 (zero points pack 8 rows)."""
    rows = max(8, elements // max(k, 1) // 8 * 8)
    return [(r, min(r + rows, n)) for r in range(0, n, rows)]


def matmul_error(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                 shape: tuple[int, int], g: Group, device: str) -> tuple[float, float, str]:
    """Relative error of the W4A16 matmul against float64 `x @ dequant(W).T`.

    Args:
        x: bf16 `[M, K]` activations (CPU; the CPU path uses the first CPU_ACT_ROWS rows); packed
            int32 `[N, K/8]`, scale `[N, K/g]`, zp int32 `[ceil(N/8), K/g]` or None, as stored;
            shape `(N, K)`; g the module's INT group.
    Returns:
        (max|y - ref| / max|ref| (inf if y is not finite), the bound for y's dtype, "triton" | "reference").
    Raises:
        ValueError / RuntimeError: a layout the kernel or the reference rejects.
    """
    if g.group_size and shape[1] < g.group_size:  # one group per row, of K columns (compressed-tensors' ceil(K/g))
        g = dataclasses.replace(g, group_size=shape[1])
    if torch.device(device).type == "cpu":
        return _error_cpu(x[:CPU_ACT_ROWS], packed, scale, zp, shape, g)
    return _error_device(x, packed, scale, zp, shape, g, torch.device(device))


def _error_cpu(x, packed, scale, zp, shape, g) -> tuple[float, float, str]:
    """The kernels' float32 reference, row block by row block, against the numba float64 reference."""
    from glmq.kernels import reference
    from glmq.quantize.validate.cpu_kernels import w4a16_matmul_f64

    (n, k), gs = shape, g.group_size or shape[1]
    ref = w4a16_matmul_f64(x, packed, scale, zp, shape, gs)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for r0, r1 in _row_blocks(n, k, REF_BLOCK):
        p, s, z = packed[r0:r1], scale[r0:r1], None if zp is None else zp[r0 // 8:-(-r1 // 8)]
        y[:, r0:r1] = (reference.w4a16_matmul_ref(x, p, s, gs) if z is None
                       else x.float() @ reference.dequantize_packed(p, s, gs, z).T)
    return _rel_error([(y, ref)]), REL_ERR_BOUND[torch.float32], "reference"


def _error_device(x, packed, scale, zp, shape, g, dev: torch.device) -> tuple[float, float, str]:
    """On CUDA: the Triton kernel (MMA with all rows, GEMV with row 0) where it applies, else the
    kernels' reference on the device; float64 reference on the device."""
    from glmq.formats.dense import dequantize_packed
    from glmq.kernels import reference

    (n, k), gs = shape, g.group_size or shape[1]
    x, packed, scale = x.to(dev), packed.to(dev), scale.to(dev)
    zp = None if zp is None else zp.to(dev)
    triton = zp is None and gs in (32, 64, 128)
    ref = x.double() @ dequantize_packed(packed, scale.double(), (n, k), g.num_bits, gs, zp).T
    if triton:
        from glmq.kernels.w4a16_dense import w4a16_matmul

        runs = [(w4a16_matmul(x, packed, scale, gs), ref),  # a full token tile
                (w4a16_matmul(x[:1].contiguous(), packed, scale, gs), ref[:1])]  # the decode launch (M = 1)
    else:
        runs = [(reference.w4a16_matmul_ref(x, packed, scale, gs) if zp is None
                 else x.float() @ reference.dequantize_packed(packed, scale, gs, zp).T, ref)]
    bound = REL_ERR_BOUND[runs[0][0].dtype]
    return _rel_error(runs), bound, "triton" if triton else "reference"


def _rel_error(runs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """max over runs of max|y - ref| / max|ref|; inf if some y is not finite."""
    err = 0.0
    for out, r in runs:
        if not torch.isfinite(out).all():
            return math.inf
        err = max(err, ((out.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return err


def scale_problem(scale: torch.Tensor) -> str | None:
    """NaN/Inf or zero group scales (pure)."""
    if scale.dtype in _FINITE_MAGNITUDE_BITS and scale.is_contiguous():
        as_int, top = _FINITE_MAGNITUDE_BITS[scale.dtype]
        bits = scale.view(as_int).numpy().view(f"u{scale.element_size()}")
        bits = bits & bits.dtype.type((1 << (8 * scale.element_size() - 1)) - 1)  # the sign cleared: |scale|
        if not ((bits - 1) > top - 1).any():  # 0 wraps to the largest value: every |scale| in [1, top]
            return None
    scale = scale.float()
    bad_f = int((~torch.isfinite(scale)).sum())
    bad_p = int((scale == 0).sum())
    if bad_f or bad_p:
        return f"{bad_f} NaN/Inf and {bad_p} zero of {scale.numel()} scales"
    return None


class ModuleScan:
    """Per-module work done while the shards are read: weight_shape values, scale checks, numerics,
    and (with `source`) the comparison of sampled quantized weights with the source.

    `keep` names the tensors to decode; `add` receives them from the reader threads and runs the
    checks as soon as a module's tensors are all in, on the buffers that were just hashed.
    """

    def __init__(self, modules: dict[str, Module], scheme: dict[str, Group], sampled: set[str], device: str, seed: int,
                 source=None):
        self.modules, self.scheme, self.sampled, self.device, self.seed = modules, scheme, sampled, device, seed
        self.source = source  # a source.SourceCheck, or None
        self.want: dict[str, dict[str, str]] = {}
        for name, g in scheme.items():
            leaves = ("weight_shape", "weight_scale")
            leaves += ("weight_packed", "weight_zero_point", "weight_g_idx") if name in sampled else ()
            self.want[name] = {leaf: f"{name}.{leaf}" for leaf in leaves if leaf in modules[name].parts}
        self.owner = {t: (m, leaf) for m, leaves in self.want.items() for leaf, t in leaves.items()}
        self.keep = set(self.owner)
        self.got: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        self.shapes: dict[str, tuple[int, int] | None] = {}  # a usable [N, K], else None
        self.values: dict[str, tuple[int, ...]] = {}  # weight_shape as read (integer dtypes), usable or not
        self.numerics = CheckResult("numerics", details={"device": device, "worst": []})
        self.errors: list[tuple[str, float, float, str]] = []
        self.unchecked: list[str] = []  # sampled modules no kernel here runs (INT8)
        self.lock = threading.Lock()
        self.gpu = threading.Lock()  # one kernel launch at a time (shared split-K ticket buffer)

    def add(self, name: str, t: torch.Tensor) -> None:
        module, leaf = self.owner[name]
        with self.lock:
            parts = self.got[module]
            parts[leaf] = t
            done = len(parts) == len(self.want[module])
            if done:
                del self.got[module]
        if done:
            self._check(module, parts)

    def _check(self, name: str, t: dict[str, torch.Tensor]) -> None:
        m, g = self.modules[name], self.scheme[name]
        shape = _shape_value(t.get("weight_shape"))
        self.shapes[name] = shape
        if (value := _ints(t.get("weight_shape"))) is not None:
            self.values[name] = value  # structure names an unusable one
        well_formed = shape is not None and not int_module_problems(m, g, shape)
        if self.source is not None and name in self.sampled and well_formed:
            self.source.compare_module(name, t, shape, g)
        if "weight_scale" in t and (why := scale_problem(t["weight_scale"])):
            self._fail(f"{name}.weight_scale: {why}", f"{name}.weight_scale", m, math.inf)
            return
        if name not in self.sampled or not well_formed:
            return  # structure reports the problem
        if g.num_bits != 4:  # int8: no W8A16 kernel here; said in the result, not passed as checked
            with self.lock:
                self.unchecked.append(name)
            return
        if (gi := t.get("weight_g_idx")) is not None and not _groups_in_order(gi, shape[1], g.group_size):
            with self.lock:  # not counted as checked: a pass here would say nothing about this module
                self.numerics.warn(f"{name}: activation-ordered groups (weight_g_idx is not arange(K) // group_size): "
                                   f"glmq's kernels and references read the groups in order, so the matmul check "
                                   f"cannot run on this module; it is not checked", tensor=name, shard=m.shard())
            return
        x = _activations(self.seed, name, shape[1])
        try:
            with self.gpu if self.device == "cuda" else contextlib.nullcontext():
                err, bound, path = matmul_error(x, t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                                shape, g, self.device)
        except (ValueError, RuntimeError) as e:  # a layout the kernel rejects: report it, do not crash the gate
            self._fail(f"{name}: the W4A16 matmul could not run: {e}", name, m, math.inf)
            return
        with self.lock:
            self.errors.append((name, err, bound, path))
        if not err <= bound:
            self._fail(f"{name}: W4A16 matmul ({path}) relative error {err:.3g} > bound {bound:g} "
                       f"(max|y - ref| / max|ref| against float64)", name, m, err)

    def nonfinite(self, e, rows: list[int]) -> None:
        """A floating-point tensor no check keeps (a norm, the embeddings, a kept FP8 weight) holds NaN or Inf in `rows`
        (reading.nonfinite_rows; called from the reader threads)."""
        with self.lock:
            self.numerics.fail(f"{e.name}: NaN or Inf in rows {rows[:8]}{' ...' if len(rows) > 8 else ''} ({e.dtype}, "
                               f"stored as it was read, not quantized): a serving engine would compute with them; "
                               f"re-convert from a source whose tensor holds numbers", tensor=e.name, shard=e.shard,
                               value=math.inf)

    def _fail(self, message: str, tensor: str, m: Module, value: float) -> None:
        with self.lock:
            self.numerics.fail(message, tensor=tensor, shard=m.shard(), value=value)

    def result(self) -> CheckResult:
        res = self.numerics
        res.failures.sort(key=lambda f: f.tensor or "")  # reader threads finish in any order
        if self.unchecked:
            first = min(self.unchecked)
            res.warn(f"{len(self.unchecked)} sampled INT8 module(s) (e.g. {first}) had no matmul check: glmq has no "
                     f"W8A16 kernel or reference, so only their scales were checked", tensor=first,
                     shard=self.modules[first].shard())
        res.checked = len(self.errors)
        res.details.update(sampled=len(self.errors), quantized=len(self.scheme), sampled_modules=sorted(self.sampled),
                           unchecked_int8=len(self.unchecked),
                           paths=sorted({p for *_, p in self.errors}), bounds=sorted({b for _, _, b, _ in self.errors}),
                           worst=[{"module": n, "rel_err": e}
                                  for n, e, *_ in sorted(self.errors, key=lambda r: (-r[1], r[0]))[:5]])
        return res


def _groups_in_order(g_idx: torch.Tensor, k: int, group_size: int | None) -> bool:
    """Whether a stored weight_g_idx is the trivial one (column j in group j // group_size)."""
    want = torch.arange(k) // (group_size or k)
    return g_idx.dim() == 1 and g_idx.numel() == k and torch.equal(g_idx.to(torch.int64), want)


def _ints(t: torch.Tensor | None) -> tuple[int, ...] | None:
    """weight_shape's values, if it holds integers (its dtype is the structure check's business)."""
    if t is None or t.is_floating_point() or t.is_complex():
        return None
    return tuple(int(v) for v in t.reshape(-1).tolist())


def _shape_value(t: torch.Tensor | None) -> tuple[int, int] | None:
    """weight_shape as a usable `(N, K)`: two positive integers; else None (structure reports why)."""
    value = _ints(t)
    if value is None or t.dim() != 1 or len(value) != 2:
        return None
    n, k = value
    return (n, k) if n > 0 and k > 0 else None


def stratum(m: Module, g: Group) -> tuple:
    """What a layout mistake has in common: tensor class, projection, packed shape, config group."""
    packed = m.parts.get("weight_packed")
    return m.cls.value, m.name.rpartition(".")[2], packed.shape if packed else None, g.name


def sample_modules(names: list[str], fraction: float, seed: int, key=None) -> set[str]:
    """A deterministic `fraction` of `names`: ceil(fraction * size) of every stratum (at least one).

    Args:
        key: name -> stratum (any sortable-by-repr value); None: one stratum.
    """
    if fraction >= 1.0:
        return set(names)
    strata: dict = defaultdict(list)
    for name in sorted(names):
        strata[None if key is None else key(name)].append(name)
    rng = random.Random(seed)
    out: set[str] = set()
    for s in sorted(strata, key=repr):
        out.update(rng.sample(strata[s], max(1, math.ceil(fraction * len(strata[s])))))
    return out
