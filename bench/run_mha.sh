#!/usr/bin/env bash
# MultiHeadAttention on the CPU, attn vs PyTorch's nn.MultiheadAttention, side by side, in fp32
# and in bf16 (torch_mha.py --dtype bfloat16 against bench_mha's BM_Mha*Bf16).
#
# Runs bench_mha (Google Benchmark) and bench/torch_mha.py on the same thread count, in
# alternating rounds so that background load hits both alike, and writes the table into
# docs/performance.md between the markers <!-- mha:begin --> and <!-- mha:end --> (only that
# block is replaced; the rest of the file belongs to other benchmarks).
#
#   bench/run_mha.sh [BUILD_DIR]          BUILD_DIR holds bench/bench_mha (default build/bench)
#   env: ATTN_THREADS (2)  ROUNDS (3)  MIN_TIME (seconds per measurement, 1)  OUT (a .md file)
#        LENGTHS ("512 2048": the sequence lengths T)
#        TORCH_BLAS_DIR: a folder with an optimised libblas.so.3 for PyTorch (see below)
#
# PyTorch's settings are its best on this machine (DESIGN.md): glibc malloc never returns big
# blocks to the kernel (no page faults per temporary) and OpenMP threads sleep when idle; both
# sides run with them (sleeping idle threads also make the process CPU time meaningful on a
# shared machine). Debian's python3-torch does its GEMMs through libblas.so.3, which is the
# netlib reference BLAS (~1 GFLOP/s) unless an optimised one is installed; the script uses
# OpenBLAS (Debian's libopenblas0-pthread or -openmp) and refuses to compare against the
# reference BLAS. OpenBLAS 0.3.21 does not know Zen 5 and picks its AVX2 (Haswell) kernels;
# OPENBLAS_CORETYPE=SkylakeX (AVX-512) is faster here (measured ~1.5x on T=512 inference),
# so it is the default (TORCH_OPENBLAS_CORETYPE= to leave OpenBLAS's own choice).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/bench}
bin=$build/bench/bench_mha
threads=${ATTN_THREADS:-2}
rounds=${ROUNDS:-3}
min_time=${MIN_TIME:-1}
out_md=${OUT:-docs/performance.md}
lengths=${LENGTHS:-512 2048}
filter="BM_GemmPeak|/($(echo $lengths | tr ' ' '|'))/"
python=/usr/bin/python3  # Debian's, where python3-torch lives
[ -x "$bin" ] || { echo "run_mha: $bin not found; build the bench_mha target first" >&2; exit 1; }

# An optimised BLAS for PyTorch, without touching the system's libblas.so.3 alternative.
blas_dir=${TORCH_BLAS_DIR:-}
if [ -z "$blas_dir" ]; then
  if readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 | grep -q openblas; then
    blas_dir=system
  else
    for d in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-openmp; do
      [ -e "$d/libblas.so.3" ] && { blas_dir=$d; break; }
    done
  fi
fi
if [ -z "$blas_dir" ]; then
  echo "run_mha: PyTorch would use the reference BLAS; apt-get install libopenblas0-pthread," \
       "or set TORCH_BLAS_DIR to a folder holding an optimised libblas.so.3" >&2
  exit 1
fi
common_env=(GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
            OMP_WAIT_POLICY=PASSIVE)
