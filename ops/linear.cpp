// linear / linear_relu / linear_backward: validation, then dispatch (linear_relu and a relu_out
// in the backward: the ReLU as a row epilogue of the product, cpu::RowTask; the reference paths
// run relu / relu_backward after).
//   backend kAuto or kCpu, float32  -> oneDNN matmul (kernels/cpu/matmul), strided views read in
//                                      place (a copy only when rows do not share one stride)
//   backend kAuto or kCpu, bfloat16 -> the same with GemmType::kBF16 and bf16 outputs: products
//                                      accumulated in f32 (bias added in f32), each result
//                                      rounded once to bf16 as oneDNN stores it; dx and dW
//                                      likewise, db summed in double, then to f32 and bf16
//   backend kReference, or float64  -> the reference loops (kernels/ref/linear.cpp); bf16 widened,
//                                      double accumulation, one rounding
#include "attn/ops/linear.hpp"
#include "ops/linear_parameter.hpp"

#include "attn/core/dtype.hpp"
#include "attn/ops/activation.hpp"
#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "kernels/cpu/matmul.hpp"
#include "kernels/ref/linear.hpp"
#include "ops/common.hpp"

#include <algorithm>
#include <optional>

namespace attn {
namespace {

bool use_fast_path(const Context& ctx, DType dtype) {
  return ctx.backend != Backend::kReference && (dtype == DType::F32 || dtype == DType::BF16);
}

// x, W, b, dy: float32, float64 or bfloat16 (all the same dtype, checked separately).
void check_linear_dtype(const char* op, const char* name, const Tensor& t) {
  check(t.defined(), op, "{} is undefined, expected a float32, float64 or bfloat16 tensor", name);
  check(t.dtype() == DType::F32 || t.dtype() == DType::F64 || t.dtype() == DType::BF16, op,
        "{} {} has dtype {}, expected F32, F64 or BF16", name, shape_arg(t.shape()),
        dtype_name(t.dtype()));
}

// The GEMM's element types for an output `out` whose rows are `ld` elements apart: f32 in and out,
// or bf16 in and bf16 out (oneDNN accumulates in f32 and rounds once when it stores).
void set_output(cpu::GemmArgs& g, Tensor& out, int64_t ld) {
  g.ldc = ld;
  if (out.dtype() == DType::BF16) {
    g.type = cpu::GemmType::kBF16;
    g.C_bf16 = static_cast<uint16_t*>(out.raw_data());
  } else {
    g.C = out.data<float>();
  }
}

// t (..., n) seen as a (rows, n) matrix with unit column stride and one row stride `ld`, as the
// GEMM takes it. Possible when the last dim is unit-stride and the leading dims collapse into one
// (contiguous tensors, slices of the last dim, row slices); dims of size 1 impose nothing.
struct RowMatrix {
  const void* data;
  int64_t rows, cols, ld;
};
std::optional<RowMatrix> as_row_matrix(const Tensor& t) {
  const int n = t.ndim();
  const int64_t cols = t.dim(n - 1);
  if (cols > 1 && t.stride(n - 1) != 1) return std::nullopt;
  int64_t rows = 1, ld = 0;
  int64_t next = 0;  // the stride the next outer dim must have to collapse
  for (int i = n - 2; i >= 0; --i) {
    if (t.dim(i) == 1) continue;
    if (ld == 0) {
      ld = t.stride(i);
      if (ld < cols) return std::nullopt;  // overlapping or reversed rows
    } else if (t.stride(i) != next) {
      return std::nullopt;
    }
    rows *= t.dim(i);
    next = t.stride(i) * t.dim(i);
  }
  if (ld == 0) ld = std::max<int64_t>(cols, 1);
  return RowMatrix{t.raw_data(), rows, cols, ld};
}

// The row matrix of t, copying t to a contiguous tensor (kept alive in `storage`) when its
// strides do not allow a view.
RowMatrix row_matrix(const Tensor& t, Tensor& storage) {
  if (auto m = as_row_matrix(t)) return *m;
  storage = t.contiguous();
  return *as_row_matrix(storage);
}

// x (..., in) and W (out, in); returns y's shape (..., out).
Shape check_linear(const char* op, const Tensor& x, const Tensor& W) {
  check_linear_dtype(op, "x", x);
  check_linear_dtype(op, "W", W);
  check(x.ndim() >= 1, op, "x has shape {}, expected (..., in)", shape_arg(x.shape()));
  detail::check_ndim(op, "W", W, 2, "(out, in)");
  detail::check_same_dtype(op, "W", W, "x", x);
  check(x.dim(-1) == W.dim(1), op, "x {} and W {} do not match, expected x (..., {})",
        shape_arg(x.shape()), shape_arg(W.shape()), W.dim(1));
  Shape y_shape = x.shape();
  y_shape.back() = W.dim(0);
  return y_shape;
}

// ReLU in place on rows [begin, end) of a contiguous (rows, cols) f32 or bf16 output: the row
// epilogue of linear_relu's product (cpu::RowTask).
struct ReluRows {
  void* y;
  int64_t cols;
  bool bf16;
  static void run(void* data, int64_t begin, int64_t end) {
    const auto& r = *static_cast<const ReluRows*>(data);
    if (r.bf16)
      cpu::relu_in_place_bf16(static_cast<uint16_t*>(r.y) + begin * r.cols, (end - begin) * r.cols);
    else
      cpu::relu_in_place_f32(static_cast<float*>(r.y) + begin * r.cols, (end - begin) * r.cols);
  }
};

// ReLU's backward on rows [begin, end) of a contiguous (rows, cols) f32 or bf16 input gradient,
// through the ReLU's output x of the same layout: the row epilogue of the input gradient's
// product when the layer's input came out of a ReLU.
struct ReluGradRows {
  void* dx;
  const void* x;
  int64_t cols;
  bool bf16;
  static void run(void* data, int64_t begin, int64_t end) {
    const auto& r = *static_cast<const ReluGradRows*>(data);
    const int64_t at = begin * r.cols, n = (end - begin) * r.cols;
    if (r.bf16)
      cpu::relu_backward_in_place_bf16(static_cast<uint16_t*>(r.dx) + at,
                                       static_cast<const uint16_t*>(r.x) + at, n);
    else
      cpu::relu_backward_in_place_f32(static_cast<float*>(r.dx) + at,
                                      static_cast<const float*>(r.x) + at, n);
  }
};

// into (optional): where y goes instead of a new tensor (linear_of_parameter_into); returned too.
Tensor linear_impl(Context& ctx, const char* op, const Tensor& x, const Tensor& W, const Tensor& b,
                   bool relu_after, bool w_fixed = false, const Tensor* into = nullptr);

}  // namespace

Tensor linear(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b) {
  return linear_impl(ctx, "linear", x, W, b, false);
}

Tensor linear_relu(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b) {
  return linear_impl(ctx, "linear_relu", x, W, b, true);
}

Tensor detail::linear_of_parameter(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b,
                                   bool relu_after) {
  return linear_impl(ctx, relu_after ? "linear_relu" : "linear", x, W, b, relu_after, true);
}

void detail::linear_of_parameter_into(Context& ctx, const Tensor& x, const Tensor& W,
                                      const Tensor& b, const Tensor& out) {
  (void)linear_impl(ctx, "linear", x, W, b, false, true, &out);
}

namespace {

Tensor linear_impl(Context& ctx, const char* op, const Tensor& x, const Tensor& W, const Tensor& b,
                   bool relu_after, bool w_fixed, const Tensor* into) {
  const Shape y_shape = check_linear(op, x, W);
  std::optional<RowMatrix> into_rows;
  if (into) {
    check(into->defined() && into->shape() == y_shape && into->dtype() == x.dtype(), op,
          "the output given has shape {} and dtype {}, expected {} and {}",
          shape_arg(into->shape()), into->defined() ? dtype_name(into->dtype()) : "none",
          shape_arg(y_shape), dtype_name(x.dtype()));
    into_rows = as_row_matrix(*into);
    check(into_rows.has_value(), op,
          "the output given (shape {}, strides {}) has rows that do not share one stride",
          shape_arg(into->shape()), shape_arg(into->strides()));
  }
  if (b.defined()) {
    check_linear_dtype(op, "b", b);
    detail::check_same_dtype(op, "b", b, "x", x);
    check(b.ndim() == 1 && b.dim(0) == W.dim(0), op, "b has shape {}, expected (out) = ({})",
          shape_arg(b.shape()), W.dim(0));
  }
  const int64_t I = W.dim(1), O = W.dim(0);
  // Rows = product of x's leading dims (x.numel() / I fails when I == 0).
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i)
    rows *= x.dim(i);
  const bool bf16 = x.dtype() == DType::BF16;
  if (use_fast_path(ctx, x.dtype())) {
    // y (rows, O) = x (rows, I) * W^T + b: W (O, I) is read in place as transposed weights.
    // bf16: the GEMM accumulates in f32, adds the bias (widened exactly) in f32 and rounds each
    // result once to bf16 as it stores it.
    Tensor x_store, w_store;
    const RowMatrix xm = row_matrix(x, x_store), wm = row_matrix(W, w_store);
    const Tensor bc = b.defined() ? (bf16 ? b.to(DType::F32) : b.contiguous()) : Tensor();
    Tensor y = into ? *into : Tensor::empty(y_shape, x.dtype());
    cpu::GemmArgs g;
    g.M = rows, g.N = O, g.K = I;
    g.A = xm.data, g.lda = xm.ld;
    g.B = wm.data, g.ldb = wm.ld, g.trans_b = true;
    // A module's own weight, whose packing a GemmFixedPackingScope (generation) may keep; W read in
    // place only (row_matrix copies a strided W into a temporary, which must not be kept).
    g.b_fixed = w_fixed && wm.data == W.raw_data();
    set_output(g, y, into ? into_rows->ld : O);
    g.bias = bc.defined() ? bc.data<float>() : nullptr;
    // With relu_after, each piece of rows is rectified by the thread that computed it, in the
    // product's region: no second pass over y and no region of its own.
    ReluRows rectify{y.raw_data(), O, bf16};
    cpu::gemm_then(g, ctx.resolved_threads(), {},
                   relu_after ? cpu::RowTask{&ReluRows::run, &rectify} : cpu::RowTask{});
    return y;
  }
  // The reference loops write a new tensor; `into` gets a copy of it.
  auto result = [&](const Tensor& y) {
    if (!into) return y;
    Tensor out = *into;
    out.copy_from(y);
    return out;
  };
  Tensor y = Tensor::empty(y_shape, x.dtype());
  const Tensor xc = x.contiguous(), wc = W.contiguous();
  const Tensor bc = b.defined() ? b.contiguous() : Tensor();
  if (bf16) {
    auto bits = [](const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); };
    ref::linear_forward_bf16(bits(xc), bits(wc), bc.defined() ? bits(bc) : nullptr,
                             static_cast<uint16_t*>(y.raw_data()), rows, I, O);
    return result(relu_after ? relu(ctx, y) : y);
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::linear_forward<F>(xc.data<F>(), wc.data<F>(), bc.defined() ? bc.data<F>() : nullptr,
                           y.data<F>(), rows, I, O);
  });
  return result(relu_after ? relu(ctx, y) : y);
}

