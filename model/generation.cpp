// Greedy and beam search over a Transformer encoder-decoder (contract in
// attn/model/generation.hpp).
//
// Vocabulary: B sources, R decoder rows (B for greedy, B*K for beam search, row b*K + k is beam k
// of source b), S source positions, V target vocabulary, t the step.
#include "attn/model/generation.hpp"

#include "nn/internal.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace attn::model {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Runs the model in eval mode (and the decoder with or without attention weights) for the
// lifetime of the guard, then puts back what it found.
class EvalGuard {
 public:
  EvalGuard(nn::EncoderDecoder& model, bool need_weights)
      : model_(model), training_(model.training()), need_weights_(model.decoder.need_weights) {
    model_.eval();
    model_.decoder.need_weights = need_weights;
  }
  ~EvalGuard() {
    model_.train(training_);
    model_.decoder.need_weights = need_weights_;
  }
  EvalGuard(const EvalGuard&) = delete;
  EvalGuard& operator=(const EvalGuard&) = delete;

 private:
  nn::EncoderDecoder& model_;
  bool training_, need_weights_;
};

// The next-token logits of R prefixes, by the cache (one step per call) or by the decoder's
// forward on the whole prefix (the reference: the same numbers up to rounding).
class PrefixDecoder {
 public:
  // enc_outputs (B, S, E); each source serves `rows_per_source` consecutive rows.
  PrefixDecoder(Context& ctx, nn::TransformerDecoder& decoder, const Tensor& enc_outputs,
                const Tensor& src_valid_lens, int64_t rows_per_source, bool use_cache,
                int64_t capacity, DType cache_dtype)
      : ctx_(ctx), decoder_(decoder), use_cache_(use_cache) {
    if (use_cache_) {
      state_ = decoder.init_state(ctx, enc_outputs, src_valid_lens, capacity, cache_dtype);
      if (rows_per_source > 1) state_.repeat_interleave(rows_per_source);
      return;
    }
    std::vector<int64_t> rows(static_cast<size_t>(enc_outputs.dim(0) * rows_per_source));
    for (size_t i = 0; i < rows.size(); ++i)
      rows[i] = static_cast<int64_t>(i) / rows_per_source;
    enc_ = nn::detail::gather_rows(enc_outputs, rows);
    if (src_valid_lens.defined())
      lens_ = nn::detail::gather_rows(src_valid_lens.to(DType::F64), rows);
  }

  // prefixes[r]: <bos> and the tokens so far, all of one length t + 1. Returns (R, V) logits of
  // position t. With the cache only the newest token is decoded (the others are cached).
  Tensor next_logits(const std::vector<std::vector<int64_t>>& prefixes) {
    const int64_t R = static_cast<int64_t>(prefixes.size());
    const int64_t len = static_cast<int64_t>(prefixes[0].size());
    if (use_cache_) {
      std::vector<int64_t> ids(static_cast<size_t>(R));
      for (int64_t r = 0; r < R; ++r)
        ids[static_cast<size_t>(r)] = prefixes[static_cast<size_t>(r)].back();
      Tensor logits = decoder_.step(ctx_, Tensor::from_vector(ids, {R, 1}), state_);
      return logits.reshape({R, logits.dim(2)});
    }
    std::vector<int64_t> ids;
    ids.reserve(static_cast<size_t>(R * len));
    for (const auto& p : prefixes)
      ids.insert(ids.end(), p.begin(), p.end());
    Tensor logits = decoder_.forward(ctx_, Tensor::from_vector(ids, {R, len}), enc_, lens_);
    return logits.select(1, len - 1).contiguous();
  }

  // Row r continues row parents[r] (beam search).
  void reorder(const std::vector<int64_t>& parents) {
    if (use_cache_) state_.reorder(parents);
  }

  const nn::DecoderState& state() const { return state_; }

