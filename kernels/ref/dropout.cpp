// Reference inverted dropout, forward and backward (see dropout.hpp).
#include "kernels/ref/dropout.hpp"

namespace attn::ref {

template <typename T>
void dropout_forward(const T* x, T* y, int64_t n, const DropoutSpec& spec) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(static_cast<double>(x[i]) * spec.factor(static_cast<uint64_t>(i)));
}

template <typename T>
void dropout_backward(const T* dy, T* dx, int64_t n, const DropoutSpec& spec) {
  // forward: y[i] = x[i] * factor(i)  (the mask is redrawn from the same seed and offset)
  for (int64_t i = 0; i < n; ++i)
    dx[i] = static_cast<T>(static_cast<double>(dy[i]) * spec.factor(static_cast<uint64_t>(i)));
}

template void dropout_forward<float>(const float*, float*, int64_t, const DropoutSpec&);
template void dropout_forward<double>(const double*, double*, int64_t, const DropoutSpec&);
template void dropout_backward<float>(const float*, float*, int64_t, const DropoutSpec&);
template void dropout_backward<double>(const double*, double*, int64_t, const DropoutSpec&);

}  // namespace attn::ref
