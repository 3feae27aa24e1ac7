// The positional-encoding experiment: the same small encoder trained on the generated order
// tasks with each positional signal (none, sinusoidal, learned, and rotary / ALiBi where the
// encoder offers them), several seeds each, then evaluated on sequences of the training length
// and of 2x and 4x that length.
//
// Every run is a pure function of its (task, variant, seed): batch s is generate_task(..., seed,
// s) and the evaluation sets use eval_stream(length), so the numbers do not depend on how many
// runs go in parallel (jobs) or on threads.
#pragma once

#include "attn/model/tasks.hpp"
#include "attn/model/trainer.hpp"

#include <functional>
#include <vector>

namespace attn::model {

struct PositionalExperimentOptions {
  std::vector<GeneratedTask> tasks = {GeneratedTask::kShift};
  std::vector<nn::PositionalKind> variants;  // empty: available_positional_kinds()
  int64_t seeds = 2;
  int64_t steps = 1200;
  int64_t batch_size = 32;
  int64_t train_len = 16;  // training lengths are uniform in [train_len / 2, train_len]
  int64_t num_symbols = 8;
  std::vector<int64_t> length_factors = {1, 2, 4};  // evaluation at train_len * factor
  int64_t eval_examples = 256;
  int64_t num_hiddens = 32, ffn_num_hiddens = 64, num_heads = 2, num_blks = 2;
  double lr = 3e-3;
  // fp32, or bf16 mixed precision (TrainOptions::precision): the same runs, to compare the
  // accuracies within their seed-to-seed spread.
  Precision precision = Precision::kFloat32;
  int jobs = 1;  // runs trained at the same time, each on its own thread; results do not depend
                 // on it
};

struct PositionalRun {
  GeneratedTask task = GeneratedTask::kShift;
  nn::PositionalKind positional = nn::PositionalKind::kNone;
  uint64_t seed = 0;
  std::vector<int64_t> lengths;  // evaluation lengths
  std::vector<double> accuracy;  // one per length
  double final_loss = 0;         // mean training loss of the last 10% of the steps
  double seconds = 0;            // wall time of the run
};

// The positional kinds the encoder can be built with now (kinds not implemented yet are left
// out rather than failing the experiment).
std::vector<nn::PositionalKind> available_positional_kinds();

// The training options of one run (exposed so `attn train` and the docs can repeat a run).
TrainOptions positional_run_options(const PositionalExperimentOptions& o, GeneratedTask task,
                                    nn::PositionalKind kind, uint64_t seed);

// Runs every (task, variant, seed), `jobs` at a time; `on_done` (optional) is called after each
// run, from the thread that finished it, serialised by a mutex. Results are in (task, variant,
// seed) order whatever the completion order.
std::vector<PositionalRun> run_positional_experiment(
    const PositionalExperimentOptions& o,
    const std::function<void(const PositionalRun&, int64_t done, int64_t total)>& on_done = {});

}  // namespace attn::model
