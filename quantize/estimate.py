"""`glmq plan`: predicted output size, peak memory per rank and wall time, before anything is converted.

From a checkpoint folder the sizes come from the real plan (headers only); from a bare config.json (no
weights) the tensor list is derived from the config with the layout tables the fixture generator uses, and
the source is cut into shards of `ASSUMED_SHARD_BYTES` (GLM-5-FP8's ~5.3 GB), and the output into files of
at most `--max-shard-size`, as from a folder.

Every measured number comes from `FIGURES`, one table in which each entry names the BENCHMARKS.md row
(machine, date, command) it was taken from; `--throughput KEY=VALUE` overrides an entry. A figure that has
not been measured is `None`, and what depends on it is printed as "not measured yet", never guessed.

Models (small pure functions, below):
- RTN, distributed: the work is split across ranks as the distributed engine splits it (stream.run with a
  dist.World): the output files, each inside one source shard, balanced by bytes read + written (`balance`,
  the same greedy as dist.share); each rank streams its files at the measured per-rank rate of input, so
  wall = fixed cost + max rank bytes in / rate. Peak RSS per rank: the process + the row blocks and
  mapped source pages in flight (`IN_FLIGHT`), independent of the shard size.
- GPTQ (calibration/engine.py, layer by layer): every rank runs the calibration forward of each decoder layer
  over all S x T tokens; the layer's routed experts and other target Linears are split across ranks, so the
  Hessians, the all-token expert work and the GPTQ solves divide. Memory per rank: the largest decoder layer
  in the compute dtype, its source copy in BF16 and the integers, the Hessians (float32 K x K per site, bounded
  by `experts_per_pass`), the hidden states [S, T, H] (in memory, or on disk with one batch in memory), GLM-5's
  carried top-k indices [S, T, index_topk] int32 and one batch's forward workspace, on top of a GPTQ process
  (transformers, numba, the tokenizer: larger than RTN's). Time: `glmq quantize`'s defaults (all of a layer's
  experts in one pass), and beside it the `experts_per_pass` variant, one calibration pass per chunk of experts.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from glmq.formats.families import TensorClass, family_for, layer_index, loader_config
from glmq.formats.safetensors_io import DTYPE_NAMES, ITEMSIZE, CheckpointError, TensorEntry, read_json_object
from glmq.formats.source import Source, SourceFormat, detect_format
from glmq.quantize.plan import DEFAULT_MAX_SHARD_BYTES, Action, make_plan
from glmq.quantize.stream import CHUNK_BYTES, PENDING_BYTES, PREFETCH, Reader
from glmq.recipes import load as load_recipe

ASSUMED_SHARD_BYTES = int(5.3e9)
_DENSE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # config dtype -> safetensors dtype
# What an RTN run holds beside the process, whatever the shard size (quantize/stream.py): source pages still
# mapped (a Reader handle is dropped every RELEASE_BYTES; the row blocks prefetched or being converted may
# still view the one before), the converted rows waiting for the write lanes (PENDING_BYTES), and the block
# being converted: its converted copy (at most 2x for FP8 -> BF16) and float32 temporaries.
IN_FLIGHT = Reader.RELEASE_BYTES + (PREFETCH + 1) * CHUNK_BYTES + PENDING_BYTES + 3 * CHUNK_BYTES
NOT_MEASURED = "not measured yet"


@dataclass(frozen=True)
class Figure:
    """A measured number and where it comes from (value None: not measured yet)."""

    value: float | None
    unit: str
    basis: str


_CPU_RUN = ("BENCHMARKS.md 'RTN conversion throughput', CPU (2 cores, 24 GiB), 2026-12-01, "
            "`python scripts/bench_rtn.py --work /tmp/glmq-bench-cpu --repeats 2 --peer-python ...`, 4.44 GB GLM-5-shape input")
_GPU_RUN = ("BENCHMARKS.md 'RTN conversion throughput', GPU (lent NVIDIA H200, 16 host cores), 2026-12-01, "
            "`PARTS=\"rtn-sizes\" bash scripts/gpu_run.sh` (bench_rtn.py --layers 8 --device cuda --repeats 3), 12.97 GB input")
_GPTQ_TODO = (NOT_MEASURED + ": no GPTQ timing at GLM-5 shapes in BENCHMARKS.md; fill from one layer of a "
              "glmq_report.json with `rates_from_layer_report`, or pass --throughput")
_GPTQ_GPU_RUN = ("BENCHMARKS.md 'GPTQ at GLM-5 shapes', session 6 (H200, 2026-12-01, `scripts/bench_gptq_gpu.py --layers 2 "
                 "--experts 256 --skip-rtn`, 128 x 256 tokens, float32, the Triton GPTQ kernels)")
FIGURES: dict[str, Figure] = {
    "rtn_cpu_GBps": Figure(0.2917, "GB/s of input per rank", _CPU_RUN + ": median conversion pipeline 15.22 s"),
    "rtn_cpu_fixed_s": Figure(2.48, "s per run", _CPU_RUN + ": median whole process 17.70 s - 15.22 s pipeline"),
    "rtn_cuda_GBps": Figure(1.635, "GB/s of input per rank", _GPU_RUN + ": median conversion pipeline 7.93 s"),
    "rtn_cuda_fixed_s": Figure(5.57, "s per run", _GPU_RUN + ": median whole process 13.50 s - 7.93 s pipeline "
                               "(torch import, planning, the compressed-tensors child's import not hidden)"),
    "copy_cpu_GBps": Figure(0.3476, "GB/s read+write+fsync", _CPU_RUN + ": median copy 12.77 s"),
    "copy_cuda_GBps": Figure(0.786, "GB/s read+write+fsync", _GPU_RUN + ": median copy 16.49 s"),
    "rss_process_cpu_GB": Figure(0.236, "GB", _CPU_RUN + ": median rss_at_start_bytes (imports, before the first tensor)"),
    "rss_process_cuda_GB": Figure(0.653, "GB", _GPU_RUN + ": median rss_at_start_bytes (imports and the CUDA context)"),
    "rss_bench_cpu_GB": Figure(0.801, "GB peak RSS", _CPU_RUN + ": median glmq peak RSS, largest input shard 0.491 GB"),
    "rss_bench_cuda_GB": Figure(1.465, "GB peak RSS", _GPU_RUN + ": median glmq peak RSS, largest input shard 0.499 GB"),
    "config_child_GB": Figure(0.4891, "GB peak RSS, rank 0 only", "BENCHMARKS.md 'The config child's memory', "
                              "CPU (2 cores), 2026-12-07, `python scripts/bench_config_child.py --json "
                              "benchmarks/bench_config_child.json` (3 runs of the built-in glm5-tiny; torch 2.13.0+cpu, "
                              "compressed-tensors 0.19.0): median config_child_peak_rss_bytes of quantize's report; the "
                              "child imports torch and compressed-tensors, whatever the model's size"),
    "gptq_process_extra_GB": Figure(0.477, "GB above rss_process_<device>_GB", "BENCHMARKS.md 'GPTQ time and memory at "
                                    "4 and 8 layers, session 7' (CPU, 2026-12-01, `python -m glmq.scripts.bench_gptq "
                                    "scaling`): a GPTQ process holds 660-680 MiB at the start of a MoE layer with no "
                                    "tensor alive (transformers' modeling code, numba and its kernels, the tokenizer, "
                                    "heap), 0.713 GB - rss_process_cpu_GB 0.236"),
    "gptq_cpu_forward_TFLOPs": Figure(None, "TFLOP/s", _GPTQ_TODO),
    "gptq_cuda_forward_TFLOPs": Figure(31.2, "TFLOP/s", _GPTQ_GPU_RUN + ": layer 1, 48.77 s, of which 35.79 s solving "
                                       "and 6.04 s loading at rtn_cuda_GBps: 216 TFLOP of layer_work in the other 6.93 s"),
    "gptq_cpu_tune_s_per_step": Figure(None, "s per tuning step of a decoder layer", NOT_MEASURED + ": no tuning "
                                       "timing at GLM-5 shapes on a CPU"),
    "gptq_cuda_tune_s_per_step": Figure(0.354, "s per tuning step of a decoder layer", "BENCHMARKS.md 'GPTQ at GLM-5 "
                                        "shapes', session 9 (H200, 2026-12-02, `scripts/bench_gptq_gpu.py --layers 1 "
                                        "--experts 64 --skip-rtn --recipe int4-w4a16-all-linear`): 70.7 s for 200 steps "
                                        "of batch 8 x 256 tokens (attention and shared expert tuned), 64 of 256 experts "
                                        "(the steps' expert FLOPs do not grow with the expert count: top-k routing)"),
    "gptq_cpu_s_per_column": Figure(None, "s per input column of a target", _GPTQ_TODO),
    "gptq_cuda_s_per_column": Figure(9.75e-6, "s per input column of a target", _GPTQ_GPU_RUN + ": layer 1, 35.79 s "
                                     "solving 3.67 M input columns with the recipe defaults (propagated clip search, "
                                     "2 sweeps of descent)"),
}


_RATE_SUFFIXES = ("GBps", "TFLOPs")  # FIGURES keys that are rates (divisors)


class ConfigError(ValueError):
    """A config.json `glmq plan` cannot plan from: missing, or without a key the estimate needs."""


def with_overrides(overrides: dict[str, float], figures: dict[str, Figure] = FIGURES) -> dict[str, Figure]:
    """`figures` with some values replaced (`--throughput KEY=VALUE`); unknown keys are an error."""
    unknown = sorted(set(overrides) - set(figures))
    if unknown:
        raise ValueError(f"unknown --throughput key(s) {unknown}; known: {sorted(figures)}")
    for k, v in overrides.items():  # a rate divides the work; zero, negative or NaN would print nonsense or crash
        if not math.isfinite(v) or v < 0 or (v == 0 and k.endswith(_RATE_SUFFIXES)):
            raise ValueError(f"--throughput {k}={v:g}: {'a rate' if k.endswith(_RATE_SUFFIXES) else 'the value'} "
                             f"must be a finite number {'> 0' if k.endswith(_RATE_SUFFIXES) else '>= 0'} "
                             f"({figures[k].unit})")
    return {k: replace(f, value=overrides[k], basis="--throughput override") if k in overrides else f
            for k, f in figures.items()}


def parse_overrides(texts: tuple[str, ...]) -> dict[str, float]:
    """`("KEY=NUMBER", ...)` from the command line -> {key: value}."""
    out = {}
    for t in texts:
        key, _, value = t.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--throughput takes KEY=NUMBER, got {t!r}") from None
    return out


@dataclass(frozen=True)
class Scale:
    """How the job is run. GPTQ defaults are calibration/engine.py's CalibrationSettings defaults
    (tests/test_estimate.py checks they agree); `experts_per_pass` is the bounded variant shown
    next to "all experts at once"."""

    ranks: int = 1
    device: str = "cpu"
    samples: int = 128
    seq_len: int = 256
    batch_size: int = 8
    dtype: str = "float32"
    experts_per_pass: int | None = 32
    expert_prior: float = 1.0
    all_token_limit: float | None = 4.0  # the prior's all-token down Hessians take the first limit x I tokens

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.samples < 1 or self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("ranks, samples, seq_len and batch_size must be positive")
        if self.device not in ("cpu", "cuda") or self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"device must be cpu|cuda and dtype float32|bfloat16|float16, got {self.device}, {self.dtype}")
        if self.experts_per_pass is not None and self.experts_per_pass < 1:
            raise ValueError("experts_per_pass must be positive (or None)")

    @property
    def dbytes(self) -> int:
        return 4 if self.dtype == "float32" else 2


# ----------------------------------------------------------------------------------------------- sizes
def virtual_source(config_path: Path) -> Source:
    """The source a config.json describes: the fixture layout, cut into ASSUMED_SHARD_BYTES shards."""
    from glmq.formats import fixtures

    config_path = Path(config_path)
    if not config_path.is_file():
        raise ConfigError(f"{config_path}: no such file; --model takes a checkpoint folder or a model's config.json")
    try:  # (a binary file was a bare UnicodeDecodeError that named no file)
        config = read_json_object(config_path, "--model takes a checkpoint folder or a model's config.json",
                                  "--model takes a checkpoint folder or a model's config.json")
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    family = family_for(config, str(config_path))
    _check_values(config, config_path)
    fmt, block = detect_format(config, Path(config_path))
    weights = ((config.get("quantization_config") or {}).get("config_groups") or {}).get("group_0", {}).get("weights") or {}
    # the layout the loaders build: a key config.json lacks takes its config class's default, as a checkpoint
    # folder's layout check reads it (families.loader_config)
    built, _ = loader_config(config)
    with _config_keys(built, config_path):
        layout = fixtures.tensor_layout(built, fmt.value if fmt.value != "dense" else "bf16", family=family.name,
                                        fp8_ct_strategy="tensor" if weights.get("strategy") == "tensor" else "channel")
    # the fixture layout stores an unquantized checkpoint in bf16; a plain FP16/FP32 one says so in its config
    # (`torch_dtype`, `dtype` since transformers 5), and an FP32 one reads, and copies, twice the bytes
    dense_dtype = None
    if fmt is SourceFormat.DENSE:
        dense_dtype = _DENSE_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"))
    entries, pos, shard, shard_bytes = {}, 0, 0, {}
    for unit in layout:
        for st in unit:
            dtype = DTYPE_NAMES[st.dtype]
            dtype = dense_dtype if dense_dtype is not None and dtype == "BF16" else dtype
            nbytes = math.prod(st.shape) * ITEMSIZE[dtype]
            if pos + nbytes > ASSUMED_SHARD_BYTES and pos:
                shard, pos = shard + 1, 0
            name = f"virtual-{shard:05d}"
            entries[st.name] = TensorEntry(st.name, name, dtype, tuple(st.shape), pos, pos + nbytes)
            pos += nbytes
            shard_bytes[name] = shard_bytes.get(name, 0) + nbytes
    return Source(Path(config_path).parent, config, family, fmt, entries, sorted(shard_bytes), shard_bytes, block, [],
                  "config-only", config_path=config_path)


def _check_values(config: dict, config_path: Path) -> None:
    """ConfigError naming every config value the layout is built from that is of the wrong kind (`"256"`, `1.5`, a
    zero count): the value checks a checkpoint folder's plan makes (families.config_value_problems and
    count_problems), here before a layout is made from them."""
    from glmq.formats.families import config_value_problems, count_problems

    problems = [p for _, p in config_value_problems(config) + count_problems(config)]
    if problems:
        raise ConfigError(f"{config_path}: {'; '.join(problems)}; fix config.json (e.g. take it as published with the "
                          f"weights)")


def from_plan(plan, scale: Scale = Scale(), figures: dict[str, Figure] = FIGURES) -> dict:
    """Sizes, memory and time for a plan of a real checkpoint (its actual shard sizes)."""
    with _config_keys(plan.source.config, plan.source.root / "config.json"):
        return summarize(plan, scale, figures, assumed=False)


def from_config_file(config_path: Path, recipe: str, scale: Scale = Scale(), figures: dict[str, Figure] = FIGURES,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Plan a conversion from config.json alone (e.g. GLM-5.2's real dimensions), output files of at most
    `max_shard_bytes` (`--max-shard-size`), each inside one assumed source shard as in a real plan."""
    return summarize_config_plan(plan_from_config(config_path, recipe, max_shard_bytes), config_path, scale, figures)


