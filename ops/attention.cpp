// Scaled dot-product and additive attention: validation, mask lowering (ops/mask.hpp), then one
// dispatch per op. Scaled dot-product attention asks the one dispatch rule of
// ops/attention_kernel.hpp (fused_attention_serves) and builds its arguments there
// (attention_problem / attention_args): the fused CPU kernels (float32:
// kernels/cpu/flash_attention, bfloat16: kernels/cpu/flash_bf16) or the oracle on the same
// problem description (kernels/ref/attention.hpp). Additive attention always runs the reference
// (kernels/ref/additive.cpp). The math is in docs/ops.md; the tests are
// tests/test_attention_cases.cpp (every implementation against the oracle) and
// tests/test_ops_attention.cpp (the op: errors, finite differences, PyTorch parity).
#include "attn/ops/attention.hpp"

#include "kernels/ref/additive.hpp"
#include "kernels/ref/attention.hpp"
#include "ops/attention_kernel.hpp"
#include "ops/common.hpp"
#include "ops/mask.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attn {
namespace {

constexpr const char* kSdpa = "scaled_dot_product_attention";
constexpr const char* kSdpaBackward = "scaled_dot_product_attention_backward";
constexpr const char* kAdditive = "additive_attention";
constexpr const char* kAdditiveBackward = "additive_attention_backward";

// F32, F64 or BF16 (scaled dot-product attention also takes bfloat16 inputs).
void check_sdpa_tensor(const char* op, const char* name, const Tensor& t) {
  check(t.defined(), op, "{} is undefined, expected a float32, float64 or bfloat16 tensor", name);
  check(t.dtype() == DType::F32 || t.dtype() == DType::F64 || t.dtype() == DType::BF16, op,
        "{} {} has dtype {}, expected F32, F64 or BF16", name, shape_arg(t.shape()),
        dtype_name(t.dtype()));
}

// q (B, T, D), k (B, S, D), v (B, S, Dv), same float dtype; valid_lens against (B, T).
ref::AttentionDims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& opts) {
  check_sdpa_tensor(op, "q", q);
  check_sdpa_tensor(op, "k", k);
  check_sdpa_tensor(op, "v", v);
  detail::check_ndim(op, "q", q, 3, "(B, T, D)");
  detail::check_ndim(op, "k", k, 3, "(B, S, D)");
  detail::check_ndim(op, "v", v, 3, "(B, S, Dv)");
  detail::check_same_dtype(op, "k", k, "q", q);
  detail::check_same_dtype(op, "v", v, "q", q);
  ref::AttentionDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2)};
  check(k.dim(0) == d.B && v.dim(0) == d.B, op,
        "batch sizes differ: q {}, k {}, v {}; expected the same B", shape_arg(q.shape()),
        shape_arg(k.shape()), shape_arg(v.shape()));
  check(k.dim(2) == d.D, op, "q {} and k {} differ in width, expected k (B, S, D) with D = {}",
        shape_arg(q.shape()), shape_arg(k.shape()), d.D);
  check(v.dim(1) == d.S, op, "k {} and v {} differ in length, expected v (B, S, Dv) with S = {}",
        shape_arg(k.shape()), shape_arg(v.shape()), d.S);
  check(d.D >= 1, op, "q {} has width 0, expected D >= 1", shape_arg(q.shape()));
  detail::check_attention_options(op, opts.dropout, opts.scale);
  if (opts.alibi_slopes.defined()) {
    const Tensor& m = opts.alibi_slopes;
    check(is_floating(m.dtype()) && m.ndim() == 1 && m.dim(0) >= 1 && d.B % m.dim(0) == 0, op,
          "alibi_slopes has shape {} and dtype {}, expected float (H) with B = {} a multiple of H",
          shape_arg(m.shape()), dtype_name(m.dtype()), d.B);
  }
  check_valid_lens(op, opts.mask.valid_lens, d.B, d.T, opts.mask.lens_repeat);
  return d;
}

void check_dout(const char* op, const Tensor& dout, const Tensor& q, const ref::AttentionDims& d) {
  check_sdpa_tensor(op, "dout", dout);
  check(dout.shape() == Shape{d.B, d.T, d.Dv}, op, "dout has shape {}, expected (B, T, Dv) = {}",
        shape_arg(dout.shape()), shape_arg(Shape{d.B, d.T, d.Dv}));
  detail::check_same_dtype(op, "dout", dout, "q", q);
}

