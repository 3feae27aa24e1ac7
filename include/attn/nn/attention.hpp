// Attention modules of d2l chapter 11 (new edition numbering), forward and backward.
//
// Vocabulary: B batch, T queries, S keys/values, H heads, E = num_hiddens, D = E / H.
#pragma once

#include "attn/nn/module.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/relative_position.hpp"
#include "attn/ops/ring_attention.hpp"

#include <optional>

namespace attn::nn {

struct AttentionInputGrads {
  Tensor dqueries, dkeys, dvalues;  // for self-attention (X, X, X) the gradient of X is the sum
};

// d2l DotProductAttention(dropout): no parameters; attention_weights() (B, T, S) pre-dropout.
// dtype F32, F64 or BF16 (then output and input gradients BF16, attention_weights F32; the
// fused bf16 kernel runs when need_weights is false).
class DotProductAttention : public Module {
 public:
  explicit DotProductAttention(double dropout, DType dtype = DType::F32);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override { return {}; }
  // queries (B, T, D), keys (B, S, D), values (B, S, Dv), valid_lens undefined / (B,) / (B, T)
  Tensor forward(Context& ctx, const Tensor& queries, const Tensor& keys, const Tensor& values,
                 const Tensor& valid_lens = {});
  AttentionInputGrads backward(Context& ctx, const Tensor& dout);
  const Tensor& attention_weights() const { return result_.weights; }

  double dropout;
  bool causal = false;
  MaskedRowPolicy masked_rows = MaskedRowPolicy::kUniform;
  int64_t lens_repeat = 1;  // used by MultiHeadAttention (valid_lens per batch, rows per head)
  // d2l always keeps attention_weights (B, T, S). Set false for long sequences: no T x S matrix
  // is then stored (the fused kernels need O(T*D) memory) and attention_weights() is undefined.
  bool need_weights = true;
  // Relative positions (not in d2l; off by default). Inside MultiHeadAttention set them on
  // mha.attention; attn/ops/relative_position.hpp has the formulas.
  //   rotary: RoPE rotates queries (position t) and keys (position s) before the scores; the
  //           query/key width must be even. The backward rotates dq and dk back.
  //   alibi_slopes: (H) float, adds -alibi_slopes[b % H] * |t - s| to the scores; with
  //           lens_repeat = H (MultiHeadAttention) b % H is the head. Runs the reference kernel.
  std::optional<RotaryOptions> rotary;
  Tensor alibi_slopes;

 private:
  Tensor q_, k_, v_, valid_lens_;
  std::optional<RotaryOptions> rotary_used_;  // the forward's settings, for the backward
  Tensor alibi_used_;
  AttentionResult result_;
  AttentionOptions options() const;
};

// d2l AdditiveAttention(num_hiddens, dropout): W_q, W_k (lazy, no bias), w_v (1, num_hiddens).
//   score = w_v(tanh(W_q q + W_k k)), no scaling; state dict W_q.weight, W_k.weight, w_v.weight.
class AdditiveAttention : public Module {
 public:
  AdditiveAttention(int64_t num_hiddens, double dropout, DType dtype = DType::F32,
                    uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& queries, const Tensor& keys, const Tensor& values,
                 const Tensor& valid_lens);
  AttentionInputGrads backward(Context& ctx, const Tensor& dout);
  const Tensor& attention_weights() const { return result_.weights; }

  Linear W_q, W_k, w_v;
  double dropout;

