// Mask lowering: valid_lens and causal to kept-key counts (contract in ops/mask.hpp).
#include "ops/mask.hpp"

#include "attn/core/error.hpp"

#include <algorithm>
#include <cmath>

namespace attn::detail {

int64_t keys_kept_by_length(double len, int64_t S) {
  // s < len for integer s <=> s < ceil(len); `!(len > 0)` also catches NaN.
  if (!(len > 0)) return 0;
  if (len >= static_cast<double>(S)) return S;
  return std::min<int64_t>(S, static_cast<int64_t>(std::ceil(len)));
}

std::vector<int32_t> kept_key_counts(const MaskOptions& mask, int64_t B, int64_t T, int64_t S) {
  check(S < (int64_t{1} << 31), "attention mask", "{} keys per row, expected fewer than 2^31", S);
  std::vector<int32_t> kept(static_cast<size_t>(B * T), static_cast<int32_t>(S));
  // Lengths as doubles (int and float lengths alike; NaN stays NaN).
  const std::vector<double> lens =
      mask.valid_lens.defined() ? mask.valid_lens.to_vector() : std::vector<double>{};
  const bool per_query = mask.valid_lens.defined() && mask.valid_lens.ndim() == 2;
  const int64_t r = mask.lens_repeat;
  for (int64_t b = 0; b < B; ++b) {
    int32_t* row = kept.data() + b * T;
    if (per_query) {
      // 2-D (B/r, T): one length per (batch, query). Row b of the scores reads lens row b / r.
      for (int64_t t = 0; t < T; ++t)
        row[t] = static_cast<int32_t>(
            keys_kept_by_length(lens[static_cast<size_t>((b / r) * T + t)], S));
    } else if (!lens.empty()) {
      // 1-D (B/r,): one length per batch (d2l's repeat_interleave over queries), so one count
      // for the whole row (a per-query ceil was a tenth of a millisecond per training step).
      std::fill(row, row + T,
                static_cast<int32_t>(keys_kept_by_length(lens[static_cast<size_t>(b / r)], S)));
    }
    if (mask.causal)  // query t sees keys 0..t
      for (int64_t t = 0; t < T; ++t)
        row[t] = std::min<int32_t>(row[t], static_cast<int32_t>(t + 1));
  }
  return kept;
}

std::vector<int32_t> length_key_counts(const MaskOptions& mask, int64_t B, int64_t T, int64_t S) {
  if (!mask.valid_lens.defined()) return {};
  return kept_key_counts(mask, B, T, S);
}

std::vector<int64_t> keys_read(const Tensor& valid_lens, bool causal, int64_t B, int64_t T,
                               int64_t S, bool uniform_reads_all) {
  std::vector<int64_t> read(static_cast<size_t>(B), 0);
  if (!valid_lens.defined() || valid_lens.ndim() == 1) {
    // One count n per batch row (or S): its queries keep n keys, min(n, t + 1) when causal, so
    // the most any reads is n (min(n, T) when causal) and a query keeps none iff n == 0. No
    // per-query counts (a B x T vector at every MultiHeadAttention forward).
    const std::vector<double> lens =
        valid_lens.defined() ? valid_lens.to_vector() : std::vector<double>{};
    for (int64_t b = 0; b < B && T > 0; ++b) {
      const int64_t n = lens.empty() ? S : keys_kept_by_length(lens[static_cast<size_t>(b)], S);
      read[b] = causal ? std::min(n, T) : n;
      if (n == 0 && uniform_reads_all) read[b] = S;
    }
    return read;
  }
  MaskOptions mask;
  mask.valid_lens = valid_lens;
  mask.causal = causal;
  const std::vector<int32_t> kept = kept_key_counts(mask, B, T, S);
  for (int64_t b = 0; b < B; ++b) {
    bool some_row_keeps_nothing = false;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = kept[static_cast<size_t>(b * T + t)];
      read[b] = std::max(read[b], n);
      some_row_keeps_nothing |= n == 0;
    }
    if (some_row_keeps_nothing && uniform_reads_all) read[b] = S;
  }
  return read;
}

}  // namespace attn::detail
