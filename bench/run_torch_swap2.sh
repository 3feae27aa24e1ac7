#!/usr/bin/env bash
# d2l's training step under PyTorch 2.x, eager and torch.compile'd: nn.MultiheadAttention (torch's
# fused CPU attention) vs attn.torch.MultiheadAttention (bench/torch_swap2.py), at T = 128
# (B = 32) and T = 512 (B = 8), fp32 and bf16 autocast. Writes the <!-- torch_swap2:begin -->
# block of docs/python.md.
#
#   bench/run_torch_swap2.sh [rounds]          (default 8)
#   ATTN_THREADS=2 (default): torch.set_num_threads; attn.torch's fused kernels follow it with
#   one spare thread (python/attn/torch.py's _threads).
#   ATTN_BENCH_VENV (default build/torch2-venv): the venv, made on first use: this checkout's
#   wheel (pip install .), NumPy 2.x, torch 2.15 (scripts/pip-torch.sh). ATTN_BENCH_REINSTALL=1
#   reinstalls attn from the checkout.
#
# Environment as bench/run_torch_swap.sh gives PyTorch, less the OpenBLAS choice (PyPI's torch
# carries its own BLAS): GLIBC_TUNABLES (no mmap per large temporary), OMP_WAIT_POLICY=PASSIVE.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-8}
export ATTN_THREADS=${ATTN_THREADS:-2}
venv=${ATTN_BENCH_VENV:-build/torch2-venv}
source scripts/ccache-env.sh
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip -q install "numpy>=2"
  bash scripts/pip-torch.sh "$venv"
  ATTN_BENCH_REINSTALL=1
fi
if [ "${ATTN_BENCH_REINSTALL:-0}" = 1 ]; then
  "$venv/bin/python" -m pip -q install --force-reinstall --no-deps .
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for T in 128 512; do
  B=$((T == 128 ? 32 : 8))
  for precision in fp32 bf16; do
    (cd "$tmp" && "$venv/bin/python" "$OLDPWD/bench/torch_swap2.py" --threads "$ATTN_THREADS" \
      --rounds "$rounds" --length "$T" --batch "$B" --precision "$precision" \
      >"$tmp/T${T}_$precision.json" 2>"$tmp/T${T}_$precision.err") ||
      { tail -20 "$tmp/T${T}_$precision.err"; exit 1; }
    echo "T = $T $precision done" >&2
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

"$venv/bin/python" - "$tmp" "$rounds" "$load_before" "$load_after" >"$tmp/swap.md" <<'PY'
import datetime, json, sys
tmp, rounds, load_before, load_after = sys.argv[1:5]
runs = [json.load(open(f"{tmp}/T{T}_{p}.json")) for T in (128, 512) for p in ("fp32", "bf16")]
cpu = "?"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
r0 = runs[0]
print("### d2l's training step under PyTorch 2.x, eager and compiled\n")
print("Written by `bench/run_torch_swap2.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, {r0['threads']} threads, "
      f"PyTorch {r0['torch']}, {rounds} rounds of {r0['min_time']} s per side, the order of the "
      "four sides rotated every round. Load average (1, 5, 15 min) before: "
      f"{load_before}; after: {load_after}. Speedup: torch's step time over attn's in the same "
      "round (eager with eager, compiled with compiled), median over rounds, quartiles beside it; "
      "above 1 attn is faster. Graph breaks: `torch._dynamo.explain` of each model.\n")
print("| batch | precision | torch eager ms | attn eager ms | eager speedup (quartiles) | "
      "torch compiled ms | attn compiled ms | compiled speedup (quartiles) | graph breaks torch / attn |")
print("|---|---|---|---|---|---|---|---|---|")
for r in runs:
    s, m, sp, gb = r["shape"], r["median_ms"], r["speedup_paired"], r["graph_breaks"]
    cell = lambda k: f"**{sp[k]['median']:.2f}x** ({sp[k]['q1']:.2f}-{sp[k]['q3']:.2f})"  # noqa
    print(f"| B = {s['B']}, T = {s['T']} | {r['precision']} | {m['torch_eager']:.1f} | "
          f"{m['attn_eager']:.1f} | {cell('eager')} | {m['torch_compiled']:.1f} | "
          f"{m['attn_compiled']:.1f} | {cell('compiled')} | "
          f"{gb['torch']['graph_breaks']} / {gb['attn']['graph_breaks']} |")
PY
cat "$tmp/swap.md"
/usr/bin/python3 bench/write_block.py torch_swap2 "$tmp/swap.md" docs/python.md
echo "wrote the torch_swap2 block of docs/python.md"