// Dropout acts only in training with p > 0; only then does the call take a stream offset.
ref::DropoutSpec forward_dropout(Context& ctx, const AttentionOptions& opts,
                                 const ref::AttentionDims& d) {
  ref::DropoutSpec spec;
  spec.active = opts.training && opts.dropout > 0.0;
  spec.p = opts.dropout;
  spec.seed = ctx.seed;
  spec.offset = spec.active ? ctx.next_dropout_offset() : 0;
  spec.index_base = spec.active ? detail::attention_dropout_index_base(ctx, opts, 1, d.T, d.S) : 0;
  return spec;
}

// The backward redraws the forward's mask: same seed, the offset the forward stored, the same
// index base (the Context's sample window must not change in between).
ref::DropoutSpec backward_dropout(const Context& ctx, const AttentionOptions& opts,
                                  const ref::AttentionDims& d, uint64_t offset) {
  ref::DropoutSpec spec;
  spec.active = opts.training && opts.dropout > 0.0;
  spec.p = opts.dropout;
  spec.seed = ctx.seed;
  spec.offset = offset;
  spec.index_base = spec.active ? detail::attention_dropout_index_base(ctx, opts, 1, d.T, d.S) : 0;
  return spec;
}

// ALiBi slopes as doubles (empty when unused; validated by check_qkv).
std::vector<double> alibi_of(const AttentionOptions& opts) {
  return opts.alibi_slopes.defined() ? opts.alibi_slopes.to_vector() : std::vector<double>{};
}

// The fused kernels run where the one dispatch rule says so (detail::fused_attention_serves,
// ops/attention_kernel.hpp); float64 never reaches them.
bool use_flash(const Context& ctx, DType dt, const AttentionOptions& opts) {
  return dt != DType::F64 && detail::fused_attention_serves(ctx, dt, opts);
}

// The fused kernels on q, k, v views (any strides), element type E (float or bf16 as uint16_t):
// out, logsumexp (float32) and the weights (float32, when asked for) into result's tensors.
template <class E>
void sdpa_fused_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const ref::AttentionDims& d, const AttentionOptions& opts,
                        AttentionResult& result) {
  check(d.S < (int64_t{1} << 31), kSdpa, "k {} has more than 2^31 keys", shape_arg(k.shape()));
  const std::vector<int32_t> kept = detail::length_key_counts(opts.mask, d.B, d.T, d.S);
  kernels::AttentionArgs<E> p =
      detail::attention_args<E>(ctx, q, k, v, 1, kept, opts, result.dropout_offset);
  p.out = detail::head_view<E>(result.output, 1);
  p.lse = result.logsumexp.data<float>();
  if (opts.need_weights) p.weights = result.weights.data<float>(), p.w_sb = d.T * d.S, p.w_st = d.S;
  detail::fused_forward(p);
}

// The fused backward serves a forward that ran the fused kernel (output of the input dtype,
// float32 logsumexp): it recomputes the weights from them.
bool fused_backward_fits(const AttentionResult& forward, const ref::AttentionDims& d, DType dt) {
  const Tensor& fo = forward.output;
  const Tensor& fl = forward.logsumexp;
  return fo.defined() && fl.defined() && fo.dtype() == dt && fl.dtype() == DType::F32 &&
         fo.shape() == Shape{d.B, d.T, d.Dv} && fl.shape() == Shape{d.B, d.T} &&
         d.S < (int64_t{1} << 31);
}

template <class E>
void sdpa_fused_backward(Context& ctx, const Tensor& dout, const Tensor& q, const Tensor& k,
                         const Tensor& v, const AttentionResult& forward,
                         const ref::AttentionDims& d, const AttentionOptions& opts,
                         AttentionGrads& grads) {
  const std::vector<int32_t> kept = detail::length_key_counts(opts.mask, d.B, d.T, d.S);
  kernels::AttentionArgs<E> p =
      detail::attention_args<E>(ctx, q, k, v, 1, kept, opts, forward.dropout_offset);
  const Tensor lse = forward.logsumexp.contiguous();
  p.out = detail::head_view<E>(forward.output, 1);  // read only by the backward
  p.lse = lse.data<float>();
  detail::fused_backward(p, detail::attention_grad_args<E>(dout, grads.dq, grads.dk, grads.dv, 1));
}

