#!/usr/bin/env bash
# Generation throughput side by side: attn's greedy search with the KV cache and the decode
# kernel (bench/bench_generate) against d2l's PyTorch predict_step loop, which re-projects the
# whole prefix every step (bench/torch_decode.py). Issue 14's shapes: E=512, 8 heads, 6 + 6
# blocks, vocab 10k, source 64, output 256 tokens, batch 1 and 16, ATTN_THREADS threads (2).
# Both sides run with OMP_WAIT_POLICY=PASSIVE (on a loaded machine, spinning OpenMP threads wait
# for descheduled ones: attn at batch 1 took 8x longer spinning). Rounds alternate attn / PyTorch
# per batch size, so load drifts hit both; the table gives the
# median tokens/s of each and their ratio, with the load average before and after.
#
#   bench/run_decode.sh [build_dir] [rounds] [batches]     (default build/default, 3, "1 16")
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-3}
batches=${3:-1 16}
export ATTN_THREADS=${ATTN_THREADS:-2}
bin="$build/bench/bench_generate"
[[ -x "$bin" ]] || { echo "run_decode.sh: $bin not built (cmake --build $build --target bench_generate)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 0; r < rounds; ++r)); do
  for b in $batches; do
    OMP_WAIT_POLICY=PASSIVE "$bin" "$b" 1 >>"$tmp/runs.jsonl"
    OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 bench/torch_decode.py --batch "$b" --threads "$ATTN_THREADS" >>"$tmp/runs.jsonl"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
/usr/bin/python3 - "$tmp/runs.jsonl" "$load_before" "$load_after" "$rounds" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
print(f"Generation throughput, {sys.argv[4]} alternating rounds, load average before "
      f"{sys.argv[2]}, after {sys.argv[3]} (tokens/s, median; min..max)")
print()
print("| batch | attn (cache + decode kernel) | d2l PyTorch loop | ratio |")
print("|---:|---:|---:|---:|")
for b in sorted({r["batch"] for r in runs}):
    cells = []
    med = {}
    for impl in ("attn", "d2l-torch"):
        v = [r["tok_s"] for r in runs if r["batch"] == b and r["impl"] == impl]
        med[impl] = statistics.median(v)
        cells.append(f"{med[impl]:.1f} ({min(v):.1f}..{max(v):.1f})")
    print(f"| {b} | {cells[0]} | {cells[1]} | {med['attn'] / med['d2l-torch']:.1f}x |")
PY
