// The bf16 attention forward on tensor cores (mma.sync m16n8k16, sm_80 and later), for the common
// case: bf16, D == Dv in {32, 64, 128} (d2l's heads are 32 wide), unit stride along the head dim,
// 4-byte aligned Q and output rows, 16-byte aligned K and V rows. Other problems take the SIMT
// kernel (flash_attention.cu), which has the same contract.
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys, D head dim.
//
// Schedule (FlashAttention-2, Dao 2023): a block = 4 warps = 64 query rows, a warp owns 16 rows
// and keeps its Q fragments and its output accumulator in registers. Keys stream through shared
// memory in tiles of 64 (both row-major, double-buffered: the kernel's comment below).
// Per tile a warp computes S = Q K^T (16 x 64, float), masks it, updates the online softmax per
// row, rescales its output rows, and multiplies P (rounded to bf16; its C-fragment layout is the
// A-fragment layout of the next product, so P never leaves registers) by V.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): g = lane / 4, c = lane % 4.
//   A (16 x 16, row): reg0 = (g, 2c..2c+1), reg1 = (g+8, 2c..), reg2 = (g, 2c+8..), reg3 = (g+8,
//   2c+8..) B (16 x 8, col):  reg0 = (k = 2c..2c+1, n = g), reg1 = (k = 2c+8.., n = g) C (16 x 8):
//   c0, c1 = (g, 2c..2c+1), c2, c3 = (g+8, 2c..2c+1)
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/flash_mma.hpp"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma_layout.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>

namespace attn::cuda {
namespace {

using kernels::AttentionArgs;
using kernels::AttentionGradArgs;

constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16 * kMmaWarps;  // query rows a block
constexpr int kMmaKeys = 64;              // keys a tile
constexpr int kPad = 8;                   // bf16 elements of padding a smem row (bank spread)

struct MmaParams {
  int64_t B, T, S, heads;
  const int32_t* kept;
  bool causal, zero_rows;
  float scale, p;
  uint64_t seed, offset;
  const uint64_t* offset_dev;  // AttentionProblem::dropout_offset_device (null: offset alone)
  DropoutIndexer drop;
  const uint16_t *q, *k, *v;
  uint16_t* out;
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, o_sb, o_sh, o_st;
  float* lse;
  // backward only: dO (the output's layout), the gradients, delta = rowsum(dO * O)
  const uint16_t* dout;
  uint16_t *dq, *dk, *dv;
  int64_t g_sb, g_sh, g_st, dq_sb, dq_sh, dq_st, dk_sb, dk_sh, dk_st, dv_sb, dv_sh, dv_st;
  const float* delta;

