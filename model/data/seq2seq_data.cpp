// Sequence-to-sequence data: preprocessing, the TSV reader, encoding, batching, BLEU (see
// attn/model/seq2seq_data.hpp and docs/seq2seq-data.md).
#include "attn/model/seq2seq_data.hpp"

#include "attn/core/error.hpp"
#include "model/data/shuffle.hpp"
#include "model/data/text_file.hpp"
#include "model/data/unicode_lower.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace attn::model {

// ----------------------------------------------------------------------------------------------
// Preprocessing

std::string preprocess_text(std::string_view text, const TextPreprocess& o) {
  if (!o.any()) return std::string(text);
  // 1. d2l: text.replace('\u202f', ' ').replace('\xa0', ' ')
  std::string s;
  if (o.nbsp_to_space) {
    s.reserve(text.size());
    for (size_t i = 0; i < text.size(); ++i) {
      const bool nnbsp = text.substr(i, 3) == "\xE2\x80\xAF";  // U+202F narrow no-break space
      const bool nbsp = text.substr(i, 2) == "\xC2\xA0";       // U+00A0 no-break space
      if (nnbsp || nbsp) {
        s.push_back(' ');
        i += nnbsp ? 2 : 1;
      } else {
        s.push_back(text[i]);
      }
    }
  } else {
    s = std::string(text);
  }
  // 2. d2l: text.lower() (on code points; ASCII-only text stays the same length).
  if (o.lowercase) s = detail::utf8_lower(s);
  if (!o.space_before_punct) return s;
  // 3. d2l: out = [' ' + c if i > 0 and c in ',.!?' and text[i-1] != ' ' else c ...]. The marks
  // and the space are ASCII, so bytes stand for code points here: a UTF-8 continuation byte is
  // never ',', '.', '!', '?' or ' '. (d2l tests the un-lowered text[i-1]; lower() never makes or
  // removes a space, so testing the lowered text is the same.)
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool mark = c == ',' || c == '.' || c == '!' || c == '?';
    if (i > 0 && mark && s[i - 1] != ' ') out.push_back(' ');
    out.push_back(c);
  }
  return out;
}

