// Transformer decoder modules (d2l 11.7): the book's shapes, d2l's state-dict names, the causal
// mask, dropout offsets, finite-difference gradchecks in float64 of every input and parameter
// (dropout on, offsets fixed so that the masks do not move), d2l's observed logits
// (reference/semantics-seq2seq.md section 7.6), and incremental decoding with the cache against
// the whole-prefix forward.
#include "attn/nn/decoder.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

void gradcheck_parameters(Module& m, const std::function<double()>& loss, double tol = 1e-6) {
  for (auto& [name, p] : m.named_parameters()) {
    ASSERT_TRUE(p->value.defined()) << name;
    EXPECT_TRUE(gradcheck(loss, p->value, p->grad.clone(), 1e-6, tol)) << name;
  }
}

Tensor ids_tensor(const std::vector<int64_t>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape, DType::I64);
}

std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> names;
  for (auto& [name, p] : m.named_parameters())
    names.push_back(name);
  return names;
}

// ----------------------------------------------------------------------------------------------
// TransformerDecoderBlock

TEST(TransformerDecoderBlock, BookShapeAndWeights) {
  Context ctx;
  // d2l: decoder_blk = TransformerDecoderBlock(24, 48, 8, 0.5, 0)
  //      X = torch.ones((2, 100, 24)); state = [encoder_blk(X, valid_lens), valid_lens, [None]]
  //      decoder_blk(X, state)[0].shape == X.shape
  TransformerEncoderBlock enc_blk(24, 48, 8, 0.5);
  TransformerDecoderBlock blk(24, 48, 8, 0.5);
  enc_blk.eval();
  blk.eval();
  Tensor X = Tensor::full({2, 100, 24}, 1.0);
  Tensor lens = ids_tensor({3, 2}, {2});
  Tensor enc = enc_blk.forward(ctx, X, lens);
  EXPECT_EQ(blk.forward(ctx, X, enc, lens).shape(), Shape({2, 100, 24}));
  EXPECT_FALSE(blk.attention1.attention_weights().defined());  // fused path: no weights
  blk.set_need_weights(true);
  blk.forward(ctx, X, enc, lens);
  const Tensor& w1 = blk.attention1.attention_weights();
  const Tensor& w2 = blk.attention2.attention_weights();
  ASSERT_EQ(w1.shape(), Shape({16, 100, 100}));
  ASSERT_EQ(w2.shape(), Shape({16, 100, 100}));
  // Causal self-attention: row q is zero exactly past column q (d2l's dec_valid_lens [1..T]).
  for (int64_t q : {0, 1, 57, 99}) {
    for (int64_t k = 0; k < 100; ++k) {
      if (k > q) {
        EXPECT_EQ(w1.at({3, q, k}), 0.0);
      } else {
        EXPECT_GT(w1.at({3, q, k}), 0.0);
      }
    }
  }
  // Cross-attention of batch 1 (heads 8..15) keeps source keys 0, 1 only.
  EXPECT_EQ(w2.at({9, 5, 2}), 0.0);
  EXPECT_NEAR(w2.at({9, 5, 0}) + w2.at({9, 5, 1}), 1.0, 1e-6);
}

TEST(TransformerDecoderBlock, StateDictNames) {
  TransformerDecoderBlock blk(8, 16, 2, 0.1);
  std::vector<std::string> want;
  for (const char* a : {"attention1", "addnorm1", "attention2", "addnorm2", "ffn", "addnorm3"}) {
    const std::string s = a;
    if (s.rfind("attention", 0) == 0) {
      for (const char* w : {".W_q.weight", ".W_k.weight", ".W_v.weight", ".W_o.weight"})
        want.push_back(s + w);
    } else if (s == "ffn") {
      for (const char* w : {".dense1.weight", ".dense1.bias", ".dense2.weight", ".dense2.bias"})
        want.push_back(s + w);
    } else {
      want.push_back(s + ".ln.weight");
      want.push_back(s + ".ln.bias");
    }
  }
  EXPECT_EQ(names_of(blk), want);
  StateDict sd = blk.state_dict();  // complete before any forward: nothing is lazy
  EXPECT_EQ(sd.size(), 18u);
  EXPECT_EQ(sd.at("attention2.W_k.weight").shape(), Shape({8, 8}));
  EXPECT_EQ(sd.at("ffn.dense1.weight").shape(), Shape({16, 8}));
  EXPECT_EQ(sd.at("ffn.dense2.weight").shape(), Shape({8, 16}));
  EXPECT_EQ(TransformerDecoderBlock(8, 16, 2, 0.1, true).state_dict().size(), 26u);  // + 8 biases
}

