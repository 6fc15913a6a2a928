#!/usr/bin/env bash
# Install everything and run the whole test suite:
#   1. the Python tests against the CPU build (torch 2.13.0 CPU), including the GPU kernels run
#      under the SIMT emulator at warp widths 32 and 64 (python_tests/gpu);
#   2. the GPU kit's dry run (scripts/gpu/run.sh --dry-run: its stages on the CPU, tiny shapes);
#   3. the C++ tests (CMake + CTest): the framework-free kernel headers, and every GPU kernel
#      under the emulator with fibers and with real threads under ThreadSanitizer (race check);
#   4. the HIP compile check: the kernels hipified offline and compiled with hipcc for gfx90a
#      (installs Debian's hipcc with apt-get; JAKIRO_TEST_HIP_BUILD=0 leaves it out);
#   5. the CUDA build check: the extension built with its CUDA sources against the CUDA 13 build
#      of torch 2.14.1 and nvcc, imported on this GPU-less machine, and the test suite run on it.
#      JAKIRO_TEST_CUDA_BUILD=0 leaves it out (it needs a CUDA toolkit and ~6 GB of disk);
#   6. the vLLM check: vLLM's CPU build serving a Jakiro head through this package's plugin
#      (scripts/serving/vllm_check.sh; .venv-vllm, ~2 GB). JAKIRO_TEST_VLLM=0 leaves it out.
# 3-5 build and run apart from the Python tests and need none of their results: they run in the
# background at the lowest priority (nice 19) while 1, 2 and 6 run, on the CPU time the Python
# tests leave (on 2 cores about half of one: much of a test is one Python thread); their logs
# are shown when they end, and any that failed fails the run. The C++ tests and the CUDA build
# check (its own environment) need nothing of .venv: they start before it is made, and the CUDA
# build check, the longest, ends the run all the same.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="$ROOT/build/test-logs"
mkdir -p "$LOGS"
NAMES=() TITLES=() PIDS=()
background() {  # NAME TITLE COMMAND: COMMAND (bash) in the background at the lowest priority, in a
                # process group of its own, its output in $LOGS/NAME.log
  # (setsid makes a session, which Linux schedules as a group beside the tests' own: nice 19 for
  # that group too, else it takes half the CPU whatever its processes' nice)
  setsid nice -n 19 bash -c "echo 19 > /proc/self/autogroup 2>/dev/null || true
set -euo pipefail
$3
echo \"(\$SECONDS s)\"" > "$LOGS/$1.log" 2>&1 &
  NAMES+=("$1") TITLES+=("$2") PIDS+=($!)
}
# A run that stops early takes its background checks with it.
# (the process itself where it has not made its group yet)
trap 'for pid in "${PIDS[@]}"; do kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done' EXIT

background cpp "C++ tests: kernel headers; GPU kernels under the SIMT emulator (fibers, threads + TSan)" "
  cmake -S '$ROOT' -B '$ROOT/build/cmake' -DCMAKE_BUILD_TYPE=Release -DJAKIRO_WITH_TORCH=OFF > /dev/null
  cmake --build '$ROOT/build/cmake' -j 2 > /dev/null
  ctest --test-dir '$ROOT/build/cmake' --output-on-failure -j 2  # the two race checks (warp widths 32, 64) side by side"
if [ "${JAKIRO_TEST_CUDA_BUILD:-1}" = "0" ]; then
  echo "== CUDA build check: left out (JAKIRO_TEST_CUDA_BUILD=0)"
else
  background cuda "CUDA build check" "bash '$ROOT/scripts/check_cuda_build.sh'"
fi
for title in "${TITLES[@]}"; do echo "== started in the background: $title"; done

source "$ROOT/scripts/env.sh" pytest scipy sentencepiece  # (sentencepiece: llama.cpp's converter, in a test)
# EAGLE's and Medusa's reference code, whose loops the integration tests run with this package's
# ops (their pins are stale and none of them is needed for their loops: --no-deps).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps eagle-llm==1.2.1 medusa-llm==0.1
cd "$ROOT"
if [ "${JAKIRO_TEST_HIP_BUILD:-1}" = "0" ]; then
  echo "== HIP compile check: left out (JAKIRO_TEST_HIP_BUILD=0)"
else  # (hipify comes with .venv's torch)
  background hip "HIP compile check" "PYTHON='$VENV/bin/python' bash '$ROOT/scripts/check_hip_build.sh'"
  echo "== started in the background: ${TITLES[-1]}"
fi

echo "== python tests (CPU build)"
JAKIRO_EXPECT_CUDA=0 "$VENV/bin/pytest" -q python_tests

echo "== the GPU kit, dry run (every stage of scripts/gpu/run.sh on the CPU, tiny shapes)"
PYTHON="$VENV/bin/python" bash "$ROOT/scripts/gpu/run.sh" --dry-run probe build errors test tensor-cores e2e decode bench sanitize profile \
  check-training train

if [ "${JAKIRO_TEST_VLLM:-1}" = "0" ]; then
  echo "== vLLM check: left out (JAKIRO_TEST_VLLM=0)"
else
  JAKIRO_VENV="$VENV" bash "$ROOT/scripts/serving/vllm_check.sh"
fi

failed=()
for i in "${!PIDS[@]}"; do
  if wait "${PIDS[$i]}"; then status=passed; else status=FAILED; failed+=("${TITLES[$i]}"); fi
  echo "== ${TITLES[$i]}: $status"
  cat "$LOGS/${NAMES[$i]}.log"
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'error: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
