// Reference masked softmax, forward and backward side by side (see masked_softmax.hpp).
#include "kernels/ref/masked_softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attn::ref {

double softmax_row(const double* score, double* w, int64_t kept, int64_t S,
                   kernels::MaskedRows policy) {
  if (kept == 0) {
    // d2l writes -1e6 into every slot, so all scores tie: 1/S over all keys, padding included.
    const double fill =
        policy == kernels::MaskedRows::kUniform ? 1.0 / static_cast<double>(S) : 0.0;
    for (int64_t s = 0; s < S; ++s)
      w[s] = fill;
    return -std::numeric_limits<double>::infinity();
  }
  // m = max over kept scores. std::max(m, NaN) keeps m; the NaN then reaches the sum through
  // exp(NaN - m), so a NaN kept score makes the row NaN, as softmax should.
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s < kept; ++s)
    m = std::max(m, score[s]);
  double sum = 0.0;
  for (int64_t s = 0; s < kept; ++s) {
    w[s] = std::exp(score[s] - m);
    sum += w[s];
  }
  const double inv = 1.0 / sum;
  for (int64_t s = 0; s < kept; ++s)
    w[s] *= inv;
  for (int64_t s = kept; s < S; ++s)
    w[s] = 0.0;  // masked weights are exactly zero
  return m + std::log(sum);
}

template <typename T>
void masked_softmax_forward(const T* X, T* Y, const int32_t* kept, kernels::MaskedRows policy,
                            int64_t rows, int64_t S) {
  std::vector<double> score(static_cast<size_t>(S)), w(static_cast<size_t>(S));
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = X + r * S;
    T* y = Y + r * S;
    for (int64_t s = 0; s < kept[r]; ++s)
      score[s] = static_cast<double>(x[s]);
    softmax_row(score.data(), w.data(), kept[r], S, policy);
    for (int64_t s = 0; s < S; ++s)
      y[s] = static_cast<T>(w[s]);  // round once
  }
}

template <typename T>
void masked_softmax_backward(const T* dY, const T* Y, T* dX, const int32_t* kept, int64_t rows,
                             int64_t S) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* dy = dY + r * S;
    const T* y = Y + r * S;
    T* dx = dX + r * S;
    const int64_t n = kept[r];
    // forward: y[s] = exp(x[s]) / sum_{s'<n} exp(x[s'])  for s < n
    // so:      dx[s] = y[s] * (dy[s] - sum_{s'<n} dy[s'] y[s'])
    // Masked slots and kept == 0 rows are constants of x (d2l overwrites them): zero gradient.
    double dot = 0.0;
    for (int64_t s = 0; s < n; ++s)
      dot += static_cast<double>(dy[s]) * y[s];
    for (int64_t s = 0; s < n; ++s)
      dx[s] = static_cast<T>(y[s] * (dy[s] - dot));
    for (int64_t s = n; s < S; ++s)
      dx[s] = T(0);
  }
}

template void masked_softmax_forward<float>(const float*, float*, const int32_t*,
                                            kernels::MaskedRows, int64_t, int64_t);
template void masked_softmax_forward<double>(const double*, double*, const int32_t*,
                                             kernels::MaskedRows, int64_t, int64_t);
template void masked_softmax_backward<float>(const float*, const float*, float*, const int32_t*,
                                             int64_t, int64_t);
template void masked_softmax_backward<double>(const double*, const double*, double*, const int32_t*,
                                              int64_t, int64_t);

}  // namespace attn::ref
