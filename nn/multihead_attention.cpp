// d2l MultiHeadAttention, forward and backward, and loading PyTorch nn.MultiheadAttention weights.
//
// Vocabulary: B batch, T queries, S keys/values, H heads, D = E / H head dim, E = num_hiddens.
//
// forward (d2l 11.5):
//   Q = W_q(queries) (B, T, E),  K = W_k(keys) (B, S, E),  V = W_v(values) (B, S, E)
//   Q_h = transpose_qkv(Q)       (B*H, T, D): row b*H + h holds features [h*D, (h+1)*D)
//   O_h = attention(Q_h, K_h, V_h, valid_lens)   valid_lens read with lens_repeat = H, which is
//                                                d2l's repeat_interleave(valid_lens, H) without
//                                                the copy
//   out = W_o(transpose_output(O_h))             (B, T, E)
// backward runs the same steps in reverse; the head split of a gradient is a head split again.
//
// Fast path (float32, kAuto/kCpu, need_weights = false, no RoPE or ALiBi): the fused kernel reads
// Q_h, K_h, V_h straight from the (B, T, E) projections and writes O (and in the backward dQ, dK,
// dV) in that layout (ops/attention_heads.hpp), so transpose_qkv / transpose_output copy nothing.
// Same numbers as the copying path, bit for bit: the kernel reads the same values.
//
// bfloat16 (dtype BF16): the bf16 linear (f32 accumulation, one rounding) and the same fused path
// on kernels/cpu/flash_bf16, which takes head strides as the fp32 kernel does (bitwise equal to
// the bf16 op on d2l's head copies, tests/test_nn_mha_heads.cpp). Where the fused path does not
// serve (need_weights, ALiBi, the reference backend) the bf16 attention op runs on head copies.
// Self-attention packs the Q/K/V projection in both dtypes.
#include "attn/nn/attention.hpp"

#include "attn/ops/linear.hpp"
#include "nn/internal.hpp"
#include "ops/attention_heads.hpp"
#include "ops/linear_parameter.hpp"
#include "ops/mask.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace attn::nn {

