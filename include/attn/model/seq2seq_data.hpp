// Sequence-to-sequence data (n -> m, d2l 10.5 "Machine Translation and the Dataset" and 11.7):
// d2l's text preprocessing, the "source<TAB>target" reader, source and target vocabularies,
// fixed-length batches with valid lengths and teacher forcing, and d2l's BLEU and exact match.
// The exact d2l behaviour, and where attn departs from it, is in docs/seq2seq-data.md.
//
// Vocabulary: B batch, T num_steps (the padded length), V vocabulary size.
//
// Token ids: vocabularies are built with Reserved::kSeq2Seq, so in source and target alike
//   <pad> = 0, <unk> = 1, <bos> = 2, <eos> = 3   (Vocabulary::kPad, kUnk, kBos, kEos)
// and the words follow, most frequent first (ties in byte order).
//
// Training batches: a Seq2SeqDataset and the EpochSampler of attn/model/data.hpp (a batch is a
// pure function of (seed, step), so a resumed run sees the batches an uninterrupted one would):
//   EpochSampler sampler(data.size(), batch_size, seed);
//   Seq2SeqBatch b = make_seq2seq_batch(data, sampler.indices(step), {.num_steps = 10});
// The generated tasks (attn/model/seq2seq_tasks.hpp) draw batch s from Rng(seed, s) instead.
//
// Reader errors are attn::Error whose message starts with "<file>:<line>: ", e.g.
//   read_seq2seq_tsv: data/fra.tsv:17: expected "source<TAB>target", found no tab
#pragma once

#include "attn/core/tensor.hpp"
#include "attn/model/data.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace attn::model {

// --- d2l's `_preprocess` (MTFraEng), each step an option ---------------------------------------
// In d2l's order, on a line (or a field) of UTF-8 text:
//   1. nbsp_to_space:      U+202F and U+00A0 become U+0020 (nothing else is normalised)
//   2. lowercase:          Python's str.lower() on code points (Unicode 14; capital sigma always
//                          becomes U+03C3, Python's final-sigma rule is not applied)
//   3. space_before_punct: a space is inserted before each of , . ! ? that is not at position 0
//                          and not already after a U+0020 ("wait..." -> "wait . . .",
//                          "who?me" -> "who ?me"; nothing is inserted after the mark)
// All off by default (the text is only split on spaces); TextPreprocess::d2l() turns all on.
struct TextPreprocess {
  bool nbsp_to_space = false;
  bool lowercase = false;
  bool space_before_punct = false;

  static TextPreprocess d2l() { return {true, true, true}; }
  bool any() const { return nbsp_to_space || lowercase || space_before_punct; }
};

// The preprocessed text. Bytes that are not UTF-8 are copied unchanged (the readers reject them
// before this step).
std::string preprocess_text(std::string_view text, const TextPreprocess& options);
// d2l's `_tokenize` split: on U+0020 only, empty tokens dropped (a '\t' or '\r' stays in a token).
std::vector<std::string> split_tokens(std::string_view text);
// preprocess_text, then split_tokens: how `attn translate` should read one source line.
std::vector<std::string> tokenize_text(std::string_view text, const TextPreprocess& options);

// --- TSV: one pair per line, "source<TAB>target" -----------------------------------------------
// Lines end with '\n'; a '\r' before it is dropped (CRLF files). Lines holding only spaces and
// tabs are skipped. Errors, each naming file:line: bytes that are not UTF-8; no tab; more than one
// tab (a Tatoeba export with its attribution column: keep two columns with `cut -f1,2`); a side
// with no token; no pair in the whole file. d2l drops malformed lines silently instead.
struct Seq2SeqExample {
  std::vector<std::string> source, target;  // tokens, without <bos> or <eos>
  int64_t line = 0;                         // 1-based line in the file (0: generated)
};

std::vector<Seq2SeqExample> parse_seq2seq_tsv(std::string_view text, const std::string& file_name,
                                              const TextPreprocess& options = {});
std::vector<Seq2SeqExample> read_seq2seq_tsv(const std::string& path,
                                             const TextPreprocess& options = {});

// Source and target vocabularies of `examples` (Vocabulary::build with Reserved::kSeq2Seq):
// tokens seen at least min_freq times (d2l uses min_freq = 2 for its French-English set), at
// most max_size entries each (0: no limit). Counts are taken over the whole sequences; d2l counts
// only what survives truncation to num_steps.
std::pair<Vocabulary, Vocabulary> build_seq2seq_vocabularies(
    const std::vector<Seq2SeqExample>& examples, int64_t min_freq = 1, int64_t max_size = 0);

// --- encoded data ------------------------------------------------------------------------------
// Token ids without <bos> or <eos> (batching adds them). An empty sequence is allowed: it becomes
// just <eos>.
struct Seq2SeqDataset {
  std::vector<std::vector<int64_t>> sources, targets;
  int64_t src_vocab_size = 0, tgt_vocab_size = 0;

  int64_t size() const { return static_cast<int64_t>(sources.size()); }
  // Row counts agree, vocab sizes > kEos, every id in [0, V) and none of <pad>, <bos>, <eos>;
  // Error(op) naming the first offending example otherwise.
  void validate(const char* op) const;
};

