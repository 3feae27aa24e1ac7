// Decode attention (contract in decode_attention.hpp): T <= 8 queries per row, keys split into
// fixed chunks, one partial softmax per (row, chunk), merged by log-sum-exp.
//
// Per work item (row b, keys [s0, s1)), scores in log2 units x = (scale * log2 e) q . k as in the
// flash kernel (one exp2 per weight), for each query t over its kept keys s < lim_t:
//   m_t = max_s x_ts,   l_t = sum_s 2^(x_ts - m_t),   o_t = sum_s 2^(x_ts - m_t) v_s    (partial)
// and per row, over its chunks c in order (Milakov & Gimelshein 2018; FlashDecoding's split-K):
//   M = max_c m_c,  l = sum_c 2^(m_c - M) l_c,  out = (sum_c 2^(m_c - M) o_c) / l,
//   lse = ln 2 * (M + log2 l).
// An item is one batch row's H heads over a chunk of kDecodeChunkKeys keys, each K and V row read
// once from memory in address order: the K pass (scores) prefetches the chunk's V rows into L2,
// the V pass reads them back per head and L features with the T sums in registers. q is held
// pre-scaled in a small buffer; K rows are dotted with all T queries per load.
//
// Performance notes: see docs/decoder.md ("The decode kernel") for the measured bandwidth.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/decode_attention.cpp"
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "kernels/cpu/decode_attention.hpp"
#include "kernels/cpu/flash_kernels-inl.h"

#include "attn/core/dtype.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

// Target-independent helpers, compiled once.
#ifndef ATTN_DECODE_ATTENTION_SHARED_
#define ATTN_DECODE_ATTENTION_SHARED_
namespace attn::cpu::decode_detail {

inline float to_float(float x) {
  return x;
}
inline float to_float(uint16_t h) {
  return bf16_to_float(h);
}

// The work of one call, shared by every target: items (row, chunk) in row order, the partials'
// layout and the pre-scaled queries.
struct Plan {
  int64_t T = 0, D = 0, Dv = 0;
  int64_t part_stride = 0;  // floats per query in a partial: o (Dv) | m | l
  float qscale = 0.0f;      // scale * log2 e
};

// Prefetch across the items of one thread (a run of consecutive chunks): the K bytes of the
// thread's next item, fetched into L2 during this item's V pass, and whether this item's K was
// fetched so by the previous one. Null / false when unknown.
struct NextK {
  const char* k = nullptr;
  int64_t bytes = 0;
  bool ready = false;
};

}  // namespace attn::cpu::decode_detail
#endif  // ATTN_DECODE_ATTENTION_SHARED_

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

const char* DecodeTargetName() {
  return hwy::TargetName(HWY_TARGET);
}

// L features of a K or V row as float: bfloat16 bits are the high half of a float.
HWY_INLINE VF LoadRow(DF d, const float* p) {
  return hn::LoadU(d, p);
}
HWY_INLINE VF LoadRow(DF d, const uint16_t* p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> d32;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(d32, hn::LoadU(d16, p))));
}

// Fetches a row into L2 (prefetcht1), each 64-byte line it touches once: the V rows of a chunk,
// streamed alongside its K rows, are read again from L2 by WeightedSumV in another order.
HWY_INLINE void PrefetchToL2(const void* p, int64_t bytes) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) - 1;
  for (uintptr_t c = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; c <= last; c += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(c), 0, 2);
}

