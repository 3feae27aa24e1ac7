// d2l's TransformerDecoderBlock, TransformerDecoder (11.7) and EncoderDecoder, forward and backward
// side by side. Incremental decoding (init_state, step, the cache) is in nn/decoder_cache.cpp.
//
// Vocabulary: B batch, T target positions, S source positions, E = num_hiddens, H heads,
// V target vocabulary.
#include "attn/nn/decoder.hpp"

#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"

#include <cmath>
#include <string>

namespace attn::nn {

// ----------------------------------------------------------------------------------------------
// TransformerDecoderBlock:
//   Y = addnorm1(X, attention1(X, X, X, causal))
//   Z = addnorm2(Y, attention2(Y, enc, enc, enc_valid_lens))
//   out = addnorm3(Z, ffn(Z))

namespace {

void check_block_args(const char* op, int64_t num_hiddens, int64_t ffn_num_hiddens,
                      int64_t num_heads, double dropout_p, DType dtype) {
  check(num_hiddens > 0 && ffn_num_hiddens > 0 && num_heads > 0, op,
        "num_hiddens ({}), ffn_num_hiddens ({}) and num_heads ({}) must be positive", num_hiddens,
        ffn_num_hiddens, num_heads);
  check(num_hiddens % num_heads == 0, op, "num_hiddens ({}) is not divisible by num_heads ({})",
        num_hiddens, num_heads);
  check(dropout_p >= 0.0 && dropout_p <= 1.0, op, "dropout probability {} is outside [0, 1]",
        dropout_p);
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} unsupported, expected F32 or F64",
        dtype_name(dtype));
}

// Runs before any member is built, so that a bad argument names the block.
double checked_block_dropout(int64_t num_hiddens, int64_t ffn_num_hiddens, int64_t num_heads,
                             double dropout_p, DType dtype) {
  check_block_args("TransformerDecoderBlock", num_hiddens, ffn_num_hiddens, num_heads, dropout_p,
                   dtype);
  return dropout_p;
}

}  // namespace

TransformerDecoderBlock::TransformerDecoderBlock(int64_t num_hiddens, int64_t ffn_num_hiddens,
                                                 int64_t num_heads, double dropout, bool use_bias,
                                                 DType dtype, uint64_t seed)
    : Module(dtype),
      attention1(num_hiddens, num_heads,
                 checked_block_dropout(num_hiddens, ffn_num_hiddens, num_heads, dropout, dtype),
                 use_bias, dtype, detail::child_seed(seed, "attention1")),
      addnorm1(num_hiddens, dropout, dtype),
      attention2(num_hiddens, num_heads, dropout, use_bias, dtype,
                 detail::child_seed(seed, "attention2")),
      addnorm2(num_hiddens, dropout, dtype),
      ffn(ffn_num_hiddens, num_hiddens, dtype, detail::child_seed(seed, "ffn")),
      addnorm3(num_hiddens, dropout, dtype) {
  const char* op = "TransformerDecoderBlock";
  // Query t sees keys 0..t: d2l's dec_valid_lens = [1, 2, ..., T] per row, as a flag (the fused
  // kernel then skips the masked half instead of scoring it). In every mode; see the header.
  attention1.attention.causal = true;
  // The block only needs dX = dQ + dK + dV of the self-attention: one GEMM on the packed
  // projection (as the encoder block).
  attention1.self_attention_input_grad = true;
  // Under autocast the sublayers' outputs and gradients stay bf16 at the seams (as the encoder
  // block; the same bits): the AddNorms widen and round them in their fused passes.
  attention1.bf16_seams = attention2.bf16_seams = true;
  addnorm1.bf16_dy = addnorm2.bf16_dy = addnorm3.bf16_dy = true;
  addnorm2.bf16_output = true;  // the FFN reads it
  // Every input of every projection is E wide, so nothing needs to stay lazy: the state dict is
  // complete from the start (d2l's LazyLinear needs one forward first).
  for (Linear* l :
       {&attention1.W_q, &attention1.W_k, &attention1.W_v, &attention1.W_o, &attention2.W_q,
        &attention2.W_k, &attention2.W_v, &attention2.W_o, &ffn.dense1})
    l->materialize(num_hiddens, op);
  ffn.dense2.materialize(ffn_num_hiddens, op);
  set_need_weights(false);
}

