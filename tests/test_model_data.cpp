// Training data: generated order tasks (deterministic by seed, built as documented), the TSV and
// CoNLL-U readers (valid files, comments, multiword tokens, every malformed-line error with its
// file:line), vocabularies, batching with padding and valid_lens, and the epoch sampler.
#include "attn/model/data.hpp"
#include "attn/model/tasks.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace attn::model {
namespace {

// Expects `f` to throw an Error whose message contains every string of `needles`.
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

// --- generated tasks -------------------------------------------------------------------------

TEST(Tasks, SameSeedSameData) {
  for (GeneratedTask task : {GeneratedTask::kShift, GeneratedTask::kSorted}) {
    TaskOptions o;
    o.task = task;
    const Dataset a = generate_task(o, 50, 7, 3), b = generate_task(o, 50, 7, 3);
    EXPECT_EQ(a.inputs, b.inputs);
    EXPECT_EQ(a.tags, b.tags);
    EXPECT_EQ(a.labels, b.labels);
    // Another seed or another stream gives other data.
    EXPECT_NE(a.inputs, generate_task(o, 50, 8, 3).inputs);
    EXPECT_NE(a.inputs, generate_task(o, 50, 7, 4).inputs);
  }
}

TEST(Tasks, ShiftTagsAreThePreviousToken) {
  TaskOptions o;
  o.task = GeneratedTask::kShift;
  o.num_symbols = 5;
  o.min_len = 3;
  o.max_len = 9;
  const Dataset d = generate_task(o, 200, 1, 0);
  ASSERT_NO_THROW(d.validate("test"));
  EXPECT_EQ(d.type, TaskType::kTagging);
  EXPECT_EQ(d.vocab_size, 7);
  EXPECT_EQ(d.num_classes, 5);
  std::set<size_t> lengths;
  for (int64_t e = 0; e < d.size(); ++e) {
    const auto& x = d.inputs[static_cast<size_t>(e)];
    const auto& t = d.tags[static_cast<size_t>(e)];
    lengths.insert(x.size());
    EXPECT_EQ(t[0], kIgnoreTag);
    for (size_t i = 1; i < x.size(); ++i)
      EXPECT_EQ(t[i], x[i - 1] - 2);
    for (int64_t id : x)
      EXPECT_TRUE(id >= 2 && id < 7);  // never <pad> or <unk>
  }
  EXPECT_EQ(lengths, (std::set<size_t>{3, 4, 5, 6, 7, 8, 9}));  // every length is drawn
}

TEST(Tasks, SortedLabelsAndBalancedMultisets) {
  TaskOptions o;
  o.task = GeneratedTask::kSorted;
  const Dataset d = generate_task(o, 400, 2, 0);
  ASSERT_NO_THROW(d.validate("test"));
  EXPECT_EQ(d.num_classes, 2);
  int64_t positives = 0;
  for (int64_t e = 0; e < d.size(); ++e) {
    const auto& x = d.inputs[static_cast<size_t>(e)];
    const bool sorted = std::is_sorted(x.begin(), x.end());
    EXPECT_EQ(d.labels[static_cast<size_t>(e)], sorted ? 1 : 0);
    positives += sorted;
  }
  EXPECT_GT(positives, 160);  // half in expectation (binomial(400, 1/2): sd 10)
  EXPECT_LT(positives, 240);
}

TEST(Tasks, BadOptions) {
  TaskOptions o;
  o.min_len = 1;
  expect_error([&] { generate_task(o, 1, 0, 0); }, {"generate_task", "min_len"});
  o = {};
  o.num_symbols = 1;
  expect_error([&] { generate_task(o, 1, 0, 0); }, {"num_symbols"});
  expect_error([] { parse_generated_task("reverse"); }, {"reverse", "shift or sorted"});
}

// --- TSV -------------------------------------------------------------------------------------

TEST(Tsv, ParsesTextAndLabels) {
  const auto ex = parse_tsv("a good  film\tpos\r\n\nbad\tneg\n   \nso so film\tpos", "x.tsv");
  ASSERT_EQ(ex.size(), 3u);
  EXPECT_EQ(ex[0].tokens, (std::vector<std::string>{"a", "good", "film"}));
  EXPECT_EQ(ex[0].label, "pos");  // the '\r' of a CRLF line is dropped
  EXPECT_EQ(ex[1].line, 3);       // blank lines are skipped but counted
  EXPECT_EQ(ex[2].line, 5);
  EXPECT_EQ(ex[2].tokens.size(), 3u);
}

TEST(Tsv, MalformedLinesNameFileAndLine) {
  expect_error([] { parse_tsv("ok\tpos\nno tab here\n", "d.tsv"); },
               {"read_tsv", "d.tsv:2:", "no tab"});
  expect_error([] { parse_tsv("a\tb\tc\n", "d.tsv"); }, {"d.tsv:1:", "more than one tab"});
  expect_error([] { parse_tsv("x\tpos\n  \tneg\n", "d.tsv"); }, {"d.tsv:2:", "text", "empty"});
  expect_error([] { parse_tsv("x\t\n", "d.tsv"); }, {"d.tsv:1:", "label", "none"});
  expect_error([] { parse_tsv("x\tvery pos\n", "d.tsv"); }, {"d.tsv:1:", "2 words"});
  expect_error([] { parse_tsv("\n\n", "d.tsv"); }, {"d.tsv", "no examples"});
}

TEST(Tsv, ReadsFilesAndReportsMissingOnes) {
  const auto path = attn::testing::temp_path("attn_test_data").concat(".tsv");
  {
    std::ofstream f(path);
    f << "the cat\tanimal\nthe car\tthing\n";
  }
  const auto ex = read_tsv(path.string());
  EXPECT_EQ(ex.size(), 2u);
  std::filesystem::remove(path);
  expect_error([&] { read_tsv(path.string()); }, {"read_tsv", "cannot open", path.string()});
}

// --- CoNLL-U ---------------------------------------------------------------------------------

// Two sentences with the format's special lines: comments, a multiword token (Spanish
// "del" = "de" + "el") and an empty node.
constexpr const char* kConllu =
    "# sent_id = 1\n"
    "# text = Vino del mar.\n"
    "1\tVino\tvenir\tVERB\tV\t_\t0\troot\t_\t_\n"
    "2-3\tdel\t_\t_\t_\t_\t_\t_\t_\t_\n"
    "2\tde\tde\tADP\tP\t_\t4\tcase\t_\t_\n"
    "3\tel\tel\tDET\tD\t_\t4\tdet\t_\t_\n"
    "4\tmar\tmar\tNOUN\tN\t_\t1\tobl\t_\tSpaceAfter=No\n"
    "4.1\tfue\t_\tVERB\tV\t_\t_\t_\t1:conj\t_\n"
    "5\t.\t.\tPUNCT\tF\t_\t1\tpunct\t_\t_\n"
    "\n"
    "# sent_id = 2\n"
    "1\tSi\tsi\tINTJ\tI\t_\t0\troot\t_\t_\r\n"
    "\n\n";

TEST(Conllu, ParsesSentencesSkippingCommentsMultiwordAndEmptyNodes) {
  const auto s = parse_conllu(kConllu, "es.conllu");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].tokens, (std::vector<std::string>{"Vino", "de", "el", "mar", "."}));
  EXPECT_EQ(s[0].tags, (std::vector<std::string>{"VERB", "ADP", "DET", "NOUN", "PUNCT"}));
  EXPECT_EQ(s[0].line, 3);
  EXPECT_EQ(s[1].tokens, (std::vector<std::string>{"Si"}));
  EXPECT_EQ(s[1].tags, (std::vector<std::string>{"INTJ"}));  // CRLF handled
  const auto x = parse_conllu(kConllu, "es.conllu", ConlluTag::kXpos);
  EXPECT_EQ(x[0].tags, (std::vector<std::string>{"V", "P", "D", "N", "F"}));
}