// QDotK by rows (every target, any D): per key and head, the T dot products along the lanes and
// one horizontal sum each. x[r, s - s0] = q_r . k_s, -inf past the row's kept keys (rows of xs
// floats). Prefetches each key's V rows into L2 for WeightedSumV.
template <int NQ, class KV>
void QDotKRows(const KV* kb, int64_t kst, int64_t ksh, const KV* vb, int64_t vst, int64_t vsh,
               int64_t Dv, int64_t nh, int64_t D, const float* qs, const int64_t* lim, int64_t s0,
               int64_t s1, float* x, int64_t xs) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t Dm = D / L * L;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t h = 0; h < nh; ++h)
      PrefetchToL2(vb + s * vst + h * vsh, Dv * static_cast<int64_t>(sizeof(KV)));
    for (int64_t h = 0; h < nh; ++h) {
      const KV* kr = kb + s * kst + h * ksh;
      const float* qh = qs + h * NQ * D;
      VF acc[NQ];
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t)
        acc[t] = hn::Zero(d);
      for (int64_t i = 0; i < Dm; i += L) {
        const VF kv = LoadRow(d, kr + i);
        HWY_UNROLL(8)
        for (int t = 0; t < NQ; ++t)
          acc[t] = hn::MulAdd(hn::LoadU(d, qh + t * D + i), kv, acc[t]);
      }
      float tail[NQ] = {};
      for (int64_t i = Dm; i < D; ++i) {
        const float kf = decode_detail::to_float(kr[i]);
        HWY_UNROLL(8)
        for (int t = 0; t < NQ; ++t)
          tail[t] += qh[t * D + i] * kf;
      }
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t) {
        const int64_t r = h * NQ + t;
        x[r * xs + (s - s0)] =
            s < lim[r] ? hn::GetLane(hn::SumOfLanes(d, acc[t])) + tail[t] : kNegInf;
      }
    }
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// A bfloat16 cache on AVX-512 (D or Dv a multiple of 32). A 512-bit load of a bf16 row is 16
// 32-bit pairs (x[2i], x[2i + 1]); as float, the even element is the pair shifted left by 16 and
// the odd one the pair with its low half cleared, so one load and two single-cycle ops widen 32
// elements (LoadRow: two loads, two widenings and two shifts).
//
// QDotK with the keys along the lanes: a group of 16 keys' rows of one head, 32 features at a
// time, is transposed as 16 x 16 pairs (transpose16x16_epi32), so that vector p holds pair p of
// the 16 keys; the T queries' features 2p and 2p + 1 are broadcast into FMAs with its two
// halves. The T x 16 scores come out as vectors, stored as they are: no horizontal sum per score
// (QDotKRows spends ~10 instructions on each, the most of its work at T = 3, 4). Per key and
// head of D = 64: 2 loads, 8 transposing shuffles, 4 widenings and 4T FMAs, against 8 + 4T + 12T
// by rows. The products are the same fp32 ones (q is not rounded); only the order of the sum
// over the features differs (2-4 partial sums per query, each in feature order).
constexpr int kPairKeys = 16;  // keys per transposed group

// transpose16x16_epi32 (kernels/cpu/transpose16.hpp) with its loops unrolled: GCC 12 -O2 kept
// them as loops through a stack copy of the tile here.
HWY_INLINE void Transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  HWY_UNROLL(8)
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  HWY_UNROLL(4)
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  HWY_UNROLL(4)
  for (int k = 0; k < 4; ++k) {
    const __m512i v02 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i w02 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i v13 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i w13 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(v02, w02, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v02, w02, 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(v13, w13, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v13, w13, 0xdd);
  }
}

