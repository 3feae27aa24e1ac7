// Elementwise helpers shared by nn/transformer*.cpp (not part of the public API). The loops are
// omp simd: elementwise, so vectorising them changes no result.
#pragma once

#include "attn/core/tensor.hpp"

#include <algorithm>
#include <initializer_list>
#include <vector>

namespace attn::nn::detail {

// sum of same-shape float tensors of one dtype (any strides) -> a fresh contiguous tensor, added
// left to right ((t0 + t1) + t2) + ...; the first two straight into the output (no clone).
inline Tensor add_all(std::initializer_list<Tensor> terms) {
  const Tensor& first = *terms.begin();
  std::vector<Tensor> parts;
  parts.reserve(terms.size());
  for (const Tensor& t : terms)
    parts.push_back(t.contiguous());
  Tensor out = Tensor::empty(first.shape(), first.dtype());
  const int64_t n = out.numel();
  auto run = [&](auto zero) {
    using F = decltype(zero);
    F* o = out.data<F>();
    const F* a = parts[0].data<F>();
    if (parts.size() == 1) {
      std::copy(a, a + n, o);
      return;
    }
    const F* b = parts[1].data<F>();
#pragma omp simd  // out is a fresh tensor: no term aliases it
    for (int64_t i = 0; i < n; ++i)
      o[i] = a[i] + b[i];
    for (size_t k = 2; k < parts.size(); ++k) {
      const F* c = parts[k].data<F>();
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        o[i] += c[i];
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
