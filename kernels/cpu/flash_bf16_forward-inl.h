// Native bf16 attention, forward (AVX512-BF16): the micro-kernel, K and V packed once per call,
// ForwardBlock (one block of queries through all key tiles with the online softmax) and the
// threaded driver ForwardNative. Design: the comment at the top of flash_bf16.cpp.
// Part of kernels/cpu/flash_bf16.cpp, included once by it inside its anonymous namespace and
// its AVX-512 + BF16 target region (not a standalone header: it uses that file's includes,
// FlashBf16Params helpers and constants). Contract: kernels/cpu/flash_bf16.hpp.
// IWYU pragma: private, include "kernels/cpu/flash_bf16.cpp"

constexpr int64_t kBlockK = 64;       // keys per tile (32 pairs)
constexpr int64_t kBlockQ = 12 * kL;  // queries per work item
constexpr int kMR = 8, kNV = 3;       // micro-tile: 8 rows x 3 vectors = 24 accumulators

// Dropout multipliers of one row of a key tile (n <= 64; flash_bf16_backward-inl.h).
void DropoutRowAny(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z);

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
__attribute__((noinline)) void MicroTile(int64_t K2, const uint32_t* a, int64_t lda, int rows,
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
__attribute__((noinline)) void GemmBf16(int64_t M, int64_t N, int64_t K2, const uint32_t* a,
                                        int64_t lda, const uint32_t* b, int64_t ldb, float* c,
                                        int64_t ldc, const float* alpha, float out_mul,
                                        float* colmax) {
  int64_t j0 = 0;
  for (; j0 + kNV * kL <= N; j0 += kNV * kL)
    for (int64_t i0 = 0; i0 < M; i0 += kMR)
      MicroTile<kMR, kNV>(K2, a + i0, lda, static_cast<int>(std::min<int64_t>(kMR, M - i0)), b + j0,
                          ldb, c + i0 * ldc + j0, ldc, alpha ? alpha + j0 : nullptr, out_mul,
                          colmax ? colmax + j0 : nullptr);
  for (; j0 < N; j0 += kL)
    for (int64_t i0 = 0; i0 < M; i0 += kMR)
      MicroTile<kMR, 1>(K2, a + i0, lda, static_cast<int>(std::min<int64_t>(kMR, M - i0)), b + j0,
                        ldb, c + i0 * ldc + j0, ldc, alpha ? alpha + j0 : nullptr, out_mul,
                        colmax ? colmax + j0 : nullptr);
}

// 2^x as Exp2Bf16 but accurate to fp32 (degree-6 Taylor series, truncation (ln2/2)^7/7! = 1.3e-7)
// and exact at x = 0: for the rescale factor 2^(m_old - m_new) of the running sum and output,
// which compounds over the key tiles (a bias of Exp2Bf16's 7.5e-5 per tile would reach 5e-3 in
// lse after 64 tiles).
inline __m512 Exp2Accurate(__m512 x) {
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

// X^T *= Z^T on the weight tile (nk keys x query lanes [c0, mqp)), keys from s0, vectorized
// across queries. Needs every query's run of keys to start on a Philox block
// (AttentionProblem::dropout_rows_aligned: S % 4 == 0 and base + s0 a multiple of 4, or the
// dropout window's Sg and s0): then query t's run starts at stream index i_t =
// dropout_index(b, t, s0), a multiple of 4, so key s0 + 4g + j of every lane is word j of Philox
// block i_t/4 + g: one 16-lane Philox per 4 keys of
// 16 queries (the scalar draw costs one call per 4 keys per query). Returns false (nothing done)
// otherwise. Masked keys hold weight 0 and stay 0.
bool DropoutTile(const FlashBf16Params& p, int64_t b, int64_t t0, int64_t s0, int64_t nk,
                 int64_t c0, int64_t mqp, float* xt) {
  if (!p.dropout_rows_aligned(s0)) return false;
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const __m512 vkeep = _mm512_set1_ps(keep_scale);
  // kept iff (r >> 8) 2^-24 >= p, exactly as attn::dropout_keep computes it in float: for p in
  // (0, 1] that is r > 256 ceil(p 2^24) - 1, one unsigned compare (KeepBound in
  // flash_kernels-inl.h; p = 1 gives 2^32 - 1: nothing kept).
  const double ceil_p =
      std::clamp(std::ceil(static_cast<double>(p.dropout) * 16777216.0), 1.0, 16777216.0);
  const __m512i bound = _mm512_set1_epi32(
      static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(ceil_p) * 256 - 1)));
  const __m512i off_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset)));
  const __m512i off_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(p.offset >> 32)));
  alignas(64) uint32_t lo_w[kL], hi_w[kL];
  for (int64_t q = c0; q < mqp; q += kL) {
    for (int64_t l = 0; l < kL; ++l) {
      const uint64_t blk = p.dropout_index(b, t0 + q + l, s0) >> 2;
      lo_w[l] = static_cast<uint32_t>(blk);
      hi_w[l] = static_cast<uint32_t>(blk >> 32);
    }
    const __m512i lo = _mm512_load_si512(lo_w), hi = _mm512_load_si512(hi_w);
    // The decisions of queries t0 + q .. + 15 (t0 and q are multiples of 16) for the backward.
    uint16_t* keep_words =
        p.dropout_keep != nullptr
            ? p.dropout_keep + (b * ((p.T + kL - 1) / kL) + (t0 + q) / kL) * p.S + s0
            : nullptr;
    // Keys 4g + j, j < 4, from word j of block g: two blocks (g, g + 1) drawn at once (two
    // dependency chains in flight; a block past the last group is drawn and not used).
    for (int64_t g = 0; 4 * g < nk; g += 2) {
      __m512i c[2][4];
      for (int n = 0; n < 2; ++n) {
        c[n][0] = _mm512_add_epi32(lo, _mm512_set1_epi32(static_cast<int>(g + n)));
        const __mmask16 carry = _mm512_cmplt_epu32_mask(c[n][0], lo);
        c[n][1] = _mm512_mask_add_epi32(hi, carry, hi, _mm512_set1_epi32(1));
        c[n][2] = off_lo;
        c[n][3] = off_hi;
      }
      Philox16x2(c, p.seed);
      for (int64_t j = 0; j < 8 && 4 * g + j < nk; ++j) {
        const __mmask16 kept = _mm512_cmpgt_epu32_mask(c[j / 4][j % 4], bound);
        if (keep_words != nullptr) keep_words[4 * g + j] = static_cast<uint16_t>(kept);
        float* row = xt + (4 * g + j) * mqp + q;
        // A multiply by 0, not a zeroing: a NaN weight stays NaN, as in the scalar path.
        _mm512_storeu_ps(row,
                         _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_maskz_mov_ps(kept, vkeep)));
      }
    }
  }
  return true;
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

