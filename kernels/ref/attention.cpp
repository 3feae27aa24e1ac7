// Reference scaled dot-product attention, forward and backward side by side.
//
// Per query row (b, t), with n = kept keys:
//   score[s] = scale * sum_d q[b,t,d] k[b,s,d] - m |t - s|        s < n (m: ALiBi slope or 0)
//   w[s]     = exp(score[s] - lse) for s < n, 0 for s >= n        lse = log sum_{s<n} exp(score)
//              (n == 0: w = 1/S everywhere (kUniform) or 0 (kZero))
//   out[b,t] = sum_s w[s] f[s] v[b,s]                             f = dropout factor
// Keys s >= n are never read when n > 0, so NaN or Inf in padding cannot leak into the output
// (PyTorch's SDPA lets it through: pytorch#101967).
#include "kernels/ref/attention.hpp"

#include "kernels/ref/masked_softmax.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::ref {
namespace {

// slope: ALiBi's m for this row's head (0: no bias); t: the query's position.
template <typename T>
void score_row(const T* qt, const T* kb, double* score, int64_t n, int64_t D, double scale,
               double slope, int64_t t) {
  for (int64_t s = 0; s < n; ++s) {
    const T* ks = kb + s * D;
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d)
      dot += static_cast<double>(qt[d]) * ks[d];
    score[s] = dot * scale;
    if (slope != 0.0) score[s] -= slope * static_cast<double>(t > s ? t - s : s - t);
  }
}

// The multiplier of weight (b, t, s): 1 without dropout, else 0 or 1 / (1 - p) from the stream.
double dropout_factor(const kernels::AttentionProblem& p, double dropout, int64_t b, int64_t t,
                      int64_t s) {
  if (!(p.dropout > 0.0f)) return 1.0;
  if (dropout >= 1.0) return 0.0;
  return dropout_keep(p.seed, p.offset, p.dropout_index(b, t, s), static_cast<float>(dropout))
             ? 1.0 / (1.0 - dropout)
             : 0.0;
}

}  // namespace

template <typename T>
void sdpa_forward(const AttentionCall<T>& c) {
  const kernels::AttentionProblem& p = c.problem;
  const int64_t B = p.B, Tq = p.T, S = p.S, D = p.D, Dv = p.Dv;
  const double scale = c.scale;
  std::vector<double> score(static_cast<size_t>(S)), w(static_cast<size_t>(S)),
      acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < B; ++b) {
    const T* kb = c.k + b * S * D;
    const T* vb = c.v + b * S * Dv;
    const double slope = c.alibi != nullptr ? c.alibi[b % c.alibi_heads] : 0.0;
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t row = b * Tq + t;
      const int64_t n = p.row_limit(b, t);
      // QDotK: score (S) of this query against its kept keys (minus ALiBi's distance bias).
      score_row(c.q + row * D, kb, score.data(), n, D, scale, slope, t);
      // Softmax over kept keys (the pre-dropout weights d2l stores).
      c.lse[row] = static_cast<T>(softmax_row(score.data(), w.data(), n, S, p.masked_rows));
      if (c.weights != nullptr) {
        for (int64_t s = 0; s < S; ++s)
          c.weights[row * S + s] = static_cast<T>(w[s]);
      }
      // WeightedSumV: out[t] = sum_s w[s] f[s] v[s] over the keys the row reads.
      std::fill(acc.begin(), acc.end(), 0.0);
      const int64_t active = active_keys(n, S, p.masked_rows);
      for (int64_t s = 0; s < active; ++s) {
        const double ws = w[s] * dropout_factor(p, c.dropout, b, t, s);
        const T* vs = vb + s * Dv;
        for (int64_t e = 0; e < Dv; ++e)
          acc[e] += ws * vs[e];
      }
      for (int64_t e = 0; e < Dv; ++e)
        c.out[row * Dv + e] = static_cast<T>(acc[e]);
    }
  }
}

template <typename T>
void sdpa_backward(const AttentionCall<T>& c) {
  const kernels::AttentionProblem& p = c.problem;
  const int64_t B = p.B, Tq = p.T, S = p.S, D = p.D, Dv = p.Dv;
  const double scale = c.scale;
  // dk and dv collect contributions from every query row: accumulate in double, round at the end.
  std::vector<double> dk_acc(static_cast<size_t>(B * S * D), 0.0);
  std::vector<double> dv_acc(static_cast<size_t>(B * S * Dv), 0.0);
  std::vector<double> score(static_cast<size_t>(S)), w(static_cast<size_t>(S)),
      dw(static_cast<size_t>(S)), dq_acc(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    const T* kb = c.k + b * S * D;
    const T* vb = c.v + b * S * Dv;
    const double slope = c.alibi != nullptr ? c.alibi[b % c.alibi_heads] : 0.0;
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t row = b * Tq + t;
      const int64_t n = p.row_limit(b, t);
      const T* qt = c.q + row * D;
      const T* go = c.dout + row * Dv;
      // Recompute the forward's weights (the ALiBi bias is a constant: it has no gradient).
      score_row(qt, kb, score.data(), n, D, scale, slope, t);
      softmax_row(score.data(), w.data(), n, S, p.masked_rows);
      const int64_t active = active_keys(n, S, p.masked_rows);
      // forward: out[t] = sum_s w[s] f[s] v[s]
      // so:      dv[s] += w[s] f[s] dout[t];   dw[s] = f[s] (dout[t] . v[s])
      for (int64_t s = 0; s < active; ++s) {
        const double fs = dropout_factor(p, c.dropout, b, t, s);
        const T* vs = vb + s * Dv;
        double* dvs = dv_acc.data() + (b * S + s) * Dv;
        double g = 0.0;
        for (int64_t e = 0; e < Dv; ++e) {
          dvs[e] += w[s] * fs * go[e];
          g += static_cast<double>(go[e]) * vs[e];
        }
        dw[s] = fs * g;
      }
      // forward: w = softmax(score) over s < n  (n == 0: w is a constant of the scores)
      // so:      dscore[s] = w[s] (dw[s] - sum_s' w[s'] dw[s'])    for s < n
      double wdw = 0.0;
      for (int64_t s = 0; s < n; ++s)
        wdw += w[s] * dw[s];
      // forward: score[s] = scale * q[t] . k[s]
      // so:      dq[t] += scale dscore[s] k[s];  dk[s] += scale dscore[s] q[t]
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (int64_t s = 0; s < n; ++s) {
        const double ds = w[s] * (dw[s] - wdw) * scale;
        const T* ks = kb + s * D;
        double* dks = dk_acc.data() + (b * S + s) * D;
        for (int64_t d = 0; d < D; ++d) {
          dq_acc[d] += ds * ks[d];
          dks[d] += ds * qt[d];
        }
      }
      for (int64_t d = 0; d < D; ++d)
        c.dq[row * D + d] = static_cast<T>(dq_acc[d]);
    }
  }
  for (size_t i = 0; i < dk_acc.size(); ++i)
    c.dk[i] = static_cast<T>(dk_acc[i]);
  for (size_t i = 0; i < dv_acc.size(); ++i)
    c.dv[i] = static_cast<T>(dv_acc[i]);
}

template void sdpa_forward<float>(const AttentionCall<float>&);
template void sdpa_forward<double>(const AttentionCall<double>&);
template void sdpa_backward<float>(const AttentionCall<float>&);
template void sdpa_backward<double>(const AttentionCall<double>&);

}  // namespace attn::ref
