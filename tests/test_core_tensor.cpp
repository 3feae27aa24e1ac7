// Core: Tensor views and conversions, Philox, float formats, errors.
#include "attn/core/context.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/tensor.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

namespace attn {
namespace {

TEST(Tensor, ShapesAndStrides) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides(), (Strides{12, 4, 1}));
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(shape_str(t.shape()), "(2, 3, 4)");
  EXPECT_FALSE(Tensor().defined());
  EXPECT_TRUE(t.defined());
}

TEST(Tensor, ViewsShareMemory) {
  std::vector<double> v(24);
  for (int i = 0; i < 24; ++i)
    v[i] = i;
  Tensor t = Tensor::from_vector(v, {2, 3, 4}, DType::F64);
  Tensor tt = t.transpose(1, 2);  // (2, 4, 3)
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.at({1, 3, 2}), t.at({1, 2, 3}));
  Tensor s = t.slice(2, 1, 3);  // (2, 3, 2)
  EXPECT_EQ(s.at({1, 2, 0}), 1 * 12 + 2 * 4 + 1);
  s.set({0, 0, 0}, -5);
  EXPECT_EQ(t.at({0, 0, 1}), -5);
  Tensor c = tt.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.at({1, 3, 2}), t.at({1, 2, 3}));
  EXPECT_EQ(t.select(0, 1).at({0, 0}), 12);
  EXPECT_EQ(t.reshape({6, -1}).shape(), (Shape{6, 4}));
  float raw[6] = {1, 2, 3, 4, 5, 6};
  Tensor w = Tensor::wrap(raw, {2, 3}, DType::F32);
  EXPECT_FALSE(w.owns_memory());
  EXPECT_EQ(w.at({1, 2}), 6);
}

TEST(Tensor, ConversionsRoundTrip) {
  Tensor t = Tensor::from_vector(std::vector<double>{1.5, -2.25, 1e-3, 65504}, {4}, DType::F64);
  EXPECT_EQ(t.to(DType::F16).to(DType::F64).at({1}), -2.25);
  EXPECT_EQ(t.to(DType::F16).at({3}), 65504);
  EXPECT_EQ(t.to(DType::BF16).at({0}), 1.5);
  EXPECT_NEAR(t.to(DType::BF16).at({2}), 1e-3, 1e-5);
}

TEST(Tensor, BadInputGivesError) {
  Tensor t = Tensor::zeros({2, 3});
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.at({2, 0}), Error);
  EXPECT_THROW(t.data<double>(), Error);
  EXPECT_THROW(Tensor::empty({-1, 2}), Error);
  int64_t big = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_THROW(Tensor::empty({big, big}), Error);                // product overflows
  EXPECT_THROW(Tensor::empty({int64_t{1} << 40, 1024}), Error);  // exceeds memory
  try {
    t.reshape({5});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "Tensor::reshape");
    EXPECT_NE(std::string(e.what()).find("(2, 3)"), std::string::npos);
  }
}

// Shape keeps up to Shape::kMaxDims sizes inline and behaves as the std::vector<int64_t> it
// replaced; one more dimension, or a bad dim index, throws Error naming the operation.
TEST(Tensor, FillSetsEveryElementAsSetFlatWould) {
  for (const DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
    for (const double v : {0.0, -0.0, 0.1, -3.0, 65504.0}) {
      Tensor t = Tensor::empty({3, 5}, dt), want = Tensor::empty({3, 5}, dt);
      t.fill(v);
      for (int64_t i = 0; i < want.numel(); ++i)
        want.set_flat(i, v);
      EXPECT_EQ(std::memcmp(t.raw_data(), want.raw_data(), t.nbytes()), 0)
          << dtype_name(dt) << " " << v;
      // A strided view: only its elements change.
      Tensor base = Tensor::zeros({3, 5}, dt);
      base.slice(1, 1, 3).fill(v);
      for (int64_t r = 0; r < 3; ++r)
        for (int64_t c = 0; c < 5; ++c)
          EXPECT_EQ(base.at({r, c}), c >= 1 && c < 3 ? want.at({r, c}) : 0.0)
              << dtype_name(dt) << " " << v << " at " << r << ", " << c;
    }
  }
}

TEST(Shape, BehavesAsAVectorOfDims) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.size(), 3u);
  EXPECT_EQ(s, (Shape{2, 3, 4}));
  EXPECT_NE(s, (Shape{2, 3}));
  EXPECT_LT((Shape{2, 3}), s);
  s.push_back(5);
  s.insert(s.begin(), 1);
  EXPECT_EQ(s, (Shape{1, 2, 3, 4, 5}));
  s.erase(s.begin() + 1, s.begin() + 3);
  EXPECT_EQ(s, (Shape{1, 4, 5}));
  s.resize(5, 7);
  EXPECT_EQ(s, (Shape{1, 4, 5, 7, 7}));
  const std::vector<int64_t> v = s;  // both ways, implicitly
  EXPECT_EQ(Shape(v), s);
  EXPECT_EQ(Shape(v.begin() + 1, v.end()), (Shape{4, 5, 7, 7}));
  EXPECT_EQ(Shape(3, 1), (Shape{1, 1, 1}));
  EXPECT_EQ(std::vector<int64_t>(s.rbegin(), s.rend()), (std::vector<int64_t>{7, 7, 5, 4, 1}));
  EXPECT_EQ(shape_str(s), "(1, 4, 5, 7, 7)");

  Shape full(Shape::kMaxDims, 1);
  EXPECT_THROW(full.push_back(1), Error);
  EXPECT_THROW(Shape(Shape::kMaxDims + 1, 1), Error);
  EXPECT_THROW(Tensor::empty(std::vector<int64_t>(Shape::kMaxDims + 1, 1)), Error);
  EXPECT_EQ(Tensor::zeros(full).numel(), 1);
  EXPECT_THROW(s.at(5), Error);

  const Tensor t = Tensor::zeros({2, 3});
  EXPECT_EQ(t.dim(-1), 3);
  EXPECT_EQ(t.stride(0), 3);
  try {
    (void)t.dim(2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "Tensor::dim");
    EXPECT_NE(std::string(e.what()).find("(2, 3)"), std::string::npos);
  }
  EXPECT_THROW((void)t.stride(-3), Error);
  // A dim after a 0 cannot overflow the product; before one it does.
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(shape_numel({0, big, big}), 0);
  EXPECT_THROW(shape_numel({big, big, 0}), Error);
}

