// The linear op on a module's own weight. Internal to the library (nn::Linear).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn::detail {

// linear(ctx, x, W, b), or linear_relu with relu_after, where W is a parameter's own tensor (not
// a temporary copy): alive and unchanged while a cpu::GemmFixedPackingScope lives on the calling
// thread (kernels/cpu/matmul.hpp), so that its GEMM packing may be kept from call to call.
Tensor linear_of_parameter(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b,
                           bool relu_after);

// linear_of_parameter (no ReLU) writing y into `out` instead of a new tensor: a view of y's shape
// and x's dtype whose rows share one stride (a decoder step's new keys, straight into its cache).
// Same values as the call that returns y.
void linear_of_parameter_into(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b,
                              const Tensor& out);

}  // namespace attn::detail
