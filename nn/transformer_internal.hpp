// Elementwise helpers shared by nn/transformer*.cpp (not part of the public API), defined in
// nn/transformer_internal.cpp. The loops are omp simd: elementwise, so vectorising them changes
// no result.
#pragma once

#include "attn/core/tensor.hpp"

#include <algorithm>
#include <initializer_list>
#include <vector>

namespace attn::nn::detail {

// sum of same-shape float tensors of one dtype (any strides) -> a fresh contiguous tensor, added
// left to right ((t0 + t1) + t2) + ...; the first two straight into the output (no clone). Large
// sums run in chunks on up to `threads` OpenMP threads: elementwise, so the same bits.
// The first term float32, a later one may be bfloat16 (an autocast gradient): widened exactly as
// it is added, the sum of its .to(F32). (nn/transformer_internal.cpp)
Tensor add_all(std::initializer_list<Tensor> terms, int threads = 1);

// x * factor -> a fresh contiguous tensor (x float32 or float64), in chunks on up to `threads`
// OpenMP threads: elementwise, so the same bits. (nn/transformer_internal.cpp)
Tensor scaled(const Tensor& x, double factor, int threads = 1);

}  // namespace attn::nn::detail
