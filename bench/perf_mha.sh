#!/usr/bin/env bash
# Where MultiHeadAttention's time goes: perf record (cpu-clock, the VM has no hardware counters)
# of one bench_mha benchmark, samples grouped into oneDNN GEMM (its JIT code), the fused
# attention kernel, head copies, kernel time (page faults, interrupts) and the rest. Setup
# (the FMA-peak probe and random inputs) is left out of the percentages.
#
#   bench/perf_mha.sh [BUILD_DIR] [BENCHMARK...]     default: build/bench, the four MHA cases
#   env: MIN_TIME (seconds, 5)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/bench}
shift || true
benches=("$@")
((${#benches[@]})) || benches=(BM_MhaInference/512 BM_MhaInference/2048 BM_MhaTraining/512
                               BM_MhaTraining/2048)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in "${benches[@]}"; do
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
  OMP_WAIT_POLICY=PASSIVE ATTN_THREADS=${ATTN_THREADS:-2} \
    perf record -q -e cpu-clock -o "$tmp/perf.data" "$build/bench/bench_mha" \
    --benchmark_filter="^$b/" --benchmark_min_time="${MIN_TIME:-5}" \
    --benchmark_min_warmup_time=1 > /dev/null 2>&1
  echo "== $b (load $(cut -d' ' -f1 /proc/loadavg))"
  perf report -i "$tmp/perf.data" --no-children --sort dso,symbol --stdio -g none 2>/dev/null |
    /usr/bin/python3 -c '
import collections, re, sys
cats = collections.Counter()
for line in sys.stdin:
    m = re.match(r"\s+([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(.*)", line)
    if not m:
        continue
    pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
    if any(x in sym for x in ("FmaLoop", "random", "mersenne", "Rng::")):
        continue  # setup
    if dso.startswith("[JIT]") or "dnnl" in dso:
        c = "oneDNN GEMM (projections)"
    elif any(x in sym for x in ("GemmT", "ForwardBlock", "BackwardItem", "AllFinite",
                                "flash_attention")):
        c = "fused attention kernel"
    elif "split_heads" in sym or "merge_heads" in sym:
        c = "head split/merge copies"
    elif dso.startswith("[kernel"):
        c = "kernel (page faults, interrupts)"
    else:
        c = "other (memset, column sums, accumulation, ...)"
    cats[c] += pct
total = sum(cats.values())
for c, v in cats.most_common():
    print(f"  {100 * v / total:5.1f}%  {c}")
'
done
