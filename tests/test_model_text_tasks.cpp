// The generated text classification tasks (attn/model/text_tasks.hpp, `attn data`): the same
// seed gives the same examples (pinned to the first line of each task, so the TSV files behind
// docs/training.md's bf16 table can be rebuilt), every label follows the task's rule read back
// from the words, the bag of words does not give the label away, the evaluation split never
// shares a text with the training split, and the TSV text reads back through parse_tsv /
// read_tsv and encodes with the vocabulary `attn train --task tsv` builds.
#include "attn/model/text_tasks.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

namespace attn::model {
namespace {

using Tokens = std::vector<std::string>;

template <typename F>
void expect_error(F f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' missing from: " << e.what();
  }
}

std::string text(const Tokens& t) {
  std::string s;
  for (const auto& w : t)
    s += (s.empty() ? "" : " ") + w;
  return s;
}

constexpr TextTask kTasks[] = {TextTask::kMonthDay, TextTask::kCompare};

TEST(TextTasks, NamesRoundTrip) {
  for (TextTask t : kTasks)
    EXPECT_EQ(parse_text_task(text_task_name(t)), t);
  expect_error([] { parse_text_task("sorted"); }, {"parse_text_task", "sorted", "month-day"});
  EXPECT_EQ(text_task_labels(TextTask::kMonthDay), (Tokens{"month-first", "day-first"}));
  EXPECT_EQ(text_task_labels(TextTask::kCompare), (Tokens{"first", "second"}));
}

TEST(TextTasks, SameSeedSameExamplesAndPinnedFirstLines) {
  for (TextTask t : kTasks) {
    for (TaskSplit split : {TaskSplit::kTrain, TaskSplit::kHeldOut}) {
      const auto a = generate_text_task(t, 50, 7, split);
      const auto b = generate_text_task(t, 50, 7, split);
      const auto c = generate_text_task(t, 50, 8, split);
      ASSERT_EQ(a.size(), 50u);
      EXPECT_EQ(text_examples_tsv(a), text_examples_tsv(b));
      EXPECT_NE(text_examples_tsv(a), text_examples_tsv(c));
      // A longer file starts with the shorter one.
      EXPECT_EQ(text_examples_tsv(generate_text_task(t, 80, 7, split)).substr(0, 1000),
                text_examples_tsv(a).substr(0, 1000));
    }
  }
  // `attn data --seed 0`'s first training lines: a change here changes every number measured on
  // these files.
  const auto md = generate_text_task(TextTask::kMonthDay, 1, 0, TaskSplit::kTrain);
  EXPECT_EQ(text_examples_tsv(md),
            "moved we moved we twentieth january trip will then to a the a our by be\t"
            "day-first\n");
  const auto cmp = generate_text_task(TextTask::kCompare, 1, 0, TaskSplit::kTrain);
  EXPECT_EQ(text_examples_tsv(cmp), "number twenty six or eighty five which\tsecond\n");
}

TEST(TextTasks, LabelsFollowTheRuleAndAreBalanced) {
  for (TextTask t : kTasks) {
    const auto ex = generate_text_task(t, 2000, 3, TaskSplit::kTrain);
    std::map<std::string, int> counts;
    for (size_t i = 0; i < ex.size(); ++i) {
      EXPECT_EQ(text_task_label(t, ex[i].tokens), ex[i].label) << text(ex[i].tokens);
      EXPECT_EQ(ex[i].line, static_cast<int64_t>(i) + 1);
      if (t == TextTask::kMonthDay) {
        EXPECT_GE(ex[i].tokens.size(), 6u);
        EXPECT_LE(ex[i].tokens.size(), 16u);
      } else {
        EXPECT_GE(ex[i].tokens.size(), 3u);
        EXPECT_LE(ex[i].tokens.size(), 9u);
      }
      ++counts[ex[i].label];
    }
    ASSERT_EQ(counts.size(), 2u);
    for (const auto& [label, n] : counts) {
      EXPECT_GT(n, 900) << label;  // 1000 expected; 4.5 standard deviations
      EXPECT_LT(n, 1100) << label;
    }
  }
}

TEST(TextTasks, TheRuleReadsOrderNotWords) {
  // The same words in the other order: the other label.
  EXPECT_EQ(text_task_label(TextTask::kMonthDay, {"we", "met", "on", "march", "the", "ninth"}),
            "month-first");
  EXPECT_EQ(text_task_label(TextTask::kMonthDay, {"we", "met", "on", "ninth", "the", "march"}),
            "day-first");
  EXPECT_EQ(text_task_label(TextTask::kMonthDay, {"twenty", "first", "may", "a", "b", "c"}),
            "day-first");
  EXPECT_EQ(text_task_label(TextTask::kCompare, {"forty", "two", "or", "seventeen"}), "first");
  EXPECT_EQ(text_task_label(TextTask::kCompare, {"seventeen", "or", "forty", "two"}), "second");
  EXPECT_EQ(text_task_label(TextTask::kCompare, {"pick", "twenty", "one", "and", "twenty"}),
            "first");
  // The bag of words: each label's multiset of texts' words, summed over many examples, is the
  // same up to sampling noise (here: how often each word appears per example, by label).
  for (TextTask t : kTasks) {
    const auto ex = generate_text_task(t, 4000, 5, TaskSplit::kTrain);
    std::map<std::string, std::array<double, 2>> freq;
    std::array<double, 2> n{};
    const Tokens labels = text_task_labels(t);
    for (const auto& e : ex) {
      const size_t l = e.label == labels[0] ? 0 : 1;
      n[l] += 1;
      for (const auto& w : e.tokens)
        freq[w][l] += 1;
    }
    for (const auto& [w, f] : freq)
      EXPECT_NEAR(f[0] / n[0], f[1] / n[1], 0.08) << text_task_name(t) << ": '" << w << "'";
  }
}

TEST(TextTasks, RejectsTextsTheTaskDoesNotMake) {
  expect_error(
      [] {
        text_task_label(TextTask::kMonthDay, {"we", "met", "on", "march"});
      },
      {"text_task_label", "month-day", "we met on march"});
  expect_error(
      [] {
        text_task_label(TextTask::kMonthDay, {"march", "may", "ninth"});
      },
      {"month-day"});
  expect_error(
      [] {
        text_task_label(TextTask::kCompare, {"forty", "two", "seventeen"});
      },
      {"compare", "separator"});
  expect_error([] { text_task_label(TextTask::kCompare, {"six", "or", "six"}); }, {"compare"});
  expect_error(
      [] {
        text_task_label(TextTask::kCompare, {"two", "forty", "or", "six"});
      },
      {"compare"});
  expect_error([] { cardinal_words(100); }, {"cardinal_words", "100", "1..99"});
  expect_error([] { ordinal_words(0); }, {"ordinal_words", "1..31"});
  expect_error([] { month_name(13); }, {"month_name", "13"});
  EXPECT_EQ(cardinal_words(42), (Tokens{"forty", "two"}));
  EXPECT_EQ(ordinal_words(31), (Tokens{"thirty", "first"}));
  EXPECT_EQ(month_name(5), "may");
  expect_error([] { generate_text_task(TextTask::kCompare, 0, 0, TaskSplit::kTrain); },
               {"generate_text_task", "num_examples", ">= 1"});
}

TEST(TextTasks, EvaluationTextsNeverAppearInTraining) {
  for (TextTask t : kTasks) {
    std::set<std::string> train;
    for (const auto& e : generate_text_task(t, 5000, 1, TaskSplit::kTrain)) {
      EXPECT_FALSE(text_task_held_out(e.tokens));
      train.insert(text(e.tokens));
    }
    for (const auto& e : generate_text_task(t, 500, 1, TaskSplit::kHeldOut)) {
      EXPECT_TRUE(text_task_held_out(e.tokens));
      EXPECT_FALSE(train.contains(text(e.tokens))) << text(e.tokens);
    }
  }
}

TEST(TextTasks, TsvReadsBackThroughReadTsvAndEncodes) {
  const auto path = attn::testing::temp_path("attn_test_text_tasks").concat(".tsv");
  for (TextTask t : kTasks) {
    const auto ex = generate_text_task(t, 300, 2, TaskSplit::kTrain);
    {
      std::ofstream f(path, std::ios::binary);
      f << text_examples_tsv(ex);
    }
    const auto back = read_tsv(path.string());
    ASSERT_EQ(back.size(), ex.size());
    for (size_t i = 0; i < ex.size(); ++i) {
      EXPECT_EQ(back[i].tokens, ex[i].tokens);
      EXPECT_EQ(back[i].label, ex[i].label);
      EXPECT_EQ(back[i].line, ex[i].line);
    }
    // As `attn train --task tsv` reads it: vocabulary from the words, the two labels.
    std::vector<Tokens> texts;
    Tokens names;
    for (const auto& e : back)
      texts.push_back(e.tokens), names.push_back(e.label);
    const Vocabulary tokens = Vocabulary::build(texts, 1);
    const Vocabulary labels = Vocabulary::labels(names);
    const Dataset d = encode_classification(back, tokens, labels, path.string());
    EXPECT_EQ(d.size(), 300);
    EXPECT_EQ(d.num_classes, 2);
  }
  std::filesystem::remove(path);
  expect_error(
      [] {
        text_examples_tsv({TextExample{{}, "x", 4}});
      },
      {"text_examples_tsv", "example 4", "empty"});
}

}  // namespace
}  // namespace attn::model
