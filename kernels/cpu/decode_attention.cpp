// Decode attention (contract in decode_attention.hpp): T <= 8 queries per row, keys split into
// fixed chunks, one partial softmax per (row, chunk), merged by log-sum-exp.
//
// Per work item (row b, keys [s0, s1)), scores in log2 units x = (scale * log2 e) q . k as in the
// flash kernel (one exp2 per weight), for each query t over its kept keys s < lim_t:
//   m_t = max_s x_ts,   l_t = sum_s 2^(x_ts - m_t),   o_t = sum_s 2^(x_ts - m_t) v_s    (partial)
// and per row, over its chunks c in order (Milakov & Gimelshein 2018; FlashDecoding's split-K):
//   M = max_c m_c,  l = sum_c 2^(m_c - M) l_c,  out = (sum_c 2^(m_c - M) o_c) / l,
//   lse = ln 2 * (M + log2 l).
// The chunk of 256 keys is read twice (K for the scores, then V), each row once from memory: the
// chunk's K and V stay in L2 between the two passes. q is held pre-scaled in a small buffer; K
// rows are dotted with all T queries per load (T accumulator vectors), V rows scaled into T
// output rows per load.
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

// Partials of row b over keys [s0, s1) for NQ queries (qs: NQ rows of D, pre-scaled; lim: kept
// keys per query). x: scratch of NQ * (kDecodeChunkKeys + L) floats. part: NQ * (Dv + 2).
template <int NQ, class KV>
void ChunkPartial(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                  const int64_t* lim, int64_t b, int64_t s0, int64_t s1, float* x, float* part) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t D = plan.D, Dv = plan.Dv, n = s1 - s0;
  const int64_t xs = kDecodeChunkKeys + L;  // row stride of x
  const int64_t Dm = D / L * L, Dvm = Dv / L * L;
  const KV* kb = a.k.data + a.row_offset(b, a.k.sb, a.k.sh);
  const KV* vb = a.v.data + a.row_offset(b, a.v.sb, a.v.sh);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // QDotK: x[t, s] = q_t . k_s over the chunk, -inf past the query's kept keys.
  for (int64_t s = s0; s < s1; ++s) {
    const KV* kr = kb + s * a.k.st;
    VF acc[NQ];
    for (int t = 0; t < NQ; ++t)
      acc[t] = hn::Zero(d);
    for (int64_t i = 0; i < Dm; i += L) {
      const VF kv = LoadRow(d, kr + i);
      for (int t = 0; t < NQ; ++t)
        acc[t] = hn::MulAdd(hn::LoadU(d, qs + t * D + i), kv, acc[t]);
    }
    float tail[NQ] = {};
    for (int64_t i = Dm; i < D; ++i) {
      const float kf = decode_detail::to_float(kr[i]);
      for (int t = 0; t < NQ; ++t)
        tail[t] += qs[t * D + i] * kf;
    }
    for (int t = 0; t < NQ; ++t)
      x[t * xs + (s - s0)] =
          s < lim[t] ? hn::GetLane(hn::SumOfLanes(d, acc[t])) + tail[t] : kNegInf;
  }

  // Softmax of the chunk: m_t, p = 2^(x - m_t) in place, l_t.
  const int64_t np = (n + L - 1) / L * L;  // padded with -inf: weight exactly 0
  float m[NQ], l[NQ];
  for (int t = 0; t < NQ; ++t) {
    float* xt = x + t * xs;
    for (int64_t j = n; j < np; ++j)
      xt[j] = kNegInf;
    VF vm = hn::Set(d, kNegInf);
    for (int64_t j = 0; j < np; j += L)
      vm = hn::Max(vm, hn::LoadU(d, xt + j));
    m[t] = hn::GetLane(hn::MaxOfLanes(d, vm));
    l[t] = 0.0f;
    if (m[t] == kNegInf) continue;  // no kept key in this chunk
    const VF vmax = hn::Set(d, m[t]);
    VF vl = hn::Zero(d);
    for (int64_t j = 0; j < np; j += L) {
      const VF p = Exp2(d, hn::Sub(hn::LoadU(d, xt + j), vmax));
      hn::StoreU(p, d, xt + j);
      vl = hn::Add(vl, p);
    }
    l[t] = hn::GetLane(hn::SumOfLanes(d, vl));
  }

  // WeightedSumV: o_t = sum_s p_ts v_s over the query's kept keys (a key past them is not read
  // for it: 0 * inf would poison the row).
  const int64_t ps = plan.part_stride;
  for (int t = 0; t < NQ; ++t) {
    float* o = part + t * ps;
    for (int64_t i = 0; i < Dv; ++i)
      o[i] = 0.0f;
    o[Dv] = m[t];
    o[Dv + 1] = l[t];
  }
  int64_t end[NQ];
  for (int t = 0; t < NQ; ++t)
    end[t] = m[t] == kNegInf ? s0 : std::min(s1, lim[t]);
  for (int64_t s = s0; s < s1; ++s) {
    const KV* vr = vb + s * a.v.st;
    for (int64_t i = 0; i < Dvm; i += L) {
      const VF vv = LoadRow(d, vr + i);
      for (int t = 0; t < NQ; ++t) {
        if (s >= end[t]) continue;
        float* o = part + t * ps + i;
        hn::StoreU(hn::MulAdd(hn::Set(d, x[t * xs + (s - s0)]), vv, hn::LoadU(d, o)), d, o);
      }
    }
    for (int64_t i = Dvm; i < Dv; ++i) {
      const float vf = decode_detail::to_float(vr[i]);
      for (int t = 0; t < NQ; ++t)
        if (s < end[t]) part[t * ps + i] += x[t * xs + (s - s0)] * vf;
    }
  }
}

