#!/usr/bin/env bash
# Installs, builds and runs every test: the unit and parity tests (CTest), the fixture generator
# (the committed fixtures must equal what it writes now), and the whole suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== build and test (RelWithDebInfo, warnings as errors)"
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default

if [ -f tests/fixtures/generate.py ]; then
  echo "== fixtures: regenerate with PyTorch and compare with the committed ones"
  tmp=$(mktemp -d)
  python3 tests/fixtures/generate.py --out "$tmp"
  python3 tests/fixtures/generate.py --compare "$tmp" tests/fixtures
  rm -rf "$tmp"
fi

echo "== build and test under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake --preset asan >/dev/null
cmake --build --preset asan
ctest --preset asan
