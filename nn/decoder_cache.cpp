// Incremental decoding for the Transformer decoder: init_state projects the encoder outputs once,
// step decodes new positions against a cache of projected keys and values.
//
// Vocabulary: B batch, T_new positions decoded by one step, L = state.length positions already
// cached, S source positions, E = num_hiddens, H heads, D = E / H, V target vocabulary.
//
// One step of one block, for new inputs X (B, T_new, E) at positions L .. L + T_new - 1
// (the training forward's lines in nn/decoder.cpp, restricted to the new rows):
//   Q = X W_q^T;  K[:, L:L+T_new] = X W_k^T;  V[:, L:L+T_new] = X W_v^T      appended to the cache
//   Y = ln1(W_o(attention(Q, K[:, :L+T_new], V[:, :L+T_new])) + X)           query L+i sees keys
//                                                                            0..L+i (causal)
//   Z = ln2(W_o2(attention(Y W_q2^T, K_enc, V_enc, enc_valid_lens)) + Y)     K_enc, V_enc from
//                                                                            init_state
//   out = ln3(ffn(Z) + Z)
// Cost per step and row: the projections O(T_new E^2), attention O(T_new (L + S) E), no
// recomputation of the prefix. The attention runs straight on the cache (head strides, the cache's
// batch stride): the decode kernel for T_new <= 8 (float32), the fused flash kernel for longer
// steps; otherwise (float64, or weights asked for) d2l's head copies and the scaled dot-product
// attention op.
#include "attn/nn/decoder.hpp"

#include "attn/ops/activation.hpp"
#include "attn/ops/embedding.hpp"
#include "attn/ops/layer_norm.hpp"
#include "attn/ops/linear.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"
#include "ops/attention_decode.hpp"
#include "ops/attention_heads.hpp"
#include "ops/linear_parameter.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace attn::nn {

