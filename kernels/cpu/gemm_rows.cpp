// The row-exact f32 GEMM (gemm_rows.hpp): AVX2 + FMA register tiles of 6 rows x 16 columns.
//
// Each element of C is acc = fma(a_k, b_k, acc) for k = 0, 1, ..., K - 1 from acc = 0, then
// acc + bias, then + the old C, whatever tile, block or slice holds it: the blocking below only
// decides when each chain runs. The chain may pause between blocks of k (its value stored as a
// float and loaded again, which is exact), and a tile with fewer rows or columns runs the same
// chain (std::fma rounds as vfmadd does). So the bits of a row depend on that row of op(A), on
// op(B), bias and its old C only.
//
// Both operands are packed, as BLIS-style kernels do, so that the register tiles read from small
// contiguous blocks: op(B) in 16-column panels, k-major (once per product, shared by its slices,
// or kept across calls for a weight: GemmFixedPackingScope), and each block of kRowBlock rows x
// kDepth k of op(A) in 6-row tiles (once per block, then read for every panel). The packers move
// 8 floats per vector (B's transposing one 8 x 8 blocks through registers); bf16 operands are
// widened as they are packed. Packing B with scalar loads took a third of a weight gradient's
// time (128 x 128 x 4096, perf), and reading six strided rows of an unpacked A left the tiles at
// 52-75% of oneDNN's jit sgemm on the d2l step's products.
#include "kernels/cpu/gemm_rows.hpp"

#include "attn/core/dtype.hpp"
#include "kernels/cpu/scratch.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ATTN_GEMM_ROWS_X86 1
#endif

namespace attn::cpu {

#if ATTN_GEMM_ROWS_X86

namespace {

constexpr int kTileRows = 6;       // 6 x 2 accumulators + 2 of B + 1 broadcast of A: 15 of 16 ymm
constexpr int64_t kPanel = 16;     // columns per tile: two 8-float vectors
constexpr int64_t kRowBlock = 96;  // rows of A kept in L2 while every panel of B passes over them
constexpr int64_t kDepth = 256;    // k per block: a panel's 16 KB of B stays in L1 across a block

#define ATTN_GEMM_ROWS_TARGET __attribute__((target("avx2,fma")))

// Where a tile's sums go after its last block of k: C's rows (row stride ldc), plus bias, plus
// the old C; `cols` < 16 for the last panel of a ragged N.
struct TileOut {
  float* c;
  int64_t ldc;
  const float* bias;  // the panel's 16 (or `cols`) bias values, or null
  bool accumulate;
  int64_t cols;
};

// acc (R x 16, row stride 16) over k in [0, depth): acc = fma(a, b, acc), from the stored
// partial sums, or from 0 when `fresh`. a: the tile's rows of op(A) as pack_a wrote them, element
// (r, k) at a[r * depth + k] (kRowMajorA) or a[k * kTileRows + r]; b: op(B)'s 16 columns of row k
// at b[k * kPanel]. With `out`, the sums are finished into C instead of stored in acc.
template <int R, bool kRowMajorA>
ATTN_GEMM_ROWS_TARGET void tile(int64_t depth, const float* a, const float* b, float* acc,
                                bool fresh, const TileOut* out) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    c0[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel);
    c1[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel + 8);
  }
  // Unrolled by 4: the k step is 12 FMAs, 8 loads and 5 integer ops of loop control and
  // addresses, which unrolling shares; 2-6% on Zen 3's forward projections (bench/ab_least.sh,
  // 1 thread).
#pragma GCC unroll 4
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kPanel), b1 = _mm256_loadu_ps(b + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(kRowMajorA ? a + r * depth + k : a + k * kTileRows + r);
      c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
    }
  }
  if (out == nullptr || out->cols < kPanel) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * kPanel, c0[r]);
      _mm256_storeu_ps(acc + r * kPanel + 8, c1[r]);
    }
    if (out == nullptr) return;
    // A ragged last panel: its columns one by one, the same two adds.
    for (int r = 0; r < R; ++r) {
      float* c = out->c + r * out->ldc;
      for (int64_t n = 0; n < out->cols; ++n) {
        float v = acc[r * kPanel + n];
        if (out->bias != nullptr) v += out->bias[n];
        c[n] = out->accumulate ? c[n] + v : v;
      }
    }
    return;
  }
  const __m256 bias0 = out->bias ? _mm256_loadu_ps(out->bias) : _mm256_setzero_ps();
  const __m256 bias1 = out->bias ? _mm256_loadu_ps(out->bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* c = out->c + r * out->ldc;
    __m256 v0 = c0[r], v1 = c1[r];
    if (out->bias != nullptr) v0 = _mm256_add_ps(v0, bias0), v1 = _mm256_add_ps(v1, bias1);
    if (out->accumulate)
      v0 = _mm256_add_ps(_mm256_loadu_ps(c), v0), v1 = _mm256_add_ps(_mm256_loadu_ps(c + 8), v1);
    _mm256_storeu_ps(c, v0);
    _mm256_storeu_ps(c + 8, v1);
  }
}