std::vector<std::pair<std::string, Parameter*>> TransformerDecoderBlock::named_parameters() {
  // d2l's registration order: attention1, addnorm1, attention2, addnorm2, ffn, addnorm3.
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "attention1", attention1);
  append_parameters(out, "addnorm1", addnorm1);
  append_parameters(out, "attention2", attention2);
  append_parameters(out, "addnorm2", addnorm2);
  append_parameters(out, "ffn", ffn);
  append_parameters(out, "addnorm3", addnorm3);
  return out;
}

void TransformerDecoderBlock::train(bool on) {
  Module::train(on);
  attention1.train(on);
  addnorm1.train(on);
  attention2.train(on);
  addnorm2.train(on);
  ffn.train(on);
  addnorm3.train(on);
}

void TransformerDecoderBlock::set_need_weights(bool on) {
  attention1.attention.need_weights = on;
  attention2.attention.need_weights = on;
}

Tensor TransformerDecoderBlock::forward(Context& ctx, const Tensor& X, const Tensor& enc_outputs,
                                        const Tensor& enc_valid_lens) {
  const char* op = "TransformerDecoderBlock";
  const int64_t E = num_hiddens();
  detail::check_input(op, "X", X, 3, dtype_);
  detail::check_input(op, "enc_outputs", enc_outputs, 3, dtype_);
  check(X.dim(2) == E && enc_outputs.dim(2) == E && enc_outputs.dim(0) == X.dim(0), op,
        "X {} and enc_outputs {} do not agree: expected (B, T, {}) and (B, S, {})",
        shape_arg(X.shape()), shape_arg(enc_outputs.shape()), E, E);
  // Dropout order (d2l's): attention1's weights, addnorm1, attention2's weights, addnorm2,
  // addnorm3.
  Tensor Y = addnorm1.forward(ctx, X, attention1.forward(ctx, X, X, X));
  Tensor Z = addnorm2.forward(ctx, Y,
                              attention2.forward(ctx, Y, enc_outputs, enc_outputs, enc_valid_lens));
  // Under autocast the FFN reads Z rounded to bf16, as its first Linear would round it.
  const Tensor& Z_ffn = addnorm2.output_bf16().defined() ? addnorm2.output_bf16() : Z;
  return addnorm3.forward(ctx, Z, ffn.forward(ctx, Z_ffn));
}

DecoderBlockGrads TransformerDecoderBlock::backward(Context& ctx, const Tensor& dout) {
  // forward: out = addnorm3(Z, ffn(Z)); Z reaches out through the residual and the FFN.
  const int threads = ctx.resolved_threads();
  AddNormGrads g3 = addnorm3.backward(ctx, dout);
  // dZ = g3.dX + the FFN's input gradient, summed inside addnorm2's backward pass.
  // forward: Z = addnorm2(Y, attention2(Y, enc, enc)); Y is the residual and the queries, enc the
  // keys and the values.
  AddNormGrads g2 = addnorm2.backward(ctx, g3.dX, ffn.backward(ctx, g3.dY));
  AttentionInputGrads ga2 = attention2.backward(ctx, g2.dY);
  DecoderBlockGrads g;
  g.denc_outputs = detail::add_all({ga2.dkeys, ga2.dvalues}, threads);
  // forward: Y = addnorm1(X, attention1(X, X, X)); X reaches Y four times. Its output's
  // gradient, g2.dX + ga2.dqueries, is summed inside addnorm1's backward pass.
  AddNormGrads g1 = addnorm1.backward(ctx, g2.dX, ga2.dqueries);
  AttentionInputGrads ga1 = attention1.backward(ctx, g1.dY);
  g.dX = ga1.dkeys.defined()
             ? detail::add_all({g1.dX, ga1.dqueries, ga1.dkeys, ga1.dvalues}, threads)
             : detail::add_all({g1.dX, ga1.dqueries}, threads);  // dQ + dK + dV in one
  return g;
}

// ----------------------------------------------------------------------------------------------
// TransformerDecoder: X = PE(embedding(ids) * sqrt(E)); X = block_i(X, enc, lens); dense(X)

