// Ops of the Transformer encoder: layer_norm, embedding, relu, softmax cross-entropy. Forward
// against the written-out formula and the book's numbers, backward against central finite
// differences in float64, and every validation path.
#include "attn/ops/activation.hpp"
#include "attn/ops/embedding.hpp"
#include "attn/ops/layer_norm.hpp"
#include "attn/ops/loss.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace attn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

// ----------------------------------------------------------------------------------------------
// layer_norm

// y = (x - mean) / sqrt(var + eps) * gamma + beta, written out in double.
Tensor layer_norm_formula(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps) {
  Tensor y = Tensor::empty(x.shape(), DType::F64);
  const int64_t E = x.dim(-1), R = x.numel() / E;
  for (int64_t r = 0; r < R; ++r) {
    double m = 0, v = 0;
    for (int64_t e = 0; e < E; ++e)
      m += x.flat(r * E + e) / E;
    for (int64_t e = 0; e < E; ++e)
      v += (x.flat(r * E + e) - m) * (x.flat(r * E + e) - m) / E;
    for (int64_t e = 0; e < E; ++e) {
      double g = gamma.defined() ? gamma.flat(e) : 1.0, b = beta.defined() ? beta.flat(e) : 0.0;
      y.set_flat(r * E + e, (x.flat(r * E + e) - m) / std::sqrt(v + eps) * g + b);
    }
  }
  return y;
}

TEST(LayerNormOp, BookExample) {
  // d2l 11.7: nn.LayerNorm(2) on [[1, 2], [2, 3]] gives [[-1, 1], [-1, 1]] up to eps:
  // 0.5 / sqrt(0.25 + 1e-5) = 0.99998.
  Context ctx;
  Tensor x = Tensor::from_vector(std::vector<double>{1, 2, 2, 3}, {2, 2}, DType::F32);
  LayerNormResult r = layer_norm(ctx, x, Tensor::full({2}, 1.0), Tensor::zeros({2}));
  const double v = 0.5 / std::sqrt(0.25 + 1e-5);
  EXPECT_NEAR(v, 0.99998, 1e-5);
  EXPECT_TRUE(close(r.y, Tensor::from_vector(std::vector<double>{-v, v, -v, v}, {2, 2}), 0, 1e-7));
  EXPECT_TRUE(close(r.mean, Tensor::from_vector(std::vector<double>{1.5, 2.5}, {2}), 0, 0));
  EXPECT_NEAR(r.rstd.flat(0), 1.0 / std::sqrt(0.25 + 1e-5), 1e-6);
}

TEST(LayerNormOp, MatchesFormulaBothDtypesAndStrides) {
  Context ctx;
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor x = random_tensor({3, 4, 7}, dt, 5, -3, 3);
    Tensor g = random_tensor({7}, dt, 6), b = random_tensor({7}, dt, 7);
    const double tol = dt == DType::F32 ? 2e-6 : 1e-13;
    EXPECT_TRUE(close(layer_norm(ctx, x, g, b).y, layer_norm_formula(x, g, b, 1e-5), 0, tol));
    EXPECT_TRUE(close(layer_norm(ctx, x).y, layer_norm_formula(x, {}, {}, 1e-5), 0, tol));
    EXPECT_TRUE(close(layer_norm(ctx, x, g, b, 0.1).y, layer_norm_formula(x, g, b, 0.1), 0, tol));
  }
  // A non-contiguous view normalises its own last dim.
  Tensor base = random_tensor({7, 5}, DType::F64, 8);
  Tensor xt = base.transpose(0, 1);  // (5, 7), strides (1, 5)
  EXPECT_TRUE(
      close(layer_norm(ctx, xt).y, layer_norm_formula(xt.contiguous(), {}, {}, 1e-5), 0, 1e-13));
  // A constant row normalises to beta (var = 0, eps keeps it finite).
  Tensor c = Tensor::full({1, 4}, 3.0, DType::F64);
  EXPECT_TRUE(close(
      layer_norm(ctx, c, Tensor::full({4}, 2.0, DType::F64), Tensor::full({4}, 0.5, DType::F64)).y,
      Tensor::full({1, 4}, 0.5, DType::F64), 0, 0));
}