 private:
  Tensor qp_, kp_, v_, valid_lens_;
  AdditiveResult result_;
};

// d2l MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False):
//   Q = W_q(queries), K = W_k(keys), V = W_v(values)     (B, T|S, E); widths of queries, keys and
//   values may differ (the projections are lazy, like LazyLinear)
//   head h owns features [h*D, (h+1)*D); attention per (b, h) with batch index b*H + h
//   out = W_o(concat_h attention(Q_h, K_h, V_h, valid_lens))   (B, T, E)
// attention_weights(): (B*H, T, S) pre-dropout, as d2l's mha.attention.attention_weights.
// State dict: d2l names W_q.weight, W_k.weight, W_v.weight, W_o.weight (+ .bias with bias=true);
// load_state_dict also accepts torch.nn.MultiheadAttention's names: in_proj_weight (3E, E) packed
// [W_q; W_k; W_v] or q_proj_weight/k_proj_weight/v_proj_weight, in_proj_bias (3E),
// out_proj.weight, out_proj.bias.
// Equivalent PyTorch: nn.MultiheadAttention(E, H, dropout, bias, batch_first=True) with
// key_padding_mask = arange(S) >= valid_lens[:, None] (d2l and torch differ on fully masked rows:
// d2l uniform, torch NaN).
// dtype F32, F64 or BF16. BF16 is the PyTorch module after .to(torch.bfloat16): inputs, output,
// input gradients, parameters and their gradients BF16 (attention_weights() F32); the
// projections run the bf16 linear (f32 accumulation, one rounding per output) and the core the
// fused bf16 kernel on the projections' head strides (as float32 below), or, where the fused
// path does not apply, the bf16 attention op on d2l's head copies.
class MultiHeadAttention : public Module {
 public:
  MultiHeadAttention(int64_t num_hiddens, int64_t num_heads, double dropout, bool bias = false,
                     DType dtype = DType::F32, uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  void load_state_dict(const StateDict& dict, bool strict = true) override;

  Tensor forward(Context& ctx, const Tensor& queries, const Tensor& keys, const Tensor& values,
                 const Tensor& valid_lens = {});
  AttentionInputGrads backward(Context& ctx, const Tensor& dout);
  // Undefined after a forward that took the fused path (need_weights = false).
  const Tensor& attention_weights() const {
    return saved_.path == Path::kHeads || saved_.path == Path::kPackedHeads
               ? attention.attention_weights()
               : saved_.core.weights;
  }
  void train(bool on = true) override;

  int64_t num_hiddens() const { return num_hiddens_; }
  int64_t num_heads() const { return num_heads_; }

  DotProductAttention attention;
  Linear W_q, W_k, W_v, W_o;
  // Self-attention only (forward(X, X, X) on one tensor): when set, backward returns the full
  // gradient of X in dqueries and leaves dkeys, dvalues undefined, instead of the three terms
  // whose sum it is. Saves two (B, T, E) GEMM outputs and the caller's sum; off by default
  // (d2l's contract). Ignored (three terms returned) when queries, keys, values differ.
  bool self_attention_input_grad = false;
  // Under autocast (a float32 module, Context::autocast_bf16) only; off by default: when set, the
  // output stays in bf16 where the fused path computes it in bf16 (W_o's rounding, not widened
  // to float32), backward also takes dout in bf16, and with self_attention_input_grad the input
  // gradient comes back in bf16 (the projection's rounding). The next layer widens exactly, so
  // the values are the same; TransformerEncoderBlock sets it, and its AddNorm reads the bf16.
  bool bf16_seams = false;
  // Sequence parallelism (not in d2l; null by default): when set, queries, keys, values (and a
  // per-query valid_lens (B, T_local)) are this rank's shard of the sequence, cut as ring_shard
  // cuts it (attn/ops/ring_attention.hpp; layout `sequence_layout`, default zigzag when causal),
  // and the attention core runs ring_attention over the communicator: the projections are per
  // token and stay local. Outputs and input gradients are the rank's rows of the
  // single-process module's on the whole sequence; PARAMETER gradients are this rank's partial
  // sums: all-reduce them (sum) across ranks before the optimizer step. float32 and bfloat16;
  // dropout draws the single-process module's masks (same seed: the same outputs; the
  // Context's dropout_first_sample composes, as in ring_attention), attention_weights() stays
  // undefined, RoPE/ALiBi are refused;
  // the padding guard for non-finite padding rows is not applied; self_attention_input_grad is
  // ignored (three input gradients). Every rank calls forward and
  // backward together (collective).
  Communicator* sequence_parallel = nullptr;
  std::optional<RingLayout> sequence_layout;

 private:
  int64_t num_hiddens_, num_heads_;
  int64_t B_ = 0, T_ = 0, S_ = 0;
  // The path of the last forward, chosen once by forward (nn/multihead_attention.cpp says when
  // each applies) and read by backward; each has one forward and one backward function.
  enum class Path : uint8_t {
    kHeads,        // d2l: three projections, head copies (B*H, T, D), DotProductAttention
    kPackedHeads,  // bfloat16 self-attention off the fused path: one stacked projection, copies
    kFused,        // three projections (B, T, E) read through head strides by the fused core
    kPackedFused,  // self-attention: one stacked projection, the fused core on its slices
    kRing,         // sequence_parallel: head copies, ring_attention over the communicator
  };
  // What backward needs of the forward, by path.
  struct Saved {
    Path path = Path::kHeads;
    // The dtype the projections and the core computed in: the module's, or BF16 for a float32
    // module under Context::autocast_bf16 (fused paths).
    DType compute_dtype = DType::F32;
    bool seams = false;    // bf16_seams under autocast at this forward
    bool stacked = false;  // packed: W_qkv_ came from the stacked parameters
    Tensor Q, K, V;        // fused: (B, T|S, E) projections (slices of one (B, T, 3E) when packed);
                           // ring: head copies (B*H, T_local, D)
    Tensor X;              // packed: the input in the compute dtype
    AttentionResult core;  // fused and ring: the core's output, lse, dropout decisions
    AttentionOptions core_options;  // fused
    Tensor valid_lens;              // ring
    RingOptions ring_options;       // ring
  };
  Saved saved_;
  // [W_q; W_k; W_v] (3E, in) and [b_q; b_k; b_v] as the packed projection reads them: the stacked
  // parameters themselves (below) or, when those are not stacked or need another dtype, a copy
  // made per forward.
  Tensor W_qkv_, b_qkv_;
  // When a self-attention forward creates W_q, W_k and W_v (they are lazy), their weights, biases
  // and gradients are made row slices of these stacked tensors: the packed projection then reads
  // the weights in place and its backward adds into the three gradients in one pass. A layer
  // created otherwise (a cross-attention forward first, or a load before the first forward) or a
  // parameter a caller later replaces leaves the stack unused (projections_stacked()), and the
  // weights are copied per forward as before.
  Tensor qkv_weight_, qkv_weight_grad_, qkv_bias_, qkv_bias_grad_;

  void stack_projections(int64_t in_features);
  bool projections_stacked() const;
  Tensor pack_projection(Context& ctx, const Tensor& X, DType wdt);
  Tensor forward_heads(Context& ctx, const Tensor& queries, const Tensor& keys,
                       const Tensor& values, const Tensor& valid_lens);
  Tensor forward_fused(Context& ctx, const Tensor& queries, const Tensor& keys,
                       const Tensor& values, const AttentionOptions& o);
  AttentionInputGrads backward_heads(Context& ctx, const Tensor& dconcat);
  AttentionInputGrads backward_fused(Context& ctx, const Tensor& dconcat);
  AttentionInputGrads backward_packed(Context& ctx, const Tensor& dconcat);
  Tensor ring_forward(Context& ctx, const Tensor& queries, const Tensor& keys, const Tensor& values,
                      const Tensor& valid_lens);
  AttentionInputGrads ring_backward(Context& ctx, const Tensor& dconcat);
};

}  // namespace attn::nn
