#!/usr/bin/env bash
# Installs, builds and runs every test:
#   1. the unit, gradient, parity, CLI and Python tests (CTest; warnings are errors) after the
#      docs check (scripts/check-docs.py), then installs the Python module for Debian's
#      /usr/bin/python3,
#   1b. where nvcc is installed: the CUDA backend configured, compiled and linked (build/cuda: the
#      library, the CUDA tests, bench_cuda and the CLI) and its host-side tests run,
#   2. the fixture generator: what it writes now must equal the committed fixtures,
#   3. the installed package, consumed through CMake and pkg-config, shared and static,
#   4. the fuzzers, for a bounded time each (FUZZ_SECONDS, default 30),
#   5. the whole CTest suite again under AddressSanitizer + UndefinedBehaviorSanitizer,
#   6. the pip route: the wheel built in a fresh virtual environment with NumPy 2.x and
#      PyTorch 2.x from PyPI, installed, and python/tests run against it (scripts/pip-check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/ccache-env.sh
start=$SECONDS
stamp() { echo "   ($((SECONDS - start)) s so far)"; }

echo "== 1. build and test (RelWithDebInfo, warnings as errors)"
# MPI on: the communicator's and data-parallel training's tests run under mpirun (2 and 4
# ranks, shared memory and TCP loopback); the library without it is the main job's build.
cmake --preset default -DATTN_BUILD_CLI=ON -DATTN_BUILD_TESTS=ON -DATTN_BUILD_BENCH=ON \
  -DATTN_BUILD_PYTHON=ON -DATTN_WITH_MPI=ON -DATTN_DEBUG_INFO=ON -DATTN_PCH=OFF \
  >/dev/null  # all on (debug info, no PCH), whatever tour.sh configured
cmake --build --preset default
# The docs name only paths, tests and `attn` flags that exist (a second, not a build).
/usr/bin/python3 scripts/check-docs.py --attn build/default/attn
ctest --preset default
# The README's set-up makes `/usr/bin/python3 -c "import attn"` work.
bash scripts/install-python.sh build/default
stamp

echo "== 1b. CUDA backend: compile and link with nvcc, run the host-side tests"
# No GPU here: the GPU tests only compile (scripts/gpu-check.sh runs them on a GPU machine). The
# same flags as step 1 (MPI on), so that the CPU objects come from ccache.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_WERROR=ON \
    -DATTN_WITH_CUDA=ON -DATTN_WITH_MPI=ON -DATTN_BUILD_TESTS=ON -DATTN_BUILD_CLI=ON \
    -DATTN_BUILD_BENCH=OFF -DATTN_BUILD_PYTHON=OFF -DATTN_DEBUG_INFO=ON -DATTN_PCH=OFF >/dev/null
  # The CLI too: its `--device cuda` paths (train, bench attention) compile only here.
  cmake --build build/cuda --target attn_cuda_tests bench_cuda attn
  ctest --test-dir build/cuda -L cuda-host --output-on-failure
else
  echo "   nvcc not found: skipped"
fi
stamp

echo "== 2. fixtures: regenerate with PyTorch and compare with the committed ones"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 tests/fixtures/generate.py --out "$tmp"
/usr/bin/python3 tests/fixtures/generate.py --compare "$tmp" tests/fixtures
stamp

echo "== 3. package"
bash scripts/check-package.sh build/default
stamp

echo "== 4. fuzzers"
bash scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
stamp

echo "== 5. build and test under AddressSanitizer + UndefinedBehaviorSanitizer"
# MPI on here too: its tests run with leak detection off (tests/mpi/CMakeLists.txt says why).
cmake --preset asan -DATTN_WITH_MPI=ON >/dev/null
cmake --build --preset asan
ctest --preset asan
stamp

echo "== 6. pip: the wheel in a fresh virtual environment, python/tests against it"
bash scripts/pip-check.sh
stamp
