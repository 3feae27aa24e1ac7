// Row-wise and elementwise ops of the d2l encoder on CUDA (kernels.hpp has each contract): dropout
// on the CPU's Philox stream, embedding, sinusoidal encoding, LayerNorm / AddNorm, masked softmax,
// cross-entropy. Row ops take a warp a row (launch.hpp: rows_config), reducing with shuffles.
//
// Glossary: R rows, E row width, S keys of a softmax row, N tokens, V classes, n elements.
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/kernels.hpp"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/warp_reduce.cuh"

#include <cuda_runtime.h>

#include <algorithm>

namespace attn::cuda {
namespace {

cudaStream_t as_stream(StreamHandle s) {
  return static_cast<cudaStream_t>(s);
}

// ---- dropout ---------------------------------------------------------------------------------
__global__ void dropout_kernel(const float* x, float* y, int64_t n, float p, uint64_t seed,
                               uint64_t offset, uint64_t base) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    y[i] = x[i] * dropout_factor(seed, offset, base + static_cast<uint64_t>(i), p);
}

// ---- embedding and positional encoding ---------------------------------------------------------
__global__ void embedding_forward_kernel(const int64_t* ids, const float* w, float* out, int64_t N,
                                         int64_t E) {
  for (int64_t i = grid_start(); i < N * E; i += grid_step()) {
    const int64_t n = i / E, e = i - n * E;
    out[i] = w[ids[n] * E + e];
  }
}
__global__ void embedding_backward_kernel(const float* dout, const int64_t* ids, float* dw,
                                          int64_t N, int64_t E) {
  for (int64_t i = grid_start(); i < N * E; i += grid_step()) {
    const int64_t n = i / E, e = i - n * E;
    atomicAdd(dw + ids[n] * E + e, dout[i]);
  }
}
// P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(same angle); angles in double, as the CPU's
// sinusoidal_exact computes them.
__global__ void sinusoidal_kernel(float* P, int64_t positions, int64_t dim) {
  for (int64_t idx = grid_start(); idx < positions * dim; idx += grid_step()) {
    const int64_t i = idx / dim, c = idx - i * dim;
    const int64_t j2 = c - (c & 1);
    const double angle =
        static_cast<double>(i) / pow(10000.0, static_cast<double>(j2) / static_cast<double>(dim));
    P[idx] = static_cast<float>((c & 1) ? cos(angle) : sin(angle));
  }
}
__global__ void add_positional_kernel(const float* x, const float* P, float* y, int64_t B,
                                      int64_t T, int64_t E, float x_scale) {
  for (int64_t i = grid_start(); i < B * T * E; i += grid_step()) {
    const int64_t te = i % (T * E);
    y[i] = x[i] * x_scale + P[te];
  }
}

// ---- LayerNorm / AddNorm ------------------------------------------------------------------------
// Statistics by Welford per lane, combined across the warp (WelfordState::combine).
__global__ void layer_norm_forward_kernel(const float* x, const float* residual, float* sum,
                                          const float* gamma, const float* beta, float* y,
                                          float* mean_out, float* rstd_out, int64_t R, int64_t E,
                                          float eps) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const float* xr = x + r * E;
  WelfordState st;
  for (int64_t e = lane; e < E; e += kWarp) {
    float v = xr[e];
    if (residual != nullptr) {
      v += residual[r * E + e];
      if (sum != nullptr) sum[r * E + e] = v;
    }
    st.add(v);
  }
  for (int o = 16; o > 0; o >>= 1) {
    WelfordState other;
    other.mean = __shfl_xor_sync(kFullWarp, st.mean, o);
    other.m2 = __shfl_xor_sync(kFullWarp, st.m2, o);
    other.count = __shfl_xor_sync(kFullWarp, st.count, o);
    st = WelfordState::combine(st, other);
  }
  const float mean = st.mean, rstd = rsqrtf(st.variance() + eps);
  for (int64_t e = lane; e < E; e += kWarp) {
    const float v = residual != nullptr ? xr[e] + residual[r * E + e] : xr[e];
    float o = (v - mean) * rstd;
    if (gamma != nullptr) o = o * gamma[e] + beta[e];
    y[r * E + e] = o;
  }
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}
// In the forward this was y = xhat * gamma + beta with xhat = (x - mean) * rstd; so with
// g = dy * gamma: dx = rstd * (g - mean_e(g) - xhat * mean_e(g * xhat)).
__global__ void layer_norm_backward_kernel(const float* dy, const float* x, const float* gamma,
                                           const float* mean, const float* rstd, float* dx,
                                           int64_t R, int64_t E) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const float m = mean[r], s = rstd[r];
  float g_sum = 0.0f, gx_sum = 0.0f;
  for (int64_t e = lane; e < E; e += kWarp) {
    const float xhat = (x[r * E + e] - m) * s;
    const float g = gamma != nullptr ? dy[r * E + e] * gamma[e] : dy[r * E + e];
    g_sum += g;
    gx_sum += g * xhat;
  }
  const float g_mean = warp_sum(g_sum) / static_cast<float>(E);
  const float gx_mean = warp_sum(gx_sum) / static_cast<float>(E);
  for (int64_t e = lane; e < E; e += kWarp) {
    const float xhat = (x[r * E + e] - m) * s;
    const float g = gamma != nullptr ? dy[r * E + e] * gamma[e] : dy[r * E + e];
    dx[r * E + e] = s * (g - g_mean - xhat * gx_mean);
  }
}
// dgamma[e] = sum_r dy * xhat, dbeta[e] = sum_r dy: a block per 32 columns and chunk of rows
// (blockIdx.y), its 32 x 32 threads take every 32nd row of the chunk (8 independent sums each, so
// that loads overlap), then a fixed tree over the row groups; the chunk's sums go to row
// blockIdx.y of dgamma / dbeta (E apart), which ln_param_sum_kernel adds in order. Deterministic.
constexpr int kParamRowGroups = 32;
__global__ void layer_norm_param_grad_kernel(const float* dy, const float* x, const float* mean,
                                             const float* rstd, float* dgamma, float* dbeta,
                                             int64_t R, int64_t E, int64_t chunk_rows) {
  __shared__ float sg[kParamRowGroups][kWarp + 1], sb[kParamRowGroups][kWarp + 1];
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  const int group = static_cast<int>(threadIdx.y);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < R ? r0 + chunk_rows : R;
  float dg[8] = {}, db[8] = {};
  if (e < E) {
    int64_t r = r0 + group;
    for (; r + 7 * kParamRowGroups < r1; r += 8 * kParamRowGroups) {
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int64_t rr = r + u * kParamRowGroups;
        const float g = dy[rr * E + e];
        dg[u] += g * (x[rr * E + e] - mean[rr]) * rstd[rr];
        db[u] += g;
      }
    }
    for (int u = 0; r < r1; r += kParamRowGroups, ++u) {
      const float g = dy[r * E + e];
      dg[u] += g * (x[r * E + e] - mean[r]) * rstd[r];
      db[u] += g;
    }
  }
  sg[group][threadIdx.x] =
      ((dg[0] + dg[1]) + (dg[2] + dg[3])) + ((dg[4] + dg[5]) + (dg[6] + dg[7]));
  sb[group][threadIdx.x] =
      ((db[0] + db[1]) + (db[2] + db[3])) + ((db[4] + db[5]) + (db[6] + db[7]));
  __syncthreads();
  for (int half = kParamRowGroups / 2; half > 0; half /= 2) {
    if (group < half) {
      sg[group][threadIdx.x] += sg[group + half][threadIdx.x];
      sb[group][threadIdx.x] += sb[group + half][threadIdx.x];
    }
    __syncthreads();
  }
  if (group == 0 && e < E) {
    if (dgamma != nullptr) dgamma[blockIdx.y * E + e] = sg[0][threadIdx.x];
    if (dbeta != nullptr) dbeta[blockIdx.y * E + e] = sb[0][threadIdx.x];
  }
}
// out[e] = sum over the chunks c of part[c * E + e], in chunk order.
__global__ void ln_param_sum_kernel(const float* part, float* out, int64_t chunks, int64_t E) {
  for (int64_t e = grid_start(); e < E; e += grid_step()) {
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c)
      acc += part[c * E + e];
    out[e] = acc;
  }
}

