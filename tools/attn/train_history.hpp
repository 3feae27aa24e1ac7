// What `attn train` adds to the library's training loop (model/training/train_loop.hpp) for the
// encoder tasks (cmd_train.cpp) and the encoder-decoder tasks (cmd_train_seq2seq.cpp) alike: the
// live progress bar on stderr, the --curve SVG and the files a finished run writes. The loop's
// names are the CLI's too.
#pragma once

#include "model/training/train_loop.hpp"
#include "tools/attn/train_progress.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>

namespace attn::cli {

using model::LoopEval;
using model::LoopResult;
using model::LoopSchedule;
using model::LoopStep;
using model::resume_history;
using model::run_summary;
using model::ScoreColumn;
using model::TrainHistory;

// The library's loop, reporting on `progress` (the bar after each step, a line per evaluation).
LoopResult run_train_loop(TrainHistory& history, Progress& progress, const LoopSchedule& schedule,
                          int64_t current_step, const std::function<LoopStep()>& step,
                          const std::function<LoopEval()>& eval, const std::function<void()>& save);

// The learning curve: train and eval loss and every score over the steps.
std::string curve_svg(const TrainHistory& history, const std::string& title);

// What a finished run writes after its final checkpoint, each file atomically: --metrics as CSV,
// or as JSON {"args", "options", "history"}; --curve as an SVG titled curve_title.
struct RunOutputs {
  std::string metrics, curve;  // paths ("": not asked for)
  nlohmann::json args;         // the run's result arguments, as its checkpoints store them
  std::string options_json;    // the trainer's options (model::to_json)
  std::string curve_title;
};
void write_run_outputs(const TrainHistory& history, const RunOutputs& outputs);

}  // namespace attn::cli
