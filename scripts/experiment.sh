#!/usr/bin/env bash
# Runs `attn experiment positional --full` (3 seeds, 3000 steps, the shift and sorted tasks, one
# run per hardware thread) and writes its table into docs/training.md between
# <!-- positional:begin --> and <!-- positional:end -->, with the date, the machine and the time
# it took. The only writer of that block: its numbers are never typed by hand.
#
#   scripts/experiment.sh [build_dir]        (default build/default; builds attn_cli there)
#   ATTN_EXPERIMENT_ARGS="--seeds 1 --steps 300" overrides the setting (a smoke test of the
#   script, not for the docs).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
cmake --build "$build" --target attn_cli >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
# shellcheck disable=SC2086
"$build/attn" experiment positional --full ${ATTN_EXPERIMENT_ARGS:-} --out "$out" >"$out/log.txt"
seconds=$(($(date +%s) - start))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
{
  echo "Written by \`scripts/experiment.sh\`; do not edit by hand. $(date -u '+%Y-%m-%d %H:%M UTC'),"
  echo "$cpu, $(nproc) hardware threads, one run per thread; ${seconds} s in all; load average"
  echo "(1, 5, 15 min) before: ${load_before}; after: ${load_after}."
  echo "Command: \`attn experiment positional --full ${ATTN_EXPERIMENT_ARGS:-}\`."
  echo
  # The table of positional.md, without its title line.
  tail -n +2 "$out/positional.md" | sed '/./,$!d'
} >"$out/block.md"
/usr/bin/python3 bench/write_block.py positional "$out/block.md" docs/training.md
echo "wrote the positional block of docs/training.md (${seconds} s)"
