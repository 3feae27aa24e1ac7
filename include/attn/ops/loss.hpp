// Softmax cross-entropy over the last dimension, with padded positions left out
// (torch.nn.functional.cross_entropy(logits.reshape(-1, C), targets.reshape(-1),
//  ignore_index=-100, reduction='mean'), plus d2l-style valid_lens masking).
//
//   logits  (..., C) float32 or float64, N = numel / C positions
//   targets (...)    I32 or I64, each in [0, C) or == ignore_index
//   valid_lens       optional, only for logits (B, T, C): position (b, t) is kept iff
//                    t < valid_lens[b] (d2l's sequence mask; float lengths as masked_softmax)
//
//   loss_p = logsumexp_c(logits[p]) - logits[p, targets[p]]   for kept positions p
//   mean:  loss = sum_kept loss_p / n_kept     (PyTorch: NaN when nothing is kept, 0/0)
//   sum:   loss = sum_kept loss_p
// A position is kept when its target is not ignore_index and (with valid_lens) it is inside the
// length. A target outside [0, C) that is not ignore_index is an Error.
//
// Backward: dlogits[p, c] = dloss * (softmax(logits[p])[c] - [c == targets[p]]) / n   for kept
// p (n = n_kept for mean, 1 for sum), 0 for left-out positions (so 0 everywhere when n_kept = 0,
// as PyTorch).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

enum class Reduction : uint8_t { kMean, kSum };

struct CrossEntropyOptions {
  int64_t ignore_index = -100;  // PyTorch's default
  Tensor valid_lens;            // undefined or (B,) for logits (B, T, C)
  Reduction reduction = Reduction::kMean;
};

struct CrossEntropyResult {
  double loss = 0.0;  // the reduced loss, in double
  int64_t kept = 0;   // number of positions that count
};

CrossEntropyResult softmax_cross_entropy(Context& ctx, const Tensor& logits, const Tensor& targets,
                                         const CrossEntropyOptions& opts = {});

// dlogits (..., C), logits' dtype, for an upstream gradient dloss of the scalar loss.
Tensor softmax_cross_entropy_backward(Context& ctx, const Tensor& logits, const Tensor& targets,
                                      const CrossEntropyOptions& opts = {}, double dloss = 1.0);

// Both at once, for a training step whose dloss is known before the loss (1, or a data-parallel
// step's 1 / kept positions over all ranks): softmax_cross_entropy's result and
// softmax_cross_entropy_backward's dlogits, the same bits, in one pass over the logits that takes
// each row's log-sum-exp once (the backward alone takes it again).
struct CrossEntropyWithGrad {
  CrossEntropyResult result;
  Tensor dlogits;
};
CrossEntropyWithGrad softmax_cross_entropy_with_grad(Context& ctx, const Tensor& logits,
                                                     const Tensor& targets,
                                                     const CrossEntropyOptions& opts = {},
                                                     double dloss = 1.0);

}  // namespace attn
