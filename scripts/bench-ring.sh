#!/usr/bin/env bash
# bench-ring.sh: issue 15's ring attention target, in one command. Alternates ROUNDS rounds of
#   single: 1 process x 2 threads, the fused kernel on the whole sequence (attn bench ring --single)
#   ring:   2 ranks x 1 thread (mpirun), ring attention on the same sequence split in two
# and prints each round, then the medians, the ratio ring / single (target: <= 1.15) for the
# forward and the backward (wall clock of the slowest rank; CPU seconds summed over processes),
# and the peak RSS per process (target: ~1/2 of the single process's data).
#
#   scripts/bench-ring.sh                     T = 32768 (2 x 16k), D = 64, B*H = 1, fp32
#   SEQ=16384 BH=2 CAUSAL=1 DTYPE=bf16 ROUNDS=5 TRANSPORT=tcp scripts/bench-ring.sh
#
# ATTN: the attn binary (default build/default/attn, built with -DATTN_WITH_MPI=ON).
# Run it on a quiet machine for figures to quote; OMP_WAIT_POLICY=PASSIVE is set here.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTN=${ATTN:-build/default/attn}
SEQ=${SEQ:-32768} D=${D:-64} BH=${BH:-1} DTYPE=${DTYPE:-f32} ROUNDS=${ROUNDS:-3}
TRANSPORT=${TRANSPORT:-shm} REPEATS=${REPEATS:-1}
causal=()
[ "${CAUSAL:-0}" = 1 ] && causal=(--causal)
export OMP_WAIT_POLICY=PASSIVE OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "$TRANSPORT" = tcp ]; then
  btl=(--mca btl self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
else
  btl=(--mca btl self,vader --mca btl_vader_single_copy_mechanism none)
fi
# Ranks yield while they wait and float over the cores (docs/scale-out.md: on a shared machine a
# spinning, pinned rank loses its core to preemption and the other rank waits for it).
btl+=(--mca mpi_yield_when_idle 1 --bind-to none)
common=(bench ring --seq "$SEQ" --head-dim "$D" --batch-heads "$BH" --dtype "$DTYPE"
        --repeats "$REPEATS" --warmup 0 --json "${causal[@]}")
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "bench-ring: T=$SEQ D=$D B*H=$BH $DTYPE ${causal[*]:-non-causal}; $ROUNDS alternating rounds; $TRANSPORT"
for ((i = 1; i <= ROUNDS; i++)); do
  OMP_NUM_THREADS=2 "$ATTN" "${common[@]}" --single --threads 2 | tee -a "$out"
  OMP_NUM_THREADS=1 mpirun -np 2 --oversubscribe "${btl[@]}" "$ATTN" "${common[@]}" --threads 1 |
    tee -a "$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(op, key):
    return statistics.median(r[key] for r in rows if r["op"] == op)
print(f"{'':10} {'single 1x2':>12} {'ring 2x1':>12} {'ring/single':>12}")
for key, name in [("forward_s", "forward s"), ("backward_s", "backward s"),
                  ("forward_cpu_s", "fwd CPU s"), ("backward_cpu_s", "bwd CPU s")]:
    s, r = med("single", key), med("ring", key)
    print(f"{name:10} {s:12.3f} {r:12.3f} {r / s:12.3f}")
s = max(max(r["peak_rss_mib"]) for r in rows if r["op"] == "single")
r = max(max(r["peak_rss_mib"]) for r in rows if r["op"] == "ring")
io_s = next(r["io_mib_per_rank"] for r in rows if r["op"] == "single")
io_r = next(r["io_mib_per_rank"] for r in rows if r["op"] == "ring")
print(f"peak RSS MiB per process: single {s:.1f}, ring {r:.1f} (ratio {r / s:.2f}); "
      f"tensors per process: single {io_s:.1f} MiB, ring {io_r:.1f} MiB")
PY
