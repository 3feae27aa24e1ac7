// The tensor-core bf16 attention forward (flash_mma.cu), chosen by flash_attention_forward when
// flash_mma_supports() says the problem fits it. No CUDA header.
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstddef>
#include <cstdint>

namespace attn::cuda {

// bf16, D == Dv in {32, 64, 128}, unit stride along D, even strides, 4-byte aligned bases; and the
// environment variable ATTN_CUDA_SIMT_ATTENTION unset (set: the SIMT kernel, for A/B runs).
bool flash_mma_supports(const kernels::AttentionArgs<uint16_t>& a);
// Benchmarks: on, every problem takes the SIMT kernel (as ATTN_CUDA_SIMT_ATTENTION set at start).
void flash_mma_set_simt_only(bool on);
// The pipelined tensor-core forward (cp.async double buffering, ldmatrix; flash_mma.cu): off until
// a GPU run has verified and timed it; ATTN_CUDA_MMA_PIPELINED set at start, or this, turns it on.
// It takes a problem flash_mma_supports() takes whose K and V rows are also 16-byte aligned.
void flash_mma_set_pipelined(bool on);
bool flash_mma_pipelined_supports(const kernels::AttentionArgs<uint16_t>& a);
// Shared memory of one pipelined block: two buffers of a K and a V tile, 64 x (D + 8) bf16 each.
size_t flash_mma_pipelined_smem(int64_t D);
// Shared memory of one block: a K tile (64 x (D + 8)) and a transposed V tile (D x 72), bf16.
size_t flash_mma_smem(int64_t D);
void flash_mma_forward(const kernels::AttentionArgs<uint16_t>& a, void* stream);

}  // namespace attn::cuda
