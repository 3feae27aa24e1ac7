// Scaled dot-product attention, additive attention and dropout ops: the d2l examples of
// semantics.md section 2, agreement with masked_softmax + matmul written out here, dropout
// determinism, NaN robustness, finite-difference gradients (float64) and bad input.
#include "attn/core/rng.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace attn {
namespace {

using testing::close;
using testing::gradcheck;
using testing::random_tensor;

template <typename F>
void expect_error(F&& f, const std::string& op) {
  try {
    f();
    ADD_FAILURE() << "expected attn::Error from " << op;
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
  }
}

Tensor lens_i64(std::vector<int64_t> v, Shape shape) {
  return Tensor::from_vector(v, shape);
}

// The formula written out: scores in double, masked_softmax, dropout factors, weighted sum.
Tensor naive_attention(const Tensor& scores, const Tensor& v, const MaskOptions& mask,
                       double p = 0.0, uint64_t seed = 0, uint64_t offset = 0) {
  Context ctx;
  Tensor w = masked_softmax(ctx, scores, mask);
  const int64_t B = scores.dim(0), T = scores.dim(1), S = scores.dim(2), Dv = v.dim(2);
  Tensor out = Tensor::zeros({B, T, Dv}, DType::F64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < Dv; ++e) {
        double acc = 0;
        for (int64_t s = 0; s < S; ++s) {
          double f = 1.0;
          if (p > 0) {
            const uint64_t i = static_cast<uint64_t>((b * T + t) * S + s);
            f = dropout_keep(seed, offset, i, static_cast<float>(p)) ? 1.0 / (1.0 - p) : 0.0;
          }
          if (w.at({b, t, s}) != 0.0) acc += w.at({b, t, s}) * f * v.at({b, s, e});
        }
        out.set({b, t, e}, acc);
      }
  return out;
}

Tensor dot_scores(const Tensor& q, const Tensor& k, double scale) {
  const int64_t B = q.dim(0), T = q.dim(1), S = k.dim(1), D = q.dim(2);
  Tensor sc = Tensor::zeros({B, T, S}, DType::F64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) {
        double acc = 0;
        for (int64_t d = 0; d < D; ++d)
          acc += q.at({b, t, d}) * k.at({b, s, d});
        sc.set({b, t, s}, acc * scale);
      }
  return sc;
}

Tensor additive_scores(const Tensor& qp, const Tensor& kp, const Tensor& w_v) {
  const int64_t B = qp.dim(0), T = qp.dim(1), S = kp.dim(1), H = qp.dim(2);
  Tensor wv = w_v.reshape({H});
  Tensor sc = Tensor::zeros({B, T, S}, DType::F64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h)
          acc += wv.at({h}) * std::tanh(qp.at({b, t, h}) + kp.at({b, s, h}));
        sc.set({b, t, s}, acc);
      }
  return sc;
}

// d2l's old-book example: keys all equal, values arange(40).reshape(1, 10, 4) twice.
struct BookExample {
  Tensor keys = Tensor::full({2, 10, 2}, 1.0);
  Tensor values = Tensor::empty({2, 10, 4});
  Tensor queries = random_tensor({2, 1, 2}, DType::F32, 7);
  Tensor lens = lens_i64({2, 6}, {2});
  BookExample() {
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 40; ++i)
        values.set_flat(b * 40 + i, i);
  }
  static void check(const Tensor& out, const Tensor& w) {
    const float sixth = 1.0f / 6.0f;
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(out.at({0, 0, e}), 2.0 + e);  // exact
      EXPECT_EQ(out.at({1, 0, e}), 10.0 + e);
    }
    for (int s = 0; s < 10; ++s) {
      EXPECT_EQ(w.at({0, 0, s}), s < 2 ? 0.5 : 0.0);
      EXPECT_EQ(w.at({1, 0, s}), s < 6 ? static_cast<double>(sixth) : 0.0);
    }
  }
};

TEST(Sdpa, BookExampleIsExact) {
  BookExample ex;
  Context ctx;
  AttentionOptions o;
  o.mask.valid_lens = ex.lens;
  o.need_weights = true;
  AttentionResult r = scaled_dot_product_attention(ctx, ex.queries, ex.keys, ex.values, o);
  EXPECT_EQ(r.output.shape(), (Shape{2, 1, 4}));
  EXPECT_EQ(r.output.dtype(), DType::F32);
  BookExample::check(r.output, r.weights);
}

