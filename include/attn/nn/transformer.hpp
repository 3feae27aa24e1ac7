// The Transformer encoder of d2l 11.7, layer by layer, forward and backward, plus the two heads a
// task puts on top of it (sequence classification, per-position tagging).
//
// Vocabulary: B batch, T positions, E = num_hiddens, F = ffn_num_hiddens, H heads, V vocabulary.
//
//   TransformerEncoder(ids (B, T), valid_lens):
//     X = pos_encoding(embedding(ids) * sqrt(E))           dropout site 1 (after the PE sum)
//     for each block:                                      post-norm residual blocks
//       Y = addnorm1(X, attention(X, X, X, valid_lens))    dropout sites 2 (weights) and 3 (Y)
//       X = addnorm2(Y, ffn(Y))                            dropout site 3 again
//   AddNorm(X, Y)      = LayerNorm(dropout(Y) + X)
//   PositionWiseFFN(X) = dense2(relu(dense1(X)))           no dropout inside (unlike PyTorch's
//                                                          nn.TransformerEncoderLayer)
// Every dropout site takes ctx.next_dropout_offset() once per training forward, in the order
// the forward meets them; the backward redraws each mask from the offset its forward stored.
//
// State dicts use d2l's names: embedding.weight, blks.block{i}.attention.W_{q,k,v,o}.weight,
// blks.block{i}.addnorm{1,2}.ln.{weight,bias}, blks.block{i}.ffn.dense{1,2}.{weight,bias}
// (25 keys for 2 blocks). A learned positional table adds pos_encoding.weight.
//
// Initialisation is PyTorch's default: Embedding N(0, 1), Linear U(+-1/sqrt(in)), LayerNorm
// weight 1 bias 0; every parameter draws from its own stream of the module's seed.
#pragma once

#include "attn/nn/attention.hpp"
#include "attn/nn/positional.hpp"
#include "attn/ops/layer_norm.hpp"
#include "attn/ops/relative_position.hpp"

#include <functional>
#include <memory>
#include <vector>

namespace attn::nn {

// torch.nn.Embedding(vocab_size, num_hiddens): out[..., :] = weight[ids[...], :].
//   ids (...) I32/I64 in [0, V) -> (..., E). weight (V, E) ~ N(0, 1); state dict "weight".
class Embedding : public Module {
 public:
  Embedding(int64_t vocab_size, int64_t num_hiddens, DType dtype = DType::F32, uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& ids);
  void backward(Context& ctx, const Tensor& dout);  // accumulates weight.grad (scatter-add)

  int64_t vocab_size() const { return weight.value.dim(0); }
  int64_t num_hiddens() const { return weight.value.dim(1); }

  Parameter weight;

 private:
  Tensor ids_;
};

// torch.nn.LayerNorm(E, eps=1e-5): normalise the last dim (biased variance), then
// y = xhat * weight + bias; weight (E) = 1, bias (E) = 0 at init. X (..., E) -> (..., E).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t normalized_shape, double eps = 1e-5, DType dtype = DType::F32);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X);
  Tensor backward(Context& ctx, const Tensor& dout);  // dX; accumulates weight.grad, bias.grad

  Parameter weight, bias;
  double eps;

 private:
  Tensor x_;
  LayerNormResult saved_;
};

// d2l PositionWiseFFN(ffn_num_hiddens, ffn_num_outputs): dense2(relu(dense1(X))), both
// LazyLinear with biases. X (..., in) -> (..., ffn_num_outputs). Under autocast X may also be
// bfloat16 (as a Linear's input may): the output then stays bf16 (dense2's rounding, not
// widened), as does dX, and dout may be either.
class PositionWiseFFN : public Module {
 public:
  PositionWiseFFN(int64_t ffn_num_hiddens, int64_t ffn_num_outputs, DType dtype = DType::F32,
                  uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X);
  Tensor backward(Context& ctx, const Tensor& dout);  // dX
  void train(bool on = true) override;

  Linear dense1, dense2;

