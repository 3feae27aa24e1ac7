// Fused CPU attention, float32: forward with online softmax, FlashAttention-2 style backward.
// The contract (shapes, masks, dropout, threads) is in flash_attention.hpp; this file holds the
// math and the loops. Per-target code (AVX-512, AVX2, scalar) is compiled from one source by
// Highway's foreach_target and picked at run time.
//
// Forward (Dao et al., FlashAttention, 2022; Milakov & Gimelshein, "Online normalizer
// calculation for softmax", 2018). Scores are kept in log2 units, x = (scale * log2 e) q.k, so
// that one exp2 per weight suffices (q is pre-multiplied by scale * log2 e when packed). For each
// query block and each key tile j, per row:
//   m_j = max(m_{j-1}, max_s x_s)                       running max
//   p_s = 2^(x_s - m_j)                                  unnormalized weights of tile j
//   l_j = 2^(m_{j-1} - m_j) l_{j-1} + sum_s p_s          running denominator
//   o_j = 2^(m_{j-1} - m_j) o_{j-1} + sum_s p_s z_s v_s  running numerator
// (z: the dropout multiplier, 0 or 1/(1-p))
// and at the end out = o / l, lse = ln 2 * (m + log2 l). Only (block x tile) scores ever exist.
//
// Backward (Dao, FlashAttention-2, 2023, Algorithm 2), with P recomputed from the saved lse:
//   P_ts  = exp(score_ts - lse_t)
//   dV_s  = sum_t P_ts Z_ts dO_t                       dropout: the weights that made out
//   dP_ts = Z_ts (dO_t . V_s)
//   D_t   = sum_s P_ts dP_ts = dO_t . out_t             (so it needs no pass over the keys)
//   dS_ts = P_ts (dP_ts - D_t)                           softmax backward
//   dQ_t  = scale sum_s dS_ts K_s,   dK_s = scale sum_t dS_ts Q_t
// Work items are (b, key range): an item owns dK and dV of its keys outright and adds its share
// of dQ into a private fp32 buffer; the buffers are summed in a fixed order at the end, so the
// result does not depend on which thread ran what.
//
// Performance notes (Zen 4, AVX-512; design and measurements in docs/kernels-cpu.md): every
// product is the one register-blocked micro-kernel of flash_kernels-inl.h (24 accumulator
// vectors). The forward works on blocks of 192 queries laid along the vector lanes (transposed,
// see ForwardBlock) and key tiles of 64; the backward on key blocks of 64 and query tiles of 96.
// Only Q^T (forward) and the key block's K, K^T, V^T plus each query tile's Q and dO (backward)
// are packed; their cost is O(1/64) of the FMAs.
// Short sequences (d2l's PyTorch loop: B*H = 128 items of T = S = 128, D = 32, head strides) are
// dominated by per-item fixed costs instead: each item runs for tens of microseconds and first
// touches ~50 KB of head-strided rows. There both kernels prefetch all of the next item's rows
// into L2 over the whole item (ShortRows, NextItemPrefetch), the backward sums D_t 16 rows at a
// time (RowDots) and stores dK, dV, dQ rows as vectors, and the forward's dropout draws two Philox
// blocks per lane at once; the arithmetic, hence every result bit, is that of the long-row path.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_attention.cpp"
// Compile for AVX-512, AVX2 and the portable scalar fallback only: SSSE3/SSE4 would add compile
// time for machines this library does not target.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_driver.hpp"
#include "kernels/cpu/flash_kernels-inl.h"
#include "kernels/cpu/row_prefetch.hpp"

#include "attn/core/rng.hpp"

#include <cmath>
#include <cstring>
#include <limits>

// Target-independent helpers, compiled once.
#ifndef ATTN_FLASH_ATTENTION_SHARED_
#define ATTN_FLASH_ATTENTION_SHARED_
namespace attn::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Offset of batch row b of a tensor with batch stride sb and head stride sh (see
// kernels/attention_problem.hpp: b = batch * heads + head).
inline int64_t HeadOffset(const FlashParams& p, int64_t b, int64_t sb, int64_t sh) {
  return p.row_offset(b, sb, sh);
}
inline int64_t QOff(const FlashParams& p, int64_t b) {
  return HeadOffset(p, b, p.q.sb, p.q.sh);
}
inline int64_t KOff(const FlashParams& p, int64_t b) {
  return HeadOffset(p, b, p.k.sb, p.k.sh);
}
inline int64_t VOff(const FlashParams& p, int64_t b) {
  return HeadOffset(p, b, p.v.sb, p.v.sh);
}
inline int64_t OOff(const FlashParams& p, int64_t b) {
  return HeadOffset(p, b, p.out.sb, p.out.sh);
}

// Keys [0, limit) are kept for row (b, t): the length mask and the causal mask both keep a prefix.
inline int64_t RowLimit(const FlashParams& p, int64_t b, int64_t t) {
  return p.row_limit(b, t);
}

// Dropout multipliers of elements i0 + k, k < n (kernels/cpu/dropout_simd.hpp).
inline void DropoutMultipliers(const FlashParams& p, uint64_t i0, int64_t n, float* z) {
  dropout_multipliers(p.dropout, p.seed, p.offset, i0, n, z);
}

}  // namespace
}  // namespace attn::cpu
#endif  // ATTN_FLASH_ATTENTION_SHARED_

HWY_BEFORE_NAMESPACE();
namespace attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int64_t kL = HWY_LANES(float);
constexpr int64_t kBlockK = kNV * kL;     // keys per tile: one micro-tile wide (AVX-512: 64)
constexpr int64_t kBlockQ = 12 * kL;      // forward query rows per block (AVX-512: 192)
constexpr int64_t kBwdBlockQ = 16 * kMR;  // backward query rows per tile (AVX-512: 96)
constexpr int64_t kPanel = kFwdNV * kL;   // forward query columns per panel (AVX-512: 48)

