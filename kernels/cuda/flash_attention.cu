// Fused attention on CUDA: forward, backward and the decode step, float arithmetic on float or
// bf16 tensors, for the problem of kernels/attention_problem.hpp (its header has the formulas).
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys, D head dim, Dv value width.
//
// The schedule (FlashAttention-2, Dao 2023, on SIMT lanes; launch.hpp has the constants):
//   forward   block = 16 query rows of one b, 4 per warp. Keys stream through shared memory in
//             tiles of 32; lane j scores key j of the tile against a row, the warp reduces the
//             tile's max and sum (online softmax), and each lane accumulates Dv / 32 output
//             columns from the tile's weights broadcast by shuffles. Causal and length masks keep
//             a prefix of the keys, so a block stops at its rows' largest limit.
//   backward  delta = rowsum(dO * O) first; then two kernels that recompute the weights from lse:
//             dQ over query blocks (the forward's shape) and dK, dV over key blocks (queries
//             stream through shared memory). No atomics: every gradient element has one writer,
//             so results are the same bits on every run. bf16 at D = Dv in {32, 64, 128} runs
//             the same two passes on tensor cores (flash_mma.cu), as the forward does.
//   decode    block = one (b, t) row; keys in chunks of 1024: each thread scores its own keys into
//             shared memory, the block reduces max and sum, the warps accumulate interleaved
//             keys' V rows into their lanes' columns, then add their rows in order.
// Dropout multiplies the normalised weights by Z (0 or 1/(1-p)) from the Philox dropout stream at
// the CPU's index for (b, t, s), so the CUDA and CPU paths drop the same weights.
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/flash_mma.hpp"
#include "kernels/cuda/kernels.hpp"
#include "kernels/cuda/launch.hpp"

#include <cuda_runtime.h>

#include <type_traits>

namespace attn::cuda {
namespace {

using kernels::AttentionArgs;
using kernels::AttentionGradArgs;
using kernels::StridedView;

constexpr unsigned kFull = 0xffffffffu;

template <class E>
struct FlashParams {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0, heads = 1;
  const int32_t* kept = nullptr;
  bool causal = false, zero_rows = false;
  float scale = 1.0f;
  float p = 0.0f;
  uint64_t seed = 0, offset = 0;
  const uint64_t* offset_dev = nullptr;  // AttentionProblem::dropout_offset_device
  DropoutIndexer drop;
  StridedView<const E> q, k, v;
  StridedView<E> out;
  float* lse = nullptr;
  // backward only
  StridedView<const E> dout;
  StridedView<E> dq, dk, dv;
  float* delta = nullptr;

  __device__ int64_t row_off(int64_t b, int64_t sb, int64_t sh) const {
    return heads == 1 ? b * sb : (b / heads) * sb + (b % heads) * sh;
  }
  // Keys [0, limit) of row (b, t) enter the softmax; *uniform marks a row without kept keys under
  // d2l's policy: weight 1/S on every key (all scores tie), so its limit becomes S.
  __device__ int64_t limit(int64_t b, int64_t t, bool* uniform) const {
    int64_t lim = row_limit(kept, causal, b, t, T, S);
    *uniform = lim == 0 && !zero_rows;
    return *uniform ? S : lim;
  }
  __device__ float dropout_z(int64_t b, int64_t t, int64_t s) const {
    const uint64_t off = offset_dev != nullptr ? *offset_dev + offset : offset;
    return dropout_factor(seed, off, drop(b, t, s), p);
  }
};

__device__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1)
    x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}
__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1)
    x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Rows [first, first + rows) of a strided view into shared memory as float, `ld` floats apart;
// rows past `count` are zero.
template <class E>
__device__ void load_rows(float* dst, int64_t ld, const E* base, int64_t st, int64_t sd,
                          int64_t first, int64_t rows, int64_t count, int64_t width) {
  for (int64_t i = threadIdx.x; i < rows * width; i += blockDim.x) {
    const int64_t r = i / width, d = i - r * width;
    const int64_t row = first + r;
    dst[r * ld + d] = row < count ? load_f(base + row * st + d * sd) : 0.0f;
  }
}

