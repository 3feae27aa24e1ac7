// Reference scaled dot-product attention (internal): plain loops over (b, t), double
// accumulation, one score row of S doubles as scratch. Inputs are contiguous and validated by
// ops/attention.cpp. Masks arrive as kept-key counts per row (see masked_softmax.hpp).
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

// q (B, T, D), k (B, S, D), v (B, S, Dv) -> out (B, T, Dv), lse (B, T), weights (B, T, S) when
// not null (pre-dropout). kept (B*T) per-row kept-key counts.
//   score[s] = scale * q[t] . k[s] - m |t - s|         (s < kept; m = alibi[b % alibi_heads],
//                                                       0 when alibi is null)
//   w        = masked softmax of score                  (policy for kept == 0)
//   out[t]   = sum_s w[s] * drop(b, t, s) * v[s]        drop = dropout factor of index (bT+t)S+s
template <typename T>
void sdpa_forward(const T* q, const T* k, const T* v, T* out, T* weights, T* lse,
                  const int32_t* kept, kernels::MaskedRows policy, double scale,
                  const AttentionDims& dims, const DropoutSpec& drop, const double* alibi = nullptr,
                  int64_t alibi_heads = 1);

// Gradients of sdpa_forward given dout (B, T, Dv); recomputes the scores and weights.
template <typename T>
void sdpa_backward(const T* dout, const T* q, const T* k, const T* v, T* dq, T* dk, T* dv,
                   const int32_t* kept, kernels::MaskedRows policy, double scale,
                   const AttentionDims& dims, const DropoutSpec& drop,
                   const double* alibi = nullptr, int64_t alibi_heads = 1);

}  // namespace attn::ref