// The oracle's call (kernels/ref/attention.hpp) on contiguous tensors of F: the fused kernels'
// own problem from the one builder, plus the scale and p in double and ALiBi.
template <class F>
ref::AttentionCall<F> reference_call(const Context& ctx, const ref::AttentionDims& d,
                                     const std::vector<int32_t>& kept, const AttentionOptions& opts,
                                     uint64_t dropout_offset, const std::vector<double>& alibi) {
  ref::AttentionCall<F> c;
  c.problem =
      detail::attention_problem(ctx, {d.B, 1, d.T, d.S, d.D, d.Dv}, kept, opts, dropout_offset);
  c.scale = detail::attention_scale(opts.scale, d.D);
  c.dropout = opts.dropout;
  c.alibi = alibi.empty() ? nullptr : alibi.data();
  c.alibi_heads = std::max<int64_t>(static_cast<int64_t>(alibi.size()), 1);
  return c;
}

// The reference loops (kReference, float64, need_weights on kAuto, ALiBi) in the input's type;
// bfloat16 inputs are widened to float64 exactly and the results rounded. `x` holds q, k, v
// (and dout for the backward) in that type, contiguous.
struct ReferenceInputs {
  DType type;
  Tensor q, k, v, dout;
  ReferenceInputs(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor* dout0)
      : type(q0.dtype() == DType::BF16 ? DType::F64 : q0.dtype()) {
    auto in = [&](const Tensor& t) { return t.dtype() == type ? t.contiguous() : t.to(type); };
    q = in(q0), k = in(k0), v = in(v0);
    if (dout0 != nullptr) dout = in(*dout0);
  }
  // out itself when it has the reference's type, else a fresh tensor of it (copied back below).
  Tensor output(const Tensor& out) const {
    return out.dtype() == type ? out : Tensor::empty(out.shape(), type);
  }
};

void sdpa_reference_forward(const Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                            const ref::AttentionDims& d, const AttentionOptions& opts,
                            AttentionResult& result) {
  const ReferenceInputs x(q, k, v, nullptr);
  Tensor out = x.output(result.output), lse = x.output(result.logsumexp);
  Tensor weights = opts.need_weights ? x.output(result.weights) : Tensor();
  const std::vector<int32_t> kept = detail::length_key_counts(opts.mask, d.B, d.T, d.S);
  const std::vector<double> alibi = alibi_of(opts);
  detail::dispatch_float(x.type, [&](auto zero) {
    using F = decltype(zero);
    ref::AttentionCall<F> c = reference_call<F>(ctx, d, kept, opts, result.dropout_offset, alibi);
    c.q = x.q.data<F>(), c.k = x.k.data<F>(), c.v = x.v.data<F>();
    c.out = out.data<F>(), c.lse = lse.data<F>();
    c.weights = opts.need_weights ? weights.data<F>() : nullptr;
    ref::sdpa_forward<F>(c);
  });
  if (out.dtype() != result.output.dtype()) result.output.copy_from(out);
  if (lse.dtype() != result.logsumexp.dtype()) result.logsumexp.copy_from(lse);
  if (opts.need_weights && weights.dtype() != result.weights.dtype())
    result.weights.copy_from(weights);
}

// The reference recomputes the weights, so it needs neither output nor logsumexp.
void sdpa_reference_backward(const Context& ctx, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const AttentionResult& forward,
                             const ref::AttentionDims& d, const AttentionOptions& opts,
                             AttentionGrads& grads) {
  const ReferenceInputs x(q, k, v, &dout);
  Tensor dq = x.output(grads.dq), dk = x.output(grads.dk), dv = x.output(grads.dv);
  const std::vector<int32_t> kept = detail::length_key_counts(opts.mask, d.B, d.T, d.S);
  const std::vector<double> alibi = alibi_of(opts);
  detail::dispatch_float(x.type, [&](auto zero) {
    using F = decltype(zero);
    ref::AttentionCall<F> c = reference_call<F>(ctx, d, kept, opts, forward.dropout_offset, alibi);
    c.q = x.q.data<F>(), c.k = x.k.data<F>(), c.v = x.v.data<F>(), c.dout = x.dout.data<F>();
    c.dq = dq.data<F>(), c.dk = dk.data<F>(), c.dv = dv.data<F>();
    ref::sdpa_backward<F>(c);
  });
  if (dq.dtype() != grads.dq.dtype()) {
    grads.dq.copy_from(dq);
    grads.dk.copy_from(dk);
    grads.dv.copy_from(dv);
  }
}

}  // namespace

