// masked_softmax forward and backward: the d2l test vectors of semantics.md section 1, the
// fully-masked-row policies, causal masks, NaN robustness, finite-difference gradients and bad
// input.
#include "attn/core/safetensors.hpp"
#include "attn/ops/masked_softmax.hpp"
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

// d2l's example scores: arange(16).reshape(2, 2, 4) / 10 in float32.
Tensor d2l_scores(DType dtype = DType::F32) {
  std::vector<double> v(16);
  for (int i = 0; i < 16; ++i)
    v[i] = static_cast<float>(i) / 10.0f;
  return Tensor::from_vector(v, {2, 2, 4}, dtype);
}

Tensor row(const Tensor& Y, int64_t b, int64_t t) {
  return Y.select(0, b).select(0, t);
}
Tensor vec(std::vector<double> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n}, DType::F64);
}

// Runs f and checks that it throws attn::Error whose message names `op`.
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

constexpr double kF32 = 1e-6;  // fp32 tolerance against the PyTorch-printed values

TEST(MaskedSoftmax, OneDimLengths) {
  for (DType lt : {DType::I32, DType::I64, DType::F32, DType::F64}) {
    Tensor Y =
        masked_softmax(d2l_scores(), Tensor::from_vector(std::vector<double>{2, 3}, {2}, lt));
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(close(row(Y, 0, t), vec({0.47502080, 0.52497917, 0, 0}), 0, kF32));
      EXPECT_TRUE(close(row(Y, 1, t), vec({0.30060959, 0.33222497, 0.36716539, 0}), 0, kF32));
      EXPECT_EQ(Y.at({0, t, 2}), 0.0);  // masked weights are exactly zero
      EXPECT_EQ(Y.at({0, t, 3}), 0.0);
      EXPECT_EQ(Y.at({1, t, 3}), 0.0);
    }
  }
}

TEST(MaskedSoftmax, TwoDimLengths) {
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{1, 3, 2, 4}, {2, 2});
  Tensor Y = masked_softmax(d2l_scores(), lens);
  EXPECT_TRUE(close(row(Y, 0, 0), vec({1, 0, 0, 0}), 0, 0));
  EXPECT_TRUE(close(row(Y, 0, 1), vec({0.30060959, 0.33222499, 0.36716542, 0}), 0, kF32));
  EXPECT_TRUE(close(row(Y, 1, 0), vec({0.47502080, 0.52497917, 0, 0}), 0, kF32));
  EXPECT_TRUE(close(row(Y, 1, 1), vec({0.21383823, 0.23632777, 0.26118258, 0.28865141}), 0, kF32));
}

TEST(MaskedSoftmax, ZeroAndNegativeLengthsGiveUniformRows) {
  for (double first : {0.0, -1.0, std::nan("")}) {
    Tensor lens = Tensor::from_vector(std::vector<double>{first, 4}, {2}, DType::F32);
    Tensor Y = masked_softmax(d2l_scores(), lens);
    Tensor plain = masked_softmax(d2l_scores());
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(close(row(Y, 0, t), vec({0.25, 0.25, 0.25, 0.25}), 0, 0));  // exact
      EXPECT_TRUE(close(row(Y, 1, t), row(plain, 1, t), 0, 0));
    }
  }
}

TEST(MaskedSoftmax, LongLengthsMaskNothing) {
  Tensor Y = masked_softmax(d2l_scores(), Tensor::from_vector(std::vector<int64_t>{9, 4}, {2}));
  EXPECT_TRUE(close(Y, masked_softmax(d2l_scores()), 0, 0));
  // Plain softmax of row (0, 0) = [0, .1, .2, .3].
  EXPECT_TRUE(close(row(Y, 0, 0), vec({0.21383823, 0.23632777, 0.26118258, 0.28865141}), 0, kF32));
}

TEST(MaskedSoftmax, FloatLengthsAreStrict) {
  Tensor Y = masked_softmax(d2l_scores(),
                            Tensor::from_vector(std::vector<double>{2.5, 1.0}, {2}, DType::F64));
  for (int t = 0; t < 2; ++t) {
    EXPECT_GT(Y.at({0, t, 2}), 0.0);  // 2 < 2.5: kept
    EXPECT_EQ(Y.at({0, t, 3}), 0.0);
    EXPECT_TRUE(close(row(Y, 1, t), vec({1, 0, 0, 0}), 0, 0));  // 1 < 1.0 is false
  }
  EXPECT_TRUE(close(row(Y, 0, 0), vec({0.30060959, 0.33222497, 0.36716539, 0}), 0, kF32));
}

