// attn experiment positional: does the encoder need positional encoding? The same small encoder
// is trained on the generated order tasks with each positional signal the library offers, for
// several seeds, then scored on sequences of the training length and of 2x and 4x that length.
// Writes DIR/positional.csv (every run), DIR/positional.md (the table), DIR/positional_<task>.svg
// (accuracy against test length) and prints the table. Also the tour's section.
#include "attn/core/error.hpp"
#include "attn/model/experiment.hpp"
#include "tools/attn/commands.hpp"
#include "tools/attn/tour.hpp"
#include "viz/io.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <system_error>
#include <thread>

namespace attn::cli {

namespace {

constexpr const char* kOp = "experiment positional";

struct ExperimentArgs {
  std::string out;
  bool full = false;
  int64_t seeds = 0, steps = 0;    // 0: the setting's default
  int jobs = 0;                    // 0: one run per hardware thread
  std::vector<std::string> tasks;  // empty: the setting's default
  std::string precision = "fp32";
};

// quick: the tour's setting (about a minute on 2 cores); full: more seeds, steps and both tasks.
model::PositionalExperimentOptions experiment_options(const ExperimentArgs& a) {
  model::PositionalExperimentOptions o;
  o.seeds = a.full ? 3 : 1;
  o.steps = a.full ? 3000 : 1500;
  o.tasks = a.full ? std::vector<model::GeneratedTask>{model::GeneratedTask::kShift,
                                                       model::GeneratedTask::kSorted}
                   : std::vector<model::GeneratedTask>{model::GeneratedTask::kShift};
  if (a.seeds > 0) o.seeds = a.seeds;
  if (a.steps > 0) o.steps = a.steps;
  o.precision = model::parse_precision(a.precision);
  if (!a.tasks.empty()) {
    o.tasks.clear();
    for (const auto& t : a.tasks)
      o.tasks.push_back(model::parse_generated_task(t));
  }
  // Each run trains on one thread and is a pure function of (task, variant, seed), so running
  // several at once changes the wall time only (tests/test_model_threads.cpp checks it).
  check(a.jobs >= 0, kOp, "--jobs {}: expected >= 1, or 0 for one run per hardware thread", a.jobs);
  o.jobs = a.jobs > 0 ? a.jobs : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return o;
}

struct Summary {
  model::GeneratedTask task;
  nn::PositionalKind kind;
  std::vector<double> mean, lo, hi;  // per evaluation length, over seeds
  double seconds = 0;
};

std::vector<Summary> summarise(const std::vector<model::PositionalRun>& runs) {
  std::vector<Summary> out;
  for (const auto& r : runs) {
    auto it = std::find_if(out.begin(), out.end(), [&](const Summary& s) {
      return s.task == r.task && s.kind == r.positional;
    });
    if (it == out.end()) {
      out.push_back({r.task, r.positional, std::vector<double>(r.accuracy.size(), 0.0), r.accuracy,
                     r.accuracy, 0.0});
      it = out.end() - 1;
    }
    for (size_t i = 0; i < r.accuracy.size(); ++i) {
      it->mean[i] += r.accuracy[i];
      it->lo[i] = std::min(it->lo[i], r.accuracy[i]);
      it->hi[i] = std::max(it->hi[i], r.accuracy[i]);
    }
    it->seconds += r.seconds;
  }
  const double seeds = out.empty() ? 1.0 : static_cast<double>(runs.size()) / out.size();
  for (auto& s : out)
    for (double& m : s.mean)
      m /= seeds;
  return out;
}

std::string cell(const Summary& s, size_t i, int64_t seeds) {
  if (seeds == 1) return fmt::format("{:.1f}%", 100 * s.mean[i]);
  return fmt::format("{:.1f}% ({:.1f}-{:.1f})", 100 * s.mean[i], 100 * s.lo[i], 100 * s.hi[i]);
}

// The best an order-blind model can score on the evaluation set of `length` (the experiment's
// own sequences, so the bound is exact for them).
double order_blind(const model::PositionalExperimentOptions& o, model::GeneratedTask task,
                   int64_t length) {
  model::TaskOptions t;
  t.task = task;
  t.num_symbols = o.num_symbols;
  t.min_len = t.max_len = length;
  return model::order_blind_accuracy(
      t, model::generate_task(t, o.eval_examples, 0, model::eval_stream(length)));
}

viz::Table results_table(const model::PositionalExperimentOptions& o,
                         const std::vector<model::PositionalRun>& runs) {
  viz::Table t;
  t.header = {"task", "positional encoding"};
  for (int64_t f : o.length_factors)
    t.header.push_back(f == 1 ? fmt::format("accuracy at T = {} (training)", o.train_len)
                              : fmt::format("at {}x = {}", f, f * o.train_len));
  for (const Summary& s : summarise(runs)) {
    std::vector<std::string> row = {model::generated_task_name(s.task),
                                    nn::positional_kind_name(s.kind)};
    for (size_t i = 0; i < s.mean.size(); ++i)
      row.push_back(cell(s, i, o.seeds));
    t.rows.push_back(std::move(row));
  }
  for (auto task : o.tasks) {
    std::vector<std::string> row = {model::generated_task_name(task), "(best without order)"};
    for (int64_t f : o.length_factors)
      row.push_back(fmt::format("{:.1f}%", 100 * order_blind(o, task, o.train_len * f)));
    t.rows.push_back(std::move(row));
  }
  t.caption = fmt::format(
      "Accuracy on held-out sequences (mean over {} seed{}{}); encoder E={}, {} heads, {} "
      "blocks, {} steps of batch {}, trained on lengths {}..{}{}",
      o.seeds, o.seeds > 1 ? "s" : "", o.seeds > 1 ? ", min-max in parentheses" : "", o.num_hiddens,
      o.num_heads, o.num_blks, o.steps, o.batch_size, o.train_len / 2, o.train_len,
      o.precision == model::Precision::kFloat32 ? "" : ", precision bf16 (mixed)");
  return t;
}

std::string markdown(const viz::Table& t) {
  std::string out = t.caption + "\n\n|";
  for (const auto& h : t.header)
    out += " " + h + " |";
  out += "\n|";
  for (size_t i = 0; i < t.header.size(); ++i)
    out += "---|";
  out += "\n";
  for (const auto& r : t.rows) {
    out += "|";
    for (const auto& c : r)
      out += " " + c + " |";
    out += "\n";
  }
  return out;
}

std::string runs_csv(const std::vector<model::PositionalRun>& runs) {
  std::string out = "task,positional,seed,length,accuracy,final_train_loss,seconds\n";
  for (const auto& r : runs)
    for (size_t i = 0; i < r.lengths.size(); ++i)
      out += fmt::format("{},{},{},{},{:.6f},{:.6g},{:.2f}\n", model::generated_task_name(r.task),
                         nn::positional_kind_name(r.positional), r.seed, r.lengths[i],
                         r.accuracy[i], r.final_loss, r.seconds);
  return out;
}

// Accuracy against test length, one line per positional encoding, the order-blind bound dashed.
std::string figure_svg(const model::PositionalExperimentOptions& o, model::GeneratedTask task,
                       const std::vector<model::PositionalRun>& runs) {
  std::vector<viz::Series> series;
  for (const Summary& s : summarise(runs)) {
    if (s.task != task) continue;
    viz::Series line{nn::positional_kind_name(s.kind), {}, {}, "", "", true};
    for (size_t i = 0; i < s.mean.size(); ++i) {
      line.x.push_back(static_cast<double>(o.train_len * o.length_factors[i]));
      line.y.push_back(s.mean[i]);
    }
    series.push_back(std::move(line));
  }
  viz::Series floor{"best without order", {}, {}, "#999999", "4 3", false};
  for (int64_t f : o.length_factors) {
    floor.x.push_back(static_cast<double>(o.train_len * f));
    floor.y.push_back(order_blind(o, task, o.train_len * f));
  }
  series.push_back(std::move(floor));
  viz::LineChartOptions c;
  c.title = fmt::format("{} task: accuracy vs test length (trained on lengths {}..{})",
                        model::generated_task_name(task), o.train_len / 2, o.train_len);
  c.xlabel = "test sequence length";
  c.ylabel = "accuracy";
  c.xscale = viz::Scale::kLog;
  c.ymin = 0.0;
  c.ymax = 1.0;
  c.height = 300;
  return viz::line_chart_svg(series, c);
}

struct ExperimentOutput {
  viz::Table table;
  std::string csv, md;
  std::vector<std::pair<std::string, std::string>> figures;  // (file name, svg)
  double seconds = 0;
};

ExperimentOutput run_experiment(const model::PositionalExperimentOptions& o, bool verbose) {
  const auto start = std::chrono::steady_clock::now();
  const auto runs = model::run_positional_experiment(
      o, [verbose](const model::PositionalRun& r, int64_t done, int64_t total) {
        if (!verbose) return;
        std::string acc;
        for (size_t i = 0; i < r.lengths.size(); ++i)
          acc += fmt::format(" L{}={:.3f}", r.lengths[i], r.accuracy[i]);
        std::fprintf(stderr, "[%lld/%lld] %s pe=%s seed=%llu:%s (%.1f s)\n",
                     static_cast<long long>(done), static_cast<long long>(total),
                     model::generated_task_name(r.task), nn::positional_kind_name(r.positional),
                     static_cast<unsigned long long>(r.seed), acc.c_str(), r.seconds);
      });
  ExperimentOutput out;
  out.table = results_table(o, runs);
  out.csv = runs_csv(runs);
  out.md = "# attn experiment positional\n\n" + markdown(out.table);
  for (auto task : o.tasks)
    out.figures.emplace_back(fmt::format("positional_{}.svg", model::generated_task_name(task)),
                             figure_svg(o, task, runs));
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

std::vector<Command> add_experiment_command(CLI::App& app) {
  CLI::App* experiment = app.add_subcommand(
      "experiment", "Experiments that train models; `attn experiment positional --help`.");
  experiment->require_subcommand(1);
  auto args = std::make_shared<ExperimentArgs>();
  CLI::App* sub = experiment->add_subcommand(
      "positional",
      "Train the same small encoder on order tasks (shift: tag each token with the previous "
      "one; sorted: is the sequence non-decreasing) with each positional encoding, for several "
      "seeds, and score it at the training length and at 2x and 4x longer sequences. Quick by "
      "default (about a minute on 2 cores); --full for more seeds, steps and both tasks.");
  sub->add_option("--out,-o", args->out, "output directory (created if missing)")->required();
  sub->add_flag("--full", args->full, "3 seeds, 3000 steps, tasks shift and sorted");
  sub->add_option("--seeds", args->seeds, "seeds per variant (default 1 quick, 3 full)");
  sub->add_option("--steps", args->steps, "training steps per run (default 1500 quick, 3000 full)");
  sub->add_option("--tasks", args->tasks, "tasks, comma-separated: shift, sorted")->delimiter(',');
  sub->add_option("--precision", args->precision,
                  "fp32, or bf16: mixed precision as `attn train --precision bf16` (linear layers "
                  "and attention in bfloat16, float32 master weights)")
      ->capture_default_str();
  sub->add_option("--jobs", args->jobs,
                  "runs trained at the same time, one thread each (0: one per hardware thread; "
                  "the results do not depend on it)")
      ->capture_default_str();
  auto run = [args] {
    const auto o = experiment_options(*args);
    const std::filesystem::path dir = args->out;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    check(!ec && std::filesystem::is_directory(dir), kOp, "cannot create directory '{}'",
          dir.string());
    const ExperimentOutput out = run_experiment(o, true);
    viz::write_file_atomic((dir / "positional.csv").string(), out.csv);
    for (const auto& [name, svg] : out.figures)
      viz::write_file_atomic((dir / name).string(), svg);
    viz::write_file_atomic((dir / "positional.md").string(), out.md);
    print(fmt::format("{}wrote {}/positional.md, positional.csv and {} figure(s) in {:.1f} s\n",
                      text_table(out.table), dir.string(), out.figures.size(), out.seconds));
  };
  return {{sub, run}, {experiment, [] {}}};
}

// The tour's section: the quick setting.
void tour_positional_experiment(Tour& tour) {
  viz::Section& s =
      tour.report.section("positional-experiment", "Positional encoding matters: a trained model");
  s.paragraph(
      "Self-attention is permutation-equivariant: shuffle the tokens and its outputs shuffle "
      "the same way. Without positional encoding a Transformer encoder therefore cannot tell "
      "which token came before which. The shift task makes this visible: tag every token with "
      "the token just before it (the first token has no target). Each variant below is the same "
      "encoder (E = 32, 2 heads, 2 blocks, AdamW) trained on random sequences of 8 symbols, "
      "lengths 8..16, then scored on new sequences of length 16, 32 and 64.");
  ExperimentArgs args;
  const auto o = experiment_options(args);
  const ExperimentOutput out = run_experiment(o, false);
  s.table(out.table);
  for (const auto& [name, svg] : out.figures)
    s.figure(tour.write(name, svg),
             "Accuracy against test length per positional encoding. Dashed: the best an "
             "order-blind model can do (guess the most frequent other symbol of the sequence; "
             "pure chance would be 1/8). Without a position signal the encoder stays at that "
             "bound at every length. Sinusoidal, learned and rotary encodings solve the task at "
             "the training lengths. ALiBi, as an encoder applies it (a symmetric penalty "
             "-m |t - s| on the scores), tells how far away a token is but not on which side, "
             "so it cannot tell the token before from the token after. Longer sequences hold "
             "positions the model never saw: a learned table has untrained rows there, and "
             "sinusoids meet angle combinations not seen in training, while rotary encodes only "
             "offsets between tokens, which longer sequences share with short ones.");
  s.paragraph(
      fmt::format("The numbers are in `{}`; `attn experiment positional --out DIR "
                  "--full` repeats this with 3 seeds, 3000 steps and the sorted task "
                  "too. This section took {:.0f} s.",
                  tour.write("positional.csv", out.csv), out.seconds));
}

}  // namespace attn::cli