void PackBatch(const FlashBf16Params& p, Packed& pk, int64_t b) {
  const int64_t S = p.S, Dv = p.Dv, S2 = pk.S2;
  uint32_t* vt = pk.vt2 + b * S2 * Dv;
  const uint16_t* vb = p.v.data + p.row_offset(b, p.v.sb, p.v.sh);
  uint8_t bad[kBlockK];
  for (int64_t tile = 0; tile < pk.tiles; ++tile) {
    const int64_t s0 = tile * kBlockK, n = std::min(kBlockK, S - s0);
    std::fill(bad, bad + n, uint8_t{0});
    PackPairsRows(vb + s0 * p.v.st, n, Dv, p.v.st, p.v.sd, vt + s0 / 2 * Dv, Dv, bad);
    pk.v_finite[b * pk.tiles + tile] = std::none_of(bad, bad + n, [](uint8_t x) { return x != 0; });
  }
  uint32_t* kt = pk.kt2 + b * pk.D2 * pk.ldk;
  // (A first version wrote key by key, one word per 4 KiB row at S = 1024: 17% of the forward.)
  PackPairsTransposed(p.k.data + p.row_offset(b, p.k.sb, p.k.sh), S, p.D, p.k.st, p.k.sd, kt,
                      pk.ldk);
}

size_t ForwardScratchFloats(const FlashBf16Params& p, const Packed& pk) {
  return static_cast<size_t>(pk.D2 * kBlockQ + kBlockK * kBlockQ + kBlockK / 2 * kBlockQ +
                             p.Dv * kBlockQ + 5 * kBlockQ + kBlockK + p.Dv + kL);
}

