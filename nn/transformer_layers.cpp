// The layers the Transformer encoder is built from (d2l 11.7): Embedding, LayerNorm,
// PositionWiseFFN, AddNorm, and the classification and tagging heads; forward and backward side
// by side. The blocks and the encoder are in nn/transformer.cpp.
//
// Vocabulary: B batch, T positions, E = num_hiddens, F = ffn_num_hiddens, V vocabulary.
#include "attn/nn/transformer.hpp"

#include "attn/ops/activation.hpp"
#include "attn/ops/dropout.hpp"
#include "attn/ops/embedding.hpp"
#include "kernels/cpu/add_norm.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::nn {

namespace {

void check_float_dtype(const char* op, DType dtype) {
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} unsupported, expected F32 or F64",
        dtype_name(dtype));
}

void check_dropout(const char* op, double p) {
  check(p >= 0.0 && p <= 1.0, op, "dropout probability {} is outside [0, 1]", p);
}

// Checks dout against the shape and dtype the forward produced.
void check_dout(const char* op, const Tensor& dout, const Shape& expected, DType dtype) {
  check(dout.defined() && dout.shape() == expected && dout.dtype() == dtype, op,
        "dout has shape {} and dtype {}, expected {} and {}", shape_arg(dout),
        dout.defined() ? dtype_name(dout.dtype()) : "none", shape_arg(expected), dtype_name(dtype));
}

// AddNorm's dropout of Y as ops::dropout draws it: the outermost axis is the sample axis
// (Context::dropout_index_base). The fused forward draws the mask once and keeps it for the
// backward.
cpu::AddNormDropout add_norm_dropout(const Context& ctx, const Tensor& Y, double p,
                                     uint64_t offset) {
  const uint64_t per_sample =
      Y.ndim() > 0 && Y.dim(0) > 0 ? static_cast<uint64_t>(Y.numel() / Y.dim(0)) : 0;
  return {p, ctx.seed, offset, ctx.dropout_index_base(per_sample)};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Embedding: out[p] = weight[ids[p]]

Embedding::Embedding(int64_t vocab_size, int64_t num_hiddens, DType dtype, uint64_t seed)
    : Module(dtype) {
  const char* op = "Embedding";
  check(vocab_size > 0 && num_hiddens > 0, op,
        "vocab_size ({}) and num_hiddens ({}) must be positive", vocab_size, num_hiddens);
  check_float_dtype(op, dtype);
  // nn.Embedding.reset_parameters: normal_(0, 1), here from this parameter's own stream.
  weight.value = Tensor::empty({vocab_size, num_hiddens}, dtype);
  Rng rng(seed, detail::name_stream("weight"));
  for (int64_t i = 0; i < weight.value.numel(); ++i)
    weight.value.set_flat(i, rng.normal());
  weight.grad = Tensor::zeros({vocab_size, num_hiddens}, dtype);
}

std::vector<std::pair<std::string, Parameter*>> Embedding::named_parameters() {
  return {{"weight", &weight}};
}

Tensor Embedding::forward(Context& ctx, const Tensor& ids) {
  // The op checks the id dtype and that every id is in [0, V).
  Tensor out = embedding(ctx, ids, weight.value);
  ids_ = ids.contiguous();
  return out;
}

void Embedding::backward(Context& ctx, const Tensor& dout) {
  const char* op = "Embedding::backward";
  check(ids_.defined(), op, "called before forward");
  Shape expected = ids_.shape();
  expected.push_back(num_hiddens());
  check_dout(op, dout, expected, dtype_);
  // forward: out[p] = weight[ids[p]], so weight.grad[v] += sum over p with ids[p] == v of dout[p].
  detail::accumulate(weight.grad, embedding_backward(ctx, dout, ids_, vocab_size()),
                     ctx.resolved_threads());
}

// ----------------------------------------------------------------------------------------------
// LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim

LayerNorm::LayerNorm(int64_t normalized_shape, double eps_, DType dtype)
    : Module(dtype), eps(eps_) {
  const char* op = "LayerNorm";
  check(normalized_shape > 0, op, "normalized_shape must be positive, got {}", normalized_shape);
  check(std::isfinite(eps_) && eps_ >= 0.0, op, "eps is {}, expected a finite number >= 0", eps_);
  check_float_dtype(op, dtype);
  // nn.LayerNorm.reset_parameters: ones_(weight), zeros_(bias).
  weight.value = Tensor::full({normalized_shape}, 1.0, dtype);
  weight.grad = Tensor::zeros({normalized_shape}, dtype);
  bias.value = Tensor::zeros({normalized_shape}, dtype);
  bias.grad = Tensor::zeros({normalized_shape}, dtype);
}

std::vector<std::pair<std::string, Parameter*>> LayerNorm::named_parameters() {
  return {{"weight", &weight}, {"bias", &bias}};
}

Tensor LayerNorm::forward(Context& ctx, const Tensor& X) {
  const char* op = "LayerNorm";
  detail::check_input(op, "X", X, 0, dtype_);
  check(X.dim(-1) == weight.value.dim(0), op, "X has shape {}, expected (..., {})",
        shape_arg(X.shape()), weight.value.dim(0));
  x_ = X;
  saved_ = layer_norm(ctx, X, weight.value, bias.value, eps);
  return saved_.y;
}

Tensor LayerNorm::backward(Context& ctx, const Tensor& dout) {
  const char* op = "LayerNorm::backward";
  check(x_.defined(), op, "called before forward");
  check_dout(op, dout, x_.shape(), dtype_);
  LayerNormGrads g = layer_norm_backward(ctx, dout, x_, weight.value, saved_);
  detail::accumulate(weight.grad, g.dgamma);
  detail::accumulate(bias.grad, g.dbeta);
  return g.dx;
}

// ----------------------------------------------------------------------------------------------
// PositionWiseFFN: dense2(relu(dense1(X)))

PositionWiseFFN::PositionWiseFFN(int64_t ffn_num_hiddens, int64_t ffn_num_outputs, DType dtype,
                                 uint64_t seed)
    : Module(dtype),
      // d2l: nn.LazyLinear(ffn_num_hiddens), nn.LazyLinear(ffn_num_outputs), biases on.
      dense1(ffn_num_hiddens, 0, true, dtype, detail::child_seed(seed, "dense1")),
      dense2(ffn_num_outputs, 0, true, dtype, detail::child_seed(seed, "dense2")) {}

std::vector<std::pair<std::string, Parameter*>> PositionWiseFFN::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "dense1", dense1);
  append_parameters(out, "dense2", dense2);
  return out;
}

