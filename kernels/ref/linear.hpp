// Reference linear layer (internal): y = x W^T + b in PyTorch's (out, in) weight layout.
//
// Glossary: N rows (all leading dims of x flattened), I in features, O out features.
//
// T = float or double: accumulation in double, one rounding to T.
// bfloat16 (uint16_t bits, attn/core/dtype.hpp): every input widened exactly, the same double
// accumulation, then ONE rounding from double to bf16 (round to nearest even, no intermediate
// float), so y, dx, dW and db are the correctly rounded values of the double sums. The fast path
// (ops/linear.cpp) accumulates in f32 instead and rounds the f32 result once.
#pragma once

#include <cstdint>

namespace attn::ref {

// x (N, I), W (O, I), b (O) or null -> y (N, O).   y[n,o] = b[o] + sum_i x[n,i] W[o,i]
template <typename T>
void linear_forward(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t I, int64_t O);

// dy (N, O) -> dx (N, I), dW (O, I), db (O) (skipped when null).
template <typename T>
void linear_backward(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t I,
                     int64_t O);

// bfloat16 versions of the two above (all arrays bf16 bits).
void linear_forward_bf16(const uint16_t* x, const uint16_t* W, const uint16_t* b, uint16_t* y,
                         int64_t N, int64_t I, int64_t O);
void linear_backward_bf16(const uint16_t* dy, const uint16_t* x, const uint16_t* W, uint16_t* dx,
                          uint16_t* dW, uint16_t* db, int64_t N, int64_t I, int64_t O);

// double -> bfloat16 with a single rounding to nearest even (NaN stays NaN).
uint16_t double_to_bf16(double d);

}  // namespace attn::ref
