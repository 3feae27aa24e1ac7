#!/usr/bin/env bash
# Attention kernels, attn against the peers users run today (from PyPI, bench/peers-venv.sh):
# PyTorch 2.x F.scaled_dot_product_attention, ONNX Runtime's com.microsoft MultiHeadAttention
# and OpenVINO's ScaledDotProductAttention, at the same shapes, dtype and thread count, engine
# after engine in each round (the order rotates per round) so that load from other processes
# hits all alike. One process per engine and round: bench/peers_attention.py (attn runs in
# Debian's python3 with attn.torch; the peers in the venv). Writes the <!-- peers_attention -->
# block of docs/performance.md: the table at ATTN_THREADS and a thread sweep 1, 2, 4, ... up to
# the machine's cores (issue 24's layout), with the FP32 FMA peak measured in the same run.
#
#   bench/run_peers_attention.sh [--quick] [build_dir] [rounds]   (default build/default, 2)
#   ATTN_THREADS=2 (default): the main table's threads. --quick: short shapes and T=1024 only,
#   one round, short timings (a smoke test; it writes no block, only prints).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == --quick ]]; then quick=1; shift; fi
build=${1:-build/default}
rounds=${2:-2}
threads=${ATTN_THREADS:-2}
attn_bin="$build/attn"
[[ -x "$attn_bin" ]] || { echo "run_peers_attention.sh: $attn_bin not built (--target attn_cli)" >&2; exit 2; }
ls "$build"/python/attn/_attn*.so >/dev/null 2>&1 ||
  { echo "run_peers_attention.sh: the Python module is not built (--target _attn)" >&2; exit 2; }
