"""`torchrun -m glmq quantize` (2 gloo ranks) writes the same bytes as one process, and resumes after a rank dies.

Each torchrun launch costs a few seconds of imports per process, so the launches are few: one clean
2-rank run, one 2-rank run whose rank 1 fails mid-run, and one 2-rank rerun of it; a 1-process rerun
of a copy of the failed folder checks that a different world size resumes too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glmq import recipes
from glmq.calibration.engine import GPTQ_BATCH
from glmq.formats.manifest import FRAGMENT_GLOB, MANIFEST_NAME, REPORT_NAME, Manifest, fragment_name
from glmq.formats.source import open_source
from glmq.quantize import dist, stream
from glmq.quantize.plan import make_plan

SHARD = 300_000  # output shard limit: 24 output files from the tiny checkpoint's 7 source shards

# One rank of the CLI under torchrun whose StreamingWriter raises after a given number of tensor
# writes on rank 1 only (the hook of tests/test_resume.py, raising so that glmq reports it).
_FAILING_RANK = r"""
import os, sys
from glmq.formats import safetensors_io
limit, calls = int(sys.argv[1]), [0]
orig = safetensors_io.StreamingWriter.write
def write(self, name, t):
    calls[0] += 1
    if calls[0] > limit:
        raise OSError("injected write failure")
    return orig(self, name, t)
if os.environ["RANK"] == "1":
    safetensors_io.StreamingWriter.write = write
from glmq.scripts.cli import main
sys.argv = ["glmq", "quantize", "--model", sys.argv[2], "--output", sys.argv[3], "--max-shard-size", "300KB", "--no-progress"]
main()
"""


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    # --standalone: a free local rendezvous port, so concurrent test runs on one machine do not collide
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _quantize_args(src: Path, out: Path) -> list[str]:
    return ["-m", "glmq", "quantize", "--model", str(src), "--output", str(out), "--max-shard-size", "300KB",
            "--no-progress"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != REPORT_NAME}


@pytest.fixture(scope="module")
def reference(make_ckpt, tmp_path_factory):
    src = make_ckpt("glm_moe_dsa", "fp8-block")
    plan = make_plan(open_source(src), recipes.load("int4-w4a16"), SHARD)
    ref = tmp_path_factory.mktemp("dist-ref") / "ref"
    stream.run(plan, ref, progress=False)
    return src, plan, ref


# ----------------------------------------------------------------------------------------- pure parts
def test_share_is_a_deterministic_balanced_partition():
    weights = [7, 3, 3, 9, 1, 0, 5, 5, 2]
    parts = dist.share(weights, 3)
    assert parts == dist.share(list(weights), 3)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(weights[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(weights)  # LPT: no rank exceeds another by more than one job
    assert dist.share(weights, 1) == [list(range(len(weights)))]
    assert dist.share([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        dist.share(weights, 0)


# One process as a 1-rank gloo job: after `shutdown` no reference to a process group may be left, though the
# World stays (the CLI and the calibration engine keep theirs). A group still referenced after
# destroy_process_group is torn down at interpreter exit, where gloo's threads abort the process (SIGABRT,
# "terminate called without an active exception": the CI flake of the GPTQ resume test below).
_SHUTDOWN = r"""
import gc, os, socket, weakref
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from glmq.quantize import dist
world = dist.init("cpu")
assert world.gather("x", "a step") == ["x"]
refs = [weakref.ref(world.group), weakref.ref(world.cpu_group)]
dist.shutdown()
gc.collect()
assert world.group is None and world.cpu_group is None, (world.group, world.cpu_group)
assert [r() for r in refs] == [None, None], "a process group outlived shutdown"
print("ok", world.rank, world.is_lead)
"""


def test_shutdown_leaves_no_process_group_alive():
    r = subprocess.run([sys.executable, "-c", _SHUTDOWN], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok 0 True", r.stderr[-3000:]


def test_fragment_of_another_run_is_refused(tmp_path):
    Manifest({"a": 1}).save(tmp_path)
    Manifest({"a": 2}, {"x.safetensors": {}}).save(tmp_path, fragment_name(1))
    with pytest.raises(ValueError, match="different glmq run"):
        Manifest.load(tmp_path).absorb_fragments(tmp_path)


def test_single_process_run_leaves_torch_distributed_alone(reference):
    import torch.distributed

    _, _, ref = reference
    assert not torch.distributed.is_initialized()
    assert not list(ref.glob(FRAGMENT_GLOB))
    rep = json.loads((ref / REPORT_NAME).read_text())
    assert rep["world_size"] == 1 and rep["ranks"][0]["files_written"] == rep["files"]


# ----------------------------------------------------------------------------------------- torchrun
def test_two_gloo_ranks_write_the_single_process_bytes(reference, tmp_path):
    src, plan, ref = reference
    out = tmp_path / "out"
    r = _torchrun(*_quantize_args(src, out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref)  # every shard, the index, config.json, side files and the manifest
    assert r.stdout.count("wrote ") == 1, "only rank 0 prints the summary"
    rep = json.loads((out / REPORT_NAME).read_text())
    assert rep["world_size"] == 2 and [row["rank"] for row in rep["ranks"]] == [0, 1]
    assert all(row["files_written"] > 0 for row in rep["ranks"]), "a rank had no work: use more source shards"
    assert sum(row["files_written"] for row in rep["ranks"]) == len(plan.files)
    # the headline peak is rank 0's own: the job's largest is beside it, and on the summary line
    assert rep["peak_rss_bytes_largest_rank"] == max(row["peak_rss_bytes"] for row in rep["ranks"]) > 0
    assert "(rank 0; the largest rank's " in r.stdout
    assert "peak_rss_bytes_largest_rank" not in json.loads((ref / REPORT_NAME).read_text())  # one process: none


# One rank of the CLI that keeps a reference to its process group past `dist.shutdown` (as a traceback or a library
# could), and holds an object whose __del__ marks the interpreter's finalization in a file per rank.
_LEAKING_RANK = r"""
import os, sys
import torch.distributed as d
from glmq.quantize import dist
class Witness:
    def __init__(self, path):
        self.path, self.open = path, open
    def __del__(self):  # only the interpreter's finalization deletes it
        with self.open(self.path, "w") as f:
            f.write("finalized")
