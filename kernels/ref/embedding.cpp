// Reference embedding lookup, forward and backward side by side (see embedding.hpp).
#include "kernels/ref/embedding.hpp"

#include <cstddef>
#include <vector>

namespace attn::ref {

template <typename Id, typename T>
void embedding_forward(const Id* ids, const T* weight, T* out, int64_t N, int64_t E) {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = weight + static_cast<int64_t>(ids[n]) * E;
    for (int64_t e = 0; e < E; ++e)
      out[n * E + e] = row[e];
  }
}

template <typename Id, typename T>
void embedding_backward(const T* dout, const Id* ids, T* dweight, int64_t N, int64_t V, int64_t E) {
  // forward: out[n] = weight[ids[n]], so every position adds its gradient to the row it read;
  // a token seen k times collects k contributions (summed in double, in position order).
  std::vector<double> acc(static_cast<size_t>(V * E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double* row = acc.data() + static_cast<int64_t>(ids[n]) * E;
    for (int64_t e = 0; e < E; ++e)
      row[e] += dout[n * E + e];
  }
  for (int64_t i = 0; i < V * E; ++i)
    dweight[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
}

#define ATTN_EMBEDDING_INSTANTIATE(Id, T)                                            \
  template void embedding_forward<Id, T>(const Id*, const T*, T*, int64_t, int64_t); \
  template void embedding_backward<Id, T>(const T*, const Id*, T*, int64_t, int64_t, int64_t);
ATTN_EMBEDDING_INSTANTIATE(int32_t, float)
ATTN_EMBEDDING_INSTANTIATE(int32_t, double)
ATTN_EMBEDDING_INSTANTIATE(int64_t, float)
ATTN_EMBEDDING_INSTANTIATE(int64_t, double)
#undef ATTN_EMBEDDING_INSTANTIATE

}  // namespace attn::ref
