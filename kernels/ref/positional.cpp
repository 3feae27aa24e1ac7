// Reference sinusoidal positional encoding, two accuracy modes (see positional.hpp and
// include/attn/ops/positional.hpp). Column 2j holds the sine and 2j+1 the cosine of pair j; an
// odd dim ends with a lone sine column.
#include "kernels/ref/positional.hpp"

#include <cmath>

namespace attn::ref {

template <typename T>
void sinusoidal_match_d2l(T* P, int64_t positions, int64_t dim) {
  // d2l: X = arange(max_len, f32)[:, None] / pow(10000, arange(0, d, 2, f32) / d), all float32.
  const float d = static_cast<float>(dim);
  for (int64_t c = 0; c < dim; c += 2) {
    const float e = static_cast<float>(c) / d;  // true float32 division, not * (1/d)
    const float den = std::pow(10000.0f, e);    // the float overload: powf
    for (int64_t i = 0; i < positions; ++i) {
      const float angle = static_cast<float>(i) / den;
      P[i * dim + c] = static_cast<T>(std::sin(angle));
      if (c + 1 < dim) P[i * dim + c + 1] = static_cast<T>(std::cos(angle));
    }
  }
}

template <typename T>
void sinusoidal_exact(T* P, int64_t positions, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 2) {
    // In double the angle's rounding error (~i * 2^-53) is far below float32's ulp, so the
    // result is the true value rounded once (d2l's float32 angle is off by up to ~i * 2^-24).
    const double den = std::pow(10000.0, static_cast<double>(c) / static_cast<double>(dim));
    for (int64_t i = 0; i < positions; ++i) {
      const double angle = static_cast<double>(i) / den;
      P[i * dim + c] = static_cast<T>(std::sin(angle));
      if (c + 1 < dim) P[i * dim + c + 1] = static_cast<T>(std::cos(angle));
    }
  }
}

template void sinusoidal_match_d2l<float>(float*, int64_t, int64_t);
template void sinusoidal_match_d2l<double>(double*, int64_t, int64_t);
template void sinusoidal_exact<float>(float*, int64_t, int64_t);
template void sinusoidal_exact<double>(double*, int64_t, int64_t);

}  // namespace attn::ref