  __device__ int64_t row_off(int64_t b, int64_t sb, int64_t sh) const {
    return heads == 1 ? b * sb : (b / heads) * sb + (b % heads) * sh;
  }
  __device__ int64_t limit(int64_t b, int64_t t, bool* uniform) const {
    const int64_t lim = row_limit(kept, causal, b, t, T, S);
    *uniform = lim == 0 && !zero_rows;
    return *uniform ? S : lim;
  }
  __device__ float dropout_z(uint64_t offset, int64_t b, int64_t t, int64_t s) const {
    return dropout_factor(seed, offset, drop(b, t, s), p);
  }
};

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(bf16_round(lo)) | static_cast<uint32_t>(bf16_round(hi)) << 16;
}
__device__ __forceinline__ uint32_t load_u32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// The kernel's memory instructions (sm_80+): 16-byte asynchronous copies to shared
// memory (zeros where `valid` is false: the source is then not read), and ldmatrix x4.
__device__ __forceinline__ void cp_async16(uint16_t* smem, const uint16_t* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_one() {  // all groups but the newest complete
  asm volatile("cp.async.wait_group 1;\n" ::);
}
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const uint16_t* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The A fragments of rows t0 .. t0 + 15 of a row-major bf16 matrix (rows `st` apart; rows past T
// read as zeros), every 16-wide chunk of its D columns: the forward's Q, the dQ kernel's Q and dO.
template <int kChunks>
__device__ __forceinline__ void load_a_rows(uint32_t frag[kChunks][4], const uint16_t* base,
                                            int64_t st, int64_t t0, int64_t T, int lane) {
#pragma unroll
  for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const FragPos pos = mma_a_pos(lane, r, 0);  // the pair (row, col), (row, col + 1)
      const int64_t t = t0 + pos.row;
      frag[kc][r] = t < T ? load_u32(base + t * st + kc * 16 + pos.col) : 0u;
    }
}

// One block: 64 query rows (a warp's 16 each) against every key tile its rows keep. K and V tiles
// come into shared memory by cp.async, 16 bytes a thread and step, both row-major, into two
// buffers (tile j + 1 is in flight while tile j is multiplied); B fragments come by ldmatrix x4
// (K: two key tiles a load; V with .trans: two dim tiles a load; mma_layout.hpp: ldsm_k_row,
// ldsm_v_row, tested on the host against mma_b_pos). Session 25's H200 run: 85 TF/s at
// (2,16,8192,128) where the single-buffered kernel it replaced (V transposed through 2-byte
// stores, one 32-bit shared load per B register) ran 37 (docs/gpu.md).
template <int D>
__global__ void __launch_bounds__(kWarp* kMmaWarps) flash_mma_forward_kernel(const MmaParams P) {
  constexpr int ld = D + kPad;  // a row of either tile, bf16; (D + 8) * 2 bytes, 16-byte multiple
  constexpr int kChunks = D / 16, kOutTiles = D / 8, kKeyTiles = kMmaKeys / 8;
  constexpr int kTile = kMmaKeys * ld;  // elements of one K (or V) tile
  extern __shared__ uint16_t smem16[];  // [buffer][K tile, V tile]

  const int64_t b = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const uint64_t offset = P.offset_dev != nullptr ? *P.offset_dev + P.offset : P.offset;
  const int64_t t_block = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int64_t t0 = t_block + warp * 16;
  const int64_t rows[2] = {t0 + mma_c_pos(lane, 0).row, t0 + mma_c_pos(lane, 2).row};

  // Q fragments for all k-steps, straight from global memory (rows past T read as zeros).
  uint32_t qa[kChunks][4];
  load_a_rows<kChunks>(qa, P.q + P.row_off(b, P.q_sb, P.q_sh), P.q_st, t0, P.T, lane);

  bool uniform[2] = {false, false};
  int64_t lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    lim[i] = rows[i] < P.T ? P.limit(b, rows[i], &uniform[i]) : 0;
  int64_t block_limit = 0;
  for (int r = 0; r < kMmaRows && t_block + r < P.T; ++r) {
    bool u;
    block_limit = max(block_limit, P.limit(b, t_block + r, &u));
  }

  float o[kOutTiles][4];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const uint16_t* kb = P.k + P.row_off(b, P.k_sb, P.k_sh);
  const uint16_t* vb = P.v + P.row_off(b, P.v_sb, P.v_sh);
  // Tile s0's keys into buffer `buf`: 16-byte pieces, zeros past S.
  const auto load_tile = [&](int buf, int64_t s0) {
    uint16_t* ks = smem16 + buf * 2 * kTile;
    uint16_t* vs = ks + kTile;
    for (int i = threadIdx.x; i < kMmaKeys * (D / 8); i += blockDim.x) {
      const int key = i / (D / 8), d = 8 * (i % (D / 8));
      const int64_t s = s0 + key;
      const bool valid = s < P.S;
      cp_async16(ks + key * ld + d, valid ? kb + s * P.k_st + d : kb, valid);
      cp_async16(vs + key * ld + d, valid ? vb + s * P.v_st + d : vb, valid);
    }
  };
  const int64_t tiles = (block_limit + kMmaKeys - 1) / kMmaKeys;
  if (tiles > 0) load_tile(0, 0);
  cp_async_commit();
  const FragPos k_row = ldsm_k_row(lane), v_row = ldsm_v_row(lane);
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t s0 = j * kMmaKeys;
    if (j + 1 < tiles) load_tile(static_cast<int>((j + 1) & 1), s0 + kMmaKeys);
    cp_async_commit();    // (an empty group after the last tile)
    cp_async_wait_one();  // tile j has landed (this thread's copies) ...
    __syncthreads();      // ... and every thread's
    const uint16_t* ks = smem16 + (j & 1) * 2 * kTile;
    const uint16_t* vs = ks + kTile;
    if (!__all_sync(0xffffffffu, s0 >= max(lim[0], lim[1]))) {
      // S = Q K^T for 16 rows x 64 keys: one ldmatrix x4 gives two key tiles' B fragments.
      float sc[kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
        sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np)
#pragma unroll
        for (int kc = 0; kc < kChunks; ++kc) {
          uint32_t r[4];
          ldsm_x4(r, ks + (np * 16 + k_row.row) * ld + kc * 16 + k_row.col);
          mma_bf16(sc[2 * np], qa[kc], r[0], r[1]);
          mma_bf16(sc[2 * np + 1], qa[kc], r[2], r[3]);
        }
      // Mask and scale; the tile's row maxima (each row's 64 scores sit in the 4 lanes of a
      // group).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;  // rows[i] is the row of mma_c_pos(lane, e)
          const int64_t s = s0 + n * 8 + mma_c_pos(lane, e).col;
          float x = -INFINITY;
          if (s < lim[i]) x = uniform[i] ? 0.0f : sc[n][e] * P.scale;
          sc[n][e] = x;
          tile_max[i] = fmaxf(tile_max[i], x);
        }
      float alpha[2], row_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
        const float m_new = fmaxf(m[i], tile_max[i]);
        alpha[i] = SoftmaxState::rescale(m[i], m_new);
        m[i] = m_new;
      }
      // P = exp(S - m); the row sums enter l before dropout, the dropped P enters the product.
      uint32_t pa[kMmaKeys / 16][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        float pe[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          const float x = sc[n][e];
          float pv = x == -INFINITY ? 0.0f : expf(x - m[i]);
          row_sum[i] += pv;
          if (P.p > 0.0f && pv != 0.0f)
            pv *= dropout_factor(P.seed, offset,
                                 P.drop(b, rows[i], s0 + n * 8 + mma_c_pos(lane, e).col), P.p);
          pe[e] = pv;
        }
        // C fragment of key tile n is half of the A fragment of key chunk n / 2.
        pa[n / 2][p_reg_of(n, 0)] = pack_bf16(pe[0], pe[1]);
        pa[n / 2][p_reg_of(n, 2)] = pack_bf16(pe[2], pe[3]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
        l[i] = l[i] * alpha[i] + row_sum[i];
      }
      // O = O * alpha + P V.
#pragma unroll
      for (int n = 0; n < kOutTiles; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
      // O += P V: one ldmatrix x4.trans gives two dim tiles' B fragments of a 16-key chunk.
#pragma unroll
      for (int np = 0; np < kOutTiles / 2; ++np)
#pragma unroll
        for (int kc = 0; kc < kMmaKeys / 16; ++kc) {
          uint32_t r[4];
          ldsm_x4_trans(r, vs + (kc * 16 + v_row.row) * ld + np * 16 + v_row.col);
          mma_bf16(o[2 * np], pa[kc], r[0], r[1]);
          mma_bf16(o[2 * np + 1], pa[kc], r[2], r[3]);
        }
    }
    __syncthreads();  // every warp is done with buffer j & 1 before tile j + 2 goes there
  }

  uint16_t* ob = P.out + P.row_off(b, P.o_sb, P.o_sh);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t t = rows[i];
    if (t >= P.T) continue;
    const float inv = lim[i] > 0 ? 1.0f / l[i] : 0.0f;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n)
      *reinterpret_cast<uint32_t*>(ob + t * P.o_st + n * 8 + mma_c_pos(lane, 2 * i).col) =
          pack_bf16(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    if (lane % 4 == 0 && P.lse != nullptr)  // one lane of the row's group of 4
      P.lse[b * P.T + t] = (lim[i] == 0 || uniform[i]) ? -INFINITY : m[i] + logf(l[i]);
  }
}

