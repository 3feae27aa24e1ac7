// Incremental decoding with the key/value cache against the whole-prefix forward, and greedy and
// beam search with and without the cache: same tokens, logits and scores within 1e-5 (float32),
// batch sizes 1 and 5 with sources of different lengths. Beam search is also checked against
// exhaustive search on a tiny vocabulary and against greedy search at beam size 1.
#include "attn/model/generation.hpp"
#include "kernels/cpu/cross_entropy.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace attn::model {
namespace {

using attn::testing::close;
using attn::testing::random_tensor;

Tensor ids_tensor(const std::vector<int64_t>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape, DType::I64);
}

// Token ids in [lo, hi) from a seeded stream.
Tensor random_ids(const Shape& shape, int64_t lo, int64_t hi, uint64_t seed) {
  Tensor u = random_tensor(shape, DType::F64, seed, 0.0, 1.0);
  Tensor ids = Tensor::empty(shape, DType::I64);
  for (int64_t i = 0; i < u.numel(); ++i)
    ids.set_flat(i,
                 lo + std::min<int64_t>(hi - lo - 1, static_cast<int64_t>(u.flat(i) * (hi - lo))));
  return ids;
}

nn::Seq2SeqConfig small_config(DType dtype, int64_t tgt_vocab = 11) {
  nn::Seq2SeqConfig c;
  c.src_vocab_size = 13;
  c.tgt_vocab_size = tgt_vocab;
  c.num_hiddens = 16;
  c.ffn_num_hiddens = 32;
  c.num_heads = 4;
  c.num_enc_blks = 2;
  c.num_dec_blks = 2;
  c.dropout = 0.1;
  c.dtype = dtype;
  c.seed = 21;
  return c;
}

// The source lengths of a batch of `B`: ragged, 1 .. S.
Tensor ragged_lens(int64_t B, int64_t S) {
  std::vector<int64_t> lens(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    lens[static_cast<size_t>(b)] = S - (b * 3) % S;
  return ids_tensor(lens, {B});
}

// ----------------------------------------------------------------------------------------------
// step against forward

// Decodes T tokens by steps of the given sizes and compares with the eval forward on all T.
void check_steps_equal_forward(DType dtype, int64_t B, const std::vector<int64_t>& chunks,
                               double atol, DType cache = DType::F32) {
  SCOPED_TRACE(::testing::Message()
               << dtype_name(dtype) << " B=" << B << " cache " << dtype_name(cache));
  Context ctx;
  nn::EncoderDecoder model(small_config(dtype));
  model.eval();
  const int64_t S = 6, T = 7;
  Tensor src = random_ids({B, S}, 0, 13, 3), lens = ragged_lens(B, S);
  Tensor tgt = random_ids({B, T}, 0, 11, 4);
  Tensor enc = model.encoder.forward(ctx, src, lens);
  model.decoder.need_weights = true;
  Tensor want = model.decoder.forward(ctx, tgt, enc, lens);
  std::vector<Tensor> self_w, cross_w;
  for (int64_t i = 0; i < 2; ++i) {
    self_w.push_back(model.decoder.self_attention_weights(i));
    cross_w.push_back(model.decoder.cross_attention_weights(i));
  }
  for (bool weights : {false, true}) {
    model.decoder.need_weights = weights;
    nn::DecoderState state = model.decoder.init_state(ctx, enc, lens, /*capacity=*/2, cache);
    int64_t t0 = 0;
    for (int64_t n : chunks) {
      Tensor got = model.decoder.step(ctx, tgt.slice(1, t0, t0 + n).contiguous(), state);
      EXPECT_EQ(state.length, t0 + n);
      EXPECT_TRUE(close(got, want.slice(1, t0, t0 + n), 0, atol)) << "positions " << t0;
      if (weights) {
        for (size_t i = 0; i < 2; ++i) {
          EXPECT_TRUE(close(state.self_attention_weights[i],
                            self_w[i].slice(1, t0, t0 + n).slice(2, 0, t0 + n), 0, atol));
          EXPECT_TRUE(
              close(state.cross_attention_weights[i], cross_w[i].slice(1, t0, t0 + n), 0, atol));
        }
      }
      t0 += n;
    }
    EXPECT_GE(state.capacity, T);
  }
}

TEST(DecoderCache, StepsEqualForwardFloat32) {
  for (int64_t B : {1, 5}) {
    check_steps_equal_forward(DType::F32, B, {1, 1, 1, 1, 1, 1, 1}, 1e-5);
    check_steps_equal_forward(DType::F32, B, {3, 1, 3}, 1e-5);
  }
}

// A bfloat16 cache (keys and values rounded to 8 bits of mantissa, attention in float32) follows
// the float32 forward within bfloat16 rounding: the decode kernel reads it as it is, the path
// that keeps the weights reads float32 copies. A float64 decoder has no bfloat16 cache.
TEST(DecoderCache, StepsFollowForwardBfloat16Cache) {
  for (int64_t B : {1, 5}) {
    check_steps_equal_forward(DType::F32, B, {1, 1, 1, 1, 1, 1, 1}, 3e-2, DType::BF16);
    check_steps_equal_forward(DType::F32, B, {3, 1, 3}, 3e-2, DType::BF16);
  }
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F64));
  Tensor enc = model.encoder.forward(ctx, random_ids({1, 4}, 0, 13, 3));
  EXPECT_THROW(model.decoder.init_state(ctx, enc, {}, 4, DType::BF16), Error);
}

