// Relative position signals that act inside attention rather than on the input:
// rotary embeddings (RoPE; Su et al. 2021, "RoFormer") and ALiBi's slopes (Press et al. 2022,
// "Train Short, Test Long").
//
// ---------------------------------------------------------------------------------------------
// RoPE. Each query/key row x at position p (a vector of even width D) is rotated pairwise:
//   theta_i = base^(-2i/D),  i = 0 .. D/2 - 1          (base 10000, the sinusoids' frequencies)
//   y_a = x_a cos(p theta_i) - x_b sin(p theta_i)
//   y_b = x_a sin(p theta_i) + x_b cos(p theta_i)
// for the pair (a, b) = pair i. Two pairings are in use, and weights trained with one do not
// work with the other:
//
//   kAdjacent (RoFormer paper, GPT-J, Meta's LLaMA code): pair i = (2i, 2i+1)
//       x:  [ x0 x1 | x2 x3 | x4 x5 | x6 x7 ]        D = 8
//             \ /     \ /     \ /     \ /
//            th0     th1     th2     th3
//
//   kHalves (GPT-NeoX, Hugging Face LLaMA, "rotate_half"): pair i = (i, i + D/2)
//       x:  [ x0 x1 x2 x3 | x4 x5 x6 x7 ]        D = 8
//             |  |  |  |    |  |  |  |
//             |  |  |  +----|--|--|--+   th3
//             |  |  +-------|--|--+      th2
//             |  +----------|--+         th1
//             +-------------+            th0
//
// Both make q_t . k_s a function of (t - s) only: R(t)^T R(s) = R(s - t) because 2x2 rotations
// commute, so rotating queries and keys by their positions turns absolute positions into a
// relative offset inside the dot product (tested). The backward is the inverse rotation
// (angle -p theta_i): the rotation is orthogonal.
//
// ---------------------------------------------------------------------------------------------
// ALiBi. Head h (0-based) adds -m_h * |t - s| to the score of query t and key s, with the paper's
// slopes: for H a power of two, m_h = 2^(-8 (h+1) / H) (H = 8: 1/2, 1/4, ..., 1/256); otherwise
// the slopes of the nearest lower power of two n, then every other slope of 2n for the rest
// (the paper's reference code). See AttentionOptions::alibi_slopes in attn/ops/attention.hpp.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

#include <vector>

namespace attn {

enum class RotaryPairing : uint8_t {
  kAdjacent,  // (2i, 2i+1)
  kHalves,    // (i, i + D/2)
};

struct RotaryOptions {
  RotaryPairing pairing = RotaryPairing::kAdjacent;
  double base = 10000.0;
  int64_t position_offset = 0;  // row t has position t + offset (decoding with a cache)
};

// x (N, T, D) float32/float64, D even -> y (N, T, D): row (n, t) rotated for position
// t + position_offset. Angles and sin/cos in double, rounded once.
Tensor rotary_embedding(Context& ctx, const Tensor& x, const RotaryOptions& opts = {});
// The gradient: dx = R(-angle) dy (the transpose of an orthogonal rotation).
Tensor rotary_embedding_backward(Context& ctx, const Tensor& dy, const RotaryOptions& opts = {});

// ALiBi slopes m_0 .. m_{H-1} (see above). H >= 1.
std::vector<double> alibi_slopes(int64_t num_heads);

}  // namespace attn