void PositionWiseFFN::train(bool on) {
  Module::train(on);
  dense1.train(on);
  dense2.train(on);
}

Tensor PositionWiseFFN::forward(Context& ctx, const Tensor& X) {
  const bool autocast = detail::autocasts(ctx, dtype_);
  const bool x_bf16 = autocast && X.defined() && X.dtype() == DType::BF16;
  detail::check_input("PositionWiseFFN", "X", X, 0, x_bf16 ? DType::BF16 : dtype_);
  // Under autocast the hidden layer stays bf16 from dense1's product to dense2's: relu commutes
  // with the rounding (it keeps a value or gives 0), so these are the bits of the float32 round
  // trip (dense1's y widened, relu, rounded again in dense2) without its two conversions. The
  // backward follows: dense2's dx comes back bf16 (its input was), relu_backward in bf16, and
  // dense1 takes the bf16 dy as it would have rounded the float32 one.
  const DType hidden_dtype = autocast ? DType::BF16 : dtype_;
  // hidden_ = relu(dense1(X)) (..., F), rectified in dense1's product region (no pass of its
  // own); relu(h) > 0 exactly where h > 0 (NaN in both: not), so it is also the backward's mask.
  hidden_ = dense1.forward_relu(ctx, X, hidden_dtype);
  return dense2.forward(ctx, hidden_, x_bf16 ? DType::BF16 : dtype_);
}

Tensor PositionWiseFFN::backward(Context& ctx, const Tensor& dout) {
  check(hidden_.defined(), "PositionWiseFFN::backward", "called before forward");
  // forward: out = dense2(hidden), hidden = relu(dense1(X)): dense2's dx taken through ReLU's
  // backward at hidden in dx's product region, then dense1.
  return dense1.backward(ctx, dense2.backward_relu(ctx, dout, hidden_));
}

