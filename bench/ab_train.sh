#!/usr/bin/env bash
# A/B of two builds of bench_train (before and after a change to the training step), fp32 and
# bf16 mixed precision, in turns (old fp32, new fp32, old bf16, new bf16, repeated ROUNDS times)
# so that a drift of the host's speed hits all four alike. Prints every run, then per variant the
# least and the median wall ms/step and CPU ms/step (Google Benchmark's cpu_time: the main
# thread's CPU time, which at THREADS=1 is the process's), and the bf16/fp32 speed ratio of each
# build (least wall times).
#
#   bench/ab_train.sh OLD_BIN NEW_BIN [ROUNDS=3] [THREADS=2]
#   e.g. bench/ab_train.sh /tmp/bench_train_main build/default/bench/bench_train 5 2
#
# Build the "old" binary first (git stash or a checkout of main, cmake --build --target
# bench_train, cp), then the new one. Each run is bench_train's 3 s minimum of steps.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
old=$1 new=$2 rounds=${3:-3} threads=${4:-2}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for bench in BM_TrainStep/ BM_TrainStepBf16; do
    for v in old new; do
      bin=$old
      [[ $v == new ]] && bin=$new
      line=$(ATTN_THREADS=$threads OMP_WAIT_POLICY=PASSIVE "$bin" --benchmark_filter="$bench" \
        --benchmark_format=csv 2>/dev/null | awk -F, 'NR > 1 {printf "%s %s", $3, $4}')
      name=${bench%/}
      echo "round $r $v $name: wall $(cut -d' ' -f1 <<<"$line") ms, cpu $(cut -d' ' -f2 <<<"$line") ms"
      echo "$v $name $line" >>"$out"
    done
  done
done
echo "threads=$threads rounds=$rounds (ms per step: least / median)"
python3 - "$out" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    v, name, wall, cpu = line.split()
    runs.setdefault((v, name), []).append((float(wall), float(cpu)))
for (v, name), xs in sorted(runs.items()):
    w = [a for a, _ in xs]; c = [b for _, b in xs]
    print(f"{v:3} {name:16} wall {min(w):7.1f} / {statistics.median(w):7.1f}   "
          f"cpu {min(c):7.1f} / {statistics.median(c):7.1f}")
for v in ("old", "new"):
    f32, b16 = runs.get((v, "BM_TrainStep")), runs.get((v, "BM_TrainStepBf16"))
    if f32 and b16:
        print(f"{v}: bf16 / fp32 speed {min(a for a, _ in f32) / min(a for a, _ in b16):.3f}x (least wall)")
for name in ("BM_TrainStep", "BM_TrainStepBf16"):
    o, n = runs.get(("old", name)), runs.get(("new", name))
    if o and n:
        print(f"{name}: new / old speed {min(a for a, _ in o) / min(a for a, _ in n):.3f}x (least wall), "
              f"{min(b for _, b in o) / min(b for _, b in n):.3f}x (least cpu)")
EOF
