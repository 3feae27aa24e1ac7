// Fused ("flash") scaled dot-product attention on the CPU, float32, forward and backward.
// Internal to the library: ops/attention.cpp validates the user's tensors and calls these.
//
// Glossary: B batch (the ops layer flattens batch x heads into it), T queries, S keys, D head dim
// of q and k, Dv head dim of v.
//
//   q (B, T, D), k (B, S, D), v (B, S, Dv), out (B, T, Dv), lse (B, T)
//   score[b,t,s] = scale * q[b,t] . k[b,s]                    for kept keys, else masked
//   P[b,t,s]     = exp(score - lse[b,t]),  lse = log sum_s exp(score)   over kept keys
//   out[b,t]     = sum_s P[b,t,s] * Z[b,t,s] * v[b,s]
// where Z is the inverted-dropout multiplier (0 or 1/(1-p)) drawn from the dropout stream with
// index (b*T + t)*S + s (attn/core/rng.hpp), or 1 without dropout. Dropout acts on normalized
// weights: it does not enter the softmax denominator.
//
// Mask: key s of row (b, t) is kept iff s < key_limit[b*T + t] (when key_limit is given; the
// ops layer turns d2l's valid_lens into it, clamped to [0, S]) and, with `causal`, s <= t (top-left
// aligned, as attn::MaskOptions). So every row keeps a prefix [0, limit) of the keys. A row with
// no kept key follows `zero_masked_rows`: false (d2l) gives every key weight 1/S, padding included
// (then dropout as usual); true (PyTorch SDPA) gives a zero output row. lse is -inf there.
//
// Memory: never a T x S matrix. Per thread O(tile * (D + Dv)) scratch for the forward; the
// backward adds an fp32 dQ accumulator of B * splits * T * D floats when B is too small to feed
// the threads (splits > 1, see flash_attention.cpp), else T * D per thread, and T * (D + Dv)
// per thread of packed q and dO when that is at most 2^20 floats. Scratch comes from attn's block
// cache (kernels/cpu/scratch.hpp): fresh pages would cost a fault per 4 KiB on every call.
//
// Threads: a fixed list of work items (forward: (b, query block); backward: (b, key range))
// whose arithmetic does not depend on which thread runs it, so any thread count gives bitwise
// identical results.
#pragma once

#include <cstdint>
#include <vector>

namespace attn::cpu {

struct FlashParams {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0;
  // Element strides (not bytes) of each tensor's three axes; the last may be any value >= 1.
  // Head split (multi-head attention without copies): with heads > 1 the batch index b is
  // (batch, head) = (b / heads, b % heads), and row b of q starts at
  //   (b / heads) * q_sb + (b % heads) * q_sh
  // (likewise k, v, out and the gradients). So q may be a (B', T, heads * D) projection, head h
  // owning features [h*D, (h+1)*D): q_sb = T * heads * D, q_st = heads * D, q_sh = D. lse,
  // key_limit and the dropout stream index keep the flat b; weights stay b * w_sb.
  int64_t heads = 1;
  int64_t q_sh = 0, k_sh = 0, v_sh = 0, o_sh = 0;
  const float* q = nullptr;
  int64_t q_sb = 0, q_st = 0, q_sd = 1;
  const float* k = nullptr;
  int64_t k_sb = 0, k_ss = 0, k_sd = 1;
  const float* v = nullptr;
  int64_t v_sb = 0, v_ss = 0, v_sd = 1;
  float* out = nullptr;  // forward output (backward input)
  int64_t o_sb = 0, o_st = 0, o_sd = 1;
  float* lse = nullptr;  // (B, T) contiguous; natural log; forward output (backward input)
  // Optional forward output: the pre-dropout weights P (B, T, S), unit stride along S. Costs a
  // second Q K^T pass (the weights need the final lse); null (the default) skips it.
  float* weights = nullptr;
  int64_t w_sb = 0, w_st = 0;

  const int32_t* key_limit = nullptr;  // B*T entries in [0, S], or null: no length mask
  bool causal = false;
  bool zero_masked_rows = false;  // false: uniform 1/S weights (d2l); true: zero output
  float scale = 1.0f;

  float dropout = 0.0f;  // p in [0, 1]; 0 disables
  uint64_t seed = 0, offset = 0;

  int threads = 1;
};

// Gradients of the forward above. dq, dk, dv are overwritten (not accumulated into).
struct FlashGrads {
  const float* dout = nullptr;  // (B, T, Dv)
  int64_t do_sb = 0, do_st = 0, do_sd = 1;
  int64_t do_sh = 0, dq_sh = 0, dk_sh = 0, dv_sh = 0;  // head strides, as FlashParams::heads
  float* dq = nullptr;                                 // (B, T, D)
  int64_t dq_sb = 0, dq_st = 0, dq_sd = 1;
  float* dk = nullptr;  // (B, S, D)
  int64_t dk_sb = 0, dk_ss = 0, dk_sd = 1;
  float* dv = nullptr;  // (B, S, Dv)
  int64_t dv_sb = 0, dv_ss = 0, dv_sd = 1;
};

// Fills p.out and p.lse (and p.weights when set).
void flash_attention_forward(const FlashParams& p);
// Reads p.q, p.k, p.v, p.out, p.lse (as the forward left them) and g.dout; fills g.dq, g.dk, g.dv.
void flash_attention_backward(const FlashParams& p, const FlashGrads& g);

// Key ranges [bounds[j], bounds[j+1]) of the backward's work items for one batch row, shared by
// the fp32 and bf16 backwards: enough items to feed a few threads when B is small (a function of
// the shape only, never of the thread count), each a multiple of 64 keys; with a causal mask the
// ranges hold equal work (key s is seen by T - s queries), not equal keys.
std::vector<int64_t> backward_key_splits(int64_t B, int64_t T, int64_t S, bool causal);

// Name of the SIMD target the dispatcher picks on this CPU (e.g. "AVX3", "AVX2", "EMU128").
const char* flash_attention_target();
// The SIMD targets compiled in and supported by this CPU (Highway target bits, best first), and
// a switch restricting dispatch to the targets in `mask` (0 restores all). For tests and
// benchmarks that compare targets on one machine; not thread-safe.
std::vector<int64_t> flash_attention_targets();
void flash_attention_set_targets(int64_t mask);

}  // namespace attn::cpu
