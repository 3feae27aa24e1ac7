// Sequence-to-sequence data: d2l's preprocessing vectors (reference/semantics-seq2seq.md section
// 7.1), the "source<TAB>target" reader and its errors, vocabularies with fixed reserved ids and
// their JSON form, d2l's _build_arrays example token for token (section 7.2), teacher forcing,
// the epoch sampler's determinism, the generated tasks (dates, copy, reverse) and their disjoint
// held-out split, and BLEU against d2l's Python (section 7.5 and
// tests/fixtures/seq2seq_bleu_vectors.py).
#include "attn/model/seq2seq_data.hpp"
#include "attn/model/seq2seq_tasks.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
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

// Row r of a (B, T) I64 tensor as tokens of `vocab` (all T positions, padding included).
Tokens row_tokens(const Tensor& t, int64_t r, const Vocabulary& vocab) {
  Tokens out;
  for (int64_t c = 0; c < t.dim(1); ++c)
    out.push_back(vocab.token(static_cast<int64_t>(t.at({r, c}))));
  return out;
}

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> out;
  for (double v : t.to_vector())
    out.push_back(static_cast<int64_t>(v));
  return out;
}

// --- preprocessing -----------------------------------------------------------------------------

TEST(Preprocess, D2lVectors) {
  // reference/semantics-seq2seq.md 7.1: d2l's _preprocess on whole lines.
  const TextPreprocess d2l = TextPreprocess::d2l();
  EXPECT_EQ(preprocess_text("Go.\tVa !", d2l), "go .\tva !");
  EXPECT_EQ(preprocess_text("Hi.\tSalut\u202f!", d2l), "hi .\tsalut !");
  EXPECT_EQ(preprocess_text("Wait...\tAttends\u00a0!", d2l), "wait . . .\tattends !");
  EXPECT_EQ(preprocess_text("Who?Me,no!\tQui ?", d2l), "who ?me ,no !\tqui ?");
  EXPECT_EQ(preprocess_text(".Hello,  World!", d2l), ".hello ,  world !");
  EXPECT_EQ(preprocess_text("A\t.B", d2l), "a\t .b");
  // d2l's _tokenize split: spaces only, empty tokens dropped.
  EXPECT_EQ(split_tokens(".hello ,  world !"), (Tokens{".hello", ",", "world", "!"}));
  EXPECT_EQ(split_tokens("  "), Tokens{});
  EXPECT_EQ(tokenize_text("Wait...", d2l), (Tokens{"wait", ".", ".", "."}));
}

TEST(Preprocess, EachOptionAloneAndUnicodeLowerCase) {
  EXPECT_EQ(preprocess_text("Go.\u00a0Now!", {}), "Go.\u00a0Now!");  // all off: unchanged
  EXPECT_EQ(preprocess_text("Go.\u00a0Now!", {.nbsp_to_space = true}), "Go. Now!");
  EXPECT_EQ(preprocess_text("Go.\u00a0Now!", {.lowercase = true}), "go.\u00a0now!");
  EXPECT_EQ(preprocess_text("Go. Now!", {.space_before_punct = true}), "Go . Now !");
  // Python's str.lower() on code points (values printed by python3 -c "print(s.lower())").
  const TextPreprocess lower{.lowercase = true};
  EXPECT_EQ(preprocess_text("\u00c7a \u00c9T\u00c9 \u0152uvre", lower),
            "\u00e7a \u00e9t\u00e9 \u0153uvre");             // Ça ÉTÉ Œuvre
  EXPECT_EQ(preprocess_text("\u0130x", lower), "i\u0307x");  // İ -> i + dot
  EXPECT_EQ(preprocess_text("\u0401\u0416 \u01c5 \u216b", lower), "\u0451\u0436 \u01c6 \u217b");
  EXPECT_EQ(preprocess_text("\U00010400", lower), "\U00010428");  // Deseret, 4 UTF-8 bytes
  // The documented departure: Python writes a final sigma (U+03C2) at a word's end.
  EXPECT_EQ(preprocess_text("\u03a3\u0391\u03a3", lower), "\u03c3\u03b1\u03c3");
  // A mark after a multibyte letter gets its space (continuation bytes are never marks).
  EXPECT_EQ(preprocess_text("\u00c9t\u00e9!", TextPreprocess::d2l()), "\u00e9t\u00e9 !");
}

// --- reader ------------------------------------------------------------------------------------

