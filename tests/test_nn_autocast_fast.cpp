// The fast paths of mixed precision (Context::autocast_bf16) against the paths they replace,
// forward and backward, bit for bit where the arithmetic is the same:
//   - the bulk float32 <-> bfloat16 conversions (Tensor::to, one clone per SIMD target) are the
//     scalar float_to_bf16 / bf16_to_float element by element, special values and tails included;
//   - bf16 relu / relu_backward (ops/activation) are the float32 ones on the widened values,
//     rounded back (exact), on the reference and the CPU backend, across chunk boundaries;
//   - accumulating a bf16 gradient into a float32 one (nn/internal.hpp's accumulate, every
//     autocast weight gradient) is the generic element-by-element sum;
//   - Linear::forward(ctx, x, BF16) on a float32 x is Linear::forward(ctx, x) rounded to bf16;
//     Linear::forward_relu / backward_relu are the separate relu passes;
//   - PositionWiseFFN under autocast, whose hidden layer stays bf16 from dense1 to dense2, is the
//     float32 round trip (dense1's y widened, relu in float32, rounded again by dense2) that it
//     replaced, output and every gradient;
//   - the bf16 seams of a TransformerEncoderBlock (its sublayers' bf16 outputs and gradients
//     handed on as bf16, widened and rounded inside the fused AddNorm and add_all): AddNorm with a
//     bf16 Y and its bf16 output and dY are the float32 AddNorm's values converted, add_all widens
//     a bf16 term as .to(F32) would, the FFN on a bf16 input is the FFN on the float32 one, and a
//     whole block with the seams on is the block with them off, output and every gradient.
#include "attn/nn/decoder.hpp"
#include "attn/nn/module.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/activation.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

// Bitwise equality of two tensors of the same dtype, with the first difference in the message.
void expect_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  const auto* x = static_cast<const unsigned char*>(ac.raw_data());
  const auto* y = static_cast<const unsigned char*>(bc.raw_data());
  const size_t width = dtype_size(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i)
    for (size_t k = 0; k < width; ++k)
      ASSERT_EQ(x[i * width + k], y[i * width + k]) << what << ": first difference at index " << i;
}

// n bf16 values: random ones with the special values (+-0, NaN, +-inf, subnormals, the smallest
// normals) sprinkled in.
Tensor special_bf16(int64_t n, uint64_t seed) {
  Tensor t = random_tensor({n}, DType::F32, seed);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            1e-40f,
                            -1e-40f,
                            std::numeric_limits<float>::min(),
                            -std::numeric_limits<float>::min()};
  float* p = t.data<float>();
  for (int64_t i = 0; i < n; i += 7)
    p[i] = specials[(i / 7) % std::size(specials)];
  return t.to(DType::BF16);
}

TEST(AutocastFast, BulkConversionsAreTheScalarOnes) {
  // Counts 0..2x the widest vector (16 lanes) and more, at an aligned and a misaligned start.
  for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 33, 100, 1000}) {
    for (int64_t start : {0, 1}) {
      const Tensor whole = special_bf16(n + start, 5 + static_cast<uint64_t>(n)).to(DType::F32);
      // Values that are not bf16 values (so the rounding is exercised), plus exact ties.
      float* p = whole.data<float>();
      for (int64_t i = 0; i < whole.numel(); ++i)
        if (i % 7 != 0) p[i] = p[i] * 1.0009765f + (i % 3 == 0 ? 0.0f : 1e-3f);
      for (int64_t i = 3; i < whole.numel(); i += 11) {
        uint32_t u = 0x3f808000u + (static_cast<uint32_t>(i % 2) << 16);  // a tie, odd or even
        std::memcpy(&p[i], &u, 4);
      }
      const Tensor x = whole.slice(0, start, start + n);
      const Tensor y = x.to(DType::BF16);
      const auto* yb = static_cast<const uint16_t*>(y.raw_data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(yb[i], float_to_bf16(x.data<float>()[i])) << "n=" << n << " i=" << i;
      const Tensor back = y.slice(0, 0, n).to(DType::F32);
      for (int64_t i = 0; i < n; ++i) {
        const float f = back.data<float>()[i], g = bf16_to_float(yb[i]);
        ASSERT_EQ(std::memcmp(&f, &g, 4), 0) << "widening n=" << n << " i=" << i;
      }
    }
  }
}

