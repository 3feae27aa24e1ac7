#!/usr/bin/env bash
# check_train.sh ATTN MPIRUN_PREFIX...: `attn train` under mpirun trains the model one process
# trains at the same global batch. Runs the shift task for 20 steps in one process, then under
# the given mpirun command line in two halves (10 steps with a checkpoint, which rank 0 writes,
# then --resume to 20, which every rank reads), and compares the evaluation losses and the
# averaged training losses of the metrics files (within 1e-5 relative). Also checks that the
# final line is printed once, not once per rank. CHECK_TRAIN_DROPOUT (default 0) is the model's
# dropout: the masks follow the global sample, so the losses agree with dropout too.
set -euo pipefail
attn=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--task shift --length 8 --symbols 4 --num-hiddens 16 --ffn-num-hiddens 32 --num-blks 2
        --batch-size 8 --eval-every 10 --eval-examples 64 --threads 1 --seed 3
        --dropout "${CHECK_TRAIN_DROPOUT:-0}")
"$attn" train "${common[@]}" --steps 20 --metrics "$tmp/single.json" >"$tmp/single.out"
"$@" "$attn" train "${common[@]}" --steps 10 --checkpoint "$tmp/ck.safetensors" >"$tmp/first.out"
"$@" "$attn" train --resume "$tmp/ck.safetensors" --steps 20 --threads 1 \
  --metrics "$tmp/parallel.json" >"$tmp/second.out"
cat "$tmp/single.out" "$tmp/first.out" "$tmp/second.out"
lines=$(grep -c '^step 20:' "$tmp/second.out" || true)
[ "$lines" -eq 1 ] || { echo "check_train: the final line was printed $lines times"; exit 1; }
/usr/bin/python3 - "$tmp/single.json" "$tmp/parallel.json" <<'PY'
import json, sys
single = json.load(open(sys.argv[1]))["history"]
parallel = json.load(open(sys.argv[2]))["history"]
assert [r["step"] for r in single] == [r["step"] for r in parallel], (single, parallel)
for a, b in zip(single, parallel):
    for key in ("train_loss", "eval_loss", "eval_accuracy"):
        x, y = a[key], b[key]
        assert abs(x - y) <= 1e-5 * abs(x) + 1e-12, f"step {a['step']} {key}: 1 rank {x}, mpirun {y}"
    print(f"step {a['step']}: train loss {a['train_loss']:.6f} (1 rank) {b['train_loss']:.6f} (mpirun)")
print("check_train: the same losses")
PY