TEST(Seq2SeqTsv, PairsLinesCrlfAndBlankLines) {
  const auto ex = parse_seq2seq_tsv("Go.\tVa !\r\n\r\n   \nHi.\tSalut !\r\nx\ty", "t.tsv",
                                    TextPreprocess::d2l());
  ASSERT_EQ(ex.size(), 3u);
  EXPECT_EQ(ex[0].source, (Tokens{"go", "."}));
  EXPECT_EQ(ex[0].target, (Tokens{"va", "!"}));
  EXPECT_EQ(ex[0].line, 1);
  EXPECT_EQ(ex[1].source, (Tokens{"hi", "."}));
  EXPECT_EQ(ex[1].line, 4);
  EXPECT_EQ(ex[2].target, Tokens{"y"});  // no final newline
  EXPECT_EQ(ex[2].line, 5);
  // Without preprocessing the tokens are the text split on spaces.
  EXPECT_EQ(parse_seq2seq_tsv("Go.\tVa !", "t.tsv")[0].source, Tokens{"Go."});
  // The pairs of section 7.1's _tokenize example (its malformed lines are errors here, below).
  const auto t = parse_seq2seq_tsv("go .\tva !\nhi .\tsalut !\n\nrun !\tcours !\nx\ty\n", "t.tsv");
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[2].source, (Tokens{"run", "!"}));
  EXPECT_EQ(t[2].target, (Tokens{"cours", "!"}));
}

TEST(Seq2SeqTsv, BadInputNamesFileAndLine) {
  expect_error([] { parse_seq2seq_tsv("go .\tva !\nbad line\n", "d.tsv"); },
               {"read_seq2seq_tsv", "d.tsv:2:", "found no tab"});
  expect_error([] { parse_seq2seq_tsv("a\tb\tCC-BY 2.0 (France)\n", "d.tsv"); },
               {"d.tsv:1:", "found 2 tabs", "cut -f1,2"});
  expect_error([] { parse_seq2seq_tsv("a\tb\n  \tb\n", "d.tsv"); },
               {"d.tsv:2:", "source before the tab is empty"});
  expect_error([] { parse_seq2seq_tsv("a\t \n", "d.tsv"); },
               {"d.tsv:1:", "target after the tab is empty"});
  expect_error([] { parse_seq2seq_tsv("a\tb\nc\xff\td\n", "d.tsv"); },
               {"d.tsv:2:", "byte 2 (0xFF) is not valid UTF-8"});
  // Not UTF-8 (RFC 3629): a bad continuation, overlong forms, a surrogate, past U+10FFFF, cut.
  for (const char* bad : {"\xc3\x28", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80",
                          "\xf4\x90\x80\x80", "\xf8\x88\x80\x80\x80", "x\xe2\x82"})
    expect_error([&] { parse_seq2seq_tsv(std::string("ok\tfine\n") + bad + "\ty\n", "d.tsv"); },
                 {"d.tsv:2:", "is not valid UTF-8"});
  EXPECT_EQ(parse_seq2seq_tsv("\xf0\x9f\x98\x80 \xed\x9f\xbf\t\xf4\x8f\xbf\xbf", "d.tsv")[0].source,
            (Tokens{"\U0001F600", "\uD7FF"}));  // the largest code points around the gaps
  expect_error([] { parse_seq2seq_tsv("", "empty.tsv"); }, {"empty.tsv: no pairs"});
  expect_error([] { parse_seq2seq_tsv("\n \n\t\n", "blank.tsv"); }, {"blank.tsv: no pairs"});
  expect_error([] { read_seq2seq_tsv("/nonexistent/dir/pairs.tsv"); },
               {"read_seq2seq_tsv", "cannot open '/nonexistent/dir/pairs.tsv'"});
}

TEST(Seq2SeqTsv, ReadsAFile) {
  const auto path = attn::testing::temp_path("attn_test_seq2seq_pairs").concat(".tsv");
  { std::ofstream(path) << "Hello!\tBonjour !\nThanks.\tMerci.\n"; }
  const auto ex = read_seq2seq_tsv(path.string(), TextPreprocess::d2l());
  std::filesystem::remove(path);
  ASSERT_EQ(ex.size(), 2u);
  EXPECT_EQ(ex[1].target, (Tokens{"merci", "."}));
}

// --- vocabularies ------------------------------------------------------------------------------

