"""Compile every Gluon config of the decode launch table for sm_90 and digest its SASS, without a GPU.

    python scripts/sass_digest.py --out before.json [--table kernels/tuned_decode.json] [--workers 2]
    # ... edit kernels/w4a16_decode.py ...
    python scripts/sass_digest.py --out after.json --against before.json   # exit 1 where any SASS changed
    # under the Triton the table was timed with: each pick's and its 2 runner-ups' registers into the table
    python scripts/sass_digest.py --out d.json --record --timed-with 3.6.0 --alternates 2
    # under another Triton: which picks would give way to a runner-up or the Triton kernel (no GPU needed)
    python scripts/sass_digest.py --out d39.json --alternates 2 --ladder 132

What it is for: a change to `kernels/w4a16_decode.py` that leaves every launch-table kernel's SASS byte for byte as
it was cannot change their speed, so it needs no H200 run; one that changes any of them has to be timed
(kernels/NOTES.md session 24: a refactor that left the PTX instructions identical still changed ptxas's output for 9
of 64 configs, through the line tables alone, and one of those launches ran 15 % slower). The digest is of the SASS
instructions and their encodings with the addresses taken out; registers and spills come from cuobjdump. The
environment decides what Triton compiles (e.g. TRITON_DISABLE_LINE_INFO=1); the file records Triton's version and that
setting, and `--against` refuses to compare files made under different ones unless `--across-settings` is given.

Each entry is keyed `N,K|M|plain` or `N,K|M|pdl` as the table holds it and compiled as `w4a16_matmul_packed`
launches it (M as the kernel's token tile sees it, bf16 activations, the table's weight layout). Compiling takes
5-10 s a config on one core (the table holds ~70); `--workers` processes share Triton's cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
from pathlib import Path

_ADDRESS = re.compile(r"/\*[0-9a-f]+\*/")


def sass_instructions(sass: str) -> list[str]:
    """The instructions of a cuobjdump SASS listing with their `/*0000*/` addresses taken out, each with its two
    encoding words (the second on a line of its own; they hold the scheduling control bits too), so that the same code
    at other addresses digests the same."""
    out = []
    for line in sass.splitlines():
        text = line.strip()
        if not text.startswith("/*"):
            continue  # headers, labels, function names
        body = _ADDRESS.sub("", text, count=1).strip() if _ADDRESS.match(text) else text
        if body.startswith("/*") and out:  # the second encoding word: part of the instruction above
            out[-1] += " " + body
        elif body:
            out.append(body)
    return out


def table_entries(table: dict) -> list[dict]:
    """The Gluon configs of a launch table (`kernels/tuned_decode.json`), one per (shape, M, plain | pdl); entries where
    the Triton kernel won (null) are left out."""
    spans = table.get("layout", "pairs") == "spans"
    out = []
    for shape, rows in sorted(table.get("decode", {}).items()):
        n, k, _group = (int(v) for v in shape.split(","))
        for m, ent in sorted(rows.items(), key=lambda kv: int(kv[0])):
            for mode in ("plain", "pdl"):
                cfg = ent.get(mode)
                if cfg:
                    out.append({"key": f"{n},{k}|{m}|{mode}", "n": n, "k": k, "m": int(m), "pdl": mode == "pdl",
                                "spans": spans, "config": cfg})
    return out


def alternate_entries(table: dict, count: int, margin: float) -> list[dict]:
    """For each Gluon pick of `table`, the next `count` fastest Gluon configs timed beside it (the entry's "us", same
    plain | pdl mode) that beat the Triton kernel by `margin` as the pick did (`probe_decode.TUNE_MARGIN`), keyed
    `N,K|M|mode|alt<i>`: what `w4a16_decode.choose` falls back to where the pick lost its residency."""
    from glmq.kernels.w4a16_decode import DecodeConfig
    from glmq.scripts.probe_decode import parse_tag, tag

    out = []
    for pick in table_entries(table):
        n, k, m = pick["n"], pick["k"], pick["m"]
        times = table["decode"][f"{n},{k},128"][str(m)].get("us") or {}
        suffix = "-pdl" if pick["pdl"] else ""
        triton = times.get("triton" + suffix)
        if triton is None:
            continue
        mine = {t[: len(t) - len(suffix)]: us for t, us in times.items() if t.startswith("R") and
                t.endswith(suffix) and (pick["pdl"] or not t.endswith("-pdl"))}  # fmt: skip
        own = tag(DecodeConfig(**pick["config"]))
        ranked = sorted((us, t) for t, us in mine.items() if t != own and us <= margin * triton)
        for i, (us, t) in enumerate(ranked[:count]):
            out.append({**pick, "key": f"{pick['key']}|alt{i}", "config": parse_tag(t).to_dict(), "us": us})
    return out


def compile_entry(entry: dict) -> dict:
    """Compile one table entry for sm_90 (as `decode_matmul` would launch it) and digest it."""
    from glmq.kernels import w4a16_decode as DK
    from glmq.scripts.probe_decode import tag

    cfg = DK.DecodeConfig(**entry["config"])
    m, chunks = entry["m"], entry["k"] // DK.MMA_CHUNK
    if cfg.split:  # the shared-x kernel: its token tile follows from M (`xshared_tokens`)
        tok, xb = m, False
    else:  # `_decode_kernel`: an 8- or 16-token tile, x broadcast at M = 1
        tok, xb = DK.decode_tokens(m), m == 1
    try:
        r = DK.compile_sm90(cfg, chunks, tok, True, xb, entry["pdl"], entry["spans"])
    except Exception as exc:  # noqa: BLE001 - reported per entry; the others still compile
        return {"tag": tag(cfg), "error": f"{type(exc).__name__}: {exc}"[:500]}
    ins = sass_instructions(r["sass"])
    return {"tag": tag(cfg), "registers": r["registers"], "spills": r["spills"], "shared": r["shared"],
            "instructions": len(ins), "sass_sha1": hashlib.sha1("\n".join(ins).encode()).hexdigest()}


def settings() -> dict:
    import triton

    return {"triton": triton.__version__, "line_info": os.environ.get("TRITON_DISABLE_LINE_INFO", "0") in ("", "0")}


def compare(old: dict, new: dict) -> list[str]:
    """Lines naming each entry whose SASS (or registers, spills) differ, or that only one file holds."""
    lines = []
    a, b = old["entries"], new["entries"]
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            lines.append(f"{key}: only in {'the new' if x is None else 'the old'} digest")
        elif {f: v for f, v in x.items() if f in y} != {f: v for f, v in y.items() if f in x}:  # (older: no shared)
            what = ", ".join(f"{f} {x.get(f)} -> {y.get(f)}" for f in ("tag", "registers", "spills", "instructions",
                                                                      "error") if x.get(f) != y.get(f))
            lines.append(f"{key} ({y.get('tag')}): SASS differs" + (f" ({what})" if what else ""))
    return lines


def record(table: dict, digest: dict, timed_with: str, alternates: dict | None = None) -> dict:
    """`table` with each Gluon pick's registers and shared memory from `digest` as its "compiled" entry (what
    `w4a16_decode.residency_problem` compares a launch's compiled kernel with), and "triton": the version that compiled
    them, which must be the one the table was timed under (`timed_with`). `alternates` (`alternate_entries` by key):
    the digest's `|alt<i>` entries become the entry's "alternates" lists, in that order, replacing earlier ones."""
    out = json.loads(json.dumps(table))
    alternates = alternates or {}
    found: dict[tuple, dict[int, dict]] = {}  # (entry, mode) of each pick recorded -> its alternates by index
    for key, r in digest["entries"].items():
        if "error" in r or "shared" not in r:
            raise SystemExit(f"{key}: no registers and shared memory in the digest ({r.get('error', 'an older digest')})")
        shape, m, mode, *alt = key.split("|")
        n, k = shape.split(",")
        compiled = {"registers": r["registers"], "shared": r["shared"]}
        alts = found.setdefault((f"{n},{k},128", m, mode), {})
        if alt:  # an alternate: its config and time as tuned, and what it compiled to
            a = alternates[key]
            alts[int(alt[0].removeprefix("alt"))] = {"config": a["config"], "us": a["us"], "compiled": compiled}
        else:
            out["decode"][f"{n},{k},128"][m].setdefault("compiled", {})[mode] = compiled
    for (shape, m, mode), alts in found.items():  # each recorded pick's alternates: this digest's, in order, or none
        entry = out["decode"][shape][m]
        lists = {k: v for k, v in (entry.get("alternates") or {}).items() if k != mode}
        if alts:
            lists[mode] = [alts[i] for i in sorted(alts)]
        entry.pop("alternates", None)
        if lists:
            entry["alternates"] = lists
    out["triton"] = timed_with
    return out


def ladder(table: dict, digest: dict, sms: int) -> dict[str, str]:
    """What `w4a16_decode.choose` settles on for each Gluon pick of `table` (its "compiled" and "alternates" records)
    once this digest's Triton has compiled every config of the ladder (the digest must hold the `|alt<i>` entries):
    key -> "pick", "alt<i> TAG" or "triton", by the same residency arithmetic, at `sms` SMs. Configs the table holds
    no record of are taken as they come, as `choose` takes them."""
    from glmq.kernels import w4a16_decode as DK
    from glmq.scripts.probe_decode import tag

    out = {}
    for pick in table_entries(table):
        entry = table["decode"][f"{pick['n']},{pick['k']},128"][str(pick["m"])]
        mode = "pdl" if pick["pdl"] else "plain"
        steps = [("pick", pick["config"], (entry.get("compiled") or {}).get(mode), pick["key"])]
        steps += [(f"alt{i} {tag(DK.DecodeConfig(**a['config']))}", a["config"], a.get("compiled"),
                   f"{pick['key']}|alt{i}") for i, a in enumerate((entry.get("alternates") or {}).get(mode, []))]
        out[pick["key"]] = "triton"
        for name, config, timed, key in steps:
            got = digest["entries"].get(key)
            if timed is None or got is None or "error" in got:
                out[pick["key"]] = name
                break
            *_, want, have = DK.residency_waves(pick["n"], DK.DecodeConfig(**config), timed,
                                                (got["registers"], got["shared"]), sms)
            if have <= want:
                out[pick["key"]] = name
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="write the digest here (JSON)")
    ap.add_argument("--table", type=Path, default=Path(__file__).resolve().parents[1] / "kernels" / "tuned_decode.json")
    ap.add_argument("--against", type=Path, help="an earlier digest: list what differs, exit 1 if anything does")
    ap.add_argument("--across-settings", action="store_true",
                    help="compare with a digest made under another Triton or line-info setting (an experiment)")
    ap.add_argument("--only", help="substring of the entry keys (`N,K|M|plain`) to compile")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--record", action="store_true",
                    help="also write each pick's registers and shared memory into --table (its \"compiled\" entries): "
                         "only under the Triton the table was timed with, named by --timed-with")
    ap.add_argument("--timed-with", help="--record: the Triton version the table's timings were taken under")
    ap.add_argument("--alternates", type=int, default=0,
                    help="also compile each pick's next N fastest configs of the same tune (and with --record write "
                         "them as its \"alternates\", which `choose` falls back to where the pick lost its residency)")
    ap.add_argument("--ladder", type=int, metavar="SMS",
                    help="print what `choose` would run for each pick under this Triton at SMS multiprocessors "
                         "(132: H100 SXM and H200) where that is not the pick (with --alternates as recorded)")
    args = ap.parse_args(argv)
    if args.record and args.timed_with != settings()["triton"]:
        ap.error(f"--record writes this Triton's ({settings()['triton']}) registers into the table: pass --timed-with "
                 f"with the version the table was timed under, and run it under that Triton")

    from glmq.scripts.probe_decode import TUNE_MARGIN

    table_doc = json.loads(args.table.read_text())
    alternates = alternate_entries(table_doc, args.alternates, TUNE_MARGIN) if args.alternates > 0 else []
    entries = [e for e in table_entries(table_doc) + alternates if not args.only or args.only in e["key"]]
    if not entries:
        print(f"no Gluon entries in {args.table}" + (f" matching {args.only!r}" if args.only else ""), file=sys.stderr)
        return 2
    old = json.loads(args.against.read_text()) if args.against else None
    if old is not None and old.get("settings") != settings() and not args.across_settings:
        print(f"{args.against} was made under {old.get('settings')}, this run is {settings()}: not comparable",
              file=sys.stderr)
        return 2
    if args.workers > 1:
        with mp.get_context("spawn").Pool(min(args.workers, len(entries))) as pool:
            results = pool.map(compile_entry, entries, chunksize=1)
    else:
        results = [compile_entry(e) for e in entries]
    digest = {"settings": settings(), "table": str(args.table),
              "entries": {e["key"]: r for e, r in zip(entries, results)}}
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(digest, indent=1) + "\n")
    tmp.replace(args.out)
    errors = [f"{k}: {r['error']}" for k, r in digest["entries"].items() if "error" in r]
    print(f"{len(entries)} entries compiled, {len(errors)} failed; digest in {args.out}")
    for line in errors:
        print("  " + line)
    if len(errors) == len(entries):
        return 2  # nothing compiled (e.g. a Triton without Gluon): no digest to compare
    if args.record:
        if errors or args.only:
            print("--record: every pick of the table must compile (and no --only)", file=sys.stderr)
            return 2
        table = record(json.loads(args.table.read_text()), digest, args.timed_with, {e["key"]: e for e in alternates})
        tmp = args.table.with_name(args.table.name + ".tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        tmp.replace(args.table)
        print(f"recorded the registers and shared memory of {len(entries) - len(alternates)} picks and "
              f"{len(alternates)} alternates in {args.table}")
    if args.ladder:
        moved = {k: v for k, v in ladder(json.loads(args.table.read_text()), digest, args.ladder).items()
                 if v != "pick"}
        print(f"under Triton {settings()['triton']} at {args.ladder} SMs, {len(moved)} picks give way:")
        for key, what in moved.items():
            print(f"  {key}: {what}")
    if old is None:
        return 0
    diff = compare(old, digest)
    print(f"against {args.against}: {len(diff)} of {len(digest['entries'])} entries differ")
    for line in diff:
        print("  " + line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
