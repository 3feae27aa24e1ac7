// Reference Elman RNN (tanh), forward and backward through time side by side (see rnn.hpp).
#include "kernels/ref/rnn.hpp"

#include "kernels/ref/path_tracer.hpp"

#include <vector>

namespace attn::ref {

template <typename T>
int64_t rnn_tanh_forward(const T* x, const T* h0, const T* W_ih, const T* W_hh, const T* b_ih,
                         const T* b_hh, T* out, int64_t B, int64_t N, int64_t I, int64_t H) {
  using A = accum_t<T>;
  int64_t macs = 0;
  for (int64_t b = 0; b < B; ++b) {
    // Step t needs h_{t-1}, the result of step t-1: the N steps form one dependent chain.
    for (int64_t t = 0; t < N; ++t) {
      const T* xt = x + (b * N + t) * I;
      const T* hprev = t > 0 ? out + (b * N + t - 1) * H : (h0 != nullptr ? h0 + b * H : nullptr);
      T* ht = out + (b * N + t) * H;
      for (int64_t j = 0; j < H; ++j) {
        A acc = b_ih != nullptr ? A(b_ih[j]) + A(b_hh[j]) : A(0.0);
        const T* wi = W_ih + j * I;
        for (int64_t i = 0; i < I; ++i)
          acc += A(xt[i]) * A(wi[i]);
        const T* wh = W_hh + j * H;
        for (int64_t i = 0; i < H; ++i)
          acc += (hprev != nullptr ? A(hprev[i]) : A(0.0)) * A(wh[i]);
        ht[j] = store_tanh<T>(acc);
      }
      macs += H * (I + H);
    }
  }
  return macs;
}

template <typename T>
void rnn_tanh_backward(const T* dout, const T* dh_n, const T* x, const T* h0, const T* W_ih,
                       const T* W_hh, const T* out, T* dx, T* dh0, T* dW_ih, T* dW_hh, T* db_ih,
                       T* db_hh, int64_t B, int64_t N, int64_t I, int64_t H) {
  // Parameter gradients sum over b and t: accumulate in double, store at the end.
  std::vector<double> gW_ih(static_cast<size_t>(H * I), 0.0),
      gW_hh(static_cast<size_t>(H * H), 0.0);
  std::vector<double> gb(static_cast<size_t>(H), 0.0);
  std::vector<double> carry(static_cast<size_t>(H)), da(static_cast<size_t>(H));
  for (int64_t b = 0; b < B; ++b) {
    // carry = dL/dh_t from the future (steps > t), starting with the final state's gradient.
    for (int64_t j = 0; j < H; ++j)
      carry[j] = dh_n != nullptr ? static_cast<double>(dh_n[b * H + j]) : 0.0;
    for (int64_t t = N - 1; t >= 0; --t) {
      const T* ht = out + (b * N + t) * H;
      const T* hprev = t > 0 ? out + (b * N + t - 1) * H : (h0 != nullptr ? h0 + b * H : nullptr);
      const T* xt = x + (b * N + t) * I;
      // forward: h_t = tanh(a_t), a_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
      // so:      da_t = (dout_t + carry) * (1 - h_t^2)          (tanh' = 1 - tanh^2)
      for (int64_t j = 0; j < H; ++j) {
        const double h = ht[j];
        da[j] = (static_cast<double>(dout[(b * N + t) * H + j]) + carry[j]) * (1.0 - h * h);
        gb[j] += da[j];
      }
      //          dx_t = da_t W_ih,   dW_ih += da_t^T x_t
      for (int64_t i = 0; i < I; ++i) {
        double acc = 0.0;
        for (int64_t j = 0; j < H; ++j)
          acc += da[j] * W_ih[j * I + i];
        dx[(b * N + t) * I + i] = static_cast<T>(acc);
      }
      for (int64_t j = 0; j < H; ++j)
        for (int64_t i = 0; i < I; ++i)
          gW_ih[j * I + i] += da[j] * xt[i];
      //          dW_hh += da_t^T h_{t-1},   carry = dL/dh_{t-1} = da_t W_hh
      if (hprev != nullptr) {
        for (int64_t j = 0; j < H; ++j)
          for (int64_t i = 0; i < H; ++i)
            gW_hh[j * H + i] += da[j] * hprev[i];
      }
      for (int64_t i = 0; i < H; ++i) {
        double acc = 0.0;
        for (int64_t j = 0; j < H; ++j)
          acc += da[j] * W_hh[j * H + i];
        carry[i] = acc;
      }
    }
    for (int64_t j = 0; j < H; ++j)
      dh0[b * H + j] = static_cast<T>(carry[j]);
  }
  for (int64_t e = 0; e < H * I; ++e)
    dW_ih[e] = static_cast<T>(gW_ih[e]);
  for (int64_t e = 0; e < H * H; ++e)
    dW_hh[e] = static_cast<T>(gW_hh[e]);
  // b_ih and b_hh enter a_t the same way, so their gradients are equal.
  if (db_ih != nullptr) {
    for (int64_t j = 0; j < H; ++j) {
      db_ih[j] = static_cast<T>(gb[j]);
      db_hh[j] = static_cast<T>(gb[j]);
    }
  }
}

template int64_t rnn_tanh_forward<float>(const float*, const float*, const float*, const float*,
                                         const float*, const float*, float*, int64_t, int64_t,
                                         int64_t, int64_t);
template int64_t rnn_tanh_forward<double>(const double*, const double*, const double*,
                                          const double*, const double*, const double*, double*,
                                          int64_t, int64_t, int64_t, int64_t);
template int64_t rnn_tanh_forward<PathTracer>(const PathTracer*, const PathTracer*,
                                              const PathTracer*, const PathTracer*,
                                              const PathTracer*, const PathTracer*, PathTracer*,
                                              int64_t, int64_t, int64_t, int64_t);
template void rnn_tanh_backward<float>(const float*, const float*, const float*, const float*,
                                       const float*, const float*, const float*, float*, float*,
                                       float*, float*, float*, float*, int64_t, int64_t, int64_t,
                                       int64_t);
template void rnn_tanh_backward<double>(const double*, const double*, const double*, const double*,
                                        const double*, const double*, const double*, double*,
                                        double*, double*, double*, double*, double*, int64_t,
                                        int64_t, int64_t, int64_t);

}  // namespace attn::ref
