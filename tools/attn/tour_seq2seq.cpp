// Tour sections for sequence-to-sequence (n -> m) and the requirements of a positional encoding:
//   seq2seq           trains the dates task (words -> ISO order) with Seq2SeqTrainer, then shows
//                     held-out translations with BLEU, the encoder-decoder attention of one
//                     example (the alignment figure), the time per generated token with and
//                     without the KV cache, and the learned source embeddings;
//   pe-requirements   the seed's four requirements of a good positional encoding (a unique code
//                     per step; the same distance between two steps wherever they sit; bounded
//                     values that extend to longer sequences; deterministic), each checked on P.
#include "attn/core/error.hpp"
#include "attn/model/seq2seq_tasks.hpp"
#include "attn/model/seq2seq_trainer.hpp"
#include "attn/ops/positional.hpp"
#include "tools/attn/commands.hpp"
#include "tools/attn/tour.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <numeric>

namespace attn::cli {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double cpu_seconds() {
  return static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
}

std::string join(const std::vector<std::string>& tokens) {
  std::string out;
  for (const auto& t : tokens)
    out += (out.empty() ? "" : " ") + t;
  return out;
}

std::vector<std::string> tokens_of(const std::vector<int64_t>& ids, const model::Vocabulary& v) {
  std::vector<std::string> out;
  for (int64_t id : ids)
    out.push_back(v.token(id));
  return out;
}

// The dates run of the tour: small enough for well under a minute on 2 threads, large enough to
// translate nearly every held-out date exactly (docs/seq2seq.md has the measurements).
constexpr int64_t kSteps = 800, kBatch = 64, kEvalPairs = 500;

model::Seq2SeqTrainOptions dates_options(const model::Vocabulary& src, const model::Vocabulary& tgt,
                                         int64_t num_steps) {
  model::Seq2SeqTrainOptions o;
  o.model.src_vocab_size = src.size();
  o.model.tgt_vocab_size = tgt.size();
  o.model.num_hiddens = 64;
  o.model.ffn_num_hiddens = 128;
  o.model.num_heads = 4;
  o.model.num_enc_blks = 2;
  o.model.num_dec_blks = 2;
  o.model.dropout = 0.0;
  o.num_steps = num_steps;
  o.adamw.lr = 3e-3;
  o.seed = 0;
  // One thread: the batches are small (64 x 11 tokens, E = 64), a second thread saves little,
  // and on a busy machine every parallel region waits for whichever thread was preempted, which
  // multiplies the CPU time. Results do not depend on it.
  o.threads = 1;
  return o;
}

// Mean time per generated token when decoding `length` tokens for one source: with the cache
// (one step per token) or by re-running the decoder on the whole prefix (what d2l's loop costs).
double seconds_per_token(Context& ctx, nn::EncoderDecoder& m, const Tensor& enc,
                         const Tensor& valid, int64_t length, bool cache) {
  std::vector<int64_t> prefix = {model::Vocabulary::kBos};
  const auto argmax_last = [](const Tensor& logits) {
    const Tensor l = logits.contiguous();
    const int64_t V = l.dim(-1), T = l.dim(1);
    const float* row = l.data<float>() + (T - 1) * V;
    return static_cast<int64_t>(std::max_element(row, row + V) - row);
  };
  const auto start = Clock::now();
  if (cache) {
    nn::DecoderState state = m.decoder.init_state(ctx, enc, valid, length);
    for (int64_t t = 0; t < length; ++t) {
      const Tensor ids = Tensor::from_vector(std::vector<int64_t>{prefix.back()}, {1, 1});
      prefix.push_back(argmax_last(m.decoder.step(ctx, ids, state)));
    }
  } else {
    for (int64_t t = 0; t < length; ++t) {
      const Tensor ids = Tensor::from_vector(prefix, {1, static_cast<int64_t>(prefix.size())});
      prefix.push_back(argmax_last(m.decoder.forward(ctx, ids, enc, valid)));
    }
  }
  return seconds_since(start) / static_cast<double>(length);
}

// Cosine similarity of the rows `ids` of an embedding table (V, E).
viz::Matrix cosine_matrix(const Tensor& table, const std::vector<int64_t>& ids) {
  const Tensor w = table.contiguous();
  const int64_t E = w.dim(1), n = static_cast<int64_t>(ids.size());
  const float* p = w.data<float>();
  viz::Matrix m{n, n, std::vector<double>(static_cast<size_t>(n * n))};
  const auto dot = [&](int64_t a, int64_t b) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e)
      s += static_cast<double>(p[a * E + e]) * static_cast<double>(p[b * E + e]);
    return s;
  };
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      m.values[static_cast<size_t>(i * n + j)] =
          dot(ids[static_cast<size_t>(i)], ids[static_cast<size_t>(j)]) /
          std::sqrt(dot(ids[static_cast<size_t>(i)], ids[static_cast<size_t>(i)]) *
                    dot(ids[static_cast<size_t>(j)], ids[static_cast<size_t>(j)]));
  return m;
}

