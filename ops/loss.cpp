// softmax_cross_entropy / _backward / _with_grad: validation (shapes, target range, valid_lens),
// the keep mask, then the kernel: float32 logits on the CPU backends go to
// kernels/cpu/cross_entropy (SIMD, rows over threads), the rest to the reference
// (kernels/ref/loss.cpp).
#include "attn/ops/loss.hpp"

#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/ref/loss.hpp"
#include "ops/common.hpp"
#include "ops/mask.hpp"

#include <limits>
#include <vector>

namespace attn {
namespace {

template <typename F>
void dispatch_ids(DType dtype, F&& f) {
  if (dtype == DType::I32)
    f(int32_t{});
  else
    f(int64_t{});
}

// Validates everything and returns keep[n] for the N = numel / C positions.
std::vector<uint8_t> keep_mask(const char* op, const Tensor& logits, const Tensor& targets,
                               const CrossEntropyOptions& opts) {
  detail::check_float_tensor(op, "logits", logits);
  check(logits.ndim() >= 1 && logits.dim(-1) >= 1, op,
        "logits has shape {}, expected (..., C) with C >= 1", shape_arg(logits.shape()));
  check(targets.defined(), op, "targets is undefined, expected an I32 or I64 tensor");
  check(targets.dtype() == DType::I32 || targets.dtype() == DType::I64, op,
        "targets {} has dtype {}, expected I32 or I64", shape_arg(targets.shape()),
        dtype_name(targets.dtype()));
  const Shape lead(logits.shape().begin(), logits.shape().end() - 1);
  check(targets.shape() == lead, op, "targets has shape {}, expected logits {} without C: {}",
        shape_arg(targets.shape()), shape_arg(logits.shape()), shape_arg(lead));
  const int64_t C = logits.dim(-1), N = targets.numel();
  std::vector<uint8_t> keep(static_cast<size_t>(N), 1);
  if (opts.valid_lens.defined()) {
    check(logits.ndim() == 3, op, "valid_lens needs logits (B, T, C), got {}",
          shape_arg(logits.shape()));
    const int64_t B = logits.dim(0), T = logits.dim(1);
    const Tensor& vl = opts.valid_lens;
    check(is_floating(vl.dtype()) || vl.dtype() == DType::I32 || vl.dtype() == DType::I64, op,
          "valid_lens has dtype {}", dtype_name(vl.dtype()));
    check(vl.ndim() == 1 && vl.dim(0) == B, op, "valid_lens has shape {}, expected (B) = ({})",
          shape_arg(vl.shape()), B);
    // d2l's sequence mask: t counts iff float(t) < len (as masked_softmax's keys).
    for (int64_t b = 0; b < B; ++b) {
      const int64_t kept = detail::keys_kept_by_length(vl.flat(b), T);
      for (int64_t t = kept; t < T; ++t)
        keep[static_cast<size_t>(b * T + t)] = 0;
    }
  }
  const Tensor tc = targets.contiguous();
  dispatch_ids(targets.dtype(), [&](auto zero) {
    using Id = decltype(zero);
    const Id* y = tc.data<Id>();
    for (int64_t n = 0; n < N; ++n) {
      const int64_t id = static_cast<int64_t>(y[n]);
      if (id == opts.ignore_index) {
        keep[static_cast<size_t>(n)] = 0;
        continue;
      }
      // PyTorch checks every target, padded ones included; so do we (a bad id is a bug upstream).
      check(id >= 0 && id < C, op,
            "targets {} holds {} at flat position {}, expected a class in [0, {}) or "
            "ignore_index {}",
            shape_arg(targets.shape()), id, n, C, opts.ignore_index);
    }
  });
  return keep;
}

// The fast path's inputs: float32 logits, a CPU backend; targets widened to int64.
bool fast_path(const Context& ctx, const Tensor& logits) {
  return ctx.backend != Backend::kReference && logits.dtype() == DType::F32;
}

std::vector<int64_t> targets_i64(const Tensor& targets) {
  const Tensor tc = targets.contiguous();
  std::vector<int64_t> out(static_cast<size_t>(tc.numel()));
  dispatch_ids(tc.dtype(), [&](auto zero) {
    using Id = decltype(zero);
    const Id* y = tc.data<Id>();
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<int64_t>(y[i]);
  });
  return out;
}

int64_t count_kept(const std::vector<uint8_t>& keep) {
  int64_t n = 0;
  for (uint8_t k : keep)
    n += k;
  return n;
}

// The reduced loss of the kept positions' sum.
CrossEntropyResult reduced(double total, int64_t kept, Reduction reduction) {
  CrossEntropyResult r;
  r.kept = kept;
  if (reduction == Reduction::kSum) {
    r.loss = total;
  } else {
    // PyTorch: mean over nothing is 0/0 = NaN.
    r.loss =
        kept > 0 ? total / static_cast<double>(kept) : std::numeric_limits<double>::quiet_NaN();
  }
  return r;
}

// What each kept row's gradient carries. forward (mean): loss = sum_kept loss_n / kept, so
// dloss / kept.
double gradient_scale(Reduction reduction, int64_t kept, double dloss) {
  if (reduction == Reduction::kSum) return dloss;
  return kept > 0 ? dloss / static_cast<double>(kept) : 0.0;
}

double reference_forward(const Tensor& lc, const Tensor& tc, const std::vector<uint8_t>& keep) {
  const int64_t C = lc.dim(-1), N = tc.numel();
  double total = 0.0;
  dispatch_ids(tc.dtype(), [&](auto id_zero) {
    using Id = decltype(id_zero);
    detail::dispatch_float(lc.dtype(), [&](auto zero) {
      using F = decltype(zero);
      total = ref::cross_entropy_forward<Id, F>(lc.data<F>(), tc.data<Id>(), keep.data(), N, C);
    });
  });
  return total;
}

void reference_backward(const Tensor& lc, const Tensor& tc, const std::vector<uint8_t>& keep,
                        double scale, Tensor& dlogits) {
  const int64_t C = lc.dim(-1), N = tc.numel();
  dispatch_ids(tc.dtype(), [&](auto id_zero) {
    using Id = decltype(id_zero);
    detail::dispatch_float(lc.dtype(), [&](auto zero) {
      using F = decltype(zero);
      ref::cross_entropy_backward<Id, F>(lc.data<F>(), tc.data<Id>(), keep.data(),
                                         dlogits.data<F>(), N, C, scale);
    });
  });
}

}  // namespace

CrossEntropyResult softmax_cross_entropy(Context& ctx, const Tensor& logits, const Tensor& targets,
                                         const CrossEntropyOptions& opts) {
  constexpr const char* op = "softmax_cross_entropy";
  const std::vector<uint8_t> keep = keep_mask(op, logits, targets, opts);
  const int64_t C = logits.dim(-1), N = targets.numel();
  const Tensor lc = logits.contiguous(), tc = targets.contiguous();
  const double total = fast_path(ctx, logits) ? cpu::cross_entropy_forward_f32(
                                                    lc.data<float>(), targets_i64(tc).data(),
                                                    keep.data(), N, C, ctx.resolved_threads())
                                              : reference_forward(lc, tc, keep);
  return reduced(total, count_kept(keep), opts.reduction);
}

Tensor softmax_cross_entropy_backward(Context& ctx, const Tensor& logits, const Tensor& targets,
                                      const CrossEntropyOptions& opts, double dloss) {
  constexpr const char* op = "softmax_cross_entropy_backward";
  const std::vector<uint8_t> keep = keep_mask(op, logits, targets, opts);
  const int64_t C = logits.dim(-1), N = targets.numel();
  const double scale = gradient_scale(opts.reduction, count_kept(keep), dloss);
  const Tensor lc = logits.contiguous(), tc = targets.contiguous();
  Tensor dlogits = Tensor::empty(logits.shape(), logits.dtype());
  if (fast_path(ctx, logits)) {
    cpu::cross_entropy_backward_f32(lc.data<float>(), targets_i64(tc).data(), keep.data(),
                                    dlogits.data<float>(), N, C, scale, ctx.resolved_threads());
  } else {
    reference_backward(lc, tc, keep, scale, dlogits);
  }
  return dlogits;
}

CrossEntropyWithGrad softmax_cross_entropy_with_grad(Context& ctx, const Tensor& logits,
                                                     const Tensor& targets,
                                                     const CrossEntropyOptions& opts,
                                                     double dloss) {
  constexpr const char* op = "softmax_cross_entropy_with_grad";
  const std::vector<uint8_t> keep = keep_mask(op, logits, targets, opts);
  const int64_t C = logits.dim(-1), N = targets.numel(), kept = count_kept(keep);
  const double scale = gradient_scale(opts.reduction, kept, dloss);
  const Tensor lc = logits.contiguous(), tc = targets.contiguous();
  CrossEntropyWithGrad out;
  out.dlogits = Tensor::empty(logits.shape(), logits.dtype());
  double total = 0.0;
  if (fast_path(ctx, logits)) {
    total = cpu::cross_entropy_forward_backward_f32(lc.data<float>(), targets_i64(tc).data(),
                                                    keep.data(), out.dlogits.data<float>(), N, C,
                                                    scale, ctx.resolved_threads());
  } else {
    total = reference_forward(lc, tc, keep);
    reference_backward(lc, tc, keep, scale, out.dlogits);
  }
  out.result = reduced(total, kept, opts.reduction);
  return out;
}

}  // namespace attn
