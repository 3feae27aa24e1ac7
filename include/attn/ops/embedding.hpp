// Embedding lookup (torch.nn.functional.embedding; d2l's nn.Embedding(vocab_size, num_hiddens)).
//
//   ids (...) I32 or I64, every id in [0, V)     weight (V, E) float32 or float64
//   out (..., E)[p, e] = weight[ids[p], e]
// An id outside [0, V) is an Error naming the first offender (PyTorch raises IndexError).
// No padding_idx and no max_norm: d2l uses neither.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

Tensor embedding(Context& ctx, const Tensor& ids, const Tensor& weight);

// Gradient of the table: dweight (V, E) with dweight[v] = sum over positions p with ids[p] == v
// of dout[p] (a scatter-add; rows of ids never seen stay 0). dout (..., E), ids as the forward.
Tensor embedding_backward(Context& ctx, const Tensor& dout, const Tensor& ids, int64_t vocab_size);

}  // namespace attn
