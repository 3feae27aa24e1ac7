// Scaled dot-product attention (d2l DotProductAttention; PyTorch F.scaled_dot_product_attention).
//
//   q (B, T, D), k (B, S, D), v (B, S, Dv)   float32, float64 or bfloat16 (all three alike), any
//   strides
//   out (B, T, Dv) = dropout(masked_softmax(q k^T * scale [- alibi])) v,  scale = 1/sqrt(D) by
//   default; alibi[b, t, s] = m_{b % H} |t - s| when AttentionOptions::alibi_slopes is set
//
// Masks are those of masked_softmax (valid_lens (B,) or (B, T), causal, fully-masked-row policy).
// Dropout acts on the weights, only when `training` and p > 0, as inverted dropout drawn from the
// Philox dropout stream (attn/core/rng.hpp) with index base + (b*T + t)*S + s, base =
// ctx.dropout_index_base(lens_repeat * T * S) (0 unless a data-parallel shard sets the Context's
// sample window; a sample is lens_repeat rows, MultiHeadAttention's H head copies); p = 1 gives
// zeros.
// `weights` (B, T, S) are returned pre-dropout (as d2l stores attention_weights) when
// need_weights is set. `logsumexp` (B, T) is always returned: lse[b,t] = log sum_s exp(score)
// over kept keys (for the fast backward and for merging key blocks); -inf for rows without keys.
//
// bfloat16 (DType::BF16) q, k, v: output and gradients are BF16; logsumexp and the weights are
// float32 (exact enough to check that rows sum to 1, and what the backward needs). Backend::kCpu
// and kAuto (without need_weights) run the fused bf16 kernel: bf16 dot products with float32
// accumulation (AVX512-BF16 where the CPU has it; the weights P are rounded to bf16 once before
// P V, so expect up to 2^-8 relative error per weight, see docs/kernels-cpu.md), its backward
// through the float32 kernel. kReference (and kAuto with need_weights, or ALiBi) widens the inputs
// to float64 exactly, runs the reference and rounds. Mixed dtypes are an Error.
//
// d2l: DotProductAttention(dropout)(q, k, v, valid_lens).
// PyTorch: F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding_mask, dropout_p,
// is_causal).
// Implementation: ops/attention.cpp (validation and dispatch), then ops/attention_kernel.hpp.
#pragma once

#include "attn/ops/masked_softmax.hpp"

#include <optional>

namespace attn {

struct AttentionOptions {
  MaskOptions mask;
  double dropout = 0.0;         // probability of dropping a weight, in [0, 1]
  bool training = false;        // dropout only acts in training
  bool need_weights = false;    // fill AttentionResult::weights
  std::optional<double> scale;  // default 1/sqrt(D)
  // ALiBi (Press et al. 2022; attn/ops/relative_position.hpp): undefined, or (H) float slopes
  // with B % H == 0. Adds -alibi_slopes[b % H] * |t - s| to score[b, t, s] after the scaling and
  // before the mask (b % H is the head inside MultiHeadAttention, whose batch index is b*H + h).
  // The bias is a constant of q and k, so the backward only recomputes it. Reference kernel only.
  Tensor alibi_slopes;
};

struct AttentionResult {
  Tensor output;                // (B, T, Dv)
  Tensor weights;               // (B, T, S) pre-dropout, when need_weights
  Tensor logsumexp;             // (B, T), float32 or float64 as q
  uint64_t dropout_offset = 0;  // the stream offset the forward used (backward redraws the mask)
  // Internal to the fused multi-head path (float32 on AVX-512, bf16 native): the forward's
  // dropout decisions as raw 16-bit
  // words (kernels/attention_problem.hpp's AttentionArgs::dropout_keep) in an I32 tensor, which
  // its backward reads instead of drawing the stream again. Undefined elsewhere.
  Tensor dropout_keep;
};

AttentionResult scaled_dot_product_attention(Context& ctx, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const AttentionOptions& opts = {});

struct AttentionGrads {
  Tensor dq, dk, dv;  // shapes of q, k, v; contiguous
};

// Backward of scaled_dot_product_attention from the forward's inputs and result (output and
// logsumexp; the mask and dropout are redrawn from opts and result.dropout_offset).
AttentionGrads scaled_dot_product_attention_backward(Context& ctx, const Tensor& dout,
                                                     const Tensor& q, const Tensor& k,
                                                     const Tensor& v,
                                                     const AttentionResult& forward,
                                                     const AttentionOptions& opts = {});

// Additive attention (Bahdanau; d2l AdditiveAttention after its W_q, W_k projections):
//   qp (B, T, h), kp (B, S, h), w_v (h) or (1, h), v (B, S, Dv)
//   score[b,t,s] = w_v . tanh(qp[b,t] + kp[b,s])       (no scaling)
//   out = dropout(masked_softmax(score)) v
struct AdditiveResult {
  Tensor output;   // (B, T, Dv)
  Tensor weights;  // (B, T, S) pre-dropout (always: the backward needs them)
  uint64_t dropout_offset = 0;
};
AdditiveResult additive_attention(Context& ctx, const Tensor& qp, const Tensor& kp,
                                  const Tensor& w_v, const Tensor& v,
                                  const AttentionOptions& opts = {});

struct AdditiveGrads {
  Tensor dqp, dkp, dw_v, dv;
};
AdditiveGrads additive_attention_backward(Context& ctx, const Tensor& dout, const Tensor& qp,
                                          const Tensor& kp, const Tensor& w_v, const Tensor& v,
                                          const AdditiveResult& forward,
                                          const AttentionOptions& opts = {});

// Inverted dropout of x by the dropout stream at `offset` (identity when p == 0).
Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset);
// Gradient of dropout: the same mask and scale applied to dy.
Tensor dropout_backward(const Tensor& dy, double p, uint64_t seed, uint64_t offset);

}  // namespace attn
