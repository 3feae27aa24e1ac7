// Reference Elman RNN (tanh) and GRU, forward and backward through time side by side (see
// rnn.hpp).
#include "kernels/ref/rnn.hpp"

#include "kernels/ref/path_tracer.hpp"

#include <cmath>
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

// ----------------------------------------------------------------------------------------------
// GRU

namespace {

double sigmoid(double a) {
  // Both branches divide by 1 + exp(-|a|) in [1, 2]: no overflow for any finite a.
  if (a >= 0.0) return 1.0 / (1.0 + std::exp(-a));
  const double e = std::exp(a);
  return e / (1.0 + e);
}

// The gates of one GRU step from x_t (I) and h_{t-1} (H, or null for zeros):
//   gi = W_ih x_t + b_ih, gh = W_hh h_{t-1} + b_hh (3H each, rows r | z | n),
//   r, z, n (H each) as in rnn.hpp. Everything in double.
template <typename T>
void gru_gates(const T* xt, const T* hprev, const T* W_ih, const T* W_hh, const T* b_ih,
               const T* b_hh, int64_t I, int64_t H, double* gi, double* gh, double* r, double* z,
               double* n) {
  for (int64_t k = 0; k < 3 * H; ++k) {
    double ai = b_ih != nullptr ? static_cast<double>(b_ih[k]) : 0.0;
    const T* wi = W_ih + k * I;
    for (int64_t i = 0; i < I; ++i)
      ai += static_cast<double>(xt[i]) * static_cast<double>(wi[i]);
    double ah = b_hh != nullptr ? static_cast<double>(b_hh[k]) : 0.0;
    if (hprev != nullptr) {
      const T* wh = W_hh + k * H;
      for (int64_t i = 0; i < H; ++i)
        ah += static_cast<double>(hprev[i]) * static_cast<double>(wh[i]);
    }
    gi[k] = ai;
    gh[k] = ah;
  }
  for (int64_t j = 0; j < H; ++j) {
    r[j] = sigmoid(gi[j] + gh[j]);
    z[j] = sigmoid(gi[H + j] + gh[H + j]);
    n[j] = std::tanh(gi[2 * H + j] + r[j] * gh[2 * H + j]);
  }
}

}  // namespace

template <typename T>
int64_t gru_forward(const T* x, const T* h0, const T* W_ih, const T* W_hh, const T* b_ih,
                    const T* b_hh, T* out, int64_t B, int64_t N, int64_t I, int64_t H) {
  const auto H3 = static_cast<size_t>(3 * H), H1 = static_cast<size_t>(H);
  std::vector<double> gi(H3), gh(H3), r(H1), z(H1), n(H1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < N; ++t) {
      const T* xt = x + (b * N + t) * I;
      const T* hprev = t > 0 ? out + (b * N + t - 1) * H : (h0 != nullptr ? h0 + b * H : nullptr);
      gru_gates(xt, hprev, W_ih, W_hh, b_ih, b_hh, I, H, gi.data(), gh.data(), r.data(), z.data(),
                n.data());
      T* ht = out + (b * N + t) * H;
      for (int64_t j = 0; j < H; ++j) {
        const double hp = hprev != nullptr ? static_cast<double>(hprev[j]) : 0.0;
        ht[j] = static_cast<T>((1.0 - z[j]) * n[j] + z[j] * hp);
      }
    }
  }
  return B * N * 3 * H * (I + H);
}

