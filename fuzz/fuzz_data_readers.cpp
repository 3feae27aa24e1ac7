// libFuzzer target for the training-data readers (attn/model/data.hpp): parse_tsv and
// parse_conllu on in-memory text. The first byte picks the reader (TSV, CoNLL-U with UPOS, with
// XPOS); the rest is the file. Any input must either parse or end in attn::Error; a crash, a
// sanitizer report, another exception type or a broken invariant of a parsed result is a bug.
//
// What a parsed result must satisfy (the readers' documented contract):
//   - TSV: every example has >= 1 token and a non-empty label; no token is empty or holds a
//     space, tab or newline; the label holds no tab or newline; line numbers increase.
//   - CoNLL-U: tokens and tags pair up one to one, none empty, none holding a tab or newline;
//     no tag is "_"; sentences' first lines increase.
// Parsed data then goes the way training takes it: vocabularies, encoding, Dataset::validate,
// and padded batches, whose shapes and valid_lens must agree with the sequences.
#include "attn/core/error.hpp"
#include "attn/model/data.hpp"

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      fuzz_tsv(text);
      break;
    case 1:
      fuzz_conllu(text, ConlluTag::kUpos);
      break;
    default:
      fuzz_conllu(text, ConlluTag::kXpos);
      break;
  }
  return 0;
}
