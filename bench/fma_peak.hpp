// The machine's FP32 FMA peak, measured: a register-only loop of independent fused multiply-adds
// on the widest SIMD target Highway picks, run on `threads` threads at once. Benchmarks (bench/,
// `attn bench attention`) divide their GFLOP/s by this figure, measured in the same run. An
// instrument, not part of the library: the CLI and the bench binaries link it as attn_fma_peak.
#pragma once

namespace attn::bench {

// GFLOP/s of all `threads` together (2 FLOP per lane per FMA); best of a few short runs.
double measure_fma_peak_gflops(int threads);
// Name of the SIMD target the loop ran on (e.g. "AVX3").
const char* fma_peak_target();

}  // namespace attn::bench
