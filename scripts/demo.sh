#!/usr/bin/env bash
# Install everything (first run: a few minutes) and run the project's main job.
set -euo pipefail
demo_args=("$@")
set --  # env.sh takes extra pip packages as arguments: the demo's own are not for it
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd /tmp  # run the installed package, not the source tree
"$PY" -m jakiro_ext demo "${demo_args[@]}"