template <class E>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    flash_forward_kernel(const FlashParams<E> P) {
  extern __shared__ float smem[];
  const int64_t b = blockIdx.y;
  const int64_t t_first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t D = P.D, Dv = P.Dv, ldq = D + 1, ldv = Dv + 1;
  float* qs = smem;                      // (kRowsPerBlock, D)
  float* ks = qs + kRowsPerBlock * ldq;  // (kTile, D)
  float* vs = ks + kTile * ldq;          // (kTile, Dv)

  load_rows(qs, ldq, P.q.data + P.row_off(b, P.q.sb, P.q.sh), P.q.st, P.q.sd, t_first,
            kRowsPerBlock, P.T, D);
  // The keys this block reads: the largest limit among its rows.
  int64_t block_limit = 0;
  for (int r = 0; r < kRowsPerBlock && t_first + r < P.T; ++r) {
    bool u;
    block_limit = max(block_limit, P.limit(b, t_first + r, &u));
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kMaxPerLane];
  int64_t lim[kRowsPerWarp];
  bool uniform[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t_first + warp * kRowsPerWarp + r;
    uniform[r] = false;
    lim[r] = t < P.T ? P.limit(b, t, &uniform[r]) : 0;
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      acc[r][i] = 0.0f;
  }

  const E* kb = P.k.data + P.row_off(b, P.k.sb, P.k.sh);
  const E* vb = P.v.data + P.row_off(b, P.v.sb, P.v.sh);
  for (int64_t s0 = 0; s0 < block_limit; s0 += kTile) {
    __syncthreads();  // the previous tile is consumed (and, the first time, q is loaded)
    load_rows(ks, ldq, kb, P.k.st, P.k.sd, s0, kTile, P.S, D);
    load_rows(vs, ldv, vb, P.v.st, P.v.sd, s0, kTile, P.S, Dv);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (s0 >= lim[r]) continue;  // warp-uniform: lim is a row's
      const int64_t rr = warp * kRowsPerWarp + r;
      const int64_t t = t_first + rr;
      const int64_t s = s0 + lane;
      float score = -INFINITY;
      if (s < lim[r]) {
        if (uniform[r]) {
          score = 0.0f;
        } else {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d)
            dot += qs[rr * ldq + d] * ks[lane * ldq + d];
          score = dot * P.scale;
        }
      }
      // Key s0 < lim is in the tile, so the tile max is finite.
      const float m_new = fmaxf(m[r], warp_max(score));
      float pj = score == -INFINITY ? 0.0f : expf(score - m_new);
      const float alpha = SoftmaxState::rescale(m[r], m_new);
      l[r] = l[r] * alpha + warp_sum(pj);
      m[r] = m_new;
      if (P.p > 0.0f && pj != 0.0f) pj *= P.dropout_z(b, t, s);
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i)
        acc[r][i] *= alpha;
      const int64_t n = lim[r] - s0 < kTile ? lim[r] - s0 : kTile;
      for (int j = 0; j < n; ++j) {
        const float pjj = __shfl_sync(kFull, pj, j);
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
          const int64_t c = lane + kWarp * i;
          if (c < Dv) acc[r][i] += pjj * vs[j * ldv + c];
        }
      }
    }
  }

  E* ob = P.out.data + P.row_off(b, P.out.sb, P.out.sh);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t_first + warp * kRowsPerWarp + r;
    if (t >= P.T) continue;
    const float inv = lim[r] > 0 ? 1.0f / l[r] : 0.0f;  // a kZero row without keys: zeros
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t c = lane + kWarp * i;
      if (c < Dv) store_f(ob + t * P.out.st + c * P.out.sd, acc[r][i] * inv);
    }
    if (lane == 0 && P.lse != nullptr)
      P.lse[b * P.T + t] = (lim[r] == 0 || uniform[r]) ? -INFINITY : m[r] + logf(l[r]);
  }
}

