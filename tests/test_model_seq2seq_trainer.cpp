// Seq2SeqTrainer: the masked loss is d2l's token mean; the loss falls and the model learns to
// copy; thread counts give the same bits; "train N, save, load, train M" equals N + M steps in
// one go (losses bitwise, dropout on); a checkpoint of another task, other options or a corrupt
// file is a clear error that changes nothing; translation handles <unk>, empty and long sources;
// bf16 mixed precision trains, resumes bit for bit and decodes in float32.
#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/model/seq2seq_tasks.hpp"
#include "attn/model/seq2seq_trainer.hpp"
#include "attn/model/trainer.hpp"
#include "attn/ops/loss.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace attn::model {
namespace {

namespace fs = std::filesystem;

// The copy task over 4 letters, lengths 3..5, a 1+1 block model of width 16: milliseconds per
// step even under ASan.
struct Tiny {
  Seq2SeqTaskOptions task;
  Seq2SeqTrainOptions options;
  int64_t batch_size = 16;
  Vocabulary src, tgt;

  explicit Tiny(double dropout = 0.1) {
    task.task = Seq2SeqTask::kCopy;
    task.num_symbols = 4;
    task.min_len = 3;
    task.max_len = 5;
    src = seq2seq_task_source_vocabulary(task);
    tgt = seq2seq_task_target_vocabulary(task);
    options.model.src_vocab_size = src.size();
    options.model.tgt_vocab_size = tgt.size();
    options.model.num_hiddens = 16;
    options.model.ffn_num_hiddens = 32;
    options.model.num_heads = 2;
    options.model.num_enc_blks = 1;
    options.model.num_dec_blks = 1;
    options.model.dropout = dropout;
    options.num_steps = 6;
    options.adamw.lr = 1e-2;
    options.seed = 5;
    options.threads = 1;
  }
  Seq2SeqDataset data(int64_t n, uint64_t stream, TaskSplit split) const {
    return encode_seq2seq(generate_seq2seq_task(task, n, options.seed, stream, split), src, tgt);
  }
  // Batch s of the run: a pure function of (seed, s).
  Seq2SeqBatch batch(int64_t step) const {
    const Seq2SeqDataset d = data(batch_size, static_cast<uint64_t>(step), TaskSplit::kTrain);
    std::vector<int64_t> idx(static_cast<size_t>(batch_size));
    std::iota(idx.begin(), idx.end(), 0);
    return make_seq2seq_batch(d, idx, {options.num_steps, true});
  }
  std::vector<double> run(Seq2SeqTrainer& t, int64_t stop) const {
    std::vector<double> losses;
    while (t.step() < stop)
      losses.push_back(t.train_step(batch(t.step())).loss);
    return losses;
  }
};

fs::path temp_path(const std::string& name) {
  return attn::testing::temp_path("attn_test_seq2seq_trainer_" + name);
}

void expect_same_parameters(nn::Module& a, nn::Module& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [name, t] : sa) {
    ASSERT_TRUE(sb.count(name)) << name;
    const Tensor& u = sb.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()), 0) << name << " differs";
  }
}

// Runs `resumed` to step 10 after the losses `got` of its first steps: every loss equals the
// uninterrupted run's (`expected`, `straight`), and so does every parameter.
void expect_resumed_run_repeats(const Tiny& tiny, Seq2SeqTrainer& resumed, std::vector<double> got,
                                const std::vector<double>& expected, Seq2SeqTrainer& straight) {
  for (double l : tiny.run(resumed, 10))
    got.push_back(l);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i], expected[i]) << "step " << i + 1;
  expect_same_parameters(resumed.model(), straight.model());
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    for (const auto& p : parts)
      EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
  }
}

TEST(Seq2SeqTrainer, LossIsTheMaskedTokenMean) {
  // semantics-seq2seq.md 7.4: Y = [[1,3,0],[2,2,0]] with pad 0 -> d2l's Seq2Seq.loss 1.12376952.
  // Here the mask comes from tgt_valid_lens = [2, 2] (the labels before the first pad).
  Context ctx;
  const Tensor logits = Tensor::from_vector(
      std::vector<float>{1,    2,    0.5f, -1, 0, 0,  0, 0, 2,    -1,   0,    1,
                         0.5f, 0.5f, 3,    0,  1, -2, 0, 2, 0.3f, 0.2f, 0.1f, 0},
      {2, 3, 4});
  const Tensor labels = Tensor::from_vector(std::vector<int64_t>{1, 3, 0, 2, 2, 0}, {2, 3});
  CrossEntropyOptions ce;
  ce.valid_lens = Tensor::from_vector(std::vector<int64_t>{2, 2}, {2});
  EXPECT_NEAR(softmax_cross_entropy(ctx, logits, labels, ce).loss, 1.1237695579, 1e-6);
}