 private:
  Tensor hidden_;  // relu(dense1(X)): dense2's input, and the mask of relu's backward
};

struct AddNormGrads {
  Tensor dX;  // the residual input
  Tensor dY;  // the sublayer output
};

// d2l AddNorm(norm_shape, dropout): ln(dropout(Y) + X). X, Y (..., E) -> (..., E).
// Under autocast (a float32 module, Context::autocast_bf16) Y may also be bfloat16, a sublayer's
// bf16 output: it is widened exactly, so the result is that of Y.to(F32).
class AddNorm : public Module {
 public:
  AddNorm(int64_t norm_shape, double dropout, DType dtype = DType::F32);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X, const Tensor& Y);
  AddNormGrads backward(Context& ctx, const Tensor& dout);
  // The same for an output gradient that comes as two terms, dout + dout_add (a residual's two
  // paths; dout_add of dout's dtype, or bf16 for a float32 module under autocast): the bits of
  // backward(add of the two), summed as the fused pass reads them instead of in a pass of its own.
  AddNormGrads backward(Context& ctx, const Tensor& dout, const Tensor& dout_add);
  void train(bool on = true) override;

  // Under autocast the next layer may read this output, and the sublayer its gradient, in bf16.
  // bf16_output: forward also keeps the output rounded to bf16 (output_bf16(); the bits of
  // forward(...).to(BF16)). bf16_dy: backward returns dY in bf16 (the float dY's bits rounded).
  // Both come from the fused pass instead of a pass of their own; TransformerEncoderBlock sets
  // them where its next layer reads bf16. Without autocast they change nothing.
  bool bf16_output = false;
  bool bf16_dy = false;
  const Tensor& output_bf16() const { return out_bf16_; }

  LayerNorm ln;
  double dropout;

 private:
  Tensor out_bf16_;
  bool dy_bf16_ = false;  // bf16_dy under autocast at the forward, for its backward
  bool dropped_ = false;
  uint64_t dropout_offset_ = 0;
  // The fused float32 CPU path (kernels/cpu/add_norm.hpp) keeps its own saved state: the sum Z,
  // LayerNorm's mean and rstd, and the dropout mask (one byte per element); otherwise ln holds
  // them and the backward redraws the mask.
  bool fused_ = false;
  Tensor z_, mean_, rstd_;
  std::vector<uint8_t> keep_;
};

// d2l TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
//   Y = addnorm1(X, attention(X, X, X, valid_lens));  out = addnorm2(Y, ffn(Y))
// X (B, T, E) -> (B, T, E); valid_lens undefined, (B,) or (B, T), passed to the attention.
class TransformerEncoderBlock : public Module {
 public:
  TransformerEncoderBlock(int64_t num_hiddens, int64_t ffn_num_hiddens, int64_t num_heads,
                          double dropout, bool use_bias = false, DType dtype = DType::F32,
                          uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X, const Tensor& valid_lens = {});
  Tensor backward(Context& ctx, const Tensor& dout);  // dX (the three attention inputs summed)
  void train(bool on = true) override;

  MultiHeadAttention attention;
  AddNorm addnorm1;
  PositionWiseFFN ffn;
  AddNorm addnorm2;
};

// Which position signal the encoder uses (see docs/transformer.md for each formula).
enum class PositionalKind : uint8_t {
  kNone,        // no position signal: X = dropout(embedding * sqrt(E)); attention is then
                // permutation-equivariant
  kSinusoidal,  // d2l's PositionalEncoding (the default)
  kLearned,     // a learned (max_len, E) table added like the sinusoids: pos_encoding.weight
  kRotary,      // RoPE: rotates each head's queries and keys (DotProductAttention::rotary);
                // the head width E / H must be even
  kAlibi,       // ALiBi: a per-head distance bias -m_h |t - s| on the scores
                // (DotProductAttention::alibi_slopes with the paper's slopes)
};
const char* positional_kind_name(PositionalKind kind);
// Parses "none", "sinusoidal", "learned", "rotary"/"rope", "alibi"; throws Error otherwise.
PositionalKind parse_positional_kind(const std::string& name);

