// nn::AddNorm's fused float32 CPU path (kernels/cpu/add_norm.hpp: dropout + residual add +
// LayerNorm in one pass per chunk of rows, and one fused backward) against its oracle, the
// separate ops it replaces on the same backend: attn::dropout, the float add, layer_norm, then
// layer_norm_backward and dropout_backward. They do the same arithmetic, so outputs, dX, dY and
// the LayerNorm parameter gradients must agree bit for bit: dropout 0, > 0 and 1, eval mode, odd
// E, a strided Y, 1 and 2 threads, shapes over several chunks of rows, a nonzero
// Context::dropout_first_sample. Against the reference backend (unfused, double accumulation) to
// float32 rounding. And the mask helpers it uses (kernels/cpu/dropout_simd.hpp: the mask drawn once
// as bytes, then applied) against cpu::dropout_range_f32's draw, bitwise, at unaligned starts.
#include "attn/core/context.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/dropout.hpp"
#include "attn/ops/layer_norm.hpp"
#include "kernels/cpu/dropout_simd.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

struct Outputs {
  Tensor out, dX, dY, dgamma, dbeta;
  uint64_t offsets_taken = 0;
};

::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  return testing::close(a, b, 0.0, 0.0);
}

// A module with non-trivial LayerNorm parameters (ones and zeros would hide gamma's use).
nn::AddNorm make_add_norm(int64_t E, double p, bool training) {
  nn::AddNorm an(E, p, DType::F32);
  an.ln.weight.value = random_tensor({E}, DType::F32, 21, 0.5, 1.5);
  an.ln.bias.value = random_tensor({E}, DType::F32, 22);
  an.train(training);
  return an;
}

// The module under test: forward, then backward of dout.
Outputs run_module(Context ctx, const Tensor& X, const Tensor& Y, const Tensor& dout, double p,
                   bool training) {
  nn::AddNorm an = make_add_norm(X.dim(-1), p, training);
  const uint64_t before = ctx.dropout_offset();
  Outputs o;
  o.out = an.forward(ctx, X, Y);
  o.offsets_taken = ctx.dropout_offset() - before;
  nn::AddNormGrads g = an.backward(ctx, dout);
  o.dX = g.dX;
  o.dY = g.dY;
  o.dgamma = an.ln.weight.grad;
  o.dbeta = an.ln.bias.grad;
  return o;
}

// The separate ops, in AddNorm's order: Z = dropout(Y) + X, out = layer_norm(Z); dZ =
// layer_norm_backward, dX = dZ, dY = dropout_backward(dZ).
Outputs run_oracle(Context ctx, const Tensor& X, const Tensor& Y, const Tensor& dout, double p,
                   bool training) {
  nn::AddNorm an = make_add_norm(X.dim(-1), p, training);
  const bool dropped = training && p > 0.0;
  const uint64_t offset = ctx.dropout_offset();
  const Tensor Yd = dropped ? dropout(ctx, Y, p, ctx.seed, offset) : Y.contiguous();
  const Tensor Xc = X.contiguous();
  Tensor Z = Tensor::empty(X.shape(), DType::F32);
  for (int64_t i = 0; i < Z.numel(); ++i)
    Z.data<float>()[i] = Yd.data<float>()[i] + Xc.data<float>()[i];
  const LayerNormResult f = layer_norm(ctx, Z, an.ln.weight.value, an.ln.bias.value, an.ln.eps);
  const LayerNormGrads g = layer_norm_backward(ctx, dout, Z, an.ln.weight.value, f);
  Outputs o;
  o.out = f.y;
  o.dX = g.dx;
  o.dY = dropped ? dropout_backward(ctx, g.dx, p, ctx.seed, offset) : g.dx;
  o.dgamma = g.dgamma;
  o.dbeta = g.dbeta;
  o.offsets_taken = dropped ? 1 : 0;
  return o;
}

void expect_same(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.out, b.out)) << what << ": out";
  EXPECT_TRUE(same_bits(a.dX, b.dX)) << what << ": dX";
  EXPECT_TRUE(same_bits(a.dY, b.dY)) << what << ": dY";
  EXPECT_TRUE(same_bits(a.dgamma, b.dgamma)) << what << ": dgamma";
  EXPECT_TRUE(same_bits(a.dbeta, b.dbeta)) << what << ": dbeta";
  EXPECT_EQ(a.offsets_taken, b.offsets_taken) << what;
}

// (B, T, E): small, odd E, and one over several 64-row chunks big enough to run threaded.
const std::vector<Shape> kShapes = {{2, 3, 8}, {3, 7, 13}, {4, 100, 96}};