def plan_from_config(config_path: Path, recipe, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
    """The plan of `from_config_file` (its source: `virtual_source`); `recipe` a name or path, or a loaded Recipe."""
    source = virtual_source(config_path)
    with _config_keys(source.config, Path(config_path)):
        return make_plan(source, load_recipe(recipe) if isinstance(recipe, str) else recipe, max_shard_bytes)


def summarize_config_plan(plan, config_path: Path, scale: Scale = Scale(), figures: dict[str, Figure] = FIGURES) -> dict:
    """`from_config_file`'s summary of a `plan_from_config` plan."""
    with _config_keys(plan.source.config, Path(config_path)):
        return summarize(plan, scale, figures, assumed=True)


@contextmanager
def _config_keys(config: dict, config_path: Path):
    """A KeyError for a key the config lacks -> ConfigError naming the file and the key."""
    try:
        yield
    except KeyError as e:
        key = e.args[0] if e.args else None
        if not isinstance(key, str) or key in config:
            raise
        raise ConfigError(f"{config_path}: no {key!r} key, which glmq plan needs; use the model's complete "
                          f"config.json (e.g. as published with its weights)") from None


def summarize(plan, scale: Scale, figures: dict[str, Figure], assumed: bool) -> dict:
    shard_bytes = plan.source.shard_bytes
    return {
        "source": str(plan.source.root), "family": plan.source.family.name,
        "source_format": plan.source.fmt.value, "recipe": plan.recipe.name, "tensors": len(plan.items),
        "bytes_in": plan.source.total_bytes, "bytes_out": plan.bytes_out, "output_files": len(plan.files),
        "by_class": plan.by_class(), "shards_assumed": assumed, "largest_input_shard": max(shard_bytes.values()),
        "scale": asdict(scale),
        "rtn": rtn_estimate(rtn_jobs(plan), max(shard_bytes.values()), scale, figures),
        "gptq": gptq_estimate(plan, scale, figures),
        # the compressed-tensors config child, which rank 0 (the lead) starts first and keeps for the whole run
        "config_child_rss": figures["config_child_GB"].value * 1e9,
    }


# ------------------------------------------------------------------------------------- distribution
def balance(costs: dict[str, float], ranks: int) -> list[list[str]]:
    """Split work items across ranks: largest first, each to the least-loaded rank (LPT greedy, at most
    4/3 of the optimal makespan). Every item lands on exactly one rank; ties go to the lower rank."""
    loads, out = [0.0] * ranks, [[] for _ in range(ranks)]
    for key in sorted(costs, key=lambda k: (-costs[k], k)):
        r = min(range(ranks), key=lambda i: (loads[i], i))
        loads[r] += costs[key]
        out[r].append(key)
    return out


def rtn_jobs(plan) -> dict[str, tuple[int, int]]:
    """RTN's units of work: the plan's output files (each inside one source shard), as (bytes in, bytes out)."""
    return {f.name: (sum(it.in_bytes for it in f.items), f.nbytes) for f in plan.files}


def rtn_estimate(jobs: dict[str, tuple[int, int]], largest_shard: int, scale: Scale, figures: dict[str, Figure]) -> dict:
    """RTN per rank: the split of `jobs` (name -> (bytes in, bytes out)), peak RSS and wall time (None where a
    figure is not measured). Jobs are balanced by bytes read + written, as stream.run's distributed split."""
    split = balance({k: i + o for k, (i, o) in jobs.items()}, scale.ranks)
    per_rank = [sum(jobs[j][0] for j in r) for r in split]
    process = figures[f"rss_process_{scale.device}_GB"].value * 1e9
    rate, fixed = figures[f"rtn_{scale.device}_GBps"].value, figures[f"rtn_{scale.device}_fixed_s"].value
    wall = None if rate is None or fixed is None else fixed + max(per_rank) / (rate * 1e9)
    return {"jobs": len(jobs), "rank_bytes_max": max(per_rank), "rank_bytes_min": min(per_rank),
            "rank_jobs_max": max(len(r) for r in split), "largest_shard": largest_shard,
            "peak_rss": rtn_peak_rss(process), "process_rss": process, "seconds": wall,
            "rate_GBps": rate, "fixed_s": fixed, "copy_GBps": figures[f"copy_{scale.device}_GBps"].value,
            "model_check": {d: {"model": rtn_peak_rss(figures[f"rss_process_{d}_GB"].value * 1e9),
                                "measured": figures[f"rss_bench_{d}_GB"].value * 1e9} for d in ("cpu", "cuda")}}


def rtn_peak_rss(process_rss: float) -> float:
    """The process and what is in flight (`IN_FLIGHT`): not the shard, whose pages are released as it is read."""
    return process_rss + IN_FLIGHT


# --------------------------------------------------------------------------------------------- GPTQ
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")


@dataclass(frozen=True)
class Target:
    """One Linear GPTQ quantizes: [n, k], its routed expert (None: a plain Linear), its Hessian site."""

    module: str
    n: int
    k: int
    expert: int | None
    site: str


@dataclass(frozen=True)
class Layer:
    """What GPTQ's memory and time depend on, for one decoder layer (element counts)."""

    index: int
    params: int
    expert_params: int
    bytes_in: int  # source bytes (weights and scales) every rank reads and dequantizes to build the layer
    linear_flops: int  # 2 N K summed over every 2-D weight, routed experts weighted by top_k / E
    targets: tuple[Target, ...]
    routed_flops: int = 0  # the routed experts' part of linear_flops


def decoder_layers(plan) -> dict[int, Layer]:
    """Every decoder layer (not the MTP layer, which engine.py leaves to RTN) from the plan's items."""
    cfg, n_layers = plan.source.config, plan.source.config["num_hidden_layers"]
    share = cfg.get("num_experts_per_tok", 0) / max(cfg.get("n_routed_experts", 1), 1)
    acc: dict[int, dict] = {}
    for it in plan.items:
        i = layer_index(it.name)
        if i is None or i >= n_layers:
            continue
        a = acc.setdefault(i, {"params": 0, "expert": 0, "bytes": 0, "flops": 0.0, "routed_flops": 0.0, "targets": []})
        numel = math.prod(it.src.shape)
        routed = it.cls is TensorClass.ROUTED_EXPERT
        a["params"] += numel
        a["expert"] += numel if routed else 0
        a["bytes"] += it.in_bytes
        if len(it.src.shape) == 2:
            a["flops"] += 2 * numel * (share if routed else 1)
            a["routed_flops"] += 2 * numel * share if routed else 0
        if it.action is Action.QUANTIZE:
            m = _EXPERT.match(it.module)
            e = int(m.group(1)) if m else None
            site = it.module if m is None else f"{e}.{'down' if m.group(2) == 'down' else 'gate_up'}"
            a["targets"].append(Target(it.module, it.src.shape[0], it.src.shape[1], e, site))
    return {i: Layer(i, a["params"], a["expert"], a["bytes"], round(a["flops"]), tuple(a["targets"]),
                     round(a["routed_flops"])) for i, a in sorted(acc.items())}


def rank_units(layer: Layer, ranks: int) -> list[list[Target]]:
    """The layer's targets per rank: whole routed experts (their Hessian sites go together) and plain
    Linears, balanced by GPTQ solve cost (input columns)."""
    units: dict[str, list[Target]] = {}
    for t in layer.targets:
        units.setdefault(f"e{t.expert}" if t.expert is not None else t.module, []).append(t)
    split = balance({u: sum(t.k for t in ts) for u, ts in units.items()}, ranks)
    return [[t for u in r for t in units[u]] for r in split]


def hessian_bytes(targets: list[Target], experts_per_pass: int | None, prior: bool) -> int:
    """float32 K x K Hessians one rank holds at once (collect.py / layer_gptq.py): pass 0's plain-Linear
    sites and the all-token MoE-input Hessian, plus one chunk of `experts_per_pass` experts, each with its
    gate_up and down sites and, with `expert_prior`, its all-token down site."""
    plain = {t.site: t.k for t in targets if t.expert is None}
    sites: dict[int, dict[str, int]] = {}
    for t in targets:
        if t.expert is not None:
            sites.setdefault(t.expert, {})[t.site] = t.k
    per_expert = sorted((sum(k * k * (2 if prior and s.endswith("down") else 1) for s, k in e.items())
                         for e in sites.values()), reverse=True)
    all_tokens = max((k for e in sites.values() for s, k in e.items() if s.endswith("gate_up")), default=0) ** 2
    return 4 * (sum(k * k for k in plain.values()) + all_tokens + sum(per_expert[: experts_per_pass or len(per_expert)]))


def layer_memory(layer: Layer, targets: list[Target], cfg: dict, scale: Scale, experts_per_pass: int | None,
                 offload: bool) -> dict[str, float]:
    """Bytes per rank of one decoder layer's GPTQ, by component; each lives on "host" or "device"."""
    s, t, b, d, h = scale.samples, scale.seq_len, scale.batch_size, scale.dbytes, cfg["hidden_size"]
    topk = min(cfg.get("index_topk", 0), t)  # the indexer keeps min(index_topk, T) tokens
    widest = max((tg.n for tg in layer.targets), default=h)
    tokens_kept = b if offload else s
    target_params = sum(tg.n * tg.k for tg in layer.targets)
    biggest = max(layer.targets, key=lambda tg: tg.k, default=None)
    mask = b * t * t * d if topk else 0  # GLM-5's DSA reads a materialised causal mask (layers.py full_mask)
    indexer = b * t * t * (cfg.get("index_n_heads", 0) * 4 * 2 + 1) if topk else 0  # scores, relu copy, bool mask
    return {
        "layer": d * layer.params,  # the built decoder layer in the compute dtype
        "source_bf16": 2 * layer.params,  # layer_state(): FP8 dequantized to BF16, held for the whole layer
        # int8 q (+ small scales) of every target, needed by the output forward, and their packed copy while
        # the layer file is written (on a GPU host the largest host-side part: 1 rank measured 22.9 GB RSS)
        "integers": target_params * 1.5,
        "rebuild": 2 * target_params + 2 * layer.expert_params,  # dequantized targets + fused experts (bf16)
        "hessians": hessian_bytes(targets, experts_per_pass, scale.expert_prior > 0),
        # float32 H copies and W copies of the largest problem; coordinate descent adds a damped H and a W
        "solve": 0 if biggest is None else 4 * (5 * biggest.k**2 + 3 * biggest.n * biggest.k),
        "hidden": (2 if offload else 1) * tokens_kept * t * h * d,  # offloaded: one batch read + one written
        "carry": 2 * tokens_kept * t * topk * 4,  # GLM-5 top-k indices, int32: the layer's input and output
        "workspace": mask + indexer + b * t * cfg.get("num_experts_per_tok", 0) * cfg.get("n_routed_experts", 0) * 8
        + 8 * b * t * widest * d,
    }


def peak_memory(parts: dict[str, float], device: str, process: float) -> dict[str, float]:
    """Host and device peaks from layer_memory's parts. Phase A (calibrate + solve) holds the layer, the
    Hessians and the solve workspace; phase B (rebuild with the integers + output forward) the rebuild copies.
    On CPU the device is the host."""
    host = process + parts["integers"] + parts["hidden"] + parts["carry"]
    dev_a = parts["layer"] + parts["hessians"] + parts["solve"] + parts["workspace"]
    dev_b = parts["layer"] + parts["workspace"] + parts["rebuild"]
    # the source weights are dequantized where the layer is computed (layers.SourceTensors): on a GPU the
    # host keeps only the integers and the hidden states
    work = parts["source_bf16"] + max(dev_a, dev_b)
    if device == "cpu":
        return {"host": host + work, "device": 0.0}
    return {"host": host, "device": work}


def attention_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Scores and weighted sum over the whole sequence (the explicit mask makes SDPA compute all T keys)."""
    heads = cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:
        qk, v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    else:
        qk = v = cfg.get("head_dim") or cfg["hidden_size"] // heads
    indexer = cfg.get("index_n_heads", 0) * cfg.get("index_head_dim", 0) if "index_topk" in cfg else 0
    return 2.0 * seq_len * (heads * (qk + v) + indexer)


def layer_work(layer: Layer, targets: list[Target], cfg: dict, scale: Scale) -> dict[str, float]:
    """FLOPs of one rank's calibration passes and input columns of its GPTQ solves, for one layer.

    Passes: one per chunk of this rank's experts (at least one) plus the output forward of the quantized
    layer, each a full forward over S x T tokens, except that a chunk pass runs only its own routed experts
    (calibration/collect.py `_ExpertTap`): the chunk passes together run the routed experts once. Hessian
    sums cost 2 K^2 per token and site (routed sites see top_k / E of the tokens on average); with
    `expert_prior` every expert of the rank also runs gate/up over every token (2 * 2 H I) and sums its
    all-token down Hessian (2 I^2), over the first `all_token_limit` x I tokens only
    (CalibrationSettings.all_token_limit).
    """
    tokens = scale.samples * scale.seq_len
    experts = sorted({t.expert for t in targets if t.expert is not None})
    passes = max(1, math.ceil(len(experts) / (scale.experts_per_pass or max(len(experts), 1)))) if targets else 0
    attention = attention_flops_per_token(cfg, scale.seq_len)
    forward = tokens * (layer.linear_flops + attention)
    share = cfg.get("num_experts_per_tok", 0) / max(cfg.get("n_routed_experts", 1), 1)
    hess = sum(t.k**2 for t in {t.site: t for t in targets if t.expert is None}.values())
    gate_k = max((t.k for t in layer.targets if t.site.endswith("gate_up")), default=0)
    down_k = max((t.k for t in layer.targets if t.site.endswith("down")), default=0)
    hess += (gate_k**2 if experts else 0) + len(experts) * share * (gate_k**2 + down_k**2)
    prior = len(experts) * (2 * gate_k * down_k + down_k**2) if scale.expert_prior > 0 else 0
    prior_tokens = tokens if not scale.all_token_limit else min(tokens, int(scale.all_token_limit * down_k))
    unrouted = tokens * (layer.linear_flops - layer.routed_flops + attention)  # a chunk pass after the first
    passes_flops = (min(passes, 1) + 1) * forward + max(passes - 1, 0) * unrouted  # + the output forward
    return {"passes": passes + 1, "flops": passes_flops + 2 * (tokens * hess + prior_tokens * prior),
            "columns": sum(t.k for t in targets)}


def gptq_estimate(plan, scale: Scale, figures: dict[str, Figure]) -> dict:
    """GPTQ memory per rank for the largest decoder layer, and wall time over every layer when measured."""
    cfg, layers = plan.source.config, decoder_layers(plan)
    if not any(la.targets for la in layers.values()):
        return {"targets": 0}
    big = max(layers.values(), key=lambda la: la.params)
    per_rank = rank_units(big, scale.ranks)
    worst = max(per_rank, key=lambda ts: hessian_bytes(ts, None, scale.expert_prior > 0))
    # not RTN's process: GPTQ's imports transformers and numba, and tokenizes the calibration text
    process = (figures[f"rss_process_{scale.device}_GB"].value + figures["gptq_process_extra_GB"].value) * 1e9
    variants = {}
    for epp in (None, scale.experts_per_pass):
        for offload in (False, True):
            parts = layer_memory(big, worst, cfg, scale, epp, offload)
            variants[f"{'all' if epp is None else epp}/{'disk' if offload else 'memory'}"] = {
                "parts": parts, **peak_memory(parts, scale.device, process)}
    rate = figures[f"gptq_{scale.device}_forward_TFLOPs"].value
    per_col = figures[f"gptq_{scale.device}_s_per_column"].value
    load_rate = figures[f"rtn_{scale.device}_GBps"].value
    load = sum(la.bytes_in for la in layers.values()) / (load_rate * 1e9) if load_rate else None

    def work(epp: int | None) -> tuple[float, float, float | None]:
        """(FLOPs, columns, seconds) on the busiest rank over every layer, `epp` experts' Hessians a pass."""
        sc, flops, columns = replace(scale, experts_per_pass=epp), 0.0, 0.0
        for la in layers.values():
            works = [layer_work(la, ts, cfg, sc) for ts in rank_units(la, scale.ranks)]
            flops += max(w["flops"] for w in works)
            columns += max(w["columns"] for w in works)
        known = rate is not None and per_col is not None and load is not None
        return flops, columns, load + flops / (rate * 1e12) + columns * per_col if known else None

    # the time of glmq quantize's defaults (all of a layer's experts in one pass, as the GPTQ figures were
    # measured), and of the bounded variant shown beside it: each chunk of experts is one more calibration pass
    flops, columns, seconds = work(None)
    b_flops, _, b_seconds = work(scale.experts_per_pass)
    return {"targets": sum(len(la.targets) for la in layers.values()), "layers": len(layers),
            "largest_layer": big.index, "largest_params": big.params, "largest_expert_params": big.expert_params,
            "largest_targets": len(big.targets), "rank_targets": max(len(ts) for ts in per_rank),
            "rank_experts": len({t.expert for t in worst if t.expert is not None}),
            "experts": len({t.expert for t in big.targets if t.expert is not None}),
            "memory": variants, "process_rss": process, "flops": flops, "columns": columns, "load_seconds": load,
            "tune_iters": plan.recipe.spec.tune_iters, "seconds": seconds,
            "bounded": {"experts_per_pass": scale.experts_per_pass, "flops": b_flops, "seconds": b_seconds}}


def rates_from_layer_report(row: dict, layer: Layer, cfg: dict, scale: Scale, load_GBps: float) -> dict[str, float]:
    """The two GPTQ figures from one measured decoder layer, to paste into FIGURES.

    Args:
        row: one entry of glmq_report.json["gptq"]["layers"] (seconds, calibration_tokens_per_s,
            forward_tokens_per_s), from a one-rank run with `scale`'s calibration settings.
        layer: that layer, from `decoder_layers(plan)` of the same checkpoint and recipe.
        load_GBps: the rate at which the layer was read and dequantized (the RTN figure of the device).
    Returns:
        {"forward_TFLOPs": FLOP/s of the calibration passes and the output forward,
         "s_per_column": the rest of the layer's time, minus loading, per solved input column}.
    """
    w = layer_work(layer, list(layer.targets), cfg, scale)
    tokens = scale.samples * scale.seq_len
    fwd_s = (w["passes"] - 1) * tokens / row["calibration_tokens_per_s"] + tokens / row["forward_tokens_per_s"]
    solve_s = max(row["seconds"] - fwd_s - layer.bytes_in / (load_GBps * 1e9), 0.0)
    return {"forward_TFLOPs": w["flops"] / fwd_s / 1e12, "s_per_column": solve_s / w["columns"]}


# --------------------------------------------------------------------------------------------- text
def _gb(n: float) -> str:
    """GB at real scale; MB or KB below 10 MB, where every row of a small model read 0.00 GB."""
    if abs(n) >= 1e7 or n == 0:
        return f"{n / 1e9:9.2f} GB"
    return f"{n / 1e6:9.2f} MB" if abs(n) >= 1e5 else f"{n / 1e3:9.2f} KB"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _count(n: int) -> str:
    """A parameter count in B / M / K (GLM-5's layer: "9.74 B"; a generated tiny model's: "303.1 K", not "0.00 B")."""
    for div, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if round(n / div, digits) >= 1:  # as printed: 999.95 M reads "1.00 B", not "1000.0 M"
            return f"{n / div:.{digits}f} {unit}"
    return str(n)


def format_summary(s: dict, figures: dict[str, Figure] = FIGURES) -> str:
    sc = s["scale"]
    lines = [f"== predicted output: {s['family']} ({s['source_format']}) with recipe {s['recipe']}"
             + (", config only (shards assumed 5.3 GB)" if s["shards_assumed"] else ""),
             f"{'class:action':32s} {'tensors':>8s} {'in':>12s} {'out':>12s}"]
    for key, row in s["by_class"].items():
        lines.append(f"{key:32s} {row['tensors']:8d} {_gb(row['bytes_in']):>12s} {_gb(row['bytes_out']):>12s}")
    lines.append(f"{'total':32s} {s['tensors']:8d} {_gb(s['bytes_in']):>12s} {_gb(s['bytes_out']):>12s}"
                 f"   ({s['bytes_out'] / s['bytes_in']:.3f}x, {s['output_files']} output files)")
    child = (f"rank 0 also runs the compressed-tensors config child for the whole run, alongside: "
             f"{_gb(s['config_child_rss']).strip()} more [config_child_GB: {figures['config_child_GB'].basis}]")
    again = f"rank 0 also runs the config child, alongside: {_gb(s['config_child_rss']).strip()} more (as for RTN)"
    return "\n".join(lines + _rtn_lines(s["rtn"], sc, figures) + [child] + _gptq_lines(s["gptq"], sc, figures, s["rtn"])
                     + ([again] if s["gptq"]["targets"] else []))


def _rtn_lines(r: dict, sc: dict, figures: dict[str, Figure]) -> list[str]:
    dev = sc["device"]
    proc = "CUDA-initialised process" if dev == "cuda" else "process"
    chk = r["model_check"]
    lines = [f"== RTN on {sc['ranks']} rank(s), device {dev}",
             f"{r['jobs']} output files split by bytes read + written: bytes in per rank max "
             f"{_gb(r['rank_bytes_max']).strip()} ({r['rank_jobs_max']} files), min {_gb(r['rank_bytes_min']).strip()}",
             f"peak RSS per rank: {_gb(r['peak_rss']).strip()} = row blocks and mapped source in flight "
             f"{_gb(IN_FLIGHT).strip()} + {proc} {_gb(r['process_rss']).strip()} (not the largest input shard, "
             f"{_gb(r['largest_shard']).strip()}: its pages are released as it is read)",
             "  model check on the measured bench inputs: "
             + ", ".join(f"{d} model {chk[d]['model'] / 1e9:.2f} GB vs measured {chk[d]['measured'] / 1e9:.2f} GB "
                         f"({(chk[d]['model'] - chk[d]['measured']) / 1e9:+.2f} GB)" for d in chk)
             + ": an upper bound"]
    if r["seconds"] is None:
        lines.append(f"wall: {NOT_MEASURED} (rtn_{dev}_GBps)")
    else:
        lines.append(f"wall: {_duration(r['seconds'])} = {r['fixed_s']:.0f} s fixed + max rank bytes at "
                     f"{r['rate_GBps']} GB/s of input per rank [rtn_{dev}_GBps: {figures[f'rtn_{dev}_GBps'].basis}]")
        if sc["ranks"] > 1:
            floor = r["rank_bytes_max"] * sc["ranks"] / (r["copy_GBps"] * 1e9)
            lines.append(f"  assumes every rank has its own storage bandwidth; ranks sharing one host's disk are bounded "
                         f"by it (plain copy of the input measured at {r['copy_GBps']} GB/s: {_duration(floor)})")
    return lines


def _gptq_lines(g: dict, sc: dict, figures: dict[str, Figure], rtn: dict) -> list[str]:
    dev, epp = sc["device"], sc["experts_per_pass"]
    lines = [f"== GPTQ on {sc['ranks']} rank(s), device {dev}, {sc['samples']} x {sc['seq_len']} calibration tokens, "
             f"batch {sc['batch_size']}, {sc['dtype']}"]
    if not g["targets"]:
        return lines + ["no decoder-layer targets: the recipe quantizes nothing GPTQ would calibrate"]
    v = g["memory"]
    p, q = v["all/memory"]["parts"], v[f"{epp or 'all'}/disk"]["parts"]
    where = "GPU" if dev == "cuda" else "host"
    lines.append(f"largest decoder layer: model.layers.{g['largest_layer']}, {_count(g['largest_params'])} params "
                 f"({_count(g['largest_expert_params'])} in {g['experts']} routed experts), {g['largest_targets']} "
                 f"targets; the busiest rank quantizes {g['rank_targets']} of them ({g['rank_experts']} experts)")
    rows = [(f"decoder layer in {sc['dtype']} ({where})", p["layer"]),
            (f"source layer dequantized to bf16 ({where})", p["source_bf16"]),
            ("integers of the layer's targets, int8 (host)", p["integers"]),
            (f"rebuild with the integers: dequantized + fused ({where})", p["rebuild"]),
            (f"Hessians, all {g['rank_experts']} experts of the rank at once ({where})", p["hessians"]),
            (f"Hessians, --experts-per-pass {epp} ({where})", q["hessians"]),
            ("GPTQ solve workspace, largest target (" + where + ")", p["solve"]),
            (f"one batch's forward workspace, estimate ({where})", p["workspace"]),
            ("hidden states [S, T, H] in memory, --activations memory (host)", p["hidden"]),
            ("hidden states on disk: one batch in, one out (host)", q["hidden"])]
    if p["carry"]:
        rows.append(("carried top-k indices, int32, in + out (host)", p["carry"]))
    rows.append(("process: imports, tokenizer, heap (host)", g["process_rss"]))
    lines += [f"  {label:62s} {_gb(n)}" for label, n in rows]
    # glmq quantize's defaults first (all of a layer's experts at once, --activations disk), then each option
    for key, label in (("all/disk", "quantize's defaults (all experts at once, hidden states on disk)"),
                       ("all/memory", "with --activations memory"),
                       (f"{epp or 'all'}/disk", f"with --experts-per-pass {epp}")):
        m = v[key]
        lines.append(f"peak per rank, {label}: host {_gb(m['host']).strip()}"
                     + (f", GPU {_gb(m['device']).strip()}" if dev == "cuda" else ""))
    lines.append(f"work: {g['flops'] / 1e15:.1f} PFLOP of calibration passes ({g['bounded']['flops'] / 1e15:.1f} with "
                 f"--experts-per-pass {epp}) and {g['columns'] / 1e6:.2f} M solved input "
                 f"columns on the busiest rank, over {g['layers']} decoder layers")
    keys = [f"gptq_{dev}_forward_TFLOPs", f"gptq_{dev}_s_per_column"]
    missing = [k for k in keys if figures[k].value is None]
    if g["load_seconds"] is not None and rtn["seconds"] is not None:
        lines.append(f"measured part: every rank reads and dequantizes every decoder layer "
                     f"({_duration(g['load_seconds'])} at the RTN rate, rtn_{dev}_GBps) and the checkpoint is written as "
                     f"by RTN ({_duration(rtn['seconds'])}): {_duration(g['load_seconds'] + rtn['seconds'])}")
    if missing:
        lines.append(f"wall: {NOT_MEASURED}; a lower bound is the measured part above "
                     f"({', '.join(missing)}: {figures[missing[0]].basis})")
    elif g["seconds"] is not None:
        lines.append(f"wall: {_duration(g['seconds'] + (rtn['seconds'] or 0))} = measured part + calibration passes "
                     f"{_duration(g['flops'] / (figures[keys[0]].value * 1e12))} + solves "
                     f"{_duration(g['columns'] * figures[keys[1]].value)} (quantize's defaults, all experts at once; "
                     f"with --experts-per-pass {epp}: {_duration(g['bounded']['seconds'] + (rtn['seconds'] or 0))}, "
                     f"calibration passes {_duration(g['bounded']['flops'] / (figures[keys[0]].value * 1e12))}); "
                     "EXTRAPOLATION from " + "; ".join(f"{k} = {figures[k].value} ({figures[k].basis})" for k in keys))
    if g.get("tune_iters"):
        f = figures[f"gptq_{dev}_tune_s_per_step"]
        cost = (f"about {_duration(f.value * g['tune_iters'] * g['layers'])} more if every layer steps as fast as a GLM-5 "
                f"layer, at {f.value} s a step ({f.basis})"
                if f.value is not None else f.basis)
        lines.append(f"layer-output tuning ({g['tune_iters']} steps a layer, tune_iters) is NOT in the wall above: {cost}")
    return lines
