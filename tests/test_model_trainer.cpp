// Trainer: the loss falls on a tiny task; the same seed gives the same losses for 1 and 2
// threads; a checkpoint + resume repeats an uninterrupted run bit for bit; checkpoint writes are
// atomic; a checkpoint of other options is refused without changing anything.
#include "attn/core/safetensors.hpp"
#include "attn/model/tasks.hpp"
#include "attn/model/trainer.hpp"
#include "attn/ops/loss.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>

namespace attn::model {
namespace {

namespace fs = std::filesystem;

// A tiny tagging setup (shift, 3 symbols, lengths 3..6): milliseconds per step, even under ASan.
struct Tiny {
  TaskOptions task;
  TrainOptions options;
  int64_t batch_size = 8;

  explicit Tiny(GeneratedTask kind = GeneratedTask::kShift, double dropout = 0.1) {
    task.task = kind;
    task.num_symbols = 3;
    task.min_len = 3;
    task.max_len = 6;
    options.model.type = task_type(kind);
    options.model.vocab_size = task_vocab_size(task);
    options.model.num_classes = task_num_classes(task);
    options.model.num_hiddens = 16;
    options.model.ffn_num_hiddens = 16;
    options.model.num_heads = 2;
    options.model.num_blks = 1;
    options.model.dropout = dropout;  // exercises the dropout stream in every test
    options.model.positional = nn::PositionalKind::kLearned;
    options.model.max_len = 8;
    options.adamw.lr = 1e-2;
    options.seed = 11;
    options.threads = 1;
  }
  // Batch s of the run: a pure function of (seed, s), as the CLI draws it.
  Batch batch(int64_t step) const {
    std::vector<int64_t> idx(static_cast<size_t>(batch_size));
    std::iota(idx.begin(), idx.end(), 0);
    return make_batch(generate_task(task, batch_size, options.seed, static_cast<uint64_t>(step)),
                      idx);
  }
  // Losses of steps [trainer.step(), stop).
  std::vector<double> run(Trainer& t, int64_t stop) const {
    std::vector<double> losses;
    while (t.step() < stop)
      losses.push_back(t.train_step(batch(t.step())).loss);
    return losses;
  }
};

fs::path temp_path(const std::string& name) {
  return attn::testing::temp_path("attn_test_trainer_" + name);
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Files in `dir` whose name starts with `stem` (leftover temporaries of an atomic write).
std::vector<std::string> files_starting_with(const fs::path& dir, const std::string& stem) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(stem, 0) == 0) out.push_back(n);
  }
  return out;
}

void expect_same_parameters(SequenceModel& a, SequenceModel& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [name, t] : sa) {
    ASSERT_TRUE(sb.count(name)) << name;
    const Tensor& u = sb.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()), 0) << name << " differs";
  }
}

TEST(Trainer, LossFallsOnATinyTask) {
  Tiny tiny(GeneratedTask::kShift, 0.0);
  tiny.batch_size = 32;  // 8 sequences are too noisy a signal to converge in 150 steps
  Trainer t(tiny.options);
  const std::vector<double> losses = tiny.run(t, 150);
  const double first = std::accumulate(losses.begin(), losses.begin() + 10, 0.0) / 10;
  const double last = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
  EXPECT_LT(last, 0.2 * first) << "first 10 steps " << first << ", last 10 " << last;
  TaskOptions eval = tiny.task;
  eval.min_len = eval.max_len = 6;
  const EvalStats s = t.evaluate(make_batches(generate_task(eval, 64, 1, eval_stream(6)), 32));
  EXPECT_EQ(s.count, 64 * 5);  // position 0 has no target
  EXPECT_GT(s.accuracy, 0.9);  // chance is 1/3
}