template <int NQ>
HWY_INLINE void QDotKBf16Pairs(const uint16_t* kb, int64_t kst, int64_t ksh, const uint16_t* vb,
                               int64_t vst, int64_t vsh, int64_t Dv, int64_t nh, int64_t D,
                               const float* qs, const int64_t* lim, int64_t s0, int64_t s1,
                               float* x, int64_t xs, bool k_ready) {
  // Partial sums per query: 4 for T <= 2, 2 for T = 3, 4 (FMA latency 4: at least 4 chains in
  // flight), 1 above (32 registers: 16 for the transposed pairs).
  constexpr int NA = NQ <= 2 ? 4 : NQ <= 4 ? 2 : 1;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g0 = s0; g0 < s1; g0 += kPairKeys) {
    const int64_t m = std::min<int64_t>(kPairKeys, s1 - g0);  // keys of this group
    // Keys of the next group to prefetch (none when the previous item's V pass fetched this chunk).
    const int64_t mn = k_ready ? 0 : std::min<int64_t>(kPairKeys, s1 - g0 - kPairKeys);
    for (int64_t h = 0; h < nh; ++h) {
      const uint16_t* kh = kb + g0 * kst + h * ksh;
      // The rows of one head are 16 strided reads that the hardware prefetchers do not follow:
      // this head's K rows of the next group are fetched into L2 now, its V rows of this group
      // too (WeightedSumV reads them after the chunk's softmax).
      for (int64_t i = 0; i < mn; ++i)
        PrefetchToL2(kh + (kPairKeys + i) * kst, D * 2);
      for (int64_t i = 0; i < m; ++i)
        PrefetchToL2(vb + (g0 + i) * vst + h * vsh, Dv * 2);
      const float* qh = qs + nh * NQ * D + h * D * NQ;  // feature-major: [f][t]
      __m512 acc[NQ][NA];
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t) {
        HWY_UNROLL(4)
        for (int j = 0; j < NA; ++j)
          acc[t][j] = _mm512_setzero_ps();
      }
      for (int64_t f0 = 0; f0 < D; f0 += 32) {
        __m512i blk[kPairKeys];
        if (m == kPairKeys) {
          HWY_UNROLL(16)
          for (int i = 0; i < kPairKeys; ++i)
            blk[i] = _mm512_loadu_si512(kh + i * kst + f0);
        } else {  // rows past the group's keys are not read
          for (int i = 0; i < kPairKeys; ++i)
            blk[i] = i < m ? _mm512_loadu_si512(kh + i * kst + f0) : _mm512_setzero_si512();
        }
        Transpose16x16(blk);
        const float* qf = qh + f0 * NQ;
        HWY_UNROLL(16)
        for (int p = 0; p < 16; ++p) {
          const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(blk[p], 16));
          const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(blk[p], high));
          const int je = (2 * p) % NA, jo = (2 * p + 1) % NA;
          HWY_UNROLL(8)
          for (int t = 0; t < NQ; ++t) {
            acc[t][je] = _mm512_fmadd_ps(_mm512_set1_ps(qf[2 * p * NQ + t]), ke, acc[t][je]);
            acc[t][jo] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(2 * p + 1) * NQ + t]), ko, acc[t][jo]);
          }
        }
      }
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t) {
        __m512 sum = acc[t][0];
        HWY_UNROLL(4)
        for (int j = 1; j < NA; ++j)
          sum = _mm512_add_ps(sum, acc[t][j]);
        const int64_t r = h * NQ + t;
        const int64_t kept = std::clamp<int64_t>(lim[r] - g0, 0, kPairKeys);
        const __mmask16 keep = static_cast<__mmask16>((uint32_t{1} << kept) - 1);
        _mm512_storeu_ps(x + r * xs + (g0 - s0), _mm512_mask_blend_ps(keep, neg_inf, sum));
      }
    }
  }
}

// WeightedSumV of a bfloat16 V (Dv a multiple of 32): o_r = sum_s p_rs v_s per head, 32 features
// per load as even / odd halves (W = 2: 64 features, two loads per key, for 4 * NQ sums in
// registers), the T sums per feature in key order as in the generic pass (the same fp32 FMAs in
// the same order); the even / odd lanes are interleaved back on the store.
template <int NQ, int W>
HWY_INLINE void WeightedSumVBf16(const uint16_t* vb, int64_t vst, int64_t vsh, int64_t nh,
                                 int64_t Dv, const float* x, int64_t xs, int64_t s0,
                                 const int64_t* ends, float* part, int64_t ps, const char*& pf,
                                 const char* pf_end) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t r0 = h * NQ;
    int64_t e = s0;
    HWY_UNROLL(8)
    for (int t = 0; t < NQ; ++t)
      e = std::max(e, ends[r0 + t]);
    const uint16_t* vh = vb + h * vsh;
    const float* xh = x + r0 * xs - s0;
    for (int64_t i = 0; i < Dv; i += 32 * W) {
      __m512 acc[NQ][2 * W];
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t) {
        HWY_UNROLL(4)
        for (int j = 0; j < 2 * W; ++j)
          acc[t][j] = _mm512_setzero_ps();
      }
      for (int64_t s = s0; s < e; ++s) {
        if (pf < pf_end) {  // two lines of the next item's K per key
          __builtin_prefetch(pf, 0, 2);
          __builtin_prefetch(pf + 64, 0, 2);
          pf += 128;
        }
        __m512 v[2 * W];
        HWY_UNROLL(4)
        for (int w = 0; w < W; ++w) {
          const __m512i raw = _mm512_loadu_si512(vh + s * vst + i + 32 * w);
          v[2 * w] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          v[2 * w + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
        }
        HWY_UNROLL(8)
        for (int t = 0; t < NQ; ++t) {
          const __m512 p = _mm512_set1_ps(xh[t * xs + s]);
          HWY_UNROLL(4)
          for (int j = 0; j < 2 * W; ++j)
            acc[t][j] = _mm512_fmadd_ps(p, v[j], acc[t][j]);
        }
      }
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t) {
        float* o = part + (r0 + t) * ps + i;
        HWY_UNROLL(4)
        for (int w = 0; w < W; ++w) {
          _mm512_storeu_ps(o + 32 * w,
                           _mm512_permutex2var_ps(acc[t][2 * w], lo_idx, acc[t][2 * w + 1]));
          _mm512_storeu_ps(o + 32 * w + 16,
                           _mm512_permutex2var_ps(acc[t][2 * w], hi_idx, acc[t][2 * w + 1]));
        }
      }
    }
  }
}
#endif  // AVX-512

