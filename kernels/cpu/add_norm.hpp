// d2l's AddNorm, LayerNorm(dropout(Y) + X), fused for the float32 fast path (internal; used by
// nn::AddNorm on kAuto / kCpu).
//
// The separate ops it replaces run dropout over (R, E), then the add, then LayerNorm, each a
// pass over the whole tensor, and in the backward LayerNorm's backward then dropout's. Here each
// chunk of kLayerNormChunkRows rows is done start to end while it is in cache:
//   forward   the dropout mask of y drawn once (cpu::dropout_keep_range: the mask ops::dropout
//             draws, element i at stream index index_base + i) and kept as bytes, z = dropout(y)
//             + x, then the LayerNorm rows of z (layer_norm_simd.hpp)
//   backward  dx = LayerNorm backward rows (= dz), then dy = dropout(dx) with the saved mask
// The arithmetic is the separate ops' exactly (dropout in double, the add in float, the same row
// kernels, dgamma / dbeta summed per chunk of kLayerNormChunkRows rows and the chunks in order),
// so every output is bitwise what cpu::dropout_f32 + add + layer_norm(_backward)_f32 give, for
// any thread count. Tested against those ops in tests/test_nn_add_norm.cpp.
#pragma once

#include <cstdint>

namespace attn::cpu {

// Inverted dropout of the sublayer output y: drop probability p in [0, 1], the stream of
// (seed, offset), element i of y at stream index index_base + i. keep: R * E bytes, the mask the
// forward draws and its backward reads.
struct AddNormDropout {
  double p = 0.0;
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint64_t index_base = 0;
  uint8_t* keep = nullptr;
};

// Mixed precision (autocast) at the seams of a block: the sublayer's output arrives in bfloat16
// and the next linear layer reads this output, and the backward's dy, rounded to bfloat16. The
// fused pass does those conversions on the chunk while it is in cache, instead of a pass over
// the whole tensor each (and a parallel region each) before and after. Bits: y widened exactly,
// out and dy rounded to nearest even as floats_to_bf16 rounds, so the same as converting the
// float tensors.
struct AddNormBf16 {
  const uint16_t* y = nullptr;  // forward: y as bf16 bits (R, E); the float y is then null
  uint16_t* out = nullptr;      // forward: out rounded to bf16 as well (R, E), or null
  uint16_t* dy = nullptr;       // backward: dy as bf16 (R, E) instead of float (the float dy
                                // is then null); with no drop, dy = dz rounded
};

// A second term of the output's gradient (R, E), float32 or bfloat16 bits (one of the two): the
// backward's dout is then dout + term, summed as each chunk is read (in float, the bf16 term
// widened exactly), the bits of adding them first (add_all) without that pass over the tensor.
// A block's residual gives AddNorm its gradient as two such terms.
struct AddNormGradTerm {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
};

// x, y (R, E) -> z = dropout(y) + x (saved for the backward), out = LayerNorm(z) (R, E),
// mean, rstd (R). gamma, beta (E) or both null. drop null: z = y + x (eval, or p == 0).
// x, y, z, out must not overlap.
void add_norm_forward_f32(const float* x, const float* y, const float* gamma, const float* beta,
                          float* z, float* out, float* mean, float* rstd, int64_t R, int64_t E,
                          double eps, const AddNormDropout* drop, int threads,
                          const AddNormBf16* bf16 = nullptr);

// dout (R, E), the forward's z, mean, rstd -> dx = dz (R, E); dy = dropout(dz) (R, E) when drop is
// given (its p and the keep mask its forward wrote; else dy is unused: the gradient for y is dz
// itself); dgamma, dbeta (E) when gamma is given. dout, dx, dy must not overlap. bf16->dy: dy in
// bf16 instead (also without drop). dout_add: a second term of the gradient, added to dout (it
// must not overlap dx or dy).
void add_norm_backward_f32(const float* dout, const float* z, const float* gamma, const float* mean,
                           const float* rstd, float* dx, float* dy, float* dgamma, float* dbeta,
                           int64_t R, int64_t E, const AddNormDropout* drop, int threads,
                           const AddNormBf16* bf16 = nullptr,
                           const AddNormGradTerm* dout_add = nullptr);

}  // namespace attn::cpu
