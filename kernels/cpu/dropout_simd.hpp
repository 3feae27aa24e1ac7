// SIMD Philox for the dropout stream (internal; see dropout_simd.cpp and encoder_ops.hpp).
#pragma once

#include <cstdint>

namespace attn::cpu {

// y[i] = float(double(x[i]) * f_i) for i in [begin, end), begin a multiple of 4, where
// f_i = scale if (philox word of element i >> 8) >= threshold, else 0 (attn/core/rng.hpp's
// stream for (seed, offset)). x and y are the whole tensors (indexed from 0).
void dropout_range_f32(const float* x, float* y, int64_t begin, int64_t end, uint32_t threshold,
                       double scale, uint64_t seed, uint64_t offset);

}  // namespace attn::cpu
