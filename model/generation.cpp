// Greedy and beam search over a Transformer encoder-decoder (contract in
// attn/model/generation.hpp).
//
// Vocabulary: B sources, R decoder rows (B for greedy, B*K for beam search, row b*K + k is beam k
// of source b), S source positions, V target vocabulary, t the step.
#include "attn/model/generation.hpp"

#include "kernels/cpu/cross_entropy.hpp"
#include "kernels/cpu/matmul.hpp"
#include "nn/internal.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace attn::model {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Runs the model in eval mode (and the decoder with or without attention weights) for the
// lifetime of the guard, then puts back what it found. The weights do not change meanwhile, so
// their GEMM packings are kept from step to step (kernels/cpu/matmul.hpp).
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
  cpu::GemmFixedPackingScope packings_;
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

  // Row r of `prefixes` (R rows of `stride` tokens): <bos> and the tokens so far, `len` of them.
  // Returns (R, V) logits of position len - 1. With the cache only the newest token is decoded
  // (the others are cached).
  Tensor next_logits(const std::vector<int64_t>& prefixes, int64_t R, int64_t len, int64_t stride) {
    if (use_cache_) {
      std::vector<int64_t> ids(static_cast<size_t>(R));
      for (int64_t r = 0; r < R; ++r)
        ids[static_cast<size_t>(r)] = prefixes[static_cast<size_t>(r * stride + len - 1)];
      Tensor logits = decoder_.step(ctx_, Tensor::from_vector(ids, {R, 1}), state_);
      return logits.reshape({R, logits.dim(2)});
    }
    std::vector<int64_t> ids;
    ids.reserve(static_cast<size_t>(R * len));
    for (int64_t r = 0; r < R; ++r)
      ids.insert(ids.end(), prefixes.begin() + r * stride, prefixes.begin() + r * stride + len);
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

// The logits (R, V) of a step, row by row in their own float type (float32 or float64), read
// in place: the log-probabilities are taken in double from the widened values, the same bits as
// from a double copy (cpu::log_sum_exp sums a float row as its widened copy), without the copy
// of R x V values per step (V is the target vocabulary, 10k in a translation model).
class StepLogits {
 public:
  explicit StepLogits(const Tensor& logits)
      : t_(logits.contiguous()), V_(t_.dim(-1)), f32_(t_.dtype() == DType::F32) {}
  // f(row r as `const float*` or `const double*`).
  template <typename F>
  auto with_row(int64_t r, F&& f) const {
    return f32_ ? f(t_.data<float>() + r * V_) : f(t_.data<double>() + r * V_);
  }

 private:
  Tensor t_;
  int64_t V_;
  bool f32_;
};

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
  // Plain variables, not a structured binding: the searches' lambdas capture V (clang 14 does
  // not capture bindings).
  const Checked dims = check_generation(op, model, src, src_valid_lens, o);
  const int64_t B = dims.B, V = dims.V;
  const bool keep_weights = o.keep_cross_attention && o.use_cache;
  EvalGuard guard(model, keep_weights);
  const Tensor enc = model.encoder.forward(ctx, src, src_valid_lens);
  PrefixDecoder dec(ctx, model.decoder, enc, src_valid_lens, 1, o.use_cache, o.max_len + 1,
                    o.cache_dtype);

  Generation g;
  g.tokens.assign(static_cast<size_t>(B), {});
  g.ended.assign(static_cast<size_t>(B), false);
  g.scores.assign(static_cast<size_t>(B), 0.0);
  // Row b: <bos> and the tokens so far (g.steps + 1 of them), room for max_len more.
  const int64_t stride = o.max_len + 1;
  std::vector<int64_t> prefixes(static_cast<size_t>(B * stride), o.bos);
  std::vector<Tensor> step_logits;
  std::vector<std::vector<Tensor>> step_weights(static_cast<size_t>(model.decoder.num_blks()));
  int64_t live = B;
  while (live > 0 && g.steps < o.max_len) {
    const Tensor logits = dec.next_logits(prefixes, B, g.steps + 1, stride);  // (B, V)
    const StepLogits rows(logits);
    ++g.steps;
    if (o.keep_logits) step_logits.push_back(logits);
    if (keep_weights)
      for (size_t i = 0; i < step_weights.size(); ++i)
        step_weights[i].push_back(dec.state().cross_attention_weights[i]);
    for (int64_t b = 0; b < B; ++b) {
      int64_t& next = prefixes[static_cast<size_t>(b * stride + g.steps)];
      if (g.ended[static_cast<size_t>(b)]) {
        next = o.eos;  // keeps the batch rectangular; its logits are ignored
        continue;
      }
      // argmax, the lowest index on ties (torch.argmax on CPU).
      const int64_t best = rows.with_row(b, [&](const auto* row) {
        const int64_t i = std::max_element(row, row + V) - row;
        const double m = row[i];
        g.scores[static_cast<size_t>(b)] += m - cpu::log_sum_exp(row, V, m);
        return i;
      });
      next = best;
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

// Ranking: higher log P first, then the lower beam, then the lower token. A total order, so the
// best `keep` candidates and their order do not depend on the order they are offered in.
bool ranks_before(const Candidate& x, const Candidate& y) {
  if (x.logp != y.logp) return x.logp > y.logp;
  if (x.beam != y.beam) return x.beam < y.beam;
  return x.token < y.token;
}

// The best `keep` of the candidates offered, best first (a source's K beams offer K*V of them and
// 2K are kept: most are turned away by one comparison with the worst kept).
class TopCandidates {
 public:
  void reset(size_t keep) {
    keep_ = keep;
    kept_.clear();
  }
  // Inline: nearly every one of the K*V candidates is below the worst kept, which its log P
  // alone decides (GCC stopped inlining the whole of offer into the search's loop once the row
  // became a lambda: 6.5% of a translate profile). Ties and the insertion are the rare part.
  [[gnu::always_inline]] void offer(const Candidate& c) {
    if (kept_.size() == keep_ && c.logp < kept_.back().logp) return;
    insert(c);
  }
  const std::vector<Candidate>& kept() const { return kept_; }

 private:
  void insert(const Candidate& c) {
    if (kept_.size() == keep_ && !ranks_before(c, kept_.back())) return;
    if (kept_.size() == keep_) kept_.pop_back();
    kept_.insert(std::upper_bound(kept_.begin(), kept_.end(), c, ranks_before), c);
  }

  size_t keep_ = 0;
  std::vector<Candidate> kept_;
};

}  // namespace

Generation beam_search(Context& ctx, nn::EncoderDecoder& model, const Tensor& src,
                       const Tensor& src_valid_lens, const GenerationOptions& o) {
  const char* op = "beam_search";
  // Plain variables, not a structured binding: the searches' lambdas capture V (clang 14 does
  // not capture bindings).
  const Checked dims = check_generation(op, model, src, src_valid_lens, o);
  const int64_t B = dims.B, V = dims.V;
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

  // Beam k of source b is row b*K + k: <bos> and its tokens so far (t + 1 of them at step t),
  // room for max_len more. At the start only beam 0 is live (all K would extend the same <bos>
  // into K copies of the same candidates).
  const int64_t stride = o.max_len + 1;
  std::vector<int64_t> prefixes(static_cast<size_t>(R * stride), o.bos), next(prefixes.size());
  std::vector<double> beam_logp(static_cast<size_t>(R), kNegInf);
  for (int64_t b = 0; b < B; ++b)
    beam_logp[static_cast<size_t>(b * K)] = 0.0;
  std::vector<std::vector<Hypothesis>> finished(static_cast<size_t>(B));
  std::vector<bool> done(static_cast<size_t>(B), false);
  TopCandidates top;
  std::vector<int64_t> parents(static_cast<size_t>(R));
  std::vector<double> next_logp(static_cast<size_t>(R));
  Generation g;
  int64_t open = B;
  while (open > 0 && g.steps < o.max_len) {
    const int64_t t = g.steps++;  // the prefixes hold t + 1 tokens
    const StepLogits rows(dec.next_logits(prefixes, R, t + 1, stride));  // (R, V)
    std::iota(parents.begin(), parents.end(), 0);
    std::fill(next_logp.begin(), next_logp.end(), kNegInf);
    // Row r of the next step: row `from` of this one and `token`.
    auto extend = [&](int64_t r, int64_t from, int64_t token) {
      const auto row = prefixes.begin() + from * stride;
      std::copy(row, row + t + 1, next.begin() + r * stride);
      next[static_cast<size_t>(r * stride + t + 1)] = token;
    };
    for (int64_t b = 0; b < B; ++b) {
      if (done[static_cast<size_t>(b)]) {
        for (int64_t k = 0; k < K; ++k)
          extend(b * K + k, b * K + k, o.eos);  // ignored rows keep the batch rectangular
        continue;
      }
      // Every extension of every live beam, of which the best 2K are kept.
      top.reset(static_cast<size_t>(2 * K));
      for (int64_t k = 0; k < K; ++k) {
        const size_t r = static_cast<size_t>(b * K + k);
        if (beam_logp[r] == kNegInf) continue;
        rows.with_row(b * K + k, [&](const auto* row) {
          const double lse = cpu::log_sum_exp(row, V, *std::max_element(row, row + V));
          for (int64_t v = 0; v < V; ++v)
            top.offer({beam_logp[r] + (static_cast<double>(row[v]) - lse), k, v});
        });
      }
      const std::vector<Candidate>& best = top.kept();
      int64_t live = 0;
      for (size_t rank = 0; rank < best.size() && live < K; ++rank) {
        const Candidate& c = best[rank];
        const int64_t parent = b * K + c.beam;
        if (c.token == o.eos) {
          // Only an <eos> among the K best finishes a hypothesis: K live extensions beat the rest.
          if (rank < static_cast<size_t>(K)) {
            const auto p = prefixes.begin() + parent * stride;
            finished[static_cast<size_t>(b)].push_back(
                {normalized(c.logp, t + 1), std::vector<int64_t>(p + 1, p + t + 1), true});
          }
          continue;
        }
        const int64_t r = b * K + live;
        parents[static_cast<size_t>(r)] = parent;
        extend(r, parent, c.token);
        next_logp[static_cast<size_t>(r)] = c.logp;
        ++live;
      }
      for (int64_t k = live; k < K; ++k) {  // fewer than K live extensions: dead rows
        const int64_t r = b * K + k;
        extend(r, b * K, o.eos);
        parents[static_cast<size_t>(r)] = b * K;
      }
      if (static_cast<int64_t>(finished[static_cast<size_t>(b)].size()) >= K || live == 0) {
        done[static_cast<size_t>(b)] = true;
        --open;
      }
    }
    std::swap(prefixes, next);
    std::swap(beam_logp, next_logp);
    dec.reorder(parents);
  }
  // max_len reached: the live prefixes of open sources finish unended.
  for (int64_t b = 0; b < B; ++b) {
    if (done[static_cast<size_t>(b)]) continue;
    for (int64_t k = 0; k < K; ++k) {
      const size_t r = static_cast<size_t>(b * K + k);
      if (beam_logp[r] == kNegInf) continue;
      const auto p = prefixes.begin() + static_cast<int64_t>(r) * stride;
      finished[static_cast<size_t>(b)].push_back(
          {normalized(beam_logp[r], g.steps), std::vector<int64_t>(p + 1, p + g.steps + 1), false});
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
