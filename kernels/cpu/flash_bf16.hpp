// Fused ("flash") scaled dot-product attention on the CPU with bfloat16 inputs and outputs and
// float32 accumulation. Internal to the library: ops/attention.cpp validates and calls these.
//
// Same contract as the float32 kernels (kernels/cpu/flash_attention.hpp: shapes, the key_limit /
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
// Without AVX512-BF16, when weights are requested, or when forced (tests), the forward converts
// q, k, v to fp32 and runs cpu::flash_attention_forward, then rounds out to bf16.
//
// Backward. With AVX512-BF16 (and T, S > 0) the native kernel: FlashAttention-2's backward as the
// fp32 kernel does it (work items (b, key range), P recomputed from lse), its five products (Q K^T,
// dO V^T, dV += (P Z)^T dO, dK += dS^T Q, dQ += dS K) as bf16 dot products of pairs with fp32
// accumulation. P Z and dS are rounded to bf16 once for the products that consume them; dq, dk, dv
// accumulate in fp32 and are rounded to bf16 once. Extra memory per thread: q and dO packed as
// pairs (4 T (D + Dv) bytes when that is <= 8 MiB, else per 96-query tile), kept between calls (up
// to 16 MiB per thread), plus the fp32 dQ shares (T D floats per thread, or per item when B < 4
// splits the keys); never a T x S matrix.
// Without AVX512-BF16 or when forced: converts q, k, v, out, dout to fp32, runs the fp32 backward
// (cpu::flash_attention_backward) and rounds dq, dk, dv to bf16 (O(B (T + S) D) extra fp32 memory,
// from a per-thread arena kept between calls up to 64 MiB, as the fallback forward's copies).
#pragma once

#include <cstdint>

namespace attn::cpu {

struct FlashBf16Params {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0;
  // Element strides (not bytes) of each tensor's three axes; the last may be any value >= 1.
  const uint16_t* q = nullptr;
  int64_t q_sb = 0, q_st = 0, q_sd = 1;
  const uint16_t* k = nullptr;
  int64_t k_sb = 0, k_ss = 0, k_sd = 1;
  const uint16_t* v = nullptr;
  int64_t v_sb = 0, v_ss = 0, v_sd = 1;
  uint16_t* out = nullptr;  // forward output (backward input)
  int64_t o_sb = 0, o_st = 0, o_sd = 1;
  // Head split, as FlashParams::heads: with heads > 1 row b of q starts at
  // (b / heads) * q_sb + (b % heads) * q_sh (likewise k, v, out and the gradients), so q, k, v
  // may be (B', T, heads * D) projections read in place. lse, key_limit and weights stay (B, ...).
  int64_t heads = 1;
  int64_t q_sh = 0, k_sh = 0, v_sh = 0, o_sh = 0;
  float* lse = nullptr;  // (B, T) contiguous, float32; forward output (backward input)
  // Optional forward output: pre-dropout weights (B, T, S) in float32, unit stride along S.
  float* weights = nullptr;
  int64_t w_sb = 0, w_st = 0;

  const int32_t* key_limit = nullptr;  // B*T entries in [0, S], or null: no length mask
  bool causal = false;
  bool zero_masked_rows = false;
  float scale = 1.0f;

  float dropout = 0.0f;
  uint64_t seed = 0, offset = 0;

  int threads = 1;
};

struct FlashBf16Grads {
  const uint16_t* dout = nullptr;  // (B, T, Dv)
  int64_t do_sb = 0, do_st = 0, do_sd = 1;
  uint16_t* dq = nullptr;  // (B, T, D)
  int64_t dq_sb = 0, dq_st = 0, dq_sd = 1;
  uint16_t* dk = nullptr;  // (B, S, D)
  int64_t dk_sb = 0, dk_ss = 0, dk_sd = 1;
  uint16_t* dv = nullptr;  // (B, S, Dv)
  int64_t dv_sb = 0, dv_ss = 0, dv_sd = 1;
  int64_t do_sh = 0, dq_sh = 0, dk_sh = 0, dv_sh = 0;  // head strides, as FlashBf16Params::heads
};

// Fills p.out and p.lse (and p.weights when set).
void flash_attention_forward_bf16(const FlashBf16Params& p);
// Reads p.q, p.k, p.v, p.out, p.lse and g.dout; overwrites g.dq, g.dk, g.dv.
void flash_attention_backward_bf16(const FlashBf16Params& p, const FlashBf16Grads& g);

// True when the forward and backward run the native AVX512-BF16 kernels on this CPU (and they
// are not forced off). For tests and benchmarks: force_fallback(true) makes every forward and
// backward take the fp32 conversion path, so both paths can be tested on one machine; not
// thread-safe.
bool flash_bf16_native();
void flash_bf16_force_fallback(bool on);

}  // namespace attn::cpu
