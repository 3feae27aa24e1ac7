#!/usr/bin/env bash
# The pip route as a user takes it, checked: a fresh virtual environment, the wheel built from
# this checkout (`python -m build --wheel`: pyproject.toml's scikit-build-core over the CMake
# build), installed, with NumPy 2.x and PyTorch 2.x from PyPI, then python/tests run against the
# installed package (from a neutral directory, so the checkout's python/attn cannot shadow it).
#
#   bash scripts/pip-check.sh            (scripts/test.sh runs it; needs `setup.sh build` + python3-venv)
#
# The C++ dependencies come from Debian (scripts/setup.sh build); torch comes from
# scripts/pip-torch.sh (which says why it is not a plain `pip install torch`). pip's cache
# (~/.cache/pip) keeps the wheels between runs.
#
# Environment: ATTN_PIP_VENV (default ~/.cache/attn/pip-venv, recreated on every run),
# ATTN_TORCH (default 2.15.0; "none" skips torch, whose tests then skip visibly).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source scripts/ccache-env.sh
python=${PYTHON:-/usr/bin/python3}
venv=${ATTN_PIP_VENV:-$HOME/.cache/attn/pip-venv}
torch_version=${ATTN_TORCH:-2.15.0}

rm -rf "$venv"
"$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# The build runs in this venv (--no-isolation) with pyproject.toml's build requirements installed
# here: the venv's fixed path keeps pybind11's include path the same from run to run, so ccache
# serves the bindings too (pip's isolated build environment has a new random path every time,
# which ccache cannot see past). `pip install .` as users run it is the isolated build.
pip install build pytest "numpy>=2" "scikit-build-core>=0.10" "pybind11>=2.12"

echo "-- pip-check: building the wheel"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
t0=$SECONDS
"$venv/bin/python" -m build --wheel --no-isolation --outdir "$out" . >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
wheel=$(ls "$out"/attn-*.whl)
echo "-- pip-check: $(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB in $((SECONDS - t0)) s"
pip install "$wheel"

if [ "$torch_version" != none ]; then
  t0=$SECONDS
  bash scripts/pip-torch.sh "$venv" "$torch_version"
  echo "-- pip-check: torch installed in $((SECONDS - t0)) s"
fi

echo "-- pip-check: python/tests against the installed wheel"
cd /
"$venv/bin/python" -c "import attn, numpy; print('-- pip-check: attn', attn.__version__, 'at',
attn.__path__[0], 'numpy', numpy.__version__)"
OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE=1 \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$root/python/tests"
