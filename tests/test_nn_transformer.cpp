// Transformer encoder modules (d2l 11.7): the book's sanity checks, d2l's state-dict names,
// dropout offsets, and finite-difference gradchecks in float64 of every input and parameter
// (dropout on, with the stream offsets fixed so that the masks do not move).
#include "attn/nn/transformer.hpp"
#include "attn/ops/layer_norm.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

// Gradchecks every parameter of `m`: p.grad must already hold d loss / d p (from one backward
// after zero_grad). `loss` must reset the dropout offsets itself.
void gradcheck_parameters(Module& m, const std::function<double()>& loss, double tol = 1e-6) {
  for (auto& [name, p] : m.named_parameters()) {
    ASSERT_TRUE(p->value.defined()) << name;
    EXPECT_TRUE(gradcheck(loss, p->value, p->grad.clone(), 1e-6, tol)) << name;
  }
}

Tensor ids_tensor(const std::vector<int64_t>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape, DType::I64);
}

// ----------------------------------------------------------------------------------------------
// Layers

TEST(TransformerLayers, EmbeddingInitLookupAndBackward) {
  Context ctx;
  Embedding emb(50, 40, DType::F64, 7);
  // N(0, 1): mean and variance of 2000 draws within a few standard errors.
  double m = 0, v = 0;
  for (double x : emb.weight.value.to_vector())
    m += x / 2000;
  for (double x : emb.weight.value.to_vector())
    v += (x - m) * (x - m) / 2000;
  EXPECT_NEAR(m, 0.0, 0.1);
  EXPECT_NEAR(v, 1.0, 0.15);
  Tensor ids = ids_tensor({3, 3, 49, 0}, {2, 2});
  Tensor out = emb.forward(ctx, ids);
  EXPECT_EQ(out.shape(), Shape({2, 2, 40}));
  EXPECT_EQ(out.at({1, 0, 5}), emb.weight.value.at({49, 5}));
  Tensor w = random_tensor({2, 2, 40}, DType::F64, 3);
  emb.zero_grad();
  emb.backward(ctx, w);
  gradcheck_parameters(emb, [&] { return dot(emb.forward(ctx, ids), w); });
  EXPECT_THROW(emb.forward(ctx, ids_tensor({50}, {1})), Error);  // id == V
  EXPECT_THROW(Embedding(0, 4), Error);
  EXPECT_EQ(emb.state_dict().count("weight"), 1u);
}

TEST(TransformerLayers, LayerNormBookExampleAndGradcheck) {
  Context ctx;
  LayerNorm ln(2);
  Tensor out =
      ln.forward(ctx, Tensor::from_vector(std::vector<double>{1, 2, 2, 3}, {2, 2}, DType::F32));
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_NEAR(out.flat(i), i % 2 ? 0.99998 : -0.99998, 1e-5);
  EXPECT_EQ(ln.state_dict().size(), 2u);

  LayerNorm ln64(5, 1e-5, DType::F64);
  ln64.weight.value.copy_from(random_tensor({5}, DType::F64, 1));
  ln64.bias.value.copy_from(random_tensor({5}, DType::F64, 2));
  Tensor X = random_tensor({2, 3, 5}, DType::F64, 3), w = random_tensor({2, 3, 5}, DType::F64, 4);
  auto loss = [&] { return dot(ln64.forward(ctx, X), w); };
  loss();
  ln64.zero_grad();
  Tensor dX = ln64.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, X, dX));
  gradcheck_parameters(ln64, loss);
}

TEST(TransformerLayers, PositionWiseFFNBookShapeAndGradcheck) {
  Context ctx;
  // d2l: ffn = PositionWiseFFN(4, 8); ffn(torch.ones((2, 3, 4))).shape == (2, 3, 8)
  PositionWiseFFN ffn(4, 8);
  EXPECT_EQ(ffn.forward(ctx, Tensor::full({2, 3, 4}, 1.0)).shape(), Shape({2, 3, 8}));
  auto sd = ffn.state_dict();
  EXPECT_EQ(sd.at("dense1.weight").shape(), Shape({4, 4}));
  EXPECT_EQ(sd.at("dense1.bias").shape(), Shape({4}));
  EXPECT_EQ(sd.at("dense2.weight").shape(), Shape({8, 4}));
  EXPECT_EQ(sd.at("dense2.bias").shape(), Shape({8}));

  PositionWiseFFN f64(6, 3, DType::F64, 5);
  Tensor X = random_tensor({2, 4, 3}, DType::F64, 6), w = random_tensor({2, 4, 3}, DType::F64, 7);
  auto loss = [&] { return dot(f64.forward(ctx, X), w); };
  loss();
  f64.zero_grad();
  Tensor dX = f64.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, X, dX));
  gradcheck_parameters(f64, loss);
}