// Where the parameter gradients go: fresh tensors (linear_backward) or sums added to in place
// (linear_backward_accumulate: float32 on the fast path only).
struct GradTargets {
  Tensor* dW_sum = nullptr;
  Tensor* db_sum = nullptr;
};

// linear_backward's checks; returns the number of rows (the product of x's leading dims).
int64_t check_linear_backward(const char* op, const Tensor& dy, const Tensor& x, const Tensor& W) {
  const Shape y_shape = check_linear(op, x, W);
  check_linear_dtype(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == y_shape, op, "dy has shape {}, expected (..., out) = {}",
        shape_arg(dy.shape()), shape_arg(y_shape));
  // Rows = product of x's leading dims (x.numel() / I fails when I == 0).
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i)
    rows *= x.dim(i);
  return rows;
}

// relu_out, when defined, must be a tensor of x's shape and dtype (the ReLU output that fed the
// layer).
void check_relu_out(const char* op, const Tensor& relu_out, const Tensor& x) {
  if (!relu_out.defined()) return;
  check(relu_out.shape() == x.shape() && relu_out.dtype() == x.dtype(), op,
        "relu_out is {} {}, expected x's shape {} and dtype {}", dtype_name(relu_out.dtype()),
        shape_arg(relu_out.shape()), shape_arg(x.shape()), dtype_name(x.dtype()));
}