// The loops over the NQ queries are unrolled by hand (HWY_UNROLL): GCC 12 -O2 keeps the NQ
// accumulator vectors of a plain loop in a stack array, each FMA then a load and a store that
// waits on the previous key's store.
//
// Partials of the nh heads of one batch row (rows b0 .. b0 + nh - 1, sharing the cache's
// positions) over keys [s0, s1), NQ queries each; row r = h * NQ + t below. qs: nh*NQ rows of D,
// pre-scaled, then the same per head feature-major (D x NQ, for QDotKBf16Pairs); lim: kept keys per
// row r; x: scratch of nh*NQ rows of kDecodeChunkKeys + L floats; ends: nh*NQ; part: nh*NQ partials
// of Dv + 2 floats. All heads of a key are read together: a (capacity, H*D) cache then streams
// through contiguous memory that the hardware prefetchers follow. Reading one head at a time (its
// rows H*D apart) stalls on the first load of every row, and software prefetch of the strided
// rows does not make up for it (docs/decoder.md, "The decode kernel").
template <int NQ, class KV>
void ChunkPartial(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                  const int64_t* lim, int64_t b0, int64_t nh, int64_t s0, int64_t s1, float* x,
                  int64_t* ends, float* part, const decode_detail::NextK& next) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t D = plan.D, Dv = plan.Dv, n = s1 - s0, ps = plan.part_stride;
  const int64_t xs = kDecodeChunkKeys + L;  // row stride of x
  const int64_t Dvm = Dv / L * L;
  const KV* kb = a.k.data + a.row_offset(b0, a.k.sb, a.k.sh);
  const KV* vb = a.v.data + a.row_offset(b0, a.v.sb, a.v.sh);
  const int64_t ksh = nh > 1 ? a.k.sh : 0, vsh = nh > 1 ? a.v.sh : 0;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // QDotK: x[r, s] = q_r . k_s over the chunk, -inf past the row's kept keys.
  bool scored = false;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (std::is_same_v<KV, uint16_t>) {
    if (D % 32 == 0) {
      QDotKBf16Pairs<NQ>(kb, a.k.st, ksh, vb, a.v.st, vsh, Dv, nh, D, qs, lim, s0, s1, x, xs,
                         next.ready);
      scored = true;
    }
  }