// Outputs in the input's dtype; bfloat16 inputs give float32 logsumexp and weights. One stream
// offset when dropping, then the fused kernel where the one rule says so, else the reference.
AttentionResult scaled_dot_product_attention(Context& ctx, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const AttentionOptions& opts) {
  const ref::AttentionDims d = check_qkv(kSdpa, q, k, v, opts);
  const DType dt = q.dtype();
  const DType stats = dt == DType::BF16 ? DType::F32 : dt;
  AttentionResult result;
  result.output = Tensor::empty({d.B, d.T, d.Dv}, dt);
  result.logsumexp = Tensor::empty({d.B, d.T}, stats);
  if (opts.need_weights) result.weights = Tensor::empty({d.B, d.T, d.S}, stats);
  result.dropout_offset = opts.training && opts.dropout > 0.0 ? ctx.next_dropout_offset() : 0;
  if (use_flash(ctx, dt, opts)) {
    if (dt == DType::BF16)
      sdpa_fused_forward<uint16_t>(ctx, q, k, v, d, opts, result);
    else
      sdpa_fused_forward<float>(ctx, q, k, v, d, opts, result);
    return result;
  }
  sdpa_reference_forward(ctx, q, k, v, d, opts, result);
  return result;
}

AttentionGrads scaled_dot_product_attention_backward(Context& ctx, const Tensor& dout,
                                                     const Tensor& q, const Tensor& k,
                                                     const Tensor& v,
                                                     const AttentionResult& forward,
                                                     const AttentionOptions& opts) {
  const ref::AttentionDims d = check_qkv(kSdpaBackward, q, k, v, opts);
  check_dout(kSdpaBackward, dout, q, d);
  const DType dt = q.dtype();
  AttentionGrads grads{Tensor::empty(q.shape(), dt), Tensor::empty(k.shape(), dt),
                       Tensor::empty(v.shape(), dt)};
  if (use_flash(ctx, dt, opts) && fused_backward_fits(forward, d, dt)) {
    if (dt == DType::BF16)
      sdpa_fused_backward<uint16_t>(ctx, dout, q, k, v, forward, d, opts, grads);
    else
      sdpa_fused_backward<float>(ctx, dout, q, k, v, forward, d, opts, grads);
    return grads;
  }
  sdpa_reference_backward(ctx, dout, q, k, v, forward, d, opts, grads);
  return grads;
}

namespace {

// qp (B, T, H), kp (B, S, H), w_v (H) or (1, H), v (B, S, Dv). Returns dims with D = H.
ref::AttentionDims check_additive(const char* op, const Tensor& qp, const Tensor& kp,
                                  const Tensor& w_v, const Tensor& v,
                                  const AttentionOptions& opts) {
  detail::check_float_tensor(op, "qp", qp);
  detail::check_float_tensor(op, "kp", kp);
  detail::check_float_tensor(op, "w_v", w_v);
  detail::check_float_tensor(op, "v", v);
  detail::check_ndim(op, "qp", qp, 3, "(B, T, h)");
  detail::check_ndim(op, "kp", kp, 3, "(B, S, h)");
  detail::check_ndim(op, "v", v, 3, "(B, S, Dv)");
  detail::check_same_dtype(op, "kp", kp, "qp", qp);
  detail::check_same_dtype(op, "w_v", w_v, "qp", qp);
  detail::check_same_dtype(op, "v", v, "qp", qp);
  ref::AttentionDims d{qp.dim(0), qp.dim(1), kp.dim(1), qp.dim(2), v.dim(2)};
  check(kp.dim(0) == d.B && v.dim(0) == d.B, op,
        "batch sizes differ: qp {}, kp {}, v {}; expected the same B", shape_arg(qp.shape()),
        shape_arg(kp.shape()), shape_arg(v.shape()));
  check(kp.dim(2) == d.D, op, "qp {} and kp {} differ in width, expected kp (B, S, h) with h = {}",
        shape_arg(qp.shape()), shape_arg(kp.shape()), d.D);
  check(v.dim(1) == d.S, op, "kp {} and v {} differ in length, expected v (B, S, Dv) with S = {}",
        shape_arg(kp.shape()), shape_arg(v.shape()), d.S);
  const bool wv_ok = (w_v.ndim() == 1 && w_v.dim(0) == d.D) ||
                     (w_v.ndim() == 2 && w_v.dim(0) == 1 && w_v.dim(1) == d.D);
  check(wv_ok, op, "w_v has shape {}, expected (h) = ({}) or (1, h) = (1, {})",
        shape_arg(w_v.shape()), d.D, d.D);
  detail::check_attention_options(op, opts.dropout, opts.scale);
  check(!opts.alibi_slopes.defined(), op,
        "alibi_slopes is set, but ALiBi biases dot-product scores only (additive attention has "
        "no q . k term to bias)");
  check_valid_lens(op, opts.mask.valid_lens, d.B, d.T, opts.mask.lens_repeat);
  return d;
}

}  // namespace

