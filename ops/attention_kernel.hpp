// The one place where tensors and options become the fused kernels' arguments
// (kernels/attention_problem.hpp), for scaled_dot_product_attention (ops/attention.cpp, (B, T, D)
// tensors, one head per row) and multi-head attention on projections (ops/attention_heads.cpp,
// (B, T, H*D) tensors read through head strides), float32 and bfloat16 alike. Internal to ops/.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/attention_problem.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "ops/mask.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

namespace attn::detail {

// (B, L, heads * W) tensor t as a strided (B, heads, L, W) view: row (b, h, l) of batch row
// b * heads + h starts at b * stride(0) + h * W + l * stride(1). heads = 1 is SDPA's (B, L, W).
// (Reads shape() and strides() directly: Tensor::dim and stride format their error message on
// every call.)
template <class E>
kernels::StridedView<E> head_view(const Tensor& t, int64_t heads) {
  const auto& st = t.strides();
  return {static_cast<E*>(t.raw_data()), st[0], t.shape()[2] / heads, st[1], st[2]};
}

// The dropout stream index of weight (0, 0, 0) of a call on (rows, T, S) weights, rows =
// batch * heads (the heads path) or MultiHeadAttention's head copies to SDPA (B * H rows with
// lens_repeat = H): a sample is heads * lens_repeat rows, and the Context's data-parallel sample
// window (Context::dropout_first_sample) places this call's first sample in the global batch.
// The one rule for the fused kernels (attention_args) and the reference paths (ops/attention.cpp).
inline uint64_t attention_dropout_index_base(const Context& ctx, const AttentionOptions& opts,
                                             int64_t heads, int64_t T, int64_t S) {
  return ctx.dropout_index_base(static_cast<uint64_t>(heads * opts.mask.lens_repeat * T * S));
}

// Everything but the output views: shapes from q (B, T, heads*D), k (B, S, heads*D),
// v (B, S, heads*Dv); the mask as kept-key counts (`kept`, from length_key_counts over the
// B*heads rows; it must outlive the call); scale, the dropout stream (active only in training
// with p > 0, at `dropout_offset`, from attention_dropout_index_base), threads and the test
// switches from ctx.
template <class E>
kernels::AttentionArgs<E> attention_args(const Context& ctx, const Tensor& q, const Tensor& k,
                                         const Tensor& v, int64_t heads,
                                         const std::vector<int32_t>& kept,
                                         const AttentionOptions& opts, uint64_t dropout_offset) {
  kernels::AttentionArgs<E> p;
  const Shape &qs = q.shape(), &ks = k.shape(), &vs = v.shape();
  p.B = qs[0] * heads, p.T = qs[1], p.S = ks[1], p.D = qs[2] / heads, p.Dv = vs[2] / heads;
  p.heads = heads;
  p.kept_keys = counts_or_null(kept);
  p.causal = opts.mask.causal;
  p.masked_rows = lower_policy(opts.mask.masked_rows);
  p.scale =
      static_cast<float>(opts.scale ? *opts.scale : 1.0 / std::sqrt(static_cast<double>(p.D)));
  const bool drop = opts.training && opts.dropout > 0.0;
  p.dropout = drop ? static_cast<float>(opts.dropout) : 0.0f;
  p.seed = ctx.seed;
  p.offset = drop ? dropout_offset : 0;
  p.dropout_index_base = drop ? attention_dropout_index_base(ctx, opts, heads, p.T, p.S) : 0;
  p.threads = ctx.resolved_threads();
  p.simd_targets = ctx.kernel_targets;
  p.force_bf16_fallback = ctx.force_bf16_fallback;
  p.q = head_view<const E>(q, heads);
  p.k = head_view<const E>(k, heads);
  p.v = head_view<const E>(v, heads);
  return p;
}

// The backward's views: dout like the output, dq, dk, dv like q, k, v.
template <class E>
kernels::AttentionGradArgs<E> attention_grad_args(const Tensor& dout, const Tensor& dq,
                                                  const Tensor& dk, const Tensor& dv,
                                                  int64_t heads) {
  return {head_view<const E>(dout, heads), head_view<E>(dq, heads), head_view<E>(dk, heads),
          head_view<E>(dv, heads)};
}

// The fused CPU kernels by element type: float (kernels/cpu/flash_attention) or bf16 stored as
// uint16_t (kernels/cpu/flash_bf16).
inline void fused_forward(const kernels::AttentionArgs<float>& p) {
  cpu::flash_attention_forward(p);
}
inline void fused_forward(const kernels::AttentionArgs<uint16_t>& p) {
  cpu::flash_attention_forward_bf16(p);
}
inline void fused_backward(const kernels::AttentionArgs<float>& p,
                           const kernels::AttentionGradArgs<float>& g) {
  cpu::flash_attention_backward(p, g);
}
inline void fused_backward(const kernels::AttentionArgs<uint16_t>& p,
                           const kernels::AttentionGradArgs<uint16_t>& g) {
  cpu::flash_attention_backward_bf16(p, g);
}

}  // namespace attn::detail
