// Fused CPU attention with bfloat16 inputs (contract in flash_bf16.hpp).
//
// Native forward (AVX512-BF16, chosen at run time). The fp32 kernel's layout (flash_attention.cpp:
// a block of queries along the vector lanes, key tiles, online softmax in log2 units) with both
// products done by vdpbf16ps, which multiplies the two bf16 of each 32-bit lane of two vectors
// and adds both products to the fp32 lane of the accumulator: one instruction is 32 multiplies.
// So every operand is laid out as *pairs* along the reduction axis:
//
//   X^T = K Q^T  (keys x queries)   reduction over d: Q^T packed per block as qt2[d/2][t] =
//                                   (q[t][2i], q[t][2i+1]); K as a broadcast 32-bit pair
//                                   (k[s][2i], k[s][2i+1]) from a copy packed once per call,
//                                   kt2[b][i][s], so that the 8 keys of a micro-tile are adjacent.
//   O^T += V^T P^T (Dv x queries)   reduction over s: P^T rounded to bf16 as pt2[s/2][t] =
//                                   (P[2j][t], P[2j+1][t]) (vcvtne2ps2bf16 + one vpermw per two key
//                                   rows); V as a broadcast pair (v[2j][e], v[2j+1][e]) from a
//                                   copy packed once per call, vt2[b][j][e].
//
// Scores come out of the dot products in fp32 and are multiplied by c = scale log2 e on the
// store (q is not pre-scaled: that would round q * c to bf16 again), where the micro-kernel also
// keeps the tile's column maximum. The softmax is fp32: the weights use a degree-3 exp2 (relative
// error 7.5e-5, far below the 2^-8 of the bf16 rounding that follows), the per-tile rescale an
// accurate one; the denominator l sums the fp32 weights, the numerator uses the bf16-rounded
// (dropped-out) weights. Everything else (masks, masked rows, NaN rules, threads) follows the
// fp32 kernel. Measured against it and the history of each choice: docs/notes/bf16-kernel.md.
//
// Native backward (AVX512-BF16): FlashAttention-2 Algorithm 2 with the same pairs (layout in the
// section "Native backward" below): all five products on vdpbf16ps, P Z and dS
// rounded to bf16 once for the products that consume them, dQ, dK, dV accumulated in fp32 and
// rounded once.
//
// Performance notes (2 cores, AMD EPYC with avx512_bf16, 2 threads): forward 1.8x the fp32
// forward at T = S = 1024 (D = 64 and 128), 1.6-1.9x at T = S = 4096 (load ~8). Of the time,
// ~70-80% is the micro-kernel, ~15-20% the softmax, ~4% the packs. Backward 1.6-1.9x the fp32
// backward at the same shapes (load 2-3); ~70% micro-kernels, ~20% the softmax backward, ~4%
// the packs.
#include "kernels/cpu/flash_bf16.hpp"

#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/scratch.hpp"
#include "kernels/cpu/transpose16.hpp"

#include "attn/core/dtype.hpp"
#include "attn/core/rng.hpp"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace attn::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool cpu_has_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// Keys [0, limit) are kept for row (b, t) (length mask and causal mask both keep a prefix).
int64_t row_limit(const FlashBf16Params& p, int64_t b, int64_t t) {
  return p.row_limit(b, t);
}

// Dropout multipliers of elements i0 + k, k < n (kernels/cpu/dropout_simd.hpp).
void dropout_multipliers(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z) {
  cpu::dropout_multipliers(p.dropout, p.seed, p.offset, i0, n, z);
}

// Offset of batch row b in a tensor with batch stride sb and head stride sh (heads > 1: b is
// (batch, head) = (b / heads, b % heads); kernels/attention_problem.hpp).
inline int64_t head_off(int64_t heads, int64_t b, int64_t sb, int64_t sh) {
  return heads == 1 ? b * sb : b / heads * sb + b % heads * sh;
}

// ---------------------------------------------------------------------------------------------
// Fallback: through the fp32 kernels

// Widens a strided (B, N, C) bf16 view into the contiguous fp32 array dst (rows split over the
// threads: elementwise, so the result does not depend on the split).
template <class U>  // uint16_t or const uint16_t
void to_float(const kernels::StridedView<U> src, int64_t B, int64_t N, int64_t C, int64_t heads,
              int threads, float* dst) {
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t bn = 0; bn < B * N; ++bn) {
    const uint16_t* x = src.data + head_off(heads, bn / N, src.sb, src.sh) + bn % N * src.st;
    float* y = dst + bn * C;
    for (int64_t c = 0; c < C; ++c)
      y[c] = bf16_to_float(x[c * src.sd]);
  }
}

// Rounds a contiguous (B, N, C) fp32 array into a strided bf16 view.
void to_bf16(const float* src, const kernels::StridedView<uint16_t> dst, int64_t B, int64_t N,
             int64_t C, int64_t heads, int threads) {
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t bn = 0; bn < B * N; ++bn) {
    const float* x = src + bn * C;
    uint16_t* y = dst.data + head_off(heads, bn / N, dst.sb, dst.sh) + bn % N * dst.st;
    for (int64_t c = 0; c < C; ++c)
      y[c * dst.sd] = float_to_bf16(x[c]);
  }
}

// A contiguous (B, N, C) view of `data`.
template <class E>
kernels::StridedView<E> contiguous_view(E* data, int64_t N, int64_t C) {
  return {data, N * C, 0, C, 1};
}

// fp32 copies of q, k, v and out (converted from p.out.data with `with_out`, for the backward;
// otherwise only room for the fp32 kernel's output), then `extra` more floats for the caller,
// all in one scratch block (every part is written before it is read: conversions, or the fp32
// kernels' outputs, which overwrite), and the fp32 kernel's parameters on them.
struct Fp32Copies {
  Scratch<float> arena;
  float *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *extra = nullptr;
  FlashParams f;
};

void fp32_params(const FlashBf16Params& p, bool with_out, size_t extra, Fp32Copies& c) {
  const int64_t B = p.B, T = p.T, S = p.S, D = p.D, Dv = p.Dv;
  const int th = p.threads;
  const auto n = [](int64_t a, int64_t b, int64_t e) { return static_cast<size_t>(a * b * e); };
  const size_t nq = n(B, T, D), nk = n(B, S, D), nv = n(B, S, Dv), no = n(B, T, Dv);
  c.arena = Scratch<float>("flash_attention_bf16", nq + nk + nv + no + extra);
  c.q = c.arena.get();
  c.k = c.q + nq, c.v = c.k + nk, c.out = c.v + nv, c.extra = c.out + no;
  to_float(p.q, B, T, D, p.heads, th, c.q);
  to_float(p.k, B, S, D, p.heads, th, c.k);
  to_float(p.v, B, S, Dv, p.heads, th, c.v);
  if (with_out) to_float(p.out, B, T, Dv, p.heads, th, c.out);
  FlashParams& f = c.f;
  static_cast<kernels::AttentionProblem&>(f) = p;  // the same problem, on contiguous copies
  f.heads = 1;
  f.q = contiguous_view<const float>(c.q, T, D);
  f.k = contiguous_view<const float>(c.k, S, D);
  f.v = contiguous_view<const float>(c.v, S, Dv);
  f.out = contiguous_view(c.out, T, Dv);
  f.lse = p.lse;
  f.weights = p.weights, f.w_sb = p.w_sb, f.w_st = p.w_st;
}

void forward_fallback(const FlashBf16Params& p) {
  Fp32Copies c;
  fp32_params(p, /*with_out=*/false, /*extra=*/0, c);
  flash_attention_forward(c.f);
  to_bf16(c.out, p.out, p.B, p.T, p.Dv, p.heads, p.threads);
}

// ---------------------------------------------------------------------------------------------
// Native forward (AVX512-BF16). Everything from here to the pop_options is compiled for
// AVX-512 + BF16 and reached only when cpu_has_bf16().

#if defined(__clang__)  // the fuzz build
#pragma clang attribute push( \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// GCC 12's avx512fintrin.h builds _mm512_max_ps and friends on `__m512 __Y = __Y;`
// (_mm512_undefined_ps), which -Wmaybe-uninitialized reports once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

constexpr int64_t kL = 16;            // fp32 lanes (queries) per vector
constexpr int64_t kBlockK = 64;       // keys per tile (32 pairs)
constexpr int64_t kBlockQ = 12 * kL;  // queries per work item
constexpr int kMR = 8, kNV = 3;       // micro-tile: 8 rows x 3 vectors = 24 accumulators

