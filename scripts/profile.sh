#!/usr/bin/env bash
# Where the CPU time of the CLI's own loops goes: `perf record -e cpu-clock` (a software event, so
# it works in VMs without hardware counters; run as root or with kernel.perf_event_paranoid <= 1)
# over an `attn train` run on padded variable-length batches and over an `attn translate` run, then
# the top symbols of each, every one labelled arithmetic or overhead (bench/profile_report.py).
# Overhead is what the issue that asked for this script counts as waste: string building and
# formatting, allocation, page faults, copies (memmove/memcpy), bounds checks, locks and OpenMP
# waits. The script exits 1 when an overhead symbol takes more than --limit percent (default 3).
#
#   bash scripts/profile.sh [build_dir] [--precision fp32|bf16] [--limit 3] [--threads 2]
#
# Reading it: arithmetic symbols are attn's kernels (ForwardBlock, BackwardItem, GemmT, layer_norm_*,
# Dropout*) and oneDNN's JIT code (reported by perf as "[JIT] tid N": the GEMMs). A libgomp address
# is a thread waiting: at a region's end barrier for the slowest thread (load imbalance), or
# between regions while the calling thread runs serial code; the regions section after the train
# profile says which, and where. A string or malloc symbol near the top means a hot path builds
# error text or allocates per element.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/default
precision=fp32
limit=3
threads=2
while (($#)); do
  case "$1" in
    --precision) precision=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -*) echo "profile.sh: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
attn="$build/attn"
[[ -x "$attn" ]] || { echo "profile.sh: $attn not built (cmake --build $build --target attn_cli)" >&2; exit 2; }
command -v perf >/dev/null || { echo "profile.sh: perf not found (apt-get install linux-perf)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736

echo "== attn train: shift task, lengths 64..128 padded per batch, B = 32, $precision, $threads threads"
# The run also records its OpenMP regions (bench/omp_trace.cpp, preloaded; built with the
# benchmarks, not in sanitized builds), so that the OpenMP waits below can be split by cause.
trace_lib="$build/bench/libattn_omp_trace.so"
preload=()
[[ -f "$trace_lib" ]] && preload=(env LD_PRELOAD="$(realpath "$trace_lib")" ATTN_OMP_TRACE="$tmp/regions.txt")
perf record -q -e cpu-clock -o "$tmp/train.data" "${preload[@]}" "$attn" train --task shift --length 128 \
  --symbols 8 --num-hiddens 128 --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 \
  --batch-size 32 --threads "$threads" --steps 500 --eval-every 0 --eval-examples 64 \
  --precision "$precision" >/dev/null 2>"$tmp/train.err" || { cat "$tmp/train.err" >&2; exit 1; }
status=0
perf report -i "$tmp/train.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null |
  /usr/bin/python3 bench/profile_report.py --limit "$limit" || status=1
echo "-- the same run past its first fifth (the first fifth compiles a oneDNN plan per new batch"
echo "   length; shown for reading, the exit status is the whole run's)"
perf report -i "$tmp/train.data" --no-children --sort dso,sym --stdio -g none --time 20%-100% \
  2>/dev/null | /usr/bin/python3 bench/profile_report.py --limit "$limit" --top 0 || true
if [[ -s "$tmp/regions.txt" ]]; then
  echo "-- the same run's OpenMP regions past its first fifth (one-time GEMM plans; bench/omp_trace.py)"
  /usr/bin/python3 bench/omp_trace.py "$tmp/regions.txt" --from 0.2 --top 8
fi

echo "== attn translate: the dates model, greedy and beam 4, 4,096 sentences"
"$attn" train --task dates --steps 200 --num-hiddens 64 --ffn-num-hiddens 128 --num-heads 4 \
  --batch-size 64 --threads "$threads" --checkpoint "$tmp/dates.safetensors" >/dev/null 2>&1
# Sources in the task's own form (dates in words, bench/translate_sources.txt), cycled to 4,096
# lines (enough that steady decoding, not start-up, fills the profile).
for i in $(seq 1 512); do cat bench/translate_sources.txt; done >"$tmp/src.txt"
perf record -q -e cpu-clock -o "$tmp/translate.data" -- bash -c "
  '$attn' translate --checkpoint '$tmp/dates.safetensors' --threads $threads <'$tmp/src.txt' >/dev/null &&
  '$attn' translate --checkpoint '$tmp/dates.safetensors' --threads $threads --beam 4 <'$tmp/src.txt' >/dev/null"
perf report -i "$tmp/translate.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null |
  /usr/bin/python3 bench/profile_report.py --limit "$limit" || status=1
exit $status
