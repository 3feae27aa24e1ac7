// LayerNorm rows for the float32 fast path (internal; see encoder_ops.hpp), compiled once per
// SIMD target by Highway's foreach_target and picked at run time: the double-precision loops of
// the reference's arithmetic then use the machine's widest vectors (8 doubles on AVX-512)
// instead of the baseline's 2.
#pragma once

#include <cstdint>

namespace attn::cpu {

// Rows [r0, r1) of x (R, E) -> y, mean, rstd (see cpu::layer_norm_forward_f32).
void layer_norm_forward_rows_f32(const float* x, const float* gamma, const float* beta, float* y,
                                 float* mean, float* rstd, int64_t r0, int64_t r1, int64_t E,
                                 double eps);
// Rows [r0, r1): dx, and when dg / db are given, their sums over these rows added into dg, db
// (E doubles each). scratch: 2 * E doubles.
void layer_norm_backward_rows_f32(const float* dy, const float* x, const float* gamma,
                                  const float* mean, const float* rstd, float* dx, double* dg,
                                  double* db, double* scratch, int64_t r0, int64_t r1, int64_t E);

}  // namespace attn::cpu
