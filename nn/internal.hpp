// Helpers shared by the modules in nn/ (not part of the public API).
#pragma once

#include "attn/core/tensor.hpp"
#include "attn/nn/module.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace attn::nn::detail {

// A 64-bit stream id derived from a name (FNV-1a), so that every parameter draws its initial
// values from its own Philox stream: Rng(seed, name_stream("weight")).
uint64_t name_stream(std::string_view name);
// The seed a child module gets from its parent's seed and its attribute name ("W_q"), so that
// W_q and W_k of one MultiHeadAttention start different (splitmix64 finaliser of the mix).
uint64_t child_seed(uint64_t seed, std::string_view name);

// "MultiHeadAttention" for a module object (its dynamic type, namespace stripped).
std::string module_name(const Module& m);

// Fills a fresh contiguous F32/F64 tensor with draw() in row-major order (a typed loop: a large
// embedding table has millions of entries).
template <typename Draw>
void fill_with(Tensor& t, Draw&& draw) {
  if (t.dtype() == DType::F32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      p[i] = static_cast<float>(draw());
  } else {
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i)
      p[i] = draw();
  }
}

// grad += g elementwise; g may have any strides and any float dtype, but grad.numel() elements
// in the same row-major order (so (h) accumulates into (1, h)). Large contiguous float gradients
// are split over up to `threads` OpenMP threads (elementwise: the same bits).
void accumulate(Tensor& grad, const Tensor& g, int threads = 1);

// x.to(dtype) (float32 <-> bfloat16, a contiguous x), split into chunks converted on up to
// ctx.resolved_threads() OpenMP threads when x is large: elementwise, so the same bits as x.to.
// Any other case is x.to(dtype) itself.
Tensor convert(const Context& ctx, const Tensor& x, DType dtype);

// Whether a module of `module_dtype` computes its linear layers and attention core in bfloat16
// (Context::autocast_bf16: float32 modules only, and not on the reference backend, which is the
// oracle and stays in the module's precision).
bool autocasts(const Context& ctx, DType module_dtype);

// Checks that x is a float tensor of the module's dtype with `ndim` dimensions.
void check_input(const char* op, const char* what, const Tensor& x, int ndim, DType dtype);

// d2l's transpose_qkv: X (B, L, H*D) -> (B*H, L, D) contiguous, row b*H + h holding features
// [h*D, (h+1)*D) of X[b]. Any strides of X.
Tensor split_heads(const Tensor& X, int64_t num_heads);
// d2l's transpose_output, the inverse: Y (B*H, L, D) -> (B, L, H*D) contiguous.
Tensor merge_heads(const Tensor& Y, int64_t num_heads);
// The same into out (B, L, H*D) of Y's dtype, any strides (e.g. a slice of a (B, L, 3E) buffer).
void merge_heads_into(const Tensor& Y, int64_t num_heads, Tensor& out);

// Row i of the result is row rows[i] of t along dim 0 (t made contiguous first): beam search's
// reordering of the decoder cache (decoder_cache.cpp) and of the encoder outputs
// (model/generation.cpp).
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows);

}  // namespace attn::nn::detail
