// Datasets, vocabularies, the TSV and CoNLL-U readers, and batching (see attn/model/data.hpp).
#include "attn/model/data.hpp"

#include "attn/core/error.hpp"
#include "model/data/shuffle.hpp"
#include "model/data/text_file.hpp"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <numeric>
#include <unordered_map>

namespace attn::model {

const char* task_type_name(TaskType type) {
  return type == TaskType::kClassification ? "classification" : "tagging";
}

// ----------------------------------------------------------------------------------------------
// Dataset

int64_t Dataset::max_length() const {
  size_t m = 0;
  for (const auto& s : inputs)
    m = std::max(m, s.size());
  return static_cast<int64_t>(m);
}

int64_t Dataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& s : inputs)
    n += static_cast<int64_t>(s.size());
  return n;
}

void Dataset::validate(const char* op) const {
  check(vocab_size > 0 && num_classes > 0, op, "vocab_size ({}) and num_classes ({}) must be > 0",
        vocab_size, num_classes);
  const bool tagging = type == TaskType::kTagging;
  check(tagging ? tags.size() == inputs.size() : labels.size() == inputs.size(), op,
        "{} examples but {} {}", inputs.size(), tagging ? tags.size() : labels.size(),
        tagging ? "tag rows" : "labels");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check(!inputs[i].empty(), op, "example {} is empty", i);
    for (int64_t id : inputs[i])
      check(id >= 0 && id < vocab_size, op, "example {} has token id {} outside [0, {})", i, id,
            vocab_size);
    if (tagging) {
      check(tags[i].size() == inputs[i].size(), op, "example {} has {} tokens but {} tags", i,
            inputs[i].size(), tags[i].size());
      for (int64_t t : tags[i])
        check(t == kIgnoreTag || (t >= 0 && t < num_classes), op,
              "example {} has tag {} outside [0, {})", i, t, num_classes);
    } else {
      check(labels[i] >= 0 && labels[i] < num_classes, op,
            "example {} has label {} outside [0, {})", i, labels[i], num_classes);
    }
  }
}

int64_t truncate(Dataset& data, int64_t max_len) {
  check(max_len >= 1, "truncate", "max_len must be >= 1, got {}", max_len);
  int64_t cut = 0;
  const size_t m = static_cast<size_t>(max_len);
  for (size_t i = 0; i < data.inputs.size(); ++i) {
    if (data.inputs[i].size() <= m) continue;
    ++cut;
    data.inputs[i].resize(m);
    if (data.type == TaskType::kTagging) data.tags[i].resize(m);
  }
  return cut;
}

// ----------------------------------------------------------------------------------------------
// Vocabulary

namespace {

// The reserved tokens of each kind, in id order (kPad, kUnk, kBos, kEos).
std::vector<std::string> reserved_tokens(Reserved reserved) {
  switch (reserved) {
    case Reserved::kNone:
      return {};
    case Reserved::kPadUnk:
      return {"<pad>", "<unk>"};
    case Reserved::kSeq2Seq:
      return {"<pad>", "<unk>", "<bos>", "<eos>"};
  }
  return {};
}

}  // namespace

Vocabulary::Vocabulary(bool specials)
    : Vocabulary(specials ? Reserved::kPadUnk : Reserved::kNone) {}

Vocabulary::Vocabulary(Reserved reserved) : reserved_(reserved) {
  for (const auto& t : reserved_tokens(reserved))
    add(t);
}

int64_t Vocabulary::num_reserved() const {
  return static_cast<int64_t>(reserved_tokens(reserved_).size());
}

