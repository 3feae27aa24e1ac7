#!/usr/bin/env bash
# Makes `/usr/bin/python3 -c "import attn"` work: builds the module for Debian's python3 (if the
# build tree lacks it) and installs the package with CMake's install rule, i.e. into
# <prefix>/lib/python3.X/dist-packages/attn (prefix /usr/local, on Debian python3's sys.path).
# No pip, no PyPI (Debian's pybind11-dev, NumPy 1.24, torch 1.13). For a virtual environment,
# `pip install .` instead (pyproject.toml; docs/python.md, "Set-up").
#
#   bash scripts/install-python.sh [build-dir]        (default: build/default)
#   PREFIX=/opt/attn bash scripts/install-python.sh   (then add its dist-packages to PYTHONPATH)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
prefix=${PREFIX:-/usr/local}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" --target _attn

SUDO=""
if [ ! -w "$prefix" ] && [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
$SUDO cmake --install "$build" --component python --prefix "$prefix"

# Check from a neutral directory, so the source tree's python/attn cannot shadow the install.
python=$(sed -n 's/^ATTN_PYTHON_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
site="$prefix/$(sed -n 's/^ATTN_PYTHON_INSTALL_DIR:STRING=//p' "$build/CMakeCache.txt")"
if [ "$prefix" != /usr/local ]; then
  echo "install-python: $site is not on python3's default path; use PYTHONPATH=$site"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
(cd / && "${python:-/usr/bin/python3}" -c \
  "import attn; print('install-python: attn', attn.__version__, 'at', attn.__path__[0])")
