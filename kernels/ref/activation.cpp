// Reference elementwise activations, forward and backward side by side (see activation.hpp).
#include "kernels/ref/activation.hpp"

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

template void relu_forward<float>(const float*, float*, int64_t);
template void relu_forward<double>(const double*, double*, int64_t);
template void relu_backward<float>(const float*, const float*, float*, int64_t);
template void relu_backward<double>(const double*, const double*, double*, int64_t);

}  // namespace attn::ref