std::vector<std::string> split_tokens(std::string_view text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(' ', pos);
    if (end == std::string_view::npos) end = text.size();
    if (end > pos) out.emplace_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

std::vector<std::string> tokenize_text(std::string_view text, const TextPreprocess& options) {
  return split_tokens(preprocess_text(text, options));
}

// ----------------------------------------------------------------------------------------------
// Reader

using detail::fail_at;

std::vector<Seq2SeqExample> parse_seq2seq_tsv(std::string_view text, const std::string& file_name,
                                              const TextPreprocess& options) {
  const char* op = "read_seq2seq_tsv";
  std::vector<Seq2SeqExample> out;
  detail::for_each_line(text, [&](std::string_view line, int64_t number) {
    if (detail::blank(line)) return;
    if (const size_t bad = detail::find_invalid_utf8(line); bad != std::string_view::npos)
      fail_at(op, file_name, number, "byte {} (0x{:02X}) is not valid UTF-8", bad + 1,
              static_cast<unsigned char>(line[bad]));
    const size_t tab = line.find('\t');
    if (tab == std::string_view::npos)
      fail_at(op, file_name, number, "expected \"source<TAB>target\", found no tab");
    const size_t tabs = static_cast<size_t>(std::count(line.begin(), line.end(), '\t'));
    if (tabs > 1)
      fail_at(op, file_name, number,
              "expected \"source<TAB>target\", found {} tabs (a Tatoeba export with an "
              "attribution column? keep two columns: cut -f1,2)",
              tabs);
    // Preprocessing the whole line equals d2l's (it runs on the whole file): the tab is kept,
    // and a space it inserts at the start of a field only makes an empty token, dropped below.
    const std::string clean = preprocess_text(line, options);
    const size_t ctab = clean.find('\t');
    Seq2SeqExample ex;
    ex.source = split_tokens(std::string_view(clean).substr(0, ctab));
    ex.target = split_tokens(std::string_view(clean).substr(ctab + 1));
    ex.line = number;
    if (ex.source.empty()) fail_at(op, file_name, number, "the source before the tab is empty");
    if (ex.target.empty()) fail_at(op, file_name, number, "the target after the tab is empty");
    out.push_back(std::move(ex));
  });
  check(!out.empty(), op, "{}: no pairs (expected lines \"source<TAB>target\")", file_name);
  return out;
}

std::vector<Seq2SeqExample> read_seq2seq_tsv(const std::string& path,
                                             const TextPreprocess& options) {
  return parse_seq2seq_tsv(detail::read_text_file("read_seq2seq_tsv", path), path, options);
}

std::pair<Vocabulary, Vocabulary> build_seq2seq_vocabularies(
    const std::vector<Seq2SeqExample>& examples, int64_t min_freq, int64_t max_size) {
  std::vector<std::vector<std::string>> src, tgt;
  src.reserve(examples.size());
  tgt.reserve(examples.size());
  for (const auto& e : examples) {
    src.push_back(e.source);
    tgt.push_back(e.target);
  }
  return {Vocabulary::build(src, min_freq, max_size, Reserved::kSeq2Seq),
          Vocabulary::build(tgt, min_freq, max_size, Reserved::kSeq2Seq)};
}

// ----------------------------------------------------------------------------------------------
// Encoded data

void Seq2SeqDataset::validate(const char* op) const {
  check(src_vocab_size > Vocabulary::kEos && tgt_vocab_size > Vocabulary::kEos, op,
        "vocab sizes ({}, {}) must exceed the 4 reserved tokens", src_vocab_size, tgt_vocab_size);
  check(sources.size() == targets.size(), op, "{} sources but {} targets", sources.size(),
        targets.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    for (int side = 0; side < 2; ++side) {
      const int64_t v = side == 0 ? src_vocab_size : tgt_vocab_size;
      for (int64_t id : side == 0 ? sources[i] : targets[i]) {
        check(id >= 0 && id < v, op, "example {} has {} id {} outside [0, {})", i,
              side == 0 ? "source" : "target", id, v);
        check(id == Vocabulary::kUnk || id > Vocabulary::kEos, op,
              "example {} has the reserved {} id {} inside its text", i,
              side == 0 ? "source" : "target", id);
      }
    }
  }
}

std::vector<int64_t> encode_seq2seq_tokens(const std::vector<std::string>& tokens,
                                           const Vocabulary& vocab) {
  std::vector<int64_t> ids = vocab.encode(tokens);
  for (int64_t& id : ids)
    if (id == Vocabulary::kPad || id == Vocabulary::kBos || id == Vocabulary::kEos)
      id = Vocabulary::kUnk;
  return ids;
}

Seq2SeqDataset encode_seq2seq(const std::vector<Seq2SeqExample>& examples, const Vocabulary& src,
                              const Vocabulary& tgt) {
  check(src.reserved() == Reserved::kSeq2Seq && tgt.reserved() == Reserved::kSeq2Seq,
        "encode_seq2seq", "both vocabularies must reserve <pad> <unk> <bos> <eos>");
  Seq2SeqDataset d;
  d.src_vocab_size = src.size();
  d.tgt_vocab_size = tgt.size();
  d.sources.reserve(examples.size());
  d.targets.reserve(examples.size());
  for (const auto& e : examples) {
    d.sources.push_back(encode_seq2seq_tokens(e.source, src));
    d.targets.push_back(encode_seq2seq_tokens(e.target, tgt));
  }
  return d;
}

std::pair<Seq2SeqDataset, Seq2SeqDataset> split_holdout(const Seq2SeqDataset& data, double fraction,
                                                        uint64_t seed) {
  // A Philox stream of its own: the encoder data's split_holdout uses (3 << 60) - 1; this one
  // sits just below.
  const detail::HoldoutOrder h =
      detail::holdout_order(data.size(), fraction, seed, (uint64_t{3} << 60) - 2, "pairs");
  Seq2SeqDataset a, b;
  for (Seq2SeqDataset* d : {&a, &b}) {
    d->src_vocab_size = data.src_vocab_size;
    d->tgt_vocab_size = data.tgt_vocab_size;
  }
  for (int64_t k = 0; k < data.size(); ++k) {
    Seq2SeqDataset& d = k < data.size() - h.held ? a : b;
    const size_t e = static_cast<size_t>(h.order[static_cast<size_t>(k)]);
    d.sources.push_back(data.sources[e]);
    d.targets.push_back(data.targets[e]);
  }
  return {std::move(a), std::move(b)};
}

// ----------------------------------------------------------------------------------------------
// Batching

namespace {

// d2l's pad_or_trim(seq + ['<eos>'], T) written into row r of a (B, T) array already filled with
// <pad>. Returns the valid length (the non-pad positions).
int64_t put_row(const std::vector<int64_t>& seq, int64_t* row, int64_t T) {
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(seq.size()), T);
  std::copy_n(seq.begin(), n, row);
  if (n < T) row[n] = Vocabulary::kEos;  // lost when the sequence fills T: d2l's truncation
  return std::min<int64_t>(static_cast<int64_t>(seq.size()) + 1, T);
}

// The padded length of one side: num_steps, or the longest row + <eos> when trimming.
int64_t side_length(const std::vector<const std::vector<int64_t>*>& rows,
                    const Seq2SeqBatchOptions& o) {
  if (!o.trim_to_longest) return o.num_steps;
  int64_t longest = 0;
  for (const auto* r : rows)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(r->size()) + 1);
  return std::min(longest, o.num_steps);
}

