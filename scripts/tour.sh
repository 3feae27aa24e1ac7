#!/usr/bin/env bash
# The main job: install, build, and run `attn tour` into ./tour (open tour/index.html).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target attn_cli
./build/default/attn tour --out "${1:-tour}"
