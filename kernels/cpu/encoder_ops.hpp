// Fast float32 CPU paths for the elementwise and per-row ops of a Transformer encoder's training
// step: inverted dropout, ReLU, and LayerNorm forward and backward (internal).
//
// Each is the reference kernel's math (kernels/ref/dropout.cpp, activation.cpp, layer_norm.cpp)
// spread over `threads` OpenMP threads in chunks fixed by the shape, never by the thread count, so
// results are bitwise identical for any `threads`:
//   dropout, relu      elementwise; bit-identical to the reference (dropout draws the Philox
//                      blocks in SIMD lanes, kernels/cpu/dropout_simd.cpp, one per 4 elements,
//                      where the reference redraws a block per element)
//   layer_norm         rows in parallel (kernels/cpu/layer_norm_simd.cpp: compiled per SIMD
//                      target); per row the reference's double arithmetic, but each
//                      row sum with 8 partial sums (the reference adds in order): y, mean, rstd
//                      and dx agree with the reference to float32 rounding (a few ulp at most)
//   layer_norm_backward dgamma / dbeta summed in double per chunk of kLayerNormChunkRows rows,
//                      the chunks added in order
// Tested against the reference over sweeps in tests/test_kernels_encoder_ops_cpu.cpp.
#pragma once

#include <cstdint>

namespace attn::cpu {

constexpr int64_t kLayerNormChunkRows = 64;

// y[i] = float(double(x[i]) * factor), factor = 0 (dropped), 1 / (1 - p) (kept), as
// ref::DropoutSpec::factor; keep iff dropout_uniform(seed, offset, index_base + i) >= p. x may
// alias y.
void dropout_f32(const float* x, float* y, int64_t n, double p, uint64_t seed, uint64_t offset,
                 uint64_t index_base, int threads);

// The sinusoidal encoder's input stage, d2l's dropout(X * sqrt(E) + P[:T]), in one pass per
// chunk: y = dropout_f32(float(double(x) * factor) + P[t]) for x, y (B, T, E) contiguous and P's
// rows t (E floats each, row stride ldp), dropout p in [0, 1) (0: none) of stream (seed, offset,
// index_base) as dropout_f32 draws it. The bits of scaling, the positional add and dropout_f32
// in turn. x may alias y.
void scale_add_positions_dropout_f32(const float* x, double factor, const float* P, int64_t ldp,
                                     float* y, int64_t B, int64_t T, int64_t E, double p,
                                     uint64_t seed, uint64_t offset, uint64_t index_base,
                                     int threads);
// Its backward: dx = float(double(dropout_f32(dy)) * factor) over n elements (dropout as above;
// p 0: none). dy may alias dx.
void dropout_scale_f32(const float* dy, double factor, float* dx, int64_t n, double p,
                       uint64_t seed, uint64_t offset, uint64_t index_base, int threads);

// x and y (dy, x and dx) must not overlap.
void relu_forward_f32(const float* x, float* y, int64_t n, int threads);
void relu_backward_f32(const float* dy, const float* x, float* dx, int64_t n, int threads);
// In place, on the calling thread (a GEMM's row epilogue: kernels/cpu/matmul.hpp's RowTask), with
// the bits of relu_forward_f32 / relu_backward_f32: y = relu(y); dx = x > 0 ? dx : 0.
void relu_in_place_f32(float* y, int64_t n);
void relu_backward_in_place_f32(float* dx, const float* x, int64_t n);
void relu_in_place_bf16(uint16_t* y, int64_t n);
void relu_backward_in_place_bf16(uint16_t* dx, const uint16_t* x, int64_t n);
// bfloat16 (uint16_t bits): ref::relu_forward_bf16 / relu_backward_bf16 in parallel chunks.
void relu_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n, int threads);
void relu_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n,
                        int threads);

// x (R, E) -> y (R, E), mean (R), rstd (R); gamma, beta (E) or both null.
void layer_norm_forward_f32(const float* x, const float* gamma, const float* beta, float* y,
                            float* mean, float* rstd, int64_t R, int64_t E, double eps,
                            int threads);
// dx (R, E); dgamma, dbeta (E) when gamma is given (else unused).
void layer_norm_backward_f32(const float* dy, const float* x, const float* gamma, const float* mean,
                             const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t R,
                             int64_t E, int threads);
// dgamma, dbeta (E) from per-chunk double partials (2 * E per chunk: dgamma's E, then dbeta's),
// the chunks added in order; what layer_norm_backward_f32 and the fused AddNorm backward
// (add_norm.hpp) end with.
void layer_norm_sum_partials_f32(const double* partial, int64_t chunks, int64_t E, float* dgamma,
                                 float* dbeta);

}  // namespace attn::cpu
