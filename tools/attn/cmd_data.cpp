// attn data: the generated text classification tasks of attn/model/text_tasks.hpp written as TSV
// files (text<TAB>label) for `attn train --task tsv --data DIR/train.tsv --eval-data
// DIR/eval.tsv`. The files are a pure function of (task, sizes, seed), and the evaluation file
// never shares a text with the training file.
#include "attn/core/error.hpp"
#include "attn/model/text_tasks.hpp"
#include "tools/attn/commands.hpp"
#include "viz/io.hpp"

#include <filesystem>
#include <map>
#include <memory>
#include <system_error>

namespace attn::cli {

namespace {

constexpr const char* kOp = "data";

struct DataArgs {
  std::string task = "month-day";
  std::string out;
  int64_t train = 10000, eval = 1000;
  uint64_t seed = 0;
};

std::string label_counts(const std::vector<model::TextExample>& examples) {
  std::map<std::string, int64_t> counts;
  for (const auto& ex : examples)
    ++counts[ex.label];
  std::string s;
  for (const auto& [label, n] : counts)
    s += fmt::format("{}{} {}", s.empty() ? "" : ", ", n, label);
  return s;
}

void run_data(const DataArgs& a) {
  // The examples are built in memory before the atomic writes (~100 bytes each with the strings).
  constexpr int64_t kMaxExamples = 10'000'000;
  check(a.train >= 1 && a.eval >= 1 && a.train <= kMaxExamples && a.eval <= kMaxExamples, kOp,
        "--train ({}) and --eval ({}) must be in [1, {}]", a.train, a.eval, kMaxExamples);
  const model::TextTask task = model::parse_text_task(a.task);
  const std::filesystem::path dir = a.out;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  check(!ec && std::filesystem::is_directory(dir), kOp, "cannot create directory '{}'",
        dir.string());
  const auto train = model::generate_text_task(task, a.train, a.seed, model::TaskSplit::kTrain);
  const auto eval = model::generate_text_task(task, a.eval, a.seed, model::TaskSplit::kHeldOut);
  const std::string train_path = (dir / "train.tsv").string();
  const std::string eval_path = (dir / "eval.tsv").string();
  viz::write_file_atomic(train_path, model::text_examples_tsv(train));
  viz::write_file_atomic(eval_path, model::text_examples_tsv(eval));
  print(fmt::format("attn data {} (seed {}): {} ({}), {} ({})\n", a.task, a.seed, train_path,
                    label_counts(train), eval_path, label_counts(eval)));
}

}  // namespace

std::vector<Command> add_data_command(CLI::App& app) {
  auto args = std::make_shared<DataArgs>();
  CLI::App* sub = app.add_subcommand(
      "data",
      "Write a generated text classification task as TSV files (DIR/train.tsv, DIR/eval.tsv; "
      "text<TAB>label) for `attn train --task tsv`. month-day: filler words with a month name "
      "and a day ordinal, which comes first? compare: two numbers 1..99 in words, which is "
      "larger? Both need word order: without positional information a model is at 50%. The "
      "evaluation file never shares a text with the training file.");
  sub->add_option("--task", args->task, "month-day or compare")
      ->check(CLI::IsMember({"month-day", "compare"}))
      ->capture_default_str();
  sub->add_option("--out,-o", args->out, "output directory (created if missing)")->required();
  sub->add_option("--train", args->train, "training examples")->capture_default_str();
  sub->add_option("--eval", args->eval, "evaluation examples")->capture_default_str();
  sub->add_option("--seed", args->seed, "seeds the examples")->capture_default_str();
  auto run = [args] { run_data(*args); };
  return {{sub, run}};
}

}  // namespace attn::cli
