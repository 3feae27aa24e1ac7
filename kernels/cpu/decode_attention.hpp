// Decode attention on the CPU: a few queries per row (T = 1..8) against a long key/value cache,
// float32 or bfloat16 cache, float32 queries and output. The incremental step of a decoder
// (nn/decoder_cache.cpp) attends with its new positions against every cached position; the
// flash kernel (flash_attention.hpp) is built for T >= ~100 and costs about as much at T = 1 as
// at T = 64, so one generated token paid for a full query block per head.
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys (the cache's positions), D head
// width of q and k, Dv of v. The math is AttentionProblem's (kernels/attention_problem.hpp):
//   score[b,t,s] = scale * q[b,t] . k[b,s]            s < row_limit(b, t) (kept keys)
//   out[b,t]     = sum_s softmax_s(score) v[b,s],      lse[b,t] = log sum_s exp(score)
// with its masked-row policy (kUniform: 1/S on all S keys; kZero: zero row; lse -inf) and
// without dropout (decoding is eval mode: dropout must be 0).
//
// The cache is read in place: a (B', capacity, H*D) buffer is the view sb = capacity*H*D,
// sh = D, st = H*D, sd = 1, with heads = H and S = the cached length (or fewer: keys past every
// row's limit are never read, so S may be the capacity with kept_keys giving the lengths). The
// heads of one batch row are read together: a V row kept by another query or head of the same
// batch row is read with weight exactly 0, so it must be finite (a cache is).
//
// Memory-bound: every K and V row is read once. Keys are cut into chunks of kDecodeChunkKeys;
// work items are (row, chunk) pairs spread over threads (so one row of a 64k cache is split
// across all threads: split-K), each producing a partial (max, sum, weighted V sum) per query;
// the partials of a row are merged by log-sum-exp in chunk order. Chunks do not depend on the
// thread count, so the result is bitwise identical for any number of threads.
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstdint>

namespace attn::cpu {

// Queries per row the kernel takes (the decoder's step decodes 1; speculative / multi-token
// steps a few). More queries belong to the flash kernel.
constexpr int64_t kDecodeMaxQueries = 8;
// Keys per work item, which reads all H heads of them: 128 keys of H*D = 512 in fp32 are 256 KiB
// of V kept in L2 between the item's two passes; a partial of T * (Dv + 2) floats per head and
// 128 keys is < 1% of the reads.
constexpr int64_t kDecodeChunkKeys = 128;

// The kernel's arguments: the problem (dropout 0) and its tensors. KV is float or uint16_t
// (bfloat16 bits, attn/core/dtype.hpp). k and v need unit feature stride (sd == 1); q and out
// take any strides. lse (B, T) contiguous float32, may be null.
template <class KV>
struct DecodeArgs : kernels::AttentionProblem {
  kernels::StridedView<const float> q;
  kernels::StridedView<const KV> k, v;
  kernels::StridedView<float> out;
  float* lse = nullptr;
};

// Forward only. Throws attn::Error when T is outside [1, kDecodeMaxQueries], dropout != 0 or a
// k/v feature stride is not 1. The SIMD target is Highway's dynamic dispatch, restricted for the
// call to AttentionProblem::simd_targets when nonzero (kernels/cpu/target_scope.hpp).
void decode_attention(const DecodeArgs<float>& a);
void decode_attention(const DecodeArgs<uint16_t>& a);

// Name of the SIMD target the dispatch picks now (e.g. "AVX3", "AVX2", "EMU128").
const char* decode_attention_target();

}  // namespace attn::cpu