namespace {

// Runs before any member is built, so a bad (E, H) is reported as MultiHeadAttention's error.
double checked_dropout(int64_t num_hiddens, int64_t num_heads, double dropout_p) {
  const char* op = "MultiHeadAttention";
  check(num_hiddens > 0 && num_heads > 0, op,
        "num_hiddens ({}) and num_heads ({}) must be positive", num_hiddens, num_heads);
  check(num_hiddens % num_heads == 0, op,
        "num_hiddens ({}) is not divisible by num_heads ({}): each head needs D = E / H features",
        num_hiddens, num_heads);
  return dropout_p;
}

// Padded key/value rows are not part of the computation: no query reads them (d2l's valid_lens
// mask keys s >= len). Their projection gradients are still a product, W_k.grad += dK^T keys, and
// dK = 0 there, but 0 * NaN = NaN: a NaN or Inf in padding would poison W_k.grad and W_v.grad
// (PyTorch has the same leak, pytorch#41508). So rows that nothing reads are zeroed before the
// projection, in a copy made only when such a row holds a non-finite value.
//   keys:   row s of batch b is read iff s < max_t kept(b, t)
//   values: the same, except that a query row that keeps no key under the uniform policy (d2l)
//           averages every value, padding included, so then all of its batch's values are read.
// True when every element of rows [s0, S) of batch row b of the (B, S, E) tensor X is finite.
// A strided scan over the raw rows (the padded positions of every batch, every forward): per
// element only a load and a compare, no index checks or conversions through double.
template <class E, class Finite>
bool rows_finite(const Tensor& X, int64_t b, int64_t s0, Finite finite) {
  const E* base = static_cast<const E*>(X.raw_data());
  const auto& st = X.strides();
  const int64_t S = X.dim(1), width = X.dim(2);
  for (int64_t s = s0; s < S; ++s) {
    const E* row = base + b * st[0] + s * st[1];
    bool ok = true;
    if (st[2] == 1) {  // rows of contiguous features: a loop the compiler vectorizes
      for (int64_t e = 0; e < width; ++e)
        ok &= finite(row[e]);
    } else {
      for (int64_t e = 0; e < width; ++e)
        ok &= finite(row[e * st[2]]);
    }
    if (!ok) return false;
  }
  return true;
}

bool unread_rows_finite(const Tensor& X, const std::vector<int64_t>& read) {
  const int64_t B = X.dim(0);
  for (int64_t b = 0; b < B; ++b) {
    bool ok = true;
    switch (X.dtype()) {
      case DType::F32:
        // Exponent bits all ones: Inf or NaN (a bit test vectorizes where std::isfinite did not).
        ok = rows_finite<float>(X, b, read[b], [](float v) {
          return (std::bit_cast<uint32_t>(v) & 0x7f800000u) != 0x7f800000u;
        });
        break;
      case DType::F64:
        ok = rows_finite<double>(X, b, read[b], [](double v) { return std::isfinite(v); });
        break;
      case DType::BF16:  // exponent bits all ones: Inf or NaN
        ok = rows_finite<uint16_t>(X, b, read[b],
                                   [](uint16_t v) { return (v & 0x7f80u) != 0x7f80u; });
        break;
      default:
        for (int64_t s = read[b]; s < X.dim(1) && ok; ++s)
          for (int64_t e = 0; e < X.dim(2) && ok; ++e)
            ok = std::isfinite(X.at({b, s, e}));
    }
    if (!ok) return false;
  }
  return true;
}

// X itself, or a copy with rows [read[b], S) of each batch row b zeroed (detail::keys_read).
Tensor zero_unread_padding(const Tensor& X, const std::vector<int64_t>& read) {
  const int64_t B = X.dim(0), S = X.dim(1);
  if (unread_rows_finite(X, read)) return X;
  Tensor clean = X.clone();
  for (int64_t b = 0; b < B; ++b)
    if (read[b] < S) clean.select(0, b).slice(0, read[b], S).fill(0.0);
  return clean;
}

// The same tensor: same memory, shape and strides (self-attention passes X three times).
bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.raw_data() == b.raw_data() && a.shape() == b.shape() && a.strides() == b.strides() &&
         a.dtype() == b.dtype();
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(int64_t num_hiddens, int64_t num_heads, double dropout_p,
                                       bool bias, DType dtype, uint64_t seed)
    : Module(dtype),
      attention(checked_dropout(num_hiddens, num_heads, dropout_p), dtype),
      // d2l: W_q = W_k = W_v = W_o = LazyLinear(num_hiddens, bias=bias). Lazy, so queries, keys
      // and values may have different widths; each layer draws from its own stream.
      W_q(num_hiddens, 0, bias, dtype, detail::child_seed(seed, "W_q")),
      W_k(num_hiddens, 0, bias, dtype, detail::child_seed(seed, "W_k")),
      W_v(num_hiddens, 0, bias, dtype, detail::child_seed(seed, "W_v")),
      W_o(num_hiddens, 0, bias, dtype, detail::child_seed(seed, "W_o")),
      num_hiddens_(num_hiddens),
      num_heads_(num_heads) {
  attention.lens_repeat = num_heads;
}

std::vector<std::pair<std::string, Parameter*>> MultiHeadAttention::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "W_q", W_q);
  append_parameters(out, "W_k", W_k);
  append_parameters(out, "W_v", W_v);
  append_parameters(out, "W_o", W_o);
  return out;
}

void MultiHeadAttention::train(bool on) {
  Module::train(on);
  attention.train(on);
  for (Linear* l : {&W_q, &W_k, &W_v, &W_o})
    l->train(on);
}