// One micro-tile C (rows x NV*16, fp32) = [alpha .*] C + A B with bf16 pairs:
// A(i, k) = a[k*lda + i], a 32-bit word holding two bf16 (broadcast); row k of B is NV*16 words
// at b + k*ldb, each two bf16. The rows of A are adjacent words, so one pointer and constant
// offsets address all MR broadcasts (GCC spilled accumulators when each row had its own
// pointer). Rows past `rows` read the words after them (the packed buffers have MR words of
// slack) and are not stored. alpha null: C starts at 0; else C starts as C times alpha per
// column (the online softmax's rescale, fused into the load). Stores C * out_mul and, when colmax
// is set, folds the stored rows into the running column maxima colmax[0 .. NV*16) (the score
// tile's maximum, so the softmax needs no pass of its own for it).
template <int MR, int NV>
__attribute__((noinline)) void micro_tile(int64_t K2, const uint32_t* a, int64_t lda, int rows,
                                          const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                                          const float* alpha, float out_mul, float* colmax) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[i][j] = (alpha != nullptr && i < rows)
                      ? _mm512_mul_ps(_mm512_loadu_ps(c + i * ldc + j * kL),
                                      _mm512_loadu_ps(alpha + j * kL))
                      : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = (__m512bh)_mm512_loadu_si512(b + j * kL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i]));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ai, bv[j]);
    }
    a += lda;
    b += ldb;
  }
  const __m512 mul = _mm512_set1_ps(out_mul);
  if (colmax == nullptr) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      if (i >= rows) break;
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        _mm512_storeu_ps(c + i * ldc + j * kL, _mm512_mul_ps(acc[i][j], mul));
    }
    return;
  }
  __m512 mx[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j)
    mx[j] = _mm512_loadu_ps(colmax + j * kL);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m512 x = _mm512_mul_ps(acc[i][j], mul);
      _mm512_storeu_ps(c + i * ldc + j * kL, x);
      mx[j] = _mm512_max_ps(mx[j], x);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j)
    _mm512_storeu_ps(colmax + j * kL, mx[j]);
}

// C (M x N) = [alpha .*] C + A B over the micro-tiles (N a multiple of 16): one B panel of NV
// vectors stays in L1 while every MR-row panel of A streams past it.
__attribute__((noinline)) void gemm_bf16(int64_t M, int64_t N, int64_t K2, const uint32_t* a,
                                         int64_t lda, const uint32_t* b, int64_t ldb, float* c,
                                         int64_t ldc, const float* alpha, float out_mul,
                                         float* colmax) {
  int64_t j0 = 0;
  for (; j0 + kNV * kL <= N; j0 += kNV * kL)
    for (int64_t i0 = 0; i0 < M; i0 += kMR)
      micro_tile<kMR, kNV>(K2, a + i0, lda, static_cast<int>(std::min<int64_t>(kMR, M - i0)),
                           b + j0, ldb, c + i0 * ldc + j0, ldc, alpha ? alpha + j0 : nullptr,
                           out_mul, colmax ? colmax + j0 : nullptr);
  for (; j0 < N; j0 += kL)
    for (int64_t i0 = 0; i0 < M; i0 += kMR)
      micro_tile<kMR, 1>(K2, a + i0, lda, static_cast<int>(std::min<int64_t>(kMR, M - i0)), b + j0,
                         ldb, c + i0 * ldc + j0, ldc, alpha ? alpha + j0 : nullptr, out_mul,
                         colmax ? colmax + j0 : nullptr);
}

// 2^x, exactly 0 for x <= -150 (masked scores set to -inf, minus a finite max). x = n + f,
// n = round(x), |f| <= 1/2; 2^f by a degree-3 polynomial fitted for minimal relative error on
// [-1/2, 1/2] (iteratively reweighted least squares; max relative error 7.5e-5, as low as the
// degree-4 Taylor series, 5.6e-5, with one FMA less: the weights are rounded to bf16, 2^-8 =
// 3.9e-3, right after); vscalefps multiplies by 2^n and underflows to 0 below the subnormals.
inline __m512 exp2_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_set1_ps(0.05517167f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.24261114f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.69326097f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.99992806f));
  return _mm512_scalef_ps(poly, n);
}

// 2^x as exp2_bf16 but accurate to fp32 (degree-6 Taylor series, truncation (ln2/2)^7/7! = 1.3e-7)
// and exact at x = 0: for the rescale factor 2^(m_old - m_new) of the running sum and output,
// which compounds over the key tiles (a bias of exp2_bf16's 7.5e-5 per tile would reach 5e-3 in
// lse after 64 tiles).
inline __m512 exp2_accurate(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_set1_ps(1.5403530393381606e-04f);  // ln2^6 / 6!
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.3333558146428443e-03f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.6181291076284772e-03f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5504108664821580e-02f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.4022650695910071e-01f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.9314718055994531e-01f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);
}

// Two rows of 16 fp32 weights (keys 2j and 2j+1 of 16 queries) rounded to bf16 (nearest even) and
// interleaved into 16 pairs: lane t = (lo[t], hi[t]). vcvtne2ps2bf16 puts lo in halves 0..15 and
// hi in halves 16..31; vpermw interleaves them.
inline __m512i pair_bf16(__m512 lo, __m512 hi) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Philox 4x32-10 (attn/core/rng.hpp) on 16 counters at once: c[w] holds word w of every lane's
// counter on entry and word w of its output on exit. 32 x 32 -> 64-bit products: vpmuludq on
// the even lanes and on the odd lanes shifted down, merged by a blend.
inline void mul_hi_lo(__m512i x, uint32_t m, __m512i& hi, __m512i& lo) {
  const __m512i vm = _mm512_set1_epi32(static_cast<int>(m));
  lo = _mm512_mullo_epi32(x, vm);
  const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(x, vm), 32);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), vm);
  hi = _mm512_mask_blend_epi32(0xaaaa, even, odd);
}

inline void philox16(__m512i c[4], uint64_t seed) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mul_hi_lo(c[0], 0xD2511F53u, hi0, lo0);
    mul_hi_lo(c[2], 0xCD9E8D57u, hi1, lo1);
    const __m512i n0 =
        _mm512_xor_si512(_mm512_xor_si512(hi1, c[1]), _mm512_set1_epi32(static_cast<int>(k0)));
    const __m512i n2 =
        _mm512_xor_si512(_mm512_xor_si512(hi0, c[3]), _mm512_set1_epi32(static_cast<int>(k1)));
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// X^T *= Z^T on the weight tile (nk keys x query lanes [c0, mqp)), keys from s0, vectorized
// across queries. Needs S % 4 == 0: then query t's run of keys starts at element (bT + t)S + s0,
// a multiple of 4 (s0 is a multiple of the tile), so key s0 + 4g + j of every lane is word j of
// Philox block ((bT + t)S + s0)/4 + g: one 16-lane Philox per 4 keys of 16 queries (the scalar
// draw costs one call per 4 keys per query). Returns false (nothing done) otherwise. Masked keys
// hold weight 0 and stay 0.
bool dropout_tile(const FlashBf16Params& p, int64_t b, int64_t t0, int64_t s0, int64_t nk,
                  int64_t c0, int64_t mqp, float* xt) {
  if (p.S % 4 != 0) return false;
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const __m512 vp = _mm512_set1_ps(p.dropout), vkeep = _mm512_set1_ps(keep_scale);
  const __m512 two_m24 = _mm512_set1_ps(1.0f / 16777216.0f);
  const __m512i off_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset)));
  const __m512i off_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset >> 32)));
  alignas(64) uint32_t lo_w[kL], hi_w[kL];
  for (int64_t q = c0; q < mqp; q += kL) {
    for (int64_t l = 0; l < kL; ++l) {
      const uint64_t blk = static_cast<uint64_t>((b * p.T + t0 + q + l) * p.S + s0) >> 2;
      lo_w[l] = static_cast<uint32_t>(blk);
      hi_w[l] = static_cast<uint32_t>(blk >> 32);
    }
    const __m512i lo = _mm512_load_si512(lo_w), hi = _mm512_load_si512(hi_w);
    for (int64_t g = 0; 4 * g < nk; ++g) {
      __m512i c[4];
      c[0] = _mm512_add_epi32(lo, _mm512_set1_epi32(static_cast<int>(g)));
      const __mmask16 carry = _mm512_cmplt_epu32_mask(c[0], lo);
      c[1] = _mm512_mask_add_epi32(hi, carry, hi, _mm512_set1_epi32(1));
      c[2] = off_lo;
      c[3] = off_hi;
      philox16(c, p.seed);
      for (int64_t j = 0; j < 4 && 4 * g + j < nk; ++j) {
        // kept iff (r >> 8) 2^-24 >= p, exactly as attn::dropout_keep computes it in float
        const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c[j], 8)), two_m24);
        const __m512 z = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, vp, _CMP_GE_OQ), vkeep);
        float* row = xt + (4 * g + j) * mqp + q;
        _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), z));
      }
    }
  }
  return true;
}