Vocabulary Vocabulary::build(const std::vector<std::vector<std::string>>& sequences,
                             int64_t min_freq, int64_t max_size, Reserved reserved) {
  const char* op = "Vocabulary::build";
  check(reserved != Reserved::kNone, op, "a token vocabulary needs reserved tokens");
  Vocabulary v(reserved);
  check(min_freq >= 1, op, "min_freq must be >= 1, got {}", min_freq);
  check(max_size == 0 || max_size >= v.size(), op,
        "max_size must be 0 (no limit) or >= {} (the reserved tokens), got {}", v.size(), max_size);
  std::unordered_map<std::string, int64_t> counts;
  for (const auto& s : sequences)
    for (const auto& t : s)
      ++counts[t];
  std::vector<std::pair<std::string, int64_t>> sorted(counts.begin(), counts.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  for (const auto& [token, count] : sorted) {
    if (count < min_freq) break;  // sorted by count: the rest are rarer
    if (max_size > 0 && v.size() >= max_size) break;
    v.add(token);  // a literal reserved token ("<pad>", ...) in the data maps onto the special
  }
  return v;
}

Vocabulary Vocabulary::labels(const std::vector<std::string>& labels) {
  std::vector<std::string> sorted = labels;
  std::sort(sorted.begin(), sorted.end());
  Vocabulary v(false);
  for (const auto& l : sorted)
    v.add(l);
  return v;
}

Vocabulary Vocabulary::from_tokens(const std::vector<std::string>& tokens, bool specials) {
  return from_tokens(tokens, specials ? Reserved::kPadUnk : Reserved::kNone);
}

Vocabulary Vocabulary::from_tokens(const std::vector<std::string>& tokens, Reserved reserved) {
  const char* op = "Vocabulary::from_tokens";
  const std::vector<std::string> head = reserved_tokens(reserved);
  check(tokens.size() >= head.size() && std::equal(head.begin(), head.end(), tokens.begin()), op,
        "a token vocabulary must start with {}", fmt::join(head, ", "));
  Vocabulary v(Reserved::kNone);
  v.reserved_ = reserved;
  for (const auto& t : tokens) {
    check(!v.contains(t), op, "token '{}' is listed twice", t);
    v.add(t);
  }
  return v;
}

std::string Vocabulary::to_json() const {
  const nlohmann::json array(tokens_);
  try {
    return array.dump();  // strict: invalid UTF-8 throws instead of being altered
  } catch (const nlohmann::json::exception& e) {
    throw Error("Vocabulary::to_json", fmt::format("a token is not valid UTF-8 ({})", e.what()));
  }
}

Vocabulary Vocabulary::from_json(std::string_view text, Reserved reserved) {
  const char* op = "Vocabulary::from_json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw Error(op, fmt::format("not JSON: {}", e.what()));
  }
  check(j.is_array(), op, "expected a JSON array of token strings, found {}", j.type_name());
  std::vector<std::string> tokens;
  tokens.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    check(j[i].is_string(), op, "entry {} is {}, expected a string", i, j[i].type_name());
    tokens.push_back(j[i].get<std::string>());
  }
  try {
    return from_tokens(tokens, reserved);
  } catch (const Error& e) {
    throw Error(op, e.what());
  }
}

int64_t Vocabulary::add(const std::string& token) {
  auto it = index_.find(token);
  if (it != index_.end()) return it->second;
  const int64_t id = size();
  tokens_.push_back(token);
  index_.emplace(token, id);
  return id;
}

int64_t Vocabulary::id(const std::string& token) const {
  auto it = index_.find(token);
  if (it != index_.end()) return it->second;
  check(has_specials(), "Vocabulary", "unknown label '{}' ({} known labels)", token, size());
  return kUnk;
}

const std::string& Vocabulary::token(int64_t id) const {
  check(id >= 0 && id < size(), "Vocabulary", "id {} is outside [0, {})", id, size());
  return tokens_[static_cast<size_t>(id)];
}

std::vector<int64_t> Vocabulary::encode(const std::vector<std::string>& tokens) const {
  std::vector<int64_t> ids;
  ids.reserve(tokens.size());
  for (const auto& t : tokens)
    ids.push_back(id(t));
  return ids;
}

// ----------------------------------------------------------------------------------------------
// Readers

namespace {

using detail::blank;
using detail::fail_at;
using detail::for_each_line;

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    size_t end = s.find(sep, pos);
    if (end == std::string_view::npos) {
      out.emplace_back(s.substr(pos));
      return out;
    }
    out.emplace_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
}

// Whitespace tokens (spaces; tabs never reach here in TSV text).
std::vector<std::string> words(std::string_view s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    while (pos < s.size() && s[pos] == ' ')
      ++pos;
    size_t end = pos;
    while (end < s.size() && s[end] != ' ')
      ++end;
    if (end > pos) out.emplace_back(s.substr(pos, end - pos));
    pos = end;
  }
  return out;
}

}  // namespace

