// The positional-encoding experiment (see attn/model/experiment.hpp).
#include "attn/model/experiment.hpp"

#include "attn/core/error.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

namespace attn::model {

std::vector<nn::PositionalKind> available_positional_kinds() {
  std::vector<nn::PositionalKind> out;
  for (auto kind :
       {nn::PositionalKind::kNone, nn::PositionalKind::kSinusoidal, nn::PositionalKind::kLearned,
        nn::PositionalKind::kRotary, nn::PositionalKind::kAlibi}) {
    nn::TransformerEncoderOptions o;
    o.positional = kind;
    o.max_len = 4;
    try {
      nn::TransformerEncoder probe(4, 4, 4, 2, 1, 0.0, false, o);
      out.push_back(kind);
    } catch (const Error&) {
      // Not implemented in this build of the encoder: the experiment shows what exists.
    }
  }
  return out;
}

TrainOptions positional_run_options(const PositionalExperimentOptions& o, GeneratedTask task,
                                    nn::PositionalKind kind, uint64_t seed) {
  TaskOptions t;
  t.task = task;
  t.num_symbols = o.num_symbols;
  TrainOptions r;
  r.model.type = task_type(task);
  r.model.vocab_size = task_vocab_size(t);
  r.model.num_classes = task_num_classes(t);
  r.model.num_hiddens = o.num_hiddens;
  r.model.ffn_num_hiddens = o.ffn_num_hiddens;
  r.model.num_heads = o.num_heads;
  r.model.num_blks = o.num_blks;
  r.model.dropout = 0.0;  // the tasks are noise-free; dropout only slows the comparison down
  r.model.positional = kind;
  // A learned table must cover the longest evaluation length (its rows past train_len are never
  // trained: that is the point of the length test).
  const int64_t longest = *std::max_element(o.length_factors.begin(), o.length_factors.end());
  r.model.max_len = o.train_len * longest;
  r.adamw.lr = o.lr;
  r.precision = o.precision;
  r.seed = seed;
  r.threads = 1;
  return r;
}

namespace {

PositionalRun run_one(const PositionalExperimentOptions& o, GeneratedTask task,
                      nn::PositionalKind kind, uint64_t seed) {
  const auto start = std::chrono::steady_clock::now();
  TaskOptions t;
  t.task = task;
  t.num_symbols = o.num_symbols;
  t.min_len = std::max<int64_t>(2, o.train_len / 2);
  t.max_len = o.train_len;
  Trainer trainer(positional_run_options(o, task, kind, seed));
  std::vector<int64_t> idx(static_cast<size_t>(o.batch_size));
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t tail = std::max<int64_t>(1, o.steps / 10);
  double tail_loss = 0;
  for (int64_t s = 0; s < o.steps; ++s) {
    const StepStats st = trainer.train_step(
        make_batch(generate_task(t, o.batch_size, seed, static_cast<uint64_t>(s)), idx));
    if (s >= o.steps - tail) tail_loss += st.loss;
  }
  PositionalRun r;
  r.task = task;
  r.positional = kind;
  r.seed = seed;
  r.final_loss = tail_loss / static_cast<double>(tail);
  for (int64_t f : o.length_factors) {
    TaskOptions e = t;
    e.min_len = e.max_len = o.train_len * f;
    // The evaluation set depends on the length only, not on the run's seed: every variant and
    // seed is scored on the same sequences.
    const Dataset d = generate_task(e, o.eval_examples, 0, eval_stream(e.max_len));
    r.lengths.push_back(e.max_len);
    r.accuracy.push_back(trainer.evaluate(make_batches(d, 64)).accuracy);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace

std::vector<PositionalRun> run_positional_experiment(
    const PositionalExperimentOptions& o,
    const std::function<void(const PositionalRun&, int64_t, int64_t)>& on_done) {
  const char* op = "experiment positional";
  check(!o.tasks.empty(), op, "no task given");
  check(o.seeds >= 1 && o.steps >= 1 && o.batch_size >= 1, op,
        "seeds ({}), steps ({}) and batch_size ({}) must be >= 1", o.seeds, o.steps, o.batch_size);
  check(o.train_len >= 2, op, "train_len must be >= 2, got {}", o.train_len);
  check(!o.length_factors.empty(), op, "no evaluation length given");
  for (int64_t f : o.length_factors)
    check(f >= 1, op, "length factors must be >= 1, got {}", f);
  check(o.eval_examples >= 1 && o.jobs >= 1, op, "eval_examples ({}) and jobs ({}) must be >= 1",
        o.eval_examples, o.jobs);
  const std::vector<nn::PositionalKind> variants =
      o.variants.empty() ? available_positional_kinds() : o.variants;

  struct Job {
    GeneratedTask task;
    nn::PositionalKind kind;
    uint64_t seed;
  };
  std::vector<Job> jobs;
  for (GeneratedTask task : o.tasks)
    for (nn::PositionalKind kind : variants)
      for (int64_t s = 0; s < o.seeds; ++s)
        jobs.push_back({task, kind, static_cast<uint64_t>(s)});

  // Independent runs on `jobs` threads: each owns its Trainer and Context (threads = 1), so
  // nothing is shared but the job counter and the callback's mutex.
  std::vector<PositionalRun> results(jobs.size());
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    for (size_t i = next++; i < jobs.size(); i = next++) {
      try {
        results[i] = run_one(o, jobs[i].task, jobs[i].kind, jobs[i].seed);
        std::lock_guard<std::mutex> lock(mutex);
        const int64_t n = ++done;
        if (on_done) on_done(results[i], n, static_cast<int64_t>(jobs.size()));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = std::current_exception();
        next = jobs.size();  // stop handing out work
      }
    }
  };
  const size_t n_threads = std::min<size_t>(static_cast<size_t>(o.jobs), jobs.size());
  std::vector<std::thread> threads;
  for (size_t k = 1; k < n_threads; ++k)
    threads.emplace_back(worker);
  worker();
  for (auto& t : threads)
    t.join();
  if (failure) std::rethrow_exception(failure);
  return results;
}

}  // namespace attn::model
