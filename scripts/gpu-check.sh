#!/usr/bin/env bash
# The GPU check of the CUDA backend (docs/gpu.md): one short run on a GPU machine verifies and
# times everything.
#
#   scripts/gpu-check.sh build        on a machine of the CI kind (nvcc, no GPU needed): builds the
#                                     CUDA tests, bench_cuda and the attn CLI (build/cuda) and
#                                     bundles them with the Debian libraries they need into
#                                     build/gpu-check (< 50 MB)
#   scripts/gpu-check.sh run [--quick]  on the GPU machine, from the repository root, with
#                                     build/gpu-check carried there: every GPU test (every failure
#                                     reported, none stops the run), compute-sanitizer memcheck on
#                                     a small subset, `attn train --device cuda` resumed on the
#                                     CPU, bench_cuda beside PyTorch (SDPA, the training step), one
#                                     table.
#                                     Section 5 sweeps the host CPU's attention by threads
#                                     (GPU_CHECK_SKIP_THREADS=1 skips it); section 6 runs the CPU
#                                     GEMM tests there (AVX-512 + AMX) and times the training step
#                                     beside PyTorch (GPU_CHECK_CPU_THREADS, default 2); section 7
#                                     A/Bs the f32 products' kernel and the attention kernels'
#                                     flush of subnormals there (GPU_CHECK_SKIP_AB=1 skips it);
#                                     section 8 samples where the CPU step, `attn train` and
#                                     `attn translate` spend their time there
#                                     (bench/sample_prof.cpp: no perf there). GPU_CHECK_SKIP_CPU=1
#                                     skips sections 6 to 8 (a GPU-only run).
#                                     Results also go to $OUT (the device tool's folder) if set.
#   scripts/gpu-check.sh cpu          sections 6 to 8 alone (any machine with the bundle and
#                                     PyTorch)
#   scripts/gpu-check.sh profile      section 8 alone
#
# The GPU machine has the NVIDIA driver, the CUDA 13 toolkit (cuBLASLt comes from there: 500 MB
# is too much to carry) and PyTorch 2.x, but none of Debian's packages.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
bundle=build/gpu-check