TEST(AddNormFused, MatchesSeparateOpsBitwise) {
  for (const Shape& shape : kShapes) {
    const Tensor X = random_tensor(shape, DType::F32, 1);
    const Tensor Y = random_tensor(shape, DType::F32, 2, -2.0, 2.0);
    const Tensor dout = random_tensor(shape, DType::F32, 3);
    for (double p : {0.0, 0.1, 0.5, 1.0})
      for (bool training : {true, false})
        for (int threads : {1, 2})
          for (uint64_t first_sample : {uint64_t{0}, uint64_t{3}}) {
            Context ctx;
            ctx.backend = Backend::kCpu;
            ctx.threads = threads;
            ctx.seed = 1234;
            ctx.set_dropout_offset(7);
            ctx.dropout_first_sample = first_sample;
            const std::string what = shape_str(shape) + " p " + std::to_string(p) +
                                     (training ? " train" : " eval") + " threads " +
                                     std::to_string(threads) + " first_sample " +
                                     std::to_string(first_sample);
            expect_same(run_module(ctx, X, Y, dout, p, training),
                        run_oracle(ctx, X, Y, dout, p, training), what);
          }
  }
}

TEST(AddNormFused, ThreadCountAndStridedInputsDoNotChangeBits) {
  const Shape shape = {4, 100, 96};
  // Y a strided view: the last axis of a wider tensor.
  const Tensor wide = random_tensor({4, 100, 2 * 96}, DType::F32, 4);
  const Tensor Y = wide.slice(2, 0, 96);
  ASSERT_FALSE(Y.is_contiguous());
  const Tensor X = random_tensor(shape, DType::F32, 5);
  const Tensor dout = random_tensor(shape, DType::F32, 6);
  Context ctx;
  ctx.backend = Backend::kAuto;
  ctx.seed = 99;
  ctx.threads = 1;
  const Outputs one = run_module(ctx, X, Y, dout, 0.3, true);
  expect_same(one, run_oracle(ctx, X, Y, dout, 0.3, true), "strided Y");
  ctx.threads = 2;
  expect_same(run_module(ctx, X, Y, dout, 0.3, true), one, "2 threads vs 1");
}

TEST(AddNormFused, CloseToTheReferenceBackend) {
  const Shape shape = {3, 7, 13};
  const Tensor X = random_tensor(shape, DType::F32, 7);
  const Tensor Y = random_tensor(shape, DType::F32, 8);
  const Tensor dout = random_tensor(shape, DType::F32, 9);
  for (double p : {0.0, 0.25}) {
    Context ctx;
    ctx.seed = 5;
    ctx.dropout_first_sample = 2;
    ctx.backend = Backend::kCpu;
    const Outputs fast = run_module(ctx, X, Y, dout, p, true);
    ctx.backend = Backend::kReference;
    const Outputs ref = run_module(ctx, X, Y, dout, p, true);
    EXPECT_TRUE(testing::close(fast.out, ref.out, 1e-5, 1e-5)) << "p " << p;
    EXPECT_TRUE(testing::close(fast.dX, ref.dX, 1e-5, 1e-5)) << "p " << p;
    EXPECT_TRUE(testing::close(fast.dY, ref.dY, 1e-5, 1e-5)) << "p " << p;
    EXPECT_TRUE(testing::close(fast.dgamma, ref.dgamma, 1e-5, 1e-5)) << "p " << p;
    EXPECT_TRUE(testing::close(fast.dbeta, ref.dbeta, 1e-5, 1e-5)) << "p " << p;
  }
}

