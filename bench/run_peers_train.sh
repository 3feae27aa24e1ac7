#!/usr/bin/env bash
# Training step and the MHA module, attn against PyTorch 2.x from PyPI (bench/peers-venv.sh):
#  - the d2l encoder classifier's step (B 32 x T 128, E 128, 4 heads, FFN 256, 2 blocks,
#    dropout 0.1, AdamW, clip): attn's bench_train (BM_TrainStep fp32, BM_TrainStepBf16 and
#    their padded BM_TrainStepPadded, BM_TrainStepPaddedBf16) against bench/peers_train.py
#    (PyTorch 2.x eager fp32, bf16 autocast, torch.compile with and without autocast; full
#    length and padded: lengths uniform in [T/2, T], each batch padded to its longest; both
#    sides count valid tokens per second);
#  - the MHA module (B 4 x T 512, E 512, 8 heads): bench_mha's BM_Mha{Inference,Training}[Bf16]
#    against bench/torch_mha.py run by PyTorch 2.x (nn.MultiheadAttention, fp32 and bf16).
# Same shapes and thread count (ATTN_THREADS, default 2), attn and PyTorch in turns per round.
# Writes the <!-- peers_train --> block of docs/performance.md.
#
#   bench/run_peers_train.sh [--quick] [build_dir] [rounds]      (default build/default, 2)
#   --quick: one round, 1 s per measurement, no torch.compile; prints without writing.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == --quick ]]; then quick=1; shift; fi
build=${1:-build/default}
rounds=${2:-2}
export ATTN_THREADS=${ATTN_THREADS:-2}
threads=$ATTN_THREADS
for b in bench_train bench_mha; do
  [[ -x "$build/bench/$b" ]] || { echo "run_peers_train.sh: $build/bench/$b not built" >&2; exit 2; }