TEST(MaskedSoftmax, ZeroPolicyGivesZeroRows) {
  Context ctx;
  MaskOptions mask;
  mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{0, 2}, {2});
  mask.masked_rows = MaskedRowPolicy::kZero;
  Tensor Y = masked_softmax(ctx, d2l_scores(), mask);
  for (int t = 0; t < 2; ++t) {
    EXPECT_TRUE(close(row(Y, 0, t), vec({0, 0, 0, 0}), 0, 0));
    EXPECT_TRUE(close(row(Y, 1, t), vec({0.47502080, 0.52497917, 0, 0}), 0, kF32));
  }
}

TEST(MaskedSoftmax, Float64MatchesFloat32) {
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{2, 3}, {2});
  Tensor y64 = masked_softmax(d2l_scores(DType::F64), lens);
  EXPECT_EQ(y64.dtype(), DType::F64);
  EXPECT_TRUE(close(masked_softmax(d2l_scores(), lens).to(DType::F64), y64, 0, 1e-7));
}

TEST(MaskedSoftmax, CausalIsTopLeftAligned) {
  Context ctx;
  MaskOptions mask;
  mask.causal = true;
  // T = 4, S = 2, equal scores: [[1, 0], [.5, .5], [.5, .5], [.5, .5]] (PyTorch is_causal).
  Tensor Y = masked_softmax(ctx, Tensor::zeros({1, 4, 2}), mask);
  EXPECT_TRUE(close(Y.select(0, 0).reshape({8}), vec({1, 0, .5, .5, .5, .5, .5, .5}), 0, 0));
  // T = 3, S = 5: row t uniform over keys 0..t.
  Y = masked_softmax(ctx, Tensor::zeros({1, 3, 5}, DType::F64), mask);
  for (int t = 0; t < 3; ++t)
    for (int s = 0; s < 5; ++s)
      EXPECT_EQ(Y.at({0, t, s}), s <= t ? 1.0 / (t + 1) : 0.0);
  // Causal AND lengths: len 2 caps row 3 at keys {0, 1}; row 0 keeps key 0 only.
  mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{2}, {1});
  Y = masked_softmax(ctx, Tensor::zeros({1, 4, 4}), mask);
  EXPECT_TRUE(close(row(Y, 0, 0), vec({1, 0, 0, 0}), 0, 0));
  EXPECT_TRUE(close(row(Y, 0, 3), vec({.5, .5, 0, 0}), 0, 0));
}

TEST(MaskedSoftmax, LensRepeatReadsBatchOverRepeat) {
  Context ctx;
  MaskOptions mask;
  mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{1, 3}, {2});
  mask.lens_repeat = 2;  // rows 0, 1 read length 1; rows 2, 3 read length 3 (MHA's b*H + h)
  Tensor X = random_tensor({4, 2, 4}, DType::F32, 3);
  Tensor Y = masked_softmax(ctx, X, mask);
  for (int b = 0; b < 4; ++b) {
    const int len = b < 2 ? 1 : 3;
    for (int t = 0; t < 2; ++t)
      for (int s = 0; s < 4; ++s)
        EXPECT_EQ(Y.at({b, t, s}) == 0.0, s >= len);
  }
}

TEST(MaskedSoftmax, DoesNotMutateInputAndTakesStridedViews) {
  Tensor X = random_tensor({2, 4, 3}, DType::F32, 5);
  Tensor before = X.clone();
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{1, 2}, {2});
  Tensor Xt = X.transpose(1, 2);  // (2, 3, 4), strided
  Tensor Y = masked_softmax(Xt, lens);
  EXPECT_TRUE(close(X, before, 0, 0));
  EXPECT_TRUE(close(Y, masked_softmax(Xt.contiguous(), lens), 0, 0));
}

TEST(MaskedSoftmax, NanInMaskedScoreDoesNotLeak) {
  Tensor X = d2l_scores();
  X.set({0, 0, 3}, std::nan(""));  // masked by len 2
  X.set({0, 1, 2}, std::numeric_limits<double>::infinity());
  Tensor lens = Tensor::from_vector(std::vector<int64_t>{2, 3}, {2});
  Tensor Y = masked_softmax(X, lens);
  EXPECT_TRUE(close(Y, masked_softmax(d2l_scores(), lens), 0, 0));
  // A fully masked row ignores its scores entirely.
  Tensor Z = masked_softmax(X, Tensor::from_vector(std::vector<int64_t>{0, 3}, {2}));
  for (int s = 0; s < 4; ++s)
    EXPECT_EQ(Z.at({0, 0, s}), 0.25);
}