// ----------------------------------------------------------------------------------------------
// AddNorm: ln(dropout(Y) + X)

AddNorm::AddNorm(int64_t norm_shape, double dropout_p, DType dtype)
    : Module(dtype), ln(norm_shape, 1e-5, dtype), dropout(dropout_p) {
  check_dropout("AddNorm", dropout_p);
}

std::vector<std::pair<std::string, Parameter*>> AddNorm::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "ln", ln);
  return out;
}

void AddNorm::train(bool on) {
  Module::train(on);
  ln.train(on);
}

Tensor AddNorm::forward(Context& ctx, const Tensor& X, const Tensor& Y) {
  const char* op = "AddNorm";
  detail::check_input(op, "X", X, 0, dtype_);
  const bool autocast = detail::autocasts(ctx, dtype_);
  if (autocast && Y.defined() && Y.dtype() == DType::BF16) {
    detail::check_input(op, "Y", Y, 0, DType::BF16);
  } else {
    detail::check_input(op, "Y", Y, 0, dtype_);
  }
  check(X.shape() == Y.shape(), op, "X {} and Y {} must have the same shape", shape_arg(X.shape()),
        shape_arg(Y.shape()));
  check_dropout(op, dropout);
  // Dropout acts on the sublayer output Y only, never on the residual X (d2l).
  dropped_ = training_ && dropout > 0.0;
  if (dropped_) dropout_offset_ = ctx.next_dropout_offset();
  const bool out_bf16 = autocast && bf16_output;
  dy_bf16_ = autocast && bf16_dy;
  out_bf16_ = Tensor();
  // float32 on the CPU fast path: one fused pass per chunk of rows (kernels/cpu/add_norm.hpp),
  // bitwise the separate ops below. Other cases (and a shape LayerNorm rejects) run those ops.
  const int64_t E = ln.weight.value.dim(0);
  fused_ = ctx.backend != Backend::kReference && dtype_ == DType::F32 && X.dim(-1) == E;
  if (!fused_) {
    const Tensor Yf = Y.to(dtype_);
    Tensor Yd = dropped_ ? attn::dropout(ctx, Yf, dropout, ctx.seed, dropout_offset_) : Yf;
    Tensor out = ln.forward(ctx, detail::add_all({Yd, X}));
    if (out_bf16) out_bf16_ = detail::convert(ctx, out, DType::BF16);
    return out;
  }
  const Tensor Xc = X.contiguous(), Yc = Y.contiguous();
  const int64_t R = X.numel() / E;
  Shape rows(X.shape().begin(), X.shape().end() - 1);
  z_ = Tensor::empty(X.shape(), DType::F32);
  mean_ = Tensor::empty(rows, DType::F32);
  rstd_ = Tensor::empty(rows, DType::F32);
  Tensor out = Tensor::empty(X.shape(), DType::F32);
  cpu::AddNormDropout drop = add_norm_dropout(ctx, Y, dropout, dropout_offset_);
  if (dropped_) {
    keep_.resize(static_cast<size_t>(X.numel()));
    drop.keep = keep_.data();
  }
  cpu::AddNormBf16 bf16;
  const bool y_bf16 = Yc.dtype() == DType::BF16;
  if (y_bf16) bf16.y = static_cast<const uint16_t*>(Yc.raw_data());
  if (out_bf16) {
    out_bf16_ = Tensor::empty(X.shape(), DType::BF16);
    bf16.out = static_cast<uint16_t*>(out_bf16_.raw_data());
  }
  const Tensor gamma = ln.weight.value.contiguous(), beta = ln.bias.value.contiguous();
  cpu::add_norm_forward_f32(Xc.data<float>(), y_bf16 ? nullptr : Yc.data<float>(),
                            gamma.data<float>(), beta.data<float>(), z_.data<float>(),
                            out.data<float>(), mean_.data<float>(), rstd_.data<float>(), R, E,
                            ln.eps, dropped_ ? &drop : nullptr, ctx.resolved_threads(), &bf16);
  return out;
}

