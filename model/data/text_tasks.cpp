// The generated text classification tasks (see attn/model/text_tasks.hpp).
#include "attn/model/text_tasks.hpp"

#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "model/data/words_hash.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <string_view>

namespace attn::model {

namespace {

constexpr uint64_t kHeldOutBuckets = 10;  // 1 in 10 texts is held out
constexpr int64_t kMaxDrawsPerExample = 100000;
constexpr int64_t kMonthDayMinLen = 6, kMonthDayMaxLen = 16;
constexpr int64_t kCompareMaxFillers = 2;  // before the first number and after the second

// Neither month names nor number words, so that the rule can be read back from the text.
constexpr std::array<const char*, 32> kMonthDayFillers = {
    "the",  "meeting", "is",   "on",   "we",     "met",  "moved", "to",   "party", "from",  "until",
    "next", "report",  "due",  "trip", "starts", "ends", "and",   "then", "a",     "after", "her",
    "his",  "visit",   "call", "was",  "will",   "be",   "by",    "at",   "our",   "class"};
constexpr std::array<const char*, 12> kCompareFillers = {"which", "is",      "larger", "pick",
                                                         "the",   "greater", "number", "say",
                                                         "tell",  "me",      "bigger", "please"};
constexpr std::array<const char*, 4> kCompareSeparators = {"or", "versus", "against", "and"};

const char* label_name(TextTask task, int index) {
  if (task == TextTask::kMonthDay) return index == 0 ? "month-first" : "day-first";
  return index == 0 ? "first" : "second";
}

std::string join(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words)
    s += (s.empty() ? "" : " ") + w;
  return s;
}

// Reading texts back: the words of each kind and the numbers they spell.
struct Lexicon {
  std::map<std::string, int, std::less<>> cardinals;  // "forty two" -> 42
  std::set<std::string, std::less<>> number_words, day_words, months, separators;

  Lexicon() {
    for (int n = 1; n <= 99; ++n) {
      const auto w = cardinal_words(n);
      cardinals.emplace(join(w), n);
      number_words.insert(w.begin(), w.end());
    }
    for (int d = 1; d <= 31; ++d) {
      const auto w = ordinal_words(d);
      day_words.insert(w.begin(), w.end());
    }
    for (int m = 1; m <= 12; ++m)
      months.insert(month_name(m));
    separators.insert(kCompareSeparators.begin(), kCompareSeparators.end());
  }
};

const Lexicon& lexicon() {
  static const Lexicon lex;
  return lex;
}

std::string month_day_label(const std::vector<std::string>& tokens) {
  const Lexicon& lex = lexicon();
  int64_t month = -1, day = -1, months = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (lex.months.contains(tokens[i])) {
      ++months;
      month = static_cast<int64_t>(i);
    }
    if (day < 0 && lex.day_words.contains(tokens[i])) day = static_cast<int64_t>(i);
  }
  check(months == 1 && day >= 0, "text_task_label",
        "month-day: expected one month name and a day, got \"{}\"", join(tokens));
  return label_name(TextTask::kMonthDay, month < day ? 0 : 1);
}

std::string compare_label(const std::vector<std::string>& tokens) {
  const Lexicon& lex = lexicon();
  const auto sep = std::find_if(tokens.begin(), tokens.end(),
                                [&](const std::string& t) { return lex.separators.contains(t); });
  const auto is_number = [&](const std::string& t) { return lex.number_words.contains(t); };
  auto value = [&](std::vector<std::string> words) {
    const auto it = lex.cardinals.find(join(words));
    return it == lex.cardinals.end() ? 0 : it->second;
  };
  int a = 0, b = 0;
  if (sep != tokens.end()) {
    const auto first = std::find_if_not(std::make_reverse_iterator(sep), tokens.rend(), is_number);
    const auto last = std::find_if_not(sep + 1, tokens.end(), is_number);
    a = value({first.base(), sep});
    b = value({sep + 1, last});
  }
  check(a > 0 && b > 0 && a != b, "text_task_label",
        "compare: expected two different numbers around a separator, got \"{}\"", join(tokens));
  return label_name(TextTask::kCompare, a > b ? 0 : 1);
}

}  // namespace

const char* text_task_name(TextTask task) {
  return task == TextTask::kMonthDay ? "month-day" : "compare";
}