struct TransformerEncoderOptions {
  PositionalKind positional = PositionalKind::kSinusoidal;
  int64_t max_len = 1000;  // sinusoidal: cache size; learned: table size (a hard limit)
  DType dtype = DType::F32;
  uint64_t seed = 0;
  RotaryPairing rotary_pairing = RotaryPairing::kAdjacent;  // kRotary: which features pair up
};

// d2l TransformerEncoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
// use_bias=False): ids (B, T) I32/I64 -> (B, T, E).
class TransformerEncoder : public Module {
 public:
  TransformerEncoder(int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                     int64_t num_heads, int64_t num_blks, double dropout, bool use_bias = false,
                     const TransformerEncoderOptions& options = {});
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& ids, const Tensor& valid_lens = {});
  // Accumulates every parameter gradient; ids have no gradient. `block_done` (optional) is called
  // with block i's index as soon as its backward has finished, i.e. when its parameters'
  // gradients are final (last block first): data-parallel training starts reducing them there
  // while the earlier blocks' backward still runs.
  void backward(Context& ctx, const Tensor& dout,
                const std::function<void(int64_t)>& block_done = {});
  void train(bool on = true) override;

  // d2l's encoder.attention_weights[i]: block i's (B*H, T, T) pre-dropout weights of the last
  // forward.
  const Tensor& attention_weights(int64_t i) const;
  // Whether the next forwards keep those weights (off: the fused attention path, no (B*H, T, T)
  // tensor; attention_weights(i) is then undefined).
  void set_need_weights(bool on);
  int64_t num_blks() const { return static_cast<int64_t>(blks.size()); }
  int64_t num_hiddens() const { return num_hiddens_; }
  PositionalKind positional() const { return positional_; }

  Embedding embedding;
  // Exactly one of these is used, by `positional`: kSinusoidal -> pos_encoding (no parameters),
  // kLearned -> learned_pos (state dict pos_encoding.weight); the others drop out directly.
  PositionalEncoding pos_encoding;
  std::unique_ptr<LearnedPositionalEmbedding> learned_pos;
  std::vector<std::unique_ptr<TransformerEncoderBlock>> blks;
  double dropout;

 private:
  int64_t num_hiddens_;
  PositionalKind positional_;
  bool dropped_ = false;  // kNone / kRotary / kAlibi: dropout after the scaled embedding
  uint64_t dropout_offset_ = 0;
};

// Sequence classification head: masked mean over the valid positions, then a Linear.
//   pooled[b] = (1/n_b) sum_{t < n_b} X[b, t],  n_b = #{t in [0, T): t < valid_lens[b]}
//   logits = dense(pooled)   (B, num_classes); state dict dense.weight, dense.bias
// valid_lens undefined pools all T positions; a row with n_b = 0 pools to zeros (its logits are
// dense's bias). dense is lazy (in_features 0) unless num_hiddens is given.
class ClassificationHead : public Module {
 public:
  ClassificationHead(int64_t num_classes, int64_t num_hiddens = 0, DType dtype = DType::F32,
                     uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X, const Tensor& valid_lens = {});
  Tensor backward(Context& ctx, const Tensor& dlogits);  // dX (B, T, E); 0 at padded positions

  Linear dense;

 private:
  std::vector<int64_t> counts_;  // n_b of the last forward
  int64_t T_ = 0;
};

// Per-position tagging head: logits[b, t] = dense(X[b, t])   (B, T, num_tags). Mask padded
// positions in the loss (softmax_cross_entropy's valid_lens or ignore_index), not here.
class TaggingHead : public Module {
 public:
  TaggingHead(int64_t num_tags, int64_t num_hiddens = 0, DType dtype = DType::F32,
              uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X);
  Tensor backward(Context& ctx, const Tensor& dlogits);  // dX

  Linear dense;
};

}  // namespace attn::nn