namespace {

// Copies n positions of batch row sb of src, starting at position s0, to batch row db of dst at
// d0. Both (B, L, E) with contiguous (L, E) rows per batch row, same dtype.
void copy_positions(Tensor& dst, int64_t db, int64_t d0, const Tensor& src, int64_t sb, int64_t s0,
                    int64_t n) {
  if (n <= 0) return;
  const int64_t E = dst.dim(2);
  const size_t elem = dtype_size(dst.dtype());
  auto* d = static_cast<std::byte*>(dst.raw_data()) + (db * dst.stride(0) + d0 * E) * elem;
  const auto* s =
      static_cast<const std::byte*>(src.raw_data()) + (sb * src.stride(0) + s0 * E) * elem;
  std::memcpy(d, s, static_cast<size_t>(n * E) * elem);
}

Tensor apply_linear(Context& ctx, const Tensor& x, const Linear& l) {
  return attn::detail::linear_of_parameter(ctx, x, l.weight.value,
                                           l.has_bias() ? l.bias.value : Tensor(), false);
}

// The projection l(X) of the new positions X (B, T_new, E) stored in `cache` (B, capacity, E) at
// positions L .. L + T_new - 1. Where the new rows are one stride apart in the cache (one new
// position, or one batch row) and the cache has X's dtype, the product writes there directly;
// otherwise (a bfloat16 cache, several rows of several positions) it is converted and copied in.
void append_projection(Context& ctx, const Tensor& X, const Linear& l, Tensor& cache, int64_t L) {
  const int64_t B = X.dim(0), Tn = X.dim(1);
  if (cache.dtype() == X.dtype() && (Tn == 1 || B == 1)) {
    attn::detail::linear_of_parameter_into(
        ctx, X, l.weight.value, l.has_bias() ? l.bias.value : Tensor(), cache.slice(1, L, L + Tn));
    return;
  }
  const Tensor n = apply_linear(ctx, X, l).to(cache.dtype()).contiguous();
  for (int64_t b = 0; b < B; ++b)
    copy_positions(cache, b, L, n, b, 0, Tn);
}

// AddNorm in eval mode: ln(Y + X), the training forward's add_all({Y, X}) order.
Tensor add_norm(Context& ctx, const AddNorm& an, const Tensor& X, const Tensor& Y) {
  return layer_norm(ctx, detail::add_all({Y, X}), an.ln.weight.value, an.ln.bias.value, an.ln.eps)
      .y;
}

// Multi-head attention core on (B, ., E) projections: the decode kernel for a few new queries
// (ops/attention_decode.hpp: split-K over the cache, fp32 or bf16), the fused flash kernel on the
// tensors as they are for more, or d2l's transpose_qkv -> attention -> transpose_output when the
// weights are asked for. lens: undefined, (B,) or (B, T_new), per batch row. weights (optional):
// the (B*H, T_new, S) pre-dropout weights.
Tensor heads_attention(Context& ctx, const Tensor& Q, const Tensor& K, const Tensor& V, int64_t H,
                       const Tensor& lens, Tensor* weights) {
  AttentionOptions o;
  o.mask.valid_lens = lens;
  o.need_weights = weights != nullptr;
  if (attn::detail::multi_head_decode_supported(ctx, Q.dtype(), Q.dim(1), o))
    return attn::detail::multi_head_decode_attention(ctx, Q, K, V, H, o).output;
  // A bfloat16 cache outside the decode kernel (more than 8 new positions, weights asked for):
  // float32 copies for the other paths.
  if (K.dtype() != Q.dtype())
    return heads_attention(ctx, Q, K.to(Q.dtype()), V.to(Q.dtype()), H, lens, weights);
  if (!weights && attn::detail::multi_head_fused_supported(ctx, Q.dtype(), o))
    return attn::detail::multi_head_attention_forward(ctx, Q, K, V, H, o).output;
  o.mask.lens_repeat = H;
  AttentionResult r = scaled_dot_product_attention(
      ctx, detail::split_heads(Q, H), detail::split_heads(K, H), detail::split_heads(V, H), o);
  if (weights) *weights = r.weights;
  return detail::merge_heads(r.output, H);
}

// attention2 over the encoder's projections. Rows sharing an encoder row (state.enc_share > 1:
// a source's beams) go to the decode kernel as one row of enc_share * T_new queries against the
// one copy of its keys and values: q (B, T_new, E) viewed as (B / share, share * T_new, E), each
// query computed as on its own row. Where that kernel does not serve them (weights asked for, too
// many queries, float64, the reference backend), the encoder's rows are copied out per row.
Tensor cross_attention(Context& ctx, const Tensor& Q, const DecoderBlockCache& c,
                       const DecoderState& state, int64_t H, Tensor* weights) {
  const int64_t share = state.enc_share;
  if (share == 1)
    return heads_attention(ctx, Q, c.enc_keys, c.enc_values, H, state.enc_valid_lens, weights);
  const int64_t B = Q.dim(0), T = Q.dim(1), E = Q.dim(2);
  AttentionOptions o;
  o.mask.valid_lens = state.enc_valid_lens;
  o.need_weights = weights != nullptr;
  if (attn::detail::multi_head_decode_supported(ctx, Q.dtype(), share * T, o) &&
      Q.is_contiguous()) {
    const Tensor grouped = Q.reshape({B / share, share * T, E});
    return attn::detail::multi_head_decode_attention(ctx, grouped, c.enc_keys, c.enc_values, H, o)
        .output.reshape({B, T, E});
  }
  std::vector<int64_t> rows(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i)
    rows[static_cast<size_t>(i)] = i / share;
  const Tensor lens =
      state.enc_valid_lens.defined() ? detail::gather_rows(state.enc_valid_lens, rows) : Tensor();
  return heads_attention(ctx, Q, detail::gather_rows(c.enc_keys, rows),
                         detail::gather_rows(c.enc_values, rows), H, lens, weights);
}

// Grows every block's self-attention cache to hold at least `needed` positions (geometrically,
// so a long generation reallocates O(log) times), keeping the cached rows (the spare capacity
// stays uninitialised, as init_state leaves it).
void reserve(DecoderState& state, int64_t needed) {
  if (needed <= state.capacity) return;
  const int64_t cap = std::max(needed, 2 * state.capacity);
  for (DecoderBlockCache& c : state.blocks) {
    for (Tensor* t : {&c.keys, &c.values}) {
      Tensor grown = Tensor::empty({state.batch, cap, t->dim(2)}, t->dtype());
      for (int64_t b = 0; b < state.batch; ++b)
        copy_positions(grown, b, 0, *t, b, 0, state.length);
      *t = grown;
    }
  }
  state.capacity = cap;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// DecoderState

void DecoderState::reorder(const std::vector<int64_t>& rows) {
  const char* op = "DecoderState::reorder";
  check(static_cast<int64_t>(rows.size()) == batch, op, "{} rows given for a state of batch {}",
        rows.size(), batch);
  for (int64_t r : rows)
    check(r >= 0 && r < batch, op, "row {} is outside [0, {})", r, batch);
  // The encoder's keys and values only move when a row takes another source's row (beam search
  // reorders within each source's beams, so usually they stay).
  bool same_sources = true;
  for (int64_t i = 0; i < batch; ++i)
    same_sources &= source_row[static_cast<size_t>(rows[static_cast<size_t>(i)])] ==
                    source_row[static_cast<size_t>(i)];
  // Rows that continue another row (`moving`: overwritten), and of the rows they read those that
  // are overwritten themselves, each once (`read_rows`): only those are set aside first; a row
  // that continues itself (most, in beam search) is read in place and not touched. Only the
  // decoded positions are copied, not the spare capacity.
  // Where rows move across sources, the encoder's rows of the new order, one per row.
  std::vector<int64_t> encoder_rows;
  if (!same_sources)
    for (int64_t r : rows)
      encoder_rows.push_back(r / enc_share);
  std::vector<int64_t> moving, read_rows, slot(static_cast<size_t>(batch), -1);
  std::vector<bool> overwritten(static_cast<size_t>(batch), false);
  for (int64_t i = 0; i < batch; ++i)
    if (rows[static_cast<size_t>(i)] != i) {
      moving.push_back(i);
      overwritten[static_cast<size_t>(i)] = true;
    }
  for (int64_t i : moving) {
    const auto from = static_cast<size_t>(rows[static_cast<size_t>(i)]);
    if (overwritten[from] && slot[from] < 0) {
      slot[from] = static_cast<int64_t>(read_rows.size());
      read_rows.push_back(static_cast<int64_t>(from));
    }
  }
  for (DecoderBlockCache& c : blocks) {
    for (Tensor* t : {&c.keys, &c.values}) {
      if (moving.empty() || length == 0) break;
      Tensor read;
      if (!read_rows.empty()) {
        read =
            Tensor::empty({static_cast<int64_t>(read_rows.size()), length, t->dim(2)}, t->dtype());
        for (size_t j = 0; j < read_rows.size(); ++j)
          copy_positions(read, static_cast<int64_t>(j), 0, *t, read_rows[j], 0, length);
      }
      for (int64_t i : moving) {
        const int64_t from = rows[static_cast<size_t>(i)];
        if (overwritten[static_cast<size_t>(from)])
          copy_positions(*t, i, 0, read, slot[static_cast<size_t>(from)], 0, length);
        else
          copy_positions(*t, i, 0, *t, from, 0, length);
      }
    }
    if (!same_sources) {
      c.enc_keys = detail::gather_rows(c.enc_keys, encoder_rows);
      c.enc_values = detail::gather_rows(c.enc_values, encoder_rows);
    }
  }
  if (!same_sources) {
    if (enc_valid_lens.defined())
      enc_valid_lens = detail::gather_rows(enc_valid_lens, encoder_rows);
    enc_share = 1;
    std::vector<int64_t> sources(rows.size());
    for (size_t i = 0; i < rows.size(); ++i)
      sources[i] = source_row[static_cast<size_t>(rows[i])];
    source_row = sources;
  }
}

void DecoderState::repeat_interleave(int64_t times) {
  check(times >= 1, "DecoderState::repeat_interleave", "times must be >= 1, got {}", times);
  std::vector<int64_t> rows(static_cast<size_t>(batch * times));
  for (size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<int64_t>(i) / times;
  for (DecoderBlockCache& c : blocks) {
    // The self-attention caches: the decoded positions only, not the spare capacity.
    for (Tensor* t : {&c.keys, &c.values}) {
      Tensor grown = Tensor::empty({batch * times, t->dim(1), t->dim(2)}, t->dtype());
      for (size_t i = 0; i < rows.size(); ++i)
        copy_positions(grown, static_cast<int64_t>(i), 0, *t, rows[i], 0, length);
      *t = grown;
    }
  }
  // The encoder's rows stay as they are, shared by each row's `times` copies.
  enc_share *= times;
  std::vector<int64_t> sources(rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    sources[i] = source_row[static_cast<size_t>(rows[i])];
  source_row = sources;
  batch *= times;
}

// ----------------------------------------------------------------------------------------------
// init_state and step

DecoderState TransformerDecoder::init_state(Context& ctx, const Tensor& enc_outputs,
                                            const Tensor& enc_valid_lens, int64_t capacity,
                                            DType cache_dtype) {
  const char* op = "TransformerDecoder::init_state";
  detail::check_input(op, "enc_outputs", enc_outputs, 3, dtype_);
  const int64_t B = enc_outputs.dim(0), E = num_hiddens_;
  check(enc_outputs.dim(2) == E, op, "enc_outputs has shape {}, expected (B, S, {})",
        shape_arg(enc_outputs.shape()), E);
  check(capacity >= 0, op, "capacity must be >= 0, got {}", capacity);
  // The float64 decoder keeps its float64 cache (DType::F32 is the parameter's default).
  const DType cache = dtype_ == DType::F64 && cache_dtype == DType::F32 ? dtype_ : cache_dtype;
  check(cache == dtype_ || (dtype_ == DType::F32 && cache == DType::BF16), op,
        "cache_dtype {} for a {} decoder: expected the decoder's dtype or bfloat16 for float32",
        dtype_name(cache_dtype), dtype_name(dtype_));
  DecoderState state;
  state.batch = B;
  state.capacity = std::max<int64_t>(capacity, 1);
  if (enc_valid_lens.defined()) {
    check(enc_valid_lens.ndim() == 1 && enc_valid_lens.dim(0) == B, op,
          "enc_valid_lens has shape {}, expected (B) = ({})", shape_arg(enc_valid_lens.shape()), B);
    // float64 holds every integer length exactly and keeps d2l's float lengths.
    state.enc_valid_lens = enc_valid_lens.to(DType::F64).clone();
  }
  state.source_row.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    state.source_row[static_cast<size_t>(b)] = b;
  for (auto& blk : blks) {
    DecoderBlockCache c;
    // forward: attention2(Y, enc, enc) projects enc with W_k and W_v whatever the queries are.
    c.enc_keys = apply_linear(ctx, enc_outputs, blk->attention2.W_k).to(cache).contiguous();
    c.enc_values = apply_linear(ctx, enc_outputs, blk->attention2.W_v).to(cache).contiguous();
    // Uninitialised: a position is written by the step that decodes it before anything reads it
    // (attention reads positions [0, length + T_new) only), so clearing the spare capacity was
    // time for nothing (1-1.6% of a greedy translate profile).
    c.keys = Tensor::empty({B, state.capacity, E}, cache);
    c.values = Tensor::empty({B, state.capacity, E}, cache);
    state.blocks.push_back(std::move(c));
  }
  state.self_attention_weights.assign(blks.size(), Tensor());
  state.cross_attention_weights.assign(blks.size(), Tensor());
  return state;
}

Tensor TransformerDecoder::step(Context& ctx, const Tensor& ids, DecoderState& state) {
  const char* op = "TransformerDecoder::step";
  check(ids.defined() && ids.ndim() == 2 && ids.dim(0) == state.batch && ids.dim(1) >= 1, op,
        "ids has shape {}, expected (B, T_new) = ({}, >= 1)", shape_arg(ids), state.batch);
  check(state.blocks.size() == blks.size(), op,
        "the state has {} blocks, the decoder {}: it comes from another decoder",
        state.blocks.size(), blks.size());
  const int64_t B = state.batch, Tn = ids.dim(1), L = state.length, E = num_hiddens_;
  const int64_t H = num_heads_;
  reserve(state, L + Tn);

  // X = embedding(ids) * sqrt(E) + P[L : L + T_new]: the positions of these tokens in the whole
  // sequence (d2l adds P[0] at every step; see the header).
  Tensor X = detail::scaled(attn::embedding(ctx, ids, embedding.weight.value),
                            std::sqrt(static_cast<double>(E)));
  const Tensor P = pos_encoding.P(L + Tn).slice(0, L, L + Tn).contiguous();
  auto add_rows = [&](auto zero) {
    using F = decltype(zero);
    F* x = X.data<F>();
    const F* p = P.data<F>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tn * E; ++i)
        x[b * Tn * E + i] = x[b * Tn * E + i] + p[i];
  };
  if (dtype_ == DType::F32)
    add_rows(float{});
  else
    add_rows(double{});

  // New query i (position L + i) sees cached keys 0 .. L + i. One new query sees all of them.
  Tensor self_lens;
  if (Tn > 1) {
    std::vector<int64_t> lens(static_cast<size_t>(B * Tn));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tn; ++i)
        lens[static_cast<size_t>(b * Tn + i)] = L + i + 1;
    self_lens = Tensor::from_vector(lens, {B, Tn}, DType::I64);
  }

  for (size_t i = 0; i < blks.size(); ++i) {
    const TransformerDecoderBlock& blk = *blks[i];
    DecoderBlockCache& c = state.blocks[i];
    // Self-attention over the cache extended by the new positions.
    const Tensor Q = apply_linear(ctx, X, blk.attention1.W_q);
    append_projection(ctx, X, blk.attention1.W_k, c.keys, L);
    append_projection(ctx, X, blk.attention1.W_v, c.values, L);
    const Tensor K = c.keys.slice(1, 0, L + Tn), V = c.values.slice(1, 0, L + Tn);
    Tensor O = heads_attention(ctx, Q, K, V, H, self_lens,
                               need_weights ? &state.self_attention_weights[i] : nullptr);
    const Tensor Y = add_norm(ctx, blk.addnorm1, X, apply_linear(ctx, O, blk.attention1.W_o));
    // Encoder-decoder attention over the projections init_state made.
    const Tensor Q2 = apply_linear(ctx, Y, blk.attention2.W_q);
    O = cross_attention(ctx, Q2, c, state, H,
                        need_weights ? &state.cross_attention_weights[i] : nullptr);
    const Tensor Z = add_norm(ctx, blk.addnorm2, Y, apply_linear(ctx, O, blk.attention2.W_o));
    const Linear& d1 = blk.ffn.dense1;  // relu(dense1(Z)) in dense1's product (linear_relu)
    const Tensor F =
        apply_linear(ctx,
                     attn::detail::linear_of_parameter(
                         ctx, Z, d1.weight.value, d1.has_bias() ? d1.bias.value : Tensor(), true),
                     blk.ffn.dense2);
    X = add_norm(ctx, blk.addnorm3, Z, F);
  }
  state.length = L + Tn;
  return apply_linear(ctx, X, dense);  // (B, T_new, V)
}

}  // namespace attn::nn