TEST(LayerNormOp, Gradcheck) {
  Context ctx;
  Tensor x = random_tensor({2, 3, 5}, DType::F64, 11, -2, 2);
  Tensor g = random_tensor({5}, DType::F64, 12), b = random_tensor({5}, DType::F64, 13);
  Tensor w = random_tensor({2, 3, 5}, DType::F64, 14);
  auto loss = [&] { return dot(layer_norm(ctx, x, g, b).y, w); };
  LayerNormResult fwd = layer_norm(ctx, x, g, b);
  LayerNormGrads grads = layer_norm_backward(ctx, w, x, g, fwd);
  EXPECT_TRUE(gradcheck(loss, x, grads.dx));
  EXPECT_TRUE(gradcheck(loss, g, grads.dgamma));
  EXPECT_TRUE(gradcheck(loss, b, grads.dbeta));
  // Without affine parameters.
  auto loss2 = [&] { return dot(layer_norm(ctx, x).y, w); };
  LayerNormGrads g2 = layer_norm_backward(ctx, w, x, {}, layer_norm(ctx, x));
  EXPECT_FALSE(g2.dgamma.defined());
  EXPECT_TRUE(gradcheck(loss2, x, g2.dx));
}

TEST(LayerNormOp, BadInput) {
  Context ctx;
  Tensor x = random_tensor({2, 4}, DType::F64);
  Tensor g = Tensor::full({4}, 1.0, DType::F64), b = Tensor::zeros({4}, DType::F64);
  EXPECT_THROW(layer_norm(ctx, x, g), Error);                                      // beta missing
  EXPECT_THROW(layer_norm(ctx, x, Tensor::full({3}, 1.0, DType::F64), b), Error);  // width
  EXPECT_THROW(layer_norm(ctx, x, g.to(DType::F32), b), Error);                    // dtype
  EXPECT_THROW(layer_norm(ctx, Tensor::zeros({2, 4}, DType::I64)), Error);
  EXPECT_THROW(layer_norm(ctx, Tensor::zeros({2, 0}, DType::F64)), Error);
  EXPECT_THROW(layer_norm(ctx, x, g, b, -1.0), Error);
  LayerNormResult r = layer_norm(ctx, x, g, b);
  EXPECT_THROW(layer_norm_backward(ctx, random_tensor({2, 3}), x, g, r), Error);
  try {
    layer_norm(ctx, x, Tensor::full({3}, 1.0, DType::F64), b);
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "layer_norm");
    EXPECT_NE(std::string(e.what()).find("(3)"), std::string::npos) << e.what();
  }
}

// ----------------------------------------------------------------------------------------------
// embedding

TEST(EmbeddingOp, LooksUpRowsForBothIdTypes) {
  Context ctx;
  Tensor W = random_tensor({5, 3}, DType::F32, 2);
  for (DType id_dt : {DType::I32, DType::I64}) {
    Tensor ids = Tensor::from_vector(std::vector<int64_t>{4, 0, 4, 2, 1, 3}, {2, 3}, id_dt);
    Tensor out = embedding(ctx, ids, W);
    ASSERT_EQ(out.shape(), Shape({2, 3, 3}));
    for (int64_t n = 0; n < 6; ++n)
      for (int64_t e = 0; e < 3; ++e)
        EXPECT_EQ(out.flat(n * 3 + e), W.at({static_cast<int64_t>(ids.flat(n)), e}));
  }
}

