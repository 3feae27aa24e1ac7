#!/usr/bin/env bash
# A/B of two builds of a Google Benchmark binary (e.g. bench_attention before and after a
# change): runs them in turns, ROUNDS times, and prints each one's CPU time per benchmark, so
# that a drift of the host's speed hits both alike. Build the "old" binary first (git stash,
# cmake --build, cp), then the new one.
#
#   bench/ab.sh OLD_BIN NEW_BIN FILTER [ROUNDS=3] [THREADS=1]
#   e.g. bench/ab.sh /tmp/old_ba build/default/bench/bench_attention 'BM_FlashForward/BH:16/T:1024' 4 1
#
# One thread and CPU time are the steadiest on a shared 2-core VM; compare the least times.
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
old=$1 new=$2 filter=$3 rounds=${4:-3} threads=${5:-1}
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    bin=$old
    [[ $v == new ]] && bin=$new
    times=$(ATTN_THREADS=$threads OMP_WAIT_POLICY=PASSIVE "$bin" --benchmark_filter="$filter" \
      --benchmark_min_time=1 --benchmark_min_warmup_time=0.2 --benchmark_format=csv 2>/dev/null |
      awk -F, 'NR > 1 {printf "%s ", $4}')
    echo "round $r $v: $times"
  done
done
