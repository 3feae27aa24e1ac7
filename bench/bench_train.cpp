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
// Counter tokens_per_second = B * T per step / wall time. BM_TrainStepPadded/bf16:{0,1} is the
// same step on what users train on: lengths uniform in [T/2, T], the batch padded to its
// longest, valid tokens per second. BM_TrainStepParts times the parts of a
// step alone (forward, loss, backward, clip + AdamW), to see where the time goes without perf;
// BM_AddNorm one AddNorm site, the separate ops (/0) against the fused path (/1).
//
//   build/<dir>/bench/bench_train --benchmark_repetitions=5       (bench/run_train.sh runs it)
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

// The padded batch of what users run: lengths uniform in [T/2, T] (seeded), the batch padded to
// its longest sequence (d2l's valid_lens mark the rest), as `attn train --task shift` batches.
attn::model::Batch make_padded_batch() {
  std::mt19937_64 rng(43);
  std::vector<int64_t> lens(kB);
  for (int64_t& l : lens)
    l = kT / 2 + static_cast<int64_t>(rng() % (kT / 2 + 1));
  const int64_t width = *std::max_element(lens.begin(), lens.end());
  attn::model::Batch b;
  b.ids = attn::Tensor::zeros({kB, width}, attn::DType::I64);  // 0: the padding id
  b.valid_lens = attn::Tensor::empty({kB}, attn::DType::I64);
  b.targets = attn::Tensor::empty({kB}, attn::DType::I64);
  b.tokens = 0;
  for (int64_t i = 0; i < kB; ++i) {
    for (int64_t t = 0; t < lens[static_cast<size_t>(i)]; ++t)
      b.ids.data<int64_t>()[i * width + t] = 2 + static_cast<int64_t>(rng() % (kVocab - 2));
    b.valid_lens.data<int64_t>()[i] = lens[static_cast<size_t>(i)];
    b.targets.data<int64_t>()[i] = static_cast<int64_t>(rng() % kClasses);
    b.tokens += lens[static_cast<size_t>(i)];
  }
  return b;
}

void set_counters(benchmark::State& state) {
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(kB * kT), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = bench_threads();
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

// The step on a padded batch (make_padded_batch), fp32 or mixed precision (arg 1).
// tokens_per_second counts the valid tokens only, so that it compares with the full-length
// step's; padded_fraction is the share of the batch's B x width positions that are padding.
void BM_TrainStepPadded(benchmark::State& state) {
  const bool bf16 = state.range(0) == 1;
  attn::model::Trainer trainer(
      train_options(bf16 ? attn::model::Precision::kBFloat16 : attn::model::Precision::kFloat32));
  const attn::model::Batch batch = make_padded_batch();
  trainer.train_step(batch);
  for (auto _ : state) {
    attn::model::StepStats s = trainer.train_step(batch);
    benchmark::DoNotOptimize(s.loss);
  }
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(batch.tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["padded_fraction"] =
      1.0 - static_cast<double>(batch.tokens) / static_cast<double>(batch.ids.numel());
  state.counters["threads"] = bench_threads();
}

// The encoder-decoder's step (model::Seq2SeqTrainer, what `attn train --task translate|dates`
// runs): the long shape of bench/run_peers_seq2seq.sh, B 32 pairs of 64 + 64 tokens (<eos> and
// <bos> included), vocabularies of 1000, E 128, 4 heads, FFN 256, 2 + 2 blocks, dropout 0.1,
// AdamW and clipping. Arg 0: every pair full length; arg 1: source and target lengths uniform in
// [T/2, T] (seeded), the batch padded to its longest. tokens_per_second counts the valid target
// tokens (those in the loss).
void BM_Seq2SeqStep(benchmark::State& state) {
  constexpr int64_t kPairs = 32, kSteps = 64, kWords = 996, kE2 = 128;
  const bool padded = state.range(0) == 1;
  std::vector<std::string> words = {"<pad>", "<unk>", "<bos>", "<eos>"};
  for (int64_t i = 0; i < kWords; ++i)
    words.push_back("w" + std::to_string(i));
  const attn::model::Vocabulary vocab =
      attn::model::Vocabulary::from_tokens(words, attn::model::Reserved::kSeq2Seq);
  attn::model::Seq2SeqTrainOptions o;
  o.model.src_vocab_size = o.model.tgt_vocab_size = vocab.size();
  o.model.num_hiddens = kE2;
  o.model.ffn_num_hiddens = 2 * kE2;
  o.model.num_heads = 4;
  o.model.num_enc_blks = o.model.num_dec_blks = 2;
  o.model.dropout = kDropout;
  o.num_steps = kSteps;
  o.threads = bench_threads();
  attn::model::Seq2SeqTrainer trainer(o, vocab, vocab);
  attn::model::Seq2SeqDataset data;
  data.src_vocab_size = data.tgt_vocab_size = vocab.size();
  std::mt19937_64 rng(44);
  auto length = [&] {  // tokens before <eos> (and after <bos>)
    const int64_t n = kSteps - 1;
    return padded ? n / 2 + static_cast<int64_t>(rng() % static_cast<uint64_t>(n / 2 + 1)) : n;
  };
  auto sentence = [&](int64_t n) {
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t& id : ids)
      id = attn::model::Vocabulary::kEos + 1 + static_cast<int64_t>(rng() % kWords);
    return ids;
  };
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < kPairs; ++i) {
    data.sources.push_back(sentence(length()));
    data.targets.push_back(sentence(length()));
    rows.push_back(i);
  }
  const attn::model::Seq2SeqBatch batch =
      attn::model::make_seq2seq_batch(data, rows, {kSteps, /*trim_to_longest=*/true});
  trainer.train_step(batch);
  for (auto _ : state) {
    attn::model::Seq2SeqStepStats s = trainer.train_step(batch);
    benchmark::DoNotOptimize(s.loss);
  }
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(batch.tgt_tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = bench_threads();
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
BENCHMARK(BM_TrainStepPadded)
    ->ArgName("bf16")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(3.0);
BENCHMARK(BM_Seq2SeqStep)
    ->ArgName("padded")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(3.0);
BENCHMARK(BM_TrainStepParts)->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(3.0);
BENCHMARK(BM_AddNorm)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
