#!/usr/bin/env bash
# Times a cold `pip install .` into a fresh virtual environment, as a user's first install runs:
# no ccache (CCACHE_DISABLE=1), no build folder (build/pip is removed first), pip's isolated build
# environment. It runs as its two halves, `pip wheel .` (the build: what `pip install .` does
# first) and `pip install` of that wheel, so that the wheel's size comes from the same build.
# Prints one line with the wall time, the CPU time, the load average before and after and the
# wheel's size, and writes it into docs/python.md's pip_install_time block.
#
#   bash bench/pip_install_time.sh    (needs scripts/setup.sh build, python3-venv, /usr/bin/time)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
/usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip -q --disable-pip-version-check install build
rm -rf build/pip
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
CCACHE_DISABLE=1 /usr/bin/time -f "%e %U %S" -o "$venv/time" bash -c '
  "$1/bin/python" -m pip -q --disable-pip-version-check wheel --no-deps -w "$1/dist" . &&
  "$1/bin/python" -m pip -q --disable-pip-version-check install "$1"/dist/attn-*.whl' \
  _ "$venv" >"$venv/install.log" 2>&1 || { tail -30 "$venv/install.log"; exit 1; }
read -r wall user sys <"$venv/time"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
(cd / && "$venv/bin/python" -c "import attn; attn.MultiHeadAttention(8, 2, 0.0)")  # it works
wheel=$(ls "$venv"/dist/attn-*.whl)
line=$(printf 'pip_install_time: cold `pip install .` %.0f s wall, %.0f s user + %.0f s system CPU, %s cores; wheel %s, %s KiB; load before %s, after %s\n' \
  "$wall" "$user" "$sys" "$(nproc)" "$(basename "$wheel")" "$(du -k "$wheel" | cut -f1)" \
  "$load_before" "$load_after")
echo "$line"
printf '%s (%s, %s UTC; written by `bench/pip_install_time.sh`)\n' "${line#pip_install_time: }" \
  "$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)" "$(date -u '+%Y-%m-%d %H:%M')" \
  >"$venv/block.md"
/usr/bin/python3 bench/write_block.py pip_install_time "$venv/block.md" docs/python.md