// True when a 16-word vector of bf16 pairs holds no Inf or NaN (exponent field all ones).
inline bool pairs_finite(__m512i w) {
  const __m512i e = _mm512_set1_epi16(0x7f80);
  return _mm512_cmpeq_epi16_mask(_mm512_and_si512(w, e), e) == 0;
}

// dst[j*ld + r] = (x[r][2j], x[r][2j+1]) for r < n, j < ceil(D/2), with x[r][c] = src[r*rs + c*sd]
// (a zero high half past D): a tile's rows laid along the lanes as bf16 pairs. With unit feature
// stride, 16 x 16 blocks of pairs go through transpose16x16_epi32 (a first version gathered the
// pair j of 16 rows: 7% of the forward at T = S = 1024, D = 64); else scalar.
void pack_pairs_transposed(const uint16_t* src, int64_t n, int64_t D, int64_t rs, int64_t sd,
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

// Packed copies made once per call, before the work items (O(B S (D + Dv)), against the
// O(B T S (D + Dv)) of the products): the A operands of both products with their rows (keys for
// K, features for V) in adjacent words.
struct Packed {
  int64_t S2 = 0, D2 = 0, tiles = 0, ldk = 0;
  uint32_t* vt2 = nullptr;        // (B, S2, Dv) words: (v[2j][e], v[2j+1][e])
  uint32_t* kt2 = nullptr;        // (B, D2, ldk) words: (k[s][2i], k[s][2i+1])
  std::vector<uint8_t> v_finite;  // (B, tiles): V of the 64-key tile is finite
  Scratch<uint32_t> block;        // vt2 and kt2
};

// dst[i*ld + c] = (x[2i][c], x[2i+1][c]) for i < ceil(n/2), c < C, with x[r][c] = src[r*rs + c*cs]
// (a zero high half past row n), zeros for c in [C, ld): rows laid out as pairs along the row
// axis, features adjacent. bad[r] |= (row r's pair holds an Inf or NaN) (both rows of a pair are
// marked: a conservative flag, it only sends a tile to the exact loops).
void pack_pairs_rows(const uint16_t* src, int64_t n, int64_t C, int64_t rs, int64_t cs,
                     uint32_t* dst, int64_t ld, uint8_t* bad) {
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
        finite &= pairs_finite(w);
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

void pack_batch(const FlashBf16Params& p, Packed& pk, int64_t b) {
  const int64_t S = p.S, Dv = p.Dv, S2 = pk.S2;
  uint32_t* vt = pk.vt2 + b * S2 * Dv;
  const uint16_t* vb = p.v.data + head_off(p.heads, b, p.v.sb, p.v.sh);
  uint8_t bad[kBlockK];
  for (int64_t tile = 0; tile < pk.tiles; ++tile) {
    const int64_t s0 = tile * kBlockK, n = std::min(kBlockK, S - s0);
    std::fill(bad, bad + n, uint8_t{0});
    pack_pairs_rows(vb + s0 * p.v.st, n, Dv, p.v.st, p.v.sd, vt + s0 / 2 * Dv, Dv, bad);
    pk.v_finite[b * pk.tiles + tile] = std::none_of(bad, bad + n, [](uint8_t x) { return x != 0; });
  }
  uint32_t* kt = pk.kt2 + b * pk.D2 * pk.ldk;
  // (A first version wrote key by key, one word per 4 KiB row at S = 1024: 17% of the forward.)
  pack_pairs_transposed(p.k.data + head_off(p.heads, b, p.k.sb, p.k.sh), S, p.D, p.k.st, p.k.sd, kt,
                        pk.ldk);
}

size_t scratch_floats(const FlashBf16Params& p, const Packed& pk) {
  return static_cast<size_t>(pk.D2 * kBlockQ + kBlockK * kBlockQ + kBlockK / 2 * kBlockQ +
                             p.Dv * kBlockQ + 5 * kBlockQ + kBlockK + p.Dv + kL);
}

// Output row of a query with no kept key: the mean of v over all S keys (d2l), dropout applied
// to the 1/S weights, or zeros (PyTorch SDPA).
void masked_row(const FlashBf16Params& p, int64_t b, int64_t t, float* acc, float* z) {
  std::fill(acc, acc + p.Dv, 0.0f);
  if (p.zero_masked_rows()) return;
  for (int64_t s0 = 0; s0 < p.S; s0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, p.S - s0);
    if (p.dropout > 0.0f) {
      dropout_multipliers(p, static_cast<uint64_t>((b * p.T + t) * p.S + s0), nk, z);
    } else {
      std::fill(z, z + nk, 1.0f);
    }
    for (int64_t s = 0; s < nk; ++s) {
      const float w = z[s] / static_cast<float>(p.S);
      const uint16_t* vs = p.v.data + head_off(p.heads, b, p.v.sb, p.v.sh) + (s0 + s) * p.v.st;
      for (int64_t e = 0; e < p.Dv; ++e)
        acc[e] += w * bf16_to_float(vs[e * p.v.sd]);
    }
  }
}

// One work item: queries [t0, t0 + kBlockQ) of batch row b (the fp32 ForwardBlock's structure).
void forward_block(const FlashBf16Params& p, const Packed& pk, int64_t b, int64_t t0,
                   float* scratch) {
  const int64_t D = p.D, Dv = p.Dv, D2 = pk.D2;
  const int64_t mq = std::min(kBlockQ, p.T - t0), mqp = (mq + kL - 1) / kL * kL;
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(scratch);             // (D2, mqp) Q^T pairs
  float* xt = scratch + D2 * mqp;                                   // (kBlockK, mqp) X^T, P^T
  uint32_t* pt2 = reinterpret_cast<uint32_t*>(xt + kBlockK * mqp);  // (kBlockK/2, mqp) P^T pairs
  float* ot = reinterpret_cast<float*>(pt2 + kBlockK / 2 * mqp);    // (Dv, mqp) O^T
  float* mv = ot + Dv * mqp;                                        // (mqp) running max
  float* lv = mv + mqp;                                             // (mqp) running sum
  float* limv = lv + mqp;                                           // (mqp) key limits
  float* alpha = limv + mqp;                                        // (mqp) rescale
  float* z = alpha + mqp;                                           // (kBlockK) dropout
  float* tmp = z + kBlockK;                                         // (Dv) masked row
  float* tmax = tmp + p.Dv;                                         // (mqp) tile maximum
  const bool dropout = p.dropout > 0.0f;
  const float c = p.scale * kLog2e;

  int64_t lim[kBlockQ];
  int64_t max_lim = 0;
  for (int64_t r = 0; r < mq; ++r) {
    lim[r] = row_limit(p, b, t0 + r);
    max_lim = std::max(max_lim, lim[r]);
    limv[r] = static_cast<float>(lim[r]);
  }
  std::fill(limv + mq, limv + mqp, 0.0f);  // padding lanes: junk columns, never stored
  pack_pairs_transposed(p.q.data + head_off(p.heads, b, p.q.sb, p.q.sh) + t0 * p.q.st, mq, D,
                        p.q.st, p.q.sd, qt2, mqp);
  for (int64_t j = 0; j < D2; ++j)
    std::fill(qt2 + j * mqp + mq, qt2 + (j + 1) * mqp, 0u);
  std::fill(ot, ot + Dv * mqp, 0.0f);
  std::fill(mv, mv + mqp, kNegInf);
  std::fill(lv, lv + mqp, 0.0f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);

  const uint32_t* kt2 = pk.kt2 + b * D2 * pk.ldk;
  const uint32_t* vt2 = pk.vt2 + b * pk.S2 * Dv;

  for (int64_t s0 = 0; s0 < max_lim; s0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, max_lim - s0), nk2 = (nk + 1) / 2;
    int64_t r_first = 0;
    while (lim[r_first] <= s0)
      ++r_first;
    const int64_t c0 = r_first / kL * kL, ncol = mqp - c0;
    int64_t min_lim = p.S;
    for (int64_t r = c0; r < mq; ++r)
      min_lim = std::min(min_lim, lim[r]);

    // X^T = c K Q^T: (nk, ncol), fp32
    std::fill(tmax + c0, tmax + mqp, kNegInf);
    gemm_bf16(nk, ncol, D2, kt2 + s0, pk.ldk, qt2 + c0, mqp, xt + c0, mqp, nullptr, c, tmax + c0);
    const bool masked = min_lim < s0 + nk;
    if (masked) {  // some kept prefix ends inside this tile: mask key s0+s >= limit
      for (int64_t s = 0; s < nk; ++s) {
        const __m512 key = _mm512_set1_ps(static_cast<float>(s0 + s));
        float* row = xt + s * mqp;
        for (int64_t q = c0; q < mqp; q += kL) {
          const __mmask16 keep = _mm512_cmp_ps_mask(key, _mm512_loadu_ps(limv + q), _CMP_LT_OQ);
          _mm512_storeu_ps(row + q, _mm512_mask_blend_ps(keep, neg_inf, _mm512_loadu_ps(row + q)));
        }
      }
    }

    // Online softmax, 16 queries per vector; without dropout the weights go straight to bf16
    // pairs, with it they stay fp32 in xt until the multipliers are applied.
    for (int64_t q = c0; q < mqp; q += kL) {
      const __m512 m_old = _mm512_loadu_ps(mv + q);
      __m512 m_new;
      if (!masked) {  // the score GEMM left the tile maximum in tmax
        m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(tmax + q));
      } else {  // over the kept keys only; four chains (one vmaxps chain is latency-bound)
        __m512 mx[4] = {m_old, m_old, m_old, m_old};
        int64_t s = 0;
        for (; s + 4 <= nk; s += 4)
          for (int u = 0; u < 4; ++u)
            mx[u] = _mm512_max_ps(mx[u], _mm512_loadu_ps(xt + (s + u) * mqp + q));
        for (; s < nk; ++s)
          mx[0] = _mm512_max_ps(mx[0], _mm512_loadu_ps(xt + s * mqp + q));
        m_new = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
      }
      // No kept key so far: m = -inf; subtract 0 instead (weights 2^-inf = 0, not NaN).
      const __m512 m_use = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                                                m_new, _mm512_setzero_ps());
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < nk2; ++j) {
        float* x0 = xt + 2 * j * mqp + q;
        const __m512 e0 = exp2_bf16(_mm512_sub_ps(_mm512_loadu_ps(x0), m_use));
        const __m512 e1 = 2 * j + 1 < nk
                              ? exp2_bf16(_mm512_sub_ps(_mm512_loadu_ps(x0 + mqp), m_use))
                              : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        if (dropout) {
          _mm512_storeu_ps(x0, e0);
          if (2 * j + 1 < nk) _mm512_storeu_ps(x0 + mqp, e1);
        } else {
          _mm512_storeu_si512(pt2 + j * mqp + q, pair_bf16(e0, e1));
        }
      }
      const __m512 a = exp2_accurate(_mm512_sub_ps(m_old, m_use));  // 0 on a first kept tile
      _mm512_storeu_ps(lv + q, _mm512_fmadd_ps(_mm512_loadu_ps(lv + q), a, sum));
      _mm512_storeu_ps(mv + q, m_new);
      _mm512_storeu_ps(alpha + q, a);
    }
    // Dropout: numerator weights only (it acts after the normalization).
    if (dropout && !dropout_tile(p, b, t0, s0, nk, c0, mqp, xt)) {
      for (int64_t r = r_first; r < mq; ++r) {
        const int64_t n = std::clamp<int64_t>(lim[r] - s0, 0, nk);
        dropout_multipliers(p, static_cast<uint64_t>((b * p.T + t0 + r) * p.S + s0), n, z);
        for (int64_t s = 0; s < n; ++s)
          xt[s * mqp + r] *= z[s];
      }
    }
    if (dropout) {
      for (int64_t q = c0; q < mqp; q += kL)
        for (int64_t j = 0; j < nk2; ++j) {
          const float* x0 = xt + 2 * j * mqp + q;
          const __m512 e1 = 2 * j + 1 < nk ? _mm512_loadu_ps(x0 + mqp) : _mm512_setzero_ps();
          _mm512_storeu_si512(pt2 + j * mqp + q, pair_bf16(_mm512_loadu_ps(x0), e1));
        }
    }

    // O^T = alpha O^T + V^T P^T: (Dv, ncol). A pair's second key past nk has weight 0, so it is
    // harmless unless its v is not finite (0 * Inf): such tiles, like partly masked tiles with
    // non-finite v, add only the kept terms.
    const bool clean = min_lim >= s0 + nk && (nk % 2 == 0 || s0 + nk == p.S);
    if (clean || pk.v_finite[b * pk.tiles + s0 / kBlockK]) {
      gemm_bf16(Dv, ncol, nk2, vt2 + s0 / 2 * Dv, Dv, pt2 + c0, mqp, ot + c0, mqp, alpha + c0, 1.0f,
                nullptr);
    } else {
      for (int64_t e = 0; e < Dv; ++e)
        for (int64_t q = c0; q < mqp; ++q)
          ot[e * mqp + q] *= alpha[q];
      for (int64_t r = r_first; r < mq; ++r)
        for (int64_t s = 0; s < std::min(nk, lim[r] - s0); ++s) {
          const uint32_t w = pt2[s / 2 * mqp + r];
          const float pw = bf16_to_float(static_cast<uint16_t>(s % 2 == 0 ? w : w >> 16));
          const uint16_t* vs = p.v.data + head_off(p.heads, b, p.v.sb, p.v.sh) + (s0 + s) * p.v.st;
          for (int64_t e = 0; e < Dv; ++e)
            ot[e * mqp + r] += pw * bf16_to_float(vs[e * p.v.sd]);
        }
    }
  }

  // out = O^T / l, transposed back 16 queries at a time (vcvtneps2bf16 rounds to nearest even).
  for (int64_t r = 0; r < mqp; ++r)
    alpha[r] = r < mq && lim[r] > 0 ? 1.0f / lv[r] : 0.0f;
  alignas(32) uint16_t o16[kL];
  for (int64_t e = 0; e < Dv; ++e)
    for (int64_t q = 0; q < mq; q += kL) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(ot + e * mqp + q), _mm512_loadu_ps(alpha + q));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o16), (__m256i)_mm512_cvtneps_pbh(x));
      uint16_t* o = p.out.data + head_off(p.heads, b, p.out.sb, p.out.sh) + (t0 + q) * p.out.st +
                    e * p.out.sd;
      for (int64_t l = 0; l < std::min(kL, mq - q); ++l)
        o[l * p.out.st] = o16[l];
    }
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t t = t0 + r;
    if (lim[r] == 0) {
      uint16_t* orow = p.out.data + head_off(p.heads, b, p.out.sb, p.out.sh) + t * p.out.st;
      masked_row(p, b, t, tmp, z);
      p.lse[b * p.T + t] = kNegInf;
      for (int64_t e = 0; e < Dv; ++e)
        orow[e * p.out.sd] = float_to_bf16(tmp[e]);
    } else {
      p.lse[b * p.T + t] = (mv[r] + std::log2(lv[r])) * kLn2;
    }
  }
}

