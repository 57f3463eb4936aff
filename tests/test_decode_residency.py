"""The launch table's picks run only at the residency they were timed at (kernels/NOTES.md, session 42): CPU tests of
`w4a16_decode.programs_per_sm`, `residency_problem`, `choose`'s fallback, the launch record and the tables' data."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import triton_interpreter_guard  # tests/ is on sys.path

triton_interpreter_guard()  # before glmq.kernels imports triton: the Triton test modules collected later need the flag

from glmq.kernels import w4a16_decode as DK  # noqa: E402
from glmq.kernels import w4a16_dense as D  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = DK.DecodeConfig(rows=16, warps=4, depth=2, split=4, ring=4, wgmma=True)  # 64-row programs, K split 4


@pytest.mark.parametrize("registers, shared, warps, want", [
    (164, 16384, 4, 3), (165, 16384, 4, 3), (168, 16384, 4, 3), (169, 16384, 4, 2), (187, 16384, 4, 2),
    (255, 16384, 4, 2), (128, 16384, 4, 4), (64, 16384, 4, 8), (128, 0, 8, 2), (32, 0, 1, 32),
    (64, 100 << 10, 4, 2), (64, 228 << 10, 4, 0),
])
def test_programs_per_sm(registers, shared, warps, want):
    # 64K registers in per-warp units of 256, 228 KB of shared memory less 1 KB a program, 64 warps, 32 programs
    assert DK.programs_per_sm(registers, shared, warps) == want


def test_launch_programs():
    assert DK.launch_programs(6144, CFG) == 96 * 4
    assert DK.launch_programs(6145, CFG) == 97 * 4
    assert DK.launch_programs(100, DK.DecodeConfig(rows=32, warps=4)) == 4  # `_decode_kernel`: one program a row block


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A launch table for "Test GPU" naming CFG at M = 16 on [6144, 512] weights, timed at 165 registers; the Gluon
    kernel taken as available (choose() on a CPU device), and no launch recorded yet."""
    def write(compiled=True, n=6144, alternates=()):
        entry = {"plain": CFG.to_dict(), "pdl": None}
        if compiled:
            entry["compiled"] = {"plain": {"registers": 165, "shared": 16384}}
        if alternates:
            entry["alternates"] = {"plain": [{"config": c.to_dict(), "us": 1.0, "compiled": {"registers": r,
                                                                                             "shared": 16384}}
                                             for c, r in alternates]}
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"device": "Test GPU", "layout": "pairs", "triton": "3.6.0",
                                    "decode": {f"{n},512,128": {"16": entry}}}))
        DK._table.cache_clear()
        return D.prepack(torch.randint(-(2**31), 2**31 - 1, (n, 64), dtype=torch.int32),
                         torch.rand(n, 4).to(torch.bfloat16), 128)

    monkeypatch.setattr(DK, "TUNED_PATHS", {D.Layout.PAIRS: tmp_path / "t.json"})
    monkeypatch.setattr(DK, "available", lambda device: True)
    monkeypatch.setattr(DK, "_COMPILED", {})
    monkeypatch.setattr(DK, "_RESIDENCY_LOST", {})
    monkeypatch.setattr(DK, "_SETTLED", {})
    yield write
    DK._table.cache_clear()


def _compiled(w, registers, pdl=False, cfg=CFG):
    DK._COMPILED[DK._compile_key(cfg, 16, w.k, pdl, False)] = (registers, 16384)


def test_choose_takes_the_pick_compiled_as_timed(table):
    w = table()
    assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) == CFG  # nothing launched yet: taken
    _compiled(w, 166)  # three programs an SM, as timed
    assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) == CFG


def test_choose_drops_a_pick_that_lost_its_residency(table, caplog):
    w = table()
    _compiled(w, 187)  # two programs an SM: 384 programs on 132 SMs take two waves instead of one
    with caplog.at_level(logging.WARNING, logger="glmq.kernels.w4a16_decode"):
        assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) is None  # the Triton kernels
        assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1  # once per pick
    assert "165 registers" in msgs[0] and "187 registers" in msgs[0] and "2 waves" in msgs[0]
    assert "probe_decode.py --tune" in msgs[0]