TEST(DecoderCache, StepsEqualForwardFloat64) {
  for (int64_t B : {1, 5}) {
    check_steps_equal_forward(DType::F64, B, {1, 1, 1, 1, 1, 1, 1}, 1e-12);
    check_steps_equal_forward(DType::F64, B, {2, 5}, 1e-12);
  }
}

// repeat_interleave and reorder (beam search's moves) keep every row's cache its own.
TEST(DecoderCache, RepeatAndReorderFollowTheRows) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F64));
  model.eval();
  const int64_t S = 5;
  Tensor src = random_ids({2, S}, 0, 13, 7), lens = ids_tensor({5, 2}, {2});
  Tensor enc = model.encoder.forward(ctx, src, lens);
  nn::DecoderState state = model.decoder.init_state(ctx, enc, lens, 1);
  state.repeat_interleave(2);  // rows 0, 1 <- source 0; rows 2, 3 <- source 1
  ASSERT_EQ(state.batch, 4);
  std::vector<std::vector<int64_t>> prefix = {{1, 3}, {1, 4}, {1, 5}, {1, 6}};
  std::vector<int64_t> source = {0, 0, 1, 1};
  model.decoder.step(ctx, ids_tensor({1, 3, 1, 4, 1, 5, 1, 6}, {4, 2}), state);
  // Within sources, then across them (the encoder's projections move too).
  for (const std::vector<int64_t>& rows :
       {std::vector<int64_t>{1, 1, 3, 2}, std::vector<int64_t>{2, 0, 3, 1}}) {
    state.reorder(rows);
    std::vector<std::vector<int64_t>> p2;
    std::vector<int64_t> s2;
    for (int64_t r : rows) {
      p2.push_back(prefix[static_cast<size_t>(r)]);
      s2.push_back(source[static_cast<size_t>(r)]);
    }
    prefix = p2;
    source = s2;
    std::vector<int64_t> next = {7, 8, 9, 2};
    Tensor got = model.decoder.step(ctx, ids_tensor(next, {4, 1}), state);
    for (int64_t r = 0; r < 4; ++r) {
      auto& p = prefix[static_cast<size_t>(r)];
      p.push_back(next[static_cast<size_t>(r)]);
      const int64_t b = source[static_cast<size_t>(r)];
      const int64_t L = static_cast<int64_t>(p.size());
      Tensor want = model.decoder.forward(ctx, ids_tensor(p, {1, L}), enc.slice(0, b, b + 1),
                                          lens.slice(0, b, b + 1));
      EXPECT_TRUE(close(got.slice(0, r, r + 1), want.slice(1, L - 1, L), 0, 1e-12)) << "row " << r;
    }
  }
  EXPECT_THROW(state.reorder({0, 1}), Error);
  EXPECT_THROW(state.reorder({0, 1, 2, 4}), Error);
  EXPECT_THROW(model.decoder.step(ctx, ids_tensor({1, 2}, {2, 1}), state), Error);  // batch 2 != 4
}

