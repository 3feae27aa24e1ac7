// The progress bar, learning curve and output files of `attn train` (see train_history.hpp).
#include "tools/attn/train_history.hpp"

#include "viz/chart.hpp"
#include "viz/io.hpp"

namespace attn::cli {

LoopResult run_train_loop(TrainHistory& history, Progress& progress, const LoopSchedule& schedule,
                          int64_t current_step, const std::function<LoopStep()>& step,
                          const std::function<LoopEval()>& eval,
                          const std::function<void()>& save) {
  const model::LoopProgress report{
      [&](int64_t s, double loss, double rate, double eta) { progress.update(s, loss, rate, eta); },
      [&](const std::string& line) { progress.line(line); }};
  return model::run_train_loop(history, report, schedule, current_step, step, eval, save);
}

std::string curve_svg(const TrainHistory& history, const std::string& title) {
  std::vector<viz::Series> series{{"train loss", {}, {}, "", "", false},
                                  {"eval loss", {}, {}, "", "", false}};
  for (const ScoreColumn& c : history.columns())
    series.push_back({c.curve, {}, {}, "", "", true});
  for (const TrainHistory::Row& r : history.rows()) {
    const double x = static_cast<double>(r.step);
    for (auto& s : series)
      s.x.push_back(x);
    series[0].y.push_back(r.train_loss);
    series[1].y.push_back(r.eval_loss);
    for (size_t i = 0; i < r.scores.size(); ++i)
      series[i + 2].y.push_back(r.scores[i]);
  }
  viz::LineChartOptions o;
  o.title = title;
  o.xlabel = "step";
  o.ylabel = history.curve_ylabel();
  o.ymin = 0.0;
  o.height = 300;
  return viz::line_chart_svg(series, o);
}

void write_run_outputs(const TrainHistory& history, const RunOutputs& outputs) {
  if (!outputs.metrics.empty())
    viz::write_file_atomic(
        outputs.metrics,
        model::metrics_text(history, outputs.metrics, outputs.args, outputs.options_json));
  if (!outputs.curve.empty())
    viz::write_file_atomic(outputs.curve, curve_svg(history, outputs.curve_title));
}

}  // namespace attn::cli
