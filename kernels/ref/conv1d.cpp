// Reference 1-D convolution, forward and backward side by side (see conv1d.hpp).
#include "kernels/ref/conv1d.hpp"

#include "kernels/ref/path_tracer.hpp"

namespace attn::ref {

template <typename T>
int64_t conv1d_forward(const T* x, const T* W, const T* b, T* y, int64_t B, int64_t N, int64_t Ci,
                       int64_t Co, int64_t K) {
  using A = accum_t<T>;
  const int64_t P = (K - 1) / 2;
  int64_t macs = 0;
  for (int64_t bb = 0; bb < B; ++bb) {
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t o = 0; o < Co; ++o) {
        A acc = b != nullptr ? A(b[o]) : A(0.0);
        for (int64_t j = 0; j < K; ++j) {
          // Tap j reads position s = t + j - P of the zero-padded sequence.
          const int64_t s = t + j - P;
          const bool inside = s >= 0 && s < N;
          const T* xs = x + (bb * N + (inside ? s : 0)) * Ci;
          const T* w = W + o * Ci * K + j;  // W[o, i, j] = w[i * K]
          for (int64_t i = 0; i < Ci; ++i)
            acc += (inside ? A(xs[i]) : A(0.0)) * A(w[i * K]);
          macs += Ci;
        }
        y[(bb * N + t) * Co + o] = store_step<T>(acc);
      }
    }
  }
  return macs;
}

template <typename T>
void conv1d_backward(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t B, int64_t N,
                     int64_t Ci, int64_t Co, int64_t K) {
  const int64_t P = (K - 1) / 2;
  // forward: y[b,t,o] = b[o] + sum_j sum_i W[o,i,j] x[b, t+j-P, i]
  // so:      dx[b,s,i] = sum_j sum_o dy[b, s-j+P, o] W[o,i,j]   over the t = s-j+P in [0, N)
  for (int64_t bb = 0; bb < B; ++bb) {
    for (int64_t s = 0; s < N; ++s) {
      for (int64_t i = 0; i < Ci; ++i) {
        double acc = 0.0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t t = s - j + P;
          if (t < 0 || t >= N) continue;  // that output does not exist: no term
          const T* dyt = dy + (bb * N + t) * Co;
          for (int64_t o = 0; o < Co; ++o)
            acc += static_cast<double>(dyt[o]) * W[(o * Ci + i) * K + j];
        }
        dx[(bb * N + s) * Ci + i] = static_cast<T>(acc);
      }
    }
  }
  //          dW[o,i,j] = sum_b sum_t dy[b,t,o] x[b, t+j-P, i]   (padded x contributes 0)
  for (int64_t o = 0; o < Co; ++o) {
    for (int64_t i = 0; i < Ci; ++i) {
      for (int64_t j = 0; j < K; ++j) {
        double acc = 0.0;
        for (int64_t bb = 0; bb < B; ++bb) {
          for (int64_t t = 0; t < N; ++t) {
            const int64_t s = t + j - P;
            if (s < 0 || s >= N) continue;
            acc += static_cast<double>(dy[(bb * N + t) * Co + o]) * x[(bb * N + s) * Ci + i];
          }
        }
        dW[(o * Ci + i) * K + j] = static_cast<T>(acc);
      }
    }
  }
  //          db[o] = sum_b sum_t dy[b,t,o]
  if (db != nullptr) {
    for (int64_t o = 0; o < Co; ++o) {
      double acc = 0.0;
      for (int64_t r = 0; r < B * N; ++r)
        acc += dy[r * Co + o];
      db[o] = static_cast<T>(acc);
    }
  }
}

template int64_t conv1d_forward<float>(const float*, const float*, const float*, float*, int64_t,
                                       int64_t, int64_t, int64_t, int64_t);
template int64_t conv1d_forward<double>(const double*, const double*, const double*, double*,
                                        int64_t, int64_t, int64_t, int64_t, int64_t);
template int64_t conv1d_forward<PathTracer>(const PathTracer*, const PathTracer*, const PathTracer*,
                                            PathTracer*, int64_t, int64_t, int64_t, int64_t,
                                            int64_t);
template void conv1d_backward<float>(const float*, const float*, const float*, float*, float*,
                                     float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void conv1d_backward<double>(const double*, const double*, const double*, double*, double*,
                                      double*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace attn::ref
