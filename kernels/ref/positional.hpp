// Reference sinusoidal positional encoding (internal).
//   P[i, 2j] = sin(i / 10000^(2j/d)),  P[i, 2j+1] = cos(i / 10000^(2j/d))
#pragma once

#include <cstdint>

namespace attn::ref {

// P (positions, dim) in d2l's float32 chain: e = f32(2j) / f32(d), den = powf(10000, e),
// angle = f32(i) / den, sinf / cosf. Written as float, then widened to T.
template <typename T>
void sinusoidal_match_d2l(T* P, int64_t positions, int64_t dim);

// P (positions, dim) with the angle i * 10000^(-2j/d) and sin/cos in double, rounded once.
template <typename T>
void sinusoidal_exact(T* P, int64_t positions, int64_t dim);

}  // namespace attn::ref
