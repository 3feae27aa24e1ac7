// Mask lowering (internal to ops/ and nn/): the user's MaskOptions (d2l's valid_lens, causal,
// the masked-row policy) become what the kernels take (kernels/attention_problem.hpp): one
// kept-key count per score row and a kernel-level policy enum. Written once here for every
// attention op (ops/attention.cpp, ops/attention_heads.cpp, ops/masked_softmax.cpp) and for
// nn::MultiHeadAttention's padding guard.
//
// Every mask attn supports keeps a prefix of the keys: d2l's valid_lens keep s iff
// float(s) < len, causal keeps s iff s <= t, and their AND is the shorter prefix.
#pragma once

#include "attn/ops/masked_softmax.hpp"
#include "kernels/attention_problem.hpp"

#include <cstdint>
#include <vector>

namespace attn::detail {

// Number of keys a length keeps: #{s in [0, S) : float(s) < len}. NaN and len <= 0 keep none.
int64_t keys_kept_by_length(double len, int64_t S);

// kept[b*T + t] for every row of a (B, T, S) score tensor: valid_lens (validated by
// check_valid_lens: undefined, (B / r,) or (B / r, T) with r = mask.lens_repeat, any dtype) AND
// causal (s <= t). Needs S < 2^31 (the caller checks it).
std::vector<int32_t> kept_key_counts(const MaskOptions& mask, int64_t B, int64_t T, int64_t S);

// The same, but empty without valid_lens: the fused kernels then keep S keys, or t + 1 when
// causal, themselves, which saves building B*T counts on every call.
std::vector<int32_t> length_key_counts(const MaskOptions& mask, int64_t B, int64_t T, int64_t S);

// Null for an empty count vector (no length mask), else its data.
inline const int32_t* counts_or_null(const std::vector<int32_t>& kept) {
  return kept.empty() ? nullptr : kept.data();
}

inline kernels::MaskedRows lower_policy(MaskedRowPolicy policy) {
  return policy == MaskedRowPolicy::kZero ? kernels::MaskedRows::kZero
                                          : kernels::MaskedRows::kUniform;
}

// Keys (or values) of batch b that some query reads: rows [0, read[b]) of a (B, S, .) tensor
// under valid_lens (defined; (B,) or (B, T)) and causal, for B batches of T queries.
//   read[b] = max over t of kept(b, t); a query that keeps no key under the uniform policy
//   (`uniform_reads_all`, d2l) averages every value, padding included, so then read[b] = S.
std::vector<int64_t> keys_read(const Tensor& valid_lens, bool causal, int64_t B, int64_t T,
                               int64_t S, bool uniform_reads_all);

}  // namespace attn::detail
