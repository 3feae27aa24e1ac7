// attn translate and attn predict: apply a checkpoint written by `attn train` to new text, one
// input line -> one output line on stdout.
//
//   attn translate --checkpoint CK [--beam N] [--max-len L] [FILE|-]
//     an encoder-decoder checkpoint (--task translate|dates|copy|reverse): each line is a source
//     sentence (read as training read it: d2l's preprocessing for translate; the part before a
//     tab when the line is "source<TAB>target"); the output is its translation, greedy or beam
//     search with the KV cache.
//   attn predict --checkpoint CK [FILE|-]
//     an encoder checkpoint (--task shift|sorted|tsv|conllu): each line is a token sequence
//     (words for tsv/conllu, symbol numbers 0.. for the generated tasks); the output is its class
//     (classification) or one tag per token (tagging).
//
// Bad input: unknown tokens become <unk>; an empty line gives an empty line; a line
// longer than the model's limit is cut, with one warning on stderr naming the line; a checkpoint
// of the other kind or a corrupt one, --beam 0: one line on stderr, exit 2, nothing on stdout
// (the output is printed only once every line is done).
#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/model/seq2seq_trainer.hpp"
#include "attn/model/trainer.hpp"
#include "tools/attn/commands.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

namespace attn::cli {

namespace {

using nlohmann::json;

// The lines of FILE, or of stdin for "-"; a trailing '\r' is dropped (CRLF files).
std::vector<std::string> read_lines(const std::string& path, const char* op) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), {});
  } else {
    std::ifstream in(path, std::ios::binary);
    check(in.good(), op, "cannot open '{}'", path);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<std::string> lines;
  std::istringstream ss(text);
  for (std::string line; std::getline(ss, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
  }
  return lines;
}

std::string join(const std::vector<std::string>& tokens) {
  std::string out;
  for (const auto& t : tokens)
    out += (out.empty() ? "" : " ") + t;
  return out;
}

void warn(const std::string& text) {
  std::fprintf(stderr, "attn: warning: %s\n", text.c_str());
}

// The checkpoint's kind, with the message for a file of the other kind.
void expect_format(const std::string& path, const char* wanted, const char* op) {
  std::string format;
  try {
    format = model::checkpoint_format(path);
  } catch (const Error& e) {
    throw Error(op, e.what());
  }
  if (format == wanted) return;
  if (format == model::kSeq2SeqCheckpointFormat)
    throw Error(op, fmt::format("{} is an encoder-decoder (sequence-to-sequence) checkpoint: use "
                                "`attn translate`",
                                path));
  if (format == model::kEncoderCheckpointFormat)
    throw Error(op, fmt::format("{} is a checkpoint of an encoder task (classification or "
                                "tagging): use `attn predict`",
                                path));
  throw Error(op, fmt::format("{}: unknown checkpoint format '{}'", path, format));
}

// --- translate ---------------------------------------------------------------------------------

struct TranslateArgs {
  std::string checkpoint, input = "-";
  int64_t beam = 1, max_len = 0, batch_size = 64;
  double length_penalty = 0.75;
  int threads = 0;
};

void run_translate(const TranslateArgs& a) {
  const char* op = "translate";
  check(a.beam >= 1, op, "--beam must be >= 1 (1: greedy search), got {}", a.beam);
  check(a.max_len >= 0, op, "--max-len must be >= 0 (0: the model's num_steps), got {}", a.max_len);
  check(a.batch_size >= 1, op, "--batch-size must be >= 1, got {}", a.batch_size);
  expect_format(a.checkpoint, model::kSeq2SeqCheckpointFormat, op);
  auto trainer = model::Seq2SeqTrainer::from_checkpoint(a.checkpoint, a.threads);
  const std::vector<std::string> lines = read_lines(a.input, op);
  std::vector<std::vector<std::string>> sources;
  sources.reserve(lines.size());
  for (const auto& line : lines)
    sources.push_back(
        model::tokenize_text(line.substr(0, line.find('\t')), trainer->options().preprocess));
  model::TranslateOptions o;
  o.beam_size = a.beam;
  o.length_penalty = a.length_penalty;
  o.max_len = a.max_len;
  o.batch_size = a.batch_size;
  const model::Translations t = trainer->translate(sources, o);
  const std::string name = a.input == "-" ? "<stdin>" : a.input;
  for (int64_t i : t.cut)
    warn(fmt::format("{}:{}: source of {} tokens cut to the model's limit of {} (with <eos>)", name,
                     i + 1, sources[static_cast<size_t>(i)].size(), trainer->options().num_steps));
  std::string out;
  for (const auto& tokens : t.tokens)
    out += join(tokens) + "\n";
  print(out);
}

// --- predict -----------------------------------------------------------------------------------

struct PredictArgs {
  std::string checkpoint, input = "-";
  int64_t batch_size = 64;
  int threads = 0;
};

void run_predict(const PredictArgs& a) {
  const char* op = "predict";
  check(a.batch_size >= 1, op, "--batch-size must be >= 1, got {}", a.batch_size);
  expect_format(a.checkpoint, model::kEncoderCheckpointFormat, op);
  model::TrainOptions options = model::Trainer::checkpoint_options(a.checkpoint);
  options.threads = a.threads;
  model::Trainer trainer(options);
  std::map<std::string, std::string> extra;
  try {
    extra = trainer.load_checkpoint(a.checkpoint);
  } catch (const Error& e) {
    throw Error(op, e.what());
  }
  // What `attn train` stored: the task, and for user data the vocabulary and label names.
  std::string task;
  std::vector<std::string> vocab, labels;
  try {
    const json args = json::parse(extra.at("train.args"));
    task = args.at("task").get<std::string>();
    vocab = json::parse(extra.at("train.vocab")).get<std::vector<std::string>>();
    labels = json::parse(extra.at("train.labels")).get<std::vector<std::string>>();
  } catch (const std::exception& e) {
    throw Error(op, fmt::format("{}: no usable train.args/train.vocab/train.labels metadata (not "
                                "written by `attn train`?): {}",
                                a.checkpoint, e.what()));
  }
  const bool user = task == "tsv" || task == "conllu";
  const model::Vocabulary tokens =
      user ? model::Vocabulary::from_tokens(vocab, model::Reserved::kPadUnk) : model::Vocabulary();
  const int64_t num_symbols = options.model.vocab_size - 2;
  // Generated tasks: symbol k is id k + 2; anything else is <unk>.
  auto encode = [&](const std::string& token) -> int64_t {
    if (user) return tokens.id(token);
    try {
      size_t used = 0;
      const long long k = std::stoll(token, &used);
      if (used == token.size() && k >= 0 && k < num_symbols) return k + 2;
    } catch (const std::exception&) {
    }
    return model::Vocabulary::kUnk;
  };
  auto label = [&](int64_t c) {
    return user ? labels.at(static_cast<size_t>(c)) : std::to_string(c);
  };
  const bool tagging = options.model.type == model::TaskType::kTagging;
  // The longest sequence the model takes: a learned table's size (sinusoids extend, but the
  // training data was cut there too).
  const int64_t limit = options.model.max_len;
  const std::string name = a.input == "-" ? "<stdin>" : a.input;

  const std::vector<std::string> lines = read_lines(a.input, op);
  model::Dataset data;
  data.type = options.model.type;
  data.vocab_size = options.model.vocab_size;
  data.num_classes = options.model.num_classes;
  std::vector<int64_t> rows;  // the non-empty lines, in order
  for (size_t i = 0; i < lines.size(); ++i) {
    std::vector<int64_t> ids;
    for (const auto& t : model::split_tokens(lines[i]))
      ids.push_back(encode(t));
    if (ids.empty()) continue;
    if (static_cast<int64_t>(ids.size()) > limit) {
      warn(fmt::format("{}:{}: {} tokens cut to the model's limit of {}", name, i + 1, ids.size(),
                       limit));
      ids.resize(static_cast<size_t>(limit));
    }
    data.tags.emplace_back(ids.size(), model::kIgnoreTag);
    data.labels.push_back(0);
    data.inputs.push_back(std::move(ids));
    rows.push_back(static_cast<int64_t>(i));
  }
  std::vector<std::string> out(lines.size());
  for (int64_t first = 0; first < data.size(); first += a.batch_size) {
    std::vector<int64_t> idx;
    for (int64_t i = first; i < std::min(data.size(), first + a.batch_size); ++i)
      idx.push_back(i);
    const model::Batch b = model::make_batch(data, idx);
    const Tensor pred = trainer.predict(b).contiguous();
    const int64_t* p = pred.data<int64_t>();
    const int64_t T = tagging ? pred.dim(1) : 1;
    for (size_t r = 0; r < idx.size(); ++r) {
      std::string& line = out[static_cast<size_t>(rows[static_cast<size_t>(idx[r])])];
      if (!tagging) {
        line = label(p[r]);
        continue;
      }
      const size_t n = data.inputs[static_cast<size_t>(idx[r])].size();
      for (size_t t = 0; t < n; ++t)
        line += (t ? " " : "") + label(p[static_cast<int64_t>(r) * T + static_cast<int64_t>(t)]);
    }
  }
  std::string text;
  for (const auto& line : out)
    text += line + "\n";
  print(text);
}

}  // namespace