TEST(EmbeddingOp, BackwardScatterAddsAndGradchecks) {
  Context ctx;
  Tensor W = random_tensor({6, 4}, DType::F64, 3);
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 1, 5, 0, 1, 2}, {3, 2});
  Tensor w = random_tensor({3, 2, 4}, DType::F64, 4);
  Tensor dW = embedding_backward(ctx, w, ids, 6);
  ASSERT_EQ(dW.shape(), Shape({6, 4}));
  // Token 1 appears three times: its row collects three gradients; token 3 none.
  for (int64_t e = 0; e < 4; ++e) {
    EXPECT_NEAR(dW.at({1, e}), w.at({0, 0, e}) + w.at({0, 1, e}) + w.at({2, 0, e}), 1e-15);
    EXPECT_EQ(dW.at({3, e}), 0.0);
  }
  EXPECT_TRUE(gradcheck([&] { return dot(embedding(ctx, ids, W), w); }, W, dW));
}

TEST(EmbeddingOp, BadInput) {
  Context ctx;
  Tensor W = random_tensor({5, 3}, DType::F64);
  EXPECT_THROW(embedding(ctx, Tensor::from_vector(std::vector<int64_t>{0, 5}, {2}), W), Error);
  EXPECT_THROW(embedding(ctx, Tensor::from_vector(std::vector<int64_t>{-1}, {1}, DType::I32), W),
               Error);
  EXPECT_THROW(embedding(ctx, Tensor::zeros({2}, DType::F32), W), Error);  // float ids
  EXPECT_THROW(embedding(ctx, Tensor::zeros({2}, DType::I64), random_tensor({5})), Error);
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{0, 1}, {2});
  EXPECT_THROW(embedding_backward(ctx, random_tensor({3, 3}), ids, 5), Error);  // shape
  EXPECT_THROW(embedding_backward(ctx, random_tensor({2, 3}), ids, 1), Error);  // id 1 >= V
  try {
    embedding(ctx, Tensor::from_vector(std::vector<int64_t>{0, 7}, {1, 2}), W);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "embedding");
    EXPECT_NE(std::string(e.what()).find("holds 7"), std::string::npos) << e.what();
  }
}

// ----------------------------------------------------------------------------------------------
// relu

TEST(ReluOp, ForwardBackward) {
  Context ctx;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor x = Tensor::from_vector(std::vector<double>{-2, 0, 3, nan}, {4}, DType::F64);
  Tensor y = relu(ctx, x);
  EXPECT_EQ(y.flat(0), 0.0);
  EXPECT_EQ(y.flat(1), 0.0);
  EXPECT_EQ(y.flat(2), 3.0);
  EXPECT_TRUE(std::isnan(y.flat(3)));
  Tensor dx = relu_backward(ctx, Tensor::full({4}, 5.0, DType::F64), x);
  EXPECT_EQ(dx.to_vector(), (std::vector<double>{0, 0, 5, 0}));  // 0 at x == 0, as PyTorch
  // Away from the kink the finite differences agree.
  Tensor x2 = random_tensor({3, 5}, DType::F64, 9);
  Tensor w = random_tensor({3, 5}, DType::F64, 10);
  EXPECT_TRUE(gradcheck([&] { return dot(relu(ctx, x2), w); }, x2, relu_backward(ctx, w, x2)));
  EXPECT_THROW(relu(ctx, Tensor::zeros({2}, DType::I32)), Error);
  EXPECT_THROW(relu_backward(ctx, random_tensor({2}), random_tensor({3})), Error);
}

// ----------------------------------------------------------------------------------------------
// softmax_cross_entropy

TEST(CrossEntropyOp, HandComputed) {
  Context ctx;
  // Two positions, three classes: loss_n = log(sum exp z) - z[y].
  Tensor z = Tensor::from_vector(std::vector<double>{1, 2, 3, 0, 0, 0}, {2, 3}, DType::F64);
  Tensor y = Tensor::from_vector(std::vector<int64_t>{2, 0}, {2});
  const double l0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double l1 = std::log(3.0);
  CrossEntropyResult r = softmax_cross_entropy(ctx, z, y);
  EXPECT_EQ(r.kept, 2);
  EXPECT_NEAR(r.loss, (l0 + l1) / 2, 1e-15);
  CrossEntropyOptions sum;
  sum.reduction = Reduction::kSum;
  EXPECT_NEAR(softmax_cross_entropy(ctx, z, y, sum).loss, l0 + l1, 1e-15);
  // dz = (softmax - onehot) / 2
  Tensor dz = softmax_cross_entropy_backward(ctx, z, y);
  EXPECT_NEAR(dz.at({1, 0}), (1.0 / 3 - 1) / 2, 1e-15);
  EXPECT_NEAR(dz.at({1, 1}), (1.0 / 3) / 2, 1e-15);
}

