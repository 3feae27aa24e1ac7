// relu / relu_backward: validation, then the reference kernel (kernels/ref/activation.cpp), or
// for float32 on kAuto / kCpu the threaded one (kernels/cpu/encoder_ops.cpp, the same bits).
#include "attn/ops/activation.hpp"

#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/ref/activation.hpp"
#include "ops/common.hpp"

namespace attn {

Tensor relu(Context& ctx, const Tensor& x) {
  detail::check_float_tensor("relu", "x", x);
  const Tensor xc = x.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  if (ctx.backend != Backend::kReference && x.dtype() == DType::F32) {
    cpu::relu_forward_f32(xc.data<float>(), y.data<float>(), x.numel(), ctx.resolved_threads());
    return y;
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::relu_forward<F>(xc.data<F>(), y.data<F>(), x.numel());
  });
  return y;
}

Tensor relu_backward(Context& ctx, const Tensor& dy, const Tensor& x) {
  constexpr const char* op = "relu_backward";
  detail::check_float_tensor(op, "x", x);
  detail::check_float_tensor(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == x.shape(), op, "dy has shape {}, expected x's shape {}",
        shape_str(dy.shape()), shape_str(x.shape()));
  const Tensor dyc = dy.contiguous(), xc = x.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  if (ctx.backend != Backend::kReference && x.dtype() == DType::F32) {
    cpu::relu_backward_f32(dyc.data<float>(), xc.data<float>(), dx.data<float>(), x.numel(),
                           ctx.resolved_threads());
    return dx;
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::relu_backward<F>(dyc.data<F>(), xc.data<F>(), dx.data<F>(), x.numel());
  });
  return dx;
}

}  // namespace attn
