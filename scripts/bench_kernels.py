"""Benchmark glmq's W4A16 Triton kernels on one GPU at GLM-5 shapes, against cuBLAS, tinygemm and the
bandwidth floor.

    pip install --no-deps -e .          # makes the checkout importable as `glmq`
    python scripts/bench_kernels.py --out DIR          # ~3-5 minutes on one H200
    python scripts/bench_kernels.py --smoke --out DIR  # CPU self-test of this script (interpreter, tiny shapes)

What is timed (symmetric int4, group 128, bf16 activations and scales):
  dense   y = x @ W.T for [N, K] in {6144->24576, 12288->6144, the expert's 6144->2*2048 and 2048->6144}
          at M in {1, 4, 16, 64, 256, 2048}, plus 8192x8192 at M = 1 (seen on H200 before: floor ~8.3 us,
          cuBLAS ~45-49 us, _weight_int4pack_mm ~25 us):
            glmq        glmq.kernels.w4a16_dense.w4a16_matmul on the compressed-tensors tensors (prepacked on
                        the first, untimed call and cached, as a serving engine repacks at load)
            glmq-pdl    the same calls with pdl=True: each launch a programmatic dependent of the one before
                        (the chain of a decode step whose kernels all opt in; cuBLAS and tinygemm do not)
            glmq-pdl-pfN-WHEN  (--pdl-variants N:WHEN ..., M <= 64) glmq-pdl with DenseConfig.pdl_prefetch = N
                        and pdl_mode = WHEN ("early" or "late"); glmq-pdl itself takes pdl_mode "auto"
            glmq-spans (-pdl)  the same on weights prepacked in the SPANS layout (`prepack(..., layout="spans")`:
                        the Gluon decode kernel loads x 16 bytes at a time; the Triton kernel permutes x, in
                        registers up to M = 16, by a copy kernel above), with its own tuned table
                        (kernels/tuned_decode_spans.json)
            glmq-triton (-pdl)  at M <= 16: the Triton kernel alone (the config choose_config picks), beside
                        glmq, which may take the Gluon decode kernel (kernels/w4a16_decode.py, its tuned table)
            glmq-ticket the same launch at M = 1 with the split-K partials reduced by the last-arriver ticket
                        (DenseConfig.mailbox=False, the session-5 epilogue) instead of the mailbox
            cublas-fp16 / cublas-bf16   torch.nn.functional.linear with the dequantized weight
            int4pack    torch._weight_int4pack_mm (tinygemm) with its own packing
                        (torch._convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles=8), scales and zeros
                        [K/g, N, 2] bf16; x must be bf16); recorded "unavailable" with the reason if it fails
            floor       (packed + scale bytes) / measured device-to-device copy rate (read + write counted)
            read floor  the same bytes / measured streaming-read rate (a large torch.amax): the stricter one
  moe     GLM-5 routed experts: E = 256, H = 6144, I = 2048, top-8, at the same M:
            glmq-fused        fused_moe_w4a16 (alignment included)
            glmq-kernels      its two grouped GEMM launches + the top-k sum, alignment precomputed
            bf16-grouped      gather + torch._grouped_mm (gate_up) + SiLU*up + torch._grouped_mm (down) + weighted
                              index_add, routing metadata precomputed (not timed)
            bf16-loop         the same per active expert with torch.matmul (M <= 16 only)
            floor             packed + scale bytes of the experts the routing touches / copy rate

Method: every implementation is checked against glmq.kernels.reference first (a wrong result is
recorded and not timed). Timing replays a CUDA graph of `inner` rounds over R copies of the weights
(R chosen so that the copies together are >= 4x the L2 cache, however small one copy is, so no call
finds its weights in L2), after a warm-up; the median of 15 replays divided by the calls per replay
is reported in microseconds. The graph removes Python launch overhead, as a serving engine's decode
graphs do. If capture fails, the same loop is timed eagerly with CUDA events (the "mode" field says
which). Launch configurations come from kernels/tuned_configs.json (scripts/tune_kernels.py) when it
was tuned on this GPU; nothing is tuned inside the timed region.

Outputs in --out (default $OUT, else ./bench-out): bench_kernels.json, bench_kernels.md, bench_kernels.png
(if matplotlib imports).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("bench_kernels")

GROUP = 128
M_LIST = (1, 4, 16, 64, 256, 2048)
DENSE = {  # name -> (N, K); "large" shapes carry the >= 3x cuBLAS target
    "dense 6144->24576": (24576, 6144),
    "dense 12288->6144": (6144, 12288),
    "expert w13 6144->2x2048": (4096, 6144),
    "expert w2 2048->6144": (6144, 2048),
}
LARGE = ("dense 6144->24576", "dense 12288->6144", "square 8192x8192")
SQUARE = ("square 8192x8192", 8192, 8192)
MOE = dict(experts=256, hidden=6144, inter=2048, topk=8)
SMOKE_DENSE = {"smoke 256->96": (96, 256), "smoke 128->64": (64, 128)}
SMOKE_SQUARE = ("smoke square 128", 128, 128)
SMOKE_MOE = dict(experts=8, hidden=256, inter=128, topk=2)
SMOKE_M = (1, 3, 17)
REL_TOL = 3e-2  # bf16 output: a few ulps (2^-8) of max|ref|; layout bugs give O(1) errors


@dataclasses.dataclass
class Record:
    op: str  # "dense" | "moe" | "copy"
    shape: str
    m: int
    impl: str
    status: str = "ok"  # ok | wrong | unavailable | skipped
    us: float | None = None
    rel_err: float | None = None
    mode: str = ""
    note: str = ""
    bytes_moved: int | None = None
    flops: float | None = None


class Bench:
    """Timing and bookkeeping for one run."""

    def __init__(self, device: torch.device, budget_s: float, smoke: bool, compare_planes: bool = True,
                 prev_table: dict | None = None, pdl_variants: tuple[str, ...] = (), spans: bool = True):
        self.device = device
        self.spans = spans  # also time the dense GEMMs on SPANS-layout weights (glmq-spans, glmq-spans-pdl)
        self.pdl_variants = pdl_variants  # extra glmq-pdl variants ("PREFETCH:early|late") at M <= 64
        self.cuda = device.type == "cuda"
        self.deadline = time.monotonic() + budget_s
        self.smoke = smoke
        self.compare_planes = compare_planes  # also time the session-3 kernel (PLANES weights) at M <= 64
        self.prev_table = prev_table  # an earlier launch table (--prev-table): its PAIRS configs at M <= 64
        self.records: list[Record] = []
        props = torch.cuda.get_device_properties(device) if self.cuda else None
        self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20) if props else 50 << 20
        self.copy_rate = self.measure_copy_rate()
        self.read_rate = self.measure_read_rate()

    # ---- timing ---------------------------------------------------------------------------------

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def copies(self, bytes_per_copy: int) -> int:
        """Weight copies to rotate through so that consecutive calls miss L2 (together >= 4x L2; 2 on CPU)."""
        if not self.cuda:
            return 2
        return max(1, min(64, math.ceil(4 * self.l2_bytes / max(bytes_per_copy, 1))))

    def time_us(self, calls: list[Callable[[], object]]) -> tuple[float, str]:
        """Median microseconds per call of `calls` (run round-robin)."""
        if not self.cuda:
            for c in calls:
                c()
            t0 = time.perf_counter()
            for c in calls:
                c()
            return (time.perf_counter() - t0) * 1e6 / len(calls), "cpu-wall"
        try:
            return self._graph_us(calls), "cuda-graph"
        except Exception as exc:  # capture can fail for ops that sync or allocate on the host
            log.warning("graph capture failed (%s); timing eagerly", exc)
            torch.cuda.synchronize()
            return self._eager_us(calls), "eager-events"

    def _rounds_for(self, calls, target_ms: float) -> int:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for c in calls:
            c()
        end.record()
        end.synchronize()
        return max(1, min(200, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3))))

    def _graph_us(self, calls) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (JIT, allocator) on the capture stream
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        rounds = self._rounds_for(calls, target_ms=5.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for c in calls:
                    c()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(15):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return statistics.median(times) * 1e3 / (rounds * len(calls))

    def _eager_us(self, calls) -> float:
        for c in calls:
            c()
        rounds = self._rounds_for(calls, target_ms=5.0)
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(15):
            start.record()
            for _ in range(rounds):
                for c in calls:
                    c()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times) * 1e3 / (rounds * len(calls))

    def measure_copy_rate(self) -> float:
        """Device-to-device copy rate in bytes/s, counting read + write (the floor's denominator)."""
        # fp32 elements (a 1-byte dtype ran at 2.7 TB/s on H200, against ~4.3 TB/s for wider ones)
        n = (1 << 28) if self.cuda else (1 << 22)
        src = torch.randn(n, device=self.device)
        dst = torch.empty_like(src)
        us, mode = self.time_us([lambda: dst.copy_(src)])
        rate = 2 * 4 * n / (us * 1e-6)
        self.records.append(Record("copy", f"{4 * n >> 20} MiB", 0, "d2d-copy", us=us, mode=mode, bytes_moved=8 * n))
        log.info("device-to-device copy: %.1f us for %d MiB -> %.2f TB/s (read + write)", us, 4 * n >> 20, rate / 1e12)
        del src, dst
        return rate

    def measure_read_rate(self) -> float:
        """Streaming-read rate in bytes/s (torch.amax over 1 GiB of fp32): the floor of a read-bound kernel."""
        n = (1 << 28) if self.cuda else (1 << 20)
        src = torch.randn(n, device=self.device)
        us, mode = self.time_us([lambda: torch.amax(src)])
        rate = 4 * n / (us * 1e-6)
        self.records.append(Record("copy", f"{4 * n >> 20} MiB", 0, "read-amax", us=us, mode=mode, bytes_moved=4 * n))
        log.info("streaming read (amax): %.1f us for %d MiB -> %.2f TB/s", us, 4 * n >> 20, rate / 1e12)
        del src
        return rate

    # ---- bookkeeping -----------------------------------------------------------------------------

    def run(self, op, shape, m, impl, make: Callable[[], tuple[list[Callable], torch.Tensor]], ref, nbytes=None,
            flops=None, note: str | Callable[[], str] = "") -> Record:  # fmt: skip
        """Build an implementation (`make` -> (calls, first output)), check it against `ref`, time it. A callable
        `note` is read once the calls have run: the config `w4a16_decode.choose` settled on by then is the one timed
        (its residency ladder may give a launch-table pick up after the first launches; BENCHMARKS.md session 45)."""
        rec = Record(op, shape, m, impl, bytes_moved=nbytes, flops=flops)
        self.records.append(rec)
        if self.out_of_time():
            rec.status, rec.note = "skipped", "time budget spent"
            return rec
        try:
            calls, y = make()
        except Exception as exc:  # e.g. torch._weight_int4pack_mm missing for this build or shape
            rec.status, rec.note = "unavailable", f"{type(exc).__name__}: {exc}"[:300]
            log.info("%-28s M=%-5d %-14s unavailable: %s", shape, m, impl, rec.note)
            return rec
        rec.rel_err = rel_err(y, ref)
        if not rec.rel_err < REL_TOL:
            rec.status, rec.note = "wrong", note() if callable(note) else note
            log.error("%-28s M=%-5d %-14s WRONG: rel err %.3g", shape, m, impl, rec.rel_err)
            return rec
        rec.us, rec.mode = self.time_us(calls)
        rec.note = note() if callable(note) else note
        log.info("%-28s M=%-5d %-14s %10.1f us  (err %.1e)", shape, m, impl, rec.us, rec.rel_err)
        return rec

    def floor(self, op, shape, m, nbytes) -> None:
        self.records.append(Record(op, shape, m, "floor", us=nbytes / self.copy_rate * 1e6, bytes_moved=nbytes))
        self.records.append(Record(op, shape, m, "read-floor", us=nbytes / self.read_rate * 1e6, bytes_moved=nbytes))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def random_int4(*shape: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed int4 weight `[..., N, K]`: int32 [..., N, K/8] (uniform nibbles), bf16 scales."""
    *lead, n, k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (*lead, n, k // 8), dtype=torch.int32, device=device, generator=gen)
    scale = (torch.rand(*lead, n, k // GROUP, device=device, generator=gen) * 0.01 + 0.002).to(torch.bfloat16)
    return packed, scale


def packed_bytes(wp: torch.Tensor, ws: torch.Tensor) -> int:
    return wp.numel() * wp.element_size() + ws.numel() * ws.element_size()


# ---- dense ----------------------------------------------------------------------------------------


def dense_config_note(b: Bench, m: int, n: int, k: int, layout=None, pdl: bool = False, packed=None) -> str:
    """The launch configuration `w4a16_matmul` picks for this call (the Gluon decode kernel's table or rule, else
    the Triton kernels' tuned table or heuristic)."""
    from glmq.kernels import w4a16_dense as D

    layout = D.default_layout(D.chunk_for(k), GROUP) if layout is None else D.Layout(layout)
    if packed is not None and b.cuda:
        from glmq.kernels import w4a16_decode as DK

        dcfg = DK.choose(m, packed, b.device, D.device_name(b.device), pdl)
        if dcfg is not None:
            return f"gluon decode config {compact(dcfg)}"
    cfg = D.choose_config(m, n, k, GROUP, D.sm_count(b.device), D.device_name(b.device), layout)
    return f"{layout.value} config {compact(cfg)}"


def prev_config(b: Bench, m: int, n: int, k: int):
    """The PAIRS config the --prev-table held for this shape and M (smallest tuned M >= m), or None."""
    from glmq.kernels import w4a16_dense as D

    rows = ((b.prev_table or {}).get("pairs", {}).get("dense", {}) if b.cuda else {}).get(f"{n},{k},{GROUP}")
    if not rows:
        return None
    ms = sorted(int(v) for v in rows)
    return D.DenseConfig(**rows[str(next((v for v in ms if v >= m), ms[-1]))])


def compact(cfg) -> str:
    """A launch config as 'field=value' for the fields that differ from the defaults (tiles always)."""
    keep = ("kind", "block_m", "block_n", "block_n_up", "block_n_down", "split_k", "rows", "warps", "depth")
    parts = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        v = getattr(v, "value", v)
        if f.name in keep or v != f.default:
            parts.append(f"{f.name}={v}")
    return " ".join(parts)


def int4pack_weights(wp: torch.Tensor, ws: torch.Tensor):
    """compressed-tensors int4 -> tinygemm's (_convert_weight_to_int4pack, [K/g, N, 2] scales+zeros).

    tinygemm dequantizes w = (u - 8) * scale + zero (aten/src/ATen/native/cuda/int4mm.cu), so zero = 0
    reproduces the symmetric format. Its uint8 input holds k = 2i in the high nibble of byte i;
    compressed-tensors' little-endian words hold it in the low nibble, hence the swap.
    """
    u8 = wp.contiguous().view(torch.uint8)  # (N, K/2): low nibble = even k
    swapped = ((u8 & 0xF) << 4) | (u8 >> 4)
    w4 = torch._convert_weight_to_int4pack(swapped.contiguous(), 8)
    sz = torch.stack([ws.to(torch.bfloat16), torch.zeros_like(ws, dtype=torch.bfloat16)], dim=-1)
    return w4, sz.transpose(0, 1).contiguous()


def bench_dense(b: Bench, shape: str, n: int, k: int, ms, seed: int) -> None:
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_dense as D
    from glmq.kernels.w4a16_dense import w4a16_matmul

    wp, ws = random_int4(n, k, device=b.device, seed=seed)
    w32 = R.dequantize_packed(wp, ws, GROUP)  # (N, K) fp32: the reference weight
    nbytes = packed_bytes(wp, ws)
    # Weight copies, built once per shape and rotated so that no call finds its weights in L2.
    ours_w = [(wp, ws)] + [(wp.clone(), ws.clone()) for _ in range(b.copies(nbytes) - 1)]
    w16 = {dt: [w32.to(dt) for _ in range(b.copies(n * k * 2))] for dt in (torch.float16, torch.bfloat16)}
    try:
        packs = [int4pack_weights(p, s) for p, s in ours_w]
    except Exception as exc:  # recorded per M below
        packs = exc
    for m in ms:
        if b.out_of_time():
            break
        x = torch.randn(m, k, device=b.device).to(torch.bfloat16)
        ref = x.float() @ w32.T
        flops = 2.0 * m * n * k
        b.floor("dense", shape, m, nbytes)

        def ours(config=None):
            return ([lambda p=p, s=s: w4a16_matmul(x, p, s, GROUP, config=config) for p, s in ours_w],
                    w4a16_matmul(x, wp, ws, GROUP, config=config))  # fmt: skip

        packed0 = D.cached_prepack(wp, ws, GROUP)
        b.run("dense", shape, m, "glmq", ours, ref, nbytes, flops,
              note=lambda: dense_config_note(b, m, n, k, packed=packed0))
        cfg = D.choose_config(m, n, k, GROUP, D.sm_count(b.device), D.device_name(b.device),
                              D.default_layout(D.chunk_for(k), GROUP))  # fmt: skip

        def chained(config=None):
            return ([lambda p=p, s=s: w4a16_matmul(x, p, s, GROUP, config=config, pdl=True) for p, s in ours_w],
                    w4a16_matmul(x, wp, ws, GROUP, config=config, pdl=True))  # fmt: skip

        b.run("dense", shape, m, "glmq-pdl", chained, ref, nbytes, flops,
              note=lambda: dense_config_note(b, m, n, k, pdl=True, packed=packed0) + "; pdl=True (programmatic dependent launches)")  # fmt: skip
        if b.spans:
            spans_w = [D.cached_prepack(p, s, GROUP, D.Layout.SPANS) for p, s in ours_w]

            def spans(pdl=False):
                return ([lambda w=w: D.w4a16_matmul_packed(x, w, pdl=pdl) for w in spans_w],
                        D.w4a16_matmul_packed(x, spans_w[0], pdl=pdl))  # fmt: skip

            for impl, pdl in (("glmq-spans", False), ("glmq-spans-pdl", True)):
                b.run("dense", shape, m, impl, lambda pdl=pdl: spans(pdl), ref, nbytes, flops,
                      note=lambda pdl=pdl: dense_config_note(b, m, n, k, D.Layout.SPANS, pdl=pdl, packed=spans_w[0])
                      + ("; pdl=True" if pdl else ""))  # fmt: skip
            del spans_w
        if m <= 16 and b.cuda and cfg.swap:  # the Triton kernel alone, where the Gluon decode kernel may be chosen
            b.run("dense", shape, m, "glmq-triton", lambda: ours(cfg), ref, nbytes, flops,
                  note=f"pairs config {compact(cfg)}; the Triton kernel (no Gluon decode kernel)")  # fmt: skip
            b.run("dense", shape, m, "glmq-triton-pdl", lambda: chained(cfg), ref, nbytes, flops,
                  note=f"pairs config {compact(cfg)}; the Triton kernel, pdl=True")  # fmt: skip
        for variant in b.pdl_variants if m <= 64 and cfg.swap else ():
            pf, when = variant.split(":")
            pcfg = dataclasses.replace(cfg, pdl_prefetch=int(pf), pdl_mode=when)
            b.run("dense", shape, m, f"glmq-pdl-pf{pf}-{when}", lambda pcfg=pcfg: chained(pcfg), ref, nbytes, flops,
                  note=f"config {compact(pcfg)}; pdl=True")  # fmt: skip
        if m == 1 and cfg.swap and cfg.split_k > 1:  # the same launch with the ticket fix-up (the session-5 kernel)
            ticket = D.DenseConfig(**{**cfg.to_dict(), "mailbox": False})

            def ticket_fixup(ticket=ticket):
                return ([lambda p=p, s=s: w4a16_matmul(x, p, s, GROUP, config=ticket) for p, s in ours_w],
                        w4a16_matmul(x, wp, ws, GROUP, config=ticket))  # fmt: skip

            b.run("dense", shape, m, "glmq-ticket", ticket_fixup, ref, nbytes, flops,
                  note=f"pairs config {compact(ticket)}; split-K through the last-arriver ticket")  # fmt: skip
        prev = prev_config(b, m, n, k)
        if prev is not None and m <= 64:

            def previous(prev=prev):
                return ([lambda p=p, s=s: w4a16_matmul(x, p, s, GROUP, config=prev) for p, s in ours_w],
                        w4a16_matmul(x, wp, ws, GROUP, config=prev))  # fmt: skip

            b.run("dense", shape, m, "glmq-prev", previous, ref, nbytes, flops,
                  note=f"pairs config {compact(prev)}; the previous launch table")  # fmt: skip
        if b.compare_planes and m <= 64:

            def planes():
                ws_p = [D.cached_prepack(p, s, GROUP, D.Layout.PLANES, False) for p, s in ours_w]
                return [lambda w=w: D.w4a16_matmul_packed(x, w) for w in ws_p], D.w4a16_matmul_packed(x, ws_p[0])

            b.run("dense", shape, m, "glmq-planes", planes, ref, nbytes, flops,
                  note=dense_config_note(b, m, n, k, D.Layout.PLANES) + "; the session-3 kernel")  # fmt: skip
        for dt, name in ((torch.float16, "cublas-fp16"), (torch.bfloat16, "cublas-bf16")):

            def cublas(dt=dt):
                xd = x.to(dt)
                return [lambda w=w: F.linear(xd, w) for w in w16[dt]], F.linear(xd, w16[dt][0])

            b.run("dense", shape, m, name, cublas, ref, n * k * 2, flops)

        def int4pack():
            if isinstance(packs, Exception):
                raise packs
            fns = [lambda w=w, s=s: torch._weight_int4pack_mm(x, w, GROUP, s) for w, s in packs]
            return fns, fns[0]()

        b.run("dense", shape, m, "int4pack", int4pack, ref, nbytes, flops)
    del ours_w, w16, packs, w32
    if b.cuda:
        torch.cuda.empty_cache()


# ---- MoE ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Routing:
    x: torch.Tensor  # (M, H) bf16
    weights: torch.Tensor  # (M, topk) fp32
    ids: torch.Tensor  # (M, topk) int64
    token_of_sorted: torch.Tensor  # (T,) token of each assignment, grouped by expert
    weight_of_sorted: torch.Tensor  # (T,) its router weight
    offs: torch.Tensor  # (E,) int32 cumulative rows per expert (torch._grouped_mm)
    experts_touched: int

    def per_expert(self) -> list:
        """[(e, token indices, router weights)] of the active experts, for the loop baseline (syncs)."""
        out = []
        for e in torch.unique(self.ids).tolist():
            tok, slot = torch.nonzero(self.ids == e, as_tuple=True)
            out.append((e, tok, self.weights[tok, slot]))
        return out


def make_routing(m: int, cfg: dict, device, seed: int) -> Routing:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, cfg["hidden"], device=device, generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, cfg["experts"], device=device, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(cfg["topk"], dim=-1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg["experts"])
    return Routing(
        x, weights, ids, order // cfg["topk"], weights.reshape(-1)[order], counts.cumsum(0).to(torch.int32),
        int((counts > 0).sum()),
    )  # fmt: skip


def bf16_grouped(r: Routing, w13_t, w2_t, inter: int):
    xs = r.x.index_select(0, r.token_of_sorted)
    gu = torch._grouped_mm(xs, w13_t, offs=r.offs)  # (T, 2I)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(h, w2_t, offs=r.offs) * r.weight_of_sorted[:, None].to(h.dtype)
    return torch.zeros_like(r.x).index_add_(0, r.token_of_sorted, y)


def bf16_loop(r: Routing, plan: list, w13, w2, inter: int):
    out = torch.zeros_like(r.x, dtype=torch.float32)
    for e, tok, wt in plan:
        gu = r.x[tok] @ w13[e].T
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (h @ w2[e].T).float() * wt[:, None])
    return out.to(r.x.dtype)


def bench_moe(b: Bench, cfg: dict, ms, seed: int) -> None:
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_moe as MO

    e_, h_, i_, topk = cfg["experts"], cfg["hidden"], cfg["inter"], cfg["topk"]
    shape = f"moe E={e_} H={h_} I={i_} top{topk}"
    w13p, w13s = random_int4(e_, 2 * i_, h_, device=b.device, seed=seed)
    w2p, w2s = random_int4(e_, h_, i_, device=b.device, seed=seed + 1)
    # BF16 experts = the same weights dequantized (so both sides compute the same function).
    w13 = torch.empty(e_, 2 * i_, h_, dtype=torch.bfloat16, device=b.device)
    w2 = torch.empty(e_, h_, i_, dtype=torch.bfloat16, device=b.device)
    for e in range(e_):
        w13[e] = R.dequantize_packed(w13p[e], w13s[e], GROUP)
        w2[e] = R.dequantize_packed(w2p[e], w2s[e], GROUP)
    expert_bytes = (packed_bytes(w13p, w13s) + packed_bytes(w2p, w2s)) // e_
    args = (w13p, w13s, w2p, w2s)
    for m in ms:
        if b.out_of_time():
            break
        routes = [make_routing(m, cfg, b.device, seed + 10 * j + m) for j in range(3)]
        r0 = routes[0]
        n_ref = min(m, 8)  # the fp32 reference dequantizes every expert it meets: check a few tokens
        ref_small = R.moe_w4a16_ref(r0.x[:n_ref], *args, r0.ids[:n_ref], r0.weights[:n_ref], GROUP)
        flops = 2.0 * m * topk * 3 * h_ * i_
        b.floor("moe", shape, m, r0.experts_touched * expert_bytes)

        def check(fn):
            def make():
                y = fn(r0)
                return [lambda r=r: fn(r) for r in routes], y[:n_ref]

            return make

        def fused(r):
            return MO.fused_moe_w4a16(r.x, *args, r.weights, r.ids, GROUP)

        layout = MO.Layout.PAIRS if GROUP == MO.MMA_CHUNK else MO.Layout.PLANES
        mcfg = MO.choose_moe_config(m, topk, e_, i_, h_, MO.sm_count(b.device), GROUP, MO.device_name(b.device), layout)
        b.run("moe", shape, m, "glmq-fused", check(fused), ref_small, r0.experts_touched * expert_bytes, flops,
              note=f"{layout.value} config {compact(mcfg)}")  # fmt: skip

        aligned = {id(r): MO.moe_align_block_size(r.ids, mcfg.block_m, e_) for r in routes}
        packed = (MO.cached_prepack(w13p, w13s, GROUP), MO.cached_prepack(w2p, w2s, GROUP))

        def kernels_only(r):
            sorted_ids, expert_ids, nb = aligned[id(r)]
            h = torch.empty(m * topk, i_, dtype=r.x.dtype, device=r.x.device)
            y = torch.empty(m, topk, h_, dtype=r.x.dtype, device=r.x.device)
            MO._launch_experts(r.x, *packed, r.weights, sorted_ids, expert_ids, nb, h, y, mcfg)
            return y.sum(dim=1)

        b.run("moe", shape, m, "glmq-kernels", check(kernels_only), ref_small, None, flops, note="alignment not timed")
        if b.compare_planes and m <= 64:
            planes = tuple(MO.cached_prepack(p, s, GROUP, MO.Layout.PLANES, False) for p, s in ((w13p, w13s), (w2p, w2s)))
            pcfg = MO.choose_moe_config(m, topk, e_, i_, h_, MO.sm_count(b.device), GROUP, MO.device_name(b.device))
            b.run("moe", shape, m, "glmq-planes", check(lambda r: MO.fused_moe_w4a16_packed(r.x, *planes, r.weights, r.ids)),
                  ref_small, r0.experts_touched * expert_bytes, flops,
                  note=f"planes config {compact(pcfg)}; the session-3 kernel")  # fmt: skip
        w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # (E, H, 2I), (E, I, H) views: K-major B
        grouped = b.run("moe", shape, m, "bf16-grouped", check(lambda r: bf16_grouped(r, w13_t, w2_t, i_)), ref_small,
                        None, flops, note="torch._grouped_mm; routing metadata not timed")  # fmt: skip
        if m <= 16 or grouped.status == "unavailable":
            plans = {id(r): r.per_expert() for r in routes}
            b.run("moe", shape, m, "bf16-loop", check(lambda r: bf16_loop(r, plans[id(r)], w13, w2, i_)), ref_small,
                  None, flops, note="matmul per active expert; routing not timed")  # fmt: skip
    del w13, w2


# ---- report ---------------------------------------------------------------------------------------


def index(records: list[Record]) -> dict:
    return {(r.op, r.shape, r.m, r.impl): r for r in records}


def cell(r: Record | None) -> str:
    if r is None:
        return ""
    if r.status == "ok":
        return f"{r.us:.1f}"
    return {"unavailable": "n/a", "skipped": "skip", "wrong": "WRONG"}[r.status]


def speedup(base: Record | None, ours: Record | None) -> float | None:
    if base and ours and base.status == ours.status == "ok":
        return base.us / ours.us
    return None


def fmt_x(v: float | None, pct: bool = False) -> str:
    if v is None:
        return ""
    return f"{100 * v:.0f}%" if pct else f"{v:.2f}x"


def dense_targets(idx: dict, shape: str, m: int, impl: str, tag: str, add) -> None:
    """The dense targets for one shape and M, for `impl` (target names suffixed with `tag`)."""
    ours = idx.get(("dense", shape, m, impl))
    if not ours or ours.status != "ok":
        return
    fp16 = speedup(idx.get(("dense", shape, m, "cublas-fp16")), ours)
    floor = speedup(idx.get(("dense", shape, m, "floor")), ours)
    rfloor = speedup(idx.get(("dense", shape, m, "read-floor")), ours)
    i4 = speedup(idx.get(("dense", shape, m, "int4pack")), ours)
    if m <= 16 and shape in LARGE and fp16 is not None:
        add(">=3x cuBLAS fp16 (M<=16, large)" + tag, fp16 >= 3, f"{shape} M={m}: {fp16:.2f}x")
    if m <= 16 and floor is not None:
        add(">=70% of bandwidth floor (M<=16)" + tag, floor >= 0.7, f"{shape} M={m}: {100 * floor:.0f}% of the copy floor"
            + (f", {100 * rfloor:.0f}% of the read floor" if rfloor is not None else ""))
    if m <= 64 and fp16 is not None:
        add("not slower than cuBLAS fp16 (M<=64)" + tag, fp16 >= 1, f"{shape} M={m}: {fp16:.2f}x")
    if i4 is not None:
        add("faster than _weight_int4pack_mm" + tag, i4 > 1, f"{shape} M={m}: {i4:.2f}x")


def targets(records: list[Record]) -> list[dict]:
    """The GPU-tuning targets, checked against this run."""
    idx = index(records)
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "met": ok, "detail": detail})

    dense_shapes = dict.fromkeys(r.shape for r in records if r.op == "dense")
    for impl, tag in (("glmq", ""), ("glmq-pdl", " [pdl chain]"), ("glmq-spans", " [spans layout]"),
                      ("glmq-spans-pdl", " [spans layout, pdl chain]")):
        for shape in dense_shapes:
            for m in sorted({r.m for r in records if r.shape == shape}):
                dense_targets(idx, shape, m, impl, tag, add)
    for r in records:
        if r.op == "moe" and r.impl == "glmq-fused" and r.status == "ok" and r.m <= 64:
            bases = [idx.get(("moe", r.shape, r.m, b)) for b in ("bf16-grouped", "bf16-loop")]
            best = min((b.us for b in bases if b and b.status == "ok"), default=None)
            if best is not None:
                add("fused MoE >=2.5x BF16 experts (decode)", best / r.us >= 2.5, f"M={r.m}: {best / r.us:.2f}x")
    return out


