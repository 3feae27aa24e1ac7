// LayerNorm rows, compiled per SIMD target (see layer_norm_simd.hpp).
#include "kernels/cpu/layer_norm_simd.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/layer_norm_simd.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#include <cmath>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {

// sum_{e < E} term(e) in double with 8 interleaved partial sums (a single running sum waits on
// each add's latency), added pairwise at the end: the reference sums in order, so results differ
// from it by double rounding only (~1e-16 relative), far below the float32 outputs' resolution.
template <typename Term>
double row_sum(int64_t E, Term term) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t e = 0;
  for (; e + 8 <= E; e += 8)
    for (int64_t k = 0; k < 8; ++k)
      acc[k] += term(e + k);
  for (; e < E; ++e)
    acc[e & 7] += term(e);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// One LayerNorm row, ref::layer_norm_forward's arithmetic: the two sums by row_sum, the
// elementwise output as a SIMD loop.
void layer_norm_row(const float* __restrict xr, const float* __restrict gamma,
                    const float* __restrict beta, float* __restrict yr, float* mean, float* rstd,
                    int64_t E, double eps) {
  const double m =
      row_sum(E, [&](int64_t e) { return static_cast<double>(xr[e]); }) / static_cast<double>(E);
  const double var = row_sum(E,
                             [&](int64_t e) {
                               const double c = xr[e] - m;
                               return c * c;
                             }) /
                     static_cast<double>(E);
  const double s = 1.0 / std::sqrt(var + eps);
  if (gamma != nullptr) {
#pragma omp simd
    for (int64_t e = 0; e < E; ++e)
      yr[e] = static_cast<float>((xr[e] - m) * s * gamma[e] + beta[e]);
  } else {
#pragma omp simd
    for (int64_t e = 0; e < E; ++e)
      yr[e] = static_cast<float>((xr[e] - m) * s);
  }
  *mean = static_cast<float>(m);
  *rstd = static_cast<float>(s);
}

// One LayerNorm row's backward (ref::layer_norm_backward's arithmetic): g and g * xhat per
// element and the dgamma / dbeta accumulation as SIMD loops, the two row sums by row_sum, dx as
// a SIMD loop. gbuf, gxbuf: E doubles of scratch.
void layer_norm_backward_row(const float* __restrict dyr, const float* __restrict xr,
                             const float* __restrict gamma, double m, double s,
                             float* __restrict dxr, double* __restrict dg, double* __restrict db,
                             double* __restrict gbuf, double* __restrict gxbuf, int64_t E) {
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) {
    const double xhat = (xr[e] - m) * s;
    const double g = gamma != nullptr ? static_cast<double>(dyr[e]) * gamma[e] : dyr[e];
    gbuf[e] = g;
    gxbuf[e] = g * xhat;
  }
  if (dg != nullptr) {
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) {
      const double xhat = (xr[e] - m) * s;
      dg[e] += static_cast<double>(dyr[e]) * xhat;
      db[e] += dyr[e];
    }
  }
  const double g_mean = row_sum(E, [&](int64_t e) { return gbuf[e]; }) / static_cast<double>(E);
  const double gx_mean = row_sum(E, [&](int64_t e) { return gxbuf[e]; }) / static_cast<double>(E);
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) {
    const double xhat = (xr[e] - m) * s;
    dxr[e] = static_cast<float>(s * (gbuf[e] - g_mean - xhat * gx_mean));
  }
}

void LayerNormForwardRows(const float* x, const float* gamma, const float* beta, float* y,
                          float* mean, float* rstd, int64_t r0, int64_t r1, int64_t E, double eps) {
  for (int64_t r = r0; r < r1; ++r)
    layer_norm_row(x + r * E, gamma, beta, y + r * E, mean + r, rstd + r, E, eps);
}

void LayerNormBackwardRows(const float* dy, const float* x, const float* gamma, const float* mean,
                           const float* rstd, float* dx, double* dg, double* db, double* scratch,
                           int64_t r0, int64_t r1, int64_t E) {
  for (int64_t r = r0; r < r1; ++r)
    layer_norm_backward_row(dy + r * E, x + r * E, gamma, mean[r], rstd[r], dx + r * E, dg, db,
                            scratch, scratch + E, E);
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::cpu {

HWY_EXPORT(LayerNormForwardRows);
HWY_EXPORT(LayerNormBackwardRows);

void layer_norm_forward_rows_f32(const float* x, const float* gamma, const float* beta, float* y,
                                 float* mean, float* rstd, int64_t r0, int64_t r1, int64_t E,
                                 double eps) {
  HWY_DYNAMIC_DISPATCH(LayerNormForwardRows)(x, gamma, beta, y, mean, rstd, r0, r1, E, eps);
}

void layer_norm_backward_rows_f32(const float* dy, const float* x, const float* gamma,
                                  const float* mean, const float* rstd, float* dx, double* dg,
                                  double* db, double* scratch, int64_t r0, int64_t r1, int64_t E) {
  HWY_DYNAMIC_DISPATCH(LayerNormBackwardRows)
  (dy, x, gamma, mean, rstd, dx, dg, db, scratch, r0, r1, E);
}

}  // namespace attn::cpu
#endif
