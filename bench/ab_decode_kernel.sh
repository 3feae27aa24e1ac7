#!/usr/bin/env bash
# A/B of two builds of bench_decode_kernel (the fused decode kernel's cache read rate as a share
# of a streaming-read probe measured in the same run): runs OLD and NEW in turns, ROUNDS times per
# thread count, each run with 3 inner rounds, all with OMP_WAIT_POLICY=PASSIVE, and prints per
# (dtype, S, T, threads) the median over the runs of the kernel's share of the probe, per wall
# second and per CPU second, for each binary. The load average before and after is printed: on
# a loaded machine the shares are indicative only.
#
#   bench/ab_decode_kernel.sh OLD_BIN NEW_BIN [ROUNDS=3] [THREADS="1 2"]
#   e.g. build the old tree's target, cp build/default/bench/bench_decode_kernel /tmp/old_bdk,
#        build the new one, then bench/ab_decode_kernel.sh /tmp/old_bdk build/default/bench/bench_decode_kernel
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
old=$1 new=$2 rounds=${3:-3} threads=${4:-1 2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for th in $threads; do
  for r in $(seq 1 "$rounds"); do
    for v in old new; do
      bin=$old
      [[ $v == new ]] && bin=$new
      ATTN_THREADS=$th OMP_WAIT_POLICY=PASSIVE "$bin" 3 | sed -n 's/^\(fp32\|bf16\) /&/p' |
        sed "s/^/$v $th /" >>"$tmp/runs.txt"
    done
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/python3 - "$tmp/runs.txt" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    v, th, dt = f[0], f[1], f[2]
    S = re.search(r"S=(\d+)", line).group(1)
    T = re.search(r" T=(\d+)", line).group(1)
    shares = re.findall(r"([\d.]+)%", line)
    kern = float(re.search(r"kernel\s+([\d.]+) GB/s", line).group(1))
    rows.setdefault((dt, int(S), int(T), int(th)), {}).setdefault(v, []).append(
        (float(shares[0]), float(shares[1]), kern))
print(f"{'cache':5} {'S':>6} {'T':>2} {'thr':>3} | {'old wall%':>9} {'old cpu%':>8} {'GB/s':>6} | "
      f"{'new wall%':>9} {'new cpu%':>8} {'GB/s':>6}")
for key in sorted(rows, key=lambda k: (k[3], k[0] != "fp32", k[1], k[2])):
    cells = []
    for v in ("old", "new"):
        xs = rows[key].get(v, [])
        med = [statistics.median(x[i] for x in xs) for i in range(3)] if xs else [float("nan")] * 3
        cells.append(f"{med[0]:9.1f} {med[1]:8.1f} {med[2]:6.2f}")
    print(f"{key[0]:5} {key[1]:>6} {key[2]:>2} {key[3]:>3} | {cells[0]} | {cells[1]}")
PY
