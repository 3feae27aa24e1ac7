// SIMD Philox for the dropout stream (internal; see dropout_simd.cpp and encoder_ops.hpp).
#pragma once

#include "attn/core/rng.hpp"

#include <cstdint>

namespace attn::cpu {

// Dropout multipliers z[k] (0 or 1/(1-p)) of elements i0 + k, k < n, of the dropout stream of
// (seed, offset) (attn/core/rng.hpp: the same draw as attn::dropout_keep), one Philox call per 4
// consecutive elements. The scalar draw the fused attention kernels use where their vectorized
// one does not apply.
inline void dropout_multipliers(float p, uint64_t seed, uint64_t offset, uint64_t i0, int64_t n,
                                float* z) {
  const float keep_scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t r[4] = {};
  uint64_t block = ~uint64_t{0};
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t i = i0 + static_cast<uint64_t>(k);
    if ((i >> 2) != block) {
      block = i >> 2;
      const uint32_t ctr[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                               static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
      philox4x32_10(key, ctr, r);
    }
    const float u = static_cast<float>(r[i & 3] >> 8) * (1.0f / 16777216.0f);
    z[k] = u >= p ? keep_scale : 0.0f;
  }
}

// y[i] = float(double(x[i]) * f_i) for i in [begin, end), where f_i = scale if (philox word of
// stream index index_base + i >> 8) >= threshold, else 0 (attn/core/rng.hpp's stream for
// (seed, offset)). x and y are the whole tensors (indexed from 0).
void dropout_range_f32(const float* x, float* y, int64_t begin, int64_t end, uint32_t threshold,
                       double scale, uint64_t seed, uint64_t offset, uint64_t index_base);

// keep[i] = 1 if element i (stream index index_base + i) is kept by dropout_range_f32's draw with
// the same threshold, else 0, for i in [begin, end): a mask to apply more than once (a forward
// and its backward) without redrawing. keep is the whole tensor's (indexed from 0).
void dropout_keep_range(uint8_t* keep, int64_t begin, int64_t end, uint32_t threshold,
                        uint64_t seed, uint64_t offset, uint64_t index_base);

// y[i] = float(double(x[i]) * (keep[i] ? scale : 0.0)), plus add[i] in float when add is given,
// for i in [begin, end): dropout_range_f32's output (then the residual sum) from a saved mask.
void dropout_apply_keep_f32(const float* x, const uint8_t* keep, const float* add, float* y,
                            int64_t begin, int64_t end, double scale);

}  // namespace attn::cpu
