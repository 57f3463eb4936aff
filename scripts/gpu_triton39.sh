#!/usr/bin/env bash
# One device call: the decode kernels under the device's Triton and under Triton 3.9 (torch 2.13's, the top of
# glmq's torch range), in the same process tree, alternating (kernels/NOTES.md, session 43).
#
# The device image has Triton 3.6 and cannot install another (no network), and a Triton wheel (286 MB) is past what a
# call carries (64 MiB with the working tree). So a stripped Triton 3.9 travels in the ignored folder .t39/, built here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d /tmp/t39whl triton==3.9.0 && python3 -m zipfile -e /tmp/t39whl/*.whl X
#   strip --strip-unneeded X/triton/_C/libtriton.so && xz -9 -c X/triton/_C/libtriton.so > .t39/a     (477 -> 38 MB)
#   rm X/triton/backends/nvidia/bin/ptxas
#   tar -C X --exclude=triton/_C/libtriton.so --exclude=triton/_C/libproton.so --exclude=triton/backends/amd \
#       --exclude='triton/backends/nvidia/lib/cupti*' \
#       --exclude=triton/backends/nvidia/bin/nvdisasm --exclude=triton/instrumentation --exclude=triton/plugins \
#       --exclude=triton/FileCheck --exclude=triton/include -cf - triton triton-3.9.0.dist-info | xz -9 > .t39/b
# and is unpacked to /tmp/t39, put first on PYTHONPATH for the "3.9" runs only. (Strip removes debug information
# only; libdevice and the CUDA headers the launcher is built with stay. Triton 3.9 compiles sm_90 and later with
# ptxas-blackwell, its `get_ptxas(arch)`, so that one travels, and the plain ptxas, for arch < 90 only, is a link to
# it here: both do not fit in a call's 64 MiB. The .t39 of sessions 49's first calls had it the other way round,
# and every 3.9 compile failed "Cannot find ptxas-blackwell".)
#
# Steps, each clipped to TOTAL_S: (1) with .cubins present, scripts/ab_triton.py --time (cubins built by Triton 3.9
# here, launched with CuPy beside the installed build); (2) scripts/bench_kernels.py on BENCH_ARGS, ROUNDS times under
# each Triton, alternating, on the ONLY shapes, each run's files under $OUT/bench-<triton>-<round>/.
# (3), with TUNE set, in the time left: scripts/probe_decode.py --tune $TUNE under each of TUNE_TRITONS (default "3.9 3.6";
# tables under $OUT/tune-<triton>/).
# Needs: REQUIRE (default H200): exit 3 at once on another GPU.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-560}; ROUNDS=${ROUNDS:-3}; AB_ROUNDS=${AB_ROUNDS:-5}
BENCH_ARGS=${BENCH_ARGS:---skip-moe --no-planes --no-spans --m 1 4 16}
BENCH_BUDGET=${BENCH_BUDGET:-60}
# ONLY: bench_kernels.py --only's shape names, ";"-separated (they hold spaces)
IFS=';' read -ra ONLY_ARR <<< "${ONLY:-dense 12288->6144;square;dense 6144->24576}"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - T0) )); }
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $G"
if [[ -n ${REQUIRE-H200} && $G != *${REQUIRE-H200}* ]]; then echo "not an ${REQUIRE-H200}: nothing run"; exit 3; fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq
export PYTHONUNBUFFERED=1
BASE=/tmp/pkg:/tmp/site
source scripts/unpack_t39.sh
PYTHONPATH=$BASE python3 -c 'import torch, triton; print("installed: torch", torch.__version__, "triton", triton.__version__)'
# (its backends are found in its own tree: the installed Triton's entry points name an AMD backend not shipped here)
T39="env TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39:$BASE"
$T39 python3 -c 'import triton; print("shipped: triton", triton.__version__, triton.__file__)'
if [[ -d .cubins ]]; then
  echo "== ab_triton ($AB_ROUNDS rounds) at $((SECONDS - T0)) s"
  PYTHONPATH=$BASE timeout "$(( $(left) / 3 ))" python3 scripts/ab_triton.py --time .cubins --rounds "$AB_ROUNDS" \
    --out "$OUT" > "$OUT/ab_triton.log" 2>&1
  grep -v '^{' "$OUT/ab_triton.log" | tail -40
fi
for r in $(seq 1 "$ROUNDS"); do
  for tv in 3.6 3.9; do
    (( $(left) < BENCH_BUDGET + 20 )) && break 2
    if [[ $tv == 3.9 ]]; then RUN=$T39; else RUN="env PYTHONPATH=$BASE"; fi
    echo "== bench under Triton $tv, round $r, at $((SECONDS - T0)) s"
    $RUN timeout "$(( BENCH_BUDGET + 60 ))" python3 scripts/bench_kernels.py --out "$OUT/bench-$tv-$r" \
      --budget-s "$BENCH_BUDGET" $BENCH_ARGS --only "${ONLY_ARR[@]}" > "$OUT/bench-$tv-$r.log" 2>&1
    echo "exit $?"; grep -E "^\| 16 |^## " "$OUT/bench-$tv-$r/bench_kernels.md" 2>/dev/null | cut -c1-220 | head -12
    # the residency ladder's warnings (w4a16_decode.choose: a pick given up, and what runs instead)
    grep -E "w4a16: the launch table" "$OUT/bench-$tv-$r.log" 2>/dev/null | cut -c1-400
    rm -f "$OUT/bench-$tv-$r/bench_kernels.png"
  done
done
if [[ -n ${TUNE-} ]]; then  # (3) TUNE: probe_decode.py --tune's arguments, e.g. "--only 12288 --m 16": the same tune under
  # each of TUNE_TRITONS (every candidate, plain and PDL, timed twice), its table under $OUT/tune-<triton>/ (not written
  # into kernels/: a table is read by every Triton, so what these show is decided by hand)
  for tv in ${TUNE_TRITONS:-3.9 3.6}; do
    (( $(left) < 60 )) && break
    if [[ $tv == 3.9 ]]; then RUN=$T39; else RUN="env PYTHONPATH=$BASE"; fi
    echo "== tune under Triton $tv ($TUNE) at $((SECONDS - T0)) s"
    mkdir -p "$OUT/tune-$tv"
    $RUN timeout "$(left)" python3 scripts/probe_decode.py --tune $TUNE --workers "${TUNE_WORKERS:-16}" \
      --out "$OUT/tune-$tv" > "$OUT/tune-$tv.log" 2>&1
    echo "exit $?"; grep -E "M=[0-9]+ (plain|pdl)" "$OUT/tune-$tv.log" | head -12
  done
fi
echo "done at $((SECONDS - T0)) s"
# one archive: a call brings back a limited number of files
(cd "$OUT" && shopt -s nullglob && got=(bench-*/bench_kernels.md bench-*/bench_kernels.json bench-*.log tune-*) &&
  (( ${#got[@]} )) && tar czf benches.tgz "${got[@]}" && rm -rf bench-*/ bench-*.log tune-*)