namespace {

double checked_decoder_args(int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                            int64_t num_heads, int64_t num_blks, double dropout_p,
                            const TransformerDecoderOptions& o) {
  const char* op = "TransformerDecoder";
  check(vocab_size > 0, op, "vocab_size must be positive, got {}", vocab_size);
  check(num_blks >= 0, op, "num_blks must be >= 0, got {}", num_blks);
  check(o.max_len >= 0, op, "max_len must be >= 0, got {}", o.max_len);
  check_block_args(op, num_hiddens, ffn_num_hiddens, num_heads, dropout_p, o.dtype);
  return dropout_p;
}

}  // namespace

TransformerDecoder::TransformerDecoder(int64_t vocab_size, int64_t num_hiddens,
                                       int64_t ffn_num_hiddens, int64_t num_heads, int64_t num_blks,
                                       double dropout, bool use_bias,
                                       const TransformerDecoderOptions& options)
    : Module(options.dtype),
      embedding(vocab_size, num_hiddens, options.dtype,
                detail::child_seed(options.seed, "embedding")),
      pos_encoding(num_hiddens,
                   checked_decoder_args(vocab_size, num_hiddens, ffn_num_hiddens, num_heads,
                                        num_blks, dropout, options),
                   options.max_len, options.dtype),
      // d2l: nn.LazyLinear(vocab_size), with a bias; its input is E wide.
      dense(vocab_size, num_hiddens, true, options.dtype,
            detail::child_seed(options.seed, "dense")),
      vocab_size_(vocab_size),
      num_hiddens_(num_hiddens),
      num_heads_(num_heads) {
  for (int64_t i = 0; i < num_blks; ++i) {
    // d2l: self.blks.add_module("block" + str(i), TransformerDecoderBlock(..., i)).
    blks.push_back(std::make_unique<TransformerDecoderBlock>(
        num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias, options.dtype,
        detail::child_seed(options.seed, "block" + std::to_string(i))));
  }
}

std::vector<std::pair<std::string, Parameter*>> TransformerDecoder::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "embedding", embedding);
  for (size_t i = 0; i < blks.size(); ++i)
    append_parameters(out, "blks.block" + std::to_string(i), *blks[i]);
  append_parameters(out, "dense", dense);
  return out;
}

void TransformerDecoder::train(bool on) {
  Module::train(on);
  embedding.train(on);
  pos_encoding.train(on);
  for (auto& blk : blks)
    blk->train(on);
  dense.train(on);
}

Tensor TransformerDecoder::forward(Context& ctx, const Tensor& ids, const Tensor& enc_outputs,
                                   const Tensor& enc_valid_lens) {
  const char* op = "TransformerDecoder";
  check(ids.defined() && ids.ndim() == 2, op, "ids has shape {}, expected (B, T)", shape_arg(ids));
  detail::check_input(op, "enc_outputs", enc_outputs, 3, dtype_);
  check(enc_outputs.dim(0) == ids.dim(0) && enc_outputs.dim(2) == num_hiddens_, op,
        "enc_outputs has shape {}, expected (B, S, E) = ({}, S, {}) for ids {}",
        shape_arg(enc_outputs.shape()), ids.dim(0), num_hiddens_, shape_arg(ids.shape()));
  // d2l: self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
  Tensor X = pos_encoding.forward_scaled(ctx, embedding.forward(ctx, ids),
                                         std::sqrt(static_cast<double>(num_hiddens_)));
  for (auto& blk : blks) {
    blk->set_need_weights(need_weights);
    X = blk->forward(ctx, X, enc_outputs, enc_valid_lens);
  }
  forward_done_ = true;
  return dense.forward(ctx, X);  // (B, T, V)
}

Tensor TransformerDecoder::backward(Context& ctx, const Tensor& dlogits) {
  check(forward_done_, "TransformerDecoder::backward", "called before forward");
  // forward: logits = dense(X_L)
  Tensor dX = dense.backward(ctx, dlogits);
  // forward: X_{i+1} = block_i(X_i, enc); enc feeds every block, so its gradient is the sum.
  Tensor denc;
  for (auto it = blks.rbegin(); it != blks.rend(); ++it) {
    DecoderBlockGrads g = (*it)->backward(ctx, dX);
    dX = g.dX;
    denc = denc.defined() ? detail::add_all({denc, g.denc_outputs}, ctx.resolved_threads())
                          : g.denc_outputs;
  }
  // forward: X_0 = dropout(embedding(ids) * sqrt(E) + P)
  embedding.backward(
      ctx, pos_encoding.backward_scaled(ctx, dX, std::sqrt(static_cast<double>(num_hiddens_))));
  return denc;  // undefined without blocks: the logits do not depend on the encoder then
}

