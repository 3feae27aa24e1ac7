// The kernels the encoder's training step needs beside ops.cu's (kernels.hpp has each contract):
// ReLU, the classification head's masked mean, the loss mean, and dropout whose stream offset is
// read on the device. Per-step values (the dropout offset, the loss's 1 / n_kept) live in device
// memory, so that a step captured once as a CUDA graph replays with each step's values.
//
// Glossary: B sequences, T positions, E width, N rows, n elements.
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/grid.cuh"
#include "kernels/cuda/kernels.hpp"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/warp_reduce.cuh"

#include <cuda_runtime.h>

namespace attn::cuda {
namespace {

__global__ void relu_forward_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) {
    const float v = x[i];
    y[i] = v > 0.0f ? v : (v == v ? 0.0f : v);  // NaN stays NaN, as torch.relu
  }
}
__global__ void relu_backward_kernel(const float* dy, const float* x, float* dx, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// y = x * Z * scale, Z of stream element index_base + i at offset *offset_base + offset.
__global__ void dropout_at_kernel(const float* x, float* y, int64_t n, float p, uint64_t seed,
                                  const uint64_t* offset_base, uint64_t offset, uint64_t index_base,
                                  float scale) {
  const uint64_t off = *offset_base + offset;
  for (int64_t i = grid_start(); i < n; i += grid_step()) {
    const float z = dropout_factor(seed, off, index_base + static_cast<uint64_t>(i), p);
    y[i] = scale == 1.0f ? x[i] * z : x[i] * z * scale;
  }
}

// pooled[b, e] = (1 / n_b) sum_{t < n_b} X[b, t, e], summed in double (as the CPU head).
__global__ void masked_mean_forward_kernel(const float* X, const int32_t* counts, float* pooled,
                                           int64_t B, int64_t T, int64_t E) {
  for (int64_t i = grid_start(); i < B * E; i += grid_step()) {
    const int64_t b = i / E, e = i - b * E;
    const int64_t n = counts[b];
    double acc = 0.0;
    for (int64_t t = 0; t < n; ++t)
      acc += X[(b * T + t) * E + e];
    pooled[i] = n > 0 ? static_cast<float>(acc / static_cast<double>(n)) : 0.0f;
  }
}
// dX[b, t] = dpooled[b] / n_b for t < n_b, else 0.
__global__ void masked_mean_backward_kernel(const float* dpooled, const int32_t* counts, float* dX,
                                            int64_t B, int64_t T, int64_t E) {
  for (int64_t i = grid_start(); i < B * T * E; i += grid_step()) {
    const int64_t e = i % E, bt = i / E, b = bt / T, t = bt - b * T;
    const int64_t n = counts[b];
    dX[i] = t < n ? static_cast<float>(dpooled[b * E + e] / static_cast<double>(n)) : 0.0f;
  }
}

// A warp a row of the (R, S) scores: y = masked softmax (d2l's policy or zeros for rows without
// kept keys, as masked_softmax_forward), yd = y * Z with Z of stream element r * S + s at offset
// *offset_base + offset (yd may be null when p = 0).
__global__ void softmax_dropout_forward_kernel(const float* x, float* y, float* yd,
                                               const int32_t* kept, bool zero_rows, int64_t R,
                                               int64_t S, float p, uint64_t seed,
                                               const uint64_t* offset_base, uint64_t offset) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const uint64_t off = *offset_base + offset;
  const int64_t n = kept_keys(kept, r, S);
  const float* xr = x + r * S;
  float m = -INFINITY;
  for (int64_t s = lane; s < n; s += kWarp)
    m = fmaxf(m, xr[s]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t s = lane; s < n; s += kWarp)
    sum += expf(xr[s] - m);
  const float inv = n > 0 ? 1.0f / warp_sum(sum) : 0.0f;
  const float fill = zero_rows ? 0.0f : 1.0f / static_cast<float>(S);
  for (int64_t s = lane; s < S; s += kWarp) {
    const float v = n == 0 ? fill : (s < n ? expf(xr[s] - m) * inv : 0.0f);
    y[r * S + s] = v;
    if (yd != nullptr)
      yd[r * S + s] = v * dropout_factor(seed, off, static_cast<uint64_t>(r * S + s), p);
  }
}
// Its backward: dy = dyd * Z, dx = y * (dy - sum_s dy * y) over the kept keys, 0 elsewhere.
__global__ void softmax_dropout_backward_kernel(const float* dyd, const float* y, float* dx,
                                                const int32_t* kept, int64_t R, int64_t S, float p,
                                                uint64_t seed, const uint64_t* offset_base,
                                                uint64_t offset) {
  const int64_t r = warp_row();
  const int lane = lane_id();
  if (r >= R) return;
  const uint64_t off = *offset_base + offset;
  const int64_t n = kept_keys(kept, r, S);
  constexpr int kHeld = 8;  // rows up to 256 keys keep dy in registers between the two passes
  float held[kHeld];
  float dot = 0.0f;
  int j = 0;
  for (int64_t s = lane; s < n; s += kWarp, ++j) {
    const float d = dyd[r * S + s] * dropout_factor(seed, off, static_cast<uint64_t>(r * S + s), p);
    if (j < kHeld) held[j] = d;
    dot += d * y[r * S + s];
  }
  dot = warp_sum(dot);
  j = 0;
  for (int64_t s = lane; s < S; s += kWarp, ++j) {
    float v = 0.0f;
    if (s < n) {
      const float d =
          j < kHeld
              ? held[j]
              : dyd[r * S + s] * dropout_factor(seed, off, static_cast<uint64_t>(r * S + s), p);
      v = y[r * S + s] * (d - dot);
    }
    dx[r * S + s] = v;
  }
}

