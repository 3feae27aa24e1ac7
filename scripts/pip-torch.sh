#!/usr/bin/env bash
# Installs PyTorch 2.x from PyPI into a virtual environment for CPU use, as small as this machine
# allows:
#
#   bash scripts/pip-torch.sh VENV [VERSION]      (default 2.15.0)
#
# PyPI's Linux torch wheels are CUDA builds: libtorch_cuda.so, which libtorch.so needs, has
# NEEDED entries on cudart, cuBLAS, cuDNN, cuFFT, cuSPARSE, cuSPARSELt, cuFile, NCCL, NVSHMEM,
# NVRTC and CUPTI, so `import torch` fails without them even on a CPU-only machine
# (`pip install --no-deps torch` plus its pure-Python requirements: "ImportError:
# libcufile.so.0: cannot open shared object file"). Where the CUDA 13 toolkit is installed (this
# project's machine kind: /usr/local/cuda) it provides most of them, and torch 2.15 then needs
# only four NVIDIA wheels more (cuFile, cuSPARSELt, NVSHMEM, and NCCL, whose toolkit copy is too
# old: "undefined symbol: ncclCommResume"): ~0.7 GB installed instead of several GB. Anywhere
# else, or for another version, this is the plain `pip install torch==VERSION` with every
# NVIDIA dependency.
set -euo pipefail
venv=${1:?usage: pip-torch.sh VENV [VERSION]}
version=${2:-2.15.0}
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# torch 2.15.0's Requires-Dist that are plain Python, and the NVIDIA wheels named above.
pure=(filelock "typing-extensions>=4.13.0" "setuptools>=77.0.3" "sympy>=1.13.3"
      "networkx>=2.5.1" jinja2 "fsspec>=0.8.5")
nvidia=(nvidia-cufile==1.17.1.22 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
        nvidia-nvshmem-cu13==3.7.2)
if [ "$version" = 2.15.0 ] && [ -e /usr/local/cuda/lib64/libcudart.so.13 ]; then
  pip install --no-deps "torch==$version" "${nvidia[@]}"
  pip install "${pure[@]}"
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "pip-torch: torch $version does not import on this machine's CUDA toolkit; installing" \
         "it with all its dependencies" >&2
    pip install "torch==$version"
  fi
else
  pip install "torch==$version"
fi
"$venv/bin/python" -c "import torch; print('pip-torch: torch', torch.__version__, 'in', '$venv')"
