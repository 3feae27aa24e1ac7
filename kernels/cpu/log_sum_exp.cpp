// log-sum-exp of a row, compiled per SIMD target (see log_sum_exp.hpp).
#include "kernels/cpu/log_sum_exp.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/log_sum_exp.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#include <cmath>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

double LogSumExp(const double* x, int64_t n, double m) {
  const hn::ScalableTag<double> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vm = hn::Set(d, m);
  auto acc0 = hn::Zero(d), acc1 = hn::Zero(d);  // two chains: exp's latency overlaps
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 = hn::Add(acc0, hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vm)));
    acc1 = hn::Add(acc1, hn::Exp(d, hn::Sub(hn::LoadU(d, x + i + N), vm)));
  }
  for (; i + N <= n; i += N)
    acc0 = hn::Add(acc0, hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vm)));
  double sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  for (; i < n; ++i)
    sum += std::exp(x[i] - m);
  return m + std::log(sum);
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::cpu {

HWY_EXPORT(LogSumExp);

double log_sum_exp(const double* x, int64_t n, double m) {
  return HWY_DYNAMIC_DISPATCH(LogSumExp)(x, n, m);
}

}  // namespace attn::cpu
#endif  // HWY_ONCE
