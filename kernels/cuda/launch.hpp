// Launch configurations of the CUDA kernels: plain host arithmetic (no CUDA header), so that the
// CPU tests check grids, tile counts and shared-memory sizes against the shapes they cover.
#pragma once

#include "kernels/cuda/device_math.hpp"

#include <cstddef>
#include <cstdint>

namespace attn::cuda {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct LaunchConfig {
  Dim3 grid, block;
  size_t smem_bytes = 0;
};

// The fused SIMT attention kernels (kernels/cuda/flash_attention.cu): a warp owns
// kRowsPerWarp query rows (forward, dQ) or key rows (dK/dV); lane j of a warp takes key j (query
// j) of a 32-wide tile held in shared memory as float, rows padded by one float against bank
// conflicts. Head dims up to kMaxHeadDim (registers hold kMaxHeadDim / 32 outputs per lane).
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarpsPerBlock * kRowsPerWarp;  // 16 query (or key) rows a block
constexpr int kTile = 32;                                     // keys (or queries) per smem tile
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPerLane = kMaxHeadDim / kWarp;

// Shared memory of the forward and dQ kernels: the block's query rows (D + 1 floats each) and
// one tile of K (D + 1) and V (Dv + 1). The dQ kernel also keeps its dO rows (Dv + 1).
inline size_t flash_forward_smem(int64_t D, int64_t Dv, bool with_dout) {
  const int64_t q_rows = kRowsPerBlock * (D + 1) + (with_dout ? kRowsPerBlock * (Dv + 1) : 0);
  return static_cast<size_t>(q_rows + kTile * (D + 1) + kTile * (Dv + 1)) * sizeof(float);
}
// The dK/dV kernel: its key rows of K and V, one tile of Q (D + 1) and dO (Dv + 1), and that
// tile's lse and delta = rowsum(dO * O).
inline size_t flash_dkdv_smem(int64_t D, int64_t Dv) {
  const int64_t k_rows = kRowsPerBlock * (D + 1) + kRowsPerBlock * (Dv + 1);
  return static_cast<size_t>(k_rows + kTile * (D + 1) + kTile * (Dv + 1) + 2 * kTile) *
         sizeof(float);
}

// Forward (and dQ): blockIdx.x walks query tiles, blockIdx.y the B rows.
inline LaunchConfig flash_forward_config(int64_t B, int64_t T, int64_t D, int64_t Dv,
                                         bool with_dout) {
  LaunchConfig c;
  c.grid.x = static_cast<unsigned>(ceil_div(T, kRowsPerBlock));
  c.grid.y = static_cast<unsigned>(B);
  c.block.x = kWarp * kWarpsPerBlock;
  c.smem_bytes = flash_forward_smem(D, Dv, with_dout);
  return c;
}
inline LaunchConfig flash_dkdv_config(int64_t B, int64_t S, int64_t D, int64_t Dv) {
  LaunchConfig c;
  c.grid.x = static_cast<unsigned>(ceil_div(S, kRowsPerBlock));
  c.grid.y = static_cast<unsigned>(B);
  c.block.x = kWarp * kWarpsPerBlock;
  c.smem_bytes = flash_dkdv_smem(D, Dv);
  return c;
}

// Decode (T small, S long: one new token against the KV cache): a block per (b, t) row, keys in
// chunks of kDecodeChunk. Each thread scores its own keys of a chunk into shared memory (256 dot
// products in flight), the block reduces the chunk's max and sum (online softmax), then warp w
// accumulates keys w, w + 8, ... into its lanes' Dv / 32 outputs; the warps' rows are added in
// order at the end. Shared memory: q (D), a chunk's scores, 8 reduction slots, 8 rows of Dv.
constexpr int kDecodeWarps = 8;
constexpr int kDecodeChunk = 1024;  // keys scored per pass into shared memory
inline size_t flash_decode_smem(int64_t D, int64_t Dv) {
  return static_cast<size_t>(D + kDecodeChunk + kDecodeWarps + kDecodeWarps * Dv) * sizeof(float);
}
inline LaunchConfig flash_decode_config(int64_t B, int64_t T, int64_t D, int64_t Dv) {
  LaunchConfig c;
  c.grid.x = static_cast<unsigned>(T);
  c.grid.y = static_cast<unsigned>(B);
  c.block.x = kWarp * kDecodeWarps;
  c.smem_bytes = flash_decode_smem(D, Dv);
  return c;
}

// Row kernels (LayerNorm, softmax, cross-entropy): one warp a row, 8 warps a block.
constexpr int kRowWarps = 8;
inline LaunchConfig rows_config(int64_t rows) {
  LaunchConfig c;
  c.grid.x = static_cast<unsigned>(ceil_div(rows, kRowWarps));
  c.block.x = kWarp * kRowWarps;
  return c;
}
// Elementwise kernels: 256 threads, a grid-stride loop over at most 65535 * 8 blocks.
inline LaunchConfig elementwise_config(int64_t n) {
  LaunchConfig c;
  c.block.x = 256;
  int64_t blocks = ceil_div(n, 256);
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  if (blocks < 1) blocks = 1;
  c.grid.x = static_cast<unsigned>(blocks);
  return c;
}

}  // namespace attn::cuda
