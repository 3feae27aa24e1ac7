#!/usr/bin/env bash
# d2l's PyTorch training step with nn.MultiheadAttention vs attn.torch.MultiheadAttention swapped
# in (bench/torch_swap.py: same process, same weights, alternating rounds), at T = 128 (the
# training benchmark's batch) and T = 512. Writes the <!-- torch_swap:begin --> block of
# docs/performance.md.
#
#   bench/run_torch_swap.sh [build_dir] [rounds]        (default build/default, 12)
#   ATTN_THREADS=2 (default) sets the thread count (torch.set_num_threads; attn.torch's fused
#   kernels follow it with one spare thread, python/attn/torch.py's _threads).
#
# Settings as bench/run_train.sh gives PyTorch: OpenBLAS (Debian's default libblas.so.3 is the
# netlib reference BLAS) with OPENBLAS_CORETYPE=SkylakeX unless TORCH_OPENBLAS_CORETYPE says
# otherwise, GLIBC_TUNABLES (no mmap per large temporary), OMP_WAIT_POLICY=PASSIVE. Both sides
# run in one process, so both get them.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-12}
export ATTN_THREADS=${ATTN_THREADS:-2}
ls "$build"/python/attn/_attn*.so >/dev/null 2>&1 ||
  { echo "run_torch_swap.sh: $build/python/attn/_attn*.so not built (-DATTN_BUILD_PYTHON=ON, target _attn)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

blas_dir=${TORCH_BLAS_DIR:-}
for d in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  if [[ -z "$blas_dir" && -e "$d/libblas.so.3" ]]; then blas_dir=$d; fi
done
[[ -n "$blas_dir" ]] || echo "run_torch_swap.sh: no OpenBLAS found; PyTorch will use the default libblas.so.3" >&2
export LD_LIBRARY_PATH="${blas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPENBLAS_CORETYPE=${TORCH_OPENBLAS_CORETYPE:-SkylakeX}
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for T in 128 512; do
  B=$((T == 128 ? 32 : 8))
  /usr/bin/python3 bench/torch_swap.py --threads "$ATTN_THREADS" --rounds "$rounds" \
    --length "$T" --batch "$B" >"$tmp/T$T.json"
  echo "T = $T done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$tmp" "$rounds" "$load_before" "$load_after" "$OPENBLAS_CORETYPE" >"$tmp/swap.md" <<'PY'
import datetime, json, sys
tmp, rounds, load_before, load_after, coretype = sys.argv[1:6]
runs = [json.load(open(f"{tmp}/T{T}.json")) for T in (128, 512)]
cpu = "?"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
print("## d2l's PyTorch training step: nn.MultiheadAttention vs attn.torch.MultiheadAttention\n")
print("Written by `bench/run_torch_swap.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, {runs[0]['threads']} threads "
      f"(torch.set_num_threads; attn.torch's fused kernels {runs[0].get('attn_threads', '?')}: "
      "one spare, docs/python.md).\n")
print("- Model: `bench/torch_train.py`'s (d2l's `TransformerEncoder`, E = 128, 4 heads, 2 blocks, "
      "FFN 256, dropout 0.1, masked-mean head), with each block's attention replaced by "
      "`torch.nn.MultiheadAttention` or `attn.torch.MultiheadAttention` (batch_first, no bias, "
      "valid_lens as key_padding_mask, need_weights=False); half of each batch padded to 3T/4. "
      "One step: forward, cross-entropy, backward, clip_grad_norm(1.0), AdamW. "
      f"`bench/torch_swap.py`: one process, same weights, {rounds} rounds of 0.5 s per side, the "
      "order rotated every round.")
print(f"- PyTorch {runs[0]['torch']}, BLAS {runs[0]['blas']} (`OPENBLAS_CORETYPE={coretype}`); "
      "`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 "
      "OMP_WAIT_POLICY=PASSIVE`.")
print(f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}. Compare the "
      "ratio, not the absolute numbers. Speedup: wall time per step, torch's round over attn's "
      "round of the same round, median over rounds (quartiles and range beside it); CPU time ratio: process CPU time per step (all threads), "
      "torch's median over attn's. Bound: nn.MultiheadAttention's step over the same loop with no "
      "attention at all (each block's attention returns its queries), both medians: the speedup "
      "an attention module that took no time would give (Amdahl).\n")
print("| batch | nn.MultiheadAttention ms/step (median) | attn.torch ms/step (median) | "
      "speedup (median of round pairs) | quartiles (range) | CPU time ratio | "
      "bound (no attention) | eval loss torch / attn |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    s, m, l = r["shape"], r["median_ms"], r["eval_loss"]
    print(f"| B = {s['B']}, T = {s['T']} | {m['torch']:.1f} | {m['attn']:.1f} | "
          f"**{r['speedup_paired_median']:.2f}x** | "
          f"{r['speedup_paired']['q1']:.2f}-{r['speedup_paired']['q3']:.2f} "
          f"({r['speedup_paired']['min']:.2f}-{r['speedup_paired']['max']:.2f}) | "
          f"{r['cpu_ratio_median']:.2f}x | {r['amdahl_bound']:.2f}x "
          f"({r['median_ms']['none']:.1f} ms) | "
          f"{l['torch']:.6f} / {l['attn']:.6f} |")
PY
cat "$tmp/swap.md"
/usr/bin/python3 bench/write_block.py torch_swap "$tmp/swap.md" docs/performance.md
echo "wrote the torch_swap block of docs/performance.md"
