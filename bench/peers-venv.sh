#!/usr/bin/env bash
# The speed peers users run today, from PyPI, in a virtual environment of the project's (never
# the system Python; Debian's PyTorch 1.13 stays the test oracle and is not touched):
# PyTorch 2.x, ONNX Runtime, OpenVINO, CTranslate2, NumPy and safetensors. Cached between runs:
# when the environment already has every package it only prints the versions (quick, no
# network). Prints the venv's python path on the last line of stdout, so callers can do
#   py=$(bench/peers-venv.sh | tail -n1)
#
#   bench/peers-venv.sh                 create or update, print versions
#   ATTN_PEERS_VENV=DIR                 where (default ~/.cache/attn-peers/venv: shared by every
#                                       checkout, outside the work tree)
#   ATTN_PEERS_UPGRADE=1                re-resolve the newest versions (pip install --upgrade)
#
# PyTorch: PyPI's Linux wheel is the CUDA build. `pip install --no-deps torch` plus its
# pure-Python requirements does not import: libtorch.so needs libtorch_cuda.so, which needs
# libcudart, cuBLAS, cuDNN, NCCL, cuFile, cuSPARSELt... (ImportError: libcufile.so.0), and the
# CPU-only wheels live on another index that this project does not use. So torch comes with its
# declared dependencies (about 5.8 GB installed, once; pip's cache keeps the wheels). The CPU
# kernels are the same code either way; no GPU is needed or used.
set -euo pipefail
venv=${ATTN_PEERS_VENV:-$HOME/.cache/attn-peers/venv}
py="$venv/bin/python"
pkgs=(numpy safetensors torch onnxruntime openvino ctranslate2 onnx)
mods=$(IFS=,; echo "${pkgs[*]}")
upgrade=()
[[ "${ATTN_PEERS_UPGRADE:-0}" == 1 ]] && upgrade=(--upgrade)

versions() {
  "$py" - <<'PY'
import importlib, sys
print(f"python {sys.version.split()[0]} at {sys.executable}", file=sys.stderr)
for name in ("numpy", "safetensors", "torch", "onnxruntime", "openvino", "ctranslate2", "onnx"):
    try:
        mod = importlib.import_module(name)
        version = getattr(mod, "__version__", None)
        if version is None and name == "openvino":
            version = mod.get_version()
        print(f"{name} {version}", file=sys.stderr)
    except Exception as e:  # a peer that does not import is reported, not fatal
        print(f"{name} NOT IMPORTABLE: {e}", file=sys.stderr)
PY
}

if [[ ! -x "$py" ]]; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
fi
if (( ${#upgrade[@]} )) || ! "$py" -c "import $mods" 2>/dev/null; then
  echo "peers-venv: installing ${pkgs[*]} into $venv" >&2
  "$py" -m pip install -q "${upgrade[@]}" "${pkgs[@]}" >&2
fi
"$py" -c "import $mods" || {
  echo "peers-venv: the environment at $venv does not import ${pkgs[*]}" >&2
  exit 1
}
versions
echo "$py"
