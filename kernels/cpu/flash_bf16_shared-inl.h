// Native bf16 attention, the steps the forward and the backward share: the degree-3 exp2, the
// pair rounding (two fp32 rows into bf16 pairs), the 16-lane Philox of the dropout stream (the
// shared one of philox-inl.h), and the packing of bf16 rows into pairs along either axis (with
// the finiteness flags that route tiles holding Inf or NaN to the careful path).
// Part of kernels/cpu/flash_bf16.cpp, included once by it inside its anonymous namespace and
// its AVX-512 + BF16 target region (not a standalone header: it uses that file's includes,
// FlashBf16Params helpers and constants). Contract: kernels/cpu/flash_bf16.hpp.
// IWYU pragma: private, include "kernels/cpu/flash_bf16.cpp"

constexpr int64_t kL = 16;  // fp32 lanes (queries) per vector

// 2^x, exactly 0 for x <= -150 (masked scores set to -inf, minus a finite max). x = n + f,
// n = round(x), |f| <= 1/2; 2^f by a degree-3 polynomial fitted for minimal relative error on
// [-1/2, 1/2] (iteratively reweighted least squares; max relative error 7.5e-5, as low as the
// degree-4 Taylor series, 5.6e-5, with one FMA less: the weights are rounded to bf16, 2^-8 =
// 3.9e-3, right after); vscalefps multiplies by 2^n and underflows to 0 below the subnormals.
inline __m512 Exp2Bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_set1_ps(0.05517167f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.24261114f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.69326097f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.99992806f));
  return _mm512_scalef_ps(poly, n);
}

// Two rows of 16 fp32 weights (keys 2j and 2j+1 of 16 queries) rounded to bf16 (nearest even) and
// interleaved into 16 pairs: lane t = (lo[t], hi[t]). vcvtne2ps2bf16 puts lo in halves 0..15 and
// hi in halves 16..31; vpermw interleaves them.
inline __m512i PairBf16(__m512 lo, __m512 hi) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Philox 4x32-10 (attn/core/rng.hpp) on 16 counters at once: c[w] holds word w of every lane's
// counter on entry and word w of its output on exit. The shared SIMD Philox (philox-inl.h, its
// AVX3 instance, included by flash_bf16.cpp), the one the fp32 kernel and the dropout op draw.
inline void Philox16(__m512i c[4], uint64_t seed) {
  N_AVX3::Philox4x32Avx512(c, seed);
}
// Two sets of 16 counters at once (c[n] as c above), rounds interleaved.
inline void Philox16x2(__m512i c[2][4], uint64_t seed) {
  N_AVX3::Philox4x32Avx512x2(c, seed);
}

// True when a 16-word vector of bf16 pairs holds no Inf or NaN (exponent field all ones).
inline bool PairsFinite(__m512i w) {
  const __m512i e = _mm512_set1_epi16(0x7f80);
  return _mm512_cmpeq_epi16_mask(_mm512_and_si512(w, e), e) == 0;
}

// dst[j*ld + r] = (x[r][2j], x[r][2j+1]) for r < n, j < ceil(D/2), with x[r][c] = src[r*rs + c*sd]
// (a zero high half past D): a tile's rows laid along the lanes as bf16 pairs. With unit feature
// stride, 16 x 16 blocks of pairs go through transpose16x16_epi32 (a first version gathered the
// pair j of 16 rows: 7% of the forward at T = S = 1024, D = 64); else scalar.
void PackPairsTransposed(const uint16_t* src, int64_t n, int64_t D, int64_t rs, int64_t sd,
                         uint32_t* dst, int64_t ld) {
  const int64_t D2 = (D + 1) / 2;
  if (sd != 1) {
    for (int64_t j = 0; j < D2; ++j) {
      const bool has1 = 2 * j + 1 < D;
      for (int64_t r = 0; r < n; ++r) {
        const uint16_t* x = src + r * rs + 2 * j * sd;
        dst[j * ld + r] = uint32_t{x[0]} | (has1 ? uint32_t{x[sd]} << 16 : 0u);
      }
    }
    return;
  }
  __m512i blk[16];
  for (int64_t ra = 0; ra < n; ra += kL) {
    const int64_t m = std::min(kL, n - ra);
    const __mmask16 rows = m == kL ? __mmask16(0xffff) : __mmask16((1u << m) - 1);
    for (int64_t j0 = 0; j0 < D2; j0 += kL) {
      const int64_t ne = std::min<int64_t>(2 * kL, D - 2 * j0);  // bf16 elements of the row
      const __mmask32 cols = ne == 2 * kL ? __mmask32(0xffffffffu) : __mmask32((1u << ne) - 1);
      for (int i = 0; i < kL; ++i) {
        const uint16_t* x = src + (ra + i) * rs + 2 * j0;
        blk[i] = i >= m         ? _mm512_setzero_si512()
                 : ne == 2 * kL ? _mm512_loadu_si512(x)
                                : _mm512_maskz_loadu_epi16(cols, x);
      }
      transpose16x16_epi32(blk);
      for (int64_t c = 0; c < std::min(kL, D2 - j0); ++c)
        _mm512_mask_storeu_epi32(dst + (j0 + c) * ld + ra, rows, blk[c]);
    }
  }
}

// dst[i*ld + c] = (x[2i][c], x[2i+1][c]) for i < ceil(n/2), c < C, with x[r][c] = src[r*rs + c*cs]
// (a zero high half past row n), zeros for c in [C, ld): rows laid out as pairs along the row
// axis, features adjacent. bad[r] |= (row r's pair holds an Inf or NaN) (both rows of a pair are
// marked: a conservative flag, it only sends a tile to the exact loops).
void PackPairsRows(const uint16_t* src, int64_t n, int64_t C, int64_t rs, int64_t cs, uint32_t* dst,
                   int64_t ld, uint8_t* bad) {
  for (int64_t i = 0; i < (n + 1) / 2; ++i) {
    const uint16_t* r0 = src + 2 * i * rs;
    const uint16_t* r1 = r0 + rs;
    const bool has1 = 2 * i + 1 < n;
    uint32_t* o = dst + i * ld;
    bool finite = true;
    int64_t c = 0;
    if (cs == 1) {
      for (; c < C; c += kL) {
        const __mmask16 m = c + kL <= C ? __mmask16(0xffff) : __mmask16((1u << (C - c)) - 1);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + c));
        const __m512i hi = has1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1 + c))
                                : _mm512_setzero_si512();
        const __m512i w = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        finite &= PairsFinite(w);
        _mm512_mask_storeu_epi32(o + c, m, w);
      }
      c = C;
    } else {
      for (; c < C; ++c) {
        const uint32_t lo = r0[c * cs], hi = has1 ? r1[c * cs] : 0u;
        finite &= (lo & 0x7f80u) != 0x7f80u && (hi & 0x7f80u) != 0x7f80u;
        o[c] = lo | (hi << 16);
      }
    }
    std::fill(o + C, o + ld, 0u);
    if (!finite) {
      bad[2 * i] = 1;
      if (has1) bad[2 * i + 1] = 1;
    }
  }
}