// A source's beams share its row of the encoder's projections (DecoderState::enc_share) instead
// of a copy each, and their cross-attention runs as one row of several queries in the decode
// kernel: the same bits as with the rows copied out, in float32 and with a bfloat16 cache; a
// reorder across sources copies them out (enc_share back to 1), also the same bits.
TEST(DecoderCache, BeamsShareTheEncoderRowsBitwise) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  model.eval();
  const int64_t S = 6, B = 3, beams = 4;
  const Tensor src = random_ids({B, S}, 0, 13, 17), lens = ids_tensor({6, 3, 5}, {B});
  const Tensor enc = model.encoder.forward(ctx, src, lens);
  for (const DType cache : {DType::F32, DType::BF16}) {
    nn::DecoderState shared = model.decoder.init_state(ctx, enc, lens, 4, cache);
    shared.repeat_interleave(beams);
    ASSERT_EQ(shared.enc_share, beams);
    ASSERT_EQ(shared.blocks[0].enc_keys.dim(0), B) << "the encoder's rows were copied";
    ASSERT_EQ(shared.enc_valid_lens.dim(0), B);
    // The same state with the encoder's rows copied out per row, as before enc_share.
    nn::DecoderState copied = model.decoder.init_state(ctx, enc, lens, 4, cache);
    copied.repeat_interleave(beams);
    std::vector<int64_t> per_row;
    for (int64_t i = 0; i < B * beams; ++i)
      per_row.push_back(i / beams);
    auto rows_out = [&](const Tensor& t) {
      Shape shape = t.shape();
      shape[0] = B * beams;
      Tensor out = Tensor::empty(shape, t.dtype());
      for (int64_t i = 0; i < B * beams; ++i)
        out.select(0, i).copy_from(t.select(0, per_row[static_cast<size_t>(i)]));
      return out;
    };
    for (nn::DecoderBlockCache& c : copied.blocks) {
      c.enc_keys = rows_out(c.enc_keys);
      c.enc_values = rows_out(c.enc_values);
    }
    std::vector<double> row_lens;
    for (int64_t r : per_row)
      row_lens.push_back(copied.enc_valid_lens.data<double>()[r]);
    copied.enc_valid_lens = Tensor::from_vector(row_lens, {B * beams}, DType::F64);
    copied.enc_share = 1;
    std::vector<int64_t> first(static_cast<size_t>(B * beams));
    for (size_t i = 0; i < first.size(); ++i)
      first[i] = static_cast<int64_t>(i % 5);
    Tensor ids = ids_tensor(first, {B * beams, 1});
    for (int step = 0; step < 3; ++step) {
      if (step == 1) {
        // Within sources (beam search's usual move): the sharing stays.
        std::vector<int64_t> rows;
        for (int64_t i = 0; i < B * beams; ++i)
          rows.push_back(i / beams * beams + (beams - 1 - i % beams));
        shared.reorder(rows);
        copied.reorder(rows);
        ASSERT_EQ(shared.enc_share, beams);
      }
      if (step == 2) {
        // Across sources: the rows are copied out.
        std::vector<int64_t> rows;
        for (int64_t i = 0; i < B * beams; ++i)
          rows.push_back((i + beams) % (B * beams));
        shared.reorder(rows);
        copied.reorder(rows);
        ASSERT_EQ(shared.enc_share, 1);
      }
      const Tensor a = model.decoder.step(ctx, ids, shared);
      const Tensor b = model.decoder.step(ctx, ids, copied);
      ASSERT_EQ(a.shape(), b.shape());
      ASSERT_EQ(std::memcmp(a.contiguous().raw_data(), b.contiguous().raw_data(), a.nbytes()), 0)
          << dtype_name(cache) << " cache, step " << step;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Greedy and beam search

struct Batch {
  Tensor src, lens;
};

Batch make_batch(int64_t B) {
  const int64_t S = 6;
  return {random_ids({B, S}, 0, 13, 10 + static_cast<uint64_t>(B)), ragged_lens(B, S)};
}

// An <eos> that source 0 produces as its third token, so that some sequences end early and
// others run to max_len (a random model has no reason to emit any particular token).
GenerationOptions options_with_reachable_eos(Context& ctx, nn::EncoderDecoder& model,
                                             const Batch& batch) {
  GenerationOptions o;
  o.bos = 0;
  o.eos = 10;
  o.max_len = 9;
  Generation probe = greedy_search(ctx, model, batch.src, batch.lens, o);
  if (probe.tokens[0].size() >= 3) o.eos = probe.tokens[0][2];
  return o;
}

// Search reads a float32 model's logits in place: the log-sum-exp of a float row is bit for bit
// that of its widened copy (what search took before), over lengths straddling the vector widths.
TEST(Generation, LogSumExpOfAFloatRowIsThatOfItsWidenedCopy) {
  for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 236, 1000}) {
    const Tensor x = random_tensor({n}, DType::F32, static_cast<uint64_t>(n), -30.0, 12.0);
    std::vector<double> wide(static_cast<size_t>(n));
    double m = -1e300;
    for (int64_t i = 0; i < n; ++i) {
      wide[static_cast<size_t>(i)] = x.data<float>()[i];
      m = std::max(m, wide[static_cast<size_t>(i)]);
    }
    const double a = cpu::log_sum_exp(x.data<float>(), n, m);
    const double b = cpu::log_sum_exp(wide.data(), n, m);
    EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "n " << n << ": " << a << " vs " << b;
  }
}

