// d2l's TransformerEncoderBlock and TransformerEncoder (11.7), forward and backward side by side,
// and the choice of positional signal. The layers they use are in nn/transformer_layers.cpp.
//
// Vocabulary: B batch, T positions, E = num_hiddens, H heads, V vocabulary.
#include "attn/nn/transformer.hpp"

#include "attn/ops/dropout.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"

#include <cmath>
#include <string>

namespace attn::nn {

// ----------------------------------------------------------------------------------------------
// TransformerEncoderBlock: Y = addnorm1(X, attention(X, X, X)), out = addnorm2(Y, ffn(Y))

TransformerEncoderBlock::TransformerEncoderBlock(int64_t num_hiddens, int64_t ffn_num_hiddens,
                                                 int64_t num_heads, double dropout, bool use_bias,
                                                 DType dtype, uint64_t seed)
    : Module(dtype),
      attention(num_hiddens, num_heads, dropout, use_bias, dtype,
                detail::child_seed(seed, "attention")),
      addnorm1(num_hiddens, dropout, dtype),
      ffn(ffn_num_hiddens, num_hiddens, dtype, detail::child_seed(seed, "ffn")),
      addnorm2(num_hiddens, dropout, dtype) {
  // The block only needs the sum dX = dQ + dK + dV of the attention's input gradients: the
  // attention returns it as one tensor (one GEMM on the packed projection; same math).
  attention.self_attention_input_grad = true;
  // Under autocast the sublayers' outputs and input gradients stay bf16 at the seams, where the
  // fused AddNorm widens and rounds them on its own pass (the same bits as converting the float
  // tensors; no pass and no parallel region of their own). Off autocast nothing changes.
  attention.bf16_seams = true;
  addnorm1.bf16_output = true;  // the FFN reads it
  addnorm1.bf16_dy = true;      // the attention's W_o reads it
  addnorm2.bf16_dy = true;      // the FFN's dense2 reads it (the block's output goes on in f32)
}

std::vector<std::pair<std::string, Parameter*>> TransformerEncoderBlock::named_parameters() {
  // d2l's registration order: attention, addnorm1, ffn, addnorm2.
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "attention", attention);
  append_parameters(out, "addnorm1", addnorm1);
  append_parameters(out, "ffn", ffn);
  append_parameters(out, "addnorm2", addnorm2);
  return out;
}

void TransformerEncoderBlock::train(bool on) {
  Module::train(on);
  attention.train(on);
  addnorm1.train(on);
  ffn.train(on);
  addnorm2.train(on);
}

Tensor TransformerEncoderBlock::forward(Context& ctx, const Tensor& X, const Tensor& valid_lens) {
  const char* op = "TransformerEncoderBlock";
  detail::check_input(op, "X", X, 3, dtype_);
  check(X.dim(2) == attention.num_hiddens(), op, "X has shape {}, expected (B, T, {})",
        shape_arg(X.shape()), attention.num_hiddens());
  // Self-attention: queries, keys and values are all X. Dropout order: attention weights, then
  // addnorm1's Y, then addnorm2's Y.
  Tensor Y = addnorm1.forward(ctx, X, attention.forward(ctx, X, X, X, valid_lens));
  // Under autocast the FFN reads Y rounded to bf16, as its first Linear would round it.
  const Tensor& Y_ffn = addnorm1.output_bf16().defined() ? addnorm1.output_bf16() : Y;
  return addnorm2.forward(ctx, Y, ffn.forward(ctx, Y_ffn));
}

Tensor TransformerEncoderBlock::backward(Context& ctx, const Tensor& dout) {
  // forward: out = addnorm2(Y, ffn(Y)); Y reaches out twice, through the residual and the FFN.
  AddNormGrads g2 = addnorm2.backward(ctx, dout);
  const int threads = ctx.resolved_threads();
  // dY = g2.dX + the FFN's input gradient, summed inside addnorm1's backward pass.
  // forward: Y = addnorm1(X, attention(X, X, X)); X reaches Y four times.
  AddNormGrads g1 = addnorm1.backward(ctx, g2.dX, ffn.backward(ctx, g2.dY));
  AttentionInputGrads ga = attention.backward(ctx, g1.dY);
  if (!ga.dkeys.defined())
    return detail::add_all({g1.dX, ga.dqueries}, threads);  // dqueries = dQ + dK + dV
  return detail::add_all({g1.dX, ga.dqueries, ga.dkeys, ga.dvalues}, threads);
}

