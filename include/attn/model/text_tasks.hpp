// Generated text classification tasks in the TSV format of `attn train --task tsv` (one example
// per line, "text<TAB>label"), made from a seed: nothing is downloaded. `attn data` writes them
// to files; they exercise the user-data path (read_tsv, the vocabulary, EpochSampler) with rules
// that need word order, so that they measure what positional encoding and precision change.
//
//   month-day  filler words with one month name and one day ordinal in them, e.g.
//                "the report moved to the twenty first after june"   -> day-first
//                "we met on march and then the ninth"                -> month-first
//              Label: which of the two comes first. 6..16 words; the day is 1..31 ("first" ..
//              "thirty first", one or two words), the month uniform, the fillers uniform from
//              32 words that are neither months nor numbers, the two positions uniform.
//   compare    two numbers 1..99 in words with a separator and a few fillers, e.g.
//                "pick forty two or seventeen"                        -> first
//                "seven versus ninety the greater"                    -> second
//              Label: which number is larger (never equal). Needs order (which number comes
//              first) and the magnitude of 27 number words combined into tens and units.
//
// In both tasks the text of a label-`first` example with its two items swapped is an equally
// likely example of the other label: the bag of words says nothing about the label, so a model
// without positional information is at chance (50%).
//
// Held-out split: an example belongs to the evaluation split iff a fixed hash of its words falls
// in 1 bucket of 10 (as the seq2seq tasks do), so a training file and an evaluation file never
// share a text whatever their seeds and sizes. generate_text_task draws from Rng(seed, 0) for
// TaskSplit::kTrain and Rng(seed, 1) for kHeldOut, rejecting the other split's texts.
#pragma once

#include "attn/model/data.hpp"
#include "attn/model/seq2seq_tasks.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace attn::model {

enum class TextTask : uint8_t { kMonthDay, kCompare };
const char* text_task_name(TextTask task);
// "month-day" or "compare"; Error otherwise.
TextTask parse_text_task(const std::string& name);
// The two labels, in the order the generator draws them (index 0 = the first item wins / comes
// first): month-day {"month-first", "day-first"}, compare {"first", "second"}.
std::vector<std::string> text_task_labels(TextTask task);

// `num_examples` (>= 1) examples of one split. Each example's `line` is its 1-based index, the
// line it takes in text_examples_tsv. Labels are drawn uniformly.
std::vector<TextExample> generate_text_task(TextTask task, int64_t num_examples, uint64_t seed,
                                            TaskSplit split);
// The label the task's rule gives `tokens` (read back from the words, independent of the
// generator's draws); Error when the text is not one the task generates.
std::string text_task_label(TextTask task, const std::vector<std::string>& tokens);
// Whether a text lies in the held-out bucket.
bool text_task_held_out(const std::vector<std::string>& tokens);

// "w1 w2 ...<TAB>label\n" per example, the format parse_tsv / read_tsv read.
std::string text_examples_tsv(const std::vector<TextExample>& examples);

}  // namespace attn::model
