#!/usr/bin/env bash
# One device-machine call for the W4A16 kernels (issue 4): kernel tests on the GPU, re-tune the launch
# table, benchmark with it, then the GLM-shape GPU tests again on the new table. Run from the repository
# root; results go to $OUT (<= 8 files: run.log, tune_results.json, tuned_configs.json, validate.json,
# bench_kernels.{json,md,png}, decompose.json).
#
# Flow ("tune" and "tests" both in PARTS): the tuner's candidates are compiled in the background
# (CPU-bound, Triton's cache) while the tests run, so the timing pass that follows finds every kernel
# compiled; the tuner starts from the existing table (--merge), re-tunes only TUNE_M, and keeps each
# bucket's old entry as a candidate, so no bucket gets slower. Every step is clipped to a deadline of
# TOTAL_S seconds after the start (the device call's limit minus a margin), so the benchmark files are
# written before the call ends.
#
# PARTS (default "tune tests bench retest"; "validate" adds the `glmq validate --device cuda` timing, beside a fresh
# process's fixed costs and `--device cpu` on the same machine; "ncu" profiles
# the dense kernels at decode shapes with Nsight Compute, scripts/profile_kernels.py; "decompose" times the decode
# GEMM's stage-dropping variants, scripts/profile_kernels.py --decompose, into decompose.json; "transfer" alternates
# bench_kernels.py with this GPU's own launch rules and scripts/bench_as_device.py "$TRANSFER_AS" (default "NVIDIA
# H200"), TRANSFER_BUDGET seconds each, into transfer.tgz)
# TUNE_M (default "1 4 16 64 256 2048"), TUNE_ARGS (extra tune_kernels.py arguments, e.g. "--skip-moe"), BENCH_ARGS (extra
# bench_kernels.py arguments, e.g. "--no-planes --prev-table benchmarks/tuned_configs_session4.json"), TOTAL_S (default 570), TEST_TIMEOUT, COMPILE_TIMEOUT, TUNE_BUDGET,
# BENCH_BUDGET, RETEST_TIMEOUT, WORKERS (compile processes beside the tests' 8), TEST_WORKERS (default 8 beside the
# tuner, 14 without it; TEST_TIMEOUT 170 and 330 s).
# Needs the wheels in .whl/ only for "validate" (compressed-tensors and its pydantic deps).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-tune tests bench retest}
TUNE_M=${TUNE_M:-1 4 16 64 256 2048}
TOTAL_S=${TOTAL_S:-570}
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - T0) )); }  # seconds left before the deadline
clip() { local want=$1 l; l=$(left); (( want > l )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq  # import the checkout as `glmq`
export PYTHONPATH=/tmp/pkg:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
TABLE=kernels/tuned_configs.json
CPID=
if [[ $PARTS == *tune* ]]; then
  echo "== tune: compiling the candidates in the background"
  timeout "$(clip ${COMPILE_TIMEOUT:-200})" python3 scripts/tune_kernels.py --out "$OUT" --merge $TABLE --m $TUNE_M ${TUNE_ARGS:-} \
    --compile-only --workers "${WORKERS:-7}" > /tmp/tune_compile.log 2>&1 &
  CPID=$!
fi
if [[ $PARTS == *tests* ]]; then
  # Beside the tuner's compile workers the tests get 8 processes and 170 s (a part of the file: it needs ~250 s at
  # -n 14 on the H200, BENCHMARKS.md session 32); alone (PARTS without "tune") 14 processes and 330 s, the whole file.
  if [[ -n $CPID ]]; then TW=${TEST_WORKERS:-8}; TT=${TEST_TIMEOUT:-170}; else TW=${TEST_WORKERS:-14}; TT=${TEST_TIMEOUT:-330}; fi
  echo "== GPU tests (old table for the tuned shapes), $TW workers, at most $TT s"
  timeout "$(clip $TT)" python3 -m pytest -q -p no:cacheprovider -n "$TW" tests/test_kernels.py 2>&1 | tail -30
  echo "tests done at $((SECONDS - T0)) s"
fi
if [[ -n $CPID ]]; then
  wait $CPID; echo "compile phase exit $? at $((SECONDS - T0)) s"
  grep -v "^warm-up failed" /tmp/tune_compile.log | tail -5
  grep "^warm-up failed" /tmp/tune_compile.log | cut -c1-300 | head -20
fi
if [[ $PARTS == *tune* ]]; then
  echo "== tune: timing"
  B=$(clip ${TUNE_BUDGET:-110})
  timeout "$(clip $((B + 30)))" python3 scripts/tune_kernels.py --out "$OUT" --merge $TABLE --write $TABLE --m $TUNE_M ${TUNE_ARGS:-} \
    --no-warm --budget-s "$B" 2>&1 | grep -v "^warm-up failed" | tail -80
  echo "tune done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *validate* ]]; then
  echo "== validate --device cuda"
  V=/tmp/glmq-validate; rm -rf $V; mkdir -p $V
  timeout "$(clip 120)" python3 -m glmq quantize --model builtin:glm5-tiny --device cuda --output $V/tiny-int4 --no-progress 2>&1 | tail -3
  timeout "$(clip 60)" python3 -m glmq validate $V/tiny-int4 --device cuda 2>&1 | tail -12
  echo "tiny validate exit: $?"
  timeout "$(clip 200)" python3 - <<'EOF' 2>&1 | tail -40
import json, os, subprocess, sys, time
from pathlib import Path
from glmq.formats import fixtures
V = Path("/tmp/glmq-validate")
t = time.time()
src = fixtures.make_checkpoint(V / "bench-fp8", "glm_moe_dsa", preset="bench", config_overrides={"num_hidden_layers": 1})
print(f"bench source written in {time.time() - t:.0f} s")
t = time.time()
q = subprocess.run([sys.executable, "-m", "glmq", "quantize", "--model", str(src), "--device", "cuda", "--output",
                    str(V / "bench-int4"), "--no-progress"], capture_output=True, text=True)
print(f"quantize --device cuda: exit {q.returncode} in {time.time() - t:.0f} s", q.stderr[-1500:] if q.returncode else "")
ckpt = V / "bench-int4"
files = sorted(ckpt.glob("*.safetensors"))
size = sum(f.stat().st_size for f in files)
def read_all():
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t
reads = [read_all(), read_all(), read_all()]
out = {"checkpoint_bytes": size, "files": len(files), "read_s": reads}
def fixed(code):  # a fresh process's fixed costs, apart from validate's own work
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t
out["fixed_s"] = {"python+torch import": fixed("import torch"),
                  "+ CUDA context": fixed("import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
                  "compressed-tensors import": fixed("import compressed_tensors")}
print("fixed costs of a fresh process (s):", {k: round(v, 2) for k, v in out["fixed_s"].items()})
# the first cuda run also compiles kernels for new shapes; the second finds them in Triton's cache; cpu: the peer
for dev in ("cuda", "cuda", "cpu"):
    t = time.perf_counter()
    rep_path = V / f"report-{dev}.json"
    r = subprocess.run([sys.executable, "-m", "glmq", "validate", str(ckpt), "--device", dev, "--json", str(rep_path)],
                       capture_output=True, text=True)
    dt = time.perf_counter() - t
    rep = rep_path.read_text()[:20000] if rep_path.exists() else ""
    out.setdefault("validate", []).append({"device": dev, "exit": r.returncode, "wall_s": dt, "report": rep,
                                           "stdout_tail": r.stdout[-3000:], "stderr_tail": r.stderr[-3000:]})
    print(f"validate --device {dev}: exit {r.returncode}, {dt:.1f} s; warm read {min(reads[1:]):.2f} s "
          f"-> ratio {dt / min(reads[1:]):.1f}x  ({size / 1e9:.2f} GB in {len(files)} files)")
    print(r.stdout[-1500:])
    if r.returncode:
        print(r.stderr[-1500:])
Path(os.environ["OUT"], "validate.json").write_text(json.dumps(out, indent=1, default=str))
EOF
  echo "validate done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *decompose* ]]; then
  echo "== decompose: decode GEMM variants that leave one stage out (scripts/profile_kernels.py --decompose)"
  timeout "$(clip ${DECOMPOSE_TIMEOUT:-90})" python3 scripts/profile_kernels.py --decompose --out "$OUT" 2>&1 | grep -v "^WARNING"
  echo "decompose done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *bench* ]]; then
  echo "== benchmark (tuned table)"
  B=$(clip ${BENCH_BUDGET:-90})
  (( B > 25 )) && B=$((B - 20))  # the budget stops new measurements; the files are written after it
  timeout "$(clip $((B + 40)))" python3 scripts/bench_kernels.py --out "$OUT" --budget-s "$B" ${BENCH_ARGS:-} 2>&1 | tail -90
  echo "bench done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *transfer* ]]; then
  # Another launch table on this GPU against this GPU's own launch rules, alternated so drift shows: own, as, own, as
  # while time lasts (scripts/bench_as_device.py). TRANSFER_AS: the GPU name the tables are looked up under ("NVIDIA
  # H200": its tables; a name no table serves, e.g. "untuned": the heuristics). Each run's JSON goes into transfer.tgz.
  AS=${TRANSFER_AS:-NVIDIA H200}
  echo "== transfer: launch rules looked up as \"$AS\" vs this GPU's own"
  i=0; mkdir -p /tmp/transfer
  while (( $(left) > ${TRANSFER_RESERVE:-60} )); do  # seconds kept for the parts after it
    for run in own as; do
      B=$(clip ${TRANSFER_BUDGET:-60}); (( B > 25 )) && B=$((B - 15))
      if [[ $run == own ]]; then CMD=(scripts/bench_kernels.py); else CMD=(scripts/bench_as_device.py "$AS"); fi
      echo "-- $run #$i (budget $B s)"
      timeout "$(clip $((B + 40)))" python3 "${CMD[@]}" --out "/tmp/transfer/$run-$i" --budget-s "$B" ${BENCH_ARGS:-} \
        2>&1 | grep -E " us |wrote|rror" | tail -60
      rm -f /tmp/transfer/$run-$i/*.png
    done
    i=$((i + 1))
  done
  tar -czf "$OUT/transfer.tgz" -C /tmp/transfer .
  echo "transfer done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *retest* ]]; then
  echo "== GPU tests at GLM-5 shapes on the new table"
  timeout "$(clip ${RETEST_TIMEOUT:-120})" python3 -m pytest -q -p no:cacheprovider -n 4 -k "glm_shapes or asm" \
    tests/test_kernels.py 2>&1 | tail -15
  echo "retest done at $((SECONDS - T0)) s"
fi
if [[ $PARTS == *ncu* ]]; then
  echo "== ncu: dense kernels at decode shapes (scripts/profile_kernels.py)"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # every case launches PAIRS 3x then PLANES 3x; profile the last launch of each (split-K kernels only:
  # the kernel name is _mma_swap_kernel or _gemv_kernel)
  timeout "$(clip ${NCU_TIMEOUT:-150})" "$NCU" --clock-control none -k regex:"_mma_swap_kernel|_gemv_kernel" \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
    --section LaunchStats python3 scripts/profile_kernels.py > "$OUT/ncu.txt" 2>&1
  echo "ncu exit $? at $((SECONDS - T0)) s"; grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|One or More" "$OUT/ncu.txt" | head -60
fi
cp $TABLE "$OUT/tuned_configs.json" 2>/dev/null || true
echo "all done at $((SECONDS - T0)) s"