TEST(CrossEntropyOp, IgnoreIndexAndValidLensLeavePositionsOut) {
  Context ctx;
  Tensor z = random_tensor({2, 4, 5}, DType::F64, 21, -3, 3);
  // Padding marked twice: by ignore_index (-100) and by valid_lens [3, 1].
  Tensor y = Tensor::from_vector(std::vector<int64_t>{1, 4, 0, -100, 2, 2, 2, 2}, {2, 4});
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{3, 1}, {2});
  // Reference: the mean over kept positions (0,0), (0,1), (0,2), (1,0) written out.
  auto term = [&](int64_t b, int64_t t) {
    double s = 0;
    for (int64_t c = 0; c < 5; ++c)
      s += std::exp(z.at({b, t, c}));
    return std::log(s) - z.at({b, t, static_cast<int64_t>(y.at({b, t}))});
  };
  const double want = (term(0, 0) + term(0, 1) + term(0, 2) + term(1, 0)) / 4;
  CrossEntropyOptions o;
  o.valid_lens = lens;
  CrossEntropyResult r = softmax_cross_entropy(ctx, z, y, o);
  EXPECT_EQ(r.kept, 4);
  EXPECT_NEAR(r.loss, want, 1e-14);
  // Only ignore_index: position (1, 1..3) count too.
  EXPECT_EQ(softmax_cross_entropy(ctx, z, y).kept, 7);
  // Gradients: zero at left-out positions, finite differences elsewhere.
  Tensor dz = softmax_cross_entropy_backward(ctx, z, y, o, 2.0);
  for (int64_t c = 0; c < 5; ++c) {
    EXPECT_EQ(dz.at({0, 3, c}), 0.0);
    EXPECT_EQ(dz.at({1, 2, c}), 0.0);
  }
  EXPECT_TRUE(gradcheck([&] { return 2.0 * softmax_cross_entropy(ctx, z, y, o).loss; }, z, dz));
  o.reduction = Reduction::kSum;
  EXPECT_TRUE(gradcheck([&] { return softmax_cross_entropy(ctx, z, y, o).loss; }, z,
                        softmax_cross_entropy_backward(ctx, z, y, o)));
  // A custom ignore_index.
  CrossEntropyOptions o2;
  o2.ignore_index = 2;
  EXPECT_EQ(
      softmax_cross_entropy(
          ctx, z,
          Tensor::from_vector(std::vector<int64_t>{1, 4, 0, 3, 2, 2, 2, 2}, {2, 4}, DType::I32), o2)
          .kept,
      4);
}

// PyTorch 1.13 (float64):
//   z = torch.tensor([[1., 2., 3.], [0., 0., 0.], [2., -1., 0.5]], requires_grad=True)
//   l = F.cross_entropy(z, torch.tensor([2, -100, 0])); l.backward()
TEST(CrossEntropyOp, MatchesPyTorchIgnoreIndexMean) {
  Context ctx;
  Tensor z =
      Tensor::from_vector(std::vector<double>{1, 2, 3, 0, 0, 0, 2, -1, 0.5}, {3, 3}, DType::F64);
  Tensor y = Tensor::from_vector(std::vector<int64_t>{2, -100, 0}, {3});
  EXPECT_NEAR(softmax_cross_entropy(ctx, z, y).loss, 0.32445863055076873, 1e-15);
  const std::vector<double> want = {
      0.04501528658519022,  0.12236423552739882,  -0.1673795221125891, 0.0, 0.0, 0.0,
      -0.10720148270536206, 0.019556286635343725, 0.08764519607001835};
  Tensor dz = softmax_cross_entropy_backward(ctx, z, y);
  for (int64_t i = 0; i < 9; ++i)
    EXPECT_NEAR(dz.flat(i), want[static_cast<size_t>(i)], 1e-15);
}

