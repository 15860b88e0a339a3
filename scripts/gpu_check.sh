#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU, within about 8 minutes:
#   1. the GPU tests (Triton kernels natively in bf16, CUDA graphs vs eager, ...);
#   2. the GPU benchmarks on dummy Qwen2.5-1.5B-Instruct weights (bf16):
#      batch-1 latency beside the bandwidth floor, and offline throughput on 256 prompts with
#      input and output lengths uniform in [100, 1024], beside transformers' generate.
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (or RESULTS_DIR=...; default gpu-results/DATE)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-${RESULTS_DIR:-gpu-results/$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
MODEL=Qwen/Qwen2.5-1.5B-Instruct
export PYTHONUNBUFFERED=1

if ! $PY -c "import aioinfer" 2>/dev/null; then
  $PY -m pip install -q -e ".[test]" >"$RESULTS/install.log" 2>&1 || { echo "install failed"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RESULTS/gpu.txt" 2>&1

status() { if [ "$1" -eq 0 ]; then echo ok; else echo "FAILED ($1)"; fi; }

timeout 240 $PY -m pytest -q -m gpu tests/gpu tests/model/test_triton_kernels.py \
  >"$RESULTS/gpu-tests.log" 2>&1
tests_rc=$?

timeout 90 $PY -m aioinfer bench latency "$MODEL" --load-format dummy --dtype bfloat16 \
  --input-len 128 --output-len 128 --result-file "$RESULTS/latency.json" \
  >"$RESULTS/latency.log" 2>&1
latency_rc=$?

timeout 240 $PY -m aioinfer bench throughput "$MODEL" --load-format dummy --dtype bfloat16 \
  --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --vs transformers \
  --hf-batch-size 64 --result-file "$RESULTS/throughput.json" \
  >"$RESULTS/throughput.log" 2>&1
throughput_rc=$?

echo
echo "== aioinfer GPU check ($(head -2 "$RESULTS/gpu.txt" | tail -1)) =="
printf '%-12s %s  %s\n' "gpu tests" "$(status $tests_rc)" "$(tail -1 "$RESULTS/gpu-tests.log")"
printf '%-12s %s\n' "latency" "$(status $latency_rc)"
tail -6 "$RESULTS/latency.log"
printf '%-12s %s\n' "throughput" "$(status $throughput_rc)"
tail -8 "$RESULTS/throughput.log"
echo "details: $RESULTS"
[ $tests_rc -eq 0 ] && [ $latency_rc -eq 0 ] && [ $throughput_rc -eq 0 ]