TEST(TransformerLayers, AddNormEvalTrainAndGradcheck) {
  Context ctx;
  ctx.seed = 5;
  AddNorm an(4, 0.5, DType::F64);
  Tensor X = random_tensor({2, 3, 4}, DType::F64, 1), Y = random_tensor({2, 3, 4}, DType::F64, 2);
  an.eval();
  // eval: ln(Y + X) exactly
  Tensor sum = X.clone();
  for (int64_t i = 0; i < sum.numel(); ++i)
    sum.set_flat(i, X.flat(i) + Y.flat(i));
  EXPECT_TRUE(close(an.forward(ctx, X, Y), layer_norm(ctx, sum).y, 0, 1e-14));
  EXPECT_EQ(ctx.dropout_offset(), 0u);
  // train: ln(dropout(Y) + X) with the dropout stream at offset 0, one offset per forward.
  an.train();
  ctx.set_dropout_offset(0);
  Tensor out = an.forward(ctx, X, Y);
  EXPECT_EQ(ctx.dropout_offset(), 1u);
  Tensor Yd = attn::dropout(Y, 0.5, ctx.seed, 0);
  for (int64_t i = 0; i < sum.numel(); ++i)
    sum.set_flat(i, X.flat(i) + Yd.flat(i));
  EXPECT_TRUE(close(out, layer_norm(ctx, sum).y, 0, 1e-14));

  Tensor w = random_tensor({2, 3, 4}, DType::F64, 3);
  auto loss = [&] {
    ctx.set_dropout_offset(0);
    return dot(an.forward(ctx, X, Y), w);
  };
  loss();
  an.zero_grad();
  AddNormGrads g = an.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, X, g.dX));
  EXPECT_TRUE(gradcheck(loss, Y, g.dY));
  gradcheck_parameters(an, loss);
  EXPECT_EQ(an.state_dict().count("ln.weight"), 1u);
}

// ----------------------------------------------------------------------------------------------
// Encoder block and encoder

TEST(TransformerEncoderBlock, BookShape) {
  Context ctx;
  // d2l: X = torch.ones((2, 100, 24)); valid_lens = torch.tensor([3, 2])
  //      encoder_blk = TransformerEncoderBlock(24, 48, 8, 0.5); encoder_blk.eval()
  TransformerEncoderBlock blk(24, 48, 8, 0.5);
  blk.eval();
  Tensor out = blk.forward(ctx, Tensor::full({2, 100, 24}, 1.0),
                           Tensor::from_vector(std::vector<int64_t>{3, 2}, {2}));
  EXPECT_EQ(out.shape(), Shape({2, 100, 24}));
  EXPECT_EQ(blk.attention.attention_weights().shape(), Shape({16, 100, 100}));
  // Every row is LayerNorm'ed: mean 0 over E (weight 1, bias 0).
  double m = 0;
  for (int64_t e = 0; e < 24; ++e)
    m += out.at({1, 50, e});
  EXPECT_NEAR(m, 0.0, 1e-4);
}

TEST(TransformerEncoderBlock, GradcheckWithDropoutAndValidLens) {
  Context ctx;
  ctx.seed = 11;
  TransformerEncoderBlock blk(4, 6, 2, 0.3, /*use_bias=*/true, DType::F64, 3);
  Tensor X = random_tensor({2, 3, 4}, DType::F64, 1), w = random_tensor({2, 3, 4}, DType::F64, 2);
  for (const Tensor& lens : {Tensor::from_vector(std::vector<int64_t>{2, 3}, {2}),
                             Tensor::from_vector(std::vector<int64_t>{1, 2, 3, 3, 1, 2}, {2, 3})}) {
    auto loss = [&] {
      ctx.set_dropout_offset(0);
      return dot(blk.forward(ctx, X, lens), w);
    };
    loss();
    EXPECT_EQ(ctx.dropout_offset(), 3u);  // attention weights, addnorm1, addnorm2
    blk.zero_grad();
    Tensor dX = blk.backward(ctx, w);
    EXPECT_TRUE(gradcheck(loss, X, dX));
    gradcheck_parameters(blk, loss);
  }
}

