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
#include "kernels/cpu/philox-inl.h"
#include "kernels/cpu/transpose16.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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
#elif HWY_TARGET == HWY_AVX2
// forward: 12 accumulators + 3 vectors of B + 1 broadcast = AVX2's 16 registers (3 x 4 needs
// one B vector from memory per row: 9 loads per 12 FMAs instead of 7); 1-3% faster on Zen 3
// by bench/ab_least.sh (docs/performance.md, session 21).
constexpr int kFwdMR = 4, kFwdNV = 3;
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

// What a micro-tile does beyond C = / += A B (the forward fuses two softmax steps into its
// products, which saves a pass over the score tile or over O^T per key tile):
//   kColMax: after storing C, colvec[j] = max(colvec[j], max over the tile's rows of C[., j])
//            (the running maximum of a score tile's columns, queries along the lanes);
//   kScaleC: C is multiplied by colvec[j] when it is loaded to accumulate (the online softmax's
//            rescale of O^T by 2^(m_old - m_new), per query column);
//   kMaskColMax: as kColMax, after C[i, j] = -inf wherever key0 + i >= lim[j] (row i is key
//            key0 + i, column j keeps the keys below lim[j]: the length and causal masks).
enum class Epi { kPlain, kColMax, kScaleC, kMaskColMax };

// The epilogue's operands, at the micro-tile's first row and column.
struct EpiArgs {
  float* colvec = nullptr;
  const float* lim = nullptr;
  float key0 = 0.0f;
};

// One micro-tile of C (rows x NV*L) = / += A (rows x K) B (K x NV*L), rows <= MR.
// A element (i, k) is a[i*a_rs + k*a_ks] (broadcast one element at a time, so A may be any
// strided view, transposed or not, straight from the caller's tensor); B and C are row-major with
// unit column stride. Rows past `rows` reuse the last valid row of A (a harmless duplicate
// computation, also for kColMax's maximum) and are not stored, so M needs no padding.
template <int MR, int NV, Epi kEpi>
HWY_INLINE void MicroTile(int64_t K, const float* HWY_RESTRICT a, int64_t a_rs, int64_t a_ks,
                          int rows, const float* HWY_RESTRICT b, int64_t ldb, float* HWY_RESTRICT c,
                          int64_t ldc, bool accumulate, const EpiArgs& epi) {
  float* HWY_RESTRICT colvec = epi.colvec;
  const DF d;
  const size_t L = hn::Lanes(d);
  const float* ar[MR];
  VF acc[MR][NV];
  VF cs[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j)
    cs[j] = kEpi == Epi::kScaleC ? hn::LoadU(d, colvec + j * L) : hn::Zero(d);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    ar[i] = a + (i < rows ? i : rows - 1) * a_rs;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      if (accumulate && i < rows) {
        acc[i][j] = hn::LoadU(d, c + i * ldc + j * L);
        if (kEpi == Epi::kScaleC) acc[i][j] = hn::Mul(acc[i][j], cs[j]);
      } else {
        acc[i][j] = hn::Zero(d);
      }
    }
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
  if (kEpi == Epi::kMaskColMax) {
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const VF lim = hn::LoadU(d, epi.lim + j * L);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const VF key = hn::Set(d, epi.key0 + static_cast<float>(i < rows ? i : rows - 1));
        acc[i][j] = hn::IfThenElse(hn::Lt(key, lim), acc[i][j], neg_inf);
      }
    }
  }
  if (kEpi == Epi::kColMax || kEpi == Epi::kMaskColMax) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      VF m = hn::LoadU(d, colvec + j * L);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        m = hn::Max(m, acc[i][j]);
      hn::StoreU(m, d, colvec + j * L);
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

