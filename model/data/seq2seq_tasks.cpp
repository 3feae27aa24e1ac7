// The generated sequence-to-sequence tasks (see attn/model/seq2seq_tasks.hpp).
#include "attn/model/seq2seq_tasks.hpp"

#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "model/data/words_hash.hpp"

#include <algorithm>
#include <array>

namespace attn::model {

namespace {

constexpr int kFirstYear = 1900, kLastYear = 2099;
constexpr uint64_t kHeldOutBuckets = 10;  // 1 in 10 dates or sequences is held out
// Draws before generate_seq2seq_task gives up on a split (validate makes an empty bucket very
// unlikely; this turns the remaining case into an error instead of an endless loop).
constexpr int64_t kMaxDrawsPerExample = 100000;

constexpr std::array<const char*, 12> kMonths = {"january",   "february", "march",    "april",
                                                 "may",       "june",     "july",     "august",
                                                 "september", "october",  "november", "december"};
constexpr std::array<const char*, 20> kUnits = {
    "",         "one",     "two",     "three",     "four",     "five",    "six",
    "seven",    "eight",   "nine",    "ten",       "eleven",   "twelve",  "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"};
constexpr std::array<const char*, 10> kTens = {"",      "",      "twenty",  "thirty", "forty",
                                               "fifty", "sixty", "seventy", "eighty", "ninety"};
constexpr std::array<const char*, 20> kOrdinalUnits = {
    "",           "first",     "second",    "third",       "fourth",     "fifth",     "sixth",
    "seventh",    "eighth",    "ninth",     "tenth",       "eleventh",   "twelfth",   "thirteenth",
    "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth"};

bool leap(int y) {
  return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
}

int days_in_month(int y, int m) {
  constexpr std::array<int, 12> kDays = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && leap(y) ? 29 : kDays[static_cast<size_t>(m - 1)];
}

void check_date(int y, int m, int d) {
  check(y >= kFirstYear && y <= kLastYear && m >= 1 && m <= 12 && d >= 1 &&
            d <= days_in_month(std::clamp(y, kFirstYear, kLastYear), std::clamp(m, 1, 12)),
        "date_in_words", "{:04}-{:02}-{:02} is not a date between {}-01-01 and {}-12-31", y, m, d,
        kFirstYear, kLastYear);
}

void append(std::vector<std::string>& out, const char* w) {
  out.emplace_back(w);
}

// 1..99 as words: "five", "twelve", "forty", "forty two".
void cardinal(std::vector<std::string>& out, int n) {
  if (n < 20) return append(out, kUnits[static_cast<size_t>(n)]);
  append(out, kTens[static_cast<size_t>(n / 10)]);
  if (n % 10) append(out, kUnits[static_cast<size_t>(n % 10)]);
}

// 1..31 as ordinal words: "third", "twentieth", "twenty first", "thirty first".
void ordinal(std::vector<std::string>& out, int n) {
  if (n < 20) return append(out, kOrdinalUnits[static_cast<size_t>(n)]);
  if (n % 10 == 0) return append(out, n == 20 ? "twentieth" : "thirtieth");
  append(out, kTens[static_cast<size_t>(n / 10)]);
  append(out, kOrdinalUnits[static_cast<size_t>(n % 10)]);
}

void year_words(std::vector<std::string>& out, int y) {
  const int yy = y % 100;
  if (y < 2000) {
    append(out, "nineteen");
    if (yy == 0) return append(out, "hundred");
    if (yy < 10) append(out, "oh");
    return cardinal(out, yy);
  }
  append(out, "two");
  append(out, "thousand");
  if (yy == 0) return;
  append(out, "and");
  cardinal(out, yy);
}

std::string two_digits(int n) {
  return fmt::format("{:02}", n);
}

// Number of distinct copy/reverse sequences, capped at `cap`.
int64_t distinct_sequences(const Seq2SeqTaskOptions& o, int64_t cap) {
  int64_t total = 0;
  for (int64_t len = o.min_len; len <= o.max_len && total < cap; ++len) {
    int64_t n = 1;
    for (int64_t i = 0; i < len && n < cap; ++i)
      n *= o.num_symbols;
    total += std::min(n, cap);
  }
  return std::min(total, cap);
}

}  // namespace

const char* seq2seq_task_name(Seq2SeqTask task) {
  switch (task) {
    case Seq2SeqTask::kDates:
      return "dates";
    case Seq2SeqTask::kCopy:
      return "copy";
    case Seq2SeqTask::kReverse:
      return "reverse";
  }
  return "?";
}

Seq2SeqTask parse_seq2seq_task(const std::string& name) {
  for (Seq2SeqTask t : {Seq2SeqTask::kDates, Seq2SeqTask::kCopy, Seq2SeqTask::kReverse})
    if (name == seq2seq_task_name(t)) return t;
  throw Error("parse_seq2seq_task",
              fmt::format("unknown task '{}', expected dates, copy or reverse", name));
}

void validate(const Seq2SeqTaskOptions& o) {
  if (o.task == Seq2SeqTask::kDates) return;  // the date range is fixed
  const char* op = "generate_seq2seq_task";
  check(o.num_symbols >= 2 && o.num_symbols <= 26, op, "num_symbols must be in [2, 26], got {}",
        o.num_symbols);
  check(o.min_len >= 1 && o.min_len <= o.max_len && o.max_len <= 64, op,
        "lengths must satisfy 1 <= min_len ({}) <= max_len ({}) <= 64", o.min_len, o.max_len);
  const int64_t distinct = distinct_sequences(o, 100);
  check(distinct >= 100, op,
        "{} symbols of length {}..{} make only {} distinct sequences; need >= 100 to hold 1 in "
        "{} out",
        o.num_symbols, o.min_len, o.max_len, distinct, kHeldOutBuckets);
}

std::vector<std::string> date_in_words(int year, int month, int day, DateForm form) {
  check_date(year, month, day);
  std::vector<std::string> out;
  if (form == DateForm::kDayOfMonth) {  // the third of march ...
    append(out, "the");
    ordinal(out, day);
    append(out, "of");
    append(out, kMonths[static_cast<size_t>(month - 1)]);
  } else {  // march the third ...
    append(out, kMonths[static_cast<size_t>(month - 1)]);
    append(out, "the");
    ordinal(out, day);
  }
  year_words(out, year);
  return out;
}

std::vector<std::string> date_iso_tokens(int year, int month, int day) {
  check_date(year, month, day);
  return {std::to_string(year), "-", two_digits(month), "-", two_digits(day)};
}

Vocabulary seq2seq_task_source_vocabulary(const Seq2SeqTaskOptions& o) {
  validate(o);
  Vocabulary v(Reserved::kSeq2Seq);
  if (o.task != Seq2SeqTask::kDates) {
    for (int64_t s = 0; s < o.num_symbols; ++s)
      v.add(std::string(1, static_cast<char>('a' + s)));
    return v;
  }
  for (const char* w : {"the", "of", "and", "oh", "hundred", "thousand"})
    v.add(w);
  for (const char* w : kMonths)
    v.add(w);
  for (size_t i = 1; i < kOrdinalUnits.size(); ++i)
    v.add(kOrdinalUnits[i]);
  v.add("twentieth");
  v.add("thirtieth");
  for (size_t i = 1; i < kUnits.size(); ++i)
    v.add(kUnits[i]);
  for (size_t i = 2; i < kTens.size(); ++i)
    v.add(kTens[i]);
  return v;
}

Vocabulary seq2seq_task_target_vocabulary(const Seq2SeqTaskOptions& o) {
  if (o.task != Seq2SeqTask::kDates) return seq2seq_task_source_vocabulary(o);
  Vocabulary v(Reserved::kSeq2Seq);
  v.add("-");
  for (int n = 1; n <= 31; ++n)
    v.add(two_digits(n));
  for (int y = kFirstYear; y <= kLastYear; ++y)
    v.add(std::to_string(y));
  return v;
}

std::pair<int64_t, int64_t> seq2seq_task_max_lengths(const Seq2SeqTaskOptions& o) {
  validate(o);
  // "the twenty first of september two thousand and ninety nine": 1 + 2 + 1 + 1 + 5.
  if (o.task == Seq2SeqTask::kDates) return {10, 5};
  return {o.max_len, o.max_len};
}

bool seq2seq_task_held_out(const Seq2SeqTaskOptions& o, const Seq2SeqExample& e) {
  // The content that must not be shared: the date (its ISO form, the same for both phrasings),
  // or the source sequence.
  const auto& key = o.task == Seq2SeqTask::kDates ? e.target : e.source;
  return detail::words_hash(key) % kHeldOutBuckets == 0;
}

std::vector<Seq2SeqExample> generate_seq2seq_task(const Seq2SeqTaskOptions& o, int64_t num_examples,
                                                  uint64_t seed, uint64_t stream, TaskSplit split) {
  const char* op = "generate_seq2seq_task";
  validate(o);
  check(num_examples >= 1, op, "num_examples must be >= 1, got {}", num_examples);
  Rng rng(seed, stream);
  const auto below = [&](int64_t n) {
    return static_cast<int64_t>(rng.below(static_cast<uint64_t>(n)));
  };
  const bool want_held_out = split == TaskSplit::kHeldOut;
  std::vector<Seq2SeqExample> out;
  out.reserve(static_cast<size_t>(num_examples));
  for (int64_t e = 0; e < num_examples; ++e) {
    Seq2SeqExample ex;
    for (int64_t draw = 0;; ++draw) {
      check(draw < kMaxDrawsPerExample, op, "no {} example found in {} draws",
            want_held_out ? "held-out" : "training", kMaxDrawsPerExample);
      if (o.task == Seq2SeqTask::kDates) {
        // Uniform over valid dates: year, month, day uniform, impossible days redrawn.
        int y = 0, m = 0, d = 0;
        do {
          y = kFirstYear + static_cast<int>(below(kLastYear - kFirstYear + 1));
          m = 1 + static_cast<int>(below(12));
          d = 1 + static_cast<int>(below(31));
        } while (d > days_in_month(y, m));
        const DateForm form = below(2) == 0 ? DateForm::kDayOfMonth : DateForm::kMonthDay;
        ex.source = date_in_words(y, m, d, form);
        ex.target = date_iso_tokens(y, m, d);
      } else {
        const int64_t n = o.min_len + below(o.max_len - o.min_len + 1);
        ex.source.clear();
        for (int64_t i = 0; i < n; ++i)
          ex.source.emplace_back(1, static_cast<char>('a' + below(o.num_symbols)));
        ex.target = ex.source;
        if (o.task == Seq2SeqTask::kReverse) std::reverse(ex.target.begin(), ex.target.end());
      }
      if (seq2seq_task_held_out(o, ex) == want_held_out) break;
    }
    out.push_back(std::move(ex));
  }
  return out;
}

std::vector<std::string> cardinal_words(int n) {
  check(n >= 1 && n <= 99, "cardinal_words", "{} is outside 1..99", n);
  std::vector<std::string> out;
  cardinal(out, n);
  return out;
}

std::vector<std::string> ordinal_words(int n) {
  check(n >= 1 && n <= 31, "ordinal_words", "{} is outside 1..31", n);
  std::vector<std::string> out;
  ordinal(out, n);
  return out;
}

std::string month_name(int month) {
  check(month >= 1 && month <= 12, "month_name", "month {} is outside 1..12", month);
  return kMonths[static_cast<size_t>(month - 1)];
}

}  // namespace attn::model
