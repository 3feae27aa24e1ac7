// Multi-head attention core on (B, T, H*D) projections: validation, then the fused CPU kernel
// with head strides (kernels::AttentionProblem::heads). Contract in ops/attention_heads.hpp.
//
// Why: d2l's transpose_qkv / transpose_output copy Q, K, V into (B*H, T, D) and the output back
// (and the backward copies dO, dQ, dK, dV), 4 + 4 passes over (B, T, E) per training step that
// move no arithmetic. The kernel only needs the address of row (b, h, t), which is
// b*T*E + t*E + h*D in the projection's own layout.
#include "ops/attention_heads.hpp"

#include "attn/ops/masked_softmax.hpp"
#include "ops/attention_kernel.hpp"
#include "ops/mask.hpp"

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
        t.defined() ? dtype_name(t.dtype()) : "undefined", shape_arg(t));
  check(t.dim(0) == B && (L < 0 || t.dim(1) == L) && t.dim(2) == width && t.stride(2) == 1, op,
        "{} has shape {} and strides ({}, {}, {}), expected ({}, {}, {}) with unit feature stride",
        name, shape_arg(t.shape()), t.stride(0), t.stride(1), t.stride(2), B, L, width);
}

HeadDims check_heads(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                     int64_t heads, const AttentionOptions& opts) {
  check(
      q.defined() && k.defined() && v.defined() && q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3,
      op, "q, k, v must be defined 3-D tensors");
  check(heads >= 1 && q.dim(2) % heads == 0 && v.dim(2) % heads == 0 && q.dim(2) > 0, op,
        "q {} and v {} widths must be positive multiples of heads = {}", shape_arg(q.shape()),
        shape_arg(v.shape()), heads);
  HeadDims d{q.dim(0), q.dim(1), k.dim(1), heads, q.dim(2) / heads, v.dim(2) / heads};
  check(q.dtype() == DType::F32 || q.dtype() == DType::BF16, op,
        "q has dtype {}, expected float32 or bfloat16", dtype_name(q.dtype()));
  check_heads_tensor(op, "q", q, d.B, d.T, d.H * d.D, q.dtype());
  check_heads_tensor(op, "k", k, d.B, d.S, d.H * d.D, q.dtype());
  check_heads_tensor(op, "v", v, d.B, d.S, d.H * d.Dv, q.dtype());
  check(d.S < (int64_t{1} << 31), op, "k {} has more than 2^31 keys", shape_arg(k.shape()));
  check(opts.mask.lens_repeat == 1, op,
        "mask.lens_repeat is {}, expected 1: valid_lens are per batch row here",
        opts.mask.lens_repeat);
  check_attention_options(op, opts.dropout, opts.scale);
  check_valid_lens(op, opts.mask.valid_lens, d.B, d.T, 1);
  return d;
}

// Kept-key counts of the (B*H) rows: row b*H + h reads the lengths of batch b. Empty without
// valid_lens (the kernel keeps S keys, or t + 1 when causal, itself).
std::vector<int32_t> head_key_counts(const AttentionOptions& opts, const HeadDims& d) {
  MaskOptions mask = opts.mask;
  mask.lens_repeat = d.H;
  return length_key_counts(mask, d.B * d.H, d.T, d.S);
}

// Whether the fused kernel of this element type records the forward's dropout decisions
// (kernels::AttentionArgs::dropout_keep), and the 16-bit words it needs.
int64_t keep_words(const kernels::AttentionArgs<float>& p) {
  return cpu::flash_dropout_keep_words(p);
}
int64_t keep_words(const kernels::AttentionArgs<uint16_t>& p) {
  return cpu::dropout_keep_words(p);
}
// The bits cost B T S / 8 bytes: quadratic in the length, where the fused kernels keep only
// O((T + S) D) for the backward. They are recorded while they take no more memory than the q, k,
// v and output the backward keeps anyway (T = S: up to S = 128 D in fp32, 64 D in bf16), so a long
// sequence's training memory stays linear in its length; past that the backward draws again.
template <class E>
bool keep_fits(const kernels::AttentionArgs<E>& p) {
  const int64_t kept_bytes = p.B * (p.T + p.S) * (p.D + p.Dv) * static_cast<int64_t>(sizeof(E));
  return 2 * keep_words(p) <= kept_bytes;
}
bool keeps_dropout(const kernels::AttentionArgs<float>& p) {
  return cpu::flash_attention_keeps_dropout(p) && keep_fits(p);
}
bool keeps_dropout(const kernels::AttentionArgs<uint16_t>& p) {
  return cpu::flash_bf16_keeps_dropout(p) && keep_fits(p);
}

template <class E>
void forward_fused(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                   const HeadDims& d, const AttentionOptions& opts, AttentionResult& result) {
  const std::vector<int32_t> kept = head_key_counts(opts, d);
  kernels::AttentionArgs<E> p =
      attention_args<E>(ctx, q, k, v, d.H, kept, opts, result.dropout_offset);
  p.out = head_view<E>(result.output, d.H);
  p.lse = result.logsumexp.data<float>();
  // The kernel records its dropout decisions for the backward (1 bit per weight) when it can.
  if (keeps_dropout(p)) {
    result.dropout_keep = Tensor::empty({(keep_words(p) + 1) / 2}, DType::I32);
    p.dropout_keep = static_cast<uint16_t*>(result.dropout_keep.raw_data());
  }
  fused_forward(p);
}

template <class E>
void backward_fused(Context& ctx, const Tensor& dout, const Tensor& q, const Tensor& k,
                    const Tensor& v, const AttentionResult& forward, const HeadDims& d,
                    const AttentionOptions& opts, Tensor& dq, Tensor& dk, Tensor& dv) {
  const std::vector<int32_t> kept = head_key_counts(opts, d);
  kernels::AttentionArgs<E> p =
      attention_args<E>(ctx, q, k, v, d.H, kept, opts, forward.dropout_offset);
  p.out = head_view<E>(forward.output, d.H);  // read only by the backward
  p.lse = forward.logsumexp.data<float>();
  // The forward's recorded decisions, when it recorded them for this very problem.
  const Tensor& keep = forward.dropout_keep;
  if (keep.defined() && keeps_dropout(p) && keep.dtype() == DType::I32 &&
      keep.numel() == (keep_words(p) + 1) / 2)
    p.dropout_keep = static_cast<uint16_t*>(keep.raw_data());
  fused_backward(p, attention_grad_args<E>(dout, dq, dk, dv, d.H));
}

}  // namespace

bool multi_head_fused_supported(const Context& ctx, DType dtype, const AttentionOptions& opts) {
  // The one rule (ops/attention_kernel.hpp); this path returns no weights.
  return fused_attention_serves(ctx, dtype, opts) && !opts.need_weights;
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
  if (q.dtype() == DType::BF16)
    forward_fused<uint16_t>(ctx, q, k, v, d, opts, result);
  else
    forward_fused<float>(ctx, q, k, v, d, opts, result);
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
  if (dt == DType::BF16)
    backward_fused<uint16_t>(ctx, dout, q, k, v, forward, d, opts, dq, dk, dv);
  else
    backward_fused<float>(ctx, dout, q, k, v, forward, d, opts, dq, dk, dv);
}

}  // namespace attn::detail