#endif
  if (!scored) QDotKRows<NQ>(kb, a.k.st, ksh, vb, a.v.st, vsh, Dv, nh, D, qs, lim, s0, s1, x, xs);

  // Softmax of the chunk per row: m_r, p = 2^(x - m_r) in place, l_r; o_r zeroed.
  const int64_t np = (n + L - 1) / L * L;  // padded with -inf: weight exactly 0
  for (int64_t r = 0; r < nh * NQ; ++r) {
    float* xr = x + r * xs;
    float* o = part + r * ps;
    for (int64_t j = n; j < np; ++j)
      xr[j] = kNegInf;
    VF vm = hn::Set(d, kNegInf);
    for (int64_t j = 0; j < np; j += L)
      vm = hn::Max(vm, hn::LoadU(d, xr + j));
    const float m = hn::GetLane(hn::MaxOfLanes(d, vm));
    for (int64_t i = 0; i < Dv; ++i)
      o[i] = 0.0f;
    o[Dv] = m;
    o[Dv + 1] = 0.0f;
    ends[r] = s0;
    if (m == kNegInf) {  // no kept key in this chunk: weights 0
      for (int64_t j = 0; j < np; ++j)
        xr[j] = 0.0f;
      continue;
    }
    ends[r] = std::min(s1, lim[r]);
    const VF vmax = hn::Set(d, m);
    VF vl = hn::Zero(d);
    for (int64_t j = 0; j < np; j += L) {
      const VF p = Exp2(d, hn::Sub(hn::LoadU(d, xr + j), vmax));
      hn::StoreU(p, d, xr + j);
      vl = hn::Add(vl, p);
    }
    o[Dv + 1] = hn::GetLane(hn::SumOfLanes(d, vl));
  }

  // WeightedSumV: o_r = sum_s p_rs v_s, per head and L features at a time with the T sums in
  // registers over the chunk's keys (the V rows are in L2: the QDotK pass prefetched them). A
  // weight past a query's kept keys is exactly 0; keys past every query's are not read.
  // Each pass also fetches the K rows of the thread's next item into L2 (NextK): memory keeps
  // streaming while this pass reads V from L2.
  const char* pf = next.k;
  const char* pf_end = next.k + next.bytes;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (std::is_same_v<KV, uint16_t>) {
    if (NQ <= 4 && Dv % 64 == 0)
      WeightedSumVBf16<NQ, 2>(vb, a.v.st, vsh, nh, Dv, x, xs, s0, ends, part, ps, pf, pf_end);
    else if (Dv % 32 == 0)
      WeightedSumVBf16<NQ, 1>(vb, a.v.st, vsh, nh, Dv, x, xs, s0, ends, part, ps, pf, pf_end);
    if (Dv % 32 == 0) {
      for (; pf < pf_end; pf += 64)  // what the V pass had no keys for
        __builtin_prefetch(pf, 0, 2);
      return;
    }
  }
#endif
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t r0 = h * NQ;
    int64_t e = s0;
    HWY_UNROLL(8)
    for (int t = 0; t < NQ; ++t)
      e = std::max(e, ends[r0 + t]);
    const KV* vh = vb + h * vsh;
    for (int64_t i = 0; i < Dvm; i += L) {
      VF acc[NQ];
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t)
        acc[t] = hn::Zero(d);
      for (int64_t s = s0; s < e; ++s) {
        if (pf < pf_end) {  // one line of the next item's K per key and L features
          __builtin_prefetch(pf, 0, 2);
          pf += 64;
        }
        const VF vv = LoadRow(d, vh + s * a.v.st + i);
        HWY_UNROLL(8)
        for (int t = 0; t < NQ; ++t)
          acc[t] = hn::MulAdd(hn::Set(d, x[(r0 + t) * xs + (s - s0)]), vv, acc[t]);
      }
      HWY_UNROLL(8)
      for (int t = 0; t < NQ; ++t)
        hn::StoreU(acc[t], d, part + (r0 + t) * ps + i);
    }
    for (int64_t i = Dvm; i < Dv; ++i)
      for (int64_t s = s0; s < e; ++s) {
        const float vf = decode_detail::to_float(vh[s * a.v.st + i]);
        HWY_UNROLL(8)
        for (int t = 0; t < NQ; ++t)
          part[(r0 + t) * ps + i] += x[(r0 + t) * xs + (s - s0)] * vf;
      }
  }
  for (; pf < pf_end; pf += 64)  // what the pass had no keys for
    __builtin_prefetch(pf, 0, 2);
}

template <class KV>
void ChunkPartialAny(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                     const int64_t* lim, int64_t b0, int64_t nh, int64_t s0, int64_t s1, float* x,
                     int64_t* ends, float* part, const decode_detail::NextK& next) {
  switch (plan.T) {
#define ATTN_DECODE_CASE(N) \
  case N:                   \
    return ChunkPartial<N, KV>(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part, next);
    ATTN_DECODE_CASE(1)
    ATTN_DECODE_CASE(2)
    ATTN_DECODE_CASE(3)
    ATTN_DECODE_CASE(4)
    ATTN_DECODE_CASE(5)
    ATTN_DECODE_CASE(6)
    ATTN_DECODE_CASE(7)
    ATTN_DECODE_CASE(8)
#undef ATTN_DECODE_CASE
    default:
      return;
  }
}