void check_options(const char* op, const Seq2SeqBatchOptions& o) {
  check(o.num_steps >= 1, op, "num_steps must be >= 1, got {}", o.num_steps);
}

}  // namespace

Seq2SeqBatch make_seq2seq_batch(const Seq2SeqDataset& data, const std::vector<int64_t>& indices,
                                const Seq2SeqBatchOptions& o) {
  const char* op = "make_seq2seq_batch";
  check_options(op, o);
  check(!indices.empty(), op, "no pairs requested");
  std::vector<const std::vector<int64_t>*> src_rows, tgt_rows;
  for (int64_t i : indices) {
    check(i >= 0 && i < data.size(), op, "pair {} is outside [0, {})", i, data.size());
    src_rows.push_back(&data.sources[static_cast<size_t>(i)]);
    tgt_rows.push_back(&data.targets[static_cast<size_t>(i)]);
  }
  const int64_t B = static_cast<int64_t>(indices.size());
  const int64_t Ts = side_length(src_rows, o), Tt = side_length(tgt_rows, o);
  Seq2SeqBatch b;
  b.src = Tensor::full({B, Ts}, static_cast<double>(Vocabulary::kPad), DType::I64);
  b.labels = Tensor::full({B, Tt}, static_cast<double>(Vocabulary::kPad), DType::I64);
  b.dec_input = Tensor::full({B, Tt}, static_cast<double>(Vocabulary::kPad), DType::I64);
  b.src_valid_lens = Tensor::zeros({B}, DType::I64);
  b.tgt_valid_lens = Tensor::zeros({B}, DType::I64);
  int64_t* src = b.src.data<int64_t>();
  int64_t* labels = b.labels.data<int64_t>();
  int64_t* dec = b.dec_input.data<int64_t>();
  int64_t* src_lens = b.src_valid_lens.data<int64_t>();
  int64_t* tgt_lens = b.tgt_valid_lens.data<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    const size_t k = static_cast<size_t>(r);
    src_lens[r] = put_row(*src_rows[k], src + r * Ts, Ts);
    tgt_lens[r] = put_row(*tgt_rows[k], labels + r * Tt, Tt);
    // Teacher forcing: the decoder sees <bos> and then the label one step late.
    dec[r * Tt] = Vocabulary::kBos;
    std::copy_n(labels + r * Tt, Tt - 1, dec + r * Tt + 1);
    b.src_tokens += src_lens[r];
    b.tgt_tokens += tgt_lens[r];
  }
  return b;
}

std::vector<Seq2SeqBatch> make_seq2seq_batches(const Seq2SeqDataset& data, int64_t batch_size,
                                               const Seq2SeqBatchOptions& options) {
  check(batch_size >= 1, "make_seq2seq_batches", "batch_size must be >= 1, got {}", batch_size);
  std::vector<Seq2SeqBatch> out;
  for (int64_t start = 0; start < data.size(); start += batch_size) {
    std::vector<int64_t> idx(static_cast<size_t>(std::min(batch_size, data.size() - start)));
    std::iota(idx.begin(), idx.end(), start);
    out.push_back(make_seq2seq_batch(data, idx, options));
  }
  return out;
}

SourceBatch make_source_batch(const std::vector<std::vector<int64_t>>& sources,
                              const Seq2SeqBatchOptions& o) {
  const char* op = "make_source_batch";
  check_options(op, o);
  check(!sources.empty(), op, "no sources");
  std::vector<const std::vector<int64_t>*> rows;
  for (const auto& s : sources)
    rows.push_back(&s);
  const int64_t B = static_cast<int64_t>(sources.size());
  const int64_t T = side_length(rows, o);
  SourceBatch b;
  b.src = Tensor::full({B, T}, static_cast<double>(Vocabulary::kPad), DType::I64);
  b.valid_lens = Tensor::zeros({B}, DType::I64);
  int64_t* src = b.src.data<int64_t>();
  int64_t* lens = b.valid_lens.data<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    const auto& s = sources[static_cast<size_t>(r)];
    lens[r] = put_row(s, src + r * T, T);
    if (static_cast<int64_t>(s.size()) + 1 > o.num_steps) b.cut.push_back(r);
  }
  return b;
}

