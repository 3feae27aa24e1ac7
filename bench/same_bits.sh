#!/usr/bin/env bash
# Does a change keep every bit of training? Trains the padded shift model (bench/run_padded.sh's
# model, bucketed batches of lengths 64..128) for STEPS steps with two builds of the CLI, fp32 and
# bf16, at THREADS threads, and the new build at 1 thread too, then compares the checkpoints
# tensor by tensor (parameters and AdamW's state; the header's metadata, which records the run,
# is not compared). Exits 1 when a tensor differs.
#
#   bench/same_bits.sh OLD_ATTN NEW_ATTN [STEPS=60] [THREADS=2]
#   e.g. bench/same_bits.sh /tmp/attn_main build/default/attn
#
# Build the "old" binary first (git stash, cmake --build --target attn_cli, cp), then the new one.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,10p' "$0" >&2; exit 2; }
old=$1 new=$2 steps=${3:-60} threads=${4:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
train() {  # binary threads precision output
  "$1" train --task shift --length 128 --symbols 8 --num-hiddens 128 --ffn-num-hiddens 256 \
    --num-heads 4 --dropout 0.1 --batch-size 32 --threads "$2" --steps "$steps" --eval-every 0 \
    --eval-examples 64 --precision "$3" --checkpoint "$4" >/dev/null 2>"$tmp/err" ||
    { cat "$tmp/err" >&2; exit 1; }
}
status=0
for precision in fp32 bf16; do
  train "$old" "$threads" "$precision" "$tmp/old.safetensors"
  train "$new" "$threads" "$precision" "$tmp/new.safetensors"
  train "$new" 1 "$precision" "$tmp/new1.safetensors"
  python3 - "$precision" "$threads" "$tmp/old.safetensors" "$tmp/new.safetensors" \
    "$tmp/new1.safetensors" <<'EOF' || status=1
import json, struct, sys

def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()
            if k != "__metadata__"}

precision, threads = sys.argv[1], sys.argv[2]
old, new, new1 = (tensors(p) for p in sys.argv[3:6])
bad = 0
for name, other, what in ((old, new, f"old vs new at {threads} threads"),
                          (new1, new, f"new at 1 vs {threads} threads")):
    differ = sorted(k for k in new if other.get(k) != new[k])
    print(f"{precision} {what}: {len(new)} tensors, {len(differ)} differ"
          + (f" ({', '.join(differ[:4])}...)" if differ else ""))
    bad += bool(differ)
sys.exit(1 if bad else 0)
EOF
done
exit $status