// The fast path's three products. With `sums`, dW and db are added into *sums.dW_sum and
// *sums.db_sum (float32) instead of written to grads.dW and grads.db. With relu_out, dx goes
// through ReLU's backward (the row epilogue of dx's product).
LinearGrads linear_backward_fast(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                                 bool has_bias, int64_t rows, const GradTargets& sums,
                                 const Tensor& relu_out) {
  const int64_t I = W.dim(1), O = W.dim(0);
  LinearGrads grads;
  // bf16: each product accumulates in f32 and is rounded to bf16 once as it is stored.
  grads.dx = Tensor::empty(x.shape(), x.dtype());
  Tensor dy_store, x_store, w_store;
  const RowMatrix dym = row_matrix(dy, dy_store), xm = row_matrix(x, x_store),
                  wm = row_matrix(W, w_store);
  const int threads = ctx.resolved_threads();
  // forward: y = x W^T + b
  // so:      dx (rows, I) = dy (rows, O) * W (O, I)
  cpu::GemmArgs gx;
  gx.M = rows, gx.N = I, gx.K = O;
  gx.A = dym.data, gx.lda = dym.ld;
  gx.B = wm.data, gx.ldb = wm.ld;
  set_output(gx, grads.dx, I);
  //          db (O) = sum over rows of dy (bf16: the float sum rounded once to bf16), in the same
  //          region as dx's product, each thread a share of the columns after its rows of dx.
  const bool bf16 = x.dtype() == DType::BF16;
  float* db = nullptr;
  bool db_accumulate = false;
  if (has_bias) {
    if (!bf16 && sums.db_sum != nullptr) {
      db = sums.db_sum->data<float>(), db_accumulate = true;
    } else {
      grads.db = Tensor::empty({O}, DType::F32);
      db = grads.db.data<float>();
    }
  }
  struct BiasGradient {
    const void* dy;
    int64_t rows, O, ld;
    float* db;
    bool accumulate, bf16;
  } bias_gradient{dym.data, rows, O, dym.ld, db, db_accumulate, bf16};
  cpu::RegionTask task;
  if (has_bias) {
    task.data = &bias_gradient;
    task.run = [](void* data, int part, int parts) {
      const auto& t = *static_cast<const BiasGradient*>(data);
      if (t.bf16) {
        cpu::column_sum_part(static_cast<const uint16_t*>(t.dy), t.rows, t.O, t.ld, t.db,
                             t.accumulate, part, parts);
      } else {
        cpu::column_sum_part(static_cast<const float*>(t.dy), t.rows, t.O, t.ld, t.db, t.accumulate,
                             part, parts);
      }
    };
  }
  // dx through ReLU's backward, each piece of rows by the thread that computed it.
  const Tensor mask = relu_out.defined() ? relu_out.contiguous() : Tensor();
  ReluGradRows relu_grad{grads.dx.raw_data(), mask.defined() ? mask.raw_data() : nullptr, I, bf16};
  cpu::gemm_then(gx, threads, task,
                 mask.defined() ? cpu::RowTask{&ReluGradRows::run, &relu_grad} : cpu::RowTask{});
  if (has_bias && bf16) grads.db = grads.db.to(DType::BF16);
  //          dW (O, I) = dy^T (O, rows) * x (rows, I): the sum over rows is the contraction
  cpu::GemmArgs gw;
  gw.M = O, gw.N = I, gw.K = rows;
  gw.A = dym.data, gw.lda = dym.ld, gw.trans_a = true;
  gw.B = xm.data, gw.ldb = xm.ld;
  if (sums.dW_sum != nullptr) {
    gw.C = sums.dW_sum->data<float>(), gw.ldc = I, gw.accumulate = true;
  } else {
    grads.dW = Tensor::empty(W.shape(), W.dtype());
    set_output(gw, grads.dW, I);
  }
  cpu::gemm(gw, threads);
  return grads;
}