ALT1 = DK.DecodeConfig(rows=16, warps=4, depth=3, split=4, ring=4, wgmma=True)
ALT2 = DK.DecodeConfig(rows=16, warps=4, depth=3, split=4, ring=4)


def test_choose_falls_back_to_the_tables_next_config_that_kept_its_residency(table, caplog):
    # Triton 3.9 at 6144->24576 M = 16 (kernels/NOTES.md, session 44): the pick and the first alternate lose a program
    # an SM; the second alternate keeps its residency and runs, instead of the Triton kernel
    w = table(alternates=[(ALT1, 160), (ALT2, 146)])
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="glmq.kernels.w4a16_decode"):
        assert DK.choose(16, w, cpu, "Test GPU", False) == CFG  # nothing launched yet: the pick runs first
        _compiled(w, 187)
        assert DK.choose(16, w, cpu, "Test GPU", False) == ALT1  # the pick lost: the next, not yet launched, runs
        _compiled(w, 190, cfg=ALT1)
        assert DK.choose(16, w, cpu, "Test GPU", False) == ALT2
        _compiled(w, 146, cfg=ALT2)  # as timed
        for _ in range(2):
            assert DK.choose(16, w, cpu, "Test GPU", False) == ALT2
    # settled: later calls read one entry, not the table (a table edited now is not read again)
    assert DK._SETTLED[(16, 6144, 512, False, D.Layout.PAIRS, "Test GPU")] == ALT2
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2  # once per config given up
    assert f"next-fastest config here, {ALT1}, runs instead" in msgs[0] and "187 registers" in msgs[0]
    assert f"next-fastest config here, {ALT2}, runs instead" in msgs[1] and "190 registers" in msgs[1]


def test_choose_takes_the_triton_kernel_when_every_alternate_lost(table, caplog):
    w = table(alternates=[(ALT2, 146)])
    cpu = torch.device("cpu")
    _compiled(w, 187)
    _compiled(w, 200, cfg=ALT2)
    with caplog.at_level(logging.WARNING, logger="glmq.kernels.w4a16_decode"):
        assert DK.choose(16, w, cpu, "Test GPU", False) is None
        assert DK.choose(16, w, cpu, "Test GPU", False) is None  # settled: no second warning
    assert "the Triton kernel runs instead" in caplog.records[-1].getMessage() and len(caplog.records) == 2


def test_choose_keeps_the_pick_and_never_reads_alternates_while_it_holds(table):
    w = table(alternates=[(ALT2, 146)])
    _compiled(w, 165)
    _compiled(w, 250, cfg=ALT2)  # would be lost, but the pick holds
    assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) == CFG
    assert DK.tuned_alternates(16, 6144, 512, "Test GPU", False) == [(ALT2, {"registers": 146, "shared": 16384})]
    assert DK.tuned_alternates(16, 6144, 512, "Test GPU", True) == []  # none recorded for PDL


def test_choose_keeps_a_pick_whose_waves_do_not_change(table):
    w = table(n=4096)  # 256 programs: two an SM still hold them in one wave
    _compiled(w, 187)
    assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) == CFG


def test_choose_without_the_tables_compile_record(table):
    w = table(compiled=False)  # an older table: nothing to hold the launch to
    _compiled(w, 187)
    assert DK.choose(16, w, torch.device("cpu"), "Test GPU", False) == CFG


def test_remember_reads_tritons_handle():
    key = ("k",)
    saved = dict(DK._COMPILED)
    try:
        DK._remember(key, SimpleNamespace(n_regs=170, metadata=SimpleNamespace(shared=8192)))
        assert DK._COMPILED[key] == (170, 8192)
        DK._remember(key, SimpleNamespace(n_regs=200, metadata=SimpleNamespace(shared=8192)))
        assert DK._COMPILED[key] == (170, 8192)  # the first launch's
        DK._remember(("other",), object())  # a handle without them: nothing recorded, nothing raised
        assert ("other",) not in DK._COMPILED
    finally:
        DK._COMPILED.clear()
        DK._COMPILED.update(saved)


