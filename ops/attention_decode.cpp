// Multi-head decode attention: validation, mask lowering, the problem from the one builder
// (ops/attention_kernel.hpp), then kernels/cpu/decode_attention on the tensors as they are (head
// strides into the (B, S, H*D) cache). Contract in ops/attention_decode.hpp.
#include "ops/attention_decode.hpp"

#include "attn/ops/masked_softmax.hpp"
#include "kernels/cpu/decode_attention.hpp"
#include "ops/attention_kernel.hpp"
#include "ops/mask.hpp"

#include <vector>

namespace attn::detail {
namespace {

constexpr const char* kOp = "multi_head_decode_attention";

void check_cache_tensor(const char* name, const Tensor& t, int64_t B, int64_t L, int64_t width,
                        DType dtype) {
  check(t.defined() && t.ndim() == 3 && t.dtype() == dtype, kOp,
        "{} must be a {} (B, L, H*D) tensor, got {} {}", name, dtype_name(dtype),
        t.defined() ? dtype_name(t.dtype()) : "undefined", shape_arg(t));
  check(t.dim(0) == B && (L < 0 || t.dim(1) == L) && t.dim(2) == width && t.stride(2) == 1, kOp,
        "{} has shape {} and strides ({}, {}, {}), expected ({}, {}, {}) with unit feature stride",
        name, shape_arg(t.shape()), t.stride(0), t.stride(1), t.stride(2), B, L < 0 ? t.dim(1) : L,
        width);
}

template <class KV>
void fill_views(cpu::DecodeArgs<KV>& a, const Tensor& q, const Tensor& k, const Tensor& v,
                int64_t D, int64_t Dv) {
  a.q = {q.data<float>(), q.stride(0), D, q.stride(1), 1};
  a.k = {static_cast<const KV*>(k.raw_data()), k.stride(0), D, k.stride(1), 1};
  a.v = {static_cast<const KV*>(v.raw_data()), v.stride(0), Dv, v.stride(1), 1};
}

}  // namespace

bool multi_head_decode_supported(const Context& ctx, DType dtype, int64_t T,
                                 const AttentionOptions& opts) {
  // The one rule (ops/attention_kernel.hpp); this kernel takes float32 queries, a few of them,
  // returns no weights and has no dropout.
  return fused_attention_serves(ctx, dtype, opts) && dtype == DType::F32 && T >= 1 &&
         T <= cpu::kDecodeMaxQueries && !(opts.training && opts.dropout > 0.0) &&
         !opts.need_weights;
}

AttentionResult multi_head_decode_attention(Context& ctx, const Tensor& q, const Tensor& k,
                                            const Tensor& v, int64_t heads,
                                            const AttentionOptions& opts) {
  check(
      q.defined() && k.defined() && v.defined() && q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3,
      kOp, "q, k, v must be defined 3-D tensors");
  check(heads >= 1 && q.dim(2) > 0 && q.dim(2) % heads == 0 && v.dim(2) % heads == 0, kOp,
        "q {} and v {} widths must be positive multiples of heads = {}", shape_arg(q.shape()),
        shape_arg(v.shape()), heads);
  const int64_t B = q.dim(0), T = q.dim(1), S = k.dim(1), D = q.dim(2) / heads,
                Dv = v.dim(2) / heads;
  check(q.dtype() == DType::F32, kOp, "q has dtype {}, expected float32", dtype_name(q.dtype()));
  check(T >= 1 && T <= cpu::kDecodeMaxQueries, kOp, "q has {} queries, expected 1..{}", T,
        cpu::kDecodeMaxQueries);
  check(!(opts.training && opts.dropout > 0.0), kOp,
        "dropout {} in training: the decode kernel has no dropout (decoding is eval mode)",
        opts.dropout);
  check(!opts.need_weights && !opts.alibi_slopes.defined(), kOp,
        "need_weights and alibi_slopes are not served here (use scaled_dot_product_attention)");
  check(opts.mask.lens_repeat == 1, kOp, "mask.lens_repeat is {}, expected 1",
        opts.mask.lens_repeat);
  check_attention_options(kOp, opts.dropout, opts.scale);
  check_cache_tensor("q", q, B, T, heads * D, DType::F32);
  check(k.dtype() == DType::F32 || k.dtype() == DType::BF16, kOp,
        "k has dtype {}, expected float32 or bfloat16", dtype_name(k.dtype()));
  check_cache_tensor("k", k, B, -1, heads * D, k.dtype());
  check_cache_tensor("v", v, B, S, heads * Dv, k.dtype());
  check(S < (int64_t{1} << 31), kOp, "k {} has more than 2^31 keys", shape_arg(k.shape()));
  check_valid_lens(kOp, opts.mask.valid_lens, B, T, 1);

  // Kept keys of the (B*H) rows: row b*H + h reads the lengths of batch b.
  MaskOptions mask = opts.mask;
  mask.lens_repeat = heads;
  const std::vector<int32_t> limits = length_key_counts(mask, B * heads, T, S);
  AttentionResult result;
  result.output = Tensor::empty({B, T, heads * Dv}, DType::F32);
  result.logsumexp = Tensor::empty({B * heads, T}, DType::F32);
  // The problem from the one builder (no dropout: checked above), then the views.
  const kernels::AttentionProblem problem =
      attention_problem(ctx, {B, heads, T, S, D, Dv}, limits, opts, /*dropout_offset=*/0);
  auto run = [&](auto& a) {
    static_cast<kernels::AttentionProblem&>(a) = problem;
    fill_views(a, q, k, v, D, Dv);
    a.out = {result.output.data<float>(), T * heads * Dv, Dv, heads * Dv, 1};
    a.lse = result.logsumexp.data<float>();
    cpu::decode_attention(a);
  };
  if (k.dtype() == DType::BF16) {
    cpu::DecodeArgs<uint16_t> a;
    run(a);
  } else {
    cpu::DecodeArgs<float> a;
    run(a);
  }
  return result;
}

}  // namespace attn::detail