int64_t QueryBlockRows() {
  return kBlockQ;
}
const char* TargetName() {
  return hwy::TargetName(HWY_TARGET);
}

// ---------------------------------------------------------------------------------------------
// Forward

// True when every element of the (rows x cols) tile src[r*s_r + c*s_c] is finite. The products
// below multiply masked weights (exact zeros) by whole rows of K, V, Q or dO, and 0 * NaN is NaN:
// a NaN or Inf in an input that one query keeps and another masks must not reach the second
// query (the reference skips masked terms). Tiles that fail this check take the masked loops.
bool AllFinite(const float* src, int64_t rows, int64_t cols, int64_t s_r, int64_t s_c) {
  const DF d;
  const VF lim = hn::Set(d, std::numeric_limits<float>::max());
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * s_r;
    int64_t c = 0;
    if (s_c == 1) {
      VF bad = hn::Zero(d);
      for (; c + kL <= cols; c += kL) {
        // |x| <= max fails for Inf and NaN; accumulate the failures as a vector of 0 / all-ones.
        bad = hn::Or(bad, hn::VecFromMask(d, hn::Not(hn::Le(hn::Abs(hn::LoadU(d, x + c)), lim))));
      }
      if (!hn::AllTrue(d, hn::Eq(bad, hn::Zero(d)))) return false;
    }
    for (; c < cols; ++c)
      if (!std::isfinite(x[c * s_c])) return false;
  }
  return true;
}

// Dropout multipliers z[0..n) of elements i0 + k of the dropout stream. When i0 % 4 == 0,
// element i0 + 4m + j is word j of Philox block i0/4 + m: L blocks are drawn at once and their
// words interleaved. Otherwise (and on the scalar target) the scalar draw.
void DropoutRow(const FlashParams& p, uint64_t i0, int64_t n, float* z) {
#if HWY_TARGET == HWY_SCALAR
  DropoutMultipliers(p, i0, n, z);
#else
  // A row that starts inside a Philox block (padded lengths that are not multiples of 4): its
  // first 1-3 elements by the scalar draw, the rest from whole blocks.
  if (const int64_t head = std::min<int64_t>(n, (4 - static_cast<int64_t>(i0 & 3)) & 3); head) {
    DropoutMultipliers(p, i0, head, z);
    i0 += static_cast<uint64_t>(head), z += head, n -= head;
  }
  const DF d;
  const DU du;
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const VU bound = KeepBound(p.dropout);
  const VF vscale = hn::Set(d, keep_scale);
  HWY_ALIGN float buf[4 * kL];
  for (int64_t k0 = 0; k0 < n; k0 += 4 * kL) {
    const uint64_t blk = (i0 >> 2) + static_cast<uint64_t>(k0 / 4);
    VU c[4];
    CounterAdd(hn::Set(du, static_cast<uint32_t>(blk)),
               hn::Set(du, static_cast<uint32_t>(blk >> 32)), hn::Iota(du, 0), c[0], c[1]);
    c[2] = hn::Set(du, static_cast<uint32_t>(p.offset));
    c[3] = hn::Set(du, static_cast<uint32_t>(p.offset >> 32));
    Philox4x32(DU(), c, p.seed);
    hn::StoreInterleaved4(DropMultiplier(c[0], bound, vscale), DropMultiplier(c[1], bound, vscale),
                          DropMultiplier(c[2], bound, vscale), DropMultiplier(c[3], bound, vscale),
                          d, buf);
    std::copy(buf, buf + std::min<int64_t>(4 * kL, n - k0), z + k0);
  }
#endif
}

// P^T *= Z^T on the score tile xt (nk keys x mqp queries), lanes [c0, c_end), keys from s0.
// Vectorized across queries when every query's run of keys starts on a Philox block
// (AttentionProblem::dropout_rows_aligned: S % 4 == 0 and base + s0 a multiple of 4; with a
// dropout window, the global Sg and s0 instead): then query t's run starts at stream index
// i_t = dropout_index(b, t, s0), a multiple of 4, so key s0 + 4g + j of every lane is word j of
// its Philox block i_t/4 + g: one draw per 4 keys per query, and each word is a whole row of the
// tile. Returns false (nothing done) otherwise.
bool DropoutTransposed(const FlashParams& p, int64_t b, int64_t t0, int64_t s0, int64_t nk,
                       int64_t c0, int64_t c_end, int64_t mqp, float* xt) {
#if HWY_TARGET == HWY_SCALAR
  return false;
#else
  if (!p.dropout_rows_aligned(s0)) return false;
  const DF d;
  const DU du;
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const VU bound = KeepBound(p.dropout);
  const VF vscale = hn::Set(d, keep_scale);
  // The decisions for the backward (KeepsDropout): word of key s, 16 queries from t0 (t0 % 16 = 0).
  uint16_t* keep = kL == 16 && p.dropout_keep != nullptr
                       ? p.dropout_keep + (b * ((p.T + kL - 1) / kL) + t0 / kL) * p.S
                       : nullptr;
  HWY_ALIGN uint32_t lo_w[kL], hi_w[kL];
  const int64_t groups = (nk + 3) / 4;
  for (int64_t c = c0; c < c_end; c += kL) {
    for (int64_t l = 0; l < kL; ++l) {
      const uint64_t blk = p.dropout_index(b, t0 + c + l, s0) >> 2;
      lo_w[l] = static_cast<uint32_t>(blk);
      hi_w[l] = static_cast<uint32_t>(blk >> 32);
    }
    const VU lo = hn::Load(du, lo_w), hi = hn::Load(du, hi_w);
    // Keys 4g + j, j < 4, from word j of block g: two blocks (g, g + 1) drawn at once.
    for (int64_t g = 0; g < groups; g += 2) {
      VU w[2][4];
      for (int n = 0; n < 2; ++n) {
        CounterAdd(lo, hi, hn::Set(du, static_cast<uint32_t>(g + n)), w[n][0], w[n][1]);
        w[n][2] = hn::Set(du, static_cast<uint32_t>(p.offset));
        w[n][3] = hn::Set(du, static_cast<uint32_t>(p.offset >> 32));
      }
      Philox4x32N<2>(du, w, p.seed);  // a block past the last group is drawn and not used
      for (int64_t k = 4 * g; k < std::min(nk, 4 * g + 8); ++k) {
        float* row = xt + k * mqp + c;
        // Kept iff the multiplier is nonzero (none when p = 1: then keep_scale is 0 too).
        const auto kept = hn::RebindMask(d, hn::Gt(w[(k - 4 * g) / 4][k % 4], bound));
        hn::StoreU(hn::Mul(hn::LoadU(d, row), hn::IfThenElseZero(kept, vscale)), d, row);
        if (keep != nullptr) {
          uint8_t bits[8] = {};
          hn::StoreMaskBits(d, kept, bits);
          keep[c / kL * p.S + s0 + k] = static_cast<uint16_t>(bits[0] | (bits[1] << 8));
        }
      }
    }
  }
  return true;
#endif
}