using TileFn = void (*)(int64_t, const float*, const float*, float*, bool, const TileOut*);
constexpr TileFn kTiles[2][kTileRows + 1] = {
    {nullptr, &tile<1, false>, &tile<2, false>, &tile<3, false>, &tile<4, false>, &tile<5, false>,
     &tile<6, false>},
    {nullptr, &tile<1, true>, &tile<2, true>, &tile<3, true>, &tile<4, true>, &tile<5, true>,
     &tile<6, true>}};

}  // namespace

bool gemm_rows_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

bool gemm_rows_preferred() {
  static const bool ok = gemm_rows_supported() && !__builtin_cpu_supports("avx512f");
  return ok;
}

namespace {
int64_t panels_of(int64_t N) {
  return (N + kPanel - 1) / kPanel;
}
}  // namespace

int64_t gemm_rows_packed_size(const GemmArgs& g) {
  return (g.N + kPanel - 1) / kPanel * g.K * kPanel;
}

namespace {
// Element i of float or bf16 data (either operand), as float (bf16 widened, exactly).
template <typename T>
float widened(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return bf16_to_float(x[i]);
  } else {
    return x[i];
  }
}

// 8 floats from p (float, or bf16 widened exactly); the first 6 only (no read past them) in
// load6.
ATTN_GEMM_ROWS_TARGET inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
ATTN_GEMM_ROWS_TARGET inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
ATTN_GEMM_ROWS_TARGET inline __m256 load6(const float* p) {
  return _mm256_maskload_ps(p, _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0));
}
ATTN_GEMM_ROWS_TARGET inline __m256 load6(const uint16_t* p) {
  const __m128i three =
      _mm_maskload_epi32(reinterpret_cast<const int*>(p), _mm_setr_epi32(-1, -1, -1, 0));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(three), 16));
}

// The 8 x 8 block in v transposed in place: v[j][i] = old v[i][j].
ATTN_GEMM_ROWS_TARGET inline void transpose8(__m256 v[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  // u0: rows 0-3 of column 0 (low half) and of column 4 (high half); u4: rows 4-7 of the same.
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20), v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20), v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  v[4] = _mm256_permute2f128_ps(u0, u4, 0x31), v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[6] = _mm256_permute2f128_ps(u2, u6, 0x31), v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

template <typename T>
ATTN_GEMM_ROWS_TARGET void pack_panels(const GemmArgs& g, const T* B, float* packed, int64_t p0,
                                       int64_t p1) {
  const int64_t N = g.N, K = g.K;
  for (int64_t p = p0; p < p1; ++p) {
    float* dst = packed + p * K * kPanel;
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    int64_t k = 0;
    if (g.trans_b) {
      // B stored (N, K): column c of the panel is row n0 + c of B, read along k; a full panel
      // 8 x 8 blocks at a time, transposed.
      if (cols == kPanel) {
        for (; k + 8 <= K; k += 8) {
          for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
            __m256 v[8];
            for (int j = 0; j < 8; ++j)
              v[j] = load8(B + (n0 + c0 + j) * g.ldb + k);
            transpose8(v);
            for (int j = 0; j < 8; ++j)
              _mm256_storeu_ps(dst + (k + j) * kPanel + c0, v[j]);
          }
        }
      }
      for (; k < K; ++k)
        for (int64_t c = 0; c < kPanel; ++c)
          dst[k * kPanel + c] = c < cols ? widened(B + (n0 + c) * g.ldb, k) : 0.0f;
      continue;
    }
    if (cols == kPanel) {
      for (; k < K; ++k) {
        _mm256_storeu_ps(dst + k * kPanel, load8(B + k * g.ldb + n0));
        _mm256_storeu_ps(dst + k * kPanel + 8, load8(B + k * g.ldb + n0 + 8));
      }
    }
    for (; k < K; ++k) {
      float* row = dst + k * kPanel;
      for (int64_t c = 0; c < cols; ++c)
        row[c] = widened(B, k * g.ldb + n0 + c);
      std::fill(row + cols, row + kPanel, 0.0f);
    }
  }
}
}  // namespace

