// The row-exact f32 GEMM (gemm_rows.hpp): AVX2 + FMA register tiles of 6 rows x 16 columns.
//
// Each element of C is acc = fma(a_k, b_k, acc) for k = 0, 1, ..., K - 1 from acc = 0, then
// acc + bias, then + the old C, whatever tile, block or slice holds it: the blocking below only
// decides when each chain runs. The chain may pause between blocks of k (its value stored as a
// float and loaded again, which is exact), and a tile with fewer rows or columns runs the same
// chain (std::fma rounds as vfmadd does). So the bits of a row depend on that row of op(A), on
// op(B), bias and its old C only.
#include "kernels/cpu/gemm_rows.hpp"

#include "attn/core/dtype.hpp"

#include <algorithm>
#include <cmath>
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
// partial sums, or from 0 when `fresh`. a: op(A)'s element (r, k) at a[r * a_rs + k * a_ks];
// b: op(B)'s 16 columns of row k at b[k * b_ks]. With `out`, the sums are finished into C
// instead of stored in acc.
template <int R>
ATTN_GEMM_ROWS_TARGET void tile(int64_t depth, const float* a, int64_t a_rs, int64_t a_ks,
                                const float* b, int64_t b_ks, float* acc, bool fresh,
                                const TileOut* out) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    c0[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel);
    c1[r] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kPanel + 8);
  }
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * b_ks), b1 = _mm256_loadu_ps(b + k * b_ks + 8);
    const float* ak = a + k * a_ks;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(ak + r * a_rs);
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

using TileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                        bool, const TileOut*);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr,  &tile<1>, &tile<2>, &tile<3>,
                                          &tile<4>, &tile<5>, &tile<6>};

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
// op(B) element (k, n) of float or bf16 B, as float (bf16 widened, exactly).
template <typename T>
float b_at(const T* B, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return bf16_to_float(B[i]);
  } else {
    return B[i];
  }
}

template <typename T>
void pack_panels(const GemmArgs& g, const T* B, float* packed, int64_t p0, int64_t p1) {
  const int64_t N = g.N, K = g.K;
  for (int64_t p = p0; p < p1; ++p) {
    float* dst = packed + p * K * kPanel;
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    if (g.trans_b) {
      // B stored (N, K): column c of the panel is row n0 + c of B, read along k.
      for (int64_t c = 0; c < kPanel; ++c) {
        if (c >= cols) {
          for (int64_t k = 0; k < K; ++k)
            dst[k * kPanel + c] = 0.0f;
          continue;
        }
        const T* src = B + (n0 + c) * g.ldb;
        for (int64_t k = 0; k < K; ++k)
          dst[k * kPanel + c] = b_at(src, k);
      }
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      float* row = dst + k * kPanel;
      for (int64_t c = 0; c < cols; ++c)
        row[c] = b_at(B, k * g.ldb + n0 + c);
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

void gemm_rows_f32(const GemmArgs& g, const float* packed) {
  const int64_t M = g.M, N = g.N, K = g.K;
  if (M <= 0 || N <= 0) return;
  thread_local std::vector<float> packed_buffer, partial_buffer, a_buffer, c_buffer;
  // 64-byte aligned, so that no 32-byte load of a packed row splits a cache line.
  const auto aligned = [](std::vector<float>& v, int64_t n) {
    v.resize(static_cast<size_t>(n + 16));
    const auto address = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - address % 64) % 64) / sizeof(float);
  };
  if (g.type == GemmType::kBF16) {
    // bf16 inputs (CPUs without a bf16 matmul): this call's op(A) widened (exact) into a float
    // copy, op(B) widened as it is packed; a bf16 output from a float one, rounded once per
    // element (with the old value added in float first), as oneDNN's bf16 kernels store it.
    const int64_t a_rows = g.trans_a ? K : M, a_cols = g.trans_a ? M : K;
    float* a32 = aligned(a_buffer, a_rows * a_cols);
    const auto* a16 = static_cast<const uint16_t*>(g.A);
    for (int64_t r = 0; r < a_rows; ++r)
      bf16_to_floats(a16 + r * g.lda, a32 + r * a_cols, a_cols);
    GemmArgs f = g;
    f.type = GemmType::kF32;
    f.A = a32, f.lda = a_cols;
    if (packed == nullptr) {
      float* own = aligned(packed_buffer, gemm_rows_packed_size(g));
      gemm_rows_pack_panels(g, own, 0, panels_of(N));
      packed = own;
    }
    if (g.C_bf16 == nullptr) return gemm_rows_f32(f, packed);
    float* c32 = aligned(c_buffer, M * N);
    f.C_bf16 = nullptr, f.C = c32, f.ldc = N, f.accumulate = false;
    gemm_rows_f32(f, packed);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* out = g.C_bf16 + m * g.ldc;
      const float* in = c32 + m * N;
      if (!g.accumulate) {
        floats_to_bf16(in, out, N);
        continue;
      }
      for (int64_t n = 0; n < N; ++n)
        out[n] = float_to_bf16(bf16_to_float(out[n]) + in[n]);
    }
    return;
  }
  const auto* A = static_cast<const float*>(g.A);
  const int64_t a_rs = g.trans_a ? 1 : g.lda, a_ks = g.trans_a ? g.lda : 1;
  const int64_t panels = panels_of(N);
  if (packed == nullptr) {
    float* own = aligned(packed_buffer, gemm_rows_packed_size(g));
    gemm_rows_pack_panels(g, own, 0, panels);
    packed = own;
  }
  // The partial sums of one block of rows, every panel, while k runs in blocks: (panels,
  // kRowBlock, 16).
  float* partial = aligned(partial_buffer, panels * kRowBlock * kPanel);
  for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - i0);
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kDepth) {
      const int64_t depth = std::max<int64_t>(0, std::min(kDepth, K - k0));
      const bool last = k0 + kDepth >= K;
      for (int64_t p = 0; p < panels; ++p) {
        const float* b = packed + p * K * kPanel + k0 * kPanel;
        const int64_t n0 = p * kPanel;
        for (int64_t r = 0; r < rows; r += kTileRows) {
          const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
          // The tile's partial sums: rows r.. of the block at stride 16, one contiguous piece.
          float* acc = partial + (p * kRowBlock + r) * kPanel;
          const TileOut out{g.C + (i0 + r) * g.ldc + n0, g.ldc,
                            g.bias != nullptr ? g.bias + n0 : nullptr, g.accumulate,
                            std::min(kPanel, N - n0)};
          kTiles[n](depth, A + (i0 + r) * a_rs + k0 * a_ks, a_rs, a_ks, b, kPanel, acc, k0 == 0,
                    last ? &out : nullptr);
        }
      }
    }
  }
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

#endif

}  // namespace attn::cpu