// True when this target's forward records its dropout decisions in p.dropout_keep (the format
// of AttentionArgs::dropout_keep): 16 query lanes per vector, and DropoutTransposed takes every
// tile (dropout_rows_aligned holds at s = 0, so at every tile start, a multiple of 64).
bool KeepsDropout(const FlashParams& p) {
  return kL == 16 && HWY_TARGET != HWY_SCALAR && p.dropout > 0.0f && p.T > 0 && p.S > 0 &&
         p.dropout_rows_aligned(0);
}

// Dropout multipliers z[0..n) of row (b, t), keys s0 .. s0 + n - 1, from the forward's recorded
// decisions (bit t % 16 of each key's word): the values DropoutRow draws, without the draw.
void DropoutRowKept(const FlashParams& p, int64_t b, int64_t t, int64_t s0, int64_t n, float* z) {
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const uint16_t* words = p.dropout_keep + (b * ((p.T + 15) / 16) + t / 16) * p.S + s0;
  const uint32_t bit = 1u << (t % 16);
  int64_t s = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  const DU du;
  const hn::Rebind<uint16_t, DU> d16;
  const VU vbit = hn::Set(du, bit);
  const VF vscale = hn::Set(d, keep_scale);
  for (; s + kL <= n; s += kL) {
    const VU w = hn::PromoteTo(du, hn::LoadU(d16, words + s));
    hn::StoreU(
        hn::IfThenElseZero(hn::RebindMask(d, hn::Ne(hn::And(w, vbit), hn::Zero(du))), vscale), d,
        z + s);
  }
#endif
  for (; s < n; ++s)
    z[s] = (words[s] & bit) != 0 ? keep_scale : 0.0f;
}

size_t ForwardScratchFloats(const FlashParams& p) {
  return static_cast<size_t>((p.D + kBlockK + p.Dv + 5) * kBlockQ + kBlockK + RoundUpLanes(p.Dv));
}

// weights[b, t0 + r, s] = 2^(x - m) / l for kept keys, 0 for masked ones, and the masked-row
// policy (1/S or 0) for queries without keys: X^T recomputed tile by tile once m and l are final.
// (2^(x - m) / l rather than 2^(x - lse): equal scores then give exactly fl(1/n).)
void WriteWeights(const FlashParams& p, int64_t b, int64_t t0, int64_t mq, int64_t mqp,
                  const int64_t* lim, const float* qt, const float* mv, const float* lv, float* xt,
                  float* m_use) {
  const DF d;
  for (int64_t r = 0; r < mq; ++r) {
    float* w = p.weights + b * p.w_sb + (t0 + r) * p.w_st;
    const float fill = lim[r] == 0 && !p.zero_masked_rows() ? 1.0f / static_cast<float>(p.S) : 0.0f;
    std::fill(w + lim[r], w + p.S, fill);
  }
  for (int64_t r = 0; r < mqp; ++r)
    m_use[r] = r < mq && lim[r] > 0 ? mv[r] : 0.0f;
  int64_t max_lim = 0;
  for (int64_t r = 0; r < mq; ++r)
    max_lim = std::max(max_lim, lim[r]);
  for (int64_t s0 = 0; s0 < max_lim; s0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, max_lim - s0);
    GemmFwd(nk, mqp, p.D, p.k.data + KOff(p, b) + s0 * p.k.st, p.k.st, p.k.sd, qt, mqp, xt, mqp,
            false);
    for (int64_t s = 0; s < nk; ++s)
      for (int64_t c = 0; c < mqp; c += kL) {
        float* x = xt + s * mqp + c;
        hn::StoreU(Exp2(d, hn::Sub(hn::LoadU(d, x), hn::LoadU(d, m_use + c))), d, x);
      }
    for (int64_t r = 0; r < mq; ++r) {
      float* w = p.weights + b * p.w_sb + (t0 + r) * p.w_st + s0;
      const int64_t n = std::clamp<int64_t>(lim[r] - s0, 0, nk);
      const float inv = n > 0 ? 1.0f / lv[r] : 0.0f;
      for (int64_t s = 0; s < n; ++s)
        w[s] = xt[s * mqp + r] * inv;
    }
  }
}

