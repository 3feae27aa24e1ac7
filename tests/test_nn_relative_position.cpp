// Relative position signals: RoPE (both pairings) and ALiBi. The rotation against a hand-built
// case, RoPE's relative property (q_t . k_s depends only on t - s), the inverse rotation as the
// gradient (finite differences), ALiBi's slopes against the paper's rule.
#include "attn/nn/attention.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/masked_softmax.hpp"
#include "attn/ops/relative_position.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace attn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

RotaryOptions pairing(RotaryPairing p) {
  RotaryOptions o;
  o.pairing = p;
  return o;
}

TEST(Rotary, HandBuiltRotationBothPairings) {
  Context ctx;
  // D = 4: theta_0 = 1, theta_1 = 10000^(-1/2) = 0.01. Position 3 (row t = 3).
  Tensor x = Tensor::zeros({1, 4, 4}, DType::F64);
  const std::vector<double> v = {1.0, 2.0, 3.0, 4.0};
  for (int64_t d = 0; d < 4; ++d)
    x.set({0, 3, d}, v[d]);
  const double c0 = std::cos(3.0), s0 = std::sin(3.0), c1 = std::cos(0.03), s1 = std::sin(0.03);
  // adjacent: pairs (0, 1) at theta_0 and (2, 3) at theta_1
  Tensor ya = rotary_embedding(ctx, x, pairing(RotaryPairing::kAdjacent));
  EXPECT_NEAR(ya.at({0, 3, 0}), 1 * c0 - 2 * s0, 1e-15);
  EXPECT_NEAR(ya.at({0, 3, 1}), 1 * s0 + 2 * c0, 1e-15);
  EXPECT_NEAR(ya.at({0, 3, 2}), 3 * c1 - 4 * s1, 1e-15);
  EXPECT_NEAR(ya.at({0, 3, 3}), 3 * s1 + 4 * c1, 1e-15);
  // halves: pairs (0, 2) at theta_0 and (1, 3) at theta_1
  Tensor yh = rotary_embedding(ctx, x, pairing(RotaryPairing::kHalves));
  EXPECT_NEAR(yh.at({0, 3, 0}), 1 * c0 - 3 * s0, 1e-15);
  EXPECT_NEAR(yh.at({0, 3, 2}), 1 * s0 + 3 * c0, 1e-15);
  EXPECT_NEAR(yh.at({0, 3, 1}), 2 * c1 - 4 * s1, 1e-15);
  EXPECT_NEAR(yh.at({0, 3, 3}), 2 * s1 + 4 * c1, 1e-15);
  // Position 0 is the identity; an offset shifts positions.
  Tensor x0 = random_tensor({2, 1, 6}, DType::F64, 3);
  EXPECT_TRUE(close(rotary_embedding(ctx, x0), x0, 0, 0));
  RotaryOptions off;
  off.position_offset = 3;
  // Equal rows at every position: with offset 3, row 0 is rotated as row 3 is without.
  Tensor same = Tensor::zeros({1, 4, 4}, DType::F64);
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t d = 0; d < 4; ++d)
      same.set({0, t, d}, v[d]);
  EXPECT_TRUE(close(rotary_embedding(ctx, same, off).slice(1, 0, 1),
                    rotary_embedding(ctx, same).slice(1, 3, 4), 0, 1e-15));
}

// RoPE's point: after rotating queries and keys by their positions, q_t . k_s depends only on
// t - s. Put the same q at every position and the same k at every position; then every pair
// (t, s) with equal t - s gives the same dot product, and different offsets differ.
TEST(Rotary, DotProductDependsOnlyOnRelativePosition) {
  Context ctx;
  for (RotaryPairing p : {RotaryPairing::kAdjacent, RotaryPairing::kHalves}) {
    SCOPED_TRACE(p == RotaryPairing::kAdjacent ? "adjacent" : "halves");
    const int64_t Tn = 12, D = 8;
    Tensor q1 = random_tensor({1, 1, D}, DType::F64, 1),
           k1 = random_tensor({1, 1, D}, DType::F64, 2);
    Tensor Q = Tensor::empty({1, Tn, D}, DType::F64), K = Tensor::empty({1, Tn, D}, DType::F64);
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t d = 0; d < D; ++d) {
        Q.set({0, t, d}, q1.flat(d));
        K.set({0, t, d}, k1.flat(d));
      }
    Tensor Qr = rotary_embedding(ctx, Q, pairing(p)), Kr = rotary_embedding(ctx, K, pairing(p));
    auto qk = [&](int64_t t, int64_t s) {
      double acc = 0;
      for (int64_t d = 0; d < D; ++d)
        acc += Qr.at({0, t, d}) * Kr.at({0, s, d});
      return acc;
    };
    for (int64_t delta = -(Tn - 1); delta < Tn; ++delta) {
      const int64_t t0 = std::max<int64_t>(0, delta);
      const double ref = qk(t0, t0 - delta);
      for (int64_t t = t0; t < Tn && t - delta < Tn; ++t)
        EXPECT_NEAR(qk(t, t - delta), ref, 1e-12) << "t " << t << ", t - s " << delta;
    }
    EXPECT_GT(std::abs(qk(5, 0) - qk(0, 0)), 1e-3);  // the offset does matter
    // A rotation keeps every row's norm.
    for (int64_t t = 0; t < Tn; ++t) {
      double n0 = 0, n1 = 0;
      for (int64_t d = 0; d < D; ++d) {
        n0 += Q.at({0, t, d}) * Q.at({0, t, d});
        n1 += Qr.at({0, t, d}) * Qr.at({0, t, d});
      }
      EXPECT_NEAR(n0, n1, 1e-13);
    }
  }
}

