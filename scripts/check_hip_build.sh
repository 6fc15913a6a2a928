#!/usr/bin/env bash
# HIP compile check of the GPU kernels: hipify csrc/cuda and csrc/include offline with
# torch.utils.hipify (from the test venv's torch), then compile every kernel
# (csrc/cuda/kernels/instantiate_all.cu, hipified) with Debian's hipcc for gfx90a (MI250).
# Installs hipcc with apt-get when it is missing. The torch glue (csrc/cuda/*.cu) is hipified
# too but not compiled: that needs a ROCm build of torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
ARCH="${JAKIRO_HIP_ARCH:-gfx90a}"
if ! command -v hipcc > /dev/null; then
  echo "== installing hipcc (Debian)"
  if [ "$(id -u)" = 0 ]; then SUDO=(); else SUDO=(sudo); fi
  APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get)
  "${APT[@]}" install -y -q hipcc > /dev/null || { "${APT[@]}" update -q > /dev/null && "${APT[@]}" install -y -q hipcc > /dev/null; }
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/csrc"
cp -r "$ROOT/csrc/cuda" "$ROOT/csrc/include" "$WORK/csrc/"
echo "== hipify ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
"$PYTHON" - "$WORK" <<'PY' > "$WORK/hipify.log" 2>&1 || { cat "$WORK/hipify.log"; exit 1; }
import sys
from torch.utils.hipify import hipify_python

work = sys.argv[1]
# hip_clang_launch: keep the <<<...>>> launch syntax, which hip-clang compiles as it is.
hipify_python.hipify(project_directory=work, output_directory=work, includes=["*"],
                     header_include_dirs=["csrc", "csrc/include"], show_progress=False,
                     is_pytorch_extension=True, hip_clang_launch=True)
PY
TU="$WORK/csrc/hip/kernels/instantiate_all.hip"
[ -f "$TU" ] || { echo "error: hipify did not produce $TU"; cat "$WORK/hipify.log"; exit 1; }
echo "== hipcc --offload-arch=$ARCH ($(HIP_PLATFORM=amd hipcc --version 2>/dev/null | head -1))"
HIP_PLATFORM=amd hipcc --offload-arch="$ARCH" -std=c++17 -O3 -Wall -Wno-unused-function \
  -I"$WORK/csrc" -I"$WORK/csrc/include" -c "$TU" -o "$WORK/kernels.o"
echo "compiled: $(du -h "$WORK/kernels.o" | cut -f1) object for $ARCH"