// The output at position t does not depend on the inputs at positions > t, in train mode (dropout
// 0) and in eval mode (d2l drops the mask in eval; attn does not).
TEST(TransformerDecoderBlock, CausalInEveryMode) {
  Context ctx;
  TransformerDecoderBlock blk(8, 16, 2, 0.0, false, DType::F64, 4);
  Tensor X = random_tensor({2, 5, 8}, DType::F64, 1), enc = random_tensor({2, 3, 8}, DType::F64, 2);
  Tensor lens = ids_tensor({3, 1}, {2});
  for (bool training : {true, false}) {
    blk.train(training);
    Tensor a = blk.forward(ctx, X, enc, lens);
    Tensor X2 = X.clone();
    for (int64_t e = 0; e < 8; ++e)
      X2.set({1, 3, e}, 5.0 + e);
    Tensor b = blk.forward(ctx, X2, enc, lens);
    EXPECT_TRUE(close(a.slice(1, 0, 3), b.slice(1, 0, 3), 0, 0));
    EXPECT_FALSE(close(a.slice(1, 3, 5), b.slice(1, 3, 5), 0, 1e-6));
  }
}

TEST(TransformerDecoderBlock, GradcheckWithDropoutAndEncValidLens) {
  Context ctx;
  ctx.seed = 11;
  TransformerDecoderBlock blk(4, 6, 2, 0.3, /*use_bias=*/true, DType::F64, 3);
  Tensor X = random_tensor({2, 3, 4}, DType::F64, 1), enc = random_tensor({2, 4, 4}, DType::F64, 2);
  Tensor w = random_tensor({2, 3, 4}, DType::F64, 3);
  for (const Tensor& lens :
       {Tensor(), ids_tensor({2, 4}, {2}), ids_tensor({1, 2, 3, 4, 0, 2}, {2, 3})}) {
    auto loss = [&] {
      ctx.set_dropout_offset(0);
      return dot(blk.forward(ctx, X, enc, lens), w);
    };
    loss();
    EXPECT_EQ(ctx.dropout_offset(), 5u);  // weights, addnorm1, weights, addnorm2, addnorm3
    blk.zero_grad();
    DecoderBlockGrads g = blk.backward(ctx, w);
    EXPECT_TRUE(gradcheck(loss, X, g.dX));
    EXPECT_TRUE(gradcheck(loss, enc, g.denc_outputs));
    gradcheck_parameters(blk, loss);
  }
}

// ----------------------------------------------------------------------------------------------
// TransformerDecoder

TEST(TransformerDecoder, StateDictNamesAndShapes) {
  Context ctx;
  TransformerDecoder dec(200, 24, 48, 8, 2, 0.5);
  std::vector<std::string> names = names_of(dec);
  ASSERT_EQ(names.size(), 39u);  // 18 per block + 3
  EXPECT_EQ(names.front(), "embedding.weight");
  EXPECT_EQ(names[1], "blks.block0.attention1.W_q.weight");
  EXPECT_EQ(names[19], "blks.block1.attention1.W_q.weight");
  EXPECT_EQ(names[37], "dense.weight");
  EXPECT_EQ(names[38], "dense.bias");
  StateDict sd = dec.state_dict();
  EXPECT_EQ(sd.at("embedding.weight").shape(), Shape({200, 24}));
  EXPECT_EQ(sd.at("dense.weight").shape(), Shape({200, 24}));
  EXPECT_EQ(sd.at("blks.block1.addnorm3.ln.bias").shape(), Shape({24}));

  dec.eval();
  Tensor ids = ids_tensor({1, 5, 7, 199, 0, 3}, {2, 3});
  Tensor enc = random_tensor({2, 4, 24}, DType::F32, 1);
  Tensor lens = ids_tensor({4, 2}, {2});
  Tensor logits = dec.forward(ctx, ids, enc, lens);
  EXPECT_EQ(logits.shape(), Shape({2, 3, 200}));
  EXPECT_FALSE(dec.self_attention_weights(0).defined());  // kept only with need_weights
  dec.need_weights = true;
  EXPECT_TRUE(close(dec.forward(ctx, ids, enc, lens), logits, 1e-5, 1e-5));
  EXPECT_EQ(dec.self_attention_weights(1).shape(), Shape({16, 3, 3}));
  EXPECT_EQ(dec.cross_attention_weights(0).shape(), Shape({16, 3, 4}));
  EXPECT_THROW(dec.cross_attention_weights(2), Error);

  // Another decoder loading this dict computes the same function.
  TransformerDecoder other(200, 24, 48, 8, 2, 0.5, false, {1000, DType::F32, 99});
  other.eval();
  EXPECT_FALSE(close(other.forward(ctx, ids, enc, lens), logits, 0, 1e-3));
  other.load_state_dict(sd);
  EXPECT_TRUE(close(other.forward(ctx, ids, enc, lens), logits, 0, 0));

  EXPECT_THROW(dec.forward(ctx, ids, random_tensor({2, 4, 8}, DType::F32, 1)), Error);
  EXPECT_THROW(dec.forward(ctx, ids, random_tensor({3, 4, 24}, DType::F32, 1)), Error);
  EXPECT_THROW(TransformerDecoder(10, 6, 8, 4, 1, 0.0), Error);  // 6 % 4 != 0
}