std::vector<TextExample> parse_tsv(std::string_view text, const std::string& file_name) {
  const char* op = "read_tsv";
  std::vector<TextExample> out;
  for_each_line(text, [&](std::string_view line, int64_t number) {
    if (blank(line)) return;
    const size_t tab = line.find('\t');
    if (tab == std::string_view::npos)
      fail_at(op, file_name, number, "expected \"text<TAB>label\", found no tab");
    if (line.find('\t', tab + 1) != std::string_view::npos)
      fail_at(op, file_name, number, "expected \"text<TAB>label\", found more than one tab");
    TextExample ex;
    ex.tokens = words(line.substr(0, tab));
    std::vector<std::string> label = words(line.substr(tab + 1));
    ex.line = number;
    if (ex.tokens.empty()) fail_at(op, file_name, number, "the text before the tab is empty");
    if (label.size() != 1)
      fail_at(op, file_name, number, "expected one label after the tab, found {}",
              label.empty() ? std::string("none") : fmt::format("{} words", label.size()));
    ex.label = std::move(label[0]);
    out.push_back(std::move(ex));
  });
  check(!out.empty(), op, "{}: no examples (expected lines \"text<TAB>label\")", file_name);
  return out;
}

std::vector<TextExample> read_tsv(const std::string& path) {
  return parse_tsv(detail::read_text_file("read_tsv", path), path);
}

std::vector<TaggedSentence> parse_conllu(std::string_view text, const std::string& file_name,
                                         ConlluTag column) {
  const char* op = "read_conllu";
  const size_t tag_field = column == ConlluTag::kUpos ? 3 : 4;
  const char* tag_name = column == ConlluTag::kUpos ? "UPOS" : "XPOS";
  std::vector<TaggedSentence> out;
  TaggedSentence current;
  auto finish = [&] {
    if (!current.tokens.empty()) out.push_back(std::move(current));
    current = TaggedSentence{};
  };
  for_each_line(text, [&](std::string_view line, int64_t number) {
    if (blank(line)) {
      finish();
      return;
    }
    if (line.front() == '#') return;  // sentence-level comments (sent_id, text, ...)
    std::vector<std::string> f = split(line, '\t');
    if (f.size() != 10)
      fail_at(op, file_name, number, "expected 10 tab-separated fields, found {}", f.size());
    const std::string& id = f[0];
    // Multiword tokens ("3-4", e.g. Spanish "del" = "de el") and empty nodes ("5.1") carry no
    // word of their own for tagging: the words have their own lines.
    if (id.find('-') != std::string::npos || id.find('.') != std::string::npos) return;
    int64_t value = 0;
    auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), value);
    if (ec != std::errc() || end != id.data() + id.size())
      fail_at(op, file_name, number, "ID '{}' is not an integer, a range or a decimal", id);
    const int64_t expected = static_cast<int64_t>(current.tokens.size()) + 1;
    if (value != expected)
      fail_at(op, file_name, number, "ID {} out of sequence, expected {}", value, expected);
    if (f[1].empty()) fail_at(op, file_name, number, "empty FORM");
    const std::string& tag = f[tag_field];
    if (tag.empty() || tag == "_")
      fail_at(op, file_name, number, "{} field is '{}', expected a tag", tag_name, tag);
    if (current.tokens.empty()) current.line = number;
    current.tokens.push_back(f[1]);
    current.tags.push_back(tag);
  });
  finish();
  check(!out.empty(), op, "{}: no sentences (expected CoNLL-U token lines)", file_name);
  return out;
}

std::vector<TaggedSentence> read_conllu(const std::string& path, ConlluTag column) {
  return parse_conllu(detail::read_text_file("read_conllu", path), path, column);
}

// ----------------------------------------------------------------------------------------------
// Encoding through vocabularies

Dataset encode_classification(const std::vector<TextExample>& examples, const Vocabulary& tokens,
                              const Vocabulary& labels, const std::string& file_name) {
  Dataset d;
  d.type = TaskType::kClassification;
  d.vocab_size = tokens.size();
  d.num_classes = labels.size();
  for (const auto& ex : examples) {
    if (!labels.contains(ex.label))
      fail_at("read_tsv", file_name, ex.line, "label '{}' does not occur in the training data",
              ex.label);
    d.inputs.push_back(tokens.encode(ex.tokens));
    d.labels.push_back(labels.id(ex.label));
  }
  return d;
}

Dataset encode_tagging(const std::vector<TaggedSentence>& sentences, const Vocabulary& tokens,
                       const Vocabulary& tags, const std::string& file_name) {
  Dataset d;
  d.type = TaskType::kTagging;
  d.vocab_size = tokens.size();
  d.num_classes = tags.size();
  for (const auto& s : sentences) {
    for (size_t i = 0; i < s.tags.size(); ++i)
      if (!tags.contains(s.tags[i]))
        fail_at("read_conllu", file_name, s.line,
                "tag '{}' (word {}) does not occur in the "
                "training data",
                s.tags[i], i + 1);
    d.inputs.push_back(tokens.encode(s.tokens));
    d.tags.push_back(tags.encode(s.tags));
  }
  return d;
}

