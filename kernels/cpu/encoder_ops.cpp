// Fast float32 CPU paths for dropout, ReLU and LayerNorm (see encoder_ops.hpp): the reference
// arithmetic, in parallel over chunks that the shape alone fixes.
#include "kernels/cpu/encoder_ops.hpp"

#include "attn/core/dtype.hpp"

#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/layer_norm_simd.hpp"
#include "kernels/cpu/parallel_for.hpp"

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

// Dropout's keep threshold for p in (0, 1): u = r * 2^-24 >= p (p as float, as the reference
// compares) <=> r >= ceil(p * 2^24), exact since a float times 2^24 is exact in double.
uint32_t dropout_threshold(double p) {
  return static_cast<uint32_t>(std::ceil(static_cast<double>(static_cast<float>(p)) * 16777216.0));
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
                 uint64_t index_base, int threads) {
  if (!(p > 0.0)) {  // inactive: the identity (factor 1)
    if (x != y) std::copy(x, x + n, y);
    return;
  }
  if (p >= 1.0) {  // every element dropped: x * 0.0 (keeps -0 and NaN as the reference does)
    parallel_for(chunks_of(n, kChunk), n >= kParallelMin ? threads : 1, [&](int64_t c) {
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
        y[i] = static_cast<float>(static_cast<double>(x[i]) * 0.0);
    });
    return;
  }
  const double scale = 1.0 / (1.0 - p);
  const uint32_t threshold = dropout_threshold(p);
  const int64_t chunks = chunks_of(n, kChunk);
  parallel_for(chunks, n >= kParallelMin ? threads : 1, [&](int64_t c) {
    dropout_range_f32(x, y, c * kChunk, std::min(n, (c + 1) * kChunk), threshold, scale, seed,
                      offset, index_base);
  });
}

void scale_add_positions_dropout_f32(const float* x, double factor, const float* P, int64_t ldp,
                                     float* y, int64_t B, int64_t T, int64_t E, double p,
                                     uint64_t seed, uint64_t offset, uint64_t index_base,
                                     int threads) {
  const int64_t rows = B * T, n = rows * E;
  if (n == 0) return;
  const bool dropping = p > 0.0;
  const uint32_t threshold = dropping ? dropout_threshold(p) : 0;
  const double scale = dropping ? 1.0 / (1.0 - p) : 1.0;
  const int64_t chunk_rows = std::max<int64_t>(1, kChunk / std::max<int64_t>(1, E));
  parallel_for(chunks_of(rows, chunk_rows), n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t r0 = c * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * E;
      const float* pr = P + (r % T) * ldp;
      float* yr = y + r * E;
#pragma omp simd
      for (int64_t e = 0; e < E; ++e)
        yr[e] = static_cast<float>(static_cast<double>(xr[e]) * factor) + pr[e];
    }
    if (dropping)
      dropout_range_f32(y, y, r0 * E, r1 * E, threshold, scale, seed, offset, index_base);
  });
}

void dropout_scale_f32(const float* dy, double factor, float* dx, int64_t n, double p,
                       uint64_t seed, uint64_t offset, uint64_t index_base, int threads) {
  const bool dropping = p > 0.0;
  const uint32_t threshold = dropping ? dropout_threshold(p) : 0;
  const double scale = dropping ? 1.0 / (1.0 - p) : 1.0;
  parallel_for(chunks_of(n, kChunk), n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    const float* src = dy;
    if (dropping) {
      dropout_range_f32(dy, dx, i0, i1, threshold, scale, seed, offset, index_base);
      src = dx;
    }
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i)
      dx[i] = static_cast<float>(static_cast<double>(src[i]) * factor);
  });
}

void relu_forward_f32(const float* x, float* y, int64_t n, int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
  parallel_for(chunks, n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t begin = c * kChunk;
    relu_forward_chunk(x + begin, y + begin, std::min(kChunk, n - begin));
  });
}

void relu_backward_f32(const float* dy, const float* x, float* dx, int64_t n, int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
  parallel_for(chunks, n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t begin = c * kChunk;
    relu_backward_chunk(dy + begin, x + begin, dx + begin, std::min(kChunk, n - begin));
  });
}

