// Fast float32 CPU paths for dropout, ReLU and LayerNorm (see encoder_ops.hpp): the reference
// arithmetic, in parallel over chunks that the shape alone fixes.
#include "kernels/cpu/encoder_ops.hpp"

#include "kernels/cpu/dropout_simd.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::cpu {

namespace {

constexpr int64_t kChunk = 16384;  // elements per parallel chunk (a multiple of 4)
constexpr int64_t kParallelMin = 32768;

int64_t chunks_of(int64_t n, int64_t chunk) {
  return (n + chunk - 1) / chunk;
}

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

// SIMD loops (omp simd; at -O2 GCC keeps a data-dependent branch, which mispredicts on half of
// the elements). NaN: x < 0 and x > 0 are both false, so relu passes NaN on and its gradient is 0.
void relu_forward_chunk(const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

void relu_backward_chunk(const float* __restrict dy, const float* __restrict x,
                         float* __restrict dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = dy[i];  // loaded unconditionally, so the select vectorises
    dx[i] = x[i] > 0.0f ? g : 0.0f;
  }
}

}  // namespace

void dropout_f32(const float* x, float* y, int64_t n, double p, uint64_t seed, uint64_t offset,
                 int threads) {
  if (!(p > 0.0)) {  // inactive: the identity (factor 1)
    if (x != y) std::copy(x, x + n, y);
    return;
  }
  if (p >= 1.0) {  // every element dropped: x * 0.0 (keeps -0 and NaN as the reference does)
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i)
      y[i] = static_cast<float>(static_cast<double>(x[i]) * 0.0);
    return;
  }
  const double scale = 1.0 / (1.0 - p);
  // u = r * 2^-24 >= p (p as float, as the reference compares) <=> r >= ceil(p * 2^24): exact,
  // since a float times 2^24 is exact in double.
  const uint32_t threshold =
      static_cast<uint32_t>(std::ceil(static_cast<double>(static_cast<float>(p)) * 16777216.0));
  const int64_t chunks = chunks_of(n, kChunk);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c)
    dropout_range_f32(x, y, c * kChunk, std::min(n, (c + 1) * kChunk), threshold, scale, seed,
                      offset);
}

void relu_forward_f32(const float* x, float* y, int64_t n, int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    relu_forward_chunk(x + begin, y + begin, std::min(kChunk, n - begin));
  }
}

void relu_backward_f32(const float* dy, const float* x, float* dx, int64_t n, int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    relu_backward_chunk(dy + begin, x + begin, dx + begin, std::min(kChunk, n - begin));
  }
}

void layer_norm_forward_f32(const float* x, const float* gamma, const float* beta, float* y,
                            float* mean, float* rstd, int64_t R, int64_t E, double eps,
                            int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R * E >= kParallelMin)
  for (int64_t r = 0; r < R; ++r)
    layer_norm_row(x + r * E, gamma, beta, y + r * E, mean + r, rstd + r, E, eps);
}

void layer_norm_backward_f32(const float* dy, const float* x, const float* gamma, const float* mean,
                             const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t R,
                             int64_t E, int threads) {
  const int64_t chunks = chunks_of(R, kLayerNormChunkRows);
  // Per chunk: sum over its rows of dy * xhat (dgamma) and dy (dbeta), in double.
  std::vector<double> partial(
      gamma != nullptr ? static_cast<size_t>(chunks) * 2 * static_cast<size_t>(E) : 0, 0.0);
#pragma omp parallel for schedule(static) num_threads(threads) if (R * E >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    double* dg = gamma != nullptr ? partial.data() + c * 2 * E : nullptr;
    double* db = gamma != nullptr ? dg + E : nullptr;
    std::vector<double> scratch(static_cast<size_t>(2 * E));
    const int64_t end = std::min(R, (c + 1) * kLayerNormChunkRows);
    for (int64_t r = c * kLayerNormChunkRows; r < end; ++r)
      layer_norm_backward_row(dy + r * E, x + r * E, gamma, mean[r], rstd[r], dx + r * E, dg, db,
                              scratch.data(), scratch.data() + E, E);
  }
  if (gamma == nullptr) return;
  for (int64_t e = 0; e < E; ++e) {
    double g = 0.0, b = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      g += partial[static_cast<size_t>(c * 2 * E + e)];
      b += partial[static_cast<size_t>(c * 2 * E + E + e)];
    }
    dgamma[e] = static_cast<float>(g);
    dbeta[e] = static_cast<float>(b);
  }
}

}  // namespace attn::cpu