// parts of (B, T, parts * H * D) rows <-> (parts, B * H, T, D) contiguous heads; `to_heads` picks
// the direction. Element i walks the heads layout, so the heads side is written (or read)
// contiguously; each D-wide row is contiguous on both sides.
__global__ void heads_layout_kernel(const float* src, float* dst, int64_t B, int64_t T, int64_t H,
                                    int64_t D, int64_t parts, bool to_heads) {
  const int64_t per_part = B * H * T * D, width = parts * H * D;
  for (int64_t i = grid_start(); i < parts * per_part; i += grid_step()) {
    const int64_t part = i / per_part, r = i - part * per_part;
    const int64_t d = r % D, row = r / D, t = row % T, bh = row / T, h = bh % H, b = bh / H;
    const int64_t j = (b * T + t) * width + part * H * D + h * D + d;
    if (to_heads)
      dst[i] = src[j];
    else
      dst[j] = src[i];
  }
}

// One block: out[0] = sum of the kept rows' losses / n_kept (double), scale[0] = 1 / n_kept
// (float; 0 when nothing is kept), in a fixed order.
__global__ void loss_mean_kernel(const float* loss, const uint8_t* keep, int64_t N, double* out,
                                 float* scale) {
  __shared__ double ssum[256];
  __shared__ long long scount[256];
  double acc = 0.0;
  long long count = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    if (keep == nullptr || keep[i] != 0) {
      acc += loss[i];
      ++count;
    }
  ssum[threadIdx.x] = acc;
  scount[threadIdx.x] = count;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      ssum[threadIdx.x] += ssum[threadIdx.x + s];
      scount[threadIdx.x] += scount[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double n = static_cast<double>(scount[0]);
    out[0] = n > 0 ? ssum[0] / n : nan("");
    scale[0] = n > 0 ? static_cast<float>(1.0 / n) : 0.0f;
  }
}

}  // namespace

void relu_forward(const float* x, float* y, int64_t n, StreamHandle s) {
  launch_elementwise("cuda::relu_forward", n, s, relu_forward_kernel, x, y, n);
}
void relu_backward(const float* dy, const float* x, float* dx, int64_t n, StreamHandle s) {
  launch_elementwise("cuda::relu_backward", n, s, relu_backward_kernel, dy, x, dx, n);
}
void dropout_at(const float* x, float* y, int64_t n, float p, uint64_t seed,
                const uint64_t* offset_base, uint64_t offset, uint64_t index_base, float scale,
                StreamHandle s) {
  launch_elementwise("cuda::dropout_at", n, s, dropout_at_kernel, x, y, n, p, seed, offset_base,
                     offset, index_base, scale);
}
void masked_mean_forward(const float* X, const int32_t* counts, float* pooled, int64_t B, int64_t T,
                         int64_t E, StreamHandle s) {
  launch_elementwise("cuda::masked_mean_forward", B * E, s, masked_mean_forward_kernel, X, counts,
                     pooled, B, T, E);
}
void masked_mean_backward(const float* dpooled, const int32_t* counts, float* dX, int64_t B,
                          int64_t T, int64_t E, StreamHandle s) {
  launch_elementwise("cuda::masked_mean_backward", B * T * E, s, masked_mean_backward_kernel,
                     dpooled, counts, dX, B, T, E);
}
void to_heads(const float* x, float* heads, int64_t B, int64_t T, int64_t H, int64_t D,
              int64_t parts, StreamHandle s) {
  launch_elementwise("cuda::to_heads", parts * B * H * T * D, s, heads_layout_kernel, x, heads, B,
                     T, H, D, parts, true);
}
void from_heads(const float* heads, float* x, int64_t B, int64_t T, int64_t H, int64_t D,
                int64_t parts, StreamHandle s) {
  launch_elementwise("cuda::from_heads", parts * B * H * T * D, s, heads_layout_kernel, heads, x, B,
                     T, H, D, parts, false);
}
void softmax_dropout_forward(const float* x, float* y, float* yd, const int32_t* kept,
                             kernels::MaskedRows policy, int64_t R, int64_t S, float p,
                             uint64_t seed, const uint64_t* offset_base, uint64_t offset,
                             StreamHandle s) {
  launch_rows("cuda::softmax_dropout_forward", R, s, softmax_dropout_forward_kernel, x, y,
              p > 0.0f ? yd : nullptr, kept, policy == kernels::MaskedRows::kZero, R, S, p, seed,
              offset_base, offset);
}
void softmax_dropout_backward(const float* dyd, const float* y, float* dx, const int32_t* kept,
                              int64_t R, int64_t S, float p, uint64_t seed,
                              const uint64_t* offset_base, uint64_t offset, StreamHandle s) {
  launch_rows("cuda::softmax_dropout_backward", R, s, softmax_dropout_backward_kernel, dyd, y, dx,
              kept, R, S, p, seed, offset_base, offset);
}
void loss_mean(const float* loss, const uint8_t* keep, int64_t N, double* mean, float* scale,
               StreamHandle s) {
  loss_mean_kernel<<<1, 256, 0, static_cast<cudaStream_t>(s)>>>(loss, keep, N, mean, scale);
  ATTN_CUDA_CHECK_LAUNCH("cuda::loss_mean");
}

}  // namespace attn::cuda
