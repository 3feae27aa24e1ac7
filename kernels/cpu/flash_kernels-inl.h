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
// so 3 x 4 = 12 (+5 = 17, one spill-free enough since B is reloaded from L1). Zen 4 runs one
// 512-bit FMA per cycle with 4 cycles of latency, so 24 independent chains hide it with room.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kMR = 6;
#elif HWY_TARGET == HWY_AVX2
constexpr int kMR = 3;
#else
constexpr int kMR = 2;
#endif
constexpr int kNV = 4;  // vectors of B (columns of C) per micro-tile

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
// Columns outside, rows inside: one (K x kNV*L) panel of B stays in L1 while every MR-row panel
// of A streams past it.
HWY_NOINLINE void Gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_ks,
                       const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t L = static_cast<int64_t>(Lanes());
  int64_t j0 = 0;
  for (; j0 + kNV * L <= N; j0 += kNV * L) {
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, M - i0));
      MicroTile<kMR, kNV>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0, ldc,
                          accumulate);
    }
  }
  for (; j0 < N; j0 += L) {
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, M - i0));
      MicroTile<kMR, 1>(K, a + i0 * a_rs, a_rs, a_ks, rows, b + j0, ldb, c + i0 * ldc + j0, ldc,
                        accumulate);
    }
  }
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

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
