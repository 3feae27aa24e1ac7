// embedding / embedding_backward: validation (dtypes, shapes, every id in range), then the
// reference kernel (kernels/ref/embedding.cpp) on Backend::kReference, else the same loops on
// the context's threads (below).
#include "attn/ops/embedding.hpp"

#include "kernels/cpu/parallel_for.hpp"
#include "kernels/ref/embedding.hpp"
#include "ops/common.hpp"

#include <algorithm>
#include <vector>

namespace attn {
namespace {

// Every id in [0, V); names the first offender with its position.
template <typename Id>
void check_ids_in_range(const char* op, const Id* ids, int64_t N, int64_t V, const Shape& shape) {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = static_cast<int64_t>(ids[n]);
    // Tested before check() so that the message's shape string is built only on failure, not for
    // every token of every batch.
    if (id >= 0 && id < V) continue;
    check(false, op,
          "ids {} holds {} at flat position {}, expected ids in [0, {}) (the vocabulary size)",
          shape_arg(shape), id, n, V);
  }
}

// Calls f(int32_t{}) or f(int64_t{}) for validated ids.
template <typename F>
void dispatch_ids(DType dtype, F&& f) {
  if (dtype == DType::I32)
    f(int32_t{});
  else
    f(int64_t{});
}

void check_ids(const char* op, const Tensor& ids) {
  check(ids.defined(), op, "ids is undefined, expected an I32 or I64 tensor");
  check(ids.dtype() == DType::I32 || ids.dtype() == DType::I64, op,
        "ids {} has dtype {}, expected I32 or I64", shape_arg(ids.shape()),
        dtype_name(ids.dtype()));
}

// Threaded versions for the fast backends (Backend::kReference keeps the reference kernel): the
// same values, since the forward copies rows and the backward sums each (id, e) element over the
// positions in order, whichever thread owns its block of columns.
constexpr int64_t kEmbeddingColumns = 16;                    // columns per task of the backward
constexpr int64_t kEmbeddingParallelMin = int64_t{1} << 16;  // N * E below this: one thread

template <typename Id, typename F>
void embedding_forward_threads(const Id* ids, const F* weight, F* out, int64_t N, int64_t E,
                               int threads) {
  cpu::parallel_for(N, N * E >= kEmbeddingParallelMin ? threads : 1, [&](int64_t n) {
    std::copy(weight + static_cast<int64_t>(ids[n]) * E,
              weight + static_cast<int64_t>(ids[n]) * E + E, out + n * E);
  });
}

template <typename Id, typename F>
void embedding_backward_threads(const F* dout, const Id* ids, F* dweight, int64_t N, int64_t V,
                                int64_t E, int threads) {
  std::vector<double> acc(static_cast<size_t>(V * E), 0.0);
  const int64_t blocks = (E + kEmbeddingColumns - 1) / kEmbeddingColumns;
  cpu::parallel_for(blocks, N * E >= kEmbeddingParallelMin ? threads : 1, [&](int64_t j) {
    const int64_t e0 = j * kEmbeddingColumns, e1 = std::min(E, e0 + kEmbeddingColumns);
    for (int64_t n = 0; n < N; ++n) {
      double* row = acc.data() + static_cast<int64_t>(ids[n]) * E;
      const F* d = dout + n * E;
#pragma omp simd
      for (int64_t e = e0; e < e1; ++e)
        row[e] += d[e];
    }
    for (int64_t v = 0; v < V; ++v)
      for (int64_t e = e0; e < e1; ++e)
        dweight[v * E + e] = static_cast<F>(acc[static_cast<size_t>(v * E + e)]);
  });
}

}  // namespace

Tensor embedding(Context& ctx, const Tensor& ids, const Tensor& weight) {
  constexpr const char* op = "embedding";
  check_ids(op, ids);
  detail::check_float_tensor(op, "weight", weight);
  detail::check_ndim(op, "weight", weight, 2, "(V, E)");
  const int64_t V = weight.dim(0), E = weight.dim(1), N = ids.numel();
  Shape out_shape = ids.shape();
  out_shape.push_back(E);
  const Tensor ic = ids.contiguous(), wc = weight.contiguous();
  Tensor out = Tensor::empty(out_shape, weight.dtype());
  dispatch_ids(ids.dtype(), [&](auto id_zero) {
    using Id = decltype(id_zero);
    check_ids_in_range(op, ic.data<Id>(), N, V, ids.shape());
    detail::dispatch_float(weight.dtype(), [&](auto zero) {
      using F = decltype(zero);
      if (ctx.backend == Backend::kReference) {
        ref::embedding_forward<Id, F>(ic.data<Id>(), wc.data<F>(), out.data<F>(), N, E);
      } else {
        embedding_forward_threads<Id, F>(ic.data<Id>(), wc.data<F>(), out.data<F>(), N, E,
                                         ctx.resolved_threads());
      }
    });
  });
  return out;
}

Tensor embedding_backward(Context& ctx, const Tensor& dout, const Tensor& ids, int64_t vocab_size) {
  constexpr const char* op = "embedding_backward";
  check_ids(op, ids);
  detail::check_float_tensor(op, "dout", dout);
  check(vocab_size >= 1, op, "vocab_size is {}, expected >= 1", vocab_size);
  check(dout.ndim() == ids.ndim() + 1, op, "dout has shape {}, expected ids' shape {} + (E)",
        shape_arg(dout.shape()), shape_arg(ids.shape()));
  for (int i = 0; i < ids.ndim(); ++i)
    check(dout.dim(i) == ids.dim(i), op, "dout has shape {}, expected ids' shape {} + (E)",
          shape_arg(dout.shape()), shape_arg(ids.shape()));
  const int64_t E = dout.dim(-1), N = ids.numel();
  const Tensor ic = ids.contiguous(), dc = dout.contiguous();
  Tensor dweight = Tensor::empty({vocab_size, E}, dout.dtype());
  dispatch_ids(ids.dtype(), [&](auto id_zero) {
    using Id = decltype(id_zero);
    check_ids_in_range(op, ic.data<Id>(), N, vocab_size, ids.shape());
    detail::dispatch_float(dout.dtype(), [&](auto zero) {
      using F = decltype(zero);
      if (ctx.backend == Backend::kReference) {
        ref::embedding_backward<Id, F>(dc.data<F>(), ic.data<Id>(), dweight.data<F>(), N,
                                       vocab_size, E);
      } else {
        embedding_backward_threads<Id, F>(dc.data<F>(), ic.data<Id>(), dweight.data<F>(), N,
                                          vocab_size, E, ctx.resolved_threads());
      }
    });
  });
  return dweight;
}

}  // namespace attn
