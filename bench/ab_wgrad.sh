#!/usr/bin/env bash
# A/B of the weight gradient's cut on oneDNN CPUs (AVX-512: kernels/cpu/matmul.hpp): bench_train's
# full-length encoder step (BM_TrainStep, BM_TrainStepBf16) with attn's chunks of the contraction
# (the default) against oneDNN's own threads (ATTN_GEMM_WGRAD=onednn), in alternating rounds, at
# each thread count; prints tokens/s per round. On CPUs without AVX-512 both run attn's row-exact
# kernel (the switch changes nothing there).
#
#   bench/ab_wgrad.sh [bench_train] [rounds] [threads...]   (default build/default/bench/bench_train,
#                                                             2 rounds, 2 threads)
# Session 24 ran it on the GPU machine's AMX Xeon as part of an ad-hoc probe (docs/performance.md).
set -euo pipefail
bin=${1:-build/default/bench/bench_train}
rounds=${2:-2}
shift $(($# > 2 ? 2 : $#))
threads=("${@:-2}")
[[ -x $bin ]] || { echo "ab_wgrad.sh: $bin not built" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_WAIT_POLICY=PASSIVE
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
for ((r = 1; r <= rounds; r++)); do
  for t in "${threads[@]}"; do
    for v in chunks onednn; do
      cut=()
      [[ $v == onednn ]] && cut=(ATTN_GEMM_WGRAD=onednn)
      env ATTN_THREADS="$t" "${cut[@]}" "$bin" \
        --benchmark_filter='BM_TrainStep(Bf16)?/' --benchmark_format=json 2>/dev/null \
        >"$tmp/ab_${v}_${t}_$r.json"
    done
  done
  echo "round $r/$rounds done" >&2
done
python3 - "$tmp" <<'PY'
import collections, glob, json, sys
rates = collections.defaultdict(list)
for f in sorted(glob.glob(f"{sys.argv[1]}/ab_*.json")):
    v, t, r = f.split("/ab_")[1][:-5].split("_")
    for b in json.load(open(f))["benchmarks"]:
        rates[(int(t), b["name"].split("/")[0], v)].append(b["tokens_per_second"])
print("threads benchmark          cut      tokens/s by round")
for k in sorted(rates):
    print(f"{k[0]:7} {k[1]:18} {k[2]:8} " + "  ".join(f"{x:9.0f}" for x in rates[k]))
PY