// One work item: queries [t0, t0 + rows) of batch row b, rows <= kBlockQ (the fp32 ForwardBlock's
// structure). (next_b, next_t0): the item this thread will probably run next (next_b < 0: none). At
// short sequences (ShortRows) its q rows and packed K and V, and this item's out rows, are
// prefetched into L2 over the item's steps, as in the fp32 forward: an item lasts microseconds
// there, and the packed K and V of all batch rows (written before the items) are no longer in L2.
void ForwardBlock(const FlashBf16Params& p, const Packed& pk, int64_t b, int64_t t0, int64_t rows,
                  float* scratch, int64_t next_b = -1, int64_t next_t0 = 0) {
  const int64_t D = p.D, Dv = p.Dv, D2 = pk.D2;
  const int64_t mq = std::min(rows, p.T - t0), mqp = (mq + kL - 1) / kL * kL;
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
  const int64_t max_lim = block_row_limits(p, b, t0, mq, mqp, lim, limv);
  PackPairsTransposed(p.q.data + p.row_offset(b, p.q.sb, p.q.sh) + t0 * p.q.st, mq, D, p.q.st,
                      p.q.sd, qt2, mqp);
  for (int64_t j = 0; j < D2; ++j)
    std::fill(qt2 + j * mqp + mq, qt2 + (j + 1) * mqp, 0u);
  std::fill(ot, ot + Dv * mqp, 0.0f);
  std::fill(mv, mv + mqp, kNegInf);
  std::fill(lv, lv + mqp, 0.0f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);

  const uint32_t* kt2 = pk.kt2 + b * D2 * pk.ldk;
  const uint32_t* vt2 = pk.vt2 + b * pk.S2 * Dv;
  const bool short_rows = ShortRows(p) && next_b >= 0;
  const bool next_kv = short_rows && next_b != b;
  constexpr auto kWhole = RowPrefetch::Mode::kWholeItem;
  RowPrefetch pf[4];
  if (short_rows) {
    const int64_t next_mq = std::min(rows, p.T - next_t0);
    pf[0] = RowPrefetch(p.q.data + p.row_offset(next_b, p.q.sb, p.q.sh) + next_t0 * p.q.st, next_mq,
                        D, p.q.st, kWhole);
    pf[1] = RowPrefetch(p.out.data + p.row_offset(b, p.out.sb, p.out.sh) + t0 * p.out.st, mq, Dv,
                        p.out.st, kWhole);
  }
  if (next_kv) {
    pf[2] = RowPrefetch(pk.kt2 + next_b * D2 * pk.ldk, 1, D2 * pk.ldk, D2 * pk.ldk, kWhole);
    pf[3] = RowPrefetch(pk.vt2 + next_b * pk.S2 * Dv, 1, pk.S2 * Dv, pk.S2 * Dv, kWhole);
  }
  // Prefetch steps: one per key tile and 16 queries.
  const int64_t steps = (max_lim + kBlockK - 1) / kBlockK * (mqp / kL);
  int64_t step = 0;

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
    GemmBf16(nk, ncol, D2, kt2 + s0, pk.ldk, qt2 + c0, mqp, xt + c0, mqp, nullptr, c, tmax + c0);
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
      if (short_rows)
        for (RowPrefetch& r : pf)
          r.Step(step, steps);
      ++step;
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
        const __m512 e0 = Exp2Bf16(_mm512_sub_ps(_mm512_loadu_ps(x0), m_use));
        const __m512 e1 = 2 * j + 1 < nk ? Exp2Bf16(_mm512_sub_ps(_mm512_loadu_ps(x0 + mqp), m_use))
                                         : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        if (dropout) {
          _mm512_storeu_ps(x0, e0);
          if (2 * j + 1 < nk) _mm512_storeu_ps(x0 + mqp, e1);
        } else {
          _mm512_storeu_si512(pt2 + j * mqp + q, PairBf16(e0, e1));
        }
      }
      const __m512 a = Exp2Accurate(_mm512_sub_ps(m_old, m_use));  // 0 on a first kept tile
      _mm512_storeu_ps(lv + q, _mm512_fmadd_ps(_mm512_loadu_ps(lv + q), a, sum));
      _mm512_storeu_ps(mv + q, m_new);
      _mm512_storeu_ps(alpha + q, a);
    }
    // Dropout: numerator weights only (it acts after the normalization).
    if (dropout && !DropoutTile(p, b, t0, s0, nk, c0, mqp, xt)) {
      for (int64_t r = r_first; r < mq; ++r) {
        const int64_t n = std::clamp<int64_t>(lim[r] - s0, 0, nk);
        DropoutRowAny(p, p.dropout_index(b, t0 + r, s0), n, z);
        for (int64_t s = 0; s < n; ++s)
          xt[s * mqp + r] *= z[s];
      }
    }
    if (dropout) {
      for (int64_t q = c0; q < mqp; q += kL)
        for (int64_t j = 0; j < nk2; ++j) {
          const float* x0 = xt + 2 * j * mqp + q;
          const __m512 e1 = 2 * j + 1 < nk ? _mm512_loadu_ps(x0 + mqp) : _mm512_setzero_ps();
          _mm512_storeu_si512(pt2 + j * mqp + q, PairBf16(_mm512_loadu_ps(x0), e1));
        }
    }

    // O^T = alpha O^T + V^T P^T: (Dv, ncol). A pair's second key past nk has weight 0, so it is
    // harmless unless its v is not finite (0 * Inf): such tiles, like partly masked tiles with
    // non-finite v, add only the kept terms.
    const bool clean = min_lim >= s0 + nk && (nk % 2 == 0 || s0 + nk == p.S);
    if (clean || pk.v_finite[b * pk.tiles + s0 / kBlockK]) {
      GemmBf16(Dv, ncol, nk2, vt2 + s0 / 2 * Dv, Dv, pt2 + c0, mqp, ot + c0, mqp, alpha + c0, 1.0f,
               nullptr);
    } else {
      for (int64_t e = 0; e < Dv; ++e)
        for (int64_t q = c0; q < mqp; ++q)
          ot[e * mqp + q] *= alpha[q];
      for (int64_t r = r_first; r < mq; ++r)
        for (int64_t s = 0; s < std::min(nk, lim[r] - s0); ++s) {
          const uint32_t w = pt2[s / 2 * mqp + r];
          const float pw = bf16_to_float(static_cast<uint16_t>(s % 2 == 0 ? w : w >> 16));
          const uint16_t* vs = p.v.data + p.row_offset(b, p.v.sb, p.v.sh) + (s0 + s) * p.v.st;
          for (int64_t e = 0; e < Dv; ++e)
            ot[e * mqp + r] += pw * bf16_to_float(vs[e * p.v.sd]);
        }
    }
  }

  // out = O^T / l, transposed back 16 queries at a time (vcvtneps2bf16 rounds to nearest even).
  for (int64_t r = 0; r < mqp; ++r)
    alpha[r] = r < mq && lim[r] > 0 ? 1.0f / lv[r] : 0.0f;
  uint16_t* const out_b = p.out.data + p.row_offset(b, p.out.sb, p.out.sh);
  if (p.out.sd == 1) {
    // Unit feature stride: 16 x 16 blocks of O^T / l through transpose16x16_epi32, each query's
    // 16 features rounded and stored at once (the element-wise stores below, 2 bytes per query
    // row each, were ~12% of the item at T = 128, D = 32). The same products and roundings.
    for (int64_t q = 0; q < mq; q += kL) {
      const __m512 va = _mm512_loadu_ps(alpha + q);
      for (int64_t e0 = 0; e0 < Dv; e0 += kL) {
        const int64_t ne = std::min(kL, Dv - e0);
        __m512i r[kL];
        for (int64_t i = 0; i < kL; ++i)
          r[i] =
              i < ne
                  ? _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(ot + (e0 + i) * mqp + q), va))
                  : _mm512_setzero_si512();
        transpose16x16_epi32(r);  // r[l]: features e0 .. e0 + 15 of query q + l
        const __mmask16 m = ne >= kL ? __mmask16(0xffff) : __mmask16((1u << ne) - 1);
        for (int64_t l = 0; l < std::min(kL, mq - q); ++l)
          _mm256_mask_storeu_epi16(out_b + (t0 + q + l) * p.out.st + e0, m,
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[l])));
      }
    }
  }
  alignas(32) uint16_t o16[kL];
  for (int64_t e = 0; p.out.sd != 1 && e < Dv; ++e)
    for (int64_t q = 0; q < mq; q += kL) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(ot + e * mqp + q), _mm512_loadu_ps(alpha + q));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o16), (__m256i)_mm512_cvtneps_pbh(x));
      uint16_t* o =
          p.out.data + p.row_offset(b, p.out.sb, p.out.sh) + (t0 + q) * p.out.st + e * p.out.sd;
      for (int64_t l = 0; l < std::min(kL, mq - q); ++l)
        o[l * p.out.st] = o16[l];
    }
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t t = t0 + r;
    if (lim[r] == 0) {
      uint16_t* orow = p.out.data + p.row_offset(b, p.out.sb, p.out.sh) + t * p.out.st;
      masked_row_output(p, b, t, tmp, z, kBlockK);
      p.lse[b * p.T + t] = kNegInf;
      for (int64_t e = 0; e < Dv; ++e)
        orow[e * p.out.sd] = float_to_bf16(tmp[e]);
    } else {
      p.lse[b * p.T + t] = (mv[r] + std::log2(lv[r])) * kLn2;
    }
  }
}

void ForwardNative(const FlashBf16Params& p) {
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
  // Each batch row's K and V are packed as pairs before any item (the driver's `prepare`).
  flash_forward_driver(
      p, "flash_attention_bf16", kBlockQ, ForwardScratchFloats(p, pk),
      [&](int64_t b) { PackBatch(p, pk, b); },
      [&](float* scratch, int64_t b, int64_t t0, int64_t rows, int64_t next_b, int64_t next_t0) {
        ForwardBlock(p, pk, b, t0, rows, scratch, next_b, next_t0);
      });
}
