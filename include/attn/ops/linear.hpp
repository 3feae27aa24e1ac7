// Linear layer: y = x W^T + b (PyTorch layout, so weights load untransposed).
//   x (..., in), W (out, in), b (out) or undefined  ->  y (..., out)
// PyTorch: torch.nn.functional.linear(x, W, b).
//
// dtypes: x, W, b (and dy in the backward) all F32, all F64 or all BF16; mixing is an error.
// BF16 is PyTorch's bf16 F.linear: outputs and gradients BF16. The fast path (kAuto, kCpu) runs
// a bf16 oneDNN GEMM accumulating in f32 (bias added in f32) that rounds each result once to
// bf16 as it stores it; dx and dW likewise, db is summed in double and rounded to f32, then bf16.
// kReference widens the inputs, accumulates in double and rounds once. With AVX512-BF16 oneDNN
// flushes bf16 subnormal inputs and f32 subnormal partial results to zero (vdpbf16ps); values of
// normal magnitude are exact.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

Tensor linear(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b = {});

// relu(linear(x, W, b)), the same bits. On the fast path each piece of the product's rows is
// rectified by the thread that has just computed it, in the product's parallel region, instead
// of in a second pass over y (the FFN's dense1, d2l's PositionWiseFFN).
Tensor linear_relu(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b = {});

struct LinearGrads {
  Tensor dx;  // (..., in)
  Tensor dW;  // (out, in)
  Tensor db;  // (out), undefined when the forward had no bias
};
// dx = dy W, dW = dy^T x (summed over leading dims), db = sum dy.
// With relu_out (x's shape and dtype: the output of the ReLU that fed this layer, x itself when
// x = relu(h)), dx is also taken through ReLU's backward: relu_backward(dy W, relu_out), the
// same bits, on the fast path in dx's product region (the FFN's dense2).
LinearGrads linear_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias, const Tensor& relu_out = {});

// The same gradients as a training step keeps them: dW added into dW_sum (out, in) and, when
// db_sum is given, db added into *db_sum (out); returns dx. The sums are contiguous, of x's dtype
// (a layer's .grad). In float32 on the fast path the weight-gradient GEMM adds into dW_sum itself
// (oneDNN's sum post-op) and the column sums into db_sum: no temporaries and no separate pass.
// Bitwise it is linear_backward followed by dW_sum += dW, db_sum += db (each sum rounded to
// float32, then added) when dW_sum starts at zero, as a training step's gradients do after
// zero_grad; on a nonzero dW_sum oneDNN adds the old value into its accumulator before the
// contraction's blocks, so the last bit may differ from the separate add. db_sum is always the
// separate add's bits. Other dtypes and backends compute the gradients and add them.
// tests/test_ops_linear.cpp. relu_out as in linear_backward.
Tensor linear_backward_accumulate(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                                  Tensor& dW_sum, Tensor* db_sum = nullptr,
                                  const Tensor& relu_out = {});

}  // namespace attn
