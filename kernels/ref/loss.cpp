// Reference softmax cross-entropy, forward and backward side by side (see loss.hpp).
#include "kernels/ref/loss.hpp"

#include <cmath>

namespace attn::ref {

// Shifted by the max so logits of +-1e4 stay finite.
template <typename T>
double logsumexp_row(const T* row, int64_t C) {
  double m = row[0];
  for (int64_t c = 1; c < C; ++c)
    m = row[c] > m ? static_cast<double>(row[c]) : m;
  if (std::isinf(m)) return m;  // all -inf gives -inf; any +inf gives +inf
  double s = 0.0;
  for (int64_t c = 0; c < C; ++c)
    s += std::exp(row[c] - m);
  return m + std::log(s);
}
template double logsumexp_row<float>(const float*, int64_t);
template double logsumexp_row<double>(const double*, int64_t);

template <typename Id, typename T>
double cross_entropy_forward(const T* logits, const Id* targets, const uint8_t* keep, int64_t N,
                             int64_t C) {
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    if (!keep[n]) continue;
    const T* row = logits + n * C;
    // -log softmax(row)[y] = logsumexp(row) - row[y]
    total += logsumexp_row(row, C) - static_cast<double>(row[targets[n]]);
  }
  return total;
}

template <typename Id, typename T>
void cross_entropy_backward(const T* logits, const Id* targets, const uint8_t* keep, T* dlogits,
                            int64_t N, int64_t C, double scale) {
  for (int64_t n = 0; n < N; ++n) {
    T* drow = dlogits + n * C;
    if (!keep[n]) {
      for (int64_t c = 0; c < C; ++c)
        drow[c] = T(0);
      continue;
    }
    // forward: loss_n = logsumexp(z) - z[y];  d/dz[c] = softmax(z)[c] - [c == y]
    const T* row = logits + n * C;
    const double lse = logsumexp_row(row, C);
    for (int64_t c = 0; c < C; ++c) {
      const double p = std::exp(row[c] - lse);
      drow[c] = static_cast<T>(scale * (p - (c == static_cast<int64_t>(targets[n]) ? 1.0 : 0.0)));
    }
  }
}

#define ATTN_LOSS_INSTANTIATE(Id, T)                                                            \
  template double cross_entropy_forward<Id, T>(const T*, const Id*, const uint8_t*, int64_t,    \
                                               int64_t);                                        \
  template void cross_entropy_backward<Id, T>(const T*, const Id*, const uint8_t*, T*, int64_t, \
                                              int64_t, double);
ATTN_LOSS_INSTANTIATE(int32_t, float)
ATTN_LOSS_INSTANTIATE(int32_t, double)
ATTN_LOSS_INSTANTIATE(int64_t, float)
ATTN_LOSS_INSTANTIATE(int64_t, double)
#undef ATTN_LOSS_INSTANTIATE

}  // namespace attn::ref
