#!/usr/bin/env bash
# Runs bench_attention (the fused CPU kernels) and bench/torch_attention.py (PyTorch's unfused
# bmm + softmax + bmm) on the same shapes and thread count, and writes the side-by-side table to
# docs/performance.md. The only writer of that file: numbers there are never typed by hand.
#
#   bench/run_cpu.sh [build_dir] [repetitions]        (default build/default, 5)
#   ATTN_THREADS=2 (default) sets both sides' thread count.
#   ATTN_BENCH_QUICK=1 runs only T = 1024, D = 64 (a smoke test of the script, not for the docs).
#   ATTN_TORCH_SEQ="1024" limits PyTorch to those sequence lengths (its T = 4096 runs take
#   minutes each on a loaded machine); missing PyTorch cells show as "—".
# Needs a quiet machine: the script records the load average before and after, and the spread
# (min / median) of the repetitions, so a noisy run is visible in the table.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
reps=${2:-5}
export ATTN_THREADS=${ATTN_THREADS:-2}
bin="$build/bench/bench_attention"
[[ -x "$bin" ]] || { echo "run_cpu.sh: $bin not built (cmake --build $build --target bench_attention)" >&2; exit 2; }
filter='BM_Flash(Bf16)?(Forward|Backward)/'
torch_shapes=()
if [[ -n "${ATTN_TORCH_SEQ:-}" ]]; then torch_shapes=(--seq ${ATTN_TORCH_SEQ}); fi
if [[ "${ATTN_BENCH_QUICK:-0}" == 1 ]]; then
  filter='BM_Flash(Bf16)?(Forward|Backward)/BH:16/T:1024/D:64/'
  torch_shapes=(--seq 1024 --dims 64)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# An optimised BLAS for PyTorch's bmm without touching the system's libblas.so.3 alternative
# (as bench/run_mha.sh): TORCH_BLAS_DIR, else Debian's OpenBLAS folders when installed.
blas_dir=${TORCH_BLAS_DIR:-}
for d in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  if [[ -z "$blas_dir" && -e "$d/libblas.so.3" ]]; then blas_dir=$d; fi
done
# OpenBLAS 0.3.21 does not know Zen 5; its AVX-512 kernels (SkylakeX) are the fast ones here (as
# bench/run_mha.sh and run_train.sh). TORCH_OPENBLAS_CORETYPE overrides; a login's
# OPENBLAS_CORETYPE (e.g. Haswell) is not inherited.
coretype=${TORCH_OPENBLAS_CORETYPE:-SkylakeX}
torch_ld=${LD_LIBRARY_PATH:-}
if [[ -n "$blas_dir" ]]; then torch_ld="$blas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
"$bin" --benchmark_filter="$filter" --benchmark_repetitions="$reps" --benchmark_min_warmup_time=0.5 \
  --benchmark_format=json --benchmark_out="$tmp/attn.json" --benchmark_out_format=json >/dev/null
# bf16 against fp32 in the same process, alternating (BM_FlashBf16Speedup): the ratio that the
# bf16 target is about, robust to the machine's load.
speed_filter='BM_FlashBf16Speedup/BH:16/T:(1024|4096)/D:(64|128)/causal:0/'
[[ "${ATTN_BENCH_QUICK:-0}" == 1 ]] && speed_filter='BM_FlashBf16Speedup/BH:16/T:1024/D:64/causal:0/'
OMP_WAIT_POLICY=PASSIVE "$bin" --benchmark_filter="$speed_filter" --benchmark_min_time=3 \
  --benchmark_format=json --benchmark_out="$tmp/speed.json" --benchmark_out_format=json >/dev/null
if [[ "${ATTN_BENCH_QUICK:-0}" == 1 ]]; then
  echo '{"benchmarks": []}' >"$tmp/long.json"
else
  "$bin" --benchmark_filter='BM_FlashLong' --benchmark_format=json \
    --benchmark_out="$tmp/long.json" --benchmark_out_format=json >/dev/null
fi
GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
OMP_WAIT_POLICY=PASSIVE OPENBLAS_CORETYPE="$coretype" LD_LIBRARY_PATH="$torch_ld" /usr/bin/python3 bench/torch_attention.py --threads "$ATTN_THREADS" \
  --reps "$reps" "${torch_shapes[@]}" >"$tmp/torch.jsonl"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$tmp" "$load_before" "$load_after" "$reps" "$coretype" >"$tmp/cpu.md" <<'PY'
