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

// One block of 256 threads: a fixed partition and a fixed tree, so the sum is the same bits on
// every run (the CPU sums in another order: equal within rounding, not bitwise).
__global__ void sum_squares_kernel(const float* x, int64_t n, double* out) {
  __shared__ double part[256];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double xi = x[i];
    acc += xi * xi;
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

}  // namespace

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                  StreamHandle stream) {
  if (n <= 0) return;
  AdamWElement u;
  u.lr = s.lr;
  u.beta1 = s.beta1;
  u.beta2 = s.beta2;
  u.eps = s.eps;
  u.weight_decay = s.weight_decay;
  const double t = static_cast<double>(s.step);
  u.step_size = s.lr / (1.0 - std::pow(s.beta1, t));
  u.bias_correction2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, t));
  const LaunchConfig c = elementwise_config(n);
  adamw_kernel<<<c.grid.x, c.block.x, 0, static_cast<cudaStream_t>(stream)>>>(w, g, m, v, n, u);
  ATTN_CUDA_CHECK_LAUNCH("cuda::adamw_update");
}

void sum_squares(const float* x, int64_t n, double* out, StreamHandle stream) {
  sum_squares_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, n, out);
  ATTN_CUDA_CHECK_LAUNCH("cuda::sum_squares");
}

}  // namespace attn::cuda