TEST(CrossEntropyOp, NothingKeptIsNaNWithZeroGradientAsPyTorch) {
  Context ctx;
  Tensor z = random_tensor({2, 3}, DType::F64);
  Tensor y = Tensor::from_vector(std::vector<int64_t>{-100, -100}, {2});
  EXPECT_TRUE(std::isnan(softmax_cross_entropy(ctx, z, y).loss));
  Tensor dz = softmax_cross_entropy_backward(ctx, z, y);
  for (double v : dz.to_vector())
    EXPECT_EQ(v, 0.0);
}

TEST(CrossEntropyOp, LargeLogitsStayFinite) {
  Context ctx;
  Tensor z = Tensor::from_vector(std::vector<double>{1e4, -1e4, 0}, {1, 3}, DType::F32);
  Tensor y = Tensor::from_vector(std::vector<int64_t>{1}, {1});
  EXPECT_NEAR(softmax_cross_entropy(ctx, z, y).loss, 2e4, 1e-6);
  EXPECT_TRUE(std::isfinite(softmax_cross_entropy_backward(ctx, z, y).flat(0)));
}

// The cross-entropy sweep's case: logits (5, 7, C) with -inf and huge logits, a row holding a NaN
// and a row of -inf, an ignored target, and (with `lens`) length-masked positions.
struct CrossEntropyCase {
  Tensor z, y;
  CrossEntropyOptions o;
};
CrossEntropyCase cross_entropy_case(int64_t C, bool lens) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t B = 5, T = 7;
  CrossEntropyCase c;
  c.z = random_tensor({B, T, C}, DType::F32, static_cast<uint64_t>(C), -6.0, 6.0);
  c.z.set_flat(3, -inf);
  if (C > 2) c.z.set_flat(C + 1, 3e4);
  std::vector<int64_t> ids(static_cast<size_t>(B * T));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int64_t>((i * 7) % static_cast<size_t>(C));
  ids[4] = -100;
  if (C > 1) {  // row 6 has a NaN; row 9 is all -inf (both kept: NaN losses, as the oracle)
    c.z.set_flat(6 * C + 1, std::nan(""));
    for (int64_t k = 0; k < C; ++k)
      c.z.set_flat(9 * C + k, -inf);
  }
  c.y = Tensor::from_vector(ids, {B, T});
  if (lens) c.o.valid_lens = Tensor::from_vector(std::vector<int64_t>{7, 3, 0, 6, 5}, {B});
  return c;
}
constexpr int64_t kCrossEntropyWidths[] = {1, 3, 7, 8, 9, 16, 17, 236, 1000};

// The float32 fast path (kernels/cpu/cross_entropy: SIMD double exp, rows over threads) against
// the reference loops, over row lengths straddling the vector width, with ignored and
// length-masked positions, -inf and huge logits, a row holding a NaN and a row of -inf; 1 and 2
// threads give the same bits.
TEST(CrossEntropyOp, CpuPathMatchesTheReference) {
  for (int64_t C : kCrossEntropyWidths)
    for (bool lens : {false, true}) {
      const auto [z, y, o] = cross_entropy_case(C, lens);
      Context ref;
      ref.backend = Backend::kReference;
      const double want = softmax_cross_entropy(ref, z, y, o).loss;
      const Tensor dwant = softmax_cross_entropy_backward(ref, z, y, o, 1.5);
      Tensor dgot[2];
      double got[2];
      for (int threads : {1, 2}) {
        Context ctx;
        ctx.threads = threads;
        got[threads - 1] = softmax_cross_entropy(ctx, z, y, o).loss;
        dgot[threads - 1] = softmax_cross_entropy_backward(ctx, z, y, o, 1.5);
      }
      SCOPED_TRACE("C " + std::to_string(C) + (lens ? " with valid_lens" : ""));
      EXPECT_EQ(std::isnan(got[0]), std::isnan(want));
      if (!std::isnan(want)) {
        EXPECT_NEAR(got[0], want, 1e-12 * std::abs(want));
      }
      EXPECT_TRUE(std::isnan(got[1]) ? std::isnan(got[0]) : got[1] == got[0]);
      EXPECT_TRUE(close(dgot[1], dgot[0], 0.0, 0.0));
      for (int64_t i = 0; i < dwant.numel(); ++i) {
        const double a = dgot[0].flat(i), b = dwant.flat(i);
        if (std::isnan(b)) {
          EXPECT_TRUE(std::isnan(a)) << "element " << i;
        } else {
          EXPECT_NEAR(a, b, 1e-6 * 1.5 + 1e-6 * std::abs(b)) << "element " << i;
        }
      }
    }
}

