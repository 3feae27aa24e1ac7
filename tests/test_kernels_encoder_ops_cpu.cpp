// The fast float32 CPU paths of dropout, ReLU and LayerNorm (kernels/cpu/encoder_ops) against the
// reference backend, over sweeps of shapes (sizes around the parallel chunk bounds, odd widths),
// drop probabilities, seeds, offsets and thread counts.
//
// Expected: dropout (forward and backward) and ReLU (both) give the reference's bits exactly (the
// same arithmetic per element). LayerNorm sums in double in another order than the reference, so
// its y, mean, rstd, dx, dgamma and dbeta agree to float32 rounding (rtol 2^-22, 2 ulp; a
// difference in the double sums can only move a float32 result across a rounding boundary).
// Every result is identical for 1, 2 and 3 threads.
#include "attn/core/context.hpp"
#include "attn/ops/activation.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/dropout.hpp"
#include "attn/ops/layer_norm.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

Context context(Backend backend, int threads) {
  Context ctx;
  ctx.backend = backend;
  ctx.threads = threads;
  return ctx;
}

// Bitwise equality (NaN == NaN, -0 != +0), naming the first differing element.
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != DType::F32 || b.dtype() != DType::F32)
    return ::testing::AssertionFailure() << "shape/dtype differ";
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  const float* pa = ac.data<float>();
  const float* pb = bc.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i, pb + i, sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << " of " << shape_str(a.shape())
                                           << ": " << pa[i] << " vs " << pb[i];
  return ::testing::AssertionSuccess();
}

const std::vector<Shape> kShapes = {{1},     {3},           {5, 7},         {4097},     {16384},
                                    {16385}, {2, 16384, 3}, {32, 128, 128}, {3, 33, 1}, {40000}};

Tensor with_specials(Shape shape, uint64_t seed) {
  Tensor x = random_tensor(shape, DType::F32, seed, -3.0, 3.0);
  // Zeros of both signs and a NaN, where the tensor is big enough.
  if (x.numel() > 3) {
    x.set_flat(0, 0.0);
    x.set_flat(1, -0.0);
    x.set_flat(2, std::numeric_limits<double>::quiet_NaN());
  }
  return x;
}

TEST(EncoderOpsCpu, DropoutMatchesReferenceBitForBit) {
  for (const Shape& shape : kShapes) {
    const Tensor x = with_specials(shape, 1);
    for (double p : {0.0, 0.1, 0.5, 0.9, 1.0}) {
      for (uint64_t seed : {0ull, 7ull, 0x123456789abcdefull}) {
        const uint64_t offset = seed * 3 + 1;
        Context ref = context(Backend::kReference, 1);
        const Tensor want = dropout(ref, x, p, seed, offset);
        const Tensor want_b = dropout_backward(ref, x, p, seed, offset);
        // The Context-free op is the reference too.
        ASSERT_TRUE(same_bits(want, attn::dropout(x, p, seed, offset)));
        for (int threads : {1, 2, 3}) {
          SCOPED_TRACE(::testing::Message() << shape_str(shape) << " p " << p << " seed " << seed
                                            << " threads " << threads);
          Context fast = context(Backend::kAuto, threads);
          EXPECT_TRUE(same_bits(dropout(fast, x, p, seed, offset), want));
          EXPECT_TRUE(same_bits(dropout_backward(fast, x, p, seed, offset), want_b));
        }
      }
    }
  }
}

TEST(EncoderOpsCpu, ReluMatchesReferenceBitForBit) {
  for (const Shape& shape : kShapes) {
    const Tensor x = with_specials(shape, 2), dy = random_tensor(shape, DType::F32, 3);
    Context ref = context(Backend::kReference, 1);
    const Tensor y = relu(ref, x), dx = relu_backward(ref, dy, x);
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << shape_str(shape) << " threads " << threads);
      Context fast = context(Backend::kCpu, threads);
      EXPECT_TRUE(same_bits(relu(fast, x), y));
      EXPECT_TRUE(same_bits(relu_backward(fast, dy, x), dx));
    }
  }
}

TEST(EncoderOpsCpu, LayerNormMatchesReference) {
  const std::vector<Shape> shapes = {{1, 1},    {3, 5},     {7, 128},       {64, 3},
                                     {65, 17},  {129, 128}, {32, 128, 128}, {2, 100, 24},
                                     {4096, 1}, {1000, 33}};
  for (const Shape& shape : shapes) {
    const int64_t E = shape.back();
    const Tensor x = random_tensor(shape, DType::F32, 4, -2.0, 3.0);
    const Tensor dy = random_tensor(shape, DType::F32, 5);
    const Tensor gamma = random_tensor({E}, DType::F32, 6, 0.5, 1.5);
    const Tensor beta = random_tensor({E}, DType::F32, 7);
    for (bool affine : {true, false}) {
      const Tensor g = affine ? gamma : Tensor(), b = affine ? beta : Tensor();
      Context ref = context(Backend::kReference, 1);
      const LayerNormResult want = layer_norm(ref, x, g, b, 1e-5);
      const LayerNormGrads want_g = layer_norm_backward(ref, dy, x, g, want);
      LayerNormGrads first;
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << shape_str(shape) << (affine ? " affine" : "") << " threads " << threads);
        Context fast = context(Backend::kAuto, threads);
        const LayerNormResult got = layer_norm(fast, x, g, b, 1e-5);
        // y is O(1) (up to |gamma| 1.5 * a few sigma): 2 ulp of it, plus as much absolute
        // near 0, where the reference's and this path's roundings of (x - mean) * rstd meet.
        EXPECT_TRUE(testing::close(got.y, want.y, 2.4e-7, 1e-6));
        EXPECT_TRUE(testing::close(got.mean, want.mean, 2.4e-7, 1e-7));
        EXPECT_TRUE(testing::close(got.rstd, want.rstd, 2.4e-7, 0));
        // dx from the reference's saved statistics, so only the backward's sums differ.
        const LayerNormGrads grads = layer_norm_backward(fast, dy, x, g, want);
        EXPECT_TRUE(testing::close(grads.dx, want_g.dx, 2.4e-7, 1e-6));
        if (threads == 1) {
          first = grads;
        } else {  // the same bits for any thread count
          EXPECT_TRUE(same_bits(grads.dx, first.dx));
          EXPECT_TRUE(same_bits(layer_norm(fast, x, g, b, 1e-5).y, got.y));
        }
        if (!affine) continue;
        // Column sums over the rows in double, added in chunks: float32 rounding apart.
        EXPECT_TRUE(testing::close(grads.dgamma, want_g.dgamma, 2.4e-7, 1e-6));
        EXPECT_TRUE(testing::close(grads.dbeta, want_g.dbeta, 2.4e-7, 1e-6));
        if (threads != 1) {
          EXPECT_TRUE(same_bits(grads.dgamma, first.dgamma));
          EXPECT_TRUE(same_bits(grads.dbeta, first.dbeta));
        }
      }
    }
  }
}

}  // namespace
}  // namespace attn
