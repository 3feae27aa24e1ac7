#!/usr/bin/env bash
# A/B of two builds of bench_train (before and after a change to the training step), fp32 and
# bf16 mixed precision, in turns (old fp32, new fp32, old bf16, new bf16, repeated ROUNDS times)
# so that a drift of the host's speed hits all four alike. Prints every run, then per variant the
# least and the median wall ms/step, CPU ms/step (Google Benchmark's cpu_time: the main thread's
# CPU time, which at THREADS=1 is the process's) and process CPU ms/step (all threads: the
# process's user + system time over its wall time, from /usr/bin/time, times the wall ms/step;
# setup included, so a slight overestimate), and the bf16/fp32 speed ratio of each build (least
# wall times, and least process CPU times: on a loaded machine the CPU times are the steadier).
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
trap 'rm -f "$out" "$out.time"' EXIT
for r in $(seq 1 "$rounds"); do
  for bench in BM_TrainStep/ BM_TrainStepBf16; do
    for v in old new; do
      bin=$old
      [[ $v == new ]] && bin=$new
      line=$(ATTN_THREADS=$threads OMP_WAIT_POLICY=PASSIVE /usr/bin/time -o "$out.time" \
        -f "%U %S %e" "$bin" --benchmark_filter="$bench" --benchmark_format=csv 2>/dev/null |
        awk -F, 'NR > 1 {printf "%s %s", $3, $4}')
      read -r user sys elapsed <"$out.time"
      proc=$(python3 -c "print(f'{($user + $sys) / $elapsed * ${line%% *}:.3f}')")
      name=${bench%/}
      echo "round $r $v $name: wall ${line%% *} ms, cpu ${line##* } ms, process cpu $proc ms"
      echo "$v $name $line $proc" >>"$out"
    done
  done
done
echo "threads=$threads rounds=$rounds (ms per step: least / median)"
python3 - "$out" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    v, name, wall, cpu, proc = line.split()
    runs.setdefault((v, name), []).append((float(wall), float(cpu), float(proc)))
def least(xs, k):
    return min(x[k] for x in xs)
for (v, name), xs in sorted(runs.items()):
    cols = []
    for k, what in ((0, "wall"), (1, "cpu"), (2, "process cpu")):
        cols.append(f"{what} {least(xs, k):7.1f} / {statistics.median(x[k] for x in xs):7.1f}")
    print(f"{v:3} {name:16} " + "   ".join(cols))
for v in ("old", "new"):
    f32, b16 = runs.get((v, "BM_TrainStep")), runs.get((v, "BM_TrainStepBf16"))
    if f32 and b16:
        print(f"{v}: bf16 / fp32 speed {least(f32, 0) / least(b16, 0):.3f}x (least wall), "
              f"{least(f32, 2) / least(b16, 2):.3f}x (least process cpu)")
for name in ("BM_TrainStep", "BM_TrainStepBf16"):
    o, n = runs.get(("old", name)), runs.get(("new", name))
    if o and n:
        print(f"{name}: new / old speed {least(o, 0) / least(n, 0):.3f}x (least wall), "
              f"{least(o, 2) / least(n, 2):.3f}x (least process cpu)")
EOF