void gemm_rows_pack_panels(const GemmArgs& g, float* packed, int64_t p0, int64_t p1) {
  if (g.type == GemmType::kBF16)
    pack_panels(g, static_cast<const uint16_t*>(g.B), packed, p0, p1);
  else
    pack_panels(g, static_cast<const float*>(g.B), packed, p0, p1);
}

namespace {

// A thread's buffer of at least n floats, 64-byte aligned (scratch.hpp), 16 floats to spare past
// n (pack_a's 8-float stores).
float* aligned(std::vector<float>& v, int64_t n) {
  return grown_aligned(v, static_cast<size_t>(n + 16));
}

// Rows [i0, i0 + rows) and k [k0, k0 + depth) of op(A) (float, or bf16 widened exactly), tile by
// tile of kTileRows rows, each tile's block at dst + t * depth * kTileRows, which the register
// tiles read for every panel of B. Two layouts, whichever copies faster: with trans_a (a k's rows
// side by side in A) k-major, element (r, k) at [k * kTileRows + r], 8 floats stored per k, the
// last 2 overwritten by the next k's (dst has 16 floats to spare); otherwise row-major, (r, k) at
// [r * depth + k], each row a plain copy (an in-register transpose to k-major cost 2-8% more of
// the d2l step's products, bench: best of 8 alternating runs, Zen 3).
template <typename T>
ATTN_GEMM_ROWS_TARGET void pack_a(const GemmArgs& g, const T* A, int64_t i0, int64_t rows,
                                  int64_t k0, int64_t depth, float* dst) {
  for (int64_t t = 0; t * kTileRows < rows; ++t) {
    const int64_t r0 = i0 + t * kTileRows, n = std::min<int64_t>(kTileRows, rows - t * kTileRows);
    float* d = dst + t * depth * kTileRows;
    int64_t k = 0;
    if (g.trans_a) {
      // Row m of op(A) is column m of A's storage: a k's rows are side by side.
      if (n == kTileRows)
        for (; k < depth; ++k)
          _mm256_storeu_ps(d + k * kTileRows, load6(A + (k0 + k) * g.lda + r0));
      for (; k < depth; ++k)
        for (int64_t r = 0; r < n; ++r)
          d[k * kTileRows + r] = widened(A + (k0 + k) * g.lda + r0, r);
      continue;
    }
    // Row r of the tile at d + r * depth.
    for (int64_t r = 0; r < n; ++r) {
      const T* src = A + (r0 + r) * g.lda + k0;
      float* row = d + r * depth;
      int64_t kk = 0;
      for (; kk + 8 <= depth; kk += 8)
        _mm256_storeu_ps(row + kk, load8(src + kk));
      for (; kk < depth; ++kk)
        row[kk] = widened(src, kk);
    }
  }
}

// C (row stride ldc) = op(A) op(B) (+ bias) (+ C when `accumulate`), op(B) packed.
template <typename T>
void rows_product(const GemmArgs& g, const T* A, const float* packed, float* C, int64_t ldc,
                  bool accumulate) {
  const int64_t M = g.M, N = g.N, K = g.K, panels = panels_of(N);
  thread_local std::vector<float> partial_buffer, a_buffer;
  // The partial sums of one block of rows, every panel, while k runs in blocks: (panels,
  // kRowBlock, 16); one block of op(A), packed.
  float* partial = aligned(partial_buffer, panels * kRowBlock * kPanel);
  float* a_pack = aligned(a_buffer, kRowBlock * kDepth);
  for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - i0);
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kDepth) {
      const int64_t depth = std::max<int64_t>(0, std::min(kDepth, K - k0));
      const bool last = k0 + kDepth >= K;
      pack_a(g, A, i0, rows, k0, depth, a_pack);
      for (int64_t p = 0; p < panels; ++p) {
        const float* b = packed + p * K * kPanel + k0 * kPanel;
        const int64_t n0 = p * kPanel;
        for (int64_t r = 0; r < rows; r += kTileRows) {
          const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
          // The tile's partial sums: rows r.. of the block at stride 16, one contiguous piece.
          float* acc = partial + (p * kRowBlock + r) * kPanel;
          const TileOut out{C + (i0 + r) * ldc + n0, ldc, g.bias != nullptr ? g.bias + n0 : nullptr,
                            accumulate, std::min(kPanel, N - n0)};
          kTiles[g.trans_a ? 0 : 1][n](depth, a_pack + r * depth, b, acc, k0 == 0,
                                       last ? &out : nullptr);
        }
      }
    }
  }
}

}  // namespace