template <class KV>
void ChunkPartialAny(const DecodeArgs<KV>& a, const decode_detail::Plan& plan, const float* qs,
                     const int64_t* lim, int64_t b, int64_t s0, int64_t s1, float* x, float* part) {
  switch (plan.T) {
#define ATTN_DECODE_CASE(N) \
  case N:                   \
    return ChunkPartial<N, KV>(a, plan, qs, lim, b, s0, s1, x, part);
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
                     const int64_t* lim, int64_t b, int64_t s0, int64_t s1, float* x, float* part) {
  ChunkPartialAny(a, plan, qs, lim, b, s0, s1, x, part);
}
void ChunkPartialBF16(const DecodeArgs<uint16_t>& a, const decode_detail::Plan& plan,
                      const float* qs, const int64_t* lim, int64_t b, int64_t s0, int64_t s1,
                      float* x, float* part) {
  ChunkPartialAny(a, plan, qs, lim, b, s0, s1, x, part);
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

  // Items: row b owns chunks first[b] .. first[b + 1) covering its largest kept-key limit.
  std::vector<int64_t> first(static_cast<size_t>(a.B + 1), 0);
  std::vector<int64_t> lims(static_cast<size_t>(a.B * a.T));
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t top = 0;
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t lim = a.row_limit(b, t);
      lims[static_cast<size_t>(b * a.T + t)] = lim;
      top = std::max(top, lim);
    }
    first[static_cast<size_t>(b + 1)] =
        first[static_cast<size_t>(b)] + (top + kDecodeChunkKeys - 1) / kDecodeChunkKeys;
  }
  const int64_t items = first.back();
  const int64_t item_floats = a.T * plan.part_stride;
  const int threads = std::max(1, a.threads);
  const int64_t L = 16;  // >= every target's lanes (x scratch padding)
  const size_t per_thread = static_cast<size_t>(a.T * (kDecodeChunkKeys + L) + a.T * a.D + a.Dv);
  const Scratch<float> scratch(op, per_thread, static_cast<size_t>(threads));
  const Scratch<float> parts(op, static_cast<size_t>(std::max<int64_t>(1, items * item_floats)));
  auto* item_fn = chunk_fn(a);
  auto* merge_fn = HWY_DYNAMIC_DISPATCH(MergePartials);

  // Pre-scaled queries of row b into qs (T rows of D).
  auto load_q = [&](int64_t b, float* qs) {
    const float* qb = a.q.data + a.row_offset(b, a.q.sb, a.q.sh);
    for (int64_t t = 0; t < a.T; ++t)
      for (int64_t i = 0; i < a.D; ++i)
        qs[t * a.D + i] = plan.qscale * qb[t * a.q.st + i * a.q.sd];
  };

#pragma omp parallel num_threads(threads)
  {
    float* own = scratch.get(omp_get_thread_num());
    float* x = own;
    float* qs = own + a.T * (kDecodeChunkKeys + L);
    float* acc = qs + a.T * a.D;
    int64_t q_row = -1;
    // Split-K: every (row, chunk) item is independent and its arithmetic fixed, so any schedule
    // gives the same partials.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), it) -
                                             first.begin() - 1);
      if (b != q_row) load_q(b, qs), q_row = b;
      const int64_t c = it - first[static_cast<size_t>(b)];
      const int64_t s0 = c * kDecodeChunkKeys;
      int64_t top = 0;
      for (int64_t t = 0; t < a.T; ++t)
        top = std::max(top, lims[static_cast<size_t>(b * a.T + t)]);
      item_fn(a, plan, qs, &lims[static_cast<size_t>(b * a.T)], b, s0,
              std::min(top, s0 + kDecodeChunkKeys), x, parts.get(0) + it * item_floats);
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
      const int64_t c0 = first[static_cast<size_t>(b)], nc = first[static_cast<size_t>(b + 1)] - c0;
      float M = 0.0f;
      const float l = merge_fn(plan, parts.get(0) + c0 * item_floats + t * plan.part_stride,
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