Tensor MultiHeadAttention::forward(Context& ctx, const Tensor& queries, const Tensor& keys,
                                   const Tensor& values, const Tensor& valid_lens) {
  const char* op = "MultiHeadAttention";
  detail::check_input(op, "queries", queries, 3, dtype_);
  detail::check_input(op, "keys", keys, 3, dtype_);
  detail::check_input(op, "values", values, 3, dtype_);
  check(
      queries.dim(0) == keys.dim(0) && keys.dim(0) == values.dim(0) && keys.dim(1) == values.dim(1),
      op,
      "queries {}, keys {} and values {} do not agree: expected (B, T, Dq), (B, S, Dk), "
      "(B, S, Dv)",
      shape_arg(queries.shape()), shape_arg(keys.shape()), shape_arg(values.shape()));
  B_ = queries.dim(0);
  T_ = queries.dim(1);
  S_ = keys.dim(1);
  saved_ = {};
  if (sequence_parallel != nullptr) return ring_forward(ctx, queries, keys, values, valid_lens);

  // Padding that no query reads stays out of the projections (and so of their gradients).
  Tensor keys_read = keys, values_read = values;
  if (valid_lens.defined()) {
    check_valid_lens(op, valid_lens, B_, T_, 1);
    const bool uniform = attention.masked_rows == MaskedRowPolicy::kUniform;
    const std::vector<int64_t> k_read =
        attn::detail::keys_read(valid_lens, attention.causal, B_, T_, S_, false);
    const std::vector<int64_t> v_read =
        uniform ? attn::detail::keys_read(valid_lens, attention.causal, B_, T_, S_, true) : k_read;
    keys_read = zero_unread_padding(keys, k_read);
    // Self-attention passes one tensor as keys and values: scanned once when both read the same.
    values_read = same_tensor(keys, values) && v_read == k_read
                      ? keys_read
                      : zero_unread_padding(values, v_read);
  }

  // The path, chosen once. Fused: no head copies, no (B*H, T, S) weights (attention_weights() is
  // undefined); it serves float32 and bfloat16 without need_weights, RoPE or ALiBi. Under
  // autocast (float32 module, Context::autocast_bf16) the projections and the fused core run in
  // bf16; off the fused path the module's own dtype. Packed: self-attention (one tensor for
  // queries, keys and values, no padding copy) projects once with the stacked weights
  // [W_q; W_k; W_v] (3E, in), which reads X once and is one larger GEMM; on the fused path, and
  // for bfloat16 also when its attention runs on head copies.
  AttentionOptions o;
  o.mask.valid_lens = valid_lens;
  o.mask.causal = attention.causal;
  o.mask.masked_rows = attention.masked_rows;
  o.dropout = attention.dropout;
  o.training = attention.training();
  o.need_weights = attention.need_weights;
  const DType cdt = detail::autocasts(ctx, dtype_) ? DType::BF16 : dtype_;
  const bool fused = !attention.rotary && !attention.alibi_slopes.defined() &&
                     attn::detail::multi_head_fused_supported(ctx, cdt, o);
  const bool packed = (fused || dtype_ == DType::BF16) && same_tensor(queries, keys) &&
                      same_tensor(queries, values) && same_tensor(keys, keys_read) &&
                      same_tensor(values, values_read);
  saved_.path = fused ? (packed ? Path::kPackedFused : Path::kFused)
                      : (packed ? Path::kPackedHeads : Path::kHeads);
  saved_.seams = bf16_seams && detail::autocasts(ctx, dtype_);
  saved_.compute_dtype = fused ? cdt : dtype_;
  if (fused) return forward_fused(ctx, queries, keys_read, values_read, o);
  return forward_heads(ctx, queries, keys_read, values_read, valid_lens);
}

// Creates W_q, W_k and W_v (each drawing its own initial values, as Linear::materialize does) as
// row slices of one stacked weight (3E, in), bias (3E) and their gradients. Only when none of the
// three exists yet, so that no caller holds a tensor of theirs that would stop being the parameter.
void MultiHeadAttention::stack_projections(int64_t in_features) {
  for (const Linear* l : {&W_q, &W_k, &W_v})
    if (l->weight.value.defined() || (l->has_bias() && l->bias.value.defined())) return;
  for (Linear* l : {&W_q, &W_k, &W_v})
    l->materialize(in_features, "MultiHeadAttention");
  const int64_t E = num_hiddens_;
  const bool bias = W_q.has_bias();
  qkv_weight_ = Tensor::empty({3 * E, in_features}, W_q.weight.value.dtype());
  qkv_weight_grad_ = Tensor::zeros({3 * E, in_features}, W_q.weight.grad.dtype());
  if (bias) {
    qkv_bias_ = Tensor::empty({3 * E}, W_q.bias.value.dtype());
    qkv_bias_grad_ = Tensor::zeros({3 * E}, W_q.bias.grad.dtype());
  }
  int64_t i = 0;
  for (Linear* l : {&W_q, &W_k, &W_v}) {
    Tensor w = qkv_weight_.slice(0, i * E, (i + 1) * E);
    w.copy_from(l->weight.value);
    l->weight.value = w;
    l->weight.grad = qkv_weight_grad_.slice(0, i * E, (i + 1) * E);
    if (bias) {
      Tensor b = qkv_bias_.slice(0, i * E, (i + 1) * E);
      b.copy_from(l->bias.value);
      l->bias.value = b;
      l->bias.grad = qkv_bias_grad_.slice(0, i * E, (i + 1) * E);
    }
    ++i;
  }
}

