// Warp-wide reductions by shuffles, shared by the row kernels of ops.cu and train_ops.cu. CUDA
// sources only (device code).
#pragma once

namespace attn::cuda {

constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1)
    x += __shfl_xor_sync(kFullWarp, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1)
    x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, o));
  return x;
}

}  // namespace attn::cuda
