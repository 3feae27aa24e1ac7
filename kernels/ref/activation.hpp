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

}  // namespace attn::ref
