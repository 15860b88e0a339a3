#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU, within about 8 minutes:
#   1. the GPU tests (Triton kernels natively in bf16, CUDA graphs vs eager, ...);
#   2. the GPU benchmarks on dummy Qwen2.5-1.5B-Instruct weights (bf16):
#      batch-1 latency beside the bandwidth floor, and offline throughput on 256 prompts with
#      input and output lengths uniform in [100, 1024], beside transformers' generate.
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (or RESULTS_DIR=...; default gpu-results/DATE)
# It runs from this checkout (no install of aioinfer itself). Python packages the machine lacks
# are installed from pip, or, on a machine without a network, from wheels in WHEELS_DIR
# (scripts/gpu_wheels.sh downloads them beforehand).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${RESULTS_DIR:-gpu-results/$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
MODEL=Qwen/Qwen2.5-1.5B-Instruct
WHEELS=${WHEELS_DIR:-.whl}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! $PY -c "import aioinfer.cli, pydantic, orjson, gguf" 2>/dev/null; then
  if [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/aioinfer-site \
      "$WHEELS"/*.whl >"$RESULTS/install.log" 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/aioinfer-site"
  else
    $PY -m pip install -q -e ".[test]" >"$RESULTS/install.log" 2>&1
  fi
  $PY -c "import aioinfer.cli, pydantic, orjson, gguf" >>"$RESULTS/install.log" 2>&1 \
    || { echo "install failed"; cat "$RESULTS/install.log"; exit 1; }
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton',
triton.__version__, '| transformers', transformers.__version__)"
} >"$RESULTS/gpu.txt" 2>&1

status() { if [ "$1" -eq 0 ]; then echo ok; else echo "FAILED ($1)"; fi; }

phase() { echo "phase $1 ends at ${SECONDS}s" >>"$RESULTS/gpu.txt"; }
phase start
# The Triton kernel tests run compiled here (in bfloat16 and float32), not interpreted.
timeout 140 $PY -m pytest -q --tb=short -p no:cacheprovider \
  tests/gpu tests/model/test_triton_kernels.py tests/model/test_triton_layers.py \
  >"$RESULTS/gpu-tests.log" 2>&1
tests_rc=$?
phase tests

timeout 75 $PY -m aioinfer bench latency "$MODEL" --load-format dummy --dtype bfloat16 \
  --input-len 128 --output-len 128 --result-file "$RESULTS/latency.json" \
  >"$RESULTS/latency.log" 2>&1
latency_rc=$?
phase latency

timeout 60 $PY scripts/gpu_step_profile.py >"$RESULTS/step-profile.log" 2>&1
profile_rc=$?
phase profile

timeout 210 $PY -m aioinfer bench throughput "$MODEL" --load-format dummy --dtype bfloat16 \
  --num-prompts 256 --input-len 100:1024 --output-len 100:1024 \
  --vs transformers --hf-batch-size 256 --result-file "$RESULTS/throughput.json" \
  >"$RESULTS/throughput.log" 2>&1
throughput_rc=$?
phase throughput

echo
echo "== aioinfer GPU check =="
cat "$RESULTS/gpu.txt"
printf '%-12s %s  %s\n' "gpu tests" "$(status $tests_rc)" "$(tail -1 "$RESULTS/gpu-tests.log")"
[ $tests_rc -eq 0 ] || grep -E "^(FAILED|ERROR)" "$RESULTS/gpu-tests.log" | head -20
printf '%-12s %s\n' "latency" "$(status $latency_rc)"
tail -8 "$RESULTS/latency.log"
printf '%-12s %s\n' "step profile" "$(status $profile_rc)"
grep -A8 "^unprofiled" "$RESULTS/step-profile.log"
printf '%-12s %s\n' "throughput" "$(status $throughput_rc)"
tail -10 "$RESULTS/throughput.log"
echo "details: $RESULTS"
[ $tests_rc -eq 0 ] && [ $latency_rc -eq 0 ] && [ $throughput_rc -eq 0 ]
