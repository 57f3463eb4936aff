"""Review of the benchmark scripts: what they time and what they refuse (behaviour only, never timing)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from glmq.formats import fixtures
from glmq.scripts import bench_dist, bench_gptq_solver, bench_rtn, bench_validate


@pytest.mark.parametrize("script", [bench_rtn, bench_dist])
def test_reused_source_with_other_options_is_refused(tmp_path, monkeypatch, script):
    """A checkpoint left under --work by a run with other --layers/--experts was benchmarked silently (and
    bench_dist reported this run's --layers/--experts for it)."""
    src = tmp_path / "src-fp8"
    fixtures.make_checkpoint(src, "glm_moe_dsa", preset="tiny")
    monkeypatch.setattr(sys, "argv", ["x", "--work", str(tmp_path), "--layers", "1", "--experts", "64"])
    monkeypatch.setattr(script.subprocess, "run", lambda *a, **k: pytest.fail("a job ran on the wrong source"))
    with pytest.raises(SystemExit, match=r"src-fp8.*n_routed_experts 8 there, 64 asked.*another --work"):
        script.main()


def test_check_source_accepts_what_make_checkpoint_wrote(tmp_path):
    src = tmp_path / "s"
    over = {"num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2}
    fixtures.make_checkpoint(src, "glm_moe_dsa", preset="tiny", split_partners=False, config_overrides=over)
    bench_rtn.check_source(src, over, preset="tiny")  # no error
    with pytest.raises(SystemExit, match="num_hidden_layers 2 there, 3 asked"):
        bench_rtn.check_source(src, over | {"num_hidden_layers": 3}, preset="tiny")


def _record_solver(monkeypatch, log):
    real = bench_gptq_solver.quantize_gptq_batch
    ticks = iter(range(10**6))

    def q(w, h, spec, **kw):
        log.append(("q", (spec.clip_objective, spec.cd_sweeps, spec.scale_refit, kw.get("clip_search"))))
        return real(w, h, spec, **kw)

    def clock():
        log.append(("t", None))
        return float(next(ticks))

    monkeypatch.setattr(bench_gptq_solver, "quantize_gptq_batch", q)
    monkeypatch.setattr(bench_gptq_solver.time, "perf_counter", clock)


def _timed_calls_are_warm(log):
    """Every solve between a start and an end clock read (a timed one) had a solve of the same options before
    it, outside the clock reads (clock reads come in start/end pairs)."""
    seen_untimed = set()
    timed = clocks = 0
    for kind, key in log:
        if kind == "t":
            clocks += 1
            continue
        if clocks % 2:
            timed += 1
            assert key in seen_untimed, f"the first call of {key} is timed: kernel compilation counted as solve time"
        else:
            seen_untimed.add(key)
    assert timed


def test_solver_variants_timed_after_a_warm_up(tmp_path, monkeypatch):
    """With --repeats 1 the first (cold) call was the timed one: 'plain', the ratios' base, carried the numba
    kernels' loading (2.09 s against 0.009 s warm at 1 x 128 x 256)."""
    log = []
    _record_solver(monkeypatch, log)
    monkeypatch.setattr(sys, "argv", ["x", "--shape", "1", "16", "128", "--repeats", "1", "--variants",
                                      "clip propagated + cd2 (default)", "--out", str(tmp_path)])
    bench_gptq_solver.main()
    _timed_calls_are_warm(log)


def test_solver_splits_use_device_and_warm_up(tmp_path, monkeypatch):
    """--splits built its problems on the CPU whatever --device said (and then labelled the file with the GPU)."""
    log, devices = [], []
    real_problem = bench_gptq_solver.problem

    def problem(b, n, k, seed=0, device="cpu"):
        devices.append(str(device))
        return real_problem(b, n, k, seed)

    _record_solver(monkeypatch, log)
    monkeypatch.setattr(bench_gptq_solver, "problem", problem)
    monkeypatch.setattr(bench_gptq_solver, "_sync", lambda dev: None)
    args = SimpleNamespace(shape=[(2, 16, 128)], splits=[2, 1], repeats=1, group_size=128, device="meta",
                           out=str(tmp_path), name="")
    monkeypatch.setattr(bench_gptq_solver, "_write", lambda rows, a: tmp_path / "r.json")
    bench_gptq_solver.splits(args)
    assert devices == ["meta"]
    _timed_calls_are_warm(log)


def test_solver_backends_warm_up(tmp_path, monkeypatch):
    log = []
    _record_solver(monkeypatch, log)
    monkeypatch.setattr(sys, "argv", ["x", "--backends", "--shape", "1", "16", "128", "--repeats", "1",
                                      "--out", str(tmp_path)])
    bench_gptq_solver.main()
    # the torch path and the kernels share options: the warm-up must come before the first timed solve
    _timed_calls_are_warm(log)
    assert json.loads((tmp_path / "bench_gptq_solver.json").read_text())["rows"]


def test_validate_jobs_unknown_name_refused():
    """`--jobs defualt` ran no validate job at all (only the hash floors) and reported that as a result."""
    with pytest.raises(SystemExit, match="defualt: no such job.*default sha256 full"):
        bench_validate.jobs_for(SimpleNamespace(source=None, also_sample=[], jobs=["defualt"]))
    with pytest.raises(SystemExit, match="source: no such job.*needs --source"):
        bench_validate.jobs_for(SimpleNamespace(source=None, also_sample=[], jobs=["source"]))


def test_validate_also_sample_kept_with_jobs():
    """`--also-sample 0.5 --jobs default` dropped the asked-for sample job silently."""
    jobs = bench_validate.jobs_for(SimpleNamespace(source=None, also_sample=[0.5], jobs=["default"]))
    assert jobs == {"default": {}, "sample-0.5": {"sample": 0.5}}


def test_gptq_quality_refuses_a_finished_row_of_another_set_variant(tmp_path, monkeypatch):
    """`bench_gptq quality --set cd_sweeps=0` without --tag labels its run 'glmq gptq', the default's label, and
    reused the default's finished row in the same --work: the variant's figures were the default's."""
    from glmq.scripts import bench_gptq

    monkeypatch.setattr(bench_gptq, "dense_copy", lambda src, dst: dst)
    monkeypatch.setattr(bench_gptq, "glmq_run", lambda *a, **k: pytest.fail("the finished row's check came too late"))
    out = tmp_path / "experts-glmq-gptq"
    out.mkdir()
    (out / "config.json").write_text("{}")
    row = {"recipe": "experts", "tool": "glmq gptq", "checkpoint": str(out), "seconds": 1.0, "set": [], "cli_args": []}
    (tmp_path / "experts-glmq-gptq.row.json").write_text(json.dumps(row))
    args = SimpleNamespace(shared=str(tmp_path), work=str(tmp_path), peer_seeds=[], recipes=["experts"],
                           set=["cd_sweeps=0"], tag="", no_rtn=True, seeds=[0], cli_arg=[], peers=[],
                           peer_python="", peer_path="")
    with pytest.raises(SystemExit, match=r"glmq gptq.*--set \[\].*\['cd_sweeps=0'\].*--tag"):
        bench_gptq.quality(args)


@pytest.mark.parametrize("script", ["bench_rtn", "bench_dist", "bench_gptq_solver", "bench_validate"])
def test_zero_repeats_refused_when_parsed(script, monkeypatch, capsys):
    """--repeats 0 ran the setup (a generated checkpoint, a conversion) and then crashed in a median of nothing."""
    import importlib

    mod = importlib.import_module(f"glmq.scripts.{script}")
    monkeypatch.setattr(sys, "argv", [script, "--repeats", "0"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2 and "--repeats: 0: expected an integer >= 1" in capsys.readouterr().err


def test_manifest_bench_removes_its_temporary_folder_on_failure(tmp_path, monkeypatch):
    from glmq.scripts import bench_manifest

    monkeypatch.setattr(bench_manifest.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    monkeypatch.setattr(bench_manifest, "records", lambda recipe: [])
    monkeypatch.setattr(bench_manifest, "journal", lambda folder, recs: (_ for _ in ()).throw(OSError("disk full")))
    monkeypatch.setattr(sys, "argv", ["bench_manifest", "--rounds", "1"])
    (tmp_path / "work").mkdir()
    with pytest.raises(OSError, match="disk full"):
        bench_manifest.main()
    assert not (tmp_path / "work").exists()


def test_rtn_bench_compares_its_peers_quantized_tensors(tmp_path):
    """bench_rtn timed the peer without checking it did the same work: `compare_quantized` finds every common
    module of two identical outputs bit-identical, and names one whose integer and scale were changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from glmq import recipes
    from glmq.formats.source import open_source
    from glmq.quantize import stream
    from glmq.quantize.plan import make_plan

    src = fixtures.make_checkpoint(tmp_path / "src", "glm_moe_dsa", preset="tiny")
    a, b = tmp_path / "a", tmp_path / "b"
    stream.run(make_plan(open_source(src), recipes.load("int4-w4a16"), 300_000), a, progress=False)
    shutil.copytree(a, b)
    same = bench_rtn.compare_quantized(a, b)
    assert same["modules"] > 10 and same["identical"] == same["modules"] and same["ints_differing"] == 0
    assert same["only_in_first"] == same["only_in_second"] == 0

    weight_map = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    module = sorted(k for k in weight_map if ".experts." in k and k.endswith(".weight_packed"))[0].removesuffix(
        ".weight_packed")
    shard = b / weight_map[module + ".weight_packed"]
    tensors = load_file(str(shard))
    tensors[module + ".weight_packed"][0, 0] ^= 1  # one 4-bit integer moves by one
    tensors[module + ".weight_scale"][0, 0] *= 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    diff = bench_rtn.compare_quantized(a, b)
    assert diff["identical"] == same["modules"] - 1 and diff["differing_examples"] == [module]
    assert diff["ints_differing"] == 1 and diff["max_int_diff"] == 1 and diff["max_scale_rel_diff"] == 0.5
    assert diff["ints"] == same["ints"] > 0
    assert diff["abs_scale_ratio"] == {"min": 1.0, "median": 1.0, "max": 1.0}  # one scale of 16+ in the module
    assert diff["negative_scales"][0] == diff["negative_scales"][1] > 0  # int4-w4a16's full-range scales are signed

    recipe = recipes.load(str(bench_rtn.ct_rtn_recipe(tmp_path)))  # the peer's scale rule, for the bit-for-bit check
    assert recipe.spec.full_range is False and recipes.load("int4-w4a16").spec.full_range is True


def test_transfer_compare_takes_medians_per_side(tmp_path):
    """bench_as_device --compare: the median of each glmq column over the own-* runs against the as-* runs, from a
    folder or its .tgz; peers, failed cells and cells timed on one side only are left out."""
    import tarfile

    from glmq.scripts import bench_as_device

    def rec(m, impl, us, status="ok"):
        return {"op": "dense", "shape": "dense 12288->6144", "m": m, "impl": impl, "us": us, "status": status}

    runs = {"own-0": [rec(64, "glmq", 28.0), rec(64, "cublas-fp16", 60.0), rec(1, "glmq", None, "skipped")],
            "own-1": [rec(64, "glmq", 27.0), rec(1, "glmq", 16.0)],
            "own-2": [rec(64, "glmq", 30.0)],
            "as-0": [rec(64, "glmq", 40.0), rec(64, "cublas-fp16", 61.0)],
            "as-1": [rec(64, "glmq", 42.0), rec(64, "glmq-pdl", 41.0)]}  # fmt: skip
    for name, records in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench_kernels.json").write_text(json.dumps({"records": records}))
    with tarfile.open(tmp_path / "t.tgz", "w:gz") as tar:
        for name in runs:
            tar.add(tmp_path / name, arcname=f"./{name}")
    for src in (tmp_path, tmp_path / "t.tgz"):
        lines = bench_as_device.compare(bench_as_device.load_runs(src))
        assert len(lines) == 2, lines  # the header and one row: glmq at M = 64
        assert lines[1].split() == ["dense", "12288->6144", "64", "glmq", "28.0", "41.0", "1.46", "3/2"], lines


def test_kernel_bench_notes_the_config_that_ran_after_timing(monkeypatch):
    """bench_kernels labels a row with the config chosen once its calls have run: `w4a16_decode.choose`'s residency
    ladder can give the launch table's pick up after its first launches, and a label taken before the launch named
    the pick for a row the runner-up (or the Triton kernel) timed (session 44's Triton 3.9 tables)."""
    import torch

    from glmq.scripts import bench_kernels

    monkeypatch.setattr(bench_kernels.Bench, "measure_copy_rate", lambda self: 1e9)
    monkeypatch.setattr(bench_kernels.Bench, "measure_read_rate", lambda self: 1e9)
    b = bench_kernels.Bench(torch.device("cpu"), budget_s=60, smoke=True)
    ran = []
    ref = torch.ones(2, 2)

    def make():
        ran.append("pick")
        return [lambda: ran.append("runner-up")], ref.clone()

    rec = b.run("dense", "s", 2, "glmq", make, ref, note=lambda: f"config after {len(ran)} calls: {ran[-1]}")
    assert rec.status == "ok" and rec.us is not None
    assert rec.note == f"config after {len(ran)} calls: runner-up" and len(ran) > 2
    assert b.run("dense", "s", 2, "x", make, ref, note="plain").note == "plain"
