// The entry points behind attn.torch (python/attn/torch.py): scaled dot-product attention forward
// and backward as separate calls, so that a torch.autograd.Function can keep the forward's output
// and logsumexp and hand them to the fused backward. Private (underscore) names: the supported
// API is attn.torch's Function and MultiheadAttention.
//
// Vocabulary: B batch, T queries, S keys, H heads, D head width of q and k, Dv of v, E = H*D.
//
//   _sdpa_forward / _sdpa_backward: q (B, T, D), k (B, S, D), v (B, S, Dv), float32, float64 or
//     bfloat16, any strides (attn::scaled_dot_product_attention[_backward]). valid_lens are per
//     group of lens_repeat batch rows (d2l's MultiHeadAttention repeats them per head: a
//     (B, H, T, D) input reshaped to (B*H, T, D) passes lens_repeat = H).
//   _heads_forward / _heads_backward: q (B, T, H*D), k (B, S, H*D), v (B, S, H*Dv) with unit
//     feature stride and any row strides (column slices of one (B, T, 3E) in-projection, or its
//     (T, B, 3E) transpose), float32 or bfloat16, run by the fused kernel through head strides
//     (ops/attention_heads.hpp): no transpose copies. valid_lens per batch row b.
//
//   _linear_forward / _linear_backward: a linear layer y = x W^T + b on attn's GEMM (oneDNN through
//     kernels/cpu/matmul.hpp, on OpenMP: the pool attn's attention kernels and torch's own parallel
//     ops use), float32 or bfloat16. Every argument is a 2-D matrix with unit column stride and a
//     row stride (x may be a column slice or the rows of a (T, B, E) tensor read as (T*B, E)); the
//     results go into tensors the caller allocated with torch (written, never accumulated: torch's
//     autograd accumulates .grad itself). bf16 as attn::linear: f32 accumulation, each result
//     rounded once to bf16 as it is stored, db summed in double and rounded once. Each product
//     runs as cpu::gemm_panels (panels of output rows on a dynamic schedule): inside a PyTorch
//     loop OpenBLAS's worker keeps spinning on one core after every GEMM torch ran, and oneDNN's
//     even split then waited for the thread sharing that core (2 threads ran no faster than 1).
//
// Tensors come in as torch tensors and go through numpy_tensor.hpp's to_tensor (a view of the
// tensor's memory, torch.bfloat16 included); results go out as torch tensors over attn's buffers
// (to_torch). The backward of the heads entry point writes into gradient tensors the caller
// allocated with torch (so a packed (B, T, 3E) gradient needs no torch.cat); it checks that attn
// views their memory rather than a copy.
//
// Dropout: the forward takes a stream offset from the shared Context (attn.Context) and returns it
// with the seed; the backward redraws the same mask from that (seed, offset), whatever the
// context's seed is by then (the heads entry points pass the forward's recorded decisions instead,
// when the kernel recorded them: AttentionResult::dropout_keep). `threads` (>= 0, 0: all cores)
// overrides the context's thread count for this call only, so attn.torch can follow
// torch.get_num_threads().
#include "bindings.hpp"

#include "attn/core/dtype.hpp"
#include "attn/core/error.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/cpu/matmul.hpp"
#include "ops/attention_heads.hpp"

#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace attn::python {