TEST(Rotary, BackwardIsTheInverseRotationAndGradchecks) {
  Context ctx;
  for (RotaryPairing p : {RotaryPairing::kAdjacent, RotaryPairing::kHalves}) {
    RotaryOptions o = pairing(p);
    o.position_offset = 2;
    Tensor x = random_tensor({3, 5, 6}, DType::F64, 4), w = random_tensor({3, 5, 6}, DType::F64, 5);
    EXPECT_TRUE(close(rotary_embedding_backward(ctx, rotary_embedding(ctx, x, o), o), x, 0, 1e-14));
    EXPECT_TRUE(gradcheck([&] { return dot(rotary_embedding(ctx, x, o), w); }, x,
                          rotary_embedding_backward(ctx, w, o)));
  }
  // float32 agrees with float64.
  Tensor x = random_tensor({2, 7, 4}, DType::F64, 6);
  EXPECT_TRUE(close(rotary_embedding(ctx, x.to(DType::F32)), rotary_embedding(ctx, x), 0, 1e-6));
}

TEST(Rotary, BadInput) {
  Context ctx;
  EXPECT_THROW(rotary_embedding(ctx, random_tensor({1, 2, 5})), Error);  // odd D
  EXPECT_THROW(rotary_embedding(ctx, random_tensor({2, 4})), Error);     // not 3-D
  EXPECT_THROW(rotary_embedding(ctx, Tensor::zeros({1, 2, 4}, DType::I32)), Error);
  RotaryOptions o;
  o.base = 0.0;
  EXPECT_THROW(rotary_embedding(ctx, random_tensor({1, 2, 4}), o), Error);
  o.base = 10000.0;
  o.position_offset = -1;
  EXPECT_THROW(rotary_embedding_backward(ctx, random_tensor({1, 2, 4}), o), Error);
}

TEST(Alibi, SlopesFollowThePaper) {
  // H = 8: 2^-1, 2^-2, ..., 2^-8.
  std::vector<double> m8 = alibi_slopes(8);
  ASSERT_EQ(m8.size(), 8u);
  for (int h = 0; h < 8; ++h)
    EXPECT_EQ(m8[h], std::ldexp(1.0, -(h + 1)));
  // H = 6 (not a power of two): those of 4 (2^-2, 2^-4, 2^-6, 2^-8), then slopes 0 and 2 of 8
  // (2^-1, 2^-3), as get_slopes(6) in the paper's code.
  const std::vector<double> want6 = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  EXPECT_EQ(alibi_slopes(6), want6);
  EXPECT_EQ(alibi_slopes(1), std::vector<double>{1.0 / 256});
  EXPECT_THROW(alibi_slopes(0), Error);
}

// ----------------------------------------------------------------------------------------------
// ALiBi inside the attention op

