#!/usr/bin/env bash
# Installs what attn needs from Debian's packages (idempotent; quick when all are present).
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libfmt-dev nlohmann-json3-dev libcli11-dev   # formatting, JSON, CLI
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and benchmarks
  libhwy-dev libdnnl-dev                       # SIMD kernels, GEMMs
  python3 python3-numpy python3-pytest python3-torch pybind11-dev python3-dev  # oracle, bindings
  libopenblas0-pthread                         # PyTorch's BLAS in bench/run_*.sh (not the reference)
  clang libclang-rt-14-dev libomp-14-dev       # fuzzers (libFuzzer; the library uses OpenMP)
  doxygen                                      # API reference (scripts/docs.sh)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