TEST(Conllu, MalformedLinesNameFileAndLine) {
  const std::string ok = "1\ta\ta\tX\t_\t_\t0\troot\t_\t_\n";
  expect_error([&] { parse_conllu(ok + "2\tb\tb\tX\t_\t_\t1\tdep\n", "t.conllu"); },
               {"read_conllu", "t.conllu:2:", "10 tab-separated fields, found 8"});
  expect_error([&] { parse_conllu(ok + "3\tb\tb\tX\t_\t_\t1\tdep\t_\t_\n", "t.conllu"); },
               {"t.conllu:2:", "ID 3 out of sequence, expected 2"});
  expect_error([&] { parse_conllu(ok + "two\tb\tb\tX\t_\t_\t1\tdep\t_\t_\n", "t.conllu"); },
               {"t.conllu:2:", "'two' is not an integer"});
  expect_error([&] { parse_conllu("# c\n" + ok + "2\tb\tb\t_\t_\t_\t1\tdep\t_\t_\n", "t.conllu"); },
               {"t.conllu:3:", "UPOS", "'_'"});
  expect_error([&] { parse_conllu("1\t\ta\tX\t_\t_\t0\troot\t_\t_\n", "t.conllu"); },
               {"t.conllu:1:", "empty FORM"});
  expect_error([] { parse_conllu("# only a comment\n\n", "t.conllu"); },
               {"t.conllu", "no sentences"});
  // A new sentence restarts the IDs at 1.
  EXPECT_EQ(parse_conllu(ok + "\n" + ok, "t.conllu").size(), 2u);
}

