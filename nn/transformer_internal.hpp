// Elementwise helpers shared by nn/transformer*.cpp (not part of the public API). The loops are
// omp simd: elementwise, so vectorising them changes no result.
#pragma once

#include "attn/core/tensor.hpp"

#include <initializer_list>

namespace attn::nn::detail {

// sum of same-shape float tensors of one dtype (any strides) -> a fresh contiguous tensor.
inline Tensor add_all(std::initializer_list<Tensor> terms) {
  const Tensor& first = *terms.begin();
  Tensor out = first.clone();
  auto run = [&](auto zero) {
    using F = decltype(zero);
    F* o = out.data<F>();
    bool skip = true;
    for (const Tensor& t : terms) {
      if (skip) {  // the first term is already in out
        skip = false;
        continue;
      }
      const Tensor c = t.contiguous();
      const F* s = c.data<F>();
      const int64_t n = out.numel();
#pragma omp simd  // out is a fresh tensor: no term aliases it
      for (int64_t i = 0; i < n; ++i)
        o[i] += s[i];
    }
  };
  if (out.dtype() == DType::F32)
    run(float{});
  else
    run(double{});
  return out;
}

// x * factor -> a fresh contiguous tensor (x float32 or float64).
inline Tensor scaled(const Tensor& x, double factor) {
  Tensor out = x.clone();
  auto run = [&](auto zero) {
    using F = decltype(zero);
    F* o = out.data<F>();
    const int64_t n = out.numel();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      o[i] = static_cast<F>(static_cast<double>(o[i]) * factor);
  };
  if (out.dtype() == DType::F32)
    run(float{});
  else
    run(double{});
  return out;
}

}  // namespace attn::nn::detail
