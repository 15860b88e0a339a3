#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU. Such a machine is lent for about 15
# minutes in all, so the questions that matter most come first:
#   phase 1 (about 5 minutes, the install included; 6 at the limits)
#     a. the Triton kernels, compiled natively (bf16 and float32), in parallel;
#     b. the engine-level GPU tests (CUDA graphs vs eager, MoE, embeddings, structured outputs,
#        `plan` against `serve`), one at a time;
#     c. scripts/gpu_engine_check.py, when the checkout has it: the engine's start-up numbers,
#        a worst-case step, graphs vs eager;
#     d. batch-1 latency beside the bandwidth floor, and the step profile;
#   phase 2 (about 3 minutes): offline throughput on 256 prompts with input and output lengths
#     uniform in [100, 1024], beside transformers' generate.
# The benchmarks run on dummy Qwen2.5-1.5B-Instruct weights in bf16.
#
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (default gpu-results/DATE)
# It writes at most 8 files into RESULTS_DIR (a lent machine sends back no more): summary.txt,
# tests.log, engine.log, latency.log, latency.json, profile.log, throughput.log, throughput.json.
# It prints summary.txt at the end and exits non-zero if anything failed.
#
# It runs from this checkout; aioinfer itself is not installed. The packages the machine lacks
# come from the wheels in .whl/ (or WHEELS_DIR; scripts/gpu_wheels.sh downloads them),
# installed with --no-deps into a folder of their own, so that no pip command can touch the
# machine's torch.
# With GPU_CHECK_DRY_RUN=1 each step's command is written into its log instead of being run
# (tests/ship/test_gpu_check_script.py checks the script that way on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
RESULTS=${1:-gpu-results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
MODEL=Qwen/Qwen2.5-1.5B-Instruct
WHEELS=${WHEELS_DIR:-.whl}
SITE=/tmp/aioinfer-site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# One Triton cache for every step: a kernel compiled by the tests is not compiled again later.
export TRITON_CACHE_DIR=/tmp/aioinfer-triton
# xgrammar's tvm-ffi would otherwise build a torch add-on with nvcc at its first import
# where torch lacks the DLPack exchange API; aioinfer hands xgrammar numpy arrays only.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1

SUMMARY=$RESULTS/summary.txt
TESTS_LOG=$RESULTS/tests.log
FAILED=0
: >"$SUMMARY"
: >"$TESTS_LOG"

# run LOG SECS CMD...: CMD with its output appended to LOG, stopped after SECS seconds. SIGINT
# first, so that pytest still prints its summary; SIGKILL 20 s later if it does not stop.
run() {
  local log=$1 secs=$2
  shift 2
  echo "\$ $*" >>"$log"
  if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    return 0
  fi
  timeout -s INT -k 20 "$secs" "$@" >>"$log" 2>&1
}

verdict() {
  case $1 in
    0) echo ok ;;
    124) echo "FAILED (time limit)" ;;
    137) echo "FAILED (killed)" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}

# record NAME RC [DETAIL]: the step's line in the summary, with the time it ended.
record() {
  printf '%-13s %5ss  %-19s %s\n' "$1" "$SECONDS" "$(verdict "$2")" "${3:-}" | sed 's/ *$//' \
    >>"$SUMMARY"
  [ "$2" -eq 0 ] || FAILED=1
}

# pytest_step NAME SECS ARGS...: one pytest run appended to tests.log; its closing line and its
# FAILED/ERROR lines go into the summary.
pytest_step() {
  local name=$1 secs=$2
  shift 2
  local from=$(($(wc -l <"$TESTS_LOG") + 1))
  echo "== $name" >>"$TESTS_LOG"
  run "$TESTS_LOG" "$secs" "$PY" -m pytest -q --tb=short -p no:cacheprovider --durations=15 "$@"
  local rc=$?
  local part closing
  part=$(tail -n +"$from" "$TESTS_LOG")
  closing=$(grep -E '(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' <<<"$part" | tail -1)
  closing=$(sed -E 's/^=+ //; s/ =+$//' <<<"$closing")
  record "$name" $rc "$closing"
  grep -E '^(FAILED|ERROR)' <<<"$part" | head -20 >>"$SUMMARY"
}

