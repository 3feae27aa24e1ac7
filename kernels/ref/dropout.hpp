// Reference inverted dropout (internal). The mask comes from the Philox dropout stream
// (attn/core/rng.hpp): element i is kept iff dropout_uniform(seed, offset, i) >= p, and a kept
// element is scaled by 1 / (1 - p), so E[dropout(x)] = x.
#pragma once

#include "attn/core/rng.hpp"

#include <cstdint>

namespace attn::ref {

struct DropoutSpec {
  bool active = false;  // training && p > 0; inactive means identity
  double p = 0.0;
  uint64_t seed = 0;
  uint64_t offset = 0;  // the stream offset of this call (Context::next_dropout_offset)
  // Stream index of local element 0 (Context::dropout_index_base: the first sample's global
  // index times the elements per sample; 0 in a single process).
  uint64_t index_base = 0;

  // The factor local element i is multiplied by: 1 (inactive), 0 (dropped) or 1 / (1 - p)
  // (kept), drawn at stream index index_base + i. p == 1 drops everything (the stream's u < 1
  // always), so the infinite scale is never used.
  double factor(uint64_t i) const {
    if (!active) return 1.0;
    if (p >= 1.0) return 0.0;
    return dropout_keep(seed, offset, index_base + i, static_cast<float>(p)) ? 1.0 / (1.0 - p)
                                                                             : 0.0;
  }
};

// y[i] = x[i] * factor(i) for i in [0, n)   (x, y contiguous; may alias)
template <typename T>
void dropout_forward(const T* x, T* y, int64_t n, const DropoutSpec& spec);

// forward: y[i] = x[i] * factor(i);  so: dx[i] = dy[i] * factor(i)
template <typename T>
void dropout_backward(const T* dy, T* dx, int64_t n, const DropoutSpec& spec);

}  // namespace attn::ref
