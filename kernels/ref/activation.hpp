// Reference elementwise activations (internal; see attn/ops/activation.hpp).
#pragma once

#include <cstdint>

namespace attn::ref {

// y[i] = max(x[i], 0), NaN kept
template <typename T>
void relu_forward(const T* x, T* y, int64_t n);

// dx[i] = x[i] > 0 ? dy[i] : 0
template <typename T>
void relu_backward(const T* dy, const T* x, T* dx, int64_t n);

// bfloat16 (uint16_t bits): each value widened exactly to float, the float formula above, and
// the result (x, dy or 0, all bf16 values) narrowed exactly: the bits a float32 relu of the
// widened values gives once rounded back to bf16 (mixed precision's FFN hidden layer).
void relu_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n);
void relu_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n);

}  // namespace attn::ref
