#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize and llama-speculative-simple (its own EAGLE-3
# speculation), the CPU bar this engine is measured against,
# from the source in PyPI's llama-cpp-python sdist (no network beyond the package index), for this
# CPU (GGML_NATIVE), into build/llama.cpp (or $1). About 5 minutes on 2 cores; run once.
#   bash scripts/build_llama_cpp.sh && python benchmarks/bench_vs_llama_cpp.py --llama-bench build/llama.cpp/bin
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/build/llama.cpp}" && cd "${1:-$ROOT/build/llama.cpp}" && pwd)"
bash "$ROOT/scripts/llama_cpp_source.sh" "$OUT"
echo "== building llama-bench, llama-quantize and llama-speculative-simple in $OUT"
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TOOLS=ON > "$OUT/cmake.log"
cmake --build "$OUT/build" -j "${JOBS:-2}" --target llama-bench llama-quantize llama-speculative-simple > "$OUT/build.log"
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-bench" "$OUT/build/bin/llama-quantize" "$OUT/build/bin/llama-speculative-simple" "$OUT/bin/"
echo "== $OUT/bin: $(ls "$OUT/bin" | tr '\n' ' ')"