TEST(Seq2SeqTrainer, LearnsToCopy) {
  Tiny tiny(0.0);
  tiny.batch_size = 32;
  Seq2SeqTrainer t(tiny.options, tiny.src, tiny.tgt);
  const std::vector<double> losses = tiny.run(t, 500);
  const double first = std::accumulate(losses.begin(), losses.begin() + 10, 0.0) / 10;
  const double last = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
  EXPECT_LT(last, 0.2 * first) << "first 10 steps " << first << ", last 10 " << last;
  const Seq2SeqEvalStats s = t.evaluate(tiny.data(64, 1u << 20, TaskSplit::kHeldOut));
  EXPECT_EQ(s.examples, 64);
  EXPECT_GT(s.exact_match, 0.5) << "bleu " << s.bleu << " loss " << s.loss;
  EXPECT_GE(s.bleu, s.exact_match);  // an exact match has BLEU 1
}

TEST(Seq2SeqTrainer, SameLossesForOneAndTwoThreads) {
  Tiny tiny;
  Seq2SeqTrainer one(tiny.options, tiny.src, tiny.tgt);
  tiny.options.threads = 2;
  Seq2SeqTrainer two(tiny.options, tiny.src, tiny.tgt);
  const std::vector<double> a = tiny.run(one, 6), b = tiny.run(two, 6);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  expect_same_parameters(one.model(), two.model());
}

TEST(Seq2SeqTrainer, ResumeFromCheckpointIsBitIdentical) {
  Tiny tiny;  // dropout 0.1: the resumed run must also continue the dropout stream
  Seq2SeqTrainer straight(tiny.options, tiny.src, tiny.tgt);
  const std::vector<double> expected = tiny.run(straight, 10);

  const fs::path path = temp_path("resume.safetensors");
  Seq2SeqTrainer first(tiny.options, tiny.src, tiny.tgt);
  std::vector<double> got = tiny.run(first, 4);
  // Evaluation in between changes neither the parameters nor the dropout stream.
  first.evaluate(tiny.data(8, 1u << 20, TaskSplit::kHeldOut));
  first.save_checkpoint(path.string(), {{"note", "half way"}});

  auto resumed = Seq2SeqTrainer::from_checkpoint(path.string(), 2);
  EXPECT_EQ(resumed->step(), 4);
  EXPECT_EQ(resumed->src_vocab().tokens(), tiny.src.tokens());
  EXPECT_EQ(resumed->tgt_vocab().tokens(), tiny.tgt.tokens());
  expect_resumed_run_repeats(tiny, *resumed, got, expected, straight);

  const SafetensorsFile f = load_safetensors(path.string());
  EXPECT_EQ(f.metadata.at("attn.format"), kSeq2SeqCheckpointFormat);
  EXPECT_EQ(f.metadata.at("note"), "half way");
  EXPECT_TRUE(f.tensors.count("model.decoder.blks.block0.attention2.W_q.weight"));
  EXPECT_TRUE(f.tensors.count("model.encoder.blks.block0.ffn.dense1.weight"));  // lazy, yet saved
  EXPECT_TRUE(f.tensors.count("optimizer.decoder.dense.weight.exp_avg"));
  EXPECT_EQ(checkpoint_format(path.string()), kSeq2SeqCheckpointFormat);
  fs::remove(path);
}

TEST(Seq2SeqTrainer, OtherTaskOtherOptionsOrCorruptCheckpointIsAClearError) {
  Tiny tiny;
  Seq2SeqTrainer t(tiny.options, tiny.src, tiny.tgt);
  tiny.run(t, 2);
  const fs::path good = temp_path("good.safetensors");
  t.save_checkpoint(good.string());
  const auto before = t.model().state_dict();

  // An encoder task's checkpoint.
  TrainOptions enc;
  enc.model.vocab_size = 6;
  enc.model.num_classes = 3;
  enc.model.num_hiddens = 8;
  enc.model.ffn_num_hiddens = 8;
  enc.model.num_blks = 1;
  enc.threads = 1;
  Trainer encoder(enc);
  const fs::path other = temp_path("encoder.safetensors");
  encoder.save_checkpoint(other.string());
  expect_error([&] { t.load_checkpoint(other.string()); }, {other.string(), "encoder task"});
  expect_error([&] { Seq2SeqTrainer::from_checkpoint(other.string()); }, {"encoder task"});
  EXPECT_EQ(checkpoint_format(other.string()), kEncoderCheckpointFormat);
  // ... and ours given to the encoder trainer.
  EXPECT_THROW(encoder.load_checkpoint(good.string()), Error);

  // Other options.
  Tiny wider;
  wider.options.model.num_hiddens = 32;
  Seq2SeqTrainer w(wider.options, wider.src, wider.tgt);
  expect_error([&] { w.load_checkpoint(good.string()); }, {"other options", "num_hiddens"});

  // A truncated file and one that is not safetensors at all.
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const fs::path cut = temp_path("cut.safetensors");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  EXPECT_THROW(t.load_checkpoint(cut.string()), Error);
  const fs::path junk = temp_path("junk.safetensors");
  std::ofstream(junk, std::ios::binary) << "not a checkpoint";
  EXPECT_THROW(Seq2SeqTrainer::from_checkpoint(junk.string()), Error);
  EXPECT_THROW(checkpoint_format(junk.string()), Error);

  // Nothing changed.
  EXPECT_EQ(t.step(), 2);
  const auto after = t.model().state_dict();
  for (const auto& [name, v] : before)
    EXPECT_EQ(std::memcmp(v.raw_data(), after.at(name).raw_data(), v.nbytes()), 0) << name;
  for (const auto& p : {good, other, cut, junk})
    fs::remove(p);
}

