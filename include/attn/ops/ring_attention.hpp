// Ring attention (Liu et al. 2023): scaled dot-product attention over a sequence split across
// the N ranks of a Communicator (sequence / context parallelism). Each rank holds its shard of
// q, k, v (same layouts as scaled_dot_product_attention, attn/ops/attention.hpp):
//
//   q (B, T_local, D), k (B, S_local, D), v (B, S_local, Dv)   float32 or bfloat16, any strides
//   valid_lens undefined, (B / r,) (per batch row: the same on every rank) or (B / r, T_local)
//              (per query: the rank's shard of the global (B / r, T), cut like q), r = lens_repeat
//   returns    out (B, T_local, Dv) of q's dtype, logsumexp (B, T_local) float32: the rank's rows
//              of the single-process result on the gathered sequence.
//
// Valid lengths count GLOBAL keys (key s of the gathered sequence is kept iff s < len), and
// causal compares global positions (query t sees keys s <= t), so the result equals
// scaled_dot_product_attention on the whole sequence. Both masked-row policies are honoured: a
// row that keeps no key at all gives a zero row (kZero) or the mean of every global value
// (kUniform, d2l); its logsumexp is -inf.
//
// Layouts (how the global sequence of length T = N * T_local is cut; ring_shard does it):
//   kContiguous  rank r holds [r T/N, (r+1) T/N)                       needs N | T
//   kZigzag      T cut into 2N chunks of c = T/(2N); rank r holds chunks r and 2N-1-r, in that
//                order (causal load balance: every rank does the same work)   needs 2N | T
// The default is kZigzag with causal, kContiguous without. Causal needs T_local == S_local.
//
// Algorithm (forward): N steps; at step i the rank holds the key/value block of rank r - i
// (mod N), runs the fused kernel of its queries against it (per pair of chunks: full, causal
// diagonal or skipped), and merges the partial (out, lse) by log-sum-exp into float32
// accumulators, while the next block is already in flight (isend/irecv, double-buffered).
// Backward: the key/value block travels with float32 accumulators of its dk, dv, which arrive
// home after N hops; dq accumulates locally; each step runs the fused backward with the global
// out and lse. Collective: every rank calls with the same shapes and options (check_same; a
// mismatch is an Error on every rank).
//
// Dropout (training with p > 0): the single-process mask on the gathered problem. Weight
// (b, t, s), t and s global positions, is element base + (b Tg + t) Sg + s of the dropout
// stream (Tg = N T_local, Sg = N S_local, base = Context::dropout_index_base(lens_repeat Tg Sg),
// as scaled_dot_product_attention on the whole sequence): each kernel call passes its block's
// place (kernels/attention_problem.hpp's dropout_window). The forward takes one stream offset
// (AttentionResult::dropout_offset), the backward redraws with it. p, seed, offset and the
// data-parallel sample window (Context::dropout_first_sample) must agree across ranks (checked).
//
// Memory per rank: q, k, v, out of the shard, two key/value blocks (and their dk, dv in the
// backward): O(T/N) per rank; no (T, S) tensor exists anywhere.
#pragma once

#include "attn/core/comm.hpp"
#include "attn/ops/attention.hpp"

#include <optional>
#include <vector>

namespace attn {

enum class RingLayout : uint8_t { kContiguous, kZigzag };
const char* ring_layout_name(RingLayout layout);

struct RingOptions {
  bool causal = false;
  MaskedRowPolicy masked_rows = MaskedRowPolicy::kUniform;
  int64_t lens_repeat = 1;           // batch row b reads valid_lens[b / lens_repeat] (MHA: heads)
  std::optional<RingLayout> layout;  // default: kZigzag when causal, else kContiguous
  std::optional<double> scale;       // default 1/sqrt(D)
  double dropout = 0.0;              // in [0, 1]; acts in training (the single-process mask)
  bool training = false;

  RingLayout resolved_layout() const {
    return layout ? *layout : (causal ? RingLayout::kZigzag : RingLayout::kContiguous);
  }
};

// Forward: the rank's rows of out and logsumexp (AttentionResult::weights stays undefined).
AttentionResult ring_attention(Context& ctx, Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& valid_lens,
                               const RingOptions& opts = {});

// Backward from the rank's dout (B, T_local, Dv) and its forward result: the rank's dq, and dk,
// dv of its own key/value shard (contiguous, dtypes of q, k, v).
AttentionGrads ring_attention_backward(Context& ctx, Communicator& comm, const Tensor& dout,
                                       const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& valid_lens, const AttentionResult& forward,
                                       const RingOptions& opts = {});

// The rank's part of a global tensor along `dim` (the sequence axis, default 1) in `layout`:
// a contiguous copy. Error unless the length divides into N (contiguous) or 2N (zigzag) parts.
Tensor ring_shard(const Tensor& global, int rank, int size, RingLayout layout, int dim = 1);
// The inverse: the global tensor from the N ranks' parts, in rank order.
Tensor ring_unshard(const std::vector<Tensor>& shards, RingLayout layout, int dim = 1);
// Collective ring_unshard: every rank gets the global tensor (N broadcasts of the parts).
Tensor ring_gather(Communicator& comm, const Tensor& local, RingLayout layout, int dim = 1);

}  // namespace attn