def markdown(records: list[Record], env: dict) -> str:
    idx = index(records)
    lines = ["# glmq W4A16 kernel benchmark", "", "```", json.dumps(env, indent=1), "```", ""]
    lines += ["Median microseconds per call (CUDA-graph replay, weights rotated past L2). floor = packed+scale",
              "bytes / device-to-device copy rate (read + write); read floor = the same bytes / streaming-read",
              "rate. eff = floor / glmq, eff(read) = read floor / glmq.", ""]  # fmt: skip
    for shape in dict.fromkeys(r.shape for r in records if r.op == "dense"):
        lines += [f"## {shape}", "", "| M | glmq | glmq pdl | spans | spans pdl | Triton kernel | Triton pdl | ticket fix-up | previous table | session-3 kernel | cuBLAS fp16 | cuBLAS bf16 | int4pack | floor | read floor | eff | eff(read) | eff(read) pdl | eff(read) spans (pdl) | vs fp16 | pdl vs fp16 | spans (pdl) vs fp16 | vs int4pack | pdl vs int4pack |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in sorted({r.m for r in records if r.shape == shape}):
            g = lambda impl: idx.get(("dense", shape, m, impl))  # noqa: E731
            lines.append(
                f"| {m} | {cell(g('glmq'))} | {cell(g('glmq-pdl'))} | {cell(g('glmq-spans'))} | {cell(g('glmq-spans-pdl'))} | {cell(g('glmq-triton'))} | {cell(g('glmq-triton-pdl'))} | {cell(g('glmq-ticket'))} | {cell(g('glmq-prev'))} | {cell(g('glmq-planes'))} | {cell(g('cublas-fp16'))} | {cell(g('cublas-bf16'))} | "
                f"{cell(g('int4pack'))} | {cell(g('floor'))} | {cell(g('read-floor'))} | "
                f"{fmt_x(speedup(g('floor'), g('glmq')), True)} | {fmt_x(speedup(g('read-floor'), g('glmq')), True)} | "
                f"{fmt_x(speedup(g('read-floor'), g('glmq-pdl')), True)} | "
                f"{fmt_x(speedup(g('read-floor'), g('glmq-spans')), True)} ({fmt_x(speedup(g('read-floor'), g('glmq-spans-pdl')), True)}) | "
                f"{fmt_x(speedup(g('cublas-fp16'), g('glmq')))} | {fmt_x(speedup(g('cublas-fp16'), g('glmq-pdl')))} | "
                f"{fmt_x(speedup(g('cublas-fp16'), g('glmq-spans')))} ({fmt_x(speedup(g('cublas-fp16'), g('glmq-spans-pdl')))}) | "
                f"{fmt_x(speedup(g('int4pack'), g('glmq')))} | {fmt_x(speedup(g('int4pack'), g('glmq-pdl')))} |"
            )
        lines.append("")
    for shape in dict.fromkeys(r.shape for r in records if r.op == "moe"):
        lines += [f"## {shape}", "", "| M | glmq fused | glmq kernels only | session-3 fused | bf16 grouped | bf16 loop | floor | read floor | eff | eff(read) | vs best bf16 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in sorted({r.m for r in records if r.shape == shape}):
            g = lambda impl: idx.get(("moe", shape, m, impl))  # noqa: E731
            bf = [x for x in (g("bf16-grouped"), g("bf16-loop")) if x and x.status == "ok"]
            best = min(bf, key=lambda x: x.us) if bf else None
            lines.append(
                f"| {m} | {cell(g('glmq-fused'))} | {cell(g('glmq-kernels'))} | {cell(g('glmq-planes'))} | {cell(g('bf16-grouped'))} | "
                f"{cell(g('bf16-loop'))} | {cell(g('floor'))} | {cell(g('read-floor'))} | "
                f"{fmt_x(speedup(g('floor'), g('glmq-fused')), True)} | {fmt_x(speedup(g('read-floor'), g('glmq-fused')), True)} | "
                f"{fmt_x(speedup(best, g('glmq-fused')))} |"
            )
        lines.append("")
    lines += ["## Targets", "", "| target | met | detail |", "|---|---|---|"]
    lines += [f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |" for t in targets(records)]
    cfgs = [r for r in records if r.impl in ("glmq", "glmq-pdl", "glmq-spans", "glmq-spans-pdl", "glmq-ticket", "glmq-prev", "glmq-fused", "glmq-planes")
            and " config " in f" {r.note}"]
    if cfgs:
        lines += ["", "## glmq launch configurations", "", "| shape | M | impl | layout and config |", "|---|---|---|---|"]
        lines += [f"| {r.shape} | {r.m} | {r.impl} | `{r.note}` |" for r in cfgs]
    notes = [r for r in records if r.status in ("unavailable", "wrong")]
    if notes:
        lines += ["", "## Not timed", ""]
        lines += [f"- {r.shape} M={r.m} {r.impl}: {r.status} {r.note or f'rel err {r.rel_err:.3g}'}" for r in notes]
    return "\n".join(lines) + "\n"


def plot(records: list[Record], path: Path) -> bool:
    """One log-log panel per shape: us per call against M (the --pdl-variants runs are left to the table)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not importable: no plot")
        return False
    shapes = list(dict.fromkeys(r.shape for r in records if r.op in ("dense", "moe")))
    cols = 3
    rows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[0::2] + tab20[1::2]  # the ten dark shades first, then their light pairs
    for ax, shape in zip(axes.flat, shapes):
        rs = [r for r in records if r.shape == shape and r.status == "ok" and not r.impl.startswith("glmq-pdl-pf")]
        for j, impl in enumerate(dict.fromkeys(r.impl for r in rs)):
            pts = sorted((r.m, r.us) for r in rs if r.impl == impl)
            ax.plot(*zip(*pts), marker="o", color=colors[j % 20], label=impl,
                    linestyle="--" if impl.endswith("floor") else "-")  # fmt: skip
        ax.set(xscale="log", yscale="log", title=shape, xlabel="M", ylabel="us / call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shapes) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def environment(b: Bench) -> dict:
    import triton

    env = {
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(b.device) if b.cuda else "cpu (TRITON_INTERPRET smoke run)",
        "copy_rate_TBps": round(b.copy_rate / 1e12, 3), "read_rate_TBps": round(b.read_rate / 1e12, 3),
        "l2_MiB": b.l2_bytes >> 20, "group_size": GROUP,
        "activations": "bf16", "scales": "bf16",
    }  # fmt: skip
    if b.cuda:
        from glmq.kernels import w4a16_dense as D

        p = torch.cuda.get_device_properties(b.device)
        table = D._tuned_table(str(D.TUNED_PATH))
        env.update(sms=p.multi_processor_count, cuda=torch.version.cuda,
                   tuned_table=D.table_serves(table, p.name))  # fmt: skip
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")), help="output directory")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new measurements after this")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--no-planes", action="store_true", help="skip the PLANES-layout (session-3) kernel at M <= 64")
    ap.add_argument("--no-spans", action="store_true", help="skip the SPANS-layout columns (glmq-spans, -pdl)")
    ap.add_argument("--m", type=int, nargs="+", help=f"override the M list {M_LIST}")
    ap.add_argument("--prev-table", type=Path, default=None,
                    help="an earlier tuned_configs.json: also time its PAIRS dense configs at M <= 64 ('previous table')")
    ap.add_argument("--pdl-variants", nargs="*", default=[], metavar="PREFETCH:early|late",
                    help="also time pdl=True with these DenseConfig.pdl_prefetch / pdl_mode values at M <= 64")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw --out/bench_kernels.png and .md from an earlier run's bench_kernels.json")
    ap.add_argument("--only", nargs="*", default=None,
                    help="dense shapes to run (names of DENSE, or 'square'); default all")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    if args.replot:
        old = json.loads(args.replot.read_text())
        recs = [Record(**r) for r in old["records"]]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kernels.md").write_text(markdown(recs, old["env"]))
        return 0 if plot(recs, args.out / "bench_kernels.png") else 1
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        ap.error("no CUDA device: run on a GPU, or pass --smoke for a CPU self-test of this script")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before glmq.kernels is imported (bench_* import it lazily)
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    prev = json.loads(args.prev_table.read_text()) if args.prev_table else None
    b = Bench(device, args.budget_s, args.smoke, not args.no_planes, prev, tuple(args.pdl_variants), not args.no_spans)

    square, dense, moe, ms = (SMOKE_SQUARE, SMOKE_DENSE, SMOKE_MOE, SMOKE_M) if args.smoke else (SQUARE, DENSE, MOE, M_LIST)
    ms = tuple(args.m) if args.m else ms
    keep = (lambda name: args.only is None or any(o in name for o in args.only))
    if not args.skip_dense:
        if keep(square[0]):
            bench_dense(b, square[0], square[1], square[2], ms[:1], seed=1)
        for j, (name, (n, k)) in enumerate(dense.items()):
            if keep(name):
                bench_dense(b, name, n, k, ms, seed=10 + j)
    # MoE last: right after its M = 2048 runs (5-7 ms of bf16 tensor-core work per call) the next
    # measurement came out ~20 % slow (H200, 2026-12-01: 6144->24576 at M = 1, one config, 31.1 us
    # after the MoE block against 25.8 us without it; the peer timed next, 27.5 us)
    if not args.skip_moe:
        bench_moe(b, moe, ms, seed=100)

    env = environment(b)
    env["wall_s"] = round(time.monotonic() - t0, 1)
    result = {"env": env, "records": [dataclasses.asdict(r) for r in b.records], "targets": targets(b.records)}
    (args.out / "bench_kernels.json").write_text(json.dumps(result, indent=1))
    (args.out / "bench_kernels.md").write_text(markdown(b.records, env))
    try:
        plotted = plot(b.records, args.out / "bench_kernels.png")
    except Exception as exc:  # the JSON and the table are already written
        log.warning("plot failed: %s", exc)
        plotted = False
    log.info("wrote %s/bench_kernels.{json,md%s} in %.0f s", args.out, ",png" if plotted else "", env["wall_s"])
    bad = [r for r in b.records if r.status == "wrong" and r.impl.startswith("glmq")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