// Against the bias built by hand: out = masked_softmax(q k^T / sqrt(D) - m_{b % H} |t - s|) v
TEST(Alibi, AttentionMatchesHandBuiltBias) {
  Context ctx;
  const int64_t H = 2, B = 2 * H, Tn = 4, S = 5, D = 3;
  Tensor q = random_tensor({B, Tn, D}, DType::F64, 1), k = random_tensor({B, S, D}, DType::F64, 2);
  Tensor v = random_tensor({B, S, 2}, DType::F64, 3);
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{5, 3}, {2});
  const std::vector<double> m = {0.5, 0.125};
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    Tensor scores = Tensor::empty({B, Tn, S}, DType::F64);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t s = 0; s < S; ++s) {
          double acc = 0;
          for (int64_t d = 0; d < D; ++d)
            acc += q.at({b, t, d}) * k.at({b, s, d});
          scores.set({b, t, s}, acc / std::sqrt(3.0) - m[b % H] * std::abs(double(t - s)));
        }
    MaskOptions mask;
    mask.valid_lens = lens;
    mask.lens_repeat = H;
    mask.causal = causal;
    Tensor w = masked_softmax(ctx, scores, mask);
    AttentionOptions o;
    o.mask = mask;
    o.need_weights = true;
    o.alibi_slopes = Tensor::from_vector(m, {H}, DType::F64);
    AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
    EXPECT_TRUE(close(r.weights, w, 0, 1e-15));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t e = 0; e < 2; ++e) {
          double acc = 0;
          for (int64_t s = 0; s < S; ++s)
            acc += w.at({b, t, s}) * v.at({b, s, e});
          EXPECT_NEAR(r.output.at({b, t, e}), acc, 1e-15);
        }
    // float32 slopes and inputs give the same within float32 rounding.
    o.alibi_slopes = o.alibi_slopes.to(DType::F32);
    AttentionResult r32 =
        scaled_dot_product_attention(ctx, q.to(DType::F32), k.to(DType::F32), v.to(DType::F32), o);
    EXPECT_TRUE(close(r32.output, r.output, 0, 1e-6));
  }
}

// The fused CPU kernels have no score bias: ALiBi calls run the reference kernel whatever the
// backend asks for, so kCpu gives exactly the reference's result.
TEST(Alibi, FastBackendsRouteToTheReference) {
  Tensor q = random_tensor({4, 5, 8}, DType::F32, 1), k = random_tensor({4, 6, 8}, DType::F32, 2);
  Tensor v = random_tensor({4, 6, 8}, DType::F32, 3), w = random_tensor({4, 5, 8}, DType::F32, 4);
  AttentionOptions o;
  o.alibi_slopes = Tensor::from_vector(alibi_slopes(2), {2}, DType::F64);
  Context ref_ctx, cpu_ctx, auto_ctx;
  ref_ctx.backend = Backend::kReference;
  cpu_ctx.backend = Backend::kCpu;
  AttentionResult r = scaled_dot_product_attention(ref_ctx, q, k, v, o);
  AttentionGrads g = scaled_dot_product_attention_backward(ref_ctx, w, q, k, v, r, o);
  for (Context* ctx : {&cpu_ctx, &auto_ctx}) {
    AttentionResult rc = scaled_dot_product_attention(*ctx, q, k, v, o);
    EXPECT_TRUE(close(rc.output, r.output, 0, 0));
    AttentionGrads gc = scaled_dot_product_attention_backward(*ctx, w, q, k, v, rc, o);
    EXPECT_TRUE(close(gc.dq, g.dq, 0, 0));
    EXPECT_TRUE(close(gc.dk, g.dk, 0, 0));
  }
}

TEST(Alibi, AttentionGradcheckWithDropoutAndLengths) {
  Context ctx;
  ctx.seed = 9;
  const int64_t H = 2;
  Tensor q = random_tensor({4, 3, 2}, DType::F64, 4), k = random_tensor({4, 5, 2}, DType::F64, 5);
  Tensor v = random_tensor({4, 5, 3}, DType::F64, 6), w = random_tensor({4, 3, 3}, DType::F64, 7);
  AttentionOptions o;
  o.mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{4, 2}, {2});
  o.mask.lens_repeat = H;
  o.dropout = 0.3;
  o.training = true;
  o.alibi_slopes = Tensor::from_vector(alibi_slopes(H), {H}, DType::F64);
  auto loss = [&] {
    ctx.set_dropout_offset(0);
    return dot(scaled_dot_product_attention(ctx, q, k, v, o).output, w);
  };
  ctx.set_dropout_offset(0);
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  AttentionGrads g = scaled_dot_product_attention_backward(ctx, w, q, k, v, r, o);
  EXPECT_TRUE(gradcheck(loss, q, g.dq));
  EXPECT_TRUE(gradcheck(loss, k, g.dk));
  EXPECT_TRUE(gradcheck(loss, v, g.dv));
}