TEST(Seq2SeqTrainer, TranslateHandlesUnknownEmptyAndLongSources) {
  Tiny tiny(0.0);
  Seq2SeqTrainer t(tiny.options, tiny.src, tiny.tgt);
  tiny.run(t, 3);
  const std::vector<std::vector<std::string>> sources = {
      {"a", "b"}, {}, {"a", "zebra", "c"}, {"a", "b", "c", "d", "a", "b", "c"}};
  const Translations greedy = t.translate(sources);
  ASSERT_EQ(greedy.tokens.size(), 4u);
  EXPECT_TRUE(greedy.tokens[1].empty());
  EXPECT_EQ(greedy.cut, std::vector<int64_t>{3});  // 7 tokens + <eos> > num_steps 6
  for (const auto& out : greedy.tokens)
    EXPECT_LE(static_cast<int64_t>(out.size()), tiny.options.num_steps);
  // Unknown words become <unk>: the same translation as writing <unk>.
  EXPECT_EQ(t.translate({{"a", "<unk>", "c"}}).tokens[0], greedy.tokens[2]);
  // Greedy equals the ids path; beam search of width 1 is greedy; batch size does not matter.
  TranslateOptions one;
  one.batch_size = 1;
  EXPECT_EQ(t.translate(sources, one).tokens, greedy.tokens);
  TranslateOptions beam;
  beam.beam_size = 3;
  EXPECT_EQ(t.translate(sources, beam).tokens.size(), 4u);
  beam.beam_size = 0;
  expect_error([&] { t.translate(sources, beam); }, {"beam size must be >= 1"});
}

// With more than one batch and more than one thread, batches are decoded side by side on
// replicas of the model (seq2seq_trainer.cpp): the same translations, cut list and evaluation as
// one thread decoding them in order, greedy and beam, and the model's mode and dropout stream
// untouched.
TEST(Seq2SeqTrainer, BatchesDecodedSideBySideMatchOneThread) {
  Tiny tiny(0.1);
  Seq2SeqTrainer one(tiny.options, tiny.src, tiny.tgt);
  tiny.run(one, 20);
  const std::string ckpt = temp_path("side_by_side.safetensors").string();
  one.save_checkpoint(ckpt);
  auto four = Seq2SeqTrainer::from_checkpoint(ckpt, 4);
  std::filesystem::remove(ckpt);
  std::vector<std::vector<std::string>> sources;
  const std::vector<std::string> words = {"a", "b", "c", "d", "zebra"};
  for (int i = 0; i < 23; ++i) {
    std::vector<std::string> s;
    for (int j = 0; j <= (i * 7) % 8; ++j)
      s.push_back(words[static_cast<size_t>((i + j * 3) % 5)]);
    sources.push_back(s);
  }
  sources[5].clear();
  for (int64_t beam : {1, 3})
    for (int64_t batch : {1, 4, 64}) {
      TranslateOptions o;
      o.beam_size = beam;
      o.batch_size = batch;
      const Translations a = one.translate(sources, o), b = four->translate(sources, o);
      EXPECT_EQ(a.tokens, b.tokens) << "beam " << beam << " batch " << batch;
      EXPECT_EQ(a.cut, b.cut) << "beam " << beam << " batch " << batch;
    }
  const Seq2SeqDataset held = tiny.data(40, 1u << 20, TaskSplit::kHeldOut);
  EXPECT_EQ(one.greedy_ids(held.sources, 8), four->greedy_ids(held.sources, 8));
  const uint64_t offset = four->context().dropout_offset();
  four->model().train();
  four->translate(sources, {});
  EXPECT_TRUE(four->model().training());
  EXPECT_EQ(four->context().dropout_offset(), offset);
}

