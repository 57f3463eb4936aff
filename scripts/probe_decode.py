"""Probe the Gluon decode kernel (kernels/w4a16_decode.py) on one GPU: correctness, then launch variants
against the Triton kernel, cuBLAS fp16 and the bandwidth floors, in one run (timing as bench_kernels.py:
CUDA-graph replay over weight copies rotated past L2, median of 15 replays).

    python scripts/probe_decode.py --out DIR [--only 8192] [--m 1 4 16] [--layouts pairs spans] [--workers 12]
    python scripts/probe_decode.py --out DIR --m 4 16 --plain --tags R16W4D4S4G8 R16W4D1S4G4M R16W4D4S1G8B2
    python scripts/probe_decode.py --tune --out DIR [--write kernels/tuned_decode.json] [--layouts spans] [--m 1 2 4]
    python scripts/probe_decode.py --timeline --out DIR --only 12288 --m 16 --tags R16W4D3S4G4H

Probe mode writes DIR/probe_decode.json and prints a table: launch variants of the Gluon kernel, its timing
probes (parts left out), the Triton kernel (the config `choose_config` picks, forced) and cuBLAS fp16, on
weights prepacked in each of `--layouts` (labels end in the layout when there are several; above M = 16 only
the Triton kernel runs, but for wgmma configs named by `--tags`); with `--tags` the Gluon variants are exactly the
named configs (`tag` names), each first checked against the float64 reference. Tune mode times, on weights in the
first of `--layouts`, for each shape and M in `--m` (default TUNE_M), the Triton kernel (the config `choose_config`
picks) and the Gluon kernel's candidates (`tune_candidates`: TUNE_CANDIDATES and the shared-x TUNE_XSHARED at the K
splits `xshared_splits` picks; from M = 9 the wgmma lists too, above M = 16 those only), plain and as PDL chains,
each twice in alternation (the lower median is kept, against drift), and writes the launch table that
`w4a16_decode.tuned_config` reads: the Gluon config where it was at least TUNE_MARGIN faster, null where the Triton
kernel won. The kernels are compiled first in `--workers` processes (Triton's
cache is shared), so the timing pass finds them compiled. Timeline mode (`timelines`) runs each shared-x config of
`--tags` once with the kernel's PROBE 5 and writes DIR/timeline.json: every program's SM, start and end time,
split-K ticket and the times of its main loop's end and of its ticket, with a summary (the spread of the programs'
ends, the SMs' idle share, where the split-K fix-up's time goes: `fixup_summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name -> (N, K)
    "square 8192x8192": (8192, 8192),
    "dense 12288->6144": (6144, 12288),
    "dense 6144->24576": (24576, 6144),
    "expert w13 6144->2x2048": (4096, 6144),
    "expert w2 2048->6144": (6144, 2048),
}
EXTRA_SHAPES = {  # --extra-shapes: layers of other MoE models the launch table was not tuned on (the heuristics' test)
    "kimi-k2 expert w13 7168->2x2048": (4096, 7168),
    "kimi-k2 expert w2 2048->7168": (7168, 2048),
    "kimi-k2 dense 7168->18432": (18432, 7168),
    "glm-4.5 expert w13 5120->2x1536": (3072, 5120),
    "glm-4.5 expert w2 1536->5120": (5120, 1536),
}
# (rows, warps, depth, probe, x_smem) per token tile (1: M = 1, 8: M <= 8, 16: M <= 16); probes leave parts out
# (w4a16_decode._decode_kernel: 1 no x, 2 words only, 3 no scales) and are timed only
VARIANTS = {
    1: [(16, 4, 2, 0, False), (16, 4, 3, 0, False), (16, 8, 2, 0, False), (16, 8, 3, 0, False), (16, 4, 4, 0, False),
        (16, 4, 2, 0, True), (16, 4, 3, 0, True), (16, 8, 2, 0, True), (16, 8, 3, 0, True), (16, 4, 4, 0, True),
        (16, 4, 2, 1, False), (16, 4, 2, 2, False)],
    8: [(16, 4, 2, 0, False), (16, 4, 3, 0, False), (16, 8, 2, 0, False), (16, 8, 3, 0, False), (32, 4, 2, 0, False),
        (32, 8, 2, 0, False), (16, 4, 2, 1, False)],
    16: [(16, 4, 2, 0, False), (16, 8, 2, 0, False), (16, 4, 3, 0, False), (32, 4, 1, 0, False), (32, 4, 2, 0, False),
         (32, 8, 1, 0, False)],
}
# the shared-x kernel (DecodeConfig.split >= 1): (rows, warps, depth, ring) per token tile; each with the K splits
# that give xshared_splits' program counts
XSHARED = {1: [(16, 4, 3, 4), (16, 8, 3, 4)],
           8: [(16, 4, 3, 4), (16, 4, 4, 4), (16, 8, 3, 4), (32, 4, 2, 4), (16, 4, 4, 8)],
           16: [(16, 4, 2, 4), (16, 4, 3, 4), (16, 4, 4, 4), (16, 8, 3, 4), (32, 4, 2, 4), (16, 4, 3, 8)]}
XSHARED_PROGRAMS = (96, 800)  # programs per launch the K splits are chosen for (132 SMs, 1-6 programs each)
GROUP = 128
TUNE_M = (1, 2, 4)
TUNE_CANDIDATES = [(16, 8, 2), (16, 8, 3), (16, 4, 2), (16, 4, 3), (32, 4, 2), (32, 4, 3), (32, 8, 2), (16, 2, 3)]
TUNE_WIDE = [(32, 4, 1), (32, 8, 1)]  # also at M >= 8 (two m16 tiles share each x fragment)
TUNE_X_SMEM = [(16, 8, 2), (16, 8, 3), (16, 4, 2), (16, 4, 3), (16, 4, 4), (32, 8, 2)]  # also with x_smem at M = 1
# the shared-x kernel at every M (at M = 1 since session 18): (rows, warps, depth, ring, step, w_smem, wgmma); the
# w_smem ones (session 16) won in its probes on 6144->24576 and the expert w2 shape at M = 16 and 12288->6144 at
# M = 4, the wgmma ones (session 17, M = 16 only) on 12288->6144 (kernels/NOTES.md)
TUNE_XSHARED = [(16, 4, 3, 4, 1, False, False), (32, 4, 2, 4, 1, False, False), (16, 4, 4, 8, 1, False, False),
                (16, 4, 4, 8, 2, False, False), (16, 4, 1, 4, 1, True, False), (16, 4, 1, 8, 2, True, False),
                (16, 8, 1, 4, 1, True, False)]
TUNE_XSHARED_WG = [(16, 4, 3, 4, 1, False, True), (16, 4, 2, 4, 1, False, True), (16, 4, 2, 2, 1, False, True),
                   (16, 4, 1, 4, 1, True, True), (16, 4, 1, 2, 1, True, True)]
TUNE_WG_MIN_M = 9  # wgmma candidates only at 16 tokens (at M = 4 the session-17 probe had them 4-40 % behind)
# above M = 16 (32 or 64 tokens a chunk) only wgmma configs run, and those with the words in registers spill at 64
# (255 registers; the w_smem ones 192-212 without spills under Triton 3.6; session 20)
TUNE_XSHARED_WIDE = [(16, 4, 1, 4, 1, True, True), (16, 4, 1, 2, 1, True, True), (16, 8, 1, 4, 1, True, True)]
# with the scales in A (DecodeConfig.scaled_a; session 23): one accumulator across chunks, 174-216 registers at 64
# tokens without spills, so the words in registers and a ring of 8 fit again
TUNE_XSHARED_SCALED = [(16, 4, 1, 4, 1, True), (16, 4, 1, 8, 2, True), (16, 4, 2, 4, 1, False), (16, 4, 3, 4, 1, False),
                       (16, 4, 2, 8, 2, False), (16, 8, 1, 4, 1, True), (16, 8, 2, 4, 1, False)]
TUNE_DIRECT_MAX_M = 8  # above it `_decode_kernel` (warps split K) is not a candidate: it lost by >= 1.35x on every
# GLM shape at M = 16 (session 15's tune, kernels/tuned_decode.json)
TUNE_MARGIN = 0.97  # the Gluon kernel only where it took <= 97 % of the Triton kernel's time


def tune_candidates(n: int, k: int, m: int, layout: str = "pairs"):
    """The Gluon configs the tuner times at this shape and M on weights of `layout`: those of the candidate lists
    above that the kernel takes there (`w4a16_decode.supports`: wgmma on PAIRS weights only)."""
    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels.w4a16_decode import DecodeConfig

    chunks = k // 128
    cands = []
    if m <= TUNE_DIRECT_MAX_M:  # `_decode_kernel`, its warps splitting K
        cands = [DecodeConfig(r, w, d) for r, w, d in TUNE_CANDIDATES]
        if m == 1:
            cands += [DecodeConfig(r, w, d, x_smem=True) for r, w, d in TUNE_X_SMEM]
        if m >= 8:
            cands += [DecodeConfig(r, w, d) for r, w, d in TUNE_WIDE]
        cands = [c for c in cands if chunks % c.warps == 0 and chunks // c.warps >= max(c.depth, 2)]
    # the shared-x kernel, with the K splits xshared_splits picks for the shape (also at M = 1: its table entries at
    # M = 4 were 3-7 % ahead of the M = 1 ones on the large shapes, where it had never been timed; session 18)
    listed = TUNE_XSHARED_WIDE if m > DK.MAX_M else TUNE_XSHARED + (TUNE_XSHARED_WG if m >= TUNE_WG_MIN_M else [])
    cands += [DecodeConfig(r, w, d, split=s, ring=g, step=st, w_smem=ws, wgmma=wg)
              for r, w, d, g, st, ws, wg in listed for s in xshared_splits(n, k, r, w)]
    if m >= TUNE_WG_MIN_M:
        cands += [DecodeConfig(r, w, d, split=s, ring=g, step=st, w_smem=ws, wgmma=True, scaled_a=True)
                  for r, w, d, g, st, ws in TUNE_XSHARED_SCALED for s in xshared_splits(n, k, r, w)]
    stub = _stub(n, k, layout)
    return [c for c in cands if DK.supports(m, stub, c)]


def xshared_splits(n: int, k: int, rows: int, warps: int) -> list[int]:
    """The K splits of the shared-x kernel worth timing for this shape: those whose launch has XSHARED_PROGRAMS
    programs with at least 4 chunks each, at most four (the smallest, the largest, one between and the one nearest
    the launch size `w4a16_decode.heuristic_config` aims at: HEURISTIC_PROGRAMS_PER_SM on each of the H200's SMs)."""
    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels.w4a16_dense import DEFAULT_SM_COUNT

    near = DK.HEURISTIC_PROGRAMS_PER_SM * DEFAULT_SM_COUNT
    chunks, blocks = k // 128, -(-n // (rows * warps))
    ok = [s for s in range(1, chunks // 4 + 1) if chunks % s == 0
          and XSHARED_PROGRAMS[0] <= blocks * s <= XSHARED_PROGRAMS[1]]
    if not ok:
        return []
    return sorted({ok[0], ok[len(ok) // 2], ok[-1], min(ok, key=lambda s: abs(blocks * s - near))})


def tag(c) -> str:
    """R{rows}W{warps}D{depth}, X with x_smem, E with pdl_early, S{split}G{ring} for the shared-x kernel, then
    B{step} where step > 1, M with w_smem, H with wgmma and A with scaled_a."""
    return (f"R{c.rows}W{c.warps}D{c.depth}{'X' if c.x_smem else ''}{'E' if c.pdl_early else ''}"
            f"{f'S{c.split}G{c.ring}' if c.split else ''}{f'B{c.step}' if c.step > 1 else ''}"
            f"{'M' if c.w_smem else ''}{'H' if c.wgmma else ''}{'A' if c.scaled_a else ''}")


def parse_probe_tag(text: str):
    """`TAG` or `TAG/P<n>` -> (DecodeConfig, n): the config and its timing probe (the kernels' PROBE; 0 for the GEMM)."""
    tag_, _, probe = text.partition("/P")
    return parse_tag(tag_), int(probe or 0)


def parse_tag(text: str):
    """`tag`'s inverse: `R16W4D3[X][E][S4G4][B2][M][H][A]` -> a DecodeConfig."""
    import re

    from glmq.kernels.w4a16_decode import DecodeConfig

    m = re.fullmatch(r"R(\d+)W(\d+)D(\d+)(X?)(E?)(?:S(\d+)G(\d+))?(?:B(\d+))?(M?)(H?)(A?)", text)
    if not m:
        raise ValueError(f"not a decode config tag: {text!r} "
                         "(R<rows>W<warps>D<depth>[X][E][S<split>G<ring>][B<step>][M][H][A])")
    r, w, d, xs, early, split, ring, step, ws, wg, sa = m.groups()
    return DecodeConfig(int(r), int(w), int(d), pdl_early=bool(early), x_smem=bool(xs), split=int(split or 0),
                        ring=int(ring or 4), step=int(step or 1), w_smem=bool(ws), wgmma=bool(wg), scaled_a=bool(sa))


def variants(n: int, k: int, m: int, xshared_only: bool = False, tag_has: str = "", tags: tuple = (),
             layout: str = "pairs", heuristic: bool = False):
    """The Gluon configs (and timing probes) to time at this shape and M: with `heuristic` what
    `w4a16_decode.heuristic_config`'s two rules give, the shared-x one also at the other of its two K splits (nearest
    HEURISTIC_PROGRAMS_PER_SM programs an SM, or that at most) where they differ; else `tags` where given (those the
    kernel takes here on weights of `layout`), else VARIANTS and XSHARED."""
    if heuristic:
        import dataclasses

        from glmq.kernels import w4a16_decode as DK
        from glmq.kernels.w4a16_dense import Layout

        cfg = DK.xshared_heuristic(m, n, k, Layout(layout))
        cands = [DK.direct_heuristic(m, n, k), cfg]
        if cfg is not None:
            cands += [dataclasses.replace(cfg, split=s) for s in sorted(
                {DK.xshared_split(n, k), DK.xshared_split(n, k, max_per_sm=DK.HEURISTIC_PROGRAMS_PER_SM)} - {cfg.split})]
        stub = _stub(n, k, layout)
        yield from ((c, 0) for c in cands if c is not None and DK.supports(m, stub, c))
        return
    if tags:
        from glmq.kernels import w4a16_decode as DK

        stub = _stub(n, k, layout)
        for t in tags:
            c, probe = parse_probe_tag(t)
            if DK.supports(m, stub, c) and not (c.x_smem and m > 1):
                yield c, probe
        return
    for cfg, probe in _variants(n, k, m, xshared_only):
        if tag_has in tag(cfg):
            yield cfg, probe


def _stub(n: int, k: int, layout: str = "pairs"):
    """A chunk-major PackedW4 of this shape and layout with no real data (for `supports`; expanded, no memory)."""
    from glmq.kernels import w4a16_dense as D

    return D.PackedW4(torch.zeros(1, 1, 16, dtype=torch.int32).expand(k // 128, n, 16),
                      torch.ones(1, k // GROUP).expand(n, k // GROUP), GROUP, chunk=128, layout=D.Layout(layout),
                      chunk_major=True)


def _variants(n: int, k: int, m: int, xshared_only: bool):
    from glmq.kernels.w4a16_decode import DecodeConfig

    tok = 1 if m == 1 else 8 if m <= 8 else 16 if m <= 16 else None  # above 16 tokens: the Triton kernel only
    chunks = k // 128
    for r, w, d, probe, xs in ([] if xshared_only else VARIANTS.get(tok, [])):
        if chunks % w == 0 and chunks // w >= d:
            yield DecodeConfig(rows=r, warps=w, depth=d, x_smem=xs), probe
    for r, w, d, ring in XSHARED.get(tok, []):
        for split in xshared_splits(n, k, r, w):
            yield DecodeConfig(rows=r, warps=w, depth=d, split=split, ring=ring), 0


def packed_copies(b, wp: torch.Tensor, ws: torch.Tensor, layout: str) -> list:
    """`prepack`ed copies of one weight, as many as `b.copies` rotates past L2 (the first from wp, ws themselves)."""
    from bench_kernels import packed_bytes
    from glmq.kernels import w4a16_dense as D

    return [D.prepack(wp, ws, GROUP, layout)] + [D.prepack(wp.clone(), ws.clone(), GROUP, layout)
                                                 for _ in range(b.copies(packed_bytes(wp, ws)) - 1)]


def _warm(job):
    n, k, m, cfg, pdl, probe, layout, *dtype = job
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_decode as DK

    torch.manual_seed(0)
    wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    ws = torch.rand(n, k // GROUP, device="cuda").to(torch.bfloat16)
    pk = D.prepack(wp, ws, GROUP, layout)
    x = torch.randn(m, k, device="cuda").to(dtype[0] if dtype else torch.bfloat16)
    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
    t = time.time()
    try:
        if isinstance(cfg, DK.DecodeConfig):
            DK.decode_matmul(x, pk, out, cfg, pdl=pdl, probe=probe)
        else:  # a DenseConfig (the Triton kernel), or None: what w4a16_matmul_packed picks
            D.w4a16_matmul_packed(x, pk, out=out, config=cfg, pdl=pdl)
        torch.cuda.synchronize()
        return f"ok {job} {time.time() - t:.1f}s"
    except Exception as exc:
        return f"FAIL {job}: {type(exc).__name__}: {str(exc)[:400]}"


def compile_all(jobs: list[tuple], workers: int) -> None:
    """Compile every job's kernel (`_warm`) in `workers` spawned processes; Triton's cache is shared."""
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        for r in pool.imap_unordered(_warm, jobs):
            if not r.startswith("ok"):
                print(r)
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s")


CHECK_SHAPES = [(1, 200, 384), (3, 256, 1024), (9, 96, 512), (16, 2048, 2048), (5, 4096, 6144), (1, 8192, 8192),
                (1, 6144, 12288), (16, 6144, 12288)]
CHECK_CONFIGS = [(16, 1, 1, False, False, 0), (32, 2, 2, True, False, 0), (16, 4, 3, False, False, 0),
                 (16, 1, 1, False, True, 0), (32, 2, 2, True, True, 0), (16, 8, 3, False, True, 0),
                 (16, 4, 2, False, False, 1), (16, 8, 3, True, False, 3), (32, 4, 2, False, False, 2),
                 (32, 8, 1, True, False, 4)]  # (rows, warps, depth, pdl, x_smem, split)


def check_cases(xshared_only: bool = False, tags: tuple = (), layout: str = "pairs") -> list[tuple]:
    """(m, n, k, dtype, DecodeConfig, pdl) of `check`: every config of CHECK_CONFIGS (or, given, of `tags`, without
    PDL) the kernel takes at each CHECK_SHAPES shape on weights of `layout`, in both activation dtypes (x_smem at
    M = 1 only; with --xshared-only the shared-x ones)."""
    from glmq.kernels import w4a16_decode as DK

    cfgs = ([(c, False) for c in dict.fromkeys(parse_probe_tag(t)[0] for t in tags)] if tags else
            [(DK.DecodeConfig(r, w, d, x_smem=xs, split=sp), pdl) for r, w, d, pdl, xs, sp in CHECK_CONFIGS])
    out = []
    for (m, n, k), dt, (cfg, pdl) in itertools.product(CHECK_SHAPES, (torch.bfloat16, torch.float16), cfgs):
        if (cfg.x_smem and m > 1) or (xshared_only and not cfg.split) or not DK.supports(m, _stub(n, k, layout), cfg):
            continue
        out.append((m, n, k, dt, cfg, pdl))
    return out


def check(dev, layout: str, xshared_only: bool = False, tags: tuple = ()) -> list[dict]:
    """Random shapes and dtypes against the float reference (output poisoned first)."""
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_decode as DK

    rows = []
    for m, n, k, dt, cfg, pdl in check_cases(xshared_only, tags, layout):
        r, w, d, xs, sp = cfg.rows, cfg.warps, cfg.depth, cfg.x_smem, cfg.split
        gen = torch.Generator(device=dev).manual_seed(m * 7 + n + k)
        wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev, generator=gen)
        sdt = torch.float32 if n == 256 else dt
        ws = (torch.rand(n, k // GROUP, device=dev, generator=gen) * 0.02 + 0.001).to(sdt)
        x = torch.randn(m, k, device=dev, generator=gen).to(dt)
        ref = x.double() @ R.dequantize_packed(wp, ws, GROUP).double().T
        out = torch.full((m, n), float("nan"), dtype=dt, device=dev)
        DK.decode_matmul(x, D.prepack(wp, ws, GROUP, layout), out, cfg, pdl=pdl)
        err = float((out.double() - ref).norm() / ref.norm())
        ok = bool(torch.isfinite(out).all()) and err < 5e-3
        rows.append(dict(m=m, n=n, k=k, dtype=str(dt), rows=r, warps=w, depth=d, pdl=pdl, x_smem=xs, split=sp,
                         rel_err=err, ok=ok, layout=layout))
        print(f"check {layout} M={m:<3} N={n:<5} K={k:<5} {str(dt):15} {tag(cfg)} pdl={pdl}: "
              f"rel err {err:.2e} {'ok' if ok else 'WRONG'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--only", default="", help="substring of the shape names to run")
    ap.add_argument("--extra-shapes", action="store_true",
                    help="also the EXTRA_SHAPES (Kimi K2, GLM-4.5 layers), which the launch table was not tuned on")
    ap.add_argument("--heuristic", action="store_true",
                    help="probe: time what w4a16_decode.heuristic_config's rules pick (direct_heuristic, "
                         "xshared_heuristic) instead of the VARIANTS / XSHARED tables or --tags")
    ap.add_argument("--m", type=int, nargs="+", default=None, help="M values (default: 1 4 16; --tune: TUNE_M)")
    ap.add_argument("--triton-only", action="store_true",
                    help="probe: time only what w4a16_matmul runs and the Triton kernel (no Gluon variants); on SPANS "
                         "weights the Triton kernel also with x permuted the other way (triton-other: the copy kernel "
                         "at M <= SPANS_PERMUTE_IN_KERNEL_MAX_M, in registers above)")
    ap.add_argument("--xshared-only", action="store_true",
                    help="probe: of the Gluon variants only the shared-x kernel's (DecodeConfig.split >= 1)")
    ap.add_argument("--plain", action="store_true", help="probe: the Gluon variants without PDL only")
    ap.add_argument("--tag-has", default="", help="probe: only the Gluon variants whose tag contains this")
    ap.add_argument("--tags", nargs="+", default=[],
                    help="probe: exactly these Gluon configs (`tag` names, e.g. R16W4D4S4G8B2), where the kernel takes "
                         "them, instead of the VARIANTS / XSHARED tables; the correctness check runs them too; "
                         "TAG/P<n> times the config's timing probe n instead (kernels' PROBE: parts left out)")
    ap.add_argument("--no-check", action="store_true",
                    help="probe: skip the correctness check on CHECK_SHAPES (each timed launch is still checked "
                         "against the float64 reference at its own shape first)")
    ap.add_argument("--compile-only", action="store_true",
                    help="probe or --tune: only compile its kernels (in --workers processes; fills Triton's cache for a "
                         "bench or a later --tune)")
    ap.add_argument("--merge", action="store_true",
                    help="--tune: keep the --write table's entries for the M values not tuned now")
    ap.add_argument("--layouts", nargs="+", default=["pairs"], choices=["pairs", "spans"],
                    help="weight layouts to probe side by side (--tune: the first)")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--tune", action="store_true", help="time the tuning candidates and write the launch table")
    ap.add_argument("--write", default="", help="--tune: also write the table here (e.g. kernels/tuned_decode.json)")
    ap.add_argument("--replace", action="store_true", help="--tune: let --write replace a table tuned on another GPU")
    ap.add_argument("--timeline", action="store_true",
                    help="each --tags config's per-program timeline (the shared-x kernel's PROBE 5) at each shape and "
                         "--m: when every program started and ended on which SM; writes DIR/timeline.json")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    if a.tune and a.write and not a.replace:
        from glmq.kernels.w4a16_dense import replace_refusal

        if why := replace_refusal(a.write, torch.cuda.get_device_name(dev)):
            ap.error(why)
    shapes = {k: v for k, v in {**SHAPES, **(EXTRA_SHAPES if a.extra_shapes else {})}.items() if a.only in k}
    if a.tune:
        tune(shapes, dev, a, out_dir)
        return
    a.m = a.m or [1, 4, 16]
    if a.timeline:
        timelines(shapes, dev, a, out_dir)
        return

    from glmq.kernels import w4a16_dense as D

    jobs = []
    name = torch.cuda.get_device_name(dev)
    for (n, k), m, lay in itertools.product(shapes.values(), a.m, a.layouts):
        tcfg = D.choose_config(m, n, k, GROUP, D.sm_count(dev), name, D.Layout.PAIRS)
        jobs += [(n, k, m, c, pdl, 0, lay) for c in (None, tcfg) for pdl in (False, True)]
        for cfg, probe in ([] if a.triton_only
                           else variants(n, k, m, a.xshared_only, a.tag_has, a.tags, lay, a.heuristic)):
            jobs.append((n, k, m, cfg, False, probe, lay))
            if not probe and not a.plain:
                jobs.append((n, k, m, cfg, True, probe, lay))
    checked = not (a.triton_only or a.no_check)  # the CHECK_SHAPES pass runs (and its kernels are compiled)
    if checked:
        jobs += [(n, k, m, cfg, pdl, 0, lay, dt) for lay in a.layouts
                 for m, n, k, dt, cfg, pdl in check_cases(a.xshared_only, a.tags, lay)]
    compile_all(jobs, a.workers)
    if a.compile_only:
        return

    rows = [r for lay in a.layouts for r in check(dev, lay, a.xshared_only, a.tags)] if checked else []

    from bench_kernels import Bench, random_int4, packed_bytes, rel_err
    import torch.nn.functional as F
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_decode as DK

    b = Bench(dev, a.budget_s, smoke=False)
    res = []
    for name, (n, k) in shapes.items():
        wp, ws = random_int4(n, k, device=dev, seed=1)
        w32 = R.dequantize_packed(wp, ws, GROUP)
        nbytes = packed_bytes(wp, ws)
        packs_of = {lay: packed_copies(b, wp, ws, lay) for lay in a.layouts}
        packs = packs_of[a.layouts[0]]
        w16 = [w32.to(torch.float16) for _ in range(b.copies(n * k * 2))]
        for m in a.m:
            if b.out_of_time():
                break
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w32.T
            outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]

            def timed(impl, fn_of, note=""):
                y = fn_of(0)
                err = rel_err(y, ref)
                if not err < 3e-2:
                    print(f"{name} M={m} {impl}: WRONG rel err {err}")
                    res.append(dict(shape=name, m=m, impl=impl, status="wrong", rel_err=err, note=note))
                    return
                us, mode = b.time_us([lambda i=i: fn_of(i) for i in range(len(packs))])
                res.append(dict(shape=name, m=m, impl=impl, us=us, rel_err=err, note=note, mode=mode))
                print(f"timed {name} M={m} {impl}: {us:.2f} us", flush=True)  # as it goes: a cut-off run still tells

            tcfg = D.choose_config(m, n, k, GROUP, D.sm_count(dev), D.device_name(dev), D.Layout.PAIRS)
            for lay, pk in packs_of.items():
                sfx = f"-{lay}" if len(packs_of) > 1 else ""
                timed(f"glmq{sfx}", lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i]))
                timed(f"glmq-pdl{sfx}", lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i], pdl=True))
                timed(f"triton{sfx}", lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i], config=tcfg))
                timed(f"triton-pdl{sfx}",
                      lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i], config=tcfg, pdl=True))
                if lay == "spans" and a.triton_only:  # the other way of permuting x (SPANS_PERMUTE_IN_KERNEL_MAX_M)
                    limit = D.SPANS_PERMUTE_IN_KERNEL_MAX_M
                    D.SPANS_PERMUTE_IN_KERNEL_MAX_M = 0 if m <= limit else 1 << 30
                    try:
                        timed(f"triton-other{sfx}",
                              lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i], config=tcfg))
                        timed(f"triton-other-pdl{sfx}",
                              lambda i, pk=pk: D.w4a16_matmul_packed(x, pk[i], out=outs[i], config=tcfg, pdl=True))
                    finally:
                        D.SPANS_PERMUTE_IN_KERNEL_MAX_M = limit
            for cfg, probe in ([] if a.triton_only
                               else variants(n, k, m, a.xshared_only, a.tag_has, a.tags, heuristic=a.heuristic)):
                for lay, pk in packs_of.items():
                    if not DK.supports(m, pk[0], cfg):  # e.g. a wgmma tag on SPANS weights
                        continue
                    label = tag(cfg) + (f"-{lay}" if len(packs_of) > 1 else "")
                    if probe:
                        DK.decode_matmul(x, pk[0], outs[0], cfg, probe=probe)
                        us, _ = b.time_us([lambda i=i, c=cfg, pk=pk: DK.decode_matmul(x, pk[i], outs[i], c, probe=probe)
                                           for i in range(len(pk))])
                        res.append(dict(shape=name, m=m, impl=f"probe{probe}-{label}", us=us))
                        continue
                    timed(f"gluon-{label}", lambda i, c=cfg, pk=pk: DK.decode_matmul(x, pk[i], outs[i], c))
                    if not a.plain:
                        timed(f"gluon-pdl-{label}",
                              lambda i, c=cfg, pk=pk: DK.decode_matmul(x, pk[i], outs[i], c, pdl=True))
            xd = x.to(torch.float16)
            us, _ = b.time_us([lambda w=w: F.linear(xd, w) for w in w16])
            res.append(dict(shape=name, m=m, impl="cublas-fp16", us=us))
            res.append(dict(shape=name, m=m, impl="floor", us=nbytes / b.copy_rate * 1e6))
            res.append(dict(shape=name, m=m, impl="read-floor", us=nbytes / b.read_rate * 1e6))
        del packs, packs_of, w16, w32
        torch.cuda.empty_cache()

    info = dict(layouts=a.layouts, device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                triton=__import__("triton").__version__, copy_rate=b.copy_rate, read_rate=b.read_rate,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    (out_dir / "probe_decode.json").write_text(json.dumps(dict(info=info, check=rows, results=res), indent=1))
    print(json.dumps(info))
    for (shape, m), grp in itertools.groupby(res, key=lambda r: (r["shape"], r["m"])):
        grp = list(grp)
        cub = next((r["us"] for r in grp if r["impl"] == "cublas-fp16"), None)
        fl = next((r["us"] for r in grp if r["impl"] == "floor"), None)
        print(f"== {shape} M={m}")
        for r in grp:
            if r.get("us") is None:
                print(f"   {r['impl']:24} {r.get('status')}")
                continue
            extra = "" if r["impl"] in ("floor", "read-floor", "cublas-fp16") else \
                f"  {cub / r['us']:.2f}x cublas  {fl / r['us'] * 100:.0f}% floor"
            print(f"   {r['impl']:24} {r['us']:7.2f} us{extra}")


def probe_timeline(x: torch.Tensor, w, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the shared-x config `cfg` with the kernel's PROBE 5 -> (int64 [split, blocks, 8] rows of (SM id,
    %globaltimer at the program's start and end in ns, %clock64 at start and end, its split-K ticket or -1,
    %globaltimer at its main loop's end and once its ticket was back), the output [M, N]), which the caller checks
    like any launch's (PROBE 5 computes the GEMM unchanged)."""
    from glmq.kernels import w4a16_decode as DK

    m, n = x.shape[0], w.n
    blocks = -(-n // (cfg.warps * cfg.rows))
    words = cfg.split * blocks * DK.TIMELINE_WORDS  # int64 words, four 2-byte elements of out each
    full = torch.zeros(m * n + 4 * words, dtype=x.dtype, device=x.device)  # out's M rows, then the timeline
    out = full[: m * n].view(m, n)
    DK.decode_matmul(x, w, out, cfg, probe=5)
    torch.cuda.synchronize()
    return full[m * n:].view(torch.int64).view(cfg.split, blocks, DK.TIMELINE_WORDS).cpu(), out


def fixup_summary(blocks: list, t0: int) -> dict:
    """Where a split-K launch's fix-up goes, from PROBE 5 rows (`probe_timeline`) grouped by row block ([split, 8]
    rows each; t0: the launch's first start). A row block's reducer is its last ticket. Per program, from its main
    loop's end: `store_ticket` = its partial's stores, the release fence and the ticket's round trip; `sum` (reducers)
    = the other partials' loads, the adds and out's store; `exit` (the others) = the ticket's broadcast and the
    exit. `reducer_tail`: a reducer's end after its block's other programs' ends. The launch's critical path: the
    program that ends last, its main loop's end and its ticket, all from t0; `loops_done` = the latest main-loop
    end of the launch, so `span - loops_done` is the time the launch runs after the last MMAs."""
    import statistics

    def p50(v):
        return statistics.median(v) if v else None

    store_ticket, sums, exits, tails = [], [], [], []
    for blk in blocks:
        last = max(blk, key=lambda r: r[5])
        tails.append(last[2] - max(r[2] for r in blk if r is not last))
        for r in blk:
            store_ticket.append(r[7] - r[6])
            (sums if r is last else exits).append(r[2] - r[7])
    rows = [r for blk in blocks for r in blk]
    crit = max(rows, key=lambda r: r[2])
    return dict(reducer_tail_ns_p50=p50(tails), reducer_tail_ns_max=max(tails), store_ticket_ns_p50=p50(store_ticket),
                store_ticket_ns_max=max(store_ticket), reducer_sum_ns_p50=p50(sums), reducer_sum_ns_max=max(sums),
                exit_ns_p50=p50(exits), loops_done_ns=max(r[6] for r in rows) - t0,
                critical=dict(loop_end_ns=crit[6] - t0, ticket_ns=crit[7] - t0, end_ns=crit[2] - t0,
                              ticket=crit[5]))


def timelines(shapes: dict, dev, a, out_dir: Path) -> None:
    """`--timeline`: for each --tags config at each shape and M, the timeline of one launch whose weights are not in
    L2 (the launch after others on rotated copies), summarised: launch span, the spread of the programs' starts and
    ends, the SMs' idle share and the reducers' tail after the other programs of their row block."""
    import statistics

    from bench_kernels import Bench, random_int4, rel_err
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_decode as DK
    from glmq.kernels.w4a16_dense import sm_count

    b = Bench(dev, a.budget_s, smoke=False)
    sms = sm_count(dev)
    res = []
    for shape, (n, k) in shapes.items():
        wp, ws = random_int4(n, k, device=dev, seed=3)
        w32 = R.dequantize_packed(wp, ws, GROUP)
        packs = packed_copies(b, wp, ws, "pairs")
        for m in a.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w32.T
            for t in a.tags:
                cfg, _probe = parse_probe_tag(t)
                if not cfg.split or not DK.supports(m, packs[0], cfg):
                    continue
                for pk in packs[1:]:  # the launches before: other copies' weights pass through L2
                    probe_timeline(x, pk, cfg)
                tl3, out = probe_timeline(x, packs[0], cfg)
                err = rel_err(out, ref)
                if not err < 3e-2:
                    raise SystemExit(f"{shape} M={m} {t}: wrong, rel err {err}")
                tl = tl3.reshape(-1, DK.TIMELINE_WORDS).tolist()
                t0 = min(r[1] for r in tl)
                starts = sorted(r[1] - t0 for r in tl)
                ends = sorted(r[2] - t0 for r in tl)
                span = ends[-1]
                by_sm = {}
                for r in tl:
                    lo, hi = by_sm.get(r[0], (r[1], r[2]))
                    by_sm[r[0]] = (min(lo, r[1]), max(hi, r[2]))
                busy = statistics.mean(hi - lo for lo, hi in by_sm.values())
                summary = dict(shape=shape, m=m, tag=t, rel_err=err, programs=len(tl), sms=len(by_sm), span_ns=span,
                               start_spread_ns=starts[-1], start_p50_ns=starts[len(starts) // 2],
                               end_first_ns=ends[0], end_p10_ns=ends[len(ends) // 10], end_p50_ns=ends[len(ends) // 2],
                               sm_busy_mean_ns=busy, sm_idle_share=1 - busy / span if span else None,
                               program_ns_p50=statistics.median(r[2] - r[1] for r in tl))
                ranks = {}  # the programs' ends by their launch rank on an SM (breadth-first: launch index // SMs)
                for idx, r in enumerate(tl):
                    ranks.setdefault(idx // sms, []).append(r[2] - t0)
                summary["end_by_rank_p50_ns"] = [statistics.median(v) for _, v in sorted(ranks.items())]
                distinct = sorted(set(r[1] for r in tl) | set(r[2] for r in tl))
                summary["timer_step_ns"] = min((b_ - a_ for a_, b_ in zip(distinct, distinct[1:])), default=None)
                if cfg.split > 1:
                    summary.update(fixup_summary(tl3.transpose(0, 1).tolist(), t0))
                print(json.dumps(summary))
                res.append(dict(summary, rows=tl))
    (out_dir / "timeline.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), results=res)))


def tune(shapes: dict, dev, a, out_dir: Path) -> None:
    import triton
    from bench_kernels import Bench, random_int4, rel_err
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels import w4a16_decode as DK

    layout, tune_m = a.layouts[0], a.m or TUNE_M
    jobs = [(n, k, m, dataclasses.replace(c, pdl_early=early), pdl, 0, layout) for (n, k) in shapes.values()
            for m in tune_m for c in tune_candidates(n, k, m, layout)
            for pdl, early in ((False, False), (True, False), (True, True)) if not (early and c.split)]
    compile_all(jobs, a.workers)
    if a.compile_only:
        return
    b = Bench(dev, a.budget_s, smoke=False)
    name = torch.cuda.get_device_name(dev)
    table = {"device": name, "measured": time.strftime("%Y-%m-%d", time.gmtime()),
             "how": "scripts/probe_decode.py --tune (median of 15 graph replays, weights rotated past L2, "
                    f"the lower of two passes; Gluon where <= {TUNE_MARGIN} x the Triton kernel)",
             "layout": layout, "triton": triton.__version__, "decode": {}}
    if a.merge and a.write and Path(a.write).exists():
        old = json.loads(Path(a.write).read_text())
        if old.get("device") == name and old.get("layout", "pairs") == layout:
            table["decode"] = old.get("decode", {})
            if "also_for" in old:  # measured on the old picks: re-check after a re-tune (gpu_kernels.sh PARTS=transfer)
                table = {"device": name, "also_for": old["also_for"], **table}
            table["measured"] = f"{old.get('measured')}; M = {', '.join(map(str, tune_m))}: {table['measured']}"
            if old.get("triton", table["triton"]) != table["triton"]:  # each entry's "compiled" says what it ran
                table["triton"] = f"{old.get('triton')}; M = {', '.join(map(str, tune_m))}: {table['triton']}"
    for shape, (n, k) in shapes.items():
        wp, ws = random_int4(n, k, device=dev, seed=3)
        w32 = R.dequantize_packed(wp, ws, GROUP)
        packs = packed_copies(b, wp, ws, layout)
        for m in tune_m:
            if b.out_of_time():  # the table so far is still written (untuned entries take the heuristic)
                print(f"{shape} M={m}: out of time, not tuned")
                break
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w32.T
            outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]
            tcfg = D.choose_config(m, n, k, GROUP, D.sm_count(dev), name, D.Layout.PAIRS)
            cands = [("triton", tcfg)] + [(tag(c), c) for c in tune_candidates(n, k, m, layout)]
            cands += [(label + "E", dataclasses.replace(c, pdl_early=True)) for label, c in cands[1:] if not c.split]
            times = {}
            for _ in range(2):
                for label, cfg in cands:
                    for pdl in ((True,) if label.endswith("E") else (False, True)):
                        fn = lambda i, c=cfg, p=pdl: D.w4a16_matmul_packed(x, packs[i], out=outs[i], config=c, pdl=p)
                        if _ == 0:
                            err = rel_err(fn(0), ref)
                            if not err < 3e-2:
                                raise SystemExit(f"{shape} M={m} {label}: wrong, rel err {err}")
                        us, _mode = b.time_us([lambda i=i: fn(i) for i in range(len(packs))])
                        key = (label, pdl)
                        times[key] = min(times.get(key, us), us)
            entry = {"us": {f"{label}{'-pdl' if pdl else ''}": round(us, 3) for (label, pdl), us in times.items()}}
            for pdl, slot in ((False, "plain"), (True, "pdl")):
                best = min((c for c in cands[1:] if (c[0], pdl) in times), key=lambda lc: times[(lc[0], pdl)])
                win = times[(best[0], pdl)] <= TUNE_MARGIN * times[("triton", pdl)]
                entry[slot] = best[1].to_dict() if win else None
                got = DK._COMPILED.get(DK._compile_key(best[1], m, k, pdl, layout == "spans")) if win else None
                if got:  # what the pick compiled to as timed (`w4a16_decode.residency_problem` holds launches to it)
                    entry.setdefault("compiled", {})[slot] = {"registers": got[0], "shared": got[1]}
                print(f"{shape:26} M={m} {slot:5}: triton {times[('triton', pdl)]:6.2f} us, gluon {best[0]} "
                      f"{times[(best[0], pdl)]:6.2f} us -> {'gluon' if win else 'triton'}")
            table["decode"].setdefault(f"{n},{k},{GROUP}", {})[str(m)] = entry
        del packs
        torch.cuda.empty_cache()
    text = json.dumps(table, indent=1) + "\n"
    (out_dir / DK.TUNED_PATHS[D.Layout(layout)].name).write_text(text)  # the file name the kernel reads
    if a.write:
        Path(a.write).write_text(text)
        DK._table.cache_clear()


if __name__ == "__main__":
    main()
