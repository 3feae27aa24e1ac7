#!/usr/bin/env bash
# What users run against the ideal case: `attn train` on padded variable-length batches (the shift
# task, lengths uniform in [T/2, T], each batch padded to its longest sequence, d2l's valid_lens)
# beside bench_train's full-length step of the same width, heads, FFN, blocks, batch, dropout and
# threads (BM_TrainStep, BM_TrainStepBf16), fp32 and bf16, in alternating rounds. Both count
# tokens the same way: the valid (unpadded) tokens a step trains on, per second of wall time. The
# CLI runs with --eval-every 0 and a 64-sequence evaluation set, so its rate is the training
# loop's (data generation, batching and logging included). Writes the <!-- padded:begin --> block
# of docs/performance.md.
#
#   bench/run_padded.sh [build_dir] [rounds]     (default build/default, 3)
#   ATTN_THREADS=2 (default) sets both sides' thread count.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-3}
threads=${ATTN_THREADS:-2}
export ATTN_THREADS=$threads
for b in "$build/attn" "$build/bench/bench_train"; do
  [[ -x "$b" ]] || { echo "run_padded.sh: $b not built" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  "$build/bench/bench_train" --benchmark_filter='BM_TrainStep(Bf16)?/' --benchmark_format=json \
    >"$tmp/bench$r.json" 2>/dev/null
  for p in fp32 bf16; do
    for k in 1 8; do
      "$build/attn" train --task shift --length 128 --symbols 8 --num-hiddens 128 \
        --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 --threads "$threads" \
        --steps 200 --eval-every 0 --eval-examples 64 --precision "$p" --bucket $k \
        2>"$tmp/cli_${p}_${k}_$r.txt" >/dev/null
    done
  done
  echo "round $r/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$tmp" "$rounds" "$threads" "$load_before" "$load_after" >"$tmp/block.md" <<'PY'
import datetime, json, re, statistics, subprocess, sys
tmp, rounds, threads, load_before, load_after = sys.argv[1:6]
rounds = int(rounds)
full = {"fp32": [], "bf16": []}
cli = {(p, k): [] for p in ("fp32", "bf16") for k in (1, 8)}
for r in range(1, rounds + 1):
    for b in json.load(open(f"{tmp}/bench{r}.json"))["benchmarks"]:
        key = "bf16" if b["name"].startswith("BM_TrainStepBf16") else "fp32"
        full[key].append(b["tokens_per_second"])
    for (p, k) in cli:
        text = open(f"{tmp}/cli_{p}_{k}_{r}.txt").read()
        rates = re.findall(r"([0-9.]+)k tok/s", text)
        if not rates:
            sys.exit(f"run_padded.sh: no rate in attn train's output:\n{text}")
        cli[(p, k)].append(float(rates[-1]) * 1e3)
cpu = "unknown"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
print(f"Measured {datetime.date.today()} by `bench/run_padded.sh` ({rounds} alternating rounds, "
      f"{threads} threads, {cpu}; load {load_before} before, {load_after} after). Model: E 128, "
      "4 heads, FFN 256, 2 blocks, dropout 0.1, B 32. Full length: bench_train, T = 128. Padded: "
      "`attn train --task shift --length 128 --symbols 8` (lengths 64..128, each batch padded to "
      "its longest), valid tokens per second. Per-round ratios, median (range):")
print()
print("| precision | bench_train full length (tok/s) | attn train padded (tok/s) | padded / full "
      "| with `--bucket 8` (tok/s) | bucketed / full |")
print("|---|---|---|---|---|---|")
def ratio(p, k):
    rs = [c / f for c, f in zip(cli[(p, k)], full[p])]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
for p in ("fp32", "bf16"):
    print(f"| {p} | {statistics.median(full[p]) / 1e3:.1f}k | {statistics.median(cli[(p, 1)]) / 1e3:.1f}k | "
          f"{ratio(p, 1)} | {statistics.median(cli[(p, 8)]) / 1e3:.1f}k | {ratio(p, 8)} |")
print()
print("The mean valid length is 96 of a batch's ~126 padded positions: the projections, FFN and "
      "LayerNorms run on every position, so without bucketing by length ~0.76 is the ceiling of "
      "padded / full (attention itself skips the masked keys). `--bucket 8` sorts 8 batches' worth of "
      "sequences by length before cutting them into batches, so each batch pads to little more than "
      "its own lengths.")
PY
cat "$tmp/block.md"
/usr/bin/python3 bench/write_block.py padded "$tmp/block.md" docs/performance.md