TEST(Generation, GreedyWithCacheEqualsRecomputing) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  for (int64_t B : {1, 5}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B);
    Batch batch = make_batch(B);
    GenerationOptions o = options_with_reachable_eos(ctx, model, batch);
    o.keep_logits = true;
    Generation cached = greedy_search(ctx, model, batch.src, batch.lens, o);
    o.use_cache = false;
    Generation full = greedy_search(ctx, model, batch.src, batch.lens, o);
    EXPECT_EQ(cached.tokens, full.tokens);
    EXPECT_EQ(cached.ended, full.ended);
    ASSERT_EQ(cached.steps, full.steps);
    EXPECT_TRUE(close(cached.logits, full.logits, 0, 1e-5));
    for (int64_t b = 0; b < B; ++b)
      EXPECT_NEAR(cached.scores[static_cast<size_t>(b)], full.scores[static_cast<size_t>(b)], 1e-5);
    EXPECT_TRUE(cached.ended[0]);
    EXPECT_LE(cached.tokens[0].size(), 2u);
    EXPECT_EQ(cached.logits.shape(), Shape({B, cached.steps, 11}));
    // The tokens are the argmax of the logits kept, and the score their log-probabilities.
    double score = 0;
    for (int64_t t = 0; t <= static_cast<int64_t>(cached.tokens[0].size()); ++t) {
      const int64_t tok =
          t < static_cast<int64_t>(cached.tokens[0].size()) ? cached.tokens[0][t] : o.eos;
      double m = -1e300, sum = 0;
      for (int64_t v = 0; v < 11; ++v)
        m = std::max(m, cached.logits.at({0, t, v}));
      for (int64_t v = 0; v < 11; ++v)
        sum += std::exp(cached.logits.at({0, t, v}) - m);
      EXPECT_EQ(cached.logits.at({0, t, tok}), m);
      score += cached.logits.at({0, t, tok}) - m - std::log(sum);
    }
    EXPECT_NEAR(cached.scores[0], score, 1e-9);
  }
}