// delta[b, t] = sum_c dO[b, t, c] * O[b, t, c]: a warp a row.
template <class E>
__global__ void flash_delta_kernel(const FlashParams<E> P) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= P.B * P.T) return;
  const int64_t b = row / P.T, t = row % P.T;
  const E* o = P.out.data + P.row_off(b, P.out.sb, P.out.sh) + t * P.out.st;
  const E* g = P.dout.data + P.row_off(b, P.dout.sb, P.dout.sh) + t * P.dout.st;
  float acc = 0.0f;
  for (int64_t c = lane; c < P.Dv; c += kWarp)
    acc += load_f(o + c * P.out.sd) * load_f(g + c * P.dout.sd);
  acc = warp_sum(acc);
  if (lane == 0) P.delta[row] = acc;
}

// dQ: the forward's schedule. In the forward this was out = sum_s P Z v; so with
// dP = Z (dO . v) and dS = P (dP - delta), dq = scale * sum_s dS k.
template <class E>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock) flash_dq_kernel(const FlashParams<E> P) {
  extern __shared__ float smem[];
  const int64_t b = blockIdx.y;
  const int64_t t_first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t D = P.D, Dv = P.Dv, ldq = D + 1, ldv = Dv + 1;
  float* qs = smem;                      // (kRowsPerBlock, D)
  float* gs = qs + kRowsPerBlock * ldq;  // (kRowsPerBlock, Dv): dO
  float* ks = gs + kRowsPerBlock * ldv;  // (kTile, D)
  float* vs = ks + kTile * ldq;          // (kTile, Dv)

  load_rows(qs, ldq, P.q.data + P.row_off(b, P.q.sb, P.q.sh), P.q.st, P.q.sd, t_first,
            kRowsPerBlock, P.T, D);
  load_rows(gs, ldv, P.dout.data + P.row_off(b, P.dout.sb, P.dout.sh), P.dout.st, P.dout.sd,
            t_first, kRowsPerBlock, P.T, Dv);
  int64_t block_limit = 0;
  float lse[kRowsPerWarp], delta[kRowsPerWarp], acc[kRowsPerWarp][kMaxPerLane];
  int64_t lim[kRowsPerWarp];
  for (int r = 0; r < kRowsPerBlock && t_first + r < P.T; ++r) {
    bool u;
    const int64_t lr = P.limit(b, t_first + r, &u);
    if (!u) block_limit = max(block_limit, lr);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t_first + warp * kRowsPerWarp + r;
    bool u = false;
    lim[r] = t < P.T ? P.limit(b, t, &u) : 0;
    if (u) lim[r] = 0;  // all scores tie whatever q is: no gradient reaches q
    lse[r] = lim[r] > 0 ? P.lse[b * P.T + t] : 0.0f;
    delta[r] = lim[r] > 0 ? P.delta[b * P.T + t] : 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      acc[r][i] = 0.0f;
  }

  const E* kb = P.k.data + P.row_off(b, P.k.sb, P.k.sh);
  const E* vb = P.v.data + P.row_off(b, P.v.sb, P.v.sh);
  for (int64_t s0 = 0; s0 < block_limit; s0 += kTile) {
    __syncthreads();
    load_rows(ks, ldq, kb, P.k.st, P.k.sd, s0, kTile, P.S, D);
    load_rows(vs, ldv, vb, P.v.st, P.v.sd, s0, kTile, P.S, Dv);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (s0 >= lim[r]) continue;
      const int64_t rr = warp * kRowsPerWarp + r;
      const int64_t t = t_first + rr;
      const int64_t s = s0 + lane;
      float ds = 0.0f;
      if (s < lim[r]) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d)
          dot += qs[rr * ldq + d] * ks[lane * ldq + d];
        const float p = expf(dot * P.scale - lse[r]);
        float dp = 0.0f;
        for (int64_t c = 0; c < Dv; ++c)
          dp += gs[rr * ldv + c] * vs[lane * ldv + c];
        if (P.p > 0.0f) dp *= P.dropout_z(b, t, s);
        ds = p * (dp - delta[r]);
      }
      const int64_t n = lim[r] - s0 < kTile ? lim[r] - s0 : kTile;
      for (int j = 0; j < n; ++j) {
        const float dsj = __shfl_sync(kFull, ds, j);
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
          const int64_t d = lane + kWarp * i;
          if (d < D) acc[r][i] += dsj * ks[j * ldq + d];
        }
      }
    }
  }

  E* gb = P.dq.data + P.row_off(b, P.dq.sb, P.dq.sh);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t_first + warp * kRowsPerWarp + r;
    if (t >= P.T) continue;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t d = lane + kWarp * i;
      if (d < D) store_f(gb + t * P.dq.st + d * P.dq.sd, acc[r][i] * P.scale);
    }
  }
}

