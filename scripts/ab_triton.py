"""The shared-x decode kernel compiled by another Triton, timed against the installed one (kernels/NOTES.md, session 42).

The device image has Triton 3.6 (torch 2.11's), while glmq's own torch range (<2.14) reaches torch 2.13, which ships
Triton 3.9; a Triton install is ~1 GB, past what a device call can carry. So the other Triton compiles here, for
sm_90, to cubins (`--build`, no GPU needed), and the device loads them with CuPy and launches them with the same
arguments as `w4a16_decode._launch_args` (`--time`), beside the installed Triton's build of the same config and
cuBLAS fp16, in one process, alternating rounds, each timed as `bench_kernels.Bench` times (CUDA-graph replay, weights
rotated past L2). Every cubin's output is first compared with the installed build's and with the float reference.

    python3 scripts/ab_triton.py --build cubins --tags R16W4D3S4G4H R16W4D4S4G4H --shapes 6144,12288 --m 16
    python3 scripts/ab_triton.py --time cubins --rounds 3            # on the GPU (needs cupy)

Hand-written launch: Triton's own launcher is generated per Triton version and cannot load another version's
kernels; a cubin's parameters are the kernel's non-constexpr arguments in order plus Triton's two scratch pointers
(null: the metadata says they are unused; `--build` refuses a kernel where they are not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the int parameters (M, N, strides) the build marks divisible by 16, as Triton's JIT specialises them at launch:
# (positions in the kernel's signature) -> at launch each value is checked
_DIVISIBLE = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11)
_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
        "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wc": "i32", "stride_sn": "i32", "stride_om": "i32"}


def build(out: Path, tags: list[str], shapes: list[tuple[int, int]], ms: list[int]) -> None:
    """Compile each tag's shared-x kernel at each (N, K) and M with the installed Triton into out/*.cubin + *.json."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from glmq.kernels import w4a16_decode as DK
    from probe_decode import parse_tag

    out.mkdir(parents=True, exist_ok=True)
    for tag in tags:
        cfg = parse_tag(tag)
        if not cfg.split:
            raise SystemExit(f"{tag}: only shared-x configs (S<split>) are built")
        for (n, k), m in ((s, m) for s in shapes for m in ms):
            consts = DK._xshared_args(m, k // 128, cfg, True, False, False)
            sig = {**_SIG, **{c: "constexpr" for c in consts}}
            attrs = {(i,): [["tt.divisibility", 16]] for i in _DIVISIBLE}
            kern = triton.compile(GluonASTSource(DK._xshared_kernel, sig, consts, attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.warps})
            md = kern.metadata
            if md.global_scratch_size or getattr(md, "profile_scratch_size", 0):
                raise SystemExit(f"{tag}: the kernel uses Triton's global scratch; this launcher passes none")
            stem = f"{tag}-{n}x{k}-m{m}"
            (out / f"{stem}.cubin").write_bytes(kern.asm["cubin"])
            meta = dict(tag=tag, n=n, k=k, m=m, name=md.name, shared=md.shared, num_warps=md.num_warps,
                        cluster_dims=list(getattr(md, "cluster_dims", None) or [1, 1, 1]),
                        triton=triton.__version__, consts=consts, n_hidden=2)
            (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
            print(f"built {stem} with Triton {triton.__version__}: {md.shared} B shared", flush=True)


class CubinLaunch:
    """One built kernel, launched as `w4a16_decode._launch_args` launches the installed build."""

    def __init__(self, meta: dict, cubin: Path):
        import cupy as cp

        from probe_decode import parse_tag

        self.meta, self.cfg = meta, parse_tag(meta["tag"])
        self.fn = cp.RawModule(path=str(cubin)).get_function(meta["name"])
        if meta["shared"] > 48 << 10:
            self.fn.max_dynamic_shared_size_bytes = meta["shared"]

    def __call__(self, x, w, out):
        import cupy as cp
        import numpy as np
        import torch

        from glmq.kernels.w4a16_dense import _tickets

        m, k = x.shape
        cfg = self.cfg
        blocks = -(-w.n // (cfg.warps * cfg.rows))
        _, stride_wc = w.word_strides()
        if cfg.split > 1:
            scratch = torch.empty(cfg.split, m, w.n, dtype=torch.float32, device=x.device)
            tickets = _tickets(x.device, blocks)
        else:
            scratch = tickets = out
        ptrs = [x.data_ptr(), w.qweight.data_ptr(), w.scale.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                tickets.data_ptr()]
        ints = [m, w.n, x.stride(0), stride_wc, w.scale.stride(0), out.stride(0)]
        for i, v in enumerate(ptrs + ints):
            if i in _DIVISIBLE and v % 16:
                raise ValueError(f"argument {i} = {v} is not divisible by 16, as the build assumed")
        args = tuple(np.uint64(p) for p in ptrs) + tuple(np.int32(v) for v in ints) + (np.uint64(0), np.uint64(0))
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.fn((blocks, cfg.split, 1), (32 * cfg.warps, 1, 1), args, shared_mem=self.meta["shared"], stream=stream)
        return out


def time_all(src: Path, rounds: int, out: Path) -> None:
    import torch
    import torch.nn.functional as F

    from bench_kernels import Bench, packed_bytes, random_int4, rel_err
    from glmq.kernels import reference as R
    from glmq.kernels import w4a16_decode as DK
    from probe_decode import packed_copies

    import triton

    dev = torch.device("cuda")
    metas = [(json.loads(p.read_text()), p.with_suffix(".cubin")) for p in sorted(src.glob("*.json"))]
    metas = [(m, c) for m, c in metas if "tag" in m]
    b = Bench(dev, 1e9, smoke=False)
    res = []
    for (n, k) in sorted({(m["n"], m["k"]) for m, _ in metas}):
        wp, ws = random_int4(n, k, device=dev, seed=1)
        w32 = R.dequantize_packed(wp, ws, 128)
        nbytes = packed_bytes(wp, ws)
        packs = packed_copies(b, wp, ws, "pairs")
        w16 = [w32.to(torch.float16) for _ in range(b.copies(n * k * 2))]
        for m in sorted({mm["m"] for mm, _ in metas if (mm["n"], mm["k"]) == (n, k)}):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w32.T
            outs = [torch.empty(m, n, dtype=x.dtype, device=dev) for _ in packs]
            impls = {}
            for meta, cubin in (t for t in metas if (t[0]["n"], t[0]["k"], t[0]["m"]) == (n, k, m)):
                launch = CubinLaunch(meta, cubin)
                cfg = launch.cfg
                mine = launch(x, packs[0], torch.empty_like(outs[0]))
                torch.cuda.synchronize()
                err = rel_err(mine, ref)
                row = dict(shape=f"{n}x{k}", m=m, tag=meta["tag"], triton_built=meta["triton"], rel_err=err)
                if DK.supports(m, packs[0], cfg):
                    try:
                        theirs = DK.decode_matmul(x, packs[0], torch.empty_like(outs[0]), cfg)
                        torch.cuda.synchronize()
                        row["max_abs_diff_vs_installed"] = (mine.float() - theirs.float()).abs().max().item()
                        impls[f"{meta['tag']}@{triton.__version__}"] = (
                            lambda i, c=cfg: DK.decode_matmul(x, packs[i], outs[i], c))
                    except Exception as e:  # e.g. a config the installed Triton cannot compile
                        row["installed_error"] = str(e)[:200]
                print(json.dumps(row), flush=True)
                res.append(dict(row, kind="check"))
                if not err < 3e-2:
                    continue
                impls[f"{meta['tag']}@{meta['triton']}"] = lambda i, f=launch: f(x, packs[i], outs[i])
            xd = x.to(torch.float16)
            impls["cublas-fp16"] = lambda i: F.linear(xd, w16[i % len(w16)])
            times = {name: [] for name in impls}
            for r in range(rounds):
                for name, fn in impls.items():
                    calls = [lambda i=i, fn=fn: fn(i) for i in range(len(w16) if name == "cublas-fp16" else len(packs))]
                    us, mode = b.time_us(calls)
                    times[name].append(us)
            cub = statistics.median(times["cublas-fp16"])
            print(f"== {n}x{k} M={m} (read floor {nbytes / b.read_rate * 1e6:.2f} us, copy floor "
                  f"{nbytes / b.copy_rate * 1e6:.2f} us)")
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"   {name:32} median {med:7.2f} us  {cub / med:5.2f}x cublas-fp16   rounds "
                      + " ".join(f"{t:.2f}" for t in ts))
                res.append(dict(kind="time", shape=f"{n}x{k}", m=m, impl=name, us=ts, median=med,
                                vs_cublas_fp16=cub / med))
    info = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton_installed=triton.__version__,
                read_rate=b.read_rate, copy_rate=b.copy_rate, rounds=rounds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_triton.json").write_text(json.dumps(dict(info=info, results=res), indent=1))
    print(json.dumps(info))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="compile the --tags into this folder with the installed Triton")
    ap.add_argument("--time", type=Path, help="time the cubins in this folder against the installed Triton's builds")
    ap.add_argument("--tags", nargs="+", default=["R16W4D3S4G4H"])
    ap.add_argument("--shapes", nargs="+", default=["6144,12288"], help="N,K")
    ap.add_argument("--m", type=int, nargs="+", default=[16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("ab-triton-out"))
    a = ap.parse_args()
    if a.build:
        build(a.build, a.tags, [tuple(int(v) for v in s.split(",")) for s in a.shapes], a.m)
    if a.time:
        time_all(a.time, a.rounds, a.out)


if __name__ == "__main__":
    main()