// ----------------------------------------------------------------------------------------------
// Positional kinds

const char* positional_kind_name(PositionalKind kind) {
  switch (kind) {
    case PositionalKind::kNone:
      return "none";
    case PositionalKind::kSinusoidal:
      return "sinusoidal";
    case PositionalKind::kLearned:
      return "learned";
    case PositionalKind::kRotary:
      return "rotary";
    case PositionalKind::kAlibi:
      return "alibi";
  }
  return "?";
}

PositionalKind parse_positional_kind(const std::string& name) {
  if (name == "none") return PositionalKind::kNone;
  if (name == "sinusoidal") return PositionalKind::kSinusoidal;
  if (name == "learned") return PositionalKind::kLearned;
  if (name == "rotary" || name == "rope") return PositionalKind::kRotary;
  if (name == "alibi") return PositionalKind::kAlibi;
  throw Error("parse_positional_kind",
              fmt::format("unknown positional encoding '{}', expected none, sinusoidal, "
                          "learned, rotary (rope) or alibi",
                          name));
}

// ----------------------------------------------------------------------------------------------
// TransformerEncoder: X = PE(embedding(ids) * sqrt(E)); X = block_i(X, valid_lens) for each i

namespace {

// Validates the hyperparameters before any member is built, so errors name the encoder.
double checked_encoder_args(int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                            int64_t num_heads, int64_t num_blks, double dropout_p,
                            const TransformerEncoderOptions& o) {
  const char* op = "TransformerEncoder";
  check(vocab_size > 0 && num_hiddens > 0 && ffn_num_hiddens > 0 && num_heads > 0, op,
        "vocab_size ({}), num_hiddens ({}), ffn_num_hiddens ({}) and num_heads ({}) must be "
        "positive",
        vocab_size, num_hiddens, ffn_num_hiddens, num_heads);
  check(num_blks >= 0, op, "num_blks must be >= 0, got {}", num_blks);
  check(num_hiddens % num_heads == 0, op, "num_hiddens ({}) is not divisible by num_heads ({})",
        num_hiddens, num_heads);
  check(dropout_p >= 0.0 && dropout_p <= 1.0, op, "dropout probability {} is outside [0, 1]",
        dropout_p);
  check(o.max_len > 0, op, "max_len must be positive, got {}", o.max_len);
  check(o.dtype == DType::F32 || o.dtype == DType::F64, op,
        "dtype {} unsupported, expected F32 or F64", dtype_name(o.dtype));
  check(o.positional != PositionalKind::kRotary || (num_hiddens / num_heads) % 2 == 0, op,
        "rotary positions need an even head width, but num_hiddens / num_heads = {} / {} = {}",
        num_hiddens, num_heads, num_hiddens / num_heads);
  return dropout_p;
}

}  // namespace

TransformerEncoder::TransformerEncoder(int64_t vocab_size, int64_t num_hiddens,
                                       int64_t ffn_num_hiddens, int64_t num_heads, int64_t num_blks,
                                       double dropout_p, bool use_bias,
                                       const TransformerEncoderOptions& options)
    : Module(options.dtype),
      embedding(vocab_size, num_hiddens, options.dtype,
                detail::child_seed(options.seed, "embedding")),
      pos_encoding(num_hiddens,
                   checked_encoder_args(vocab_size, num_hiddens, ffn_num_hiddens, num_heads,
                                        num_blks, dropout_p, options),
                   options.positional == PositionalKind::kSinusoidal ? options.max_len : 0,
                   options.dtype),
      dropout(dropout_p),
      num_hiddens_(num_hiddens),
      positional_(options.positional) {
  if (positional_ == PositionalKind::kLearned) {
    learned_pos = std::make_unique<LearnedPositionalEmbedding>(
        options.max_len, num_hiddens, dropout_p, options.dtype,
        detail::child_seed(options.seed, "pos_encoding"));
  }
  for (int64_t i = 0; i < num_blks; ++i) {
    // d2l: self.blks.add_module("block" + str(i), TransformerEncoderBlock(...)).
    blks.push_back(std::make_unique<TransformerEncoderBlock>(
        num_hiddens, ffn_num_hiddens, num_heads, dropout_p, use_bias, options.dtype,
        detail::child_seed(options.seed, "block" + std::to_string(i))));
    // Relative signals act inside every block's attention, on each head's (B*H, T, D) rows.
    DotProductAttention& inner = blks.back()->attention.attention;
    if (positional_ == PositionalKind::kRotary) {
      RotaryOptions rope;
      rope.pairing = options.rotary_pairing;
      inner.rotary = rope;
    } else if (positional_ == PositionalKind::kAlibi) {
      inner.alibi_slopes = Tensor::from_vector(alibi_slopes(num_heads), {num_heads}, DType::F64);
    }
  }
}

