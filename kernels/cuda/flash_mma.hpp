// The tensor-core bf16 attention forward and backward (flash_mma.cu), chosen by
// flash_attention_forward / flash_attention_backward when flash_mma_supports() /
// flash_mma_backward_supports() say the problem fits them. No CUDA header.
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

// The backward on tensor cores (dQ over query blocks, dK and dV over key blocks; no atomics) of
// a problem flash_mma_supports takes whose Q and dO are also read by 16-byte copies (16-byte
// aligned, strides of whole 8-element pieces) and whose gradients are stored as bf16 pairs (unit
// stride along D, even strides, 4-byte aligned), with S < 2^31. delta = rowsum(dO * O), B*T
// floats, computed before (flash_attention.cu).
bool flash_mma_backward_supports(const kernels::AttentionArgs<uint16_t>& a,
                                 const kernels::AttentionGradArgs<uint16_t>& g);
void flash_mma_backward(const kernels::AttentionArgs<uint16_t>& a,
                        const kernels::AttentionGradArgs<uint16_t>& g, const float* delta,
                        void* stream);

}  // namespace attn::cuda
