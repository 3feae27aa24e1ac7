// AdamW and the squared norm for gradient clipping on CUDA. Built with --fmad=false (CMakeLists):
// AdamWElement (device_math.hpp) then performs the CPU's double operations one rounding at a
// time, so a step on the GPU gives the CPU's float bits (tests/cuda/test_cuda_kernels.cpp).
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/kernels.hpp"
#include "kernels/cuda/launch.hpp"

#include <cuda_runtime.h>

#include <cmath>

namespace attn::cuda {
namespace {

__global__ void adamw_kernel(float* w, const float* g, float* m, float* v, int64_t n,
                             const AdamWElement u) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    u(w + i, g[i], m + i, v + i);
}

__global__ void adamw_device_kernel(float* w, const float* g, float* m, float* v, int64_t n,
                                    const AdamWElement* u, const double* skip_if) {
  if (skip_if != nullptr && !isfinite(*skip_if)) return;
  const AdamWElement e = *u;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    e(w + i, g[i], m + i, v + i);
}

// Sum of squares in two launches with a fixed partition and fixed trees, so the same bits on
// every run (the CPU sums in another order: equal within rounding, not bitwise): kSquareBlocks
// blocks of 256 threads write one partial each (thread i takes elements i, i + 256 * blocks, ...),
// then one block adds the partials.
constexpr int kSquareBlocks = static_cast<int>(kSumSquaresScratch);
__device__ double block_sum(double acc, double* part) {
  part[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  return part[0];
}
__global__ void sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double part[256];
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double xi = x[i];
    acc += xi * xi;
  }
  const double total = block_sum(acc, part);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}
__global__ void sum_squares_final_kernel(double* partial, double* out) {
  __shared__ double part[256];
  const double acc = threadIdx.x < kSquareBlocks ? partial[threadIdx.x] : 0.0;
  const double total = block_sum(acc, part);
  if (threadIdx.x == 0) *out = total;
}

// torch's clip_grad_norm_: coef = max_norm / (sqrt(sum) + 1e-6), applied when below 1, in double
// and rounded once per element (nn::clip_grad_norm). norm[0] receives sqrt(sum).
__global__ void clip_kernel(float* g, int64_t n, const double* sum, double max_norm, double* norm) {
  const double total = sqrt(*sum);
  const double coef = max_norm / (total + 1e-6);
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (start == 0) *norm = total;
  if (!(coef < 1.0)) return;
  for (int64_t i = start; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    g[i] = static_cast<float>(g[i] * coef);
}

}  // namespace

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                  StreamHandle stream) {
  if (n <= 0) return;
  const AdamWElement u = adamw_element(s);
  const LaunchConfig c = elementwise_config(n);
  adamw_kernel<<<c.grid.x, c.block.x, 0, static_cast<cudaStream_t>(stream)>>>(w, g, m, v, n, u);
  ATTN_CUDA_CHECK_LAUNCH("cuda::adamw_update");
}

AdamWElement adamw_element(const AdamWStep& s) {
  AdamWElement u;
  u.lr = s.lr;
  u.beta1 = s.beta1;
  u.beta2 = s.beta2;
  u.eps = s.eps;
  u.weight_decay = s.weight_decay;
  const double t = static_cast<double>(s.step);
  u.step_size = s.lr / (1.0 - std::pow(s.beta1, t));
  u.bias_correction2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, t));
  return u;
}

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWElement* u,
                  const double* skip_if, StreamHandle stream) {
  if (n <= 0) return;
  const LaunchConfig c = elementwise_config(n);
  adamw_device_kernel<<<c.grid.x, c.block.x, 0, static_cast<cudaStream_t>(stream)>>>(w, g, m, v, n,
                                                                                     u, skip_if);
  ATTN_CUDA_CHECK_LAUNCH("cuda::adamw_update");
}

void sum_squares(const float* x, int64_t n, double* out, double* scratch, StreamHandle stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  sum_squares_partial_kernel<<<kSquareBlocks, 256, 0, s>>>(x, n, scratch);
  ATTN_CUDA_CHECK_LAUNCH("cuda::sum_squares");
  sum_squares_final_kernel<<<1, 256, 0, s>>>(scratch, out);
  ATTN_CUDA_CHECK_LAUNCH("cuda::sum_squares");
}

void clip_by_norm(float* g, int64_t n, const double* sum_squares, double max_norm, double* norm,
                  StreamHandle stream) {
  const LaunchConfig c = elementwise_config(n > 0 ? n : 1);
  clip_kernel<<<c.grid.x, c.block.x, 0, static_cast<cudaStream_t>(stream)>>>(g, n, sum_squares,
                                                                             max_norm, norm);
  ATTN_CUDA_CHECK_LAUNCH("cuda::clip_by_norm");
}

}  // namespace attn::cuda