// Whether W_q, W_k and W_v (values, gradients, biases) are still the stacked tensors' slices.
bool MultiHeadAttention::projections_stacked() const {
  if (!qkv_weight_.defined()) return false;
  const int64_t E = num_hiddens_;
  // `part` is rows [i E, (i + 1) E) of `whole`, contiguous, of its dtype.
  auto is_rows = [E](const Tensor& part, const Tensor& whole, int64_t i) {
    if (!part.defined() || part.dtype() != whole.dtype() || !part.is_contiguous()) return false;
    Shape shape = whole.shape();
    shape[0] = E;
    const int64_t row = whole.numel() / whole.dim(0);
    return part.shape() == shape &&
           part.raw_data() == static_cast<const std::byte*>(whole.raw_data()) +
                                  i * E * row * static_cast<int64_t>(dtype_size(whole.dtype()));
  };
  int64_t i = 0;
  for (const Linear* l : {&W_q, &W_k, &W_v}) {
    if (!is_rows(l->weight.value, qkv_weight_, i) || !is_rows(l->weight.grad, qkv_weight_grad_, i))
      return false;
    if (l->has_bias() &&
        (!is_rows(l->bias.value, qkv_bias_, i) || !is_rows(l->bias.grad, qkv_bias_grad_, i)))
      return false;
    ++i;
  }
  return true;
}

// [Q K V] = X [W_q; W_k; W_v]^T + b (B, T, 3E) in dtype wdt; saved_.Q, K, V become its slices
// (views with row stride 3E) and saved_.X the input in wdt.
Tensor MultiHeadAttention::pack_projection(Context& ctx, const Tensor& X, DType wdt) {
  const int64_t E = num_hiddens_;
  stack_projections(X.dim(2));
  for (Linear* l : {&W_q, &W_k, &W_v})
    l->materialize(X.dim(2), "MultiHeadAttention");
  const bool bias = W_q.has_bias();
  saved_.stacked = projections_stacked();
  const bool own_weight = saved_.stacked && qkv_weight_.dtype() == wdt;
  if (own_weight) {
    // The parameters themselves, in place.
    W_qkv_ = qkv_weight_;
    b_qkv_ = bias ? qkv_bias_ : Tensor();
  } else if (saved_.stacked) {
    // Autocast: the float32 weights rounded to bf16 in one pass.
    W_qkv_ = detail::convert(ctx, qkv_weight_, wdt);
    b_qkv_ = bias ? qkv_bias_.to(wdt) : Tensor();
  } else {
    // Copied every forward: the optimizer updates the three weights in place. (In bf16 under
    // autocast: copy_from rounds the float32 weights.) Never into the stacked tensors.
    if (!W_qkv_.defined() || W_qkv_.shape() != Shape({3 * E, X.dim(2)}) || W_qkv_.dtype() != wdt ||
        W_qkv_.raw_data() == qkv_weight_.raw_data())
      W_qkv_ = Tensor::empty({3 * E, X.dim(2)}, wdt);
    if (bias &&
        (!b_qkv_.defined() || b_qkv_.dtype() != wdt || b_qkv_.raw_data() == qkv_bias_.raw_data()))
      b_qkv_ = Tensor::empty({3 * E}, wdt);
    int64_t i = 0;
    for (Linear* l : {&W_q, &W_k, &W_v}) {
      W_qkv_.slice(0, i * E, (i + 1) * E).copy_from(l->weight.value);
      if (bias) b_qkv_.slice(0, i * E, (i + 1) * E).copy_from(l->bias.value);
      ++i;
    }
  }
  saved_.X = detail::convert(ctx, X, wdt);
  // (B, T, 3E). On the parameter itself, its GEMM packing may be kept between calls while
  // generation holds a cpu::GemmFixedPackingScope (the encoder of every `attn translate` batch).
  const Tensor b = bias ? b_qkv_ : Tensor();
  const Tensor QKV = own_weight ? attn::detail::linear_of_parameter(ctx, saved_.X, W_qkv_, b, false)
                                : linear(ctx, saved_.X, W_qkv_, b);
  saved_.Q = QKV.slice(2, 0, E);
  saved_.K = QKV.slice(2, E, 2 * E);
  saved_.V = QKV.slice(2, 2 * E, 3 * E);
  return QKV;
}

