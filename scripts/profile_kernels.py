"""Profile the W4A16 dense kernels at decode shapes (scripts/gpu_kernels.sh parts "ncu" and "decompose").

    ncu --clock-control none -k regex:_kernel -s 2 -c 6 --section SpeedOfLight ... python scripts/profile_kernels.py
    python scripts/profile_kernels.py --decompose --out DIR     # where the time of a decode GEMM goes (GPU only)

Default: per shape (N, K) and M, the default PAIRS weights on their chosen config, then the PLANES weights on
theirs (the session-3 kernel), each launched 3 times (the first compiles); ncu skips/profiles by launch count.

--decompose (session 6, kernels/NOTES.md): at M = 1 on the large GLM-5 shapes, the shipped kernel against
variants of its transposed-MMA loop that leave one stage out, all timed as the benchmark times (CUDA-graph
replay over weight copies rotated past L2), so that differences place the time without hardware counters:
    variant            what it leaves out (outputs are wrong except for "same loop")
    same loop          nothing: the shipped loop and split-K fix-up, compiled from this file (control)
    no fix-up          the split-K reduction: partials stored, no ticket, no last-program sum
    no dequant         the nibble unpacking: the raw words go to the tensor cores as operands
    neither            both of the above
    0 chunks           the whole main loop: launch, prologue and fix-up only
    1 / 2 chunks       the main loop shortened to 1 or 2 chunks per program (pipeline fill and first round)
    stream             a loads-only kernel on the same grid (XOR of the words, four chunks in flight)
    torch.amax         torch's reduction over the same words
    add_(1)            a one-element kernel: the launch cost of a graph node

--decode CASE [CASE ...] (session 15): launch the Gluon decode kernels (kernels/w4a16_decode.py) for ncu, each
case `N,K,M,TAG` three times on PAIRS weights (the first compiles), TAG a probe_decode tag (`R16W4D3S4G4`: the
shared-x kernel with split 4, ring 4; `R16W4D3X`: `_decode_kernel` with x_smem; `R16W4D3S4G4/P1`: its timing probe 1,
no split-K fix-up) or `triton` for the Triton kernel on the config `choose_config` picks:
    ncu --clock-control none -k regex:kernel -s 2 -c 1 --section WarpStateStats ... \
        python scripts/profile_kernels.py --decode 6144,12288,16,R16W4D3S4G4

--pdl (session 10): where a chain of `pdl=True` launches gains or loses. On the large shapes at M = 1, 4, 16,
each of a few launch configurations (the chosen one; the ticket fix-up instead of the mailbox; no split-K;
half-width column tiles) timed as the benchmark times, plain and with pdl_mode "late" and "early" (no L2
prefetch), into pdl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from glmq.kernels import w4a16_dense as D

CASES = [(24576, 6144, 16), (6144, 12288, 1), (24576, 6144, 1)]
DECOMPOSE_SHAPES = [("square 8192x8192", 8192, 8192), ("dense 12288->6144", 6144, 12288),
                    ("dense 6144->24576", 24576, 6144)]  # fmt: skip


def random_operands(n: int, k: int, m: int, dev: torch.device):
    """Random packed words, bf16 group-128 scales and bf16 activations of an [n, k] weight at M = m."""
    wp = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    ws = (torch.rand(n, k // 128, device=dev) * 0.01 + 0.002).to(torch.bfloat16)
    return wp, ws, torch.randn(m, k, device=dev).to(torch.bfloat16)


def ncu_cases() -> int:
    dev = torch.device("cuda")
    for n, k, m in CASES:
        wp, ws, x = random_operands(n, k, m, dev)
        for layout, cm in ((D.Layout.PAIRS, True), (D.Layout.PLANES, False)):
            w = D.prepack(wp, ws, 128, layout, cm)
            cfg = D.choose_config(m, n, k, 128, D.sm_count(dev), D.device_name(dev), layout)
            print(f"N={n} K={k} M={m} {layout.value}: {cfg}", file=sys.stderr, flush=True)
            for _ in range(3):
                D.w4a16_matmul_packed(x, w, config=cfg)
            torch.cuda.synchronize()
    return 0


def ncu_decode(cases: list[str]) -> int:
    from glmq.kernels import w4a16_decode as DK
    from probe_decode import parse_probe_tag  # scripts/ is on sys.path when this runs as a script

    dev = torch.device("cuda")
    for case in cases:
        n, k, m, tag = case.split(",")
        n, k, m = int(n), int(k), int(m)
        wp, ws, x = random_operands(n, k, m, dev)
        w = D.prepack(wp, ws, 128, D.Layout.PAIRS)
        out = torch.empty(m, n, device=dev, dtype=x.dtype)
        if tag == "triton":
            cfg = D.choose_config(m, n, k, 128, D.sm_count(dev), D.device_name(dev), D.Layout.PAIRS)
            fn = lambda: D.w4a16_matmul_packed(x, w, config=cfg)  # noqa: E731
        else:
            cfg, probe = parse_probe_tag(tag)
            fn = lambda: DK.decode_matmul(x, w, out, cfg, probe=probe)  # noqa: E731
        print(f"N={n} K={k} M={m} {tag}: {cfg}", file=sys.stderr, flush=True)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return 0


# ---- decomposition variants (diagnostics only: not library code paths) -------------------------------


_RAW = tl.constexpr(D._raw_words_asm())


@triton.jit
def _raw_operand(words, like):
    BN: tl.constexpr = words.shape[0]
    e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
        _RAW, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
        dtype=(like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype, like.dtype),
        is_pure=True, pack=1)  # fmt: skip
    w = tl.join(tl.join(tl.join(tl.reshape(e0, [BN, 4, 4]), tl.reshape(e4, [BN, 4, 4])),
                        tl.join(tl.reshape(e1, [BN, 4, 4]), tl.reshape(e5, [BN, 4, 4]))),
                tl.join(tl.join(tl.reshape(e2, [BN, 4, 4]), tl.reshape(e6, [BN, 4, 4])),
                        tl.join(tl.reshape(e3, [BN, 4, 4]), tl.reshape(e7, [BN, 4, 4]))))  # fmt: skip
    return tl.reshape(tl.permute(w, (0, 2, 5, 4, 1, 3)), [BN, 128])


@triton.jit
def _decompose_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, chunks_per_split, num_chunks, split_k, stride_wc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DEQ: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    """`_mma_swap_kernel`'s one-token-tile PAIRS path (M < BLOCK_M), with the dequantization (DEQ) and the
    split-K fix-up (FIXUP) as switches."""
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    r128 = tl.arange(0, 128)
    xt_ptrs = x_ptr + rm[None, :] * stride_xm + r128[:, None]
    rn_in = tl.minimum(rn, N - 1)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + r16[None, :]
    s_ptrs = s_ptr + rn_in * stride_sn
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    s0 = tl.load(s_ptrs + c_lo, mask=rn * 0 + c_lo < c_hi, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c in range(c_lo, c_hi):
        words = tl.load(w_ptrs + c * stride_wc)
        xt = tl.load(xt_ptrs + c * 128, mask=(rm < M)[None, :], other=0.0)
        n0 = tl.load(s_ptrs + c + 1, mask=rn * 0 + c + 1 < c_hi, other=0.0).to(tl.float32)
        if DEQ:
            acc = D._pairs_chunk_dot(words, s0, xt, acc, True, False)
        else:
            acc += tl.dot(_raw_operand(words, xt), xt, tl.zeros_like(acc)) * s0[:, None]
        s0 = n0
    if FIXUP:
        D._write_tile(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_om, tile, pid_k, split_k, SPLIT)
    else:
        mask = (rm[None, :] < M) & (rn[:, None] < N)
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, stride_wn, chunks_per_split, num_chunks, stride_wc, BLOCK_N: tl.constexpr):
    """Loads only, on the GEMM's grid: XOR of each program's words, four chunks in flight."""
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    w_ptrs = w_ptr + tl.minimum(rn, N - 1)[:, None] * stride_wn + r16[None, :]
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
    for c in range(c_lo, c_hi, 4):
        a0 = tl.load(w_ptrs + c * stride_wc)
        a1 = tl.load(w_ptrs + (c + 1) * stride_wc, mask=r16[None, :] * 0 + c + 1 < c_hi, other=0)
        a2 = tl.load(w_ptrs + (c + 2) * stride_wc, mask=r16[None, :] * 0 + c + 2 < c_hi, other=0)
        a3 = tl.load(w_ptrs + (c + 3) * stride_wc, mask=r16[None, :] * 0 + c + 3 < c_hi, other=0)
        acc ^= (a0 ^ a1) ^ (a2 ^ a3)
    tl.store(out_ptr + (pid_k * tl.num_programs(0) + tile) * BLOCK_N + tl.arange(0, BLOCK_N), tl.xor_sum(acc, 1))


def _variant(x, w, out, cfg, deq=True, fixup=True, per=None, chunks=None):
    m, k = x.shape
    nch = k // 128
    p = -(-nch // cfg.split_k)
    split = -(-nch // p)
    tiles = -(-w.n // cfg.block_n)
    scratch = torch.empty(split, m, w.n, dtype=torch.float32, device=x.device)
    swn, swc = w.word_strides()
    _decompose_kernel[(tiles, split)](
        x, w.qweight, w.scale, out, scratch, D._tickets(x.device, tiles), m, w.n, x.stride(0), swn, w.scale.stride(0),
        out.stride(0), p if per is None else per, nch if chunks is None else chunks, split, swc,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=split > 1, DEQ=deq, FIXUP=fixup,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    return out


def _stream(w, sink, cfg, k):
    nch = k // 128
    p = -(-nch // cfg.split_k)
    split = -(-nch // p)
    tiles = -(-w.n // cfg.block_n)
    swn, swc = w.word_strides()
    _stream_kernel[(tiles, split)](w.qweight, sink, w.n, swn, p, nch, swc, BLOCK_N=cfg.block_n,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip


def decompose(out_dir: Path) -> int:
    from glmq.kernels import reference as R
    from glmq.scripts.bench_kernels import Bench, random_int4, rel_err

    dev = torch.device("cuda")
    b = Bench(dev, 1e9, False, False, None)
    rows = []

    def rec(shape, name, us, floor, note=""):
        rows.append(dict(shape=shape, m=1, variant=name, us=us, read_floor_us=floor, note=note))
        print(f"{shape:20s} {name:22s} {us:8.2f} us  {100 * floor / us:5.1f}% of the read floor  {note}", flush=True)

    sink = torch.empty(1 << 22, dtype=torch.int32, device=dev)
    for shape, n, k in DECOMPOSE_SHAPES:
        wp, ws = random_int4(n, k, device=dev, seed=1)
        nbytes = wp.numel() * 4 + ws.numel() * 2
        floor = nbytes / b.read_rate * 1e6
        packs = [D.prepack(wp, ws, 128)] + [D.prepack(wp.clone(), ws.clone(), 128) for _ in range(b.copies(nbytes) - 1)]
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        ref = x.float() @ R.dequantize_packed(wp, ws, 128).T
        cfg = D.choose_config(1, n, k, 128, D.sm_count(dev), D.device_name(dev), D.Layout.PAIRS)
        note = f"block_n {cfg.block_n} split {cfg.split_k} stages {cfg.num_stages}"
        us, _ = b.time_us([lambda p=p: D.w4a16_matmul_packed(x, p) for p in packs])
        rec(shape, "glmq", us, floor, note)
        outs = [torch.empty(1, n, dtype=x.dtype, device=dev) for _ in packs]
        for name, kw in [("same loop", {}), ("no fix-up", dict(fixup=False)), ("no dequant", dict(deq=False)),
                         ("neither", dict(deq=False, fixup=False)), ("0 chunks", dict(chunks=0)),
                         ("1 chunk", dict(per=1)), ("2 chunks", dict(per=2))]:  # fmt: skip
            y = _variant(x, packs[0], outs[0], cfg, **kw)
            err = f"rel err {rel_err(y, ref):.1e}" if not kw else ""
            us, _ = b.time_us([lambda p=p, o=o: _variant(x, p, o, cfg, **kw) for p, o in zip(packs, outs)])
            rec(shape, name, us, floor, err)
        us, _ = b.time_us([lambda p=p: _stream(p, sink, cfg, k) for p in packs])
        rec(shape, "stream", us, floor)
        us, _ = b.time_us([lambda p=p: torch.amax(p.qweight) for p in packs])
        rec(shape, "torch.amax", us, floor)
        del packs
        torch.cuda.empty_cache()
    e = torch.empty(1, device=dev)
    us, _ = b.time_us([lambda: e.add_(1)])
    rec("one element", "add_(1)", us, 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(dev), "triton": triton.__version__, "torch": torch.__version__,
           "read_rate_TBps": round(b.read_rate / 1e12, 3)}  # fmt: skip
    (out_dir / "decompose.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


PDL_SHAPES = [("dense 6144->24576", 24576, 6144), ("dense 12288->6144", 6144, 12288)]


def pdl_probe(out_dir: Path) -> int:
    import dataclasses

    from glmq.scripts.bench_kernels import Bench, random_int4

    dev = torch.device("cuda")
    b = Bench(dev, 1e9, False, False, None)
    rows = []
    for shape, n, k in PDL_SHAPES:
        wp, ws = random_int4(n, k, device=dev, seed=1)
        nbytes = wp.numel() * 4 + ws.numel() * 2
        packs = [D.prepack(wp, ws, 128)] + [D.prepack(wp.clone(), ws.clone(), 128) for _ in range(b.copies(nbytes) - 1)]
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            cfg = D.choose_config(m, n, k, 128, D.sm_count(dev), D.device_name(dev), D.Layout.PAIRS)
            variants = {"chosen": cfg, "split 1": dataclasses.replace(cfg, split_k=1),
                        "block_n 64": dataclasses.replace(cfg, block_n=64)}  # fmt: skip
            if m == 1:
                variants["ticket"] = dataclasses.replace(cfg, mailbox=False)
            for name, c in variants.items():
                for mode in ("plain", "late", "early"):
                    cc = dataclasses.replace(c, pdl_mode="late" if mode == "plain" else mode, pdl_prefetch=0)
                    us, _ = b.time_us([lambda p=p, cc=cc: D.w4a16_matmul_packed(x, p, config=cc, pdl=mode != "plain")
                                       for p in packs])  # fmt: skip
                    rows.append(dict(shape=shape, m=m, variant=name, pdl=mode, us=us,
                                     config=f"block_n {c.block_n} split {c.split_k} stages {c.num_stages} mailbox {c.mailbox}"))
                    print(f"{shape:20s} M={m:<3d} {name:12s} {mode:6s} {us:8.2f} us", flush=True)
        del packs
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(dev), "triton": triton.__version__, "torch": torch.__version__}
    (out_dir / "pdl.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decompose", action="store_true", help="time the stage-dropping variants (see the docstring)")
    ap.add_argument("--pdl", action="store_true", help="time plain against PDL chains per config (see the docstring)")
    ap.add_argument("--decode", nargs="+", metavar="N,K,M,TAG",
                    help="launch decode kernels for ncu (see the docstring)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "profile-out")))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    if args.pdl:
        return pdl_probe(args.out)
    if args.decode:
        return ncu_decode(args.decode)
    return decompose(args.out) if args.decompose else ncu_cases()


if __name__ == "__main__":
    sys.exit(main())
