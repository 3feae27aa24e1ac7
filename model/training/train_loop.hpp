// The training loop around a trainer (internal to the library; used by `attn train` for the
// encoder tasks and the encoder-decoder tasks alike, and open to the Python module): the
// evaluation history (one row per evaluation, kept in the checkpoint's "train.history" so a
// resumed run continues it, written as CSV or JSON), and the step loop with evaluation every
// `eval_every` steps and at the end, checkpoints every `checkpoint_every`, and progress reports.
//
// The two kinds of run differ only in their evaluation scores: eval_accuracy for the encoder
// tasks; bleu and exact_match for the n -> m tasks. Drawing the history (an SVG learning curve)
// and the live progress bar belong to the caller (tools/attn/train_history.hpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace attn::model {

// One evaluation score: its key in the metrics files, its name in the progress lines and the
// final summary, and its series name on the learning curve.
struct ScoreColumn {
  std::string key, text, curve;
};

class TrainHistory {
 public:
  struct Row {
    int64_t step = 0;
    double train_loss = 0, eval_loss = 0;  // train loss: the mean since the previous row
    std::vector<double> scores;            // one per ScoreColumn
    double tokens_per_second = 0, seconds = 0;
  };

  // curve_ylabel: what the scores and losses share as a y axis ("loss / accuracy").
  TrainHistory(std::vector<ScoreColumn> columns, std::string curve_ylabel)
      : columns_(std::move(columns)), curve_ylabel_(std::move(curve_ylabel)) {}

  const std::vector<ScoreColumn>& columns() const { return columns_; }
  const std::string& curve_ylabel() const { return curve_ylabel_; }
  const std::vector<Row>& rows() const { return rows_; }
  bool empty() const { return rows_.empty(); }
  const Row& back() const { return rows_.back(); }
  void push_back(Row r) { rows_.push_back(std::move(r)); }
  // The score `key` of the last row.
  double last(const std::string& key) const;

  nlohmann::json to_json() const;
  // Replaces the rows with a checkpoint's "train.history"; an attn::Error naming `where` if the
  // text is not one this class wrote.
  void load(const std::string& text, const std::string& where);
  std::string csv() const;
  // "eval accuracy 0.9531" or "BLEU 0.9950  exact match 0.9840" (separator between scores).
  std::string scores_text(const Row& r, const char* separator) const;

 private:
  std::vector<ScoreColumn> columns_;
  std::string curve_ylabel_;
  std::vector<Row> rows_;
};

// The step loop shared by both trainers. `step` runs one training step and returns it; `eval`
// evaluates the model as it is now (loss and one value per score column); `save` writes the
// periodic checkpoint. Appends a history row at every evaluation and reports it as one line.
struct LoopStep {
  int64_t step = 0, tokens = 0;
  double loss = 0;
};
struct LoopEval {
  double loss = 0;
  std::vector<double> scores;
};
struct LoopSchedule {
  int64_t steps = 0, eval_every = 0, checkpoint_every = 0;
};
struct LoopResult {
  double last_loss;  // loss of the last step run here (NaN when none ran: a finished run resumed)
  double seconds;    // wall time of this invocation's loop
};
// What the loop reports as it runs; either may be empty.
struct LoopProgress {
  // After every step: its number, loss, the tokens/s so far and the seconds left (estimated).
  std::function<void(int64_t step, double loss, double tokens_per_second, double eta_seconds)> step;
  // At every evaluation: "step N  train loss L  eval loss L  <scores>  R tok/s".
  std::function<void(const std::string& line)> line;
};

LoopResult run_train_loop(TrainHistory& history, const LoopProgress& progress,
                          const LoopSchedule& schedule, int64_t current_step,
                          const std::function<LoopStep()>& step,
                          const std::function<LoopEval()>& eval, const std::function<void()>& save);

// "12.3k", "1.2M", "950": a rate for progress lines.
std::string format_rate(double per_second);

// A resumed run: the checkpoint's "train.history" (in `extra`, what the trainer's load_checkpoint
// returned) into `history`; Error("train") when the checkpoint `path` is at `step`, beyond --steps.
void resume_history(TrainHistory& history, const std::map<std::string, std::string>& extra,
                    const std::string& path, int64_t step, int64_t steps);

// The metrics file: CSV when `path` ends in .csv, else JSON {"args", "options", "history"}.
std::string metrics_text(const TrainHistory& history, const std::string& path,
                         const nlohmann::json& args, const std::string& options_json);

// The run's last line: "step N: train loss L, eval loss L, <scores> (S s[, checkpoint
// PATH])\n"; the train loss is the last step's, or the history's when no step ran here.
std::string run_summary(const TrainHistory& history, const LoopResult& run,
                        const std::string& checkpoint);

}  // namespace attn::model