TEST(AutocastFast, Bf16ReluIsTheFloat32ReluRounded) {
  // Sizes around the CPU kernel's parallel chunk (16384) and threshold (32768).
  for (int64_t n : {0, 1, 15, 17, 16384, 16385, 40000}) {
    for (Backend backend : {Backend::kReference, Backend::kCpu}) {
      for (int threads : {1, 2}) {
        Context ctx;
        ctx.backend = backend;
        ctx.threads = threads;
        const Tensor x = special_bf16(n, 3 + static_cast<uint64_t>(n));
        const Tensor dy = special_bf16(n, 4 + static_cast<uint64_t>(n));
        const std::string what = "n=" + std::to_string(n) + " threads=" + std::to_string(threads) +
                                 (backend == Backend::kReference ? " ref" : " cpu");
        const Tensor y = relu(ctx, x);
        ASSERT_EQ(y.dtype(), DType::BF16);
        expect_same_bits(y, relu(ctx, x.to(DType::F32)).to(DType::BF16), "relu " + what);
        expect_same_bits(relu_backward(ctx, dy, x),
                         relu_backward(ctx, dy.to(DType::F32), x.to(DType::F32)).to(DType::BF16),
                         "relu_backward " + what);
      }
    }
  }
}

TEST(AutocastFast, Bf16GradientAccumulatesAsTheGenericSum) {
  for (int64_t n : {1, 17, 300}) {
    Tensor grad = random_tensor({n}, DType::F32, 31);
    const Tensor g = special_bf16(n, 32);
    // The generic path's value: float(grad) + float(double(g)), element by element.
    Tensor want = grad.clone();
    for (int64_t i = 0; i < n; ++i)
      want.data<float>()[i] += static_cast<float>(g.flat(i));
    nn::detail::accumulate(grad, g);
    expect_same_bits(grad, want, "n=" + std::to_string(n));
  }
}

TEST(AutocastFast, LinearBf16OutputIsTheFloat32OutputRounded) {
  Context ctx;
  ctx.threads = 1;
  ctx.autocast_bf16 = true;
  nn::Linear l(24, 40, true, DType::F32, 3);
  const Tensor x = random_tensor({2, 5, 40}, DType::F32, 7);
  const Tensor y32 = l.forward(ctx, x);
  const Tensor y16 = l.forward(ctx, x, DType::BF16);
  EXPECT_EQ(y32.dtype(), DType::F32);
  ASSERT_EQ(y16.dtype(), DType::BF16);
  expect_same_bits(y16, y32.to(DType::BF16), "y");
  // Without autocast a float32 layer only gives float32.
  ctx.autocast_bf16 = false;
  EXPECT_THROW(l.forward(ctx, x, DType::BF16), Error);
}

// The path PositionWiseFFN took before its hidden layer stayed bf16: each Linear widens its
// bf16 product to float32, relu runs in float32, dense2 rounds its input to bf16 again.
struct Float32RoundTripFFN {
  nn::Linear dense1, dense2;
  Tensor hidden;
  Tensor forward(Context& ctx, const Tensor& X) {
    hidden = dense1.forward(ctx, X);
    return dense2.forward(ctx, relu(ctx, hidden));
  }
  Tensor backward(Context& ctx, const Tensor& dout) {
    return dense1.backward(ctx, relu_backward(ctx, dense2.backward(ctx, dout), hidden));
  }
};

TEST(AutocastFast, FfnWithBf16HiddenIsTheFloat32RoundTrip) {
  const int64_t B = 3, T = 11, E = 32, F = 64;
  for (int threads : {1, 2}) {
    Context ctx;
    ctx.threads = threads;
    ctx.autocast_bf16 = true;
    nn::PositionWiseFFN ffn(F, E, DType::F32, 9);
    const Tensor X = random_tensor({B, T, E}, DType::F32, 21);
    const Tensor dout = random_tensor({B, T, E}, DType::F32, 22);
    ffn.forward(ctx, X);  // materialises the lazy layers
    ffn.zero_grad();
    Float32RoundTripFFN old{nn::Linear(F, E, true, DType::F32), nn::Linear(E, F, true, DType::F32),
                            Tensor()};
    old.dense1.load_state_dict(ffn.dense1.state_dict());
    old.dense2.load_state_dict(ffn.dense2.state_dict());

    const Tensor y = ffn.forward(ctx, X);
    const Tensor y_old = old.forward(ctx, X);
    ASSERT_EQ(y.dtype(), DType::F32);
    expect_same_bits(y, y_old, "output");
    const Tensor dX = ffn.backward(ctx, dout);
    const Tensor dX_old = old.backward(ctx, dout);
    ASSERT_EQ(dX.dtype(), DType::F32);
    expect_same_bits(dX, dX_old, "dX");
    expect_same_bits(ffn.dense1.weight.grad, old.dense1.weight.grad, "dense1.weight.grad");
    expect_same_bits(ffn.dense1.bias.grad, old.dense1.bias.grad, "dense1.bias.grad");
    expect_same_bits(ffn.dense2.weight.grad, old.dense2.weight.grad, "dense2.weight.grad");
    expect_same_bits(ffn.dense2.bias.grad, old.dense2.bias.grad, "dense2.bias.grad");
  }
}

