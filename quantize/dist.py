"""Rank/world plumbing for `torchrun --nproc-per-node N -m glmq quantize ...` (one or several nodes).

Every rank builds the same plan from headers, so work assignment needs no communication: `share`
splits a list of jobs by a deterministic greedy longest-processing-time balance on their cost (RTN:
an output file's bytes read plus written, `stream.file_cost`). Rank 0 checks the output folder and
broadcasts which files are already finished, so a restart with any world size redoes only the rest.
The process group carries only small Python objects (which files are finished, per-rank records
and timings, the final report); tensors and output files go through the file system, so the output
folder must be one that every rank sees (local disk on one node, a shared file system across nodes).

Backend: gloo on CPU; NCCL for `--device cuda`, where each rank uses `cuda:LOCAL_RANK`. Control-plane
collectives (barrier, broadcast, gather of objects) always go through a gloo group, so they never
touch a GPU stream and need no device bookkeeping; `World.group` is the backend group for tensors
(GPTQ).

Failure: a rank that raises reports `glmq: rank R failed on <what>: <error>` (the CLI prints the
`RankFailure` the engine raises) and exits non-zero. torchrun's elastic agent then SIGTERMs every other worker of the
job at once (checked with torch 2.13: a peer blocked in a gloo barrier or busy converting is
stopped within the agent's 0.1 s monitor interval), and no rank writes the index or config.json
because rank 0 writes them only after a gather that every rank must reach. Peers blocked in a gloo
collective also see "Connection closed by peer" at once.

Exit: `glmq quantize` under torchrun ends each rank with `leave` (os._exit after the atexit handlers), success or
failure, so that the interpreter's teardown, where a still-referenced gloo group can abort the process, never turns a
finished rank into a failed one.

This module imports `torch.distributed` only inside its functions, and the CLI calls them only when
torchrun set WORLD_SIZE > 1: single-process runs never initialise it.

For GPTQ (the calibration engine): `init` -> `World`; `World.mine(jobs, costs)` for this rank's
experts/linears of a layer; `World.group` for tensor collectives, `gather`/`broadcast`/`barrier` for
objects; `World.failure(where, e)` to name the rank and the job; then `stream.run(..., world=world)`
writes the checkpoint with the files split over the ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

# Every collective waits at most this long. It is not how failures are detected (see the module
# docstring: torchrun stops the job when a rank exits); it only ends a job whose rank hangs without
# exiting (e.g. a stuck network file system). It must exceed the longest legitimate wait: rank 0
# re-hashing every finished file on resume (~1 GB/s: ~7 min for GLM-5's 400 GB), or the peers of the
# rank converting the largest leftover job. gloo's default (30 min) would be enough for RTN; GPTQ
# layers can take longer, so the margin is generous.
DEFAULT_TIMEOUT = datetime.timedelta(hours=2)


class RankFailure(RuntimeError):
    """A rank's work failed; the message names the rank and the file or step."""

    def __init__(self, rank: int, where: str, error: BaseException | str):
        self.rank, self.where = rank, where
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"rank {rank} failed on {where}: {detail}")


def launched() -> bool:
    """True when this process is one rank of a multi-process job (torchrun sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def share(weights: Sequence[int], world_size: int) -> list[list[int]]:
    """Split jobs over ranks: greedy longest-processing-time on `weights` (e.g. bytes moved).

    Deterministic, so every rank computes the same split: jobs by decreasing weight (ties: lower
    index first) each go to the least-loaded rank (ties: lower rank). LPT's makespan is at most
    4/3 of the optimum (Graham 1969).

    Args:
        weights: cost of job i (>= 0).
        world_size: number of ranks (>= 1).
    Returns:
        for each rank, the indices of its jobs in increasing order (i.e. in plan order).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        loads[r] += weights[i]
        owned[r].append(i)
    return [sorted(o) for o in owned]


_CPU_GROUP: list = [None]  # the gloo group for objects (`init` sets it, `shutdown` drops it)