TEST(Generation, BeamWithCacheEqualsRecomputing) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  for (int64_t B : {1, 5}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B);
    Batch batch = make_batch(B);
    GenerationOptions o = options_with_reachable_eos(ctx, model, batch);
    o.beam_size = 3;
    Generation cached = beam_search(ctx, model, batch.src, batch.lens, o);
    o.use_cache = false;
    Generation full = beam_search(ctx, model, batch.src, batch.lens, o);
    EXPECT_EQ(cached.tokens, full.tokens);
    EXPECT_EQ(cached.ended, full.ended);
    EXPECT_EQ(cached.steps, full.steps);
    for (int64_t b = 0; b < B; ++b)
      EXPECT_NEAR(cached.scores[static_cast<size_t>(b)], full.scores[static_cast<size_t>(b)], 1e-5);
  }
}

TEST(Generation, BeamOfOneIsGreedy) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F64));
  Batch batch = make_batch(5);
  GenerationOptions o = options_with_reachable_eos(ctx, model, batch);
  o.beam_size = 1;
  o.length_penalty = 0.0;
  Generation greedy = greedy_search(ctx, model, batch.src, batch.lens, o);
  Generation beam = beam_search(ctx, model, batch.src, batch.lens, o);
  EXPECT_EQ(beam.tokens, greedy.tokens);
  EXPECT_EQ(beam.ended, greedy.ended);
  for (size_t b = 0; b < 5; ++b)
    EXPECT_NEAR(beam.scores[b], greedy.scores[b], 1e-12);
}

// With more beams than there are sequences, beam search is exhaustive: its best hypothesis is the
// most probable sequence of at most max_len tokens (ended by <eos> or cut at max_len).
TEST(Generation, WideBeamFindsTheMostProbableSequence) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F64, /*tgt_vocab=*/4));
  model.eval();
  Batch batch = make_batch(2);
  GenerationOptions o;
  o.bos = 0;
  o.eos = 1;
  o.max_len = 3;
  o.beam_size = 64;
  o.length_penalty = 0.0;
  Generation beam = beam_search(ctx, model, batch.src, batch.lens, o);
  for (int64_t b = 0; b < 2; ++b) {
    Tensor src = batch.src.slice(0, b, b + 1), lens = batch.lens.slice(0, b, b + 1);
    Tensor enc = model.encoder.forward(ctx, src, lens);
    // log P of every sequence: <bos> prefix, then tokens; ended ones close with <eos>.
    double best = -1e300;
    std::vector<int64_t> best_tokens;
    std::function<void(std::vector<int64_t>&, double)> search = [&](std::vector<int64_t>& p,
                                                                    double logp) {
      const int64_t L = static_cast<int64_t>(p.size());
      if (L - 1 == o.max_len) {  // cut at max_len
        if (logp > best) {
          best = logp;
          best_tokens.assign(p.begin() + 1, p.end());
        }
        return;
      }
      Tensor logits = model.decoder.forward(ctx, ids_tensor(p, {1, L}), enc, lens);
      double m = -1e300, sum = 0;
      for (int64_t v = 0; v < 4; ++v)
        m = std::max(m, logits.at({0, L - 1, v}));
      for (int64_t v = 0; v < 4; ++v)
        sum += std::exp(logits.at({0, L - 1, v}) - m);
      for (int64_t v = 0; v < 4; ++v) {
        const double lp = logp + logits.at({0, L - 1, v}) - m - std::log(sum);
        if (v == o.eos) {
          if (lp > best) {
            best = lp;
            best_tokens.assign(p.begin() + 1, p.end());
          }
          continue;
        }
        p.push_back(v);
        search(p, lp);
        p.pop_back();
      }
    };
    std::vector<int64_t> p = {o.bos};
    search(p, 0.0);
    EXPECT_EQ(beam.tokens[static_cast<size_t>(b)], best_tokens);
    EXPECT_NEAR(beam.scores[static_cast<size_t>(b)], best, 1e-12);
  }
}

