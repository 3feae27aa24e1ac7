// The kernel interface of attention: what every fused attention kernel (kernels/cpu/
// flash_attention, kernels/cpu/flash_bf16, kernels/cpu/decode_attention; the ring step calls the
// flash kernels per block) and the oracle (kernels/ref/attention.hpp) take. Internal to the
// library. Plain numbers and pointers only: no Tensor, no public op header. The ops layer
// validates the user's tensors, lowers the mask to kept-key counts (ops/mask.hpp) and fills these
// structs in one place (ops/attention_kernel.hpp); the tests build them from a case
// (tests/attention_harness.hpp) and run every case on every kernel
// (tests/test_attention_cases.cpp).
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys, D head dim of q and k, Dv of v.
//
//   q (B, T, D), k (B, S, D), v (B, S, Dv), out (B, T, Dv), lse (B, T)
//   score[b,t,s] = scale * q[b,t] . k[b,s]                    for kept keys, else masked
//   P[b,t,s]     = exp(score - lse[b,t]),  lse = log sum_s exp(score)   over kept keys
//   out[b,t]     = sum_s P[b,t,s] * Z[b,t,s] * v[b,s]
// where Z is the inverted-dropout multiplier (0 or 1/(1-p)) drawn from the dropout stream with
// index dropout_index_base + (b*T + t)*S + s (attn/core/rng.hpp; the base places a data-parallel
// shard's rows in the global batch), or 1 without dropout. A call on a block of a larger problem
// (ring attention: local queries against one key block) draws the larger problem's mask instead:
// index base + (b*Tg + t0 + t)*Sg + s0 + s with the dropout_window (rows, cols, t0, s0) below.
// Dropout acts on normalized weights: it does not enter the softmax denominator.
//
// Mask: key s of row (b, t) is kept iff s < kept_keys[b*T + t] (when kept_keys is given; the
// ops layer lowers d2l's valid_lens to it, in [0, S]) and, with `causal`, s <= t (top-left
// aligned). So every row keeps a prefix [0, limit) of the keys. A row with no kept key follows
// `masked_rows`: kUniform (d2l) gives every key weight 1/S, padding included (then dropout as
// usual); kZero (PyTorch SDPA) gives a zero output row. lse is -inf there.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::kernels {

// What a row without kept keys produces (attn::MaskedRowPolicy, lowered by ops/mask.hpp).
enum class MaskedRows : uint8_t {
  kUniform,  // d2l: weight 1/S on every key
  kZero,     // PyTorch SDPA: zero output
};

// A strided (B, H, T, D) view of one tensor, element strides (not bytes). Rows are addressed by
// a flat b = batch * heads + head (see AttentionProblem::heads): row (b, t) starts at
//   data + (b / heads) * sb + (b % heads) * sh + t * st,
// element d of it at + d * sd. A (B', T, heads * D) projection, head h owning features
// [h*D, (h+1)*D), is read in place with sb = T * heads * D, st = heads * D, sh = D.
// For k and v the T axis is the key axis S.
template <class T>
struct StridedView {
  T* data = nullptr;
  int64_t sb = 0, sh = 0, st = 0, sd = 1;
};

// Everything but the tensors: shapes, mask, scale, dropout stream, threads, test switches.
struct AttentionProblem {
  int64_t B = 0, T = 0, S = 0, D = 0, Dv = 0;
  int64_t heads = 1;  // B is (batch, head) pairs; views with heads > 1 use their head stride

  const int32_t* kept_keys = nullptr;  // B*T entries in [0, S], or null: no length mask
  bool causal = false;
  MaskedRows masked_rows = MaskedRows::kUniform;
  float scale = 1.0f;