TEST(Additive, BookExampleIsExact) {
  BookExample ex;
  Context ctx;
  AttentionOptions o;
  o.mask.valid_lens = ex.lens;
  // After the projections: equal keys stay equal, so all scores of a row tie.
  Tensor qp = random_tensor({2, 1, 8}, DType::F32, 8);
  Tensor kp = Tensor::full({2, 10, 8}, 0.3);
  Tensor w_v = random_tensor({1, 8}, DType::F32, 9);
  AdditiveResult r = additive_attention(ctx, qp, kp, w_v, ex.values, o);
  BookExample::check(r.output, r.weights);
}

struct SdpaCase {
  const char* name;
  int64_t B, T, S, D, Dv;
  Tensor lens;
  bool causal = false;
  MaskedRowPolicy policy = MaskedRowPolicy::kUniform;
};

std::vector<SdpaCase> sdpa_cases() {
  std::vector<SdpaCase> c;
  c.push_back({"no mask", 2, 3, 4, 5, 3, {}});
  c.push_back({"1-D lens", 2, 3, 5, 4, 2, lens_i64({2, 4}, {2})});
  c.push_back({"2-D lens", 2, 3, 4, 3, 5, lens_i64({1, 2, 4, 3, 0, 9}, {2, 3})});
  c.push_back({"float lens", 2, 2, 4, 3, 3,
               Tensor::from_vector(std::vector<double>{1.5, 3.2}, {2}, DType::F32)});
  c.push_back({"len 0 uniform", 2, 2, 3, 4, 2, lens_i64({0, 2}, {2})});
  c.push_back({"len 0 zero", 2, 2, 3, 4, 2, lens_i64({0, 2}, {2}), false, MaskedRowPolicy::kZero});
  c.push_back({"causal T<S", 1, 3, 5, 4, 3, {}, true});
  c.push_back({"causal T>S + lens", 2, 5, 3, 2, 4, lens_i64({2, 1}, {2}), true});
  return c;
}

TEST(Sdpa, MatchesTheFormulaForEveryMaskKind) {
  for (const SdpaCase& c : sdpa_cases()) {
    SCOPED_TRACE(c.name);
    Context ctx;
    AttentionOptions o;
    o.mask.valid_lens = c.lens;
    o.mask.causal = c.causal;
    o.mask.masked_rows = c.policy;
    o.need_weights = true;
    for (DType dt : {DType::F64, DType::F32}) {
      Tensor q = random_tensor({c.B, c.T, c.D}, dt, 1), k = random_tensor({c.B, c.S, c.D}, dt, 2),
             v = random_tensor({c.B, c.S, c.Dv}, dt, 3);
      AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
      Tensor scores = dot_scores(q, k, 1.0 / std::sqrt(static_cast<double>(c.D)));
      const double tol = dt == DType::F64 ? 1e-13 : 1e-6;
      EXPECT_TRUE(close(r.output.to(DType::F64), naive_attention(scores, v, o.mask), 0, tol));
      EXPECT_TRUE(close(r.weights.to(DType::F64), masked_softmax(ctx, scores, o.mask), 0, tol));
      EXPECT_EQ(r.output.dtype(), dt);
      EXPECT_EQ(r.logsumexp.shape(), (Shape{c.B, c.T}));
      // logsumexp over kept keys (kept = nonzero weights here), -inf without kept keys.
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < c.T; ++t) {
          double sum = 0;
          int kept = 0;
          for (int64_t s = 0; s < c.S; ++s) {
            double len =
                c.lens.defined() ? (c.lens.ndim() == 1 ? c.lens.at({b}) : c.lens.at({b, t})) : 1e9;
            if (static_cast<double>(s) < len && (!c.causal || s <= t)) {
              sum += std::exp(scores.at({b, t, s}));
              ++kept;
            }
          }
          const double lse = r.logsumexp.at({b, t});
          if (kept == 0) {
            EXPECT_EQ(lse, -std::numeric_limits<double>::infinity());
          } else {
            EXPECT_NEAR(lse, std::log(sum), tol * 10);
          }
        }
    }
  }
}