void forward_native(const FlashBf16Params& p) {
  Packed pk;
  pk.S2 = (p.S + 1) / 2;
  pk.D2 = (p.D + 1) / 2;
  pk.tiles = (p.S + kBlockK - 1) / kBlockK;
  // Rows of kt2 16 words longer than a multiple of 16: the transposed stores of a 16 x 16 block
  // then fall into different L1 sets (a stride of S = 1024 words, 4 KiB, put all 16 in one set).
  pk.ldk = (p.S + kL - 1) / kL * kL + kL;
  // One block: V then K, each with kMR words of slack (the micro-kernel reads, and discards, up
  // to kMR - 1 rows past the end), K at a 64-byte boundary.
  const size_t nv = static_cast<size_t>(p.B * pk.S2 * p.Dv + kMR);
  const size_t nv_padded = (nv + 15) / 16 * 16;
  const size_t nk = static_cast<size_t>(p.B * pk.D2 * pk.ldk + kMR);
  pk.block = Scratch<uint32_t>("flash_attention_bf16", nv_padded + nk);
  pk.vt2 = pk.block.get();
  pk.kt2 = pk.vt2 + nv_padded;
  std::fill(pk.vt2 + nv - kMR, pk.vt2 + nv, 0u);
  std::fill(pk.kt2 + nk - kMR, pk.kt2 + nk, 0u);
  pk.v_finite.assign(static_cast<size_t>(p.B * pk.tiles), 1);
  const int64_t blocks = (p.T + kBlockQ - 1) / kBlockQ, items = p.B * blocks;
  const int threads = std::max(1, p.threads);
  const Scratch<float> scratches("flash_attention_bf16", scratch_floats(p, pk), threads);
  // Work items (b, query block) as in the fp32 forward: each one's arithmetic is fixed, so any
  // thread count and any schedule give the same bits; causal items are handed out longest first.
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.B; ++b)
      pack_batch(p, pk, b);
    float* scratch = scratches.get(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t i = p.causal ? items - 1 - it : it;
      const int64_t b = i / blocks, blk = p.causal ? blocks - 1 - i % blocks : i % blocks;
      forward_block(p, pk, b, blk * kBlockQ, scratch);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Native backward (AVX512-BF16): FlashAttention-2 Algorithm 2 as the fp32 kernel does it (work
// items (b, key range), key blocks of 64, query tiles of 96), every product on bf16 pairs. The
// score and dP tiles are laid out queries x keys (rows t, 64 keys along the lanes), so that:
//
//   X  = c Q K^T   (t x s)  A = Q^T pairs along d, queries adjacent: qt2[d/2][t]
//                           B = K pairs along d, keys as lanes:      kt2[d/2][s]
//   dP = dO V^T    (t x s)  A = dot2[e/2][t],  B = vt2[e/2][s]
//   dV^T += dO^T (P Z)   (e x s)  A = dO pairs along t: dop2[t/2][e]
//                                 B = P Z rounded to bf16, pairs along t: pz2[t/2][s]
//                                 (two rows of the tile interleaved: pair_bf16)
//   dK^T += Q^T dS       (d x s)  A = qp2[t/2][d],  B = dS pairs along t: ds2[t/2][s]
//   dQ   += dS K         (t x d)  A = dS pairs along s: dsr[t][s/2] (a row of the tile rounded
//                                 with vcvtne2ps2bf16, read with a row stride of 32 words)
//                                 B = K pairs along s, features as lanes: kp2[s/2][d]
//
// P = 2^(X - lse log2 e) and dS = P (dP Z - D_t) stay fp32 (degree-3 exp2 as in the forward);
// P Z and dS are rounded to bf16 once for the products that consume them; dK^T, dV^T (per key
// block) and dQ (per item, (T, Dp)) accumulate in fp32 and are rounded to bf16 once at the end.
// Each orientation is chosen so that only one operand needs a transposition that the pairs do
// not give for free: two rows of the tile interleaved are pairs along t (dV, dK), one row
// rounded is pairs along s (dQ), so no tile is ever transposed. q and dO are packed once per
// item (both layouts) when 4 T (D + Dv) bytes fit in 8 MiB, else per query tile; k and v per key
// block. Masks, masked rows, NaN rules (tiles whose q, dO or k hold an Inf or NaN add only their
// kept terms, as AllFinite in flash_attention.cpp), dropout (the same stream; one 16-lane Philox
// per query row of a block when S % 4 == 0) and the thread-independent work items and dQ sums
// follow the fp32 backward. Measured: docs/notes/bf16-kernel.md (backward versions).

constexpr int64_t kBwdK = 64;      // keys per block (32 pairs): lanes of the score tile
constexpr int64_t kBwdK2 = 32;     // pairs per key block; the row stride of dsr
constexpr int64_t kBwdQ = 96;      // queries per tile (48 pairs)
constexpr int kBMR = 6, kBNV = 4;  // micro-tile 6 rows x 4 vectors (24 accumulators)

// C (rows x NV*16, fp32) = [C +] A B on bf16 pairs: A(i, k) = a[k*lda + i*AS] (a word broadcast;
// AS is the row stride, a constant so that one pointer and constant offsets address the MR
// rows), row k of B is NV*16 words at b + k*ldb. Rows past `rows` read the words after them
// (every buffer has slack) and are not stored. Without `accumulate`, C = out_mul * A B.
template <int MR, int NV, int AS>
__attribute__((noinline)) void bwd_tile(int64_t K2, const uint32_t* a, int64_t lda, int rows,
                                        const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                                        bool accumulate, float out_mul) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[i][j] =
          (accumulate && i < rows) ? _mm512_loadu_ps(c + i * ldc + j * kL) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = (__m512bh)_mm512_loadu_si512(b + j * kL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * AS]));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ai, bv[j]);
    }
    a += lda;
    b += ldb;
  }
  const __m512 mul = _mm512_set1_ps(accumulate ? 1.0f : out_mul);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(c + i * ldc + j * kL, _mm512_mul_ps(acc[i][j], mul));
  }
}

