"""Layer-sequential GPTQ: calibrate and quantize one decoder layer at a time, then stream the checkpoint.

For decoder layer i = 0 .. L-1 (calibration tokens embedded with the source's `embed_tokens` first):
  1. build layer i alone with transformers' own class, source weights loaded (calibration/layers.py);
  2. run the calibration hidden states through it while collecting the input Hessian of every target
     Linear of the recipe in this layer (calibration/collect.py; routed experts see only the tokens
     the layer's own router sends them);
  3. quantize every target with `quantize_gptq` (layer_gptq.py), and write the results (cache.py, atomic);
  4. run the hidden states through the *quantized* layer (dequantized integers loaded back), which
     gives the input of layer i+1; free the layer.
Then `stream.run(plan, out, quantized=CachedQWeights(...))` writes the checkpoint: the writer, the
manifest, the index and config.json are the streaming engine's, only the integers come from here.

The MTP layer (index L, `families.mtp_layers`) is not part of transformers' forward: its targets are
quantized with RTN by the streaming engine (the provider returns None), and the report says so.

Defaults, measured on the shared trained GLM-4.x MoE (int4-w4a16, 128 x 256 tokens of prose-calib.txt,
KL(source || quantized) over 96 x 256 tokens of prose-eval.txt; RTN 0.01345; seed-to-seed spread of
the calibration draw about +-3 %): GPTQ with routed Hessians 0.01229; `clip_search` 0.01118 (kept:
the largest single gain); act_order, routing-weighted Hessians and all-token Hessians for every
expert did not help (0.0107-0.0129 with and without clip); the `expert_prior` blend 0.01089 at 128
samples and, with 4 samples, 0.0138 where routed Hessians alone give 0.0193 (worse than RTN).
Tried and not kept (seed 0 unless noted): act_order 0.01268 (0.01106 / 0.01116 for seeds 0 / 1 with
clip, vs 0.01118 / 0.01110 without); routing-weight^2 token weights 0.01285; all-token Hessians for
every expert 0.01259; output-sensitivity token weights for gate/up 0.01089 mean of 3 seeds with
damp 0.3 (vs 0.01073 without); down_proj calibrated on quantized gate/up outputs toward the
unquantized expert output (asymmetric, GPTAQ-style) 0.01768: it shrinks the experts' outputs.
Solver (QuantSpec `damp`, `clip_objective`, `cd_sweeps`; mean KL of seeds 0-4, BENCHMARKS.md): the above
(block clip, no descent, damp 0.01) 0.01104; propagated clip 0.01072; + 2 coordinate-descent sweeps
0.01067; the same at damp 0.1 0.01058 (kept; every linear: 0.02994 over seeds 0-3 vs 0.03238 over 0-2);
4 sweeps at damp 0.1 0.01065; propagated clip at damp 0.1 without descent 0.01082; block clip + 4 sweeps
at damp 0.1 0.01068. The all-token down Hessians from the first 4 x I tokens (`all_token_limit`) instead of
every token: 0.01058 against 0.01058 (5 seeds), and with 4 samples, where the prior matters most, 0.01307
against 0.01304 (3 seeds).

Memory: one decoder layer (compute dtype; the routed experts in the source's dtype during the Hessian
passes) plus its Hessians (float32 K x K per target site; bound them with `experts_per_pass`), plus one
batch of the hidden states `[S, T, H]`: by default (`activations="disk"`) they live in a file in the
output's cache folder and are read and written batch by batch (batch_size * T * H * 4 bytes in float32
in memory, the file in the page cache, which the kernel reclaims and which is not the process's RSS);
with `activations="memory"` all of them are held (S*T*H*4 bytes in float32: 64 MB for the scaling
model's 64 x 256 tokens, 0.8 GB for 128 x 256 tokens of GLM-5). The same holds for GLM-5's DSA carried
top-k indices `[S, T, index_topk]` int32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from glmq.calibration import cache as cc
from glmq.calibration.collect import Target, make_target
from glmq.calibration.layer_gptq import gptq_batches, quantize_layer, sequential_stages
from glmq.calibration.layers import LayerBuilder, check_transformers_config
from glmq.calibration.report import summarize
from glmq.formats.families import layer_index
from glmq.formats.safetensors_io import TMP_SUFFIX, atomic_write_text
from glmq.quantize import stream
from glmq.quantize.output import OutputLock, plan_identity, prepare_output
from glmq.quantize.plan import Action, Plan
from glmq.quantize.rtn import QWeight, dequantize

log = logging.getLogger("glmq.gptq")
UNDER_COVERED = ("all_tokens", "rtn")


ACTIVATIONS = ("disk", "memory")
# settings that change no bit (trust_remote_code: the tokens, hashed in the identity, are what counts)
NOT_IDENTITY = ("experts_per_pass", "activations", "offload_activations", "trust_remote_code")
GPTQ_BATCH = {"cuda": 16, "cpu": 2}  # CalibrationSettings.gptq_batch when None, by device type


@dataclass(frozen=True)
class CalibrationSettings:
    """How GPTQ is calibrated. All but `experts_per_pass`, `activations` and `offload_activations` (which
    change no bit of the result) make up the run's identity.

    Attributes:
        calibration: the calibration file or dataset name (provenance only; the tokens are digested).
        samples, seq_len, seed: the calibration set (calibration/data.py).
        min_expert_tokens: a routed expert that receives fewer calibration tokens than this is
            "under-covered": it gets `under_covered` instead of its routed Hessian and is listed in the
            report. Default 1: an expert no token reaches has no Hessian of its own; low counts above
            that are handled smoothly by `expert_prior` (a hard threshold at ~K tokens was measured
            worse than the prior: 4 samples, KL 0.0144 at 256 tokens vs 0.0138 with the prior).
        expert_prior: every routed expert's Hessian is blended with the all-token one (the layer's
            MoE input, and act(gate(x)) * up(x) over every token for down_proj) as a prior worth
            `expert_prior * K` tokens: H = (n H_routed + lam H_all) / (n + lam), lam = expert_prior * K,
            K the Linear's input size. A routed Hessian from n ~ K tokens is a noisy, nearly singular
            estimate that GPTQ overfits (measured on the shared model with 4 samples: KL 0.0193, worse
            than RTN's 0.0134); the prior fades out as n grows past K. 0: routed Hessians only.
            Costs the all-token down-input Hessians of every expert (E / top_k times the routed
            expert compute in the calibration pass over the tokens they take, see all_token_limit).
        all_token_limit: the all-token down-input Hessians (the prior's, and those of under-covered
            experts) take the first `all_token_limit * I` calibration tokens (I: the experts'
            intermediate size, the side of those Hessians); None: every token. Default 4: on the
            shared model the same KL as every token (BENCHMARKS.md), and at the 280 M-parameter
            scaling model's 16384 tokens it takes a quarter of them (with the routed down projections no
            longer run in these passes: 1,850 -> 3,580 calibration tokens/s there).
        under_covered: "all_tokens" (Hessians from every token of the layer, as llm-compressor's
            moe_calibrate_all_experts) or "rtn" (round-to-nearest).
        clip_search: `quantize_gptq(clip_search=True)`: search each group's clipped scale, scored as the
            recipe's `clip_objective` says.
        batch_size: calibration samples per forward.
        dtype: compute dtype of the layer forwards and of the stored hidden states.
        experts_per_pass: routed experts whose Hessians are held at once (None: all); more passes,
            less memory.
        gptq_batch: same-shape GPTQ problems (experts) solved in one column loop
            (`quantize_gptq_batch`); bounds the extra float32 memory to about gptq_batch x (W + 3 H), plus
            one W and one H more with coordinate descent (QuantSpec.cd_sweeps). None: GPTQ_BATCH of the
            device (the batch divides launch overhead on a GPU; on a CPU the kernels loop over the batch:
            calls of 2 took 7.6 % longer than calls of 4 and the 4-layer scaling model's peak RSS during
            the solves fell by ~160 MB, BENCHMARKS.md). The output does not depend on it on a CPU.
        activations: where the hidden states between layers live: "disk" (default; a file, one batch in
            memory) or "memory" (all of them; no disk traffic beyond the per-layer save for resuming).
            "disk" writes and reads each layer's states once more than "memory" (2 x S*T*H*4 bytes a layer:
            128 MB for the scaling model, 1.6 GB for 128 x 256 tokens of GLM-5) and holds up to two copies
            on disk while a layer runs (the previous layer's until the new one is complete).
        offload_activations: folder for the "disk" files (None: the output's cache folder `.glmq-gptq/`,
            where "memory" saves each layer's states for resuming too). Only with "disk".
        sequential: quantize a layer's targets in stages in the order the forward reaches them
            (`layer_gptq.sequential_stages`: attention inputs, MLA's second projections, the attention
            output, the MLPs' gate/up, their down projections), each stage's Hessians collected from a
            pass through the layer with every earlier stage already quantized, as the GPTQ reference's
            `--true-sequential`. One calibration pass per stage instead of one per layer. False: every
            Hessian of the layer from one pass through its unquantized weights.
        trust_remote_code: load a tokenizer whose class is code in the checkpoint folder (Kimi K2's), running
            that code (`calibration.data.load_tokenizer`).
    """

    calibration: str = ""
    samples: int = 128
    seq_len: int = 256
    seed: int = 0
    min_expert_tokens: int = 1
    under_covered: str = "all_tokens"
    clip_search: bool = True
    expert_prior: float = 1.0
    all_token_limit: float | None = 4.0
    batch_size: int = 8
    dtype: str = "float32"
    experts_per_pass: int | None = None
    gptq_batch: int | None = None
    activations: str = "disk"
    offload_activations: str | None = None
    sequential: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.under_covered not in UNDER_COVERED:
            raise ValueError(f"under_covered must be one of {UNDER_COVERED}, got {self.under_covered!r}")
        if self.min_expert_tokens < 0 or self.batch_size <= 0 or (self.experts_per_pass or 1) <= 0 \
                or (self.gptq_batch or 1) <= 0:
            raise ValueError("min_expert_tokens must be >= 0; batch_size, experts_per_pass and gptq_batch positive")
        if self.all_token_limit is not None and not 0 < self.all_token_limit < math.inf:
            raise ValueError(f"all_token_limit must be a positive finite number, or None for every token, got "
                             f"{self.all_token_limit!r}")
        if not 0 <= self.expert_prior < math.inf:  # NaN too: it would never equal itself in a resumed run's identity
            raise ValueError(f"expert_prior must be a finite number >= 0, got {self.expert_prior!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.offload_activations and self.activations != "disk":
            raise ValueError("offload_activations (a folder for the hidden states) needs activations='disk'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def identity(self) -> dict:
        # `sequential` is left out while off, so caches written before it existed stay valid
        return {k: v for k, v in asdict(self).items() if k not in NOT_IDENTITY and not (k == "sequential" and not v)}


def run_gptq(plan: Plan, out: str | Path, tokens: torch.Tensor, settings: CalibrationSettings,
             device: str = "cpu", progress: bool = True, world=None) -> dict:
    """Calibrate and quantize with GPTQ layer by layer, then write the checkpoint; return the run report.

    Args:
        plan: a plan whose recipe has method "gptq" (its QuantSpec gives act_order, damp, block size).
        out: output folder; a killed run resumes from its `.glmq-gptq` cache (cache.py).
        tokens: int64 `[S, T]` calibration token ids.
        world: a `dist.World` when this process is one rank of a torchrun job (`device` is then the
            rank's device). Every rank runs each layer's calibration forward; the layer's routed experts
            and other targets are split across the ranks (`dist.share` by weight size), each rank
            collects only its own targets' Hessians and solves them, rank 0 merges the ranks' layer
            parts into the layer file, and every rank forwards through the merged integers. The
            checkpoint is then written by the distributed streaming engine.
    Returns:
        stream.run's report with a "gptq" section (calibration_report), also in glmq_report.json.
    Raises:
        CheckpointError (OutputDirError, CalibrationCacheError): the folder holds another run, or another process is
            writing into it.
        ValueError: bad tokens or a layer that does not match transformers' class.
    """
    out = Path(out)
    if tokens.ndim != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"calibration tokens must be an int64 [samples, seq_len] tensor, got {tokens.dtype} {list(tokens.shape)}")
    check_seq_len(plan, tokens.shape[1])
    check_transformers_config(plan.source.root, plan.source.config)
    from glmq.calibration.data import check_token_ids

    check_token_ids(tokens, plan.source.root, plan.source.config)  # before the output folder is touched
    if world is not None and plan.recipe.spec.tune_iters:
        raise ValueError(f"{plan.recipe.name}: tune_iters (layer-output tuning) runs in one process; set tune_iters: 0 "
                         "in the recipe to calibrate with several ranks")
    with OutputLock(out) as lock:  # from the folder's check through calibration to the written checkpoint
        return _run_gptq(plan, out, lock, tokens, settings, device, progress, world)


def _run_gptq(plan: Plan, out: Path, lock: OutputLock, tokens: torch.Tensor, settings: CalibrationSettings,
              device: str, progress: bool, world) -> dict:
    lead = world is None or world.is_lead
    # the calibration spec itself is left out: the tokens' digest is what it contributes, and `./c.txt` after
    # `c.txt` (or the file moved) refused the resume of the very same run
    calibration = {"settings": {k: v for k, v in settings.identity().items() if k != "calibration"},
                   "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
                   "tokens_shape": list(tokens.shape)}
    # the manifest first (then the cache may live inside `out`), with the calibration: the files finished before a
    # crash hold its integers, and the cache that also records it may be gone (deleted, or --offload elsewhere)
    man = prepare_output(plan, out, lock, world, calibration)
    cache = out / cc.CACHE_DIR
    identity = {"plan": plan_identity(plan), **calibration}
    finished = man.complete and len(man.files) == len(plan.files) and (cache / cc.REPORT_NAME).exists()
    calibrating_on = None if finished else torch.device(device).type  # recorded; another device warns
    if world is None:
        cc.check_identity(cache, identity, calibrating_on)
    else:
        world.on_lead("checking the calibration cache", lambda: cc.check_identity(cache, identity, calibrating_on))
    if finished:
        report = json.loads((cache / cc.REPORT_NAME).read_text())
        report["note"] = "output already complete: calibration not re-run"
    else:
        report = calibrate(plan, cache, tokens, settings, device, progress and lead, world)
        if lead:
            atomic_write_text(cache / cc.REPORT_NAME, json.dumps(report, indent=1) + "\n")
    provider = cc.CachedQWeights(cache, plan.recipe.spec, plan.source.config["num_hidden_layers"])
    result = stream.run(plan, out, device, progress and lead, quantized=provider, extra_report={"gptq": report},
                        world=world, calibration=calibration)  # returns on every rank after rank 0 finished the checkpoint
    if lead:
        for p in cache.iterdir():  # the integers now live in the checkpoint; keep identity and report
            if p.name not in (cc.IDENTITY_NAME, cc.REPORT_NAME) and p.is_file():
                p.unlink()
    return result


def run_gptq_from_text(plan: Plan, out: str | Path, settings: CalibrationSettings, device: str = "cpu",
                       progress: bool = True, world=None) -> dict:
    """`run_gptq` with the calibration set drawn from `settings.calibration` (calibration/data.py)."""
    from glmq.calibration.data import calibration_tokens

    check_seq_len(plan, settings.seq_len)  # before the text is tokenized
    check_transformers_config(plan.source.root, plan.source.config)
    if Path(out).is_dir() and (world is None or world.is_lead):
        # a folder another glmq process writes into is refused before the text is tokenized (seconds to minutes),
        # not after; the run takes the lock for good later (`run_gptq`)
        with OutputLock(Path(out)) as probe:
            probe.acquire()
    if world is not None:  # every rank reads the text itself
        from glmq.calibration.data import check_every_rank_reads

        check_every_rank_reads(settings.calibration)
    tokens = calibration_tokens(plan.source.root, settings.calibration, settings.samples, settings.seq_len,
                                settings.seed, trust_remote_code=settings.trust_remote_code)
    return run_gptq(plan, out, tokens, settings, device, progress, world)


def check_seq_len(plan: Plan, seq_len: int) -> None:
    """Calibration windows longer than the model's `max_position_embeddings` would calibrate on positions it does
    not serve (vLLM and SGLang refuse longer prompts): a CalibrationDataError (a ValueError) naming the limit."""
    from glmq.calibration.data import CalibrationDataError

    limit = plan.source.config.get("max_position_embeddings")
    if limit and seq_len > limit:
        raise CalibrationDataError(f"{plan.source.root}: --seq-len {seq_len} is longer than the model's "
                                   f"max_position_embeddings ({limit}); use --seq-len {limit} or less")


def targets_by_layer(plan: Plan) -> dict[int, list[Target]]:
    """QUANTIZE items of the decoder layers (not the MTP layer), per layer index."""
    n = plan.source.config["num_hidden_layers"]
    out: dict[int, list[Target]] = {i: [] for i in range(n)}
    for it in plan.items:
        i = layer_index(it.name)
        if it.action is Action.QUANTIZE and i is not None and i < n:
            out[i].append(make_target(it.module, i))
    return out


# ----------------------------------------------------------------------------------------- the loop
STATE_PREFIXES = ("hidden-", "carry-", "embeddings", "reference-")  # files of hidden states
STATE_SUFFIXES = (".bin", ".tmp", cc.DIGEST_SUFFIX, TMP_SUFFIX)  # ... saved, being written, checksums, being renamed
OWNER_NAME = "glmq-owner.json"  # in an offload folder: whose states these are (`_Run.claim_offload`)
OFFLOAD_RECORD = "offload.json"  # in the cache folder: the offload folder this output's run keeps states in


def _state_files(folder: Path) -> list[Path]:
    """The hidden-state files in `folder`: saved, being written, their checksums, being renamed."""
    return [p for p in folder.iterdir() if p.name.startswith(STATE_PREFIXES) and p.name.endswith(STATE_SUFFIXES)]


def _owner(folder: Path) -> dict | None:
    """An offload folder's owner record (`OWNER_NAME`, `_Run.claim_offload`), or None where none is readable."""
    try:
        got = json.loads((folder / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def offload_dir(base: str | Path, cache: Path) -> Path:
    """The folder under `--offload-activations BASE` for the run writing `cache`'s output folder: named by that
    folder's name and a digest of its absolute path, so that runs writing to different folders never share one."""
    out = cache.parent.resolve()
    return Path(base) / f"glmq-{out.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:12]}"


class _Run:
    """State of one calibration: builder, stores, cache folder, progress."""

    def __init__(self, plan: Plan, cache: Path, tokens: torch.Tensor, settings: CalibrationSettings,
                 device: str, progress: bool, world=None):
        self.plan, self.cache, self.tokens, self.s, self.world = plan, cache, tokens, settings, world
        self.spec = plan.recipe.spec
        self.device = torch.device(device)
        self.gptq_batch = settings.gptq_batch or GPTQ_BATCH.get(self.device.type, GPTQ_BATCH["cuda"])
        self.dtype = cc.dtype_of(settings.dtype)
        self.builder = LayerBuilder(plan.source, self.device, self.dtype)
        self.n_layers = plan.source.config["num_hidden_layers"]
        self.targets = targets_by_layer(plan)
        self.on_disk = settings.activations == "disk"
        self.offload = offload_dir(settings.offload_activations, cache) if settings.offload_activations else None
        self.act_dir = self.offload or cache
        if world is not None:  # every rank keeps its own copy of the hidden states
            self.act_dir = self.act_dir / f"rank-{world.rank:05d}"
        self.act_dir.mkdir(parents=True, exist_ok=True)
        self.forget_old_offload()
        if self.offload is not None:
            self.claim_offload()
        self.progress = progress
        self.bar = None
        self.offsets: dict[str, torch.Tensor] = {}  # module -> rounding offsets of the layer being tuned (tune.py)
        # (layer index, its input hidden states and carry in the unquantized model): tune_reference "source" (tune.py)
        self.source_stream: tuple | None = None

    # -- hidden states
    def claim_offload(self) -> None:
        """Mark this rank's offload folder as this run's (`OWNER_NAME`: the output folder and a digest of the
        calibration identity), first deleting states that another run, or a run with other settings, left there:
        a resumed run must never take them for its own layer input."""
        ident = self.cache / cc.IDENTITY_NAME
        owner = {"output": str(self.cache.parent.resolve()),
                 "identity_sha256": hashlib.sha256(ident.read_bytes()).hexdigest() if ident.exists() else None}
        old = _owner(self.act_dir)
        if old != owner:
            if _state_files(self.act_dir):
                log.warning("%s: hidden states of another run (%s); deleting them", self.act_dir,
                            (old or {}).get("output", "unknown owner"))
                self.drop_states()  # .bin and .tmp alike
            atomic_write_text(self.act_dir / OWNER_NAME, json.dumps(owner, indent=1) + "\n")

    def forget_old_offload(self) -> None:
        """Delete this output's hidden states that this run will never read: those an earlier run left in another
        layout, i.e. in the offload folder it used when this run keeps them elsewhere (another --offload-activations,
        or none), or in the folders of another number of processes (a single process keeps them in its folder, rank R
        of a distributed run in `rank-R` under it). A resumed run reads only its own folder, and the end of a run
        removes only its own folder's states, so these stayed for good (GLM-5: ~0.8 GB a layer input and rank). Then
        record this run's offload folder (`OFFLOAD_RECORD`). In a distributed run rank 0 deletes, and only folders
        no rank of this run uses."""
        record = self.cache / OFFLOAD_RECORD
        try:
            old = Path(json.loads(record.read_text())["dir"])
        except (OSError, ValueError, KeyError, TypeError):
            old = None
        if self.world is None or self.world.rank == 0:
            bases = [self.cache] + ([self.offload] if self.offload is not None else [])
            bases += [old] if old is not None and old not in [b.resolve() for b in bases] else []
            for base in bases:
                self._drop_stale_states(base, own=base == self.cache)
        if self.world is not None:  # every rank has read the old record before rank 0 replaces it
            self.world.barrier("reading the offload record")
        if self.world is None or self.world.rank == 0:
            if self.offload is None:
                record.unlink(missing_ok=True)
            else:
                atomic_write_text(record, json.dumps({"dir": str(self.offload.resolve())}) + "\n")

    def _drop_stale_states(self, base: Path, own: bool) -> None:
        """The state folders under `base` (itself, and `rank-*` in it) that no rank of this run uses: their states
        deleted, with their owner file and the folder where it empties (never the cache folder itself). `own`: the
        output's cache, whose states are this output's; elsewhere only folders whose owner file names this output."""
        if not base.is_dir():
            return
        this = self.offload if self.offload is not None else self.cache
        in_use = set()
        if base == this:
            in_use = {base} if self.world is None else {base / f"rank-{r:05d}" for r in range(self.world.size)}
        output = str(self.cache.parent.resolve())
        for d in [base, *sorted(p for p in base.glob("rank-*") if p.is_dir())]:
            if d in in_use:
                continue
            if not own and (_owner(d) or {}).get("output") != output:
                continue  # another output's (or nobody's): not ours to delete
            states = _state_files(d)
            if states:
                log.warning("%s: hidden states of this output's earlier run (%s), which this run never reads "
                            "(it keeps them in %s): deleting them", d, "another --offload-activations or none"
                            if base != this else "another number of processes", self.act_dir)
            for f in states:
                f.unlink(missing_ok=True)
            if not own:
                (d / OWNER_NAME).unlink(missing_ok=True)
            for folder in (d, base):
                if folder != self.cache and folder not in in_use:
                    try:
                        folder.rmdir()
                    except OSError:  # not empty (in use, or files not glmq's) or already gone
                        pass

    def hidden_path(self, i: int, kind: str = "hidden") -> Path:
        return self.act_dir / f"{kind}-{i:05d}.bin"

    def embeddings(self, name: str = "embeddings") -> cc.Activations:
        s, t = self.tokens.shape
        shape = (s, t, self.builder.config.hidden_size)
        if not self.on_disk:
            return cc.Activations.in_memory(self.builder.embed(self.tokens))
        store = cc.Activations.new_file(self.act_dir / f"{name}.tmp", shape, self.dtype)
        for b0 in range(0, s, self.s.batch_size):
            store.write(b0, self.builder.embed(self.tokens[b0:b0 + self.s.batch_size]))
        return store

    def forward(self, layer, src: cc.Activations, carry: cc.Activations | None, dst: cc.Activations | None,
                carry_dst: list | None = None, index: int = 0, trim: bool = False, carry_kind: str = "carry") -> float:
        """Run every batch of `src` through `layer`; write outputs to `dst` (None: discard). Returns tokens/s.

        A layer's second output (GLM-5's top-k selection) is fed to it as `HFLayer.carry` and, when
        `carry_dst` is a list, stored in a new store appended to it (a file named by `carry_kind`). `trim`: hand the heap's free pages
        back after every batch (`stream.release_free_memory`).
        """
        t0, s = time.perf_counter(), src.shape[0]
        name = self.builder.spec.carry
        with torch.no_grad():
            for b0 in range(0, s, self.s.batch_size):
                b1 = min(b0 + self.s.batch_size, s)
                x = src.read(b0, b1).to(self.device)
                kw = self.builder.layer_kwargs(x)
                if name:
                    kw[name] = None if carry is None else carry.read(b0, b1).to(self.device)
                y = layer(x, **kw)
                if isinstance(y, tuple):
                    y, extra = y
                    if carry_dst is not None:
                        if not carry_dst:
                            carry_dst.append(self._carry_store(extra, s, index, carry_kind))
                        carry_dst[0].write(b0, extra)
                if dst is not None:
                    dst.write(b0, y)
                del x, y, kw
                if trim:
                    stream.release_free_memory()
        return src.shape[0] * src.shape[1] / max(time.perf_counter() - t0, 1e-9)

    def _carry_store(self, extra: torch.Tensor, s: int, i: int, kind: str = "carry") -> cc.Activations:
        return self.new_store(self.hidden_path(i, kind), (s, *extra.shape[1:]), extra.dtype)

    def new_store(self, path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> cc.Activations:
        """An empty store of states: a file at `path` with the `.tmp` suffix (activations on disk), or a tensor."""
        if not self.on_disk:
            return cc.Activations.in_memory(torch.empty(shape, dtype=dtype))
        return cc.Activations.new_file(path.with_suffix(".tmp"), shape, dtype)

    def drop_states(self, keep: tuple[str, ...] = ()) -> None:
        """Delete saved/temporary hidden states and their checksums other than `keep` (file names) and theirs."""
        for p in _state_files(self.act_dir):
            if p.name.removesuffix(cc.DIGEST_SUFFIX) not in keep:
                p.unlink(missing_ok=True)

    def drop_partial_states(self) -> None:
        """Delete the hidden states being written (`*.tmp`: of no use to a resumed run, which starts from the
        newest complete `hidden-*.bin`, kept, or regenerates its input from the layer files)."""
        for p in self.act_dir.glob("*.tmp"):
            if p.name.startswith(STATE_PREFIXES):
                p.unlink(missing_ok=True)

    def output_store(self, src: cc.Activations, i: int) -> cc.Activations:
        if not self.on_disk:
            return src  # in place, batch by batch: one copy in memory
        return self.new_store(self.hidden_path(i), src.shape, src.dtype)

    # -- one layer
    def quantized_layer(self, i: int, state: dict, qweights: dict[str, QWeight]):
        """Layer i with every target replaced by its dequantized integers (what the checkpoint holds)."""
        state = dict(state)
        self.put_quantized(i, state, qweights)
        return self.builder.build(i, state, chunked_experts=True)

    def put_quantized(self, i: int, state: dict, qweights: dict[str, QWeight]) -> None:
        """Replace in `state` (in place) the weights of `qweights`' modules by their dequantized integers."""
        prefix = f"model.layers.{i}."
        for module, qw in qweights.items():
            name = module[len(prefix):] + ".weight"
            w = state[name]  # dequantized where the layer lives: on a GPU the host holds only the integers
            qw = QWeight(qw.q.to(w.device), qw.scale.to(w.device),
                         None if qw.zero_point is None else qw.zero_point.to(w.device))
            state[name] = dequantize(qw, self.spec.group_size).to(w.dtype)

    def layer(self, i: int, src: cc.Activations, carry: cc.Activations | None):
        """Calibrate, quantize and forward layer i; returns its output stores (hidden, carry)."""
        t0 = time.perf_counter()
        targets = self.targets[i]
        state = self.builder.tensors.layer_state(i)
        meta = {"layer": i, "targets": {}}
        stages = sequential_stages(targets) if self.s.sequential else [targets] if targets else []
        metas, packed = [], {}
        # built by quantize_layer, which drops it after its last calibration pass, before the solves;
        # in a later stage, `state` holds the earlier stages' targets dequantized (put_quantized); a closure, not a
        # default argument, so that `del state` below frees the dict (the linter takes the emptied cell for a bug)
        build = lambda as_stored: self.builder.build(i, state, as_stored)  # noqa: E731, F821
        fp_state = dict(state) if self.spec.tune_iters else None  # the stages replace entries, not tensors
        for stage in stages:
            mine = stage if self.world is None else self.share(stage, state)
            qw, m = quantize_layer(self, i, build, state, mine, src, carry)
            if self.world is not None:
                qw, m = self.merge(i, qw, m)
            if stage is not stages[-1]:  # the next stage's pass sees it quantized (quantized_layer does the last)
                self.put_quantized(i, state, qw)
            packed.update(cc.packed(qw, self.spec))  # what the layer file holds: the integers 8 to an int32
            metas.append(m)
            del qw
        if metas:
            meta = merge_stage_metas(metas)
        if fp_state is not None and packed:
            packed, meta["tune"] = self.tune(i, fp_state, packed, src, carry)
        stream.release_free_memory()  # what the solves left behind, before the forward's activations
        qlayer = self.quantized_layer(i, state, cc.PackedQWeights(packed, self.spec))
        del state
        stream.release_free_memory()  # the dequantized integers and fusing copies, before the forward's activations
        dst, carry_dst = self.output_store(src, i), []
        # trimmed after every batch: the experts' per-batch temporaries (their sizes vary with the routing)
        # left ~0.25 GB of free heap pages resident over the 8 batches of the scaling model's forward
        meta["forward_tokens_per_s"] = round(self.forward(qlayer, src, carry, dst, carry_dst, i, trim=True), 1)
        del qlayer
        stream.release_free_memory()
        dst.save(self.hidden_path(i))
        meta["hidden"] = dst.describe()
        if carry_dst:
            carry_dst[0].save(self.hidden_path(i, "carry"))
            meta["carry"] = carry_dst[0].describe()
        meta["seconds"] = round(time.perf_counter() - t0, 3)
        meta["peak_rss_bytes"] = stream.peak_rss_bytes()
        meta["threads"] = torch.get_num_threads()  # CPU sums are thread-count dependent (`_warn_thread_change`)
        if self.world is None or self.world.is_lead:
            cc.save_layer(self.cache, i, packed, meta)
        self.drop_states(keep=(self.hidden_path(i).name, self.hidden_path(i, "carry").name)  # only the newest
                         + tuple(a.path.name for a in (self.source_stream or ())[1:] if a is not None and a.path is not None))
        return dst, (carry_dst[0] if carry_dst else None)

    def tune(self, i: int, fp_state: dict, packed: dict, src, carry) -> tuple[dict, dict]:
        """Layer i's GPTQ result tuned on the layer's output error (tune.py): the packed tensors to keep and the
        report entry."""
        from glmq.calibration.tune import tune_layer

        offsets, self.offsets = self.offsets, {}
        tuned, tmeta = tune_layer(self, i, fp_state, cc.PackedQWeights(packed, self.spec), offsets, src, carry)
        return {**packed, **cc.packed(tuned, self.spec)}, tmeta  # the targets not tuned keep their packed tensors

    # -- several ranks
    def share(self, targets: list[Target], state: dict) -> list[Target]:
        """This rank's targets of a layer, balanced by weight size, in their original order.

        On a GPU with one Hessian pass (no `experts_per_pass`) the units shared are whole GPTQ batches,
        exactly as one process forms them (`gptq_batches`): every problem is then solved in a batch of
        the same size and make-up as in a single process. cuBLAS and cuSOLVER may pick another kernel
        for another batch count, so this is what keeps a GPU run byte-identical across rank counts; the
        balance granularity is one batch (GLM-5: 32 expert batches of 16, 4 per rank on 8 GPUs). On CPU
        the batched kernels loop over the batch (the same bits for any batch size, which
        tests/test_distributed.py checks), so the units are single experts and plain Linears, the finer
        balance that a few experts need. With several passes each rank forms its own passes, so the
        units are single experts on a GPU too (identical bits then not guaranteed there).
        """
        if self.device.type != "cpu" and self.s.experts_per_pass is None:
            units = [[t for g in batch for t in g] for batch in gptq_batches(targets, state, self.gptq_batch)]
        else:
            by: dict[object, list[Target]] = {}
            for t in targets:
                by.setdefault(("expert", t.expert) if t.expert is not None else t.module, []).append(t)
            units = list(by.values())
        cost = [sum(state[t.local + ".weight"].numel() for t in u) for u in units]
        keep = {t for j in self.world.mine(range(len(units)), cost) for t in units[j]}
        return [t for t in targets if t in keep]

    def merge(self, i: int, qweights: dict[str, QWeight], meta: dict) -> tuple[dict[str, QWeight], dict]:
        """Every rank's part of layer i -> the whole layer on every rank, through the cache folder.

        Each rank writes its part; once all are written every rank reads them all (the integers the
        layer file will hold, bit for bit); rank 0 merges the diagnostics and, after the next layer
        file is written, the parts go (a resume redoes a layer whose file is missing).
        """
        w = self.world
        cc.save_layer(self.cache, i, cc.packed(qweights, self.spec), meta, part=w.rank)
        metas = w.gather(meta, f"layer {i}: gathering the ranks' diagnostics")
        w.barrier(f"layer {i}: waiting for every rank's part")
        whole: dict[str, QWeight] = {}
        for r in range(w.size):
            whole.update(cc.load_qweights(self.cache, i, self.spec, part=r))
        w.barrier(f"layer {i}: reading the parts")
        if w.is_lead:
            cc.drop_parts(self.cache, i)
        return whole, (merge_metas(metas) if w.is_lead else meta)

    def resume_input(self, start: int) -> tuple[cc.Activations, cc.Activations | None]:
        """The input of layer `start`: saved states if present, else regenerated from the layer files."""
        if start > 0:
            meta = cc.layer_meta(self.cache, start - 1)
            h = cc.Activations.load(self.hidden_path(start - 1), tuple(meta["hidden"]["shape"]),
                                    cc.dtype_of(meta["hidden"]["dtype"]), not self.on_disk)
            c = None
            if "carry" in meta:
                c = cc.Activations.load(self.hidden_path(start - 1, "carry"), tuple(meta["carry"]["shape"]),
                                        cc.dtype_of(meta["carry"]["dtype"]), not self.on_disk)
            if h is not None and (c is not None or "carry" not in meta):
                log.info("resuming at layer %d from saved hidden states", start)
                return h, c
        src, carry = self.embeddings(), None
        for j in range(start):  # regenerate: forward the finished layers from their integers
            log.info("resuming: regenerating the input of layer %d with quantized layer %d", start, j)
            qlayer = self.quantized_layer(j, self.builder.tensors.layer_state(j),
                                          cc.load_qweights(self.cache, j, self.spec))
            dst, carry_dst = self.output_store(src, j), []
            self.forward(qlayer, src, carry, dst, carry_dst, j)
            if self.on_disk:
                dst.save(self.hidden_path(j))
            src, carry = dst, (carry_dst[0] if carry_dst else None)
        return src, carry


def _united(metas: list[dict]) -> dict:
    """The first of a layer's partial diagnostics with every part's targets, and the expert counts of the first
    part that has them (a part that collected routed experts; the counts are the same in every such part)."""
    out = dict(metas[0])
    out["targets"] = {k: v for m in metas for k, v in m["targets"].items()}
    for m in metas:
        if "tokens_per_expert" in m:
            out["tokens_per_expert"], out["under_covered"] = m["tokens_per_expert"], m["under_covered"]
            break
    # from a part that took all-token down Hessians: in a true-sequential layer the down stage, not gate/up's
    out["all_token_hessian_tokens"] = next((m["all_token_hessian_tokens"] for m in metas
                                            if m.get("all_token_hessian_tokens")), None)
    return out


def merge_metas(metas: list[dict]) -> dict:
    """One layer's diagnostics from the ranks' parts: targets united, expert counts (the same on every
    rank) from a rank that saw experts, solve time the slowest rank's."""
    out = _united(metas)
    out["gptq_seconds"] = max(m.get("gptq_seconds", 0.0) for m in metas)
    out["ranks"] = len(metas)
    return out


def merge_stage_metas(metas: list[dict]) -> dict:
    """One layer's diagnostics from its sequential stages (one stage: that stage's): targets united, expert
    counts from the first stage that routed tokens to experts, times summed, tokens/s averaged."""
    if len(metas) == 1:
        return metas[0]
    out = _united(metas)
    tps = [m["calibration_tokens_per_s"] for m in metas if m.get("calibration_tokens_per_s")]
    out["calibration_tokens_per_s"] = round(statistics.fmean(tps), 1) if tps else None
    out["gptq_seconds"] = round(sum(m.get("gptq_seconds") or 0.0 for m in metas), 3)
    phases: dict[str, float] = {}
    for m in metas:
        for k, v in (m.get("gptq_phase_seconds") or {}).items():
            phases[k] = round(phases.get(k, 0.0) + v, 3)
    out["gptq_phase_seconds"] = phases
    out["sequential_stages"] = [sorted({t.rsplit(".", 1)[-1] for t in m["targets"]}) for m in metas]
    return out


def _warn_thread_change(metas: list[dict | None], cache: Path) -> None:
    """Warn when a CPU run resumes with another thread count than the finished layers were calibrated with: CPU
    matmuls sum in a thread-dependent order, so the output is then byte-identical to an uninterrupted run with
    neither count (a valid GPTQ result all the same)."""
    before = sorted({m.get("threads") for m in metas if m and isinstance(m.get("threads"), int)})
    now = torch.get_num_threads()
    if before and before != [now]:
        log.warning("%s: the finished layers were calibrated with %s thread(s), this run uses %d: CPU sums depend on "
                    "the thread count, so the output will not be byte-identical to an uninterrupted run (set "
                    "OMP_NUM_THREADS=%d to match them)", cache, "/".join(map(str, before)), now, before[-1])


def calibrate(plan: Plan, cache: Path, tokens: torch.Tensor, settings: CalibrationSettings,
              device: str = "cpu", progress: bool = True, world=None) -> dict:
    """Steps 1-4 of the module docstring for every decoder layer not yet in `cache`; returns the report."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    run = _Run(plan, cache, tokens, settings, device, progress, world)
    done = [cc.layer_meta(cache, i) is not None for i in range(run.n_layers)]
    start = done.index(False) if False in done else run.n_layers
    if world is not None:  # rank 0's view, taken before any rank starts (a fast rank 0 may finish a layer
        start = world.broadcast(start, "finding the first layer to calibrate")  # before rank 1 looks)
    if 0 < start < run.n_layers and run.device.type == "cpu":
        _warn_thread_change([cc.layer_meta(cache, i) for i in range(start)], cache)
    if start < run.n_layers:
        run.bar = tqdm(total=sum(len(run.targets[i]) for i in range(start, run.n_layers)), unit="tensor",
                       desc="glmq gptq", disable=not progress, dynamic_ncols=True)
        try:
            src, carry = run.resume_input(start)
            for i in range(start, run.n_layers):
                run.bar.set_description(f"GPTQ layer {i} ({i + 1}/{run.n_layers})")  # numbered as the report does
                src, carry = run.layer(i, src, carry)
        except BaseException:
            run.drop_partial_states()
            raise
        run.bar.close()
        del src, carry
    run.drop_states()  # every decoder layer is done: no hidden states are needed any more
    if run.offload is not None:
        (run.act_dir / OWNER_NAME).unlink(missing_ok=True)
    if world is None or world.rank == 0:
        (cache / OFFLOAD_RECORD).unlink(missing_ok=True)
    for d in (run.act_dir, run.offload):  # this rank's folder, then (the last rank to leave) the offload one
        if d is not None and d != cache:
            try:
                d.rmdir()
            except OSError:  # not empty (another rank's states) or already gone
                pass
    ranks = [{"rank": 0, **stream.peak_memory()}]
    if world is not None:  # rank 0 writes each layer file after the layer's forward: wait for the last one
        world.barrier("writing the last layer file")
        ranks = world.gather({"rank": world.rank, **stream.peak_memory()}, "gathering the ranks' peak memory")
    metas = [cc.layer_meta(cache, i) for i in range(run.n_layers)]
    report = summarize(plan, metas, settings, tokens, resumed_from=start, seconds=time.perf_counter() - t0)
    report["ranks"] = ranks  # None on ranks other than 0, which do not write the report
    return report
