// Softmax cross-entropy rows and a row's log-sum-exp, compiled per SIMD target (see
// cross_entropy.hpp).
#include "kernels/cpu/cross_entropy.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cross_entropy.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/ref/loss.hpp"

#include <cmath>
#include <cstdint>
#include <type_traits>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// sum_c exp(row[c] - m) in double over float or double rows: lanes of partial sums in two chains
// (exp's latency overlaps), then the remainder with std::exp. The same order of operations for
// both input types, so a float row and its widened copy give the same sum.
template <typename T>
double SumExp(const T* row, int64_t C, double m) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<T, decltype(dd)> dt;  // as many T as dd has doubles
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));
  auto load = [&](int64_t c) {
    if constexpr (std::is_same_v<T, double>) {
      return hn::LoadU(dd, row + c);
    } else {
      return hn::PromoteTo(dd, hn::LoadU(dt, row + c));
    }
  };
  const auto vm = hn::Set(dd, m);
  auto s0 = hn::Zero(dd), s1 = hn::Zero(dd);
  int64_t c = 0;
  for (; c + 2 * N <= C; c += 2 * N) {
    s0 = hn::Add(s0, hn::Exp(dd, hn::Sub(load(c), vm)));
    s1 = hn::Add(s1, hn::Exp(dd, hn::Sub(load(c + N), vm)));
  }
  for (; c + N <= C; c += N)
    s0 = hn::Add(s0, hn::Exp(dd, hn::Sub(load(c), vm)));
  double s = hn::GetLane(hn::SumOfLanes(dd, hn::Add(s0, s1)));
  for (; c < C; ++c)
    s += std::exp(static_cast<double>(row[c]) - m);
  return s;
}

// log sum_c exp(row[c]) in double, the max taken first (an infinite max is the result, as the
// reference's).
double RowLse(const float* row, int64_t C) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));
  int64_t c = 0;
  double m = row[0];
  bool nan = false;
  if (C >= N) {
    auto vmax = hn::PromoteTo(dd, hn::LoadU(df, row));
    for (; c + N <= C; c += N) {
      const auto x = hn::PromoteTo(dd, hn::LoadU(df, row + c));
      nan |= !hn::AllFalse(dd, hn::IsNaN(x));
      vmax = hn::Max(vmax, x);
    }
    m = hn::GetLane(hn::MaxOfLanes(dd, vmax));
  }
  for (; c < C; ++c) {
    nan |= std::isnan(row[c]);
    m = row[c] > m ? static_cast<double>(row[c]) : m;
  }
  if (nan) return ref::logsumexp_row(row, C);  // as the reference propagates it
  if (std::isinf(m)) return m;
  return m + std::log(SumExp(row, C, m));
}

double LogSumExpF64(const double* x, int64_t n, double m) {
  return m + std::log(SumExp(x, n, m));
}
double LogSumExpF32(const float* x, int64_t n, double m) {
  return m + std::log(SumExp(x, n, m));
}

double ForwardRows(const float* logits, const int64_t* targets, const uint8_t* keep, int64_t r0,
                   int64_t r1, int64_t C) {
  double total = 0.0;
  for (int64_t n = r0; n < r1; ++n) {
    if (!keep[n]) continue;
    const float* row = logits + n * C;
    total += RowLse(row, C) - static_cast<double>(row[targets[n]]);
  }
  return total;
}

// drow = scale * (softmax(row) - onehot(y)) from the row's log-sum-exp `lse`.
void GradRow(const float* row, int64_t y, double lse, int64_t C, double scale, float* drow) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(dd));
  const auto vl = hn::Set(dd, lse), vs = hn::Set(dd, scale);
  int64_t c = 0;
  for (; c + N <= C; c += N) {
    const auto p = hn::Exp(dd, hn::Sub(hn::PromoteTo(dd, hn::LoadU(df, row + c)), vl));
    hn::StoreU(hn::DemoteTo(df, hn::Mul(vs, p)), df, drow + c);
  }
  for (; c < C; ++c)
    drow[c] = static_cast<float>(scale * std::exp(row[c] - lse));
  // The target's entry: softmax - 1 (the exp again, so that p - 1 is taken in double).
  drow[y] = static_cast<float>(scale * (std::exp(row[y] - lse) - 1.0));
}

// The backward of one row, kept or not, from its log-sum-exp (a kept row's).
void BackwardRow(const float* row, const int64_t* target, const uint8_t* keep, double lse,
                 int64_t C, double scale, float* drow) {
  if (!*keep) {
    for (int64_t c = 0; c < C; ++c)
      drow[c] = 0.0f;
  } else if (!std::isfinite(lse)) {
    // A NaN, or an infinite largest logit: the reference's row (NaNs where it gives NaN;
    // Highway's exp would turn exp(NaN) into 0).
    ref::cross_entropy_backward(row, target, keep, drow, 1, C, scale);
  } else {
    GradRow(row, *target, lse, C, scale, drow);
  }
}

