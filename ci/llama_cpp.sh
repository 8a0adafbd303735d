#!/usr/bin/env bash
# llama.cpp for the tests and benchmarks (never a dependency of portaserve): the sources
# vendored in the llama-cpp-python source distribution on PyPI, with llama.cpp's own
# converter (convert_hf_to_gguf.py) and tools built from them with cmake.
#
#   ci/llama_cpp.sh DIR [TARGET...]      (default target: llama-tokenize)
#
# DIR receives the source tree; the tools land in DIR/build/bin. Then
#   export PORTASERVE_LLAMA_CPP_DIR=DIR
# Building llama-tokenize alone takes about 4 minutes on 2 cores; a second run reuses the build.
# Only the named targets are built. The tests need llama-tokenize; benchmarks/compare.py's
# `--llama-cpp DIR` needs
#   ci/llama_cpp.sh DIR llama-tokenize llama-bench llama-batched-bench llama-server
# (the server is configured only when llama-server is asked for, without its web UI, which
# would be downloaded or built with npm).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${1:?usage: ci/llama_cpp.sh DIR [TARGET...]}"
shift
TARGETS=("${@:-llama-tokenize}")
PYTHON="${PYTHON:-python3}"

if [ ! -f "$DIR/convert_hf_to_gguf.py" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
    mkdir -p "$(dirname "$DIR")"
    rm -rf "$DIR"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR"
    echo "$VERSION" >"$DIR/LLAMA_CPP_PYTHON_VERSION"  # benchmarks/compare.py names the sources by it
fi
# the compiler's warnings go to a log; a failure prints its end
log="$DIR/build.log"
SERVER=OFF
for t in "${TARGETS[@]}"; do
    if [ "$t" = llama-server ]; then SERVER=ON; fi
done
# a tree configured with the server keeps it (turning it off again would only drop targets)
if grep -qs '^LLAMA_BUILD_SERVER:BOOL=ON' "$DIR/build/CMakeCache.txt"; then SERVER=ON; fi
if ! { cmake -S "$DIR" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER="$SERVER" \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        && cmake --build "$DIR/build" --target "${TARGETS[@]}" -j "$(nproc)"; } >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "building llama.cpp failed (the whole log: $log)" >&2
    exit 1
fi
echo "llama.cpp $VERSION in $DIR: $(cd "$DIR/build/bin" && ls "${TARGETS[@]}")"
