#!/usr/bin/env bash
# llama.cpp's source as PyPI's llama-cpp-python sdist vendors it (no network beyond the package
# index), into $1/src (default build/llama.cpp/src), whole or not at all; nothing if it is there.
# Used by build_llama_cpp.sh (its benchmarks' binaries) and by the test that converts an EAGLE-3
# head with llama.cpp's own convert_hf_to_gguf.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/build/llama.cpp}" && cd "${1:-$ROOT/build/llama.cpp}" && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if [ ! -f "$OUT/src/CMakeLists.txt" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "== llama-cpp-python $VERSION source (its vendored llama.cpp)"
  (cd "$tmp" && "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp")
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$OUT/src.partial" && cp -r "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$OUT/src.partial"
  rm -f "$OUT/src.partial/.git"  # a submodule link into the sdist's absent git folder
  mv "$OUT/src.partial" "$OUT/src"  # whole or not at all
fi