// C (M x N, N a multiple of 16) = [C +] A B over the micro-tiles, A addressed as in bwd_tile.
template <int AS>
void bwd_gemm(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t lda, const uint32_t* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate, float out_mul) {
  int64_t j0 = 0;
  for (; j0 + kBNV * kL <= N; j0 += kBNV * kL)
    for (int64_t i0 = 0; i0 < M; i0 += kBMR)
      bwd_tile<kBMR, kBNV, AS>(K2, a + i0 * AS, lda,
                               static_cast<int>(std::min<int64_t>(kBMR, M - i0)), b + j0, ldb,
                               c + i0 * ldc + j0, ldc, accumulate, out_mul);
  for (; j0 < N; j0 += kL)
    for (int64_t i0 = 0; i0 < M; i0 += kBMR)
      bwd_tile<kBMR, 1, AS>(K2, a + i0 * AS, lda, static_cast<int>(std::min<int64_t>(kBMR, M - i0)),
                            b + j0, ldb, c + i0 * ldc + j0, ldc, accumulate, out_mul);
}

// Dropout multipliers z[0..n) of elements i0 + k of the stream, n <= 64 (one key block of a
// query row). When i0 % 4 == 0 (S % 4 == 0), element i0 + 4l + w is word w of Philox block
// i0/4 + l: one 16-lane Philox gives all 64, and its four output words are interleaved with
// unpacks and a 4 x 4 transpose of 128-bit lanes. Otherwise the scalar draw. (The forward's
// dropout_tile vectorizes across queries instead: its tile is transposed.)
void dropout_row64(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z) {
  if ((i0 & 3) != 0) {
    dropout_multipliers(p, i0, n, z);
    return;
  }
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const uint64_t blk = i0 >> 2;
  const __m512i lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(blk)));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(blk >> 32)));
  __m512i c[4];
  c[0] =
      _mm512_add_epi32(lo, _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  c[1] = _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(c[0], lo), hi, _mm512_set1_epi32(1));
  c[2] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset)));
  c[3] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset >> 32)));
  philox16(c, p.seed);
  __m512 m[4];
  for (int j = 0; j < 4; ++j) {  // kept iff (r >> 8) 2^-24 >= p, as attn::dropout_keep
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c[j], 8)),
                                   _mm512_set1_ps(1.0f / 16777216.0f));
    m[j] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, _mm512_set1_ps(p.dropout), _CMP_GE_OQ),
                               _mm512_set1_ps(keep_scale));
  }
  // 128-bit lane k of v[i] holds the 4 words of Philox lane 4k + i (elements 16k + 4i ..).
  const __m512 a0 = _mm512_unpacklo_ps(m[0], m[1]), a1 = _mm512_unpackhi_ps(m[0], m[1]);
  const __m512 b0 = _mm512_unpacklo_ps(m[2], m[3]), b1 = _mm512_unpackhi_ps(m[2], m[3]);
  const __m512 v0 =
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a0), _mm512_castps_pd(b0)));
  const __m512 v1 =
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a0), _mm512_castps_pd(b0)));
  const __m512 v2 =
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a1), _mm512_castps_pd(b1)));
  const __m512 v3 =
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a1), _mm512_castps_pd(b1)));
  // Elements 16k .. 16k + 15 = lane k of v0, v1, v2, v3.
  const __m512 t0 = _mm512_shuffle_f32x4(v0, v1, 0x44), t1 = _mm512_shuffle_f32x4(v2, v3, 0x44);
  const __m512 t2 = _mm512_shuffle_f32x4(v0, v1, 0xee), t3 = _mm512_shuffle_f32x4(v2, v3, 0xee);
  _mm512_storeu_ps(z, _mm512_shuffle_f32x4(t0, t1, 0x88));
  _mm512_storeu_ps(z + 16, _mm512_shuffle_f32x4(t0, t1, 0xdd));
  _mm512_storeu_ps(z + 32, _mm512_shuffle_f32x4(t2, t3, 0x88));
  _mm512_storeu_ps(z + 48, _mm512_shuffle_f32x4(t2, t3, 0xdd));
}