std::vector<std::pair<std::string, Parameter*>> TransformerEncoder::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "embedding", embedding);
  if (learned_pos) append_parameters(out, "pos_encoding", *learned_pos);
  for (size_t i = 0; i < blks.size(); ++i)
    append_parameters(out, "blks.block" + std::to_string(i), *blks[i]);
  return out;
}

void TransformerEncoder::train(bool on) {
  Module::train(on);
  embedding.train(on);
  pos_encoding.train(on);
  if (learned_pos) learned_pos->train(on);
  for (auto& blk : blks)
    blk->train(on);
}

Tensor TransformerEncoder::forward(Context& ctx, const Tensor& ids, const Tensor& valid_lens) {
  const char* op = "TransformerEncoder";
  check(ids.defined() && ids.ndim() == 2, op, "ids has shape {}, expected (B, T)", shape_arg(ids));
  check(dropout >= 0.0 && dropout <= 1.0, op, "dropout probability {} is outside [0, 1]", dropout);
  // Since positional encoding values are between -1 and 1, the embedding values are multiplied
  // by sqrt(E) to rescale before they are summed up (d2l).
  const double factor = std::sqrt(static_cast<double>(num_hiddens_));
  Tensor X = embedding.forward(ctx, ids);
  switch (positional_) {
    case PositionalKind::kSinusoidal:
      X = pos_encoding.forward_scaled(ctx, X, factor);  // scale, add P, dropout: one pass
      break;
    case PositionalKind::kLearned:
      X = learned_pos->forward(ctx, detail::scaled(X, factor, ctx.resolved_threads()));
      break;
    default:
      // No additive table: dropout site 1 acts on the scaled embedding directly.
      X = detail::scaled(X, factor, ctx.resolved_threads());
      dropped_ = training_ && dropout > 0.0;
      if (dropped_) {
        dropout_offset_ = ctx.next_dropout_offset();
        X = attn::dropout(ctx, X, dropout, ctx.seed, dropout_offset_);
      }
      break;
  }
  for (auto& blk : blks)
    X = blk->forward(ctx, X, valid_lens);
  return X;
}

void TransformerEncoder::backward(Context& ctx, const Tensor& dout,
                                  const std::function<void(int64_t)>& block_done) {
  Tensor dX = dout;
  for (int64_t i = num_blks() - 1; i >= 0; --i) {
    dX = blks[static_cast<size_t>(i)]->backward(ctx, dX);
    if (block_done) block_done(i);
  }
  // forward: X = positional(embedding(ids) * sqrt(E))
  const double factor = std::sqrt(static_cast<double>(num_hiddens_));
  switch (positional_) {
    case PositionalKind::kSinusoidal:
      dX = pos_encoding.backward_scaled(ctx, dX, factor);  // dropout backward and scale: one pass
      break;
    case PositionalKind::kLearned:
      dX = detail::scaled(learned_pos->backward(ctx, dX), factor, ctx.resolved_threads());
      break;
    default:
      if (dropped_) dX = dropout_backward(ctx, dX, dropout, ctx.seed, dropout_offset_);
      dX = detail::scaled(dX, factor, ctx.resolved_threads());
      break;
  }
  embedding.backward(ctx, dX);
}

void TransformerEncoder::set_need_weights(bool on) {
  for (auto& blk : blks)
    blk->attention.attention.need_weights = on;
}

const Tensor& TransformerEncoder::attention_weights(int64_t i) const {
  check(i >= 0 && i < num_blks(), "TransformerEncoder::attention_weights",
        "block {} does not exist, the encoder has {} blocks", i, num_blks());
  return blks[static_cast<size_t>(i)]->attention.attention_weights();
}

}  // namespace attn::nn