// One step of the online softmax for NV vectors of query columns from c, over the nk rows of the
// score tile xt (ld mqp): P^T = 2^(X^T - m_new) in place, l = 2^(m_old - m_new) l + sum_s P^T,
// alpha = 2^(m_old - m_new), m = m_new (mn holds m_new, max(m_old, the tile's maxima)). NV
// columns at once keep NV independent chains of sums and exponentials in flight.
template <int NV>
HWY_INLINE void SoftmaxColumns(int64_t nk, int64_t mqp, int64_t c, float* xt, float* mv,
                               const float* mn, float* lv, float* alpha) {
  const DF d;
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  VF m_use[NV], sum[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    const VF m_new = hn::LoadU(d, mn + c + j * kL);
    // A query with no kept key so far keeps m = -inf; subtract 0 instead so that its weights
    // come out 0 (2^-inf) rather than NaN (-inf - -inf).
    m_use[j] = hn::IfThenElse(hn::Eq(m_new, neg_inf), hn::Zero(d), m_new);
    sum[j] = hn::Zero(d);
  }
  for (int64_t s = 0; s < nk; ++s) {
    float* x = xt + s * mqp + c;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const VF e = Exp2(d, hn::Sub(hn::LoadU(d, x + j * kL), m_use[j]));
      hn::StoreU(e, d, x + j * kL);
      sum[j] = hn::Add(sum[j], e);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    const int64_t cj = c + j * kL;
    const VF a = Exp2(d, hn::Sub(hn::LoadU(d, mv + cj), m_use[j]));  // 0 on a first kept tile
    hn::StoreU(hn::MulAdd(hn::LoadU(d, lv + cj), a, sum[j]), d, lv + cj);
    hn::StoreU(hn::LoadU(d, mn + cj), d, mv + cj);
    hn::StoreU(a, d, alpha + cj);
  }
}

