#!/usr/bin/env bash
# Training throughput, attn against PyTorch, side by side: bench_train (model::Trainer steps of
# the encoder classifier) and bench/torch_train.py (the same model in PyTorch 1.13 with d2l's
# code), same shapes, batch and thread count, run in turns (attn, torch, attn, torch, ...) so
# that load from other processes hits both alike. Writes the <!-- train:begin --> block of
# docs/performance.md (the other blocks belong to bench/run_cpu.sh and bench/run_mha.sh).
#
#   bench/run_train.sh [build_dir] [rounds]        (default build/default, 3)
#   ATTN_THREADS=2 (default) sets both sides' thread count.
#
# Both sides run with GLIBC_TUNABLES (no mmap per large temporary) and OMP_WAIT_POLICY=PASSIVE,
# PyTorch's best settings here. PyTorch also gets OpenBLAS (Debian's default libblas.so.3 alternative is the netlib
# reference BLAS, which would make the baseline meaningless): the openblas-pthread folder of
# libopenblas0-pthread goes first on the torch process's LD_LIBRARY_PATH only (TORCH_BLAS_DIR
# overrides). OPENBLAS_CORETYPE picks its kernels: SkylakeX (AVX-512) unless
# TORCH_OPENBLAS_CORETYPE says otherwise; OpenBLAS 0.3.21 does not know Zen 5, and on this
# machine SkylakeX trains 1.3-2x faster than Haswell or Zen (measured side by side). The BLAS torch mapped is printed and
# written to the table.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
rounds=${2:-3}
export ATTN_THREADS=${ATTN_THREADS:-2}
bin="$build/bench/bench_train"
[[ -x "$bin" ]] || { echo "run_train.sh: $bin not built (cmake --build $build --target bench_train)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

blas_dir=${TORCH_BLAS_DIR:-}
for d in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  if [[ -z "$blas_dir" && -e "$d/libblas.so.3" ]]; then blas_dir=$d; fi
done
[[ -n "$blas_dir" ]] || echo "run_train.sh: no OpenBLAS found (apt-get install libopenblas0-pthread); PyTorch will use the default libblas.so.3" >&2
torch_ld=${LD_LIBRARY_PATH:-}
if [[ -n "$blas_dir" ]]; then torch_ld="$blas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
coretype=${TORCH_OPENBLAS_CORETYPE:-SkylakeX}  # not OPENBLAS_CORETYPE: a login may set that

# Both processes get the allocator and OpenMP settings that PyTorch needs for its best: no mmap
# (and page faults) per large temporary, and OpenMP threads that sleep instead of spinning while
# they wait (on a machine shared with other work, spinning threads steal the cores).
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  "$bin" --benchmark_filter='^BM_TrainStep(Bf16|Parts)?/' --benchmark_format=json \
    --benchmark_out="$tmp/attn$r.json" --benchmark_out_format=json >/dev/null
  OPENBLAS_CORETYPE="$coretype" LD_LIBRARY_PATH="$torch_ld" /usr/bin/python3 bench/torch_train.py --threads "$ATTN_THREADS" --reps 1 >"$tmp/torch$r.json"
  OPENBLAS_CORETYPE="$coretype" LD_LIBRARY_PATH="$torch_ld" /usr/bin/python3 bench/torch_train.py --threads "$ATTN_THREADS" --reps 1 --autocast >"$tmp/torchbf$r.json"
  echo "round $r/$rounds done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "PyTorch's BLAS: $(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["blas"])' "$tmp/torch1.json")" >&2

/usr/bin/python3 - "$tmp" "$rounds" "$load_before" "$load_after" "$coretype" >"$tmp/train.md" <<'PY'
import datetime, json, statistics, sys
tmp, rounds, load_before, load_after, coretype = sys.argv[1:6]
rounds = int(rounds)
attn, attn_bf, parts, torch_rates, torch_bf, blas, threads = [], [], {}, [], [], set(), None
for r in range(1, rounds + 1):
    for b in json.load(open(f"{tmp}/attn{r}.json"))["benchmarks"]:
        if b["name"].startswith("BM_TrainStepParts"):
            for k in ("forward_ms", "loss_ms", "backward_ms", "clip_adamw_ms"):
                parts.setdefault(k, []).append(b[k])
        elif b["name"].startswith("BM_TrainStepBf16"):
            attn_bf.append(b["tokens_per_second"])
        elif b["name"].startswith("BM_TrainStep"):
            attn.append(b["tokens_per_second"])
            threads = int(b["threads"])
    t = json.load(open(f"{tmp}/torch{r}.json"))
    torch_rates += t["tokens_per_second"]
    torch_bf += json.load(open(f"{tmp}/torchbf{r}.json"))["tokens_per_second"]
    blas.add(t["blas"])
