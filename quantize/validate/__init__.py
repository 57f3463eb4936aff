"""`glmq validate`: the CI gate for a converted (compressed-tensors pack-quantized) checkpoint.

Seven checks, each returning a `CheckResult`:
  config     quantization_config parses with the installed compressed-tensors and has only the keys
             every release vLLM/SGLang may ship accepts (formats.md §2d).                  config.py
  structure  every tensor the config promises, with its dtype and shape (formats.md §2a); nothing
             left over (weight_scale_inv, FP8, orphan companions, a dense weight next to its packed
             one); every expert of every MoE layer; `ignore` agrees with what is stored. structure.py
  index      index <-> shard headers, total_size, duplicates.                          checkpoint.py
  serving    vLLM Marlin / Marlin-MoE shape rules at a tensor-parallel degree (formats.md §3a), per
             tensor class; failures make the checkpoint invalid (`serving=False` skips it). serving.py
  numerics   scales finite and non-zero (every module; full_range writes negative ones); every other floating-point
             tensor free of NaN and Inf (reading.nonfinite_rows, on the bytes as they are hashed); on a deterministic
             sample of each kind of module, the W4A16 kernel (Triton on CUDA, `kernels/reference.py` on CPU) against a float64
             matmul of the dequantized weight (cpu_kernels.py on CPU).                         numerics.py
  source     (with a source) sampled quantized weights within the RTN bound of the source weights
             (GPTQ: relative error reported per layer); every unquantized tensor unchanged.  source.py
  integrity  every tensor's xxh3-128 (or, with --sha256 or an older manifest, sha256) against
             `glmq_manifest.json` (no manifest: a warning).                                 integrity.py
`driver.validate` runs them; report.py holds the result types and the terminal table.

Cost: after the headers, the checkpoint is read once (reading.py): a pool of threads, one per core,
maps the shards and hashes every byte straight from the page cache, and hands the tensors the checks
need to them in copies of the bytes it hashed (the scales and shapes of every module, the sampled
modules' packed weights, with --source the unquantized tensors), so nothing is read twice and the
checks overlap the reading. The checksum is xxh3-128 (~30 GB/s per core; mapping + hashing ran at
~8 GB/s on one core of the 2-core machine, faster than a buffered `read()` of the same files);
`--sha256` (~1 GB/s per core) costs ~2-4x a warm read on 2 cores. The default sample
(numerics.DEFAULT_SAMPLE, 0.5% of each stratum, at least one) keeps the matmuls a small part of that;
`--sample 1.0` checks every module. A source adds one read of the source tensors that are compared and
the FP8 dequantization of them. Fixed costs per process, whatever the checkpoint's size: importing
compressed-tensors (seconds; it overlaps the scan) and loading the numba kernels (~1 s of CPU).
Measured ratios to a warm read: BENCHMARKS.md, "validate" (scripts/bench_validate.py).

Exit codes (`Report.exit_code`, `CannotValidate`): 0 valid, 1 invalid, 2 could not run.
"""

from glmq.quantize.validate.checkpoint import (COMPANIONS, INT_LEAVES, Checkpoint, Module, check_index,
                                               load_checkpoint, modules_of)
from glmq.quantize.validate.config import Group, QuantConfig, check_config, group_for, read_quant_config
from glmq.quantize.validate.driver import validate
from glmq.quantize.validate.integrity import check_integrity
from glmq.quantize.validate.numerics import (ACT_ROWS, DEFAULT_SAMPLE, REL_ERR_BOUND, ModuleScan, matmul_error,
                                             sample_modules, scale_problem, stratum)
from glmq.quantize.validate.reading import ScanStats, scan_shards, work_units
from glmq.quantize.validate.report import (BeingWritten, CannotValidate, CheckResult, Finding, Report, Status,
                                           format_report)
from glmq.quantize.validate.serving import check_serving, dense_rules, moe_rules
from glmq.quantize.validate.source import SourceCheck, SourceReader, recipe_method, rtn_bound_steps, weight_error
from glmq.quantize.validate.structure import LEAF_DTYPES, check_structure, expected_shapes, int_module_problems

__all__ = [
    "ACT_ROWS", "COMPANIONS", "DEFAULT_SAMPLE", "INT_LEAVES", "LEAF_DTYPES", "REL_ERR_BOUND", "rtn_bound_steps",
    "BeingWritten", "CannotValidate", "CheckResult", "Checkpoint", "Finding", "Group", "Module", "ModuleScan", "QuantConfig", "Report",
    "ScanStats", "SourceCheck", "SourceReader", "Status", "check_config", "check_index", "check_integrity",
    "check_serving", "check_structure", "dense_rules", "expected_shapes", "format_report", "group_for",
    "int_module_problems", "load_checkpoint", "matmul_error", "modules_of", "moe_rules", "read_quant_config",
    "recipe_method", "sample_modules", "scale_problem", "scan_shards", "stratum", "validate", "weight_error",
    "work_units",
]