namespace {

// Runs f(local) with the GIL released and the shared context locked, on a copy of the context
// whose thread count is `threads`; the dropout offsets it takes are written back.
template <typename F>
auto run_on_copy(const ContextPtr& shared, int threads, std::optional<uint64_t> seed, F&& f) {
  check(threads >= 0, "attn.torch", "threads is {}, expected >= 0 (0: all cores)", threads);
  return without_gil([&] {
    std::lock_guard lock(shared->mutex);
    Context local = shared->ctx;
    local.threads = threads;
    if (seed) local.seed = *seed;
    auto result = f(local);
    shared->ctx.set_dropout_offset(local.dropout_offset());
    return result;
  });
}

ContextPtr context_or_default(const ContextPtr& ctx) {
  return ctx ? ctx : default_context();
}

AttentionOptions attention_options(const Input& lens, int64_t lens_repeat, bool causal,
                                   double dropout, bool training, std::optional<double> scale,
                                   const std::string& masked_rows, const char* op) {
  AttentionOptions opts;
  opts.mask.valid_lens = lens.tensor;
  opts.mask.lens_repeat = lens_repeat;
  opts.mask.causal = causal;
  opts.mask.masked_rows = parse_masked_rows(masked_rows, op);
  opts.dropout = dropout;
  opts.training = training;
  opts.scale = scale;
  return opts;
}

// A view of the torch tensor `obj` that the caller's memory backs (results are written there).
Tensor writable_view(py::handle obj, Input& keep, const char* op, const char* name) {
  keep = to_tensor(obj, op, name, InputKind::kFloatBF16);
  const auto expected = obj.attr("data_ptr")().cast<uintptr_t>();
  check(reinterpret_cast<uintptr_t>(keep.tensor.raw_data()) == expected, op,
        "{} {} could not be viewed without a copy, expected a float32 or bfloat16 CPU tensor "
        "with non-negative strides",
        name, shape_str(keep.tensor.shape()));
  return keep.tensor;
}

// Forward results as Python: (out, logsumexp, seed, offset).
py::tuple forward_tuple(const AttentionResult& r, uint64_t seed) {
  return py::make_tuple(to_torch(r.output), to_torch(r.logsumexp), seed, r.dropout_offset);
}

// The forward's result as the backward reads it (output and logsumexp; weights are not needed).
AttentionResult saved_result(const Input& out, const Input& lse, uint64_t offset) {
  AttentionResult r;
  r.output = out.tensor;
  r.logsumexp = lse.tensor;
  r.dropout_offset = offset;
  return r;
}

// A (rows, cols) matrix as the GEMM reads it: unit column stride, row stride ld >= cols.
struct Matrix {
  void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
};

Matrix matrix_of(const Tensor& t, const char* op, const char* name) {
  check(t.ndim() == 2, op, "{} has shape {}, expected a 2-D matrix", name, shape_str(t.shape()));
  Matrix m{t.raw_data(), t.dim(0), t.dim(1), t.stride(0)};
  check(m.cols <= 1 || t.stride(1) == 1, op,
        "{} {} has column stride {}, expected 1 (a row-major matrix or a column slice of one)",
        name, shape_str(t.shape()), t.stride(1));
  if (m.rows <= 1) m.ld = std::max<int64_t>(m.cols, 1);
  check(m.ld >= m.cols, op, "{} {} has row stride {}, expected >= {} (rows that do not overlap)",
        name, shape_str(t.shape()), m.ld, m.cols);
  return m;
}

// Checks that `m` is (rows, cols); `what` spells the expectation for the message.
void check_dims(const Matrix& m, int64_t rows, int64_t cols, const char* op, const char* name,
                const char* what) {
  check(m.rows == rows && m.cols == cols, op, "{} is ({}, {}), expected {} = ({}, {})", name,
        m.rows, m.cols, what, rows, cols);
}

// The GEMM's element types for output `c` of dtype `dtype`: f32 in and out, or bf16 in and bf16
// out (oneDNN accumulates in f32 and rounds once as it stores).
void set_output(cpu::GemmArgs& g, const Matrix& c, DType dtype) {
  g.ldc = c.ld;
  if (dtype == DType::BF16) {
    g.type = cpu::GemmType::kBF16;
    g.C_bf16 = static_cast<uint16_t*>(c.data);
  } else {
    g.C = static_cast<float*>(c.data);
  }
}

// A float32 or bfloat16 torch tensor as an attn Tensor, dtype `dtype` (an Error names the first
// that differs); outputs (`writable`) must be viewed in place.
Tensor linear_arg(py::handle obj, Input& keep, DType dtype, bool writable, const char* op,
                  const char* name) {
  Tensor t = writable ? writable_view(obj, keep, op, name)
                      : (keep = to_tensor(obj, op, name, InputKind::kFloatBF16)).tensor;
  check(t.dtype() == dtype, op, "{} {} has dtype {}, expected {} (the call's dtype)", name,
        shape_str(t.shape()), python_dtype_name(t.dtype()), python_dtype_name(dtype));
  return t;
}

// The dtype of the call, read from its first argument `x` (named `name`): float32 or bfloat16.
DType linear_dtype(const Input& x, const char* op, const char* name) {
  const DType t = x.tensor.dtype();
  check(t == DType::F32 || t == DType::BF16, op,
        "{} has dtype {}, expected float32 or bfloat16 (float64 runs torch's F.linear)", name,
        python_dtype_name(t));
  return t;
}

// The bias (N) as float (the GEMM adds it in f32; bf16 values widen exactly).
std::vector<float> bias_as_float(const Tensor& b) {
  std::vector<float> out(static_cast<size_t>(b.dim(0)));
  for (int64_t n = 0; n < b.dim(0); ++n) {
    const std::byte* p = static_cast<const std::byte*>(b.raw_data()) +
                         n * b.stride(0) * static_cast<int64_t>(dtype_size(b.dtype()));
    out[static_cast<size_t>(n)] = b.dtype() == DType::BF16
                                      ? bf16_to_float(*reinterpret_cast<const uint16_t*>(p))
                                      : *reinterpret_cast<const float*>(p);
  }
  return out;
}

}  // namespace

