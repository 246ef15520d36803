#!/usr/bin/env bash
# Run HERE (not on the GPU machine): put what benchmarks/gpu_h200.sh needs into .gpu/ (git-ignored via
# .git/info/exclude), to be named in the device call's `carry`: a trimmed llama-cpp-python sdist tree
# (~10 MB instead of 77 MB: no .git, vocab test models, docs, media, web UI, mobile examples) and the
# pure-Python wheels the GPU image lacks (gguf, diskcache).
#   bash benchmarks/prepare_gpu_carry.sh [/path/to/llama_cpp_python-0.3.36]
set -euo pipefail
VER=0.3.36
SRC=${1:-/tmp/sdist/llama_cpp_python-$VER}
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/whl
if [ ! -d "$SRC" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VER" -d /tmp/sdist-dl
  mkdir -p "$(dirname "$SRC")" && tar xzf "/tmp/sdist-dl/llama_cpp_python-$VER.tar.gz" -C "$(dirname "$SRC")"
fi
base=$(basename "$SRC")
tar czf ".gpu/$base-trimmed.tar.gz" -C "$(dirname "$SRC")" \
  --exclude="$base/.git" --exclude="$base/docs" \
  --exclude="$base/vendor/llama.cpp/.git" --exclude="$base/vendor/llama.cpp/models" \
  --exclude="$base/vendor/llama.cpp/docs" --exclude="$base/vendor/llama.cpp/media" \
  --exclude="$base/vendor/llama.cpp/tools/ui" --exclude="$base/vendor/llama.cpp/examples/llama.android" \
  --exclude="$base/vendor/llama.cpp/examples/llama.swiftui" --exclude='*.gguf' "$base"
# The GPU image has numpy, pyyaml, requests, tqdm, typer, rich, jinja2, scikit-build-core, cmake, ninja.
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf==0.19.0 diskcache==5.6.3
du -sh .gpu/* .gpu/whl/*
