// The training loop of model/training/train_loop.hpp without a model: when it evaluates and saves,
// what the history records and how it survives a checkpoint, and the metrics files.
#include "model/training/train_loop.hpp"

#include "attn/core/error.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace attn::model {
namespace {

// A run of `steps` steps whose loss is 1/step, 10 tokens each, resumed at `start`; records which
// steps were evaluated and saved, and the progress reports.
struct FakeRun {
  std::vector<int64_t> evaluated, saved, reported;
  std::vector<std::string> lines;
  int64_t at = 0;

  LoopResult run(TrainHistory& h, LoopSchedule schedule, int64_t start) {
    at = start;
    const LoopProgress progress{[&](int64_t s, double, double, double) { reported.push_back(s); },
                                [&](const std::string& line) { lines.push_back(line); }};
    return run_train_loop(
        h, progress, schedule, start,
        [&] {
          ++at;
          return LoopStep{at, 10, 1.0 / static_cast<double>(at)};
        },
        [&] {
          evaluated.push_back(at);
          return LoopEval{0.5, {static_cast<double>(at) / 100.0}};
        },
        [&] { saved.push_back(at); });
  }
};

TrainHistory history() {
  return TrainHistory({{"eval_accuracy", "eval accuracy", "eval accuracy"}}, "loss / accuracy");
}

TEST(TrainLoop, EvaluatesEveryNAndAtTheEndSavesBetween) {
  TrainHistory h = history();
  FakeRun r;
  const LoopResult res = r.run(h, {10, 4, 3}, 0);
  EXPECT_EQ(r.evaluated, (std::vector<int64_t>{4, 8, 10}));
  EXPECT_EQ(r.saved, (std::vector<int64_t>{3, 6, 9}));  // not at the last step: the caller saves
  EXPECT_EQ(r.reported.size(), 10u);
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_NE(r.lines[0].find("eval accuracy 0.0400"), std::string::npos) << r.lines[0];
  ASSERT_EQ(h.rows().size(), 3u);
  // The train loss of a row is the mean since the previous row: steps 5..8.
  EXPECT_DOUBLE_EQ(h.rows()[1].train_loss, (1.0 / 5 + 1.0 / 6 + 1.0 / 7 + 1.0 / 8) / 4);
  EXPECT_DOUBLE_EQ(h.last("eval_accuracy"), 0.10);
  EXPECT_DOUBLE_EQ(res.last_loss, 0.1);
  EXPECT_THROW(h.last("bleu"), Error);
}

TEST(TrainLoop, ResumedHistoryContinuesAndAFinishedRunOnlyEvaluates) {
  TrainHistory first = history();
  FakeRun a;
  a.run(first, {6, 3, 0}, 0);
  TrainHistory resumed = history();
  resume_history(resumed, {{"train.history", first.to_json().dump()}}, "ck.safetensors", 6, 9);
  ASSERT_EQ(resumed.rows().size(), 2u);
  FakeRun b;
  b.run(resumed, {9, 3, 0}, 6);
  EXPECT_EQ(b.evaluated, (std::vector<int64_t>{9}));
  EXPECT_EQ(resumed.rows().size(), 3u);
  EXPECT_GE(resumed.back().seconds, first.back().seconds);  // time continues across the resume

  // Resumed at the end: no step runs, the loop evaluates once if the last row is not there yet.
  FakeRun c;
  const LoopResult done = c.run(resumed, {9, 3, 0}, 9);
  EXPECT_TRUE(c.evaluated.empty());
  EXPECT_TRUE(std::isnan(done.last_loss));
  EXPECT_NE(run_summary(resumed, done, "").find("step 9: train loss"), std::string::npos);

  EXPECT_THROW(resume_history(resumed, {{"train.history", first.to_json().dump()}}, "ck", 10, 9),
               Error);  // the checkpoint is beyond --steps
  EXPECT_THROW(resume_history(resumed, {{"train.history", "[{\"step\": 1}]"}}, "ck", 1, 9), Error);
}

TEST(TrainLoop, MetricsAsCsvOrJson) {
  TrainHistory h = history();
  FakeRun r;
  r.run(h, {4, 2, 0}, 0);
  const std::string csv = metrics_text(h, "m.csv", {}, "{}");
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "step,train_loss,eval_loss,eval_accuracy,tokens_per_second,seconds");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 3);
  const auto json = nlohmann::json::parse(metrics_text(h, "m.json", {{"steps", 4}}, "{\"lr\": 1}"));
  EXPECT_EQ(json["args"]["steps"], 4);
  EXPECT_EQ(json["options"]["lr"], 1);
  EXPECT_EQ(json["history"].size(), 2u);
  EXPECT_EQ(format_rate(950), "950");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(2.5e6), "2.5M");
}

}  // namespace
}  // namespace attn::model