// dK and dV over key blocks; queries stream through shared memory, lane i taking query i of the
// tile. dv[s] = sum_t P Z dO[t];  dk[s] = scale * sum_t dS q[t]  (dS as in the dQ kernel).
template <class E>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock) flash_dkdv_kernel(const FlashParams<E> P) {
  extern __shared__ float smem[];
  const int64_t b = blockIdx.y;
  const int64_t s_first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t D = P.D, Dv = P.Dv, ldq = D + 1, ldv = Dv + 1;
  float* ks = smem;                      // (kRowsPerBlock, D): this block's keys
  float* vs = ks + kRowsPerBlock * ldq;  // (kRowsPerBlock, Dv)
  float* qs = vs + kRowsPerBlock * ldv;  // (kTile, D): a tile of queries
  float* gs = qs + kTile * ldq;          // (kTile, Dv): their dO
  float* lse_s = gs + kTile * ldv;       // (kTile)
  float* delta_s = lse_s + kTile;        // (kTile)

  load_rows(ks, ldq, P.k.data + P.row_off(b, P.k.sb, P.k.sh), P.k.st, P.k.sd, s_first,
            kRowsPerBlock, P.S, D);
  load_rows(vs, ldv, P.v.data + P.row_off(b, P.v.sb, P.v.sh), P.v.st, P.v.sd, s_first,
            kRowsPerBlock, P.S, Dv);
  float dk[kRowsPerWarp][kMaxPerLane], dv[kRowsPerWarp][kMaxPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      dk[r][i] = dv[r][i] = 0.0f;

  // Purely causal: queries before this block's first key never see it.
  const int64_t t_begin = (P.causal && P.kept == nullptr) ? s_first / kTile * kTile : 0;
  const E* qb = P.q.data + P.row_off(b, P.q.sb, P.q.sh);
  const E* gb = P.dout.data + P.row_off(b, P.dout.sb, P.dout.sh);
  const float inv_S = 1.0f / static_cast<float>(P.S);
  for (int64_t t0 = t_begin; t0 < P.T; t0 += kTile) {
    __syncthreads();
    load_rows(qs, ldq, qb, P.q.st, P.q.sd, t0, kTile, P.T, D);
    load_rows(gs, ldv, gb, P.dout.st, P.dout.sd, t0, kTile, P.T, Dv);
    if (threadIdx.x < kTile) {
      const int64_t t = t0 + threadIdx.x;
      lse_s[threadIdx.x] = t < P.T ? P.lse[b * P.T + t] : 0.0f;
      delta_s[threadIdx.x] = t < P.T ? P.delta[b * P.T + t] : 0.0f;
    }
    __syncthreads();
    const int64_t t = t0 + lane;
    bool uniform = false;
    const int64_t lim = t < P.T ? P.limit(b, t, &uniform) : 0;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t rr = warp * kRowsPerWarp + r;
      const int64_t s = s_first + rr;
      if (s >= P.S) continue;  // warp-uniform
      float pz = 0.0f, ds = 0.0f;
      if (s < lim) {
        float p;
        if (uniform) {
          p = inv_S;  // scores tie: no dS
        } else {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d)
            dot += qs[lane * ldq + d] * ks[rr * ldq + d];
          p = expf(dot * P.scale - lse_s[lane]);
        }
        const float z = P.p > 0.0f ? P.dropout_z(b, t, s) : 1.0f;
        pz = p * z;
        if (!uniform) {
          float dp = 0.0f;
          for (int64_t c = 0; c < Dv; ++c)
            dp += gs[lane * ldv + c] * vs[rr * ldv + c];
          ds = p * (dp * z - delta_s[lane]);
        }
      }
      // Lanes past T hold zeros: no need to bound the loop.
      for (int j = 0; j < kTile; ++j) {
        const float pzj = __shfl_sync(kFull, pz, j);
        const float dsj = __shfl_sync(kFull, ds, j);
        if (pzj == 0.0f && dsj == 0.0f) continue;  // warp-uniform after the shuffles
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
          const int64_t c = lane + kWarp * i;
          if (c < Dv) dv[r][i] += pzj * gs[j * ldv + c];
          if (c < D) dk[r][i] += dsj * qs[j * ldq + c];
        }
      }
    }
  }

  E* dkb = P.dk.data + P.row_off(b, P.dk.sb, P.dk.sh);
  E* dvb = P.dv.data + P.row_off(b, P.dv.sb, P.dv.sh);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t s = s_first + warp * kRowsPerWarp + r;
    if (s >= P.S) continue;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t c = lane + kWarp * i;
      if (c < D) store_f(dkb + s * P.dk.st + c * P.dk.sd, dk[r][i] * P.scale);
      if (c < Dv) store_f(dvb + s * P.dv.st + c * P.dv.sd, dv[r][i]);
    }
  }
}

