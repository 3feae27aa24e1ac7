// d2l's attention scoring modules: DotProductAttention and AdditiveAttention, forward and
// backward side by side. The math lives in ops/attention; these modules own the projections,
// remember what the backward needs and keep attention_weights() for inspection (pre-dropout).
//
// Vocabulary: B batch, T queries, S keys/values, h hidden width of additive attention.
#include "attn/nn/attention.hpp"

#include "nn/internal.hpp"

namespace attn::nn {

namespace {

void check_dropout(const char* op, double p) {
  check(p >= 0.0 && p <= 1.0, op, "dropout probability {} is outside [0, 1]", p);
}

void check_float_dtype(const char* op, DType dtype) {
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} unsupported, expected F32 or F64",
        dtype_name(dtype));
}

// Shapes shared by both scoring functions: queries (B, T, ?), keys (B, S, ?), values (B, S, Dv).
void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, DType dtype) {
  detail::check_input(op, "queries", q, 3, dtype);
  detail::check_input(op, "keys", k, 3, dtype);
  detail::check_input(op, "values", v, 3, dtype);
  check(q.dim(0) == k.dim(0) && k.dim(0) == v.dim(0) && k.dim(1) == v.dim(1), op,
        "queries {}, keys {} and values {} do not agree: expected (B, T, Dq), (B, S, Dk), "
        "(B, S, Dv)",
        shape_arg(q.shape()), shape_arg(k.shape()), shape_arg(v.shape()));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// DotProductAttention: out = dropout(masked_softmax(q k^T / sqrt(D))) v

DotProductAttention::DotProductAttention(double dropout_p, DType dtype)
    : Module(dtype), dropout(dropout_p) {
  check_dropout("DotProductAttention", dropout_p);
  // No parameters, and scaled_dot_product_attention takes bfloat16 q, k, v (outputs and
  // gradients bfloat16, weights float32), so this layer can run in BF16 too.
  check(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16, "DotProductAttention",
        "dtype {} unsupported, expected F32, F64 or BF16", dtype_name(dtype));
}

AttentionOptions DotProductAttention::options() const {
  AttentionOptions o;
  o.mask.valid_lens = valid_lens_;
  o.mask.lens_repeat = lens_repeat;
  o.mask.causal = causal;
  o.mask.masked_rows = masked_rows;
  o.dropout = dropout;
  o.training = training_;
  // d2l always keeps self.attention_weights; so do we unless asked not to (the backward needs
  // only the output and logsumexp).
  o.need_weights = need_weights;
  o.alibi_slopes = alibi_used_;
  return o;
}

Tensor DotProductAttention::forward(Context& ctx, const Tensor& queries, const Tensor& keys,
                                    const Tensor& values, const Tensor& valid_lens) {
  const char* op = "DotProductAttention";
  check_qkv(op, queries, keys, values, dtype_);
  check(queries.dim(2) == keys.dim(2), op, "queries {} and keys {} need the same last dimension",
        shape_arg(queries.shape()), shape_arg(keys.shape()));
  check_dropout(op, dropout);
  check(!rotary || queries.dim(2) % 2 == 0, op,
        "rotary is set but queries {} have an odd width: RoPE rotates pairs of features (inside "
        "MultiHeadAttention: num_hiddens / num_heads must be even)",
        shape_arg(queries.shape()));
  rotary_used_ = rotary;
  alibi_used_ = alibi_slopes;
  // RoPE: the scores see queries rotated by their positions t and keys by theirs s, so q . k
  // depends on t - s. The rotated tensors are what the backward differentiates through.
  q_ = rotary ? rotary_embedding(ctx, queries, *rotary) : queries;
  k_ = rotary ? rotary_embedding(ctx, keys, *rotary) : keys;
  v_ = values;
  valid_lens_ = valid_lens;
  // The op validates valid_lens against (B, T) and lens_repeat, takes a dropout offset from ctx
  // when it drops, and records it in result_ for the backward.
  result_ = scaled_dot_product_attention(ctx, q_, k_, v_, options());
  return result_.output;
}

AttentionInputGrads DotProductAttention::backward(Context& ctx, const Tensor& dout) {
  check(result_.output.defined(), "DotProductAttention::backward", "called before forward");
  check(dout.shape() == result_.output.shape(), "DotProductAttention::backward",
        "dout has shape {}, expected the output's {}", shape_arg(dout.shape()),
        shape_arg(result_.output.shape()));
  // The mask and the dropout pattern are redrawn from the options and result_.dropout_offset;
  // switching train/eval between forward and backward is not supported.
  AttentionGrads g =
      scaled_dot_product_attention_backward(ctx, dout, q_, k_, v_, result_, options());
  if (rotary_used_) {
    // forward: q_ = R(t) queries, k_ = R(s) keys, so dqueries = R(t)^T dq_ (the inverse rotation).
    g.dq = rotary_embedding_backward(ctx, g.dq, *rotary_used_);
    g.dk = rotary_embedding_backward(ctx, g.dk, *rotary_used_);
  }
  return {g.dq, g.dk, g.dv};
}

// ----------------------------------------------------------------------------------------------
// AdditiveAttention: score[b,t,s] = w_v . tanh(W_q q[b,t] + W_k k[b,s]), no scaling

AdditiveAttention::AdditiveAttention(int64_t num_hiddens, double dropout_p, DType dtype,
                                     uint64_t seed)
    : Module(dtype),
      // d2l: W_k, W_q = LazyLinear(num_hiddens, bias=False), w_v = LazyLinear(1, bias=False).
      // w_v always sees num_hiddens features, so it is built eagerly with the same init.
      W_q(num_hiddens, 0, false, dtype, detail::child_seed(seed, "W_q")),
      W_k(num_hiddens, 0, false, dtype, detail::child_seed(seed, "W_k")),
      w_v(1, num_hiddens, false, dtype, detail::child_seed(seed, "w_v")),
      dropout(dropout_p) {
  check_dropout("AdditiveAttention", dropout_p);
  check_float_dtype("AdditiveAttention", dtype);
}

std::vector<std::pair<std::string, Parameter*>> AdditiveAttention::named_parameters() {
  // d2l registers W_k before W_q; the order only matters for listing, names are what load.
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "W_k", W_k);
  append_parameters(out, "W_q", W_q);
  append_parameters(out, "w_v", w_v);
  return out;
}

