#!/usr/bin/env bash
# What users run against the ideal case, side by side in alternating rounds, same threads:
# - the encoder training step: bench_train's full-length step (BM_TrainStep, BM_TrainStepBf16)
#   beside its padded one (BM_TrainStepPadded: lengths uniform in [T/2, T], the batch padded to
#   its longest, d2l's valid_lens) and beside `attn train` on padded variable-length batches (the
#   shift task, lengths 64..128, with and without --bucket 8), fp32 and bf16;
# - the seq2seq training step: BM_Seq2SeqStep full length and padded (B 32, 64 + 64 tokens);
# - MHA inference: bench_mha's BM_MhaInference beside BM_MhaInferencePadded, fp32 and bf16;
# - `attn translate` (the dates model of bench/run_peers_translate.sh, 4,096 held-out sources,
#   greedy, batch 32): the CLI's own rate.
# Token rates count valid (unpadded) tokens; MHA GFLOP/s count the useful work. Writes the
# <!-- padded:begin --> block of docs/performance.md.
#
#   bench/run_padded.sh [build_dir] [rounds]     (default build/default, 3)
#   ATTN_THREADS=2 (default) sets every side's thread count.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-3}
threads=${ATTN_THREADS:-2}
export ATTN_THREADS=$threads
for b in "$build/attn" "$build/bench/bench_train" "$build/bench/bench_mha"; do
  [[ -x "$b" ]] || { echo "run_padded.sh: $b not built" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
# The dates checkpoint for `attn translate` (the one run_peers_translate.sh trains and caches).
ckpt="$build/peers/dates.safetensors"
if [[ ! -s "$ckpt" ]]; then
  mkdir -p "$build/peers"
  echo "training the dates checkpoint $ckpt (once; about a minute)" >&2
  "$build/attn" train --task dates --steps 800 --eval-every 0 --eval-examples 1000 \
    --num-hiddens 64 --ffn-num-hiddens 128 --num-heads 4 --num-blks 2 --batch-size 64 \
    --lr 3e-3 --threads "$threads" --checkpoint "$ckpt" >&2
fi
python3 bench/peers_dates.py "$tmp/held.tsv"
awk 'NR % 3 == 1 && ++k <= 4096' "$tmp/held.tsv" | cut -f1 >"$tmp/sources.txt"
: >"$tmp/empty.txt"
seconds() {  # command... -> wall seconds
  local s e
  s=$(date +%s.%N)
  "$@" >"$tmp/out.txt"
  e=$(date +%s.%N)
  python3 -c "print($e - $s)"
}
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  "$build/bench/bench_train" \
    --benchmark_filter='BM_TrainStep(Bf16)?/|BM_TrainStepPadded|BM_Seq2SeqStep' \
    --benchmark_format=json >"$tmp/bench$r.json" 2>/dev/null
  "$build/bench/bench_mha" --benchmark_filter='BM_MhaInference' --benchmark_format=json \
    >"$tmp/mha$r.json" 2>/dev/null
  for input in sources empty; do
    seconds "$build/attn" translate --checkpoint "$ckpt" --threads "$threads" --batch-size 32 \
      "$tmp/$input.txt" >"$tmp/translate_${input}_$r.txt"
    if [[ $input == sources ]]; then wc -w <"$tmp/out.txt" >"$tmp/translated_tokens.txt"; fi
  done
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
padded = {"fp32": [], "bf16": []}
s2s = {"full": [], "padded": []}
mha = {}  # (T, dtype, padded) -> [GFLOP/s]
translate = []
cli = {(p, k): [] for p in ("fp32", "bf16") for k in (1, 8)}
for r in range(1, rounds + 1):
    for b in json.load(open(f"{tmp}/bench{r}.json"))["benchmarks"]:
        name = b["name"]
        if name.startswith("BM_TrainStepPadded"):
            padded["bf16" if "bf16:1" in name else "fp32"].append(b["tokens_per_second"])
        elif name.startswith("BM_Seq2SeqStep"):
            s2s["padded" if "padded:1" in name else "full"].append(b["tokens_per_second"])
        elif name.startswith("BM_TrainStep"):
            full["bf16" if name.startswith("BM_TrainStepBf16") else "fp32"].append(
                b["tokens_per_second"])
    for b in json.load(open(f"{tmp}/mha{r}.json"))["benchmarks"]:
        name = b["name"]
        m = re.match(r"BM_MhaInference(Padded|Bf16)?/(?:T:)?(\d+)(?:/bf16:(\d))?", name)
        if not m:
            continue
        kind, T, bf = m.group(1), int(m.group(2)), m.group(3)
        dtype = "bf16" if kind == "Bf16" or bf == "1" else "fp32"
        mha.setdefault((T, dtype, kind == "Padded"), []).append(b["GFLOP"])
    wall = float(open(f"{tmp}/translate_sources_{r}.txt").read())
    empty = float(open(f"{tmp}/translate_empty_{r}.txt").read())
    translate.append(wall - empty)
    for (p, k) in cli:
        text = open(f"{tmp}/cli_{p}_{k}_{r}.txt").read()
        rates = re.findall(r"([0-9.]+)k tok/s", text)
        if not rates:
            sys.exit(f"run_padded.sh: no rate in attn train's output:\n{text}")
        cli[(p, k)].append(float(rates[-1]) * 1e3)
out_tokens = int(open(f"{tmp}/translated_tokens.txt").read())
cpu = "unknown"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
print(f"Measured {datetime.date.today()} by `bench/run_padded.sh` ({rounds} alternating rounds, "
      f"{threads} threads, {cpu}; load {load_before} before, {load_after} after). Token rates "
      "count valid (unpadded) tokens; median over rounds, ratios per round: median (range).")
print()
print("**Encoder training step** (E 128, 4 heads, FFN 256, 2 blocks, dropout 0.1, B 32). Full "
      "length: `BM_TrainStep(Bf16)`, T = 128. Padded: `BM_TrainStepPadded` (lengths uniform in "
      "[64, 128], seeded, the batch padded to its longest) and `attn train --task shift --length "
      "128 --symbols 8` (the same lengths, every batch drawn anew), with and without `--bucket 8`.")
print()
print("| precision | full length (tok/s) | BM padded (tok/s) | BM padded / full | attn train padded "
      "(tok/s) | CLI / full | with `--bucket 8` (tok/s) | bucketed / full |")
print("|---|---|---|---|---|---|---|---|")
def ratio(xs, ys):
    rs = [x / y for x, y in zip(xs, ys)]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
def k(x):
    return f"{statistics.median(x) / 1e3:.1f}k"
for p in ("fp32", "bf16"):
    print(f"| {p} | {k(full[p])} | {k(padded[p])} | {ratio(padded[p], full[p])} | "
          f"{k(cli[(p, 1)])} | {ratio(cli[(p, 1)], full[p])} | {k(cli[(p, 8)])} | "
          f"{ratio(cli[(p, 8)], full[p])} |")
print()
print("The mean valid length is 96 of a batch's ~126 padded positions: the projections, FFN and "
      "LayerNorms run on every position, so without bucketing by length ~0.76 is the ceiling of "
      "padded / full (attention itself skips the masked keys). `--bucket 8` sorts 8 batches' worth of "
      "sequences by length before cutting them into batches, so each batch pads to little more than "
      "its own lengths.")
print()
print("**Seq2seq training step** (`BM_Seq2SeqStep`: B 32 pairs, 64 + 64 tokens, vocabularies of "
      "1000, E 128, 4 heads, FFN 256, 2 + 2 blocks, dropout 0.1; padded: source and target lengths "
      "uniform in [32, 64]; valid target tokens per second): full "
      f"{k(s2s['full'])}, padded {k(s2s['padded'])}, padded / full {ratio(s2s['padded'], s2s['full'])}.")
print()
print("**MultiHeadAttention inference** (B 4, E 512, 8 heads, self-attention with biases; padded: "
      "valid lengths uniform in [T/2, T], the batch T wide; GFLOP/s of the useful work):")
print()
print("| T | dtype | full (GFLOP/s) | padded (GFLOP/s) | padded / full |")
print("|---|---|---|---|---|")
for T in (512, 2048):
    for dt in ("fp32", "bf16"):
        f, pd = mha.get((T, dt, False)), mha.get((T, dt, True))
        if f and pd:
            print(f"| {T} | {dt} | {statistics.median(f):.0f} | {statistics.median(pd):.0f} | "
                  f"{ratio(pd, f)} |")
print()
rates = [out_tokens / t for t in translate]
print(f"**`attn translate`** (the dates model of `bench/run_peers_translate.sh`, 4,096 held-out "
      f"sources, greedy, `--batch-size 32`; wall time minus that of an empty input): "
      f"{k(rates)} target tokens/s ({out_tokens} tokens). CTranslate2 on the same weights: the "
      "`peers_translate` block.")
PY
cat "$tmp/block.md"
/usr/bin/python3 bench/write_block.py padded "$tmp/block.md" docs/performance.md
