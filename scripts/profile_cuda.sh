#!/usr/bin/env bash
# Profile one `glmq quantize --device cuda` run (main thread, cProfile) on the GLM-5-layout bench input.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/glmq
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m compileall -q /tmp/site >/dev/null
export PYTHONPATH=/tmp/pkg:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "from glmq.formats import fixtures; fixtures.make_checkpoint('/tmp/gb/src', 'glm_moe_dsa', preset='bench', split_partners=False, config_overrides={'num_hidden_layers': 3})"
python3 -m cProfile -s tottime -m glmq quantize -m /tmp/gb/src -o /tmp/gb/o1 --device cuda --no-progress 2>&1 | head -60 | tee "$OUT/profile.txt"
python3 -c "import json; print(json.load(open('/tmp/gb/o1/glmq_report.json'))['stage_busy_seconds'])" | tee -a "$OUT/profile.txt"
