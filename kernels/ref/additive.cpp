// Reference additive attention, forward and backward side by side.
//
// The (B, T, S, H) feature tensor tanh(qp[t] + kp[s]) that d2l materialises is recomputed per
// (t, s) instead: memory stays O(S) per row and the backward recomputes it the same way.
#include "kernels/ref/additive.hpp"

#include "kernels/ref/masked_softmax.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::ref {
namespace {

// score[s] = sum_h w_v[h] tanh(qp[t,h] + kp[s,h]) for s < n.
template <typename T>
void additive_scores(const T* qt, const T* kb, const T* w_v, double* score, int64_t n, int64_t H) {
  for (int64_t s = 0; s < n; ++s) {
    const T* ks = kb + s * H;
    double acc = 0.0;
    for (int64_t h = 0; h < H; ++h)
      acc += static_cast<double>(w_v[h]) * std::tanh(static_cast<double>(qt[h]) + ks[h]);
    score[s] = acc;
  }
}

}  // namespace

template <typename T>
void additive_forward(const T* qp, const T* kp, const T* w_v, const T* v, T* out, T* weights,
                      const int32_t* kept, kernels::MaskedRows policy, const AttentionDims& dims,
                      const DropoutSpec& drop) {
  const auto [B, Tq, S, H, Dv] = dims;
  std::vector<double> score(static_cast<size_t>(S)), w(static_cast<size_t>(S)),
      acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < B; ++b) {
    const T* kb = kp + b * S * H;
    const T* vb = v + b * S * Dv;
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t row = b * Tq + t;
      const int64_t n = kept[row];
      additive_scores(qp + row * H, kb, w_v, score.data(), n, H);
      softmax_row(score.data(), w.data(), n, S, policy);
      for (int64_t s = 0; s < S; ++s)
        weights[row * S + s] = static_cast<T>(w[s]);
      std::fill(acc.begin(), acc.end(), 0.0);
      const int64_t active = active_keys(n, S, policy);
      for (int64_t s = 0; s < active; ++s) {
        const double ws = w[s] * drop.factor(static_cast<uint64_t>(row * S + s));
        const T* vs = vb + s * Dv;
        for (int64_t e = 0; e < Dv; ++e)
          acc[e] += ws * vs[e];
      }
      for (int64_t e = 0; e < Dv; ++e)
        out[row * Dv + e] = static_cast<T>(acc[e]);
    }
  }
}

template <typename T>
void additive_backward(const T* dout, const T* qp, const T* kp, const T* w_v, const T* v, T* dqp,
                       T* dkp, T* dw_v, T* dv, const int32_t* kept, kernels::MaskedRows policy,
                       const AttentionDims& dims, const DropoutSpec& drop) {
  const auto [B, Tq, S, H, Dv] = dims;
  std::vector<double> dkp_acc(static_cast<size_t>(B * S * H), 0.0);
  std::vector<double> dv_acc(static_cast<size_t>(B * S * Dv), 0.0);
  std::vector<double> dwv_acc(static_cast<size_t>(H), 0.0);
  std::vector<double> score(static_cast<size_t>(S)), w(static_cast<size_t>(S)),
      dw(static_cast<size_t>(S)), dq_acc(static_cast<size_t>(H));
  for (int64_t b = 0; b < B; ++b) {
    const T* kb = kp + b * S * H;
    const T* vb = v + b * S * Dv;
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t row = b * Tq + t;
      const int64_t n = kept[row];
      const T* qt = qp + row * H;
      const T* go = dout + row * Dv;
      additive_scores(qt, kb, w_v, score.data(), n, H);
      softmax_row(score.data(), w.data(), n, S, policy);
      const int64_t active = active_keys(n, S, policy);
      // forward: out[t] = sum_s w[s] f[s] v[s]
      // so:      dv[s] += w[s] f[s] dout[t];   dw[s] = f[s] (dout[t] . v[s])
      for (int64_t s = 0; s < active; ++s) {
        const double fs = drop.factor(static_cast<uint64_t>(row * S + s));
        const T* vs = vb + s * Dv;
        double* dvs = dv_acc.data() + (b * S + s) * Dv;
        double g = 0.0;
        for (int64_t e = 0; e < Dv; ++e) {
          dvs[e] += w[s] * fs * go[e];
          g += static_cast<double>(go[e]) * vs[e];
        }
        dw[s] = fs * g;
      }
      // forward: w = softmax(score) over s < n
      // so:      dscore[s] = w[s] (dw[s] - sum_s' w[s'] dw[s'])
      double wdw = 0.0;
      for (int64_t s = 0; s < n; ++s)
        wdw += w[s] * dw[s];
      // forward: score[s] = sum_h w_v[h] a[h],  a[h] = tanh(qp[t,h] + kp[s,h])
      // so:      dw_v[h] += dscore a[h];  dqp[t,h] += dscore w_v[h] (1 - a[h]^2);  dkp[s,h] same
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (int64_t s = 0; s < n; ++s) {
        const double ds = w[s] * (dw[s] - wdw);
        const T* ks = kb + s * H;
        double* dks = dkp_acc.data() + (b * S + s) * H;
        for (int64_t h = 0; h < H; ++h) {
          const double a = std::tanh(static_cast<double>(qt[h]) + ks[h]);
          const double dpre = ds * w_v[h] * (1.0 - a * a);
          dwv_acc[h] += ds * a;
          dq_acc[h] += dpre;
          dks[h] += dpre;
        }
      }
      for (int64_t h = 0; h < H; ++h)
        dqp[row * H + h] = static_cast<T>(dq_acc[h]);
    }
  }
  for (size_t i = 0; i < dkp_acc.size(); ++i)
    dkp[i] = static_cast<T>(dkp_acc[i]);
  for (size_t i = 0; i < dv_acc.size(); ++i)
    dv[i] = static_cast<T>(dv_acc[i]);
  for (size_t i = 0; i < dwv_acc.size(); ++i)
    dw_v[i] = static_cast<T>(dwv_acc[i]);
}

template void additive_forward<float>(const float*, const float*, const float*, const float*,
                                      float*, float*, const int32_t*, kernels::MaskedRows,
                                      const AttentionDims&, const DropoutSpec&);
template void additive_forward<double>(const double*, const double*, const double*, const double*,
                                       double*, double*, const int32_t*, kernels::MaskedRows,
                                       const AttentionDims&, const DropoutSpec&);
template void additive_backward<float>(const float*, const float*, const float*, const float*,
                                       const float*, float*, float*, float*, float*, const int32_t*,
                                       kernels::MaskedRows, const AttentionDims&,
                                       const DropoutSpec&);
template void additive_backward<double>(const double*, const double*, const double*, const double*,
                                        const double*, double*, double*, double*, double*,
                                        const int32_t*, kernels::MaskedRows, const AttentionDims&,
                                        const DropoutSpec&);

}  // namespace attn::ref