// ---- masked softmax -----------------------------------------------------------------------------
__global__ void masked_softmax_forward_kernel(const float* x, float* y, const int32_t* kept,
                                              bool zero_rows, int64_t R, int64_t S) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const int64_t n = kept_keys(kept, r, S);
  if (n == 0) {  // d2l: every score ties at -1e6, so 1/S everywhere; SDPA's policy: zeros
    const float fill = zero_rows ? 0.0f : 1.0f / static_cast<float>(S);
    for (int64_t s = lane; s < S; s += kWarp)
      y[r * S + s] = fill;
    return;
  }
  float m = -INFINITY;
  for (int64_t s = lane; s < n; s += kWarp)
    m = fmaxf(m, x[r * S + s]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t s = lane; s < n; s += kWarp)
    sum += expf(x[r * S + s] - m);
  const float inv = 1.0f / warp_sum(sum);
  for (int64_t s = lane; s < S; s += kWarp)
    y[r * S + s] = s < n ? expf(x[r * S + s] - m) * inv : 0.0f;
}
// dx = y * (dy - sum_s dy * y) over the kept keys; masked keys (and rows without keys, whose
// weights are constants) get no gradient.
__global__ void masked_softmax_backward_kernel(const float* dy, const float* y, float* dx,
                                               const int32_t* kept, int64_t R, int64_t S) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const int64_t n = kept_keys(kept, r, S);
  float dot = 0.0f;
  for (int64_t s = lane; s < n; s += kWarp)
    dot += dy[r * S + s] * y[r * S + s];
  dot = warp_sum(dot);
  for (int64_t s = lane; s < S; s += kWarp)
    dx[r * S + s] = s < n ? y[r * S + s] * (dy[r * S + s] - dot) : 0.0f;
}