TEST(Generation, CrossAttentionKeptPerStep) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  Batch batch = make_batch(5);
  GenerationOptions o;
  o.bos = 0;
  o.max_len = 4;
  o.eos = 10;
  o.keep_cross_attention = true;
  Generation g = greedy_search(ctx, model, batch.src, batch.lens, o);
  ASSERT_EQ(g.cross_attention.size(), 2u);
  const Tensor& w = g.cross_attention[1];
  ASSERT_EQ(w.shape(), Shape({5 * 4, g.steps, 6}));
  for (int64_t b = 0; b < 5; ++b) {
    const int64_t len = static_cast<int64_t>(batch.lens.flat(b));
    for (int64_t t = 0; t < g.steps; ++t) {
      double sum = 0;
      for (int64_t s = 0; s < 6; ++s) {
        sum += w.at({b * 4 + 3, t, s});
        if (s >= len) {
          EXPECT_EQ(w.at({b * 4 + 3, t, s}), 0.0);
        }
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
  EXPECT_FALSE(model.decoder.need_weights);  // put back
}

// An empty source (valid length 0) still translates: its cross-attention averages every source
// position (d2l's uniform rows), nothing is NaN, and the other sources are unaffected by it.
TEST(Generation, EmptySourceDecodes) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  Batch batch = make_batch(3);
  GenerationOptions o;
  o.bos = 0;
  o.eos = 10;
  o.max_len = 5;
  o.keep_logits = true;
  Tensor lens = ids_tensor({0, 4, 6}, {3});
  for (bool beam : {false, true}) {
    Generation g = beam ? beam_search(ctx, model, batch.src, lens, o)
                        : greedy_search(ctx, model, batch.src, lens, o);
    for (double s : g.scores)
      EXPECT_TRUE(std::isfinite(s));
    Generation alone = beam ? beam_search(ctx, model, batch.src.slice(0, 1, 3).contiguous(),
                                          lens.slice(0, 1, 3).contiguous(), o)
                            : greedy_search(ctx, model, batch.src.slice(0, 1, 3).contiguous(),
                                            lens.slice(0, 1, 3).contiguous(), o);
    EXPECT_EQ(g.tokens[1], alone.tokens[0]);
    EXPECT_EQ(g.tokens[2], alone.tokens[1]);
  }
}

TEST(Generation, RestoresTheModeAndRejectsBadOptions) {
  Context ctx;
  nn::EncoderDecoder model(small_config(DType::F32));
  Batch batch = make_batch(2);
  GenerationOptions o;
  o.bos = 0;
  o.eos = 10;
  o.max_len = 3;
  model.train();
  const uint64_t offset = ctx.dropout_offset();
  Generation a = greedy_search(ctx, model, batch.src, batch.lens, o);
  EXPECT_TRUE(model.training());
  EXPECT_TRUE(model.decoder.blks[0]->addnorm1.training());
  EXPECT_EQ(ctx.dropout_offset(), offset);  // no dropout ran
  Generation b = greedy_search(ctx, model, batch.src, batch.lens, o);
  EXPECT_EQ(a.tokens, b.tokens);
  // Without valid lengths every source position is read.
  EXPECT_NO_THROW(greedy_search(ctx, model, batch.src, Tensor(), o));

  GenerationOptions bad = o;
  bad.beam_size = 0;
  EXPECT_THROW(beam_search(ctx, model, batch.src, batch.lens, bad), Error);
  bad = o;
  bad.max_len = 0;
  EXPECT_THROW(greedy_search(ctx, model, batch.src, batch.lens, bad), Error);
  bad = o;
  bad.eos = 11;  // vocabulary of 11
  EXPECT_THROW(greedy_search(ctx, model, batch.src, batch.lens, bad), Error);
  EXPECT_THROW(greedy_search(ctx, model, batch.src, ids_tensor({1, 2, 3}, {3}), o), Error);
  EXPECT_THROW(beam_search(ctx, model, batch.src.reshape({12}), Tensor(), o), Error);
}

}  // namespace
}  // namespace attn::model
