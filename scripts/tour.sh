#!/usr/bin/env bash
# The main job: install what the library and the CLI need (scripts/setup.sh build: no test
# packages), build the CLI, and run `attn tour` into ./tour (open tour/index.html).
#   bash scripts/tour.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
source scripts/ccache-env.sh
# The CLI on (even if an earlier configure turned it off); tests, benchmarks and the Python
# module off, since their packages come with `setup.sh test` (scripts/test.sh turns them on).
# No debug information and the CLI's third-party headers precompiled: on a bare machine the
# build is cold, and this halves it (scripts/test.sh turns both back).
cmake --preset default -DATTN_BUILD_CLI=ON -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_BENCH=OFF \
  -DATTN_BUILD_PYTHON=OFF -DATTN_DEBUG_INFO=OFF -DATTN_PCH=ON >/dev/null
cmake --build --preset default --target attn_cli
./build/default/attn tour --out "${1:-tour}"
