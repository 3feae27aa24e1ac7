// The machine's FP32 FMA peak, measured: a register-only loop of independent fused multiply-adds
// on the widest SIMD target Highway picks, run on `threads` threads at once. Benchmarks (bench/,
// `attn bench`) divide their GFLOP/s by this figure, measured in the same run.
#pragma once

namespace attn::cpu {

// GFLOP/s of all `threads` together (2 FLOP per lane per FMA); best of a few short runs.
double measure_fma_peak_gflops(int threads);
// Name of the SIMD target the loop ran on (e.g. "AVX3").
const char* fma_peak_target();

}  // namespace attn::cpu
