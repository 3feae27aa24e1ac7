// linear / linear_backward: y = x W^T + b against the written-out formula, 2-D and 3-D x,
// with and without bias, finite-difference gradients (float64) and bad input;
// linear_backward_accumulate against linear_backward followed by the adds, bit for bit; the fused
// ReLU (linear_relu, relu_out) against the separate passes, bit for bit; linear_of_parameter_into
// against linear, bit for bit.
#include "attention_harness.hpp"
#include "attn/ops/activation.hpp"
#include "attn/ops/linear.hpp"
#include "ops/linear_parameter.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace attn {
namespace {

using testing::bitwise_equal;
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

// sum + g elementwise in sum's dtype (bf16: in float, rounded once), on fresh tensors.
Tensor added(const Tensor& sum, const Tensor& g) {
  Tensor out = sum.contiguous().clone();
  for (int64_t i = 0; i < out.numel(); ++i)
    out.set_flat(i, out.dtype() == DType::F64
                        ? sum.flat(i) + g.flat(i)
                        : static_cast<double>(static_cast<float>(sum.flat(i)) +
                                              static_cast<float>(g.flat(i))));
  return out;
}

TEST(LinearBackwardAccumulate, IsTheGradientsAddedBitwise) {
  // (rows, in, out): small; the model's widths; products oneDNN splits along the contraction on
  // 2 threads (the weight gradient's K is the row count: (512, 64, 4096) and (16, 16, 20000) as
  // (out, in, rows)).
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {5, 3, 2}, {64, 32, 48}, {640, 128, 384}, {4096, 64, 512}, {20000, 16, 16}};
  for (const auto& [rows, in, out] : shapes) {
    for (const DType dtype : {DType::F32, DType::F64, DType::BF16}) {
      for (const Backend backend : {Backend::kAuto, Backend::kReference}) {
        // The loops of the reference (and of float64) on the small shapes only.
        const bool loops = backend == Backend::kReference || dtype == DType::F64;
        if (loops && rows * in * out > (int64_t{1} << 18)) continue;
        for (const int threads : {1, 2}) {
          for (const bool from_zero : {true, false}) {
            Context ctx;
            ctx.backend = backend;
            ctx.threads = threads;
            const uint64_t seed = static_cast<uint64_t>(rows * 7 + in * 3 + out);
            // x as a slice of a wider tensor (a row stride other than in), 3-D.
            const Tensor x =
                random_tensor({2, rows / 2 + rows % 2, in + 3}, dtype, seed).slice(2, 1, in + 1);
            const Tensor W = random_tensor({out, in}, dtype, seed + 1);
            Shape y_shape = x.shape();
            y_shape.back() = out;
            const Tensor dy = random_tensor(y_shape, dtype, seed + 2);
            const Tensor dW0 = from_zero ? Tensor::zeros({out, in}, dtype)
                                         : random_tensor({out, in}, dtype, seed + 3, -4, 4);
            const Tensor db0 = from_zero ? Tensor::zeros({out}, dtype)
                                         : random_tensor({out}, dtype, seed + 4, -4, 4);
            const LinearGrads want = linear_backward(ctx, dy, x, W, true);
            Tensor dW = dW0.clone(), db = db0.clone();
            const Tensor dx = linear_backward_accumulate(ctx, dy, x, W, dW, &db);
            const std::string what =
                std::to_string(rows) + "x" + std::to_string(in) + "x" + std::to_string(out) + " " +
                std::string(dtype_name(dtype)) + " threads " + std::to_string(threads) +
                (from_zero ? " from 0" : "") + (backend == Backend::kReference ? " reference" : "");
            EXPECT_TRUE(bitwise_equal(dx, want.dx)) << what;
            EXPECT_TRUE(bitwise_equal(db, added(db0, want.db))) << what;
            if (from_zero || dtype != DType::F32 || backend == Backend::kReference) {
              EXPECT_TRUE(bitwise_equal(dW, added(dW0, want.dW))) << what;
            } else {
              // oneDNN adds the old sum into its accumulator before the contraction's blocks:
              // the same sum, rounded in another order.
              EXPECT_TRUE(close(dW, added(dW0, want.dW), 1e-5, 1e-5)) << what;
            }
            // Without a bias sum only the weight gradient moves.
            Tensor dW_only = dW0.clone();
            EXPECT_TRUE(bitwise_equal(linear_backward_accumulate(ctx, dy, x, W, dW_only), want.dx));
            EXPECT_TRUE(bitwise_equal(dW_only, dW)) << what;
          }
        }
      }
    }
  }
}