// Mean of m over rows in [r0, r1) x columns in [c0, c1), the diagonal left out.
double block_mean(const viz::Matrix& m, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  double s = 0;
  int64_t n = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c)
      if (r != c) s += m.at(r, c), ++n;
  return n ? s / static_cast<double>(n) : 0.0;
}

}  // namespace

// --- n -> m ------------------------------------------------------------------------------------

void tour_seq2seq(Tour& tour) {
  viz::Section& s = tour.report.section("seq2seq", "n -> m: an encoder-decoder learns dates");
  s.paragraph(
      "Self-attention serves three kinds of sequence task: an output per token (tagging, n -> n), "
      "one output per sequence (classification, n -> 1), and an output sequence of another "
      "length (translation, n -> m). The last needs the other half of the Transformer (d2l "
      "11.7): a decoder whose masked self-attention sees only the tokens generated so far and "
      "whose encoder-decoder attention reads the encoded source. Here it learns a generated task "
      "that needs both reordering and a mapping of words to symbols: a date written out in words "
      "becomes the same date in ISO order.");

  model::Seq2SeqTaskOptions task;  // dates
  const model::Vocabulary src = model::seq2seq_task_source_vocabulary(task);
  const model::Vocabulary tgt = model::seq2seq_task_target_vocabulary(task);
  const auto [src_len, tgt_len] = model::seq2seq_task_max_lengths(task);
  const int64_t num_steps = std::max(src_len, tgt_len) + 1;
  model::Seq2SeqTrainer trainer(dates_options(src, tgt, num_steps), src, tgt);
  const auto start = Clock::now();
  const double cpu_start = cpu_seconds();
  double last_loss = 0;
  while (trainer.step() < kSteps) {
    const model::Seq2SeqDataset d = model::encode_seq2seq(
        model::generate_seq2seq_task(task, kBatch, 0, static_cast<uint64_t>(trainer.step()),
                                     model::TaskSplit::kTrain),
        src, tgt);
    std::vector<int64_t> idx(static_cast<size_t>(kBatch));
    std::iota(idx.begin(), idx.end(), 0);
    last_loss = trainer.train_step(model::make_seq2seq_batch(d, idx, {num_steps, true})).loss;
  }
  const double train_seconds = seconds_since(start), train_cpu = cpu_seconds() - cpu_start;
  const model::Seq2SeqDataset held =
      model::encode_seq2seq(model::generate_seq2seq_task(task, kEvalPairs, 0, model::eval_stream(0),
                                                         model::TaskSplit::kHeldOut),
                            src, tgt);
  const model::Seq2SeqEvalStats e = trainer.evaluate(held);
  s.paragraph(fmt::format(
      "`attn train --task dates --steps {} --batch-size {} --num-hiddens 64 --ffn-num-hiddens 128 "
      "--num-heads 4 --num-blks 2` trained {} steps of {} dates in {:.1f} s ({:.1f} s of CPU "
      "time), last training loss {:.4f}. On {} held-out dates (a tenth of all dates never "
      "drawn for training), greedy decoding with the KV cache translates {:.1f}% exactly, mean "
      "BLEU (d2l's, up to 4-grams) {:.3f}.",
      kSteps, kBatch, kSteps, kBatch, train_seconds, train_cpu, last_loss, kEvalPairs,
      100 * e.exact_match, e.bleu));

  constexpr int64_t kShown = 8;
  const std::vector<std::vector<int64_t>> firsts(held.sources.begin(),
                                                 held.sources.begin() + kShown);
  const auto pred = trainer.greedy_ids(firsts);
  viz::Table t;
  t.caption = "Held-out dates, translated greedily (BLEU of each against its target, k = 4)";
  t.header = {"source", "translation", "target", "BLEU"};
  for (int64_t i = 0; i < kShown; ++i) {
    const auto p = model::ids_to_tokens(pred[static_cast<size_t>(i)], tgt);
    const auto l = tokens_of(held.targets[static_cast<size_t>(i)], tgt);
    t.rows.push_back({join(tokens_of(held.sources[static_cast<size_t>(i)], src)), join(p), join(l),
                      fmt::format("{:.3f}", model::bleu(p, l, 4))});
  }
  s.table(std::move(t));

  // The alignment figure: the last decoder block's encoder-decoder attention, head by head.
  Context& ctx = trainer.context();
  nn::EncoderDecoder& m = trainer.model();
  // The example: the first held-out date in the "the <day> of <month> <year>" form (the most
  // reordering) that the model translates exactly, else the first of that form.
  std::vector<std::string> example;
  {
    const auto all = trainer.greedy_ids(held.sources);
    for (size_t i = 0; i < all.size(); ++i) {
      auto words = tokens_of(held.sources[i], src);
      if (words.empty() || words[0] != "the") continue;
      if (example.empty()) example = words;
      if (all[i] == held.targets[i]) {
        example = std::move(words);
        break;
      }
    }
  }
  const model::SourceBatch one =
      model::make_source_batch({model::encode_seq2seq_tokens(example, src)}, {num_steps, true});
  model::GenerationOptions g;
  g.bos = model::Vocabulary::kBos;
  g.eos = model::Vocabulary::kEos;
  g.max_len = num_steps;
  g.keep_cross_attention = true;
  const model::Generation gen = model::greedy_search(ctx, m, one.src, one.valid_lens, g);
  std::vector<std::string> rows = tokens_of(gen.tokens[0], tgt), cols = example;
  if (gen.ended[0]) rows.push_back("<eos>");
  cols.push_back("<eos>");
  const Tensor cross = gen.cross_attention.back().contiguous();  // (H, steps, S)
  const int64_t H = cross.dim(0), steps = cross.dim(1), S = cross.dim(2);
  std::vector<viz::HeatmapPanel> panels;
  for (int64_t h = 0; h < H; ++h) {
    viz::Matrix mat{steps, S, std::vector<double>(static_cast<size_t>(steps * S))};
    for (int64_t i = 0; i < steps * S; ++i)
      mat.values[static_cast<size_t>(i)] =
          static_cast<double>(cross.data<float>()[h * steps * S + i]);
    panels.push_back({std::move(mat), fmt::format("head {}", h)});
  }
  // Where each step looks most, averaged over the heads: "token <- source word".
  std::string looks;
  for (int64_t r = 0; r < steps && r < static_cast<int64_t>(rows.size()); ++r) {
    int64_t best = 0;
    double best_w = -1;
    for (int64_t c = 0; c < S; ++c) {
      double sum = 0;
      for (const auto& p : panels)
        sum += p.matrix.at(r, c);
      if (sum > best_w) best_w = sum, best = c;
    }
    looks += fmt::format("{}{} <- {}", looks.empty() ? "" : ", ", rows[static_cast<size_t>(r)],
                         cols[static_cast<size_t>(best)]);
  }
  viz::HeatmapOptions ho;
  ho.title = "Encoder-decoder attention, last decoder block";
  ho.xlabel = "source tokens (keys)";
  ho.ylabel = "generated tokens";
  ho.colorbar_label = "weight";
  ho.vmin = 0.0;
  ho.vmax = 1.0;
  ho.row_labels = rows;
  ho.col_labels = cols;
  s.figure(tour.write("seq2seq_alignment.svg", viz::heatmap_grid_svg({panels}, ho)),
           fmt::format("\"{}\" -> \"{}\". Each row is one decoding step (labelled with the token "
                       "it produced), each column a source token; a row sums to 1 over the "
                       "source (d2l's attention_weights[1], kept while decoding with the cache). "
                       "The source word each step attends to most, averaged over the heads: {}. "
                       "Whatever of the reordering the encoder has not already done shows here.",
                       join(example), join(tokens_of(gen.tokens[0], tgt)), looks));

  // Time per generated token: the cache keeps each step O(t E); recomputing the prefix costs
  // O(t E^2) at step t, so its time per token grows with the output length. One thread: a step
  // of one token is too small to share, and the machine may be busy.
  m.eval();
  const int threads = ctx.threads;
  ctx.threads = 1;
  const Tensor enc = m.encoder.forward(ctx, one.src, one.valid_lens);
  viz::Series cached{"with the KV cache", {}, {}, "", "", false};
  viz::Series full{"recomputing the prefix", {}, {}, "", "", false};
  viz::Table tt;
  tt.caption = "Time per generated token (one source, greedy, this model)";
  tt.header = {"output length", "with cache (us)", "without (us)", "ratio"};
  seconds_per_token(ctx, m, enc, one.valid_lens, 8, true);  // warm-up: first-call costs
  for (int64_t L : {16, 32, 64, 128, 256, 512}) {
    double a = 1e30, b = 1e30;  // the best of two runs each
    for (int rep = 0; rep < 2; ++rep) {
      a = std::min(a, seconds_per_token(ctx, m, enc, one.valid_lens, L, true));
      b = std::min(b, seconds_per_token(ctx, m, enc, one.valid_lens, L, false));
    }
    cached.x.push_back(static_cast<double>(L)), cached.y.push_back(a * 1e6);
    full.x.push_back(static_cast<double>(L)), full.y.push_back(b * 1e6);
    tt.rows.push_back({fmt::format("{}", L), fmt::format("{:.0f}", a * 1e6),
                       fmt::format("{:.0f}", b * 1e6), fmt::format("{:.1f}x", b / a)});
  }
  ctx.threads = threads;
  viz::LineChartOptions lo;
  lo.title = "Time per generated token against output length";
  lo.xlabel = "output length (tokens)";
  lo.ylabel = "microseconds per token";
  lo.xscale = viz::Scale::kLog;
  lo.ymin = 0.0;
  lo.height = 300;
  s.figure(tour.write("seq2seq_decode_time.svg", viz::line_chart_svg({cached, full}, lo)),
           "Decoding token t with the cache projects only the new token and attends over t cached "
           "keys and values: the time per token stays nearly flat. Without it every step runs the "
           "decoder over the whole prefix again (d2l's loop re-projects its cached block inputs "
           "the same way), so the time per token grows linearly with the output length.");
  s.table(std::move(tt));

  // The learned source embeddings: months, ordinal days and cardinal numbers.
  std::vector<std::string> words;
  for (const char* w : {"january", "february", "march", "april", "may", "june", "july", "august",
                        "september", "october", "november", "december"})
    words.emplace_back(w);
  for (const char* w : {"first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
                        "ninth", "tenth", "eleventh", "twelfth"})
    words.emplace_back(w);
  for (const char* w : {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                        "ten", "eleven", "twelve"})
    words.emplace_back(w);
  std::vector<int64_t> ids;
  for (const auto& w : words)
    ids.push_back(src.id(w));
  // The table starts as N(0, 1) noise (d2l's nn.Embedding init): what training wrote is the
  // change from it, so the figure shows the cosine similarity of the updates W - W_0 (a model
  // built from the same seed has W_0).
  const Tensor W = m.encoder.embedding.weight.value.contiguous();
  const Tensor W0 = model::Seq2SeqTrainer(trainer.options(), src, tgt)
                        .model()
                        .encoder.embedding.weight.value.contiguous();
  Tensor dW = Tensor::empty(W.shape(), DType::F32);
  for (int64_t i = 0; i < W.numel(); ++i)
    dW.data<float>()[i] = W.data<float>()[i] - W0.data<float>()[i];
  const viz::Matrix raw = cosine_matrix(W, ids);
  const viz::Matrix cos = cosine_matrix(dW, ids);
  viz::HeatmapOptions co;
  co.title = "Cosine similarity of what training changed in the source embeddings";
  co.colormap = viz::Colormap::kRdBu;
  co.vmin = -1.0;
  co.vmax = 1.0;
  co.row_labels = words;
  co.col_labels = words;
  co.colorbar_label = "cosine";
  const double months = block_mean(cos, 0, 12, 0, 12), ords = block_mean(cos, 12, 24, 12, 24),
               cards = block_mean(cos, 24, 36, 24, 36), across = block_mean(cos, 0, 12, 12, 36);
  const double ord_card = [&] {  // "third" against "three": the same number, two words
    double sum = 0;
    for (int64_t k = 0; k < 12; ++k)
      sum += cos.at(12 + k, 24 + k);
    return sum / 12;
  }();
  s.figure(tour.write("seq2seq_embeddings.svg", viz::heatmap_svg(cos, co)),
           fmt::format(
               "A one-hot code makes every two words equally far apart (cosine 0); a learned "
               "embedding can place words by what the task needs. The encoder's embedding.weight "
               "({} x {}) starts as random N(0, 1) vectors, and {} steps move it little: the "
               "cosine similarity of the trained vectors themselves averages {:.2f} within the "
               "month names, as random vectors would. The updates W - W_0 drawn here: mean "
               "cosine within month names {:.2f}, within ordinal days {:.2f}, within cardinal "
               "numbers {:.2f}; between months and the number words {:.2f}; an ordinal and the "
               "cardinal of the same number (\"third\", \"three\") {:.2f}. {}",
               W.dim(0), W.dim(1), kSteps, block_mean(raw, 0, 12, 0, 12), months, ords, cards,
               across, ord_card,
               std::min({months, ords, cards}) > across + 0.05
                   ? "Training pushed the words of each kind the same way: they cluster, weakly."
                   : "They do not cluster: the model tells the kinds apart in its later layers."));
}