TEST(Alibi, BadInput) {
  Context ctx;
  Tensor q = random_tensor({3, 2, 2}), k = random_tensor({3, 2, 2}), v = random_tensor({3, 2, 2});
  AttentionOptions o;
  o.alibi_slopes = Tensor::from_vector(std::vector<double>{0.5, 0.25}, {2});  // 3 % 2 != 0
  EXPECT_THROW(scaled_dot_product_attention(ctx, q, k, v, o), Error);
  o.alibi_slopes = Tensor::zeros({1, 1});
  EXPECT_THROW(scaled_dot_product_attention(ctx, q, k, v, o), Error);
  o.alibi_slopes = Tensor::zeros({1}, DType::I64);
  EXPECT_THROW(scaled_dot_product_attention(ctx, q, k, v, o), Error);
  o.alibi_slopes = Tensor::full({1}, 0.5);
  EXPECT_NO_THROW(scaled_dot_product_attention(ctx, q, k, v, o));
  EXPECT_THROW(additive_attention(ctx, q, k, random_tensor({2}), v, o), Error);
}

// ALiBi makes attention prefer near keys: with equal queries and keys a row's weights fall by
// exp(-m) per step of distance, on both sides (the symmetric |t - s|).
TEST(Alibi, EqualKeysDecayWithDistance) {
  Context ctx;
  nn::DotProductAttention att(0.0, DType::F64);
  att.alibi_slopes = Tensor::from_vector(std::vector<double>{0.5}, {1}, DType::F64);
  Tensor ones = Tensor::full({1, 6, 2}, 1.0, DType::F64);
  att.forward(ctx, ones, ones, ones);
  const Tensor& w = att.attention_weights();
  for (int64_t s = 2; s + 1 < 6; ++s)
    EXPECT_NEAR(w.at({0, 2, s + 1}) / w.at({0, 2, s}), std::exp(-0.5), 1e-14);
  EXPECT_NEAR(w.at({0, 2, 1}), w.at({0, 2, 3}), 1e-15);
}

// ----------------------------------------------------------------------------------------------
// Inside the attention modules

// DotProductAttention with rotary = plain attention on rotated queries and keys.
TEST(RotaryModule, DotProductAttentionRotatesQueriesAndKeys) {
  Context ctx;
  for (RotaryPairing p : {RotaryPairing::kAdjacent, RotaryPairing::kHalves}) {
    nn::DotProductAttention att(0.0, DType::F64);
    att.rotary = pairing(p);
    Tensor q = random_tensor({2, 3, 4}, DType::F64, 1), k = random_tensor({2, 5, 4}, DType::F64, 2);
    Tensor v = random_tensor({2, 5, 3}, DType::F64, 3);
    Tensor out = att.forward(ctx, q, k, v);
    AttentionOptions o;
    Tensor want = scaled_dot_product_attention(ctx, rotary_embedding(ctx, q, pairing(p)),
                                               rotary_embedding(ctx, k, pairing(p)), v, o)
                      .output;
    EXPECT_TRUE(close(out, want, 0, 1e-15));
  }
  nn::DotProductAttention att(0.0, DType::F64);
  att.rotary = RotaryOptions{};
  Tensor odd = random_tensor({1, 2, 3}, DType::F64);
  EXPECT_THROW(att.forward(ctx, odd, odd, odd), Error);  // RoPE needs an even width
}

// MultiHeadAttention with RoPE (both pairings) or ALiBi: gradients of the input and of every
// projection by finite differences, dropout on, valid_lens set.
TEST(RotaryModule, MultiHeadAttentionGradchecks) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0 ? "rope adjacent" : variant == 1 ? "rope halves" : "alibi");
    Context ctx;
    ctx.seed = 4;
    nn::MultiHeadAttention mha(8, 2, 0.25, false, DType::F64, 7);
    if (variant < 2)
      mha.attention.rotary =
          pairing(variant == 0 ? RotaryPairing::kAdjacent : RotaryPairing::kHalves);
    else
      mha.attention.alibi_slopes = Tensor::from_vector(alibi_slopes(2), {2}, DType::F64);
    Tensor X = random_tensor({2, 4, 8}, DType::F64, 1), w = random_tensor({2, 4, 8}, DType::F64, 2);
    Tensor lens = Tensor::from_vector(std::vector<int64_t>{4, 3}, {2});
    auto loss = [&] {
      ctx.set_dropout_offset(0);
      return dot(mha.forward(ctx, X, X, X, lens), w);
    };
    loss();
    mha.zero_grad();
    nn::AttentionInputGrads g = mha.backward(ctx, w);
    Tensor dX = g.dqueries.clone();
    for (int64_t i = 0; i < dX.numel(); ++i)
      dX.set_flat(i, dX.flat(i) + g.dkeys.flat(i) + g.dvalues.flat(i));
    EXPECT_TRUE(gradcheck(loss, X, dX));
    for (auto& [name, prm] : mha.named_parameters())
      EXPECT_TRUE(gradcheck(loss, prm->value, prm->grad.clone())) << name;
  }
}

}  // namespace
}  // namespace attn
