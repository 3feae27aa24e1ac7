// Fused ("flash") scaled dot-product attention on the CPU with bfloat16 inputs and outputs and
// float32 accumulation. Internal to the library: ops/attention.cpp validates and calls these.
//
// Same contract as the float32 kernels (kernels/attention_problem.hpp: shapes, the kept-key /
// causal prefix mask, the masked-row policies, the Philox dropout stream with element index
// (b*T + t)*S + s, lse in natural log, bitwise identical results for any thread count); only
// the element type of q, k, v, out, dout and the gradients differs: bf16 stored as uint16_t
// (attn/core/dtype.hpp, round to nearest even). lse and the optional weights stay float32.
//
// Forward. With AVX512-BF16 (vdpbf16ps, checked at run time) the native kernel: both products
// as bf16 dot products of pairs with fp32 accumulation, the online softmax in fp32, the weights
// P rounded to bf16 once (after dropout) for the P V product. So out carries, beyond the final
// rounding to bf16, one bf16 rounding of each weight. Design and measurements:
// docs/kernels-cpu.md ("bfloat16"), docs/notes/bf16-kernel.md.
// The native forward packs k and v of all B rows as pairs once per call (4 B (S D + S Dv) bytes)
// into scratch from attn's block cache (kernels/cpu/scratch.hpp), not faulted in on every call.
// Without AVX512-BF16, when weights are requested, or when forced (force_bf16_fallback, for
// tests), the forward converts
// q, k, v to fp32 and runs cpu::flash_attention_forward, then rounds out to bf16.
//
// Backward. With AVX512-BF16 (and T, S > 0) the native kernel: FlashAttention-2's backward as the
// fp32 kernel does it (work items (b, key range), P recomputed from lse), its five products (Q K^T,
// dO V^T, dV += (P Z)^T dO, dK += dS^T Q, dQ += dS K) as bf16 dot products of pairs with fp32
// accumulation. P Z and dS are rounded to bf16 once for the products that consume them; dq, dk, dv
// accumulate in fp32 and are rounded to bf16 once. Extra memory per thread: q and dO packed as
// pairs (4 T (D + Dv) bytes when that is <= 8 MiB, else per 96-query tile), kept between calls (up
// to 16 MiB per thread), plus the fp32 dQ shares (T D floats per thread, or per item when a small B
// splits the keys: kernels/cpu/flash_driver.hpp); never a T x S matrix.
// Without AVX512-BF16 or when forced: converts q, k, v, out, dout to fp32, runs the fp32 backward
// (cpu::flash_attention_backward) and rounds dq, dk, dv to bf16 (O(B (T + S) D) extra fp32 memory,
// from a per-thread arena kept between calls up to 64 MiB, as the fallback forward's copies).
#pragma once

#include "kernels/attention_problem.hpp"

#include <cstdint>

namespace attn::cpu {

using FlashBf16Params = kernels::AttentionArgs<uint16_t>;
using FlashBf16Grads = kernels::AttentionGradArgs<uint16_t>;

// Fills p.out and p.lse (and p.weights when set).
void flash_attention_forward_bf16(const FlashBf16Params& p);
// Reads p.q, p.k, p.v, p.out, p.lse and g.dout; overwrites g.dq, g.dk, g.dv.
void flash_attention_backward_bf16(const FlashBf16Params& p, const FlashBf16Grads& g);

// True when this CPU runs the native AVX512-BF16 kernels (a call still takes the fp32 conversion
// path with AttentionProblem::force_bf16_fallback, from Context::force_bf16_fallback, so tests
// cover both paths on one machine).
bool flash_bf16_native();

// True when the native forward would record its dropout decisions in p.dropout_keep (given one of
// dropout_keep_words(p) words) for the backward: this CPU has AVX512-BF16, no fallback is forced,
// no weights are asked for, dropout is on, and every row's stream index and S (the dropout window's
// columns when there is one) are multiples of 4 (AttentionProblem::dropout_rows_aligned: the
// forward's 16-lane Philox path). Otherwise the forward ignores p.dropout_keep, and a caller
// must not pass one to the backward.
bool flash_bf16_keeps_dropout(const FlashBf16Params& p);
// Words of p.dropout_keep: B ceil(T / 16) S.
int64_t dropout_keep_words(const FlashBf16Params& p);

}  // namespace attn::cpu