TEST(Seq2SeqVocabulary, ReservedIdsMinFreqUnknownsAndJson) {
  const auto ex = parse_seq2seq_tsv("a b a\tx y\nb a c\tx\n<eos> c\ty <pad>\n", "v.tsv");
  const auto [src, tgt] = build_seq2seq_vocabularies(ex, 2);
  // Reserved first at fixed ids, then by count (a 3, b 2, c 2: ties in byte order).
  EXPECT_EQ(src.tokens(), (Tokens{"<pad>", "<unk>", "<bos>", "<eos>", "a", "b", "c"}));
  EXPECT_EQ(tgt.tokens(), (Tokens{"<pad>", "<unk>", "<bos>", "<eos>", "x", "y"}));
  EXPECT_EQ(src.reserved(), Reserved::kSeq2Seq);
  EXPECT_EQ(src.num_reserved(), 4);
  EXPECT_EQ(src.id("<pad>"), Vocabulary::kPad);
  EXPECT_EQ(src.id("<unk>"), Vocabulary::kUnk);
  EXPECT_EQ(src.id("<bos>"), Vocabulary::kBos);
  EXPECT_EQ(src.id("<eos>"), Vocabulary::kEos);
  EXPECT_EQ(build_seq2seq_vocabularies(ex, 1).first.size(), 7);  // c already at 2
  EXPECT_EQ(build_seq2seq_vocabularies(ex, 3).first.size(), 5);  // only a
  EXPECT_EQ(build_seq2seq_vocabularies(ex, 1, 5).first.size(), 5);
  // Unknown words and literal specials in the text become <unk>.
  EXPECT_EQ(encode_seq2seq_tokens({"a", "zz", "<eos>", "<pad>", "<bos>", "<unk>", "c"}, src),
            (std::vector<int64_t>{4, 1, 1, 1, 1, 1, 6}));
  const Seq2SeqDataset d = encode_seq2seq(ex, src, tgt);
  EXPECT_NO_THROW(d.validate("test"));
  EXPECT_EQ(d.sources[2], (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(d.targets[2], (std::vector<int64_t>{5, 1}));

  // JSON round trip (what a checkpoint stores), and its errors.
  const std::string json = src.to_json();
  EXPECT_EQ(json, R"(["<pad>","<unk>","<bos>","<eos>","a","b","c"])");
  const Vocabulary back = Vocabulary::from_json(json, Reserved::kSeq2Seq);
  EXPECT_EQ(back.tokens(), src.tokens());
  EXPECT_EQ(back.reserved(), Reserved::kSeq2Seq);
  EXPECT_EQ(back.id("c"), 6);
  const Vocabulary unicode = Vocabulary::from_json(
      Vocabulary::from_tokens({"<pad>", "<unk>", "\u00e7a", "\""}, Reserved::kPadUnk).to_json(),
      Reserved::kPadUnk);
  EXPECT_EQ(unicode.token(2), "\u00e7a");
  EXPECT_EQ(unicode.token(3), "\"");
  expect_error([] { Vocabulary::from_json("[\"<pad>\",", Reserved::kSeq2Seq); },
               {"Vocabulary::from_json", "not JSON"});
  expect_error([] { Vocabulary::from_json("{}", Reserved::kSeq2Seq); }, {"expected a JSON array"});
  expect_error([] { Vocabulary::from_json("[\"<pad>\", 3]", Reserved::kPadUnk); },
               {"entry 1 is number"});
  expect_error([&] { Vocabulary::from_json(R"(["<pad>","<unk>","a"])", Reserved::kSeq2Seq); },
               {"must start with <pad>, <unk>, <bos>, <eos>"});
  expect_error([&] { Vocabulary::from_json(R"(["<pad>","<unk>","a","a"])", Reserved::kPadUnk); },
               {"listed twice"});
  expect_error(
      [] {
        Vocabulary::from_tokens({"<pad>", "<unk>", "\xff"}, true).to_json();
      },
      {"Vocabulary::to_json", "UTF-8"});
  // An encoder vocabulary cannot feed encode_seq2seq (no <bos>/<eos>).
  const Vocabulary& target_vocab = tgt;  // (clang cannot capture a structured binding)
  expect_error([&] { encode_seq2seq(ex, Vocabulary::build({{"a"}}), target_vocab); },
               {"encode_seq2seq"});
}

// --- batching ----------------------------------------------------------------------------------

// reference/semantics-seq2seq.md 7.2: d2l's _build_arrays (num_steps = 4, min_freq = 2). The ids
// differ (d2l sorts its vocabulary by code point and reserves nothing), so the rows are compared
// as tokens; every row is d2l's, token for token.
TEST(Seq2SeqBatch, D2lBuildArraysTokenForToken) {
  const auto ex = parse_seq2seq_tsv(
      "Go.\tVa !\nHi.\tSalut !\nRun!\tCours !\nRun!\tCourez !\nWho?\tQui ?\nWow!\t\u00c7a alors !\n"
      "Go now, run fast!\tVa maintenant, cours vite !\n",
      "fra.tsv", TextPreprocess::d2l());
  const auto [src_vocab, tgt_vocab] = build_seq2seq_vocabularies(ex, 2);
  // d2l's word sets: src {!, ., go, run}, tgt {!, cours, va}; ours by count (! 4, run 3).
  EXPECT_EQ(src_vocab.tokens(),
            (Tokens{"<pad>", "<unk>", "<bos>", "<eos>", "!", "run", ".", "go"}));
  EXPECT_EQ(tgt_vocab.tokens(), (Tokens{"<pad>", "<unk>", "<bos>", "<eos>", "!", "cours", "va"}));
  const Seq2SeqDataset d = encode_seq2seq(ex, src_vocab, tgt_vocab);
  const Seq2SeqBatch b = make_seq2seq_batch(d, {0, 1, 2, 3, 4, 5, 6}, {.num_steps = 4});
  ASSERT_EQ(b.src.shape(), (Shape{7, 4}));
  ASSERT_EQ(b.dec_input.shape(), (Shape{7, 4}));
  ASSERT_EQ(b.labels.shape(), (Shape{7, 4}));
  EXPECT_EQ(b.src.dtype(), DType::I64);
  // d2l's arrays through d2l's vocabularies ['!', '.', '<eos>', '<pad>', '<unk>', 'go', 'run'] and
  // ['!', '<bos>', '<eos>', '<pad>', '<unk>', 'cours', 'va'].
  const std::vector<Tokens> src = {
      {"go", ".", "<eos>", "<pad>"},        {"<unk>", ".", "<eos>", "<pad>"},
      {"run", "!", "<eos>", "<pad>"},       {"run", "!", "<eos>", "<pad>"},
      {"<unk>", "<unk>", "<eos>", "<pad>"}, {"<unk>", "!", "<eos>", "<pad>"},
      {"go", "<unk>", "<unk>", "run"}};
  const std::vector<Tokens> dec_in = {
      {"<bos>", "va", "!", "<eos>"},        {"<bos>", "<unk>", "!", "<eos>"},
      {"<bos>", "cours", "!", "<eos>"},     {"<bos>", "<unk>", "!", "<eos>"},
      {"<bos>", "<unk>", "<unk>", "<eos>"}, {"<bos>", "<unk>", "<unk>", "!"},
      {"<bos>", "va", "<unk>", "<unk>"}};
  const std::vector<Tokens> label = {
      {"va", "!", "<eos>", "<pad>"},        {"<unk>", "!", "<eos>", "<pad>"},
      {"cours", "!", "<eos>", "<pad>"},     {"<unk>", "!", "<eos>", "<pad>"},
      {"<unk>", "<unk>", "<eos>", "<pad>"}, {"<unk>", "<unk>", "!", "<eos>"},
      {"va", "<unk>", "<unk>", "cours"}};
  for (int64_t r = 0; r < 7; ++r) {
    EXPECT_EQ(row_tokens(b.src, r, src_vocab), src[static_cast<size_t>(r)]) << "row " << r;
    EXPECT_EQ(row_tokens(b.dec_input, r, tgt_vocab), dec_in[static_cast<size_t>(r)]) << "row " << r;
    EXPECT_EQ(row_tokens(b.labels, r, tgt_vocab), label[static_cast<size_t>(r)]) << "row " << r;
  }
  EXPECT_EQ(ints(b.src_valid_lens), (std::vector<int64_t>{3, 3, 3, 3, 3, 3, 4}));
  // The labels that count in the loss: d2l's mask (labels != <pad>) marks the same positions.
  EXPECT_EQ(ints(b.tgt_valid_lens), (std::vector<int64_t>{3, 3, 3, 3, 3, 4, 4}));
  EXPECT_EQ(b.src_tokens, 22);
  EXPECT_EQ(b.tgt_tokens, 23);
}

TEST(Seq2SeqBatch, TeacherForcingShiftTrimAndSources) {
  Seq2SeqDataset d;
  d.src_vocab_size = d.tgt_vocab_size = 20;
  d.sources = {{4, 5, 6}, {7}, {}};
  d.targets = {{8, 9}, {10, 11, 12, 13, 14, 15}, {16}};
  EXPECT_NO_THROW(d.validate("test"));
  const Seq2SeqBatch b = make_seq2seq_batch(d, {1, 0, 2}, {.num_steps = 5});
  // labels: y + <eos>, cut at 5 (row 0 loses its <eos>); dec_input = <bos>, labels[:, :-1].
  EXPECT_EQ(ints(b.labels),
            (std::vector<int64_t>{10, 11, 12, 13, 14, 8, 9, 3, 0, 0, 16, 3, 0, 0, 0}));
  EXPECT_EQ(ints(b.dec_input),
            (std::vector<int64_t>{2, 10, 11, 12, 13, 2, 8, 9, 3, 0, 2, 16, 3, 0, 0}));
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(b.dec_input.at({r, 0}), Vocabulary::kBos);
    for (int64_t t = 1; t < 5; ++t)
      EXPECT_EQ(b.dec_input.at({r, t}), b.labels.at({r, t - 1}));
  }
  EXPECT_EQ(ints(b.src), (std::vector<int64_t>{7, 3, 0, 0, 0, 4, 5, 6, 3, 0, 3, 0, 0, 0, 0}));
  EXPECT_EQ(ints(b.src_valid_lens), (std::vector<int64_t>{2, 4, 1}));  // empty source: <eos>
  EXPECT_EQ(ints(b.tgt_valid_lens), (std::vector<int64_t>{5, 3, 2}));

  // trim_to_longest: each side padded to its longest row + <eos> (capped at num_steps); the
  // valid positions are those of the fixed-length batch.
  const Seq2SeqBatch t = make_seq2seq_batch(d, {0, 2}, {.num_steps = 5, .trim_to_longest = true});
  EXPECT_EQ(t.src.shape(), (Shape{2, 4}));
  EXPECT_EQ(t.labels.shape(), (Shape{2, 3}));
  EXPECT_EQ(ints(t.labels), (std::vector<int64_t>{8, 9, 3, 16, 3, 0}));
  EXPECT_EQ(ints(t.dec_input), (std::vector<int64_t>{2, 8, 9, 2, 16, 3}));
  EXPECT_EQ(make_seq2seq_batch(d, {1}, {.num_steps = 5, .trim_to_longest = true}).labels.shape(),
            (Shape{1, 5}));

  const auto all = make_seq2seq_batches(d, 2, {.num_steps = 6});
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1].size(), 1);
  expect_error([&] { make_seq2seq_batch(d, {3}, {}); }, {"make_seq2seq_batch", "pair 3"});
  expect_error([&] { make_seq2seq_batch(d, {0}, {.num_steps = 0}); }, {"num_steps must be >= 1"});

  // Sources alone (translation): the rows that lost their <eos> are reported.
  const SourceBatch s = make_source_batch({{4, 5, 6, 7}, {}, {8}}, {.num_steps = 4});
  EXPECT_EQ(ints(s.src), (std::vector<int64_t>{4, 5, 6, 7, 3, 0, 0, 0, 8, 3, 0, 0}));
  EXPECT_EQ(ints(s.valid_lens), (std::vector<int64_t>{4, 1, 2}));
  EXPECT_EQ(s.cut, (std::vector<int64_t>{0}));

  // Output rows back to tokens: up to the first <eos> or <pad>.
  const Vocabulary v =
      Vocabulary::from_tokens({"<pad>", "<unk>", "<bos>", "<eos>", "x", "y"}, Reserved::kSeq2Seq);
  const std::vector<int64_t> out = {4, 5, 1, 3, 4, 4};
  EXPECT_EQ(ids_to_tokens(out, v), (Tokens{"x", "y", "<unk>"}));
  EXPECT_EQ(ids_to_tokens(std::vector<int64_t>{5, 0, 4}, v), Tokens{"y"});
  EXPECT_EQ(ids_to_tokens(std::vector<int64_t>{3}, v), Tokens{});
}