void bind_torch(py::module_& m) {
  m.def(
      "_sdpa_forward",
      [](py::handle q_, py::handle k_, py::handle v_, py::handle valid_lens, int64_t lens_repeat,
         bool causal, double dropout, bool training, std::optional<double> scale,
         const std::string& masked_rows, int threads, ContextPtr ctx) {
        const char* op = "attn.torch.scaled_dot_product_attention";
        Input q = to_tensor(q_, op, "q", InputKind::kFloatBF16);
        Input k = to_tensor(k_, op, "k", InputKind::kFloatBF16);
        Input v = to_tensor(v_, op, "v", InputKind::kFloatBF16);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        check_same_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}});
        const AttentionOptions opts =
            attention_options(lens, lens_repeat, causal, dropout, training, scale, masked_rows, op);
        uint64_t seed = 0;
        AttentionResult r =
            run_on_copy(context_or_default(ctx), threads, std::nullopt, [&](Context& c) {
              seed = c.seed;
              return scaled_dot_product_attention(c, q.tensor, k.tensor, v.tensor, opts);
            });
        return forward_tuple(r, seed);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("valid_lens"), py::arg("lens_repeat"),
      py::arg("causal"), py::arg("dropout"), py::arg("training"), py::arg("scale"),
      py::arg("masked_rows"), py::arg("threads"), py::arg("ctx"),
      "attn.torch's forward on (B, T, D) tensors: (out, logsumexp, seed, dropout_offset).");

  m.def(
      "_sdpa_backward",
      [](py::handle dout_, py::handle q_, py::handle k_, py::handle v_, py::handle out_,
         py::handle lse_, py::handle valid_lens, int64_t lens_repeat, bool causal, double dropout,
         bool training, std::optional<double> scale, const std::string& masked_rows, uint64_t seed,
         uint64_t offset, int threads, ContextPtr ctx) {
        const char* op = "attn.torch.scaled_dot_product_attention backward";
        Input dout = to_tensor(dout_, op, "grad_output", InputKind::kFloatBF16);
        Input q = to_tensor(q_, op, "q", InputKind::kFloatBF16);
        Input k = to_tensor(k_, op, "k", InputKind::kFloatBF16);
        Input v = to_tensor(v_, op, "v", InputKind::kFloatBF16);
        Input out = to_tensor(out_, op, "output", InputKind::kFloatBF16);
        Input lse = to_tensor(lse_, op, "logsumexp", InputKind::kFloat);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        const AttentionOptions opts =
            attention_options(lens, lens_repeat, causal, dropout, training, scale, masked_rows, op);
        const AttentionResult forward = saved_result(out, lse, offset);
        AttentionGrads g = run_on_copy(context_or_default(ctx), threads, seed, [&](Context& c) {
          return scaled_dot_product_attention_backward(c, dout.tensor, q.tensor, k.tensor, v.tensor,
                                                       forward, opts);
        });
        return py::make_tuple(to_torch(g.dq), to_torch(g.dk), to_torch(g.dv));
      },
      py::arg("grad_output"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("output"),
      py::arg("logsumexp"), py::arg("valid_lens"), py::arg("lens_repeat"), py::arg("causal"),
      py::arg("dropout"), py::arg("training"), py::arg("scale"), py::arg("masked_rows"),
      py::arg("seed"), py::arg("offset"), py::arg("threads"), py::arg("ctx"),
      "attn.torch's backward on (B, T, D) tensors: (dq, dk, dv).");

  m.def(
      "_heads_supported",
      [](py::handle dtype, ContextPtr ctx) {
        const DType t = parse_float_dtype(dtype, "attn.torch", /*allow_bf16=*/true);
        const ContextPtr c = context_or_default(ctx);
        std::lock_guard lock(c->mutex);
        return detail::multi_head_fused_supported(c->ctx, t, AttentionOptions{});
      },
      py::arg("dtype"), py::arg("ctx"),
      "Whether the fused head-strided kernels serve this dtype on ctx's backend.");

  m.def(
      "_heads_forward",
      [](py::handle q_, py::handle k_, py::handle v_, int64_t heads, py::handle valid_lens,
         bool causal, double dropout, bool training, std::optional<double> scale,
         const std::string& masked_rows, int threads, ContextPtr ctx) {
        const char* op = "attn.torch multi-head attention";
        Input q = to_tensor(q_, op, "q", InputKind::kFloatBF16);
        Input k = to_tensor(k_, op, "k", InputKind::kFloatBF16);
        Input v = to_tensor(v_, op, "v", InputKind::kFloatBF16);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        check_same_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}});
        const AttentionOptions opts =
            attention_options(lens, 1, causal, dropout, training, scale, masked_rows, op);
        uint64_t seed = 0;
        AttentionResult r =
            run_on_copy(context_or_default(ctx), threads, std::nullopt, [&](Context& c) {
              seed = c.seed;
              return detail::multi_head_attention_forward(c, q.tensor, k.tensor, v.tensor, heads,
                                                          opts);
            });
        // The kernel's recorded dropout decisions (an int32 tensor, or None): the backward
        // reads them instead of redrawing the mask.
        return py::make_tuple(to_torch(r.output), to_torch(r.logsumexp), seed, r.dropout_offset,
                              to_torch(r.dropout_keep));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("heads"), py::arg("valid_lens"),
      py::arg("causal"), py::arg("dropout"), py::arg("training"), py::arg("scale"),
      py::arg("masked_rows"), py::arg("threads"), py::arg("ctx"),
      "attn.torch's fused forward on (B, T, H*D) tensors: (out (B, T, H*Dv), logsumexp (B*H, T), "
      "seed, dropout_offset, dropout_keep (int32 tensor or None)).");

  m.def(
      "_heads_backward",
      [](py::handle dout_, py::handle q_, py::handle k_, py::handle v_, py::handle out_,
         py::handle lse_, int64_t heads, py::handle valid_lens, bool causal, double dropout,
         bool training, std::optional<double> scale, const std::string& masked_rows, uint64_t seed,
         uint64_t offset, py::handle dq_, py::handle dk_, py::handle dv_, int threads,
         ContextPtr ctx, py::handle dropout_keep) {
        const char* op = "attn.torch multi-head attention backward";
        Input dout = to_tensor(dout_, op, "grad_output", InputKind::kFloatBF16);
        Input q = to_tensor(q_, op, "q", InputKind::kFloatBF16);
        Input k = to_tensor(k_, op, "k", InputKind::kFloatBF16);
        Input v = to_tensor(v_, op, "v", InputKind::kFloatBF16);
        Input out = to_tensor(out_, op, "output", InputKind::kFloatBF16);
        Input lse = to_tensor(lse_, op, "logsumexp", InputKind::kFloat);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        Input dq_keep, dk_keep, dv_keep;
        Tensor dq = writable_view(dq_, dq_keep, op, "dq");
        Tensor dk = writable_view(dk_, dk_keep, op, "dk");
        Tensor dv = writable_view(dv_, dv_keep, op, "dv");
        const AttentionOptions opts =
            attention_options(lens, 1, causal, dropout, training, scale, masked_rows, op);
        AttentionResult forward = saved_result(out, lse, offset);
        // Used only when it has the size this problem's decisions take (else redrawn).
        Input keep = to_tensor(dropout_keep, op, "dropout_keep", InputKind::kLens, true);
        if (keep.tensor.defined() && keep.tensor.dtype() == DType::I32 &&
            keep.tensor.is_contiguous())
          forward.dropout_keep = keep.tensor;
        run_on_copy(context_or_default(ctx), threads, seed, [&](Context& c) {
          detail::multi_head_attention_backward(c, dout.tensor, q.tensor, k.tensor, v.tensor,
                                                forward, heads, opts, dq, dk, dv);
          return 0;
        });
      },
      py::arg("grad_output"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("output"),
      py::arg("logsumexp"), py::arg("heads"), py::arg("valid_lens"), py::arg("causal"),
      py::arg("dropout"), py::arg("training"), py::arg("scale"), py::arg("masked_rows"),
      py::arg("seed"), py::arg("offset"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
      py::arg("threads"), py::arg("ctx"), py::arg("dropout_keep") = py::none(),
      "attn.torch's fused backward on (B, T, H*D) tensors: writes dq, dk, dv (torch tensors the "
      "caller allocated, shapes of q, k, v, unit feature stride); dropout_keep: the forward's.");

  m.def(
      "_linear_forward",
      [](py::handle x_, py::handle w_, py::handle b_, py::handle y_, int threads) {
        const char* op = "attn.torch linear";
        check(threads >= 1, op, "threads is {}, expected >= 1", threads);
        Input xi, wi, bi, yi;
        xi = to_tensor(x_, op, "x", InputKind::kFloatBF16);
        const DType dtype = linear_dtype(xi, op, "x");
        const Matrix x = matrix_of(xi.tensor, op, "x");
        const Matrix w = matrix_of(linear_arg(w_, wi, dtype, false, op, "W"), op, "W");
        const Matrix y = matrix_of(linear_arg(y_, yi, dtype, true, op, "y"), op, "y");
        check(w.cols == x.cols, op, "x is ({}, {}) and W ({}, {}), expected W (out, {})", x.rows,
              x.cols, w.rows, w.cols, x.cols);
        check_dims(y, x.rows, w.rows, op, "y", "(rows of x, rows of W)");
        std::vector<float> bias;
        if (!b_.is_none()) {
          const Tensor b = linear_arg(b_, bi, dtype, false, op, "b");
          check(b.ndim() == 1 && b.dim(0) == w.rows, op, "b has shape {}, expected (out) = ({})",
                shape_str(b.shape()), w.rows);
          bias = bias_as_float(b);
        }
        // y (M, N) = x (M, K) * W^T + b: W (N, K) is read in place as transposed weights.
        cpu::GemmArgs g;
        g.M = x.rows, g.N = w.rows, g.K = x.cols;
        g.A = x.data, g.lda = x.ld;
        g.B = w.data, g.ldb = w.ld, g.trans_b = true;
        set_output(g, y, dtype);
        g.bias = bias.empty() ? nullptr : bias.data();
        without_gil([&] { cpu::gemm_panels(g, threads); });
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("y"), py::arg("threads"),
      "y (M, N) = x (M, K) W^T + b on attn's GEMM, written into y (a torch tensor the caller "
      "allocated); float32 or bfloat16 2-D matrices with unit column stride.");

  m.def(
      "_linear_backward",
      [](py::handle dy_, py::handle x_, py::handle w_, py::handle dx_, py::handle dw_,
         py::handle db_, int threads) {
        const char* op = "attn.torch linear backward";
        check(threads >= 1, op, "threads is {}, expected >= 1", threads);
        Input dyi, xi, wi, dxi, dwi, dbi;
        dyi = to_tensor(dy_, op, "grad_output", InputKind::kFloatBF16);
        const DType dtype = linear_dtype(dyi, op, "grad_output");
        const Matrix dy = matrix_of(dyi.tensor, op, "grad_output");
        const Matrix x = matrix_of(linear_arg(x_, xi, dtype, false, op, "x"), op, "x");
        const Matrix w = matrix_of(linear_arg(w_, wi, dtype, false, op, "W"), op, "W");
        check(w.cols == x.cols, op, "x is ({}, {}) and W ({}, {}), expected W (out, {})", x.rows,
              x.cols, w.rows, w.cols, x.cols);
        check_dims(dy, x.rows, w.rows, op, "grad_output", "(rows of x, rows of W)");
        const int64_t M = x.rows, N = w.rows, K = x.cols;
        std::optional<Matrix> dx, dw;
        if (!dx_.is_none()) dx = matrix_of(linear_arg(dx_, dxi, dtype, true, op, "dx"), op, "dx");
        if (!dw_.is_none()) dw = matrix_of(linear_arg(dw_, dwi, dtype, true, op, "dW"), op, "dW");
        if (dx) check_dims(*dx, M, K, op, "dx", "x's shape");
        if (dw) check_dims(*dw, N, K, op, "dW", "W's shape");
        Tensor db;
        if (!db_.is_none()) {
          db = linear_arg(db_, dbi, dtype, true, op, "db");
          check(db.ndim() == 1 && db.dim(0) == N && (N <= 1 || db.stride(0) == 1), op,
                "db has shape {} (stride {}), expected a contiguous (out) = ({})",
                shape_str(db.shape()), db.ndim() == 1 ? db.stride(0) : 0, N);
        }
        without_gil([&] {
          // forward: y = x W^T + b
          // so:      dx (M, K) = dy (M, N) * W (N, K)
          if (dx) {
            cpu::GemmArgs g;
            g.M = M, g.N = K, g.K = N;
            g.A = dy.data, g.lda = dy.ld;
            g.B = w.data, g.ldb = w.ld;
            set_output(g, *dx, dtype);
            cpu::gemm_panels(g, threads);
          }
          //          dW (N, K) = dy^T (N, M) * x (M, K): the sum over rows is the contraction
          if (dw) {
            cpu::GemmArgs g;
            g.M = N, g.N = K, g.K = M;
            g.A = dy.data, g.lda = dy.ld, g.trans_a = true;
            g.B = x.data, g.ldb = x.ld;
            set_output(g, *dw, dtype);
            cpu::gemm_panels(g, threads);
          }
          //          db (N) = sum over rows of dy, in double (bf16: rounded once at the end)
          if (db.defined()) {
            if (dtype == DType::BF16) {
              std::vector<float> sum(static_cast<size_t>(N));
              cpu::column_sum(static_cast<const uint16_t*>(dy.data), M, N, dy.ld, sum.data(), false,
                              threads);
              auto* out = static_cast<uint16_t*>(db.raw_data());
              for (int64_t n = 0; n < N; ++n)
                out[n] = float_to_bf16(sum[static_cast<size_t>(n)]);
            } else {
              cpu::column_sum(static_cast<const float*>(dy.data), M, N, dy.ld, db.data<float>(),
                              false, threads);
            }
          }
        });
      },
      py::arg("grad_output"), py::arg("x"), py::arg("weight"), py::arg("dx"), py::arg("dweight"),
      py::arg("dbias"), py::arg("threads"),
      "The linear layer's gradients on attn's GEMM, each written (not accumulated) into a torch "
      "tensor the caller allocated, or skipped when None: dx = dy W, dW = dy^T x, db = sum of dy "
      "over rows.");
}

}  // namespace attn::python