// C (M x N) = / += A (M x K) B (K x N), N a multiple of L; A addressed as in MicroTile; colvec
// (N floats) as kEpi says, unused for kPlain.
// Columns outside, rows inside: one (K x NV*L) panel of B stays in L1 while every MR-row panel
// of A streams past it.
template <int MR, int NV, Epi kEpi = Epi::kPlain>
HWY_NOINLINE void GemmT(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                        const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                        const EpiArgs& epi = EpiArgs()) {
  const int64_t L = static_cast<int64_t>(Lanes());
  // The epilogue's operands at micro-tile (i0, j0).
  const auto at = [&epi](int64_t i0, int64_t j0) {
    EpiArgs e;
    if (kEpi != Epi::kPlain) e.colvec = epi.colvec + j0;
    if (kEpi == Epi::kMaskColMax) {
      e.lim = epi.lim + j0;
      e.key0 = epi.key0 + static_cast<float>(i0);
    }
    return e;
  };
  int64_t j0 = 0;
  for (; j0 + NV * L <= N; j0 += NV * L) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - i0));
      MicroTile<MR, NV, kEpi>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0,
                              ldc, accumulate, at(i0, j0));
    }
  }
  for (; j0 < N; j0 += L) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - i0));
      MicroTile<MR, 1, kEpi>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0,
                             ldc, accumulate, at(i0, j0));
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
// Scores C = A B with colmax[j] = max(colmax[j], max_i C[i, j]).
HWY_INLINE void GemmFwdColMax(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                              int64_t a_ks, const float* b, int64_t ldb, float* c, int64_t ldc,
                              float* colmax) {
  GemmT<kFwdMR, kFwdNV, Epi::kColMax>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, false,
                                      EpiArgs{colmax, nullptr, 0.0f});
}
// As GemmFwdColMax with row i (key key0 + i) of column j set to -inf where key0 + i >= lim[j]
// first. Keys are exact in float up to 2^24.
HWY_INLINE void GemmFwdMaskColMax(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                                  int64_t a_ks, const float* b, int64_t ldb, float* c, int64_t ldc,
                                  float* colmax, const float* lim, int64_t key0) {
  GemmT<kFwdMR, kFwdNV, Epi::kMaskColMax>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, false,
                                          EpiArgs{colmax, lim, static_cast<float>(key0)});
}
// O^T: C = C diag(scale) + A B.
HWY_INLINE void GemmFwdScaleC(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs,
                              int64_t a_ks, const float* b, int64_t ldb, float* c, int64_t ldc,
                              float* scale) {
  GemmT<kFwdMR, kFwdNV, Epi::kScaleC>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, true,
                                      EpiArgs{scale, nullptr, 0.0f});
}

// 2^x for x <= 0 (scores minus their running max), exactly 0 for x <= -200 (so masked scores set
// to -inf give weight 0).
// AVX-512: x = n + f with n = floor(x), f = x - n in [0, 1) from one vreduceps; 2^f by a degree-6
// minimax polynomial (relative error 1.9e-9, 6.2e-8 after float rounding); 2^n applied by
// vscalefps, which also gives the exact 0 below -149 (10 instructions with the clamp).
// Elsewhere: n = round(x), |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor series to degree 7
// (truncation error (ln2/2)^8/8! = 5e-9); 2^n built in the exponent field (0 for n <= -127).
HWY_INLINE VF Exp2(DF d, VF x) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  (void)d;
  const __m512 v = _mm512_max_ps(x.raw, _mm512_set1_ps(-200.0f));
  const __m512 f = _mm512_reduce_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 poly = _mm512_set1_ps(2.170438820e-04f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.243936364e-03f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.678835049e-03f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.548337102e-02f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.402298152e-01f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.931470037e-01f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  return VF{_mm512_scalef_ps(poly, v)};
#else
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
#endif
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

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// In-register transpose of a 16 x 16 tile of floats (kernels/cpu/transpose16.hpp).
HWY_INLINE void Transpose16(__m512 r[16]) {
  __m512i x[16];
  for (int i = 0; i < 16; ++i)
    x[i] = _mm512_castps_si512(r[i]);
  transpose16x16_epi32(x);
  for (int i = 0; i < 16; ++i)
    r[i] = _mm512_castsi512_ps(x[i]);
}
#endif

// Square tiles of kTile x kTile floats transposed in registers, one vector per row: 16 x 16 on
// AVX-512, 8 x 8 on AVX2 (the packing loops below; the scalar target has none). Undefined
// first: this file is compiled once per target.
#undef ATTN_FLASH_TILE_TRANSPOSE
#if HWY_ARCH_X86 && (HWY_TARGET <= HWY_AVX3 || HWY_TARGET == HWY_AVX2)
#define ATTN_FLASH_TILE_TRANSPOSE 1
constexpr int kTile = HWY_LANES(float);
HWY_INLINE void TransposeTile(VF r[kTile]) {
#if HWY_TARGET <= HWY_AVX3
  __m512 x[16];
  for (int i = 0; i < 16; ++i)
    x[i] = r[i].raw;
  Transpose16(x);
  for (int i = 0; i < 16; ++i)
    r[i].raw = x[i];
#else
  // Rows a..h: pairs interleaved within each 128-bit half (a0 b0 a1 b1 | a4 b4 a5 b5), then
  // quadruples (a0 b0 c0 d0 | a4 b4 c4 d4), then the halves of rows a-d and e-h joined.
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i].raw, r[2 * i + 1].raw);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i].raw, r[2 * i + 1].raw);
  }
  for (int h = 0; h < 2; ++h) {  // rows a-d, then e-h
    const __m256 lo0 = t[4 * h], hi0 = t[4 * h + 1], lo1 = t[4 * h + 2], hi1 = t[4 * h + 3];
    u[4 * h + 0] = _mm256_shuffle_ps(lo0, lo1, _MM_SHUFFLE(1, 0, 1, 0));  // columns 0 | 4
    u[4 * h + 1] = _mm256_shuffle_ps(lo0, lo1, _MM_SHUFFLE(3, 2, 3, 2));  // columns 1 | 5
    u[4 * h + 2] = _mm256_shuffle_ps(hi0, hi1, _MM_SHUFFLE(1, 0, 1, 0));  // columns 2 | 6
    u[4 * h + 3] = _mm256_shuffle_ps(hi0, hi1, _MM_SHUFFLE(3, 2, 3, 2));  // columns 3 | 7
  }
  for (int c = 0; c < 4; ++c) {
    r[c].raw = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4].raw = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