TEST(Seq2SeqBatch, EpochSamplerIsAPureFunctionOfSeedAndStep) {
  const Seq2SeqTaskOptions o{.task = Seq2SeqTask::kReverse};
  const auto ex = generate_seq2seq_task(o, 23, 5, 0, TaskSplit::kTrain);
  const Seq2SeqDataset d =
      encode_seq2seq(ex, seq2seq_task_source_vocabulary(o), seq2seq_task_target_vocabulary(o));
  EpochSampler run(d.size(), 4, 11);
  std::vector<std::vector<int64_t>> seen;
  for (int64_t step = 0; step < 30; ++step)
    seen.push_back(run.indices(step));
  // A resumed run (a fresh sampler starting at any step) draws the same pairs and batches.
  for (int64_t step : {29, 0, 17, 6, 23}) {
    EpochSampler resumed(d.size(), 4, 11);
    EXPECT_EQ(resumed.indices(step), seen[static_cast<size_t>(step)]) << "step " << step;
    const Seq2SeqBatch a = make_seq2seq_batch(d, seen[static_cast<size_t>(step)], {.num_steps = 8});
    const Seq2SeqBatch b = make_seq2seq_batch(d, resumed.indices(step), {.num_steps = 8});
    EXPECT_EQ(a.src.to_vector(), b.src.to_vector());
    EXPECT_EQ(a.labels.to_vector(), b.labels.to_vector());
  }
  // Each epoch is a permutation of the pairs: steps 0..22 of batch 4 cover 4 epochs of 23.
  std::vector<int64_t> first_epoch;
  for (int64_t k = 0; k < 23; ++k)
    first_epoch.push_back(seen[static_cast<size_t>(k / 4)][static_cast<size_t>(k % 4)]);
  EXPECT_EQ(std::set<int64_t>(first_epoch.begin(), first_epoch.end()).size(), 23u);
  EXPECT_NE(EpochSampler(d.size(), 4, 12).indices(0), seen[0]);  // another seed, another order

  const auto [train, held] = split_holdout(d, 0.2, 3);
  EXPECT_EQ(train.size(), 19);
  EXPECT_EQ(held.size(), 4);
  EXPECT_EQ(split_holdout(d, 0.2, 3).second.sources, held.sources);
  expect_error([&] { split_holdout(d, 1.5, 0); }, {"fraction"});
}

