// Native bf16 attention, backward (AVX512-BF16): BackwardItem (one batch row's key range, all
// query tiles) and the threaded driver BackwardNative with its dQ shares.
// Part of kernels/cpu/flash_bf16.cpp, included once by it inside its anonymous namespace and
// its AVX-512 + BF16 target region (not a standalone header: it uses that file's includes,
// FlashBf16Params helpers and constants). Contract: kernels/cpu/flash_bf16.hpp.
// IWYU pragma: private, include "kernels/cpu/flash_bf16.cpp"

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
//                                 (two rows of the tile interleaved: PairBf16)
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
void BackwardGemm(int64_t M, int64_t N, int64_t K2, const uint32_t* a, int64_t lda,
                  const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                  float out_mul) {
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
// DropoutTile vectorizes across queries instead: its tile is transposed.)
void DropoutRow64(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z) {
  if ((i0 & 3) != 0) {
    DropoutMultipliers(p, i0, n, z);
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
  Philox16(c, p.seed);
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

// DropoutRow64 for any i0 (n <= 64): the Philox blocks from the one holding element i0 are drawn
// whole, as DropoutRow64 draws aligned rows, and the row is cut out of them. Padded batches have
// lengths that are not multiples of 4, so most rows start inside a block; the scalar draw per
// element cost more than the rest of the attention there.
void DropoutRowAny(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z) {
  const int64_t off = static_cast<int64_t>(i0 & 3);
  if (off == 0) {
    DropoutRow64(p, i0, n, z);  // stores 64 values: z must have room (every caller's z does)
    return;
  }
  alignas(64) float tmp[128];
  DropoutRow64(p, i0 - off, std::min<int64_t>(64, off + n), tmp);
  if (off + n > 64) DropoutRow64(p, i0 - off + 64, off + n - 64, tmp + 64);
  std::copy(tmp + off, tmp + off + n, z);
}

// The same multipliers z[0..n) of row t, keys s0 .. s0 + n - 1 (n <= 64), from the forward's
// recorded decisions (FlashBf16Params::dropout_keep): bit t % 16 of each key's word.
void DropoutRowKept(const FlashBf16Params& p, int64_t b, int64_t t, int64_t s0, int64_t n,
                    float* z) {
  const float keep_scale = p.dropout < 1.0f ? 1.0f / (1.0f - p.dropout) : 0.0f;
  const uint16_t* words = p.dropout_keep + (b * ((p.T + kL - 1) / kL) + t / kL) * p.S + s0;
  const __m256i bit = _mm256_set1_epi16(static_cast<short>(1u << (t % kL)));
  for (int64_t c = 0; c < n; c += kL) {
    const __mmask16 m = n - c >= kL ? __mmask16(0xffff) : __mmask16((1u << (n - c)) - 1);
    const __mmask16 kept =
        _mm256_mask_test_epi16_mask(m, _mm256_maskz_loadu_epi16(m, words + c), bit);
    _mm512_storeu_ps(z + c, _mm512_maskz_mov_ps(kept, _mm512_set1_ps(keep_scale)));
  }
}

// min(n, 16) bf16 x[c * stride] as fp32 lanes (zeros past n).
inline __m512 LoadBf16(const uint16_t* x, int64_t n, int64_t stride) {
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
inline void StoreBf16Row(const float* x, int64_t n, float mul, uint16_t* dst, int64_t stride) {
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

// Rows s0 + s (s < nk) of dst (row stride st, feature stride sd) = bf16(mul * column s of acc),
// acc (n x kBwdK fp32, row j = feature j): dK and dV of a key block, accumulated transposed.
// With unit feature stride, 16 x 16 blocks go through transpose16x16_epi32 and each row is
// rounded and stored 16 features at a time; otherwise each feature row is rounded into out16 and
// copied element by element. The same products and roundings (vcvtneps2bf16) either way.
void StoreKeyRowsBf16(const float* acc, int64_t n, int64_t nk, float mul, uint16_t* dst, int64_t st,
                      int64_t sd, uint16_t* out16) {
  if (sd != 1) {
    for (int64_t j = 0; j < n; ++j)
      StoreBf16Row(acc + j * kBwdK, nk, mul, out16 + j * kBwdK, 1);
    for (int64_t s = 0; s < nk; ++s)
      for (int64_t j = 0; j < n; ++j)
        dst[s * st + j * sd] = out16[j * kBwdK + s];
    return;
  }
  const __m512 vm = _mm512_set1_ps(mul);
  for (int64_t s = 0; s < nk; s += kL) {
    for (int64_t j0 = 0; j0 < n; j0 += kL) {
      const int64_t nj = std::min(kL, n - j0);
      __m512i r[kL];
      for (int64_t i = 0; i < kL; ++i)
        r[i] = i < nj ? _mm512_loadu_si512(acc + (j0 + i) * kBwdK + s) : _mm512_setzero_si512();
      transpose16x16_epi32(r);  // r[i]: features j0 .. j0 + 15 of key s + i
      const __mmask16 m = nj >= kL ? __mmask16(0xffff) : __mmask16((1u << nj) - 1);
      for (int64_t i = 0; i < std::min(kL, nk - s); ++i)
        _mm256_mask_storeu_epi16(
            dst + (s + i) * st + j0, m,
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_castsi512_ps(r[i]), vm)));
    }
  }
}

// Whole-row packing (q and dO packed once per item) when it takes at most 8 MiB per thread;
// longer rows are packed per query tile (O(tile) memory, 4 packs per tile and key block).
bool BackwardWholeRows(const FlashBf16Params& p) {
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
  float *dk_acc, *dv_acc, *z;         // fp32 dK^T, dV^T, dropout
  float *lse2, *drow;                 // (T) lse log2 e, D_t
  int64_t* lim;                       // (T) row limits
  uint16_t* out16;                    // dK or dV of a key block rounded to bf16
  uint8_t* bad;                       // (rows) q or dO row not finite

  // The buffers carved from `base`, Bytes(p) bytes, 64-byte aligned.
  BwdBuffers(const FlashBf16Params& p, std::byte* base) { Layout(p, base); }
  static size_t Bytes(const FlashBf16Params& p) {
    BwdBuffers sizes;
    return sizes.Layout(p, nullptr);
  }

 private:
  BwdBuffers() = default;
  // Points every buffer into base (nullptr: only counts) and returns the bytes used.
  size_t Layout(const FlashBf16Params& p, std::byte* base) {
    const int64_t D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
    rows = BackwardWholeRows(p) ? p.T : std::min(p.T, kBwdQ);
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
    carve(lse2, p.T);
    carve(drow, p.T);
    carve(lim, p.T);
    carve(bad, rows);
    return used;
  }
};

// Rows [ta, tb) of q and dO of batch row b into w's four layouts (row ta at index 0).
void PackQueryRows(const FlashBf16Params& p, const FlashBf16Grads& g, int64_t b, int64_t ta,
                   int64_t tb, BwdBuffers& w) {
  const int64_t n = tb - ta, D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
  const uint16_t* q = p.q.data + p.row_offset(b, p.q.sb, p.q.sh) + ta * p.q.st;
  const uint16_t* dout = g.dout.data + p.row_offset(b, g.dout.sb, g.dout.sh) + ta * g.dout.st;
  PackPairsTransposed(q, n, p.D, p.q.st, p.q.sd, w.qt2, w.ldq);
  PackPairsTransposed(dout, n, p.Dv, g.dout.st, g.dout.sd, w.dot2, w.ldq);
  for (int64_t j = 0; j < D2; ++j)
    std::fill(w.qt2 + j * w.ldq + n, w.qt2 + (j + 1) * w.ldq, 0u);
  for (int64_t j = 0; j < Dv2; ++j)
    std::fill(w.dot2 + j * w.ldq + n, w.dot2 + (j + 1) * w.ldq, 0u);
  std::fill(w.bad, w.bad + n, uint8_t{0});
  PackPairsRows(q, n, p.D, p.q.st, p.q.sd, w.qp2, p.D, w.bad);
  PackPairsRows(dout, n, p.Dv, g.dout.st, g.dout.sd, w.dop2, p.Dv, w.bad);
}

// One work item: dK, dV of keys [sa, sb) of batch row b, and their share of dQ (unscaled,
// added into dq_part (T, w.Dp)). next_b >= 0: the item this thread probably runs next, all keys
// of next_b, whose rows are prefetched into L2 over this item (NextItemPrefetch, as the fp32
// backward).
void BackwardItem(const FlashBf16Params& p, const FlashBf16Grads& g, int64_t b, int64_t sa,
                  int64_t sb, float* dq_part, BwdBuffers& w, int64_t next_b = -1) {
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
    const int64_t lim = RowLimit(p, b, t);
    w.lim[t] = lim;
    any_masked |= lim == 0;
    max_lim = std::max(max_lim, lim);
    w.lse2[t] = p.lse[b * T + t] * kLog2e;
    const uint16_t* o = p.out.data + p.row_offset(b, p.out.sb, p.out.sh) + t * p.out.st;
    const uint16_t* dout = g.dout.data + p.row_offset(b, g.dout.sb, g.dout.sh) + t * g.dout.st;
    // D_t = dO_t . out_t in fp32, 16 lanes then a fixed reduction: error <= ~(Dv/16 + 4) 2^-24
    // sum |dO| |out|, far below the error of out itself (its bf16 rounding, 2^-8 |out|).
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < Dv; e += kL)
      acc = _mm512_fmadd_ps(LoadBf16(o + e * p.out.sd, Dv - e, p.out.sd),
                            LoadBf16(dout + e * g.dout.sd, Dv - e, g.dout.sd), acc);
    w.drow[t] = _mm512_reduce_add_ps(acc);
  }
  if (whole) PackQueryRows(p, g, b, 0, T, w);
  NextItemPrefetch next(p, g, next_b);
  // Prefetch steps: one per key block and 16 query rows as if none were skipped; the rest at the
  // end.
  const int64_t steps = (sb - sa + kBwdK - 1) / kBwdK * ((T + 15) / 16);
  int64_t step = 0;

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
      const uint16_t* kb = p.k.data + p.row_offset(b, p.k.sb, p.k.sh) + s0 * p.k.st;
      std::fill(w.kt2, w.kt2 + D2 * kBwdK, 0u);
      std::fill(w.vt2, w.vt2 + Dv2 * kBwdK, 0u);
      PackPairsTransposed(kb, nkr, D, p.k.st, p.k.sd, w.kt2, kBwdK);
      PackPairsTransposed(p.v.data + p.row_offset(b, p.v.sb, p.v.sh) + s0 * p.v.st, nkr, Dv, p.v.st,
                          p.v.sd, w.vt2, kBwdK);
      uint8_t kbad[kBwdK] = {};
      PackPairsRows(kb, nkr, D, p.k.st, p.k.sd, w.kp2, Dp, kbad);
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
        PackQueryRows(p, g, b, t0, t0 + mq, w);
        ta = t0;
      }
      const uint32_t* qt2 = w.qt2 + (t0 - ta);
      const uint32_t* dot2 = w.dot2 + (t0 - ta);
      const uint32_t* qp2 = w.qp2 + (t0 - ta) / 2 * D;
      const uint32_t* dop2 = w.dop2 + (t0 - ta) / 2 * Dv;
      bool q_finite = true;
      for (int64_t r = 0; r < mq; ++r)
        q_finite &= w.bad[t0 - ta + r] == 0;

      BackwardGemm<1>(mq, nkrp, D2, qt2, w.ldq, w.kt2, kBwdK, x, kBwdK, false, c);  // c Q K^T
      BackwardGemm<1>(mq, nkrp, Dv2, dot2, w.ldq, w.vt2, kBwdK, dpt, kBwdK, false, 1.0f);

      // P = 2^(X - lse2), P Z, dS = P (dP Z - D_t) for two rows and 32 keys at a time, in
      // registers; masked keys get exact zeros (a select, so even a NaN score or dP of a masked
      // key gives 0). Out go only the bf16 roundings: pz2, ds2 (pairs along t) and dsr (pairs
      // along s).
      for (int64_t r = 0; r < mq; r += 2) {
        if (r % 16 == 0) next.Step(step++, steps);
        int64_t n[2];
        __m512 l2[2], dd[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t rr = r + h, t = t0 + rr;
          n[h] = rr < mq ? std::clamp<int64_t>(w.lim[t] - s0, 0, nkr) : 0;
          l2[h] = _mm512_set1_ps(rr < mq ? w.lse2[t] : 0.0f);
          dd[h] = _mm512_set1_ps(rr < mq ? w.drow[t] : 0.0f);
          if (dropout && n[h] > 0) {
            if (p.dropout_keep != nullptr) {
              DropoutRowKept(p, b, t, s0, n[h], w.z + h * kBwdK);
            } else {
              DropoutRowAny(p, p.dropout_index(b, t, s0), n[h], w.z + h * kBwdK);
            }
          }
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
              const __m512 pv = Exp2Bf16(_mm512_sub_ps(_mm512_loadu_ps(x + off), l2[h]));
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
              _mm512_storeu_si512(pz2 + r / 2 * kBwdK + v * kL, PairBf16(pz[0], pz[1]));
              _mm512_storeu_si512(ds2 + r / 2 * kBwdK + v * kL, PairBf16(ds[0][u], ds[1][u]));
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
        BackwardGemm<1>(Dv, nkrp, mq2, dop2, Dv, pz2, kBwdK, dv_acc, kBwdK, true, 1.0f);
        BackwardGemm<1>(D, nkrp, mq2, qp2, D, ds2, kBwdK, dk_acc, kBwdK, true, 1.0f);
      } else {
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t t = t0 + r, n = std::clamp<int64_t>(w.lim[t] - s0, 0, nkr);
          const uint16_t* qr = p.q.data + p.row_offset(b, p.q.sb, p.q.sh) + t * p.q.st;
          const uint16_t* dor = g.dout.data + p.row_offset(b, g.dout.sb, g.dout.sh) + t * g.dout.st;
          for (int64_t s = 0; s < n; ++s) {
            for (int64_t e = 0; e < Dv; ++e)
              dv_acc[e * kBwdK + s] += half(pz2, r, s) * bf16_to_float(dor[e * g.dout.sd]);
            for (int64_t d = 0; d < D; ++d)
              dk_acc[d * kBwdK + s] += half(ds2, r, s) * bf16_to_float(qr[d * p.q.sd]);
          }
        }
      }
      if (k_finite) {
        BackwardGemm<kBwdK2>(mq, Dp, nkr2, dsr, 1, w.kp2, Dp, dq_part + t0 * Dp, Dp, true, 1.0f);
      } else {
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t t = t0 + r, n = std::clamp<int64_t>(w.lim[t] - s0, 0, nkr);
          for (int64_t s = 0; s < n; ++s) {
            const uint16_t* kr = p.k.data + p.row_offset(b, p.k.sb, p.k.sh) + (s0 + s) * p.k.st;
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
          DropoutRowAny(p, p.dropout_index(b, t, s0), nk, z);
        } else {
          std::fill(z, z + nk, 1.0f);
        }
        const uint16_t* dor = g.dout.data + p.row_offset(b, g.dout.sb, g.dout.sh) + t * g.dout.st;
        for (int64_t e = 0; e < Dv; ++e) {
          const float go = bf16_to_float(dor[e * g.dout.sd]);
          for (int64_t s = 0; s < nk; ++s)
            dv_acc[e * kBwdK + s] += z[s] / static_cast<float>(p.S) * go;
        }
      }
    }

    // dK = scale sum dS Q, dV = sum P Z dO: rounded once (vcvtneps2bf16), transposed back.
    StoreKeyRowsBf16(dk_acc, D, nk, p.scale,
                     g.dk.data + p.row_offset(b, g.dk.sb, g.dk.sh) + s0 * g.dk.st, g.dk.st, g.dk.sd,
                     w.out16);
    StoreKeyRowsBf16(dv_acc, Dv, nk, 1.0f,
                     g.dv.data + p.row_offset(b, g.dv.sb, g.dv.sh) + s0 * g.dv.st, g.dv.st, g.dv.sd,
                     w.out16);
  }
  next.Step(steps - 1, steps);
}

void BackwardNative(const FlashBf16Params& p, const FlashBf16Grads& g) {
  const int64_t Dp = (p.D + kL - 1) / kL * kL;
  static_assert(kBwdK == 64, "backward_key_splits cuts at multiples of 64 keys");
  flash_backward_driver(
      p, "flash_attention_backward_bf16", Dp, BwdBuffers::Bytes(p),
      /*zero_scratch=*/true, [&](std::byte* scratch) { return BwdBuffers(p, scratch); },
      [&](BwdBuffers& w, int64_t b, int64_t sa, int64_t sb, float* part, int64_t next_b) {
        BackwardItem(p, g, b, sa, sb, part, w, next_b);
      },
      // dq = scale * (sum of the shares), rounded to bf16 once.
      [&](int64_t b, int64_t t0, int64_t t1, const float* rows, int64_t ld) {
        for (int64_t t = t0; t < t1; ++t)
          StoreBf16Row(rows + (t - t0) * ld, p.D, p.scale,
                       g.dq.data + p.row_offset(b, g.dq.sb, g.dq.sh) + t * g.dq.st, g.dq.sd);
      });
}