void ChunkPartialF32(const DecodeArgs<float>& a, const decode_detail::Plan& plan, const float* qs,
                     const int64_t* lim, int64_t b0, int64_t nh, int64_t s0, int64_t s1, float* x,
                     int64_t* ends, float* part, const decode_detail::NextK& next) {
  ChunkPartialAny(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part, next);
}
void ChunkPartialBF16(const DecodeArgs<uint16_t>& a, const decode_detail::Plan& plan,
                      const float* qs, const int64_t* lim, int64_t b0, int64_t nh, int64_t s0,
                      int64_t s1, float* x, int64_t* ends, float* part,
                      const decode_detail::NextK& next) {
  ChunkPartialAny(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part, next);
}

// Merge of one query's partials p_c (stride `cs` floats apart, n of them) into acc (Dv floats):
// acc = sum_c 2^(m_c - M) o_c, returns l; M in *M.
float MergePartials(const decode_detail::Plan& plan, const float* p, int64_t cs, int64_t n,
                    float* acc, float* M) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t Dv = plan.Dv, Dvm = Dv / L * L;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c)
    mx = std::max(mx, p[c * cs + Dv]);
  *M = mx;
  for (int64_t i = 0; i < Dv; ++i)
    acc[i] = 0.0f;
  float l = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    const float* pc = p + c * cs;
    if (pc[Dv] == -std::numeric_limits<float>::infinity()) continue;
    const float w = std::exp2(pc[Dv] - mx);
    l += w * pc[Dv + 1];
    const VF vw = hn::Set(d, w);
    for (int64_t i = 0; i < Dvm; i += L)
      hn::StoreU(hn::MulAdd(vw, hn::LoadU(d, pc + i), hn::LoadU(d, acc + i)), d, acc + i);
    for (int64_t i = Dvm; i < Dv; ++i)
      acc[i] += w * pc[i];
  }
  return l;
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

// ---------------------------------------------------------------------------------------------
// Dispatch and threads (compiled once)

#if HWY_ONCE
#include "kernels/cpu/denormals.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu/scratch.hpp"
#include "kernels/cpu/target_scope.hpp"

#include "attn/core/error.hpp"

#include <omp.h>

#include <vector>

