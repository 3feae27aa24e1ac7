// Training throughput of a small Transformer encoder classifier: the model `attn train` builds
// (embedding * sqrt(E) + sinusoidal PE, 2 post-norm encoder blocks, masked-mean classification
// head), one full step of model::Trainer per iteration: forward, softmax cross-entropy, backward,
// clip_grad_norm(1.0) and AdamW.
//
// Shapes of issue 5: E = 128, H = 4 (D = 32), 2 blocks, FFN 256 (d2l's 2 * E), vocabulary 1000,
// 2 classes, B = 32 sequences of T = 128 tokens (every sequence full length, valid_lens given),
// dropout 0.1, fp32 (BM_TrainStepBf16: mixed precision), ATTN_THREADS threads (default 2).
// bench/torch_train.py is the same model in PyTorch (d2l's code) and bench/run_train.sh runs both
// side by side.
//
// What users train on is padded (issue 23): BM_TrainStepPadded and BM_TrainStepPaddedBf16 run the
// same model and options on batches whose lengths are uniform in [T/2, T] (seeded), each batch
// padded with <pad> to its longest sequence by model::make_batch (as `attn train` batches), d2l's
// valid_lens given. kPaddedBatches such batches are drawn once and cycled, so the widths vary
// from step to step as the CLI's do and every run sees the same batches.
//
// The encoder-decoder's step (model::Seq2SeqTrainer, what `attn train --task dates|translate`
// runs): BM_Seq2SeqStep every pair full length, BM_Seq2SeqStepPadded source and target lengths
// uniform in [T/2, T], and both in bf16 mixed precision (BM_Seq2SeqStepBf16,
// BM_Seq2SeqStepPaddedBf16: `attn train --precision bf16`), at the `long` shape of
// bench/run_peers_seq2seq.sh (B 32, 64 + 64 tokens, vocabularies of 1000, E 128, 4 heads, FFN 256,
// 2 + 2 blocks, dropout 0.1).
//
// Counter tokens_per_second: the valid tokens a step trains on per second of wall time (B * T
// for the full-length encoder step; the sum of valid_lens for the padded ones; the target tokens
// in the loss, <eos> included, for seq2seq). padded_fraction: the share of the batches' positions
// that are padding (0 for full length). BM_TrainStepParts times the parts of a step alone
// (forward, loss, backward, clip + AdamW), to see where the time goes without perf; BM_AddNorm
// one AddNorm site, the separate ops (/0) against the fused path (/1).
//
//   build/<dir>/bench/bench_train --benchmark_repetitions=5       (bench/run_train.sh runs it)
//   bench/run_padded.sh runs the padded benchmarks beside the full-length ones and the CLI.
#include "attn/model/data.hpp"
#include "attn/model/seq2seq_data.hpp"
#include "attn/model/seq2seq_trainer.hpp"
#include "attn/model/trainer.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/dropout.hpp"
#include "attn/ops/layer_norm.hpp"
#include "attn/ops/loss.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t kB = 32, kT = 128, kE = 128, kH = 4, kF = 256, kBlocks = 2, kVocab = 1000,
                  kClasses = 2;
constexpr double kDropout = 0.1;
// Padded batches drawn once and cycled: enough that the mean padding is near its expectation.
constexpr int kPaddedBatches = 8;

