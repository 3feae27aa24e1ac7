// Reference scaled dot-product attention (internal), the oracle of the fused kernels: plain loops
// over (b, t), double accumulation, one score row of S doubles as scratch. It takes the kernels'
// problem description (kernels/attention_problem.hpp), so ops/attention.cpp builds one problem
// for both (ops/attention_kernel.hpp) and the tests run every case on it and on every kernel
// (tests/test_attention_cases.cpp). Inputs are contiguous and validated by the ops layer.
//
// Glossary: B batch, T queries, S keys/values, D query/key width, Dv value width.
#pragma once

#include "kernels/attention_problem.hpp"
#include "kernels/ref/dropout.hpp"

#include <cstdint>

namespace attn::ref {

struct AttentionDims {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0;
};

// One call of the oracle: the problem description the fused kernels take
// (kernels/attention_problem.hpp: shapes, kept-key prefix mask with causal, masked-row policy,
// dropout stream with its index base and window) on contiguous tensors of T (float or double),
// plus what only the oracle has: the scale and the dropout probability in double (exact for
// float64 inputs; the kernels take them rounded to float) and ALiBi. problem.heads is ignored
// (rows are contiguous); problem.scale and problem.dropout are ignored in favour of the doubles
// (dropout acts iff problem.dropout > 0, as in the kernels).
template <typename T>
struct AttentionCall {
  kernels::AttentionProblem problem;
  double scale = 1.0, dropout = 0.0;
  const double* alibi = nullptr;  // (alibi_heads) slopes: score -= alibi[b % alibi_heads] |t - s|
  int64_t alibi_heads = 1;
  const T *q = nullptr, *k = nullptr, *v = nullptr;      // (B, T, D), (B, S, D), (B, S, Dv)
  T *out = nullptr, *lse = nullptr, *weights = nullptr;  // forward: (B, T, Dv), (B, T), (B, T, S)
  const T* dout = nullptr;                               // backward: (B, T, Dv) in
  T *dq = nullptr, *dk = nullptr, *dv = nullptr;         // backward: shapes of q, k, v out
};

// q, k, v -> out, lse and (when not null, pre-dropout) weights. Per row (b, t), n = kept keys:
//   score[s] = scale * q[t] . k[s] - m |t - s|         (s < n; m = alibi[b % alibi_heads] or 0)
//   w        = masked softmax of score                  (masked-row policy for n == 0)
//   out[t]   = sum_s w[s] * drop(b, t, s) * v[s]        drop: the problem's dropout stream
template <typename T>
void sdpa_forward(const AttentionCall<T>& c);

// dq, dk, dv from dout, q, k, v (recomputes the scores and weights; out and lse are not read).
template <typename T>
void sdpa_backward(const AttentionCall<T>& c);

}  // namespace attn::ref