// Linear::forward_relu / backward_relu (the FFN's fused ReLU) are forward + relu and
// relu_backward + backward, bit for bit, output and gradients: float32, and under autocast with a
// bf16 y / bf16 relu_out (fused) and a float32 one (masked after the widening); rows enough that
// the products are cut into slices on 2 threads.
TEST(AutocastFast, LinearReluIsTheSeparatePasses) {
  const int64_t B = 3, T = 400, I = 48, O = 64;
  for (const bool autocast : {false, true}) {
    for (const DType y_dtype : {DType::F32, DType::BF16}) {
      if (!autocast && y_dtype == DType::BF16) continue;
      for (const int threads : {1, 2}) {
        Context ctx;
        ctx.threads = threads;
        ctx.autocast_bf16 = autocast;
        const std::string what = std::string(autocast ? "autocast " : "") +
                                 std::string(dtype_name(y_dtype)) + " threads " +
                                 std::to_string(threads);
        nn::Linear fused(O, I, true, DType::F32, 5), plain(O, I, true, DType::F32, 5);
        const Tensor x = random_tensor({B, T, I}, DType::F32, 31);
        const Tensor y = fused.forward_relu(ctx, x, y_dtype);
        const Tensor y_plain = relu(ctx, plain.forward(ctx, x, y_dtype));
        expect_same_bits(y, y_plain, what + ": y");
        // A second layer fed by the ReLU's output.
        nn::Linear next(I, O, true, DType::F32, 6), next_plain(I, O, true, DType::F32, 6);
        next.forward(ctx, y, DType::F32);
        next_plain.forward(ctx, y_plain, DType::F32);
        const Tensor dout = random_tensor({B, T, I}, DType::F32, 32);
        const Tensor dy = next.backward_relu(ctx, dout, y);
        const Tensor dy_plain = relu_backward(ctx, next_plain.backward(ctx, dout), y_plain);
        expect_same_bits(dy, dy_plain, what + ": dy");
        expect_same_bits(next.weight.grad, next_plain.weight.grad, what + ": weight.grad");
        expect_same_bits(next.bias.grad, next_plain.bias.grad, what + ": bias.grad");
      }
    }
  }
}

// AddNorm under autocast with bf16_output, bf16_dy and a bf16 Y, against the float32 AddNorm on
// Y.to(F32): the same output; output_bf16() its rounding; dX the same and dY (bf16) the float dY
// rounded; the same LayerNorm gradients. Over chunk boundaries and the parallel split, with and
// without dropout. Without autocast the flag changes nothing.
TEST(AutocastFast, AddNormSeamsAreTheFloat32Conversions) {
  const int64_t B = 4, T = 301, E = 32;  // 1204 rows: 19 chunks of 64, 38528 elements (parallel)
  const Tensor X = random_tensor({B, T, E}, DType::F32, 31);
  const Tensor Y = random_tensor({B, T, E}, DType::F32, 32).to(DType::BF16);
  const Tensor dout = random_tensor({B, T, E}, DType::F32, 33);
  for (double p : {0.0, 0.3}) {
    for (int threads : {1, 2}) {
      auto make = [&](bool seams) {
        nn::AddNorm an(E, p, DType::F32);
        an.ln.weight.value = random_tensor({E}, DType::F32, 21, 0.5, 1.5);
        an.ln.bias.value = random_tensor({E}, DType::F32, 22);
        an.train(true);
        an.bf16_output = an.bf16_dy = seams;
        return an;
      };
      const std::string what = "p " + std::to_string(p) + ", threads " + std::to_string(threads);
      Context c1, c2;
      c1.threads = c2.threads = threads;
      c1.autocast_bf16 = c2.autocast_bf16 = true;
      c1.seed = c2.seed = 7;
      nn::AddNorm seams = make(true), plain = make(false);
      const Tensor out = seams.forward(c1, X, Y);
      const Tensor out_plain = plain.forward(c2, X, Y.to(DType::F32));
      expect_same_bits(out, out_plain, what + ": output");
      ASSERT_TRUE(seams.output_bf16().defined()) << what;
      EXPECT_FALSE(plain.output_bf16().defined()) << what;
      expect_same_bits(seams.output_bf16(), out_plain.to(DType::BF16), what + ": output_bf16");
      const nn::AddNormGrads g = seams.backward(c1, dout);
      const nn::AddNormGrads g_plain = plain.backward(c2, dout);
      expect_same_bits(g.dX, g_plain.dX, what + ": dX");
      ASSERT_EQ(g.dY.dtype(), DType::BF16) << what;
      expect_same_bits(g.dY, g_plain.dY.to(DType::BF16), what + ": dY");
      expect_same_bits(seams.ln.weight.grad, plain.ln.weight.grad, what + ": dgamma");
      expect_same_bits(seams.ln.bias.grad, plain.ln.bias.grad, what + ": dbeta");
    }
  }
  // Off autocast: a float32 dY and no bf16 output, and a bf16 Y is an error naming AddNorm.
  Context ctx;
  nn::AddNorm an(E, 0.0, DType::F32);
  an.bf16_output = an.bf16_dy = true;
  an.forward(ctx, X, Y.to(DType::F32));
  EXPECT_FALSE(an.output_bf16().defined());
  EXPECT_EQ(an.backward(ctx, dout).dY.dtype(), DType::F32);
  try {
    an.forward(ctx, X, Y);
    FAIL() << "a bf16 Y without autocast was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("AddNorm"), std::string::npos) << e.what();
  }
}

