// nn positional modules: d2l's PositionalEncoding and LearnedPositionalEmbedding, forward against
// the op and the formula, backward against finite differences, dropout offsets, length limits;
// PositionalEncoding's one-pass forward_scaled / backward_scaled against the separate ops.
#include "attn/nn/positional.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/positional.hpp"
#include "nn/transformer_internal.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

// X + P[:T] written out, P from the formula in double: P[i, 2j] = sin(i / 10000^(2j/E)), ...
Tensor plus_sinusoids(const Tensor& X) {
  Tensor out = X.to(DType::F64).clone();
  const int64_t E = X.dim(2);
  for (int64_t b = 0; b < X.dim(0); ++b)
    for (int64_t i = 0; i < X.dim(1); ++i)
      for (int64_t c = 0; c < E; ++c) {
        const double angle = static_cast<double>(i) / std::pow(10000.0, (c - c % 2) / double(E));
        out.set({b, i, c}, out.at({b, i, c}) + (c % 2 == 0 ? std::sin(angle) : std::cos(angle)));
      }
  return out;
}

TEST(PositionalEncoding, EvalAddsTheSinusoids) {
  Context ctx;
  for (DType dt : {DType::F32, DType::F64}) {
    PositionalEncoding pe(8, 0.5, 1000, dt);
    pe.eval();
    Tensor X = random_tensor({2, 7, 8}, dt, 3);
    Tensor out = pe.forward(ctx, X);
    EXPECT_EQ(out.shape(), X.shape());
    EXPECT_EQ(out.dtype(), dt);
    EXPECT_TRUE(close(out, plus_sinusoids(X), 0, dt == DType::F32 ? 1e-6 : 1e-14));
    EXPECT_EQ(pe.forward(ctx, X).to_vector(), out.to_vector());  // deterministic in eval
    EXPECT_EQ(ctx.dropout_offset(), 0u);
    // P(T) is the cached table, the op's values.
    EXPECT_TRUE(close(pe.P(7).slice(0, 0, 7), sinusoidal_encoding(7, 8, dt), 0, 0));
    EXPECT_EQ(pe.num_parameters(), 0);
    EXPECT_TRUE(pe.state_dict().empty());
  }
}

TEST(PositionalEncoding, BookRowsFloat32) {
  PositionalEncoding pe(4, 0.0);
  const Tensor& P = pe.P(3);
  EXPECT_EQ(P.at({0, 0}), 0.0);
  EXPECT_EQ(P.at({0, 1}), 1.0);
  EXPECT_NEAR(P.at({1, 0}), 0.84147096, 1e-7);
  EXPECT_NEAR(P.at({2, 3}), 0.99980003, 1e-7);
}

// Unlike d2l, max_len is a cache size: longer inputs regrow it, and odd widths work.
TEST(PositionalEncoding, LongerThanMaxLenAndOddWidth) {
  Context ctx;
  PositionalEncoding pe(5, 0.0, 4, DType::F64);
  Tensor X = random_tensor({1, 11, 5}, DType::F64, 2);
  Tensor out = pe.forward(ctx, X);
  EXPECT_TRUE(close(out, plus_sinusoids(X), 0, 1e-14));
  EXPECT_GE(pe.P(11).dim(0), 11);
  EXPECT_TRUE(close(pe.P(11).slice(0, 0, 11), sinusoidal_encoding(11, 5, DType::F64), 0, 0));
  EXPECT_THROW(pe.forward(ctx, random_tensor({1, 3, 4}, DType::F64)), Error);  // E differs
  EXPECT_THROW(pe.forward(ctx, random_tensor({3, 5}, DType::F64)), Error);     // not (B, T, E)
  EXPECT_THROW(pe.forward(ctx, random_tensor({1, 3, 5}, DType::F32)), Error);  // dtype
  EXPECT_THROW(PositionalEncoding(0, 0.1), Error);
  EXPECT_THROW(PositionalEncoding(4, -0.1), Error);
}

TEST(PositionalEncoding, DropoutTakesOneOffsetPerTrainingForward) {
  Context ctx;
  ctx.seed = 31;
  PositionalEncoding pe(6, 0.5, 1000, DType::F64);
  Tensor X = random_tensor({2, 9, 6}, DType::F64, 4);
  ctx.set_dropout_offset(10);
  Tensor out = pe.forward(ctx, X);
  EXPECT_EQ(ctx.dropout_offset(), 11u);
  // The same stream as the op: dropout(X + P, p, seed, offset 10).
  EXPECT_TRUE(close(out, attn::dropout(plus_sinusoids(X), 0.5, 31, 10), 0, 1e-14));
  int dropped = 0;
  for (double y : out.to_vector())
    dropped += y == 0.0;
  EXPECT_GT(dropped, 20);  // about half of 108
  EXPECT_LT(dropped, 88);
  Tensor again = pe.forward(ctx, X);
  EXPECT_GT(max_abs_diff(out, again), 0.0);  // offset 11: a new mask
  pe.eval();
  Tensor plain = pe.forward(ctx, X);
  EXPECT_EQ(ctx.dropout_offset(), 12u);
  EXPECT_TRUE(close(plain, plus_sinusoids(X), 0, 1e-14));
}

TEST(PositionalEncoding, Gradcheck) {
  for (double p : {0.0, 0.4}) {
    Context ctx;
    ctx.seed = 8;
    PositionalEncoding pe(5, p, 3, DType::F64);
    Tensor X = random_tensor({2, 6, 5}, DType::F64, 1);
    auto run = [&] {
      ctx.set_dropout_offset(2);
      return pe.forward(ctx, X);
    };
    Tensor R = random_tensor({2, 6, 5}, DType::F64, 2);
    run();
    Tensor dX = pe.backward(ctx, R);
    EXPECT_TRUE(gradcheck([&] { return dot(run(), R); }, X, dX)) << "p = " << p;
  }
}

