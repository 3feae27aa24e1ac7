#!/usr/bin/env bash
# Translation throughput, `attn translate` against CTranslate2 running the same trained weights:
# a dates checkpoint (`attn train --task dates`, the command of docs/seq2seq.md, trained once and
# cached in BUILD/peers/), converted by bench/attn_to_ctranslate2.py through CTranslate2's
# specification API. Before any timing counts, both engines translate every held-out date
# (bench/peers_dates.py: 7,165 dates in two phrasings) at batch 32, greedy and beam 4, and must
# write the same lines; every timed run is compared again. Then greedy and beam 4 at batch 1 and
# 32, fp32, ATTN_THREADS threads (default 2), attn and CTranslate2 in turns (the order swaps
# per round). Writes the <!-- peers_translate --> block of docs/performance.md.
#
#   bench/run_peers_translate.sh [--quick] [build_dir] [rounds]      (default build/default, 3)
#   ATTN_PEERS_CHECKPOINT=FILE   use this dates checkpoint instead of training one
#   --quick: 256 timed sentences, one round; prints the block without writing it.
#
# attn's time is the wall time of the `attn translate` process minus that of the same command
# on an empty input (process start, checkpoint load: measured every round); CTranslate2's is the
# time inside translate_batch (its model load is reported apart). tokens/s counts the target
# tokens written, <eos> not included; both engines write the same tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == --quick ]]; then quick=1; shift; fi
build=${1:-build/default}
rounds=${2:-3}
threads=${ATTN_THREADS:-2}
attn_bin="$build/attn"
[[ -x "$attn_bin" ]] || { echo "run_peers_translate.sh: $attn_bin not built (--target attn_cli)" >&2; exit 2; }
py=$(bench/peers-venv.sh | tail -n1)
# The OpenMP wait policy is the default on both sides, as users run them (an earlier version set
# OMP_WAIT_POLICY=PASSIVE, which slowed both engines several times over at batch 1).
work="$build/peers"
mkdir -p "$work"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ckpt=${ATTN_PEERS_CHECKPOINT:-$work/dates.safetensors}
if [[ ! -s "$ckpt" ]]; then
  echo "training the dates checkpoint $ckpt (once; about a minute)" >&2
  "$attn_bin" train --task dates --steps 800 --eval-every 0 --eval-examples 1000 \
    --num-hiddens 64 --ffn-num-hiddens 128 --num-heads 4 --num-blks 2 --batch-size 64 \
    --lr 3e-3 --threads "$threads" --checkpoint "$ckpt" >&2
fi
rm -rf "$tmp/ct2"
"$py" bench/attn_to_ctranslate2.py "$ckpt" "$tmp/ct2" >"$tmp/convert.json"
python3 bench/peers_dates.py "$tmp/held.tsv"
max_len=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_steps"])' "$tmp/convert.json")

attn_run() {  # input beam batch out -> seconds of wall time
  local s e
  s=$(date +%s.%N)
  "$attn_bin" translate --checkpoint "$ckpt" --threads "$threads" --beam "$2" --batch-size "$3" \
    --max-len "$max_len" "$1" >"$4"
  e=$(date +%s.%N)
  python3 -c "print($e - $s)"
}
ct2_run() {  # input beam batch out [--inter] -> JSON
  "$py" bench/peers_translate.py "$tmp/ct2" "$1" "$4" --beam "$2" --batch "$3" \
    --threads "$threads" --max-len "$max_len" ${5:-}
}

# 1. The same translations on every held-out date, or no timing at all.
for beam in 1 4; do
  attn_run "$tmp/held.tsv" "$beam" 32 "$tmp/attn_all_$beam.txt" >/dev/null
  ct2_run "$tmp/held.tsv" "$beam" 32 "$tmp/ct2_all_$beam.txt" >/dev/null
  if ! cmp -s "$tmp/attn_all_$beam.txt" "$tmp/ct2_all_$beam.txt"; then
    n=$(paste "$tmp/attn_all_$beam.txt" "$tmp/ct2_all_$beam.txt" | awk -F'\t' '$1 != $2' | wc -l)
    echo "run_peers_translate.sh: beam $beam: attn and CTranslate2 differ on $n of $(wc -l <"$tmp/held.tsv") held-out sources; first ones (source | attn | ct2):" >&2
    paste <(cut -f1 "$tmp/held.tsv") "$tmp/attn_all_$beam.txt" "$tmp/ct2_all_$beam.txt" |
      awk -F'\t' '$2 != $3' | head -5 >&2
    exit 1
  fi
done
held=$(wc -l <"$tmp/held.tsv")
correct=$(paste <(cut -f2 "$tmp/held.tsv") "$tmp/attn_all_1.txt" | awk -F'\t' '$1 == $2' | wc -l)
echo "identical translations on all $held held-out sources, greedy and beam 4 (exact match with the reference: $correct)" >&2