// Decode: one block per (b, t) row, its keys in chunks of kDecodeChunk. Per chunk every thread
// scores its own keys into shared memory (a key's dot product is one thread's loop, so 256 keys
// are in flight at once instead of one per warp), the block reduces the chunk's max and updates
// the online softmax, and then warp w accumulates keys w, w + kDecodeWarps, ... of the chunk into
// its lanes' output columns (V rows read across the lanes). The warps' sums are added in warp
// order at the end: deterministic.
__device__ float block_reduce(float x, float* red, bool max_op) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  x = max_op ? warp_max(x) : warp_sum(x);
  __syncthreads();  // red may still be read by the previous reduction
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kDecodeWarps; ++w)
    r = max_op ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

template <class E>
__global__ void __launch_bounds__(kWarp* kDecodeWarps) flash_decode_kernel(const FlashParams<E> P) {
  extern __shared__ float smem[];
  const int64_t t = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  float* qs = smem;                  // (D)
  float* sc = qs + P.D;              // (kDecodeChunk) scores, then weights
  float* red = sc + kDecodeChunk;    // (kDecodeWarps)
  float* part = red + kDecodeWarps;  // (kDecodeWarps, Dv)
  bool uniform = false;
  const int64_t lim = P.limit(b, t, &uniform);
  const E* qr = P.q.data + P.row_off(b, P.q.sb, P.q.sh) + t * P.q.st;
  for (int64_t d = tid; d < P.D; d += blockDim.x)
    qs[d] = load_f(qr + d * P.q.sd);
  const E* kb = P.k.data + P.row_off(b, P.k.sb, P.k.sh);
  const E* vb = P.v.data + P.row_off(b, P.v.sb, P.v.sh);
  float acc[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    acc[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  __syncthreads();
  for (int64_t s0 = 0; s0 < lim; s0 += kDecodeChunk) {
    const int n = static_cast<int>(lim - s0 < kDecodeChunk ? lim - s0 : kDecodeChunk);
    // Scores of the chunk, each thread its keys; the chunk's max.
    float cmax = -INFINITY;
    for (int j = tid; j < n; j += blockDim.x) {
      float score = 0.0f;
      if (!uniform) {
        const E* kr = kb + (s0 + j) * P.k.st;
        float dot = 0.0f;
        for (int64_t d = 0; d < P.D; ++d)
          dot += qs[d] * load_f(kr + d * P.k.sd);
        score = dot * P.scale;
      }
      sc[j] = score;
      cmax = fmaxf(cmax, score);
    }
    cmax = block_reduce(cmax, red, true);
    const float m_new = fmaxf(m, cmax);
    const float alpha = SoftmaxState::rescale(m, m_new);
    m = m_new;
    // Weights: exp(score - m) enter l undropped; the dropped ones enter the output.
    float csum = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) {
      float pj = expf(sc[j] - m_new);
      csum += pj;
      if (P.p > 0.0f) pj *= P.dropout_z(b, t, s0 + j);
      sc[j] = pj;
    }
    csum = block_reduce(csum, red, false);  // its __syncthreads also publishes sc
    l = l * alpha + csum;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      acc[i] *= alpha;
#pragma unroll 4
    for (int j = warp; j < n; j += kDecodeWarps) {
      const float pj = sc[j];
      const E* vr = vb + (s0 + j) * P.v.st;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int64_t c = lane + kWarp * i;
        if (c < P.Dv) acc[i] += pj * load_f(vr + c * P.v.sd);
      }
    }
    __syncthreads();  // sc is rewritten by the next chunk
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t c = lane + kWarp * i;
    if (c < P.Dv) part[warp * P.Dv + c] = acc[i];
  }
  __syncthreads();
  const float inv = lim > 0 ? 1.0f / l : 0.0f;
  E* orow = P.out.data + P.row_off(b, P.out.sb, P.out.sh) + t * P.out.st;
  for (int64_t c = tid; c < P.Dv; c += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kDecodeWarps; ++w)
      o += part[w * P.Dv + c];
    store_f(orow + c * P.out.sd, o * inv);
  }
  if (tid == 0 && P.lse != nullptr)
    P.lse[b * P.T + t] = (lim == 0 || uniform) ? -INFINITY : m + logf(l);
}