TEST(MaskedSoftmax, NanInKeptScorePropagates) {
  Tensor X = d2l_scores();
  X.set({1, 0, 1}, std::nan(""));
  Tensor Y = masked_softmax(X, Tensor::from_vector(std::vector<int64_t>{2, 3}, {2}));
  EXPECT_TRUE(std::isnan(Y.at({1, 0, 0})));
  EXPECT_TRUE(std::isnan(Y.at({1, 0, 1})));
  EXPECT_EQ(Y.at({1, 0, 3}), 0.0);            // masked stays exactly zero
  EXPECT_FALSE(std::isnan(Y.at({1, 1, 0})));  // other rows untouched
}

TEST(MaskedSoftmax, HugeLogitsStayFinite) {
  Tensor X = Tensor::from_vector(std::vector<double>{1e4, -1e4, 1e4 - 1, 0, -1e4, -1e4, -1e4, -1e4},
                                 {1, 2, 4}, DType::F32);
  Tensor Y = masked_softmax(X);
  for (int64_t i = 0; i < Y.numel(); ++i)
    EXPECT_TRUE(std::isfinite(Y.flat(i)));
  const double e = std::exp(-1.0);
  EXPECT_TRUE(close(row(Y, 0, 0), vec({1 / (1 + e), 0, e / (1 + e), 0}), 0, kF32));
  EXPECT_TRUE(close(row(Y, 0, 1), vec({.25, .25, .25, .25}), 0, 0));
}

TEST(MaskedSoftmax, ValidScoresBelowFillStillWin) {
  // d2l fills with -1e6 and would return [0, 0, 1] here; attn masks exactly (header note).
  Tensor X = Tensor::from_vector(std::vector<double>{-2e6, -3e6, 0}, {1, 1, 3}, DType::F64);
  Tensor Y = masked_softmax(X, Tensor::from_vector(std::vector<int64_t>{2}, {1}));
  EXPECT_TRUE(close(Y.reshape({3}), vec({1, 0, 0}), 0, 0));
}

// ---------------------------------------------------------------------------------------------
// Gradients: loss = sum(masked_softmax(X) * G), checked by central differences in float64.

void check_gradient(const MaskOptions& mask, Shape shape = {2, 3, 5}) {
  Context ctx;
  Tensor X = random_tensor(shape, DType::F64, 11, -2, 2);
  Tensor G = random_tensor(shape, DType::F64, 12);
  Tensor Y = masked_softmax(ctx, X, mask);
  Tensor dX = masked_softmax_backward(ctx, G, Y, mask);
  auto loss = [&] { return testing::dot(masked_softmax(ctx, X, mask), G); };
  EXPECT_TRUE(gradcheck(loss, X, dX, 1e-6, 1e-7));
}

TEST(MaskedSoftmaxBackward, NoMask) {
  check_gradient({});
}

TEST(MaskedSoftmaxBackward, OneDimLengths) {
  MaskOptions m;
  m.valid_lens = Tensor::from_vector(std::vector<int64_t>{2, 4}, {2});
  check_gradient(m);
}

TEST(MaskedSoftmaxBackward, TwoDimFloatLengths) {
  MaskOptions m;
  m.valid_lens =
      Tensor::from_vector(std::vector<double>{1.5, 3, 5, 0.2, 2.7, 9}, {2, 3}, DType::F64);
  check_gradient(m);
}

TEST(MaskedSoftmaxBackward, ZeroLengthBothPolicies) {
  for (MaskedRowPolicy p : {MaskedRowPolicy::kUniform, MaskedRowPolicy::kZero}) {
    MaskOptions m;
    m.valid_lens = Tensor::from_vector(std::vector<int64_t>{0, 3}, {2});
    m.masked_rows = p;
    check_gradient(m);
    // Rows without kept keys get exactly zero gradient.
    Context ctx;
    Tensor X = random_tensor({2, 3, 5}, DType::F64, 13);
    Tensor G = random_tensor({2, 3, 5}, DType::F64, 14);
    Tensor dX = masked_softmax_backward(ctx, G, masked_softmax(ctx, X, m), m);
    for (int t = 0; t < 3; ++t)
      for (int s = 0; s < 5; ++s)
        EXPECT_EQ(dX.at({0, t, s}), 0.0);
  }
}

TEST(MaskedSoftmaxBackward, Causal) {
  MaskOptions m;
  m.causal = true;
  check_gradient(m, {2, 4, 3});
  m.valid_lens = Tensor::from_vector(std::vector<int64_t>{2, 0}, {2});
  check_gradient(m, {2, 4, 3});
}

