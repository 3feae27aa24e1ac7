// The SIMD Philox 4x32-10 of the dropout stream (attn/core/rng.hpp, the scalar original, round
// for round), shared by every kernel that drops: the fused fp32 attention (flash_kernels-inl.h),
// the elementwise dropout (dropout_simd.cpp) and, through Philox4x32Avx512 on raw registers, the
// AVX-512 bf16 attention (flash_bf16_shared-inl.h). Included once per SIMD target through
// hwy/foreach_target.h. The dropout and bf16 dropout tests check it against the scalar stream.

// Per-target include guard, the Highway idiom: toggles once per target.
#if defined(ATTN_PHILOX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_PHILOX_INL_H_
#undef ATTN_PHILOX_INL_H_
#else
#define ATTN_PHILOX_INL_H_
#endif

#include "hwy/highway.h"

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR
// x * m as 64-bit products, split into the high and low 32 bits per lane: MulEven gives the
// even lanes' products; the odd lanes are shifted into even position first; OddEven merges them.
template <class DU>
HWY_INLINE void PhiloxMulHiLo(DU du, hn::Vec<DU> x, uint32_t m, hn::Vec<DU>& hi, hn::Vec<DU>& lo) {
  using VU = hn::Vec<DU>;
  const hn::RepartitionToWide<DU> dw;
  const VU vm = hn::Set(du, m);
  lo = hn::Mul(x, vm);
  const VU even = hn::BitCast(du, hn::ShiftRight<32>(hn::MulEven(x, vm)));  // hi in even lanes
  const VU x_odd = hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(dw, x)));
  const VU odd = hn::BitCast(du, hn::MulEven(x_odd, vm));  // hi in odd lanes
  hi = hn::OddEven(odd, even);
}

// Philox 4x32-10 with key (lo32(seed), hi32(seed)) on Lanes(du) counters at once: c[w] holds
// word w of every lane's counter on entry and word w of its output on exit.
template <class DU>
HWY_INLINE void Philox4x32(DU du, hn::Vec<DU> c[4], uint64_t seed) {
  using VU = hn::Vec<DU>;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  // Unrolled: the rolled loop kept part of its state on the stack across rounds (a store and a
  // reload on the chain of every round in the fp32 attention forward's dropout).
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
    VU hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(du, c[0], 0xD2511F53u, hi0, lo0);
    PhiloxMulHiLo(du, c[2], 0xCD9E8D57u, hi1, lo1);
    const VU n0 = hn::Xor(hn::Xor(hi1, c[1]), hn::Set(du, k0));
    const VU n2 = hn::Xor(hn::Xor(hi0, c[3]), hn::Set(du, k1));
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;  // Weyl key increments
    k1 += 0xBB67AE85u;
  }
}

// Philox4x32 on N independent sets of counters (c[n][w] as c[w] above), their rounds interleaved:
// N dependency chains in flight instead of one (the fp32 attention forward draws 2 blocks of
// every query lane at once).
template <int N, class DU>
HWY_INLINE void Philox4x32N(DU du, hn::Vec<DU> (*c)[4], uint64_t seed) {
  using VU = hn::Vec<DU>;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      VU hi0, lo0, hi1, lo1;
      PhiloxMulHiLo(du, c[n][0], 0xD2511F53u, hi0, lo0);
      PhiloxMulHiLo(du, c[n][2], 0xCD9E8D57u, hi1, lo1);
      const VU n0 = hn::Xor(hn::Xor(hi1, c[n][1]), hn::Set(du, k0));
      const VU n2 = hn::Xor(hn::Xor(hi0, c[n][3]), hn::Set(du, k1));
      c[n][0] = n0;
      c[n][1] = lo1;
      c[n][2] = n2;
      c[n][3] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

#if HWY_TARGET == HWY_AVX3
// Philox4x32 on 16 counters held in raw AVX-512 registers, for the bf16 attention kernel, which
// is written in intrinsics (kernels/cpu/flash_bf16.cpp): Highway's 512-bit vectors wrap the same
// registers, so this compiles to the same instructions as a call from Highway code. Its callers
// must be compiled for (a superset of) Highway's AVX3 target to inline it.
HWY_INLINE void Philox4x32Avx512(__m512i c[4], uint64_t seed) {
  using DU = hn::Full512<uint32_t>;
  hn::Vec<DU> v[4] = {hn::Vec<DU>{c[0]}, hn::Vec<DU>{c[1]}, hn::Vec<DU>{c[2]}, hn::Vec<DU>{c[3]}};
  Philox4x32(DU(), v, seed);
  for (int w = 0; w < 4; ++w)
    c[w] = v[w].raw;
}

// Philox4x32N<2> on raw registers: two independent sets of 16 counters, rounds interleaved (the
// bf16 forward's dropout draws two blocks of every query lane at once, as the fp32 forward).
HWY_INLINE void Philox4x32Avx512x2(__m512i c[2][4], uint64_t seed) {
  using DU = hn::Full512<uint32_t>;
  hn::Vec<DU> v[2][4];
  for (int n = 0; n < 2; ++n)
    for (int w = 0; w < 4; ++w)
      v[n][w] = hn::Vec<DU>{c[n][w]};
  Philox4x32N<2>(DU(), v, seed);
  for (int n = 0; n < 2; ++n)
    for (int w = 0; w < 4; ++w)
      c[n][w] = v[n][w].raw;
}
#endif  // HWY_TARGET == HWY_AVX3

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