// linear_relu is relu(linear) and a relu_out in the backward is relu_backward(dx, relu_out), bit
// for bit: every dtype and backend, 1 to 3 threads, products cut into slices and tail pieces
// (3,040 rows) or not, a strided x; the weight and bias gradients do not change.
TEST(LinearRelu, IsTheSeparatePassesBitwise) {
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {5, 3, 2}, {97, 40, 33}, {3040, 128, 256}, {3040, 256, 128}};
  for (const auto& [rows, in, out] : shapes) {
    for (const DType dtype : {DType::F32, DType::BF16, DType::F64}) {
      for (const Backend backend : {Backend::kAuto, Backend::kReference}) {
        const bool loops = backend == Backend::kReference || dtype == DType::F64;
        if (loops && rows * in * out > (int64_t{1} << 20)) continue;
        for (const int threads : {1, 2, 3}) {
          Context ctx;
          ctx.backend = backend;
          ctx.threads = threads;
          const uint64_t seed = static_cast<uint64_t>(rows + in * 5 + out * 11);
          const Tensor x =
              random_tensor({2, rows / 2 + rows % 2, in + 3}, dtype, seed).slice(2, 1, in + 1);
          const Tensor W = random_tensor({out, in}, dtype, seed + 1);
          const Tensor b = random_tensor({out}, dtype, seed + 2);
          const std::string what = std::to_string(rows) + "x" + std::to_string(in) + "x" +
                                   std::to_string(out) + " " + std::string(dtype_name(dtype)) +
                                   " threads " + std::to_string(threads) +
                                   (backend == Backend::kReference ? " reference" : "");
          // Forward: relu(linear) (about half the outputs are negative).
          const Tensor y = linear_relu(ctx, x, W, b);
          EXPECT_TRUE(bitwise_equal(y, relu(ctx, linear(ctx, x, W, b)))) << what;
          EXPECT_TRUE(bitwise_equal(linear_relu(ctx, x, W), relu(ctx, linear(ctx, x, W)))) << what;
          // Backward of a layer whose input is a ReLU's output: x itself rectified.
          const Tensor xr = relu(ctx, x);
          Shape y_shape = xr.shape();
          y_shape.back() = out;
          const Tensor dy = random_tensor(y_shape, dtype, seed + 3);
          const LinearGrads plain = linear_backward(ctx, dy, xr, W, true);
          const LinearGrads fused = linear_backward(ctx, dy, xr, W, true, xr);
          EXPECT_TRUE(bitwise_equal(fused.dx, relu_backward(ctx, plain.dx, xr))) << what;
          EXPECT_TRUE(bitwise_equal(fused.dW, plain.dW)) << what;
          EXPECT_TRUE(bitwise_equal(fused.db, plain.db)) << what;
          Tensor dW = Tensor::zeros({out, in}, dtype), db = Tensor::zeros({out}, dtype);
          Tensor dW2 = dW.clone(), db2 = db.clone();
          const Tensor dx = linear_backward_accumulate(ctx, dy, xr, W, dW, &db, xr);
          const Tensor dx_plain = linear_backward_accumulate(ctx, dy, xr, W, dW2, &db2);
          EXPECT_TRUE(bitwise_equal(dx, relu_backward(ctx, dx_plain, xr))) << what;
          EXPECT_TRUE(bitwise_equal(dW, dW2)) << what;
          EXPECT_TRUE(bitwise_equal(db, db2)) << what;
        }
      }
    }
  }
}

