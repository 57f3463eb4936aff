#!/usr/bin/env bash
# One device-machine call for the Gluon decode kernel (kernels/w4a16_decode.py, issue 4, session 11): tune its
# launch table against the Triton kernel, run the GPU kernel tests with that table, then the kernel benchmark.
# Run from the repository root; results in $OUT (tuned_decode.json, tune.log, tests.log, bench_kernels.{json,md,png},
# run.log). TUNE_S / TEST_S / BENCH_S bound the three steps (seconds); TEST_ARGS (shell words, quotes kept) and
# BENCH_ARGS are passed on, TUNE_ARGS to the tuner (e.g. "--layouts spans --m 1 4 8 16", with
# TUNE_WRITE=kernels/tuned_decode_spans.json, the table it then writes; TUNE_S=0 skips the tuning).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq  # import the checkout as `glmq`
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
T0=$SECONDS
echo "== tune (scripts/probe_decode.py --tune)"
if [ "${TUNE_S:-150}" -gt 0 ]; then
  timeout "${TUNE_S:-150}" python3 scripts/probe_decode.py --tune --out "$OUT" \
    --write "${TUNE_WRITE:-kernels/tuned_decode.json}" --workers 15 --budget-s $(( ${TUNE_S:-150} - 40 )) ${TUNE_ARGS:-} \
    > "$OUT/tune.log" 2>&1
  echo "tune exit $? at $((SECONDS - T0)) s"; grep -v "^ok\|Warning\|warn_once" "$OUT/tune.log" | tail -40
else
  echo "skipped (TUNE_S=0)"
fi
echo "== GPU kernel tests"
eval timeout "${TEST_S:-170}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py "${TEST_ARGS:-}" \
  > "$OUT/tests.log" 2>&1  # eval: TEST_ARGS may quote, e.g. TEST_ARGS='-k "decode or pdl"'
echo "tests exit $? at $((SECONDS - T0)) s"; tail -15 "$OUT/tests.log"
echo "== benchmark"
B=${BENCH_S:-220}
timeout "$B" python3 scripts/bench_kernels.py --out "$OUT" --budget-s $(( B - 45 )) --no-planes ${BENCH_ARGS:-} 2>&1 | tail -60
echo "bench exit $? at $((SECONDS - T0)) s"