@pytest.mark.parametrize("name", ["tuned_decode.json", "tuned_decode_spans.json"])
def test_shipped_tables_record_what_their_picks_compiled_to(name):
    # every Gluon pick says what it compiled to when it was timed (scripts/sass_digest.py --record, Triton 3.6.0)
    table = json.loads((ROOT / "kernels" / name).read_text())
    assert table["triton"] == "3.6.0"
    picks = alternates = 0
    for shape, rows in table["decode"].items():
        for m, entry in rows.items():
            for slot in ("plain", "pdl"):
                if entry.get(slot):
                    picks += 1
                    got = entry["compiled"][slot]
                    assert 32 <= got["registers"] <= 255 and got["shared"] >= 0, (shape, m, slot)
                    cfg = DK.DecodeConfig(**entry[slot])
                    assert DK.programs_per_sm(got["registers"], got["shared"], cfg.warps) >= 1, (shape, m, slot)
                    # its fallbacks, fastest first, each with what it compiled to and never the pick itself
                    alts = entry.get("alternates", {}).get(slot, [])
                    times = [a["us"] for a in alts]
                    assert times == sorted(times) and len(alts) <= 2, (shape, m, slot)
                    for a in alts:
                        alt = DK.DecodeConfig(**a["config"])
                        assert alt != cfg and DK.programs_per_sm(a["compiled"]["registers"], a["compiled"]["shared"],
                                                                 alt.warps) >= 1, (shape, m, slot)
                    alternates += len(alts)
    assert picks > 10 and alternates > picks


