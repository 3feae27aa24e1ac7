// 1-D convolution over a sequence with 'same' zero padding (the CNN of the chapter's CNN / RNN /
// self-attention comparison).
//
//   x (B, n, d_in), W (d_out, d_in, k) with k odd, b (d_out) or undefined  ->  y (B, n, d_out)
//   y[b,t,o] = b[o] + sum_{j<k} sum_i W[o,i,j] x[b, t+j-p, i],   p = (k-1)/2,  x = 0 outside [0, n)
//
// Layout: activations are (B, n, d) like every sequence in attn (PyTorch's Conv1d wants (B, d, n));
// W is in PyTorch's Conv1d layout (out, in, k), so weights load untransposed.
// PyTorch: F.conv1d(x.transpose(1, 2), W, b, padding=p).transpose(1, 2).
// Cost: the forward performs B*n*d_out*k*d_in multiply-accumulates, 2 FLOPs each; padded taps
// count (they are multiplied by the padding zeros, as an im2col convolution does).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

#include <cstdint>

namespace attn {

// `flops` (optional) receives the FLOPs the kernel performed (2 per multiply-accumulate).
Tensor conv1d(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b = {},
              int64_t* flops = nullptr);

struct Conv1dGrads {
  Tensor dx;  // (B, n, d_in)
  Tensor dW;  // (d_out, d_in, k)
  Tensor db;  // (d_out), undefined when the forward had no bias
};
// Gradients of conv1d from the upstream gradient dy (B, n, d_out) and the forward's x and W.
Conv1dGrads conv1d_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias);

}  // namespace attn
