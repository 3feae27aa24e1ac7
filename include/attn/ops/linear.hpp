// Linear layer: y = x W^T + b (PyTorch layout, so weights load untransposed).
//   x (..., in), W (out, in), b (out) or undefined  ->  y (..., out)
// PyTorch: torch.nn.functional.linear(x, W, b).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

Tensor linear(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b = {});

struct LinearGrads {
  Tensor dx;  // (..., in)
  Tensor dW;  // (out, in)
  Tensor db;  // (out), undefined when the forward had no bias
};
// dx = dy W, dW = dy^T x (summed over leading dims), db = sum dy.
LinearGrads linear_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias);

}  // namespace attn