template <typename T>
void gru_backward(const T* dout, const T* dh_n, const T* x, const T* h0, const T* W_ih,
                  const T* W_hh, const T* b_ih, const T* b_hh, const T* out, T* dx, T* dh0,
                  T* dW_ih, T* dW_hh, T* db_ih, T* db_hh, int64_t B, int64_t N, int64_t I,
                  int64_t H) {
  const auto H3 = static_cast<size_t>(3 * H), H1 = static_cast<size_t>(H);
  // Parameter gradients sum over b and t: accumulate in double, store at the end.
  std::vector<double> gW_ih(H3 * static_cast<size_t>(I), 0.0), gW_hh(H3 * H1, 0.0);
  std::vector<double> gb_ih(H3, 0.0), gb_hh(H3, 0.0);
  std::vector<double> gi(H3), gh(H3), r(H1), z(H1), n(H1);
  std::vector<double> dgi(H3), dgh(H3), carry(H1), direct(H1);
  for (int64_t b = 0; b < B; ++b) {
    // carry = dL/dh_t from the future (steps > t), starting with the final state's gradient.
    for (int64_t j = 0; j < H; ++j)
      carry[j] = dh_n != nullptr ? static_cast<double>(dh_n[b * H + j]) : 0.0;
    for (int64_t t = N - 1; t >= 0; --t) {
      const T* xt = x + (b * N + t) * I;
      const T* hprev = t > 0 ? out + (b * N + t - 1) * H : (h0 != nullptr ? h0 + b * H : nullptr);
      gru_gates(xt, hprev, W_ih, W_hh, b_ih, b_hh, I, H, gi.data(), gh.data(), r.data(), z.data(),
                n.data());
      // forward: h_t = (1 - z) n + z h,  n = tanh(a_n),  a_n = gi_n + r gh_n,
      //          r = sigmoid(gi_r + gh_r),  z = sigmoid(gi_z + gh_z)
      // so, with dh = dout_t + carry:
      //          dz = dh (h - n),  dn = dh (1 - z),  dh (direct) = dh z
      //          da_n = dn (1 - n^2):  dgi_n = da_n,  dgh_n = da_n r,  dr = da_n gh_n
      //          da_r = dr r (1 - r),  da_z = dz z (1 - z): dgi and dgh both get them
      for (int64_t j = 0; j < H; ++j) {
        const double dh = static_cast<double>(dout[(b * N + t) * H + j]) + carry[j];
        const double hp = hprev != nullptr ? static_cast<double>(hprev[j]) : 0.0;
        const double da_n = dh * (1.0 - z[j]) * (1.0 - n[j] * n[j]);
        const double da_r = da_n * gh[2 * H + j] * r[j] * (1.0 - r[j]);
        const double da_z = dh * (hp - n[j]) * z[j] * (1.0 - z[j]);
        dgi[j] = dgh[j] = da_r;
        dgi[H + j] = dgh[H + j] = da_z;
        dgi[2 * H + j] = da_n;
        dgh[2 * H + j] = da_n * r[j];
        direct[j] = dh * z[j];
      }
      //          dx_t = dgi W_ih,  dW_ih += dgi^T x_t,  db_ih += dgi
      for (int64_t i = 0; i < I; ++i) {
        double acc = 0.0;
        for (int64_t k = 0; k < 3 * H; ++k)
          acc += dgi[k] * static_cast<double>(W_ih[k * I + i]);
        dx[(b * N + t) * I + i] = static_cast<T>(acc);
      }
      for (int64_t k = 0; k < 3 * H; ++k) {
        for (int64_t i = 0; i < I; ++i)
          gW_ih[k * I + i] += dgi[k] * static_cast<double>(xt[i]);
        gb_ih[k] += dgi[k];
        gb_hh[k] += dgh[k];
      }
      //          dW_hh += dgh^T h_{t-1},  carry = dL/dh_{t-1} = direct + dgh W_hh
      if (hprev != nullptr) {
        for (int64_t k = 0; k < 3 * H; ++k)
          for (int64_t i = 0; i < H; ++i)
            gW_hh[k * H + i] += dgh[k] * static_cast<double>(hprev[i]);
      }
      for (int64_t i = 0; i < H; ++i) {
        double acc = direct[i];
        for (int64_t k = 0; k < 3 * H; ++k)
          acc += dgh[k] * static_cast<double>(W_hh[k * H + i]);
        carry[i] = acc;
      }
    }
    for (int64_t j = 0; j < H; ++j)
      dh0[b * H + j] = static_cast<T>(carry[j]);
  }
  for (int64_t e = 0; e < 3 * H * I; ++e)
    dW_ih[e] = static_cast<T>(gW_ih[e]);
  for (int64_t e = 0; e < 3 * H * H; ++e)
    dW_hh[e] = static_cast<T>(gW_hh[e]);
  // Unlike the RNN's, the two biases get different gradients: b_hn sits inside r * (...).
  if (db_ih != nullptr) {
    for (int64_t k = 0; k < 3 * H; ++k) {
      db_ih[k] = static_cast<T>(gb_ih[k]);
      db_hh[k] = static_cast<T>(gb_hh[k]);
    }
  }
}

template int64_t gru_forward<float>(const float*, const float*, const float*, const float*,
                                    const float*, const float*, float*, int64_t, int64_t, int64_t,
                                    int64_t);
template int64_t gru_forward<double>(const double*, const double*, const double*, const double*,
                                     const double*, const double*, double*, int64_t, int64_t,
                                     int64_t, int64_t);
template void gru_backward<float>(const float*, const float*, const float*, const float*,
                                  const float*, const float*, const float*, const float*,
                                  const float*, float*, float*, float*, float*, float*, float*,
                                  int64_t, int64_t, int64_t, int64_t);
template void gru_backward<double>(const double*, const double*, const double*, const double*,
                                   const double*, const double*, const double*, const double*,
                                   const double*, double*, double*, double*, double*, double*,
                                   double*, int64_t, int64_t, int64_t, int64_t);

}  // namespace attn::ref
