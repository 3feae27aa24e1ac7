// Reference rotary position embedding: one routine serves the forward (sign +1) and the backward
// (sign -1, the inverse rotation: R(a)^T = R(-a)).
#include "kernels/ref/relative_position.hpp"

#include <cmath>
#include <vector>

namespace attn::ref {

template <typename T>
void rotary_apply(const T* x, T* y, int64_t N, int64_t Tn, int64_t D, const RotaryOptions& opts,
                  double sign) {
  const int64_t half = D / 2;
  // theta_i = base^(-2i/D), the same frequencies as the sinusoidal encoding.
  std::vector<double> theta(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    theta[i] = std::pow(opts.base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t t = 0; t < Tn; ++t) {
    const double p = static_cast<double>(t + opts.position_offset);
    for (int64_t i = 0; i < half; ++i) {
      c[i] = std::cos(p * theta[i]);
      s[i] = sign * std::sin(p * theta[i]);
    }
    for (int64_t n = 0; n < N; ++n) {
      const T* xr = x + (n * Tn + t) * D;
      T* yr = y + (n * Tn + t) * D;
      for (int64_t i = 0; i < half; ++i) {
        // pair i: (2i, 2i+1) adjacent, or (i, i + D/2) halves
        const int64_t a = opts.pairing == RotaryPairing::kAdjacent ? 2 * i : i;
        const int64_t b = opts.pairing == RotaryPairing::kAdjacent ? 2 * i + 1 : i + half;
        const double xa = xr[a], xb = xr[b];
        yr[a] = static_cast<T>(xa * c[i] - xb * s[i]);
        yr[b] = static_cast<T>(xa * s[i] + xb * c[i]);
      }
    }
  }
}

template void rotary_apply<float>(const float*, float*, int64_t, int64_t, int64_t,
                                  const RotaryOptions&, double);
template void rotary_apply<double>(const double*, double*, int64_t, int64_t, int64_t,
                                   const RotaryOptions&, double);

}  // namespace attn::ref
