// linear / linear_backward: y = x W^T + b against the written-out formula, 2-D and 3-D x,
// with and without bias, finite-difference gradients (float64) and bad input.
#include "attn/ops/linear.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <string>

namespace attn {
namespace {

using testing::close;
using testing::gradcheck;
using testing::random_tensor;

TEST(Linear, SmallExampleIsExact) {
  Context ctx;
  Tensor x = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3}, DType::F32);
  Tensor W = Tensor::from_vector(std::vector<double>{1, 0, -1, 0.5, 0.5, 0.5}, {2, 3}, DType::F32);
  Tensor b = Tensor::from_vector(std::vector<double>{10, -10}, {2}, DType::F32);
  Tensor y = linear(ctx, x, W, b);
  EXPECT_TRUE(
      close(y, Tensor::from_vector(std::vector<double>{8, -7, 8, -2.5}, {2, 2}, DType::F32), 0, 0));
  EXPECT_TRUE(close(linear(ctx, x, W),
                    Tensor::from_vector(std::vector<double>{-2, 3, -2, 7.5}, {2, 2}, DType::F32), 0,
                    0));
}

TEST(Linear, ThreeDimInputMatchesFormula) {
  Context ctx;
  Tensor x = random_tensor({2, 3, 4}), W = random_tensor({5, 4}, DType::F64, 2),
         b = random_tensor({5}, DType::F64, 3);
  Tensor y = linear(ctx, x, W, b);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 5}));
  for (int i = 0; i < 2; ++i)
    for (int t = 0; t < 3; ++t)
      for (int o = 0; o < 5; ++o) {
        double acc = b.at({o});
        for (int k = 0; k < 4; ++k)
          acc += x.at({i, t, k}) * W.at({o, k});
        EXPECT_NEAR(y.at({i, t, o}), acc, 1e-15);
      }
  // float32 rounds the double accumulation once.
  Tensor y32 = linear(ctx, x.to(DType::F32), W.to(DType::F32), b.to(DType::F32));
  EXPECT_EQ(y32.dtype(), DType::F32);
  EXPECT_TRUE(close(y32.to(DType::F64),
                    linear(ctx, x.to(DType::F32).to(DType::F64), W.to(DType::F32).to(DType::F64),
                           b.to(DType::F32).to(DType::F64)),
                    6e-8, 1e-7));
  // Strided x (a transposed view) and 1-D x.
  Tensor xt = random_tensor({4, 3}).transpose(0, 1);
  EXPECT_TRUE(close(linear(ctx, xt, W, b), linear(ctx, xt.contiguous(), W, b), 0, 0));
  EXPECT_EQ(linear(ctx, random_tensor({4}), W).shape(), (Shape{5}));
}

void check_linear_gradients(const Shape& x_shape, bool bias) {
  Context ctx;
  const int64_t in = x_shape.back(), out = 3;
  Tensor x = random_tensor(x_shape, DType::F64, 51), W = random_tensor({out, in}, DType::F64, 52);
  Tensor b = bias ? random_tensor({out}, DType::F64, 53) : Tensor();
  Shape y_shape = x_shape;
  y_shape.back() = out;
  Tensor G = random_tensor(y_shape, DType::F64, 54);
  LinearGrads g = linear_backward(ctx, G, x, W, bias);
  EXPECT_EQ(g.db.defined(), bias);
  auto loss = [&] { return testing::dot(linear(ctx, x, W, b), G); };
  EXPECT_TRUE(gradcheck(loss, x, g.dx)) << "dx";
  EXPECT_TRUE(gradcheck(loss, W, g.dW)) << "dW";
  if (bias) {
    EXPECT_TRUE(gradcheck(loss, b, g.db)) << "db";
  }
}

TEST(LinearBackward, Gradcheck) {
  check_linear_gradients({4, 5}, true);
  check_linear_gradients({4, 5}, false);
  check_linear_gradients({2, 3, 4}, true);
  check_linear_gradients({2, 3, 4}, false);
}

TEST(LinearErrors, BadInputNamesTheOp) {
  Context ctx;
  auto expect_error = [](auto&& f, const std::string& op) {
    try {
      f();
      ADD_FAILURE() << "expected attn::Error from " << op;
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), op);
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos);
    }
  };
  Tensor x = random_tensor({2, 4}), W = random_tensor({3, 4}), b = random_tensor({3});
  expect_error([&] { linear(ctx, x, random_tensor({3, 5})); }, "linear");  // in mismatch
  expect_error([&] { linear(ctx, x, random_tensor({12})); }, "linear");    // 1-D W
  expect_error([&] { linear(ctx, x, W, random_tensor({4})); }, "linear");  // bias length
  expect_error([&] { linear(ctx, x, W, random_tensor({1, 3})); }, "linear");
  expect_error([&] { linear(ctx, x.to(DType::F32), W); }, "linear");  // mixed dtypes
  expect_error([&] { linear(ctx, x, W, b.to(DType::F32)); }, "linear");
  expect_error([&] { linear(ctx, Tensor::zeros({2, 4}, DType::I64), W); }, "linear");
  expect_error([&] { linear(ctx, Tensor(), W); }, "linear");
  expect_error(
      [&] {
        linear_backward(ctx, random_tensor({2, 4}), x, W, true);
      },
      "linear_backward");  // dy must be (2, 3)
  expect_error(
      [&] {
        linear_backward(ctx, random_tensor({2, 3}, DType::F32), x, W, true);
      },
      "linear_backward");
}

}  // namespace
}  // namespace attn