// Beyond 48 KB of dynamic shared memory a kernel must opt in (the forward at D 128: 68 KB). The
// caller keeps the result in a static: a driver call per launch cost as much as a d2l-sized
// kernel.
template <class Kernel>
cudaError_t opt_in_smem(Kernel kernel, size_t smem) {
  return smem > 48 * 1024
             ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem))
             : cudaSuccess;
}

template <int D>
void launch_mma(const MmaParams& P, void* stream) {
  const char* op = "cuda::flash_attention_forward";
  const size_t smem = flash_mma_smem(D);
  static const cudaError_t opted = opt_in_smem(flash_mma_forward_kernel<D>, smem);
  ATTN_CUDA_CHECK(op, opted);
  const dim3 grid(static_cast<unsigned>(ceil_div(P.T, kMmaRows)), static_cast<unsigned>(P.B));
  flash_mma_forward_kernel<D>
      <<<grid, kWarp * kMmaWarps, smem, static_cast<cudaStream_t>(stream)>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

// The backward (FlashAttention-2's recomputation from lse; no atomics, so every gradient element
// has one writer and a run's bits do not change from run to run, as in the SIMT kernels): delta
// = rowsum(dO * O) first (flash_attention.cu), then dQ over query blocks and dK, dV over key
// blocks. With dropout the forward was O = (P Z) V, so dP = Z (dO V^T), dS = P (dP - delta),
// dQ = scale dS K, dK = scale dS^T Q, dV = (P Z)^T dO. P Z and dS are rounded to bf16 as the
// A operands of the products that follow (their C fragments are those A fragments, as the
// forward's P); the sums are float.

// dQ: the forward's schedule (a warp's 16 query rows, Q and dO fragments in registers; K and V
// tiles double-buffered by cp.async). Per tile S = Q K^T and dO V^T (V's rows addressed as the
// forward addresses K's), then dQ += dS K (K as the forward's V: ldmatrix .trans). A row without
// kept keys, or whose scores all tie (uniform), gets no gradient.
template <int D>
__global__ void __launch_bounds__(kWarp* kMmaWarps) flash_mma_dq_kernel(const MmaParams P) {
  constexpr int ld = D + kPad;
  constexpr int kChunks = D / 16, kOutTiles = D / 8, kKeyTiles = kMmaKeys / 8;
  constexpr int kTile = kMmaKeys * ld;
  extern __shared__ uint16_t smem16[];  // [buffer][K tile, V tile]

  const int64_t b = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const uint64_t offset = P.offset_dev != nullptr ? *P.offset_dev + P.offset : P.offset;
  const int64_t t_block = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int64_t t0 = t_block + warp * 16;
  const int64_t rows[2] = {t0 + mma_c_pos(lane, 0).row, t0 + mma_c_pos(lane, 2).row};

  uint32_t qa[kChunks][4], ga[kChunks][4];
  load_a_rows<kChunks>(qa, P.q + P.row_off(b, P.q_sb, P.q_sh), P.q_st, t0, P.T, lane);
  load_a_rows<kChunks>(ga, P.dout + P.row_off(b, P.g_sb, P.g_sh), P.g_st, t0, P.T, lane);

  int64_t lim[2];
  float lse[2], delta[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    bool u = false;
    lim[i] = rows[i] < P.T ? P.limit(b, rows[i], &u) : 0;
    if (u) lim[i] = 0;  // all scores tie whatever q is: no gradient reaches q
    lse[i] = lim[i] > 0 ? P.lse[b * P.T + rows[i]] : 0.0f;
    delta[i] = lim[i] > 0 ? P.delta[b * P.T + rows[i]] : 0.0f;
  }
  int64_t block_limit = 0;
  for (int r = 0; r < kMmaRows && t_block + r < P.T; ++r) {
    bool u;
    const int64_t lr = P.limit(b, t_block + r, &u);
    if (!u) block_limit = max(block_limit, lr);
  }

  float dq[kOutTiles][4];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n)
    dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  const uint16_t* kb = P.k + P.row_off(b, P.k_sb, P.k_sh);
  const uint16_t* vb = P.v + P.row_off(b, P.v_sb, P.v_sh);
  const auto load_tile = [&](int buf, int64_t s0) {
    uint16_t* ks = smem16 + buf * 2 * kTile;
    uint16_t* vs = ks + kTile;
    for (int i = threadIdx.x; i < kMmaKeys * (D / 8); i += blockDim.x) {
      const int key = i / (D / 8), d = 8 * (i % (D / 8));
      const int64_t s = s0 + key;
      const bool valid = s < P.S;
      cp_async16(ks + key * ld + d, valid ? kb + s * P.k_st + d : kb, valid);
      cp_async16(vs + key * ld + d, valid ? vb + s * P.v_st + d : vb, valid);
    }
  };
  const int64_t tiles = (block_limit + kMmaKeys - 1) / kMmaKeys;
  if (tiles > 0) load_tile(0, 0);
  cp_async_commit();
  const FragPos k_row = ldsm_k_row(lane), v_row = ldsm_v_row(lane);
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t s0 = j * kMmaKeys;
    if (j + 1 < tiles) load_tile(static_cast<int>((j + 1) & 1), s0 + kMmaKeys);
    cp_async_commit();
    cp_async_wait_one();
    __syncthreads();
    const uint16_t* ks = smem16 + (j & 1) * 2 * kTile;
    const uint16_t* vs = ks + kTile;
    if (!__all_sync(0xffffffffu, s0 >= max(lim[0], lim[1]))) {
      float sc[kKeyTiles][4], dp[kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np)
#pragma unroll
        for (int kc = 0; kc < kChunks; ++kc) {
          uint32_t r[4];
          ldsm_x4(r, ks + (np * 16 + k_row.row) * ld + kc * 16 + k_row.col);
          mma_bf16(sc[2 * np], qa[kc], r[0], r[1]);
          mma_bf16(sc[2 * np + 1], qa[kc], r[2], r[3]);
          ldsm_x4(r, vs + (np * 16 + k_row.row) * ld + kc * 16 + k_row.col);
          mma_bf16(dp[2 * np], ga[kc], r[0], r[1]);
          mma_bf16(dp[2 * np + 1], ga[kc], r[2], r[3]);
        }
      uint32_t dsa[kMmaKeys / 16][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        float de[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          const int64_t s = s0 + n * 8 + mma_c_pos(lane, e).col;
          float ds = 0.0f;
          if (s < lim[i]) {
            const float pv = expf(sc[n][e] * P.scale - lse[i]);
            float g = dp[n][e];
            if (P.p > 0.0f) g *= P.dropout_z(offset, b, rows[i], s);
            ds = pv * (g - delta[i]);
          }
          de[e] = ds;
        }
        dsa[n / 2][p_reg_of(n, 0)] = pack_bf16(de[0], de[1]);
        dsa[n / 2][p_reg_of(n, 2)] = pack_bf16(de[2], de[3]);
      }
#pragma unroll
      for (int np = 0; np < kOutTiles / 2; ++np)
#pragma unroll
        for (int kc = 0; kc < kMmaKeys / 16; ++kc) {
          uint32_t r[4];
          ldsm_x4_trans(r, ks + (kc * 16 + v_row.row) * ld + np * 16 + v_row.col);
          mma_bf16(dq[2 * np], dsa[kc], r[0], r[1]);
          mma_bf16(dq[2 * np + 1], dsa[kc], r[2], r[3]);
        }
    }
    __syncthreads();
  }

  uint16_t* out = P.dq + P.row_off(b, P.dq_sb, P.dq_sh);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t t = rows[i];
    if (t >= P.T) continue;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n)
      *reinterpret_cast<uint32_t*>(out + t * P.dq_st + n * 8 + mma_c_pos(lane, 2 * i).col) =
          pack_bf16(dq[n][2 * i] * P.scale, dq[n][2 * i + 1] * P.scale);
  }
}

