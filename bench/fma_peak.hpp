// The benchmarks' name for the measured FMA peak; it lives in the library (kernels/cpu/fma_peak)
// so that `attn bench` measures it the same way.
#pragma once

#include "kernels/cpu/fma_peak.hpp"

namespace attn::bench {

inline double measure_fma_peak_gflops(int threads) {
  return cpu::measure_fma_peak_gflops(threads);
}
inline const char* fma_peak_target() {
  return cpu::fma_peak_target();
}

}  // namespace attn::bench
