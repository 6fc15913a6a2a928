#!/usr/bin/env bash
# CTest's race check (CMakeLists.txt): run race_check built with fibers ($1) and with threads under
# ThreadSanitizer ($2). Both must exit 0 and finish ("done"), with the same outputs.
set -euo pipefail
fibers="$("$1")"
threads="$("$2")"
[ "$(tail -n 1 <<< "$fibers")" = done ] || { echo "the fiber build did not finish: $fibers"; exit 1; }
if [ "$fibers" != "$threads" ]; then
  echo "the fiber and thread builds disagree:"
  diff <(echo "$fibers") <(echo "$threads") || true
  exit 1
fi
echo "$fibers"