TEST(TransformerEncoder, BookShapeAndStateDictNames) {
  Context ctx;
  // d2l: encoder = TransformerEncoder(200, 24, 48, 8, 2, 0.5); encoder.eval()
  //      encoder(torch.ones((2, 100), dtype=torch.long), valid_lens).shape == (2, 100, 24)
  TransformerEncoder enc(200, 24, 48, 8, 2, 0.5);
  enc.eval();
  Tensor ids = Tensor::full({2, 100}, 1.0, DType::I64);
  Tensor out = enc.forward(ctx, ids, Tensor::from_vector(std::vector<int64_t>{3, 2}, {2}));
  EXPECT_EQ(out.shape(), Shape({2, 100, 24}));
  EXPECT_EQ(enc.attention_weights(1).shape(), Shape({16, 100, 100}));
  EXPECT_THROW(enc.attention_weights(2), Error);

  std::vector<std::string> names;
  for (auto& [name, p] : enc.named_parameters())
    names.push_back(name);
  std::vector<std::string> want = {"embedding.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string b = "blks.block" + std::to_string(i) + ".";
    for (const char* s : {"attention.W_q.weight", "attention.W_k.weight", "attention.W_v.weight",
                          "attention.W_o.weight", "addnorm1.ln.weight", "addnorm1.ln.bias",
                          "ffn.dense1.weight", "ffn.dense1.bias", "ffn.dense2.weight",
                          "ffn.dense2.bias", "addnorm2.ln.weight", "addnorm2.ln.bias"})
      want.push_back(b + s);
  }
  EXPECT_EQ(names, want);
  StateDict sd = enc.state_dict();
  EXPECT_EQ(sd.size(), 25u);
  EXPECT_EQ(sd.at("embedding.weight").shape(), Shape({200, 24}));
  EXPECT_EQ(sd.at("blks.block1.attention.W_q.weight").shape(), Shape({24, 24}));
  EXPECT_EQ(sd.at("blks.block0.ffn.dense1.weight").shape(), Shape({48, 24}));
  EXPECT_EQ(sd.at("blks.block0.ffn.dense1.bias").shape(), Shape({48}));
  EXPECT_EQ(sd.at("blks.block0.ffn.dense2.weight").shape(), Shape({24, 48}));
  EXPECT_EQ(sd.at("blks.block1.addnorm2.ln.bias").shape(), Shape({24}));

  // A second encoder loading this dict computes the same function.
  TransformerEncoder other(200, 24, 48, 8, 2, 0.5, false,
                           {PositionalKind::kSinusoidal, 1000, DType::F32, 99});
  other.eval();
  Tensor small = ids_tensor({1, 5, 7, 199}, {1, 4});
  other.forward(ctx, small);  // materialise the lazy layers
  EXPECT_FALSE(close(other.forward(ctx, small), enc.forward(ctx, small), 0, 1e-3));
  other.load_state_dict(sd);
  EXPECT_TRUE(close(other.forward(ctx, small), enc.forward(ctx, small), 0, 0));
}

TEST(TransformerEncoder, DropoutTakesOneOffsetPerSite) {
  Context ctx;
  TransformerEncoder enc(10, 8, 16, 2, 2, 0.1);
  Tensor ids = ids_tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  enc.forward(ctx, ids);
  EXPECT_EQ(ctx.dropout_offset(), 7u);  // PE sum + 2 blocks x (weights, addnorm1, addnorm2)
  enc.eval();
  enc.forward(ctx, ids);
  EXPECT_EQ(ctx.dropout_offset(), 7u);
  // Two training forwards differ (fresh masks); eval is deterministic.
  enc.train();
  Tensor a = enc.forward(ctx, ids), b = enc.forward(ctx, ids);
  EXPECT_FALSE(close(a, b, 0, 1e-6));
}

// The full encoder, 2 blocks, dropout on, every parameter, for each positional kind available
// and both valid_lens layouts.
void encoder_gradcheck(PositionalKind kind, const Tensor& lens,
                       RotaryPairing pairing = RotaryPairing::kAdjacent) {
  Context ctx;
  ctx.seed = 3;
  TransformerEncoderOptions o;
  o.positional = kind;
  o.rotary_pairing = pairing;
  o.max_len = 8;
  o.dtype = DType::F64;
  o.seed = 17;
  TransformerEncoder enc(7, 4, 6, 2, 2, 0.2, false, o);
  Tensor ids = ids_tensor({1, 6, 3, 0, 2, 2}, {2, 3});
  Tensor w = random_tensor({2, 3, 4}, DType::F64, 5);
  auto loss = [&] {
    ctx.set_dropout_offset(0);
    return dot(enc.forward(ctx, ids, lens), w);
  };
  loss();
  enc.zero_grad();
  enc.backward(ctx, w);
  gradcheck_parameters(enc, loss);
}