// ---- cross-entropy ------------------------------------------------------------------------------
__device__ float row_logsumexp(const float* z, int64_t V, int lane) {
  float m = -INFINITY;
  for (int64_t c = lane; c < V; c += kWarp)
    m = fmaxf(m, z[c]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t c = lane; c < V; c += kWarp)
    sum += expf(z[c] - m);
  return m + logf(warp_sum(sum));
}
__global__ void cross_entropy_forward_kernel(const float* logits, const int64_t* targets,
                                             const uint8_t* keep, float* loss, int64_t N,
                                             int64_t V) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= N) return;
  if (keep != nullptr && keep[r] == 0) {
    if (lane == 0) loss[r] = 0.0f;
    return;
  }
  const float lse = row_logsumexp(logits + r * V, V, lane);
  if (lane == 0) loss[r] = lse - logits[r * V + targets[r]];
}
__global__ void cross_entropy_backward_kernel(const float* logits, const int64_t* targets,
                                              const uint8_t* keep, float* dlogits, int64_t N,
                                              int64_t V, float scale, const float* scale_dev) {
  const int64_t r = warp_row();
  if (scale_dev != nullptr) scale = *scale_dev;
  const int lane = lane_id();
  if (r >= N) return;
  if (keep != nullptr && keep[r] == 0) {
    for (int64_t c = lane; c < V; c += kWarp)
      dlogits[r * V + c] = 0.0f;
    return;
  }
  const float lse = row_logsumexp(logits + r * V, V, lane);
  const int64_t target = targets[r];
  for (int64_t c = lane; c < V; c += kWarp)
    dlogits[r * V + c] = scale * (expf(logits[r * V + c] - lse) - (c == target ? 1.0f : 0.0f));
}

}  // namespace

