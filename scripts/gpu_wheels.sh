#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels of the packages aioinfer needs that a
# CUDA machine's Python 3.12 image may lack, for scripts/gpu_check.sh to install there without
# a network (it installs from WHEELS_DIR, default .whl, when `import aioinfer.cli` fails).
# The list was read off an image that had torch, triton, transformers, aiohttp, typer, rich,
# prometheus-client, safetensors and huggingface_hub but not these.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
  typing_extensions==4.16.0 orjson==3.13.0 gguf==0.19.0