// --- vocabulary and encoding -----------------------------------------------------------------

TEST(Vocabulary, SpecialsFrequencyOrderMinFreqAndUnknowns) {
  const Vocabulary v = Vocabulary::build({{"b", "a", "c", "a"}, {"b", "a", "d"}}, 1);
  // <pad>, <unk>, then by count (a 3, b 2), ties (c, d: 1) in byte order.
  EXPECT_EQ(v.tokens(), (std::vector<std::string>{"<pad>", "<unk>", "a", "b", "c", "d"}));
  EXPECT_EQ(v.id("zebra"), Vocabulary::kUnk);
  EXPECT_EQ(v.encode({"a", "d", "?"}), (std::vector<int64_t>{2, 5, 1}));
  EXPECT_EQ(Vocabulary::build({{"b", "a", "c", "a"}, {"b", "a", "d"}}, 2).size(), 4);
  EXPECT_EQ(Vocabulary::build({{"b", "a", "c", "a"}, {"b", "a", "d"}}, 1, 3).size(), 3);

  const Vocabulary labels = Vocabulary::labels({"pos", "neg", "pos"});
  EXPECT_EQ(labels.tokens(), (std::vector<std::string>{"neg", "pos"}));
  expect_error([&] { labels.id("neutral"); }, {"unknown label 'neutral'"});

  const Vocabulary back = Vocabulary::from_tokens(v.tokens(), true);
  EXPECT_EQ(back.tokens(), v.tokens());
  EXPECT_EQ(back.id("c"), v.id("c"));
  expect_error([] { Vocabulary::from_tokens({"a", "a"}, false); }, {"listed twice"});
  expect_error([] { Vocabulary::from_tokens({"a"}, true); }, {"<pad>, <unk>"});
}

TEST(Encode, UnknownEvaluationLabelsNameTheLine) {
  const auto train = parse_tsv("a b\tpos\nc\tneg\n", "train.tsv");
  const auto eval = parse_tsv("a\tpos\nz\tmaybe\n", "eval.tsv");
  std::vector<std::vector<std::string>> texts;
  std::vector<std::string> labels;
  for (const auto& e : train)
    texts.push_back(e.tokens), labels.push_back(e.label);
  const Vocabulary tv = Vocabulary::build(texts), lv = Vocabulary::labels(labels);
  const Dataset d = encode_classification(train, tv, lv, "train.tsv");
  EXPECT_EQ(d.labels, (std::vector<int64_t>{1, 0}));
  EXPECT_NO_THROW(d.validate("test"));
  expect_error([&] { encode_classification(eval, tv, lv, "eval.tsv"); },
               {"eval.tsv:2:", "label 'maybe'"});

  const auto s = parse_conllu(kConllu, "es.conllu");
  const Vocabulary tags = Vocabulary::labels({"VERB", "ADP", "DET", "NOUN", "PUNCT"});
  expect_error([&] { encode_tagging(s, tv, tags, "es.conllu"); }, {"es.conllu:12:", "tag 'INTJ'"});
}