std::vector<Command> add_translate_command(CLI::App& app) {
  auto a = std::make_shared<TranslateArgs>();
  CLI::App* sub = app.add_subcommand(
      "translate",
      "Translate each line of FILE (or stdin) with an encoder-decoder checkpoint of `attn train "
      "--task translate|dates|copy|reverse`: greedy or beam search with the KV cache, one "
      "translation per line on stdout.");
  sub->add_option("--checkpoint", a->checkpoint, "checkpoint written by attn train")
      ->required()
      ->type_name("FILE")
      ->check(kNonEmptyPath);
  sub->add_option("--beam", a->beam, "beam size (1: greedy search)")->capture_default_str();
  sub->add_option("--length-penalty", a->length_penalty,
                  "beam search: rank by log P / length^alpha")
      ->capture_default_str();
  sub->add_option("--max-len", a->max_len,
                  "tokens generated at most, <eos> included (0: the model's num_steps)")
      ->capture_default_str();
  sub->add_option("--batch-size", a->batch_size, "sources decoded together")->capture_default_str();
  sub->add_option("--threads", a->threads, "threads (0: all); results do not depend on it")
      ->capture_default_str();
  sub->add_option("input", a->input, "source sentences, one per line ('-': stdin)")
      ->type_name("FILE|-")
      ->capture_default_str();
  return {{sub, [a] { run_translate(*a); }}};
}

std::vector<Command> add_predict_command(CLI::App& app) {
  auto a = std::make_shared<PredictArgs>();
  CLI::App* sub = app.add_subcommand(
      "predict",
      "Apply an encoder checkpoint of `attn train --task shift|sorted|tsv|conllu` to each line of "
      "FILE (or stdin): the class of the line, or one tag per token, on stdout.");
  sub->add_option("--checkpoint", a->checkpoint, "checkpoint written by attn train")
      ->required()
      ->type_name("FILE")
      ->check(kNonEmptyPath);
  sub->add_option("--batch-size", a->batch_size, "lines run together")->capture_default_str();
  sub->add_option("--threads", a->threads, "threads (0: all); results do not depend on it")
      ->capture_default_str();
  sub->add_option("input", a->input, "token sequences, one per line ('-': stdin)")
      ->type_name("FILE|-")
      ->capture_default_str();
  return {{sub, [a] { run_predict(*a); }}};
}

}  // namespace attn::cli