build() {
  set -e
  source scripts/ccache-env.sh
  cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_WERROR=ON \
    -DATTN_WITH_CUDA=ON -DATTN_WITH_MPI=ON -DATTN_BUILD_TESTS=ON -DATTN_BUILD_CLI=ON \
    -DATTN_BUILD_BENCH=ON -DATTN_BUILD_PYTHON=OFF -DATTN_DEBUG_INFO=ON -DATTN_PCH=OFF >/dev/null
  # bench_train and the OpenMP trace for section 6 (the host's CPU), beside the CUDA binaries.
  cmake --build build/cuda --target attn_cuda_tests bench_cuda attn bench_train attn_omp_trace \
    attn_sample_prof test_kernels_matmul_cpu
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/lib-fallback"
  find build/cuda/tests/cuda -maxdepth 1 -type f -executable -name 'test_cuda_*' \
    -exec cp {} "$bundle/bin/" \;
  cp build/cuda/bench_cuda build/cuda/attn build/cuda/bench/bench_train \
    build/cuda/tests/test_kernels_matmul_cpu "$bundle/bin/"
  strip --strip-debug "$bundle"/bin/*
  # Preloaded, not linked: the loop below would not find it.
  cp build/cuda/bench/libattn_omp_trace.so build/cuda/bench/libattn_sample_prof.so "$bundle/lib/"
  # Every shared library the binaries load, except glibc's own (the GPU machine's glibc is newer)
  # and the CUDA toolkit's large libraries (the GPU machine has the same CUDA 13 toolkit).
  for bin in "$bundle"/bin/*; do
    ldd "$bin" | awk '$3 ~ /^\// {print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*) ;;
      libcublas*|libcudnn*|libnccl*) ;;
      # The C++ runtime only as a fallback: a newer system copy must win, or PyTorch and
      # compute-sanitizer, which need newer symbol versions, would load this one.
      libstdc++.so.*|libgcc_s.so.*) cp -L "$lib" "$bundle/lib-fallback/" ;;
      *) cp -L "$lib" "$bundle/lib/" ;;
    esac
  done
  # Large libraries (oneDNN: ~38 MB) and binaries travel xz-compressed; `run` unpacks them
  # (test_cuda_host stays as it is: `run` looks for it first).
  find "$bundle/lib" -type f -size +8M -exec xz -T2 -6 {} \;
  find "$bundle/bin" -type f -size +3M ! -name test_cuda_host -exec xz -T2 -6 {} \;
  local size
  size=$(du -sm "$bundle" | cut -f1)
  echo "bundle $bundle: ${size} MB"
  ls "$bundle/bin" "$bundle/lib" "$bundle/lib-fallback"
  if [ "$size" -gt 50 ]; then
    echo "gpu-check: the bundle is over 50 MB" >&2
    exit 1
  fi
}

# The bundle's libraries on LD_LIBRARY_PATH (the machine's own kept in orig_ld, for PyTorch),
# cuBLASLt found, the large libraries unpacked; prints the GPU and the host CPU.
setup() {
  # cuBLASLt from the toolkit, or else from PyTorch's wheels (nvidia/cu13/lib or nvidia/cublas/lib).
  local cublas_dir=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublasLt.so.13" ] && { cublas_dir=$d; break; }
  done
  if [ -z "$cublas_dir" ]; then
    cublas_dir=$(dirname "$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
  fi
  echo "cuBLASLt from: ${cublas_dir:-(not found)}"
  for packed in "$bundle"/lib/*.xz "$bundle"/bin/*.xz; do
    [ -e "$packed" ] || continue
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[1][:-3], "wb") as o:
    shutil.copyfileobj(f, o)' "$packed" && rm -f "$packed"
    case "$packed" in */bin/*) chmod +x "${packed%.xz}" ;; esac
  done
  local libs="$PWD/$bundle/lib:${cublas_dir}"
  # The binaries need GLIBCXX_3.4.29 (GCC 11); an older system C++ runtime gets the bundled one.
  local sys_cxx
  sys_cxx=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  if [ -z "$sys_cxx" ] || ! grep -qa 'GLIBCXX_3\.4\.29' "$sys_cxx"; then
    libs="$libs:$PWD/$bundle/lib-fallback"
    echo "(system libstdc++ too old or missing: using the bundled one)"
  fi
  orig_ld=${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH="$libs${orig_ld:+:$orig_ld}"
  nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
  echo "host: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs ($(lscpu | sed -n 's/^Thread(s) per core: *//p' | head -1) threads a core)$(grep -qw amx_bf16 /proc/cpuinfo && echo ', AMX-BF16')"
}

# Section 5: attn's fused attention on the host's CPU by threads (issue 24's scaling).
thread_sweep() {
  local out=$1
  echo "== 5. the host's CPU (issue 24): attn's fused attention, B*H=16, T=S=1024, D=64, by threads"
  : >"$out/cpu_threads.jsonl"
  local threads_list="1 2 4 8 $(nproc)"
  for dtype in f32 bf16; do
    for pass in "" --backward; do
      for t in $threads_list; do
        timeout 30 "$bundle/bin/attn" bench attention --batch-heads 16 --queries 1024 \
          --head-dim 64 --dtype "$dtype" $pass --threads "$t" --repeats 3 \
          --warmup-seconds 0.2 --json 2>/dev/null | python3 -c \
          'import json, sys; print(json.dumps(json.load(sys.stdin)))' >>"$out/cpu_threads.jsonl"
      done
    done
  done
  python3 - "$out/cpu_threads.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
threads = sorted({r["threads"] for r in rows})
print("GFLOP/s (x the 1-thread rate)   " + "".join(f"{t:>16}" for t in threads))
for dtype in ("f32", "bf16"):
    for p in ("forward", "backward"):
        got = {r["threads"]: r["gflops"] for r in rows if r["dtype"] == dtype and r["pass"] == p}
        one = got.get(1)
        cells = "".join(f"{got[t]:>8.0f} ({got[t] / one:4.1f}x)" if t in got and one else f"{'-':>16}"
                        for t in threads)
        print(f"{dtype:5} {p:24} {cells}")
PY
}

