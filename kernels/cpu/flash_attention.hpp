// Fused ("flash") scaled dot-product attention on the CPU, float32, forward and backward.
// Internal to the library: ops/attention.cpp validates the user's tensors and calls these.
//
// The problem and its views: kernels/attention_problem.hpp (shapes, strides, the kept-key /
// causal prefix mask, the masked-row policy, the dropout stream, lse in natural log).
//
// Memory: never a T x S matrix. Per thread O(tile * (D + Dv)) scratch for the forward; the
// backward adds an fp32 dQ accumulator of B * splits * T * D floats when B is too small to feed
// the threads (splits > 1, see flash_driver.hpp), else T * D per thread, and T * (D + Dv)
// per thread of packed q and dO when that is at most 2^20 floats. Scratch comes from attn's block
// cache (kernels/cpu/scratch.hpp): fresh pages would cost a fault per 4 KiB on every call.
//
// Threads: a fixed list of work items (forward: (b, query block); backward: (b, key range))
// whose arithmetic does not depend on which thread runs it, so any thread count gives bitwise
// identical results. The items, their schedule and the dQ merge are the flash driver's
// (flash_driver.hpp), shared with the bf16 kernels; flash_attention.cpp holds the block arithmetic.
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstdint>
#include <vector>

namespace attn::cpu {

using FlashParams = kernels::AttentionArgs<float>;
using FlashGrads = kernels::AttentionGradArgs<float>;

// Fills p.out and p.lse (and p.weights when set).
void flash_attention_forward(const FlashParams& p);
// Reads p.q, p.k, p.v, p.out, p.lse (as the forward left them) and g.dout; fills g.dq, g.dk, g.dv.
void flash_attention_backward(const FlashParams& p, const FlashGrads& g);

// True when the forward records its dropout decisions in p.dropout_keep (given
// flash_dropout_keep_words(p) words; AttentionArgs::dropout_keep's format) and the backward may
// then read them instead of drawing the stream again: dropout on, a 16-lane SIMD target (AVX-512)
// and every row's stream aligned to Philox blocks (AttentionProblem::dropout_rows_aligned(0)).
// Otherwise the forward ignores p.dropout_keep and the caller must pass none to the backward.
bool flash_attention_keeps_dropout(const FlashParams& p);
int64_t flash_dropout_keep_words(const FlashParams& p);

// The work schedule (items, key splits, dQ merge): flash_driver.hpp, shared with flash_bf16.

// Name of the SIMD target the dispatcher picks on this CPU (e.g. "AVX3", "AVX2", "EMU128"), or
// of one target bit of flash_attention_targets().
const char* flash_attention_target();
const char* flash_attention_target_name(int64_t target);
// The SIMD targets compiled in and supported by this CPU (Highway target bits, best first). A call
// restricts its dispatch to some of them with AttentionProblem::simd_targets (from
// Context::kernel_targets), for tests and benchmarks that compare targets on one machine.
std::vector<int64_t> flash_attention_targets();

}  // namespace attn::cpu
