// masked_softmax: validation, then dispatch to the reference kernel
// (kernels/ref/masked_softmax.cpp). The math is in docs/ops.md.
#include "attn/ops/masked_softmax.hpp"

#include "kernels/ref/masked_softmax.hpp"
#include "ops/common.hpp"
#include "ops/mask.hpp"

namespace attn {

void check_valid_lens(const char* op, const Tensor& valid_lens, int64_t B, int64_t T,
                      int64_t lens_repeat) {
  check(lens_repeat >= 1, op, "lens_repeat is {}, expected >= 1", lens_repeat);
  if (!valid_lens.defined()) return;
  check(B % lens_repeat == 0, op, "batch {} is not a multiple of lens_repeat {}", B, lens_repeat);
  const DType dt = valid_lens.dtype();
  check(dt == DType::I32 || dt == DType::I64 || dt == DType::F32 || dt == DType::F64, op,
        "valid_lens has dtype {}, expected I32, I64, F32 or F64", dtype_name(dt));
  const int64_t Bl = B / lens_repeat;
  const bool ok = (valid_lens.ndim() == 1 && valid_lens.dim(0) == Bl) ||
                  (valid_lens.ndim() == 2 && valid_lens.dim(0) == Bl && valid_lens.dim(1) == T);
  check(ok, op,
        "valid_lens has shape {}, expected (B) = ({}) or (B, T) = ({}, {}) (lens_repeat {})",
        shape_arg(valid_lens.shape()), Bl, Bl, T, lens_repeat);
}

namespace {

void check_scores(const char* op, const char* name, const Tensor& X) {
  detail::check_float_tensor(op, name, X);
  detail::check_ndim(op, name, X, 3, "(B, T, S)");
}

}  // namespace

Tensor masked_softmax(Context& ctx, const Tensor& X, const MaskOptions& mask) {
  constexpr const char* op = "masked_softmax";
  check_scores(op, "X", X);
  const int64_t B = X.dim(0), T = X.dim(1), S = X.dim(2);
  check_valid_lens(op, mask.valid_lens, B, T, mask.lens_repeat);
  (void)ctx;  // one backend so far: every Backend value runs the reference
  const Tensor x = X.contiguous();
  Tensor y = Tensor::empty(X.shape(), X.dtype());
  check(S < (int64_t{1} << 31), op, "X {} has more than 2^31 keys", shape_arg(X.shape()));
  const std::vector<int32_t> kept = detail::kept_key_counts(mask, B, T, S);
  detail::dispatch_float(X.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::masked_softmax_forward<F>(x.data<F>(), y.data<F>(), kept.data(),
                                   detail::lower_policy(mask.masked_rows), B * T, S);
  });
  return y;
}

Tensor masked_softmax(const Tensor& X, const Tensor& valid_lens) {
  Context ctx;
  MaskOptions mask;
  mask.valid_lens = valid_lens;
  return masked_softmax(ctx, X, mask);
}

Tensor masked_softmax_backward(Context& ctx, const Tensor& dY, const Tensor& Y,
                               const MaskOptions& mask) {
  constexpr const char* op = "masked_softmax_backward";
  check_scores(op, "Y", Y);
  detail::check_float_tensor(op, "dY", dY);
  check(dY.shape() == Y.shape(), op, "dY has shape {}, expected Y's shape {}",
        shape_arg(dY.shape()), shape_arg(Y.shape()));
  detail::check_same_dtype(op, "dY", dY, "Y", Y);
  const int64_t B = Y.dim(0), T = Y.dim(1), S = Y.dim(2);
  check_valid_lens(op, mask.valid_lens, B, T, mask.lens_repeat);
  (void)ctx;
  const Tensor dy = dY.contiguous(), y = Y.contiguous();
  Tensor dx = Tensor::empty(Y.shape(), Y.dtype());
  check(S < (int64_t{1} << 31), op, "Y {} has more than 2^31 keys", shape_arg(Y.shape()));
  const std::vector<int32_t> kept = detail::kept_key_counts(mask, B, T, S);
  detail::dispatch_float(Y.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::masked_softmax_backward<F>(dy.data<F>(), y.data<F>(), dx.data<F>(), kept.data(), B * T, S);
  });
  return dx;
}

}  // namespace attn