// kFused, kPackedFused: the projections (B, T|S, E), head h in features [h*D, (h+1)*D), go to the
// fused core as they are. Under autocast the inputs go in as bf16, so the projections come out
// bf16 for the bf16 core.
Tensor MultiHeadAttention::forward_fused(Context& ctx, const Tensor& queries, const Tensor& keys,
                                         const Tensor& values, const AttentionOptions& o) {
  const DType cdt = saved_.compute_dtype;
  if (saved_.path == Path::kPackedFused) {
    pack_projection(ctx, queries, cdt);
  } else {
    saved_.Q = W_q.forward(ctx, queries.to(cdt));
    saved_.K = W_k.forward(ctx, keys.to(cdt));
    saved_.V = W_v.forward(ctx, values.to(cdt));
  }
  saved_.core_options = o;
  saved_.core = attn::detail::multi_head_attention_forward(ctx, saved_.Q, saved_.K, saved_.V,
                                                           num_heads_, o);  // O (B, T, E)
  const Tensor out = W_o.forward(ctx, saved_.core.output);
  return saved_.seams ? out : detail::convert(ctx, out, dtype_);
}

// kHeads, kPackedHeads: d2l's transpose_qkv to head copies (B*H, T|S, D), DotProductAttention
// per (b, h) with D = E / H (the mask of batch b serves its H rows: lens_repeat = H, set at
// construction), transpose_output back to (B, T, E).
Tensor MultiHeadAttention::forward_heads(Context& ctx, const Tensor& queries, const Tensor& keys,
                                         const Tensor& values, const Tensor& valid_lens) {
  const int64_t H = num_heads_;
  Tensor Qp, Kp, Vp;
  if (saved_.path == Path::kPackedHeads) {
    pack_projection(ctx, queries, saved_.compute_dtype);
    Qp = saved_.Q, Kp = saved_.K, Vp = saved_.V;
    saved_.Q = saved_.K = saved_.V = Tensor();  // the head copies live on in `attention`
  } else {
    Qp = W_q.forward(ctx, queries), Kp = W_k.forward(ctx, keys), Vp = W_v.forward(ctx, values);
  }
  Tensor Oh = attention.forward(ctx, detail::split_heads(Qp, H), detail::split_heads(Kp, H),
                                detail::split_heads(Vp, H), valid_lens);  // (B*H, T, D)
  return W_o.forward(ctx, detail::merge_heads(Oh, H));
}

AttentionInputGrads MultiHeadAttention::backward(Context& ctx, const Tensor& dout) {
  const char* op = "MultiHeadAttention::backward";
  check(B_ > 0 || T_ > 0, op, "called before forward");
  // (With bf16_seams under autocast, dout may be bf16: W_o's backward rounds it to bf16 anyway.)
  const bool bf16_dout =
      bf16_seams && detail::autocasts(ctx, dtype_) && dout.defined() && dout.dtype() == DType::BF16;
  check(dout.shape() == Shape({B_, T_, num_hiddens_}) && (dout.dtype() == dtype_ || bf16_dout), op,
        "dout has shape {} and dtype {}, expected {} and {}", shape_arg(dout.shape()),
        dtype_name(dout.dtype()), shape_arg({B_, T_, num_hiddens_}), dtype_name(dtype_));
  // forward: out = W_o(concat)
  const Tensor dconcat = W_o.backward(ctx, dout);  // (B, T, E), in the compute dtype
  switch (saved_.path) {
    case Path::kRing:
      return ring_backward(ctx, dconcat);
    case Path::kPackedFused:
    case Path::kPackedHeads:
      return backward_packed(ctx, dconcat);
    case Path::kFused:
      return backward_fused(ctx, dconcat);
    case Path::kHeads:
      break;
  }
  return backward_heads(ctx, dconcat);
}