// min(n, 16) bf16 x[c * stride] as fp32 lanes (zeros past n).
inline __m512 load_bf16(const uint16_t* x, int64_t n, int64_t stride) {
  if (stride == 1) {
    const __mmask16 m = n >= kL ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
  }
  alignas(64) uint32_t w[kL] = {};
  for (int64_t c = 0; c < std::min(n, kL); ++c)
    w[c] = uint32_t{x[c * stride]} << 16;
  return _mm512_castsi512_ps(_mm512_load_si512(w));
}

// dst[c * stride] = bf16(mul * x[c]) for c < n, rounded to nearest even (vcvtneps2bf16).
inline void store_bf16_row(const float* x, int64_t n, float mul, uint16_t* dst, int64_t stride) {
  const __m512 vm = _mm512_set1_ps(mul);
  for (int64_t c = 0; c < n; c += kL) {
    const __mmask16 m = n - c >= kL ? __mmask16(0xffff) : __mmask16((1u << (n - c)) - 1);
    const __m256i h =
        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vm));
    if (stride == 1) {
      _mm256_mask_storeu_epi16(dst + c, m, h);
    } else {
      alignas(32) uint16_t o[kL];
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), h);
      for (int64_t l = 0; l < std::min(kL, n - c); ++l)
        dst[(c + l) * stride] = o[l];
    }
  }
}

// Whole-row packing (q and dO packed once per item) when it takes at most 8 MiB per thread;
// longer rows are packed per query tile (O(tile) memory, 4 packs per tile and key block).
bool bwd_whole_rows(const FlashBf16Params& p) {
  return p.T * (p.D + p.Dv) <= (int64_t{1} << 21);
}

// Per-thread buffers of the native backward, carved from each thread's part of one scratch block
// (kernels/cpu/scratch.hpp: from attn's block cache, so not faulted in again on every call).
// Zero-filled per call and then only ever overwritten, so every read is of initialized memory
// (the micro-kernel reads, and discards, up to kBMR - 1 rows past the valid ones).
struct BwdBuffers {
  int64_t rows = 0, ldq = 0, Dp = 0;
  uint32_t *qt2, *dot2, *qp2, *dop2;  // packed q, dO (all rows, or one tile's)
  uint32_t *kt2, *vt2, *kp2;          // packed k, v of a key block
  uint32_t *pz2, *ds2, *dsr;          // bf16 pairs of P Z and dS
  float *x, *dp;                      // fp32 tiles of the scores and of dP
  float *dk_acc, *dv_acc, *z, *part;  // fp32 dK^T, dV^T, dropout, dQ share (T, Dp)
  float *lse2, *drow;                 // (T) lse log2 e, D_t
  int64_t* lim;                       // (T) row limits
  uint16_t* out16;                    // dK or dV of a key block rounded to bf16
  uint8_t* bad;                       // (rows) q or dO row not finite

  // The buffers carved from `base`, Bytes(p, with_part) bytes, 64-byte aligned.
  BwdBuffers(const FlashBf16Params& p, bool with_part, std::byte* base) {
    Layout(p, with_part, base);
  }
  static size_t Bytes(const FlashBf16Params& p, bool with_part) {
    BwdBuffers sizes;
    return sizes.Layout(p, with_part, nullptr);
  }

