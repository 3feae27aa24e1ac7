// The Transformer decoder of d2l 11.7 and the encoder-decoder that joins it to the encoder,
// forward and backward, plus incremental decoding with a key/value cache.
//
// Vocabulary: B batch, T target positions, S source positions, E = num_hiddens,
// F = ffn_num_hiddens, H heads, V target vocabulary.
//
//   TransformerDecoder(ids (B, T), enc_outputs (B, S, E), enc_valid_lens (B,)):
//     X = pos_encoding(embedding(ids) * sqrt(E))               dropout site 1 (after the PE sum)
//     for each block:                                          post-norm residual blocks
//       Y  = addnorm1(X, attention1(X, X, X, causal))          sites: weights, addnorm1
//       Z  = addnorm2(Y, attention2(Y, enc, enc, enc_lens))    sites: weights, addnorm2
//       X  = addnorm3(Z, ffn(Z))                               site: addnorm3
//     logits = dense(X)                                        (B, T, V), no softmax
// The forward takes ctx.next_dropout_offset() at each site in that order (1 + 5 per block);
// the backward redraws every mask from the offset its forward stored.
//
// Where attn departs from d2l (docs/decoder.md; reference/semantics-seq2seq.md section 2):
//   - the self-attention is causal in every mode. d2l masks through dec_valid_lens = [1..T] per
//     row in training only, so its eval-mode full forward attends to future tokens;
//   - incremental decoding adds positional-encoding row t at step t (d2l adds row 0 at every
//     step), so decoding with the cache computes what training computed;
//   - the cache holds each block's projected keys and values (d2l caches the block inputs and
//     re-projects the whole prefix every step): a step costs O(t*E), not O(t*E^2);
//   - the projections are created at construction (d2l's are LazyLinear): every width is E.
//
// State dicts use d2l's names: embedding.weight,
// blks.block{i}.attention{1,2}.W_{q,k,v,o}.weight, blks.block{i}.addnorm{1,2,3}.ln.{weight,bias},
// blks.block{i}.ffn.dense{1,2}.{weight,bias}, dense.weight, dense.bias (18 per block + 3); the
// EncoderDecoder prefixes "encoder." and "decoder.".
#pragma once

#include "attn/nn/transformer.hpp"

#include <memory>
#include <vector>

namespace attn::nn {

struct DecoderBlockGrads {
  Tensor dX;            // (B, T, E), the block input
  Tensor denc_outputs;  // (B, S, E), keys and values of the encoder-decoder attention summed
};

// d2l TransformerDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
//   Y = addnorm1(X, attention1(X, X, X)) with query t seeing keys 0..t (causal);
//   Z = addnorm2(Y, attention2(Y, enc_outputs, enc_outputs, enc_valid_lens));
//   out = addnorm3(Z, ffn(Z))
// X (B, T, E), enc_outputs (B, S, E), enc_valid_lens undefined, (B,) or (B, T) -> (B, T, E).
class TransformerDecoderBlock : public Module {
 public:
  TransformerDecoderBlock(int64_t num_hiddens, int64_t ffn_num_hiddens, int64_t num_heads,
                          double dropout, bool use_bias = false, DType dtype = DType::F32,
                          uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X, const Tensor& enc_outputs,
                 const Tensor& enc_valid_lens = {});
  // Accumulates every parameter gradient.
  DecoderBlockGrads backward(Context& ctx, const Tensor& dout);
  void train(bool on = true) override;
  // Keep both attentions' (B*H, T, T|S) pre-dropout weights on the next forward
  // (attention1/2.attention_weights()). Off: the fused kernel runs and they are undefined.
  void set_need_weights(bool on);

  int64_t num_hiddens() const { return attention1.num_hiddens(); }

  MultiHeadAttention attention1;  // masked self-attention
  AddNorm addnorm1;
  MultiHeadAttention attention2;  // encoder-decoder attention
  AddNorm addnorm2;
  PositionWiseFFN ffn;
  AddNorm addnorm3;
};

// One block's cache for incremental decoding.
struct DecoderBlockCache {
  // (B, capacity, E): attention1's W_k and W_v applied to the block's input at positions
  // [0, DecoderState::length); rows past that are unused capacity.
  Tensor keys, values;
  // (B / DecoderState::enc_share, S, E): attention2's W_k and W_v applied to enc_outputs, once
  // per source.
  Tensor enc_keys, enc_values;
};

// d2l's decoder state [enc_outputs, enc_valid_lens, per-block cache], with projected keys and
// values. Made by TransformerDecoder::init_state, advanced by TransformerDecoder::step.
struct DecoderState {
  // (B / enc_share,) F64, or undefined (every source position is kept)
  Tensor enc_valid_lens;
  int64_t batch = 0;  // B: rows of the state
  // Rows per row of the encoder's tensors (enc_valid_lens, enc_keys, enc_values): row i attends
  // to their row i / enc_share. repeat_interleave multiplies it instead of copying the encoder's
  // projections for every beam; a reorder that moves rows across sources copies them out (1).
  int64_t enc_share = 1;
  int64_t length = 0;    // positions decoded so far; the next step's first position
  int64_t capacity = 0;  // cache rows allocated per batch row (grows on demand)
  std::vector<DecoderBlockCache> blocks;
  // source_row[i]: the init_state row whose encoder outputs row i attends to.
  std::vector<int64_t> source_row;
  // With TransformerDecoder::need_weights: the last step's (B*H, T_new, length) self- and
  // (B*H, T_new, S) cross-attention weights per block, pre-dropout (d2l's attention_weights).
  std::vector<Tensor> self_attention_weights, cross_attention_weights;