AttentionInputGrads MultiHeadAttention::backward_packed(Context& ctx, const Tensor& dconcat) {
  // forward: O = attention(Q, K, V) with [Q K V] = X [W_q; W_k; W_v]^T + b (B, T, 3E); the
  // attention gradients land in the slices of one (B, T, 3E) buffer, every element written.
  const int64_t H = num_heads_, E = num_hiddens_;
  const Tensor dQKV = Tensor::empty({B_, T_, 3 * E}, saved_.compute_dtype);
  Tensor dQ = dQKV.slice(2, 0, E), dK = dQKV.slice(2, E, 2 * E), dV = dQKV.slice(2, 2 * E, 3 * E);
  if (saved_.path == Path::kPackedFused) {
    attn::detail::multi_head_attention_backward(ctx, dconcat, saved_.Q, saved_.K, saved_.V,
                                                saved_.core, H, saved_.core_options, dQ, dK, dV);
  } else {
    // bf16 off the fused path: the attention ran on head copies (B*H, T, D); its gradients
    // are merged back into the slices (transpose_output into a strided destination).
    AttentionInputGrads gh = attention.backward(ctx, detail::split_heads(dconcat, H));
    detail::merge_heads_into(gh.dqueries, H, dQ);
    detail::merge_heads_into(gh.dkeys, H, dK);
    detail::merge_heads_into(gh.dvalues, H, dV);
  }
  // dX = dQKV [W_q; W_k; W_v] (one GEMM over 3E), dW_qkv = dQKV^T X, db_qkv = column sums.
  const bool bias = W_q.has_bias();
  const int threads = ctx.resolved_threads();
  LinearGrads lg;
  if (saved_.stacked && projections_stacked()) {
    // The three gradients are one stacked tensor: added into in one pass, or (float32 weights
    // used in place) by the GEMM itself.
    if (W_qkv_.dtype() == DType::F32 && qkv_weight_grad_.dtype() == DType::F32) {
      lg.dx = linear_backward_accumulate(ctx, dQKV, saved_.X, W_qkv_, qkv_weight_grad_,
                                         bias ? &qkv_bias_grad_ : nullptr);
    } else {
      lg = linear_backward(ctx, dQKV, saved_.X, W_qkv_, bias);
      detail::accumulate(qkv_weight_grad_, lg.dW, threads);
      if (bias) detail::accumulate(qkv_bias_grad_, lg.db, threads);
    }
  } else {
    lg = linear_backward(ctx, dQKV, saved_.X, W_qkv_, bias);
    int64_t i = 0;
    for (Linear* l : {&W_q, &W_k, &W_v}) {
      detail::accumulate(l->weight.grad, lg.dW.slice(0, i * E, (i + 1) * E), threads);
      if (bias) detail::accumulate(l->bias.grad, lg.db.slice(0, i * E, (i + 1) * E), threads);
      ++i;
    }
  }
  if (self_attention_input_grad)
    return {saved_.seams ? lg.dx : detail::convert(ctx, lg.dx, dtype_), Tensor(), Tensor()};
  // The three input gradients separately (d2l's contract): dqueries = dQ W_q, and so on, with
  // the weights the forward used (W_qkv_'s rows).
  auto input_grad = [&](const Tensor& dY, int64_t part) {
    return linear(ctx, dY, W_qkv_.slice(0, part * E, (part + 1) * E).transpose(0, 1)).to(dtype_);
  };
  return {input_grad(dQ, 0), input_grad(dK, 1), input_grad(dV, 2)};
}

