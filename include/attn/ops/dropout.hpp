// Inverted dropout with a Context: the same op as dropout / dropout_backward in
// attn/ops/attention.hpp (the Philox dropout stream of attn/core/rng.hpp, element i kept iff
// u_i >= p and scaled by 1 / (1 - p)), dispatched on ctx.backend: float32 on kAuto / kCpu takes
// the multi-threaded kernel (kernels/cpu/encoder_ops), which gives the reference's bits exactly.
// Data parallelism: x's outermost axis is its sample axis, and element i is drawn at stream index
// ctx.dropout_index_base(numel / dim(0)) + i, so a shard of a batch (Context::dropout_first_sample
// its first sample) draws the masks of those samples in the whole batch (base 0 by default).
//
// PyTorch: torch.nn.functional.dropout(x, p, training=True) (another random stream).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

#include <cstdint>

namespace attn {

// y = x * mask / (1 - p), mask from (seed, offset); x F32/F64, any shape; p in [0, 1].
Tensor dropout(Context& ctx, const Tensor& x, double p, uint64_t seed, uint64_t offset);
// forward: y = x * factor(i); so dx = dy * factor(i), the mask redrawn from (seed, offset).
Tensor dropout_backward(Context& ctx, const Tensor& dy, double p, uint64_t seed, uint64_t offset);

}  // namespace attn
