// Reference elementwise activations, forward and backward side by side (see activation.hpp).
#include "kernels/ref/activation.hpp"

#include "attn/core/dtype.hpp"

namespace attn::ref {

template <typename T>
void relu_forward(const T* x, T* y, int64_t n) {
  // x < 0 is false for NaN, so NaN passes through as torch.relu does.
  for (int64_t i = 0; i < n; ++i)
    y[i] = x[i] < T(0) ? T(0) : x[i];
}

template <typename T>
void relu_backward(const T* dy, const T* x, T* dx, int64_t n) {
  // forward: y = max(x, 0); dy/dx is 1 for x > 0 and taken as 0 at x <= 0 (PyTorch's choice).
  for (int64_t i = 0; i < n; ++i)
    dx[i] = x[i] > T(0) ? dy[i] : T(0);
}

void relu_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = bf16_to_float(x[i]) < 0.0f ? uint16_t{0} : x[i];
}

void relu_backward_bf16(const uint16_t* dy, const uint16_t* x, uint16_t* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    dx[i] = bf16_to_float(x[i]) > 0.0f ? dy[i] : uint16_t{0};
}

template void relu_forward<float>(const float*, float*, int64_t);
template void relu_forward<double>(const double*, double*, int64_t);
template void relu_backward<float>(const float*, const float*, float*, int64_t);
template void relu_backward<double>(const double*, const double*, double*, int64_t);

}  // namespace attn::ref