TEST(Sdpa, ZeroPolicyGivesZeroOutputRow) {
  Context ctx;
  AttentionOptions o;
  o.mask.valid_lens = lens_i64({0, 3}, {2});
  o.mask.masked_rows = MaskedRowPolicy::kZero;
  Tensor q = random_tensor({2, 2, 4}), k = random_tensor({2, 3, 4}, DType::F64, 2),
         v = random_tensor({2, 3, 2}, DType::F64, 3);
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  for (int t = 0; t < 2; ++t)
    for (int e = 0; e < 2; ++e)
      EXPECT_EQ(r.output.at({0, t, e}), 0.0);
  // kUniform instead: the mean of all values, padding included (d2l).
  o.mask.masked_rows = MaskedRowPolicy::kUniform;
  r = scaled_dot_product_attention(ctx, q, k, v, o);
  for (int e = 0; e < 2; ++e)
    EXPECT_NEAR(r.output.at({0, 0, e}), (v.at({0, 0, e}) + v.at({0, 1, e}) + v.at({0, 2, e})) / 3,
                1e-15);
}

TEST(Sdpa, ScaleOptionAndStridedViews) {
  Context ctx;
  Tensor q = random_tensor({2, 3, 4}, DType::F64, 1), k = random_tensor({2, 5, 4}, DType::F64, 2),
         v = random_tensor({2, 5, 3}, DType::F64, 3);
  AttentionOptions o;
  o.scale = 0.7;
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  EXPECT_TRUE(close(r.output, naive_attention(dot_scores(q, k, 0.7), v, {}), 0, 1e-13));
  // The same q as a strided view (a transposed buffer) gives the same output.
  Tensor qt = q.transpose(1, 2).contiguous().transpose(1, 2);
  ASSERT_FALSE(qt.is_contiguous());
  EXPECT_TRUE(close(scaled_dot_product_attention(ctx, qt, k, v, o).output, r.output, 0, 0));
}

TEST(Sdpa, NanInMaskedKeysDoesNotLeak) {
  Context ctx;
  AttentionOptions o;
  o.mask.valid_lens = lens_i64({2, 3}, {2});
  Tensor q = random_tensor({2, 2, 4}), k = random_tensor({2, 4, 4}, DType::F64, 2),
         v = random_tensor({2, 4, 3}, DType::F64, 3);
  AttentionResult clean = scaled_dot_product_attention(ctx, q, k, v, o);
  Tensor kn = k.clone(), vn = v.clone();
  for (int d = 0; d < 4; ++d)
    kn.set({0, 3, d}, std::nan(""));  // key 3 of batch 0 is padding
  for (int e = 0; e < 3; ++e)
    vn.set({0, 2, e}, std::nan(""));  // value 2 too
  kn.set({1, 3, 0}, std::numeric_limits<double>::infinity());
  AttentionResult r = scaled_dot_product_attention(ctx, q, kn, vn, o);
  EXPECT_TRUE(close(r.output, clean.output, 0, 0));  // unlike pytorch#101967
  // ... while NaN in a kept key reaches its row.
  kn.set({1, 0, 0}, std::nan(""));
  r = scaled_dot_product_attention(ctx, q, kn, v, o);
  EXPECT_TRUE(std::isnan(r.output.at({1, 0, 0})));
  EXPECT_FALSE(std::isnan(r.output.at({0, 0, 0})));
}

TEST(Sdpa, HugeLogitsInFloat32StayFinite) {
  Context ctx;
  // q . k / sqrt(4) reaches +-1e4.
  Tensor q = Tensor::from_vector(std::vector<double>{100, 100, 100, 100, -100, -100, -100, -100},
                                 {1, 2, 4}, DType::F32);
  Tensor k = Tensor::from_vector(
      std::vector<double>{50, 50, 50, 50, -50, -50, -50, -50, 49.99f, 50, 50, 50}, {1, 3, 4},
      DType::F32);
  Tensor v = random_tensor({1, 3, 2}, DType::F32, 4);
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v);
  for (int64_t i = 0; i < r.output.numel(); ++i)
    EXPECT_TRUE(std::isfinite(r.output.flat(i)));
  for (int64_t i = 0; i < r.logsumexp.numel(); ++i)
    EXPECT_TRUE(std::isfinite(r.logsumexp.flat(i)));
  EXPECT_NEAR(r.logsumexp.at({0, 0}), 1e4, 1.0);
}