py=$(bench/peers-venv.sh | tail -n1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Every engine gets PyTorch's best allocator and OpenMP settings (no mmap per large temporary;
# sleeping, not spinning, OpenMP waiters on a shared machine), as in bench/run_cpu.sh.
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE

# pass:dtype:B:H:T:D:mask (bench/peers_attention.py)
main=()
shapes=("32:4:128:32" "4:4:1024:64" "4:4:1024:128" "1:4:4096:64" "1:1:8192:128")
(( quick )) && shapes=("32:4:128:32" "4:4:1024:64")
for s in "${shapes[@]}"; do
  for p in forward backward; do
    for d in fp32 bf16; do
      for m in none pad; do main+=("$p:$d:$s:$m"); done
    done
  done
done
sweep=()
for p in forward backward; do for d in fp32 bf16; do sweep+=("$p:$d:4:4:1024:64:none"); done; done
cores=$(nproc)
sweep_threads=()
for ((t = 1; t < cores; t *= 2)); do sweep_threads+=("$t"); done
sweep_threads+=("$cores")
min_time=0.4
if (( quick )); then rounds=1; min_time=0.1; fi

engines=(attn torch ort ov)
run_engine() {  # engine threads cases...
  local e=$1 t=$2; shift 2
  if [[ $e == attn ]]; then
    PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 bench/peers_attention.py \
      --engine attn --threads "$t" --min-time "$min_time" "$@"
  else
    "$py" bench/peers_attention.py --engine "$e" --threads "$t" --min-time "$min_time" "$@"
  fi
}
peak_reading() {  # threads: three readings (the highest counts), before and after each batch
  for _ in 1 2 3; do
    python3 -c "import sys; sys.path.insert(0, 'bench'); import json, peers_common as c; \
print(json.dumps({'peak': c.fma_peak('$attn_bin', $1), 'threads': $1}))" >>"$tmp/peaks.jsonl"
  done
}
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 0; r < rounds; r++)); do
  for t in "$threads" "${sweep_threads[@]}"; do
    if [[ $t == "$threads" ]]; then cases=("${main[@]}"); else cases=("${sweep[@]}"); fi
    # The sweep's row at the main thread count comes from the main table's runs.
    if [[ $t == "$threads" && -e "$tmp/main_done$r" ]]; then continue; fi
    peak_reading "$t"
    for ((i = 0; i < ${#engines[@]}; i++)); do
      e=${engines[$(((i + r) % ${#engines[@]}))]}
      run_engine "$e" "$t" "${cases[@]}" >>"$tmp/rows.jsonl"
    done
    peak_reading "$t"
    [[ $t == "$threads" ]] && touch "$tmp/main_done$r"
    echo "round $((r + 1))/$rounds, $t threads done" >&2
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$tmp" "$threads" "$rounds" "$load_before" "$load_after" "${sweep_threads[*]}" \
  >"$tmp/block.md" <<'PY'
import datetime, statistics, sys
sys.path.insert(0, "bench")
import peers_common as pc
tmp, threads, rounds, load_before, load_after, sweep = sys.argv[1:7]
threads, rounds, sweep = int(threads), int(rounds), [int(t) for t in sweep.split()]
rows = pc.read_jsonl(f"{tmp}/rows.jsonl")
peaks = {}
for p in pc.read_jsonl(f"{tmp}/peaks.jsonl"):
    peaks.setdefault(p["threads"], []).append(p["peak"])
peak = {t: max(v) for t, v in peaks.items()}
res, versions, skipped = {}, {}, {}
for r in rows:
    versions[r["engine"]] = r["version"]
    key = (r["engine"], r["threads"], r["case"])
    if "skipped" in r:
        skipped[key] = r["skipped"]
    else:
        res.setdefault(key, []).append(r)
names = {"attn": "attn", "torch": "PyTorch", "ort": "ONNX Runtime", "ov": "OpenVINO"}


def cell(engine, t, case, pct=False):
    got = res.get((engine, t, case))
    if not got:
        return "—"
    best = max(g["best_gflops"] for g in got)
    med = statistics.median(g["gflops"] for g in got)
    s = f"{best:.0f} ({med:.0f})"
    if pct:
        s += f" {100 * best / peak[t]:.0f}%"
    return s


def best(engine, t, case):
    got = res.get((engine, t, case))
    return max(g["best_gflops"] for g in got) if got else None


print("## Attention: attn against PyTorch 2.x, ONNX Runtime and OpenVINO (PyPI)\n")
print(f"Written by `bench/run_peers_attention.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {pc.cpu_model()}, {threads} threads "
      "for every engine in the first table.\n")
print(f"- Versions: attn {versions.get('attn', '?')}; PyTorch {versions.get('torch', '?')} "
      f"(PyPI wheel, CPU kernels); ONNX Runtime {versions.get('ort', '?')}; OpenVINO "
      f"{versions.get('ov', '?')}. {pc.amx_line()}.")
print("- attn: `attn.torch.scaled_dot_product_attention` (the fused kernels; Debian's PyTorch "
      "1.13 tensors, `attn.default_context.threads` = the thread count). PyTorch 2.x: "
      "`F.scaled_dot_product_attention`, padding as a (B, 1, 1, S) bool `attn_mask`. ONNX "
      "Runtime: one `com.microsoft` MultiHeadAttention node (q, k, v as (B, T, H·D), "
      "`key_padding_mask` (B, S)); fp32 forward only. OpenVINO: one opset13 "
      "ScaledDotProductAttention node, `INFERENCE_PRECISION_HINT` f32 or bf16 (f32 in and out); "
      "forward only. Script: `bench/peers_attention.py`.")
print("- q, k, v (B, H, T, D), T = S, uniform [-1, 1). mask `pad`: key length per batch row "
      "uniform in [T/2, T] (d2l's valid_lens, seeded, the same for every engine). FLOPs: "
      "4·H·T·(sum of kept keys)·D forward (4·BH·T·S·D unmasked), backward 2.5× forward; the "
      "backward is timed alone (after an untimed forward).")
print(f"- GFLOP/s best (median) over {rounds} round(s), engines in turns (order rotating); "
      "% = attn's best over the FP32 FMA peak attn measured at that thread count in the same "
      "run (" + ", ".join(f"{t} thr: {p:.0f} GFLOP/s" for t, p in sorted(peak.items())) +
      f"). Load average before: {load_before}; after: {load_after}; compare ratios, not the "
      "absolute numbers.\n")
print("| pass | dtype | B×H | T=S | D | mask | attn (% of peak) | PyTorch 2.x | ONNX Runtime | "
      "OpenVINO | attn / best peer |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
cases = []
for r in rows:
    if r["threads"] == threads and r["case"] not in cases:
        cases.append(r["case"])
order = {"forward": 0, "backward": 1}
cases.sort(key=lambda c: (order[c.split(":")[0]], c.split(":")[1] != "fp32",
                          int(c.split(":")[4]), int(c.split(":")[5]), c.split(":")[6]))
for case in cases:
    p, d, B, H, T, D, m = case.split(":")
    a = best("attn", threads, case)
    peer = [b for b in (best(e, threads, case) for e in ("torch", "ort", "ov")) if b]
    ratio = f"**{a / max(peer):.2f}×**" if a and peer else "—"
    print(f"| {p} | {d} | {int(B) * int(H)} | {T} | {D} | {m} | {cell('attn', threads, case, True)} | "
          f"{cell('torch', threads, case)} | {cell('ort', threads, case)} | "
          f"{cell('ov', threads, case)} | {ratio} |")
reasons = sorted({v for (e, t, c), v in skipped.items()})
if reasons:
    print("\n— : " + "; ".join(reasons) + ".")

print(f"\n### Thread sweep (issue 24's layout): B×H = 16, T = S = 1024, D = 64, no mask, GFLOP/s best\n")
print("| | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in sweep) + " |")
print("|---|" + "---|" * len(sweep))
for e, d, p, pct in (("attn", "fp32", "forward", True), ("attn", "fp32", "backward", True),
                     ("attn", "bf16", "forward", False), ("attn", "bf16", "backward", False)):
    case = f"{p}:{d}:4:4:1024:64:none"
    cells = []
    for t in sweep:
        b = best(e, t, case)
        cells.append("—" if b is None else
                     f"{b:.0f} ({100 * b / peak[t]:.0f}%)" if pct else f"{b:.0f}")
    print(f"| attn {d} {p}{' (% of FMA peak)' if pct else ''} | " + " | ".join(cells) + " |")
for e, d in (("torch", "fp32"), ("torch", "bf16")):
    cells = []
    for t in sweep:
        f, b = (best(e, t, f"{p}:{d}:4:4:1024:64:none") for p in ("forward", "backward"))
        cells.append(f"{f:.0f} / {b:.0f}" if f and b else "—")
    print(f"| PyTorch {versions.get('torch', '?').split('+')[0]} SDPA {d} fwd / bwd | "
          + " | ".join(cells) + " |")
for e, d in (("ort", "fp32"), ("ov", "fp32"), ("ov", "bf16")):
    cells = []
    for t in sweep:
        b = best(e, t, f"forward:{d}:4:4:1024:64:none")
        cells.append(f"{b:.0f}" if b else "—")
    print(f"| {names[e]} {versions.get(e, '?')} {d} fwd | " + " | ".join(cells) + " |")
print("\nFMA peak per thread count (GFLOP/s, the highest read in the run): "
      + ", ".join(f"{t}: {p:.0f}" for t, p in sorted(peak.items())) + ".")
over = [r for r in rows if r["engine"] == "attn" and "best_gflops" in r
        and r["best_gflops"] > peak[r["threads"]]]
if over:
    print(f"\n{len(over)} of attn's figures exceed the FP32 peak: bf16 can (its dot products do "
          "more than one FMA's work per instruction); fp32 ones above 100% mean that every peak "
          "reading of the run was taken while other processes held the cores (see the load "
          "average), so for this run the ratio columns are the meaningful ones.")
PY
cat "$tmp/block.md"
if (( quick )); then
  echo "run_peers_attention.sh --quick: no block written" >&2
else
  python3 bench/write_block.py peers_attention "$tmp/block.md" docs/performance.md
  echo "wrote the peers_attention block of docs/performance.md" >&2
fi