// --- generated tasks ---------------------------------------------------------------------------

std::string join(const Tokens& t) {
  std::string s;
  for (const auto& w : t)
    s += (s.empty() ? "" : " ") + w;
  return s;
}

TEST(Seq2SeqTasks, DatesInWords) {
  EXPECT_EQ(join(date_in_words(2005, 3, 3, DateForm::kDayOfMonth)),
            "the third of march two thousand and five");
  EXPECT_EQ(join(date_in_words(2005, 3, 3, DateForm::kMonthDay)),
            "march the third two thousand and five");
  EXPECT_EQ(join(date_iso_tokens(2005, 3, 3)), "2005 - 03 - 03");
  EXPECT_EQ(join(date_in_words(1999, 12, 31, DateForm::kMonthDay)),
            "december the thirty first nineteen ninety nine");
  EXPECT_EQ(join(date_in_words(1900, 1, 1, DateForm::kDayOfMonth)),
            "the first of january nineteen hundred");
  EXPECT_EQ(join(date_in_words(1907, 7, 20, DateForm::kDayOfMonth)),
            "the twentieth of july nineteen oh seven");
  EXPECT_EQ(join(date_in_words(1912, 11, 12, DateForm::kDayOfMonth)),
            "the twelfth of november nineteen twelve");
  EXPECT_EQ(join(date_in_words(2000, 2, 29, DateForm::kDayOfMonth)),
            "the twenty ninth of february two thousand");
  EXPECT_EQ(join(date_in_words(2042, 9, 30, DateForm::kDayOfMonth)),
            "the thirtieth of september two thousand and forty two");
  EXPECT_EQ(join(date_iso_tokens(2099, 12, 31)), "2099 - 12 - 31");
  expect_error([] { date_in_words(1900, 2, 29, DateForm::kDayOfMonth); },
               {"1900-02-29 is not a date"});  // 1900 is not a leap year
  expect_error([] { date_iso_tokens(2001, 4, 31); }, {"2001-04-31"});
  expect_error([] { date_iso_tokens(2100, 1, 1); }, {"2100-01-01"});
}

