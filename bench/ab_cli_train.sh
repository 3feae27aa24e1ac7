#!/usr/bin/env bash
# A/B of two builds of the CLI on what users run: `attn train` on padded variable-length batches
# (the shift task, lengths 64..128, bucketed; the model of bench/run_padded.sh), fp32 and bf16,
# in turns (old fp32, new fp32, old bf16, new bf16, repeated ROUNDS times) so that a drift of the
# host's speed hits all four alike. Prints every run's tokens/s (the CLI's own figure at its last
# step), then per variant the best and the median, and new / old of each.
#
#   bench/ab_cli_train.sh OLD_ATTN NEW_ATTN [ROUNDS=3] [THREADS=2] [STEPS=300]
#   e.g. bench/ab_cli_train.sh /tmp/attn_main build/default/attn 5 2
#
# Build the "old" binary first (git stash, cmake --build --target attn_cli, cp), then the new one.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
old=$1 new=$2 rounds=${3:-3} threads=${4:-2} steps=${5:-300}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for precision in fp32 bf16; do
    for v in old new; do
      bin=$old
      [[ $v == new ]] && bin=$new
      rate=$("$bin" train --task shift --length 128 --symbols 8 --num-hiddens 128 \
        --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 --threads "$threads" \
        --steps "$steps" --eval-every 0 --eval-examples 64 --precision "$precision" 2>&1 |
        grep -o '[0-9.]*k tok/s' | tail -1 | sed 's/k tok\/s//')
      [[ -n $rate ]] || { echo "ab_cli_train: no tokens/s from $bin" >&2; exit 1; }
      echo "round $r $v $precision: ${rate}k tokens/s"
      echo "$v $precision $rate" >>"$out"
    done
  done
done
python3 - "$out" "$threads" "$rounds" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    v, precision, rate = line.split()
    runs.setdefault((v, precision), []).append(float(rate))
print(f"threads={sys.argv[2]} rounds={sys.argv[3]} (k tokens/s: best / median)")
for precision in ("fp32", "bf16"):
    for v in ("old", "new"):
        r = runs[(v, precision)]
        print(f"{v} {precision}: {max(r):7.1f} / {statistics.median(r):7.1f}")
    o, n = runs[("old", precision)], runs[("new", precision)]
    print(f"{precision}: new / old {max(n) / max(o):.3f}x (best), "
          f"{statistics.median(n) / statistics.median(o):.3f}x (median)")
EOF