int bench_threads() {
  const char* env = std::getenv("ATTN_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

attn::model::TrainOptions train_options(
    attn::model::Precision precision = attn::model::Precision::kFloat32) {
  attn::model::TrainOptions o;
  o.precision = precision;
  o.model.type = attn::model::TaskType::kClassification;
  o.model.vocab_size = kVocab;
  o.model.num_classes = kClasses;
  o.model.num_hiddens = kE;
  o.model.ffn_num_hiddens = kF;
  o.model.num_heads = kH;
  o.model.num_blks = kBlocks;
  o.model.dropout = kDropout;
  o.model.positional = attn::nn::PositionalKind::kSinusoidal;
  o.adamw.lr = 1e-3;
  o.clip_norm = 1.0;
  o.seed = 0;
  o.threads = bench_threads();
  return o;
}

attn::model::Batch make_batch() {
  std::mt19937_64 rng(42);
  attn::model::Batch b;
  b.ids = attn::Tensor::empty({kB, kT}, attn::DType::I64);
  b.valid_lens = attn::Tensor::empty({kB}, attn::DType::I64);
  b.targets = attn::Tensor::empty({kB}, attn::DType::I64);
  int64_t* ids = b.ids.data<int64_t>();
  for (int64_t i = 0; i < kB * kT; ++i)
    ids[i] = 2 + static_cast<int64_t>(rng() % (kVocab - 2));
  for (int64_t i = 0; i < kB; ++i) {
    b.valid_lens.data<int64_t>()[i] = kT;
    b.targets.data<int64_t>()[i] = static_cast<int64_t>(rng() % kClasses);
  }
  b.tokens = kB * kT;
  return b;
}

// kPaddedBatches batches of kB sequences, lengths uniform in [kT/2, kT] from a fixed seed, random
// ids and classes, each batch padded to its longest sequence by model::make_batch.
std::vector<attn::model::Batch> make_padded_batches() {
  std::mt19937_64 rng(43);
  attn::model::Dataset data;
  data.type = attn::model::TaskType::kClassification;
  data.vocab_size = kVocab;
  data.num_classes = kClasses;
  for (int64_t i = 0; i < kPaddedBatches * kB; ++i) {
    const int64_t len = kT / 2 + static_cast<int64_t>(rng() % (kT / 2 + 1));
    std::vector<int64_t> ids(static_cast<size_t>(len));
    for (int64_t& id : ids)
      id = 2 + static_cast<int64_t>(rng() % (kVocab - 2));
    data.inputs.push_back(std::move(ids));
    data.labels.push_back(static_cast<int64_t>(rng() % kClasses));
  }
  std::vector<attn::model::Batch> batches;
  for (int64_t n = 0; n < kPaddedBatches; ++n) {
    std::vector<int64_t> rows(kB);
    for (int64_t i = 0; i < kB; ++i)
      rows[static_cast<size_t>(i)] = n * kB + i;
    batches.push_back(attn::model::make_batch(data, rows));
  }
  return batches;
}

void set_counters(benchmark::State& state) {
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(kB * kT), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["padded_fraction"] = 0;
  state.counters["threads"] = bench_threads();
}

// Counters of a benchmark that cycled through batches: `valid` tokens summed over the steps it
// timed, and the share of padding over the whole batch set (the same whatever the step count).
void set_cycled_counters(benchmark::State& state, double valid, double padded_fraction) {
  state.counters["tokens_per_second"] = benchmark::Counter(valid, benchmark::Counter::kIsRate);
  state.counters["padded_fraction"] = padded_fraction;
  state.counters["threads"] = bench_threads();
}

// The timed loop of the padded benchmarks: one untimed step per batch first (allocations at
// every width, threads), then `trainer`'s steps over `batches` cycled. Returns the valid tokens
// (tokens(batch)) of the steps timed.
template <class Trainer, class Batch, class Tokens>
double cycle_steps(benchmark::State& state, Trainer& trainer, const std::vector<Batch>& batches,
                   Tokens tokens) {
  for (const Batch& b : batches)
    trainer.train_step(b);
  double valid = 0;
  size_t next = 0;
  for (auto _ : state) {
    const Batch& b = batches[next];
    next = (next + 1) % batches.size();
    auto s = trainer.train_step(b);
    benchmark::DoNotOptimize(s.loss);
    valid += static_cast<double>(tokens(b));
  }
  return valid;
}

// The encoder step on the padded batches, cycled; fp32 or mixed precision.
void run_padded_steps(benchmark::State& state, attn::model::Precision precision) {
  attn::model::Trainer trainer(train_options(precision));
  const std::vector<attn::model::Batch> batches = make_padded_batches();
  const double valid =
      cycle_steps(state, trainer, batches, [](const attn::model::Batch& b) { return b.tokens; });
  double tokens = 0, positions = 0;
  for (const attn::model::Batch& b : batches) {
    tokens += static_cast<double>(b.tokens);
    positions += static_cast<double>(b.ids.numel());
  }
  set_cycled_counters(state, valid, 1.0 - tokens / positions);
}

// One optimisation step of the trainer, as `attn train` runs it.
void BM_TrainStep(benchmark::State& state) {
  attn::model::Trainer trainer(train_options());
  const attn::model::Batch batch = make_batch();
  trainer.train_step(batch);  // warm-up: allocations, thread pool
  for (auto _ : state) {
    attn::model::StepStats s = trainer.train_step(batch);
    benchmark::DoNotOptimize(s.loss);
  }
  set_counters(state);
}

// The same step in mixed precision (`attn train --precision bf16`): linear layers and attention
// in bfloat16, float32 master weights, AdamW, LayerNorm and loss.
void BM_TrainStepBf16(benchmark::State& state) {
  attn::model::Trainer trainer(train_options(attn::model::Precision::kBFloat16));
  const attn::model::Batch batch = make_batch();
  trainer.train_step(batch);
  for (auto _ : state) {
    attn::model::StepStats s = trainer.train_step(batch);
    benchmark::DoNotOptimize(s.loss);
  }
  set_counters(state);
}

// The steps of BM_TrainStep and BM_TrainStepBf16 on padded batches (lengths uniform in [T/2, T]).
void BM_TrainStepPadded(benchmark::State& state) {
  run_padded_steps(state, attn::model::Precision::kFloat32);
}

void BM_TrainStepPaddedBf16(benchmark::State& state) {
  run_padded_steps(state, attn::model::Precision::kBFloat16);
}

// --- the encoder-decoder's step ----------------------------------------------------------------
constexpr int64_t kS2sB = 32, kS2sT = 64, kS2sVocab = 1000, kS2sE = 128;

// A Reserved::kSeq2Seq vocabulary of kS2sVocab entries (the four reserved tokens, then words).
attn::model::Vocabulary seq2seq_vocab() {
  attn::model::Vocabulary v(attn::model::Reserved::kSeq2Seq);
  for (int64_t i = 0; v.size() < kS2sVocab; ++i)
    v.add("w" + std::to_string(i));
  return v;
}

// Batches of kS2sB pairs made by make_seq2seq_batch with trim_to_longest (as `attn train` makes
// them). Full length: every side kS2sT - 1 ids + <eos>. Padded: each side's valid length (ids +
// <eos>) uniform in [T/2, T], seeded; kPaddedBatches batches to cycle.
std::vector<attn::model::Seq2SeqBatch> make_seq2seq_batches(bool padded) {
  std::mt19937_64 rng(44);
  attn::model::Seq2SeqDataset data;
  data.src_vocab_size = data.tgt_vocab_size = kS2sVocab;
  auto sentence = [&] {
    const int64_t valid =
        padded ? kS2sT / 2 + static_cast<int64_t>(rng() % (kS2sT / 2 + 1)) : kS2sT;
    std::vector<int64_t> ids(static_cast<size_t>(valid - 1));  // <eos> is added by batching
    for (int64_t& id : ids)
      id = attn::model::Vocabulary::kEos + 1 +
           static_cast<int64_t>(rng() % (kS2sVocab - attn::model::Vocabulary::kEos - 1));
    return ids;
  };
  const int64_t n = padded ? kPaddedBatches : 1;
  for (int64_t i = 0; i < n * kS2sB; ++i) {
    data.sources.push_back(sentence());
    data.targets.push_back(sentence());
  }
  std::vector<attn::model::Seq2SeqBatch> batches;
  for (int64_t b = 0; b < n; ++b) {
    std::vector<int64_t> rows(kS2sB);
    for (int64_t i = 0; i < kS2sB; ++i)
      rows[static_cast<size_t>(i)] = b * kS2sB + i;
    batches.push_back(attn::model::make_seq2seq_batch(data, rows, {kS2sT, true}));
  }
  return batches;
}

void run_seq2seq_steps(benchmark::State& state, bool padded, attn::model::Precision precision) {
  attn::model::Seq2SeqTrainOptions o;
  o.model.src_vocab_size = o.model.tgt_vocab_size = kS2sVocab;
  o.model.num_hiddens = kS2sE;
  o.model.ffn_num_hiddens = 2 * kS2sE;
  o.model.num_heads = 4;
  o.model.num_enc_blks = o.model.num_dec_blks = 2;
  o.model.dropout = kDropout;
  o.num_steps = kS2sT;
  o.adamw.lr = 1e-3;
  o.clip_norm = 1.0;
  o.seed = 0;
  o.threads = bench_threads();
  o.precision = precision;
  attn::model::Seq2SeqTrainer trainer(o, seq2seq_vocab(), seq2seq_vocab());
  const std::vector<attn::model::Seq2SeqBatch> batches = make_seq2seq_batches(padded);
  const double valid = cycle_steps(state, trainer, batches,
                                   [](const attn::model::Seq2SeqBatch& b) { return b.tgt_tokens; });
  // padded_fraction: the target side's; src_padded_fraction: the source side's.
  double tgt = 0, tgt_positions = 0, src = 0, src_positions = 0;
  for (const attn::model::Seq2SeqBatch& b : batches) {
    tgt += static_cast<double>(b.tgt_tokens);
    tgt_positions += static_cast<double>(b.labels.numel());
    src += static_cast<double>(b.src_tokens);
    src_positions += static_cast<double>(b.src.numel());
  }
  set_cycled_counters(state, valid, 1.0 - tgt / tgt_positions);
  state.counters["src_padded_fraction"] = 1.0 - src / src_positions;
}

void BM_Seq2SeqStep(benchmark::State& state) {
  run_seq2seq_steps(state, false, attn::model::Precision::kFloat32);
}

void BM_Seq2SeqStepPadded(benchmark::State& state) {
  run_seq2seq_steps(state, true, attn::model::Precision::kFloat32);
}

void BM_Seq2SeqStepBf16(benchmark::State& state) {
  run_seq2seq_steps(state, false, attn::model::Precision::kBFloat16);
}

void BM_Seq2SeqStepPaddedBf16(benchmark::State& state) {
  run_seq2seq_steps(state, true, attn::model::Precision::kBFloat16);
}

// The same step in its four parts, each timed by hand (manual time = the whole step), with the
// seconds per step of each part as counters.
void BM_TrainStepParts(benchmark::State& state) {
  attn::model::Trainer trainer(train_options());
  const attn::model::Batch batch = make_batch();
  attn::model::SequenceModel& model = trainer.model();
  attn::Context& ctx = trainer.context();
  trainer.train_step(batch);
  using clock = std::chrono::steady_clock;
  double t_forward = 0, t_loss = 0, t_backward = 0, t_optim = 0;
  for (auto _ : state) {
    const auto t0 = clock::now();
    model.train();
    trainer.optimizer().zero_grad();
    attn::Tensor logits = model.forward(ctx, batch.ids, batch.valid_lens);
    const auto t1 = clock::now();
    attn::CrossEntropyResult loss = attn::softmax_cross_entropy(ctx, logits, batch.targets);
    attn::Tensor dlogits = attn::softmax_cross_entropy_backward(ctx, logits, batch.targets);
    const auto t2 = clock::now();
    model.backward(ctx, dlogits);
    const auto t3 = clock::now();
    attn::nn::clip_grad_norm(trainer.optimizer().parameters(), 1.0);
    trainer.optimizer().step();
    const auto t4 = clock::now();
    benchmark::DoNotOptimize(loss.loss);
    auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    t_forward += sec(t0, t1);
    t_loss += sec(t1, t2);
    t_backward += sec(t2, t3);
    t_optim += sec(t3, t4);
    state.SetIterationTime(sec(t0, t4));
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["forward_ms"] = 1e3 * t_forward / n;
  state.counters["loss_ms"] = 1e3 * t_loss / n;
  state.counters["backward_ms"] = 1e3 * t_backward / n;
  state.counters["clip_adamw_ms"] = 1e3 * t_optim / n;
  set_counters(state);
}

// One AddNorm site of the step, LayerNorm(dropout(Y) + X) at (B, T, E), training, forward and
// backward: arg 0 the separate ops the module ran before the fused path (dropout, add,
// layer_norm, layer_norm_backward, dropout_backward), arg 1 nn::AddNorm (kernels/cpu/add_norm).
void BM_AddNorm(benchmark::State& state) {
  const bool fused = state.range(0) == 1;
  attn::Context ctx;
  ctx.threads = bench_threads();
  attn::nn::AddNorm an(kE, kDropout);
  an.train();
  attn::Tensor X = attn::Tensor::empty({kB, kT, kE}), Y = attn::Tensor::empty({kB, kT, kE});
  attn::Tensor dout = attn::Tensor::empty({kB, kT, kE});
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (attn::Tensor* t : {&X, &Y, &dout})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->data<float>()[i] = u(rng);
  for (auto _ : state) {
    if (fused) {
      attn::Tensor out = an.forward(ctx, X, Y);
      attn::nn::AddNormGrads g = an.backward(ctx, dout);
      benchmark::DoNotOptimize(g.dY.data<float>());
    } else {
      const uint64_t offset = ctx.next_dropout_offset();
      attn::Tensor Yd = attn::dropout(ctx, Y, kDropout, ctx.seed, offset);
      attn::Tensor Z = attn::Tensor::empty(X.shape());
      float* z = Z.data<float>();
      const float *yd = Yd.data<float>(), *x = X.data<float>();
      for (int64_t i = 0; i < Z.numel(); ++i)
        z[i] = yd[i] + x[i];
      attn::LayerNormResult f = attn::layer_norm(ctx, Z, an.ln.weight.value, an.ln.bias.value);
      attn::LayerNormGrads g = attn::layer_norm_backward(ctx, dout, Z, an.ln.weight.value, f);
      attn::Tensor dY = attn::dropout_backward(ctx, g.dx, kDropout, ctx.seed, offset);
      benchmark::DoNotOptimize(dY.data<float>());
    }
  }
  state.counters["threads"] = bench_threads();
}

}  // namespace

BENCHMARK(BM_TrainStep)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_TrainStepBf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_TrainStepPadded)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_TrainStepPaddedBf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_Seq2SeqStep)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_Seq2SeqStepPadded)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_Seq2SeqStepBf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_Seq2SeqStepPaddedBf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
BENCHMARK(BM_TrainStepParts)->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(3.0);
BENCHMARK(BM_AddNorm)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