  // Dropout stream (attn/core/rng.hpp): p in [0, 1], 0 disables; (seed, offset) pick the stream.
  float dropout = 0.0f;
  uint64_t seed = 0, offset = 0;
  // CUDA only: when set, the stream offset is *dropout_offset_device + offset, read on the device
  // when the kernel runs, so that a step captured once as a CUDA graph replays with each step's
  // offsets. The CPU kernels ignore it.
  const uint64_t* dropout_offset_device = nullptr;
  // Stream index of element (0, 0, 0): the global index of this call's first sample times the
  // elements per sample, heads * T * S (Context::dropout_index_base; 0 in a single process).
  uint64_t dropout_index_base = 0;
  // The block's place in the problem whose mask is drawn (ring attention's global (Tg, Sg)):
  // query t of this call is row t0 + t of Tg, key s is column s0 + s of Sg. rows = 0 (the
  // default) means this call is the whole problem: Tg = T, Sg = S, t0 = s0 = 0.
  struct DropoutWindow {
    int64_t rows = 0, cols = 0, t0 = 0, s0 = 0;
  } dropout_window;

  int threads = 1;

  // Test and benchmark switches (attn::Context::kernel_targets / force_bf16_fallback): restrict
  // the SIMD dispatch of the Highway kernels to these target bits (0: all this CPU supports), and
  // make the bf16 kernels take their fp32 conversion path.
  int64_t simd_targets = 0;
  bool force_bf16_fallback = false;

  bool zero_masked_rows() const { return masked_rows == MaskedRows::kZero; }

  // Offset of row b of a view with batch stride sb and head stride sh.
  int64_t row_offset(int64_t b, int64_t sb, int64_t sh) const {
    return heads == 1 ? b * sb : (b / heads) * sb + (b % heads) * sh;
  }

  // The dropout stream index of weight (b, t, s).
  uint64_t dropout_index(int64_t b, int64_t t, int64_t s) const {
    const DropoutWindow& w = dropout_window;
    if (w.rows == 0) return dropout_index_base + static_cast<uint64_t>((b * T + t) * S + s);
    return dropout_index_base + static_cast<uint64_t>((b * w.rows + w.t0 + t) * w.cols + w.s0 + s);
  }
  // True when the index of (b, t, s) is a multiple of 4 for every b and t (a whole Philox block
  // starts at key s of every row): the SIMD draws across queries need it.
  bool dropout_rows_aligned(int64_t s) const {
    const DropoutWindow& w = dropout_window;
    if (w.rows == 0) return S % 4 == 0 && (dropout_index_base + static_cast<uint64_t>(s)) % 4 == 0;
    return w.cols % 4 == 0 && (dropout_index_base + static_cast<uint64_t>(w.s0 + s)) % 4 == 0;
  }

  // Keys [0, limit) are kept by row (b, t): the length mask and the causal mask both keep a prefix.
  int64_t row_limit(int64_t b, int64_t t) const {
    int64_t lim = kept_keys ? kept_keys[b * T + t] : S;
    if (causal) lim = std::min(lim, t + 1);
    return std::clamp<int64_t>(lim, 0, S);
  }
};

// A forward call: the problem and its tensors of element type E (float, or bf16 as uint16_t).
template <class E>
struct AttentionArgs : AttentionProblem {
  StridedView<const E> q, k, v;
  StridedView<E> out;    // forward output (backward input)
  float* lse = nullptr;  // (B, T) contiguous, float32, natural log; forward output (backward input)
  // Optional forward output: the pre-dropout weights P (B, T, S) in float32, unit stride along S.
  // Costs a second Q K^T pass (the weights need the final lse); null (the default) skips it.
  float* weights = nullptr;
  int64_t w_sb = 0, w_st = 0;
  // Optional (cpu::flash_attention_keeps_dropout and cpu::flash_bf16_keeps_dropout say when): the
  // forward's dropout decisions, one bit per weight, bit t % 16 of word
  // dropout_keep[(b * ceil(T / 16) + t / 16) * S + s] set iff weight (b, t, s) is kept. The
  // forward writes the words of every kept key (s < the row's limit); the backward, given the
  // same words, reads them instead of drawing the stream again. Null: both draw.
  uint16_t* dropout_keep = nullptr;
};

// The backward's tensors: dout in, dq, dk, dv overwritten (not accumulated into).
template <class E>
struct AttentionGradArgs {
  StridedView<const E> dout;  // (B, T, Dv)
  StridedView<E> dq;          // (B, T, D)
  StridedView<E> dk;          // (B, S, D)
  StridedView<E> dv;          // (B, S, Dv)
};

}  // namespace attn::kernels
