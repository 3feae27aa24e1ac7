// Reference linear layer, forward and backward side by side (see linear.hpp).
#include "kernels/ref/linear.hpp"

namespace attn::ref {

template <typename T>
void linear_forward(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t I, int64_t O) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * I;
    for (int64_t o = 0; o < O; ++o) {
      const T* wo = W + o * I;
      double acc = b != nullptr ? static_cast<double>(b[o]) : 0.0;
      for (int64_t i = 0; i < I; ++i)
        acc += static_cast<double>(xn[i]) * wo[i];
      y[n * O + o] = static_cast<T>(acc);
    }
  }
}

template <typename T>
void linear_backward(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t I,
                     int64_t O) {
  // forward: y[n,o] = b[o] + sum_i x[n,i] W[o,i]
  // so:      dx[n,i] = sum_o dy[n,o] W[o,i]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      double acc = 0.0;
      for (int64_t o = 0; o < O; ++o)
        acc += static_cast<double>(dy[n * O + o]) * W[o * I + i];
      dx[n * I + i] = static_cast<T>(acc);
    }
  }
  //          dW[o,i] = sum_n dy[n,o] x[n,i]
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t i = 0; i < I; ++i) {
      double acc = 0.0;
      for (int64_t n = 0; n < N; ++n)
        acc += static_cast<double>(dy[n * O + o]) * x[n * I + i];
      dW[o * I + i] = static_cast<T>(acc);
    }
  }
  //          db[o] = sum_n dy[n,o]
  if (db != nullptr) {
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t n = 0; n < N; ++n)
        acc += dy[n * O + o];
      db[o] = static_cast<T>(acc);
    }
  }
}

template void linear_forward<float>(const float*, const float*, const float*, float*, int64_t,
                                    int64_t, int64_t);
template void linear_forward<double>(const double*, const double*, const double*, double*, int64_t,
                                     int64_t, int64_t);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*,
                                     float*, int64_t, int64_t, int64_t);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*,
                                      double*, int64_t, int64_t, int64_t);

}  // namespace attn::ref
