// Multi-head attention core on (B, T, H*D) projections: validation, then the fused CPU kernel
// with head strides (cpu::FlashParams::heads). Contract in ops/attention_heads.hpp.
//
// Why: d2l's transpose_qkv / transpose_output copy Q, K, V into (B*H, T, D) and the output back
// (and the backward copies dO, dQ, dK, dV), 4 + 4 passes over (B, T, E) per training step that
// move no arithmetic. The kernel only needs the address of row (b, h, t), which is
// b*T*E + t*E + h*D in the projection's own layout.
#include "ops/attention_heads.hpp"

#include "attn/ops/masked_softmax.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "kernels/ref/masked_softmax.hpp"

#include <cmath>
#include <vector>

namespace attn::detail {
namespace {

constexpr const char* kForward = "multi_head_attention_forward";
constexpr const char* kBackward = "multi_head_attention_backward";

struct HeadDims {
  int64_t B, T, S, H, D, Dv;
};

// A (B, L, H*W) tensor of `dtype` (float32 or bfloat16) with unit feature stride.
void check_heads_tensor(const char* op, const char* name, const Tensor& t, int64_t B, int64_t L,
                        int64_t width, DType dtype) {
  check(t.defined() && t.dtype() == dtype && t.ndim() == 3, op,
        "{} must be a {} (B, L, H*D) tensor like q, got {} {}", name, dtype_name(dtype),
        t.defined() ? dtype_name(t.dtype()) : "undefined", t.defined() ? shape_str(t.shape()) : "");
  check(t.dim(0) == B && (L < 0 || t.dim(1) == L) && t.dim(2) == width && t.stride(2) == 1, op,
        "{} has shape {} and strides ({}, {}, {}), expected ({}, {}, {}) with unit feature stride",
        name, shape_str(t.shape()), t.stride(0), t.stride(1), t.stride(2), B, L, width);
}

HeadDims check_heads(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                     int64_t heads, const AttentionOptions& opts) {
  check(
      q.defined() && k.defined() && v.defined() && q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3,
      op, "q, k, v must be defined 3-D tensors");
  check(heads >= 1 && q.dim(2) % heads == 0 && v.dim(2) % heads == 0 && q.dim(2) > 0, op,
        "q {} and v {} widths must be positive multiples of heads = {}", shape_str(q.shape()),
        shape_str(v.shape()), heads);
  HeadDims d{q.dim(0), q.dim(1), k.dim(1), heads, q.dim(2) / heads, v.dim(2) / heads};
  check(q.dtype() == DType::F32 || q.dtype() == DType::BF16, op,
        "q has dtype {}, expected float32 or bfloat16", dtype_name(q.dtype()));
  check_heads_tensor(op, "q", q, d.B, d.T, d.H * d.D, q.dtype());
  check_heads_tensor(op, "k", k, d.B, d.S, d.H * d.D, q.dtype());
  check_heads_tensor(op, "v", v, d.B, d.S, d.H * d.Dv, q.dtype());
  check(d.S < (int64_t{1} << 31), op, "k {} has more than 2^31 keys", shape_str(k.shape()));
  check(opts.mask.lens_repeat == 1, op,
        "mask.lens_repeat is {}, expected 1: valid_lens are per batch row here",
        opts.mask.lens_repeat);
  check(opts.dropout >= 0.0 && opts.dropout <= 1.0, op, "dropout is {}, expected in [0, 1]",
        opts.dropout);
  check(!opts.scale || std::isfinite(*opts.scale), op, "scale is {}, expected a finite number",
        opts.scale.value_or(0.0));
  check_valid_lens(op, opts.mask.valid_lens, d.B, d.T, 1);
  return d;
}

// Kept-key counts of the (B*H) rows: row b*H + h reads the lengths of batch b. Empty without
// valid_lens (the kernel keeps S keys, or t + 1 when causal, itself).
std::vector<int32_t> key_limits(const AttentionOptions& opts, const HeadDims& d) {
  if (!opts.mask.valid_lens.defined()) return {};
  MaskOptions mask = opts.mask;
  mask.lens_repeat = d.H;
  const std::vector<int64_t> kept = ref::kept_key_counts(mask, d.B * d.H, d.T, d.S);
  return std::vector<int32_t>(kept.begin(), kept.end());  // each in [0, S], S < 2^31
}

// Sizes, mask, scale, dropout and threads (everything but the tensors).
cpu::FlashParams flash_params_common(const Context& ctx, const HeadDims& d,
                                     const std::vector<int32_t>& limits,
                                     const AttentionOptions& opts, uint64_t dropout_offset) {
  cpu::FlashParams p;
  p.B = d.B * d.H, p.T = d.T, p.S = d.S, p.D = d.D, p.Dv = d.Dv;
  p.heads = d.H;
  p.key_limit = limits.empty() ? nullptr : limits.data();
  p.causal = opts.mask.causal;
  p.zero_masked_rows = opts.mask.masked_rows == MaskedRowPolicy::kZero;
  p.scale = static_cast<float>(opts.scale ? *opts.scale : 1.0 / std::sqrt(double(d.D)));
  const bool drop = opts.training && opts.dropout > 0.0;
  p.dropout = drop ? static_cast<float>(opts.dropout) : 0.0f;
  p.seed = ctx.seed;
  p.offset = drop ? dropout_offset : 0;
  p.threads = ctx.resolved_threads();
  return p;
}

cpu::FlashParams flash_params(const Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                              const HeadDims& d, const std::vector<int32_t>& limits,
                              const AttentionOptions& opts, uint64_t dropout_offset) {
  cpu::FlashParams p = flash_params_common(ctx, d, limits, opts, dropout_offset);
  // Row (b, h, t) of q starts at b*q_sb + h*D + t*q_st.
  p.q = q.data<float>(), p.q_sb = q.stride(0), p.q_sh = d.D, p.q_st = q.stride(1), p.q_sd = 1;
  p.k = k.data<float>(), p.k_sb = k.stride(0), p.k_sh = d.D, p.k_ss = k.stride(1), p.k_sd = 1;
  p.v = v.data<float>(), p.v_sb = v.stride(0), p.v_sh = d.Dv, p.v_ss = v.stride(1), p.v_sd = 1;
  return p;
}

// The same for bfloat16 q, k, v (kernels/cpu/flash_bf16), which takes head strides alike.
cpu::FlashBf16Params flash_bf16_params(const Context& ctx, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const HeadDims& d,
                                       const std::vector<int32_t>& limits,
                                       const AttentionOptions& opts, uint64_t dropout_offset) {
  const cpu::FlashParams f = flash_params_common(ctx, d, limits, opts, dropout_offset);
  cpu::FlashBf16Params p;
  p.B = f.B, p.T = f.T, p.S = f.S, p.D = f.D, p.Dv = f.Dv;
  p.heads = d.H;
  p.q = static_cast<const uint16_t*>(q.raw_data());
  p.q_sb = q.stride(0), p.q_sh = d.D, p.q_st = q.stride(1), p.q_sd = 1;
  p.k = static_cast<const uint16_t*>(k.raw_data());
  p.k_sb = k.stride(0), p.k_sh = d.D, p.k_ss = k.stride(1), p.k_sd = 1;
  p.v = static_cast<const uint16_t*>(v.raw_data());
  p.v_sb = v.stride(0), p.v_sh = d.Dv, p.v_ss = v.stride(1), p.v_sd = 1;
  p.key_limit = f.key_limit;
  p.causal = f.causal;
  p.zero_masked_rows = f.zero_masked_rows;
  p.scale = f.scale;
  p.dropout = f.dropout;
  p.seed = f.seed;
  p.offset = f.offset;
  p.threads = f.threads;
  return p;
}

}  // namespace

bool multi_head_fused_supported(const Context& ctx, DType dtype, const AttentionOptions& opts) {
  return (dtype == DType::F32 || dtype == DType::BF16) && !opts.alibi_slopes.defined() &&
         !opts.need_weights && (ctx.backend == Backend::kAuto || ctx.backend == Backend::kCpu);
}

AttentionResult multi_head_attention_forward(Context& ctx, const Tensor& q, const Tensor& k,
                                             const Tensor& v, int64_t heads,
                                             const AttentionOptions& opts) {
  const HeadDims d = check_heads(kForward, q, k, v, heads, opts);
  check(multi_head_fused_supported(ctx, q.dtype(), opts), kForward,
        "needs float32 or bfloat16, Backend::kAuto or kCpu, no need_weights and no alibi_slopes");
  AttentionResult result;
  result.output = Tensor::empty({d.B, d.T, d.H * d.Dv}, q.dtype());
  result.logsumexp = Tensor::empty({d.B * d.H, d.T}, DType::F32);
  // As scaled_dot_product_attention: only a call that drops takes a stream offset.
  result.dropout_offset = opts.training && opts.dropout > 0.0 ? ctx.next_dropout_offset() : 0;
  const std::vector<int32_t> limits = key_limits(opts, d);
  if (q.dtype() == DType::BF16) {
    cpu::FlashBf16Params p =
        flash_bf16_params(ctx, q, k, v, d, limits, opts, result.dropout_offset);
    p.out = static_cast<uint16_t*>(result.output.raw_data());
    p.o_sb = d.T * d.H * d.Dv, p.o_sh = d.Dv, p.o_st = d.H * d.Dv, p.o_sd = 1;
    p.lse = result.logsumexp.data<float>();
    cpu::flash_attention_forward_bf16(p);
    return result;
  }
  cpu::FlashParams p = flash_params(ctx, q, k, v, d, limits, opts, result.dropout_offset);
  p.out = result.output.data<float>();
  p.o_sb = d.T * d.H * d.Dv, p.o_sh = d.Dv, p.o_st = d.H * d.Dv, p.o_sd = 1;
  p.lse = result.logsumexp.data<float>();
  cpu::flash_attention_forward(p);
  return result;
}

void multi_head_attention_backward(Context& ctx, const Tensor& dout, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const AttentionResult& forward,
                                   int64_t heads, const AttentionOptions& opts, Tensor& dq,
                                   Tensor& dk, Tensor& dv) {
  const HeadDims d = check_heads(kBackward, q, k, v, heads, opts);
  check(multi_head_fused_supported(ctx, q.dtype(), opts), kBackward,
        "needs float32 or bfloat16, Backend::kAuto or kCpu, no need_weights and no alibi_slopes");
  const DType dt = q.dtype();
  check_heads_tensor(kBackward, "dout", dout, d.B, d.T, d.H * d.Dv, dt);
  check_heads_tensor(kBackward, "forward.output", forward.output, d.B, d.T, d.H * d.Dv, dt);
  check(forward.logsumexp.defined() && forward.logsumexp.dtype() == DType::F32 &&
            forward.logsumexp.shape() == Shape({d.B * d.H, d.T}) &&
            forward.logsumexp.is_contiguous(),
        kBackward, "forward.logsumexp must be a contiguous float32 (B*H, T) = ({}, {}) tensor",
        d.B * d.H, d.T);
  check_heads_tensor(kBackward, "dq", dq, d.B, d.T, d.H * d.D, dt);
  check_heads_tensor(kBackward, "dk", dk, d.B, d.S, d.H * d.D, dt);
  check_heads_tensor(kBackward, "dv", dv, d.B, d.S, d.H * d.Dv, dt);
  const std::vector<int32_t> limits = key_limits(opts, d);
  if (dt == DType::BF16) {
    cpu::FlashBf16Params p =
        flash_bf16_params(ctx, q, k, v, d, limits, opts, forward.dropout_offset);
    const Tensor& o = forward.output;
    p.out = static_cast<uint16_t*>(o.raw_data());  // read only by the backward
    p.o_sb = o.stride(0), p.o_sh = d.Dv, p.o_st = o.stride(1), p.o_sd = 1;
    p.lse = forward.logsumexp.data<float>();
    cpu::FlashBf16Grads g;
    auto bf = [](const Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); };
    g.dout = bf(dout), g.do_sb = dout.stride(0), g.do_sh = d.Dv, g.do_st = dout.stride(1);
    g.dq = bf(dq), g.dq_sb = dq.stride(0), g.dq_sh = d.D, g.dq_st = dq.stride(1);
    g.dk = bf(dk), g.dk_sb = dk.stride(0), g.dk_sh = d.D, g.dk_ss = dk.stride(1);
    g.dv = bf(dv), g.dv_sb = dv.stride(0), g.dv_sh = d.Dv, g.dv_ss = dv.stride(1);
    cpu::flash_attention_backward_bf16(p, g);
    return;
  }
  cpu::FlashParams p = flash_params(ctx, q, k, v, d, limits, opts, forward.dropout_offset);
  const Tensor& o = forward.output;
  p.out = o.data<float>();  // read only by the backward
  p.o_sb = o.stride(0), p.o_sh = d.Dv, p.o_st = o.stride(1), p.o_sd = 1;
  p.lse = forward.logsumexp.data<float>();
  cpu::FlashGrads g;
  g.dout = dout.data<float>(), g.do_sb = dout.stride(0), g.do_sh = d.Dv, g.do_st = dout.stride(1);
  g.dq = dq.data<float>(), g.dq_sb = dq.stride(0), g.dq_sh = d.D, g.dq_st = dq.stride(1);
  g.dk = dk.data<float>(), g.dk_sb = dk.stride(0), g.dk_sh = d.D, g.dk_ss = dk.stride(1);
  g.dv = dv.data<float>(), g.dv_sb = dv.stride(0), g.dv_sh = d.Dv, g.dv_ss = dv.stride(1);
  cpu::flash_attention_backward(p, g);
}

}  // namespace attn::detail
