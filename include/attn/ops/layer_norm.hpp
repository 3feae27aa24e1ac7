// Layer normalisation over the last dimension (Ba et al. 2016; torch.nn.LayerNorm(E), eps 1e-5).
//
//   x (..., E), gamma (E), beta (E)  float32 or float64, any strides
//   mean[r] = (1/E) sum_e x[r, e]
//   var[r]  = (1/E) sum_e (x[r, e] - mean[r])^2          biased, as PyTorch
//   rstd[r] = 1 / sqrt(var[r] + eps)
//   y[r, e] = (x[r, e] - mean[r]) * rstd[r] * gamma[e] + beta[e]
// r runs over all leading positions (R = numel / E rows). gamma and beta are both given (affine,
// PyTorch's default) or both undefined (elementwise_affine=False: gamma = 1, beta = 0).
//
// d2l: nn.LayerNorm(num_hiddens) inside AddNorm.   PyTorch: F.layer_norm(x, (E,), w, b, 1e-5).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

namespace attn {

struct LayerNormResult {
  Tensor y;     // (..., E) contiguous, x's dtype
  Tensor mean;  // (...) the row means, x's dtype (saved for the backward)
  Tensor rstd;  // (...) 1 / sqrt(var + eps)
};

LayerNormResult layer_norm(Context& ctx, const Tensor& x, const Tensor& gamma = {},
                           const Tensor& beta = {}, double eps = 1e-5);

struct LayerNormGrads {
  Tensor dx;      // (..., E)
  Tensor dgamma;  // (E), undefined without affine
  Tensor dbeta;   // (E), undefined without affine
};

// Backward from the forward's input and saved statistics. With xhat = (x - mean) * rstd and
// g = dy * gamma:
//   dx     = rstd * (g - mean_e(g) - xhat * mean_e(g * xhat))
//   dgamma = sum_r dy * xhat,   dbeta = sum_r dy
LayerNormGrads layer_norm_backward(Context& ctx, const Tensor& dy, const Tensor& x,
                                   const Tensor& gamma, const LayerNormResult& forward);

}  // namespace attn