template <class E>
FlashParams<E> make_params(const AttentionArgs<E>& a, const char* op) {
  require(a.D >= 1 && a.D <= kMaxHeadDim && a.Dv >= 1 && a.Dv <= kMaxHeadDim, op,
          "head dims D and Dv must lie in [1, 256] on CUDA");
  require(a.B <= 65535, op, "B (batch * heads) must be at most 65535 on CUDA");
  require(a.weights == nullptr, op, "the CUDA kernels do not return attention weights");
  require(a.dropout_keep == nullptr, op, "the CUDA kernels draw the dropout stream on both passes");
  FlashParams<E> P;
  P.B = a.B;
  P.T = a.T;
  P.S = a.S;
  P.D = a.D;
  P.Dv = a.Dv;
  P.heads = a.heads;
  P.kept = a.kept_keys;
  P.causal = a.causal;
  P.zero_rows = a.zero_masked_rows();
  P.scale = a.scale;
  P.p = a.dropout;
  P.seed = a.seed;
  P.offset = a.offset;
  P.offset_dev = a.dropout_offset_device;
  P.drop.base = a.dropout_index_base;
  P.drop.T = a.T;
  P.drop.S = a.S;
  P.drop.rows = a.dropout_window.rows;
  P.drop.cols = a.dropout_window.cols;
  P.drop.t0 = a.dropout_window.t0;
  P.drop.s0 = a.dropout_window.s0;
  P.q = a.q;
  P.k = a.k;
  P.v = a.v;
  P.out = a.out;
  P.lse = a.lse;
  return P;
}

// Kernels asking for more than 48 KiB of dynamic shared memory must opt in (D, Dv up to 256 need
// up to ~100 KiB; the H100 offers 227 KiB a block, the A100 163 KiB).
template <class Kernel>
void allow_smem(Kernel kernel, const LaunchConfig& c, const char* op) {
  if (c.smem_bytes > 48 * 1024)
    ATTN_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(c.smem_bytes)));
}

