// Multi-head scaled dot-product attention on the projections' own layout: no head copies.
// Internal to the library (nn::MultiHeadAttention's fast path); the public op is
// attn::scaled_dot_product_attention on (B*H, T, D) tensors.
//
// Vocabulary: B batch, T queries, S keys, H heads, D head width of q and k, Dv of v.
//
//   q (B, T, H*D), k (B, S, H*D), v (B, S, H*Dv): any row strides, unit feature stride (so
//   column slices of one (B, T, 3E) projection work); head h owns features [h*D, (h+1)*D).
//   output (B, T, H*Dv) contiguous, logsumexp (B*H, T).
// Same numbers as d2l's transpose_qkv -> scaled_dot_product_attention on (B*H, ., D) with batch
// index b*H + h (valid_lens per batch b, lens_repeat = H) -> transpose_output, and bitwise equal
// to that path on the fused CPU kernel: the kernel reads the same values through head strides
// (kernels::AttentionProblem::heads, kernels/attention_problem.hpp) instead of from copies. The
// dropout stream index is the (B*H) one.
#pragma once

#include "attn/core/context.hpp"
#include "attn/ops/attention.hpp"

namespace attn::detail {

// True when the fused CPU kernel serves these options: float32 or bfloat16 (kernels/cpu/
// flash_bf16: output bf16, logsumexp float32, gradients bf16), Backend::kAuto without
// need_weights (the weights route to the reference, as ops/attention.cpp) or Backend::kCpu
// without need_weights, and no ALiBi bias.
bool multi_head_fused_supported(const Context& ctx, DType dtype, const AttentionOptions& opts);

// opts.mask.valid_lens: undefined, (B,) or (B, T), one per batch row (opts.mask.lens_repeat must
// be 1; the op serves each batch's lengths to its H heads). Takes a dropout offset from ctx when
// it drops, and records it in the result.
AttentionResult multi_head_attention_forward(Context& ctx, const Tensor& q, const Tensor& k,
                                             const Tensor& v, int64_t heads,
                                             const AttentionOptions& opts);

// Gradients of the forward above given dout (B, T, H*Dv) (unit feature stride). dq, dk, dv are
// preallocated with the shapes of q, k, v, any row strides and unit feature stride (e.g. slices of
// one (B, T, 3E) buffer); they are overwritten.
void multi_head_attention_backward(Context& ctx, const Tensor& dout, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const AttentionResult& forward,
                                   int64_t heads, const AttentionOptions& opts, Tensor& dq,
                                   Tensor& dk, Tensor& dv);

}  // namespace attn::detail