TEST(MaskedSoftmaxBackward, Float32MatchesFloat64) {
  Context ctx;
  MaskOptions m;
  m.valid_lens = Tensor::from_vector(std::vector<int64_t>{2, 4}, {2});
  Tensor X = random_tensor({2, 3, 5}, DType::F64, 15), G = random_tensor({2, 3, 5}, DType::F64, 16);
  Tensor d64 = masked_softmax_backward(ctx, G, masked_softmax(ctx, X, m), m);
  Tensor X32 = X.to(DType::F32), G32 = G.to(DType::F32);
  Tensor d32 = masked_softmax_backward(ctx, G32, masked_softmax(ctx, X32, m), m);
  EXPECT_EQ(d32.dtype(), DType::F32);
  EXPECT_TRUE(close(d32.to(DType::F64), d64, 1e-5, 1e-6));
}

// ---------------------------------------------------------------------------------------------
// Bad input: each throws attn::Error naming the op.

TEST(MaskedSoftmaxErrors, BadInputNamesTheOp) {
  Context ctx;
  const std::string op = "masked_softmax";
  expect_error([&] { masked_softmax(Tensor::zeros({2, 4})); }, op);  // 2-D
  expect_error([&] { masked_softmax(Tensor::zeros({2, 2, 4}, DType::I32)); }, op);
  expect_error([&] { masked_softmax(Tensor::zeros({2, 2, 4}, DType::BF16)); }, op);
  expect_error([&] { masked_softmax(Tensor()); }, op);
  // valid_lens of the wrong length / shape / dtype.
  expect_error(
      [&] {
        masked_softmax(d2l_scores(), Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {3}));
      },
      op);
  expect_error(
      [&] {
        masked_softmax(d2l_scores(), Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {1, 3}));
      },
      op);
  expect_error([&] { masked_softmax(d2l_scores(), Tensor::zeros({2, 2, 1})); }, op);
  expect_error([&] { masked_softmax(d2l_scores(), Tensor::zeros({2}, DType::F16)); }, op);
  MaskOptions m;
  m.lens_repeat = 0;
  expect_error([&] { masked_softmax(ctx, d2l_scores(), m); }, op);
  m.lens_repeat = 3;  // B = 2 is not a multiple of 3
  m.valid_lens = Tensor::from_vector(std::vector<int64_t>{1}, {1});
  expect_error([&] { masked_softmax(ctx, d2l_scores(), m); }, op);
  try {
    masked_softmax(d2l_scores(), Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {3}));
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(3)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(2, 2)"), std::string::npos) << e.what();
  }
  const std::string bop = "masked_softmax_backward";
  Tensor Y = masked_softmax(d2l_scores());
  expect_error([&] { masked_softmax_backward(ctx, Tensor::zeros({2, 2, 3}), Y); }, bop);
  expect_error([&] { masked_softmax_backward(ctx, Y.to(DType::F64), Y); }, bop);
  expect_error([&] { masked_softmax_backward(ctx, Y.reshape({4, 4}), Y.reshape({4, 4})); }, bop);
}

// ---------------------------------------------------------------------------------------------
// PyTorch parity: tests/fixtures/masked_softmax.safetensors, written by tests/fixtures/generate.py
// running the d2l code on PyTorch 1.13 (regenerate: python3 tests/fixtures/generate.py --out
// tests/fixtures). "<case>.exact.<x>" is the float64 run rounded to float32: attn's double
// accumulation lands within a float32 ulp or two of it; torch's own float32 result within
// rtol 1e-5 / atol 1e-6.

SafetensorsFile load_fixture(const std::string& name) {
  return load_safetensors(std::string(ATTN_FIXTURE_DIR) + "/" + name + ".safetensors");
}

std::vector<std::string> fixture_cases(const SafetensorsFile& f) {
  std::vector<std::string> cases;
  for (const auto& [key, value] : f.metadata)
    if (key.rfind("case.", 0) == 0) cases.push_back(key.substr(5));
  return cases;
}

// Compares attn's result with the fixture's float32 (PyTorch) and exact values of `name`.
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

TEST(MaskedSoftmaxParity, MatchesD2lOnPyTorch) {
  const SafetensorsFile f = load_fixture("masked_softmax");
  const std::vector<std::string> cases = fixture_cases(f);
  ASSERT_GE(cases.size(), 10u);
  for (const std::string& c : cases) {
    Context ctx;
    MaskOptions m;
    if (f.tensors.count(c + ".valid_lens")) m.valid_lens = f.tensors.at(c + ".valid_lens");
    const Tensor& X = f.tensors.at(c + ".X");
    Tensor Y = masked_softmax(ctx, X, m);
    expect_parity(f, c, "Y", Y);
    expect_parity(f, c, "dX", masked_softmax_backward(ctx, f.tensors.at(c + ".G"), Y, m));
  }
}

}  // namespace
}  // namespace attn
