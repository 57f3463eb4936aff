"""The one typed description of how a weight is quantized.

`QuantSpec` is frozen and validated on construction; recipes map 1:1 onto its fields, and
`glmq.formats.compressed_tensors.quantization_args` is the single place that translates it into
compressed-tensors' `QuantizationArgs`.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass


class Method(str, enum.Enum):
    RTN = "rtn"
    GPTQ = "gptq"


SUPPORTED_BITS = (4, 8)
# vLLM's Marlin kernels take exactly these group sizes (formats.md §3a); anything else would not serve.
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# How GPTQ's clip search scores a candidate group scale (glmq.quantize.gptq, `_clip_search`):
CLIP_OBJECTIVES = ("propagated", "block")
TUNE_REFERENCES = ("layer", "source")

# The type of each QuantSpec field, checked on construction and, with the file and key named, when a recipe is
# loaded (recipes.from_dict): "int" a whole number (not a bool, not 4.0: a float crashed the packing part-way
# through a conversion), "bool" true/false (not the string "false", which is truthy), "float" any number (not a
# bool), "float?" a number or None, "str" a string (the allowed values are checked after).
FIELD_TYPES = {"num_bits": "int", "group_size": "int", "symmetric": "bool", "full_range": "bool", "method": "str",
               "act_order": "bool", "damp": "float", "block_size": "int", "clip_objective": "str",
               "cd_sweeps": "int", "scale_refit": "int", "tune_iters": "int", "tune_lr": "float?",
               "tune_reference": "str", "tune_experts": "bool"}
_EXPECTED = {"int": "a whole number without a decimal point or quotes (e.g. 4, not 4.0 or \"4\")",
             "bool": "true or false, without quotes",
             "float": "a number",
             "float?": "a number, or null",
             "str": "a string"}


def type_mismatch(kind: str, value: object) -> str | None:
    """None when `value` is of `kind` (a FIELD_TYPES value), else what such a value must be."""
    ok = {"int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
          "bool": lambda v: isinstance(v, bool),
          "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
          "float?": lambda v: v is None or isinstance(v, numbers.Real) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}[kind](value)
    return None if ok else _EXPECTED[kind]


@dataclass(frozen=True)
class QuantSpec:
    """How one Linear weight `[N, K]` becomes integers.

    Attributes:
        num_bits: 4 (int4, packed 8 per int32) or 8 (int8, packed 4 per int32).
        group_size: contiguous input columns that share one scale; K must be a multiple of it.
        symmetric: True -> scale = absmax / (2^(b-1) - 0.5), no zero point (what vLLM/SGLang MoE need).
            False -> min/max scale with an int zero point (written as `weight_zero_point`).
        full_range: symmetric specs only: use all 2^b integer levels, as AutoRound's "full range" symmetric
            scheme does. The group's value of largest magnitude maps exactly to q_min (-8 for int4): scale =
            max(g) / q_min when max(g) > |min(g)| (a negative scale), else |min(g)| / -q_min. The format is
            unchanged (w = q * scale, no zero point; serving kernels multiply by the scale whatever its
            sign), but the grid is 1/16 finer than absmax / 7.5 and has one more level on the side of the
            largest weight. Measured on the shared model (BENCHMARKS.md, "Full-range scales"): RTN every
            linear KL -14 %, GPTQ -10 %.
        method: "rtn" or "gptq".
        act_order: GPTQ only: process columns by decreasing Hessian diagonal ("static" act-order);
            the written format is unchanged (no g_idx).
        damp: GPTQ only: dampening added to the Hessian diagonal, as a fraction of its mean (0.1: with
            the two options below it measured better than 0.01 on the shared model, BENCHMARKS.md).
        block_size: GPTQ only: columns per lazy-batch block (paper §4, "Lazy Batch-Updates").
        clip_objective: GPTQ only, when the clip search is on (`CalibrationSettings.clip_search`): how a
            candidate clipped group scale is scored per row. "propagated": the group's columns are
            quantized one by one with GPTQ's own error feedback inside the group, and the GPTQ loss of the
            group (sum of squared `(w - q) / [U]_jj`) is kept lowest; "block": the group is rounded in
            isolation and `d H_gg d^T` (H's diagonal block of the group) is kept lowest.
        cd_sweeps: GPTQ only: sweeps of integer coordinate descent after GPTQ, scales fixed, on the
            damped objective tr((W - Wq) (H + damp) (W - Wq)^T); 0 = plain GPTQ. 2 measured as good as 4
            at half the cost.
        scale_refit: GPTQ only, symmetric specs: rounds of refitting each row's group scales to the final
            integers (least squares on the same damped objective, `glmq.quantize.scale_refit`), each followed
            by one more descent sweep when cd_sweeps > 0; 0 = the scales GPTQ chose (default). 1 measured better
            than 0 and 2 on the shared model (BENCHMARKS.md, "GPTQ scale refit"), but it is off by default: on a
            CPU it made the 4-layer scaling model's GPTQ run 1.58x the peer's speed instead of >= 2x.
        tune_iters: GPTQ only, symmetric specs: iterations of tuning each decoder layer's rounding (an
            integer moves at most one step) and group scales on the layer's output error, started from
            GPTQ's result (AutoRound's signed gradient descent in GPTQ's frame, `glmq.calibration.tune`);
            0 = off.
        tune_lr: the tuning's step size, decaying linearly to 0 over tune_iters; None: 1 / tune_iters
            (AutoRound's default).
        tune_reference: the tuning's target: "layer", the unquantized layer on the same (quantized model's)
            input; "source", the unquantized model's own output of the layer, so the tuning also pulls
            back the error of the layers before it.
        tune_experts: tune the routed experts too, in layers with at most `tune.TUNE_EXPERT_WEIGHTS` expert
            weights (larger ones, e.g. GLM-5's 9.7 G, keep GPTQ's result, and the report says so); False: they
            always keep GPTQ's result and the tuning holds only the layer's other targets.
    """

    num_bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    full_range: bool = False
    method: Method = Method.RTN
    act_order: bool = False
    damp: float = 0.1
    block_size: int = 128
    clip_objective: str = "propagated"
    cd_sweeps: int = 2
    scale_refit: int = 0
    tune_iters: int = 0
    tune_lr: float | None = None
    tune_reference: str = "layer"
    tune_experts: bool = True

    def __post_init__(self) -> None:
        for name, kind in FIELD_TYPES.items():
            value = getattr(self, name)
            if (want := type_mismatch(kind, value)) is not None:
                # ValueError, as the range checks below (and the recipe loader catches both)
                raise ValueError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
            if kind == "int" and type(value) is not int:  # e.g. numpy.int64: a plain int, as JSON writes it
                object.__setattr__(self, name, int(value))
        if self.method not in tuple(m.value for m in Method):
            raise ValueError(f"method must be one of {tuple(m.value for m in Method)}, got {self.method!r}")
        object.__setattr__(self, "method", Method(self.method))
        if self.num_bits not in SUPPORTED_BITS:
            raise ValueError(f"num_bits must be one of {SUPPORTED_BITS}, got {self.num_bits}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size must be one of {SUPPORTED_GROUP_SIZES} (the sizes vLLM's Marlin kernels "
                f"serve), got {self.group_size}"
            )
        if not 0.0 <= self.damp < 1.0:
            raise ValueError(f"damp must be in [0, 1), got {self.damp}")
        if self.clip_objective not in CLIP_OBJECTIVES:
            raise ValueError(f"clip_objective must be one of {CLIP_OBJECTIVES}, got {self.clip_objective!r}")
        if not isinstance(self.cd_sweeps, int) or isinstance(self.cd_sweeps, bool) or self.cd_sweeps < 0:
            raise ValueError(f"cd_sweeps must be an integer >= 0, got {self.cd_sweeps!r}")
        if not isinstance(self.scale_refit, int) or isinstance(self.scale_refit, bool) or self.scale_refit < 0:
            raise ValueError(f"scale_refit must be an integer >= 0, got {self.scale_refit!r}")
        if not isinstance(self.tune_iters, int) or isinstance(self.tune_iters, bool) or self.tune_iters < 0:
            raise ValueError(f"tune_iters must be an integer >= 0, got {self.tune_iters!r}")
        if self.tune_lr is not None and not 0 < self.tune_lr < float("inf"):  # `.inf` is valid YAML for a float
            raise ValueError(f"tune_lr must be a positive finite number, got {self.tune_lr!r}")
        if self.tune_reference not in TUNE_REFERENCES:
            raise ValueError(f"tune_reference must be one of {TUNE_REFERENCES}, got {self.tune_reference!r}")
        if self.full_range and not self.symmetric:
            raise ValueError("full_range needs a symmetric spec (an asymmetric one has a zero point instead)")
        if self.tune_iters and not self.symmetric:
            raise ValueError("tune_iters needs a symmetric spec (the tuning keeps no zero point)")
        if self.scale_refit and not self.symmetric:
            raise ValueError("scale_refit needs a symmetric spec (an asymmetric one keeps GPTQ's scales and zero "
                             "points); set scale_refit: 0")
        if self.block_size <= 0 or self.block_size % self.group_size and self.group_size % self.block_size:
            raise ValueError(
                f"block_size {self.block_size} and group_size {self.group_size} must divide one another"
            )

    @property
    def half_range(self) -> float:
        """The divisor of a symmetric group's scale: (q_max - q_min) / 2 (7.5 for int4), or -q_min (8) with
        `full_range`, whose dividend is signed (`rtn.compute_qparams`)."""
        return float(-self.q_min) if self.full_range else (self.q_max - self.q_min) / 2.0

    @property
    def q_min(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def q_max(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    @property
    def pack_factor(self) -> int:
        """Quantized values per int32 word."""
        return 32 // self.num_bits

    def check_shape(self, shape: tuple[int, ...]) -> str | None:
        """Return why a weight of `shape` cannot take this spec, or None if it can."""
        if len(shape) != 2:
            return f"expected a 2-D Linear weight, got shape {list(shape)}"
        k = shape[1]
        if k % self.group_size:
            return (
                f"input dimension {k} is not a multiple of group_size {self.group_size}; "
                f"use a recipe with a group size that divides {k}, or keep this tensor unquantized"
            )
        if k % self.pack_factor:
            return f"input dimension {k} is not a multiple of {self.pack_factor} (int32 packing)"
        return None