// The ids of `tokens` in a Reserved::kSeq2Seq vocabulary. Unknown tokens become <unk>, and so do
// literal "<pad>", "<bos>" and "<eos>" in the text: padding, start and end are only ever where
// batching puts them (so valid lengths and the loss's pad mask agree).
std::vector<int64_t> encode_seq2seq_tokens(const std::vector<std::string>& tokens,
                                           const Vocabulary& vocab);
// Every example through the two vocabularies (Error unless both are Reserved::kSeq2Seq).
Seq2SeqDataset encode_seq2seq(const std::vector<Seq2SeqExample>& examples, const Vocabulary& src,
                              const Vocabulary& tgt);

// (train, held out): a seeded shuffle, then the last `fraction` (at least 1 pair) is held out,
// as split_holdout of data.hpp. Needs at least 2 pairs. Pairs repeated in the file can land on
// both sides; the generated tasks split by content instead and never overlap.
std::pair<Seq2SeqDataset, Seq2SeqDataset> split_holdout(const Seq2SeqDataset& data, double fraction,
                                                        uint64_t seed);

// --- batching (d2l 1.0 `_build_arrays`) --------------------------------------------------------
// Each side is ids + <eos>, then cut to T or padded with <pad> to T (so a sequence of T or more
// tokens loses its <eos>, as in d2l). The target's <bos> + cut/padded target gives the decoder
// input and the labels of teacher forcing:
//   src            (B, Ts) I64  x_0 .. x_{n-1} <eos> <pad> ...
//   src_valid_lens (B,)    I64  min(n + 1, Ts): the non-pad positions (d2l's src_valid_len)
//   dec_input      (B, Tt) I64  <bos> y_0 .. y_{Tt-2}        (dec_input[:, t] = labels[:, t-1])
//   labels         (B, Tt) I64  y_0 .. y_{m-1} <eos> <pad> ... (cut to Tt)
//   tgt_valid_lens (B,)    I64  min(m + 1, Tt): the labels that count in the loss (d2l computes
//                               and drops it; its loss masks labels == <pad>, the same positions)
// Ts = Tt = num_steps as d2l; with trim_to_longest each side is instead padded only to its
// longest row in the batch (at most num_steps): the same valid positions, less padding to
// compute on.
struct Seq2SeqBatchOptions {
  int64_t num_steps = 9;  // d2l's MTFraEng default
  bool trim_to_longest = false;
};

struct Seq2SeqBatch {
  Tensor src, src_valid_lens, dec_input, labels, tgt_valid_lens;
  int64_t src_tokens = 0, tgt_tokens = 0;  // sums of the valid lengths
  int64_t size() const { return src.defined() ? src.dim(0) : 0; }
};

// The pairs `indices` of `data`, in that order.
Seq2SeqBatch make_seq2seq_batch(const Seq2SeqDataset& data, const std::vector<int64_t>& indices,
                                const Seq2SeqBatchOptions& options);
// The whole dataset in order, batch_size pairs per batch (the last one may be smaller).
std::vector<Seq2SeqBatch> make_seq2seq_batches(const Seq2SeqDataset& data, int64_t batch_size,
                                               const Seq2SeqBatchOptions& options);

// Sources alone, for translation: the src and src_valid_lens of make_seq2seq_batch. `cut` lists
// the rows whose ids + <eos> did not fit in num_steps (to warn about, naming their lines).
struct SourceBatch {
  Tensor src, valid_lens;
  std::vector<int64_t> cut;
  int64_t size() const { return src.defined() ? src.dim(0) : 0; }
};
SourceBatch make_source_batch(const std::vector<std::vector<int64_t>>& sources,
                              const Seq2SeqBatchOptions& options);

// The tokens of one output or label row: up to the first <eos> or <pad> (not included), as d2l
// cuts its predictions before '<eos>'.
std::vector<std::string> ids_to_tokens(std::span<const int64_t> ids, const Vocabulary& vocab);

// --- scores ------------------------------------------------------------------------------------
// d2l 1.0's `bleu(pred_seq, label_seq, k)`:
//   BLEU = exp(min(0, 1 - len_label / len_pred)) * prod_{n=1}^{min(k, len_pred)} p_n^(1/2^n)
// p_n = clipped n-gram matches / (len_pred - n + 1): a predicted n-gram matches while its count
// in the label is not used up. Double arithmetic in d2l's order, so the value equals Python's.
// An empty prediction scores 0 (d2l's string form cannot be empty: '' is one empty token), and 1
// when the label is empty too. k >= 1 (d2l's chapter uses k = 2; attn reports k = 4).
double bleu(const std::vector<std::string>& pred, const std::vector<std::string>& label,
            int64_t k = 4);
// The same on d2l's strings: split on ' ' keeping empty tokens ('' is [''], "a  b" has 3).
double bleu_text(std::string_view pred, std::string_view label, int64_t k = 4);
// The mean of the sentence BLEUs (what d2l prints per sentence, averaged; this is not the corpus
// BLEU of Papineni et al. or sacrebleu). Error when the counts differ or are 0.
double mean_bleu(const std::vector<std::vector<std::string>>& preds,
                 const std::vector<std::vector<std::string>>& labels, int64_t k = 4);
// The fraction of predictions equal to their label token for token.
double exact_match(const std::vector<std::vector<std::string>>& preds,
                   const std::vector<std::vector<std::string>>& labels);

}  // namespace attn::model