# Section 6: the d2l encoder's training step on the host's CPU at GPU_CHECK_CPU_THREADS threads
# (default 2, as issue 23's targets): bench_train beside PyTorch's eager and bf16 autocast step
# (bench/peers_train.py with the machine's PyTorch), full length and padded; `attn train` on
# padded batches (the CLI's own loop, --bucket 1 and the default 8; 200 steps: the whole run's rate
# and that of steps 100-200, past the warm-up) against bench_train's full length; and where a bf16
# `attn train` run's threads wait (bench/omp_trace.py; the trace comes back in $out for
# symbolizing on the build machine, whose build/cuda/attn has the same addresses).
cpu_step() {
  local out=$1 t=${GPU_CHECK_CPU_THREADS:-2}
  echo "== 6. the host's CPU, $t threads (issue 23): the encoder step beside PyTorch, attn train"
  if [ ! -x "$bundle/bin/bench_train" ]; then
    echo "bench_train is not in the bundle: skipped"
    return
  fi
  # The GEMM tests on this CPU: the GPU host is the only AVX-512 + AMX machine the project sees,
  # and the tests' oneDNN paths (bf16 products, the weight gradient's chunks) run only there.
  if [ -x "$bundle/bin/test_kernels_matmul_cpu" ]; then
    timeout 180 "$bundle/bin/test_kernels_matmul_cpu" --gtest_color=no >"$out/cpu_gemm_tests.log" 2>&1
    local rc=$?
    echo "CPU GEMM tests on this host: rc $rc, $(grep -c '^\[       OK \]' "$out/cpu_gemm_tests.log") passed, $(grep -c '^\[  SKIPPED \] [A-Za-z]*\.[A-Za-z]* (' "$out/cpu_gemm_tests.log") skipped"
    if [ "$rc" -ne 0 ]; then
      grep -B1 -A6 'Failure$' "$out/cpu_gemm_tests.log" | head -60
      failed=1
    fi
  fi
  local train=(train --task shift --length 128 --symbols 8 --num-hiddens 128
    --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 --threads "$t"
    --eval-examples 64)
  (
    export ATTN_THREADS=$t OMP_WAIT_POLICY=PASSIVE
    export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
    timeout 120 "$bundle/bin/bench_train" \
      --benchmark_filter='BM_TrainStep(Bf16)?/|BM_TrainStep.*[Pp]ad' --benchmark_min_time=1 \
      --benchmark_format=json >"$out/cpu_train_attn.json" 2>/dev/null
    : >"$out/cpu_train_torch.jsonl"
    for m in eager autocast; do
      for pad in "" --padded; do
        # shellcheck disable=SC2086
        LD_LIBRARY_PATH="$orig_ld" timeout 120 python3 bench/peers_train.py --threads "$t" \
          --mode "$m" $pad --min-time 1 >>"$out/cpu_train_torch.jsonl" 2>>"$out/cpu_train_torch.err"
      done
    done
    # 200 steps, evaluated every 100 (64 sequences): the whole run's rate, and that of steps
    # 100-200 from the metrics (tokens and seconds since the start at each evaluation), without
    # the first steps' warm-up (allocations, oneDNN primitives for each new batch width).
    for p in fp32 bf16; do
      for k in 1 8; do
        rm -f "$out/cli_${p}_$k.csv"
        timeout 120 "$bundle/bin/attn" "${train[@]}" --steps 200 --eval-every 100 \
          --metrics "$out/cli_${p}_$k.csv" --precision "$p" --bucket "$k" \
          2>"$out/cli_${p}_$k.txt" >/dev/null
      done
    done
    # bench_train's full length again after the CLI's runs: this host's rates drift by 20% from
    # minute to minute (session 26), so each ratio is taken against the faster of the two.
    timeout 60 "$bundle/bin/bench_train" --benchmark_filter='BM_TrainStep(Bf16)?/' \
      --benchmark_min_time=1 --benchmark_format=json >"$out/cpu_train_attn_after.json" 2>/dev/null
    LD_PRELOAD="$PWD/$bundle/lib/libattn_omp_trace.so" ATTN_OMP_TRACE="$out/omp_bf16.trace" \
      timeout 120 "$bundle/bin/attn" "${train[@]}" --steps 60 --precision bf16 >/dev/null 2>&1
  )
  python3 - "$out" "$t" <<'PY'
import csv, json, sys
out, threads = sys.argv[1], sys.argv[2]


def rates(name):
    got = {}
    try:
        for b in json.load(open(f"{out}/{name}"))["benchmarks"]:
            if "tokens_per_second" in b:
                got[b["name"].split("/")[0]] = b["tokens_per_second"]
    except (OSError, ValueError) as e:
        print(f"bench_train gave no JSON in {name}: {e}")
    return got


attn, after = rates("cpu_train_attn.json"), rates("cpu_train_attn_after.json")
torch, version = {}, "?"
for line in open(f"{out}/cpu_train_torch.jsonl"):
    t = json.loads(line)
    version = t.get("torch", version)
    torch[(t["mode"], t["padded"])] = t.get("tokens_per_second")
cli, warm = {}, {}
for p in ("fp32", "bf16"):
    for k in (1, 8):
        try:
            rows = list(csv.DictReader(open(f"{out}/cli_{p}_{k}.csv")))
        except OSError:
            rows = []
        if rows:
            cli[(p, k)] = float(rows[-1]["tokens_per_second"])
            seen = [(float(x["tokens_per_second"]) * float(x["seconds"]), float(x["seconds"]))
                    for x in rows]
            if len(seen) > 1 and seen[-1][1] > seen[0][1]:
                warm[(p, k)] = (seen[-1][0] - seen[0][0]) / (seen[-1][1] - seen[0][1])


def f(v):
    return f"{v:>10,.0f}" if v else f"{'-':>10}"


def r(a, b):
    return f"{a / b:5.2f}x" if a and b else "    -"


print(f"tokens/s, {threads} threads; PyTorch {version}")
print("                     full length      padded   attn/torch full  padded")
for label, sfx, mode in (("attn fp32", "", "eager"), ("attn bf16", "Bf16", "autocast")):
    a, ap = attn.get(f"BM_TrainStep{sfx}"), attn.get(f"BM_TrainStepPadded{sfx}")
    t, tp = torch.get((mode, False)), torch.get((mode, True))
    print(f"{label:12}        {f(a)}  {f(ap)}")
    print(f"torch {mode:9}     {f(t)}  {f(tp)}        {r(a, t)}  {r(ap, tp)}")
print("bench_train full length after the CLI's runs: " + ", ".join(
    f"{k} {f(v).strip()}" for k, v in after.items()))
print("attn train on padded batches (200 steps), tokens/s and the ratio to bench_train's full "
      "length, the faster of its runs before and after (target >= 0.75x):")
print(" " * 17 + "  ".join(f"{h:>19}" for h in ("--bucket 1: all", "steps 100-200",
                                                "--bucket 8: all", "steps 100-200")))
for p, sfx in (("fp32", ""), ("bf16", "Bf16")):
    full = max(attn.get(f"BM_TrainStep{sfx}") or 0, after.get(f"BM_TrainStep{sfx}") or 0)
    cells = [f"{f(d.get((p, k)))} ({r(d.get((p, k)), full)})" for k in (1, 8) for d in (cli, warm)]
    print(f"attn train {p}  " + "  ".join(cells))
PY
  [ -s "$out/cpu_train_torch.err" ] && tail -n 3 "$out/cpu_train_torch.err"
  python3 bench/omp_trace.py "$out/omp_bf16.trace" --top 8 2>&1 | head -30
}

