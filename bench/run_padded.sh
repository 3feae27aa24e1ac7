#!/usr/bin/env bash
# What users run against the ideal case, in alternating rounds on the same threads (issue 23):
#  - the encoder training step (E 128, 4 heads, FFN 256, 2 blocks, dropout 0.1, B 32, T 128),
#    fp32 and bf16: bench_train's full-length step (BM_TrainStep, BM_TrainStepBf16) beside its
#    padded one (BM_TrainStepPadded, BM_TrainStepPaddedBf16: lengths uniform in [T/2, T], each
#    batch padded to its longest, d2l's valid_lens) and beside `attn train` on the shift task
#    (the same lengths and padding), without and with --bucket 8;
#  - the seq2seq training step (B 32, 64 + 64 tokens, vocabularies of 1000, E 128, 2 + 2 blocks),
#    fp32 and bf16: BM_Seq2SeqStep(Bf16) beside BM_Seq2SeqStepPadded(Bf16) (source and target
#    lengths uniform in [T/2, T]);
#  - MHA inference (B 4, E 512, 8 heads, T 512 and 2048), fp32 and bf16: BM_MhaInference(Bf16)
#    beside BM_MhaInferencePadded(Bf16), GFLOP/s of the valid work;
#  - `attn translate` on the dates checkpoint of docs/seq2seq.md (trained once and cached in
#    BUILD/peers/dates.safetensors, as bench/run_peers_translate.sh does) over 1024 held-out
#    sources (bench/peers_dates.py), greedy and beam 4, batch 1 and 32.
# Training rates count valid tokens per second of wall time (the target tokens in the loss for
# seq2seq); the CLI runs with --eval-every 0 and a 64-sequence evaluation set, so its rate is the
# training loop's (data generation, batching and logging included). attn translate's rate is the
# target tokens written (no <eos>) over the wall time minus that of the same command on an empty
# input (process start, checkpoint load). Writes the <!-- padded:begin --> block of
# docs/performance.md.
#
#   bench/run_padded.sh [build_dir] [rounds]     (default build/default, 3)
#   ATTN_THREADS=2 (default) sets every side's thread count.
#   ATTN_PEERS_CHECKPOINT=FILE   use this dates checkpoint instead of the cached one
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

ckpt=${ATTN_PEERS_CHECKPOINT:-$build/peers/dates.safetensors}
if [[ ! -s "$ckpt" ]]; then
  echo "training the dates checkpoint $ckpt (once; about a minute)" >&2
  mkdir -p "$(dirname "$ckpt")"
  "$build/attn" train --task dates --steps 800 --eval-every 0 --eval-examples 1000 \
    --num-hiddens 64 --ffn-num-hiddens 128 --num-heads 4 --num-blks 2 --batch-size 64 \
    --lr 3e-3 --threads "$threads" --checkpoint "$ckpt" >&2
