// Reference rotary position embedding (internal; see attn/ops/relative_position.hpp).
//
// Glossary: N rows of sequences (batch x heads), T positions, D width (even).
#pragma once

#include "attn/ops/relative_position.hpp"

#include <cstdint>

namespace attn::ref {

// y (N, T, D) = x rotated pairwise by sign * (t + offset) * theta_i (sign -1 is the inverse, the
// backward). x and y contiguous; they must not alias.
template <typename T>
void rotary_apply(const T* x, T* y, int64_t N, int64_t Tn, int64_t D, const RotaryOptions& opts,
                  double sign);

}  // namespace attn::ref
