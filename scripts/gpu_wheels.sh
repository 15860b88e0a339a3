#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels of the Python packages that aioinfer and its GPU
# tests need but the GPU machine's image lacks, so that scripts/gpu_check.sh can install them
# there without a network. That image runs Python 3.12 on x86_64 and already has torch, triton,
# transformers, numpy, ninja, requests, tqdm, pyyaml, aiohttp, pytest (with xdist and timeout)
# and the rest of aioinfer's dependencies.
# Never list torch, triton or nvidia-* here: the image's own builds must stay in use, and the
# whole checkout travels to that machine within 64 MiB (this folder is about 8 MiB).
# The versions are the ones the development environment tests with; each wheel is fetched
# without its dependencies, so a new package's Requires-Dist must be checked by hand:
#   unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

WHEELS=(
  pydantic==2.14.4
  pydantic_core==2.50.5
  annotated_types==0.8.0
  typing_inspection==0.4.5
  typing_extensions==4.16.0
  orjson==3.13.0
  gguf==0.19.0
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
)
# Not pytest-asyncio: no GPU test is async, and its releases pin pytest versions the image's
# pytest may not meet (pytest's config then only warns about the asyncio options).

# A fresh folder each time: gpu_check.sh installs .whl/*.whl, and two versions of one package
# there would make that install fail.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$tmp" "${WHEELS[@]}"
rm -rf .whl
mkdir .whl
mv "$tmp"/*.whl .whl/

ls -l .whl
size_mib=$(du -sm .whl | cut -f1)
echo ".whl: $(find .whl -type f -name '*.whl' | wc -l) wheels, ${size_mib} MiB"
if [ "$size_mib" -ge 40 ]; then
  echo "error: .whl is over 40 MiB; the checkout must reach the GPU machine within 64 MiB" >&2
  exit 1
fi
