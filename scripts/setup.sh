#!/usr/bin/env bash
# Installs what attn needs from Debian's packages, by profile (idempotent; quick when all are
# present). Every package is named here: nothing is left to apt's Recommends (installs run with
# --no-install-recommends) or to what a machine happens to have. scripts/fresh-machine.sh proves
# it in a bare Debian 12 root.
#
#   bash scripts/setup.sh [PROFILE...]      (default: build)
#
#   build   the library, the CLI and `attn tour` (scripts/tour.sh)
#   test    build + everything scripts/test.sh runs: GoogleTest, Google Benchmark, the Python
#           module and its tests, PyTorch (the oracle), clang + libFuzzer, the package checks
#   docs    doxygen (scripts/docs.sh)
#   fresh   debootstrap and git (scripts/fresh-machine.sh)
set -euo pipefail

build=(
  g++ cmake ninja-build ccache                 # compiler (its libgomp is the OpenMP runtime), build
  libfmt-dev nlohmann-json3-dev libcli11-dev   # formatting, JSON, CLI
  libhwy-dev                                   # Highway: SIMD kernels
  # oneDNN: the GEMMs. Its CMake config (dnnl-config.cmake) requires OpenCL's headers and
  # loader even for a CPU-only build, but the package only *recommends* them.
  libdnnl-dev ocl-icd-opencl-dev
)
test=(
  "${build[@]}"
  pkg-config                                   # scripts/check-package.sh
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and benchmarks
  python3 python3-dev python3-numpy python3-pytest pybind11-dev  # the Python module and its tests
  python3-venv                                 # scripts/pip-check.sh: the wheel in a fresh venv
  python3-torch                                # the oracle (tests/fixtures, parity, bench)
  libopenblas0-pthread                         # PyTorch's BLAS in bench/run_*.sh (not the reference)
  clang libclang-rt-14-dev libomp-14-dev       # fuzzers (libFuzzer; the library uses OpenMP)
  openmpi-bin libopenmpi-dev                   # -DATTN_WITH_MPI=ON: mpirun + MPI for the tests
)
docs=(doxygen python3)
fresh=(debootstrap git)  # scripts/fresh-machine.sh: the root, and the clone of HEAD

(($#)) || set -- build
wanted=()
for profile in "$@"; do
  case "$profile" in
    build) wanted+=("${build[@]}") ;;
    test) wanted+=("${test[@]}") ;;
    docs) wanted+=("${docs[@]}") ;;
    fresh) wanted+=("${fresh[@]}") ;;
    *) echo "setup: unknown profile '$profile' (expected build, test, docs or fresh)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  # Each name once, in order (profiles overlap).
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | awk '!seen[$0]++')
  echo "setup ($*): installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