 private:
  BwdBuffers() = default;
  // Points every buffer into base (nullptr: only counts) and returns the bytes used.
  size_t Layout(const FlashBf16Params& p, bool with_part, std::byte* base) {
    const int64_t D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
    rows = bwd_whole_rows(p) ? p.T : std::min(p.T, kBwdQ);
    ldq = (rows + kL - 1) / kL * kL + kL;
    Dp = (p.D + kL - 1) / kL * kL;
    const int64_t rows2 = (rows + 1) / 2;
    size_t used = 0;
    auto carve = [&](auto*& ptr, int64_t n) {
      using T = std::remove_reference_t<decltype(*ptr)>;
      ptr = base ? reinterpret_cast<T*>(base + used) : nullptr;
      used += (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    };
    carve(qt2, D2 * ldq + kBMR);
    carve(dot2, Dv2 * ldq + kBMR);
    carve(qp2, rows2 * p.D + kBMR);
    carve(dop2, rows2 * p.Dv + kBMR);
    carve(kt2, D2 * kBwdK);
    carve(vt2, Dv2 * kBwdK);
    carve(kp2, kBwdK2 * Dp + kL);
    carve(pz2, kBwdQ / 2 * kBwdK);
    carve(ds2, kBwdQ / 2 * kBwdK);
    carve(dsr, (kBwdQ + kBMR) * kBwdK2);
    carve(x, kBwdQ * kBwdK);
    carve(dp, kBwdQ * kBwdK);
    carve(dk_acc, p.D * kBwdK);
    carve(out16, std::max(p.D, p.Dv) * kBwdK);
    carve(dv_acc, p.Dv * kBwdK);
    carve(z, 2 * kBwdK);
    carve(part, with_part ? p.T * Dp : 0);
    carve(lse2, p.T);
    carve(drow, p.T);
    carve(lim, p.T);
    carve(bad, rows);
    return used;
  }
};

// Per-thread BwdBuffers memory for a parallel region, zero-filled (see BwdBuffers).
Scratch<std::byte> bwd_scratch(const FlashBf16Params& p, bool with_part, int threads) {
  return Scratch<std::byte>("flash_attention_backward_bf16", BwdBuffers::Bytes(p, with_part),
                            static_cast<size_t>(threads), /*zero=*/true);
}

// Rows [ta, tb) of q and dO of batch row b into w's four layouts (row ta at index 0).
void pack_query_rows(const FlashBf16Params& p, const FlashBf16Grads& g, int64_t b, int64_t ta,
                     int64_t tb, BwdBuffers& w) {
  const int64_t n = tb - ta, D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
  const uint16_t* q = p.q.data + head_off(p.heads, b, p.q.sb, p.q.sh) + ta * p.q.st;
  const uint16_t* dout = g.dout.data + head_off(p.heads, b, g.dout.sb, g.dout.sh) + ta * g.dout.st;
  pack_pairs_transposed(q, n, p.D, p.q.st, p.q.sd, w.qt2, w.ldq);
  pack_pairs_transposed(dout, n, p.Dv, g.dout.st, g.dout.sd, w.dot2, w.ldq);
  for (int64_t j = 0; j < D2; ++j)
    std::fill(w.qt2 + j * w.ldq + n, w.qt2 + (j + 1) * w.ldq, 0u);
  for (int64_t j = 0; j < Dv2; ++j)
    std::fill(w.dot2 + j * w.ldq + n, w.dot2 + (j + 1) * w.ldq, 0u);
  std::fill(w.bad, w.bad + n, uint8_t{0});
  pack_pairs_rows(q, n, p.D, p.q.st, p.q.sd, w.qp2, p.D, w.bad);
  pack_pairs_rows(dout, n, p.Dv, g.dout.st, g.dout.sd, w.dop2, p.Dv, w.bad);
}

// One work item: dK, dV of keys [sa, sb) of batch row b, and their share of dQ (unscaled,
// added into dq_part (T, w.Dp)).
void backward_item(const FlashBf16Params& p, const FlashBf16Grads& g, int64_t b, int64_t sa,
                   int64_t sb, float* dq_part, BwdBuffers& w) {
  const int64_t T = p.T, D = p.D, Dv = p.Dv, D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2, Dp = w.Dp;
  const bool whole = w.rows == T;
  const bool dropout = p.dropout > 0.0f;
  const float c = p.scale * kLog2e;
  float *const x = w.x, *const dpt = w.dp;
  float *const dk_acc = w.dk_acc, *const dv_acc = w.dv_acc;
  uint32_t *const pz2 = w.pz2, *const ds2 = w.ds2, *const dsr = w.dsr;

  bool any_masked = false;
  int64_t max_lim = 0;  // keys >= max_lim are kept by no query: never read (may be NaN padding)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lim = row_limit(p, b, t);
    w.lim[t] = lim;
    any_masked |= lim == 0;
    max_lim = std::max(max_lim, lim);
    w.lse2[t] = p.lse[b * T + t] * kLog2e;
    const uint16_t* o = p.out.data + head_off(p.heads, b, p.out.sb, p.out.sh) + t * p.out.st;
    const uint16_t* dout = g.dout.data + head_off(p.heads, b, g.dout.sb, g.dout.sh) + t * g.dout.st;
    // D_t = dO_t . out_t in fp32, 16 lanes then a fixed reduction: error <= ~(Dv/16 + 4) 2^-24
    // sum |dO| |out|, far below the error of out itself (its bf16 rounding, 2^-8 |out|).
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < Dv; e += kL)
      acc = _mm512_fmadd_ps(load_bf16(o + e * p.out.sd, Dv - e, p.out.sd),
                            load_bf16(dout + e * g.dout.sd, Dv - e, g.dout.sd), acc);
    w.drow[t] = _mm512_reduce_add_ps(acc);
  }
  if (whole) pack_query_rows(p, g, b, 0, T, w);

  for (int64_t s0 = sa; s0 < sb; s0 += kBwdK) {
    const int64_t nk = std::min(kBwdK, sb - s0);
    // Keys [s0, s0 + nkr) are kept by some query; the rest of the block only gets zeros (and the
    // masked-row term of dV below).
    const int64_t nkr = std::clamp<int64_t>(max_lim - s0, 0, nk);
    const int64_t nkrp = (nkr + kL - 1) / kL * kL, nkr2 = (nkr + 1) / 2, nv = nkrp / kL;
    std::fill(dk_acc, dk_acc + D * kBwdK, 0.0f);
    std::fill(dv_acc, dv_acc + Dv * kBwdK, 0.0f);
    bool k_finite = true;
    if (nkr > 0) {
      const uint16_t* kb = p.k.data + head_off(p.heads, b, p.k.sb, p.k.sh) + s0 * p.k.st;
      std::fill(w.kt2, w.kt2 + D2 * kBwdK, 0u);
      std::fill(w.vt2, w.vt2 + Dv2 * kBwdK, 0u);
      pack_pairs_transposed(kb, nkr, D, p.k.st, p.k.sd, w.kt2, kBwdK);
      pack_pairs_transposed(p.v.data + head_off(p.heads, b, p.v.sb, p.v.sh) + s0 * p.v.st, nkr, Dv,
                            p.v.st, p.v.sd, w.vt2, kBwdK);
      uint8_t kbad[kBwdK] = {};
      pack_pairs_rows(kb, nkr, D, p.k.st, p.k.sd, w.kp2, Dp, kbad);
      for (int64_t s = 0; s < nkr; ++s)
        k_finite &= kbad[s] == 0;
    }

    // Query tiles start at the next row that keeps a key of this block (rounded down to even:
    // pairs along t start at even rows), so rows that see none cost nothing.
    for (int64_t t0 = 0, mq = 0; nkr > 0 && t0 < T; t0 += mq) {
      int64_t t1 = t0;
      while (t1 < T && w.lim[t1] <= s0)
        ++t1;
      if (t1 == T) break;
      t0 = std::max(t0, t1 & ~int64_t{1});
      mq = std::min(kBwdQ, T - t0);
      const int64_t mq2 = (mq + 1) / 2;
      int64_t ta = 0;
      if (!whole) {
        pack_query_rows(p, g, b, t0, t0 + mq, w);
        ta = t0;
      }
      const uint32_t* qt2 = w.qt2 + (t0 - ta);
      const uint32_t* dot2 = w.dot2 + (t0 - ta);
      const uint32_t* qp2 = w.qp2 + (t0 - ta) / 2 * D;
      const uint32_t* dop2 = w.dop2 + (t0 - ta) / 2 * Dv;
      bool q_finite = true;
      for (int64_t r = 0; r < mq; ++r)
        q_finite &= w.bad[t0 - ta + r] == 0;

      bwd_gemm<1>(mq, nkrp, D2, qt2, w.ldq, w.kt2, kBwdK, x, kBwdK, false, c);  // c Q K^T
      bwd_gemm<1>(mq, nkrp, Dv2, dot2, w.ldq, w.vt2, kBwdK, dpt, kBwdK, false, 1.0f);

      // P = 2^(X - lse2), P Z, dS = P (dP Z - D_t) for two rows and 32 keys at a time, in
      // registers; masked keys get exact zeros (a select, so even a NaN score or dP of a masked
      // key gives 0). Out go only the bf16 roundings: pz2, ds2 (pairs along t) and dsr (pairs
      // along s).
      for (int64_t r = 0; r < mq; r += 2) {
        int64_t n[2];
        __m512 l2[2], dd[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t rr = r + h, t = t0 + rr;
          n[h] = rr < mq ? std::clamp<int64_t>(w.lim[t] - s0, 0, nkr) : 0;
          l2[h] = _mm512_set1_ps(rr < mq ? w.lse2[t] : 0.0f);
          dd[h] = _mm512_set1_ps(rr < mq ? w.drow[t] : 0.0f);
          if (dropout && n[h] > 0)
            dropout_row64(p, static_cast<uint64_t>((b * T + t) * p.S + s0), n[h], w.z + h * kBwdK);
        }
        for (int64_t v2 = 0; v2 < nv; v2 += 2) {
          __m512 ds[2][2];
          for (int u = 0; u < 2; ++u) {
            const int64_t v = v2 + u;
            __m512 pz[2];
            for (int h = 0; h < 2; ++h) {
              const int64_t m = std::clamp<int64_t>(n[h] - v * kL, 0, kL);
              if (v >= nv || m == 0) {
                pz[h] = ds[h][u] = _mm512_setzero_ps();
                continue;
              }
              const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
              const int64_t off = (r + h) * kBwdK + v * kL;
              const __m512 pv = exp2_bf16(_mm512_sub_ps(_mm512_loadu_ps(x + off), l2[h]));
              __m512 dpv = _mm512_loadu_ps(dpt + off), pzv = pv;
              if (dropout) {
                const __m512 zv = _mm512_maskz_loadu_ps(keep, w.z + h * kBwdK + v * kL);
                pzv = _mm512_mul_ps(pv, zv);
                dpv = _mm512_mul_ps(dpv, zv);
              }
              pz[h] = _mm512_maskz_mov_ps(keep, pzv);
              ds[h][u] = _mm512_maskz_mov_ps(keep, _mm512_mul_ps(pv, _mm512_sub_ps(dpv, dd[h])));
            }
            if (v < nv) {
              _mm512_storeu_si512(pz2 + r / 2 * kBwdK + v * kL, pair_bf16(pz[0], pz[1]));
              _mm512_storeu_si512(ds2 + r / 2 * kBwdK + v * kL, pair_bf16(ds[0][u], ds[1][u]));
            }
          }
          for (int h = 0; h < 2 && r + h < mq; ++h)
            _mm512_storeu_si512(dsr + (r + h) * kBwdK2 + v2 * kL / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(ds[h][1], ds[h][0]));
        }
      }
      // Weight of (row r, key s) of the tile from the pairs along t (for the exact loops).
      auto half = [](const uint32_t* pairs, int64_t r, int64_t s) {
        const uint32_t word = pairs[r / 2 * kBwdK + s];
        return bf16_to_float(static_cast<uint16_t>(r % 2 == 0 ? word : word >> 16));
      };

      // dV^T += dO^T (P Z), dK^T += Q^T dS (unscaled), dQ += dS K (unscaled). Tiles with
      // non-finite inputs add only the kept terms (as AllFinite in flash_attention.cpp: a masked
      // weight is an exact 0, and 0 * NaN would not be).
      if (q_finite) {
        bwd_gemm<1>(Dv, nkrp, mq2, dop2, Dv, pz2, kBwdK, dv_acc, kBwdK, true, 1.0f);
        bwd_gemm<1>(D, nkrp, mq2, qp2, D, ds2, kBwdK, dk_acc, kBwdK, true, 1.0f);
      } else {
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t t = t0 + r, n = std::clamp<int64_t>(w.lim[t] - s0, 0, nkr);
          const uint16_t* qr = p.q.data + head_off(p.heads, b, p.q.sb, p.q.sh) + t * p.q.st;
          const uint16_t* dor =
              g.dout.data + head_off(p.heads, b, g.dout.sb, g.dout.sh) + t * g.dout.st;
          for (int64_t s = 0; s < n; ++s) {
            for (int64_t e = 0; e < Dv; ++e)
              dv_acc[e * kBwdK + s] += half(pz2, r, s) * bf16_to_float(dor[e * g.dout.sd]);
            for (int64_t d = 0; d < D; ++d)
              dk_acc[d * kBwdK + s] += half(ds2, r, s) * bf16_to_float(qr[d * p.q.sd]);
          }
        }
      }
      if (k_finite) {
        bwd_gemm<kBwdK2>(mq, Dp, nkr2, dsr, 1, w.kp2, Dp, dq_part + t0 * Dp, Dp, true, 1.0f);
      } else {
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t t = t0 + r, n = std::clamp<int64_t>(w.lim[t] - s0, 0, nkr);
          for (int64_t s = 0; s < n; ++s) {
            const uint16_t* kr =
                p.k.data + head_off(p.heads, b, p.k.sb, p.k.sh) + (s0 + s) * p.k.st;
            for (int64_t d = 0; d < D; ++d)
              dq_part[t * Dp + d] += half(ds2, r, s) * bf16_to_float(kr[d * p.k.sd]);
          }
        }
      }
    }

    // Rows without a kept key: their weights are the constant 1/S (d2l), so only dV sees them.
    if (any_masked && !p.zero_masked_rows()) {
      for (int64_t t = 0; t < T; ++t) {
        if (w.lim[t] != 0) continue;
        float* z = w.z;
        if (dropout) {
          dropout_multipliers(p, static_cast<uint64_t>((b * T + t) * p.S + s0), nk, z);
        } else {
          std::fill(z, z + nk, 1.0f);
        }
        const uint16_t* dor =
            g.dout.data + head_off(p.heads, b, g.dout.sb, g.dout.sh) + t * g.dout.st;
        for (int64_t e = 0; e < Dv; ++e) {
          const float go = bf16_to_float(dor[e * g.dout.sd]);
          for (int64_t s = 0; s < nk; ++s)
            dv_acc[e * kBwdK + s] += z[s] / static_cast<float>(p.S) * go;
        }
      }
    }

    // dK = scale sum dS Q, dV = sum P Z dO: rounded once (vcvtneps2bf16), transposed back.
    for (int64_t d = 0; d < D; ++d)
      store_bf16_row(dk_acc + d * kBwdK, nk, p.scale, w.out16 + d * kBwdK, 1);
    for (int64_t s = 0; s < nk; ++s) {
      uint16_t* dk = g.dk.data + head_off(p.heads, b, g.dk.sb, g.dk.sh) + (s0 + s) * g.dk.st;
      for (int64_t d = 0; d < D; ++d)
        dk[d * g.dk.sd] = w.out16[d * kBwdK + s];
    }
    for (int64_t e = 0; e < Dv; ++e)
      store_bf16_row(dv_acc + e * kBwdK, nk, 1.0f, w.out16 + e * kBwdK, 1);
    for (int64_t s = 0; s < nk; ++s) {
      uint16_t* dv = g.dv.data + head_off(p.heads, b, g.dv.sb, g.dv.sh) + (s0 + s) * g.dv.st;
      for (int64_t e = 0; e < Dv; ++e)
        dv[e * g.dv.sd] = w.out16[e * kBwdK + s];
    }
  }
}

