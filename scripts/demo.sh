#!/usr/bin/env bash
# Install everything (first run: a few minutes) and run the project's main job.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd /tmp  # run the installed package, not the source tree
"$PY" -m jakiro_ext demo "$@"