// dK and dV: a block = 64 keys (a warp's 16), loaded once, whose rows are the A operands of
// S^T = K Q^T and dP^T = V dO^T (ldmatrix without .trans: ldsm_a_row); queries stream through
// shared memory in tiles of QT (Q and dO rows by cp.async, double-buffered) with their lse, delta
// and key limits. Then dV += (P Z)^T dO and dK += dS^T Q, dO and Q as B operands by ldmatrix
// .trans. A uniform row weighs every key 1/S and sends no dS.
template <int D, int QT>
__global__ void __launch_bounds__(kWarp* kMmaWarps) flash_mma_dkdv_kernel(const MmaParams P) {
  constexpr int ld = D + kPad;
  constexpr int kChunks = D / 16, kOutTiles = D / 8, kQTiles = QT / 8;
  constexpr int kKV = kMmaKeys * ld, kQ = QT * ld;
  // The block's K and V tiles; [buffer][Q tile, dO tile]; [buffer][lse, delta, limit, uniform].
  extern __shared__ uint16_t smem16[];
  uint16_t* ks = smem16;
  uint16_t* vs = ks + kKV;
  uint16_t* qbuf = vs + kKV;
  float* fbuf = reinterpret_cast<float*>(qbuf + 4 * kQ);

  const int64_t b = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const uint64_t offset = P.offset_dev != nullptr ? *P.offset_dev + P.offset : P.offset;
  const int64_t s_first = static_cast<int64_t>(blockIdx.x) * kMmaKeys;
  const int64_t s_warp = s_first + warp * 16;
  const int64_t keys[2] = {s_warp + mma_c_pos(lane, 0).row, s_warp + mma_c_pos(lane, 2).row};

  const uint16_t* kb = P.k + P.row_off(b, P.k_sb, P.k_sh);
  const uint16_t* vb = P.v + P.row_off(b, P.v_sb, P.v_sh);
  for (int i = threadIdx.x; i < kMmaKeys * (D / 8); i += blockDim.x) {
    const int key = i / (D / 8), d = 8 * (i % (D / 8));
    const int64_t s = s_first + key;
    const bool valid = s < P.S;
    cp_async16(ks + key * ld + d, valid ? kb + s * P.k_st + d : kb, valid);
    cp_async16(vs + key * ld + d, valid ? vb + s * P.v_st + d : vb, valid);
  }
  const uint16_t* qg = P.q + P.row_off(b, P.q_sb, P.q_sh);
  const uint16_t* gg = P.dout + P.row_off(b, P.g_sb, P.g_sh);
  const auto load_tile = [&](int buf, int64_t t0) {
    uint16_t* qs = qbuf + buf * 2 * kQ;
    uint16_t* gs = qs + kQ;
    for (int i = threadIdx.x; i < QT * (D / 8); i += blockDim.x) {
      const int row = i / (D / 8), d = 8 * (i % (D / 8));
      const int64_t t = t0 + row;
      const bool valid = t < P.T;
      cp_async16(qs + row * ld + d, valid ? qg + t * P.q_st + d : qg, valid);
      cp_async16(gs + row * ld + d, valid ? gg + t * P.g_st + d : gg, valid);
    }
    float* f = fbuf + buf * 4 * QT;
    int32_t* fl = reinterpret_cast<int32_t*>(f);
    for (int i = threadIdx.x; i < QT; i += blockDim.x) {
      const int64_t t = t0 + i;
      bool u = false;
      const int64_t lim = t < P.T ? P.limit(b, t, &u) : 0;
      const bool scored = lim > 0 && !u;
      f[i] = scored ? P.lse[b * P.T + t] : 0.0f;
      f[QT + i] = scored ? P.delta[b * P.T + t] : 0.0f;
      fl[2 * QT + i] = static_cast<int32_t>(lim);  // <= S < 2^31 (flash_mma_backward_supports)
      fl[3 * QT + i] = u ? 1 : 0;
    }
  };

  float dk[kOutTiles][4], dv[kOutTiles][4];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dk[n][e] = dv[n][e] = 0.0f;
  // Purely causal: queries before this block's first key never see it.
  const int64_t t_begin = (P.causal && P.kept == nullptr) ? s_first / QT * QT : 0;
  const int64_t tiles = P.T > t_begin ? (P.T - t_begin + QT - 1) / QT : 0;
  const float inv_S = 1.0f / static_cast<float>(P.S);
  if (tiles > 0) load_tile(0, t_begin);
  cp_async_commit();  // the block's keys and the first query tile
  const FragPos k_row = ldsm_k_row(lane), a_row = ldsm_a_row(lane), v_row = ldsm_v_row(lane);
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t t0 = t_begin + j * QT;
    if (j + 1 < tiles) load_tile(static_cast<int>((j + 1) & 1), t0 + QT);
    cp_async_commit();
    cp_async_wait_one();
    __syncthreads();
    const uint16_t* qs = qbuf + (j & 1) * 2 * kQ;
    const uint16_t* gs = qs + kQ;
    const float* f = fbuf + (j & 1) * 4 * QT;
    const int32_t* fl = reinterpret_cast<const int32_t*>(f);
    // Does a query of the tile keep a key of this warp? (Each row keeps a prefix of the keys.)
    bool any = false;
    for (int q = lane; q < QT; q += kWarp)
      any |= fl[2 * QT + q] > s_warp;
    if (__any_sync(0xffffffffu, any)) {
      float sc[kQTiles][4], dp[kQTiles][4];
#pragma unroll
      for (int n = 0; n < kQTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc) {
        uint32_t ka[4], va[4];
        ldsm_x4(ka, ks + (warp * 16 + a_row.row) * ld + kc * 16 + a_row.col);
        ldsm_x4(va, vs + (warp * 16 + a_row.row) * ld + kc * 16 + a_row.col);
#pragma unroll
        for (int np = 0; np < kQTiles / 2; ++np) {
          uint32_t r[4];
          ldsm_x4(r, qs + (np * 16 + k_row.row) * ld + kc * 16 + k_row.col);
          mma_bf16(sc[2 * np], ka, r[0], r[1]);
          mma_bf16(sc[2 * np + 1], ka, r[2], r[3]);
          ldsm_x4(r, gs + (np * 16 + k_row.row) * ld + kc * 16 + k_row.col);
          mma_bf16(dp[2 * np], va, r[0], r[1]);
          mma_bf16(dp[2 * np + 1], va, r[2], r[3]);
        }
      }
      uint32_t pa[QT / 16][4], da[QT / 16][4];
#pragma unroll
      for (int n = 0; n < kQTiles; ++n) {
        float pe[4], de[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int q = n * 8 + mma_c_pos(lane, e).col;  // the query within the tile
          const int64_t s = keys[e >> 1];
          float pz = 0.0f, ds = 0.0f;
          if (s < fl[2 * QT + q]) {  // s < the row's limit (0 past T)
            const bool uniform = fl[3 * QT + q] != 0;
            const float pv = uniform ? inv_S : expf(sc[n][e] * P.scale - f[q]);
            const float z = P.p > 0.0f ? P.dropout_z(offset, b, t0 + q, s) : 1.0f;
            pz = pv * z;
            if (!uniform) ds = pv * (dp[n][e] * z - f[QT + q]);
          }
          pe[e] = pz;
          de[e] = ds;
        }
        pa[n / 2][p_reg_of(n, 0)] = pack_bf16(pe[0], pe[1]);
        pa[n / 2][p_reg_of(n, 2)] = pack_bf16(pe[2], pe[3]);
        da[n / 2][p_reg_of(n, 0)] = pack_bf16(de[0], de[1]);
        da[n / 2][p_reg_of(n, 2)] = pack_bf16(de[2], de[3]);
      }
#pragma unroll
      for (int np = 0; np < kOutTiles / 2; ++np)
#pragma unroll
        for (int kc = 0; kc < QT / 16; ++kc) {
          uint32_t r[4];
          ldsm_x4_trans(r, gs + (kc * 16 + v_row.row) * ld + np * 16 + v_row.col);
          mma_bf16(dv[2 * np], pa[kc], r[0], r[1]);
          mma_bf16(dv[2 * np + 1], pa[kc], r[2], r[3]);
          ldsm_x4_trans(r, qs + (kc * 16 + v_row.row) * ld + np * 16 + v_row.col);
          mma_bf16(dk[2 * np], da[kc], r[0], r[1]);
          mma_bf16(dk[2 * np + 1], da[kc], r[2], r[3]);
        }
    }
    __syncthreads();  // every warp is done with buffer j & 1 before tile j + 2 goes there
  }
  asm volatile("cp.async.wait_all;\n" ::);  // no copy outlives the block (no query tile: T = 0)

  uint16_t* dkb = P.dk + P.row_off(b, P.dk_sb, P.dk_sh);
  uint16_t* dvb = P.dv + P.row_off(b, P.dv_sb, P.dv_sh);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t s = keys[i];
    if (s >= P.S) continue;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      const int col = n * 8 + mma_c_pos(lane, 2 * i).col;
      *reinterpret_cast<uint32_t*>(dkb + s * P.dk_st + col) =
          pack_bf16(dk[n][2 * i] * P.scale, dk[n][2 * i + 1] * P.scale);
      *reinterpret_cast<uint32_t*>(dvb + s * P.dv_st + col) =
          pack_bf16(dv[n][2 * i], dv[n][2 * i + 1]);
    }
  }
}