TEST(TransformerDecoder, DropoutOffsetsAndDeterminism) {
  Context ctx;
  ctx.seed = 2;
  TransformerDecoder dec(10, 8, 16, 2, 2, 0.2);
  Tensor ids = ids_tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor enc = random_tensor({2, 4, 8}, DType::F32, 1);
  Tensor a = dec.forward(ctx, ids, enc);
  EXPECT_EQ(ctx.dropout_offset(), 11u);  // PE sum + 2 blocks x 5 sites
  ctx.set_dropout_offset(0);
  EXPECT_TRUE(close(dec.forward(ctx, ids, enc), a, 0, 0));      // same offsets, same masks
  EXPECT_FALSE(close(dec.forward(ctx, ids, enc), a, 0, 1e-6));  // fresh offsets, new masks
  dec.eval();
  const uint64_t before = ctx.dropout_offset();
  Tensor e1 = dec.forward(ctx, ids, enc), e2 = dec.forward(ctx, ids, enc);
  EXPECT_EQ(ctx.dropout_offset(), before);
  EXPECT_TRUE(close(e1, e2, 0, 0));
}

void decoder_gradcheck(const Tensor& lens, int64_t num_blks) {
  Context ctx;
  ctx.seed = 3;
  TransformerDecoder dec(7, 4, 6, 2, num_blks, 0.2, false, {8, DType::F64, 17});
  Tensor ids = ids_tensor({1, 6, 3, 0, 2, 2}, {2, 3});
  Tensor enc = random_tensor({2, 4, 4}, DType::F64, 4);
  Tensor w = random_tensor({2, 3, 7}, DType::F64, 5);
  auto loss = [&] {
    ctx.set_dropout_offset(0);
    return dot(dec.forward(ctx, ids, enc, lens), w);
  };
  loss();
  dec.zero_grad();
  Tensor denc = dec.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, enc, denc));
  gradcheck_parameters(dec, loss);
}

TEST(TransformerDecoder, GradcheckEveryParameterAndEncOutputs) {
  decoder_gradcheck(Tensor(), 1);
  decoder_gradcheck(ids_tensor({3, 1}, {2}), 2);
}