@dataclass(frozen=True)
class World:
    """This process's place in the job, and the collectives the engine needs.

    `device` is the torch device string the rank computes on ("cpu" or "cuda:LOCAL_RANK").
    """

    rank: int
    size: int
    local_rank: int
    device: str

    # The groups are looked up, not held: a World outlives `shutdown` (the CLI and the engine keep theirs), and a
    # gloo group still referenced after destroy_process_group is torn down at interpreter exit instead, where its
    # worker threads abort the process ("terminate called without an active exception": SIGABRT in 8 of 20 runs
    # of a two-rank gloo gather-then-exit script under torchrun, torch 2.13; in none of 100 once no reference was
    # left).
    @property
    def group(self) -> Any:
        """The backend group (gloo / NCCL) for tensors; None after `shutdown`."""
        import torch.distributed as d

        return d.group.WORLD if d.is_initialized() else None

    @property
    def cpu_group(self) -> Any:
        """The gloo group for objects and barriers; None after `shutdown`."""
        return _CPU_GROUP[0]

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def mine(self, items: Sequence, weights: Sequence[int]) -> list:
        """This rank's share of `items` (see `share`), in their original order."""
        return [items[i] for i in share(weights, self.size)[self.rank]]

    def failure(self, where: str, error: BaseException | str) -> RankFailure:
        return error if isinstance(error, RankFailure) else RankFailure(self.rank, where, error)

    def on_lead(self, step: str, fn: Callable[[], Any], share: bool = False) -> Any:
        """Run `fn` on rank 0 only while the other ranks wait (a failure there names rank 0 and `step`);
        with `share`, every rank returns rank 0's result, otherwise the others return None."""
        out = None
        if self.is_lead:
            try:
                out = fn()
            except Exception as e:
                raise self.failure(step, e) from e
        if share:
            return self.broadcast(out, step)
        self.barrier(step)
        return out

    def barrier(self, step: str) -> None:
        self._collective(step, lambda d: d.barrier(group=self.cpu_group))

    def broadcast(self, obj: Any, step: str, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank (pickled)."""
        box = [obj]
        self._collective(step, lambda d: d.broadcast_object_list(box, src=src, group=self.cpu_group))
        return box[0]

    def gather(self, obj: Any, step: str) -> list | None:
        """Every rank's `obj`, by rank, on rank 0; None on the others."""
        box = [None] * self.size if self.is_lead else None
        self._collective(step, lambda d: d.gather_object(obj, box, dst=0, group=self.cpu_group))
        return box

    def _collective(self, step: str, fn) -> None:
        import torch.distributed as d

        try:
            fn(d)
        except RuntimeError as e:  # gloo: "Connection closed by peer" when another rank died; or the timeout
            raise RankFailure(self.rank, step, f"another rank stopped or hung (its own message names it): {e}") from e


def init(device: str = "cpu", timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> World:
    """Join the torchrun job described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.

    Args:
        device: "cpu" (gloo) or "cuda" (NCCL; this rank uses cuda:LOCAL_RANK).
    Raises:
        RankFailure: not a torchrun environment, no such device, or the process group did not form.
    """
    import torch
    import torch.distributed as d

    rank = int(os.environ.get("RANK", "0"))
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RankFailure(rank, "start-up", f"not launched by torchrun ({', '.join(missing)} unset); run "
                                            f"`torchrun --nproc-per-node N -m glmq quantize ...`")
    size, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if torch.cuda.device_count() <= local:
            raise RankFailure(rank, "start-up", f"LOCAL_RANK {local} but {torch.cuda.device_count()} CUDA device(s) "
                                                f"are visible; use --nproc-per-node <= the GPU count, or --device cpu")
        torch.cuda.set_device(local)
        dev, backend = f"cuda:{local}", "nccl"
    elif device == "cpu":
        dev, backend = "cpu", "gloo"
    else:
        raise ValueError(f"unknown device {device!r}; use cpu or cuda")
    # on a GPU host too: the host side (reading, packing, hashing, CPU-side copies) needs threads
    _share_cpu_cores(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        d.init_process_group(backend, timeout=timeout, device_id=torch.device(dev) if backend == "nccl" else None)
        _CPU_GROUP[0] = d.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else d.group.WORLD
    except (RuntimeError, ValueError) as e:  # rendezvous timeout, NCCL start-up, a peer that died early
        raise RankFailure(rank, f"joining the {backend} process group of {size} ranks", e) from e
    return World(rank, size, local, dev)


def _share_cpu_cores(local_ranks: int) -> None:
    """Give each rank of this node its share of the cores for the torch and numba kernels.

    torchrun sets OMP_NUM_THREADS=1 per worker (one core per rank), while numba's pool defaults to every
    core in every rank (N ranks x all cores threads). Both are wrong for a conversion whose cost is those
    kernels: N ranks on C cores should run C/N threads each.
    """
    import torch

    from glmq.quantize import fused_cpu

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, cores // max(1, local_ranks))
    torch.set_num_threads(n)
    if fused_cpu.available():  # numba's count is per calling thread: the kernels run in this (main) thread
        fused_cpu.numba.set_num_threads(min(n, fused_cpu.numba.config.NUMBA_NUM_THREADS))


def shutdown() -> None:
    """Leave the job cleanly (only after success: a failed job is torn down by torchrun): the groups are destroyed
    here, with no reference to them left in this module or in any `World`."""
    import torch.distributed as d

    _CPU_GROUP[0] = None
    if d.is_initialized():
        d.destroy_process_group()


def leave(code: int = 0) -> NoReturn:
    """End this rank's process with exit status `code`: the atexit handlers, then `os._exit`, without the
    interpreter's finalization.

    For the CLI, once everything the rank wrote is closed. At finalization every object still alive is destroyed,
    and a gloo process group that something still references is torn down there by C++ destructors whose worker
    threads can abort the process (SIGABRT, "terminate called without an active exception") after the rank's work
    is complete: torchrun then reports a finished conversion as failed (pytorch/pytorch#190489; destroying the
    groups at exit is not in torch: PRs #157193 and #179291). `shutdown` leaves no reference of glmq's own, but a
    rank that fails has not called it, and references held elsewhere (a traceback, a library) cannot be ruled out.
    Nothing is lost: Python's buffered streams are flushed here, and every glmq output file is closed, so the kernel
    holds all that was written (no fsync happens at a normal exit either).
    """
    import atexit
    import sys

    try:
        atexit._run_exitfuncs()  # what a normal exit runs before finalization (logging's flush, child processes)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (the launcher gone): nothing more can reach it
                pass
        os._exit(code)


def run_rtn(plan, out: str | Path, device: str = "cpu", progress: bool = True) -> dict | None:
    """The distributed `glmq quantize` (RTN): join the job, convert this rank's files, leave.

    Returns:
        the run report on rank 0, None on the other ranks (only rank 0 prints).
    Raises:
        RankFailure: this rank's work failed (the message names the rank and the file).
    """
    from glmq.quantize import stream

    world = init(device)
    report = stream.run(plan, out, device=world.device, progress=progress and world.is_lead, world=world)
    shutdown()
    return report if world.is_lead else None