torch_env=("${common_env[@]}")
coretype=${TORCH_OPENBLAS_CORETYPE-SkylakeX}
[ -n "$coretype" ] && torch_env+=("OPENBLAS_CORETYPE=$coretype")
if [ "$blas_dir" != system ]; then
  torch_env+=("LD_LIBRARY_PATH=$blas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
loads=()
for r in $(seq 1 "$rounds"); do
  loads+=("$(cut -d' ' -f1 /proc/loadavg)")
  echo "run_mha: round $r/$rounds (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  env "${common_env[@]}" ATTN_THREADS="$threads" "$bin" --benchmark_min_time="$min_time" --benchmark_format=json \
    --benchmark_min_warmup_time=0.5 \
    --benchmark_filter="$filter" \
    > "$tmp/ours.$r.json"
  env "${torch_env[@]}" "$python" bench/torch_mha.py --threads "$threads" \
    --min-time "$min_time" --lengths $lengths > "$tmp/torch.$r.jsonl"
  env "${torch_env[@]}" "$python" bench/torch_mha.py --threads "$threads" --dtype bfloat16 \
    --min-time "$min_time" --lengths $lengths > "$tmp/torch_bf16.$r.jsonl"
done
loads+=("$(cut -d' ' -f1 /proc/loadavg)")

"$python" - "$tmp" "$rounds" "$threads" "$out_md" "${loads[*]}" "$blas_dir" "$coretype" <<'EOF'
import json, os, platform, sys, tempfile

tmp, rounds, threads, out_md, loads, blas_dir, coretype = sys.argv[1:8]
rounds = int(rounds)

ours = {}  # benchmark name -> [(wall ms, GFLOP/s, process CPU ms) per round]
fma_peak = 0.0
for r in range(1, rounds + 1):
    run = json.load(open(f"{tmp}/ours.{r}.json"))
    fma_peak = max(fma_peak, float(run["context"].get("fma_peak_GFLOPS", 0)))
    for b in run["benchmarks"]:
        name = b["name"].replace("/process_time", "").replace("/real_time", "")
        ours.setdefault(name, []).append((b["real_time"], b["GFLOP"], b["cpu_time"]))
torch = {}  # (mode, T) -> [(wall ms, GFLOP/s, process CPU ms)] (best of each round)
torch_bf16 = {}  # the same for nn.MultiheadAttention(...).to(torch.bfloat16)
torch_version = "?"
torch_blas = set()  # the libblas / OpenBLAS file the torch process really mapped
for r in range(1, rounds + 1):
    for path, into in ((f"{tmp}/torch.{r}.jsonl", torch), (f"{tmp}/torch_bf16.{r}.jsonl", torch_bf16)):
        for line in open(path):
            d = json.loads(line)
            torch_version = d["torch"]
            torch_blas.add(os.path.basename(d.get("blas", "?")))
            into.setdefault((d["mode"], d["T"]), []).append(
                (d["ms_min"], d["gflops_best"], d["cpu_ms_min"]))

def best(samples):  # the fastest round: least disturbed by the shared machine
    return min(samples, key=lambda s: s[0])

def spread(samples):  # (slowest - fastest) / fastest, in percent
    ms = [s[0] for s in samples]
    return 100.0 * (max(ms) - min(ms)) / min(ms)

cpu = "?"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
family = next((l.split(":")[1].strip() for l in open("/proc/cpuinfo")
               if l.startswith("cpu family")), "?")

rows = []
for mode, name in (("inference", "BM_MhaInference"), ("training", "BM_MhaTraining")):
    for T in (512, 2048):
        o = ours.get(f"{name}/{T}")
        t = torch.get((mode, T))
        if not o or not t:
            continue
        ob, tb = best(o), best(t)
        oc, tc = min(s[2] for s in o), min(s[2] for s in t)
        rows.append(f"| {mode} | {T} | {ob[0]:.1f} | {ob[1]:.1f} | {tb[0]:.1f} | {tb[1]:.1f} | "
                    f"**{tb[0] / ob[0]:.2f}x** | {oc:.0f} / {tc:.0f} ({tc / oc:.2f}x) | "
                    f"{spread(o):.0f}% / {spread(t):.0f}% |")

# bf16: attn bf16 vs PyTorch bf16, with both fp32 runs of the same rounds beside them.
rows_bf16 = []
for mode, name in (("inference", "BM_MhaInference"), ("training", "BM_MhaTraining")):
    for T in (512, 2048):
        o, o32 = ours.get(f"{name}Bf16/{T}"), ours.get(f"{name}/{T}")
        t, t32 = torch_bf16.get((mode, T)), torch.get((mode, T))
        if not o or not t or not o32 or not t32:
            continue
        ob, tb, o32b, t32b = best(o), best(t), best(o32), best(t32)
        oc, tc = min(s[2] for s in o), min(s[2] for s in t)
        rows_bf16.append(
            f"| {mode} | {T} | {ob[0]:.1f} | {ob[1]:.1f} | {o32b[0]:.1f} | {tb[0]:.1f} | "
            f"{t32b[0]:.1f} | **{tb[0] / ob[0]:.2f}x** | {o32b[0] / ob[0]:.2f}x | "
            f"{oc:.0f} / {tc:.0f} ({tc / oc:.2f}x) | {spread(o):.0f}% / {spread(t):.0f}% |")

parts = []
labels = {
    "BM_ProjectionForward": "one projection, forward (x W^T + b)",
    "BM_ProjectionBackward": "one projection, backward (dx, dW, db)",
    "BM_ProjectionQkvForward": "packed [W_q; W_k; W_v] projection, forward",
    "BM_AttentionCoreForward": "attention core, forward (B*H, T, D)",
    "BM_AttentionCoreBackward": "attention core, backward",
    "BM_AttentionHeadsForward": "attention core on the (B, T, 3E) projection, head strides, forward",
    "BM_AttentionHeadsBackward": "attention core, head strides, backward (into (B, T, 3E))",
    "BM_ProjectionQkvForwardBf16": "bf16 packed projection, forward (f32 accumulation, one rounding)",
    "BM_ProjectionBackwardBf16": "bf16 one projection, backward",
    "BM_AttentionCoreForwardBf16": "bf16 attention core, forward (B*H, T, D)",
    "BM_AttentionCoreBackwardBf16": "bf16 attention core, backward",
}
for key, label in labels.items():
    for T in (512, 2048):
        o = ours.get(f"{key}/{T}")
        if o:
            ob = best(o)
            oc = min(s[2] for s in o)
            parts.append(f"| {label} | {T} | {ob[0]:.2f} | {ob[1]:.1f} | {oc:.2f} | "
                         f"{spread(o):.0f}% |")
peak = ours.get("BM_GemmPeak/2048")
peak_line = (f"Peaks measured in the same runs ({threads} threads, best round): register-only FMA "
             f"loop {fma_peak:.0f} GFLOP/s; oneDNN f32 GEMM 2048^3 {best(peak)[1]:.0f} GFLOP/s."
             if peak else "")

# Where the time of one MHA call goes, from the parts: 4 projections + the core. In process CPU
# time (least over the rounds), which other processes on the machine disturb far less than
# wall time; the parts ran in separate benchmarks, so the split is an estimate.
def cpu_ms(key):
    return min(s[2] for s in ours[key])

split = []
for mode, name in (("inference", "BM_MhaInference"), ("training", "BM_MhaTraining")):
    for T in (512, 2048):
        if not ours.get(f"{name}/{T}"):
            continue
        # What MultiHeadAttention runs: the packed Q/K/V projection + W_o, and the head-strided
        # core; the training step adds the backward of 4 projections' worth of GEMMs (the packed
        # one is 3 of them in one call) and the core's backward.
        proj = cpu_ms(f"BM_ProjectionQkvForward/{T}") + cpu_ms(f"BM_ProjectionForward/{T}")
        core = cpu_ms(f"BM_AttentionHeadsForward/{T}")
        if mode == "training":
            proj += 4 * cpu_ms(f"BM_ProjectionBackward/{T}")
            core += cpu_ms(f"BM_AttentionHeadsBackward/{T}")
        tot = cpu_ms(f"{name}/{T}")
        rest = tot - proj - core
        split.append(f"| {mode} | {T} | {tot:.1f} | {proj:.1f} ({100 * proj / tot:.0f}%) | "
                     f"{core:.1f} ({100 * core / tot:.0f}%) | {rest:.1f} ({100 * rest / tot:.0f}%) |")

blas = "system libblas.so.3 (OpenBLAS)" if blas_dir == "system" else f"OpenBLAS from {os.path.basename(blas_dir)}"
blas += f", mapped: {', '.join(sorted(torch_blas))}"
if coretype:
    blas += f", OPENBLAS_CORETYPE={coretype}"
if any("openblas" not in b for b in torch_blas):
    sys.exit(f"run_mha: PyTorch mapped {torch_blas}, not OpenBLAS: its numbers would be invalid")
block = f"""<!-- mha:begin -->
## MultiHeadAttention: attn vs PyTorch nn.MultiheadAttention (CPU)

Written by `bench/run_mha.sh` (do not edit by hand). B = 4, E = 512, H = 8 (D = 64),
self-attention X (B, T, E), T = S, projections with bias, fp32, {threads} threads, no dropout,
**need_weights = False on both sides** (attn's `mha.attention.need_weights = false`: the fused
kernel on the projections' layout; d2l's default `true` keeps the (B*H, T, S) weights and runs
the reference kernel), the training step returns dX as one tensor on both sides
(`self_attention_input_grad`, PyTorch's `x.grad`).
GFLOP/s count projections 2·rows·E·E each (4 of them) plus attention 4·B·H·T·S·D; a training
step (forward + backward wrt parameters and input) counts 3x the projections + 3.5x attention.
PyTorch {torch_version} (Debian, {blas}), eval + no_grad for inference; attn with
`Backend::kAuto`. Both with PyTorch's best settings (GLIBC_TUNABLES mmap_max=0,
trim_threshold=64 GiB, OMP_WAIT_POLICY=PASSIVE). Wall time: best of {rounds} alternating
rounds (the speedup column); both sides warm up first (primitive creation, first touch of
buffers). CPU ms: process CPU time per step, all threads, least of the
rounds: on a loaded machine it still measures the work each side does, but it does not
reward parallel efficiency. Spread = (slowest - fastest) / fastest wall time over the rounds,
attn / PyTorch. CPU: {cpu} (family {family}), {platform.machine()}; 1-min load average at each
round and at the end: {loads} (2 cores; > 2 means other processes competed).

| mode | T | attn ms | attn GFLOP/s | PyTorch ms | PyTorch GFLOP/s | speedup | CPU ms attn / PyTorch | spread |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Where attn's time goes, in process CPU ms (all threads; the parts timed alone on the same
shapes, so an estimate; "rest" = packing [W_q; W_k; W_v], page faults of fresh outputs, bias
and gradient accumulation, the scheduler; the head split/merge copies are gone):

| mode | T | total CPU ms | projections | attention core | rest |
|---|---|---|---|---|---|
{chr(10).join(split)}

bfloat16, same shapes, settings and rounds: attn's `MultiHeadAttention(..., DType::BF16)` (bf16
GEMMs accumulating in f32 with one rounding per output, the bf16 attention kernels on head
copies) vs PyTorch's `nn.MultiheadAttention(...).to(torch.bfloat16)` (oneDNN bf16 linear layers
inside PyTorch); the fp32 columns repeat the table above. Speedup = PyTorch bf16 / attn bf16
wall time; attn bf16 vs fp32 = attn fp32 / attn bf16.

| mode | T | attn bf16 ms | attn bf16 GFLOP/s | attn fp32 ms | PyTorch bf16 ms | PyTorch fp32 ms | speedup (bf16) | attn bf16 vs fp32 | CPU ms attn / PyTorch (bf16) | spread (bf16) |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows_bf16)}

| part | T | wall ms | GFLOP/s (wall) | CPU ms | spread |
|---|---|---|---|---|---|
{chr(10).join(parts)}

{peak_line}
<!-- mha:end -->"""

# bench/write_block.py: replace only this script's block, atomically.
sys.path.insert(0, "bench")
from write_block import write_block
write_block("mha", block.removeprefix("<!-- mha:begin -->\n").removesuffix("\n<!-- mha:end -->"),
            out_md)
print(block)
EOF
