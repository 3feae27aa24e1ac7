// relu / relu_backward: validation, then the reference kernel (kernels/ref/activation.cpp), or
// for float32 on kAuto / kCpu the threaded one (kernels/cpu/encoder_ops.cpp, the same bits).
#include "attn/ops/activation.hpp"

#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/ref/activation.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

// float32, float64 or bfloat16.
void check_activation_dtype(const char* op, const char* name, const Tensor& t) {
  check(t.defined(), op, "{} is undefined, expected a float32, float64 or bfloat16 tensor", name);
  check(t.dtype() == DType::F32 || t.dtype() == DType::F64 || t.dtype() == DType::BF16, op,
        "{} {} has dtype {}, expected F32, F64 or BF16", name, shape_arg(t.shape()),
        dtype_name(t.dtype()));
}

const uint16_t* bf16_bits(const Tensor& t) {
  return static_cast<const uint16_t*>(t.raw_data());
}
uint16_t* bf16_bits(Tensor& t) {
  return static_cast<uint16_t*>(t.raw_data());
}

}  // namespace

Tensor relu(Context& ctx, const Tensor& x) {
  check_activation_dtype("relu", "x", x);
  const Tensor xc = x.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  if (x.dtype() == DType::BF16) {
    if (ctx.backend == Backend::kReference)
      ref::relu_forward_bf16(bf16_bits(xc), bf16_bits(y), x.numel());
    else
      cpu::relu_forward_bf16(bf16_bits(xc), bf16_bits(y), x.numel(), ctx.resolved_threads());
    return y;
  }
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
  check_activation_dtype(op, "x", x);
  check_activation_dtype(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == x.shape(), op, "dy has shape {}, expected x's shape {}",
        shape_arg(dy.shape()), shape_arg(x.shape()));
  const Tensor dyc = dy.contiguous(), xc = x.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  if (x.dtype() == DType::BF16) {
    if (ctx.backend == Backend::kReference)
      ref::relu_backward_bf16(bf16_bits(dyc), bf16_bits(xc), bf16_bits(dx), x.numel());
    else
      cpu::relu_backward_bf16(bf16_bits(dyc), bf16_bits(xc), bf16_bits(dx), x.numel(),
                              ctx.resolved_threads());
    return dx;
  }
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
