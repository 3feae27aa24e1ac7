#!/usr/bin/env bash
# The main job: install, build, and run `attn tour` into ./tour (open tour/index.html).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default -DATTN_BUILD_CLI=ON >/dev/null  # on even if an earlier configure turned it off
cmake --build --preset default --target attn_cli
./build/default/attn tour --out "${1:-tour}"