TEST(Trainer, ClassificationHeadTrainsAndPredicts) {
  Tiny tiny(GeneratedTask::kSorted);
  Trainer t(tiny.options);
  const std::vector<double> losses = tiny.run(t, 5);
  for (double l : losses)
    EXPECT_TRUE(std::isfinite(l));
  const Batch b = tiny.batch(100);
  const Tensor pred = t.predict(b);
  EXPECT_EQ(pred.shape(), (Shape{tiny.batch_size}));
  for (double p : pred.to_vector())
    EXPECT_TRUE(p == 0 || p == 1);
  EXPECT_TRUE(t.model().classifier != nullptr);
  EXPECT_EQ(t.model().state_dict().count("head.dense.weight"), 1u);
}

TEST(Trainer, SameSeedSameLossesForOneAndTwoThreads) {
  Tiny tiny;
  Trainer one(tiny.options);
  tiny.options.threads = 2;
  Trainer two(tiny.options);
  const std::vector<double> a = tiny.run(one, 8), b = tiny.run(two, 8);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i], b[i]) << "step " << i + 1;  // bit for bit, not within a tolerance
  expect_same_parameters(one.model(), two.model());
  // A different seed is a different run.
  tiny.options.seed = 12;
  Trainer other(tiny.options);
  EXPECT_NE(tiny.run(other, 1)[0], a[0]);
}

TEST(Trainer, ResumeFromCheckpointIsBitIdentical) {
  Tiny tiny;  // dropout 0.1: the resumed run must also continue the dropout stream
  Trainer straight(tiny.options);
  const std::vector<double> expected = tiny.run(straight, 10);

  const fs::path path = temp_path("resume.safetensors");
  Trainer first(tiny.options);
  std::vector<double> got = tiny.run(first, 4);
  first.save_checkpoint(path.string(), {{"note", "half way"}});

  Trainer resumed(Trainer::checkpoint_options(path.string()));
  const auto extra = resumed.load_checkpoint(path.string());
  EXPECT_EQ(extra.at("note"), "half way");
  EXPECT_EQ(resumed.step(), 4);
  for (double l : tiny.run(resumed, 10))
    got.push_back(l);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i], expected[i]) << "step " << i + 1;
  expect_same_parameters(resumed.model(), straight.model());
  fs::remove(path);
}

TEST(Trainer, CheckpointHoldsModelOptimizerAndState) {
  Tiny tiny;
  Trainer t(tiny.options);
  tiny.run(t, 2);
  const fs::path path = temp_path("contents.safetensors");
  t.save_checkpoint(path.string());
  const SafetensorsFile f = load_safetensors(path.string());
  EXPECT_EQ(f.metadata.at("attn.step"), "2");
  EXPECT_EQ(f.metadata.at("attn.format"), "attn-checkpoint/1");
  EXPECT_TRUE(f.tensors.count("model.encoder.embedding.weight"));
  EXPECT_TRUE(f.tensors.count("model.encoder.blks.block0.ffn.dense1.weight"));  // lazy, yet saved
  EXPECT_TRUE(f.tensors.count("optimizer.encoder.embedding.weight.exp_avg_sq"));
  EXPECT_EQ(f.tensors.at("optimizer.head.dense.bias.step").to_vector(), std::vector<double>{2});
  EXPECT_EQ(train_options_from_json(to_json(tiny.options)).seed, tiny.options.seed);
  fs::remove(path);
}

TEST(Trainer, CheckpointWriteIsAtomic) {
  Tiny tiny;
  Trainer t(tiny.options);
  tiny.run(t, 1);
  const fs::path dir = temp_path("atomic");
  fs::remove_all(dir);
  fs::create_directories(dir);

  // A good checkpoint, then failing writes over it: the old file stays intact, no temporary is
  // left behind.
  const fs::path path = dir / "ck.safetensors";
  t.save_checkpoint(path.string());
  const std::string before = file_bytes(path);
  tiny.run(t, 2);
  EXPECT_THROW(t.save_checkpoint(path.string(), {{"attn.step", "99"}}), Error);  // reserved
  EXPECT_EQ(file_bytes(path), before);

  // The target is a directory: the temporary file is written, then the rename fails.
  const fs::path blocked = dir / "blocked.safetensors";
  fs::create_directories(blocked / "inside");
  EXPECT_THROW(t.save_checkpoint(blocked.string()), Error);
  EXPECT_TRUE(fs::is_directory(blocked));
  // No such directory: nothing is created.
  EXPECT_THROW(t.save_checkpoint((dir / "missing" / "ck.safetensors").string()), Error);
  EXPECT_FALSE(fs::exists(dir / "missing"));
  EXPECT_EQ(files_starting_with(dir, "ck.safetensors"), std::vector<std::string>{"ck.safetensors"});
  EXPECT_EQ(files_starting_with(dir, "blocked.safetensors"),
            std::vector<std::string>{"blocked.safetensors"});
  fs::remove_all(dir);
}

