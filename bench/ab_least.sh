#!/usr/bin/env bash
# A/B of two or more builds of a Google Benchmark binary by the least time over many short runs:
# the binaries take turns, ROUNDS times, each run REPS repetitions of MIN_TIME seconds, and the
# least real time per benchmark and binary is kept. On the shared 2-vCPU VMs other guests take
# 10-25% of a run's time at random; bench/ab.sh's 1-second runs then differ by more than the
# change being measured, while the least of ROUNDS x REPS short runs settles within ~2% (a
# kernel's speed when nobody else ran). Prints each benchmark's least time per binary and its
# ratio to the first binary's (> 1: faster than the first).
#
#   bench/ab_least.sh FILTER ROUNDS BIN_A BIN_B [BIN_C ...]
#   THREADS=1 (default), REPS=5, MIN_TIME=0.15 (seconds per repetition)
#   e.g. bench/ab_least.sh 'BM_FlashForward/BH:16/T:1024' 4 /tmp/old_bench_attention \
#          build/default/bench/bench_attention
set -euo pipefail
[[ $# -ge 4 ]] || { sed -n '2,14p' "$0" >&2; exit 2; }
filter=$1 rounds=$2
shift 2
threads=${THREADS:-1} reps=${REPS:-5} min_time=${MIN_TIME:-0.15}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
  i=0
  for bin in "$@"; do
    ATTN_THREADS=$threads OMP_WAIT_POLICY=PASSIVE "$bin" --benchmark_filter="$filter" \
      --benchmark_min_time="$min_time" --benchmark_repetitions="$reps" \
      --benchmark_format=csv 2>/dev/null | sed "s|^|$i,|" >>"$tmp/runs.csv"
    i=$((i + 1))
  done
  echo "round $r/$rounds done" >&2
done
python3 - "$tmp/runs.csv" "$@" <<'PY'
import csv, sys
path, bins = sys.argv[1], sys.argv[2:]
least, unit = {}, {}
for row in csv.reader(open(path)):
    if len(row) < 6 or row[1] == "name":
        continue
    b, name = int(row[0]), row[1]
    if name.endswith(("_mean", "_median", "_stddev", "_cv")):
        continue
    name = name.split("/real_time")[0].split("/process_time")[0]
    t = float(row[3])
    key = (name, b)
    least[key] = min(least.get(key, t), t)
    unit[name] = row[5]
names = sorted({n for n, _ in least}, key=lambda n: list(k[0] for k in least).index(n))
width = max(len(n) for n in names) if names else 0
print(f"least real time over all runs; ratio = first binary's time / this one's (> 1: faster)")
for i, b in enumerate(bins):
    print(f"  [{i}] {b}")
for n in names:
    base = least.get((n, 0))
    cells = []
    for i in range(len(bins)):
        t = least.get((n, i))
        if t is None:
            cells.append("—")
        elif i == 0 or base is None:
            cells.append(f"{t:.3f} {unit[n]}")
        else:
            cells.append(f"{t:.3f} {unit[n]} ({base / t:.3f}x)")
    print(f"{n:<{width}}  " + "   ".join(cells))
PY