void dropout_forward(const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset,
                     uint64_t index_base, StreamHandle s) {
  launch_elementwise("cuda::dropout_forward", n, s, dropout_kernel, x, y, n, p, seed, offset,
                     index_base);
}
void dropout_backward(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                      uint64_t offset, uint64_t index_base, StreamHandle s) {
  // The multiplier is the same function of the index as in the forward: dx = dy * Z.
  launch_elementwise("cuda::dropout_backward", n, s, dropout_kernel, dy, dx, n, p, seed, offset,
                     index_base);
}
void embedding_forward(const int64_t* ids, const float* weight, float* out, int64_t N, int64_t E,
                       StreamHandle s) {
  launch_elementwise("cuda::embedding_forward", N * E, s, embedding_forward_kernel, ids, weight,
                     out, N, E);
}
void embedding_backward(const float* dout, const int64_t* ids, float* dweight, int64_t N, int64_t E,
                        StreamHandle s) {
  launch_elementwise("cuda::embedding_backward", N * E, s, embedding_backward_kernel, dout, ids,
                     dweight, N, E);
}
void sinusoidal_encoding(float* P, int64_t positions, int64_t dim, StreamHandle s) {
  launch_elementwise("cuda::sinusoidal_encoding", positions * dim, s, sinusoidal_kernel, P,
                     positions, dim);
}
void add_positional(const float* x, const float* P, float* y, int64_t B, int64_t T, int64_t E,
                    float x_scale, StreamHandle s) {
  launch_elementwise("cuda::add_positional", B * T * E, s, add_positional_kernel, x, P, y, B, T, E,
                     x_scale);
}
void layer_norm_forward(const float* x, const float* residual, float* sum, const float* gamma,
                        const float* beta, float* y, float* mean, float* rstd, int64_t R, int64_t E,
                        float eps, StreamHandle s) {
  launch_rows("cuda::layer_norm_forward", R, s, layer_norm_forward_kernel, x, residual, sum, gamma,
              beta, y, mean, rstd, R, E, eps);
}
void layer_norm_backward(const float* dy, const float* x, const float* gamma, const float* mean,
                         const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t R,
                         int64_t E, StreamHandle s) {
  launch_rows("cuda::layer_norm_backward", R, s, layer_norm_backward_kernel, dy, x, gamma, mean,
              rstd, dx, R, E);
  layer_norm_param_grads(dy, x, mean, rstd, dgamma, dbeta, R, E, nullptr, s);
}
void layer_norm_param_grads(const float* dy, const float* x, const float* mean, const float* rstd,
                            float* dgamma, float* dbeta, int64_t R, int64_t E, float* scratch,
                            StreamHandle s) {
  if ((dgamma == nullptr && dbeta == nullptr) || E <= 0) return;
  // With scratch, chunks of rows run side by side (enough blocks for the GPU), summed after.
  const int64_t chunks =
      scratch == nullptr ? 1 : std::min<int64_t>(kLayerNormChunks, ceil_div(R, 256));
  const int64_t chunk_rows = chunks > 1 ? ceil_div(R, chunks) : (R > 0 ? R : 1);
  const dim3 grid(static_cast<unsigned>(ceil_div(E, kWarp)), static_cast<unsigned>(chunks));
  const dim3 block(kWarp, kParamRowGroups);
  float* pg = chunks > 1 ? scratch : dgamma;
  float* pb = chunks > 1 ? (dbeta != nullptr ? scratch + kLayerNormChunks * E : nullptr) : dbeta;
  if (chunks > 1 && dgamma == nullptr) pg = nullptr;
  layer_norm_param_grad_kernel<<<grid, block, 0, as_stream(s)>>>(dy, x, mean, rstd, pg, pb, R, E,
                                                                 chunk_rows);
  ATTN_CUDA_CHECK_LAUNCH("cuda::layer_norm_backward");
  if (chunks > 1) {
    if (dgamma != nullptr)
      launch_elementwise("cuda::layer_norm_backward", E, s, ln_param_sum_kernel, pg, dgamma, chunks,
                         E);
    if (dbeta != nullptr)
      launch_elementwise("cuda::layer_norm_backward", E, s, ln_param_sum_kernel, pb, dbeta, chunks,
                         E);
  }
}
void masked_softmax_forward(const float* x, float* y, const int32_t* kept,
                            kernels::MaskedRows policy, int64_t R, int64_t S, StreamHandle s) {
  launch_rows("cuda::masked_softmax_forward", R, s, masked_softmax_forward_kernel, x, y, kept,
              policy == kernels::MaskedRows::kZero, R, S);
}
void masked_softmax_backward(const float* dy, const float* y, float* dx, const int32_t* kept,
                             int64_t R, int64_t S, StreamHandle s) {
  launch_rows("cuda::masked_softmax_backward", R, s, masked_softmax_backward_kernel, dy, y, dx,
              kept, R, S);
}
void cross_entropy_forward(const float* logits, const int64_t* targets, const uint8_t* keep,
                           float* loss, int64_t N, int64_t V, StreamHandle s) {
  launch_rows("cuda::cross_entropy_forward", N, s, cross_entropy_forward_kernel, logits, targets,
              keep, loss, N, V);
}
void cross_entropy_backward(const float* logits, const int64_t* targets, const uint8_t* keep,
                            float* dlogits, int64_t N, int64_t V, float scale, StreamHandle s) {
  launch_rows("cuda::cross_entropy_backward", N, s, cross_entropy_backward_kernel, logits, targets,
              keep, dlogits, N, V, scale, static_cast<const float*>(nullptr));
}

void cross_entropy_backward(const float* logits, const int64_t* targets, const uint8_t* keep,
                            float* dlogits, int64_t N, int64_t V, const float* scale,
                            StreamHandle s) {
  launch_rows("cuda::cross_entropy_backward", N, s, cross_entropy_backward_kernel, logits, targets,
              keep, dlogits, N, V, 0.0f, scale);
}

}  // namespace attn::cuda
