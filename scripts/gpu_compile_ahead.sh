#!/usr/bin/env bash
# One device call (session 49): on an H200, the owed Triton 3.9 bench of 12288->6144 M = 16 (scripts/gpu_triton39.sh);
# on another sm_90 GPU, the checks of `w4a16_decode._compile_ahead`: the GPU residency tests under the image's Triton
# and under the stripped Triton 3.9 in .t39/ (scripts/gpu_triton39.sh says how to build it), the whole kernel test file,
# and scripts/ladder_first_call.py under both (what the first call settles on). Needs .whl/ (pytest-xdist, execnet).
# PARTS=39 skips the first two runs under the image's Triton; ONLY_TESTS=1 runs the tests alone, on any GPU.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
T0=$SECONDS; P="python3 -m pytest -q -p no:cacheprovider"
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
if [[ $G == *H200* && -z ${ONLY_TESTS:-} ]]; then  # the owed bench first, then only the GPU residency tests under both Tritons
  BENCH_BUDGET=60 ROUNDS=${BENCH_ROUNDS:-3} TOTAL_S=${BENCH_TOTAL_S:-480} ONLY="dense 12288->6144" \
    BENCH_ARGS="--skip-moe --no-planes --no-spans --m 16" TUNE="--only 12288 --m 16" TUNE_TRITONS=3.9 \
    bash scripts/gpu_triton39.sh 2>&1 | grep -v "nanobind\|leaked\|^ - " | tail -60
  export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
  for T in "" "TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39:/tmp/pkg:/tmp/site"; do
    env $T timeout 60 $P -m gpu tests/test_decode_residency.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -5
  done
  [[ -n ${H200_KERNEL_TESTS:-} ]] && timeout 200 $P -n 14 tests/test_kernels.py 2>&1 | tail -4
  exit
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq; export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
if [[ ${PARTS:-36 39} == *36* ]]; then
  timeout 90 $P -m gpu tests/test_decode_residency.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -5
  timeout 280 $P -n 14 tests/test_kernels.py 2>&1 | tail -4; echo "== at $((SECONDS-T0)) s"
fi
source scripts/unpack_t39.sh
T39="env TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39:/tmp/pkg:/tmp/site"
$T39 timeout 90 $P -m gpu tests/test_decode_residency.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -5
[[ -n ${ONLY_TESTS:-} ]] && exit
$T39 timeout 100 python3 scripts/ladder_first_call.py --m 16 32 --json $OUT/ladder-3.9.json 2>&1 | grep -v FP_FUSION | tail -30; echo "== at $((SECONDS-T0)) s"
timeout $((560-(SECONDS-T0))) python3 scripts/ladder_first_call.py --m 16 32 --json $OUT/ladder-3.6.json 2>&1 | tail -20
