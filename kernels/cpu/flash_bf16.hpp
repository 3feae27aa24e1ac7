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
// Without AVX512-BF16, when weights are requested, or when forced (tests), the forward converts
// q, k, v to fp32 and runs cpu::flash_attention_forward, then rounds out to bf16.
//
// Backward: converts q, k, v, out, dout to fp32, runs the fp32 FlashAttention-2 backward
// (cpu::flash_attention_backward) and rounds dq, dk, dv to bf16. It is not a native bf16 kernel:
// it costs O(B (T + S) D) extra fp32 memory and runs at the fp32 speed. The fp32 copies (also
// those of the fallback forward) live in a per-thread arena kept between calls up to 64 MiB, so
// repeated calls do not page-fault fresh memory; larger requests are freed on return.
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
};

// Fills p.out and p.lse (and p.weights when set).
void flash_attention_forward_bf16(const FlashBf16Params& p);
// Reads p.q, p.k, p.v, p.out, p.lse and g.dout; overwrites g.dq, g.dk, g.dv.
void flash_attention_backward_bf16(const FlashBf16Params& p, const FlashBf16Grads& g);

// True when the forward runs the native AVX512-BF16 kernel on this CPU (and it is not forced
// off). For tests and benchmarks: force_fallback(true) makes every forward take the fp32
// conversion path, so both paths can be tested on one machine; not thread-safe.
bool flash_bf16_native();
void flash_bf16_force_fallback(bool on);

}  // namespace attn::cpu