void BackwardRows(const float* logits, const int64_t* targets, const uint8_t* keep, float* dlogits,
                  int64_t r0, int64_t r1, int64_t C, double scale) {
  for (int64_t n = r0; n < r1; ++n) {
    const float* row = logits + n * C;
    BackwardRow(row, targets + n, keep + n, keep[n] ? RowLse(row, C) : 0.0, C, scale,
                dlogits + n * C);
  }
}

// ForwardRows' sum and BackwardRows' rows in one pass: each row's log-sum-exp taken once, its
// gradient written while the row is in cache. The same bits as the two.
double ForwardBackwardRows(const float* logits, const int64_t* targets, const uint8_t* keep,
                           float* dlogits, int64_t r0, int64_t r1, int64_t C, double scale) {
  double total = 0.0;
  for (int64_t n = r0; n < r1; ++n) {
    const float* row = logits + n * C;
    double lse = 0.0;
    if (keep[n]) {
      lse = RowLse(row, C);
      total += lse - static_cast<double>(row[targets[n]]);
    }
    BackwardRow(row, targets + n, keep + n, lse, C, scale, dlogits + n * C);
  }
  return total;
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "kernels/cpu/parallel_for.hpp"

#include <vector>

namespace attn::cpu {

HWY_EXPORT(ForwardRows);
HWY_EXPORT(BackwardRows);
HWY_EXPORT(ForwardBackwardRows);
HWY_EXPORT(LogSumExpF64);
HWY_EXPORT(LogSumExpF32);

double log_sum_exp(const double* x, int64_t n, double m) {
  return HWY_DYNAMIC_DISPATCH(LogSumExpF64)(x, n, m);
}
double log_sum_exp(const float* x, int64_t n, double m) {
  return HWY_DYNAMIC_DISPATCH(LogSumExpF32)(x, n, m);
}

namespace {
constexpr int64_t kChunkRows = 16;  // rows per task; fixes the forward's order of additions

// The threads a pass over N rows of C logits is worth, counted as the flops that would take
// as long (kernels/cpu/parallel.hpp): about 20 per logit and pass (an exp, a subtraction, the
// sums), and per row a log, a maximum and reductions across lanes that cost like thousands. Rows
// of 8 tags took 18 ns forward and 42 ns backward (the log-sum-exp again, then the exps) on one
// Zen 5 core. (Counted per logit only, the tagging task's 2,048-4,096 rows of 8 ran on one thread,
// 0.2-0.4 ms a step, while the other waited.)
int ce_threads(int64_t N, int64_t C, int threads, bool backward) {
  const double per_row =
      backward ? 40.0 * static_cast<double>(C) + 4000.0 : 20.0 * static_cast<double>(C) + 2000.0;
  return threads_for(per_row * static_cast<double>(N), std::max(1, threads));
}
}  // namespace

double cross_entropy_forward_f32(const float* logits, const int64_t* targets, const uint8_t* keep,
                                 int64_t N, int64_t C, int threads) {
  const int64_t chunks = (N + kChunkRows - 1) / kChunkRows;
  std::vector<double> sums(static_cast<size_t>(chunks), 0.0);
  auto* rows = HWY_DYNAMIC_DISPATCH(ForwardRows);
  parallel_for(chunks, ce_threads(N, C, threads, false), [&](int64_t k) {
    sums[static_cast<size_t>(k)] =
        rows(logits, targets, keep, k * kChunkRows, std::min(N, (k + 1) * kChunkRows), C);
  });
  double total = 0.0;
  for (double s : sums)
    total += s;
  return total;
}

void cross_entropy_backward_f32(const float* logits, const int64_t* targets, const uint8_t* keep,
                                float* dlogits, int64_t N, int64_t C, double scale, int threads) {
  const int64_t chunks = (N + kChunkRows - 1) / kChunkRows;
  auto* rows = HWY_DYNAMIC_DISPATCH(BackwardRows);
  parallel_for(chunks, ce_threads(N, C, threads, true), [&](int64_t k) {
    rows(logits, targets, keep, dlogits, k * kChunkRows, std::min(N, (k + 1) * kChunkRows), C,
         scale);
  });
}

double cross_entropy_forward_backward_f32(const float* logits, const int64_t* targets,
                                          const uint8_t* keep, float* dlogits, int64_t N, int64_t C,
                                          double scale, int threads) {
  const int64_t chunks = (N + kChunkRows - 1) / kChunkRows;
  std::vector<double> sums(static_cast<size_t>(chunks), 0.0);
  auto* rows = HWY_DYNAMIC_DISPATCH(ForwardBackwardRows);
  // As much work per row as the backward alone (the forward's log-sum-exp is the one it takes).
  parallel_for(chunks, ce_threads(N, C, threads, true), [&](int64_t k) {
    sums[static_cast<size_t>(k)] = rows(logits, targets, keep, dlogits, k * kChunkRows,
                                        std::min(N, (k + 1) * kChunkRows), C, scale);
  });
  double total = 0.0;
  for (double s : sums)
    total += s;
  return total;
}

}  // namespace attn::cpu
#endif  // HWY_ONCE
