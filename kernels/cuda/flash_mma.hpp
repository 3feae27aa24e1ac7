// The tensor-core bf16 attention forward (flash_mma.cu), chosen by flash_attention_forward when
// flash_mma_supports() says the problem fits it. No CUDA header.
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstddef>
#include <cstdint>

namespace attn::cuda {

// bf16, D == Dv in {32, 64, 128}, unit stride along D; Q and the output with even strides and
// 4-byte aligned bases, K and V with strides of whole 8-element (16-byte) pieces and 16-byte
// aligned bases (the kernel copies their rows 16 bytes at a time); and the environment variable
// ATTN_CUDA_SIMT_ATTENTION unset (set: the SIMT kernel, for A/B runs).
bool flash_mma_supports(const kernels::AttentionArgs<uint16_t>& a);
// Benchmarks: on, every problem takes the SIMT kernel (as ATTN_CUDA_SIMT_ATTENTION set at start).
void flash_mma_set_simt_only(bool on);
// Shared memory of one block: two buffers of a K and a V tile, 64 x (D + 8) bf16 each.
size_t flash_mma_smem(int64_t D);
void flash_mma_forward(const kernels::AttentionArgs<uint16_t>& a, void* stream);

}  // namespace attn::cuda
