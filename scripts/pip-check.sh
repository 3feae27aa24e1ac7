#!/usr/bin/env bash
# The pip route as a user takes it, checked: a fresh virtual environment, the wheel built from
# this checkout (`python -m build --wheel`: pyproject.toml's scikit-build-core over the CMake
# build), installed, with NumPy 2.x and PyTorch 2.x from PyPI, then python/tests run against the
# installed package (from a neutral directory, so the checkout's python/attn cannot shadow it).
#
#   bash scripts/pip-check.sh            (scripts/test.sh runs it; needs `setup.sh build` + python3-venv)
#
# The C++ dependencies come from Debian (scripts/setup.sh build). PyPI's torch wheels for Linux
# are CUDA builds whose libraries need CUDA's (NEEDED entries, so `import torch` fails without
# them, even on a CPU). On this project's machine kind the CUDA 13 toolkit is installed, so the
# venv takes torch with --no-deps, its pure-Python dependencies and the four NVIDIA wheels the
# toolkit lacks (~0.7 GB instead of several); anywhere else (no CUDA toolkit) the full
# `pip install torch` (torch_deps below). pip's cache (~/.cache/pip) keeps the wheels between runs.
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
pip install build pytest "numpy>=2"

echo "-- pip-check: building the wheel"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
t0=$SECONDS
"$venv/bin/python" -m build --wheel --outdir "$out" . >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
wheel=$(ls "$out"/attn-*.whl)
echo "-- pip-check: $(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB in $((SECONDS - t0)) s"
pip install "$wheel"

# torch's requirements that are plain Python (its METADATA's Requires-Dist, less the CUDA ones).
torch_pure=(filelock "typing-extensions>=4.13.0" "setuptools>=77.0.3" "sympy>=1.13.3"
            "networkx>=2.5.1" jinja2 "fsspec>=0.8.5")
# torch 2.15's NVIDIA wheels that the machine's CUDA 13.0 toolkit does not provide (or provides
# in an older version: NCCL), found by `import torch` failing on each in turn.
torch_nvidia=(nvidia-cufile==1.17.1.22 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
              nvidia-nvshmem-cu13==3.7.2)
if [ "$torch_version" != none ]; then
  t0=$SECONDS
  if [ -e /usr/local/cuda/lib64/libcudart.so.13 ] && [ "$torch_version" = 2.15.0 ]; then
    pip install --no-deps "torch==$torch_version" "${torch_nvidia[@]}"
    pip install "${torch_pure[@]}"
  else
    pip install "torch==$torch_version"
  fi
  "$venv/bin/python" -c "import torch; print('-- pip-check: torch', torch.__version__)"
  echo "-- pip-check: torch installed in $((SECONDS - t0)) s"
fi

echo "-- pip-check: python/tests against the installed wheel"
cd /
"$venv/bin/python" -c "import attn, numpy; print('-- pip-check: attn', attn.__version__, 'at',
attn.__path__[0], 'numpy', numpy.__version__)"
OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE=1 \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$root/python/tests"