AdditiveResult additive_attention(Context& ctx, const Tensor& qp, const Tensor& kp,
                                  const Tensor& w_v, const Tensor& v,
                                  const AttentionOptions& opts) {
  const ref::AttentionDims d = check_additive(kAdditive, qp, kp, w_v, v, opts);
  const DType dt = qp.dtype();
  AdditiveResult result;
  result.output = Tensor::empty({d.B, d.T, d.Dv}, dt);
  result.weights = Tensor::empty({d.B, d.T, d.S}, dt);
  const ref::DropoutSpec drop = forward_dropout(ctx, opts, d);
  result.dropout_offset = drop.offset;
  const Tensor qc = qp.contiguous(), kc = kp.contiguous(), wc = w_v.contiguous(),
               vc = v.contiguous();
  const std::vector<int32_t> kept = detail::kept_key_counts(opts.mask, d.B, d.T, d.S);
  // Reference only (no fused additive kernel).
  detail::dispatch_float(dt, [&](auto zero) {
    using F = decltype(zero);
    ref::additive_forward<F>(qc.data<F>(), kc.data<F>(), wc.data<F>(), vc.data<F>(),
                             result.output.data<F>(), result.weights.data<F>(), kept.data(),
                             detail::lower_policy(opts.mask.masked_rows), d, drop);
  });
  return result;
}

AdditiveGrads additive_attention_backward(Context& ctx, const Tensor& dout, const Tensor& qp,
                                          const Tensor& kp, const Tensor& w_v, const Tensor& v,
                                          const AdditiveResult& forward,
                                          const AttentionOptions& opts) {
  const ref::AttentionDims d = check_additive(kAdditiveBackward, qp, kp, w_v, v, opts);
  check_dout(kAdditiveBackward, dout, qp, d);
  const DType dt = qp.dtype();
  AdditiveGrads grads{Tensor::empty(qp.shape(), dt), Tensor::empty(kp.shape(), dt),
                      Tensor::empty(w_v.shape(), dt), Tensor::empty(v.shape(), dt)};
  const ref::DropoutSpec drop = backward_dropout(ctx, opts, d, forward.dropout_offset);
  const Tensor qc = qp.contiguous(), kc = kp.contiguous(), wc = w_v.contiguous(),
               vc = v.contiguous(), gc = dout.contiguous();
  const std::vector<int32_t> kept = detail::kept_key_counts(opts.mask, d.B, d.T, d.S);
  detail::dispatch_float(dt, [&](auto zero) {
    using F = decltype(zero);
    ref::additive_backward<F>(gc.data<F>(), qc.data<F>(), kc.data<F>(), wc.data<F>(), vc.data<F>(),
                              grads.dqp.data<F>(), grads.dkp.data<F>(), grads.dw_v.data<F>(),
                              grads.dv.data<F>(), kept.data(),
                              detail::lower_policy(opts.mask.masked_rows), d, drop);
  });
  return grads;
}

}  // namespace attn