namespace attn::cpu {

HWY_EXPORT(DecodeTargetName);
HWY_EXPORT(ChunkPartialF32);
HWY_EXPORT(ChunkPartialBF16);
HWY_EXPORT(MergePartials);

namespace {

using decode_detail::Plan;

auto* chunk_fn(const DecodeArgs<float>&) {
  return HWY_DYNAMIC_DISPATCH(ChunkPartialF32);
}
auto* chunk_fn(const DecodeArgs<uint16_t>&) {
  return HWY_DYNAMIC_DISPATCH(ChunkPartialBF16);
}

template <class KV>
void run(const DecodeArgs<KV>& a) {
  constexpr const char* op = "decode_attention";
  const TargetScope targets(a.simd_targets);
  check(a.T >= 1 && a.T <= kDecodeMaxQueries, op, "T = {} queries per row, expected 1..{}", a.T,
        kDecodeMaxQueries);
  check(a.dropout == 0.0f, op, "dropout is {}, expected 0 (decoding is eval mode)", a.dropout);
  check(a.k.sd == 1 && a.v.sd == 1, op, "k and v need unit feature stride, got {} and {}", a.k.sd,
        a.v.sd);
  check(a.B >= 0 && a.S >= 0 && a.D >= 1 && a.Dv >= 1, op,
        "B = {}, S = {}, D = {}, Dv = {}: expected B, S >= 0 and D, Dv >= 1", a.B, a.S, a.D, a.Dv);
  if (a.B == 0) return;
  Plan plan;
  plan.T = a.T, plan.D = a.D, plan.Dv = a.Dv;
  plan.part_stride = a.Dv + 2;
  plan.qscale = a.scale * 1.4426950408889634f;  // log2 e

  // Items: (group, chunk). A group is the H heads of one batch row (rows g*H .. g*H + H - 1), read
  // together; group g owns chunks first[g] .. first[g + 1) covering its largest kept-key limit.
  const int64_t H = std::max<int64_t>(1, a.heads);
  check(a.B % H == 0, op, "B = {} rows is not a multiple of heads = {}", a.B, H);
  const int64_t G = a.B / H, HT = H * a.T;
  std::vector<int64_t> first(static_cast<size_t>(G + 1), 0), tops(static_cast<size_t>(G), 0);
  std::vector<int64_t> lims(static_cast<size_t>(a.B * a.T));
  for (int64_t g = 0; g < G; ++g) {
    int64_t top = 0;
    for (int64_t r = 0; r < HT; ++r) {
      const int64_t b = g * H + r / a.T, t = r % a.T;
      const int64_t lim = a.row_limit(b, t);
      lims[static_cast<size_t>(b * a.T + t)] = lim;
      top = std::max(top, lim);
    }
    tops[static_cast<size_t>(g)] = top;
    first[static_cast<size_t>(g + 1)] =
        first[static_cast<size_t>(g)] + (top + kDecodeChunkKeys - 1) / kDecodeChunkKeys;
  }
  const int64_t items = first.back();
  const int64_t item_floats = HT * plan.part_stride;
  const int threads =
      threads_for(2.0 * static_cast<double>(a.B * a.T) * static_cast<double>(a.S * (a.D + a.Dv)),
                  std::max(1, a.threads));
  const int64_t L = 16;  // >= every target's lanes (x scratch padding)
  const size_t per_thread = static_cast<size_t>(HT * (kDecodeChunkKeys + L) + 2 * HT * a.D + a.Dv);
  const Scratch<float> scratch(op, per_thread, static_cast<size_t>(threads));
  const Scratch<float> parts(op, static_cast<size_t>(std::max<int64_t>(1, items * item_floats)));
  auto* item_fn = chunk_fn(a);
  // Item it: group g, keys [s0, s1).
  struct Item {
    int64_t g, s0, s1;
  };
  auto item_at = [&](int64_t it) {
    const int64_t g =
        static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1);
    const int64_t s0 = (it - first[static_cast<size_t>(g)]) * kDecodeChunkKeys;
    return Item{g, s0, std::min(tops[static_cast<size_t>(g)], s0 + kDecodeChunkKeys)};
  };
  // Runs of consecutive items per thread: up to 16, at least 8 runs per thread.
  const int64_t run_len = std::clamp<int64_t>(items / (8 * threads), 1, 16);
  // The K rows of consecutive keys (all heads) are one span: an item's K is one range of bytes.
  const bool k_rows_contiguous = a.k.st == (H - 1) * a.k.sh + a.D;
  auto* merge_fn = HWY_DYNAMIC_DISPATCH(MergePartials);

  // Pre-scaled queries of group g into qs: H*T rows of D, then per head D x T (feature-major).
  auto load_q = [&](int64_t g, float* qs) {
    float* qt = qs + HT * a.D;
    for (int64_t r = 0; r < HT; ++r) {
      const float* qb = a.q.data + a.row_offset(g * H + r / a.T, a.q.sb, a.q.sh);
      for (int64_t i = 0; i < a.D; ++i)
        qs[r * a.D + i] = qt[(r / a.T * a.D + i) * a.T + r % a.T] =
            plan.qscale * qb[(r % a.T) * a.q.st + i * a.q.sd];
    }
  };

