// libFuzzer target for the training-data readers (attn/model/data.hpp, seq2seq_data.hpp):
// parse_tsv, parse_conllu and parse_seq2seq_tsv on in-memory text. The first byte picks the
// reader (byte % 4: TSV, CoNLL-U with UPOS, with XPOS, source<TAB>target; for the last, bit 2
// turns on d2l's preprocessing); the rest is the file. Any input must either parse or end in
// attn::Error; a crash, a sanitizer report, another exception type or a broken invariant of a
// parsed result is a bug.
//
// What a parsed result must satisfy (the readers' documented contract):
//   - TSV: every example has >= 1 token and a non-empty label; no token is empty or holds a
//     space, tab or newline; the label holds no tab or newline; line numbers increase.
//   - CoNLL-U: tokens and tags pair up one to one, none empty, none holding a tab or newline;
//     no tag is "_"; sentences' first lines increase.
//   - source<TAB>target: both sides have >= 1 token, none empty or holding a space, tab or
//     newline, all valid UTF-8; line numbers increase.
// Parsed data then goes the way training takes it: vocabularies, encoding, Dataset::validate,
// and padded batches, whose shapes and valid_lens must agree with the sequences. Seq2seq data
// also checks the vocabularies' JSON round trip, teacher forcing (dec_input = <bos> + labels
// shifted), that the label rows read back as the targets, and BLEU of a target against itself.
#include "attn/core/error.hpp"
#include "attn/model/data.hpp"
#include "attn/model/seq2seq_data.hpp"
#include "model/data/unicode_lower.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace attn;
using namespace attn::model;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_data_readers: %s\n", what);
  std::abort();
}

void expect(bool ok, const char* what) {
  if (!ok) fail(what);
}

bool has_any(std::string_view s, std::string_view chars) {
  return s.find_first_of(chars) != std::string_view::npos;
}

// Batches of the whole dataset: (B, T) ids padded with kPad, lengths equal to the sequences'.
void check_batches(const Dataset& data) {
  int64_t seen = 0;
  for (const Batch& b : make_batches(data, 3)) {
    expect(b.ids.ndim() == 2 && b.valid_lens.ndim() == 1, "batch ranks");
    for (int64_t i = 0; i < b.size(); ++i) {
      const auto& seq = data.inputs[static_cast<size_t>(seen + i)];
      const int64_t len = static_cast<int64_t>(b.valid_lens.at({i}));
      expect(len == static_cast<int64_t>(seq.size()), "valid_lens differs from the sequence");
      for (int64_t t = 0; t < b.ids.dim(1); ++t) {
        const int64_t id = static_cast<int64_t>(b.ids.at({i, t}));
        expect(t < len ? id == seq[static_cast<size_t>(t)] : id == Vocabulary::kPad,
               "batch ids differ from the sequence or its padding");
      }
    }
    seen += b.size();
  }
  expect(seen == data.size(), "batches do not cover the dataset");
}

// Only the parse may reject the input: an Error from a later step on parsed data escapes the
// fuzzer (libFuzzer reports the uncaught exception as a crash).
void fuzz_tsv(std::string_view text) {
  std::vector<TextExample> examples;
  try {
    examples = parse_tsv(text, "fuzz.tsv");
  } catch (const attn::Error&) {
    return;
  }
  expect(!examples.empty(), "parse_tsv returned no example without an error");
  int64_t last_line = 0;
  std::vector<std::vector<std::string>> sequences;
  std::vector<std::string> labels;
  for (const TextExample& e : examples) {
    expect(!e.tokens.empty(), "TSV example without tokens");
    for (const std::string& t : e.tokens)
      expect(!t.empty() && !has_any(t, " \t\n"), "bad TSV token");
    expect(!e.label.empty() && !has_any(e.label, "\t\n"), "bad TSV label");
    expect(e.line > last_line, "TSV line numbers do not increase");
    last_line = e.line;
    sequences.push_back(e.tokens);
    labels.push_back(e.label);
  }
  const Vocabulary tokens = Vocabulary::build(sequences, 1, 0);
  const Vocabulary classes = Vocabulary::labels(labels);
  const Dataset data = encode_classification(examples, tokens, classes, "fuzz.tsv");
  data.validate("fuzz_data_readers");
  expect(data.size() == static_cast<int64_t>(examples.size()), "encoded size differs");
  check_batches(data);
}

