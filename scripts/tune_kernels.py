"""Tune glmq's W4A16 kernels on the GPU at hand and write the launch table the wrappers read.

    python scripts/tune_kernels.py --out DIR [--write kernels/tuned_configs.json] [--budget-s 240]
    python scripts/tune_kernels.py --out DIR --merge kernels/tuned_configs.json --m 16 64 256 2048

For every GLM-5 shape of scripts/bench_kernels.py (group 128, bf16) and M in {1, 4, 16, 64, 256, 2048}
it times a grid of launch configurations and keeps the fastest one whose output matches the float32
reference. Candidates: the transposed tensor-core kernel (`swap`: tiles, warps, stages, split-K) at
every M; with --merge, the entry the existing table holds for that (shape, M) as the baseline, else
the older grid (GEMV tiles / chunks per step / warps / split-K; per-plane MMA tiles); MoE block and
column tiles likewise. The table is keyed by the GPU's name, (N, K, g) or (E, H, I, topk, g), and M;
`choose_config` / `choose_moe_config` take the entry of the smallest tuned M >= the call's M and fall
back to their heuristics elsewhere, so nothing is tuned at call time. --merge keeps every entry of
the existing table that this run does not re-tune, so a run over some M buckets never loses the rest,
and a bucket never gets slower than its old entry (which competes as a candidate).

Method: compilation happens first, in parallel worker processes that share Triton's on-disk cache
(--compile-only stops there: run it beside other CPU work, then time with --no-warm); each candidate
is then checked once and timed as a CUDA-graph replay of calls rotating over weight copies that
together exceed 4x the L2 cache (median of 5 replays), the same method as the benchmark.
Writes DIR/tune_results.json (every timing) and the table (DIR/tuned_configs.json, and --write).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GROUP = 128
M_LIST = (1, 4, 16, 64, 256, 2048)
# tuned in this order (what the budget does not reach keeps its old entry): the expert-sized shapes first
DENSE = {"w2": (6144, 2048), "w13": (4096, 6144), "d6144x12288": (6144, 12288), "square": (8192, 8192),
         "d24576x6144": (24576, 6144)}  # fmt: skip
MOE = dict(experts=256, hidden=6144, inter=2048, topk=8)


# Transposed-kernel candidates by M bucket: (block_m, block_n, num_warps, num_stages) tiles, and the
# split-K targets (programs per SM) tried for each. Register and shared-memory use of every tile was
# checked offline with Triton 3.6's ptxas for sm_90a (no spills; 128 x 128 with 4 warps spills).
SWAP_TILES = {
    4: ([(16, 64, 4, 4), (16, 128, 4, 4), (16, 64, 4, 6), (16, 128, 4, 6), (16, 128, 8, 4), (16, 64, 4, 3)], (2, 4)),
    16: ([(16, 64, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (16, 64, 4, 6), (16, 128, 8, 4)], (1, 2, 4)),
    64: ([(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (64, 256, 8, 3), (64, 64, 4, 3),
          (64, 64, 4, 2), (32, 64, 4, 4), (64, 128, 8, 4), (32, 64, 4, 3), (32, 64, 4, 6), (64, 64, 4, 5)], (1, 2)),
    256: ([(64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 256, 8, 3)], (1, 2)),
    2048: ([(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (256, 128, 8, 2)], (1,)),
}


# Besides the split-K factors above: splits that put about this many programs per SM (M <= 64), so
# that small shapes (the expert-sized 2048->6144 has 16 chunks) see every wave fill, not only 2x / 4x
SPLIT_RATIOS = (0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4)


def explicit_splits(tiles: int, chunks: int, sms: int) -> list[int]:
    """Split-K values that give about SPLIT_RATIOS programs per SM, each split keeping >= 2 chunks."""
    out = set()
    for r in SPLIT_RATIOS:
        s = max(1, round(r * sms / tiles))
        if s == 1 or chunks // s >= 2:
            out.add(min(s, 32))
    return sorted(out)


def swap_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    from glmq.kernels.w4a16_dense import split_for

    # M = 1..3 take the M = 4 tiles: with 16-token tiles the kernel does the same work for any M <= 16
    # (on H200 it ran 6144->24576 at M = 4 in 36 us against the GEMV's 42 us at M = 1)
    bucket = next((b for b in sorted(SWAP_TILES) if b >= m), max(SWAP_TILES))
    tiles_list, factors = SWAP_TILES[bucket]
    out = []
    for bm, bn, warps, stages in tiles_list:
        tiles = -(-m // bm) * -(-n // bn)
        for f in factors:
            split = split_for(tiles, k // 128, f * sms, min_steps=2)
            out.append(dict(kind="mma", block_m=bm, block_n=bn, split_k=split, swap=True, num_warps=warps,
                            num_stages=stages))  # fmt: skip
    # the plain-Triton dequantization on the heuristic's tile: a fallback should the inline PTX lose
    heur = {4: 0, 16: 1, 64: 2, 256: 2, 2048: 0}[bucket]
    out.append(dict(out[heur * len(factors)], asm=False))
    if bucket <= 64:
        chunks = k // 128
        for bm, bn, warps, stages in tiles_list:
            tiles = -(-m // bm) * -(-n // bn)
            for split in explicit_splits(tiles, chunks, sms):
                out.append(dict(kind="mma", block_m=bm, block_n=bn, split_k=split, swap=True, num_warps=warps,
                                num_stages=stages))  # fmt: skip
    if m == 1:  # the split-K reduction either way (DenseConfig.mailbox): it won on long loops only (kernels/NOTES.md)
        out += [dict(c, mailbox=False) for c in out if c["split_k"] > 1]
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


def legacy_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """The grid of the GEMV and per-plane MMA kernels (used where no baseline entry exists)."""
    from glmq.kernels.w4a16_dense import _next_pow2, split_for

    out = []
    chunks = k // 128
    if m <= 8:
        bm = _next_pow2(m)
        for bn in (32, 64, 128):
            for cpi in (1, 2, 4):
                if bm * bn * cpi > 512 or (bm >= 4 and bn * cpi > 128):
                    continue
                steps = -(-chunks // cpi)
                tiles = -(-m // bm) * -(-n // bn)
                for f in (2, 4, 8):
                    split = split_for(tiles, steps, f * sms, min_steps=1)
                    for warps in (4, 8):
                        out.append(dict(kind="gemv", block_m=bm, block_n=bn, split_k=split, cpi=cpi, num_warps=warps))
    if m >= 4:  # per-plane dots; the gathered K = 128 dot (big_dot) lost everywhere on H200 and is not tried
        bms = {4: (16,), 16: (16,), 64: (32, 64), 256: (64, 128), 2048: (64, 128)}.get(m, (16,))
        for bm in bms:
            for bn in (64, 128):
                if bm == 128 and bn < 128:
                    continue
                tiles = -(-m // bm) * -(-n // bn)
                split = split_for(tiles, chunks, (4 if m <= 64 else 1) * sms, min_steps=2)
                warps = 8 if bm == 128 else 4
                out.append(dict(kind="mma", block_m=bm, block_n=bn, split_k=split, num_warps=warps, num_stages=2))
    return out


def dense_candidates(m: int, n: int, k: int, sms: int, base: dict | None = None, layout: str = "pairs") -> list[dict]:
    """[baseline (the existing table's entry) or, on PLANES weights, the legacy grid] + the transposed
    kernel's candidates."""
    swap = swap_candidates(m, n, k, sms)
    out = ([base] if base else [] if layout == "pairs" else legacy_candidates(m, n, k, sms)) + swap
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


MOE_SWAP_BM = {1: (16,), 4: (16,), 16: (16,), 64: (16, 32), 256: (32, 64), 2048: (64, 128)}


def moe_candidates(m: int, base: dict | None = None, layout: str = "pairs") -> list[dict]:
    """Per block size: warps/stages of the transposed kernel (+ the baseline, or on PLANES the legacy grid)."""
    out = []
    if base:
        out.append({k: v for k, v in base.items() if k not in ("block_n_up", "block_n_down")})
    elif layout == "planes":
        for bm in (16,) if m <= 16 else (16, 32) if m <= 64 else (32, 64) if m <= 256 else (64,):
            for warps in (4,) if bm <= 32 else (4, 8):
                out.append(dict(block_m=bm, num_warps=warps))
    for bm in MOE_SWAP_BM.get(m, (16,) if m < 64 else (64,)):
        for warps, stages in ((4, 3), (4, 4)) if bm <= 32 else ((8, 3), (8, 4)) if bm == 64 else ((8, 3),):
            out.append(dict(block_m=bm, swap=True, num_warps=warps, num_stages=stages))
    out.append(dict(out[-1], asm=False))  # plain-Triton dequantization, as a fallback
    return out


def moe_col_tiles(cfg: dict, which: str) -> tuple[int, ...]:
    """Column tiles tried per launch: >= 64 for the transposed kernel (the MMA's M), and only tiles
    that Triton 3.6's ptxas fits in registers without spilling (checked offline for sm_90a): the
    gate_up launch's two accumulators cap it at 128; 256 in the down launch needs block_m 16 or 8 warps."""
    if cfg.get("swap"):
        if which == "up":
            return (64, 128)
        bm, warps = cfg["block_m"], cfg.get("num_warps", 4)
        return (64, 128, 256) if bm <= 16 or (warps == 8 and bm <= 64) else (64, 128)
    return (32, 64, 128) if which == "up" else (64, 128, 256)


# ---- compilation in parallel ----------------------------------------------------------------------


LAYOUT = ["pairs"]  # the weight layout being tuned (--layout), also set in the compile workers


def prepack_dense(D, wp, ws):
    return D.prepack(wp, ws, GROUP, LAYOUT[0], LAYOUT[0] == "pairs")


def prepack_moe(MO, w13p, w13s, w2p, w2s):
    from glmq.kernels.w4a16_dense import prepack

    return tuple(prepack(p, s, GROUP, LAYOUT[0], LAYOUT[0] == "pairs") for p, s in ((w13p, w13s), (w2p, w2s)))


def _warm(tasks: list[tuple], layout: str = "pairs") -> int:
    """Worker: run each (op, args) once so that Triton compiles and caches it."""
    LAYOUT[0] = layout
    import glmq.kernels.w4a16_dense as D
    import glmq.kernels.w4a16_moe as MO

    dev = torch.device("cuda")
    weights: dict = {}
    done = 0
    for op, shape, m, cfg in tasks:
        try:
            if op == "dense":
                n, k = shape
                if shape not in weights:
                    wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
                    ws = torch.rand(n, k // GROUP, device=dev).to(torch.bfloat16)
                    weights[shape] = prepack_dense(D, wp, ws)
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                D.w4a16_matmul_packed(x, weights[shape], config=D.DenseConfig(**cfg))
            else:
                _moe_once(MO, m, cfg, weights, dev)
            done += 1
        except Exception as exc:  # reported again (and excluded) by the timing pass
            print(f"warm-up failed {op} {shape} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    torch.cuda.synchronize()
    return done


def _moe_once(MO, m, cfg, weights, dev):
    e, h, i, topk = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["topk"]
    small = 16  # compile on a few experts (a multiple of 16, as E = 256, so Triton specialises alike)
    if "moe" not in weights:
        w13p = torch.randint(-(2**31), 2**31 - 1, (small, 2 * i, h // 8), dtype=torch.int32, device=dev)
        w2p = torch.randint(-(2**31), 2**31 - 1, (small, h, i // 8), dtype=torch.int32, device=dev)
        w13s = torch.rand(small, 2 * i, h // GROUP, device=dev).to(torch.bfloat16)
        w2s = torch.rand(small, h, i // GROUP, device=dev).to(torch.bfloat16)
        weights["moe"] = prepack_moe(MO, w13p, w13s, w2p, w2s)
    x = torch.randn(m, h, device=dev).to(torch.bfloat16)
    ids = torch.randint(0, small, (m, topk), device=dev)
    tw = torch.rand(m, topk, device=dev)
    ups, downs = moe_col_tiles(cfg, "up"), moe_col_tiles(cfg, "down")
    for bn_up, bn_down in itertools.zip_longest(ups, downs, fillvalue=ups[-1]):
        c = MO.MoeConfig(block_n_up=bn_up, block_n_down=bn_down, **cfg)
        MO.fused_moe_w4a16_packed(x, *weights["moe"], tw, ids, config=c)
    del e


def warm_all(tasks: list[tuple], workers: int) -> None:
    t0 = time.monotonic()
    chunks = [(tasks[j::workers], LAYOUT[0]) for j in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        done = sum(pool.starmap(_warm, chunks))
    print(f"compiled {done}/{len(tasks)} launches in {time.monotonic() - t0:.0f} s with {workers} workers", flush=True)


# ---- timing -----------------------------------------------------------------------------------------


def graph_us(calls, replays: int = 5, target_ms: float = 2.0) -> float:
    """Median microseconds per call of `calls` (round-robin), replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for c in calls:
        c()
    b.record()
    b.synchronize()
    rounds = max(1, min(100, math.ceil(target_ms / max(a.elapsed_time(b), 1e-3))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts) * 1e3 / (rounds * len(calls))


def rel_err(y, ref) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return math.inf
    return float((y - ref).abs().max() / ref.abs().max())


def tune_dense(name, n, k, ms, sms, l2, results, table, deadline, base):
    import glmq.kernels.w4a16_dense as D
    from glmq.kernels import reference as R

    dev = torch.device("cuda")
    wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    ws = (torch.rand(n, k // GROUP, device=dev) * 0.01 + 0.002).to(torch.bfloat16)
    nbytes = wp.numel() * 4 + ws.numel() * 2
    copies = max(1, math.ceil(4 * l2 / nbytes))
    packs = [prepack_dense(D, wp, ws)] + [prepack_dense(D, wp.clone(), ws.clone()) for _ in range(copies - 1)]
    w32 = R.dequantize_packed(wp, ws, GROUP)
    key = f"{n},{k},{GROUP}"
    entry = table.setdefault(key, {})
    for m in ms:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = x.float() @ w32.T
        best = None
        old = base.get(key, {}).get(str(m))
        for cfg in dense_candidates(m, n, k, sms, old, LAYOUT[0]):
            if time.monotonic() > deadline:
                print("tuning budget spent", flush=True)
                return
            rec = dict(op="dense", shape=name, n=n, k=k, m=m, cfg=cfg, baseline=old is not None and cfg is old)
            try:
                c = D.DenseConfig(**cfg)
                err = rel_err(D.w4a16_matmul_packed(x, packs[0], config=c), ref)
                if not err < 2e-2:
                    rec.update(status="wrong", err=err)
                else:
                    us = graph_us([lambda p=p: D.w4a16_matmul_packed(x, p, config=c) for p in packs])
                    rec.update(status="ok", us=us, err=err)
                    if best is None or us < best[0]:
                        best = (us, cfg)
            except Exception as exc:
                rec.update(status="failed", note=f"{type(exc).__name__}: {str(exc)[:200]}")
            results.append(rec)
        if best:
            entry[str(m)] = best[1]
            was = next((r["us"] for r in results if r.get("baseline") and r.get("shape") == name and r["m"] == m
                        and r.get("status") == "ok"), None)  # fmt: skip
            print(f"{name:12s} M={m:5d} best {best[0]:8.1f} us (old entry {was or float('nan'):8.1f})  {best[1]}",
                  flush=True)  # fmt: skip
    del packs, w32
    torch.cuda.empty_cache()


def tune_moe(ms, sms, results, table, deadline, base):
    import glmq.kernels.w4a16_moe as MO
    from glmq.kernels import reference as R

    dev = torch.device("cuda")
    e, h, i, topk = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["topk"]
    gen = torch.Generator(device=dev).manual_seed(0)
    w13p = torch.randint(-(2**31), 2**31 - 1, (e, 2 * i, h // 8), dtype=torch.int32, device=dev, generator=gen)
    w2p = torch.randint(-(2**31), 2**31 - 1, (e, h, i // 8), dtype=torch.int32, device=dev, generator=gen)
    w13s = (torch.rand(e, 2 * i, h // GROUP, device=dev, generator=gen) * 0.01 + 0.002).to(torch.bfloat16)
    w2s = (torch.rand(e, h, i // GROUP, device=dev, generator=gen) * 0.01 + 0.002).to(torch.bfloat16)
    w13, w2 = prepack_moe(MO, w13p, w13s, w2p, w2s)
    key = f"{e},{h},{i},{topk},{GROUP}"
    entry = table.setdefault(key, {})
    for m in ms:
        routes = []
        for j in range(3):
            x = torch.randn(m, h, device=dev).to(torch.bfloat16)
            tw, ti = torch.softmax(torch.randn(m, e, device=dev), -1).topk(topk, -1)
            routes.append((x, tw, ti))
        x0, tw0, ti0 = routes[0]
        nref = min(m, 4)
        ref = R.moe_w4a16_ref(x0[:nref], w13p, w13s, w2p, w2s, ti0[:nref], tw0[:nref], GROUP)
        best = None
        old = base.get(key, {}).get(str(m))
        for idx, cand in enumerate(moe_candidates(m, old, LAYOUT[0])):
            if time.monotonic() > deadline:
                print("tuning budget spent", flush=True)
                return
            # the two launches are independent: pick each column tile on its own launch's time
            bm = cand["block_m"]
            aligned = [MO.moe_align_block_size(ti, bm, e) for _, _, ti in routes]
            parts = {}
            for which in ("up", "down"):
                for bn in moe_col_tiles(cand, which):
                    cfg = MO.MoeConfig(block_n_up=bn, block_n_down=bn, **cand)
                    rec = dict(op="moe", m=m, cfg={**cand, "bn": bn, "launch": which})
                    try:
                        def call(r, a, cfg=cfg, which=which):
                            x, tw, ti = r
                            hbuf = torch.empty(m * topk, i, dtype=x.dtype, device=dev)
                            ybuf = torch.empty(m, topk, h, dtype=x.dtype, device=dev)
                            _one_launch(MO, which, x, w13, w2, tw, *a, hbuf, ybuf, cfg)
                        us = graph_us([lambda r=r, a=a: call(r, a) for r, a in zip(routes, aligned)], target_ms=4.0)
                        rec.update(status="ok", us=us)
                        if which not in parts or us < parts[which][0]:
                            parts[which] = (us, bn)
                    except Exception as exc:
                        rec.update(status="failed", note=f"{type(exc).__name__}: {str(exc)[:200]}")
                    results.append(rec)
            if len(parts) < 2:
                continue
            cfg = dict(cand, block_n_up=parts["up"][1], block_n_down=parts["down"][1])
            try:
                y = MO.fused_moe_w4a16_packed(x0[:nref], w13, w2, tw0[:nref], ti0[:nref], config=MO.MoeConfig(**cfg))
                err = rel_err(y, ref)
            except Exception as exc:
                err = math.inf
                print("moe check failed", cfg, exc, flush=True)
            total = parts["up"][0] + parts["down"][0]
            results.append(dict(op="moe", m=m, cfg=cfg, status="ok" if err < 3e-2 else "wrong", us=total, err=err,
                                baseline=old is not None and idx == 0))  # fmt: skip
            if err < 3e-2 and (best is None or total < best[0]):
                best = (total, cfg)
        if best:
            entry[str(m)] = best[1]
            was = next((r["us"] for r in results if r.get("baseline") and r["op"] == "moe" and r["m"] == m
                        and r.get("status") == "ok"), None)  # fmt: skip
            print(f"moe M={m:5d} best {best[0]:8.1f} us (two launches; old entry {was or float('nan'):8.1f})  {best[1]}",
                  flush=True)  # fmt: skip


def _one_launch(MO, which, x, w13, w2, tw, sorted_ids, expert_ids, num_blocks, h, y, cfg):
    """One of `_launch_experts`' two launches (the other's output buffer is left as is)."""
    m, topk, num_experts = x.shape[0], y.shape[1], w13.lead[0]
    if which == "up":
        MO._grouped_launch(cfg, "up", x, w13, h, sorted_ids, expert_ids, tw, num_blocks, m * topk, num_experts, topk)
    else:
        MO._grouped_launch(cfg, "down", h, w2, y, sorted_ids, expert_ids, tw, num_blocks, m * topk, num_experts, topk)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "tune-out")))
    ap.add_argument("--write", type=Path, default=None, help="also write the table here (kernels/tuned_configs.json)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="start from this table (same GPU): keep what is not re-tuned, use its entries as baselines")
    ap.add_argument("--replace", action="store_true", help="let --write replace a table tuned on another GPU")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--m", type=int, nargs="+", default=list(M_LIST))
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--shapes", nargs="+", choices=sorted(DENSE), help="dense shapes to tune (default: all)")
    ap.add_argument("--compile-only", action="store_true", help="fill Triton's cache and stop")
    ap.add_argument("--no-warm", action="store_true", help="skip the parallel compilation (cache already warm)")
    ap.add_argument("--layout", choices=["pairs", "planes"], default="pairs",
                    help="weight layout to tune (pairs: the table's 'pairs' section; planes: its top level)")
    args = ap.parse_args(argv)
    LAYOUT[0] = args.layout
    if args.shapes:
        for name in set(DENSE) - set(args.shapes):
            del DENSE[name]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from glmq.kernels.w4a16_dense import replace_refusal

    if args.write and not args.replace and (why := replace_refusal(args.write, torch.cuda.get_device_name(0))):
        ap.error(why)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    import glmq.kernels.w4a16_dense as D

    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)
    old = json.loads(args.merge.read_text()) if args.merge and args.merge.exists() else {}
    if old.get("device") != props.name:
        old = {}
    section = old.get("pairs", {}) if args.layout == "pairs" else old
    base_dense, base_moe = section.get("dense", {}), section.get("moe", {})
    tasks = []
    if not args.skip_dense:
        for n, k in DENSE.values():
            for m in args.m:
                tasks += [("dense", (n, k), m, c)
                          for c in dense_candidates(m, n, k, sms, base_dense.get(f"{n},{k},{GROUP}", {}).get(str(m)),
                                                    args.layout)]
    if not args.skip_moe:
        mkey = f"{MOE['experts']},{MOE['hidden']},{MOE['inter']},{MOE['topk']},{GROUP}"
        tasks += [("moe", None, m, c) for m in args.m
                  for c in moe_candidates(m, base_moe.get(mkey, {}).get(str(m)), args.layout)]
    if not args.no_warm:
        warm_all(tasks, args.workers)
    if args.compile_only:
        print(f"compile-only: {len(tasks)} launches in {time.monotonic() - t0:.0f} s", flush=True)
        return 0
    table = json.loads(json.dumps(old)) if old else {}  # every other layout's entries stay as they were
    table.update({"device": props.name, "triton": triton.__version__, "torch": torch.__version__, "group_size": GROUP,
                  "note": "written by scripts/tune_kernels.py; keys: 'N,K,g' / 'E,H,I,topk,g', then M; top level: "
                          "PLANES weights, 'pairs': PAIRS weights (kernels/w4a16_dense.py Layout)"})  # fmt: skip
    tuned = table.setdefault("pairs", {}) if args.layout == "pairs" else table
    tuned["dense"], tuned["moe"] = json.loads(json.dumps(base_dense)), json.loads(json.dumps(base_moe))
    tuned.pop("wall_s", None)
    results: list[dict] = []
    # dense before MoE, and every dense shape's decode sizes before any prefill size: what the budget
    # does not reach keeps its old entry
    small_ms = [m for m in args.m if m <= 64]
    big_ms = [m for m in args.m if m > 64]
    if not args.skip_dense:
        for ms in (small_ms, big_ms):
            for name, (n, k) in DENSE.items():
                if ms:
                    tune_dense(name, n, k, ms, sms, l2, results, tuned["dense"], deadline, base_dense)
    if not args.skip_moe:
        tune_moe(list(args.m), sms, results, tuned["moe"], deadline, base_moe)
    table["wall_s"] = round(time.monotonic() - t0, 1)
    (args.out / "tune_results.json").write_text(json.dumps(results, indent=0))
    (args.out / "tuned_configs.json").write_text(json.dumps(table, indent=1))
    if args.write:
        args.write.write_text(json.dumps(table, indent=1) + "\n")
        D._tuned_table.cache_clear()
    print(f"tuning done in {table['wall_s']} s: {sum(r.get('status') == 'ok' for r in results)} timings", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