AttentionInputGrads MultiHeadAttention::backward_fused(Context& ctx, const Tensor& dconcat) {
  // forward: O = attention(Q, K, V) in the (B, T, E) layout; the gradients land there too.
  const DType cdt = saved_.compute_dtype;
  Tensor dQ = Tensor::empty(saved_.Q.shape(), cdt), dK = Tensor::empty(saved_.K.shape(), cdt),
         dV = Tensor::empty(saved_.V.shape(), cdt);
  attn::detail::multi_head_attention_backward(ctx, dconcat, saved_.Q, saved_.K, saved_.V,
                                              saved_.core, num_heads_, saved_.core_options, dQ, dK,
                                              dV);
  return {W_q.backward(ctx, dQ).to(dtype_), W_k.backward(ctx, dK).to(dtype_),
          W_v.backward(ctx, dV).to(dtype_)};
}

AttentionInputGrads MultiHeadAttention::backward_heads(Context& ctx, const Tensor& dconcat) {
  const int64_t H = num_heads_;
  // forward: concat = transpose_output(O_h); its adjoint is transpose_qkv.
  AttentionInputGrads gh = attention.backward(ctx, detail::split_heads(dconcat, H));
  // forward: Q_h = transpose_qkv(W_q(queries)), and the same for K and V.
  AttentionInputGrads g;
  g.dqueries = W_q.backward(ctx, detail::merge_heads(gh.dqueries, H));
  g.dkeys = W_k.backward(ctx, detail::merge_heads(gh.dkeys, H));
  g.dvalues = W_v.backward(ctx, detail::merge_heads(gh.dvalues, H));
  return g;
}

// ----------------------------------------------------------------------------------------------
// Sequence parallelism: the projections on the rank's tokens, the core by ring_attention on d2l's
// head copies (B*H, T_local, D), valid_lens read with lens_repeat = H as on one process.

Tensor MultiHeadAttention::ring_forward(Context& ctx, const Tensor& queries, const Tensor& keys,
                                        const Tensor& values, const Tensor& valid_lens) {
  const char* op = "MultiHeadAttention";
  check(!attention.rotary && !attention.alibi_slopes.defined(), op,
        "sequence_parallel is set together with RoPE or ALiBi, which ring attention does not "
        "support; expected neither");
  const int64_t H = num_heads_;
  saved_.path = Path::kRing;
  saved_.compute_dtype = dtype_;
  RingOptions& ro = saved_.ring_options;
  ro.causal = attention.causal;
  ro.masked_rows = attention.masked_rows;
  ro.lens_repeat = H;
  ro.layout = sequence_layout;
  ro.dropout = attention.dropout;
  ro.training = attention.training();
  saved_.valid_lens = valid_lens;
  saved_.Q = detail::split_heads(W_q.forward(ctx, queries), H);
  saved_.K = detail::split_heads(W_k.forward(ctx, keys), H);
  saved_.V = detail::split_heads(W_v.forward(ctx, values), H);
  saved_.core =
      ring_attention(ctx, *sequence_parallel, saved_.Q, saved_.K, saved_.V, valid_lens, ro);
  return W_o.forward(ctx, detail::merge_heads(saved_.core.output, H));
}

AttentionInputGrads MultiHeadAttention::ring_backward(Context& ctx, const Tensor& dconcat) {
  const int64_t H = num_heads_;
  const AttentionGrads gh = ring_attention_backward(
      ctx, *sequence_parallel, detail::split_heads(dconcat, H), saved_.Q, saved_.K, saved_.V,
      saved_.valid_lens, saved_.core, saved_.ring_options);
  AttentionInputGrads g;
  g.dqueries = W_q.backward(ctx, detail::merge_heads(gh.dq, H));
  g.dkeys = W_k.backward(ctx, detail::merge_heads(gh.dk, H));
  g.dvalues = W_v.backward(ctx, detail::merge_heads(gh.dv, H));
  return g;
}