// add_all with bf16 terms after a float32 one: each widened as it is added, the sum of the
// .to(F32) terms, over several parallel chunks and with a strided term.
TEST(AutocastFast, AddAllWidensBf16Terms) {
  const int64_t n = 3 * (int64_t{1} << 14) + 5;
  const Tensor a = random_tensor({n}, DType::F32, 41);
  const Tensor b = special_bf16(n, 42);
  const Tensor wide = special_bf16(2 * n, 43);
  const Tensor c = wide.reshape({n, 2}).select(1, 1);  // stride 2
  for (int threads : {1, 2, 3}) {
    expect_same_bits(nn::detail::add_all({a, b}, threads),
                     nn::detail::add_all({a, b.to(DType::F32)}, threads), "a + b");
    expect_same_bits(nn::detail::add_all({a, b, c}, threads),
                     nn::detail::add_all({a, b.to(DType::F32), c.to(DType::F32)}, threads),
                     "a + b + c");
  }
  EXPECT_THROW(nn::detail::add_all({b, a}), Error);  // bf16 first: not a float32 sum
}

// The FFN under autocast on a bf16 input: dense1 reads it as it would have rounded the float32
// input, so the output (bf16) and dX (bf16) are the float32-input values rounded (exactly: both
// are bf16 results widened there), and the weight gradients are the same.
TEST(AutocastFast, FfnOnBf16InputIsTheFfnOnTheFloat32Input) {
  const int64_t B = 3, T = 11, E = 32, F = 64;
  Context ctx;
  ctx.threads = 2;
  ctx.autocast_bf16 = true;
  nn::PositionWiseFFN a(F, E, DType::F32, 9), b(F, E, DType::F32, 9);
  const Tensor X = random_tensor({B, T, E}, DType::F32, 21);
  const Tensor dout = random_tensor({B, T, E}, DType::F32, 22);
  const Tensor y = a.forward(ctx, X);
  const Tensor y_bf16 = b.forward(ctx, X.to(DType::BF16));
  ASSERT_EQ(y_bf16.dtype(), DType::BF16);
  expect_same_bits(y_bf16.to(DType::F32), y, "output");
  const Tensor dX = a.backward(ctx, dout);
  const Tensor dX_bf16 = b.backward(ctx, dout.to(DType::BF16));
  ASSERT_EQ(dX_bf16.dtype(), DType::BF16);
  expect_same_bits(dX_bf16.to(DType::F32), dX, "dX");
  expect_same_bits(a.dense1.weight.grad, b.dense1.weight.grad, "dense1.weight.grad");
  expect_same_bits(a.dense2.weight.grad, b.dense2.weight.grad, "dense2.weight.grad");
  expect_same_bits(a.dense2.bias.grad, b.dense2.bias.grad, "dense2.bias.grad");
}