// reference/semantics-seq2seq.md section 7.6, observed on d2l's decoder (torch 1.13, float32):
// V=5, d=4, ffn=8, H=2, one block, dropout 0; weight j of the state_dict order, flat index i,
// = float32(0.5 sin(0.7 i + 1.3 j)); enc_outputs[0, k, c] = float32(cos(0.3 (4k + c))), S = 3,
// enc_valid_lens [2], tokens [[1, 4, 2]]. d2l's train-mode forward is the causal computation
// attn runs in every mode; d2l's incremental prediction adds P[0] at each step, attn P[t], which
// makes it equal the train-mode forward (the first step agrees with d2l either way).
TEST(TransformerDecoder, MatchesD2lObservedLogits) {
  Context ctx;
  TransformerDecoder dec(5, 4, 8, 2, 1, 0.0);
  int64_t j = 0;
  for (auto& [name, p] : dec.named_parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i)
      p->value.set_flat(i, static_cast<float>(0.5 * std::sin(0.7 * i + 1.3 * j)));
    ++j;
  }
  Tensor enc = Tensor::empty({1, 3, 4});
  for (int64_t i = 0; i < 12; ++i)
    enc.set_flat(i, static_cast<float>(std::cos(0.3 * i)));
  Tensor lens = ids_tensor({2}, {1});
  Tensor ids = ids_tensor({1, 4, 2}, {1, 3});
  const Tensor want =
      Tensor::from_vector(std::vector<double>{0.826931, -0.099718, 1.068036, -0.603420, 0.365170,
                                              0.751364, 0.007095, 0.942319, -0.473325, 0.245731,
                                              0.725527, 0.038605, 0.908778, -0.441630, 0.219544},
                          {1, 3, 5});
  for (bool training : {true, false}) {
    dec.train(training);
    EXPECT_TRUE(close(dec.forward(ctx, ids, enc, lens), want, 0, 1e-5));
  }
  DecoderState state = dec.init_state(ctx, enc, lens);
  Tensor steps = Tensor::empty({1, 3, 5});
  for (int64_t t = 0; t < 3; ++t)
    steps.slice(1, t, t + 1).copy_from(dec.step(ctx, ids.slice(1, t, t + 1).contiguous(), state));
  EXPECT_TRUE(close(steps, want, 0, 1e-5));
}

// ----------------------------------------------------------------------------------------------
// EncoderDecoder

TEST(EncoderDecoder, StateDictNamesAndGradcheck) {
  {
    // d2l: 64 keys for 2 + 2 blocks.
    Seq2SeqConfig c;
    c.src_vocab_size = c.tgt_vocab_size = 5;
    c.num_hiddens = 4;
    c.ffn_num_hiddens = 6;
    c.num_heads = 2;
    EncoderDecoder model(c);
    std::vector<std::string> names = names_of(model);
    ASSERT_EQ(names.size(), 64u);
    EXPECT_EQ(names.front(), "encoder.embedding.weight");
    EXPECT_EQ(names[1], "encoder.blks.block0.attention.W_q.weight");
    EXPECT_EQ(names[25], "decoder.embedding.weight");
    EXPECT_EQ(names[26], "decoder.blks.block0.attention1.W_q.weight");
    EXPECT_EQ(names.back(), "decoder.dense.bias");
  }
  // The gradcheck on one block each (every path is there: the encoder's output feeds every
  // decoder block's keys and values).
  Seq2SeqConfig c;
  c.src_vocab_size = 6;
  c.tgt_vocab_size = 5;
  c.num_hiddens = 4;
  c.ffn_num_hiddens = 6;
  c.num_heads = 2;
  c.num_enc_blks = 1;
  c.num_dec_blks = 1;
  c.dropout = 0.2;
  c.dtype = DType::F64;
  c.seed = 5;
  EncoderDecoder model(c);
  Context ctx;
  ctx.seed = 9;
  Tensor src = ids_tensor({1, 5, 3, 2, 0, 4, 4, 1}, {2, 4});
  Tensor lens = ids_tensor({4, 2}, {2});
  Tensor tgt = ids_tensor({1, 2, 3, 4, 0, 1}, {2, 3});
  Tensor w = random_tensor({2, 3, 5}, DType::F64, 3);
  auto loss = [&] {
    ctx.set_dropout_offset(0);
    return dot(model.forward(ctx, src, tgt, lens), w);
  };
  loss();
  model.zero_grad();
  model.backward(ctx, w);
  gradcheck_parameters(model, loss);

  // A fresh model (other seed) loading the dict computes the same logits.
  Seq2SeqConfig c2 = c;
  c2.seed = 77;
  EncoderDecoder other(c2);
  model.eval();
  other.eval();
  Tensor want = model.forward(ctx, src, tgt, lens);
  EXPECT_FALSE(close(other.forward(ctx, src, tgt, lens), want, 0, 1e-6));
  other.load_state_dict(model.state_dict());
  EXPECT_TRUE(close(other.forward(ctx, src, tgt, lens), want, 0, 0));
}

}  // namespace
}  // namespace attn::nn