def test_sass_digest_record(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_digest

    table = {"device": "X", "decode": {"6144,512,128": {"16": {"plain": CFG.to_dict(), "pdl": CFG.to_dict()}}}}
    digest = {"entries": {"6144,512|16|plain": {"registers": 164, "shared": 16384},
                          "6144,512|16|pdl": {"registers": 162, "shared": 16384}}}
    out = sass_digest.record(table, digest, "3.6.0")
    assert out["triton"] == "3.6.0"
    assert out["decode"]["6144,512,128"]["16"]["compiled"] == {"plain": {"registers": 164, "shared": 16384},
                                                               "pdl": {"registers": 162, "shared": 16384}}
    assert "compiled" not in table["decode"]["6144,512,128"]["16"]  # a copy
    with pytest.raises(SystemExit, match="6144,512|16|pdl"):
        sass_digest.record(table, {"entries": {"6144,512|16|pdl": {"error": "boom"}}}, "3.6.0")


def test_sass_digest_alternates_and_their_record():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_digest

    from glmq.scripts.probe_decode import tag

    pick, t1, t2, slow = "R16W4D2S4G4H", "R16W4D3S4G4", "R16W4D1S4G4M", "R16W4D3S4G4H"
    us = {pick: 10.0, t1: 10.5, t2: 10.2, slow: 11.0, "triton": 11.0, pick + "-pdl": 9.0, t1 + "-pdl": 9.5,
          "triton-pdl": 11.0}
    table = {"device": "X", "decode": {"6144,512,128": {"16": {"plain": CFG.to_dict(), "pdl": CFG.to_dict(),
                                                               "us": us}}}}
    alts = sass_digest.alternate_entries(table, 3, 0.97)
    # fastest first, the pick left out, only those that beat the Triton kernel by the margin (11.0 does not), per mode
    assert [(a["key"], tag(DK.DecodeConfig(**a["config"])), a["us"]) for a in alts] == [
        ("6144,512|16|plain|alt0", t2, 10.2), ("6144,512|16|plain|alt1", t1, 10.5), ("6144,512|16|pdl|alt0", t1, 9.5)]
    digest = {"entries": {"6144,512|16|plain": {"registers": 164, "shared": 16384},
                          "6144,512|16|pdl": {"registers": 162, "shared": 16384},
                          **{a["key"]: {"registers": 100 + i, "shared": 8192} for i, a in enumerate(alts)}}}
    entry = sass_digest.record(table, digest, "3.6.0", {a["key"]: a for a in alts})["decode"]["6144,512,128"]["16"]
    assert [(a["us"], a["compiled"]["registers"]) for a in entry["alternates"]["plain"]] == [(10.2, 100), (10.5, 101)]
    assert entry["alternates"]["pdl"] == [{"config": alts[2]["config"], "us": 9.5,
                                           "compiled": {"registers": 102, "shared": 8192}}]
    # recorded again without alternates: the old lists go
    again = sass_digest.record({"decode": {"6144,512,128": {"16": entry}}}, {"entries": {
        "6144,512|16|plain": {"registers": 164, "shared": 16384}}}, "3.6.0")
    assert "plain" not in again["decode"]["6144,512,128"]["16"].get("alternates", {})


SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the shared-x kernel's launch table is sm_90's")


def _gpu_weight(n, k, dev):
    gen = torch.Generator().manual_seed(0)
    wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen).to(dev)
    ws = (torch.rand(n, k // 128, generator=gen) * 0.01 + 0.002).to(torch.bfloat16).to(dev)
    return wp, ws, D.prepack(wp, ws, 128)


@pytest.mark.gpu
@SM90
def test_a_pick_that_lost_its_residency_gives_way_on_the_gpu(tmp_path, monkeypatch, caplog):
    # A table claiming its pick was timed at 8 registers and no shared memory (16 programs an SM, the most of 4 warps:
    # its 3072 programs in two waves on 132 SMs); any real build needs far more (Triton 3.6: ~150, 3.9: ~80), so more
    # waves. The first call already compiles the pick (without launching it), finds that out and runs the Triton
    # kernel, with one warning; every call gives the reference's result.
    dev = torch.device("cuda")
    cfg = DK.DecodeConfig(rows=16, warps=4, depth=3, split=8, ring=4)
    n, k, m = 24576, 4096, 16
    name = torch.cuda.get_device_name(dev)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": name, "layout": "pairs", "triton": "test", "decode": {f"{n},{k},128": {
        str(m): {"plain": cfg.to_dict(), "pdl": None, "compiled": {"plain": {"registers": 8, "shared": 0}}}}}}))
    monkeypatch.setattr(DK, "TUNED_PATHS", {D.Layout.PAIRS: path})
    monkeypatch.setattr(DK, "_COMPILED", {})
    monkeypatch.setattr(DK, "_RESIDENCY_LOST", {})
    monkeypatch.setattr(DK, "_SETTLED", {})
    launched, decode_matmul = [], DK.decode_matmul
    monkeypatch.setattr(DK, "decode_matmul", lambda *a, **kw: (launched.append(a[3]), decode_matmul(*a, **kw))[1])
    DK._table.cache_clear()
    try:
        wp, ws, w = _gpu_weight(n, k, dev)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
        from glmq.kernels import reference as R

        ref = x.double() @ R.dequantize_packed(wp, ws, 128).double().T
        with caplog.at_level(logging.WARNING, logger="glmq.kernels.w4a16_decode"):
            for _ in range(3):
                y = D.w4a16_matmul_packed(x, w)
                assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        got = DK._COMPILED[DK._compile_key(cfg, m, k, False, False)]
        assert DK.programs_per_sm(*got, 4) < 16  # what this Triton built
        assert launched == []  # the pick was compiled, never launched
        assert DK.choose(m, w, dev, name, False) is None
        assert sum("the Triton kernel runs instead" in r.getMessage() for r in caplog.records) == 1
    finally:
        DK._table.cache_clear()


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("cfg, m, pdl", [
    (DK.DecodeConfig(rows=16, warps=4, depth=3, split=4, ring=4, wgmma=True), 16, False),
    (DK.DecodeConfig(rows=16, warps=4, depth=3, split=4, ring=4, wgmma=True), 16, True),
    (DK.DecodeConfig(rows=16, warps=4, depth=2, split=1, ring=4), 8, False),
    (DK.DecodeConfig(rows=16, warps=4, depth=2), 1, True),
])
def test_compiling_ahead_records_what_the_launch_builds(cfg, m, pdl, monkeypatch):
    """`_compile_ahead` (Triton's warmup) compiles the kernel the launch runs: the launch after it gets the same
    compiled kernel from Triton's cache (no second compile), and it records the same registers and shared memory."""
    dev = torch.device("cuda")
    n, k = 2048, 4096
    _, _, w = _gpu_weight(n, k, dev)
    key = DK._compile_key(cfg, m, k, pdl, False)
    monkeypatch.setattr(DK, "_COMPILED", {})
    ahead = DK._compile_ahead(m, w, cfg, pdl, torch.bfloat16, dev)
    assert ahead is not None and DK._COMPILED[key][0] > 0
    recorded = DK._COMPILED.pop(key)
    handles = []
    remember = DK._remember
    monkeypatch.setattr(DK, "_remember", lambda kk, kernel: (handles.append(kernel), remember(kk, kernel)))
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    DK.decode_matmul(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=dev), cfg, pdl=pdl)
    assert handles == [ahead] and handles[0] is ahead
    assert DK._COMPILED[key] == recorded