// ---------------------------------------------------------------------------------------------
// Dropout inside attention.

TEST(SdpaDropout, TrainingDrawsTheStreamMask) {
  Context ctx;
  ctx.seed = 1234;
  ctx.set_dropout_offset(40);
  AttentionOptions o;
  o.dropout = 0.5;
  o.training = true;
  o.need_weights = true;
  o.mask.valid_lens = lens_i64({3, 5}, {2});
  Tensor q = random_tensor({2, 4, 3}), k = random_tensor({2, 5, 3}, DType::F64, 2),
         v = random_tensor({2, 5, 2}, DType::F64, 3);
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  EXPECT_EQ(r.dropout_offset, 40u);
  EXPECT_EQ(ctx.dropout_offset(), 41u);  // one offset per forward call
  Tensor scores = dot_scores(q, k, 1.0 / std::sqrt(3.0));
  EXPECT_TRUE(close(r.output, naive_attention(scores, v, o.mask, 0.5, 1234, 40), 0, 1e-13));
  // Weights are pre-dropout: rows sum to 1.
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 4; ++t) {
      double sum = 0;
      for (int s = 0; s < 5; ++s)
        sum += r.weights.at({b, t, s});
      EXPECT_NEAR(sum, 1.0, 1e-14);
    }
  // Same seed and offset: the same output; the next offset: a different mask.
  ctx.set_dropout_offset(40);
  EXPECT_TRUE(close(scaled_dot_product_attention(ctx, q, k, v, o).output, r.output, 0, 0));
  EXPECT_GT(max_abs_diff(scaled_dot_product_attention(ctx, q, k, v, o).output, r.output), 0.0);
}