void fuzz_conllu(std::string_view text, ConlluTag column) {
  std::vector<TaggedSentence> sentences;
  try {
    sentences = parse_conllu(text, "fuzz.conllu", column);
  } catch (const attn::Error&) {
    return;
  }
  expect(!sentences.empty(), "parse_conllu returned no sentence without an error");
  int64_t last_line = 0;
  std::vector<std::vector<std::string>> forms;
  std::vector<std::string> all_tags;
  for (const TaggedSentence& s : sentences) {
    expect(!s.tokens.empty() && s.tokens.size() == s.tags.size(), "tokens and tags differ");
    for (const std::string& t : s.tokens)
      expect(!t.empty() && !has_any(t, "\t\n"), "bad FORM");
    for (const std::string& t : s.tags)
      expect(!t.empty() && t != "_" && !has_any(t, "\t\n"), "bad tag");
    expect(s.line > last_line, "CoNLL-U sentence lines do not increase");
    last_line = s.line;
    forms.push_back(s.tokens);
    all_tags.insert(all_tags.end(), s.tags.begin(), s.tags.end());
  }
  const Vocabulary tokens = Vocabulary::build(forms, 1, 0);
  const Vocabulary tags = Vocabulary::labels(all_tags);
  const Dataset data = encode_tagging(sentences, tokens, tags, "fuzz.conllu");
  data.validate("fuzz_data_readers");
  check_batches(data);
}

void check_seq2seq_batch(const Seq2SeqDataset& data, const std::vector<Seq2SeqExample>& examples,
                         const Vocabulary& tgt, const Seq2SeqBatchOptions& o) {
  std::vector<int64_t> all(static_cast<size_t>(data.size()));
  for (size_t i = 0; i < all.size(); ++i)
    all[i] = static_cast<int64_t>(i);
  const Seq2SeqBatch b = make_seq2seq_batch(data, all, o);
  expect(b.size() == data.size() && b.src.dim(1) <= o.num_steps && b.labels.dim(1) <= o.num_steps,
         "seq2seq batch shape");
  const int64_t T = b.labels.dim(1);
  for (int64_t r = 0; r < b.size(); ++r) {
    const auto& target = examples[static_cast<size_t>(r)].target;
    const int64_t m = static_cast<int64_t>(target.size());
    expect(static_cast<int64_t>(b.tgt_valid_lens.at({r})) == std::min(m + 1, o.num_steps),
           "tgt_valid_lens differs from the target length");
    expect(static_cast<int64_t>(b.dec_input.at({r, 0})) == Vocabulary::kBos, "no <bos>");
    for (int64_t t = 1; t < T; ++t)
      expect(b.dec_input.at({r, t}) == b.labels.at({r, t - 1}), "teacher forcing shift");
    // The label row reads back as the target (literal specials became <unk>), cut to T.
    std::vector<int64_t> row(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t)
      row[static_cast<size_t>(t)] = static_cast<int64_t>(b.labels.at({r, t}));
    const std::vector<std::string> back = ids_to_tokens(row, tgt);
    expect(static_cast<int64_t>(back.size()) == std::min(m, T), "label row length");
    for (size_t i = 0; i < back.size(); ++i)
      expect(back[i] == target[i] || back[i] == "<unk>", "label row differs from the target");
  }
}

void fuzz_seq2seq_tsv(std::string_view text, bool d2l) {
  std::vector<Seq2SeqExample> examples;
  try {
    examples = parse_seq2seq_tsv(text, "fuzz.tsv", d2l ? TextPreprocess::d2l() : TextPreprocess{});
  } catch (const attn::Error&) {
    return;
  }
  expect(!examples.empty(), "parse_seq2seq_tsv returned no pair without an error");
  int64_t last_line = 0;
  for (const Seq2SeqExample& e : examples) {
    expect(!e.source.empty() && !e.target.empty(), "seq2seq pair with an empty side");
    for (const auto* side : {&e.source, &e.target})
      for (const std::string& t : *side)
        expect(!t.empty() && !has_any(t, " \t\n") &&
                   attn::model::detail::find_invalid_utf8(t) == std::string::npos,
               "bad seq2seq token");
    expect(e.line > last_line, "seq2seq line numbers do not increase");
    last_line = e.line;
  }
  const auto [src, tgt] = build_seq2seq_vocabularies(examples, 1, 0);
  for (const Vocabulary* v : {&src, &tgt})
    expect(Vocabulary::from_json(v->to_json(), Reserved::kSeq2Seq).tokens() == v->tokens(),
           "vocabulary JSON round trip");
  const Seq2SeqDataset data = encode_seq2seq(examples, src, tgt);
  data.validate("fuzz_data_readers");
  for (int64_t steps : {1, 3, 8})
    for (bool trim : {false, true})
      check_seq2seq_batch(data, examples, tgt, {.num_steps = steps, .trim_to_longest = trim});
  const Seq2SeqExample& first = examples.front();
  expect(bleu(first.target, first.target, 4) == 1.0, "BLEU of a target against itself");
  const double b = bleu(first.source, first.target, 4);
  expect(b >= 0.0 && b <= 1.0, "BLEU outside [0, 1]");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      fuzz_tsv(text);
      break;
    case 1:
      fuzz_conllu(text, ConlluTag::kUpos);
      break;
    case 2:
      fuzz_conllu(text, ConlluTag::kXpos);
      break;
    default:
      fuzz_seq2seq_tsv(text, (data[0] >> 2) & 1);
      break;
  }
  return 0;
}