  // Beam search: row i continues row rows[i] (rows.size() == batch, each in [0, batch)). Copies
  // the decoded positions of the rows that take another row's, in place (as step writes into the
  // caches: a copied DecoderState shares them); the encoder's keys and values only where a row
  // takes another source's row.
  void reorder(const std::vector<int64_t>& rows);
  // Row b becomes rows b*times .. b*times + times - 1 (torch.repeat_interleave along the batch):
  // one source's state for each of its beams.
  void repeat_interleave(int64_t times);
};

struct TransformerDecoderOptions {
  int64_t max_len = 1000;  // the sinusoid table's initial size (not a limit: it grows)
  DType dtype = DType::F32;
  uint64_t seed = 0;
};

// d2l TransformerDecoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout):
// ids (B, T) I32/I64 -> logits (B, T, V). Sinusoidal positions (d2l's PositionalEncoding).
class TransformerDecoder : public Module {
 public:
  TransformerDecoder(int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                     int64_t num_heads, int64_t num_blks, double dropout, bool use_bias = false,
                     const TransformerDecoderOptions& options = {});
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  void train(bool on = true) override;

  // The teacher-forced forward over whole target sequences (training, scoring): the same
  // computation in train and eval mode except for dropout.
  Tensor forward(Context& ctx, const Tensor& ids, const Tensor& enc_outputs,
                 const Tensor& enc_valid_lens = {});
  // dlogits (B, T, V) -> d enc_outputs (B, S, E), summed over the blocks. Accumulates every
  // parameter gradient; ids have no gradient.
  Tensor backward(Context& ctx, const Tensor& dlogits);

  // d2l's init_state(enc_outputs, enc_valid_lens): projects the encoder outputs through every
  // block's attention2.W_k and W_v once and reserves `capacity` cached positions (it grows when
  // exceeded). enc_valid_lens: undefined or (B,), any integer or float dtype. cache_dtype: the
  // dtype of the cached keys and values (self-attention cache and encoder projections): the
  // decoder's dtype, or bfloat16 for a float32 decoder (half the memory and the bytes each step
  // reads; the projections are rounded to bfloat16 when cached, the attention accumulates in
  // float32: kernels/cpu/decode_attention).
  DecoderState init_state(Context& ctx, const Tensor& enc_outputs,
                          const Tensor& enc_valid_lens = {}, int64_t capacity = 64,
                          DType cache_dtype = DType::F32);
  // Decodes ids (B, T_new) at positions state.length .. state.length + T_new - 1 against the
  // cache, appends them to it, and returns their logits (B, T_new, V). Always the eval-mode
  // computation (no dropout), whatever train() says; modifies no saved activation. Equal to the
  // last T_new positions of forward() on the whole prefix, up to rounding.
  Tensor step(Context& ctx, const Tensor& ids, DecoderState& state);

  // d2l's attention_weights[0][i] (self) and [1][i] (cross) of the last forward with
  // need_weights: (B*H, T, T) and (B*H, T, S).
  const Tensor& self_attention_weights(int64_t i) const;
  const Tensor& cross_attention_weights(int64_t i) const;

  int64_t num_blks() const { return static_cast<int64_t>(blks.size()); }
  int64_t num_hiddens() const { return num_hiddens_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t vocab_size() const { return vocab_size_; }

  // Keep the attention weights (forward: in the blocks' attentions; step: in the state). Off by
  // default: the weights cost a (B*H, T, S) matrix per attention and bypass the fused kernel.
  bool need_weights = false;

  Embedding embedding;
  PositionalEncoding pos_encoding;
  std::vector<std::unique_ptr<TransformerDecoderBlock>> blks;
  Linear dense;

 private:
  int64_t vocab_size_, num_hiddens_, num_heads_;
  bool forward_done_ = false;
};

// Hyperparameters of a Transformer encoder-decoder (d2l 11.7's Seq2Seq of a TransformerEncoder
// and a TransformerDecoder with the same width).
struct Seq2SeqConfig {
  int64_t src_vocab_size = 0, tgt_vocab_size = 0;
  int64_t num_hiddens = 32, ffn_num_hiddens = 64, num_heads = 4;
  int64_t num_enc_blks = 2, num_dec_blks = 2;
  double dropout = 0.1;
  bool use_bias = false;
  int64_t max_len = 1000;  // sinusoid table size of both (grows on demand)
  DType dtype = DType::F32;
  uint64_t seed = 0;
};

// d2l EncoderDecoder(encoder, decoder): forward(enc_X, dec_X, enc_valid_lens) =
// decoder(dec_X, decoder.init_state(encoder(enc_X, enc_valid_lens), enc_valid_lens)).
// State dict: "encoder." + the encoder's names, "decoder." + the decoder's.
class EncoderDecoder : public Module {
 public:
  explicit EncoderDecoder(const Seq2SeqConfig& config);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  void train(bool on = true) override;

  // enc_X (B, S), dec_X (B, T) token ids; enc_valid_lens undefined or (B,) -> logits (B, T, V).
  Tensor forward(Context& ctx, const Tensor& enc_X, const Tensor& dec_X,
                 const Tensor& enc_valid_lens = {});
  // Accumulates every parameter gradient of encoder and decoder.
  void backward(Context& ctx, const Tensor& dlogits);

  // Keep every attention's weights (encoder self, decoder self and cross) on the next forward.
  void set_need_weights(bool on);

  const Seq2SeqConfig& config() const { return config_; }

  TransformerEncoder encoder;
  TransformerDecoder decoder;

 private:
  Seq2SeqConfig config_;
};

}  // namespace attn::nn
