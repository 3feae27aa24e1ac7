// Mask lowering (ops/mask.{hpp,cpp}): d2l's valid_lens and the causal flag become one kept-key
// count per score row, the single form every attention kernel takes
// (kernels/attention_problem.hpp). Checked here against the definitions: key s of row (b, t) is
// kept iff float(s) < len and, when causal, s <= t; lengths repeat over lens_repeat batch rows
// (multi-head attention's heads).
#include "ops/mask.hpp"

#include "attn/core/error.hpp"
#include "attn/core/tensor.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace attn::detail {
namespace {

// Kept keys of row (b, t) counted one key at a time from the definition.
int64_t kept_by_definition(double len, bool causal, int64_t t, int64_t S) {
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s)
    n += (static_cast<double>(s) < len) && (!causal || s <= t);
  return n;
}

TEST(MaskLowering, KeysKeptByLengthFollowsD2lsComparison) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double len : {-3.0, -0.5, 0.0, 0.25, 1.0, 1.5, 2.0, 6.999, 7.0, 8.0, 1e30, inf, -inf})
    EXPECT_EQ(keys_kept_by_length(len, 7), kept_by_definition(len, false, 0, 7)) << len;
  EXPECT_EQ(keys_kept_by_length(nan, 7), 0);  // NaN compares false: nothing kept
  EXPECT_EQ(keys_kept_by_length(3.0, 0), 0);
}

TEST(MaskLowering, CountsMatchTheDefinitionForEveryMaskKind) {
  const int64_t Bl = 2, T = 5, S = 6;
  const std::vector<double> lens1{2.5, 9.0};
  std::vector<double> lens2(Bl * T);
  for (int64_t i = 0; i < Bl * T; ++i)
    lens2[i] = static_cast<double>((i * 7) % 9) - 1.0;  // -1 .. 7: none, some, all kept
  for (int64_t repeat : {1, 3}) {
    for (bool causal : {false, true}) {
      for (int kind = 0; kind < 3; ++kind) {
        SCOPED_TRACE("repeat " + std::to_string(repeat) + (causal ? " causal" : "") + " kind " +
                     std::to_string(kind));
        MaskOptions mask;
        mask.causal = causal;
        mask.lens_repeat = repeat;
        if (kind == 1) mask.valid_lens = Tensor::from_vector(lens1, {Bl});
        if (kind == 2) mask.valid_lens = Tensor::from_vector(lens2, {Bl, T}, DType::F32);
        const int64_t B = Bl * repeat;
        const std::vector<int32_t> kept = kept_key_counts(mask, B, T, S);
        ASSERT_EQ(kept.size(), static_cast<size_t>(B * T));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < T; ++t) {
            const double len = kind == 0   ? std::numeric_limits<double>::infinity()
                               : kind == 1 ? lens1[b / repeat]
                                           : lens2[(b / repeat) * T + t];
            EXPECT_EQ(kept[b * T + t], kept_by_definition(len, causal, t, S)) << b << "," << t;
          }
        // The fused kernels' form: empty without lengths (they apply causal themselves).
        const std::vector<int32_t> lengths = length_key_counts(mask, B, T, S);
        EXPECT_EQ(lengths.empty(), kind == 0);
        if (kind != 0) {
          EXPECT_EQ(lengths, kept);
        }
        EXPECT_EQ(counts_or_null(lengths), kind == 0 ? nullptr : lengths.data());
      }
    }
  }
}

TEST(MaskLowering, IntegerLengthsAgreeWithFloatLengths) {
  MaskOptions as_int, as_float;
  as_int.valid_lens = Tensor::from_vector(std::vector<int64_t>{0, 3, 9}, {3}, DType::I32);
  as_float.valid_lens = Tensor::from_vector(std::vector<double>{0.0, 3.0, 9.0}, {3});
  EXPECT_EQ(kept_key_counts(as_int, 3, 2, 5), kept_key_counts(as_float, 3, 2, 5));
}

TEST(MaskLowering, PolicyLowersToTheKernelEnum) {
  EXPECT_EQ(lower_policy(MaskedRowPolicy::kUniform), kernels::MaskedRows::kUniform);
  EXPECT_EQ(lower_policy(MaskedRowPolicy::kZero), kernels::MaskedRows::kZero);
}

// Rows of keys and values that some query reads (nn::MultiHeadAttention zeroes the others when
// they hold NaN or Inf): the longest kept prefix of the batch, or all S when a row keeps nothing
// under the uniform policy (it averages every value).
TEST(MaskLowering, KeysReadIsTheLongestKeptPrefix) {
  const Tensor lens1 = Tensor::from_vector(std::vector<double>{0.0, 2.0, 9.0}, {3});
  EXPECT_EQ(keys_read(lens1, false, 3, 4, 6, false), (std::vector<int64_t>{0, 2, 6}));
  EXPECT_EQ(keys_read(lens1, false, 3, 4, 6, true), (std::vector<int64_t>{6, 2, 6}));
  EXPECT_EQ(keys_read(lens1, true, 3, 4, 6, false), (std::vector<int64_t>{0, 2, 4}));  // t < 4
  const Tensor lens2 =
      Tensor::from_vector(std::vector<double>{1.0, 5.0, 0.0, 3.0, 2.0, 2.0}, {2, 3});
  EXPECT_EQ(keys_read(lens2, false, 2, 3, 6, false), (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(keys_read(lens2, false, 2, 3, 6, true), (std::vector<int64_t>{6, 3}));
  EXPECT_EQ(keys_read(lens2, true, 2, 3, 6, false), (std::vector<int64_t>{2, 2}));
}

// One length per batch row takes a shortcut (no per-query counts): the same answer as the
// per-query path given that length for every query, causal or not, uniform or not, for lengths
// that are zero, fractional, negative, NaN or past S, and for T above, at and below S.
TEST(MaskLowering, KeysReadOfOneLengthPerRowIsThePerQueryAnswer) {
  const std::vector<double> lens = {0.0, 2.5, 9.0, -1.0, std::nan(""), 6.0, 1.0, 3.0};
  const int64_t B = static_cast<int64_t>(lens.size()), S = 6;
  for (int64_t T : {0, 1, 4, 6, 9}) {
    std::vector<double> per_query;
    for (double len : lens)
      per_query.insert(per_query.end(), static_cast<size_t>(T), len);
    const Tensor lens1 = Tensor::from_vector(lens, {B});
    const Tensor lens2 = Tensor::from_vector(per_query, {B, T});
    for (bool causal : {false, true})
      for (bool uniform : {false, true})
        EXPECT_EQ(keys_read(lens1, causal, B, T, S, uniform),
                  keys_read(lens2, causal, B, T, S, uniform))
            << "T " << T << " causal " << causal << " uniform " << uniform;
  }
}

TEST(MaskLowering, RejectsMoreThan2To31Keys) {
  MaskOptions mask;
  EXPECT_THROW(kept_key_counts(mask, 1, 1, int64_t{1} << 31), Error);
}

}  // namespace
}  // namespace attn::detail