TEST(Dataset, TruncateCutsTokensAndTags) {
  TaskOptions o;
  o.min_len = o.max_len = 10;
  Dataset d = generate_task(o, 3, 0, 0);
  EXPECT_EQ(truncate(d, 4), 3);
  EXPECT_EQ(d.max_length(), 4);
  EXPECT_EQ(d.tags[0].size(), 4u);
  EXPECT_EQ(truncate(d, 4), 0);
}

// --- batching --------------------------------------------------------------------------------

TEST(Batch, PadsAndRecordsValidLens) {
  Dataset d;
  d.type = TaskType::kTagging;
  d.vocab_size = 10;
  d.num_classes = 3;
  d.inputs = {{5, 6, 7}, {8}, {9, 9}};
  d.tags = {{0, 1, 2}, {2}, {1, kIgnoreTag}};
  const Batch b = make_batch(d, {1, 0});
  EXPECT_EQ(b.ids.shape(), (Shape{2, 3}));
  EXPECT_EQ(b.ids.to_vector(), (std::vector<double>{8, 0, 0, 5, 6, 7}));
  EXPECT_EQ(b.valid_lens.to_vector(), (std::vector<double>{1, 3}));
  EXPECT_EQ(b.targets.to_vector(), (std::vector<double>{2, -100, -100, 0, 1, 2}));
  EXPECT_EQ(b.tokens, 4);
  EXPECT_EQ(make_batch(d, {2}, 5).ids.shape(), (Shape{1, 5}));  // pad_to widens

  const auto all = make_batches(d, 2);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1].size(), 1);
  expect_error([&] { make_batch(d, {3}); }, {"make_batch", "example 3"});

  Dataset c;
  c.type = TaskType::kClassification;
  c.vocab_size = 10;
  c.num_classes = 2;
  c.inputs = {{2, 3}, {4}};
  c.labels = {1, 0};
  const Batch cb = make_batch(c, {0, 1});
  EXPECT_EQ(cb.targets.shape(), (Shape{2}));
  EXPECT_EQ(cb.targets.to_vector(), (std::vector<double>{1, 0}));
}

TEST(EpochSampler, EveryEpochIsAPermutationAndStepsAreReproducible) {
  EpochSampler s(10, 4, 3);
  std::vector<int64_t> seen;
  for (int64_t step = 0; step < 5; ++step)
    for (int64_t i : s.indices(step))
      seen.push_back(i);
  // Steps 0..4 cover positions 0..19: epochs 0 and 1, each a permutation of 0..9.
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> e(seen.begin() + epoch * 10, seen.begin() + epoch * 10 + 10);
    std::sort(e.begin(), e.end());
    for (int64_t i = 0; i < 10; ++i)
      EXPECT_EQ(e[static_cast<size_t>(i)], i);
  }
  EpochSampler fresh(10, 4, 3);  // a resumed run asks for step 3 first
  EXPECT_EQ(fresh.indices(3), s.indices(3));
  EXPECT_NE(EpochSampler(10, 4, 4).indices(0), EpochSampler(10, 4, 3).indices(0));
}

TEST(Dataset, HoldoutSplitKeepsEveryExampleOnce) {
  TaskOptions o;
  o.task = GeneratedTask::kSorted;
  const Dataset d = generate_task(o, 20, 0, 0);
  const auto [train, held] = split_holdout(d, 0.25, 1);
  EXPECT_EQ(train.size(), 15);
  EXPECT_EQ(held.size(), 5);
  std::multiset<std::vector<int64_t>> all(d.inputs.begin(), d.inputs.end()), parts;
  parts.insert(train.inputs.begin(), train.inputs.end());
  parts.insert(held.inputs.begin(), held.inputs.end());
  EXPECT_EQ(all, parts);
  EXPECT_EQ(train.labels.size(), 15u);
}

}  // namespace
}  // namespace attn::model