// --- the four requirements of a positional encoding ---------------------------------------------

void tour_pe_requirements(Tour& tour) {
  viz::Section& s =
      tour.report.section("pe-requirements", "What a positional encoding must do, checked");
  s.paragraph(
      "A good positional encoding gives (1) a unique code for every step; (2) the same distance "
      "between two steps wherever they sit in the sequence, whatever its length; (3) bounded "
      "values that extend to sequences longer than any seen in training; and (4) the same code "
      "every time (deterministic). Each is checked below on d2l's sinusoidal P (d = 64, float64, "
      "positions 0..N-1).");
  constexpr int64_t kDim = 64, kN = 2048;
  const Tensor P = sinusoidal_encoding(kN, kDim, DType::F64, SinusoidalMode::kExact);
  const double* p = P.data<double>();
  const auto dist = [&](int64_t i, int64_t j) {
    double s2 = 0;
    for (int64_t c = 0; c < kDim; ++c) {
      const double d = p[i * kDim + c] - p[j * kDim + c];
      s2 += d * d;
    }
    return std::sqrt(s2);
  };
  const auto dot = [&](int64_t i, int64_t j) {
    double s2 = 0;
    for (int64_t c = 0; c < kDim; ++c)
      s2 += p[i * kDim + c] * p[j * kDim + c];
    return s2;
  };

  // (1) unique: the smallest distance between two different rows.
  double min_d = 1e30;
  int64_t min_i = 0, min_j = 0;
  for (int64_t i = 0; i < kN; ++i)
    for (int64_t j = i + 1; j < kN; ++j)
      if (const double d = dist(i, j); d < min_d) min_d = d, min_i = i, min_j = j;
  // (2) the distance of rows i and i + k depends on k only: its spread over i, per k.
  double worst_spread = 0;
  for (int64_t k = 1; k <= 256; ++k) {
    double lo = 1e30, hi = -1e30;
    for (int64_t i = 0; i + k < kN; ++i) {
      const double d = dist(i, i + k);
      lo = std::min(lo, d), hi = std::max(hi, d);
    }
    worst_spread = std::max(worst_spread, hi - lo);
  }
  std::vector<viz::Series> curves;
  for (int64_t i : {0, 100, 1000}) {
    viz::Series c{fmt::format("P[{}] . P[{} + k]", i, i), {}, {}, "", "", false};
    for (int64_t k = 0; k <= 200; ++k)
      c.x.push_back(static_cast<double>(k)), c.y.push_back(dot(i, i + k));
    curves.push_back(std::move(c));
  }
  // (3) bounded, and rows do not depend on N: the first rows of a longer table are the same.
  const Tensor longer = sinusoidal_encoding(8 * kN, kDim, DType::F64, SinusoidalMode::kExact);
  double max_abs = 0, max_norm_err = 0;
  for (int64_t i = 0; i < 8 * kN; ++i) {
    double n2 = 0;
    for (int64_t c = 0; c < kDim; ++c) {
      const double v = longer.data<double>()[i * kDim + c];
      max_abs = std::max(max_abs, std::abs(v));
      n2 += v * v;
    }
    max_norm_err = std::max(max_norm_err, std::abs(std::sqrt(n2) - std::sqrt(kDim / 2.0)));
  }
  const bool prefix_same = std::memcmp(longer.raw_data(), P.raw_data(), P.nbytes()) == 0;
  // (4) deterministic: computed again (float32, d2l's order), the same bits.
  const Tensor a = sinusoidal_encoding(kN, kDim, DType::F32, SinusoidalMode::kMatchD2l);
  const Tensor b = sinusoidal_encoding(kN, kDim, DType::F32, SinusoidalMode::kMatchD2l);
  const bool same_bits = std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;

  viz::Table t;
  t.caption = fmt::format("The four requirements on P (d = {}, N = {})", kDim, kN);
  t.header = {"requirement", "check", "result"};
  t.rows.push_back(
      {"1. a unique code per step",
       fmt::format("smallest ||P[i] - P[j]|| over all {} pairs i != j", kN * (kN - 1) / 2),
       fmt::format("{:.3f} (rows {} and {}): no two steps share a code", min_d, min_i, min_j)});
  t.rows.push_back(
      {"2. same distance wherever the steps sit",
       "max over k = 1..256 of the spread (max - min over i) of ||P[i] - P[i+k]||",
       fmt::format("{:.1e}: the distance depends on the offset k only", worst_spread)});
  t.rows.push_back({"3. bounded, extends to longer sequences",
                    fmt::format("max |P| and max | ||P[i]|| - sqrt(d/2) | over {} positions; "
                                "first {} rows of the longer table",
                                8 * kN, kN),
                    fmt::format("{:.6f} and {:.1e}; rows {}", max_abs, max_norm_err,
                                prefix_same ? "bitwise identical" : "DIFFERENT")});
  t.rows.push_back({"4. deterministic", "P computed twice (float32, d2l's operations)",
                    same_bits ? "bitwise identical, no parameters" : "DIFFERENT"});
  s.table(std::move(t));

  // P P^T: entry (i, j) is sum_c cos((i - j) w_c), a function of i - j alone (a Toeplitz matrix).
  constexpr int64_t kShow = 100;
  viz::Matrix ppt{kShow, kShow, std::vector<double>(static_cast<size_t>(kShow * kShow))};
  for (int64_t i = 0; i < kShow; ++i)
    for (int64_t j = 0; j < kShow; ++j)
      ppt.values[static_cast<size_t>(i * kShow + j)] = dot(i, j);
  viz::HeatmapOptions ho;
  ho.title = "P P^T (100 positions, d = 64)";
  ho.xlabel = "position j";
  ho.ylabel = "position i";
  ho.colorbar_label = "P[i] . P[j]";
  s.figure(tour.write("pe_gram.svg", viz::heatmap_svg(ppt, ho)),
           "P P^T: P[i] . P[j] = sum_c cos((i - j) w_c) depends on the offset i - j alone, so "
           "every diagonal is constant (requirement 2), the maximum d/2 lies on the main diagonal "
           "only (requirement 1), and no entry exceeds d/2 (requirement 3).");
  viz::LineChartOptions lo;
  lo.title = "P[i] . P[i + k] against the offset k, from three starting steps";
  lo.xlabel = "offset k";
  lo.ylabel = "dot product";
  lo.height = 280;
  s.figure(tour.write("pe_offset_dot.svg", viz::line_chart_svg(curves, lo)),
           "The three curves lie on top of each other: the similarity of two steps is a function "
           "of their offset, the same at the start of a sequence as a thousand steps in.");
}

}  // namespace attn::cli