// Query tile of the dK/dV kernel: 64 rows, 32 at D = 128 (its dK and dV accumulators take 128
// registers a thread already).
constexpr int bwd_query_tile(int D) {
  return D == 128 ? 32 : 64;
}

template <int D>
size_t dkdv_smem() {
  constexpr int ld = D + kPad, QT = bwd_query_tile(D);
  return static_cast<size_t>(2 * kMmaKeys * ld + 4 * QT * ld) * sizeof(uint16_t) +
         static_cast<size_t>(2 * 4 * QT) * sizeof(float);
}

template <int D>
void launch_mma_backward(const MmaParams& P, void* stream) {
  const char* op = "cuda::flash_attention_backward";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t dq_smem = flash_mma_smem(D);
  static const cudaError_t dq_opted = opt_in_smem(flash_mma_dq_kernel<D>, dq_smem);
  ATTN_CUDA_CHECK(op, dq_opted);
  const dim3 dq_grid(static_cast<unsigned>(ceil_div(P.T, kMmaRows)), static_cast<unsigned>(P.B));
  flash_mma_dq_kernel<D><<<dq_grid, kWarp * kMmaWarps, dq_smem, s>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
  constexpr int QT = bwd_query_tile(D);
  const size_t kv_smem = dkdv_smem<D>();
  static const cudaError_t kv_opted = opt_in_smem(flash_mma_dkdv_kernel<D, QT>, kv_smem);
  ATTN_CUDA_CHECK(op, kv_opted);
  const dim3 kv_grid(static_cast<unsigned>(ceil_div(P.S, kMmaKeys)), static_cast<unsigned>(P.B));
  flash_mma_dkdv_kernel<D, QT><<<kv_grid, kWarp * kMmaWarps, kv_smem, s>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

size_t flash_mma_smem(int64_t D) {
  return static_cast<size_t>(2 * 2 * kMmaKeys * (D + kPad)) * sizeof(uint16_t);
}

namespace {
// A/B: the environment variable read once (a getenv per launch cost as much as a small kernel),
// then flash_mma_set_simt_only (bench_cuda times both kernels in one process).
std::atomic<bool> simt_only{std::getenv("ATTN_CUDA_SIMT_ATTENTION") != nullptr};
}  // namespace

void flash_mma_set_simt_only(bool on) {
  simt_only.store(on, std::memory_order_relaxed);
}

bool flash_mma_supports(const AttentionArgs<uint16_t>& a) {
  if (simt_only.load(std::memory_order_relaxed)) return false;
  if (a.D != a.Dv || (a.D != 32 && a.D != 64 && a.D != 128)) return false;
  if (a.q.sd != 1 || a.k.sd != 1 || a.v.sd != 1 || a.out.sd != 1) return false;
  // 32-bit loads and stores of bf16 pairs: even strides and 4-byte aligned bases.
  for (const void* p : {static_cast<const void*>(a.q.data), static_cast<const void*>(a.k.data),
                        static_cast<const void*>(a.v.data), static_cast<const void*>(a.out.data)})
    if (reinterpret_cast<uintptr_t>(p) % 4 != 0) return false;
  for (int64_t s : {a.q.sb, a.q.sh, a.q.st, a.out.sb, a.out.sh, a.out.st})
    if (s % 2 != 0) return false;
  // K and V by 16-byte copies: 16-byte aligned bases, strides of whole 8-element pieces.
  for (const void* p : {static_cast<const void*>(a.k.data), static_cast<const void*>(a.v.data)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  for (int64_t s : {a.k.sb, a.k.sh, a.k.st, a.v.sb, a.v.sh, a.v.st})
    if (s % 8 != 0) return false;
  return true;
}

namespace {
MmaParams mma_params(const AttentionArgs<uint16_t>& a) {
  MmaParams P{};
  P.B = a.B;
  P.T = a.T;
  P.S = a.S;
  P.heads = a.heads;
  P.kept = a.kept_keys;
  P.causal = a.causal;
  P.zero_rows = a.zero_masked_rows();
  P.scale = a.scale;
  P.p = a.dropout;
  P.seed = a.seed;
  P.offset = a.offset;
  P.offset_dev = a.dropout_offset_device;
  P.drop = DropoutIndexer{a.dropout_index_base,
                          a.T,
                          a.S,
                          a.dropout_window.rows,
                          a.dropout_window.cols,
                          a.dropout_window.t0,
                          a.dropout_window.s0};
  P.q = a.q.data;
  P.k = a.k.data;
  P.v = a.v.data;
  P.out = a.out.data;
  P.q_sb = a.q.sb;
  P.q_sh = a.q.sh;
  P.q_st = a.q.st;
  P.k_sb = a.k.sb;
  P.k_sh = a.k.sh;
  P.k_st = a.k.st;
  P.v_sb = a.v.sb;
  P.v_sh = a.v.sh;
  P.v_st = a.v.st;
  P.o_sb = a.out.sb;
  P.o_sh = a.out.sh;
  P.o_st = a.out.st;
  P.lse = a.lse;
  return P;
}
}  // namespace

void flash_mma_forward(const AttentionArgs<uint16_t>& a, void* stream) {
  const MmaParams P = mma_params(a);
  if (a.B == 0 || a.T == 0) return;
  if (a.D == 32)
    launch_mma<32>(P, stream);
  else if (a.D == 64)
    launch_mma<64>(P, stream);
  else
    launch_mma<128>(P, stream);
}

bool flash_mma_backward_supports(const AttentionArgs<uint16_t>& a,
                                 const AttentionGradArgs<uint16_t>& g) {
  if (!flash_mma_supports(a)) return false;
  // The dK/dV kernel keeps each query's key limit (<= S) as a 32-bit integer.
  if (a.S >= (int64_t{1} << 31)) return false;
  if (g.dout.sd != 1 || g.dq.sd != 1 || g.dk.sd != 1 || g.dv.sd != 1) return false;
  // Q and dO rows also come by 16-byte copies (the dK/dV kernel's query tiles).
  for (const void* p : {static_cast<const void*>(a.q.data), static_cast<const void*>(g.dout.data)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  for (int64_t s : {a.q.sb, a.q.sh, a.q.st, g.dout.sb, g.dout.sh, g.dout.st})
    if (s % 8 != 0) return false;
  // The gradients are stored as bf16 pairs: 4-byte words.
  for (const void* p : {static_cast<const void*>(g.dq.data), static_cast<const void*>(g.dk.data),
                        static_cast<const void*>(g.dv.data)})
    if (reinterpret_cast<uintptr_t>(p) % 4 != 0) return false;
  for (int64_t s :
       {g.dq.sb, g.dq.sh, g.dq.st, g.dk.sb, g.dk.sh, g.dk.st, g.dv.sb, g.dv.sh, g.dv.st})
    if (s % 2 != 0) return false;
  return true;
}

void flash_mma_backward(const AttentionArgs<uint16_t>& a, const AttentionGradArgs<uint16_t>& g,
                        const float* delta, void* stream) {
  MmaParams P = mma_params(a);
  P.dout = g.dout.data;
  P.g_sb = g.dout.sb;
  P.g_sh = g.dout.sh;
  P.g_st = g.dout.st;
  P.dq = g.dq.data;
  P.dq_sb = g.dq.sb;
  P.dq_sh = g.dq.sh;
  P.dq_st = g.dq.st;
  P.dk = g.dk.data;
  P.dk_sb = g.dk.sb;
  P.dk_sh = g.dk.sh;
  P.dk_st = g.dk.st;
  P.dv = g.dv.data;
  P.dv_sb = g.dv.sb;
  P.dv_sh = g.dv.sh;
  P.dv_st = g.dv.st;
  P.delta = delta;
  if (a.B == 0 || a.T == 0 || a.S == 0) return;
  if (a.D == 32)
    launch_mma_backward<32>(P, stream);
  else if (a.D == 64)
    launch_mma_backward<64>(P, stream);
  else
    launch_mma_backward<128>(P, stream);
}

}  // namespace attn::cuda
