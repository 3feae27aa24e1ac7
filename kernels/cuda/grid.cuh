// Index helpers and the elementwise launcher shared by the kernels of ops.cu and train_ops.cu.
// CUDA sources only (device code and a kernel launch).
//
// Two layouts (launch.hpp makes both configurations): grid-stride loops over n elements
// (elementwise_config), and a warp a row (rows_config: kRowWarps rows per block).
#pragma once

#include "kernels/cuda/check.hpp"
#include "kernels/cuda/kernels.hpp"
#include "kernels/cuda/launch.hpp"

#include <cuda_runtime.h>

#include <cstdint>

namespace attn::cuda {

// Grid-stride loop: for (i = grid_start(); i < n; i += grid_step()).
__device__ __forceinline__ int64_t grid_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_step() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// A warp a row: this warp's row, and this thread's lane in it.
__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
}
__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x % kWarp);
}

// The keys a softmax row keeps: kept[r] (all S without a kept array), clamped to [0, S].
__device__ __forceinline__ int64_t kept_keys(const int32_t* kept, int64_t r, int64_t S) {
  const int64_t n = kept != nullptr ? kept[r] : S;
  return n < 0 ? 0 : (n > S ? S : n);
}

// kernel<<<c>>>(args...) on stream s, its launch checked under the name `op`.
template <class Kernel, class... Args>
void launch(const char* op, const LaunchConfig& c, StreamHandle s, Kernel kernel, Args... args) {
  kernel<<<c.grid.x, c.block.x, 0, static_cast<cudaStream_t>(s)>>>(args...);
  ATTN_CUDA_CHECK_LAUNCH(op);
}

// Over n elements (grid-stride loops); nothing for n <= 0.
template <class Kernel, class... Args>
void launch_elementwise(const char* op, int64_t n, StreamHandle s, Kernel kernel, Args... args) {
  if (n > 0) launch(op, elementwise_config(n), s, kernel, args...);
}

// Over rows, a warp a row; nothing for rows <= 0.
template <class Kernel, class... Args>
void launch_rows(const char* op, int64_t rows, StreamHandle s, Kernel kernel, Args... args) {
  if (rows > 0) launch(op, rows_config(rows), s, kernel, args...);
}

}  // namespace attn::cuda
