// The generated order tasks (see attn/model/tasks.hpp for why each needs positions).
#include "attn/model/tasks.hpp"

#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"

#include <algorithm>

namespace attn::model {

namespace {

constexpr int64_t kFirstSymbol = 2;  // ids 0 and 1 are <pad> and <unk>

}  // namespace

const char* generated_task_name(GeneratedTask task) {
  return task == GeneratedTask::kShift ? "shift" : "sorted";
}

GeneratedTask parse_generated_task(const std::string& name) {
  if (name == "shift") return GeneratedTask::kShift;
  if (name == "sorted") return GeneratedTask::kSorted;
  throw Error("parse_generated_task",
              fmt::format("unknown task '{}', expected shift or sorted", name));
}

TaskType task_type(GeneratedTask task) {
  return task == GeneratedTask::kShift ? TaskType::kTagging : TaskType::kClassification;
}

void validate(const TaskOptions& o) {
  const char* op = "generate_task";
  check(o.num_symbols >= 2 && o.num_symbols <= 1'000'000, op,
        "num_symbols must be in [2, 1000000], got {}", o.num_symbols);
  check(o.min_len >= 2 && o.min_len <= o.max_len && o.max_len <= 1'000'000, op,
        "lengths must satisfy 2 <= min_len ({}) <= max_len ({}) <= 1000000", o.min_len, o.max_len);
}

int64_t task_vocab_size(const TaskOptions& o) {
  return o.num_symbols + kFirstSymbol;
}

int64_t task_num_classes(const TaskOptions& o) {
  return o.task == GeneratedTask::kShift ? o.num_symbols : 2;
}

Dataset generate_task(const TaskOptions& o, int64_t num_examples, uint64_t seed, uint64_t stream) {
  validate(o);
  check(num_examples >= 1, "generate_task", "num_examples must be >= 1, got {}", num_examples);
  Rng rng(seed, stream);
  Dataset d;
  d.type = task_type(o.task);
  d.vocab_size = task_vocab_size(o);
  d.num_classes = task_num_classes(o);
  const auto below = [&](int64_t n) {
    return static_cast<int64_t>(rng.below(static_cast<uint64_t>(n)));
  };
  for (int64_t e = 0; e < num_examples; ++e) {
    const int64_t n = o.min_len + below(o.max_len - o.min_len + 1);
    std::vector<int64_t> seq(static_cast<size_t>(n));
    for (auto& t : seq)
      t = kFirstSymbol + below(o.num_symbols);
    if (o.task == GeneratedTask::kShift) {
      // tag[i] = the symbol at i - 1; position 0 has no predecessor and does not count.
      std::vector<int64_t> tags(static_cast<size_t>(n), kIgnoreTag);
      for (size_t i = 1; i < seq.size(); ++i)
        tags[i] = seq[i - 1] - kFirstSymbol;
      d.tags.push_back(std::move(tags));
    } else {
      // Half positives (the multiset sorted), half negatives (the multiset in a random order
      // that is not sorted). A multiset of one repeated symbol has no unsorted order: it can
      // only be a positive (rare: num_symbols^(1-n)).
      std::sort(seq.begin(), seq.end());
      const bool constant = seq.front() == seq.back();
      const bool positive = rng.below(2) == 1 || constant;
      if (!positive) {
        do {
          for (int64_t i = n - 1; i > 0; --i)
            std::swap(seq[static_cast<size_t>(i)], seq[static_cast<size_t>(below(i + 1))]);
        } while (std::is_sorted(seq.begin(), seq.end()));
      }
      d.labels.push_back(positive ? 1 : 0);
    }
    d.inputs.push_back(std::move(seq));
  }
  return d;
}

double order_blind_accuracy(const TaskOptions& o, const Dataset& d) {
  if (o.task == GeneratedTask::kSorted) return 0.5;
  double expected = 0;
  int64_t count = 0;
  std::vector<int64_t> freq(static_cast<size_t>(d.vocab_size));
  for (const auto& seq : d.inputs) {
    std::fill(freq.begin(), freq.end(), 0);
    for (int64_t t : seq)
      ++freq[static_cast<size_t>(t)];
    // Position i >= 1 knows its own token x and the multiset; the target is uniform over the
    // multiset minus one x (from its own point of view, any other token could precede it).
    for (size_t i = 1; i < seq.size(); ++i) {
      --freq[static_cast<size_t>(seq[i])];
      const int64_t best = *std::max_element(freq.begin(), freq.end());
      const int64_t ties = std::count(freq.begin(), freq.end(), best);
      // The target is seq[i-1]; the predictor picks uniformly among the `ties` most frequent.
      if (freq[static_cast<size_t>(seq[i - 1])] == best)
        expected += 1.0 / static_cast<double>(ties);
      ++freq[static_cast<size_t>(seq[i])];
      ++count;
    }
  }
  return count ? expected / static_cast<double>(count) : 0.0;
}

}  // namespace attn::model
