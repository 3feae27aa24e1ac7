// layer_norm / layer_norm_backward: validation, then the reference kernel
// (kernels/ref/layer_norm.cpp), or for float32 on kAuto / kCpu the row-parallel one
// (kernels/cpu/encoder_ops.cpp: the reference's arithmetic per row; see its header).
#include "attn/ops/layer_norm.hpp"

#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/ref/layer_norm.hpp"
#include "ops/common.hpp"

#include <cmath>

namespace attn {
namespace {

// x (..., E) with E >= 1; gamma and beta both (E) of x's dtype, or both undefined.
int64_t check_layer_norm(const char* op, const Tensor& x, const Tensor& gamma, const Tensor& beta) {
  detail::check_float_tensor(op, "x", x);
  check(x.ndim() >= 1 && x.dim(-1) >= 1, op, "x has shape {}, expected (..., E) with E >= 1",
        shape_arg(x.shape()));
  const int64_t E = x.dim(-1);
  check(gamma.defined() == beta.defined(), op,
        "gamma is {} but beta is {}: give both (affine) or neither",
        gamma.defined() ? "given" : "undefined", beta.defined() ? "given" : "undefined");
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"gamma", &gamma}, {"beta", &beta}}) {
    if (!t->defined()) continue;
    detail::check_float_tensor(op, name, *t);
    detail::check_same_dtype(op, name, *t, "x", x);
    check(t->ndim() == 1 && t->dim(0) == E, op, "{} has shape {}, expected (E) = ({}) for x {}",
          name, shape_arg(t->shape()), E, shape_arg(x.shape()));
  }
  return E;
}

Shape row_shape(const Tensor& x) {
  return Shape(x.shape().begin(), x.shape().end() - 1);
}

}  // namespace

LayerNormResult layer_norm(Context& ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                           double eps) {
  constexpr const char* op = "layer_norm";
  const int64_t E = check_layer_norm(op, x, gamma, beta);
  check(std::isfinite(eps) && eps >= 0.0, op, "eps is {}, expected a finite number >= 0", eps);
  const int64_t R = x.numel() / E;
  const Tensor xc = x.contiguous();
  const Tensor gc = gamma.defined() ? gamma.contiguous() : Tensor();
  const Tensor bc = beta.defined() ? beta.contiguous() : Tensor();
  LayerNormResult r{Tensor::empty(x.shape(), x.dtype()), Tensor::empty(row_shape(x), x.dtype()),
                    Tensor::empty(row_shape(x), x.dtype())};
  if (ctx.backend != Backend::kReference && x.dtype() == DType::F32) {
    cpu::layer_norm_forward_f32(xc.data<float>(), gc.defined() ? gc.data<float>() : nullptr,
                                bc.defined() ? bc.data<float>() : nullptr, r.y.data<float>(),
                                r.mean.data<float>(), r.rstd.data<float>(), R, E, eps,
                                ctx.resolved_threads());
    return r;
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::layer_norm_forward<F>(xc.data<F>(), gc.defined() ? gc.data<F>() : nullptr,
                               bc.defined() ? bc.data<F>() : nullptr, r.y.data<F>(),
                               r.mean.data<F>(), r.rstd.data<F>(), R, E, eps);
  });
  return r;
}

LayerNormGrads layer_norm_backward(Context& ctx, const Tensor& dy, const Tensor& x,
                                   const Tensor& gamma, const LayerNormResult& forward) {
  constexpr const char* op = "layer_norm_backward";
  // beta does not enter the backward; pass gamma for both so the pairing check holds.
  const int64_t E = check_layer_norm(op, x, gamma, gamma);
  detail::check_float_tensor(op, "dy", dy);
  detail::check_same_dtype(op, "dy", dy, "x", x);
  check(dy.shape() == x.shape(), op, "dy has shape {}, expected x's shape {}",
        shape_arg(dy.shape()), shape_arg(x.shape()));
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"mean", &forward.mean}, {"rstd", &forward.rstd}}) {
    detail::check_float_tensor(op, name, *t);
    detail::check_same_dtype(op, name, *t, "x", x);
    check(t->shape() == row_shape(x), op, "saved {} has shape {}, expected {} (x without E)", name,
          shape_arg(t->shape()), shape_arg(row_shape(x)));
  }
  const int64_t R = x.numel() / E;
  const Tensor dyc = dy.contiguous(), xc = x.contiguous();
  const Tensor gc = gamma.defined() ? gamma.contiguous() : Tensor();
  const Tensor mc = forward.mean.contiguous(), sc = forward.rstd.contiguous();
  LayerNormGrads g;
  g.dx = Tensor::empty(x.shape(), x.dtype());
  if (gamma.defined()) {
    g.dgamma = Tensor::empty({E}, x.dtype());
    g.dbeta = Tensor::empty({E}, x.dtype());
  }
  if (ctx.backend != Backend::kReference && x.dtype() == DType::F32) {
    cpu::layer_norm_backward_f32(
        dyc.data<float>(), xc.data<float>(), gc.defined() ? gc.data<float>() : nullptr,
        mc.data<float>(), sc.data<float>(), g.dx.data<float>(),
        gc.defined() ? g.dgamma.data<float>() : nullptr,
        gc.defined() ? g.dbeta.data<float>() : nullptr, R, E, ctx.resolved_threads());
    return g;
  }
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::layer_norm_backward<F>(dyc.data<F>(), xc.data<F>(), gc.defined() ? gc.data<F>() : nullptr,
                                mc.data<F>(), sc.data<F>(), g.dx.data<F>(),
                                gc.defined() ? g.dgamma.data<F>() : nullptr,
                                gc.defined() ? g.dbeta.data<F>() : nullptr, R, E);
  });
  return g;
}

}  // namespace attn
