// Generation with a Transformer encoder-decoder: greedy search and beam search over a batch of
// sources of different lengths, with the decoder's key/value cache (nn::TransformerDecoder::step)
// or, for reference and timing, by recomputing the whole prefix at every step.
//
// Vocabulary: B sources, S source positions, K beams, V target vocabulary, t the step (the
// position of the token being predicted; <bos> sits at position 0).
//
// Both run the model in eval mode (no dropout) and put back the mode they found.
//   greedy: token_t = argmax_v log p(v | prefix) (the lowest index on ties), the d2l 1.0
//     predict_step loop, except that a sequence stops at its <eos> (d2l runs max_len steps) and
//     that the positional encoding row is the step (d2l adds row 0 at every step).
//   beam (d2l 10.8): keeps the K most probable prefixes per source; a prefix that ends in <eos>
//     becomes a finished hypothesis scored log P / L^alpha, L its length with <eos>
//     (alpha = length_penalty; 0 ranks by log P). Per step: the 2K best extensions of the live
//     prefixes (ties: lower beam, then lower token); an <eos> among the first K of them finishes,
//     the first K others live on. A source is done when it has K finished hypotheses; at max_len
//     its live prefixes finish too (L = max_len). The best finished hypothesis is returned.
// Rows of finished sources keep being fed <eos> (their results are ignored), so the batch stays
// rectangular; a source whose sequence ended costs its row until the whole batch ends.
#pragma once

#include "attn/nn/decoder.hpp"

#include <vector>

namespace attn::model {

struct GenerationOptions {
  int64_t bos = 1;  // the target vocabulary's <bos> and <eos> indices
  int64_t eos = 2;
  int64_t max_len = 32;          // tokens generated per sequence at most, <eos> included
  int64_t beam_size = 4;         // beam_search only; >= 1
  double length_penalty = 0.75;  // beam_search only: alpha in log P / L^alpha (d2l's 0.75)
  bool use_cache = true;         // false: the decoder's forward on the whole prefix every step
  bool keep_logits = false;      // greedy_search only: fill Generation::logits
  // greedy_search with use_cache only: fill Generation::cross_attention (the alignment figure).
  bool keep_cross_attention = false;
};

struct Generation {
  // Per source: the generated tokens without <bos> and <eos>.
  std::vector<std::vector<int64_t>> tokens;
  std::vector<bool> ended;     // stopped at <eos> (false: cut at max_len)
  std::vector<double> scores;  // greedy: sum of log p of the tokens, <eos> included;
                               // beam: that sum / L^length_penalty
  int64_t steps = 0;           // decoder steps run (the longest sequence, <eos> included)
  // keep_logits: (B, steps, V), the logits each step computed (after a sequence ended its row
  // holds the logits of the <eos> fed to it).
  Tensor logits;
  // keep_cross_attention: per decoder block, (B*H, steps, S) pre-dropout weights of each step's
  // query over the source (row b*H + h), d2l's attention_weights[1][i] of predict_step stacked.
  std::vector<Tensor> cross_attention;
};

// src (B, S) I32/I64 token ids, src_valid_lens undefined or (B,) (source positions >= the length
// are padding: neither the encoder nor the cross-attention reads them).
Generation greedy_search(Context& ctx, nn::EncoderDecoder& model, const Tensor& src,
                         const Tensor& src_valid_lens, const GenerationOptions& options);
Generation beam_search(Context& ctx, nn::EncoderDecoder& model, const Tensor& src,
                       const Tensor& src_valid_lens, const GenerationOptions& options);

}  // namespace attn::model
