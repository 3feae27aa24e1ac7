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

// Fetches a row into L2 (prefetcht1): the V rows of a chunk, streamed alongside its K rows, are
// read again from L2 by WeightedSumV in another order.
HWY_INLINE void PrefetchToL2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64)
    __builtin_prefetch(c + i, 0, 2);
  __builtin_prefetch(c + bytes - 1, 0, 2);
}

// The loops over the NQ queries are unrolled by hand (HWY_UNROLL): GCC 12 -O2 kept the NQ
// accumulator vectors in a stack array, each FMA a load and a store on the previous key's store,
// ~10 cycles per key and feature block (perf annotate: 33% of the samples on one such loop).
//
// Partials of the nh heads of one batch row (rows b0 .. b0 + nh - 1, sharing the cache's
// positions) over keys [s0, s1), NQ queries each; row r = h * NQ + t below. qs: nh*NQ rows of D,
// pre-scaled; lim: kept keys per row r; x: scratch of nh*NQ rows of kDecodeChunkKeys + L floats;
// ends: nh*NQ; part: nh*NQ partials of Dv + 2 floats.
// All heads of a key are read together: a (capacity, H*D) cache then streams through contiguous
// memory that the hardware prefetchers follow. Reading one head at a time (its rows H*D apart)
// stalled on the first load of every row (~85% of the kernel's samples in a perf profile, 2-4
// GB/s at S = 4k); software prefetch of the strided rows only got it to ~33% of the probe.
template <int NQ, class KV>
void ChunkPartial(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                  const int64_t* lim, int64_t b0, int64_t nh, int64_t s0, int64_t s1, float* x,
                  int64_t* ends, float* part) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t D = plan.D, Dv = plan.Dv, n = s1 - s0, ps = plan.part_stride;
  const int64_t xs = kDecodeChunkKeys + L;  // row stride of x
  const int64_t Dm = D / L * L, Dvm = Dv / L * L;
  const KV* kb = a.k.data + a.row_offset(b0, a.k.sb, a.k.sh);
  const KV* vb = a.v.data + a.row_offset(b0, a.v.sb, a.v.sh);
  const int64_t ksh = nh > 1 ? a.k.sh : 0, vsh = nh > 1 ? a.v.sh : 0;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // QDotK: x[r, s] = q_r . k_s over the chunk, -inf past the row's kept keys.
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t h = 0; h < nh; ++h)
      PrefetchToL2(vb + s * a.v.st + h * vsh, Dv * static_cast<int64_t>(sizeof(KV)));
    for (int64_t h = 0; h < nh; ++h) {
      const KV* kr = kb + s * a.k.st + h * ksh;
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
}

template <class KV>
void ChunkPartialAny(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                     const int64_t* lim, int64_t b0, int64_t nh, int64_t s0, int64_t s1, float* x,
                     int64_t* ends, float* part) {
  switch (plan.T) {
#define ATTN_DECODE_CASE(N) \
  case N:                   \
    return ChunkPartial<N, KV>(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part);
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
                     int64_t* ends, float* part) {
  ChunkPartialAny(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part);
}
void ChunkPartialBF16(const DecodeArgs<uint16_t>& a, const decode_detail::Plan& plan,
                      const float* qs, const int64_t* lim, int64_t b0, int64_t nh, int64_t s0,
                      int64_t s1, float* x, int64_t* ends, float* part) {
  ChunkPartialAny(a, plan, qs, lim, b0, nh, s0, s1, x, ends, part);
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
  const int threads = std::max(1, a.threads);
  const int64_t L = 16;  // >= every target's lanes (x scratch padding)
  const size_t per_thread = static_cast<size_t>(HT * (kDecodeChunkKeys + L) + HT * a.D + a.Dv);
  const Scratch<float> scratch(op, per_thread, static_cast<size_t>(threads));
  const Scratch<float> parts(op, static_cast<size_t>(std::max<int64_t>(1, items * item_floats)));
  auto* item_fn = chunk_fn(a);
  auto* merge_fn = HWY_DYNAMIC_DISPATCH(MergePartials);

  // Pre-scaled queries of group g into qs (H*T rows of D).
  auto load_q = [&](int64_t g, float* qs) {
    for (int64_t r = 0; r < HT; ++r) {
      const float* qb = a.q.data + a.row_offset(g * H + r / a.T, a.q.sb, a.q.sh);
      for (int64_t i = 0; i < a.D; ++i)
        qs[r * a.D + i] = plan.qscale * qb[(r % a.T) * a.q.st + i * a.q.sd];
    }
  };

#pragma omp parallel num_threads(threads)
  {
    float* own = scratch.get(omp_get_thread_num());
    float* x = own;
    float* qs = own + HT * (kDecodeChunkKeys + L);
    float* acc = qs + HT * a.D;
    std::vector<int64_t> ends(static_cast<size_t>(HT));
    int64_t q_group = -1;
    // Split-K: every (group, chunk) item is independent and its arithmetic fixed, so any schedule
    // gives the same partials.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t g = static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), it) -
                                             first.begin() - 1);
      if (g != q_group) load_q(g, qs), q_group = g;
      const int64_t s0 = (it - first[static_cast<size_t>(g)]) * kDecodeChunkKeys;
      item_fn(a, plan, qs, &lims[static_cast<size_t>(g * HT)], g * H, H, s0,
              std::min(tops[static_cast<size_t>(g)], s0 + kDecodeChunkKeys), x, ends.data(),
              parts.get(0) + it * item_floats);
    }

    // Merge each row's partials in chunk order (the implicit barrier above ends the items).
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < a.B * a.T; ++bt) {
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
        continue;
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
    }
  }
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
