#!/usr/bin/env bash
# The seq2seq (n -> m) training step, attn against PyTorch 2.x from PyPI (bench/peers-venv.sh):
# bench/peers_seq2seq.py on the dates model of docs/seq2seq.md (B 64, 11 + 11 tokens) and a
# longer one (B 32, 64 + 64 tokens, E 128), padded batches, dropout 0.1, AdamW and clipping;
# attn through its Python module and PyTorch 2.x eager, each in fp32 and in bf16 mixed precision
# (attn: context.autocast_bf16; PyTorch: torch.autocast), the same thread
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
    for ac in "" --autocast; do
      PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 \
        bench/peers_seq2seq.py --engine attn $ac --threads "$threads" --shape "$shape" \
        --min-time "$min_time" >>"$tmp/rows.jsonl"
    done
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
      f"`attn.cross_entropy_with_grad`, `attn.optim`); PyTorch {ver.get('torch', '?')} eager running d2l's "
      "code (tests/fixtures/d2l_reference.py). Script: `bench/peers_seq2seq.py`.\n")
print("- One step: teacher-forced forward, cross-entropy over the target positions < "
      "tgt_valid_lens, backward, clip_grad_norm 1.0, AdamW; dropout 0.1; padded batches (source "
      "and target lengths uniform in [L/2, L]). tokens/s = B × T target positions per step.")
print("- `dates`: B 64, 11 + 11 tokens, vocab 70 / 236, E 64, 4 heads, FFN 128, 2 + 2 blocks "
      "(the model of docs/seq2seq.md). `long`: B 32, 64 + 64 tokens, vocab 1000, E 128, 4 heads, "
      "FFN 256, 2 + 2 blocks.")
print(f"- {rounds} round(s), in turns; best (median). Load average before: {lb}; after: {la}.\n")
print("| shape | attn fp32 | PyTorch eager fp32 | attn / eager fp32 | attn bf16 mixed | "
      "PyTorch bf16 autocast | attn bf16 / bf16 autocast |")
print("|---|---|---|---|---|---|---|")
for shape in ("dates", "long"):
    a, t = res[("attn", shape)], res[("torch", shape)]
    ab, tb = res[("attn-autocast", shape)], res[("torch-autocast", shape)]
    print(f"| {shape} | {fmt(a)} | {fmt(t)} | {ratio(a, t)} | {fmt(ab)} | {fmt(tb)} | "
          f"{ratio(ab, tb)} |")
bf16 = "native" if "avx512_bf16" in pc.cpu_flags() or "amx_bf16" in pc.cpu_flags() else "none"
print("\nbf16 mixed precision: attn's `EncoderDecoder` with `context.autocast_bf16 = True` (as "
      "`attn train --precision bf16`), PyTorch's d2l model under `torch.autocast(\"cpu\", "
      f"dtype=torch.bfloat16)`. bf16 arithmetic on this CPU: {bf16} (without AVX512-BF16 or AMX "
      "attn multiplies the bf16-rounded values in float32, at about its fp32 speed).")
PY
cat "$tmp/block.md"
if (( quick )); then
  echo "run_peers_seq2seq.sh --quick: no block written" >&2
else
  python3 bench/write_block.py peers_seq2seq "$tmp/block.md" docs/performance.md
  echo "wrote the peers_seq2seq block of docs/performance.md" >&2
fi