TEST(SdpaDropout, EvalAndZeroAreIdentityAndOneGivesZeros) {
  Context ctx;
  ctx.seed = 5;
  Tensor q = random_tensor({2, 3, 4}), k = random_tensor({2, 4, 4}, DType::F64, 2),
         v = random_tensor({2, 4, 3}, DType::F64, 3);
  AttentionResult plain = scaled_dot_product_attention(ctx, q, k, v);
  AttentionOptions o;
  o.dropout = 0.9;
  o.training = false;  // eval: identity, and no offset taken
  EXPECT_TRUE(close(scaled_dot_product_attention(ctx, q, k, v, o).output, plain.output, 0, 0));
  EXPECT_EQ(ctx.dropout_offset(), 0u);
  o.dropout = 0.0;
  o.training = true;
  EXPECT_TRUE(close(scaled_dot_product_attention(ctx, q, k, v, o).output, plain.output, 0, 0));
  o.dropout = 1.0;
  o.need_weights = true;
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  for (int64_t i = 0; i < r.output.numel(); ++i)
    EXPECT_EQ(r.output.flat(i), 0.0);
  EXPECT_TRUE(close(r.weights, masked_softmax(ctx, dot_scores(q, k, 0.5), {}), 0, 1e-15));
  AttentionGrads g =
      scaled_dot_product_attention_backward(ctx, random_tensor({2, 3, 3}), q, k, v, r, o);
  for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
    for (int64_t i = 0; i < t->numel(); ++i)
      EXPECT_EQ(t->flat(i), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Gradients by central differences: loss = sum(out * G).

void check_sdpa_gradients(const SdpaCase& c, const AttentionOptions& base) {
  Context ctx;
  ctx.seed = 99;
  AttentionOptions o = base;
  o.mask.valid_lens = c.lens;
  o.mask.causal = c.causal;
  o.mask.masked_rows = c.policy;
  Tensor q = random_tensor({c.B, c.T, c.D}, DType::F64, 21),
         k = random_tensor({c.B, c.S, c.D}, DType::F64, 22),
         v = random_tensor({c.B, c.S, c.Dv}, DType::F64, 23),
         G = random_tensor({c.B, c.T, c.Dv}, DType::F64, 24);
  const uint64_t offset = ctx.dropout_offset();
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  AttentionGrads g = scaled_dot_product_attention_backward(ctx, G, q, k, v, r, o);
  auto loss = [&] {
    ctx.set_dropout_offset(offset);  // redraw the same mask every evaluation
    return testing::dot(scaled_dot_product_attention(ctx, q, k, v, o).output, G);
  };
  EXPECT_TRUE(gradcheck(loss, q, g.dq, 1e-6, 1e-7)) << "dq";
  EXPECT_TRUE(gradcheck(loss, k, g.dk, 1e-6, 1e-7)) << "dk";
  EXPECT_TRUE(gradcheck(loss, v, g.dv, 1e-6, 1e-7)) << "dv";
}

TEST(SdpaBackward, GradcheckEveryMaskKind) {
  for (const SdpaCase& c : sdpa_cases()) {
    SCOPED_TRACE(c.name);
    check_sdpa_gradients(c, {});
  }
}

TEST(SdpaBackward, GradcheckWithDropoutAndScale) {
  AttentionOptions o;
  o.dropout = 0.3;
  o.training = true;
  o.scale = 0.8;
  for (const SdpaCase& c : sdpa_cases()) {
    SCOPED_TRACE(c.name);
    check_sdpa_gradients(c, o);
  }
}

TEST(SdpaBackward, Float32MatchesFloat64) {
  Context ctx;
  AttentionOptions o;
  o.mask.valid_lens = lens_i64({2, 4}, {2});
  Tensor q = random_tensor({2, 3, 4}), k = random_tensor({2, 4, 4}, DType::F64, 2),
         v = random_tensor({2, 4, 5}, DType::F64, 3), G = random_tensor({2, 3, 5}, DType::F64, 4);
  AttentionGrads g64 = scaled_dot_product_attention_backward(
      ctx, G, q, k, v, scaled_dot_product_attention(ctx, q, k, v, o), o);
  Tensor q32 = q.to(DType::F32), k32 = k.to(DType::F32), v32 = v.to(DType::F32);
  AttentionGrads g32 = scaled_dot_product_attention_backward(
      ctx, G.to(DType::F32), q32, k32, v32, scaled_dot_product_attention(ctx, q32, k32, v32, o), o);
  EXPECT_TRUE(close(g32.dq.to(DType::F64), g64.dq, 1e-5, 1e-6));
  EXPECT_TRUE(close(g32.dk.to(DType::F64), g64.dk, 1e-5, 1e-6));
  EXPECT_TRUE(close(g32.dv.to(DType::F64), g64.dv, 1e-5, 1e-6));
}

// ---------------------------------------------------------------------------------------------
// Additive attention.

TEST(Additive, MatchesTheFormula) {
  for (const SdpaCase& c : sdpa_cases()) {
    SCOPED_TRACE(c.name);
    Context ctx;
    AttentionOptions o;
    o.mask.valid_lens = c.lens;
    o.mask.causal = c.causal;
    o.mask.masked_rows = c.policy;
    Tensor qp = random_tensor({c.B, c.T, c.D}, DType::F64, 1),
           kp = random_tensor({c.B, c.S, c.D}, DType::F64, 2),
           w_v = random_tensor({c.D}, DType::F64, 3),
           v = random_tensor({c.B, c.S, c.Dv}, DType::F64, 4);
    AdditiveResult r = additive_attention(ctx, qp, kp, w_v, v, o);
    Tensor scores = additive_scores(qp, kp, w_v);
    EXPECT_TRUE(close(r.output, naive_attention(scores, v, o.mask), 0, 1e-13));
    EXPECT_TRUE(close(r.weights, masked_softmax(ctx, scores, o.mask), 0, 1e-13));
  }
}

TEST(AdditiveBackward, GradcheckAllFourGradients) {
  for (bool dropout : {false, true}) {
    for (const SdpaCase& c : sdpa_cases()) {
      SCOPED_TRACE(std::string(c.name) + (dropout ? " + dropout" : ""));
      Context ctx;
      ctx.seed = 7;
      AttentionOptions o;
      o.mask.valid_lens = c.lens;
      o.mask.causal = c.causal;
      o.mask.masked_rows = c.policy;
      o.dropout = dropout ? 0.4 : 0.0;
      o.training = true;
      Tensor qp = random_tensor({c.B, c.T, c.D}, DType::F64, 31),
             kp = random_tensor({c.B, c.S, c.D}, DType::F64, 32),
             w_v = random_tensor({1, c.D}, DType::F64, 33),  // d2l's w_v.weight (1, h)
          v = random_tensor({c.B, c.S, c.Dv}, DType::F64, 34),
             G = random_tensor({c.B, c.T, c.Dv}, DType::F64, 35);
      const uint64_t offset = ctx.dropout_offset();
      AdditiveResult r = additive_attention(ctx, qp, kp, w_v, v, o);
      AdditiveGrads g = additive_attention_backward(ctx, G, qp, kp, w_v, v, r, o);
      EXPECT_EQ(g.dw_v.shape(), w_v.shape());
      auto loss = [&] {
        ctx.set_dropout_offset(offset);
        return testing::dot(additive_attention(ctx, qp, kp, w_v, v, o).output, G);
      };
      EXPECT_TRUE(gradcheck(loss, qp, g.dqp, 1e-6, 1e-7)) << "dqp";
      EXPECT_TRUE(gradcheck(loss, kp, g.dkp, 1e-6, 1e-7)) << "dkp";
      EXPECT_TRUE(gradcheck(loss, w_v, g.dw_v, 1e-6, 1e-7)) << "dw_v";
      EXPECT_TRUE(gradcheck(loss, v, g.dv, 1e-6, 1e-7)) << "dv";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The dropout free functions.

TEST(Dropout, IdentityZerosAndExactScale) {
  Tensor x = random_tensor({3, 50}, DType::F32, 41, 0.5, 2.0);  // never zero
  EXPECT_TRUE(close(dropout(x, 0.0, 1, 2), x, 0, 0));
  Tensor z = dropout(x, 1.0, 1, 2);
  for (int64_t i = 0; i < z.numel(); ++i)
    EXPECT_EQ(z.flat(i), 0.0);
  for (double p : {0.1, 0.5, 0.75}) {
    Tensor y = dropout(x, p, 1, 2);
    int64_t kept = 0;
    for (int64_t i = 0; i < y.numel(); ++i) {
      const bool keep = dropout_keep(1, 2, static_cast<uint64_t>(i), static_cast<float>(p));
      // Kept entries are x * 1/(1-p), rounded once to float32.
      const double expect = keep ? static_cast<float>(x.flat(i) * (1.0 / (1.0 - p))) : 0.0;
      EXPECT_EQ(y.flat(i), expect) << i;
      kept += keep;
    }
    EXPECT_NEAR(static_cast<double>(kept) / 150.0, 1.0 - p, 0.15);
    EXPECT_TRUE(close(dropout(x, p, 1, 2), y, 0, 0));  // same seed and offset: same mask
    EXPECT_GT(max_abs_diff(dropout(x, p, 1, 3), y), 0.0);
    EXPECT_GT(max_abs_diff(dropout(x, p, 2, 2), y), 0.0);
  }
}

TEST(Dropout, BackwardIsTheSameMaskAndGradchecks) {
  Tensor x = random_tensor({4, 7}, DType::F64, 42);
  Tensor G = random_tensor({4, 7}, DType::F64, 43);
  Tensor dx = dropout_backward(G, 0.35, 8, 9);
  EXPECT_TRUE(gradcheck([&] { return testing::dot(dropout(x, 0.35, 8, 9), G); }, x, dx));
  // Strided input: same result as its contiguous copy.
  Tensor xt = x.transpose(0, 1);
  EXPECT_TRUE(close(dropout(xt, 0.35, 8, 9), dropout(xt.contiguous(), 0.35, 8, 9), 0, 0));
}

// ---------------------------------------------------------------------------------------------
// Bad input.

TEST(AttentionErrors, BadInputNamesTheOp) {
  Context ctx;
  const std::string op = "scaled_dot_product_attention";
  Tensor q = random_tensor({2, 3, 4}), k = random_tensor({2, 5, 4}), v = random_tensor({2, 5, 6});
  auto sdpa = [&](const Tensor& a, const Tensor& b, const Tensor& c, AttentionOptions o = {}) {
    scaled_dot_product_attention(ctx, a, b, c, o);
  };
  expect_error([&] { sdpa(q.select(0, 0), k, v); }, op);               // 2-D q
  expect_error([&] { sdpa(q, k.select(0, 0), v.select(0, 0)); }, op);  // 2-D k, v
  expect_error([&] { sdpa(q, random_tensor({3, 5, 4}), v); }, op);     // batch
  expect_error([&] { sdpa(q, random_tensor({2, 5, 3}), v); }, op);     // width
  expect_error([&] { sdpa(q, k, random_tensor({2, 4, 6})); }, op);     // S
  expect_error([&] { sdpa(q.to(DType::F32), k, v); }, op);             // mixed dtypes
  // all-BF16 is accepted (tests/test_kernels_flash_bf16.cpp); F16 and mixed BF16/F32 are not
  expect_error([&] { sdpa(q.to(DType::F16), k.to(DType::F16), v.to(DType::F16)); }, op);
  expect_error([&] { sdpa(q.to(DType::BF16), k, v.to(DType::BF16)); }, op);
  expect_error([&] { sdpa(Tensor::zeros({2, 3, 4}, DType::I64), k, v); }, op);
  AttentionOptions o;
  o.dropout = 1.5;
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o.dropout = -0.1;
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o.dropout = std::nan("");
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o = {};
  o.mask.valid_lens = lens_i64({1, 2, 3}, {3});
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o.mask.valid_lens = lens_i64({1, 2, 3, 4}, {2, 2});  // (B, T) is (2, 3)
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o.mask.valid_lens = Tensor::zeros({2}, DType::BF16);
  expect_error([&] { sdpa(q, k, v, o); }, op);
  o = {};
  o.scale = std::numeric_limits<double>::infinity();
  expect_error([&] { sdpa(q, k, v, o); }, op);

  const std::string bop = "scaled_dot_product_attention_backward";
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v);
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(ctx, random_tensor({2, 3, 4}), q, k, v, r);
      },
      bop);
  expect_error(
      [&] { scaled_dot_product_attention_backward(ctx, r.output.to(DType::F32), q, k, v, r); },
      bop);

  const std::string aop = "additive_attention";
  Tensor w_v = random_tensor({4});
  auto add = [&](const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& c) {
    additive_attention(ctx, a, b, w, c);
  };
  expect_error([&] { add(q.select(0, 0), k, w_v, v); }, aop);
  expect_error([&] { add(q, random_tensor({2, 5, 3}), w_v, v); }, aop);
  expect_error([&] { add(q, k, random_tensor({5}), v); }, aop);
  expect_error([&] { add(q, k, random_tensor({2, 4}), v); }, aop);
  expect_error([&] { add(q, k, w_v, random_tensor({2, 4, 6})); }, aop);
  expect_error([&] { add(q, k, w_v.to(DType::F32), v); }, aop);
  AdditiveResult ar = additive_attention(ctx, q, k, w_v, v);
  expect_error(
      [&] {
        additive_attention_backward(ctx, random_tensor({2, 3, 5}), q, k, w_v, v, ar);
      },
      "additive_attention_backward");

  expect_error([&] { dropout(q, 1.01, 0, 0); }, "dropout");
  expect_error([&] { dropout(Tensor::zeros({3}, DType::I32), 0.5, 0, 0); }, "dropout");
  expect_error([&] { dropout_backward(q, -1, 0, 0); }, "dropout_backward");
}

// ---------------------------------------------------------------------------------------------
// PyTorch parity: tests/fixtures/dot_product_attention.safetensors, written by
// tests/fixtures/generate.py running the d2l code on PyTorch 1.13 (regenerate: python3
// tests/fixtures/generate.py --out tests/fixtures). "<case>.exact.<x>" is the float64 run rounded
// to float32: attn's double accumulation lands within a float32 ulp or two of it; torch's own
// float32 result within rtol 1e-5 / atol 1e-6.

SafetensorsFile load_fixture(const std::string& name) {
  return load_safetensors(std::string(ATTN_FIXTURE_DIR) + "/" + name + ".safetensors");
}

std::vector<std::string> fixture_cases(const SafetensorsFile& f) {
  std::vector<std::string> cases;
  for (const auto& [key, value] : f.metadata)
    if (key.rfind("case.", 0) == 0) cases.push_back(key.substr(5));
  return cases;
}

// Compares attn's result with the fixture's float32 (PyTorch) and exact values of `name`. The
// tight "vs exact" bound holds for the reference kernels (double accumulation), so these tests
// pin Backend::kReference; the fast paths meet the PyTorch tolerance in tests/test_nn_parity.cpp.
void expect_parity(const SafetensorsFile& f, const std::string& c, const std::string& name,
                   const Tensor& ours) {
  SCOPED_TRACE(c + "." + name +
               " (regenerate: python3 tests/fixtures/generate.py --out "
               "tests/fixtures)");
  const Tensor& torch32 = f.tensors.at(c + "." + name);
  const Tensor& exact = f.tensors.at(c + ".exact." + name);
  ASSERT_EQ(ours.shape(), torch32.shape());
  EXPECT_TRUE(close(ours.to(DType::F64), exact.to(DType::F64), 2.5e-7, 1e-7)) << "vs exact";
  EXPECT_TRUE(close(ours.to(DType::F64), torch32.to(DType::F64), 1e-5, 1e-6)) << "vs torch";
}

TEST(SdpaParity, MatchesD2lDotProductAttentionOnPyTorch) {
  const SafetensorsFile f = load_fixture("dot_product_attention");
  const std::vector<std::string> cases = fixture_cases(f);
  ASSERT_GE(cases.size(), 5u);
  for (const std::string& c : cases) {
    Context ctx;
    ctx.backend = Backend::kReference;
    AttentionOptions o;  // eval: the fixtures' dropout 0.5 is inactive
    o.dropout = 0.5;
    o.need_weights = true;
    if (f.tensors.count(c + ".valid_lens")) o.mask.valid_lens = f.tensors.at(c + ".valid_lens");
    const Tensor &q = f.tensors.at(c + ".queries"), &k = f.tensors.at(c + ".keys"),
                 &v = f.tensors.at(c + ".values");
    AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
    expect_parity(f, c, "output", r.output);
    expect_parity(f, c, "attention_weights", r.weights);
    AttentionGrads g =
        scaled_dot_product_attention_backward(ctx, f.tensors.at(c + ".G"), q, k, v, r, o);
    expect_parity(f, c, "grad.queries", g.dq);
    expect_parity(f, c, "grad.keys", g.dk);
    expect_parity(f, c, "grad.values", g.dv);
  }
}

// d2l AdditiveAttention = linear projections (ops/linear) + additive_attention.
TEST(AdditiveParity, MatchesD2lAdditiveAttentionOnPyTorch) {
  const SafetensorsFile f = load_fixture("additive_attention");
  const std::vector<std::string> cases = fixture_cases(f);
  ASSERT_GE(cases.size(), 5u);
  for (const std::string& c : cases) {
    Context ctx;
    ctx.backend = Backend::kReference;
    AttentionOptions o;
    if (f.tensors.count(c + ".valid_lens")) o.mask.valid_lens = f.tensors.at(c + ".valid_lens");
    const Tensor &queries = f.tensors.at(c + ".queries"), &keys = f.tensors.at(c + ".keys"),
                 &v = f.tensors.at(c + ".values");
    const Tensor &W_q = f.tensors.at(c + ".param.W_q.weight"),
                 &W_k = f.tensors.at(c + ".param.W_k.weight"),
                 &w_v = f.tensors.at(c + ".param.w_v.weight");
    Tensor qp = linear(ctx, queries, W_q), kp = linear(ctx, keys, W_k);
    AdditiveResult r = additive_attention(ctx, qp, kp, w_v, v, o);
    expect_parity(f, c, "output", r.output);
    expect_parity(f, c, "attention_weights", r.weights);
    AdditiveGrads g =
        additive_attention_backward(ctx, f.tensors.at(c + ".G"), qp, kp, w_v, v, r, o);
    LinearGrads gq = linear_backward(ctx, g.dqp, queries, W_q, false);
    LinearGrads gk = linear_backward(ctx, g.dkp, keys, W_k, false);
    expect_parity(f, c, "grad.values", g.dv);
    expect_parity(f, c, "grad.w_v.weight", g.dw_v);
    expect_parity(f, c, "grad.queries", gq.dx);
    expect_parity(f, c, "grad.keys", gk.dx);
    expect_parity(f, c, "grad.W_q.weight", gq.dW);
    expect_parity(f, c, "grad.W_k.weight", gk.dW);
  }
}

}  // namespace
}  // namespace attn
