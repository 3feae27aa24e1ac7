// Per-target building blocks of the CPU flash attention (included once per SIMD target by
// flash_attention.cpp through hwy/foreach_target.h): the register-blocked GEMM micro-kernel, a
// vector exp2, and the packing of tiles into scratch.
//
// Everything is float32. Vectors hold L lanes (16 for AVX-512, 8 for AVX2, 4 for EMU128).

// Per-target include guard, the Highway idiom: toggles once per target.
#if defined(ATTN_FLASH_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_FLASH_KERNELS_INL_H_
#undef ATTN_FLASH_KERNELS_INL_H_
#else
#define ATTN_FLASH_KERNELS_INL_H_
#endif

#include "hwy/highway.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Rows of the micro-kernel. It keeps MR x 4 accumulator vectors in registers plus 4 vectors of B
// and one broadcast: AVX-512 has 32 registers, so 6 x 4 = 24 accumulators (+5 = 29); AVX2 has 16,
// so 3 x 4 = 12 (+5 = 17: one B vector is used as a memory operand of its FMAs instead). Zen 4
// runs one 512-bit FMA per cycle with 4 cycles of latency, so 24 independent chains hide it.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kMR = 6;
#elif HWY_TARGET == HWY_AVX2
constexpr int kMR = 3;
#else
constexpr int kMR = 2;
#endif
constexpr int kNV = 4;  // vectors of B (columns of C) per micro-tile
#if (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) && !defined(ATTN_FLASH_FWD_6X4)
constexpr int kFwdMR = 8, kFwdNV = 3;  // forward: 24 accumulators as 8 rows x 3 vectors
#else
constexpr int kFwdMR = kMR, kFwdNV = kNV;
#endif

HWY_INLINE size_t Lanes() {
  return hn::Lanes(DF());
}
HWY_INLINE int64_t RoundUpLanes(int64_t n) {
  const int64_t L = static_cast<int64_t>(Lanes());
  return (n + L - 1) / L * L;
}

// One micro-tile of C (rows x NV*L) = / += A (rows x K) B (K x NV*L), rows <= MR.
// A element (i, k) is a[i*a_rs + k*a_ks] (broadcast one element at a time, so A may be any
// strided view, transposed or not, straight from the caller's tensor); B and C are row-major with
// unit column stride. Rows past `rows` reuse the last valid row of A (a harmless duplicate
// computation) and are not stored, so M needs no padding.
template <int MR, int NV>
HWY_INLINE void MicroTile(int64_t K, const float* HWY_RESTRICT a, int64_t a_rs, int64_t a_ks,
                          int rows, const float* HWY_RESTRICT b, int64_t ldb, float* HWY_RESTRICT c,
                          int64_t ldc, bool accumulate) {
  const DF d;
  const size_t L = hn::Lanes(d);
  const float* ar[MR];
  VF acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    ar[i] = a + (i < rows ? i : rows - 1) * a_rs;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[i][j] = (accumulate && i < rows) ? hn::LoadU(d, c + i * ldc + j * L) : hn::Zero(d);
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    VF bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = hn::LoadU(d, bk + j * L);
    const int64_t ak = k * a_ks;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const VF ai = hn::Set(d, ar[i][ak]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        acc[i][j] = hn::MulAdd(ai, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      hn::StoreU(acc[i][j], d, c + i * ldc + j * L);
  }
}

// C (M x N) = / += A (M x K) B (K x N), N a multiple of L; A addressed as in MicroTile.
// Columns outside, rows inside: one (K x NV*L) panel of B stays in L1 while every MR-row panel
// of A streams past it.
template <int MR, int NV>
HWY_NOINLINE void GemmT(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                        const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t L = static_cast<int64_t>(Lanes());
  int64_t j0 = 0;
  for (; j0 + NV * L <= N; j0 += NV * L) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - i0));
      MicroTile<MR, NV>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0, ldc,
                        accumulate);
    }
  }
  for (; j0 < N; j0 += L) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - i0));
      MicroTile<MR, 1>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0, ldc,
                       accumulate);
    }
  }
}

// The backward's products: M is 64 keys or 96 queries, N the padded key tile or head dim.
HWY_INLINE void Gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                     const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  GemmT<kMR, kNV>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
}

// The forward's products: M is the 64-key tile or Dv, N the query block (a multiple of 3 vectors
// on AVX-512, so 8 x 3 covers M = 64 without a ragged micro-panel).
HWY_INLINE void GemmFwd(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                        const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  GemmT<kFwdMR, kFwdNV>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
}

// 2^x for x <= 0 (scores minus their running max), exactly 0 for x <= -127 (so masked scores
// set to -inf give weight 0). x = n + f with n = round(x), |f| <= 1/2; 2^f = e^(f ln 2) by its
// Taylor series to degree 7 (truncation error (ln2/2)^8/8! = 5e-9, below float rounding);
// 2^n is built in the exponent field, and n = -127 makes it 0.
HWY_INLINE VF Exp2(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  x = hn::Max(x, hn::Set(d, -127.0f));
  const VF n = hn::Round(x);
  const VF f = hn::Sub(x, n);
  VF poly = hn::Set(d, 1.525273380405984e-05f);  // ln2^7 / 7!
  poly = hn::MulAdd(poly, f, hn::Set(d, 1.5403530393381606e-04f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 1.3333558146428443e-03f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 9.6181291076284772e-03f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 5.5504108664821580e-02f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 2.4022650695910071e-01f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 6.9314718055994531e-01f));
  poly = hn::MulAdd(poly, f, hn::Set(d, 1.0f));
  const auto bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::Mul(poly, hn::BitCast(d, bits));
}

