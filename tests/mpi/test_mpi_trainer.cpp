// Data-parallel training under `mpirun -np N`: N ranks, each computing its shard of every global
// batch, train the model one process trains at the same global batch (losses within 1e-5
// relative after 20 steps, also when B is not a multiple of N, and with dropout); rank 0 writes the
// checkpoint, every rank resumes from it; differing options or batches across ranks are reported on
// every rank. Each rank also trains the 1-rank reference itself (a single-process communicator).
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "attn/model/tasks.hpp"
#include "attn/model/trainer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>

#include <unistd.h>

namespace attn::model {
namespace {

std::shared_ptr<Communicator> world() {
  static std::shared_ptr<Communicator> w = world_communicator();
  return w;
}

// A small tagging setup (shift, 4 symbols, lengths 4..8, 2 blocks): milliseconds per step.
struct TinyRun {
  TaskOptions task;
  TrainOptions options;
  int64_t batch_size = 8;

  explicit TinyRun(GeneratedTask kind = GeneratedTask::kShift) {
    task.task = kind;
    task.num_symbols = 4;
    task.min_len = 4;
    task.max_len = 8;
    options.model.type = task_type(kind);
    options.model.vocab_size = task_vocab_size(task);
    options.model.num_classes = task_num_classes(task);
    options.model.num_hiddens = 16;
    options.model.ffn_num_hiddens = 32;
    options.model.num_heads = 2;
    options.model.num_blks = 2;
    options.model.positional = nn::PositionalKind::kLearned;
    options.model.max_len = 8;
    options.adamw.lr = 1e-2;
    options.seed = 5;
    options.threads = 1;
  }
  Batch batch(int64_t step) const {
    std::vector<int64_t> idx(static_cast<size_t>(batch_size));
    std::iota(idx.begin(), idx.end(), 0);
    return make_batch(generate_task(task, batch_size, options.seed, static_cast<uint64_t>(step)),
                      idx);
  }
  std::vector<double> run(Trainer& t, int64_t stop) const {
    std::vector<double> losses;
    while (t.step() < stop)
      losses.push_back(t.train_step(batch(t.step())).loss);
    return losses;
  }
};

void expect_close_losses(const std::vector<double>& parallel, const std::vector<double>& single) {
  ASSERT_EQ(parallel.size(), single.size());
  for (size_t i = 0; i < single.size(); ++i)
    EXPECT_NEAR(parallel[i], single[i], 1e-5 * std::abs(single[i]))
        << "step " << i + 1 << " on rank " << world()->rank() << " of " << world()->size();
}

void expect_close_parameters(Trainer& a, Trainer& b, double rtol) {
  const auto sa = a.model().state_dict(), sb = b.model().state_dict();
  for (const auto& [name, t] : sa) {
    std::string detail;
    EXPECT_TRUE(allclose(t, sb.at(name), rtol, 1e-6, &detail)) << name << ": " << detail;
  }
}

void check_equivalence(TinyRun s, int64_t steps) {
  Trainer parallel(s.options, world());
  Trainer single(s.options);
  const auto p = s.run(parallel, steps), q = s.run(single, steps);
  expect_close_losses(p, q);
  expect_close_parameters(parallel, single, 1e-4);
  // Evaluation is sharded over the ranks and reduced: the same figures as one process.
  std::vector<Batch> eval = {s.batch(1000), s.batch(1001), s.batch(1002)};
  const EvalStats ep = parallel.evaluate(eval), es = single.evaluate(eval);
  EXPECT_EQ(ep.count, es.count);
  EXPECT_NEAR(ep.loss, es.loss, 1e-5 * es.loss);
}

TEST(DataParallel, SameLossesAsOneRankTagging) {
  check_equivalence(TinyRun(), 20);
}

TEST(DataParallel, SameLossesAsOneRankClassification) {
  check_equivalence(TinyRun(GeneratedTask::kSorted), 20);
}

// Dropout in every site of the encoder (embedding, attention weights, both AddNorms): the masks
// follow the global sample (Context::dropout_first_sample), so N ranks still train the 1-rank
// model.
TEST(DataParallel, SameLossesAsOneRankWithDropout) {
  TinyRun s;
  s.options.model.dropout = 0.1;
  check_equivalence(s, 20);
}

TEST(DataParallel, SameLossesAsOneRankWithDropoutUnevenShards) {
  TinyRun s(GeneratedTask::kSorted);
  s.options.model.dropout = 0.2;
  s.batch_size = 2 * world()->size() + 1;
  check_equivalence(s, 20);
}

TEST(DataParallel, UnevenShards) {
  TinyRun s;
  s.batch_size = 2 * world()->size() + 1;  // shards differ by one sequence
  check_equivalence(s, 20);
}

TEST(DataParallel, Rank0WritesTheCheckpointEveryRankResumes) {
  TinyRun s;
  // One path for all ranks: rank 0's choice, broadcast.
  std::string path = (std::filesystem::temp_directory_path() /
                      ("attn_test_mpi_" + std::to_string(::getpid()) + ".safetensors"))
                         .string();
  int64_t length = static_cast<int64_t>(path.size());
  world()->broadcast(&length, sizeof length, 0);
  path.resize(static_cast<size_t>(length));
  world()->broadcast(path.data(), length, 0);

  Trainer straight(s.options, world());
  const auto all = s.run(straight, 20);
  Trainer first(s.options, world());
  s.run(first, 10);
  first.save_checkpoint(path, {{"note", "mpi"}});
  EXPECT_TRUE(std::filesystem::exists(path));  // every rank sees it once save returns
  Trainer resumed(s.options, world());
  EXPECT_EQ(resumed.load_checkpoint(path).at("note"), "mpi");
  EXPECT_EQ(resumed.step(), 10);
  const auto rest = s.run(resumed, 20);
  for (size_t i = 0; i < rest.size(); ++i)
    EXPECT_EQ(rest[i], all[10 + i]) << "step " << 11 + i;  // the same reductions: the same bits

  // A file that only rank 0 finds: every rank throws (rank 0 too), none waits forever.
  const std::string where = world()->rank() == 0 ? path : path + ".missing";
  try {
    resumed.load_checkpoint(where);
    ADD_FAILURE() << "rank " << world()->rank() << ": the failed load was not reported";
  } catch (const Error& e) {
    if (world()->rank() == 0) {
      EXPECT_NE(std::string(e.what()).find("failed on"), std::string::npos) << e.what();
    }
  }
  world()->barrier();
  if (world()->rank() == 0) std::filesystem::remove(path);
}

TEST(DataParallel, MismatchesAcrossRanksAreReported) {
  TinyRun s;
  // Different model widths on rank 1: the constructor throws on every rank.
  TinyRun other = s;
  if (world()->rank() == 1) other.options.model.ffn_num_hiddens = 48;
  EXPECT_THROW(Trainer(other.options, world()), Error);
  // A different batch (another step's) on rank 1: train_step throws on every rank.
  Trainer t(s.options, world());
  TinyRun wider = s;
  if (world()->rank() == 1) wider.batch_size += 1;
  const Batch b = wider.batch(0);
  try {
    t.train_step(b);
    ADD_FAILURE() << "rank " << world()->rank() << ": differing batches not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs across ranks"), std::string::npos) << e.what();
  }
  // Fewer sequences than ranks.
  s.batch_size = world()->size() - 1;
  Trainer small(s.options, world());
  EXPECT_THROW(small.train_step(s.batch(0)), Error);
}

}  // namespace
}  // namespace attn::model
