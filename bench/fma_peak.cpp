// FP32 FMA peak: each thread runs kChains independent accumulator chains of MulAdd, so the loop is
// bound by FMA throughput, not latency (Zen 4: 4-cycle latency, one 512-bit or two 256-bit FMAs
// per cycle, so 8+ chains suffice; 12 leaves margin and fits 16 and 32 registers alike). Nothing
// touches memory inside the loop.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/fma_peak.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#include "bench/fma_peak.hpp"

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace attn::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Runs `iters` x 12 FMAs of full vectors; returns the FLOPs done and a value that depends on the
// result (so the loop is not removed).
double FmaLoop(int64_t iters, float seed, float* sink) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f), a = hn::Set(d, 1e-7f);
  auto c0 = hn::Set(d, seed), c1 = hn::Add(c0, a), c2 = hn::Add(c1, a), c3 = hn::Add(c2, a);
  auto c4 = hn::Add(c3, a), c5 = hn::Add(c4, a), c6 = hn::Add(c5, a), c7 = hn::Add(c6, a);
  auto c8 = hn::Add(c7, a), c9 = hn::Add(c8, a), c10 = hn::Add(c9, a), c11 = hn::Add(c10, a);
  for (int64_t i = 0; i < iters; ++i) {
    c0 = hn::MulAdd(c0, m, a);
    c1 = hn::MulAdd(c1, m, a);
    c2 = hn::MulAdd(c2, m, a);
    c3 = hn::MulAdd(c3, m, a);
    c4 = hn::MulAdd(c4, m, a);
    c5 = hn::MulAdd(c5, m, a);
    c6 = hn::MulAdd(c6, m, a);
    c7 = hn::MulAdd(c7, m, a);
    c8 = hn::MulAdd(c8, m, a);
    c9 = hn::MulAdd(c9, m, a);
    c10 = hn::MulAdd(c10, m, a);
    c11 = hn::MulAdd(c11, m, a);
  }
  auto s =
      hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)), hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)));
  s = hn::Add(s, hn::Add(hn::Add(c8, c9), hn::Add(c10, c11)));
  *sink = hn::GetLane(s);
  return 2.0 * 12.0 * static_cast<double>(hn::Lanes(d)) * static_cast<double>(iters);
}

const char* Target() {
  return hwy::TargetName(HWY_TARGET);
}

}  // namespace attn::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <algorithm>
#include <chrono>

namespace attn::bench {
namespace {

// Iterations per thread and repeat: ~0.1 s at full speed. A sanitized build (ASan keeps the
// loop's vectors on its instrumented stack, ~40x slower) runs 1/64 of them: its figure means
// nothing, and `attn bench` under the sanitizer test suite stays a few seconds.
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kIters = 20'000'000 / 64;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr int64_t kIters = 20'000'000 / 64;
#else
constexpr int64_t kIters = 20'000'000;
#endif
#else
constexpr int64_t kIters = 20'000'000;
#endif

}  // namespace

HWY_EXPORT(FmaLoop);
HWY_EXPORT(Target);

const char* fma_peak_target() {
  return HWY_DYNAMIC_DISPATCH(Target)();
}

double measure_fma_peak_gflops(int threads) {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double flops = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
      float sink = 0;
      flops += HWY_DYNAMIC_DISPATCH(FmaLoop)(kIters, 1.0f + omp_get_thread_num(), &sink);
      if (sink == 12345.0f) flops += 1;  // keeps `sink` alive
    }
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops / sec * 1e-9);
  }
  return best;
}

}  // namespace attn::bench
#endif  // HWY_ONCE
