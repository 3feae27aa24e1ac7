// Fused AddNorm for float32 (see add_norm.hpp): per chunk of rows, dropout + add + LayerNorm, and
// LayerNorm backward + dropout backward from the saved mask, with the separate ops' arithmetic.
#include "kernels/cpu/add_norm.hpp"

#include "attn/core/dtype.hpp"
#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/cpu/layer_norm_simd.hpp"
#include "kernels/cpu/parallel_for.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::cpu {

namespace {

constexpr int64_t kParallelMin = 32768;  // elements; as encoder_ops.cpp

// The dropout draw's constants, as cpu::dropout_f32 derives them: keep iff (word >> 8) >=
// threshold, i.e. u >= float(p); kept elements times 1 / (1 - p), dropped ones times 0.0. p >= 1
// gives threshold 2^24, above every 24-bit word: all dropped, x * 0.0 as dropout_f32's own p >= 1
// path.
struct DropConstants {
  uint32_t threshold;
  double scale;
};

DropConstants drop_constants(double p) {
  const uint32_t threshold =
      static_cast<uint32_t>(std::ceil(static_cast<double>(static_cast<float>(p)) * 16777216.0));
  return {threshold, p < 1.0 ? 1.0 / (1.0 - p) : 0.0};
}

int64_t row_chunks(int64_t R) {
  return (R + kLayerNormChunkRows - 1) / kLayerNormChunkRows;
}

}  // namespace

void add_norm_forward_f32(const float* x, const float* y, const float* gamma, const float* beta,
                          float* z, float* out, float* mean, float* rstd, int64_t R, int64_t E,
                          double eps, const AddNormDropout* drop, int threads,
                          const AddNormBf16* bf16) {
  const bool dropping = drop != nullptr && drop->p > 0.0;
  const DropConstants dc = drop_constants(dropping ? drop->p : 0.0);
  const uint16_t* y_bf16 = bf16 != nullptr ? bf16->y : nullptr;
  uint16_t* out_bf16 = bf16 != nullptr ? bf16->out : nullptr;
  const int64_t chunks = row_chunks(R);
  parallel_for(chunks, R * E >= kParallelMin ? threads : 1, [&](int64_t c) {
    const int64_t r0 = c * kLayerNormChunkRows, r1 = std::min(R, r0 + kLayerNormChunkRows);
    const int64_t begin = r0 * E, end = r1 * E, n = end - begin;
    // The chunk's y as floats: y itself, or the bf16 y widened into a buffer of the thread's.
    const float* yc = y != nullptr ? y + begin : nullptr;
    if (y_bf16 != nullptr) {
      thread_local std::vector<float> widened;
      widened.resize(static_cast<size_t>(n));
      bf16_to_floats(y_bf16 + begin, widened.data(), n);
      yc = widened.data();
    }
    if (dropping) {
      // z = dropout(y) + x: add_all({dropout(Y), X})'s float sum of dropout_f32's output.
      dropout_keep_range(drop->keep, begin, end, dc.threshold, drop->seed, drop->offset,
                         drop->index_base);
      dropout_apply_keep_f32(yc, drop->keep + begin, x + begin, z + begin, 0, n, dc.scale);
    } else {
      const float* xc = x + begin;
      float* zc = z + begin;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        zc[i] = yc[i] + xc[i];
    }
    layer_norm_forward_rows_f32(z, gamma, beta, out, mean, rstd, r0, r1, E, eps);
    if (out_bf16 != nullptr) floats_to_bf16(out + begin, out_bf16 + begin, n);
  });
}

void add_norm_backward_f32(const float* dout, const float* z, const float* gamma, const float* mean,
                           const float* rstd, float* dx, float* dy, float* dgamma, float* dbeta,
                           int64_t R, int64_t E, const AddNormDropout* drop, int threads,
                           const AddNormBf16* bf16, const AddNormGradTerm* dout_add) {
  const bool dropping = drop != nullptr && drop->p > 0.0;
  const bool adding =
      dout_add != nullptr && (dout_add->f32 != nullptr || dout_add->bf16 != nullptr);
  const DropConstants dc = drop_constants(dropping ? drop->p : 0.0);
  uint16_t* dy_bf16 = bf16 != nullptr ? bf16->dy : nullptr;
  const int64_t chunks = row_chunks(R);
  // Per chunk: its rows' sums of dout * zhat (dgamma) and dout (dbeta) in double, as
  // cpu::layer_norm_backward_f32.
  std::vector<double> partial(
      gamma != nullptr ? static_cast<size_t>(chunks) * 2 * static_cast<size_t>(E) : 0, 0.0);
  const int team = R * E >= kParallelMin ? std::max(1, threads) : 1;
  TaskShares shares(chunks, team);  // a chunk's partial sums are its own: any thread may run it
#pragma omp parallel num_threads(team) if (team > 1)
  {
    std::vector<double> scratch(static_cast<size_t>(2 * E));
    // bf16 dy with dropout: the float dy of a chunk, before its rounding.
    std::vector<float> dropped(
        dy_bf16 != nullptr && dropping ? static_cast<size_t>(kLayerNormChunkRows * E) : 0);
    // dout + dout_add of a chunk.
    std::vector<float> summed(adding ? static_cast<size_t>(kLayerNormChunkRows * E) : 0);
    shares.run(omp_get_thread_num(), [&](int64_t c) {
      const int64_t r0 = c * kLayerNormChunkRows, r1 = std::min(R, r0 + kLayerNormChunkRows);
      const int64_t begin = r0 * E, n = (r1 - r0) * E;
      double* dg = gamma != nullptr ? partial.data() + c * 2 * E : nullptr;
      double* db = gamma != nullptr ? dg + E : nullptr;
      if (adding) {
        // add_all({dout, dout_add})'s float sums, then the chunk's rows from the buffer.
        const float* a = dout + begin;
        float* sc = summed.data();
        if (dout_add->bf16 != nullptr) {
          const uint16_t* t = dout_add->bf16 + begin;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i)
            sc[i] = a[i] + bf16_to_float(t[i]);
        } else {
          const float* t = dout_add->f32 + begin;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i)
            sc[i] = a[i] + t[i];
        }
        layer_norm_backward_rows_f32(sc, z + begin, gamma, mean + r0, rstd + r0, dx + begin, dg, db,
                                     scratch.data(), 0, r1 - r0, E);
      } else {
        layer_norm_backward_rows_f32(dout, z, gamma, mean, rstd, dx, dg, db, scratch.data(), r0, r1,
                                     E);
      }
      // dy = dropout_backward(dz): the forward's mask and scale.
      if (dy_bf16 != nullptr) {
        const float* dyc = dx + begin;
        if (dropping) {
          dropout_apply_keep_f32(dx + begin, drop->keep + begin, nullptr, dropped.data(), 0, n,
                                 dc.scale);
          dyc = dropped.data();
        }
        floats_to_bf16(dyc, dy_bf16 + begin, n);
      } else if (dropping) {
        dropout_apply_keep_f32(dx, drop->keep, nullptr, dy, begin, begin + n, dc.scale);
      }
    });
  }
  if (gamma != nullptr) layer_norm_sum_partials_f32(partial.data(), chunks, E, dgamma, dbeta);
}

}  // namespace attn::cpu