done
py=$(bench/peers-venv.sh | tail -n1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
min_time=3
modes=(eager autocast compile compile-autocast)
if (( quick )); then rounds=1; min_time=1; modes=(eager autocast); fi

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  "$build/bench/bench_train" --benchmark_filter='BM_TrainStep(Bf16)?/|BM_TrainStep.*[Pp]ad' \
    --benchmark_min_time="$min_time" --benchmark_format=json >"$tmp/attn_train$r.json"
  for m in "${modes[@]}"; do
    for pad in "" --padded; do
      if ! timeout 900 "$py" bench/peers_train.py --threads "$threads" --mode "$m" $pad \
        --min-time "$min_time" >>"$tmp/torch_train.jsonl" 2>"$tmp/torch_train.err"; then
        tail -n 3 "$tmp/torch_train.err" >&2
        echo "{\"mode\": \"$m\", \"padded\": $([[ -n $pad ]] && echo true || echo false), \"skipped\": \"the process failed (or ran past 900 s)\"}" >>"$tmp/torch_train.jsonl"
      fi
    done
  done
  "$build/bench/bench_mha" --benchmark_filter='BM_Mha(Inference|Training)(Bf16)?/512/' \
    --benchmark_min_time="$min_time" --benchmark_format=json >"$tmp/attn_mha$r.json"
  for d in float32 bfloat16; do
    "$py" bench/torch_mha.py --threads "$threads" --lengths 512 --dtype "$d" \
      --min-time "$min_time" --min-reps 3 >>"$tmp/torch_mha.jsonl"
  done
  echo "round $r/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$tmp" "$threads" "$rounds" "$load_before" "$load_after" >"$tmp/block.md" <<'PY'
import datetime, json, statistics, sys
sys.path.insert(0, "bench")
import peers_common as pc
tmp, threads, rounds, lb, la = sys.argv[1:6]
rounds = int(rounds)
attn, mha, peak = {}, {}, 0.0
for r in range(1, rounds + 1):
    for b in json.load(open(f"{tmp}/attn_train{r}.json"))["benchmarks"]:
        if "tokens_per_second" in b:
            attn.setdefault(b["name"].split("/")[0], []).append(b["tokens_per_second"])
    run = json.load(open(f"{tmp}/attn_mha{r}.json"))
    peak = max(peak, float(run["context"].get("fma_peak_GFLOPS", 0) or 0))
    for b in run["benchmarks"]:
        mha.setdefault(b["name"].split("/")[0], []).append(b["GFLOP"])
torch, skipped, version = {}, {}, "?"
for t in pc.read_jsonl(f"{tmp}/torch_train.jsonl"):
    key = (t["mode"], t["padded"])
    version = t.get("torch", version)
    if "skipped" in t:
        skipped[key] = t["skipped"]
    else:
        torch.setdefault(key, []).append(t["tokens_per_second"])
tmha = {}
for t in pc.read_jsonl(f"{tmp}/torch_mha.jsonl"):
    tmha.setdefault((t["mode"], t["dtype"]), []).append(t["gflops_best"])


def fmt(v):
    return f"{max(v):,.0f} ({statistics.median(v):,.0f})" if v else "—"


print("## Training step and MHA module: attn against PyTorch 2.x (PyPI)\n")
print(f"Written by `bench/run_peers_train.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {pc.cpu_model()}, {threads} threads on "
      f"both sides. PyTorch {version} (PyPI wheel, its bundled MKL/oneDNN; CPU only). "
      f"{pc.amx_line()}.\n")
print("- Encoder classifier step: embedding × √E + sinusoidal PE, 2 post-norm blocks (E 128, 4 "
      "heads, FFN 256), masked-mean head, vocabulary 1000, dropout 0.1; forward, cross-entropy, "
      "backward, clip_grad_norm 1.0, AdamW. Batch 32 × 128; `padded`: valid lengths uniform in "
      "[64, 128] (seeded), each batch padded to its longest (attn: 8 batches cycled, PyTorch: "
      "one). tokens/s = valid tokens per second (32 × 128 per step at full length). attn: "
      "`bench/bench_train.cpp`; PyTorch: `bench/peers_train.py` (d2l's code from "
      "tests/fixtures/d2l_reference.py, as bench/torch_train.py).")
print(f"- {rounds} round(s), attn and PyTorch in turns; best (median). Load average before: "
      f"{lb}; after: {la}. Both sides with `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:"
      "glibc.malloc.trim_threshold=68719476736 OMP_WAIT_POLICY=PASSIVE`.\n")
print("| step, tokens/s | full length | padded |")
print("|---|---|---|")
pads = [n for n in attn if "ad" in n[len("BM_TrainStep"):]]
print(f"| attn fp32 (`BM_TrainStep`) | {fmt(attn.get('BM_TrainStep'))} | "
      + (", ".join(f"{fmt(attn[n])} `{n}`" for n in pads if "Bf16" not in n) or
         "— (bench_train has no padded step in this build)") + " |")
print(f"| attn bf16 mixed (`BM_TrainStepBf16`) | {fmt(attn.get('BM_TrainStepBf16'))} | "
      + (", ".join(f"{fmt(attn[n])} `{n}`" for n in pads if "Bf16" in n) or "—") + " |")
labels = {"eager": "eager fp32", "autocast": "eager, bf16 autocast",
          "compile": "torch.compile fp32", "compile-autocast": "torch.compile, bf16 autocast"}
for mode, label in labels.items():
    cells = []
    for pad in (False, True):
        if (mode, pad) in torch:
            cells.append(fmt(torch[(mode, pad)]))
        elif (mode, pad) in skipped:
            cells.append(f"did not run: {skipped[(mode, pad)]}")
        else:
            cells.append("not run (--quick)")
    print(f"| PyTorch {version.split('+')[0]} {label} | " + " | ".join(cells) + " |")


def ratio(a, b):
    return f"**{max(a) / max(b):.2f}×** ({statistics.median(a) / statistics.median(b):.2f}×)" \
        if a and b else "—"


print("\nTargets (issue 23: >= 2× PyTorch 2.x eager fp32, >= 2× its bf16 autocast; full length "
      "and padded):\n")
print("| ratio, best (median) | full length | padded |")
print("|---|---|---|")
a32, a16 = attn.get("BM_TrainStep"), attn.get("BM_TrainStepBf16")
p32, p16 = attn.get("BM_TrainStepPadded"), attn.get("BM_TrainStepPaddedBf16")
for label, a, p, mode in (("attn fp32 / PyTorch eager fp32", a32, p32, "eager"),
                          ("attn bf16 / PyTorch bf16 autocast", a16, p16, "autocast"),
                          ("attn fp32 / PyTorch torch.compile fp32", a32, p32, "compile"),
                          ("attn bf16 / PyTorch torch.compile bf16 autocast", a16, p16,
                           "compile-autocast")):
    if mode.startswith("compile") and (mode, False) not in torch and (mode, True) not in torch:
        continue
    print(f"| {label} | {ratio(a, torch.get((mode, False)))} | "
          f"{ratio(p, torch.get((mode, True)))} |")

print(f"\nMHA module, B 4 × T 512, E 512, 8 heads, self-attention, biases, no dropout, GFLOP/s "
      f"best (median) (FLOPs as bench_mha.cpp counts them; FP32 FMA peak {peak:.0f} GFLOP/s "
      "measured by bench_mha in the same run):\n")
print("| | attn | PyTorch 2.x `nn.MultiheadAttention` | attn / PyTorch |")
print("|---|---|---|---|")
for name, mode, dt in (("BM_MhaInference", "inference", "float32"),
                       ("BM_MhaTraining", "training", "float32"),
                       ("BM_MhaInferenceBf16", "inference", "bfloat16"),
                       ("BM_MhaTrainingBf16", "training", "bfloat16")):
    a, t = mha.get(name), tmha.get((mode, dt))
    print(f"| {mode} {'fp32' if dt == 'float32' else 'bf16'} | {fmt(a)} | {fmt(t)} | "
          f"{ratio(a, t)} |")
PY
cat "$tmp/block.md"
if (( quick )); then
  echo "run_peers_train.sh --quick: no block written" >&2
else
  python3 bench/write_block.py peers_train "$tmp/block.md" docs/performance.md
  echo "wrote the peers_train block of docs/performance.md" >&2
fi
