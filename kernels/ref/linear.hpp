// Reference linear layer (internal): y = x W^T + b in PyTorch's (out, in) weight layout.
//
// Glossary: N rows (all leading dims of x flattened), I in features, O out features.
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

}  // namespace attn::ref