Tensor AdditiveAttention::forward(Context& ctx, const Tensor& queries, const Tensor& keys,
                                  const Tensor& values, const Tensor& valid_lens) {
  const char* op = "AdditiveAttention";
  check_qkv(op, queries, keys, values, dtype_);
  check_dropout(op, dropout);
  // queries, keys = W_q(queries), W_k(keys):  (B, T, h), (B, S, h)
  qp_ = W_q.forward(ctx, queries);
  kp_ = W_k.forward(ctx, keys);
  v_ = values;
  valid_lens_ = valid_lens;
  AttentionOptions o;
  o.mask.valid_lens = valid_lens;
  o.dropout = dropout;
  o.training = training_;
  // features = tanh(q[:, :, None] + k[:, None]); scores = w_v(features); weights = softmax
  result_ = additive_attention(ctx, qp_, kp_, w_v.weight.value, v_, o);
  return result_.output;
}

AttentionInputGrads AdditiveAttention::backward(Context& ctx, const Tensor& dout) {
  check(result_.output.defined(), "AdditiveAttention::backward", "called before forward");
  check(dout.shape() == result_.output.shape(), "AdditiveAttention::backward",
        "dout has shape {}, expected the output's {}", shape_arg(dout.shape()),
        shape_arg(result_.output.shape()));
  AttentionOptions o;
  o.mask.valid_lens = valid_lens_;
  o.dropout = dropout;
  o.training = training_;
  AdditiveGrads g =
      additive_attention_backward(ctx, dout, qp_, kp_, w_v.weight.value, v_, result_, o);
  // forward: scores = w_v(features), so w_v.weight.grad += sum over (b, t, s) of dscore * features
  // (the op returns it as dw_v).
  detail::accumulate(w_v.weight.grad, g.dw_v);
  // forward: qp = W_q(queries), kp = W_k(keys)
  Tensor dqueries = W_q.backward(ctx, g.dqp);
  Tensor dkeys = W_k.backward(ctx, g.dkp);
  return {dqueries, dkeys, g.dv};
}

}  // namespace attn::nn