TEST(TransformerEncoder, GradcheckEveryParameter1DValidLens) {
  encoder_gradcheck(PositionalKind::kSinusoidal, ids_tensor({2, 3}, {2}));
}

TEST(TransformerEncoder, GradcheckEveryParameter2DValidLens) {
  encoder_gradcheck(PositionalKind::kSinusoidal, ids_tensor({1, 2, 3, 3, 2, 1}, {2, 3}));
}

TEST(TransformerEncoder, GradcheckOtherPositionalKinds) {
  for (PositionalKind k : {PositionalKind::kNone, PositionalKind::kLearned, PositionalKind::kRotary,
                           PositionalKind::kAlibi}) {
    SCOPED_TRACE(positional_kind_name(k));
    encoder_gradcheck(k, ids_tensor({2, 3}, {2}));
    encoder_gradcheck(k, ids_tensor({1, 2, 3, 3, 2, 1}, {2, 3}));
  }
  encoder_gradcheck(PositionalKind::kRotary, ids_tensor({3, 2}, {2}), RotaryPairing::kHalves);
}

// Without any position signal the encoder is permutation-equivariant: permuting the tokens
// permutes the outputs. Every position signal breaks that. Symmetric ALiBi (|t - s|) cannot tell
// a sequence from its reverse, and neither can no signal at all; the others can.
TEST(TransformerEncoder, PositionSignalsBreakPermutationSymmetry) {
  Context ctx;
  const std::vector<int64_t> tokens = {1, 2, 3, 4}, perm = {2, 0, 3, 1};
  std::vector<int64_t> permuted(4), reversed(4);
  for (int64_t t = 0; t < 4; ++t) {
    permuted[t] = tokens[perm[t]];
    reversed[t] = tokens[3 - t];
  }
  // max over (t, e) of |out(ids)[src(t)] - out(other)[t]|
  auto mismatch = [](const Tensor& a, const Tensor& b, const std::vector<int64_t>& src) {
    double diff = 0;
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t e = 0; e < 8; ++e)
        diff = std::max(diff, std::abs(a.at({0, src[t], e}) - b.at({0, t, e})));
    return diff;
  };
  for (PositionalKind k :
       {PositionalKind::kNone, PositionalKind::kSinusoidal, PositionalKind::kLearned,
        PositionalKind::kRotary, PositionalKind::kAlibi}) {
    SCOPED_TRACE(positional_kind_name(k));
    TransformerEncoderOptions o;
    o.positional = k;
    o.dtype = DType::F64;
    o.max_len = 8;
    TransformerEncoder enc(6, 8, 16, 2, 2, 0.0, false, o);
    enc.eval();
    Tensor a = enc.forward(ctx, ids_tensor(tokens, {1, 4}));
    const double d_perm = mismatch(a, enc.forward(ctx, ids_tensor(permuted, {1, 4})), perm);
    const double d_rev = mismatch(a, enc.forward(ctx, ids_tensor(reversed, {1, 4})), {3, 2, 1, 0});
    if (k == PositionalKind::kNone) {
      EXPECT_LT(d_perm, 1e-12);
    } else {
      EXPECT_GT(d_perm, 1e-3);
    }
    if (k == PositionalKind::kNone || k == PositionalKind::kAlibi) {
      EXPECT_LT(d_rev, 1e-12);
    } else {
      EXPECT_GT(d_rev, 1e-3);
    }
  }
  TransformerEncoderOptions odd;
  odd.positional = PositionalKind::kRotary;
  EXPECT_THROW(TransformerEncoder(6, 6, 8, 2, 1, 0.0, false, odd), Error);  // head width 3
}

TEST(TransformerEncoder, LearnedTableNameAndKinds) {
  TransformerEncoderOptions o;
  o.positional = PositionalKind::kLearned;
  o.max_len = 16;
  TransformerEncoder enc(10, 8, 16, 2, 1, 0.0, false, o);
  EXPECT_EQ(enc.state_dict().at("pos_encoding.weight").shape(), Shape({16, 8}));
  Context ctx;
  EXPECT_THROW(enc.forward(ctx, Tensor::zeros({1, 17}, DType::I64)), Error);  // beyond max_len
  EXPECT_EQ(parse_positional_kind("rope"), PositionalKind::kRotary);
  EXPECT_EQ(parse_positional_kind("none"), PositionalKind::kNone);
  EXPECT_THROW(parse_positional_kind("absolute"), Error);
  for (PositionalKind k :
       {PositionalKind::kNone, PositionalKind::kSinusoidal, PositionalKind::kLearned,
        PositionalKind::kRotary, PositionalKind::kAlibi})
    EXPECT_EQ(parse_positional_kind(positional_kind_name(k)), k);
}