// sum (contiguous) += g elementwise in sum's dtype (bf16: in float, rounded once).
void add_into(Tensor& sum, const Tensor& g) {
  const Tensor gc = g.contiguous();
  const int64_t n = sum.numel();
  if (sum.dtype() == DType::BF16) {
    auto* dst = static_cast<uint16_t*>(sum.raw_data());
    const auto* src = static_cast<const uint16_t*>(gc.raw_data());
    for (int64_t i = 0; i < n; ++i)
      dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(src[i]));
    return;
  }
  detail::dispatch_float(sum.dtype(), [&](auto zero) {
    using F = decltype(zero);
    F* dst = sum.data<F>();
    const F* src = gc.data<F>();
    for (int64_t i = 0; i < n; ++i)
      dst[i] += src[i];
  });
}

LinearGrads linear_backward_reference(const Tensor& dy, const Tensor& x, const Tensor& W,
                                      bool has_bias, int64_t rows);

}  // namespace

LinearGrads linear_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias, const Tensor& relu_out) {
  const int64_t rows = check_linear_backward("linear_backward", dy, x, W);
  check_relu_out("linear_backward", relu_out, x);
  if (use_fast_path(ctx, x.dtype()))
    return linear_backward_fast(ctx, dy, x, W, has_bias, rows, {}, relu_out);
  LinearGrads grads = linear_backward_reference(dy, x, W, has_bias, rows);
  if (relu_out.defined()) grads.dx = relu_backward(ctx, grads.dx, relu_out);
  return grads;
}

