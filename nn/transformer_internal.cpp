// add_all and scaled (nn/transformer_internal.hpp): compiled here, with OpenMP, rather than
// inline in the header (which tests include without OpenMP).
#include "nn/transformer_internal.hpp"

#include "kernels/cpu/parallel_for.hpp"

#include <algorithm>
#include <vector>

namespace attn::nn::detail {

Tensor add_all(std::initializer_list<Tensor> terms, int threads) {
  constexpr int64_t kChunk = int64_t{1} << 14;  // elements per task
  const Tensor& first = *terms.begin();
  std::vector<Tensor> parts;
  parts.reserve(terms.size());
  for (const Tensor& t : terms) {
    check(t.dtype() == first.dtype() ||
              (first.dtype() == DType::F32 && t.dtype() == DType::BF16 && &t != &first),
          "add_all", "terms of dtype {} and {}: expected one float dtype (or bf16 after F32)",
          dtype_name(first.dtype()), dtype_name(t.dtype()));
    parts.push_back(t.contiguous());
  }
  Tensor out = Tensor::empty(first.shape(), first.dtype());
  const int64_t n = out.numel(), chunks = (n + kChunk - 1) / kChunk;
  auto run = [&](auto zero) {
    using F = decltype(zero);
    F* const o = out.data<F>();
    cpu::parallel_for(chunks, threads, [&](int64_t c) {
      const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
      const F* a = parts[0].data<F>();
      if (parts.size() == 1) {
        std::copy(a + i0, a + i1, o + i0);
        return;
      }
      for (size_t k = 1; k < parts.size(); ++k) {
        // o = a + t for the second term (straight into the output), o += t after.
        const F* base = k == 1 ? a : o;
        if (parts[k].dtype() == DType::BF16) {
          const auto* t = static_cast<const uint16_t*>(parts[k].raw_data());
#pragma omp simd  // out is a fresh tensor: no term aliases it
          for (int64_t i = i0; i < i1; ++i)
            o[i] = base[i] + bf16_to_float(t[i]);
        } else {
          const F* t = parts[k].data<F>();
#pragma omp simd
          for (int64_t i = i0; i < i1; ++i)
            o[i] = base[i] + t[i];
        }
      }
    });
  };
  if (out.dtype() == DType::F32)
    run(float{});
  else
    run(double{});
  return out;
}

Tensor scaled(const Tensor& x, double factor, int threads) {
  constexpr int64_t kChunk = int64_t{1} << 14;  // elements per task
  const Tensor in = x.contiguous();
  Tensor out = Tensor::empty(in.shape(), in.dtype());
  const int64_t n = out.numel(), chunks = (n + kChunk - 1) / kChunk;
  auto run = [&](auto zero) {
    using F = decltype(zero);
    const F* const a = in.data<F>();
    F* const o = out.data<F>();
    cpu::parallel_for(chunks, threads, [&](int64_t c) {
      const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
#pragma omp simd
      for (int64_t i = i0; i < i1; ++i)
        o[i] = static_cast<F>(static_cast<double>(a[i]) * factor);
    });
  };
  if (out.dtype() == DType::F32)
    run(float{});
  else
    run(double{});
  return out;
}

}  // namespace attn::nn::detail
