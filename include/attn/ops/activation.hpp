// Elementwise activations.
//
// relu(x) = max(x, 0)    (torch.relu; d2l PositionWiseFFN's nn.ReLU)
// relu_backward: dx = dy where x > 0, else 0. The derivative at exactly 0 is taken as 0, as
// PyTorch's threshold_backward does. NaN inputs propagate (relu(NaN) = NaN).
// BF16 (torch.relu on a bf16 tensor): the float32 formula on the widened values, narrowed back
// exactly, so a bf16 relu is bit for bit the float32 relu of the widened input rounded to bf16
// (mixed precision keeps the FFN's hidden layer in bf16 this way).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

Tensor relu(Context& ctx, const Tensor& x);                             // any shape, F32/F64/BF16
Tensor relu_backward(Context& ctx, const Tensor& dy, const Tensor& x);  // x: the forward input

}  // namespace attn