// ----------------------------------------------------------------------------------------------
// State dicts: d2l names, or torch.nn.MultiheadAttention's
//
//   torch                       d2l
//   in_proj_weight (3E, E)      rows [0, E) W_q.weight, [E, 2E) W_k.weight, [2E, 3E) W_v.weight
//   q/k/v_proj_weight           W_q/W_k/W_v.weight    (torch uses these when kdim/vdim != E)
//   in_proj_bias (3E)           W_q.bias, W_k.bias, W_v.bias in that order
//   out_proj.weight / .bias     W_o.weight / W_o.bias
// torch's bias=True gives all four projections a bias, like d2l's bias=True. Extra torch
// parameters (bias_k, bias_v) have no d2l counterpart and are unexpected names.

void MultiHeadAttention::load_state_dict(const StateDict& dict, bool strict) {
  const std::string op = "MultiHeadAttention::load_state_dict";
  static constexpr std::array<std::string_view, 7> kTorchNames = {
      "in_proj_weight", "q_proj_weight",   "k_proj_weight", "v_proj_weight",
      "in_proj_bias",   "out_proj.weight", "out_proj.bias"};
  auto is_torch = [](const std::string& key) {
    for (auto n : kTorchNames)
      if (key == n) return true;
    return false;
  };
  bool any_torch = false;
  for (const auto& [key, t] : dict)
    any_torch |= is_torch(key);
  if (!any_torch) return Module::load_state_dict(dict, strict);

  // Translate to d2l names (views of the packed tensors, no copies), then load as usual so
  // shapes, dtypes and strictness are checked in one place and the load stays atomic.
  const int64_t E = num_hiddens_;
  StateDict d2l;
  std::string translated;
  for (const auto& [key, t] : dict)
    if (!is_torch(key)) d2l.emplace(key, t);
  auto put = [&](const std::string& name, const Tensor& t, const std::string& from) {
    check(!d2l.count(name), op.c_str(), "'{}' is given twice: directly and as part of '{}'", name,
          from);
    d2l.emplace(name, t);
  };
  auto get = [&](const char* key) -> const Tensor* {
    auto it = dict.find(key);
    if (it == dict.end()) return nullptr;
    check(it->second.defined(), op.c_str(), "'{}' is an undefined tensor", key);
    translated += (translated.empty() ? "" : ", ") + std::string(key);
    return &it->second;
  };
  if (const Tensor* w = get("in_proj_weight")) {
    check(w->ndim() == 2 && w->dim(0) == 3 * E, op.c_str(),
          "'in_proj_weight' has shape {}, expected (3E, in) = ({}, in): W_q, W_k, W_v stacked",
          shape_arg(w->shape()), 3 * E);
    put("W_q.weight", w->slice(0, 0, E), "in_proj_weight");
    put("W_k.weight", w->slice(0, E, 2 * E), "in_proj_weight");
    put("W_v.weight", w->slice(0, 2 * E, 3 * E), "in_proj_weight");
  }
  if (const Tensor* w = get("q_proj_weight")) put("W_q.weight", *w, "q_proj_weight");
  if (const Tensor* w = get("k_proj_weight")) put("W_k.weight", *w, "k_proj_weight");
  if (const Tensor* w = get("v_proj_weight")) put("W_v.weight", *w, "v_proj_weight");
  if (const Tensor* b = get("in_proj_bias")) {
    check(b->ndim() == 1 && b->dim(0) == 3 * E, op.c_str(),
          "'in_proj_bias' has shape {}, expected (3E) = ({})", shape_arg(b->shape()), 3 * E);
    put("W_q.bias", b->slice(0, 0, E), "in_proj_bias");
    put("W_k.bias", b->slice(0, E, 2 * E), "in_proj_bias");
    put("W_v.bias", b->slice(0, 2 * E, 3 * E), "in_proj_bias");
  }
  if (const Tensor* w = get("out_proj.weight")) put("W_o.weight", *w, "out_proj.weight");
  if (const Tensor* b = get("out_proj.bias")) put("W_o.bias", *b, "out_proj.bias");

  try {
    Module::load_state_dict(d2l, strict);
  } catch (const Error& e) {
    // Say which names were translated, so "missing W_o.bias" makes sense to a PyTorch user.
    std::string message = e.what();
    const std::string prefix = e.op() + ": ";
    if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
    throw Error(e.op(), message + " (PyTorch names translated to d2l's: " + translated + ")");
  }
}

}  // namespace attn::nn