// backward(dout, dout_add), a residual's two gradient terms summed inside the pass, against
// backward of their float sum: the same bits, float32 or bf16 second term, with dropout, bf16 dy
// under autocast, fused (kCpu) and not (kReference), 1 and 2 threads.
TEST(AddNormFused, TwoGradientTermsAreTheirSumBitwise) {
  for (const Shape& shape : kShapes) {
    const Tensor X = random_tensor(shape, DType::F32, 31);
    const Tensor Y = random_tensor(shape, DType::F32, 32, -2.0, 2.0);
    const Tensor dout = random_tensor(shape, DType::F32, 33);
    for (const DType add_dtype : {DType::F32, DType::BF16})
      for (const Backend backend : {Backend::kCpu, Backend::kReference})
        for (const bool bf16_dy : {false, true})
          for (const double p : {0.0, 0.3})
            for (const int threads : {1, 2}) {
              const Tensor add = random_tensor(shape, add_dtype, 34, -3.0, 3.0);
              Tensor sum = Tensor::empty(shape, DType::F32);
              for (int64_t i = 0; i < sum.numel(); ++i)
                sum.data<float>()[i] = dout.data<float>()[i] + static_cast<float>(add.flat(i));
              Context ctx;
              ctx.backend = backend;
              ctx.threads = threads;
              ctx.seed = 77;
              ctx.autocast_bf16 = bf16_dy;
              std::vector<nn::AddNormGrads> grads;
              std::vector<Tensor> ln_grads;
              for (const bool two_terms : {true, false}) {
                nn::AddNorm an = make_add_norm(X.dim(-1), p, true);
                an.bf16_dy = bf16_dy;
                Context c = ctx;
                an.forward(c, X, Y);
                grads.push_back(two_terms ? an.backward(c, dout, add) : an.backward(c, sum));
                ln_grads.push_back(an.ln.weight.grad);
                ln_grads.push_back(an.ln.bias.grad);
              }
              const std::string what = shape_str(shape) + " " + std::string(dtype_name(add_dtype)) +
                                       (backend == Backend::kCpu ? " fused" : " reference") +
                                       (bf16_dy ? " bf16 dy" : "") + " p " + std::to_string(p) +
                                       " threads " + std::to_string(threads);
              EXPECT_TRUE(same_bits(grads[0].dX, grads[1].dX)) << what;
              EXPECT_TRUE(same_bits(grads[0].dY, grads[1].dY)) << what;
              EXPECT_EQ(grads[0].dY.dtype(), grads[1].dY.dtype()) << what;
              EXPECT_TRUE(same_bits(ln_grads[0], ln_grads[2])) << what << ": dgamma";
              EXPECT_TRUE(same_bits(ln_grads[1], ln_grads[3])) << what << ": dbeta";
            }
  }
}

TEST(AddNormFused, ChecksAsTheSeparateOps) {
  Context ctx;
  ctx.backend = Backend::kCpu;
  nn::AddNorm an(8, 0.1, DType::F32);
  an.train();
  EXPECT_THROW(an.backward(ctx, Tensor::zeros({2, 8}, DType::F32)), Error);  // before forward
  EXPECT_THROW(an.forward(ctx, Tensor::zeros({2, 7}), Tensor::zeros({2, 7})), Error);  // E != 8
  an.forward(ctx, Tensor::zeros({2, 8}), Tensor::zeros({2, 8}));
  EXPECT_THROW(an.backward(ctx, Tensor::zeros({2, 9}, DType::F32)), Error);  // dout's shape
  EXPECT_THROW(an.backward(ctx, Tensor::zeros({2, 8}, DType::F64)), Error);  // dout's dtype
  // The second term: dout's shape, and dout's dtype or bf16.
  const Tensor dout = Tensor::zeros({2, 8}, DType::F32);
  EXPECT_THROW(an.backward(ctx, dout, Tensor::zeros({2, 9}, DType::F32)), Error);
  EXPECT_THROW(an.backward(ctx, dout, Tensor::zeros({2, 8}, DType::F64)), Error);
}

TEST(AddNormFused, SavedMaskIsDropoutRangesDraw) {
  constexpr int64_t n = 300;
  std::vector<float> x(n), add(n), want(n), got(n), got_sum(n);
  for (int64_t i = 0; i < n; ++i) {
    x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
    add[static_cast<size_t>(i)] = std::cos(0.11f * static_cast<float>(i));
  }
  x[5] = -0.0f;  // dropped: -0 * 0.0 stays -0
  x[9] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> keep(n);
  for (double p : {0.1, 0.5, 1.0})
    for (uint64_t index_base : {uint64_t{0}, uint64_t{1}, uint64_t{6}, uint64_t{4099}})
      for (int64_t begin : {int64_t{0}, int64_t{3}, int64_t{130}}) {
        const uint32_t threshold = static_cast<uint32_t>(
            std::ceil(static_cast<double>(static_cast<float>(p)) * 16777216.0));
        const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
        std::fill(want.begin(), want.end(), 7.0f);
        std::fill(got.begin(), got.end(), 7.0f);
        cpu::dropout_range_f32(x.data(), want.data(), begin, n, threshold, scale, 42, 3,
                               index_base);
        cpu::dropout_keep_range(keep.data(), begin, n, threshold, 42, 3, index_base);
        cpu::dropout_apply_keep_f32(x.data(), keep.data(), nullptr, got.data(), begin, n, scale);
        EXPECT_EQ(std::memcmp(want.data(), got.data(), sizeof(float) * n), 0)
            << "p " << p << " index_base " << index_base << " begin " << begin;
        cpu::dropout_apply_keep_f32(x.data(), keep.data(), add.data(), got_sum.data(), begin, n,
                                    scale);
        for (int64_t i = begin; i < n; ++i) {
          const float sum = want[static_cast<size_t>(i)] + add[static_cast<size_t>(i)];
          EXPECT_EQ(std::memcmp(&sum, &got_sum[static_cast<size_t>(i)], sizeof(float)), 0)
              << "sum at " << i << " p " << p << " index_base " << index_base;
        }
      }
}

}  // namespace
}  // namespace attn