// One work item: rows [t0, t0 + rows) of batch b, rows <= kBlockQ (flash_driver.hpp).
//
// The block is computed transposed, queries along the vector lanes: X^T = K Q^T (keys x queries)
// and O^T += V^T P^T. Then every softmax step is elementwise across the lanes (the running max
// and sum of 16 queries at once, no horizontal reductions, the rescale a vector multiply), and
// both products read K and V as broadcast scalars straight from the caller's strided tensors:
// only Q^T (once per block) is packed.
//
// (next_b, next_t0): the item this thread will probably run next (next_b < 0: none), whose q
// rows are prefetched during this one.
void ForwardBlock(const FlashParams& p, int64_t b, int64_t t0, int64_t rows, float* scratch,
                  int64_t next_b, int64_t next_t0) {
  const int64_t D = p.D, Dv = p.Dv;
  const int64_t mq = std::min(rows, p.T - t0), mqp = RoundUpLanes(mq);
  float* qt = scratch;             // (D, mqp)       (scale log2 e) Q^T
  float* xt = qt + D * mqp;        // (kBlockK, mqp) X^T scores, then P^T weights
  float* ot = xt + kBlockK * mqp;  // (Dv, mqp)      O^T unnormalized output
  float* mv = ot + Dv * mqp;       // (mqp) running max (log2 units)
  float* lv = mv + mqp;            // (mqp) running denominator
  float* limv = lv + mqp;          // (mqp) key limit per query, as float
  float* alpha = limv + mqp;       // (mqp) rescale factor of this tile
  float* mn = alpha + mqp;         // (mqp) running max including this tile
  float* z = mn + mqp;             // (kBlockK) dropout multipliers
  float* tmp = z + kBlockK;        // (Dvp) masked-row output

  int64_t lim[kBlockQ];
  const int64_t max_lim = block_row_limits(p, b, t0, mq, mqp, lim, limv);
  PackTransposed(p.q.data + QOff(p, b) + t0 * p.q.st, mq, D, p.q.st, p.q.sd, p.scale * kLog2e, qt,
                 mqp);
  std::memset(ot, 0, sizeof(float) * Dv * mqp);  // memset: GCC -O2 left std::fill scalar
  std::fill(mv, mv + mqp, kNegInf);
  std::fill(lv, lv + mqp, 0.0f);

  // Keys past every row's limit are never touched (causal: the blocks above the diagonal).
  // Short rows (ShortRows): all of the next item's q, k and v rows and this item's out rows,
  // spread over every panel of the item; else the next q and this out over the last tiles.
  const bool prefetch = p.q.sd == 1 && p.out.sd == 1;
  const bool whole = ShortRows(p);
  const int64_t tiles = (max_lim + kBlockK - 1) / kBlockK;
  const int64_t panels = (mqp + kPanel - 1) / kPanel, steps = whole ? tiles * panels : tiles;
  const RowPrefetch::Mode read =
      whole ? RowPrefetch::Mode::kWholeItem : RowPrefetch::Mode::kLastSteps;
  RowPrefetch next_q(
      prefetch && next_b >= 0 ? p.q.data + QOff(p, next_b) + next_t0 * p.q.st : nullptr,
      std::min(rows, p.T - next_t0), D, p.q.st, read);
  RowPrefetch this_out(prefetch ? p.out.data + OOff(p, b) + t0 * p.out.st : nullptr, mq, Dv,
                       p.out.st, read);
  const bool next_kv = whole && next_b >= 0 && next_b != b && p.k.sd == 1 && p.v.sd == 1;
  RowPrefetch next_k(next_kv ? p.k.data + KOff(p, next_b) : nullptr, p.S, D, p.k.st, read);
  RowPrefetch next_v(next_kv ? p.v.data + VOff(p, next_b) : nullptr, p.S, Dv, p.v.st, read);
  int64_t step = 0;
  const auto prefetch_step = [&] {
    next_q.Step(step, steps);
    this_out.Step(step, steps);
    next_k.Step(step, steps);
    next_v.Step(step, steps);
    ++step;
  };
  for (int64_t s0 = 0; s0 < max_lim; s0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, max_lim - s0);
    if (!whole) prefetch_step();
    // Queries before the first one that keeps a key of this tile are skipped, a vector at a time
    // (causal: those above the diagonal).
    int64_t r_first = 0;
    while (lim[r_first] <= s0)
      ++r_first;
    const int64_t c0 = r_first / kL * kL;
    int64_t min_lim = p.S;
    for (int64_t r = c0; r < mq; ++r)
      min_lim = std::min(min_lim, lim[r]);

    const float* kb = p.k.data + KOff(p, b) + s0 * p.k.st;
    const float* vb = p.v.data + VOff(p, b) + s0 * p.v.st;
    const bool full = min_lim >= s0 + nk;  // every query from c0 keeps every key of the tile
    // A non-finite v of a key that some queries mask must reach only the queries that keep it.
    const bool v_finite = full || AllFinite(vb, nk, Dv, p.v.st, p.v.sd);

    // One panel of kPanel query columns at a time through all the steps, so that its scores,
    // weights and O^T columns stay in L1 between the two products.
    for (int64_t c1 = c0; c1 < mqp; c1 += kPanel) {
      if (whole) prefetch_step();
      const int64_t c2 = std::min(mqp, c1 + kPanel), w = c2 - c1;
      // X^T = K (Q^T scaled): (nk, w), and mn = max(m, column maxima of X^T).
      std::copy(mv + c1, mv + c2, mn + c1);
      if (full) {  // the maximum comes out of the product
        GemmFwdColMax(nk, w, D, kb, p.k.st, p.k.sd, qt + c1, mqp, xt + c1, mqp, mn + c1);
      } else {  // some kept prefix ends inside this tile: key s0+s >= limit masked in the product
        GemmFwdMaskColMax(nk, w, D, kb, p.k.st, p.k.sd, qt + c1, mqp, xt + c1, mqp, mn + c1,
                          limv + c1, s0);
      }

      // Online softmax, 16 queries per vector (the recurrence at the top of the file).
      int64_t c = c1;
      for (; c + kFwdNV * kL <= c2; c += kFwdNV * kL)
        SoftmaxColumns<kFwdNV>(nk, mqp, c, xt, mv, mn, lv, alpha);
      for (; c < c2; c += kL)
        SoftmaxColumns<1>(nk, mqp, c, xt, mv, mn, lv, alpha);
      // Dropout acts after normalization: it scales the numerator's weights only.
      if (p.dropout > 0.0f && !DropoutTransposed(p, b, t0, s0, nk, c1, c2, mqp, xt)) {
        for (int64_t r = std::max(r_first, c1); r < std::min(mq, c2); ++r) {
          const int64_t n = std::clamp<int64_t>(lim[r] - s0, 0, nk);
          DropoutRow(p, p.dropout_index(b, t0 + r, s0), n, z);
          for (int64_t s = 0; s < n; ++s)
            xt[s * mqp + r] *= z[s];
        }
      }
      // O^T = O^T diag(alpha) + V^T P^T: (Dv, w)
      if (v_finite) {
        GemmFwdScaleC(Dv, w, nk, vb, p.v.sd, p.v.st, xt + c1, mqp, ot + c1, mqp, alpha + c1);
      } else {  // add only the kept terms
        for (int64_t e = 0; e < Dv; ++e)
          MulRow(ot + e * mqp + c1, alpha + c1, w);
        for (int64_t r = std::max(r_first, c1); r < std::min(mq, c2); ++r)
          for (int64_t s = 0; s < std::min(nk, lim[r] - s0); ++s)
            for (int64_t e = 0; e < Dv; ++e)
              ot[e * mqp + r] += xt[s * mqp + r] * vb[s * p.v.st + e * p.v.sd];
      }
    }
  }

  if (whole) {  // the steps of panels skipped (causal), then the rest at once
    step = std::max<int64_t>(step, steps - 1);
    prefetch_step();
  }
  if (p.weights != nullptr) WriteWeights(p, b, t0, mq, mqp, lim, qt, mv, lv, xt, alpha);

  // out = O^T transposed back, each row divided by its l (alpha is free again: its last use was
  // WriteWeights); queries without a kept key then get the masked-row policy instead.
  float* inv = alpha;
  for (int64_t r = 0; r < mq; ++r) {
    inv[r] = lim[r] == 0 ? 0.0f : 1.0f / lv[r];
    p.lse[b * p.T + t0 + r] = lim[r] == 0 ? kNegInf : (mv[r] + std::log2(lv[r])) * kLn2;
  }
  float* out = p.out.data + OOff(p, b) + t0 * p.out.st;
  UnpackTransposed(ot, mqp, mq, Dv, inv, out, p.out.st, p.out.sd);
  for (int64_t r = 0; r < mq; ++r) {
    if (lim[r] != 0) continue;
    masked_row_output(p, b, t0 + r, tmp, z, kBlockK);
    for (int64_t e = 0; e < Dv; ++e)
      out[r * p.out.st + e * p.out.sd] = tmp[e];
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

// Every key block of an item reads all T rows of q and dO. Packed per query tile, that is T/64
// copies of both per item, and with head strides (rows E or 3E floats apart) one page per row
// each time; when they fit in 4 MiB per thread they are packed once per item instead (the same
// values, so the same results). Longer rows keep the O(tile) memory of the per-tile packing.
bool PackWholeRows(const FlashParams& p) {
  return p.T * (RoundUpLanes(p.D) + RoundUpLanes(p.Dv)) <= (int64_t{1} << 20);
}

size_t BackwardScratchFloats(const FlashParams& p) {
  const int64_t Dp = RoundUpLanes(p.D), Dvp = RoundUpLanes(p.Dv);
  return static_cast<size_t>(p.D * kBlockK + kBlockK * Dp + p.Dv * kBlockK + kBwdBlockQ * Dp +
                             kBwdBlockQ * Dvp + 3 * kBwdBlockQ * kBlockK + kBlockK * Dp +
                             kBlockK * Dvp + kBlockK + 3 * p.T +
                             (PackWholeRows(p) ? p.T * (Dp + Dvp) : 0));
}

// One work item: dK, dV of keys [sa, sb) of batch b, and their share of dQ (unscaled, summed
// into dq_part (T, ldq), ldq >= the padded D). next_b >= 0: the item this thread probably runs
// next, all keys of next_b (NextItemPrefetch).
void BackwardItem(const FlashParams& p, const FlashGrads& g, int64_t b, int64_t sa, int64_t sb,
                  float* dq_part, int64_t ldq, float* scratch, int64_t next_b) {
  const DF d;
  const int64_t T = p.T, D = p.D, Dv = p.Dv, Dp = RoundUpLanes(D), Dvp = RoundUpLanes(Dv);
  float* kt = scratch;                        // (D, kBlockK)      K^T of the tile (scores)
  float* kp = kt + D * kBlockK;               // (kBlockK, Dp)     K of the tile (dQ)
  float* vt = kp + kBlockK * Dp;              // (Dv, kBlockK)     V^T of the tile (dP)
  float* q_tile = vt + Dv * kBlockK;          // (kBwdBlockQ, Dp)     q * scale * log2 e
  float* do_tile = q_tile + kBwdBlockQ * Dp;  // (kBwdBlockQ, Dvp)    dO
  float* pb = do_tile + kBwdBlockQ * Dvp;     // (kBwdBlockQ, nkp)    P
  float* ds = pb + kBwdBlockQ * kBlockK;      // (kBwdBlockQ, nkp)    dP, then dS
  float* pz = ds + kBwdBlockQ * kBlockK;      // (kBwdBlockQ, nkp)    P * Z (dropout only)
  float* dk_acc = pz + kBwdBlockQ * kBlockK;  // (kBlockK, Dp)
  float* dv_acc = dk_acc + kBlockK * Dp;      // (kBlockK, Dvp)
  float* z = dv_acc + kBlockK * Dvp;          // (kBlockK)
  float* lse2 = z + kBlockK;                  // (T) lse in log2 units
  float* drow = lse2 + T;                     // (T) D_t = dO_t . out_t
  float* limf = drow + T;                     // (T) row limits (exact in float below 2^24 keys)
  const bool whole = PackWholeRows(p);
  float* q_all = whole ? limf + T : nullptr;         // (T, Dp)  all of q, scaled (PackWholeRows)
  float* do_all = whole ? q_all + T * Dp : nullptr;  // (T, Dvp) all of dO
  const bool dropout = p.dropout > 0.0f;
  const float c = p.scale * kLog2e;
  // Whether all of q and dO are finite, checked once per item when they are packed whole (the
  // common case: then no query tile needs its own check below).
  bool q_do_finite = false;
  if (whole) {
    PackRows(p.q.data + QOff(p, b), T, D, p.q.st, p.q.sd, c, q_all, Dp);
    PackRows(g.dout.data + HeadOffset(p, b, g.dout.sb, g.dout.sh), T, Dv, g.dout.st, g.dout.sd,
             1.0f, do_all, Dvp);
    q_do_finite = AllFinite(q_all, T, D, Dp, 1) && AllFinite(do_all, T, Dv, Dvp, 1);
  }

  bool any_masked = false;
  int64_t max_lim =
      0;  // keys >= max_lim are kept by no query: never read (they may be NaN padding)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lim = RowLimit(p, b, t);
    limf[t] = static_cast<float>(lim);
    any_masked |= lim == 0;
    max_lim = std::max(max_lim, lim);
    lse2[t] = p.lse[b * T + t] * kLog2e;
  }
  RowDots(p.out.data + OOff(p, b), p.out.st, p.out.sd,
          g.dout.data + HeadOffset(p, b, g.dout.sb, g.dout.sh), g.dout.st, g.dout.sd, T, Dv, drow);
  NextItemPrefetch next(p, g, next_b);
  // Prefetch steps: one per key block and 16 query rows as if none were skipped; the rest at the
  // end.
  const int64_t steps = (sb - sa + kBlockK - 1) / kBlockK * ((T + 15) / 16);
  int64_t step = 0;

  for (int64_t s0 = sa; s0 < sb; s0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, sb - s0), nkp = RoundUpLanes(nk);
    // Keys [s0, s0 + nkr) are kept by some query; the rest of the block only gets zeros (and the
    // masked-row term of dV below).
    const int64_t nkr = std::clamp<int64_t>(max_lim - s0, 0, nk);
    const int64_t nkrp = RoundUpLanes(nkr);
    PackTransposed(p.k.data + KOff(p, b) + s0 * p.k.st, nkr, D, p.k.st, p.k.sd, 1.0f, kt, nkp);
    PackRows(p.k.data + KOff(p, b) + s0 * p.k.st, nkr, D, p.k.st, p.k.sd, 1.0f, kp, Dp);
    PackTransposed(p.v.data + VOff(p, b) + s0 * p.v.st, nkr, Dv, p.v.st, p.v.sd, 1.0f, vt, nkp);
    std::memset(dk_acc, 0, sizeof(float) * nk * Dp);  // memset: GCC -O2 left std::fill scalar
    std::memset(dv_acc, 0, sizeof(float) * nk * Dvp);
    const bool k_finite = AllFinite(kp, nkr, D, Dp, 1);

    // Query tiles start at the next row that keeps a key of this block, so rows that see none
    // (causal: t < s0; a length mask: short rows) cost nothing. Tiles depend on the mask, never
    // on the thread count.
    const float s0f = static_cast<float>(s0);
    for (int64_t t0 = 0, mq = 0; nkr > 0 && t0 < T; t0 += mq) {
      while (t0 < T && limf[t0] <= s0f)
        ++t0;
      if (t0 == T) break;
      mq = std::min(kBwdBlockQ, T - t0);
      const float* qp = whole ? q_all + t0 * Dp : q_tile;      // (mq, Dp)  c Q of the tile
      const float* dop = whole ? do_all + t0 * Dvp : do_tile;  // (mq, Dvp) dO of the tile
      if (!whole) {
        PackRows(p.q.data + QOff(p, b) + t0 * p.q.st, mq, D, p.q.st, p.q.sd, c, q_tile, Dp);
        PackRows(g.dout.data + HeadOffset(p, b, g.dout.sb, g.dout.sh) + t0 * g.dout.st, mq, Dv,
                 g.dout.st, g.dout.sd, 1.0f, do_tile, Dvp);
      }
      // Columns [nkrp, nkp) (keys no query keeps) are neither computed nor read below.
      Gemm(mq, nkrp, D, qp, Dp, 1, kt, nkp, pb, nkp, false);     // x = (scale log2 e) Q K^T
      Gemm(mq, nkrp, Dv, dop, Dvp, 1, vt, nkp, ds, nkp, false);  // dO V^T

      for (int64_t r = 0; r < mq; ++r) {
        if (r % 16 == 0) next.Step(step++, steps);
        const int64_t t = t0 + r;
        float* prow = pb + r * nkp;
        float* drw = ds + r * nkp;
        float* pzrow = pz + r * nkp;
        const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(limf[t]) - s0, 0, nk);
        if (n == 0) {
          std::fill(prow, prow + nkrp, 0.0f);
          std::fill(drw, drw + nkrp, 0.0f);
          if (dropout) std::fill(pzrow, pzrow + nkrp, 0.0f);
          continue;
        }
        std::fill(prow + n, prow + nkrp, kNegInf);
        const VF vl = hn::Set(d, lse2[t]), vd = hn::Set(d, drow[t]);
        if (dropout) {
          if (p.dropout_keep != nullptr)
            DropoutRowKept(p, b, t, s0, n, z);
          else
            DropoutRow(p, p.dropout_index(b, t, s0), n, z);
          std::fill(z + n, z + nkrp, 0.0f);
        }
        for (int64_t k = 0; k < nkrp; k += kL) {
          const VF pv = Exp2(d, hn::Sub(hn::LoadU(d, prow + k), vl));  // P
          VF dp = hn::LoadU(d, drw + k);
          if (dropout) {
            const VF zv = hn::LoadU(d, z + k);
            hn::StoreU(hn::Mul(pv, zv), d, pzrow + k);
            dp = hn::Mul(dp, zv);
          }
          hn::StoreU(pv, d, prow + k);
          hn::StoreU(hn::Mul(pv, hn::Sub(dp, vd)), d, drw + k);  // dS = P (dP - D)
        }
        // Masked keys: dS = 0 exactly, even if their v made dP NaN (0 * NaN would not be 0).
        std::fill(drw + n, drw + nkrp, 0.0f);
      }
      const float* pzb = dropout ? pz : pb;
      // dV += (P Z)^T dO, dK += dS^T (c Q), dQ += dS K (A read transposed by its strides).
      // Tiles with non-finite inputs add only the kept terms (see AllFinite).
      if (q_do_finite || (AllFinite(qp, mq, D, Dp, 1) && AllFinite(dop, mq, Dv, Dvp, 1))) {
        Gemm(nkr, Dvp, mq, pzb, 1, nkp, dop, Dvp, dv_acc, Dvp, true);
        Gemm(nkr, Dp, mq, ds, 1, nkp, qp, Dp, dk_acc, Dp, true);
      } else {
        for (int64_t r = 0; r < mq; ++r)
          for (int64_t s = 0; s < std::clamp<int64_t>(int64_t(limf[t0 + r]) - s0, 0, nk); ++s) {
            for (int64_t e = 0; e < Dv; ++e)
              dv_acc[s * Dvp + e] += pzb[r * nkp + s] * dop[r * Dvp + e];
            for (int64_t e = 0; e < D; ++e)
              dk_acc[s * Dp + e] += ds[r * nkp + s] * qp[r * Dp + e];
          }
      }
      if (k_finite) {
        Gemm(mq, Dp, nkr, ds, nkp, 1, kp, Dp, dq_part + t0 * ldq, ldq, true);
      } else {
        for (int64_t r = 0; r < mq; ++r)
          for (int64_t s = 0; s < std::clamp<int64_t>(int64_t(limf[t0 + r]) - s0, 0, nk); ++s)
            for (int64_t e = 0; e < D; ++e)
              dq_part[(t0 + r) * ldq + e] += ds[r * nkp + s] * kp[s * Dp + e];
      }
    }

    // Rows without a kept key: their weights are the constant 1/S (d2l), so only dV sees them.
    if (any_masked && !p.zero_masked_rows()) {
      for (int64_t t = 0; t < T; ++t) {
        if (limf[t] != 0.0f) continue;
        if (dropout) {
          DropoutRow(p, p.dropout_index(b, t, s0), nk, z);
        } else {
          std::fill(z, z + nk, 1.0f);
        }
        const float* dout = g.dout.data + HeadOffset(p, b, g.dout.sb, g.dout.sh) + t * g.dout.st;
        for (int64_t s = 0; s < nk; ++s) {
          const float w = z[s] / static_cast<float>(p.S);
          for (int64_t k = 0; k < Dv; ++k)
            dv_acc[s * Dvp + k] += w * dout[k * g.dout.sd];
        }
      }
    }

    // dK = scale sum dS Q = ln 2 * sum dS (c Q), since c = scale log2 e.
    for (int64_t s = 0; s < nk; ++s) {
      float* dk = g.dk.data + HeadOffset(p, b, g.dk.sb, g.dk.sh) + (s0 + s) * g.dk.st;
      float* dv = g.dv.data + HeadOffset(p, b, g.dv.sb, g.dv.sh) + (s0 + s) * g.dv.st;
      StoreRow(dk_acc + s * Dp, D, kLn2, dk, g.dk.sd);
      StoreRow(dv_acc + s * Dvp, Dv, 1.0f, dv, g.dv.sd);
    }
  }
  next.Step(steps - 1, steps);
}