// A TransformerEncoderBlock under autocast with its bf16 seams (the default) against the same
// block with them off (every sublayer output and gradient widened to float32 between the
// sublayers, as before): output, dX and every parameter gradient bit for bit. Padded batch,
// dropout, 1 and 2 threads.
TEST(AutocastFast, EncoderBlockSeamsChangeNoBit) {
  const int64_t B = 4, T = 40, E = 32, H = 4, F = 64;
  const Tensor X = random_tensor({B, T, E}, DType::F32, 51);
  const Tensor dout = random_tensor({B, T, E}, DType::F32, 52);
  const Tensor valid_lens = Tensor::from_vector(std::vector<float>{40, 23, 31, 9}, {B});
  for (int threads : {1, 2}) {
    auto run = [&](bool seams, Tensor& out, Tensor& dX) {
      Context ctx;
      ctx.threads = threads;
      ctx.autocast_bf16 = true;
      ctx.seed = 3;
      auto blk = std::make_unique<nn::TransformerEncoderBlock>(E, F, H, 0.1, true, DType::F32, 11);
      blk->attention.bf16_seams = seams;
      blk->addnorm1.bf16_output = blk->addnorm1.bf16_dy = seams;
      blk->addnorm2.bf16_dy = seams;
      blk->train(true);
      out = blk->forward(ctx, X, valid_lens);
      dX = blk->backward(ctx, dout);
      return blk;
    };
    Tensor out_on, dX_on, out_off, dX_off;
    auto on = run(true, out_on, dX_on);
    auto off = run(false, out_off, dX_off);
    const std::string what = "threads " + std::to_string(threads);
    ASSERT_TRUE(on->addnorm1.output_bf16().defined()) << "the seams were not taken";
    ASSERT_FALSE(off->addnorm1.output_bf16().defined());
    ASSERT_EQ(out_on.dtype(), DType::F32);
    ASSERT_EQ(dX_on.dtype(), DType::F32);
    expect_same_bits(out_on, out_off, what + ": output");
    expect_same_bits(dX_on, dX_off, what + ": dX");
    const auto p_on = on->named_parameters(), p_off = off->named_parameters();
    ASSERT_EQ(p_on.size(), p_off.size());
    for (size_t i = 0; i < p_on.size(); ++i)
      expect_same_bits(p_on[i].second->grad, p_off[i].second->grad,
                       what + ": " + p_on[i].first + ".grad");
  }
}

// The decoder block likewise (causal self-attention, cross-attention on padded encoder outputs,
// the FFN): seams on against off, output, both input gradients and every parameter gradient.
TEST(AutocastFast, DecoderBlockSeamsChangeNoBit) {
  const int64_t B = 3, T = 17, S = 23, E = 32, H = 4, F = 64;
  const Tensor X = random_tensor({B, T, E}, DType::F32, 61);
  const Tensor enc = random_tensor({B, S, E}, DType::F32, 62);
  const Tensor dout = random_tensor({B, T, E}, DType::F32, 63);
  const Tensor enc_lens = Tensor::from_vector(std::vector<float>{23, 11, 5}, {B});
  for (int threads : {1, 2}) {
    auto run = [&](bool seams, Tensor& out, nn::DecoderBlockGrads& g) {
      Context ctx;
      ctx.threads = threads;
      ctx.autocast_bf16 = true;
      ctx.seed = 4;
      auto blk = std::make_unique<nn::TransformerDecoderBlock>(E, F, H, 0.1, false, DType::F32, 12);
      blk->attention1.bf16_seams = blk->attention2.bf16_seams = seams;
      blk->addnorm1.bf16_dy = blk->addnorm2.bf16_dy = blk->addnorm3.bf16_dy = seams;
      blk->addnorm2.bf16_output = seams;
      blk->train(true);
      out = blk->forward(ctx, X, enc, enc_lens);
      g = blk->backward(ctx, dout);
      return blk;
    };
    Tensor out_on, out_off;
    nn::DecoderBlockGrads g_on, g_off;
    auto on = run(true, out_on, g_on);
    auto off = run(false, out_off, g_off);
    const std::string what = "threads " + std::to_string(threads);
    ASSERT_TRUE(on->addnorm2.output_bf16().defined()) << "the seams were not taken";
    ASSERT_EQ(out_on.dtype(), DType::F32);
    ASSERT_EQ(g_on.dX.dtype(), DType::F32);
    ASSERT_EQ(g_on.denc_outputs.dtype(), DType::F32);
    expect_same_bits(out_on, out_off, what + ": output");
    expect_same_bits(g_on.dX, g_off.dX, what + ": dX");
    expect_same_bits(g_on.denc_outputs, g_off.denc_outputs, what + ": denc_outputs");
    const auto p_on = on->named_parameters(), p_off = off->named_parameters();
    ASSERT_EQ(p_on.size(), p_off.size());
    for (size_t i = 0; i < p_on.size(); ++i)
      expect_same_bits(p_on[i].second->grad, p_off[i].second->grad,
                       what + ": " + p_on[i].first + ".grad");
  }
}

}  // namespace
}  // namespace attn