TEST(Seq2SeqTasks, DeterministicAnswersAndVocabularies) {
  for (Seq2SeqTask task : {Seq2SeqTask::kDates, Seq2SeqTask::kCopy, Seq2SeqTask::kReverse}) {
    SCOPED_TRACE(seq2seq_task_name(task));
    const Seq2SeqTaskOptions o{.task = task};
    EXPECT_EQ(parse_seq2seq_task(seq2seq_task_name(task)), task);
    const auto a = generate_seq2seq_task(o, 300, 7, 3, TaskSplit::kTrain);
    const auto b = generate_seq2seq_task(o, 300, 7, 3, TaskSplit::kTrain);
    ASSERT_EQ(a.size(), 300u);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].source, b[i].source);
      EXPECT_EQ(a[i].target, b[i].target);
    }
    EXPECT_NE(a[0].source, generate_seq2seq_task(o, 1, 8, 3, TaskSplit::kTrain)[0].source);
    EXPECT_NE(a[0].source, generate_seq2seq_task(o, 1, 7, 4, TaskSplit::kTrain)[0].source);
    // Every token is in the task's vocabularies (no <unk>), within the advertised lengths.
    const Vocabulary src = seq2seq_task_source_vocabulary(o),
                     tgt = seq2seq_task_target_vocabulary(o);
    const auto [max_src, max_tgt] = seq2seq_task_max_lengths(o);
    const Seq2SeqDataset d = encode_seq2seq(a, src, tgt);
    EXPECT_NO_THROW(d.validate("test"));
    size_t longest_src = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      for (int64_t id : d.sources[i])
        EXPECT_NE(id, Vocabulary::kUnk) << join(a[i].source);
      for (int64_t id : d.targets[i])
        EXPECT_NE(id, Vocabulary::kUnk) << join(a[i].target);
      EXPECT_LE(static_cast<int64_t>(a[i].source.size()), max_src);
      EXPECT_LE(static_cast<int64_t>(a[i].target.size()), max_tgt);
      longest_src = std::max(longest_src, a[i].source.size());
      if (task == Seq2SeqTask::kCopy) {
        EXPECT_EQ(a[i].target, a[i].source);
      }
      if (task == Seq2SeqTask::kReverse) {
        EXPECT_EQ(a[i].target, Tokens(a[i].source.rbegin(), a[i].source.rend()));
      }
      if (task == Seq2SeqTask::kDates) {
        // The answer is the ISO form of the date the words name: rebuild the words from it.
        const Tokens& iso = a[i].target;
        const int y = std::stoi(iso[0]), m = std::stoi(iso[2]), day = std::stoi(iso[4]);
        const DateForm form = a[i].source[0] == "the" ? DateForm::kDayOfMonth : DateForm::kMonthDay;
        EXPECT_EQ(a[i].source, date_in_words(y, m, day, form));
      }
    }
    EXPECT_EQ(static_cast<int64_t>(longest_src), max_src);  // 300 draws reach the longest
  }
  EXPECT_EQ(seq2seq_task_source_vocabulary({}).size(), 70);   // 4 + 66 words
  EXPECT_EQ(seq2seq_task_target_vocabulary({}).size(), 236);  // 4 + "-" + 01..31 + 200 years
  EXPECT_EQ(seq2seq_task_target_vocabulary({.task = Seq2SeqTask::kCopy, .num_symbols = 5}).tokens(),
            (Tokens{"<pad>", "<unk>", "<bos>", "<eos>", "a", "b", "c", "d", "e"}));
  expect_error([] { parse_seq2seq_task("sort"); }, {"unknown task 'sort'"});
  expect_error([] { validate(Seq2SeqTaskOptions{.task = Seq2SeqTask::kCopy, .num_symbols = 27}); },
               {"num_symbols"});
  expect_error([] { validate(Seq2SeqTaskOptions{.task = Seq2SeqTask::kCopy, .min_len = 0}); },
               {"min_len"});
  expect_error(
      [] {
        validate(Seq2SeqTaskOptions{
            .task = Seq2SeqTask::kReverse, .num_symbols = 2, .min_len = 1, .max_len = 3});
      },
      {"only 14 distinct sequences"});
}

