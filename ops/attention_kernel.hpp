// The one place that decides which attention kernel runs, and with which arguments, for every
// attention entry: scaled_dot_product_attention (ops/attention.cpp, (B, T, D) tensors, one head
// per row), multi-head attention on projections (ops/attention_heads.cpp, (B, T, H*D) tensors
// read through head strides), decode (ops/attention_decode.cpp) and the ring step
// (ops/ring_attention.cpp), float32 and bfloat16 alike. Internal to ops/.
//
//   check_attention_options   the option checks every entry shares (dropout, scale)
//   attention_scale           the one scale formula (1/sqrt(D) unless given)
//   fused_attention_serves    the one dispatch rule: fused kernel or reference loops
//   attention_problem         the one builder of kernels::AttentionProblem (shapes, mask, scale,
//                             dropout stream, threads, SIMD targets) from a Context and options
//   attention_args            the problem plus the q, k, v views (kernels/attention_problem.hpp)
//   fused_forward/backward    the fused kernels by element type (kernels/cpu/flash_attention.hpp,
//                             kernels/cpu/flash_bf16.hpp)
// Next file on a call's way down: kernels/attention_problem.hpp (the arguments' contract), then
// the kernel's header.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/attention_problem.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "ops/common.hpp"
#include "ops/mask.hpp"

#include <cmath>
#include <cstdint>
#include <optional>
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

// The option checks every attention entry shares: dropout in [0, 1] and a finite scale.
inline void check_attention_options(const char* op, double dropout,
                                    const std::optional<double>& scale) {
  check(dropout >= 0.0 && dropout <= 1.0, op, "dropout is {}, expected in [0, 1]", dropout);
  check(!scale || std::isfinite(*scale), op, "scale is {}, expected a finite number",
        scale.value_or(0.0));
}

// The scale of the scores: the caller's, else 1/sqrt(D) (d2l, PyTorch SDPA). In double for the
// reference loops; the kernels take it rounded to float.
inline double attention_scale(const std::optional<double>& scale, int64_t D) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
}

// Fused or not? The fused CPU kernels (float32: kernels/cpu/flash_attention; bfloat16:
// kernels/cpu/flash_bf16; decode: kernels/cpu/decode_attention) serve float32 and bfloat16 on
// Backend::kCpu, and on kAuto unless the caller asks for the weights: then a (B, T, S) tensor
// exists anyway, so the fused kernel's memory saving is moot, and the reference gives the weights
// (and the gradients) with double accumulation, as d2l's checks expect. kReference, float64 and
// ALiBi (the kernels have no score bias) run the reference loops. A backward follows the rule of
// its forward (same options). The entries add only what their own kernel cannot do: the heads and
// decode paths return no weights, decode has no dropout and takes 1..kDecodeMaxQueries queries.
inline bool fused_attention_serves(const Context& ctx, DType dtype, const AttentionOptions& opts) {
  if (dtype != DType::F32 && dtype != DType::BF16) return false;
  if (opts.alibi_slopes.defined()) return false;
  return ctx.backend == Backend::kCpu || (ctx.backend == Backend::kAuto && !opts.need_weights);
}

// Shapes of one kernel call: B rows of (batch, head) pairs = batch * heads.
struct AttentionShape {
  int64_t batch = 0, heads = 1, T = 0, S = 0, D = 0, Dv = 0;
};

// Everything but the tensors: shapes; the mask as kept-key counts (`kept`, from
// length_key_counts over the batch*heads rows, empty for none; it must outlive the call), causal
// and the masked-row policy from opts.mask; the scale; the dropout stream (active only in training
// with p > 0, at `dropout_offset`, index base from attention_dropout_index_base); threads and the
// test switches (Context::kernel_targets, force_bf16_fallback) from ctx. Every entry builds its
// kernel's problem here, so a Context field reaches every kernel.
inline kernels::AttentionProblem attention_problem(const Context& ctx, const AttentionShape& d,
                                                   const std::vector<int32_t>& kept,
                                                   const AttentionOptions& opts,
                                                   uint64_t dropout_offset) {
  kernels::AttentionProblem p;
  p.B = d.batch * d.heads, p.T = d.T, p.S = d.S, p.D = d.D, p.Dv = d.Dv;
  p.heads = d.heads;
  p.kept_keys = counts_or_null(kept);
  p.causal = opts.mask.causal;
  p.masked_rows = lower_policy(opts.mask.masked_rows);
  p.scale = static_cast<float>(attention_scale(opts.scale, d.D));
  const bool drop = opts.training && opts.dropout > 0.0;
  p.dropout = drop ? static_cast<float>(opts.dropout) : 0.0f;
  p.seed = ctx.seed;
  p.offset = drop ? dropout_offset : 0;
  p.dropout_index_base = drop ? attention_dropout_index_base(ctx, opts, d.heads, d.T, d.S) : 0;
  p.threads = ctx.resolved_threads();
  p.simd_targets = ctx.kernel_targets;
  p.force_bf16_fallback = ctx.force_bf16_fallback;
  return p;
}

// The problem of q (B, T, heads*D), k (B, S, heads*D), v (B, S, heads*Dv) and their views; the
// caller adds the outputs.
template <class E>
kernels::AttentionArgs<E> attention_args(const Context& ctx, const Tensor& q, const Tensor& k,
                                         const Tensor& v, int64_t heads,
                                         const std::vector<int32_t>& kept,
                                         const AttentionOptions& opts, uint64_t dropout_offset) {
  const Shape &qs = q.shape(), &ks = k.shape(), &vs = v.shape();
  const AttentionShape d{qs[0], heads, qs[1], ks[1], qs[2] / heads, vs[2] / heads};
  kernels::AttentionArgs<E> p;
  static_cast<kernels::AttentionProblem&>(p) =
      attention_problem(ctx, d, kept, opts, dropout_offset);
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