AddNormGrads AddNorm::backward(Context& ctx, const Tensor& dout) {
  return backward(ctx, dout, Tensor());
}

AddNormGrads AddNorm::backward(Context& ctx, const Tensor& dout, const Tensor& dout_add) {
  // forward: Z = dropout(Y) + X; out = ln(Z). So dX = dZ and dY = dropout_backward(dZ).
  AddNormGrads g;
  if (dout_add.defined()) {
    check(dout.defined() && dout_add.shape() == dout.shape() &&
              (dout_add.dtype() == dout.dtype() ||
               (dout.dtype() == DType::F32 && dout_add.dtype() == DType::BF16)),
          "AddNorm::backward", "dout_add has shape {} and dtype {}, expected dout's {} and {}{}",
          shape_arg(dout_add), dtype_name(dout_add.dtype()), shape_arg(dout),
          dout.defined() ? dtype_name(dout.dtype()) : "none",
          dout.defined() && dout.dtype() == DType::F32 ? " (or BF16)" : "");
    if (!fused_) return backward(ctx, detail::add_all({dout, dout_add}, ctx.resolved_threads()));
  }
  if (!fused_) {
    Tensor dZ = ln.backward(ctx, dout);
    g.dY = dropped_ ? dropout_backward(ctx, dZ, dropout, ctx.seed, dropout_offset_) : dZ;
    g.dX = dZ;
    if (dy_bf16_) g.dY = detail::convert(ctx, g.dY, DType::BF16);
    return g;
  }
  const char* op = "AddNorm::backward";
  check_dout(op, dout, z_.shape(), dtype_);
  const Tensor doutc = dout.contiguous();
  const int64_t E = z_.dim(-1), R = z_.numel() / E;
  g.dX = Tensor::empty(z_.shape(), DType::F32);
  cpu::AddNormBf16 bf16;
  if (dy_bf16_) {
    g.dY = Tensor::empty(z_.shape(), DType::BF16);
    bf16.dy = static_cast<uint16_t*>(g.dY.raw_data());
  } else {
    g.dY = dropped_ ? Tensor::empty(z_.shape(), DType::F32) : g.dX;
  }
  Tensor dgamma = Tensor::empty({E}, DType::F32), dbeta = Tensor::empty({E}, DType::F32);
  // The forward's mask (keep_) and p; the stream is not drawn again.
  cpu::AddNormDropout drop;
  drop.p = dropout;
  drop.keep = keep_.data();
  const Tensor gamma = ln.weight.value.contiguous();
  // dout + dout_add, summed as the pass reads dout.
  const Tensor addc = dout_add.defined() ? dout_add.contiguous() : Tensor();
  cpu::AddNormGradTerm add;
  if (addc.defined() && addc.dtype() == DType::BF16)
    add.bf16 = static_cast<const uint16_t*>(addc.raw_data());
  else if (addc.defined())
    add.f32 = addc.data<float>();
  cpu::add_norm_backward_f32(doutc.data<float>(), z_.data<float>(), gamma.data<float>(),
                             mean_.data<float>(), rstd_.data<float>(), g.dX.data<float>(),
                             dropped_ && !dy_bf16_ ? g.dY.data<float>() : nullptr,
                             dgamma.data<float>(), dbeta.data<float>(), R, E,
                             dropped_ ? &drop : nullptr, ctx.resolved_threads(), &bf16, &add);
  detail::accumulate(ln.weight.grad, dgamma);
  detail::accumulate(ln.bias.grad, dbeta);
  return g;
}

// ----------------------------------------------------------------------------------------------
// ClassificationHead: logits = dense(masked mean over t < n_b of X[b, t])

namespace {

// n_b = #{t in [0, T) : t < len}: d2l's "kept iff float(t) < len" rule (NaN and len <= 0 keep
// nothing).
int64_t positions_kept(double len, int64_t T) {
  if (!(len > 0.0)) return 0;
  return std::min<int64_t>(T, static_cast<int64_t>(std::ceil(std::min(len, 9.0e18))));
}

}  // namespace

ClassificationHead::ClassificationHead(int64_t num_classes, int64_t num_hiddens, DType dtype,
                                       uint64_t seed)
    : Module(dtype),
      dense(num_classes, num_hiddens, true, dtype, detail::child_seed(seed, "dense")) {}