# Section 7: on the host's CPU, A/B runs of bench_train's full-length step (bench/ab_env.sh,
# GPU_CHECK_CPU_THREADS threads, 2 rounds): f32 products on oneDNN (the default on AVX-512 CPUs)
# against attn's row-exact kernel (what AVX2 CPUs run; session 25: about 30% slower here), and the
# attention kernels' flush of subnormals (kernels/cpu/denormals.hpp) against none
# (ATTN_ATTENTION_DENORMALS=keep), fp32 and bf16; then the f32 kernels at all the host's threads
# (1 round), and the step's parts on each. GPU_CHECK_SKIP_AB=1 skips it.
cpu_gemm_ab() {
  local out=$1 t=${GPU_CHECK_CPU_THREADS:-2}
  if [ -n "${GPU_CHECK_SKIP_AB:-}" ]; then
    echo "== 7. skipped (GPU_CHECK_SKIP_AB set)"
    return
  fi
  echo "== 7. the host's CPU: A/B of the f32 products' kernel and of the flush of subnormals (tokens/s)"
  bash bench/ab_env.sh "$bundle/bin/bench_train" 2 "$t" 'BM_TrainStep/' auto: \
    onednn:ATTN_GEMM_F32=onednn rows:ATTN_GEMM_F32=rows denormals:ATTN_ATTENTION_DENORMALS=keep \
    2>/dev/null
  bash bench/ab_env.sh "$bundle/bin/bench_train" 2 "$t" 'BM_TrainStepBf16/' auto: \
    denormals:ATTN_ATTENTION_DENORMALS=keep 2>/dev/null | tail -n +2
  bash bench/ab_env.sh "$bundle/bin/bench_train" 1 "$(nproc)" 'BM_TrainStep/' auto: \
    rows:ATTN_GEMM_F32=rows 2>/dev/null | tail -n +2
  echo "-- the step's parts (BM_TrainStepParts, $t threads), f32 products on oneDNN, then attn's:"
  local v
  for v in onednn rows; do
    ATTN_THREADS=$t ATTN_GEMM_F32=$v OMP_WAIT_POLICY=PASSIVE "$bundle/bin/bench_train" \
      --benchmark_filter=BM_TrainStepParts 2>/dev/null | tail -n 1 | sed "s/^/$v: /"
  done
}