def test_sass_digest_ladder_settles_as_choose_does():
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_digest

    rec = {"registers": 165, "shared": 16384}
    table = {"decode": {"6144,512,128": {"16": {
        "plain": CFG.to_dict(), "pdl": CFG.to_dict(), "compiled": {"plain": rec, "pdl": rec},
        "alternates": {"plain": [{"config": ALT1.to_dict(), "us": 1, "compiled": rec},
                                 {"config": ALT2.to_dict(), "us": 2, "compiled": {"registers": 146, "shared": 16384}}],
                       "pdl": [{"config": ALT2.to_dict(), "us": 1, "compiled": rec}]}}}}}
    lost, held = {"registers": 187, "shared": 16384}, {"registers": 160, "shared": 16384}
    digest = {"entries": {"6144,512|16|plain": lost, "6144,512|16|plain|alt0": lost, "6144,512|16|plain|alt1": held,
                          "6144,512|16|pdl": held}}
    assert sass_digest.ladder(table, digest, 132) == {"6144,512|16|plain": "alt1 R16W4D3S4G4", "6144,512|16|pdl": "pick"}
    digest["entries"]["6144,512|16|plain|alt1"] = lost
    digest["entries"]["6144,512|16|pdl"] = lost
    digest["entries"]["6144,512|16|pdl|alt0"] = {"error": "boom"}  # unknown: taken as it comes
    assert sass_digest.ladder(table, digest, 132) == {"6144,512|16|plain": "triton", "6144,512|16|pdl": "alt0 R16W4D3S4G4"}


@pytest.mark.parametrize("cfg", [DK.DecodeConfig(rows=16, warps=4, depth=3, split=4, ring=4, wgmma=True),
                                 DK.DecodeConfig(rows=16, warps=4, depth=2, split=1, ring=4),
                                 DK.DecodeConfig(rows=32, warps=8, depth=1, x_smem=True, pdl_early=True)])
@pytest.mark.parametrize("m, pdl, dtype", [(1, True, torch.bfloat16), (16, False, torch.float16)])
def test_a_compile_ahead_passes_what_the_launch_passes(cfg, m, pdl, dtype):
    """`_compile_ahead`'s arguments are the launch's (kernel, grid, constants, every integer), with each tensor the
    launch takes or allocates (x, out, the split-K scratch and tickets) as its dtype, which Triton's warmup takes for a
    pointer: so the compile matches the launch's without allocating anything (the GPU tests check the compiled kernel
    is the one the launch then gets from the cache)."""
    n, k = 2048, 4096
    w = D.prepack(torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32),
                  torch.rand(n, k // 128).to(torch.bfloat16), 128)
    x, out = torch.randn(m, k).to(dtype), torch.empty(m, n, dtype=dtype)
    fn, grid, args, kw = DK._launch_args(m, dtype, w, cfg, pdl, 0, x, out)
    fn2, grid2, ahead, kw2 = DK._launch_args(m, dtype, w, cfg, pdl)
    assert (fn2, grid2, kw2) == (fn, grid, kw) and len(ahead) == len(args)
    assert args[0] is x and args[3] is out
    for a, b in zip(args, ahead):
        if isinstance(a, torch.Tensor):
            assert b is a if a is w.qweight or a is w.scale else b == a.dtype
        else:
            assert b == a
