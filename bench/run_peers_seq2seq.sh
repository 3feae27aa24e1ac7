#!/usr/bin/env bash
# The seq2seq (n -> m) training step, attn against PyTorch 2.x from PyPI (bench/peers-venv.sh):
# bench/peers_seq2seq.py on the dates model of docs/seq2seq.md (B 64, 11 + 11 tokens) and a
# longer one (B 32, 64 + 64 tokens, E 128), padded batches, dropout 0.1, AdamW and clipping;
# attn through its Python module, PyTorch 2.x eager fp32 and with bf16 autocast, the same thread
# count (ATTN_THREADS, default 2), in turns per round. Writes the <!-- peers_seq2seq --> block of
# docs/performance.md.
#
#   bench/run_peers_seq2seq.sh [--quick] [build_dir] [rounds]     (default build/default, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == --quick ]]; then quick=1; shift; fi
build=${1:-build/default}
rounds=${2:-2}
threads=${ATTN_THREADS:-2}
ls "$build"/python/attn/_attn*.so >/dev/null 2>&1 ||
  { echo "run_peers_seq2seq.sh: the Python module is not built (--target _attn)" >&2; exit 2; }
py=$(bench/peers-venv.sh | tail -n1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
min_time=3
if (( quick )); then rounds=1; min_time=1; fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  for shape in dates long; do
    PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 bench/peers_seq2seq.py \
      --engine attn --threads "$threads" --shape "$shape" --min-time "$min_time" >>"$tmp/rows.jsonl"
    "$py" bench/peers_seq2seq.py --engine torch --threads "$threads" --shape "$shape" \
      --min-time "$min_time" >>"$tmp/rows.jsonl"
    "$py" bench/peers_seq2seq.py --engine torch --autocast --threads "$threads" --shape "$shape" \
      --min-time "$min_time" >>"$tmp/rows.jsonl"
  done
  echo "round $r/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$tmp" "$threads" "$rounds" "$load_before" "$load_after" >"$tmp/block.md" <<'PY'
import datetime, statistics, sys
sys.path.insert(0, "bench")
import peers_common as pc
tmp, threads, rounds, lb, la = sys.argv[1:6]
rows = pc.read_jsonl(f"{tmp}/rows.jsonl")
res, ver = {}, {}
for r in rows:
    key = (r["engine"] + ("-autocast" if r["autocast"] else ""), r["shape"])
    res.setdefault(key, []).append(r["tokens_per_second"])
    ver[r["engine"]] = r["version"]


def fmt(v):
    return f"{max(v):,.0f} ({statistics.median(v):,.0f})"


def ratio(a, b):
    return f"**{max(a) / max(b):.2f}×** ({statistics.median(a) / statistics.median(b):.2f}×)"


print("## Seq2seq training step: attn against PyTorch 2.x (PyPI)\n")
print(f"Written by `bench/run_peers_seq2seq.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {pc.cpu_model()}, {threads} threads on "
      f"both sides. attn {ver.get('attn', '?')} (its Python module: `attn.EncoderDecoder`, "
      f"`attn.cross_entropy`, `attn.optim`); PyTorch {ver.get('torch', '?')} eager running d2l's "
      "code (tests/fixtures/d2l_reference.py). Script: `bench/peers_seq2seq.py`.\n")
print("- One step: teacher-forced forward, cross-entropy over the target positions < "
      "tgt_valid_lens, backward, clip_grad_norm 1.0, AdamW; dropout 0.1; padded batches (source "
      "and target lengths uniform in [L/2, L]). tokens/s = B × T target positions per step.")
print("- `dates`: B 64, 11 + 11 tokens, vocab 70 / 236, E 64, 4 heads, FFN 128, 2 + 2 blocks "
      "(the model of docs/seq2seq.md). `long`: B 32, 64 + 64 tokens, vocab 1000, E 128, 4 heads, "
      "FFN 256, 2 + 2 blocks.")
print(f"- {rounds} round(s), in turns; best (median). Load average before: {lb}; after: {la}.\n")
print("| shape | attn fp32 | PyTorch eager fp32 | PyTorch bf16 autocast | attn / eager fp32 | "
      "attn / bf16 autocast |")
print("|---|---|---|---|---|---|")
for shape in ("dates", "long"):
    a, t, tb = res[("attn", shape)], res[("torch", shape)], res[("torch-autocast", shape)]
    print(f"| {shape} | {fmt(a)} | {fmt(t)} | {fmt(tb)} | {ratio(a, t)} | {ratio(a, tb)} |")
print("\n`attn.EncoderDecoder` takes float32 or float64 only (bf16 runs in attn's attention and "
      "linear layers), so only attn's fp32 step runs here; bench_train's BM_TrainStepBf16 "
      "covers bf16 for the encoder (the peers_train block).")
PY
cat "$tmp/block.md"
if (( quick )); then
  echo "run_peers_seq2seq.sh --quick: no block written" >&2
else
  python3 bench/write_block.py peers_seq2seq "$tmp/block.md" docs/performance.md
  echo "wrote the peers_seq2seq block of docs/performance.md" >&2
fi