template <class E>
void forward_impl(const AttentionArgs<E>& a, StreamHandle stream) {
  const char* op = "cuda::flash_attention_forward";
  const FlashParams<E> P = make_params(a, op);
  const LaunchConfig c = flash_forward_config(a.B, a.T, a.D, a.Dv, false);
  if (a.B == 0 || a.T == 0) return;
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (flash_mma_supports(a)) {  // bf16 on tensor cores (flash_mma.cu)
      flash_mma_forward(a, stream);
      return;
    }
  }
  allow_smem(flash_forward_kernel<E>, c, op);
  flash_forward_kernel<E><<<dim3(c.grid.x, c.grid.y), dim3(c.block.x), c.smem_bytes,
                            static_cast<cudaStream_t>(stream)>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

template <class E>
void backward_impl(const AttentionArgs<E>& a, const AttentionGradArgs<E>& g, float* delta,
                   StreamHandle stream) {
  const char* op = "cuda::flash_attention_backward";
  FlashParams<E> P = make_params(a, op);
  require(a.lse != nullptr && delta != nullptr, op, "the backward needs lse and delta scratch");
  P.dout = g.dout;
  P.dq = g.dq;
  P.dk = g.dk;
  P.dv = g.dv;
  P.delta = delta;
  if (a.B == 0 || a.T == 0 || a.S == 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const LaunchConfig rc = rows_config(a.B * a.T);
  flash_delta_kernel<E><<<rc.grid.x, rc.block.x, 0, s>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (flash_mma_backward_supports(a, g)) {  // bf16 on tensor cores (flash_mma.cu)
      flash_mma_backward(a, g, delta, stream);
      return;
    }
  }
  const LaunchConfig cq = flash_forward_config(a.B, a.T, a.D, a.Dv, true);
  allow_smem(flash_dq_kernel<E>, cq, op);
  flash_dq_kernel<E><<<dim3(cq.grid.x, cq.grid.y), dim3(cq.block.x), cq.smem_bytes, s>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
  const LaunchConfig ck = flash_dkdv_config(a.B, a.S, a.D, a.Dv);
  allow_smem(flash_dkdv_kernel<E>, ck, op);
  flash_dkdv_kernel<E><<<dim3(ck.grid.x, ck.grid.y), dim3(ck.block.x), ck.smem_bytes, s>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

template <class E>
void decode_impl(const AttentionArgs<E>& a, StreamHandle stream) {
  const char* op = "cuda::flash_attention_decode";
  const FlashParams<E> P = make_params(a, op);
  if (a.B == 0 || a.T == 0) return;
  const LaunchConfig c = flash_decode_config(a.B, a.T, a.D, a.Dv);
  flash_decode_kernel<E><<<dim3(c.grid.x, c.grid.y), dim3(c.block.x), c.smem_bytes,
                           static_cast<cudaStream_t>(stream)>>>(P);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

void flash_attention_forward(const AttentionArgs<float>& a, StreamHandle s) {
  forward_impl(a, s);
}
void flash_attention_forward(const AttentionArgs<uint16_t>& a, StreamHandle s) {
  forward_impl(a, s);
}
void flash_attention_backward(const AttentionArgs<float>& a, const AttentionGradArgs<float>& g,
                              float* delta, StreamHandle s) {
  backward_impl(a, g, delta, s);
}
void flash_attention_backward(const AttentionArgs<uint16_t>& a,
                              const AttentionGradArgs<uint16_t>& g, float* delta, StreamHandle s) {
  backward_impl(a, g, delta, s);
}
void flash_attention_decode(const AttentionArgs<float>& a, StreamHandle s) {
  decode_impl(a, s);
}
void flash_attention_decode(const AttentionArgs<uint16_t>& a, StreamHandle s) {
  decode_impl(a, s);
}

}  // namespace attn::cuda
