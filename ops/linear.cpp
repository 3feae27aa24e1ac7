// linear / linear_backward: validation, then the reference kernel (kernels/ref/linear.cpp).
// dispatch: oneDNN matmul (kernels/cpu) can plug in here.
#include "attn/ops/linear.hpp"

#include "kernels/ref/linear.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

// x (..., in) and W (out, in); returns y's shape (..., out).
Shape check_linear(const char* op, const Tensor& x, const Tensor& W) {
  detail::check_float_tensor(op, "x", x);
  detail::check_float_tensor(op, "W", W);
  check(x.ndim() >= 1, op, "x has shape {}, expected (..., in)", shape_str(x.shape()));
  detail::check_ndim(op, "W", W, 2, "(out, in)");
  detail::check_same_dtype(op, "W", W, "x", x);
  check(x.dim(-1) == W.dim(1), op, "x {} and W {} do not match, expected x (..., {})",
        shape_str(x.shape()), shape_str(W.shape()), W.dim(1));
  Shape y_shape = x.shape();
  y_shape.back() = W.dim(0);
  return y_shape;
}

}  // namespace

Tensor linear(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b) {
  constexpr const char* op = "linear";
  const Shape y_shape = check_linear(op, x, W);
  if (b.defined()) {
    detail::check_float_tensor(op, "b", b);
    detail::check_same_dtype(op, "b", b, "x", x);
    check(b.ndim() == 1 && b.dim(0) == W.dim(0), op, "b has shape {}, expected (out) = ({})",
          shape_str(b.shape()), W.dim(0));
  }
  (void)ctx;
  const int64_t I = W.dim(1), O = W.dim(0);
  // Rows = product of x's leading dims (x.numel() / I fails when I == 0).
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i)
    rows *= x.dim(i);
  const Tensor xc = x.contiguous(), wc = W.contiguous();
  const Tensor bc = b.defined() ? b.contiguous() : Tensor();
  Tensor y = Tensor::empty(y_shape, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::linear_forward<F>(xc.data<F>(), wc.data<F>(), bc.defined() ? bc.data<F>() : nullptr,
                           y.data<F>(), rows, I, O);
  });
  return y;
}

LinearGrads linear_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias) {
  constexpr const char* op = "linear_backward";
  const Shape y_shape = check_linear(op, x, W);
  detail::check_float_tensor(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == y_shape, op, "dy has shape {}, expected (..., out) = {}",
        shape_str(dy.shape()), shape_str(y_shape));
  (void)ctx;
  const int64_t I = W.dim(1), O = W.dim(0);
  // Rows = product of x's leading dims (x.numel() / I fails when I == 0).
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i)
    rows *= x.dim(i);
  const Tensor dyc = dy.contiguous(), xc = x.contiguous(), wc = W.contiguous();
  LinearGrads grads;
  grads.dx = Tensor::empty(x.shape(), x.dtype());
  grads.dW = Tensor::empty(W.shape(), W.dtype());
  if (has_bias) grads.db = Tensor::empty({O}, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::linear_backward<F>(dyc.data<F>(), xc.data<F>(), wc.data<F>(), grads.dx.data<F>(),
                            grads.dW.data<F>(), has_bias ? grads.db.data<F>() : nullptr, rows, I,
                            O);
  });
  return grads;
}

}  // namespace attn