namespace {

// The reference loops' gradients (kReference, float64).
LinearGrads linear_backward_reference(const Tensor& dy, const Tensor& x, const Tensor& W,
                                      bool has_bias, int64_t rows) {
  const int64_t I = W.dim(1), O = W.dim(0);
  const bool bf16 = x.dtype() == DType::BF16;
  LinearGrads grads;
  grads.dx = Tensor::empty(x.shape(), x.dtype());
  grads.dW = Tensor::empty(W.shape(), W.dtype());
  if (has_bias) grads.db = Tensor::empty({O}, x.dtype());
  const Tensor dyc = dy.contiguous(), xc = x.contiguous(), wc = W.contiguous();
  if (bf16) {
    auto in = [](const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); };
    auto out = [](const Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); };
    ref::linear_backward_bf16(in(dyc), in(xc), in(wc), out(grads.dx), out(grads.dW),
                              has_bias ? out(grads.db) : nullptr, rows, I, O);
    return grads;
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::linear_backward<F>(dyc.data<F>(), xc.data<F>(), wc.data<F>(), grads.dx.data<F>(),
                            grads.dW.data<F>(), has_bias ? grads.db.data<F>() : nullptr, rows, I,
                            O);
  });
  return grads;
}

}  // namespace

Tensor linear_backward_accumulate(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                                  Tensor& dW_sum, Tensor* db_sum, const Tensor& relu_out) {
  constexpr const char* op = "linear_backward_accumulate";
  const int64_t rows = check_linear_backward(op, dy, x, W);
  check_relu_out(op, relu_out, x);
  auto check_sum = [&](const char* name, const Tensor& t, const Shape& shape) {
    check(t.defined() && t.shape() == shape && t.dtype() == x.dtype() && t.is_contiguous(), op,
          "{} is {} {}{}, expected a contiguous {} tensor of shape {} (x's dtype)", name,
          t.defined() ? dtype_name(t.dtype()) : "undefined",
          t.defined() ? shape_arg(t.shape()) : shape_arg(Shape{}),
          t.defined() && !t.is_contiguous() ? " (strided)" : "", dtype_name(x.dtype()),
          shape_arg(shape));
  };
  check_sum("dW_sum", dW_sum, W.shape());
  if (db_sum != nullptr) check_sum("db_sum", *db_sum, Shape{W.dim(0)});
  if (use_fast_path(ctx, x.dtype()) && x.dtype() == DType::F32)
    return linear_backward_fast(ctx, dy, x, W, db_sum != nullptr, rows, {&dW_sum, db_sum}, relu_out)
        .dx;
  LinearGrads g = linear_backward(ctx, dy, x, W, db_sum != nullptr, relu_out);
  add_into(dW_sum, g.dW);
  if (db_sum != nullptr) add_into(*db_sum, g.db);
  return g.dx;
}

bool cpu_bf16_native() {
  return cpu::gemm_bf16_native() && cpu::flash_bf16_native();
}

}  // namespace attn