TEST(TransformerEncoder, Float32AgreesWithFloat64) {
  Context ctx;
  TransformerEncoderOptions o;
  o.dtype = DType::F64;
  TransformerEncoder e64(20, 8, 16, 2, 2, 0.0, false, o);
  Tensor ids = ids_tensor({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  Tensor lens = ids_tensor({4, 2}, {2});
  Tensor out64 = e64.forward(ctx, ids, lens);
  TransformerEncoder e32(20, 8, 16, 2, 2, 0.0);
  e32.load_state_dict(e64.state_dict());
  EXPECT_TRUE(close(e32.forward(ctx, ids, lens), out64, 0, 2e-5));
}

TEST(TransformerEncoder, BadArguments) {
  EXPECT_THROW(TransformerEncoder(10, 6, 8, 4, 1, 0.1), Error);  // 6 % 4
  EXPECT_THROW(TransformerEncoder(0, 8, 8, 2, 1, 0.1), Error);
  EXPECT_THROW(TransformerEncoder(10, 8, 8, 2, 1, 1.5), Error);
  TransformerEncoder enc(10, 8, 8, 2, 1, 0.1);
  Context ctx;
  EXPECT_THROW(enc.forward(ctx, Tensor::zeros({2, 3, 1}, DType::I64)), Error);  // not (B, T)
  EXPECT_THROW(enc.forward(ctx, Tensor::zeros({2, 3}, DType::F32)), Error);     // float ids
  EXPECT_THROW(enc.forward(ctx, Tensor::zeros({2, 3}, DType::I64), ids_tensor({1, 2, 3}, {3})),
               Error);  // valid_lens (3) for B = 2
}

// ----------------------------------------------------------------------------------------------
// Heads

TEST(Heads, ClassificationPoolsValidPositions) {
  Context ctx;
  ClassificationHead head(3, 4, DType::F64, 2);
  Tensor X = random_tensor({2, 5, 4}, DType::F64, 1);
  Tensor lens = Tensor::from_vector(std::vector<double>{2.5, 0.0}, {2}, DType::F64);
  Tensor logits = head.forward(ctx, X, lens);
  ASSERT_EQ(logits.shape(), Shape({2, 3}));
  // Row 0 averages positions 0..2 (2.5 keeps t < 2.5); row 1 keeps nothing: logits = bias.
  for (int64_t c = 0; c < 3; ++c) {
    double want = head.dense.bias.value.flat(c);
    for (int64_t e = 0; e < 4; ++e)
      want += head.dense.weight.value.at({c, e}) *
              (X.at({0, 0, e}) + X.at({0, 1, e}) + X.at({0, 2, e})) / 3;
    EXPECT_NEAR(logits.at({0, c}), want, 1e-14);
    EXPECT_NEAR(logits.at({1, c}), head.dense.bias.value.flat(c), 1e-15);
  }
  Tensor w = random_tensor({2, 3}, DType::F64, 3);
  auto loss = [&] { return dot(head.forward(ctx, X, lens), w); };
  loss();
  head.zero_grad();
  Tensor dX = head.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, X, dX));
  gradcheck_parameters(head, loss);
  EXPECT_EQ(dX.at({0, 4, 0}), 0.0);  // padding gets no gradient
  // No valid_lens: all T positions.
  auto loss_all = [&] { return dot(head.forward(ctx, X), w); };
  loss_all();
  EXPECT_TRUE(gradcheck(loss_all, X, head.backward(ctx, w)));
  EXPECT_THROW(head.forward(ctx, X, ids_tensor({1}, {1})), Error);
  EXPECT_EQ(head.state_dict().size(), 2u);
}

TEST(Heads, TaggingIsPerPosition) {
  Context ctx;
  TaggingHead head(5, 0, DType::F64, 4);  // lazy
  Tensor X = random_tensor({2, 3, 4}, DType::F64, 1);
  Tensor w = random_tensor({2, 3, 5}, DType::F64, 2);
  auto loss = [&] { return dot(head.forward(ctx, X), w); };
  EXPECT_EQ(head.forward(ctx, X).shape(), Shape({2, 3, 5}));
  head.zero_grad();
  Tensor dX = head.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, X, dX));
  gradcheck_parameters(head, loss);
}

}  // namespace
}  // namespace attn::nn