TEST(Trainer, RefusesACheckpointOfOtherOptionsAndChangesNothing) {
  Tiny tiny;
  Trainer t(tiny.options);
  tiny.run(t, 2);
  const fs::path path = temp_path("other.safetensors");
  t.save_checkpoint(path.string());

  Tiny other;
  other.options.adamw.lr = 5e-3;
  Trainer u(other.options);
  const nn::StateDict before = u.model().state_dict();
  try {
    u.load_checkpoint(path.string());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("load_checkpoint"), std::string::npos) << m;
    EXPECT_NE(m.find("/adamw/lr"), std::string::npos) << m;
  }
  EXPECT_EQ(u.step(), 0);
  EXPECT_EQ(u.model().state_dict().at("head.dense.weight").to_vector(),
            before.at("head.dense.weight").to_vector());

  // Not a checkpoint at all: a plain safetensors file without the trainer's metadata.
  const fs::path plain = temp_path("plain.safetensors");
  save_safetensors(plain.string(), {{"x", Tensor::zeros({1})}});
  EXPECT_THROW(u.load_checkpoint(plain.string()), Error);
  fs::remove(path);
  fs::remove(plain);
}

// The backward hook data-parallel training reduces gradients at: stages 0 (head), 1..n (blocks,
// last first), n + 1 (embeddings) are reported in order, each once; when stage s is reported,
// the gradients of its parameters are final (the full backward does not change them after).
TEST(Trainer, BackwardStagesReportFinalGradientsInOrder) {
  Tiny tiny(GeneratedTask::kShift, 0.0);
  tiny.options.model.num_blks = 3;
  Trainer t(tiny.options);
  SequenceModel& m = t.model();
  const auto params = m.named_parameters();
  std::vector<int> per_stage(static_cast<size_t>(m.num_stages()), 0);
  for (const auto& [name, p] : params) {
    const int64_t s = m.stage_of(name);
    ASSERT_GE(s, 0) << name;
    ASSERT_LT(s, m.num_stages()) << name;
    ++per_stage[static_cast<size_t>(s)];
  }
  for (int n : per_stage)
    EXPECT_GT(n, 0);  // no empty bucket
  EXPECT_EQ(m.stage_of("head.dense.weight"), 0);
  EXPECT_EQ(m.stage_of("encoder.blks.block2.ffn.dense1.weight"), 1);
  EXPECT_EQ(m.stage_of("encoder.blks.block0.attention.W_q.weight"), 3);
  EXPECT_EQ(m.stage_of("encoder.embedding.weight"), 4);

  const Batch b = tiny.batch(0);
  m.train();
  for (auto& [name, p] : params)
    p->grad.fill(0.0);
  Tensor logits = m.forward(t.context(), b.ids, b.valid_lens);
  CrossEntropyOptions ce;
  const Tensor dlogits = softmax_cross_entropy_backward(t.context(), logits, b.targets, ce);
  std::vector<int64_t> order;
  std::map<std::string, std::vector<double>> at_report;
  m.backward(t.context(), dlogits, [&](int64_t stage) {
    order.push_back(stage);
    for (const auto& [name, p] : params)
      if (m.stage_of(name) == stage) at_report[name] = p->grad.to_vector();
  });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  for (const auto& [name, p] : params)
    EXPECT_EQ(p->grad.to_vector(), at_report.at(name)) << name << " changed after its stage";
}

}  // namespace
}  // namespace attn::model
