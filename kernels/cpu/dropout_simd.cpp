// The dropout stream's Philox blocks, many at once in SIMD lanes (Highway, dispatched at run
// time): the part of cpu::dropout_f32 (encoder_ops.cpp) that costs. Element i's keep decision is
// the reference's exactly (attn/core/rng.hpp): u_i = (philox(key, (i / 4, offset))[i % 4] >> 8)
// * 2^-24, kept iff u_i >= p; then y = float(double(x) * factor) as ref::DropoutSpec::factor.
#include "kernels/cpu/dropout_simd.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/dropout_simd.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "kernels/cpu/philox-inl.h"

#include "attn/core/rng.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR
using DU = hn::ScalableTag<uint32_t>;
using VU = hn::Vec<DU>;
constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(uint32_t);
#endif

// The scalar draw of elements [from, to): use(i, r) with r = (Philox word of stream index
// index_base + i) >> 8, one Philox block per 4 stream indices, as the reference. Serves the
// elements before the first stream index that is a multiple of 4, the tail, and the scalar target.
template <class Use>
void ScalarDraw(int64_t from, int64_t to, uint64_t seed, uint64_t offset, uint64_t index_base,
                const Use& use) {
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t bits[4] = {};
  uint64_t block = ~uint64_t{0};
  for (int64_t i = from; i < to; ++i) {
    const uint64_t g = index_base + static_cast<uint64_t>(i);
    if ((g >> 2) != block) {
      block = g >> 2;
      const uint32_t ctr[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                               static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
      philox4x32_10(key, ctr, bits);
    }
    use(i, bits[g & 3] >> 8);
  }
}

// The end of the scalar head: the first element at or after `begin` whose stream index is a
// multiple of 4 (from there on, lane k of a SIMD step holds the block of elements 4k..4k+3).
inline int64_t HeadEnd(int64_t begin, int64_t end, uint64_t index_base) {
  const int64_t head =
      static_cast<int64_t>((4 - ((index_base + static_cast<uint64_t>(begin)) & 3)) & 3);
  return std::min(end, begin + head);
}

#if HWY_TARGET != HWY_SCALAR
// Philox 4x32-10 of the L blocks starting at stream block block0, word w of lane k in c[w]
// (philox-inl.h): lane k's words decide elements 4k..4k+3 of the step.
HWY_INLINE void PhiloxBlocks(DU du, uint64_t block0, VU off_lo, VU off_hi, uint64_t seed, VU c[4]) {
  HWY_ALIGN uint32_t lo[kMaxLanes], hi[kMaxLanes];
  const int64_t L = static_cast<int64_t>(hn::Lanes(du));
  for (int64_t k = 0; k < L; ++k) {
    lo[k] = static_cast<uint32_t>(block0 + static_cast<uint64_t>(k));
    hi[k] = static_cast<uint32_t>((block0 + static_cast<uint64_t>(k)) >> 32);
  }
  c[0] = hn::Load(du, lo);
  c[1] = hn::Load(du, hi);
  c[2] = off_lo;
  c[3] = off_hi;
  Philox4x32(du, c, seed);
}
#endif

// Elements [begin, end) of one dropout call, local element i at stream index index_base + i.
// `threshold` is the smallest 24-bit integer r with r * 2^-24 >= p, so "u >= p" is
// "(word >> 8) >= threshold".
void DropoutRange(const float* x, float* y, int64_t begin, int64_t end, uint32_t threshold,
                  double scale, uint64_t seed, uint64_t offset, uint64_t index_base) {
  const auto scalar = [&](int64_t from, int64_t to) {
    ScalarDraw(from, to, seed, offset, index_base, [&](int64_t i, uint32_t r) {
      const double f = r >= threshold ? scale : 0.0;
      y[i] = static_cast<float>(static_cast<double>(x[i]) * f);
    });
  };
  int64_t i0 = HeadEnd(begin, end, index_base);
  scalar(begin, i0);
#if HWY_TARGET != HWY_SCALAR
  const DU du;
  const int64_t L = static_cast<int64_t>(hn::Lanes(du));
  HWY_ALIGN uint32_t words[4][kMaxLanes];
  HWY_ALIGN uint32_t ordered[4 * kMaxLanes];
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const hn::Rebind<uint32_t, decltype(dd)> dw32;
  const hn::Rebind<int32_t, decltype(dd)> di;
  const int64_t Ld = static_cast<int64_t>(hn::Lanes(dd));
  const auto vthreshold = hn::Set(dd, static_cast<double>(threshold));
  const auto vscale = hn::Set(dd, scale);
  const VU off_lo = hn::Set(du, static_cast<uint32_t>(offset));
  const VU off_hi = hn::Set(du, static_cast<uint32_t>(offset >> 32));
  for (; i0 + 4 * L <= end; i0 += 4 * L) {
    VU c[4];
    PhiloxBlocks(du, (index_base + static_cast<uint64_t>(i0)) >> 2, off_lo, off_hi, seed, c);
    for (int w = 0; w < 4; ++w)
      hn::Store(c[w], du, words[w]);
    // Element i0 + e takes word e % 4 of lane e / 4: put the words in element order, then
    // decide and scale Ld elements at a time, the product in double as the reference.
    for (int64_t k = 0; k < L; ++k)
      for (int64_t j = 0; j < 4; ++j)
        ordered[4 * k + j] = words[j][k];
    for (int64_t e = 0; e < 4 * L; e += Ld) {
      // r = w >> 8 < 2^24: as int32 and as double it is exact.
      const auto r = hn::BitCast(di, hn::ShiftRight<8>(hn::LoadU(dw32, ordered + e)));
      const auto keep = hn::Ge(hn::PromoteTo(dd, r), vthreshold);  // exact: r < 2^24
      const auto xd = hn::PromoteTo(dd, hn::LoadU(df, x + i0 + e));
      // Dropped elements are x * 0.0, as the reference (keeps -0 and NaN).
      const auto out = hn::IfThenElse(keep, hn::Mul(xd, vscale), hn::Mul(xd, hn::Zero(dd)));
      hn::StoreU(hn::DemoteTo(df, out), df, y + i0 + e);
    }
  }
#endif
  scalar(i0, end);
}

// DropoutRange's draw, keeping the decisions instead of applying them.
void DropoutKeepRange(uint8_t* keep, int64_t begin, int64_t end, uint32_t threshold, uint64_t seed,
                      uint64_t offset, uint64_t index_base) {
  const auto scalar = [&](int64_t from, int64_t to) {
    ScalarDraw(from, to, seed, offset, index_base,
               [&](int64_t i, uint32_t r) { keep[i] = r >= threshold ? 1 : 0; });
  };
  int64_t i0 = HeadEnd(begin, end, index_base);
  scalar(begin, i0);
#if HWY_TARGET != HWY_SCALAR
  const DU du;
  const int64_t L = static_cast<int64_t>(hn::Lanes(du));
  HWY_ALIGN uint32_t words[4][kMaxLanes];
  const VU off_lo = hn::Set(du, static_cast<uint32_t>(offset));
  const VU off_hi = hn::Set(du, static_cast<uint32_t>(offset >> 32));
  const VU vthreshold = hn::Set(du, threshold);
  const VU one = hn::Set(du, 1u);
  for (; i0 + 4 * L <= end; i0 += 4 * L) {
    VU c[4];
    PhiloxBlocks(du, (index_base + static_cast<uint64_t>(i0)) >> 2, off_lo, off_hi, seed, c);
    // Lane k's word w decides element i0 + 4k + w: kept iff not (w >> 8) < threshold.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    // Byte w of lane k's 32-bit word is element i0 + 4k + w: the four decisions of a lane shifted
    // into one word, and the words stored at once (a scalar 4 x L transpose stores byte by byte,
    // which shows in a bf16 training step at short sequences).
    VU packed = hn::Zero(du);
    for (int w = 0; w < 4; ++w) {
      const VU bit = hn::IfThenZeroElse(hn::Lt(hn::ShiftRight<8>(c[w]), vthreshold), one);
      packed = hn::Or(packed, hn::Shl(bit, hn::Set(du, static_cast<uint32_t>(8 * w))));
    }
    hn::StoreU(packed, du, words[0]);
    std::memcpy(keep + i0, words[0], static_cast<size_t>(4 * L));
#else
    for (int w = 0; w < 4; ++w)
      hn::Store(hn::IfThenZeroElse(hn::Lt(hn::ShiftRight<8>(c[w]), vthreshold), one), du, words[w]);
    for (int64_t k = 0; k < L; ++k)
      for (int64_t j = 0; j < 4; ++j)
        keep[i0 + 4 * k + j] = static_cast<uint8_t>(words[j][k]);
#endif
  }
#endif
  scalar(i0, end);
}

// Plain loops: compiled per target, so they vectorise with the target's widest vectors.
void DropoutApplyKeep(const float* HWY_RESTRICT x, const uint8_t* HWY_RESTRICT keep,
                      const float* HWY_RESTRICT add, float* HWY_RESTRICT y, int64_t begin,
                      int64_t end, double scale) {
  if (add != nullptr) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const double f = keep[i] != 0 ? scale : 0.0;
      y[i] = static_cast<float>(static_cast<double>(x[i]) * f) + add[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const double f = keep[i] != 0 ? scale : 0.0;
      y[i] = static_cast<float>(static_cast<double>(x[i]) * f);
    }
  }
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::cpu {

HWY_EXPORT(DropoutRange);
HWY_EXPORT(DropoutKeepRange);
HWY_EXPORT(DropoutApplyKeep);

void dropout_keep_range(uint8_t* keep, int64_t begin, int64_t end, uint32_t threshold,
                        uint64_t seed, uint64_t offset, uint64_t index_base) {
  HWY_DYNAMIC_DISPATCH(DropoutKeepRange)(keep, begin, end, threshold, seed, offset, index_base);
}

void dropout_apply_keep_f32(const float* x, const uint8_t* keep, const float* add, float* y,
                            int64_t begin, int64_t end, double scale) {
  HWY_DYNAMIC_DISPATCH(DropoutApplyKeep)(x, keep, add, y, begin, end, scale);
}

void dropout_range_f32(const float* x, float* y, int64_t begin, int64_t end, uint32_t threshold,
                       double scale, uint64_t seed, uint64_t offset, uint64_t index_base) {
  HWY_DYNAMIC_DISPATCH(DropoutRange)(x, y, begin, end, threshold, scale, seed, offset, index_base);
}

}  // namespace attn::cpu
#endif
