// Reference additive (Bahdanau) attention (internal), after d2l's W_q, W_k projections.
//
// Glossary: B batch, T queries, S keys, H hidden width (d2l's num_hiddens), Dv value width.
#pragma once

#include "kernels/ref/attention.hpp"

namespace attn::ref {

// qp (B, T, H), kp (B, S, H), w_v (H), v (B, S, Dv) -> out (B, T, Dv), weights (B, T, S)
// (pre-dropout; always written). dims.D is H.
//   score[s] = sum_h w_v[h] tanh(qp[t,h] + kp[s,h])        s < kept (no scaling)
//   w = masked softmax(score);  out[t] = sum_s w[s] f[s] v[s]
template <typename T>
void additive_forward(const T* qp, const T* kp, const T* w_v, const T* v, T* out, T* weights,
                      const int32_t* kept, kernels::MaskedRows policy, const AttentionDims& dims,
                      const DropoutSpec& drop);

// Gradients dqp (B, T, H), dkp (B, S, H), dw_v (H), dv (B, S, Dv); recomputes the scores.
template <typename T>
void additive_backward(const T* dout, const T* qp, const T* kp, const T* w_v, const T* v, T* dqp,
                       T* dkp, T* dw_v, T* dv, const int32_t* kept, kernels::MaskedRows policy,
                       const AttentionDims& dims, const DropoutSpec& drop);

}  // namespace attn::ref
