#!/usr/bin/env bash
# One device-machine session: GPU kernel tests, the kernel benchmark, and RTN --device cuda against the
# I/O floor. Run from the repository root on a machine with CUDA; results go to $OUT (or ./gpu-out).
# PARTS (default "tests kernels rtn"; also "rtn-sizes" (RTN --device cuda against the copy at RTN_LAYERS decoder
# layers, default "3 8": 5.9 and 13 GB), "probe" (import/start-up times), "gptq-gpu" (every GPU-marked GPTQ and CUDA
# conversion test), "gptq-triton" (the Triton GPTQ kernels' tests, and `bench_gptq_solver --backends --device cuda`), "gptq-profile" (one
# GLM-5 gate+up batch solve under torch.profiler), "gptq-tiles" (the Triton GPTQ kernels' rows x warps per program, TILES), "cudapath", "gpq-unit" (GPTQ + cuda-path tests), "gptq" (GLM-5-shape GPTQ bench), "peer-quality" (llm-compressor GPTQ and AutoRound on the GPU against glmq, bench_gptq quality),
# "dist-rtn" / "dist-gptq" (torchrun on the machine's GPUs against one GPU, scripts/bench_dist.py; DIST_JOBS picks the
# GPTQ rank counts, e.g. "2" in one call and "1" in the next: the JSON digests compare them)) picks what runs. Needs the wheels in .whl/ for what the GPU image lacks (compressed-tensors and its pydantic deps).
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
has() { [[ " $PARTS " == *" $1 "* ]]; }  # whole words: "rtn" is not "dist-rtn"
if has probe; then  # where the H200 machine's start-up time goes (the compressed-tensors import, torch, CUDA)
  T='import resource, subprocess, sys, time; t = time.time(); subprocess.run([sys.executable, "-c", sys.argv[2]]); print(f"{sys.argv[1]}: {time.time() - t:.2f} s wall, child max RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6:.2f} GB")'
  { for i in 1 2; do python3 -c "$T" "import compressed_tensors ($i)" "import compressed_tensors"; done
    python3 -c "$T" "import torch" "import torch"
    python3 -c "$T" "import torch + CUDA context" "import torch; torch.zeros(1, device='cuda')"
    python3 -c "$T" "import transformers" "import transformers"
    python3 -c "$T" "import glmq.quantize.stream" "import glmq.quantize.stream"
    python3 -X importtime -c "import compressed_tensors" 2>&1 | sort -t'|' -k2 -n | tail -25
  } 2>&1 | tee "$OUT/probe.txt"