cpu = "?"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
a_best, a_med = max(attn), statistics.median(attn)
t_best, t_med = max(torch_rates), statistics.median(torch_rates)
print("## Training throughput: encoder classifier, attn vs PyTorch\n")
print("Written by `bench/run_train.sh`; do not edit by hand. "
      f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu}, {threads} threads on both sides.\n")
print("- Model: embedding * sqrt(E) + sinusoidal PE, 2 post-norm encoder blocks (E = 128, 4 heads, "
      "FFN 256), masked-mean classification head (2 classes), vocabulary 1000, dropout 0.1, fp32. "
      "One step: forward, softmax cross-entropy, backward, clip_grad_norm(1.0), AdamW(lr 1e-3). "
      "Batch 32 x 128 tokens (4096 tokens per step), every sequence full length.")
print("- attn: `bench/bench_train.cpp` (`model::Trainer::train_step`). PyTorch: "
      "`bench/torch_train.py`, Debian's 1.13 running d2l's `TransformerEncoder` "
      "(`tests/fixtures/d2l_reference.py`) with the same head, "
      f"`OPENBLAS_CORETYPE={coretype}`. Both with "
      "`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 "
      "OMP_WAIT_POLICY=PASSIVE`.")
ref = any("/blas/" in b or b == "?" for b in blas)
print(f"- PyTorch's BLAS: {'; '.join(sorted(blas))}"
      + (" — **the netlib reference BLAS: the PyTorch column is not a meaningful baseline**"
         if ref else "") + ".")
print(f"- {rounds} rounds, attn and PyTorch in turns; load average (1, 5, 15 min) before: "
      f"{load_before}; after: {load_after}. A loaded machine slows both sides; compare the "
      "ratio, not the absolute numbers.\n")
print("| | tokens/s best | tokens/s median |")
print("|---|---|---|")
print(f"| attn | {a_best:,.0f} | {a_med:,.0f} |")
print(f"| PyTorch 1.13 | {t_best:,.0f} | {t_med:,.0f} |")
print(f"| **attn / PyTorch** | **{a_best / t_best:.2f}x** | **{a_med / t_med:.2f}x** |")
if attn_bf:
    b_best, b_med = max(attn_bf), statistics.median(attn_bf)
    tb_best, tb_med = max(torch_bf), statistics.median(torch_bf)
    print(f"| attn `--precision bf16` (mixed) | {b_best:,.0f} | {b_med:,.0f} |")
    print(f"| PyTorch 1.13 bf16 autocast | {tb_best:,.0f} | {tb_med:,.0f} |")
    print(f"| **attn bf16 / attn fp32** | **{b_best / a_best:.2f}x** | **{b_med / a_med:.2f}x** |")
    print(f"| **attn bf16 / PyTorch fp32** | **{b_best / t_best:.2f}x** | **{b_med / t_med:.2f}x** |")
    print(f"| **attn bf16 / PyTorch bf16 autocast** | **{b_best / tb_best:.2f}x** | "
          f"**{b_med / tb_med:.2f}x** |")
if parts:
    p = {k: statistics.median(v) for k, v in parts.items()}
    total = sum(p.values())
    print(f"\nattn's step by part (median ms): forward {p['forward_ms']:.1f}, loss "
          f"{p['loss_ms']:.2f}, backward {p['backward_ms']:.1f}, clip + AdamW "
          f"{p['clip_adamw_ms']:.1f} (total {total:.1f}).")
PY
cat "$tmp/train.md"
/usr/bin/python3 bench/write_block.py train "$tmp/train.md" docs/performance.md
echo "wrote the training block of docs/performance.md"