TextTask parse_text_task(const std::string& name) {
  for (TextTask t : {TextTask::kMonthDay, TextTask::kCompare})
    if (name == text_task_name(t)) return t;
  throw Error("parse_text_task",
              fmt::format("unknown text task '{}', expected month-day or compare", name));
}

std::vector<std::string> text_task_labels(TextTask task) {
  return {label_name(task, 0), label_name(task, 1)};
}

bool text_task_held_out(const std::vector<std::string>& tokens) {
  return detail::words_hash(tokens) % kHeldOutBuckets == 0;
}

std::string text_task_label(TextTask task, const std::vector<std::string>& tokens) {
  return task == TextTask::kMonthDay ? month_day_label(tokens) : compare_label(tokens);
}

std::vector<TextExample> generate_text_task(TextTask task, int64_t num_examples, uint64_t seed,
                                            TaskSplit split) {
  const char* op = "generate_text_task";
  check(num_examples >= 1, op, "num_examples must be >= 1, got {}", num_examples);
  const bool want_held_out = split == TaskSplit::kHeldOut;
  Rng rng(seed, want_held_out ? 1 : 0);
  const auto below = [&](int64_t n) {
    return static_cast<int64_t>(rng.below(static_cast<uint64_t>(n)));
  };
  const auto pick = [&](const auto& words) {
    return std::string(words[static_cast<size_t>(below(static_cast<int64_t>(words.size())))]);
  };
  std::vector<TextExample> out;
  out.reserve(static_cast<size_t>(num_examples));
  for (int64_t e = 0; e < num_examples; ++e) {
    TextExample ex;
    for (int64_t draw = 0;; ++draw) {
      check(draw < kMaxDrawsPerExample, op, "no {} example found in {} draws",
            want_held_out ? "held-out" : "training", kMaxDrawsPerExample);
      const int label = static_cast<int>(below(2));
      ex.tokens.clear();
      if (task == TextTask::kMonthDay) {
        const std::vector<std::string> month = {month_name(1 + static_cast<int>(below(12)))};
        const std::vector<std::string> day = ordinal_words(1 + static_cast<int>(below(31)));
        const int64_t len = kMonthDayMinLen + below(kMonthDayMaxLen - kMonthDayMinLen + 1);
        const int64_t fillers = len - 1 - static_cast<int64_t>(day.size());
        // Units: the fillers, then the first item inserted at i and the second at j > i.
        std::vector<std::vector<std::string>> units;
        for (int64_t f = 0; f < fillers; ++f)
          units.push_back({pick(kMonthDayFillers)});
        const int64_t i = below(fillers + 1);
        const int64_t j = i + 1 + below(fillers + 1 - i);
        units.insert(units.begin() + i, label == 0 ? month : day);
        units.insert(units.begin() + j, label == 0 ? day : month);
        for (const auto& u : units)
          ex.tokens.insert(ex.tokens.end(), u.begin(), u.end());
      } else {
        const int a = 1 + static_cast<int>(below(99));
        int b = 1 + static_cast<int>(below(98));
        if (b >= a) ++b;  // uniform over the other 98 numbers
        const int larger = std::max(a, b), smaller = std::min(a, b);
        for (int64_t f = below(kCompareMaxFillers + 1); f > 0; --f)
          ex.tokens.push_back(pick(kCompareFillers));
        for (const auto& w : cardinal_words(label == 0 ? larger : smaller))
          ex.tokens.push_back(w);
        ex.tokens.push_back(pick(kCompareSeparators));
        for (const auto& w : cardinal_words(label == 0 ? smaller : larger))
          ex.tokens.push_back(w);
        for (int64_t f = below(kCompareMaxFillers + 1); f > 0; --f)
          ex.tokens.push_back(pick(kCompareFillers));
      }
      ex.label = label_name(task, label);
      if (text_task_held_out(ex.tokens) == want_held_out) break;
    }
    ex.line = e + 1;
    out.push_back(std::move(ex));
  }
  return out;
}

std::string text_examples_tsv(const std::vector<TextExample>& examples) {
  std::string s;
  for (const auto& ex : examples) {
    check(!ex.tokens.empty() && !ex.label.empty(), "text_examples_tsv",
          "example {} has an empty text or label", ex.line);
    s += join(ex.tokens) + '\t' + ex.label + '\n';
  }
  return s;
}

}  // namespace attn::model