# Section 8: where the host CPU's time goes (perf is missing there): bench/sample_prof.cpp's
# samples of bench_train's full-length step and of a 200-step `attn train` (past its first fifth),
# fp32 and bf16, and of `attn translate` (greedy and beam 4) on the dates model, as
# scripts/profile.sh profiles both commands where perf is.
cpu_profiles() {
  local out=$1 t=${GPU_CHECK_CPU_THREADS:-2}
  echo "== 8. sampled profiles of the host's CPU, $t threads"
  # Where the time goes (perf is missing here): bench/sample_prof.cpp's samples of bench_train's
  # full-length step and of `attn train`, fp32 and bf16. The profiles come back in $out;
  # bench/sample_prof.py symbolizes them here if binutils are present, else on the build machine
  # (the same binaries in build/cuda).
  echo "(bench/sample_prof.py $out/prof_*.txt symbolizes them on the build machine too)"
  local p prec filter
  # The translation model: scripts/profile.sh's (200 steps of the dates task), and its sources
  # (16,384 lines: a second of decoding or more, so that decoding, not start-up, fills it).
  timeout 120 "$bundle/bin/attn" train --task dates --steps 200 --num-hiddens 64 \
    --ffn-num-hiddens 128 --num-heads 4 --batch-size 64 --threads "$t" \
    --checkpoint "$out/dates.safetensors" >/dev/null 2>&1
  for _ in $(seq 1 2048); do cat bench/translate_sources.txt; done >"$out/translate_src.txt"
  for p in step_fp32 step_bf16 cli_fp32 cli_bf16 translate_1 translate_4; do
    prec=${p#*_}
    filter=BM_TrainStep/
    [ "$prec" = bf16 ] && filter=BM_TrainStepBf16/
    rm -f "$out/prof_$p.txt"
    (
      export ATTN_THREADS=$t OMP_WAIT_POLICY=PASSIVE ATTN_SAMPLE_PROF="$out/prof_$p.txt"
      local preload="LD_PRELOAD=$PWD/$bundle/lib/libattn_sample_prof.so"
      if [ "${p%%_*}" = step ]; then
        timeout 60 env "$preload" "$bundle/bin/bench_train" --benchmark_filter="$filter" \
          >/dev/null 2>&1
      elif [ "${p%%_*}" = translate ]; then
        timeout 60 env "$preload" "$bundle/bin/attn" translate --checkpoint \
          "$out/dates.safetensors" --threads "$t" --beam "$prec" <"$out/translate_src.txt" \
          >/dev/null 2>&1
      else
        timeout 60 env "$preload" "$bundle/bin/attn" train --task shift --length 128 --symbols 8 \
          --num-hiddens 128 --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 \
          --threads "$t" --eval-every 0 --eval-examples 64 --steps 200 --precision "$prec" \
          >/dev/null 2>&1
      fi
    )
    # The CLI's runs past their first fifth (the warm-up creates oneDNN's primitives for each
    # new batch width); bench_train's whole (google-benchmark warms it up before timing).
    local window=()
    [ "${p%%_*}" = cli ] && window=(--late)
    if command -v nm >/dev/null && command -v readelf >/dev/null; then
      python3 bench/sample_prof.py "$out/prof_$p.txt" --top 12 "${window[@]}" \
        --search "$bundle/bin" 2>&1
    else
      head -n 1 "$out/prof_$p.txt" 2>/dev/null || echo "$p: no profile"
    fi
  done
}

run() {
  local quick=""
  [ "${1:-}" = "--quick" ] && quick="--quick"
  local out=${OUT:-$bundle/out}
  mkdir -p "$out"
  local start=$SECONDS
  # Per-binary limit: a hung kernel costs this much device time, not the whole run.
  local tlimit=${GPU_CHECK_TEST_TIMEOUT:-240}
  if [ ! -x "$bundle/bin/test_cuda_host" ]; then
    echo "gpu-check: $bundle is missing; run 'scripts/gpu-check.sh build' on the build machine" >&2
    echo "and carry build/gpu-check to this one" >&2
    exit 2
  fi
  setup

  echo "== 1. tests (every failure reported; log in $out/tests.log)"
  local failed=0 summary=""
  : >"$out/tests.log"
  for t in "$bundle"/bin/test_cuda_*; do
    local name
    name=$(basename "$t")
    timeout "$tlimit" "$t" --gtest_color=no >"$out/$name.log" 2>&1
    local rc=$?
    cat "$out/$name.log" >>"$out/tests.log"
    local passed failedn skipped
    passed=$(grep -c '^\[       OK \]' "$out/$name.log")
    failedn=$(grep -c '^\[  FAILED  \] [A-Za-z]*\.[A-Za-z]* (' "$out/$name.log")
    skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z]*\.[A-Za-z]* (' "$out/$name.log")
    summary+=$(printf '%-24s rc %-3s passed %-3s failed %-3s skipped %s' "$name" "$rc" "$passed" "$failedn" "$skipped")$'\n'
    if [ "$rc" -ne 0 ] || [ "$skipped" -gt 0 ]; then
      failed=1
      # Every failing expectation with its case: the lines gtest prints around "Failure".
      grep -B1 -A6 'Failure$' "$out/$name.log" | head -150
      [ "$rc" -eq 124 ] && echo "$name: timed out after $tlimit s"
      [ "$skipped" -gt 0 ] && echo "$name: tests skipped on a GPU machine (no device visible?)"
    fi
  done
  # The bf16 cases that take the tensor-core forward, once more through the SIMT kernel.
  ATTN_CUDA_SIMT_ATTENTION=1 timeout "$tlimit" "$bundle/bin/test_cuda_attention" --gtest_color=no \
    --gtest_filter='CudaFlashAttention.Forward*' >"$out/attention_simt.log" 2>&1
  local rc_simt=$?
  cat "$out/attention_simt.log" >>"$out/tests.log"
  summary+=$(printf '%-24s rc %-3s (every bf16 case through the SIMT kernel)' "attention, SIMT only" "$rc_simt")$'\n'
  if [ "$rc_simt" -ne 0 ]; then
    failed=1
    grep -B1 -A6 'Failure$' "$out/attention_simt.log" | head -60
  fi
  printf '%s' "$summary"
  # The largest errors of every comparison (all cases, passing or not).
  grep -h 'max err' "$out/tests.log" >"$out/errors.txt"
  echo "($(wc -l <"$out/errors.txt") comparisons; each with its largest error in $out/errors.txt)"
  echo "   ($((SECONDS - start)) s so far)"

  echo "== 2. compute-sanitizer memcheck on a small subset"
  local sanitizer=""
  for s in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer; do
    command -v "$s" >/dev/null 2>&1 && { sanitizer=$s; break; }
  done
  if [ -z "$sanitizer" ]; then
    echo "compute-sanitizer not found: skipped"
  else
    ATTN_CUDA_SMALL=1 timeout 180 "$sanitizer" --tool memcheck --error-exitcode 3 \
      "$bundle/bin/test_cuda_attention" --gtest_color=no >"$out/memcheck.log" 2>&1
    local rc=$?
    ATTN_CUDA_SMALL=1 timeout 60 "$sanitizer" --tool memcheck --error-exitcode 3 \
      "$bundle/bin/test_cuda_kernels" --gtest_color=no \
      --gtest_filter='CudaOps.Dropout*:CudaOps.LayerNorm*:CudaOps.MaskedSoftmax*' \
      >>"$out/memcheck.log" 2>&1
    local rc2=$?
    tail -n 3 "$out/memcheck.log"
    if [ "$rc" -ne 0 ] || [ "$rc2" -ne 0 ]; then
      echo "memcheck: exit codes $rc, $rc2 (3: errors found; 124: timeout); see $out/memcheck.log"
      grep -m 20 -E '^=========  *(Invalid|Program hit|Error)' "$out/memcheck.log"
      failed=1
    else
      echo "memcheck: no errors"
    fi
  fi
  echo "   ($((SECONDS - start)) s so far)"

  echo "== 3. attn train --device cuda (the d2l encoder, shift task), then resumed on the CPU"
  local train_args=(train --task shift --length 128 --symbols 8 --num-hiddens 128
    --ffn-num-hiddens 256 --num-heads 4 --dropout 0.1 --batch-size 32 --eval-every 0
    --eval-examples 256)
  rm -f "$out/gpu_run.safetensors"
  if timeout 120 "$bundle/bin/attn" "${train_args[@]}" --steps 400 --device cuda \
      --checkpoint "$out/gpu_run.safetensors" >"$out/train_gpu.log" 2>&1 &&
    timeout 60 "$bundle/bin/attn" "${train_args[@]}" --steps 420 --threads "$(nproc)" \
      --resume "$out/gpu_run.safetensors" >"$out/train_resume_cpu.log" 2>&1; then
    tail -n 4 "$out/train_gpu.log"
    echo "-- resumed on the CPU ($(nproc) threads):"
    tail -n 3 "$out/train_resume_cpu.log"
  else
    echo "attn train --device cuda or its CPU resume failed:"
    tail -n 15 "$out/train_gpu.log" "$out/train_resume_cpu.log" 2>/dev/null
    failed=1
  fi
  rm -f "$out/gpu_run.safetensors"
  echo "-- attn bench attention --device cuda:"
  for args in "--dtype bf16 --batch-heads 32 --queries 2048 --head-dim 128" \
    "--dtype bf16 --batch-heads 32 --queries 2048 --head-dim 128 --backward" \
    "--dtype f32 --batch-heads 128 --queries 128 --head-dim 32"; do
    # shellcheck disable=SC2086
    timeout 30 "$bundle/bin/attn" bench attention --device cuda $args --repeats 5 \
      --warmup-seconds 0.2 2>&1 | head -2 | tr '\n' ' ' || failed=1
    echo
  done
  echo "   ($((SECONDS - start)) s so far)"

  echo "== 4. benchmarks: attn beside PyTorch $(LD_LIBRARY_PATH="$orig_ld" python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  timeout 150 "$bundle/bin/bench_cuda" $quick >"$out/bench_attn.jsonl" || {
    echo "bench_cuda failed (rc $?)"
    failed=1
  }
  # PyTorch with the machine's own library path, not the bundle's.
  LD_LIBRARY_PATH="$orig_ld" PYTHONUNBUFFERED=1 timeout 150 python3 bench/torch_cuda.py $quick >"$out/bench_torch.jsonl" || {
    echo "bench/torch_cuda.py failed (rc $?)"
  }
  python3 bench/gpu_table.py "$out/bench_attn.jsonl" "$out/bench_torch.jsonl" | tee "$out/table.txt"
  echo "-- the training step's phases (eager steps, CUDA events; ATTN_CUDA_STEP_PROFILE=1):"
  ATTN_CUDA_STEP_PROFILE=1 timeout 60 "$bundle/bin/bench_cuda" --train-only 2>&1 >/dev/null |
    grep 'step profile' | fold -w 150
  echo
  if [ -n "${GPU_CHECK_SKIP_THREADS:-}" ]; then
    echo "== 5. skipped (GPU_CHECK_SKIP_THREADS set)"
  else
    thread_sweep "$out"
  fi
  echo "   ($((SECONDS - start)) s so far)"

  if [ -n "${GPU_CHECK_SKIP_CPU:-}" ]; then
    echo "== 6-8. skipped (GPU_CHECK_SKIP_CPU set)"
  else
    cpu_step "$out"
    echo "   ($((SECONDS - start)) s so far)"
    cpu_gemm_ab "$out"
    cpu_profiles "$out"
  fi
  echo
  echo "== summary ($((SECONDS - start)) s)"
  printf '%s' "$summary"
  if [ "$failed" -eq 0 ]; then
    echo "gpu-check: PASS"
  else
    echo "gpu-check: FAIL (details above and in $out)"
  fi
  return "$failed"
}

case "$mode" in
  build) build ;;
  run) shift; run "$@" ;;
  cpu)
    # Sections 6 and 7 alone (the host's CPU), results in $OUT or build/gpu-check/out.
    setup
    mkdir -p "${OUT:-$bundle/out}"
    cpu_step "${OUT:-$bundle/out}"
    cpu_gemm_ab "${OUT:-$bundle/out}"
    cpu_profiles "${OUT:-$bundle/out}"
    ;;
  profile)
    # Section 8 alone.
    setup
    mkdir -p "${OUT:-$bundle/out}"
    cpu_profiles "${OUT:-$bundle/out}"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh build | run [--quick] | cpu | profile" >&2
    exit 2
    ;;
esac