{
  echo "== aioinfer GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  timeout -s INT 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} >>"$SUMMARY" 2>&1

# The install log stays only while it is needed: on a failure it goes into the summary.
INSTALL_LOG=$RESULTS/install.log
: >"$INSTALL_LOG"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  run "$INSTALL_LOG" 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  install_rc=$?
else
  echo "no wheels in $WHEELS/: run scripts/gpu_wheels.sh where there is a network" >>"$INSTALL_LOG"
  install_rc=0
fi
# The first four imports are needed to run anything; the others only by some tests.
timeout -s INT 120 "$PY" - >>"$INSTALL_LOG" 2>&1 <<'EOF'
import importlib
import sys

NEEDED = ["aioinfer.cli", "pydantic", "orjson", "gguf"]
OTHERS = ["torch", "triton", "transformers", "xgrammar", "pytest"]
found, missing = [], []
for name in NEEDED + OTHERS:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        found.append(f"{name} MISSING ({type(exc).__name__}: {exc})")
        missing += [name] if name in NEEDED else []
    else:
        found.append(f"{name} {getattr(module, '__version__', '')}".rstrip())
print("versions:", ", ".join(found))
sys.exit(1 if missing else 0)
EOF
imports_rc=$?
grep '^versions:' "$INSTALL_LOG" >>"$SUMMARY"
record install $((install_rc || imports_rc))
if [ $install_rc -ne 0 ] || [ $imports_rc -ne 0 ]; then
  cat "$INSTALL_LOG" >>"$SUMMARY"
  rm -f "$INSTALL_LOG"
  cat "$SUMMARY"
  exit 1
fi
rm -f "$INSTALL_LOG"

echo "-- phase 1" >>"$SUMMARY"
# a. Kernel-only tests, in parallel: the files of tests/model/kernels, whole (their cases that
# the CPU suite runs interpreted run compiled here).
pytest_step "kernel tests" 75 -n 8 --timeout=60 tests/model/kernels

# b. Engine-level tests, one at a time (each builds an engine that takes the GPU's memory): the
# tests marked `gpu` of tests/gpu (its other tests run in the CPU suite) and the MoE decoders on
# CUDA. The live log at WARNING shows a Triton kernel's fallback to torch, which a passing test
# would hide.
engine_tests=(-m gpu tests/gpu tests/model/test_moe_gpu.py)
if grep -q "def test_plan_matches_serve_on_cuda" tests/ship/test_plan.py; then
  engine_tests+=(tests/ship/test_plan.py::test_plan_matches_serve_on_cuda)
fi
pytest_step "engine tests" 150 --timeout=75 -o log_cli=true -o log_cli_level=WARNING \
  "${engine_tests[@]}"

# c. The engine's own numbers.
if [ -f scripts/gpu_engine_check.py ]; then
  run "$RESULTS/engine.log" 60 "$PY" scripts/gpu_engine_check.py
  record "engine check" $?
  tail -20 "$RESULTS/engine.log" >>"$SUMMARY"
else
  printf '%-13s %5ss  %s\n' "engine check" "$SECONDS" \
    "skipped: scripts/gpu_engine_check.py is not in this checkout" >>"$SUMMARY"
fi

# d. Batch-1 latency and where a step's time goes.
run "$RESULTS/latency.log" 45 "$PY" -m aioinfer bench latency "$MODEL" --load-format dummy \
  --dtype bfloat16 --input-len 128 --output-len 128 --result-file "$RESULTS/latency.json"
record latency $?
tail -8 "$RESULTS/latency.log" >>"$SUMMARY"

run "$RESULTS/profile.log" 40 "$PY" scripts/gpu_step_profile.py
profile_rc=$?
record "step profile" $profile_rc
if [ $profile_rc -eq 0 ]; then
  grep -A8 "^unprofiled" "$RESULTS/profile.log" >>"$SUMMARY"
else
  tail -8 "$RESULTS/profile.log" >>"$SUMMARY"
fi

echo "-- phase 2" >>"$SUMMARY"
run "$RESULTS/throughput.log" 180 "$PY" -m aioinfer bench throughput "$MODEL" \
  --load-format dummy --dtype bfloat16 --num-prompts 256 --input-len 100:1024 \
  --output-len 100:1024 --vs transformers --hf-batch-size 256 \
  --result-file "$RESULTS/throughput.json"
record throughput $?
tail -10 "$RESULTS/throughput.log" >>"$SUMMARY"

# A Triton kernel that does not match torch on this device is replaced by torch silently (but
# for a warning): the run passes, slower. That is a failure here.
fallbacks=$(cd "$RESULTS" && grep -H "is not used on this device" ./*.log | sort -u | head -10)
if [ -n "$fallbacks" ]; then
  printf '%-13s %5ss  %s\n' "triton" "$SECONDS" "FAILED: a kernel fell back to torch" >>"$SUMMARY"
  echo "$fallbacks" >>"$SUMMARY"
  FAILED=1
fi

# A lent machine sends back at most 8 files.
files=$(find "$RESULTS" -type f | wc -l)
if [ "$files" -gt 8 ]; then
  echo "FAILED: $files files in $RESULTS, more than the 8 that come back" >>"$SUMMARY"
  FAILED=1
fi
echo "details: $RESULTS ($files files)" >>"$SUMMARY"
echo
cat "$SUMMARY"
exit $FAILED