// softmax_cross_entropy_with_grad (the trainers' one pass) against the two calls it replaces:
// the same loss, count and dlogits bit for bit, on the fast path at 1 and 2 threads and on the
// reference, mean and sum, over the same sweep.
TEST(CrossEntropyOp, WithGradIsTheForwardAndTheBackward) {
  for (int64_t C : kCrossEntropyWidths)
    for (bool lens : {false, true})
      for (Reduction reduction : {Reduction::kMean, Reduction::kSum})
        for (int threads : {0, 1, 2}) {  // 0: the reference backend
          auto [z, y, o] = cross_entropy_case(C, lens);
          o.reduction = reduction;
          Context ctx;
          if (threads == 0) ctx.backend = Backend::kReference;
          ctx.threads = std::max(threads, 1);
          const CrossEntropyResult want = softmax_cross_entropy(ctx, z, y, o);
          const Tensor dwant = softmax_cross_entropy_backward(ctx, z, y, o, 0.75);
          const CrossEntropyWithGrad got = softmax_cross_entropy_with_grad(ctx, z, y, o, 0.75);
          SCOPED_TRACE("C " + std::to_string(C) + (lens ? " with valid_lens" : "") +
                       (reduction == Reduction::kSum ? ", sum" : ", mean") + ", threads " +
                       std::to_string(threads));
          EXPECT_EQ(got.result.kept, want.kept);
          EXPECT_TRUE(std::isnan(want.loss) ? std::isnan(got.result.loss)
                                            : got.result.loss == want.loss);
          EXPECT_TRUE(close(got.dlogits, dwant, 0.0, 0.0));  // NaN where NaN
        }
  Context ctx;
  EXPECT_THROW(
      softmax_cross_entropy_with_grad(ctx, Tensor::zeros({2, 3}, DType::F32),
                                      Tensor::from_vector(std::vector<int64_t>{0, 3}, {2})),
      Error);
}

TEST(CrossEntropyOp, BadInput) {
  Context ctx;
  Tensor z = random_tensor({2, 3}, DType::F64);
  EXPECT_THROW(softmax_cross_entropy(ctx, z, Tensor::from_vector(std::vector<int64_t>{0, 3}, {2})),
               Error);  // class 3 of 3
  EXPECT_THROW(softmax_cross_entropy(ctx, z, Tensor::from_vector(std::vector<int64_t>{0}, {1})),
               Error);  // shape
  EXPECT_THROW(softmax_cross_entropy(ctx, z, Tensor::zeros({2}, DType::F32)), Error);
  CrossEntropyOptions o;
  o.valid_lens = Tensor::from_vector(std::vector<int64_t>{1, 1}, {2});
  EXPECT_THROW(softmax_cross_entropy(ctx, z, Tensor::zeros({2}, DType::I64), o),
               Error);  // valid_lens needs (B, T, C)
  Tensor z3 = random_tensor({2, 2, 3}, DType::F64);
  o.valid_lens = Tensor::from_vector(std::vector<int64_t>{1, 1, 1}, {3});
  EXPECT_THROW(softmax_cross_entropy(ctx, z3, Tensor::zeros({2, 2}, DType::I64), o), Error);
}

}  // namespace
}  // namespace attn
