#!/usr/bin/env bash
# The figures of docs/scale-out.md: message latency and bandwidth between 2 ranks over shared
# memory and TCP loopback (`attn bench comm`), and data-parallel training throughput: 2 ranks x
# 1 thread against 1 rank x 2 threads at the same global batch (`attn train`, tokens/s from its
# metrics). Needs a build with -DATTN_WITH_MPI=ON (default build/default).
#
#   bash scripts/bench-scale-out.sh [BUILD_DIR] [REPEATS]
#
# Each training configuration runs REPEATS times (default 5), alternating; the median and the
# best run are reported: on a shared machine a single run says little, and the best run is the
# one least disturbed by other work.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
repeats=${2:-5}
attn="$build/attn"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# This machine kind is shared (2 cores, several builds at once): threads that spin while they
# wait lose their core to preemption and then everyone waits for them. So OpenMP threads sleep
# when idle (OMP_WAIT_POLICY=PASSIVE, overridable) and the MPI ranks of the training run yield
# (--mca mpi_yield_when_idle 1); both are what one would set on any oversubscribed machine.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
shm=(--mca btl self,vader --mca btl_vader_single_copy_mechanism none)
tcp=(--mca btl self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== machine"
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg); Open MPI $(mpirun --version | head -1 | awk '{print $NF}')"

echo "== messages: 2 ranks, ping-pong 0<->1 and allreduce (attn bench comm)"
for transport in shm tcp; do
  declare -n flags=$transport
  echo "-- $transport: mpirun -np 2 ${flags[*]} $attn bench comm"
  OMP_NUM_THREADS=1 mpirun -np 2 "${flags[@]}" "$attn" bench comm
done

echo "== data-parallel training: same global batch, 2 ranks x 1 thread vs 1 rank x 2 threads"
# A small encoder: E=64, 4 heads, FFN 128, 2 blocks; tagging (shift), sequences of 32..64
# tokens, global batch 32. One evaluation batch at the end (64 sequences).
model=(--task shift --length 64 --symbols 16 --num-hiddens 64 --num-heads 4 --ffn-num-hiddens 128
       --num-blks 2 --batch-size 32 --steps 40 --eval-every 0 --eval-examples 64 --seed 1)
echo "model: ${model[*]}; OMP_WAIT_POLICY=$OMP_WAIT_POLICY; ranks: --mca mpi_yield_when_idle 1 --bind-to none"
tps() { /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['history'][-1]['tokens_per_second'])" "$1"; }
one=() two=()
for i in $(seq "$repeats"); do
  OMP_NUM_THREADS=2 "$attn" train "${model[@]}" --threads 2 --metrics "$tmp/one.json" >/dev/null 2>&1
  one+=("$(tps "$tmp/one.json")")
  OMP_NUM_THREADS=1 mpirun -np 2 "${shm[@]}" --mca mpi_yield_when_idle 1 --bind-to none "$attn" train "${model[@]}" --threads 1 \
    --metrics "$tmp/two.json" >/dev/null 2>&1
  two+=("$(tps "$tmp/two.json")")
done
/usr/bin/python3 - "${one[*]}" "${two[*]}" <<'PY'
import statistics, sys
one = [float(x) for x in sys.argv[1].split()]
two = [float(x) for x in sys.argv[2].split()]
m1, m2 = statistics.median(one), statistics.median(two)
b1, b2 = max(one), max(two)
print(f"1 rank x 2 threads (attn train --threads 2):              median {m1:7.0f}, best {b1:7.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in one)})")
print(f"2 ranks x 1 thread (mpirun -np 2 attn train --threads 1): median {m2:7.0f}, best {b2:7.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in two)})")
print(f"ratio 2 ranks / 1 rank: median {m2 / m1:.2f}, best {b2 / b1:.2f}")
PY