TEST(LearnedPositionalEmbedding, ForwardStateAndLimits) {
  Context ctx;
  LearnedPositionalEmbedding emb(6, 4, 0.0, DType::F64, 3);
  EXPECT_EQ(emb.weight.value.shape(), (Shape{6, 4}));
  auto sd = emb.state_dict();
  ASSERT_EQ(sd.size(), 1u);
  EXPECT_EQ(sd.begin()->first, "weight");
  Tensor X = random_tensor({2, 5, 4}, DType::F64, 1);
  Tensor out = emb.forward(ctx, X);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 5; ++t)
      for (int64_t e = 0; e < 4; ++e)
        EXPECT_DOUBLE_EQ(out.at({b, t, e}), X.at({b, t, e}) + emb.weight.value.at({t, e}));
  try {
    emb.forward(ctx, random_tensor({2, 7, 4}, DType::F64));
    FAIL() << "T = 7 > max_len = 6 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "LearnedPositionalEmbedding");
    EXPECT_NE(std::string(e.what()).find("max_len = 6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(emb.forward(ctx, random_tensor({2, 3, 5}, DType::F64)), Error);  // E differs
  // N(0, 1) initialisation, like nn.Embedding; a different seed gives a different table.
  LearnedPositionalEmbedding big(100, 50, 0.0, DType::F64, 1);
  double mean = 0, sq = 0;
  for (double w : big.weight.value.to_vector())
    mean += w, sq += w * w;
  mean /= 5000;
  sq /= 5000;
  EXPECT_NEAR(mean, 0.0, 0.05);
  EXPECT_NEAR(std::sqrt(sq - mean * mean), 1.0, 0.05);
  LearnedPositionalEmbedding other(6, 4, 0.0, DType::F64, 4);
  EXPECT_GT(max_abs_diff(other.weight.value, emb.weight.value), 0.0);
}

TEST(LearnedPositionalEmbedding, Gradcheck) {
  for (double p : {0.0, 0.3}) {
    Context ctx;
    ctx.seed = 12;
    LearnedPositionalEmbedding emb(7, 3, p, DType::F64, 5);
    Tensor X = random_tensor({2, 5, 3}, DType::F64, 1);
    auto run = [&] {
      ctx.set_dropout_offset(6);
      return emb.forward(ctx, X);
    };
    Tensor R = random_tensor({2, 5, 3}, DType::F64, 2);
    run();
    emb.zero_grad();
    Tensor dX = emb.backward(ctx, R);
    Tensor dW = emb.weight.grad.clone();
    auto loss = [&] { return dot(run(), R); };
    EXPECT_TRUE(gradcheck(loss, X, dX)) << "p = " << p;
    EXPECT_TRUE(gradcheck(loss, emb.weight.value, dW)) << "p = " << p;
    // Rows beyond T get no gradient.
    for (int64_t e = 0; e < 3; ++e)
      EXPECT_EQ(dW.at({6, e}), 0.0);
  }
}

// forward_scaled(X, f) is forward(scaled(X, f)) and backward_scaled(dout, f) is
// scaled(backward(dout), f), bit for bit, with the same dropout offsets: dropout 0, 0.1, 0.5 and 1
// (the separate ops), eval, odd widths, a strided X, a data-parallel shard's first sample, 1 and
// 2 threads (shapes past the parallel split), float64 (the separate ops).
TEST(PositionalEncoding, ScaledIsTheSeparateOpsBitwise) {
  const double factor = std::sqrt(48.0);
  for (DType dt : {DType::F32, DType::F64})
    for (double p : {0.0, 0.1, 0.5, 1.0})
      for (bool training : {true, false})
        for (int threads : {1, 2})
          for (int64_t E : {48, 7}) {
            const int64_t B = 5, T = 137;  // 32880 / 4795 elements: both sides of the split
            const Tensor wide = random_tensor({B, T, 2 * E}, dt, 5);
            const Tensor X = wide.slice(2, 0, E);  // strided rows
            const Tensor dout = random_tensor({B, T, E}, dt, 6);
            auto run = [&](bool fused, Tensor& out, Tensor& dX, uint64_t& offset) {
              Context ctx;
              ctx.threads = threads;
              ctx.seed = 77;
              ctx.set_dropout_offset(3);
              ctx.dropout_first_sample = 2;
              PositionalEncoding pe(E, p, 16, dt);  // a short cache: P grows
              pe.train(training);
              if (fused) {
                out = pe.forward_scaled(ctx, X, factor);
                dX = pe.backward_scaled(ctx, dout, factor);
              } else {
                out = pe.forward(ctx, attn::nn::detail::scaled(X, factor, threads));
                dX = attn::nn::detail::scaled(pe.backward(ctx, dout), factor, threads);
              }
              offset = ctx.dropout_offset();
            };
            Tensor out1, dX1, out2, dX2;
            uint64_t off1 = 0, off2 = 0;
            run(true, out1, dX1, off1);
            run(false, out2, dX2, off2);
            const std::string what = std::string(dtype_name(dt)) + " p " + std::to_string(p) +
                                     (training ? " train" : " eval") + " threads " +
                                     std::to_string(threads) + " E " + std::to_string(E);
            EXPECT_TRUE(close(out1, out2, 0, 0)) << what;
            EXPECT_TRUE(close(dX1, dX2, 0, 0)) << what;
            EXPECT_EQ(off1, off2) << what;
          }
}

}  // namespace
}  // namespace attn::nn