void gemm_rows_f32(const GemmArgs& g, const float* packed) {
  const int64_t M = g.M, N = g.N;
  if (M <= 0 || N <= 0) return;
  thread_local std::vector<float> packed_buffer, c_buffer;
  if (packed == nullptr) {
    float* own = aligned(packed_buffer, gemm_rows_packed_size(g));
    gemm_rows_pack_panels(g, own, 0, panels_of(N));
    packed = own;
  }
  if (g.type != GemmType::kBF16) {
    rows_product(g, static_cast<const float*>(g.A), packed, g.C, g.ldc, g.accumulate);
    return;
  }
  // bf16 inputs (CPUs without a bf16 matmul): op(A) widened (exact) as it is packed, op(B) as its
  // panels were; a bf16 output from a float one, rounded once per element (with the old value
  // added in float first), as oneDNN's bf16 kernels store it.
  const auto* A = static_cast<const uint16_t*>(g.A);
  if (g.C_bf16 == nullptr) {
    rows_product(g, A, packed, g.C, g.ldc, g.accumulate);
    return;
  }
  float* c32 = aligned(c_buffer, M * N);
  rows_product(g, A, packed, c32, N, false);
  round_rows_to_bf16(c32, N, g.C_bf16, g.ldc, M, N, g.accumulate);
}

namespace {

// A packing kept by gemm_rows_fixed_packing: the product's B (address and layout) and its
// packed panels.
struct FixedPacking {
  const void* B = nullptr;
  int64_t N = 0, K = 0, ldb = 0;
  bool trans_b = false;
  GemmType type = GemmType::kF32;
  std::vector<float> buffer;
  float* packed = nullptr;
};

struct FixedPackings {
  int depth = 0;  // scopes alive on this thread
  std::vector<FixedPacking> kept;
  size_t bytes = 0;
};
thread_local FixedPackings fixed_packings;

// What one thread keeps at most; past it, products pack per call again.
constexpr size_t kFixedMaxBytes = size_t{256} << 20, kFixedMaxKept = 256;

}  // namespace

GemmFixedPackingScope::GemmFixedPackingScope() {
  ++fixed_packings.depth;
}

GemmFixedPackingScope::~GemmFixedPackingScope() {
  if (--fixed_packings.depth > 0) return;
  fixed_packings.kept.clear();
  fixed_packings.kept.shrink_to_fit();
  fixed_packings.bytes = 0;
}

const float* gemm_rows_fixed_packing(const GemmArgs& g) {
  FixedPackings& f = fixed_packings;
  if (f.depth == 0 || !g.b_fixed || g.N <= 0 || g.K <= 0) return nullptr;
  for (const FixedPacking& e : f.kept)
    if (e.B == g.B && e.N == g.N && e.K == g.K && e.ldb == g.ldb && e.trans_b == g.trans_b &&
        e.type == g.type)
      return e.packed;
  const size_t floats = static_cast<size_t>(gemm_rows_packed_size(g));
  if (f.kept.size() >= kFixedMaxKept || f.bytes + floats * sizeof(float) > kFixedMaxBytes)
    return nullptr;
  FixedPacking& e = f.kept.emplace_back();
  e.B = g.B, e.N = g.N, e.K = g.K, e.ldb = g.ldb, e.trans_b = g.trans_b, e.type = g.type;
  e.packed = grown_aligned(e.buffer, floats);
  gemm_rows_pack_panels(g, e.packed, 0, panels_of(g.N));
  f.bytes += floats * sizeof(float);
  return e.packed;
}

#else  // not x86-64: oneDNN's kernels everywhere

bool gemm_rows_supported() {
  return false;
}
bool gemm_rows_preferred() {
  return false;
}
int64_t gemm_rows_packed_size(const GemmArgs&) {
  return 0;
}
void gemm_rows_pack_panels(const GemmArgs&, float*, int64_t, int64_t) {}
void gemm_rows_f32(const GemmArgs&, const float*) {}
GemmFixedPackingScope::GemmFixedPackingScope() = default;
GemmFixedPackingScope::~GemmFixedPackingScope() = default;
const float* gemm_rows_fixed_packing(const GemmArgs&) {
  return nullptr;
}

#endif

void round_rows_to_bf16(const float* c32, int64_t ld32, uint16_t* out, int64_t ldo, int64_t rows,
                        int64_t N, bool accumulate) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* in = c32 + m * ld32;
    uint16_t* o = out + m * ldo;
    if (!accumulate) {
      floats_to_bf16(in, o, N);
      continue;
    }
    for (int64_t n = 0; n < N; ++n)
      o[n] = float_to_bf16(bf16_to_float(o[n]) + in[n]);
  }
}

}  // namespace attn::cpu
