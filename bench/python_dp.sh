#!/usr/bin/env bash
# Data-parallel training from Python (attn.distributed): 2 ranks x 1 thread against 1 process x
# 2 threads at the same global batch, running examples/python_data_parallel.py (encoder E=64,
# 4 heads, FFN 128, 2 blocks, T=48, global batch 32, dropout 0.1, 60 steps; tokens/s over steps
# 2..60). Needs a build with -DATTN_BUILD_PYTHON=ON -DATTN_WITH_MPI=ON.
#
#   bash bench/python_dp.sh [BUILD_DIR] [ROUNDS]        (defaults: build/default, 5)
#
# A third run, 2 ranks reducing every gradient after backward (--after-backward), shows what the
# overlap buys. The configurations alternate for ROUNDS rounds; median and best tokens/s of each and their
# ratio are printed, with the CPU seconds (user + system, all processes) of the median run. On a
# shared machine threads that spin while waiting lose their core: OpenMP threads sleep
# (OMP_WAIT_POLICY=PASSIVE) and the ranks yield (--mca mpi_yield_when_idle 1), as
# scripts/bench-scale-out.sh does for `attn train`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-5}
export PYTHONPATH="$build/python" OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
py=/usr/bin/python3
example=examples/python_data_parallel.py
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # run NAME COMMAND...: appends "tokens/s cpu_seconds" to $tmp/NAME
  local name=$1
  shift
  /usr/bin/time -f "%U %S" -o "$tmp/time" "$@" >"$tmp/out" 2>&1 || { cat "$tmp/out"; exit 1; }
  local tps
  tps=$(grep -o '[0-9,]* tokens/s' "$tmp/out" | tr -d ',' | cut -d' ' -f1)
  echo "$tps $(awk '{print $1 + $2}' "$tmp/time")" >>"$tmp/$name"
}
for _ in $(seq "$rounds"); do
  OMP_NUM_THREADS=2 run one "$py" "$example" --threads 2
  OMP_NUM_THREADS=1 run two mpirun -np 2 --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
    --mca mpi_yield_when_idle 1 --bind-to none "$py" "$example" --threads 1
  OMP_NUM_THREADS=1 run after mpirun -np 2 --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
    --mca mpi_yield_when_idle 1 --bind-to none "$py" "$example" --threads 1 --after-backward
done
"$py" - "$tmp/one" "$tmp/two" "$tmp/after" <<'PY'
import statistics, sys
def load(path):
    rows = [tuple(map(float, line.split())) for line in open(path)]
    rows.sort()
    return rows
one, two, after = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
def line(label, rows):
    med = rows[len(rows) // 2]
    print(f"{label}: median {med[0]:8.0f} tokens/s (CPU {med[1]:.1f} s), best {rows[-1][0]:8.0f}"
          f"  (runs: {', '.join(f'{r[0]:.0f}' for r in rows)})")
    return med[0], rows[-1][0]
m1, b1 = line("1 process x 2 threads", one)
m2, b2 = line("2 ranks x 1 thread   ", two)
m3, b3 = line("2 ranks, after backward", after)
print(f"ratio 2x1 / 1x2: median {m2 / m1:.2f}, best {b2 / b1:.2f}")
print(f"overlapped / after backward (2 ranks): median {m2 / m3:.2f}, best {b2 / b3:.2f}")
PY
