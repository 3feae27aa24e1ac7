// Multi-head decode attention on the projections' own layout: a few new queries against a K/V
// cache (kernels/cpu/decode_attention). Internal to the library (nn::TransformerDecoder::step).
//
// Vocabulary: B batch, T queries (1..cpu::kDecodeMaxQueries), S keys, H heads, D head width.
//   q (B, T, H*D) float32, k (B, S, H*D), v (B, S, H*Dv) float32 or bfloat16 (both alike): any
//   row strides, unit feature stride (a cache (B, capacity, E) sliced to its S cached positions);
//   output (B, T, H*Dv) float32 contiguous, logsumexp (B*H, T) float32.
// The numbers of multi_head_attention_forward (ops/attention_heads.hpp) with valid_lens per batch
// row ((B,) or (B, T); lens_repeat must be 1), causal and the masked-row policy; not bitwise the
// same (another summation order), within float32 rounding of it. No dropout: a call that would
// drop (training with dropout > 0) is an error, decoding is eval mode. No weights, no ALiBi.
#pragma once

#include "attn/core/context.hpp"
#include "attn/ops/attention.hpp"

namespace attn::detail {

// True when the decode kernel serves q of `dtype` with T queries and these options.
bool multi_head_decode_supported(const Context& ctx, DType dtype, int64_t T,
                                 const AttentionOptions& opts);

AttentionResult multi_head_decode_attention(Context& ctx, const Tensor& q, const Tensor& k,
                                            const Tensor& v, int64_t heads,
                                            const AttentionOptions& opts);

}  // namespace attn::detail