void backward_native(const FlashBf16Params& p, const FlashBf16Grads& g) {
  const int64_t Dp = (p.D + kL - 1) / kL * kL;
  static_assert(kBwdK == 64, "backward_key_splits cuts at multiples of 64 keys");
  const std::vector<int64_t> bounds = backward_key_splits(p.B, p.T, p.S, p.causal);
  const int64_t splits = static_cast<int64_t>(bounds.size()) - 1, items = p.B * splits;
  const int threads = std::max(1, p.threads);
  const size_t part_floats = static_cast<size_t>(p.T * Dp);
  // dQ row (b, t) from its shares: scale * (0 + part_0 + part_1 + ...), in item order, so the
  // same sum whatever thread made each part; rounded to bf16 once.
  auto write_dq = [&](int64_t b, int64_t t, const float* const* part_rows, float* sum) {
    uint16_t* dq = g.dq.data + head_off(p.heads, b, g.dq.sb, g.dq.sh) + t * g.dq.st;
    if (splits == 1) {
      store_bf16_row(part_rows[0], p.D, p.scale, dq, g.dq.sd);
      return;
    }
    for (int64_t d = 0; d < p.D; d += kL) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < splits; ++j)
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(part_rows[j] + d));
      _mm512_storeu_ps(sum + d, acc);
    }
    store_bf16_row(sum, p.D, p.scale, dq, g.dq.sd);
  };
  if (splits == 1) {
    // One item per b: its dQ share is the whole dQ of b, written by the item's own thread.
    const Scratch<std::byte> buffers = bwd_scratch(p, /*with_part=*/true, threads);
#pragma omp parallel num_threads(threads)
    {
      BwdBuffers w(p, /*with_part=*/true, buffers.get(omp_get_thread_num()));
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < p.B; ++b) {
        std::fill(w.part, w.part + part_floats, 0.0f);
        backward_item(p, g, b, bounds[0], bounds[1], w.part, w);
        for (int64_t t = 0; t < p.T; ++t) {
          const float* row = w.part + t * Dp;
          write_dq(b, t, &row, nullptr);
        }
      }
    }
    return;
  }
  // The shares of all items, summed below.
  const Scratch<float> all_parts("flash_attention_backward_bf16",
                                 part_floats * static_cast<size_t>(items));
  float* const parts = all_parts.get();
  const Scratch<std::byte> buffers = bwd_scratch(p, /*with_part=*/false, threads);
#pragma omp parallel num_threads(threads)
  {
    {
      BwdBuffers w(p, /*with_part=*/false, buffers.get(omp_get_thread_num()));
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        float* part = parts + static_cast<size_t>(i) * part_floats;
        std::fill(part, part + part_floats, 0.0f);
        const int64_t b = i / splits, j = i % splits;
        backward_item(p, g, b, bounds[j], bounds[j + 1], part, w);
      }
    }
    std::vector<const float*> part_rows(static_cast<size_t>(splits));
    std::vector<float> sum(static_cast<size_t>(Dp));
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < p.B * p.T; ++bt) {
      const int64_t b = bt / p.T, t = bt % p.T;
      for (int64_t j = 0; j < splits; ++j)
        part_rows[j] = parts + static_cast<size_t>(b * splits + j) * part_floats + t * Dp;
      write_dq(b, t, part_rows.data(), sum.data());
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

}  // namespace

bool flash_bf16_native() {
  return cpu_has_bf16();
}

void flash_attention_forward_bf16(const FlashBf16Params& p) {
  if (p.B == 0 || p.T == 0) return;
  // The weights need a second Q K^T pass with the final row statistics, which only the fp32
  // kernel has; a caller that asks for a (B, T, S) matrix is not after the last 2x anyway.
  if (!cpu_has_bf16() || p.force_bf16_fallback || p.weights != nullptr) {
    forward_fallback(p);
    return;
  }
  forward_native(p);
}

void flash_attention_backward_bf16(const FlashBf16Params& p, const FlashBf16Grads& g) {
  if (p.B == 0) return;
  if (cpu_has_bf16() && !p.force_bf16_fallback && p.T > 0 && p.S > 0) {
    backward_native(p, g);
    return;
  }
  const int64_t B = p.B, T = p.T, S = p.S, D = p.D, Dv = p.Dv;
  // The arena after q, k, v, out: dout (B, T, Dv), dq (B, T, D), dk (B, S, D), dv (B, S, Dv).
  Fp32Copies c;
  fp32_params(p, /*with_out=*/true, static_cast<size_t>(B * (T * Dv + T * D + S * D + S * Dv)), c);
  c.f.weights = nullptr;
  float* dout = c.extra;
  float* dq = dout + B * T * Dv;
  float* dk = dq + B * T * D;
  float* dv = dk + B * S * D;
  to_float(g.dout, B, T, Dv, p.heads, p.threads, dout);
  FlashGrads fg;
  fg.dout = contiguous_view<const float>(dout, T, Dv);
  fg.dq = contiguous_view(dq, T, D);
  fg.dk = contiguous_view(dk, S, D);
  fg.dv = contiguous_view(dv, S, Dv);
  flash_attention_backward(c.f, fg);
  to_bf16(dq, g.dq, B, T, D, p.heads, p.threads);
  to_bf16(dk, g.dk, B, S, D, p.heads, p.threads);
  to_bf16(dv, g.dv, B, S, Dv, p.heads, p.threads);
}

}  // namespace attn::cpu