  // The whole call on the calling thread when the work is worth one thread only: the same loops
  // as the parallel region, without entering the OpenMP runtime (kernels/cpu/parallel.hpp).
  auto work = [&](int tid, bool parallel) {
    const FlushDenormalsScope flush;  // denormals.hpp: weights far below the maximum
    float* own = scratch.get(static_cast<size_t>(tid));
    float* x = own;
    float* qs = own + HT * (kDecodeChunkKeys + L);
    float* acc = qs + 2 * HT * a.D;
    std::vector<int64_t> ends(static_cast<size_t>(HT));
    int64_t q_group = -1;
    // Split-K: every (group, chunk) item is independent and its arithmetic fixed, so any schedule
    // gives the same partials. A thread takes runs of `run_len` consecutive items, so that an
    // item's V pass can fetch the K rows of the thread's next item (NextK).
    auto do_item = [&](int64_t it) {
      const Item cur = item_at(it);
      if (cur.g != q_group) load_q(cur.g, qs), q_group = cur.g;
      decode_detail::NextK next;
      if (k_rows_contiguous) {
        next.ready = it % run_len != 0;
        if ((it + 1) % run_len != 0 && it + 1 < items) {
          const Item nx = item_at(it + 1);
          next.k = reinterpret_cast<const char*>(a.k.data + a.row_offset(nx.g * H, a.k.sb, a.k.sh) +
                                                 nx.s0 * a.k.st);
          next.bytes = (nx.s1 - nx.s0) * a.k.st * static_cast<int64_t>(sizeof(KV));
        }
      }
      item_fn(a, plan, qs, &lims[static_cast<size_t>(cur.g * HT)], cur.g * H, H, cur.s0, cur.s1, x,
              ends.data(), parts.get(0) + it * item_floats, next);
    };
    if (parallel) {
      // A local copy: clang 14 crashes generating an orphaned `omp for` whose schedule clause
      // names a variable the enclosing lambda captured by reference (seen with -fsanitize).
      const int64_t chunk = run_len;
#pragma omp for schedule(dynamic, chunk)
      for (int64_t it = 0; it < items; ++it)
        do_item(it);
    } else {
      for (int64_t it = 0; it < items; ++it)
        do_item(it);
    }

    // Merge each row's partials in chunk order (the implicit barrier above ends the items).
    auto merge_row = [&](int64_t bt) {
      const int64_t b = bt / a.T, t = bt % a.T;
      const int64_t lim = lims[static_cast<size_t>(bt)];
      float* out = a.out.data + a.row_offset(b, a.out.sb, a.out.sh) + t * a.out.st;
      float* lse = a.lse ? a.lse + bt : nullptr;
      if (lim == 0) {
        // Masked row: d2l's uniform weights over all S keys (padding included), or zeros.
        for (int64_t i = 0; i < a.Dv; ++i)
          acc[i] = 0.0f;
        if (!a.zero_masked_rows() && a.S > 0) {
          const KV* vb = a.v.data + a.row_offset(b, a.v.sb, a.v.sh);
          for (int64_t s = 0; s < a.S; ++s)
            for (int64_t i = 0; i < a.Dv; ++i)
              acc[i] += decode_detail::to_float(vb[s * a.v.st + i]);
          for (int64_t i = 0; i < a.Dv; ++i)
            acc[i] /= static_cast<float>(a.S);
        }
        for (int64_t i = 0; i < a.Dv; ++i)
          out[i * a.out.sd] = acc[i];
        if (lse) *lse = -std::numeric_limits<float>::infinity();
        return;
      }
      const int64_t g = b / H, r = (b % H) * a.T + t;
      const int64_t c0 = first[static_cast<size_t>(g)], nc = first[static_cast<size_t>(g + 1)] - c0;
      float M = 0.0f;
      const float l = merge_fn(plan, parts.get(0) + c0 * item_floats + r * plan.part_stride,
                               item_floats, nc, acc, &M);
      const float inv = 1.0f / l;
      for (int64_t i = 0; i < a.Dv; ++i)
        out[i * a.out.sd] = acc[i] * inv;
      if (lse) *lse = 0.6931471805599453f * (M + std::log2(l));
    };
    if (parallel) {
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < a.B * a.T; ++bt)
        merge_row(bt);
    } else {
      for (int64_t bt = 0; bt < a.B * a.T; ++bt)
        merge_row(bt);
    }
  };
  if (threads == 1) {
    work(0, false);
    return;
  }
#pragma omp parallel num_threads(threads)
  work(omp_get_thread_num(), true);
}

}  // namespace

void decode_attention(const DecodeArgs<float>& a) {
  run(a);
}
void decode_attention(const DecodeArgs<uint16_t>& a) {
  run(a);
}

const char* decode_attention_target() {
  return HWY_DYNAMIC_DISPATCH(DecodeTargetName)();
}

}  // namespace attn::cpu
#endif  // HWY_ONCE