const Tensor& TransformerDecoder::self_attention_weights(int64_t i) const {
  check(i >= 0 && i < num_blks(), "TransformerDecoder::self_attention_weights",
        "block {} does not exist, the decoder has {} blocks", i, num_blks());
  return blks[static_cast<size_t>(i)]->attention1.attention_weights();
}

const Tensor& TransformerDecoder::cross_attention_weights(int64_t i) const {
  check(i >= 0 && i < num_blks(), "TransformerDecoder::cross_attention_weights",
        "block {} does not exist, the decoder has {} blocks", i, num_blks());
  return blks[static_cast<size_t>(i)]->attention2.attention_weights();
}

// ----------------------------------------------------------------------------------------------
// EncoderDecoder: logits = decoder(dec_X, encoder(enc_X, lens), lens)

namespace {

TransformerEncoderOptions encoder_options(const Seq2SeqConfig& c) {
  TransformerEncoderOptions o;
  o.positional = PositionalKind::kSinusoidal;
  o.max_len = c.max_len;
  o.dtype = c.dtype;
  o.seed = detail::child_seed(c.seed, "encoder");
  return o;
}

TransformerDecoderOptions decoder_options(const Seq2SeqConfig& c) {
  TransformerDecoderOptions o;
  o.max_len = c.max_len;
  o.dtype = c.dtype;
  o.seed = detail::child_seed(c.seed, "decoder");
  return o;
}

}  // namespace

EncoderDecoder::EncoderDecoder(const Seq2SeqConfig& c)
    : Module(c.dtype),
      encoder(c.src_vocab_size, c.num_hiddens, c.ffn_num_hiddens, c.num_heads, c.num_enc_blks,
              c.dropout, c.use_bias, encoder_options(c)),
      decoder(c.tgt_vocab_size, c.num_hiddens, c.ffn_num_hiddens, c.num_heads, c.num_dec_blks,
              c.dropout, c.use_bias, decoder_options(c)),
      config_(c) {
  set_need_weights(false);
}

std::vector<std::pair<std::string, Parameter*>> EncoderDecoder::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  append_parameters(out, "encoder", encoder);
  append_parameters(out, "decoder", decoder);
  return out;
}

void EncoderDecoder::train(bool on) {
  Module::train(on);
  encoder.train(on);
  decoder.train(on);
}

void EncoderDecoder::set_need_weights(bool on) {
  for (auto& blk : encoder.blks)
    blk->attention.attention.need_weights = on;
  decoder.need_weights = on;
}

Tensor EncoderDecoder::forward(Context& ctx, const Tensor& enc_X, const Tensor& dec_X,
                               const Tensor& enc_valid_lens) {
  const char* op = "EncoderDecoder";
  check(enc_X.defined() && dec_X.defined() && enc_X.ndim() == 2 && dec_X.ndim() == 2 &&
            enc_X.dim(0) == dec_X.dim(0),
        op, "enc_X {} and dec_X {} must be (B, S) and (B, T) token ids", shape_arg(enc_X),
        shape_arg(dec_X));
  // d2l: enc_all_outputs = self.encoder(enc_X, *args)
  //      dec_state = self.decoder.init_state(enc_all_outputs, *args)
  //      return self.decoder(dec_X, dec_state)[0]
  Tensor enc_outputs = encoder.forward(ctx, enc_X, enc_valid_lens);
  return decoder.forward(ctx, dec_X, enc_outputs, enc_valid_lens);
}

void EncoderDecoder::backward(Context& ctx, const Tensor& dlogits) {
  Tensor denc = decoder.backward(ctx, dlogits);
  if (denc.defined()) encoder.backward(ctx, denc);
}

}  // namespace attn::nn