void relu_in_place_f32(float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = y[i] < 0.0f ? 0.0f : y[i];
}

void relu_backward_in_place_f32(float* dx, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = dx[i];  // loaded unconditionally, so the select vectorises
    dx[i] = x[i] > 0.0f ? g : 0.0f;
  }
}

void relu_in_place_bf16(uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = bf16_to_float(y[i]) < 0.0f ? uint16_t{0} : y[i];
}

void relu_backward_in_place_bf16(uint16_t* dx, const uint16_t* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t g = dx[i];
    dx[i] = bf16_to_float(x[i]) > 0.0f ? g : uint16_t{0};
  }
}

// bf16 relu: widen (a shift), compare in float, keep the bits or 0; the select vectorises.
void relu_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n, int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
  parallel_for(chunks, n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i)
      y[i] = bf16_to_float(x[i]) < 0.0f ? uint16_t{0} : x[i];
  });
}

void relu_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n,
                        int threads) {
  const int64_t chunks = chunks_of(n, kChunk);
  parallel_for(chunks, n >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t g = dy[i];  // loaded unconditionally, so the select vectorises
      dx[i] = bf16_to_float(x[i]) > 0.0f ? g : uint16_t{0};
    }
  });
}

void layer_norm_forward_f32(const float* x, const float* gamma, const float* beta, float* y,
                            float* mean, float* rstd, int64_t R, int64_t E, double eps,
                            int threads) {
  const int64_t chunks = chunks_of(R, kLayerNormChunkRows);
  parallel_for(chunks, R * E >= kParallelMin ? threads : 1, [&](int64_t c) {
    layer_norm_forward_rows_f32(x, gamma, beta, y, mean, rstd, c * kLayerNormChunkRows,
                                std::min(R, (c + 1) * kLayerNormChunkRows), E, eps);
  });
}

void layer_norm_backward_f32(const float* dy, const float* x, const float* gamma, const float* mean,
                             const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t R,
                             int64_t E, int threads) {
  const int64_t chunks = chunks_of(R, kLayerNormChunkRows);
  // Per chunk: sum over its rows of dy * xhat (dgamma) and dy (dbeta), in double.
  std::vector<double> partial(
      gamma != nullptr ? static_cast<size_t>(chunks) * 2 * static_cast<size_t>(E) : 0, 0.0);
  parallel_for(chunks, R * E >= kParallelMin ? threads : 1, [&](int64_t c) {
    double* dg = gamma != nullptr ? partial.data() + c * 2 * E : nullptr;
    double* db = gamma != nullptr ? dg + E : nullptr;
    std::vector<double> scratch(static_cast<size_t>(2 * E));
    layer_norm_backward_rows_f32(dy, x, gamma, mean, rstd, dx, dg, db, scratch.data(),
                                 c * kLayerNormChunkRows,
                                 std::min(R, (c + 1) * kLayerNormChunkRows), E);
  });
  if (gamma != nullptr) layer_norm_sum_partials_f32(partial.data(), chunks, E, dgamma, dbeta);
}

void layer_norm_sum_partials_f32(const double* partial, int64_t chunks, int64_t E, float* dgamma,
                                 float* dbeta) {
  // Chunk by chunk, all 2E sums at once: each sum still adds its chunks in order from 0.0 (the
  // same bits as one column at a time), but the inner loop is unit-stride and vectorizes where a
  // column at a time was a chain of dependent adds at a stride of 2E doubles (~0.15% of a training
  // step, on one thread while the others waited).
  std::vector<double> sums(static_cast<size_t>(2 * E), 0.0);
  double* acc = sums.data();
  for (int64_t c = 0; c < chunks; ++c) {
    const double* row = partial + c * 2 * E;
#pragma omp simd
    for (int64_t j = 0; j < 2 * E; ++j)
      acc[j] += row[j];
  }
  for (int64_t e = 0; e < E; ++e) {
    dgamma[e] = static_cast<float>(acc[e]);
    dbeta[e] = static_cast<float>(acc[E + e]);
  }
}

}  // namespace attn::cpu