// ----------------------------------------------------------------------------------------------
// Batching

Batch make_batch(const Dataset& data, const std::vector<int64_t>& indices, int64_t pad_to) {
  const char* op = "make_batch";
  check(!indices.empty(), op, "no examples requested");
  const int64_t B = static_cast<int64_t>(indices.size());
  int64_t T = std::max<int64_t>(pad_to, 1);
  for (int64_t i : indices) {
    check(i >= 0 && i < data.size(), op, "example {} is outside [0, {})", i, data.size());
    T = std::max<int64_t>(T, static_cast<int64_t>(data.inputs[static_cast<size_t>(i)].size()));
  }
  const bool tagging = data.type == TaskType::kTagging;
  Batch b;
  b.ids = Tensor::full({B, T}, static_cast<double>(Vocabulary::kPad), DType::I64);
  b.valid_lens = Tensor::zeros({B}, DType::I64);
  b.targets = tagging ? Tensor::full({B, T}, static_cast<double>(kIgnoreTag), DType::I64)
                      : Tensor::zeros({B}, DType::I64);
  int64_t* ids = b.ids.data<int64_t>();
  int64_t* lens = b.valid_lens.data<int64_t>();
  int64_t* targets = b.targets.data<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    const size_t e = static_cast<size_t>(indices[static_cast<size_t>(r)]);
    const auto& seq = data.inputs[e];
    const int64_t n = static_cast<int64_t>(seq.size());
    std::copy(seq.begin(), seq.end(), ids + r * T);
    lens[r] = n;
    b.tokens += n;
    if (tagging)
      std::copy(data.tags[e].begin(), data.tags[e].end(), targets + r * T);
    else
      targets[r] = data.labels[e];
  }
  return b;
}

std::vector<Batch> make_batches(const Dataset& data, int64_t batch_size) {
  check(batch_size >= 1, "make_batches", "batch_size must be >= 1, got {}", batch_size);
  std::vector<Batch> out;
  for (int64_t start = 0; start < data.size(); start += batch_size) {
    std::vector<int64_t> idx(static_cast<size_t>(std::min(batch_size, data.size() - start)));
    std::iota(idx.begin(), idx.end(), start);
    out.push_back(make_batch(data, idx));
  }
  return out;
}

namespace {

// Streams of this file's shuffles, apart from the generated tasks' per-step streams.
constexpr uint64_t kEpochStreams = uint64_t{3} << 60;
constexpr uint64_t kHoldoutStream = (uint64_t{3} << 60) - 1;

}  // namespace

EpochSampler::EpochSampler(int64_t num_examples, int64_t batch_size, uint64_t seed)
    : n_(num_examples), batch_size_(batch_size), seed_(seed) {
  check(num_examples >= 1 && batch_size >= 1, "EpochSampler",
        "need at least one example ({}) and batch_size >= 1 ({})", num_examples, batch_size);
}

const std::vector<int64_t>& EpochSampler::permutation(int64_t epoch) {
  if (epoch != cached_epoch_) {
    perm_ = detail::shuffled(n_, seed_, kEpochStreams + static_cast<uint64_t>(epoch));
    cached_epoch_ = epoch;
  }
  return perm_;
}

std::vector<int64_t> EpochSampler::indices(int64_t step) {
  check(step >= 0, "EpochSampler", "step must be >= 0, got {}", step);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(batch_size_));
  for (int64_t k = 0; k < batch_size_; ++k) {
    const int64_t pos = step * batch_size_ + k;  // position in the endless example order
    out.push_back(permutation(pos / n_)[static_cast<size_t>(pos % n_)]);
  }
  return out;
}

std::pair<Dataset, Dataset> split_holdout(const Dataset& data, double fraction, uint64_t seed) {
  const detail::HoldoutOrder h =
      detail::holdout_order(data.size(), fraction, seed, kHoldoutStream, "examples");
  Dataset a, b;
  for (Dataset* d : {&a, &b}) {
    d->type = data.type;
    d->vocab_size = data.vocab_size;
    d->num_classes = data.num_classes;
  }
  for (int64_t k = 0; k < data.size(); ++k) {
    Dataset& d = k < data.size() - h.held ? a : b;
    const size_t e = static_cast<size_t>(h.order[static_cast<size_t>(k)]);
    d.inputs.push_back(data.inputs[e]);
    if (data.type == TaskType::kTagging)
      d.tags.push_back(data.tags[e]);
    else
      d.labels.push_back(data.labels[e]);
  }
  return {std::move(a), std::move(b)};
}

}  // namespace attn::model
