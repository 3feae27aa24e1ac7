// Training data: token-id datasets, vocabularies, the two user formats (TSV for sequence
// classification, CoNLL-U for part-of-speech tagging) and batching with padding and valid_lens.
//
// Vocabulary: B batch, T padded length of a batch, V vocabulary size, C classes (or tags).
//
// Every reader error is an attn::Error whose message starts with "<file>:<line>: " and says
// what was expected, e.g.
//   read_tsv: data/train.tsv:17: expected "text<TAB>label", found no tab
#pragma once

#include "attn/core/tensor.hpp"

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace attn::model {

// What the model predicts: one class per sequence (n -> 1) or one tag per token (n -> n).
enum class TaskType : uint8_t { kClassification, kTagging };
const char* task_type_name(TaskType type);

// The target of a position that does not count in the loss or the accuracy: padding, or a
// position a generated task leaves out. It is softmax_cross_entropy's default ignore_index.
constexpr int64_t kIgnoreTag = -100;

// A whole dataset as token ids, before batching.
struct Dataset {
  TaskType type = TaskType::kClassification;
  std::vector<std::vector<int64_t>> inputs;  // token ids in [0, vocab_size), one row per example
  std::vector<int64_t> labels;               // classification: one class per example
  std::vector<std::vector<int64_t>> tags;    // tagging: one tag per token, or kIgnoreTag
  int64_t vocab_size = 0;
  int64_t num_classes = 0;  // labels and tags lie in [0, num_classes)

  int64_t size() const { return static_cast<int64_t>(inputs.size()); }
  int64_t max_length() const;
  int64_t num_tokens() const;
  // Checks the invariants above (row counts, id and target ranges, no empty sequence); throws
  // Error(op) naming the first offending example.
  void validate(const char* op) const;
};

// Cuts every sequence (and its tags) to at most `max_len` tokens. Returns how many were cut.
int64_t truncate(Dataset& data, int64_t max_len);

// The reserved tokens at the start of a vocabulary, at fixed ids whatever the data:
//   kNone     labels and tags: nothing reserved
//   kPadUnk   encoder inputs: <pad> = 0, <unk> = 1
//   kSeq2Seq  sequence-to-sequence sources and targets: <pad> = 0, <unk> = 1, <bos> = 2,
//             <eos> = 3 (the first two as kPadUnk, so a source vocabulary also serves an encoder)
// d2l 1.0's Vocab reserves nothing for machine translation (its specials are counted like words
// and fall to <unk> under min_freq) and sorts everything by code point, so its <unk> id depends
// on the data; attn keeps the specials fixed (see docs/seq2seq-data.md).
enum class Reserved : uint8_t { kNone, kPadUnk, kSeq2Seq };

// Maps strings to dense ids. A token vocabulary starts with its reserved tokens (<pad> = 0 and
// <unk> = 1; d2l's Vocab has <unk> = 0; we put <pad> first so that padding is id 0 as in most
// toolkits); a label vocabulary has none.
class Vocabulary {
 public:
  static constexpr int64_t kPad = 0, kUnk = 1, kBos = 2, kEos = 3;

  explicit Vocabulary(bool specials = true);
  explicit Vocabulary(Reserved reserved);
  // Token vocabulary of `sequences`: the reserved tokens, then every token seen at least
  // `min_freq` times, most frequent first, ties in byte order (so the ids do not depend on the
  // file's order of first appearance); at most `max_size` entries in all (0: no limit). A literal
  // reserved token in the data ("<pad>", ...) counts towards the reserved entry, not a new one.
  static Vocabulary build(const std::vector<std::vector<std::string>>& sequences,
                          int64_t min_freq = 1, int64_t max_size = 0,
                          Reserved reserved = Reserved::kPadUnk);
  // Label vocabulary: every distinct label in byte order, no specials.
  static Vocabulary labels(const std::vector<std::string>& labels);
  // Rebuilds a vocabulary from its token list (tokens()); `specials` tells whether the first two
  // entries are <pad> and <unk>. Error when the list does not start with the reserved tokens or
  // names a token twice.
  static Vocabulary from_tokens(const std::vector<std::string>& tokens, bool specials);
  static Vocabulary from_tokens(const std::vector<std::string>& tokens, Reserved reserved);
  // Serialisation for checkpoints (safetensors metadata is text): a JSON array of the tokens in id
  // order, e.g. ["<pad>","<unk>","<bos>","<eos>","the","of"]. from_json checks the text is such an
  // array and then what from_tokens checks; Error("Vocabulary::from_json") otherwise. to_json
  // throws Error for a token that is not valid UTF-8 (JSON strings are Unicode).
  std::string to_json() const;
  static Vocabulary from_json(std::string_view json, Reserved reserved);

  // Appends `token` if new; returns its id.
  int64_t add(const std::string& token);
  bool contains(const std::string& token) const { return index_.count(token) != 0; }
  // The id of `token`: kUnk when absent from a token vocabulary; Error("Vocabulary") for an
  // unknown label (a label vocabulary has no <unk>).
  int64_t id(const std::string& token) const;
  const std::string& token(int64_t id) const;
  std::vector<int64_t> encode(const std::vector<std::string>& tokens) const;

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  bool has_specials() const { return reserved_ != Reserved::kNone; }
  Reserved reserved() const { return reserved_; }
  // How many ids the reserved tokens take: 0, 2 or 4.
  int64_t num_reserved() const;
  const std::vector<std::string>& tokens() const { return tokens_; }

 private:
  Reserved reserved_;
  std::vector<std::string> tokens_;
  std::map<std::string, int64_t, std::less<>> index_;
};

// --- TSV: one example per line, "text<TAB>label" ---------------------------------------------
// text is split on spaces (runs of spaces and a trailing '\r' are ignored); blank lines are
// skipped. Errors: no tab, more than one tab, empty text, empty label, no example at all.
struct TextExample {
  std::vector<std::string> tokens;
  std::string label;
  int64_t line = 0;  // 1-based line number in the file
};

std::vector<TextExample> parse_tsv(std::string_view text, const std::string& file_name);
std::vector<TextExample> read_tsv(const std::string& path);

// --- CoNLL-U (universaldependencies.org/format.html) -----------------------------------------
// Sentences are blocks of token lines separated by blank lines; '#' lines are comments. A token
// line has 10 tab-separated fields ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC. We keep
// FORM and the tag column (UPOS by default). Multiword token lines (ID "1-2") and empty nodes
// (ID "1.1") are skipped: the words they span have lines of their own. Errors: a field count
// other than 10, an ID that is not the next integer of its sentence, an empty FORM or tag, a
// '_' tag (no annotation), no sentence at all.
enum class ConlluTag : uint8_t { kUpos, kXpos };

struct TaggedSentence {
  std::vector<std::string> tokens, tags;
  int64_t line = 0;  // line of the sentence's first token
};

std::vector<TaggedSentence> parse_conllu(std::string_view text, const std::string& file_name,
                                         ConlluTag column = ConlluTag::kUpos);
std::vector<TaggedSentence> read_conllu(const std::string& path,
                                        ConlluTag column = ConlluTag::kUpos);

// Token ids and targets through the vocabularies. A label or tag missing from `labels` (seen in
// evaluation data but never in training data) is an Error naming the file line.
Dataset encode_classification(const std::vector<TextExample>& examples, const Vocabulary& tokens,
                              const Vocabulary& labels, const std::string& file_name);
Dataset encode_tagging(const std::vector<TaggedSentence>& sentences, const Vocabulary& tokens,
                       const Vocabulary& tags, const std::string& file_name);

// --- batching --------------------------------------------------------------------------------

// A padded batch. T is the longest sequence of the batch (or pad_to, when larger).
//   ids        (B, T) I64, Vocabulary::kPad after each sequence's end
//   valid_lens (B,)   I64, the true lengths (d2l's valid_lens: keys k >= len are masked)
//   targets    (B,)   I64 classes, or (B, T) I64 tags with kIgnoreTag at padded positions
struct Batch {
  Tensor ids, valid_lens, targets;
  int64_t tokens = 0;  // sum of valid_lens: the real (unpadded) tokens
  int64_t size() const { return ids.defined() ? ids.dim(0) : 0; }
};

// The examples `indices` of `data`, in that order.
Batch make_batch(const Dataset& data, const std::vector<int64_t>& indices, int64_t pad_to = 0);
// The whole dataset in order, batch_size examples per batch (the last one may be smaller).
std::vector<Batch> make_batches(const Dataset& data, int64_t batch_size);

// Batches for training from a fixed dataset: the example order is an endless concatenation of
// permutations (epoch e shuffled by Rng(seed, e)), and batch s holds positions
// [s*B, (s+1)*B) of it. A batch is a pure function of (seed, s), so a resumed run sees exactly
// the batches an uninterrupted one would.
class EpochSampler {
 public:
  EpochSampler(int64_t num_examples, int64_t batch_size, uint64_t seed);
  std::vector<int64_t> indices(int64_t step);

 private:
  int64_t n_, batch_size_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
  const std::vector<int64_t>& permutation(int64_t epoch);
};

// Splits `data` into (train, held out): a seeded shuffle, then the last `fraction` (at least 1
// example) is held out. Needs at least 2 examples.
std::pair<Dataset, Dataset> split_holdout(const Dataset& data, double fraction, uint64_t seed);

}  // namespace attn::model