# 2. Timing on a subset (every 3rd held-out line), alternating engines.
n_timed=4096
if (( quick )); then n_timed=256; rounds=1; fi
awk -v n="$n_timed" 'NR % 3 == 1 && ++k <= n' "$tmp/held.tsv" >"$tmp/timed.tsv"
: >"$tmp/empty.txt"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 0; r < rounds; r++)); do
  for i in 1 2 3; do echo "{\"empty\": $(attn_run "$tmp/empty.txt" 1 1 /dev/null)}"; done >>"$tmp/rows.jsonl"
  for batch in 1 32; do
    for beam in 1 4; do
      for side in $( ((r % 2)) && echo "ct2_inter ct2 attn" || echo "attn ct2 ct2_inter"); do
        if [[ $side == attn ]]; then
          secs=$(attn_run "$tmp/timed.tsv" "$beam" "$batch" "$tmp/a.txt")
          echo "{\"engine\": \"attn\", \"beam\": $beam, \"batch\": $batch, \"wall\": $secs}" >>"$tmp/rows.jsonl"
        elif [[ $side == ct2 ]]; then
          ct2_run "$tmp/timed.tsv" "$beam" "$batch" "$tmp/c.txt" |
            sed 's/^{/{"engine": "ct2", /' >>"$tmp/rows.jsonl"
        else
          ct2_run "$tmp/timed.tsv" "$beam" "$batch" "$tmp/ci.txt" --inter |
            sed 's/^{/{"engine": "ct2_inter", /' >>"$tmp/rows.jsonl"
        fi
      done
      cmp -s "$tmp/a.txt" "$tmp/c.txt" && cmp -s "$tmp/a.txt" "$tmp/ci.txt" ||
        { echo "run_peers_translate.sh: timed run beam $beam batch $batch: outputs differ" >&2; exit 1; }
    done
  done
  echo "round $((r + 1))/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
tokens=$(wc -w <"$tmp/a.txt")

python3 - "$tmp" "$threads" "$rounds" "$load_before" "$load_after" "$held" "$correct" \
  "$n_timed" "$tokens" "$max_len" >"$tmp/block.md" <<'PY'
import datetime, json, statistics, sys
sys.path.insert(0, "bench")
import peers_common as pc
tmp, threads, rounds, lb, la, held, correct, n_timed, tokens, max_len = sys.argv[1:11]
rows = pc.read_jsonl(f"{tmp}/rows.jsonl")
conv = json.load(open(f"{tmp}/convert.json"))
tokens = int(tokens)
empty = statistics.median(r["empty"] for r in rows if "empty" in r)
print("## Translation: `attn translate` against CTranslate2, the same weights\n")
print(f"Written by `bench/run_peers_translate.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {pc.cpu_model()}, {threads} threads on "
      f"both sides, fp32. CTranslate2 {conv['ctranslate2']} (PyPI).\n")
print(f"- Model: the dates checkpoint of docs/seq2seq.md (`attn train --task dates --steps 800 "
      f"...`: E = {conv['num_hiddens']}, {conv['num_heads']} heads, 2 + 2 post-norm blocks, FFN "
      "128), converted by `bench/attn_to_ctranslate2.py` (CTranslate2's TransformerSpec: "
      "pre_norm off, d2l's sinusoidal table given as the position encodings, embeddings × √E, "
      "LayerNorm eps 1e-5, no attention biases).")
print(f"- Same translations: on all {held} held-out sources (7,165 dates × 2 phrasings), greedy "
      f"and beam 4 at batch 32, attn and CTranslate2 write identical lines ({correct} of them "
      "equal the reference date); every timed run below is compared again.")
print(f"- Timed: {n_timed} held-out sources (every 3rd), consecutive batches of B, <eos> "
      f"appended to each source, at most {max_len} tokens out with <eos>; beam 4 ranks by "
      "log P / L^0.75 and stops a source at 4 finished hypotheses (patience 1) on both sides. "
      f"attn: wall time of `attn translate` minus the same command on an empty input "
      f"({1e3 * empty:.0f} ms: process start and checkpoint load). CTranslate2: the "
      "translate_batch calls (`bench/peers_translate.py`) in its two ways of using the threads: "
      "one replica on all of them (intra_threads = threads, inter_threads 1: each batch's ops "
      "split), and one replica per thread (inter_threads = threads, intra_threads 1: batches "
      "submitted asynchronously and decoded side by side, as `attn translate` decodes batches "
      "when there are more than one). The ratio is against the faster of the two. "
      f"tokens/s = {tokens} target tokens (no <eos>) / seconds.")
print(f"- {rounds} rounds, engines in turns; load average before: {lb}; after: {la}. Best "
      "(median) over rounds.\n")
print("| search | batch | attn tokens/s | CTranslate2, 1 replica × threads | CTranslate2, "
      "threads replicas × 1 | attn / faster CTranslate2 |")
print("|---|---|---|---|---|---|")
for batch in (1, 32):
    for beam in (1, 4):
        sel = [r for r in rows if r.get("beam") == beam and r.get("batch") == batch]
        a = [tokens / (r["wall"] - empty) for r in sel if r["engine"] == "attn"]
        c = [tokens / r["seconds"] for r in sel if r["engine"] == "ct2"]
        ci = [tokens / r["seconds"] for r in sel if r["engine"] == "ct2_inter"]
        best, best_med = max(max(c), max(ci)), max(statistics.median(c), statistics.median(ci))
        search = "greedy" if beam == 1 else f"beam {beam}"
        print(f"| {search} | {batch} | {max(a):,.0f} ({statistics.median(a):,.0f}) | "
              f"{max(c):,.0f} ({statistics.median(c):,.0f}) | "
              f"{max(ci):,.0f} ({statistics.median(ci):,.0f}) | **{max(a) / best:.2f}×** "
              f"({statistics.median(a) / best_med:.2f}×) |")
PY
cat "$tmp/block.md"
if (( quick )); then
  echo "run_peers_translate.sh --quick: no block written" >&2
else
  python3 bench/write_block.py peers_translate "$tmp/block.md" docs/performance.md
  echo "wrote the peers_translate block of docs/performance.md" >&2
fi
