// masked_softmax: softmax over the last axis with d2l's valid_lens masking.
//
//   X          (B, T, S) float32 or float64 (any strides)
//   valid_lens undefined (no mask), (B,) or (B, T); I32, I64, F32 or F64
//   returns    (B, T, S) contiguous, X's dtype
//
// Key s of row (b, t) is kept iff float(s) < len, len = valid_lens[b] (1-D) or valid_lens[b, t]
// (2-D); float lengths work (2.5 keeps 0, 1, 2). Kept keys get softmax(X) over the kept keys,
// masked keys get exactly 0.
//
// A row with no kept key (len <= 0 or NaN) follows `policy`:
//   kUniform (default, d2l): every key weighs 1/S, padding included. d2l gets this by writing
//            -1e6 into masked slots, so all scores tie.
//   kZero    (PyTorch SDPA >= 2.5): the row is all zeros, so the attention output is 0.
// Never NaN from masking (PyTorch's MHA gives NaN there: see docs/semantics.md).
//
// Differences from d2l, on purpose: the input is not mutated (d2l writes -1e6 into the caller's
// tensor), and valid scores below -1e6 still win over masked ones (d2l's fill value is finite).
//
// d2l: masked_softmax(X, valid_lens).   PyTorch: softmax(X.masked_fill(~mask, -inf), -1).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

enum class MaskedRowPolicy : uint8_t { kUniform, kZero };

struct MaskOptions {
  Tensor valid_lens;        // undefined, (B / repeat,) or (B / repeat, T)
  int64_t lens_repeat = 1;  // row batch b reads valid_lens[b / lens_repeat] (MHA: num_heads)
  bool causal = false;      // also mask keys s > t (query t sees keys 0..t; top-left aligned)
  MaskedRowPolicy masked_rows = MaskedRowPolicy::kUniform;
};

Tensor masked_softmax(Context& ctx, const Tensor& X, const MaskOptions& mask = {});
Tensor masked_softmax(const Tensor& X, const Tensor& valid_lens = {});  // d2l's call

// Gradient of masked_softmax. Y is the forward output. Masked positions receive zero gradient
// (d2l overwrites them with a constant); rows with no kept key receive zero gradient everywhere.
//   dX = mask * Y * (dY - sum_s(dY * Y))
Tensor masked_softmax_backward(Context& ctx, const Tensor& dY, const Tensor& Y,
                               const MaskOptions& mask = {});

// Validates valid_lens against X's (B, T) and returns nothing; throws Error naming `op`.
void check_valid_lens(const char* op, const Tensor& valid_lens, int64_t B, int64_t T,
                      int64_t lens_repeat);

}  // namespace attn