#endif
}
#endif

// dst[c*ld + r] = mul * src[r*s_r + c*s_c]: the transpose of a (rows x cols) tile, with rows
// [rows, ld) zeroed. Used for Q^T (D x queries), K^T (D x keys) and V^T (Dv x keys), so that a
// micro-kernel reads a vector of consecutive queries or keys per feature. With unit column
// stride, whole kTile x kTile tiles go through registers (a strided scalar loop over a block of
// 192 rows misses L1 on every element: it was ~7% of the forward at T = 1024, D = 128 on
// AVX-512, and the hottest loop of the forward outside its products on AVX2); the rest runs 16
// rows at a time so that each row of dst is written one cache line at a time.
HWY_INLINE void PackTransposed(const float* src, int64_t rows, int64_t cols, int64_t s_r,
                               int64_t s_c, float mul, float* dst, int64_t ld) {
  constexpr int64_t kR = 16;
  int64_t r0 = 0;
#ifdef ATTN_FLASH_TILE_TRANSPOSE
  if (s_c == 1) {
    const DF d;
    const VF vm = hn::Set(d, mul);
    for (; r0 + kTile <= rows; r0 += kTile) {
      int64_t c0 = 0;
      for (; c0 + kTile <= cols; c0 += kTile) {
        VF x[kTile];
        for (int i = 0; i < kTile; ++i)
          x[i] = hn::LoadU(d, src + (r0 + i) * s_r + c0);
        TransposeTile(x);
        for (int i = 0; i < kTile; ++i)
          hn::StoreU(hn::Mul(x[i], vm), d, dst + (c0 + i) * ld + r0);
      }
      for (int64_t c = c0; c < cols; ++c)
        for (int64_t r = r0; r < r0 + kTile; ++r)
          dst[c * ld + r] = mul * src[r * s_r + c];
    }
  }
#endif
  for (; r0 < rows; r0 += kR) {
    const int64_t r1 = std::min(rows, r0 + kR);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r)
        dst[c * ld + r] = mul * src[r * s_r + c * s_c];
  }
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = rows; r < ld; ++r)
      dst[c * ld + r] = 0.0f;
}

// dst[r*d_r + c*d_c] = src[c*ld + r] * mul[r] for r < rows, c < cols: the inverse of
// PackTransposed with a per-row factor (the forward's O^T, normalized, into the output rows).
HWY_INLINE void UnpackTransposed(const float* src, int64_t ld, int64_t rows, int64_t cols,
                                 const float* mul, float* dst, int64_t d_r, int64_t d_c) {
  constexpr int64_t kR = 16;
  int64_t r0 = 0;
#ifdef ATTN_FLASH_TILE_TRANSPOSE
  if (d_c == 1) {
    const DF d;
    for (; r0 + kTile <= rows; r0 += kTile) {
      const VF vm = hn::LoadU(d, mul + r0);
      int64_t c0 = 0;
      for (; c0 + kTile <= cols; c0 += kTile) {
        VF x[kTile];
        for (int i = 0; i < kTile; ++i)
          x[i] = hn::Mul(hn::LoadU(d, src + (c0 + i) * ld + r0), vm);
        TransposeTile(x);
        for (int i = 0; i < kTile; ++i)
          hn::StoreU(x[i], d, dst + (r0 + i) * d_r + c0);
      }
      for (int64_t r = r0; r < r0 + kTile; ++r)
        for (int64_t c = c0; c < cols; ++c)
          dst[r * d_r + c] = src[c * ld + r] * mul[r];
    }
  }
#endif
  for (; r0 < rows; r0 += kR) {
    const int64_t r1 = std::min(rows, r0 + kR);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r)
        dst[r * d_r + c * d_c] = src[c * ld + r] * mul[r];
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

// dst[k * sd] = mul * src[k] for k < n (the backward's dK and dV rows).
HWY_INLINE void StoreRow(const float* src, int64_t n, float mul, float* dst, int64_t sd) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  int64_t k = 0;
  if (sd == 1) {
    const VF vm = hn::Set(d, mul);
    for (; k + L <= n; k += L)
      hn::StoreU(hn::Mul(vm, hn::LoadU(d, src + k)), d, dst + k);
  }
  for (; k < n; ++k)
    dst[k * sd] = mul * src[k];
}