 private:
  Context& ctx_;
  nn::TransformerDecoder& decoder_;
  bool use_cache_;
  nn::DecoderState state_;
  Tensor enc_, lens_;
};

// The logits (R, V) of a step as doubles, row-major (one typed pass, not R*V element lookups:
// V is the target vocabulary, 10k in a translation model).
std::vector<double> to_doubles(const Tensor& logits) {
  const Tensor c = logits.contiguous();
  std::vector<double> out(static_cast<size_t>(c.numel()));
  if (c.dtype() == DType::F32) {
    const float* p = c.data<float>();
    std::copy(p, p + c.numel(), out.begin());
  } else {
    const double* p = c.data<double>();
    std::copy(p, p + c.numel(), out.begin());
  }
  return out;
}

// log_softmax of one row of V logits into out (V), in double.
void log_softmax_row(const double* row, int64_t V, std::vector<double>& out) {
  out.assign(row, row + V);
  const double m = *std::max_element(out.begin(), out.end());
  double sum = 0;
  for (double x : out)
    sum += std::exp(x - m);
  const double lse = m + std::log(sum);
  for (double& x : out)
    x -= lse;
}

struct Checked {
  int64_t B = 0, V = 0;
};

Checked check_generation(const char* op, nn::EncoderDecoder& model, const Tensor& src,
                         const Tensor& src_valid_lens, const GenerationOptions& o) {
  check(src.defined() && src.ndim() == 2, op, "src has shape {}, expected (B, S) token ids",
        shape_arg(src));
  check(!src_valid_lens.defined() ||
            (src_valid_lens.ndim() == 1 && src_valid_lens.dim(0) == src.dim(0)),
        op, "src_valid_lens has shape {}, expected (B) = ({})", shape_arg(src_valid_lens.shape()),
        src.dim(0));
  const int64_t V = model.decoder.vocab_size();
  check(o.bos >= 0 && o.bos < V && o.eos >= 0 && o.eos < V, op,
        "bos ({}) and eos ({}) must be target token ids in [0, {})", o.bos, o.eos, V);
  check(o.max_len >= 1, op, "max_len must be >= 1, got {}", o.max_len);
  return {src.dim(0), V};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Greedy search

Generation greedy_search(Context& ctx, nn::EncoderDecoder& model, const Tensor& src,
                         const Tensor& src_valid_lens, const GenerationOptions& o) {
  const char* op = "greedy_search";
  const auto [B, V] = check_generation(op, model, src, src_valid_lens, o);
  const bool keep_weights = o.keep_cross_attention && o.use_cache;
  EvalGuard guard(model, keep_weights);
  const Tensor enc = model.encoder.forward(ctx, src, src_valid_lens);
  PrefixDecoder dec(ctx, model.decoder, enc, src_valid_lens, 1, o.use_cache, o.max_len + 1,
                    o.cache_dtype);

  Generation g;
  g.tokens.assign(static_cast<size_t>(B), {});
  g.ended.assign(static_cast<size_t>(B), false);
  g.scores.assign(static_cast<size_t>(B), 0.0);
  std::vector<std::vector<int64_t>> prefixes(static_cast<size_t>(B), {o.bos});
  std::vector<Tensor> step_logits;
  std::vector<std::vector<Tensor>> step_weights(static_cast<size_t>(model.decoder.num_blks()));
  std::vector<double> logp;
  int64_t live = B;
  while (live > 0 && g.steps < o.max_len) {
    const Tensor logits = dec.next_logits(prefixes);  // (B, V)
    const std::vector<double> rows = to_doubles(logits);
    ++g.steps;
    if (o.keep_logits) step_logits.push_back(logits);
    if (keep_weights)
      for (size_t i = 0; i < step_weights.size(); ++i)
        step_weights[i].push_back(dec.state().cross_attention_weights[i]);
    for (int64_t b = 0; b < B; ++b) {
      auto& prefix = prefixes[static_cast<size_t>(b)];
      if (g.ended[static_cast<size_t>(b)]) {
        prefix.push_back(o.eos);  // keeps the batch rectangular; its logits are ignored
        continue;
      }
      // argmax, the lowest index on ties (torch.argmax on CPU).
      const double* row = rows.data() + b * V;
      const int64_t best = std::max_element(row, row + V) - row;
      log_softmax_row(row, V, logp);
      g.scores[static_cast<size_t>(b)] += logp[static_cast<size_t>(best)];
      prefix.push_back(best);
      if (best == o.eos) {
        g.ended[static_cast<size_t>(b)] = true;
        --live;
      } else {
        g.tokens[static_cast<size_t>(b)].push_back(best);
      }
    }
  }
  if (o.keep_logits) {
    g.logits = Tensor::empty({B, g.steps, V}, model.dtype());
    for (int64_t t = 0; t < g.steps; ++t)
      g.logits.select(1, t).copy_from(step_logits[static_cast<size_t>(t)]);
  }
  if (keep_weights) {
    for (auto& per_step : step_weights) {
      const Tensor& first = per_step.front();  // (B*H, 1, S)
      Tensor stacked = Tensor::empty({first.dim(0), g.steps, first.dim(2)}, first.dtype());
      for (int64_t t = 0; t < g.steps; ++t)
        stacked.slice(1, t, t + 1).copy_from(per_step[static_cast<size_t>(t)]);
      g.cross_attention.push_back(stacked);
    }
  }
  return g;
}

// ----------------------------------------------------------------------------------------------
// Beam search

namespace {

struct Hypothesis {
  double score;  // log P / L^alpha
  std::vector<int64_t> tokens;
  bool ended;
};

struct Candidate {
  double logp;  // log P of the extended prefix
  int64_t beam, token;
};

}  // namespace

Generation beam_search(Context& ctx, nn::EncoderDecoder& model, const Tensor& src,
                       const Tensor& src_valid_lens, const GenerationOptions& o) {
  const char* op = "beam_search";
  const auto [B, V] = check_generation(op, model, src, src_valid_lens, o);
  check(o.beam_size >= 1, op, "beam_size must be >= 1, got {}", o.beam_size);
  check(std::isfinite(o.length_penalty), op, "length_penalty is {}, expected a finite number",
        o.length_penalty);
  const int64_t K = o.beam_size, R = B * K;
  EvalGuard guard(model, false);
  const Tensor enc = model.encoder.forward(ctx, src, src_valid_lens);
  PrefixDecoder dec(ctx, model.decoder, enc, src_valid_lens, K, o.use_cache, o.max_len + 1,
                    o.cache_dtype);
  auto normalized = [&](double logp, int64_t length) {
    return logp / std::pow(static_cast<double>(length), o.length_penalty);
  };

  // Beam k of source b is row b*K + k. At the start only beam 0 is live (all K would extend the
  // same <bos> into K copies of the same candidates).
  std::vector<std::vector<int64_t>> prefixes(static_cast<size_t>(R), {o.bos});
  std::vector<double> beam_logp(static_cast<size_t>(R), kNegInf);
  for (int64_t b = 0; b < B; ++b)
    beam_logp[static_cast<size_t>(b * K)] = 0.0;
  std::vector<std::vector<Hypothesis>> finished(static_cast<size_t>(B));
  std::vector<bool> done(static_cast<size_t>(B), false);
  std::vector<double> logp;
  std::vector<Candidate> cands;
  Generation g;
  int64_t open = B;
  while (open > 0 && g.steps < o.max_len) {
    const std::vector<double> rows = to_doubles(dec.next_logits(prefixes));  // (R, V)
    const int64_t t = g.steps++;  // the prefixes hold t + 1 tokens
    std::vector<int64_t> parents(static_cast<size_t>(R));
    std::iota(parents.begin(), parents.end(), 0);
    std::vector<std::vector<int64_t>> next(static_cast<size_t>(R));
    std::vector<double> next_logp(static_cast<size_t>(R), kNegInf);
    for (int64_t b = 0; b < B; ++b) {
      if (done[static_cast<size_t>(b)]) {
        for (int64_t k = 0; k < K; ++k) {
          const size_t r = static_cast<size_t>(b * K + k);
          next[r] = prefixes[r];
          next[r].push_back(o.eos);  // ignored rows keep the batch rectangular
        }
        continue;
      }
      // Every extension of every live beam, then the best 2K (ties: lower beam, lower token).
      cands.clear();
      for (int64_t k = 0; k < K; ++k) {
        const size_t r = static_cast<size_t>(b * K + k);
        if (beam_logp[r] == kNegInf) continue;
        log_softmax_row(rows.data() + (b * K + k) * V, V, logp);
        for (int64_t v = 0; v < V; ++v)
          cands.push_back({beam_logp[r] + logp[static_cast<size_t>(v)], k, v});
      }
      const size_t keep = std::min(cands.size(), static_cast<size_t>(2 * K));
      std::partial_sort(cands.begin(), cands.begin() + static_cast<std::ptrdiff_t>(keep),
                        cands.end(), [](const Candidate& x, const Candidate& y) {
                          if (x.logp != y.logp) return x.logp > y.logp;
                          if (x.beam != y.beam) return x.beam < y.beam;
                          return x.token < y.token;
                        });
      int64_t live = 0;
      for (size_t rank = 0; rank < keep && live < K; ++rank) {
        const Candidate& c = cands[rank];
        const size_t parent = static_cast<size_t>(b * K + c.beam);
        if (c.token == o.eos) {
          // Only an <eos> among the K best finishes a hypothesis: K live extensions beat the rest.
          if (rank < static_cast<size_t>(K))
            finished[static_cast<size_t>(b)].push_back(
                {normalized(c.logp, t + 1),
                 std::vector<int64_t>(prefixes[parent].begin() + 1, prefixes[parent].end()), true});
          continue;
        }
        const size_t r = static_cast<size_t>(b * K + live);
        parents[r] = static_cast<int64_t>(parent);
        next[r] = prefixes[parent];
        next[r].push_back(c.token);
        next_logp[r] = c.logp;
        ++live;
      }
      for (int64_t k = live; k < K; ++k) {  // fewer than K live extensions: dead rows
        const size_t r = static_cast<size_t>(b * K + k);
        next[r] = prefixes[static_cast<size_t>(b * K)];
        next[r].push_back(o.eos);
        parents[r] = b * K;
      }
      if (static_cast<int64_t>(finished[static_cast<size_t>(b)].size()) >= K || live == 0) {
        done[static_cast<size_t>(b)] = true;
        --open;
      }
    }
    prefixes = std::move(next);
    beam_logp = std::move(next_logp);
    dec.reorder(parents);
  }
  // max_len reached: the live prefixes of open sources finish unended.
  for (int64_t b = 0; b < B; ++b) {
    if (done[static_cast<size_t>(b)]) continue;
    for (int64_t k = 0; k < K; ++k) {
      const size_t r = static_cast<size_t>(b * K + k);
      if (beam_logp[r] == kNegInf) continue;
      finished[static_cast<size_t>(b)].push_back(
          {normalized(beam_logp[r], g.steps),
           std::vector<int64_t>(prefixes[r].begin() + 1, prefixes[r].end()), false});
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const auto& hyps = finished[static_cast<size_t>(b)];
    // The first of the best (the earliest finished on ties).
    const auto best = std::max_element(
        hyps.begin(), hyps.end(),
        [](const Hypothesis& x, const Hypothesis& y) { return x.score < y.score; });
    g.tokens.push_back(best->tokens);
    g.ended.push_back(best->ended);
    g.scores.push_back(best->score);
  }
  return g;
}

}  // namespace attn::model