TEST(Seq2SeqTasks, HeldOutSplitNeverOverlapsTraining) {
  for (Seq2SeqTask task : {Seq2SeqTask::kDates, Seq2SeqTask::kCopy, Seq2SeqTask::kReverse}) {
    SCOPED_TRACE(seq2seq_task_name(task));
    const Seq2SeqTaskOptions o{.task = task, .num_symbols = 4, .min_len = 2, .max_len = 5};
    std::set<Tokens> train_keys, held_keys;
    // Many training batches (streams = steps) against one evaluation set.
    for (uint64_t step = 0; step < 20; ++step)
      for (const auto& e : generate_seq2seq_task(o, 100, 1, step, TaskSplit::kTrain)) {
        EXPECT_FALSE(seq2seq_task_held_out(o, e));
        train_keys.insert(task == Seq2SeqTask::kDates ? e.target : e.source);
      }
    for (const auto& e : generate_seq2seq_task(o, 500, 1, eval_stream(0), TaskSplit::kHeldOut)) {
      EXPECT_TRUE(seq2seq_task_held_out(o, e));
      held_keys.insert(task == Seq2SeqTask::kDates ? e.target : e.source);
    }
    for (const auto& k : held_keys)
      EXPECT_EQ(train_keys.count(k), 0u) << join(k);
    EXPECT_GT(held_keys.size(), task == Seq2SeqTask::kDates ? 400u : 50u);
  }
  // About 1 date in 10 is held out, the same dates whatever the seed.
  int64_t held = 0, all = 0;
  for (int y = 1900; y <= 2099; ++y)
    for (int m = 1; m <= 12; ++m) {
      const bool leap = y % 4 == 0 && y != 1900;
      const int days = m == 2                                    ? (leap ? 29 : 28)
                       : (m == 4 || m == 6 || m == 9 || m == 11) ? 30
                                                                 : 31;
      for (int day = 1; day <= days; ++day) {
        ++all;
        held += seq2seq_task_held_out({}, {.source = {}, .target = date_iso_tokens(y, m, day)});
      }
    }
  EXPECT_EQ(all, 73049);
  EXPECT_EQ(held, 7165);  // 9.8%; pinned: changing the split makes old evaluations incomparable
}