// dq rows [t0, t1) of batch b = scale * (0 + rows[t - t0]): the sums of the dQ shares
// (flash_backward_driver; the 0 + turns a -0 share into +0, as a sum of several shares does).
void WriteDq(const FlashParams& p, const FlashGrads& g, int64_t b, int64_t t0, int64_t t1,
             const float* rows, int64_t ld) {
  const DF d;
  const int64_t D = p.D;
  const VF vs = hn::Set(d, p.scale);
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = rows + (t - t0) * ld;
    float* dq = g.dq.data + HeadOffset(p, b, g.dq.sb, g.dq.sh) + t * g.dq.st;
    int64_t k = 0;
    if (g.dq.sd == 1) {
      for (; k + kL <= D; k += kL)
        hn::StoreU(hn::Mul(vs, hn::Add(hn::Zero(d), hn::LoadU(d, row + k))), d, dq + k);
    }
    for (; k < D; ++k)
      dq[k * g.dq.sd] = p.scale * (0.0f + row[k]);
  }
}

}  // namespace attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

// ---------------------------------------------------------------------------------------------
// Dispatch and threads (compiled once)

#if HWY_ONCE
#include "kernels/cpu/target_scope.hpp"

#include <vector>

namespace attn::cpu {

HWY_EXPORT(QueryBlockRows);
HWY_EXPORT(TargetName);
HWY_EXPORT(ForwardScratchFloats);
HWY_EXPORT(ForwardBlock);
HWY_EXPORT(BackwardScratchFloats);
HWY_EXPORT(BackwardItem);
HWY_EXPORT(WriteDq);
HWY_EXPORT(KeepsDropout);

bool flash_attention_keeps_dropout(const FlashParams& p) {
  const TargetScope targets(p.simd_targets);
  return HWY_DYNAMIC_DISPATCH(KeepsDropout)(p);
}

int64_t flash_dropout_keep_words(const FlashParams& p) {
  return p.B * ((p.T + 15) / 16) * p.S;
}

const char* flash_attention_target() {
  return HWY_DYNAMIC_DISPATCH(TargetName)();
}

const char* flash_attention_target_name(int64_t target) {
  return hwy::TargetName(target);
}

std::vector<int64_t> flash_attention_targets() {
  return hwy::SupportedAndGeneratedTargets();
}

void flash_attention_forward(const FlashParams& p) {
  if (p.B == 0 || p.T == 0) return;
  const TargetScope targets(p.simd_targets);
  auto* block_fn = HWY_DYNAMIC_DISPATCH(ForwardBlock);
  flash_forward_driver(
      p, "flash_attention_forward", HWY_DYNAMIC_DISPATCH(QueryBlockRows)(),
      HWY_DYNAMIC_DISPATCH(ForwardScratchFloats)(p), NoPrepare{},
      [&](float* scratch, int64_t b, int64_t t0, int64_t rows, int64_t next_b, int64_t next_t0) {
        block_fn(p, b, t0, rows, scratch, next_b, next_t0);
      });
}

void flash_attention_backward(const FlashParams& p, const FlashGrads& g) {
  if (p.B == 0) return;
  const TargetScope targets(p.simd_targets);
  const int64_t Dp = (p.D + 15) / 16 * 16;  // >= every target's padded D; dQ share row stride
  auto* item_fn = HWY_DYNAMIC_DISPATCH(BackwardItem);
  auto* write_dq_fn = HWY_DYNAMIC_DISPATCH(WriteDq);
  flash_backward_driver(
      p, "flash_attention_backward", Dp,
      HWY_DYNAMIC_DISPATCH(BackwardScratchFloats)(p) * sizeof(float), /*zero_scratch=*/false,
      [](std::byte* scratch) { return reinterpret_cast<float*>(scratch); },
      [&](float* scratch, int64_t b, int64_t sa, int64_t sb, float* part, int64_t next_b) {
        item_fn(p, g, b, sa, sb, part, Dp, scratch, next_b);
      },
      [&](int64_t b, int64_t t0, int64_t t1, const float* rows, int64_t ld) {
        write_dq_fn(p, g, b, t0, t1, rows, ld);
      });
}

}  // namespace attn::cpu
#endif  // HWY_ONCE
