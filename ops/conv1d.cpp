// conv1d / conv1d_backward: validation, then the reference kernel (kernels/ref/conv1d.cpp).
#include "attn/ops/conv1d.hpp"

#include "kernels/ref/conv1d.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

// x (B, n, d_in), W (d_out, d_in, k) with k odd; returns y's shape (B, n, d_out).
Shape check_conv1d(const char* op, const Tensor& x, const Tensor& W) {
  detail::check_float_tensor(op, "x", x);
  detail::check_float_tensor(op, "W", W);
  detail::check_ndim(op, "x", x, 3, "(B, n, d_in)");
  detail::check_ndim(op, "W", W, 3, "(d_out, d_in, k)");
  detail::check_same_dtype(op, "W", W, "x", x);
  check(x.dim(2) == W.dim(1), op, "x {} and W {} do not match, expected x (B, n, {})",
        shape_arg(x.shape()), shape_arg(W.shape()), W.dim(1));
  check(W.dim(2) % 2 == 1, op, "W {} has kernel size {}, expected an odd k ('same' padding)",
        shape_arg(W.shape()), W.dim(2));
  return {x.dim(0), x.dim(1), W.dim(0)};
}

}  // namespace

Tensor conv1d(Context& ctx, const Tensor& x, const Tensor& W, const Tensor& b, int64_t* flops) {
  constexpr const char* op = "conv1d";
  const Shape y_shape = check_conv1d(op, x, W);
  if (b.defined()) {
    detail::check_float_tensor(op, "b", b);
    detail::check_same_dtype(op, "b", b, "x", x);
    check(b.ndim() == 1 && b.dim(0) == W.dim(0), op, "b has shape {}, expected (d_out) = ({})",
          shape_arg(b.shape()), W.dim(0));
  }
  (void)ctx;
  const Tensor xc = x.contiguous(), wc = W.contiguous();
  const Tensor bc = b.defined() ? b.contiguous() : Tensor();
  Tensor y = Tensor::empty(y_shape, x.dtype());
  const int64_t macs = detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    return ref::conv1d_forward<F>(xc.data<F>(), wc.data<F>(), bc.defined() ? bc.data<F>() : nullptr,
                                  y.data<F>(), x.dim(0), x.dim(1), x.dim(2), W.dim(0), W.dim(2));
  });
  if (flops != nullptr) *flops = 2 * macs;
  return y;
}

Conv1dGrads conv1d_backward(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& W,
                            bool has_bias) {
  constexpr const char* op = "conv1d_backward";
  const Shape y_shape = check_conv1d(op, x, W);
  detail::check_float_tensor(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == y_shape, op, "dy has shape {}, expected (B, n, d_out) = {}",
        shape_arg(dy.shape()), shape_arg(y_shape));
  (void)ctx;
  const Tensor dyc = dy.contiguous(), xc = x.contiguous(), wc = W.contiguous();
  Conv1dGrads grads;
  grads.dx = Tensor::empty(x.shape(), x.dtype());
  grads.dW = Tensor::empty(W.shape(), W.dtype());
  if (has_bias) grads.db = Tensor::empty({W.dim(0)}, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::conv1d_backward<F>(dyc.data<F>(), xc.data<F>(), wc.data<F>(), grads.dx.data<F>(),
                            grads.dW.data<F>(), has_bias ? grads.db.data<F>() : nullptr, x.dim(0),
                            x.dim(1), x.dim(2), W.dim(0), W.dim(2));
  });
  return grads;
}

}  // namespace attn