TEST(Float16, SpecialValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);               // rounds to inf
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(NAN))));
  for (uint32_t h = 0; h < 0x7c00; ++h)  // every finite positive half survives a round trip
    ASSERT_EQ(float_to_f16(f16_to_float(static_cast<uint16_t>(h))), h) << h;
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(3.0f)), 3.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

// Tensor::to between F32 and BF16: the contiguous bulk path equals the per-element path taken
// by strided tensors (ties, NaN, infinities, subnormals included).
TEST(BFloat16, ContiguousConversionEqualsStrided) {
  const float values[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f,
                          -2.5f,          0x1p-130f,
                          3.0e38f,        INFINITY,
                          -INFINITY,      NAN,
                          0.0f,           -0.0f,
                          1e-3f,          65504.0f};
  const int64_t n = static_cast<int64_t>(std::size(values));
  Tensor wide = Tensor::empty({n, 2}, DType::F32);  // column 0 contiguous copy, column 1 strided
  for (int64_t i = 0; i < n; ++i) {
    wide.set_flat(2 * i, values[i]);
    wide.set_flat(2 * i + 1, values[i]);
  }
  Tensor contiguous = wide.select(1, 0).contiguous();
  Tensor strided = wide.select(1, 1);  // stride 2
  ASSERT_TRUE(contiguous.is_contiguous());
  ASSERT_FALSE(strided.is_contiguous());
  Tensor a = contiguous.to(DType::BF16), b = strided.to(DType::BF16);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t ha = static_cast<const uint16_t*>(a.raw_data())[i];
    EXPECT_EQ(ha, static_cast<const uint16_t*>(b.raw_data())[i]) << i;
    EXPECT_EQ(ha, float_to_bf16(values[i])) << i;
  }
  Tensor back = a.to(DType::F32), back_strided = b.to(DType::F64).to(DType::F32);
  for (int64_t i = 0; i < n; ++i) {
    const float x = back.data<float>()[i], y = back_strided.data<float>()[i];
    EXPECT_TRUE(std::isnan(x) ? std::isnan(y) : x == y) << i;
  }
}

// Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32 10 rounds).
TEST(Philox, KnownAnswers) {
  const uint32_t k0[2] = {0, 0}, c0[4] = {0, 0, 0, 0};
  uint32_t out[4];
  philox4x32_10(k0, c0, out);
  EXPECT_EQ(out[0], 0x6627e8d5u);
  EXPECT_EQ(out[1], 0xe169c58du);
  EXPECT_EQ(out[2], 0xbc57ac4cu);
  EXPECT_EQ(out[3], 0x9b00dbd8u);
  const uint32_t k1[2] = {0xffffffffu, 0xffffffffu},
                 c1[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
  philox4x32_10(k1, c1, out);
  EXPECT_EQ(out[0], 0x408f276du);
  EXPECT_EQ(out[1], 0x41c83b0eu);
  EXPECT_EQ(out[2], 0xa20bc7c6u);
  EXPECT_EQ(out[3], 0x6d5451fdu);
  const uint32_t k2[2] = {0xa4093822u, 0x299f31d0u},
                 c2[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u};
  philox4x32_10(k2, c2, out);
  EXPECT_EQ(out[0], 0xd16cfe09u);
  EXPECT_EQ(out[1], 0x94fdccebu);
  EXPECT_EQ(out[2], 0x5001e420u);
  EXPECT_EQ(out[3], 0x24126ea1u);
}

TEST(Philox, DropoutStreamIsUniform) {
  int kept = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i)
    kept += dropout_keep(42, 7, i, 0.3f);
  EXPECT_NEAR(kept / double(n), 0.7, 0.01);
  EXPECT_EQ(dropout_uniform(42, 7, 123), dropout_uniform(42, 7, 123));
  EXPECT_NE(dropout_uniform(42, 7, 123), dropout_uniform(42, 8, 123));
}

TEST(Rng, NormalMoments) {
  Rng rng(3);
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = rng.normal();
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
}

TEST(Context, Backends) {
  EXPECT_EQ(parse_backend("ref"), Backend::kReference);
  EXPECT_THROW(parse_backend("gpu9"), Error);
  Context ctx;
  EXPECT_EQ(ctx.next_dropout_offset(), 0u);
  EXPECT_EQ(ctx.next_dropout_offset(), 1u);
}

}  // namespace
}  // namespace attn
