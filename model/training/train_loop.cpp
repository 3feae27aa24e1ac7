// The evaluation history and the step loop of a training run (see train_loop.hpp).
#include "model/training/train_loop.hpp"

#include "attn/core/error.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cmath>

namespace attn::model {

using nlohmann::json;

double TrainHistory::last(const std::string& key) const {
  for (size_t i = 0; i < columns_.size(); ++i)
    if (columns_[i].key == key) return rows_.back().scores[i];
  throw Error("train", fmt::format("no score column '{}' in the history", key));
}

json TrainHistory::to_json() const {
  json out = json::array();
  for (const Row& r : rows_) {
    json row = {{"step", r.step},
                {"train_loss", r.train_loss},
                {"eval_loss", r.eval_loss},
                {"tokens_per_second", r.tokens_per_second},
                {"seconds", r.seconds}};
    for (size_t i = 0; i < columns_.size(); ++i)
      row[columns_[i].key] = r.scores[i];
    out.push_back(std::move(row));
  }
  return out;
}

void TrainHistory::load(const std::string& text, const std::string& where) {
  try {
    std::vector<Row> rows;
    for (const json& j : json::parse(text)) {
      Row r{j.at("step"), j.at("train_loss"),        j.at("eval_loss"),
            {},           j.at("tokens_per_second"), j.at("seconds")};
      for (const ScoreColumn& c : columns_)
        r.scores.push_back(j.at(c.key));
      rows.push_back(std::move(r));
    }
    rows_ = std::move(rows);
  } catch (const std::exception& e) {
    throw Error("train", fmt::format("{}: malformed train.history metadata: {}", where, e.what()));
  }
}

std::string TrainHistory::csv() const {
  std::string out = "step,train_loss,eval_loss";
  for (const ScoreColumn& c : columns_)
    out += "," + c.key;
  out += ",tokens_per_second,seconds\n";
  for (const Row& r : rows_) {
    out += fmt::format("{},{:.6g},{:.6g}", r.step, r.train_loss, r.eval_loss);
    for (double s : r.scores)
      out += fmt::format(",{:.6g}", s);
    out += fmt::format(",{:.1f},{:.3f}\n", r.tokens_per_second, r.seconds);
  }
  return out;
}

std::string TrainHistory::scores_text(const Row& r, const char* separator) const {
  std::string out;
  for (size_t i = 0; i < columns_.size(); ++i)
    out += fmt::format("{}{} {:.4f}", i ? separator : "", columns_[i].text, r.scores[i]);
  return out;
}

std::string format_rate(double r) {
  return r >= 1e6   ? fmt::format("{:.1f}M", r / 1e6)
         : r >= 1e3 ? fmt::format("{:.1f}k", r / 1e3)
                    : fmt::format("{:.0f}", r);
}

LoopResult run_train_loop(TrainHistory& history, const LoopProgress& progress,
                          const LoopSchedule& schedule, int64_t current_step,
                          const std::function<LoopStep()>& step,
                          const std::function<LoopEval()>& eval,
                          const std::function<void()>& save) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t first_step = current_step;
  const double seconds_before = history.empty() ? 0.0 : history.back().seconds;
  int64_t tokens = 0, loss_count = 0;
  double loss_sum = 0, last_loss = std::nan("");
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto evaluate = [&] {
    LoopEval e = eval();
    const double t = elapsed();
    history.push_back({current_step,
                       loss_count ? loss_sum / static_cast<double>(loss_count) : std::nan(""),
                       e.loss, std::move(e.scores), t > 0 ? static_cast<double>(tokens) / t : 0.0,
                       seconds_before + t});
    loss_sum = 0;
    loss_count = 0;
    const TrainHistory::Row& r = history.back();
    if (progress.line)
      progress.line(fmt::format("step {:>6}  train loss {:.4f}  eval loss {:.4f}  {}  {} tok/s",
                                r.step, r.train_loss, r.eval_loss, history.scores_text(r, "  "),
                                format_rate(r.tokens_per_second)));
  };

  while (current_step < schedule.steps) {
    const LoopStep st = step();
    current_step = st.step;
    tokens += st.tokens;
    loss_sum += st.loss;
    ++loss_count;
    last_loss = st.loss;
    const double t = elapsed();
    const double per_step = t / static_cast<double>(st.step - first_step);
    if (progress.step)
      progress.step(st.step, st.loss, static_cast<double>(tokens) / t,
                    per_step * static_cast<double>(schedule.steps - st.step));
    if ((schedule.eval_every > 0 && st.step % schedule.eval_every == 0) ||
        st.step == schedule.steps)
      evaluate();
    if (schedule.checkpoint_every > 0 && st.step % schedule.checkpoint_every == 0 &&
        st.step != schedule.steps)
      save();
  }
  if (history.empty() || history.back().step != current_step) evaluate();
  return {last_loss, elapsed()};
}

void resume_history(TrainHistory& history, const std::map<std::string, std::string>& extra,
                    const std::string& path, int64_t step, int64_t steps) {
  const auto it = extra.find("train.history");
  history.load(it != extra.end() ? it->second : std::string(), path);
  check(step <= steps, "train", "{} is at step {}, beyond --steps {}", path, step, steps);
}

std::string metrics_text(const TrainHistory& history, const std::string& path, const json& args,
                         const std::string& options_json) {
  if (path.ends_with(".csv")) return history.csv();
  return json({{"args", args},
               {"options", json::parse(options_json)},
               {"history", history.to_json()}})
             .dump(1) +
         "\n";
}

std::string run_summary(const TrainHistory& history, const LoopResult& run,
                        const std::string& checkpoint) {
  const TrainHistory::Row& r = history.back();
  return fmt::format("step {}: train loss {:.4f}, eval loss {:.4f}, {} ({:.1f} s{})\n", r.step,
                     std::isnan(run.last_loss) ? r.train_loss : run.last_loss, r.eval_loss,
                     history.scores_text(r, ", "), run.seconds,
                     checkpoint.empty() ? "" : ", checkpoint " + checkpoint);
}

}  // namespace attn::model
