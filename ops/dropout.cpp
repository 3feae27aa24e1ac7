// dropout / dropout_backward free functions (declared in attn/ops/attention.hpp, and with a
// Context in attn/ops/dropout.hpp): validation, then the reference kernel
// (kernels/ref/dropout.cpp), or for float32 on kAuto / kCpu the threaded kernel
// (kernels/cpu/encoder_ops.cpp), which gives the same bits.
#include "attn/ops/dropout.hpp"

#include "attn/ops/attention.hpp"
#include "kernels/cpu/encoder_ops.hpp"

#include "kernels/ref/dropout.hpp"
#include "ops/common.hpp"

namespace attn {
namespace {

Tensor apply_dropout(const char* op, const char* name, const Tensor& x, double p, uint64_t seed,
                     uint64_t offset, bool backward, const Context* ctx = nullptr) {
  detail::check_float_tensor(op, name, x);
  check(p >= 0.0 && p <= 1.0, op, "p is {}, expected in [0, 1]", p);
  const Tensor xc = x.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  // The outermost axis is the sample axis: a data-parallel shard draws its samples' global
  // stream indices (Context::dropout_index_base; 0 without a Context or in one process).
  const uint64_t per_sample =
      x.ndim() > 0 && x.dim(0) > 0 ? static_cast<uint64_t>(x.numel() / x.dim(0)) : 0;
  const uint64_t index_base = ctx != nullptr ? ctx->dropout_index_base(per_sample) : 0;
  // p == 0 is the identity; it still returns a fresh tensor so callers may write into it.
  if (ctx != nullptr && ctx->backend != Backend::kReference && x.dtype() == DType::F32) {
    // The mask and the scale of an element do not depend on the direction.
    cpu::dropout_f32(xc.data<float>(), y.data<float>(), x.numel(), p, seed, offset, index_base,
                     ctx->resolved_threads());
    return y;
  }
  const ref::DropoutSpec spec{p > 0.0, p, seed, offset, index_base};
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    if (backward) {
      ref::dropout_backward<F>(xc.data<F>(), y.data<F>(), x.numel(), spec);
    } else {
      ref::dropout_forward<F>(xc.data<F>(), y.data<F>(), x.numel(), spec);
    }
  });
  return y;
}

}  // namespace

Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset) {
  return apply_dropout("dropout", "x", x, p, seed, offset, false);
}

Tensor dropout_backward(const Tensor& dy, double p, uint64_t seed, uint64_t offset) {
  return apply_dropout("dropout_backward", "dy", dy, p, seed, offset, true);
}

Tensor dropout(Context& ctx, const Tensor& x, double p, uint64_t seed, uint64_t offset) {
  return apply_dropout("dropout", "x", x, p, seed, offset, false, &ctx);
}

Tensor dropout_backward(Context& ctx, const Tensor& dy, double p, uint64_t seed, uint64_t offset) {
  return apply_dropout("dropout_backward", "dy", dy, p, seed, offset, true, &ctx);
}

}  // namespace attn