std::vector<std::string> ids_to_tokens(std::span<const int64_t> ids, const Vocabulary& vocab) {
  std::vector<std::string> out;
  for (int64_t id : ids) {
    if (id == Vocabulary::kEos || id == Vocabulary::kPad) break;
    out.push_back(vocab.token(id));
  }
  return out;
}

// ----------------------------------------------------------------------------------------------
// Scores

namespace {

// d2l's loop body for one n: clipped matches of the pred n-grams against the label's.
template <typename Tok>
int64_t ngram_matches(const std::vector<Tok>& pred, const std::vector<Tok>& label, size_t n) {
  // label_subs[' '.join(label_tokens[i: i + n])] += 1, keyed by the n tokens themselves.
  std::map<std::vector<Tok>, int64_t> label_subs;
  for (size_t i = 0; i + n <= label.size(); ++i)
    ++label_subs[std::vector<Tok>(label.begin() + static_cast<std::ptrdiff_t>(i),
                                  label.begin() + static_cast<std::ptrdiff_t>(i + n))];
  int64_t matches = 0;
  for (size_t i = 0; i + n <= pred.size(); ++i) {
    auto it = label_subs.find(std::vector<Tok>(pred.begin() + static_cast<std::ptrdiff_t>(i),
                                               pred.begin() + static_cast<std::ptrdiff_t>(i + n)));
    if (it != label_subs.end() && it->second > 0) {
      ++matches;
      --it->second;
    }
  }
  return matches;
}

template <typename Tok>
double bleu_impl(const std::vector<Tok>& pred, const std::vector<Tok>& label, int64_t k) {
  check(k >= 1, "bleu", "k (the longest n-gram) must be >= 1, got {}", k);
  const double len_pred = static_cast<double>(pred.size());
  const double len_label = static_cast<double>(label.size());
  if (pred.empty()) return label.empty() ? 1.0 : 0.0;
  // score = math.exp(min(0, 1 - len_label / len_pred))
  double score = std::exp(std::min(0.0, 1.0 - len_label / len_pred));
  const size_t top = std::min<size_t>(static_cast<size_t>(k), pred.size());
  for (size_t n = 1; n <= top; ++n) {
    const double matches = static_cast<double>(ngram_matches(pred, label, n));
    // score *= math.pow(num_matches / (len_pred - n + 1), math.pow(0.5, n))
    score *= std::pow(matches / (len_pred - static_cast<double>(n) + 1.0),
                      std::pow(0.5, static_cast<double>(n)));
  }
  return score;
}

// Python's s.split(' '): empty pieces kept.
std::vector<std::string_view> split_keep_empty(std::string_view s) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (true) {
    const size_t end = s.find(' ', pos);
    if (end == std::string_view::npos) {
      out.push_back(s.substr(pos));
      return out;
    }
    out.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
}

void check_pairs(const char* op, size_t preds, size_t labels) {
  check(preds == labels && preds > 0, op,
        "{} predictions and {} labels; expected the same count, at least 1", preds, labels);
}

}  // namespace

double bleu(const std::vector<std::string>& pred, const std::vector<std::string>& label,
            int64_t k) {
  return bleu_impl(pred, label, k);
}

double bleu_text(std::string_view pred, std::string_view label, int64_t k) {
  return bleu_impl(split_keep_empty(pred), split_keep_empty(label), k);
}

double mean_bleu(const std::vector<std::vector<std::string>>& preds,
                 const std::vector<std::vector<std::string>>& labels, int64_t k) {
  check_pairs("mean_bleu", preds.size(), labels.size());
  double sum = 0.0;
  for (size_t i = 0; i < preds.size(); ++i)
    sum += bleu(preds[i], labels[i], k);
  return sum / static_cast<double>(preds.size());
}

double exact_match(const std::vector<std::vector<std::string>>& preds,
                   const std::vector<std::vector<std::string>>& labels) {
  check_pairs("exact_match", preds.size(), labels.size());
  int64_t same = 0;
  for (size_t i = 0; i < preds.size(); ++i)
    same += preds[i] == labels[i] ? 1 : 0;
  return static_cast<double>(same) / static_cast<double>(preds.size());
}

}  // namespace attn::model