import json, re, statistics, sys, platform, datetime
tmp, load_before, load_after, reps, coretype = sys.argv[1:6]
attn = json.load(open(f"{tmp}/attn.json"))
long = json.load(open(f"{tmp}/long.json"))
ctx = attn["context"]
peak = float(ctx["fma_peak_GFLOPS"])
runs = {}
for b in attn["benchmarks"]:
    if b.get("run_type") != "iteration":
        continue
    m = re.match(r"BM_Flash(Bf16)?(Forward|Backward)/BH:(\d+)/T:(\d+)/D:(\d+)/causal:(\d)",
                 b["name"])
    key = (m.group(2).lower(), int(m.group(4)), int(m.group(5)), int(m.group(6)),
           "bf16" if m.group(1) else "fp32")
    runs.setdefault(key, []).append((b["GFLOPS"], b["pct_peak"], b["peak_GFLOPS"]))
torch = {}
for line in open(f"{tmp}/torch.jsonl"):
    r = json.loads(line)
    torch[(r["pass"], r["T"], r["D"], r["causal"])] = r
cpu = "?"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
print("# Performance (CPU)\n")
print("Written by `bench/run_cpu.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, "
      f"{ctx['threads']} threads, flash target {ctx['flash_target']}.\n")
peaks = [r[2] for g in runs.values() for r in g]
print(f"- FP32 FMA peak measured in the same run ({ctx['fma_peak_target']}, register-only FMA "
      f"loop, {ctx['threads']} threads): **{peak:.0f} GFLOP/s** at the start; again right after "
      f"each benchmark, {min(peaks):.0f}-{max(peaks):.0f} GFLOP/s (the host's speed drifts). "
      "% of peak divides each repetition by the peak read right after it (the best shown).")
print(f"- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}. "
      f"{reps} repetitions; best and median shown.")
print("- FLOPs: forward 4·BH·T·S·D, backward 2.5× forward, causal halves both (useful FLOPs).")
print("- PyTorch: Debian's 1.13, `bmm + softmax + bmm` (`bench/torch_attention.py`), same "
      "threads, with `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 "
      "OMP_WAIT_POLICY=PASSIVE`; its causal case computes the full square and masks it.")
blas = sorted({r.get("blas", "?") for r in torch.values()})
print(f"- PyTorch's BLAS: {', '.join(blas) or '—'} (OPENBLAS_CORETYPE={coretype})"
      + (" — **the netlib reference BLAS: the PyTorch column is not a meaningful baseline**"
         if any("/blas/" in b for b in blas) else "") + ".\n")
print("| pass | dtype | BH | T=S | D | causal | attn GFLOP/s best (median) | % of peak | PyTorch fp32 GFLOP/s | speed-up |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(runs, key=lambda k: (k[0] != "forward", k[4] != "fp32", k[1], k[2], k[3])):
    pas, T, D, causal, dtype = key
    g = [r[0] for r in runs[key]]
    best, med = max(g), statistics.median(g)
    pct = max(r[1] for r in runs[key])
    t = torch.get(key[:4]) if dtype == "fp32" else None
    tg = f"{t['gflops']:.1f}" if t else "—"
    sp = f"{best / t['gflops']:.2f}×" if t else "—"
    print(f"| {pas} | {dtype} | 16 | {T} | {D} | {'yes' if causal else 'no'} | {best:.1f} ({med:.1f}) | "
          f"{pct:.0f}% | {tg} | {sp} |")
speed = [b for b in json.load(open(f"{tmp}/speed.json"))["benchmarks"]
         if b.get("run_type") == "iteration"]
if speed:
    print("\nbf16 against fp32, the same shapes run alternately in one process "
          "(`BM_FlashBf16Speedup`, medians over iterations; the CPU-time ratio is robust to load). "
          f"Native AVX512-BF16: {'yes' if speed[0]['native_bf16'] else 'no (fp32 fallback)'}.\n")
    print("| pass | T=S | D | fp32 ms | bf16 ms | bf16 speed-up (wall) | (CPU time) |")
    print("|---|---|---|---|---|---|---|")
    for b in speed:
        m = re.search(r"T:(\d+)/D:(\d+)/causal:\d/backward:(\d)", b["name"])
        print(f"| {'backward' if m.group(3) == '1' else 'forward'} | {m.group(1)} | {m.group(2)} | "
              f"{b['fp32_ms']:.1f} | {b['bf16_ms']:.1f} | {b['speedup']:.2f}× | "
              f"{b['speedup_cpu']:.2f}× |")
for b in long["benchmarks"]:
    print(f"\nLong sequence, forward + backward once, BH = 1, T = S = 65536, D = 64: "
          f"{b['real_time']:.1f} s, {b['GFLOPS']:.1f} GFLOP/s "
          f"({b['pct_peak']:.0f}% of the peak read right after it), peak memory beyond inputs and outputs "
          f"{b['extra_MiB']:.0f} MiB.")
PY
# Replace only this script's block of docs/performance.md (bench/run_mha.sh owns another), via a
# temporary file and a rename.
/usr/bin/python3 bench/write_block.py cpu "$tmp/cpu.md" docs/performance.md
echo "wrote the CPU attention block of docs/performance.md"