fi
/usr/bin/python3 bench/peers_dates.py "$tmp/held.tsv"
awk 'NR % 7 == 1 && ++k <= 1024' "$tmp/held.tsv" >"$tmp/timed.tsv"
: >"$tmp/empty.txt"
translate() {  # input beam batch out -> seconds of wall time
  local s e
  s=$(date +%s.%N)
  "$build/attn" translate --checkpoint "$ckpt" --threads "$threads" --beam "$2" --batch-size "$3" \
    "$1" >"$4"
  e=$(date +%s.%N)
  /usr/bin/python3 -c "print($e - $s)"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  # Full-length and padded benchmarks in separate processes, their order swapped every round, so
  # that a change of load during a round does not always favour the same side.
  for kind in $( ((r % 2)) && echo "full padded" || echo "padded full"); do
    [[ $kind == full ]] && pad="" || pad=Padded
    "$build/bench/bench_train" --benchmark_format=json \
      --benchmark_filter="^BM_TrainStep$pad(Bf16)?/|^BM_Seq2SeqStep$pad(Bf16)?/" \
      >"$tmp/train_${kind}_$r.json" 2>/dev/null
    "$build/bench/bench_mha" --benchmark_format=json --benchmark_min_time=2 \
      --benchmark_min_warmup_time=0.5 --benchmark_filter="^BM_MhaInference$pad(Bf16)?/" \
      >"$tmp/mha_${kind}_$r.json" 2>/dev/null
  done
  for p in fp32 bf16; do
    for k in 1 8; do
      "$build/attn" train --task shift --length 128 --symbols 8 --num-hiddens 128 \
        --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 --threads "$threads" \
        --steps 200 --eval-every 0 --eval-examples 64 --precision "$p" --bucket $k \
        2>"$tmp/cli_${p}_${k}_$r.txt" >/dev/null
    done
  done
  for i in 1 2 3; do translate "$tmp/empty.txt" 1 1 /dev/null; done >"$tmp/empty_$r.txt"
  for batch in 1 32; do
    for beam in 1 4; do
      translate "$tmp/timed.tsv" "$beam" "$batch" "$tmp/out_${beam}_$batch.txt" \
        >"$tmp/tr_${beam}_${batch}_$r.txt"
      echo "$(wc -w <"$tmp/out_${beam}_$batch.txt")" >"$tmp/trtok_${beam}_${batch}_$r.txt"
    done
  done
  echo "round $r/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$tmp" "$rounds" "$threads" "$load_before" "$load_after" >"$tmp/block.md" <<'PY'
import datetime, json, re, statistics, sys
tmp, rounds, threads, load_before, load_after = sys.argv[1:6]
rounds = int(rounds)
bench = {}  # (name, arg) -> [counters per round]
for r in range(1, rounds + 1):
    for f in (f"{tmp}/{b}_{k}_{r}.json" for b in ("train", "mha") for k in ("full", "padded")):
        for b in json.load(open(f))["benchmarks"]:
            parts = b["name"].split("/")
            arg = parts[1] if len(parts) > 1 and parts[1].isdigit() else ""
            bench.setdefault((parts[0], arg), []).append(b)
cli = {(p, k): [] for p in ("fp32", "bf16") for k in (1, 8)}
for r in range(1, rounds + 1):
    for (p, k) in cli:
        text = open(f"{tmp}/cli_{p}_{k}_{r}.txt").read()
        rates = re.findall(r"([0-9.]+)k tok/s", text)
        if not rates:
            sys.exit(f"run_padded.sh: no rate in attn train's output:\n{text}")
        cli[(p, k)].append(float(rates[-1]) * 1e3)
tr = {}
for r in range(1, rounds + 1):
    empty = statistics.median(float(x) for x in open(f"{tmp}/empty_{r}.txt").read().split())
    for beam in (1, 4):
        for batch in (1, 32):
            secs = float(open(f"{tmp}/tr_{beam}_{batch}_{r}.txt").read()) - empty
            tokens = int(open(f"{tmp}/trtok_{beam}_{batch}_{r}.txt").read())
            tr.setdefault((beam, batch), []).append(tokens / secs)
sys.path.insert(0, "bench")
import peers_common  # noqa: E402
cpu = peers_common.cpu_model()  # with family, model and vector extension: "AMD EPYC" is many CPUs


def series(name, counter, arg=""):
    return [b[counter] for b in bench[(name, arg)]]


def med(v, scale=1e3, unit="k"):
    return f"{statistics.median(v) / scale:.1f}{unit}"


def ratio(a, b):  # per-round ratios: median (range)
    rs = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"


print("## What users run: padded batches beside full length, and the CLI's own rates\n")
print(f"Written by `bench/run_padded.sh`; do not edit by hand. "
      f"Measured {datetime.date.today()} ({rounds} alternating rounds, "
      f"{threads} threads, {cpu}; load {load_before} before, {load_after} after). Medians over "
      "rounds; ratios are per round, median (range). Padded: lengths uniform in [T/2, T] "
      "(seeded), each batch padded to its longest, d2l's valid_lens. Training rates count valid "
      "tokens per second.")
print()
print("Encoder training step (E 128, 4 heads, FFN 256, 2 blocks, dropout 0.1, B 32, T 128). "
      "bench_train: the classifier of `BM_TrainStep` on one full-length batch, and "
      "`BM_TrainStepPadded` on 8 seeded padded batches cycled. `attn train --task shift "
      "--length 128 --symbols 8`: the same encoder with a tagging head, padded batches drawn "
      "every step, the training loop's rate.")
print()
print("| precision | bench_train full (tok/s) | bench_train padded (tok/s) | padded / full "
      "| attn train `--bucket 1` (tok/s) | `--bucket 1` / full | attn train (default `--bucket 8`, "
      "tok/s) | bucketed / full |")
print("|---|---|---|---|---|---|---|---|")
for p, suffix in (("fp32", ""), ("bf16", "Bf16")):
    full = series(f"BM_TrainStep{suffix}", "tokens_per_second")
    pad = series(f"BM_TrainStepPadded{suffix}", "tokens_per_second")
    print(f"| {p} | {med(full)} | {med(pad)} | {ratio(pad, full)} | {med(cli[(p, 1)])} | "
          f"{ratio(cli[(p, 1)], full)} | {med(cli[(p, 8)])} | {ratio(cli[(p, 8)], full)} |")
frac = series("BM_TrainStepPadded", "padded_fraction")[0]
print()
print(f"{100 * frac:.0f}% of the padded batches' positions are padding, so where every position "
      f"costs the same ~{1 - frac:.2f} is padded / full (attention itself skips the masked keys, "
      "so it can do a little better). `--bucket 8` sorts 8 batches' worth of sequences by length "
      "before cutting them into batches, so each batch pads to little more than its own lengths.")
print()
s_tf = series("BM_Seq2SeqStepPadded", "padded_fraction")[0]
s_sf = series("BM_Seq2SeqStepPadded", "src_padded_fraction")[0]
print("Seq2seq training step (`model::Seq2SeqTrainer`: B 32, 64 + 64 tokens, vocabularies of "
      "1000, E 128, 4 heads, FFN 256, 2 + 2 blocks, dropout 0.1; the `long` shape of "
      "bench/run_peers_seq2seq.sh), valid target tokens per second; bf16 is `attn train "
      "--precision bf16`'s mixed precision:")
print()
print("| precision | bench_train `BM_Seq2SeqStep` full (tok/s) | `BM_Seq2SeqStepPadded` (tok/s) | "
      "padded / full | padding, source / target |")
print("|---|---|---|---|---|")
for p, suffix in (("fp32", ""), ("bf16", "Bf16")):
    s_full = series(f"BM_Seq2SeqStep{suffix}", "tokens_per_second")
    s_pad = series(f"BM_Seq2SeqStepPadded{suffix}", "tokens_per_second")
    print(f"| {p} | {med(s_full)} | {med(s_pad)} | {ratio(s_pad, s_full)} | "
          f"{100 * s_sf:.0f}% / {100 * s_tf:.0f}% |")
print()
print("MHA inference (bench_mha: B 4, E 512, 8 heads, self-attention, biases, no weights kept), "
      "GFLOP/s; the padded ones count only the valid work (projections of valid rows, valid "
      "queries over valid keys). `rows bound`: the valid work over the work of every row "
      "(padded rows through the projections, every query over its valid keys); padded / full "
      "at the bound means padding costs its own rows' arithmetic and no more, at 1.00 nothing. "
      "`by CPU time`: the same ratio from the process CPU time (all threads; they sleep when "
      "waiting), steadier than wall time when other work comes and goes on the cores:")
print()
print("| T | dtype | full (GFLOP/s) | padded (GFLOP/s of valid work) | padded / full "
      "| by CPU time | rows bound | valid fraction |")
print("|---|---|---|---|---|---|---|---|")
for dt, suffix in (("fp32", ""), ("bf16", "Bf16")):
    for T in ("512", "2048"):
        full = series(f"BM_MhaInference{suffix}", "GFLOP", T)
        pad = series(f"BM_MhaInferencePadded{suffix}", "GFLOP", T)
        vf = series(f"BM_MhaInferencePadded{suffix}", "valid_fraction", T)[0]
        rb = series(f"BM_MhaInferencePadded{suffix}", "rows_bound", T)[0]
        # GFLOP per CPU second: the wall-time rate times wall time over process CPU time.
        cpu = {k: [b["GFLOP"] * b["real_time"] / b["cpu_time"] for b in bench[(n, T)]]
               for k, n in (("full", f"BM_MhaInference{suffix}"),
                            ("pad", f"BM_MhaInferencePadded{suffix}"))}
        print(f"| {T} | {dt} | {med(full, 1, '')} | {med(pad, 1, '')} | {ratio(pad, full)} "
              f"| {ratio(cpu['pad'], cpu['full'])} | {rb:.2f} | {vf:.2f} |")
print()
print("`attn translate` on the dates checkpoint of docs/seq2seq.md (E 64, 4 heads, 2 + 2 blocks, "
      "FFN 128), fp32, 1024 held-out sources (bench/peers_dates.py, every 7th); tokens/s = "
      "target tokens written (no <eos>) / (wall time - an empty input's):")
print()
print("| search | batch 1 (tok/s) | batch 32 (tok/s) |")
print("|---|---|---|")
for beam, label in ((1, "greedy"), (4, "beam 4")):
    print(f"| {label} | {med(tr[(beam, 1)])} | {med(tr[(beam, 32)])} |")
PY
cat "$tmp/block.md"
/usr/bin/python3 bench/write_block.py padded "$tmp/block.md" docs/performance.md