fi
has tests && python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gptq.py tests/test_cuda_path.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
has gpq-unit && python3 -m pytest -q -p no:cacheprovider tests/test_gptq.py tests/test_cuda_path.py 2>&1 | tail -8 | tee "$OUT/gptq_cuda_tests.txt"
if has gptq-triton; then  # the Triton GPTQ kernels on CUDA against the CPU kernels, then against the torch path at GLM-5 expert shapes
  timeout ${TRITON_TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gptq_triton.py 2>&1 | tail -8 | tee "$OUT/gptq_triton_tests.txt"
  timeout ${SOLVER_TIMEOUT:-150} python3 -m glmq.scripts.bench_gptq_solver --backends --device cuda --shape 8 4096 6144 --shape 8 6144 2048 \
    --repeats ${SOLVER_REPEATS:-2} --out "$OUT" --name cuda-backends 2>&1 | tail -8 | tee "$OUT/bench_gptq_solver_cuda.log"
fi
has gptq-profile && timeout ${PROFILE_TIMEOUT:-150} python3 -m glmq.scripts.bench_gptq_solver --profile --device cuda \
  --shape ${PROFILE_SHAPE:-8 4096 6144} 2>&1 | tail -30 | tee "$OUT/gptq_profile.txt"
has gptq-tiles && timeout ${TILES_TIMEOUT:-150} python3 -m glmq.scripts.bench_gptq_solver --device cuda --repeats 2 \
  --triton-tiles ${TILES:-32x4 16x2 16x4 8x1 8x2} --shape 8 4096 6144 --shape 8 6144 2048 --out "$OUT" --name cuda-tiles 2>&1 | tail -14
has gptq-gpu && python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gptq.py tests/test_gptq_engine.py tests/test_cuda_path.py tests/test_scale_refit.py tests/test_calibration.py tests/test_tune.py 2>&1 | tail -8 | tee "$OUT/gptq_gpu_tests.txt"
has cudapath && python3 -m pytest -q -p no:cacheprovider tests/test_cuda_path.py 2>&1 | tail -8 | tee "$OUT/cuda_path_tests.txt"
if has peer-quality; then  # llm-compressor (GPTQ variants, AutoRound) on the GPU against glmq: scripts/bench_gptq.py quality.
  # Needs the peer's wheels in .whl-peer/ (llmcompressor, auto-round, datasets, dill, multiprocess) and the shared
  # models folder copied to .shared-models/, both carried; PEERQ_ARGS adds bench_gptq options (recipes, peers, seeds).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peersite .whl-peer/*.whl .whl/*.whl
  for R in ${PEERQ_RUNS:-base}; do  # a run's arguments: PEERQ_ARGS_<run> if set, else PEERQ_ARGS; "cuda" adds: glmq's GPTQ only, --device cuda
    V=PEERQ_ARGS_$R; X=${!V:-${PEERQ_ARGS:-}}; [[ $R == cuda ]] && X="$X --no-rtn --peers --tag cuda --cli-arg=--device=cuda"
    timeout ${PEERQ_TIMEOUT:-500} python3 -m glmq.scripts.bench_gptq quality --shared ${SHARED_MODELS:-.shared-models} \
      --peer-python python3 --peer-path /tmp/peersite --work /tmp/bq-peer --out "$OUT" --name ${PEERQ_NAME:-gpu-peers}-$R \
      $X 2>&1 | tail -25 | tee "$OUT/bench_gptq_quality_gpu_$R.log"
  done
  tar czf "$OUT/bq-peer.tgz" -C /tmp/bq-peer $(cd /tmp/bq-peer && ls *.json *.log *.yaml 2>/dev/null)  # logs and reports, one file
fi
has kernels && timeout 330 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tail -60 | tee "$OUT/bench_kernels.log"
has gptq && timeout ${GPTQ_TIMEOUT:-500} python3 scripts/bench_gptq_gpu.py --work /tmp/glmq-g5 ${GPTQ_ARGS:-} --json "$OUT/bench_gptq_gpu.json" 2>&1 | tail -40 | tee "$OUT/bench_gptq_gpu.log"
has rtn && timeout 400 python3 scripts/bench_rtn.py --work /tmp/glmq-bench --layers 3 --device cuda --repeats 3 --out "$OUT/bench_rtn_cuda.json" 2>&1 | tail -40 | tee "$OUT/bench_rtn_cuda.log"
if has rtn-sizes; then  # the same benchmark at several input sizes (RTN_LAYERS), one work folder at a time (disk)
  for L in ${RTN_LAYERS:-3 8}; do
    timeout ${RTN_TIMEOUT:-280} python3 scripts/bench_rtn.py --work /tmp/glmq-bench-L$L --layers $L --device cuda --repeats 3 \
      --out "$OUT/bench_rtn_cuda_L$L.json" 2>&1 | grep -E "generated|round|glmq_over_copy|rss_minus"
    rm -rf /tmp/glmq-bench-L$L
  done
fi
DIST="python3 scripts/bench_dist.py --work /tmp/glmq-dist --device cuda --layers ${DIST_LAYERS:-2} --experts ${DIST_EXPERTS:-256} --shard-mb 1000 --ranks ${DIST_RANKS:-2}"
has dist-rtn && timeout ${DIST_TIMEOUT:-300} $DIST --repeats ${DIST_REPEATS:-2} --out "$OUT/bench_dist_cuda_rtn.json" 2>&1 | tail -30 | tee "$OUT/bench_dist_cuda_rtn.log"
has dist-gptq && timeout ${DIST_TIMEOUT:-500} $DIST --scheme gptq --jobs ${DIST_JOBS:-1,2} --out "$OUT/bench_dist_cuda_gptq.json" 2>&1 | tail -30 | tee "$OUT/bench_dist_cuda_gptq.log"
true
