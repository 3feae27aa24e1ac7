#!/usr/bin/env bash
# A/B of run-time switches in one bench_train (or other Google Benchmark) binary: each variant is
# a label and the environment it runs with; the variants run in turns, ROUNDS times, at each
# thread count, so that a drift of the host's speed hits all alike. Prints tokens/s (or items/s,
# else the reciprocal of the CPU time) per round.
#
#   bench/ab_env.sh BIN ROUNDS THREADS FILTER LABEL:[VAR=VALUE[,VAR=VALUE...]]...
#   THREADS: a comma list, e.g. 2 or 2,16. LABEL: with nothing after the colon, the defaults.
#   e.g. bench/ab_env.sh build/default/bench/bench_train 3 2 'BM_TrainStep/' \
#          auto: onednn:ATTN_GEMM_F32=onednn rows:ATTN_GEMM_F32=rows
# bench/ab_wgrad.sh and scripts/gpu-check.sh (section 7) call it.
set -euo pipefail
[[ $# -ge 5 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
bin=$1 rounds=$2 threads=$3 filter=$4
shift 4
[[ -x $bin ]] || { echo "ab_env.sh: $bin not built" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_WAIT_POLICY=PASSIVE
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
for ((r = 1; r <= rounds; r++)); do
  for t in ${threads//,/ }; do
    for v in "$@"; do
      label=${v%%:*} vars=${v#*:}
      IFS=, read -r -a envs <<<"$vars"
      env ATTN_THREADS="$t" "${envs[@]}" "$bin" --benchmark_filter="$filter" \
        --benchmark_format=json 2>/dev/null >"$tmp/ab_${t}_${r}_$label.json" || true
    done
  done
  echo "round $r/$rounds done" >&2
done
python3 - "$tmp" "$@" <<'PY'
import collections, glob, json, sys
tmp, labels = sys.argv[1], [v.split(":")[0] for v in sys.argv[2:]]
rates = collections.defaultdict(list)
for f in sorted(glob.glob(f"{tmp}/ab_*.json")):
    t, r, label = f.split("/ab_")[1][:-5].split("_", 2)
    try:
        benchmarks = json.load(open(f))["benchmarks"]
    except ValueError:
        continue
    for b in benchmarks:
        rate = b.get("tokens_per_second") or b.get("items_per_second") or 1e9 / b["cpu_time"]
        rates[(int(t), b["name"].split("/")[0], labels.index(label))].append(rate)
print("threads benchmark              variant    rate by round (tokens/s)")
for k in sorted(rates):
    print(f"{k[0]:7} {k[1]:22} {labels[k[2]]:10} " + "  ".join(f"{x:9.0f}" for x in rates[k]))
PY