// out[t] = sum_k double(a[t, k]) b[t, k] for t < rows (a[t, k] at a + t*a_st + k*a_sd, b alike),
// k ascending, rounded to float once: D_t = dO_t . out_t, in double since the backward subtracts
// it from dP, a difference of similar values. Each product of two floats is exact in double, so
// every row's result is fixed by the order of its sums: 16 rows at once along the lanes (16 x 16
// tiles transposed in registers, two vectors of 8 doubles), k in order, give the scalar loop's
// bits without its chain of dependent scalar adds.
inline void RowDots(const float* a, int64_t a_st, int64_t a_sd, const float* b, int64_t b_st,
                    int64_t b_sd, int64_t rows, int64_t cols, float* out) {
  int64_t t0 = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if (a_sd == 1 && b_sd == 1) {
    for (; t0 + 16 <= rows; t0 += 16) {
      __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
      int64_t c0 = 0;
      for (; c0 + 16 <= cols; c0 += 16) {
        __m512 xa[16], xb[16];
        for (int i = 0; i < 16; ++i) {
          xa[i] = _mm512_loadu_ps(a + (t0 + i) * a_st + c0);
          xb[i] = _mm512_loadu_ps(b + (t0 + i) * b_st + c0);
        }
        Transpose16(xa);
        Transpose16(xb);
        for (int i = 0; i < 16; ++i) {  // column c0 + i of the 16 rows
          lo = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(xa[i])),
                               _mm512_cvtps_pd(_mm512_castps512_ps256(xb[i])), lo);
          hi = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(xa[i], 1)),
                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(xb[i], 1)), hi);
        }
      }
      alignas(64) double acc[16];
      _mm512_store_pd(acc, lo);
      _mm512_store_pd(acc + 8, hi);
      for (int64_t i = 0; i < 16; ++i) {
        for (int64_t c = c0; c < cols; ++c)
          acc[i] += double(a[(t0 + i) * a_st + c]) * b[(t0 + i) * b_st + c];
        out[t0 + i] = static_cast<float>(acc[i]);
      }
    }
  }
#endif
  for (; t0 < rows; ++t0) {
    double acc = 0;
    for (int64_t k = 0; k < cols; ++k)
      acc += double(a[t0 * a_st + k * a_sd]) * b[t0 * b_st + k * b_sd];
    out[t0] = static_cast<float>(acc);
  }
}

#if HWY_TARGET != HWY_SCALAR
using DU = hn::RebindToUnsigned<DF>;
using VU = hn::Vec<DU>;

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

// Dropout multiplier (0 or keep_scale) from a Philox output word: kept iff (r >> 8) 2^-24 >= p
// (attn/core/rng.hpp). Both sides are exact, so for p in (0, 1] that is r >> 8 >= ceil(p 2^24),
// or r > bound = 256 ceil(p 2^24) - 1 (KeepBound): one unsigned compare per word instead of a
// shift, a conversion, a multiply and a float compare. p = 1 gives bound 2^32 - 1: nothing kept.
HWY_INLINE VU KeepBound(float p) {
  const double t = std::clamp(std::ceil(static_cast<double>(p) * 16777216.0), 1.0, 16777216.0);
  return hn::Set(DU(), static_cast<uint32_t>(static_cast<uint64_t>(t) * 256 - 1));
}
HWY_INLINE VF DropMultiplier(VU r, VU bound, VF keep_scale) {
  return hn::IfThenElseZero(hn::RebindMask(DF(), hn::Gt(r, bound)), keep_scale);
}
#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
