// Reference masked softmax (internal): plain loops, double accumulation. The oracle that every
// fast path is tested against. Validation happens in ops/masked_softmax.cpp; nothing here throws.
//
// Glossary: B batch, T queries (rows per batch), S keys (the softmax axis).
//
// Masks reach the kernels as one number per row, `kept[b*T + t]`: the row keeps keys
// [0, kept) and masks [kept, S). Every mask attn supports is such a prefix: d2l's valid_lens
// keep s iff float(s) < len, causal keeps s iff s <= t, and their AND is the shorter prefix.
// A row with kept == 0 follows the kernels::MaskedRows (uniform 1/S or zeros).
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstdint>

namespace attn::ref {

// One row of the masked softmax, in double: w[0..S) from score[0..kept) (the rest unread, so a
// NaN in a masked score cannot leak). Returns the row's logsumexp over kept keys, -inf when
// kept == 0 (whatever the policy; see docs/ops.md).
//   kept > 0:  w[s] = exp(score[s] - m) / sum_{s' < kept} exp(score[s'] - m), m = max score
//              (subtracting the max keeps logits of +-1e4 finite); w[s >= kept] = 0.
//   kept == 0: w[s] = 1/S (kUniform) or 0 (kZero).
double softmax_row(const double* score, double* w, int64_t kept, int64_t S,
                   kernels::MaskedRows policy);

// The keys a row reads after the softmax: [0, n) for a softmax row; all S for a kUniform row
// without kept keys (each weighs 1/S); none for a kZero row without kept keys.
inline int64_t active_keys(int64_t kept, int64_t S, kernels::MaskedRows policy) {
  if (kept > 0) return kept;
  return policy == kernels::MaskedRows::kUniform ? S : 0;
}

// Y (B*T, S) = masked_softmax(X); X and Y contiguous.
template <typename T>
void masked_softmax_forward(const T* X, T* Y, const int32_t* kept, kernels::MaskedRows policy,
                            int64_t rows, int64_t S);

// dX = mask * Y * (dY - sum_s dY * Y); zero for masked keys and for rows without kept keys.
template <typename T>
void masked_softmax_backward(const T* dY, const T* Y, T* dX, const int32_t* kept, int64_t rows,
                             int64_t S);

}  // namespace attn::ref