// --- scores ------------------------------------------------------------------------------------

TEST(Bleu, MatchesD2lPython) {
  struct Case {
    const char* pred;
    const char* label;
    int64_t k;
    double expected;
  };
  // reference/semantics-seq2seq.md 7.5, then tests/fixtures/seq2seq_bleu_vectors.py's output
  // (d2l 1.0's bleu, verbatim, in Python float64).
  const Case cases[] = {
      {"va !", "va !", 2, 1.0},
      {"j'ai perdu .", "j'ai perdu .", 2, 1.0},
      {"nous <unk> .", "il est calme .", 2, 0.0},
      {"il il il", "il est calme .", 2, 0.0},
      {"il est bien .", "il est calme .", 2, 0.6580370064762462},
      {"je suis <unk> .", "je suis chez moi .", 2, 0.5124797359336637},
      {"va", "va !", 2, 0.36787944117144233},
      {"", "va !", 2, 0.0},
      {"a b", "a b c d", 4, 0.36787944117144233},
      {"a b c d e", "a b c", 4, 0.0},
      {"a b c d", "a b c d", 4, 1.0},
      {"the cat sat on the mat", "the cat is on the mat", 4, 0.0},
      {"the the the the", "the cat the mat", 4, 0.0},
      {"a b a b a b", "a b a b", 3, 0.6589666468204242},
      {"2005 - 03 - 03", "2005 - 03 - 04", 4, 0.7576777383253357},
      {"2005 - 03 - 03", "2005 - 03 - 03", 4, 1.0},
      {"1999 - 12", "1999 - 12 - 31", 4, 0.513417119032592},
      {"x y z w v u", "x y z", 1, 0.7071067811865476},
      {"a  b", "a b", 2, 0.0},
      {"c b a d e f g h", "a b c d e f g h", 4, 0.7529055314486841},
      {"the cat sat on the mat today", "the cat sat on the mat", 4, 0.8449069275905315},
      {"b c d e a", "a b c d e", 4, 0.8471094639668741},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("'{}' vs '{}', k={}", c.pred, c.label, c.k));
    EXPECT_DOUBLE_EQ(bleu_text(c.pred, c.label, c.k), c.expected);
    if (std::string_view(c.pred).find("  ") == std::string_view::npos && *c.pred) {
      EXPECT_DOUBLE_EQ(bleu(split_tokens(c.pred), split_tokens(c.label), c.k), c.expected);
    }
  }
}

TEST(Bleu, EmptyKCorpusAndExactMatch) {
  EXPECT_EQ(bleu({}, {"a"}), 0.0);
  EXPECT_EQ(bleu({}, {}), 1.0);
  EXPECT_EQ(bleu({"a"}, {}), 0.0);
  EXPECT_EQ(bleu_text("", ""), 1.0);  // d2l: [''] against ['']
  expect_error([] { bleu({"a"}, {"a"}, 0); }, {"bleu", "k"});
  const std::vector<Tokens> preds = {{"2005", "-", "03", "-", "03"}, {"a", "b"}, {"x"}};
  const std::vector<Tokens> labels = {{"2005", "-", "03", "-", "04"}, {"a", "b"}, {"y"}};
  EXPECT_DOUBLE_EQ(mean_bleu(preds, labels, 4), (0.7576777383253357 + 1.0 + 0.0) / 3.0);
  EXPECT_DOUBLE_EQ(exact_match(preds, labels), 1.0 / 3.0);
  expect_error([&] { exact_match(preds, {}); }, {"exact_match", "3 predictions and 0 labels"});
  expect_error([] { mean_bleu({}, {}); }, {"mean_bleu"});
}

}  // namespace
}  // namespace attn::model