// bf16 mixed precision (Seq2SeqTrainOptions::precision): the step runs under autocast (its losses
// differ from float32's in their low bits and stay close), the model still learns, and it keeps
// the trainer's contracts: the same bits for one and two threads, and "train N, save, load,
// train M" equal to N + M steps in one go, the checkpoint naming its precision.
TEST(Seq2SeqTrainer, Bf16MixedPrecisionLearnsAndResumesBitForBit) {
  Tiny tiny;  // dropout 0.1
  Seq2SeqTrainer fp32(tiny.options, tiny.src, tiny.tgt);
  tiny.options.precision = Precision::kBFloat16;
  Seq2SeqTrainer straight(tiny.options, tiny.src, tiny.tgt);
  EXPECT_TRUE(straight.context().autocast_bf16);
  const std::vector<double> f = tiny.run(fp32, 10), expected = tiny.run(straight, 10);
  EXPECT_NE(f[0], expected[0]) << "the bf16 step gave float32's loss bit for bit";
  EXPECT_NEAR(f[0], expected[0], 1e-2 * std::abs(f[0]));

  const fs::path path = temp_path("bf16_resume.safetensors");
  tiny.options.threads = 2;
  Seq2SeqTrainer first(tiny.options, tiny.src, tiny.tgt);
  std::vector<double> got = tiny.run(first, 4);
  first.save_checkpoint(path.string());
  EXPECT_EQ(load_safetensors(path.string()).metadata.at("attn.precision"), "bf16");
  auto resumed = Seq2SeqTrainer::from_checkpoint(path.string(), 1);
  fs::remove(path);
  EXPECT_EQ(resumed->options().precision, Precision::kBFloat16);
  EXPECT_TRUE(resumed->context().autocast_bf16);
  expect_resumed_run_repeats(tiny, *resumed, got, expected, straight);

  Tiny learn(0.0);
  learn.batch_size = 32;
  learn.options.precision = Precision::kBFloat16;
  Seq2SeqTrainer t(learn.options, learn.src, learn.tgt);
  const std::vector<double> losses = learn.run(t, 500);
  const double head = std::accumulate(losses.begin(), losses.begin() + 10, 0.0) / 10;
  const double tail = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
  EXPECT_LT(tail, 0.2 * head) << "first 10 steps " << head << ", last 10 " << tail;
  EXPECT_GT(t.evaluate(learn.data(64, 1u << 20, TaskSplit::kHeldOut)).exact_match, 0.5);
}

// Decoding runs in float32 whatever the precision: a bf16 trainer and a float32 trainer holding
// the same parameters translate alike (greedy and beam) and score the same BLEU, while the
// teacher-forced evaluation loss follows each trainer's precision.
TEST(Seq2SeqTrainer, Bf16TrainerDecodesInFloat32) {
  Tiny tiny(0.0);
  tiny.options.precision = Precision::kBFloat16;
  Seq2SeqTrainer bf16(tiny.options, tiny.src, tiny.tgt);
  // Barely trained: the best logits of a step are often close, so decoding under autocast would
  // pick other tokens than float32 somewhere among the held-out sources.
  tiny.run(bf16, 3);
  const fs::path path = temp_path("bf16_decode.safetensors");
  bf16.save_checkpoint(path.string());
  tiny.options.precision = Precision::kFloat32;
  Seq2SeqTrainer fp32(tiny.options, tiny.src, tiny.tgt);
  fp32.load_checkpoint(path.string());  // a checkpoint loads in either precision
  fs::remove(path);
  EXPECT_FALSE(fp32.context().autocast_bf16);
  const Seq2SeqDataset held = tiny.data(256, 1u << 20, TaskSplit::kHeldOut);
  EXPECT_EQ(bf16.greedy_ids(held.sources, 8), fp32.greedy_ids(held.sources, 8));
  std::vector<std::vector<std::string>> sources;
  for (const auto& ids : held.sources)
    sources.push_back(ids_to_tokens(ids, tiny.src));
  for (int64_t beam : {1, 3}) {
    TranslateOptions o;
    o.beam_size = beam;
    EXPECT_EQ(bf16.translate(sources, o).tokens, fp32.translate(sources, o).tokens)
        << "beam " << beam;
  }
  const Seq2SeqEvalStats a = bf16.evaluate(held), b = fp32.evaluate(held);
  EXPECT_EQ(a.bleu, b.bleu);
  EXPECT_EQ(a.exact_match, b.exact_match);
  EXPECT_NE(a.loss, b.loss) << "the bf16 trainer's evaluation loss was float32's";
  EXPECT_NEAR(a.loss, b.loss, 2e-2 * std::abs(b.loss));
}

}  // namespace
}  // namespace attn::model
