// Generated sequence-to-sequence tasks for quick runs (n -> m), made from a seed (nothing is
// downloaded). Each example is text (Seq2SeqExample), so training, `attn translate` and the tour
// go through the same vocabularies and readers as a user's TSV file.
//
//   dates    a date written out in words -> the same date in ISO order. Two phrasings:
//              "the third of march two thousand and five" -> "2005 - 03 - 03"
//              "march the third two thousand and five"    -> "2005 - 03 - 03"
//            Output needs reordering (day month year -> year month day) and a mapping of words to
//            symbols (ordinals -> "03", month names -> "03", 1 to 5 year words -> "2005").
//            Every valid date from 1900-01-01 to 2099-12-31 (73,049), uniform. Years read
//            "nineteen hundred", "nineteen oh five", "nineteen ninety nine", "two thousand",
//            "two thousand and five", "two thousand and forty two".
//   copy     a sequence of letters -> itself
//   reverse  a sequence of letters -> the letters in reverse order
//            Letters are the first num_symbols of "a" .. "z"; lengths uniform in
//            [min_len, max_len], letters uniform.
//
// Held-out split: an example is held out iff a fixed hash of its content (the date for dates,
// the source sequence for copy and reverse) falls in 1 bucket of 10. Training draws reject held-
// out examples and evaluation draws reject the others, so the two never share a date or a
// sequence however many batches are drawn; the split does not depend on the seed (every run is
// evaluated on the same unseen set). Examples are drawn from Rng(seed, stream) as the encoder
// tasks of attn/model/tasks.hpp: training batch s is generate_seq2seq_task(o, B, seed, s, kTrain),
// an evaluation set is generate_seq2seq_task(o, N, seed, eval_stream(0), kHeldOut).
#pragma once

#include "attn/model/data.hpp"
#include "attn/model/seq2seq_data.hpp"
#include "attn/model/tasks.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace attn::model {

enum class Seq2SeqTask : uint8_t { kDates, kCopy, kReverse };
const char* seq2seq_task_name(Seq2SeqTask task);
// "dates", "copy" or "reverse"; Error otherwise.
Seq2SeqTask parse_seq2seq_task(const std::string& name);

enum class TaskSplit : uint8_t { kTrain, kHeldOut };

struct Seq2SeqTaskOptions {
  Seq2SeqTask task = Seq2SeqTask::kDates;
  int64_t num_symbols = 10;           // copy, reverse: the alphabet, 2 .. 26 letters
  int64_t min_len = 3, max_len = 10;  // copy, reverse: sequence lengths, 1 <= min <= max <= 64
};

// Checks the options; copy and reverse also need at least 100 distinct sequences so that the
// held-out bucket is not empty. Error("generate_seq2seq_task").
void validate(const Seq2SeqTaskOptions& options);

// Every token a source (target) of the task can hold, after the reserved <pad> <unk> <bos> <eos>,
// in a fixed order: the same vocabulary for every seed.
Vocabulary seq2seq_task_source_vocabulary(const Seq2SeqTaskOptions& options);
Vocabulary seq2seq_task_target_vocabulary(const Seq2SeqTaskOptions& options);
// The longest source and target (tokens, without <eos>): num_steps >= longest + 1 keeps <eos>.
// dates: (10, 5).
std::pair<int64_t, int64_t> seq2seq_task_max_lengths(const Seq2SeqTaskOptions& options);

// `num_examples` examples of one split from Rng(seed, stream).
std::vector<Seq2SeqExample> generate_seq2seq_task(const Seq2SeqTaskOptions& options,
                                                  int64_t num_examples, uint64_t seed,
                                                  uint64_t stream, TaskSplit split);
// Whether `example` (as generated for `options`) lies in the held-out bucket.
bool seq2seq_task_held_out(const Seq2SeqTaskOptions& options, const Seq2SeqExample& example);

// The dates task's two sides, for a valid date in [1900, 2099]; Error otherwise.
// kDayOfMonth: "the third of march ...", kMonthDay: "march the third ...".
enum class DateForm : uint8_t { kDayOfMonth, kMonthDay };
std::vector<std::string> date_in_words(int year, int month, int day, DateForm form);
// {"2005", "-", "03", "-", "03"}
std::vector<std::string> date_iso_tokens(int year, int month, int day);
// The words the dates task writes numbers with (also used by attn/model/text_tasks.hpp):
// 1..99 as "five", "twelve", "forty", "forty two"; 1..31 as "third", "twentieth", "thirty first".
// Error outside those ranges.
std::vector<std::string> cardinal_words(int n);
std::vector<std::string> ordinal_words(int n);
// "january" .. "december" for 1..12; Error otherwise.
std::string month_name(int month);

}  // namespace attn::model