std::vector<std::pair<std::string, Parameter*>> ClassificationHead::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "dense", dense);
  return out;
}

Tensor ClassificationHead::forward(Context& ctx, const Tensor& X, const Tensor& valid_lens) {
  const char* op = "ClassificationHead";
  detail::check_input(op, "X", X, 3, dtype_);
  const int64_t B = X.dim(0), T = X.dim(1), E = X.dim(2);
  counts_.assign(static_cast<size_t>(B), T);
  if (valid_lens.defined()) {
    check(valid_lens.ndim() == 1 && valid_lens.dim(0) == B, op,
          "valid_lens has shape {}, expected (B) = ({}) for X {}", shape_arg(valid_lens.shape()), B,
          shape_arg(X.shape()));
    for (int64_t b = 0; b < B; ++b)
      counts_[static_cast<size_t>(b)] = positions_kept(valid_lens.flat(b), T);
  }
  T_ = T;
  // pooled[b, e] = (1/n_b) sum_{t < n_b} X[b, t, e]   (B, E), summed in double
  const Tensor Xc = X.contiguous();
  Tensor pooled = Tensor::zeros({B, E}, dtype_);
  auto pool = [&](auto zero) {
    using F = decltype(zero);
    const F* x = Xc.data<F>();
    F* out = pooled.data<F>();
    std::vector<double> acc(static_cast<size_t>(E));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = counts_[static_cast<size_t>(b)];
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t e = 0; e < E; ++e)
          acc[e] += x[(b * T + t) * E + e];
      for (int64_t e = 0; e < E; ++e)
        out[b * E + e] = n > 0 ? static_cast<F>(acc[e] / static_cast<double>(n)) : F(0);
    }
  };
  if (dtype_ == DType::F32)
    pool(float{});
  else
    pool(double{});
  return dense.forward(ctx, pooled);
}

Tensor ClassificationHead::backward(Context& ctx, const Tensor& dlogits) {
  check(!counts_.empty(), "ClassificationHead::backward", "called before forward");
  Tensor dpooled = dense.backward(ctx, dlogits);  // (B, E)
  const int64_t B = dpooled.dim(0), E = dpooled.dim(1);
  // forward: pooled[b] = mean_{t < n_b} X[b, t], so dX[b, t] = dpooled[b] / n_b for t < n_b.
  const Tensor dp = dpooled.contiguous();
  Tensor dX = Tensor::zeros({B, T_, E}, dtype_);
  auto spread = [&](auto zero) {
    using F = decltype(zero);
    const F* g = dp.data<F>();
    F* dx = dX.data<F>();
    // The row dpooled[b] / n_b once per b (a double division per element was most of this
    // loop), then copied to its n_b positions.
    std::vector<F> row(static_cast<size_t>(E));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = counts_[static_cast<size_t>(b)];
      for (int64_t e = 0; e < E; ++e)
        row[static_cast<size_t>(e)] = static_cast<F>(g[b * E + e] / static_cast<double>(n));
      for (int64_t t = 0; t < n; ++t)
        std::copy(row.begin(), row.end(), dx + (b * T_ + t) * E);
    }
  };
  if (dtype_ == DType::F32)
    spread(float{});
  else
    spread(double{});
  return dX;
}

// ----------------------------------------------------------------------------------------------
// TaggingHead: logits[b, t] = dense(X[b, t])

TaggingHead::TaggingHead(int64_t num_tags, int64_t num_hiddens, DType dtype, uint64_t seed)
    : Module(dtype), dense(num_tags, num_hiddens, true, dtype, detail::child_seed(seed, "dense")) {}

std::vector<std::pair<std::string, Parameter*>> TaggingHead::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "dense", dense);
  return out;
}

Tensor TaggingHead::forward(Context& ctx, const Tensor& X) {
  detail::check_input("TaggingHead", "X", X, 3, dtype_);
  return dense.forward(ctx, X);
}

Tensor TaggingHead::backward(Context& ctx, const Tensor& dlogits) {
  return dense.backward(ctx, dlogits);
}

}  // namespace attn::nn