// dst[r*ld + c] = mul * src[r*s_r + c*s_c] for r < rows, c < cols; columns [cols, ld) are zeroed
// so that padded lanes stay finite (and contribute 0) in the micro-kernels.
HWY_INLINE void PackRows(const float* src, int64_t rows, int64_t cols, int64_t s_r, int64_t s_c,
                         float mul, float* dst, int64_t ld) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF vm = hn::Set(d, mul);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * s_r;
    float* o = dst + r * ld;
    int64_t c = 0;
    if (s_c == 1) {
      for (; c + L <= cols; c += L)
        hn::StoreU(hn::Mul(hn::LoadU(d, s + c), vm), d, o + c);
    }
    for (; c < cols; ++c)
      o[c] = mul * s[c * s_c];
    for (; c < ld; ++c)
      o[c] = 0.0f;
  }
}

// dst[c*ld + r] = mul * src[r*s_r + c*s_c]: the transpose of a (rows x cols) tile, with rows
// [rows, ld) zeroed. Used for Q^T (D x queries), K^T (D x keys) and V^T (Dv x keys), so that a
// micro-kernel reads a vector of consecutive queries or keys per feature.
HWY_INLINE void PackTransposed(const float* src, int64_t rows, int64_t cols, int64_t s_r,
                               int64_t s_c, float mul, float* dst, int64_t ld) {
  for (int64_t c = 0; c < cols; ++c) {
    float* o = dst + c * ld;
    const float* s = src + c * s_c;
    for (int64_t r = 0; r < rows; ++r)
      o[r] = mul * s[r * s_r];
    for (int64_t r = rows; r < ld; ++r)
      o[r] = 0.0f;
  }
}

// x[0..n) *= s (n a multiple of L).
HWY_INLINE void ScaleRow(float* x, int64_t n, float s) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF vs = hn::Set(d, s);
  for (int64_t c = 0; c < n; c += L)
    hn::StoreU(hn::Mul(hn::LoadU(d, x + c), vs), d, x + c);
}

// x[0..n) *= z[0..n) (n a multiple of L).
HWY_INLINE void MulRow(float* x, const float* z, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t c = 0; c < n; c += L)
    hn::StoreU(hn::Mul(hn::LoadU(d, x + c), hn::LoadU(d, z + c)), d, x + c);
}

// y[0..n) += s * x[0..n) (n a multiple of L).
HWY_INLINE void AxpyRow(float s, const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF vs = hn::Set(d, s);
  for (int64_t c = 0; c < n; c += L)
    hn::StoreU(hn::MulAdd(vs, hn::LoadU(d, x + c), hn::LoadU(d, y + c)), d, y + c);
}

#if HWY_TARGET != HWY_SCALAR
// Philox 4x32-10 (attn/core/rng.hpp) on L counters at once: c[0..3] hold word w of every
// lane's counter on entry and word w of its output on exit. The 32 x 32 -> 64-bit products come
// from MulEven on the even lanes and on the odd lanes shifted down, merged by OddEven.
using DU = hn::RebindToUnsigned<DF>;
using VU = hn::Vec<DU>;

HWY_INLINE void MulHiLo(VU x, uint32_t m, VU& hi, VU& lo) {
  const DU du;
  const hn::RepartitionToWide<DU> dw;
  const VU vm = hn::Set(du, m);
  lo = hn::Mul(x, vm);
  const VU even = hn::BitCast(du, hn::ShiftRight<32>(hn::MulEven(x, vm)));  // hi in even lanes
  const VU x_odd = hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(dw, x)));
  const VU odd = hn::BitCast(du, hn::MulEven(x_odd, vm));  // hi in odd lanes
  hi = hn::OddEven(odd, even);
}

HWY_INLINE void Philox4x32(VU c[4], uint64_t seed) {
  const DU du;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    VU hi0, lo0, hi1, lo1;
    MulHiLo(c[0], 0xD2511F53u, hi0, lo0);
    MulHiLo(c[2], 0xCD9E8D57u, hi1, lo1);
    const VU n0 = hn::Xor(hn::Xor(hi1, c[1]), hn::Set(du, k0));
    const VU n2 = hn::Xor(hn::Xor(hi0, c[3]), hn::Set(du, k1));
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Counter words 0 and 1 of the 64-bit block index (hi:lo) + g, per lane: lo + g with the carry
// into hi (an unsigned compare via the sign flip).
HWY_INLINE void CounterAdd(VU lo, VU hi, VU g, VU& c0, VU& c1) {
  const DU du;
  const hn::RebindToSigned<DU> di;
  const VU sign = hn::Set(du, 0x80000000u);
  c0 = hn::Add(lo, g);
  const auto carry = hn::Lt(hn::BitCast(di, hn::Xor(c0, sign)), hn::BitCast(di, hn::Xor(lo, sign)));
  c1 = hn::Sub(hi, hn::BitCast(du, hn::VecFromMask(di, carry)));
}

// Dropout multiplier (0 or keep_scale) from a Philox output word: kept iff (r >> 8) 2^-24 >= p.
HWY_INLINE VF DropMultiplier(VU r, float p, float keep_scale) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const VF u = hn::Mul(hn::ConvertTo(d, hn::BitCast(di, hn::ShiftRight<8>(r))),
                       hn::Set(d, 1.0f / 16777216.0f));
  return hn::IfThenElseZero(hn::Ge(u, hn::Set(d, p)), hn::Set(d, keep_scale));
}
#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