// linear_of_parameter_into (a decoder step's new keys straight into its cache) writes the bits
// linear returns into a view whose rows share one stride, and nothing else of the tensor the view
// is of: every dtype and backend, 1 and 2 threads; a view it cannot write is an error.
TEST(LinearInto, WritesLinearsBitsIntoAStridedViewOnly) {
  for (const DType dtype : {DType::F32, DType::BF16, DType::F64}) {
    for (const Backend backend : {Backend::kAuto, Backend::kReference}) {
      for (const int threads : {1, 2}) {
        Context ctx;
        ctx.backend = backend;
        ctx.threads = threads;
        const int64_t B = 37, E = 24, O = 40, cap = 6, L = 4;
        const Tensor x = random_tensor({B, 1, E}, dtype, 11);
        const Tensor W = random_tensor({O, E}, dtype, 12), b = random_tensor({O}, dtype, 13);
        const Tensor cache = random_tensor({B, cap, O}, dtype, 14), before = cache.clone();
        const std::string what = std::string(dtype_name(dtype)) + " threads " +
                                 std::to_string(threads) +
                                 (backend == Backend::kReference ? " reference" : "");
        detail::linear_of_parameter_into(ctx, x, W, b, cache.slice(1, L, L + 1));
        EXPECT_TRUE(bitwise_equal(cache.slice(1, L, L + 1), linear(ctx, x, W, b))) << what;
        for (const auto& [lo, hi] : {std::pair<int64_t, int64_t>{0, L}, {L + 1, cap}})
          EXPECT_TRUE(bitwise_equal(cache.slice(1, lo, hi), before.slice(1, lo, hi))) << what;
        // One batch row of several positions: its rows are contiguous.
        const Tensor x3 = random_tensor({1, 3, E}, dtype, 15);
        detail::linear_of_parameter_into(ctx, x3, W, Tensor(), cache.slice(0, 2, 3).slice(1, 1, 4));
        EXPECT_TRUE(bitwise_equal(cache.slice(0, 2, 3).slice(1, 1, 4), linear(ctx, x3, W))) << what;
      }
    }
  }
  Context ctx;
  const Tensor x = random_tensor({4, 2, 8}), W = random_tensor({5, 8});
  const Tensor cache = Tensor::zeros({4, 6, 5}, DType::F64);
  // Two batch rows of two positions each: the rows do not share one stride.
  EXPECT_THROW(detail::linear_of_parameter_into(ctx, x, W, Tensor(), cache.slice(1, 0, 2)), Error);
  EXPECT_THROW(detail::linear_of_parameter_into(ctx, x, W, Tensor(), Tensor::zeros({4, 2, 4})),
               Error);  // shape
  EXPECT_THROW(
      detail::linear_of_parameter_into(ctx, x, W, Tensor(), Tensor::zeros({4, 2, 5}, DType::F32)),
      Error);  // dtype
  EXPECT_THROW(detail::linear_of_parameter_into(ctx, x, W, Tensor(), Tensor()), Error);
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
  expect_error([&] { linear_relu(ctx, x, random_tensor({3, 5})); }, "linear_relu");
  expect_error(
      [&] {
        linear_backward(ctx, random_tensor({2, 3}), x, W, true, random_tensor({2, 5}));
      },
      "linear_backward");
  expect_error(
      [&] {
        Tensor dW = Tensor::zeros({3, 4});
        linear_backward_accumulate(ctx, random_tensor({2, 3}), x, W, dW, nullptr, x.to(DType::F32));
      },
      "linear_backward_accumulate");
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
  // The sums: x's dtype, the parameters' shapes, contiguous.
  Tensor dy = random_tensor({2, 3}), dW = Tensor::zeros({3, 4}, DType::F64);
  Tensor db = Tensor::zeros({3}, DType::F64), none;
  Tensor wrong_shape = Tensor::zeros({4, 3}, DType::F64),
         wrong_dtype = Tensor::zeros({3, 4}, DType::F32);
  Tensor strided = Tensor::zeros({4, 3}, DType::F64).transpose(0, 1);
  Tensor short_b = Tensor::zeros({2}, DType::F64);
  linear_backward_accumulate(ctx, dy, x, W, dW, &db);
  for (Tensor* bad : {&wrong_shape, &wrong_dtype, &strided, &none})
    expect_error([&] { linear_backward_accumulate(ctx, dy, x, W, *bad, &db); },
                 "linear_backward_accumulate");
  expect_error([&] { linear_backward_accumulate(ctx, dy, x, W, dW, &short_b); },
               "linear_backward_accumulate");
  expect_error(
      [&] {
        linear_backward_accumulate(ctx, random_tensor({2, 4}), x, W, dW);
      },
      "linear_backward_accumulate");
}

}  // namespace
}  // namespace attn
