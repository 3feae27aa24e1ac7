#!/usr/bin/env bash
# A/B of the weight gradient's cut on oneDNN CPUs (AVX-512: kernels/cpu/matmul.hpp): bench_train's
# full-length encoder step (BM_TrainStep, BM_TrainStepBf16) with attn's chunks of the contraction
# (the default) against oneDNN's own threads (ATTN_GEMM_WGRAD=onednn), in alternating rounds, at
# each thread count; prints tokens/s per round. On CPUs without AVX-512 both run attn's row-exact
# kernel (the switch changes nothing there).
#
#   bench/ab_wgrad.sh [bench_train] [rounds] [threads...]   (default build/default/bench/bench_train,
#                                                             2 rounds, 2 threads)
# Session 24 ran it on the GPU machine's AMX Xeon as part of an ad-hoc probe (docs/performance.md).
set -euo pipefail
bin=${1:-build/default/bench/bench_train}
rounds=${2:-2}
shift $(($# > 2 ? 2 : $#))
threads=("${@:-2}")
list=$(IFS=,; echo "${threads[*]}")
exec "$(dirname "$0")/ab_env.sh" "$bin" "$rounds" "$list" 'BM_TrainStep(Bf16)?/' \
  chunks: onednn:ATTN_GEMM_WGRAD=onednn
