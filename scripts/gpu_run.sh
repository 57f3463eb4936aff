#!/usr/bin/env bash
# One device-machine session: GPU kernel tests, the kernel benchmark, and RTN --device cuda against the
# I/O floor. Run from the repository root on a machine with CUDA; results go to $OUT (or ./gpu-out).
# PARTS (default "tests kernels rtn"; also "cudapath", "gpq-unit" (GPTQ + cuda-path tests), "gptq" (GLM-5-shape GPTQ bench)) picks what runs. Needs the wheels in .whl/ for what the GPU image lacks (compressed-tensors and its pydantic deps).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -m compileall -q /tmp/site >/dev/null  # as a normal pip install would
fi
# import the checkout as the package `glmq` without installing it
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq
export PYTHONPATH=/tmp/pkg:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
PARTS=${PARTS:-tests kernels rtn}
[[ $PARTS == *tests* ]] && python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gptq.py tests/test_cuda_path.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
[[ $PARTS == *gpq-unit* ]] && python3 -m pytest -q -p no:cacheprovider tests/test_gptq.py tests/test_cuda_path.py 2>&1 | tail -8 | tee "$OUT/gptq_cuda_tests.txt"
[[ $PARTS == *cudapath* ]] && python3 -m pytest -q -p no:cacheprovider tests/test_cuda_path.py 2>&1 | tail -8 | tee "$OUT/cuda_path_tests.txt"
[[ $PARTS == *kernels* ]] && timeout 330 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tail -60 | tee "$OUT/bench_kernels.log"
[[ $PARTS == *gptq* ]] && timeout ${GPTQ_TIMEOUT:-500} python3 scripts/bench_gptq_gpu.py --work /tmp/glmq-g5 ${GPTQ_ARGS:-} --json "$OUT/bench_gptq_gpu.json" 2>&1 | tail -40 | tee "$OUT/bench_gptq_gpu.log"
[[ $PARTS == *rtn* ]] && timeout 400 python3 scripts/bench_rtn.py --work /tmp/glmq-bench --layers 3 --device cuda --repeats 3 --out "$OUT/bench_rtn_cuda.json" 2>&1 | tail -40 | tee "$OUT/bench_rtn_cuda.log"