witness = Witness(os.path.join(sys.argv[1], "finalized-" + os.environ["RANK"]))
init, kept = dist.init, []
def init_keeping_the_group(*a, **k):
    world = init(*a, **k)
    kept.append(d.group.WORLD)
    return world
dist.init = init_keeping_the_group
from glmq.scripts.cli import main
sys.argv = ["glmq", "quantize", *sys.argv[2:]]
main()
"""


def test_ranks_leave_without_the_interpreter_teardown_that_gloo_can_abort(reference, tmp_path):
    """A gloo group still referenced at interpreter exit is destroyed in its finalization, where gloo's threads can
    abort the process (SIGABRT) after the conversion is complete: torchrun then reported a finished run failed (the
    CI flake of the GPTQ resume test below). `dist.leave` ends every rank before that teardown, whatever holds a
    group, with the command's exit status."""
    src, _, ref = reference
    out = tmp_path / "out"
    marks = tmp_path / "marks"
    marks.mkdir()
    r = _torchrun("--no-python", sys.executable, "-c", _LEAKING_RANK, str(marks), *_quantize_args(src, out)[3:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _files(out) == _files(ref) and r.stdout.count("wrote ") == 1
    assert not list(marks.iterdir()), "a rank ran the interpreter's finalization"
    bad = tmp_path / "bad"  # a usage error: still click's message and exit status 2 (the first rank's: torchrun stops
    # the other)
    r = _torchrun("--no-python", sys.executable, "-c", _LEAKING_RANK, str(marks), "--model", str(src), "--output",
                  str(bad), "--samples", "4")
    assert r.returncode != 0 and "Error: --samples: GPTQ option(s)" in r.stderr, r.stderr[-3000:]
    assert "exitcode: 2" in r.stderr and not list(marks.iterdir()), r.stderr[-3000:]


def test_failed_rank_stops_the_job_and_any_world_size_resumes(reference, tmp_path):
    src, plan, ref = reference
    out = tmp_path / "out"
    mine = dist.share([stream.file_cost(f) for f in plan.files], 2)[1]
    writes_rank1 = sum(len(it.outputs) for i in mine for it in plan.files[i].items)
    child = tmp_path / "failing_rank.py"
    child.write_text(_FAILING_RANK)

    r = _torchrun(str(child), str(writes_rank1 // 2), str(src), str(out))
    assert r.returncode != 0
    assert "glmq: rank 1 failed on model-" in r.stderr and "injected write failure" in r.stderr, r.stderr[-3000:]
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    finished = set(Manifest.load(out).files)
    for frag in out.glob(FRAGMENT_GLOB):
        finished |= set(Manifest.load(out, frag.name).files)
    assert 0 < len(finished) < len(plan.files), "the failure should leave some files done and some to do"
    one_rank = tmp_path / "one-rank"
    shutil.copytree(out, one_rank)

    r = _torchrun(*_quantize_args(src, out))  # the same 2-rank job again
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(finished)} resumed" in r.stdout
    assert _files(out) == _files(ref)

    rep = stream.run(plan, one_rank, progress=False)  # a 1-process rerun of the failed 2-rank run
    assert rep["files_skipped_resumed"] == len(finished)
    assert _files(one_rank) == _files(ref)
    assert (one_rank / MANIFEST_NAME).exists() and not list(one_rank.glob(FRAGMENT_GLOB))


def test_two_nodes_without_a_shared_output_folder_are_refused(reference, tmp_path):
    """Two "nodes" (one torchrun each, one rank each) whose --output is not one folder, as with each node's local disk:
    rank 1 converted its files into its own folder and rank 0 wrote the index and config.json over half the shards
    missing (exit 0). Now rank 1 stops at once, naming the folder, and rank 0 writes no config.json."""
    import socket

    src, plan, ref = reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [tmp_path / "node0", tmp_path / "node1"]
    outs[1].mkdir()  # exists on node 1, as a local folder of the same path would
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]  # files, not pipes: neither launch may block on a full pipe
    procs = []
    for n in (0, 1):
        with logs[n].open("w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                           str(n), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                           str(port), *_quantize_args(src, outs[n])], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
    assert [p.wait(timeout=300) for p in procs] != [0, 0]
    err = logs[1].read_text()
    assert "glmq: rank 1 failed on output folder" in err and "every rank must write into the same folder" in err, err[-3000:]
    assert not (outs[0] / "config.json").exists() and not (outs[0] / "model.safetensors.index.json").exists()


# ----------------------------------------------------------------------------------------- GPTQ
# One rank of a GPTQ job whose batched GPTQ solver kills rank 1 (os._exit, as a crash would) at its
# `limit`-th call: with 8 experts split over 2 ranks, each rank solves 2 * ceil(4 / GPTQ_BATCH["cpu"])
# batches (gate+up, down) per MoE layer, so one more dies inside the second MoE layer, after the first
# one's file is written.
_GPTQ_RANK = r"""
import os, sys
limit = int(sys.argv[1])
if limit and os.environ["RANK"] == "1":
    from glmq.calibration import layer_gptq
    orig, calls = layer_gptq.quantize_gptq_batch, [0]
    def dying(*a, **k):
        calls[0] += 1
        if calls[0] >= limit:
            os._exit(137)
        return orig(*a, **k)
    layer_gptq.quantize_gptq_batch = dying
from glmq.scripts.cli import main
sys.argv = ["glmq", "quantize", *sys.argv[2:]]
main()
"""


@pytest.fixture(scope="module")
def gptq_reference(make_ckpt, tmp_path_factory):
    """A GLM-5-layout checkpoint with a tokenizer and text, and the single-process GPTQ run (1 thread)."""
    from test_gptq_engine import calibration_source  # tests/ is on sys.path

    tmp = tmp_path_factory.mktemp("dist-gptq")
    words = ["expert", "router", "token", "layer", "group", "scale", "the", "of"]
    src, text = calibration_source(make_ckpt, tmp, " ".join(words[(i * 7) % 8] for i in range(1500)))
    ref = tmp / "ref"
    # each of the 2 ranks runs cores // 2 threads (dist._share_cpu_cores): the reference too, so that
    # every float sum of the calibration forward is computed the same way
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", _GPTQ_RANK, "0", *_gptq_args(src, ref, text)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return src, text, ref


def _gptq_args(src: Path, out: Path, text: Path) -> list[str]:
    return ["--model", str(src), "--output", str(out), "--scheme", "gptq", "--calibration", str(text), "--samples",
            "8", "--seq-len", "32", "--max-shard-size", "300KB", "--no-progress"]


def test_gptq_two_ranks_byte_identical_and_resume_after_a_rank_dies(gptq_reference, tmp_path):
    src, text, ref = gptq_reference
    out = tmp_path / "out"
    # on CPU the ranks share single experts: in layers 1 and 2 rank 1 solves its 4 experts' gate_up and down
    # problems in batches of GPTQ_BATCH["cpu"], so the call after layer 1's is in layer 2
    limit = 2 * math.ceil(4 / GPTQ_BATCH["cpu"]) + 1
    r = _torchrun("--no-python", sys.executable, "-c", _GPTQ_RANK, str(limit), *_gptq_args(src, out, text))
    assert r.returncode != 0 and not (out / "config.json").exists(), r.stderr[-3000:]
    cache = out / ".glmq-gptq"
    layers = [p.name for p in sorted(cache.glob("layer-*"))]
    assert layers == ["layer-00000.safetensors", "layer-00001.safetensors"], r.stderr[:3000]
    r = _torchrun("--no-python", sys.executable, "-c", _GPTQ_RANK, "0", *_gptq_args(src, out, text))
    assert r.returncode == 0, r.stderr[-3000:]
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != REPORT_NAME}
    assert files == {p.name: p.read_bytes() for p in sorted(ref.iterdir()) if p.is_file() and p.name != REPORT_NAME}
    rep = json.loads((out / REPORT_NAME).read_text())
    assert rep["world_size"] == 2 and rep["gptq"]["resumed_from_layer"] == 2 and len(rep["gptq"]["layers"]) == 3
    assert not list(cache.glob("part-*")) and not [p for p in cache.iterdir() if p.is_dir()]
