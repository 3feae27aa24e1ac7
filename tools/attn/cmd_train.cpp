// attn train: a Transformer encoder with a classification or tagging head on a generated order
// task (shift, sorted) or on user data (TSV text<TAB>label, CoNLL-U part-of-speech tags), with a
// live progress bar, periodic evaluation, metrics (CSV/JSON), a learning-curve SVG, atomic
// safetensors checkpoints and bit-identical resume.
//
// Resume: the checkpoint stores the run's arguments (train.args). Every argument that changes
// results is taken from it unless given again on the command line, where it must agree; so
// `attn train --resume ck.safetensors --steps 2000` continues a run where it stopped.
//
// Data parallel: under `mpirun -np N` (attn built with -DATTN_WITH_MPI=ON), every rank draws the
// same global batch of --batch-size sequences and trains on its shard (model/trainer.hpp); rank
// 0 prints the progress and writes the metrics, the curve and the checkpoint, every rank reads
// --resume. --threads is per rank. See docs/scale-out.md.
//
// The encoder-decoder tasks (translate, dates, copy, reverse) run in cmd_train_seq2seq.cpp.
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/model/tasks.hpp"
#include "attn/model/trainer.hpp"
#include "tools/attn/commands.hpp"
#include "tools/attn/train_history.hpp"
#include "tools/attn/train_progress.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <tuple>

namespace attn::cli {

namespace {

constexpr const char* kOp = "train";
using nlohmann::json;

// The arguments that decide the results, by option name (what a checkpoint stores and a resume
// compares). Output paths, threads, --steps and the evaluation cadence are not among them.
json result_args(const TrainArgs& a) {
  json j = {{"task", a.task},
            {"data", a.data},
            {"eval-data", a.eval_data},
            {"tag-column", a.tag_column},
            {"length", a.length},
            {"symbols", a.symbols},
            {"max-len", a.max_len},
            {"min-freq", a.min_freq},
            {"pe", a.pe},
            {"num-hiddens", a.num_hiddens},
            {"ffn-num-hiddens", a.ffn_num_hiddens},
            {"num-heads", a.num_heads},
            {"num-blks", a.num_blks},
            {"dropout", a.dropout},
            {"batch-size", a.batch_size},
            {"lr", a.lr},
            {"weight-decay", a.weight_decay},
            {"clip", a.clip},
            {"seed", std::to_string(a.seed)},
            {"eval-examples", a.eval_examples}};
  if (a.bucket != 1) j["bucket"] = a.bucket;  // absent when off: older checkpoints compare equal
  return j;
}

void set_result_args(TrainArgs& a, const json& j) {
  a.task = j.at("task");
  a.data = j.at("data");
  a.eval_data = j.at("eval-data");
  a.tag_column = j.at("tag-column");
  a.length = j.at("length");
  a.symbols = j.at("symbols");
  a.max_len = j.at("max-len");
  a.min_freq = j.at("min-freq");
  a.pe = j.at("pe");
  a.num_hiddens = j.at("num-hiddens");
  a.ffn_num_hiddens = j.at("ffn-num-hiddens");
  a.num_heads = j.at("num-heads");
  a.num_blks = j.at("num-blks");
  a.dropout = j.at("dropout");
  a.batch_size = j.at("batch-size");
  a.lr = j.at("lr");
  a.weight_decay = j.at("weight-decay");
  a.clip = j.at("clip");
  a.seed = std::stoull(j.at("seed").get<std::string>());
  a.eval_examples = j.at("eval-examples");
  a.bucket = j.value("bucket", int64_t{1});  // checkpoints from before --bucket: off
}

void validate(const TrainArgs& a) {
  check(a.task == "shift" || a.task == "sorted" || a.task == "tsv" || a.task == "conllu" ||
            is_seq2seq_task(a.task),
        kOp,
        "--task must be shift, sorted, tsv, conllu, translate, dates, copy or reverse, got '{}'",
        a.task);
  const bool user = a.task == "tsv" || a.task == "conllu" || a.task == "translate";
  check(!user || !a.data.empty(), kOp, "--task {} needs --data FILE", a.task);
  check(user || a.data.empty(), kOp,
        "--data is for --task tsv|conllu|translate, not the generated '{}'", a.task);
  check(a.steps >= 0 && a.batch_size >= 1, kOp, "--steps ({}) must be >= 0, --batch-size ({}) >= 1",
        a.steps, a.batch_size);
  check(a.bucket >= 1 && a.bucket <= 4096, kOp, "--bucket must be in [1, 4096], got {}", a.bucket);
  check(a.bucket == 1 || a.task == "shift" || a.task == "sorted", kOp,
        "--bucket is for the generated encoder tasks (shift, sorted), not '{}'", a.task);
  check(a.eval_every >= 0 && a.checkpoint_every >= 0 && a.eval_examples >= 1, kOp,
        "--eval-every and --checkpoint-every must be >= 0, --eval-examples >= 1");
  check(a.length >= 2 && a.symbols >= 2 && a.max_len >= 1, kOp,
        "--length ({}) and --symbols ({}) must be >= 2, --max-len ({}) >= 1", a.length, a.symbols,
        a.max_len);
  check(a.tag_column == "upos" || a.tag_column == "xpos", kOp,
        "--tag-column must be upos or xpos, got '{}'", a.tag_column);
  check(a.checkpoint_every == 0 || !a.checkpoint.empty(), kOp,
        "--checkpoint-every needs --checkpoint FILE");
  check(a.metrics.empty() || a.metrics.ends_with(".csv") || a.metrics.ends_with(".json"), kOp,
        "--metrics must end with .csv or .json, got '{}'", a.metrics);
  nn::parse_positional_kind(a.pe);  // throws for an unknown name
}

// Where batches come from: a pure function of the step, so a resumed run sees the same ones.
struct DataSource {
  model::TaskType type = model::TaskType::kTagging;
  int64_t vocab_size = 0, num_classes = 0;
  std::function<model::Batch(int64_t)> batch;
  std::vector<model::Batch> eval;
  std::string eval_name;
  json vocab = json::array(), labels = json::array();  // user data: stored in checkpoints
  std::string summary;
};

DataSource generated_source(const TrainArgs& a) {
  model::TaskOptions t;
  t.task = model::parse_generated_task(a.task);
  t.num_symbols = a.symbols;
  t.min_len = std::max<int64_t>(2, a.length / 2);
  t.max_len = a.length;
  DataSource s;
  s.type = model::task_type(t.task);
  s.vocab_size = model::task_vocab_size(t);
  s.num_classes = model::task_num_classes(t);
  const int64_t B = a.batch_size;
  const uint64_t seed = a.seed;
  const int64_t k = a.bucket;
  if (k == 1) {
    s.batch = [t, B, seed](int64_t step) {
      std::vector<int64_t> idx(static_cast<size_t>(B));
      std::iota(idx.begin(), idx.end(), 0);
      return model::make_batch(model::generate_task(t, B, seed, static_cast<uint64_t>(step)), idx);
    };
  } else {
    // Bucketing by length: steps [g k, (g + 1) k) share one pool of k B sequences (its own stream,
    // apart from the per-step and evaluation streams), sorted by length (ties by position) and cut
    // into k batches, which the group's steps take in a seeded random order so that lengths do not
    // rise step by step. Every batch is a function of the step alone: --resume stays bit-identical.
    // The group's pool, sorted order and batch order are kept for its k steps (one pool drawn per
    // group, not per step); a step of another group draws its own. Guarded: the source may be
    // asked from more than one thread.
    struct Group {
      std::mutex mu;
      int64_t index = -1;
      model::Dataset pool;
      std::vector<int64_t> order, slot;
    };
    auto cached = std::make_shared<Group>();
    s.batch = [t, B, seed, k, cached](int64_t step) {
      Group& c = *cached;
      std::lock_guard<std::mutex> lock(c.mu);
      if (const int64_t group = step / k; group != c.index) {
        const uint64_t g = static_cast<uint64_t>(group);
        c.pool = model::generate_task(t, k * B, seed, (uint64_t{1} << 61) + g);
        c.order.resize(static_cast<size_t>(k * B));
        std::iota(c.order.begin(), c.order.end(), 0);
        const model::Dataset& pool = c.pool;
        std::stable_sort(c.order.begin(), c.order.end(), [&pool](int64_t x, int64_t y) {
          return pool.inputs[static_cast<size_t>(x)].size() <
                 pool.inputs[static_cast<size_t>(y)].size();
        });
        c.slot.resize(static_cast<size_t>(k));
        std::iota(c.slot.begin(), c.slot.end(), 0);
        Rng rng(seed, (uint64_t{1} << 61) + (uint64_t{1} << 60) + g);
        for (int64_t i = k - 1; i > 0; --i)  // Fisher-Yates
          std::swap(c.slot[static_cast<size_t>(i)],
                    c.slot[static_cast<size_t>(rng.below(static_cast<uint64_t>(i + 1)))]);
        c.index = group;
      }
      const auto first = c.order.begin() + c.slot[static_cast<size_t>(step % k)] * B;
      return model::make_batch(c.pool, std::vector<int64_t>(first, first + B));
    };
  }
  // A fixed evaluation set of the training lengths, the same for every seed.
  s.eval = model::make_batches(
      model::generate_task(t, a.eval_examples, 0, model::eval_stream(a.length)), 64);
  s.eval_name =
      fmt::format("{} held-out sequences of length {}..{}", a.eval_examples, t.min_len, t.max_len);
  s.summary = fmt::format("task {} ({}), {} symbols, lengths {}..{}", a.task,
                          model::task_type_name(s.type), a.symbols, t.min_len, t.max_len);
  return s;
}

DataSource user_source(const TrainArgs& a) {
  DataSource s;
  model::Dataset train, eval;
  model::Vocabulary tokens, labels(false);
  const bool tsv = a.task == "tsv";
  if (tsv) {
    const auto ex = model::read_tsv(a.data);
    std::vector<std::vector<std::string>> texts;
    std::vector<std::string> names;
    for (const auto& e : ex)
      texts.push_back(e.tokens), names.push_back(e.label);
    tokens = model::Vocabulary::build(texts, a.min_freq);
    labels = model::Vocabulary::labels(names);
    train = model::encode_classification(ex, tokens, labels, a.data);
    if (!a.eval_data.empty())
      eval =
          model::encode_classification(model::read_tsv(a.eval_data), tokens, labels, a.eval_data);
  } else {
    const auto col = a.tag_column == "upos" ? model::ConlluTag::kUpos : model::ConlluTag::kXpos;
    const auto sents = model::read_conllu(a.data, col);
    std::vector<std::vector<std::string>> words;
    std::vector<std::string> tags;
    for (const auto& st : sents) {
      words.push_back(st.tokens);
      tags.insert(tags.end(), st.tags.begin(), st.tags.end());
    }
    tokens = model::Vocabulary::build(words, a.min_freq);
    labels = model::Vocabulary::labels(tags);
    train = model::encode_tagging(sents, tokens, labels, a.data);
    if (!a.eval_data.empty())
      eval =
          model::encode_tagging(model::read_conllu(a.eval_data, col), tokens, labels, a.eval_data);
  }
  if (a.eval_data.empty()) {
    check(train.size() >= 2, kOp,
          "{}: {} example(s); need 2 or more to hold out an evaluation "
          "set (or give --eval-data)",
          a.data, train.size());
    std::tie(train, eval) = model::split_holdout(train, 0.1, a.seed);
    s.eval_name = fmt::format("{} examples held out of {}", eval.size(), a.data);
  } else {
    s.eval_name = fmt::format("{} examples of {}", eval.size(), a.eval_data);
  }
  const int64_t cut = model::truncate(train, a.max_len) + model::truncate(eval, a.max_len);
  s.type = train.type;
  s.vocab_size = train.vocab_size;
  s.num_classes = train.num_classes;
  s.vocab = tokens.tokens();
  s.labels = labels.tokens();
  s.eval = model::make_batches(eval, 64);
  auto data = std::make_shared<model::Dataset>(std::move(train));
  auto sampler = std::make_shared<model::EpochSampler>(data->size(), a.batch_size, a.seed);
  s.batch = [data, sampler](int64_t step) {
    return model::make_batch(*data, sampler->indices(step));
  };
  s.summary = fmt::format(
      "{} ({}): {} examples, vocabulary {}, {} {}{}", a.data, model::task_type_name(s.type),
      data->size(), s.vocab_size, s.num_classes, tsv ? "labels" : "tags",
      cut ? fmt::format(", {} sequences cut to --max-len {}", cut, a.max_len) : "");
  return s;
}

// The checkpoint's "train.args" merged into `a`: arguments given on the command line must agree.
void merge_resume_args(TrainArgs& a, const std::map<std::string, CLI::Option*>& given,
                       const std::map<std::string, std::string>& meta) {
  auto it = meta.find("train.args");
  check(it != meta.end(), kOp, "{}: no train.args metadata (not written by `attn train`)",
        a.resume);
  json saved;
  try {
    saved = json::parse(it->second);
    const json now = result_args(a);
    for (const auto& [key, value] : saved.items()) {
      auto opt = given.find(key);
      if (opt != given.end() && opt->second->count() > 0 && now.contains(key) &&
          now.at(key) != value)
        throw Error(kOp, fmt::format("--{} is {} but {} was trained with {}; leave it out to "
                                     "continue that run",
                                     key, now.at(key).dump(), a.resume, value.dump()));
    }
    set_result_args(a, saved);
  } catch (const json::exception& e) {
    throw Error(kOp, fmt::format("{}: malformed train.args metadata: {}", a.resume, e.what()));
  }
}

void run_train(TrainArgs a, const std::map<std::string, CLI::Option*>& given) {
  if (!a.resume.empty()) {
    const auto meta = load_safetensors(a.resume).metadata;
    merge_resume_args(a, given, meta);
    if (auto it = meta.find("attn.precision"); !a.precision_given && it != meta.end())
      a.precision = it->second;
  } else if (auto it = given.find("bucket"); it == given.end() || it->second->count() == 0) {
    // Bucketing by length is on by default where it applies (a resume keeps the stored choice).
    a.bucket = a.task == "shift" || a.task == "sorted" ? TrainArgs::kDefaultBucket : 1;
  }
  validate(a);
  if (is_seq2seq_task(a.task)) {
    check(a.device == "cpu", kOp,
          "--device {}: the encoder tasks (shift, sorted, tsv, conllu) train on the GPU; the "
          "encoder-decoder ({}) on the GPU is not written yet",
          a.device, a.task);
    run_seq2seq_train(a, result_args(a).dump());
    return;
  }
  const bool user = a.task == "tsv" || a.task == "conllu";
  DataSource src = user ? user_source(a) : generated_source(a);

  model::TrainOptions o;
  o.model.type = src.type;
  o.model.vocab_size = src.vocab_size;
  o.model.num_classes = src.num_classes;
  o.model.num_hiddens = a.num_hiddens;
  o.model.ffn_num_hiddens = a.ffn_num_hiddens;
  o.model.num_heads = a.num_heads;
  o.model.num_blks = a.num_blks;
  o.model.dropout = a.dropout;
  o.model.positional = nn::parse_positional_kind(a.pe);
  // Sinusoids extend to any length; a learned table is sized for the longest sequence we feed.
  o.model.max_len = user ? a.max_len : std::max<int64_t>(a.length, 1000);
  o.adamw.lr = a.lr;
  o.adamw.weight_decay = a.weight_decay;
  o.clip_norm = a.clip;
  o.seed = a.seed;
  o.threads = a.threads;
  o.precision = model::parse_precision(a.precision);
  o.device = parse_device(a.device);
  const std::shared_ptr<Communicator> comm = world_communicator();
  const bool rank0 = comm->rank() == 0;
  model::Trainer trainer(o, comm);

  TrainHistory history({{"eval_accuracy", "eval accuracy", "eval accuracy"}}, "loss / accuracy");
  if (!a.resume.empty()) {
    auto extra = trainer.load_checkpoint(a.resume);
    if (user)
      check(extra["train.vocab"] == src.vocab.dump() && extra["train.labels"] == src.labels.dump(),
            kOp,
            "{}: the vocabulary built from {} differs from the checkpoint's (was the data "
            "file changed?)",
            a.resume, a.data);
    resume_history(history, extra, a.resume, trainer.step(), a.steps);
  }

  auto save = [&](const std::string& path) {
    trainer.save_checkpoint(path, {{"train.args", result_args(a).dump()},
                                   {"train.history", history.to_json().dump()},
                                   {"train.vocab", src.vocab.dump()},
                                   {"train.labels", src.labels.dump()}});
  };

  Progress progress(a.steps, rank0);
  progress.line(fmt::format("attn train: {}", src.summary));
  if (comm->size() > 1)
    progress.line(
        fmt::format("data parallel: {} ranks ({}), {} sequences of each global batch of "
                    "{} per rank, {} threads each",
                    comm->size(), comm->name(), a.batch_size / comm->size(), a.batch_size,
                    a.threads == 0 ? std::string("all") : std::to_string(a.threads)));
  progress.line(fmt::format(
      "model: E={} F={} H={} blocks={} pe={} dropout={}, {} parameters; AdamW lr={} wd={}, clip "
      "{}; seed {}; precision {}{}",
      a.num_hiddens, a.ffn_num_hiddens, a.num_heads, a.num_blks, a.pe, a.dropout,
      trainer.model().num_parameters(), a.lr, a.weight_decay, a.clip, a.seed, a.precision,
      a.resume.empty() ? "" : fmt::format("; resumed at step {}", trainer.step())));
  if (o.precision != model::Precision::kFloat32 && o.device == Device::kCpu && !cpu_bf16_native())
    progress.line(kNoBf16Note);
  progress.line(fmt::format("evaluation: {}", src.eval_name));
  if (o.device != Device::kCpu)
    progress.line(
        fmt::format("device: {} (the step is one CUDA graph per batch shape; "
                    "evaluation and checkpoints on the CPU)",
                    trainer.device_description()));

  const LoopResult run = run_train_loop(
      history, progress, {a.steps, a.eval_every, a.checkpoint_every}, trainer.step(),
      [&] {
        const model::StepStats st = trainer.train_step(src.batch(trainer.step()));
        return LoopStep{st.step, st.tokens, st.loss};
      },
      [&] {
        const model::EvalStats e = trainer.evaluate(src.eval);
        return LoopEval{e.loss, {e.accuracy}};
      },
      [&] { save(a.checkpoint); });

  // Outputs after everything else succeeded; each is written atomically.
  if (!a.checkpoint.empty()) save(a.checkpoint);  // collective: rank 0 writes
  if (!rank0) return;
  write_run_outputs(history,
                    {a.metrics, a.curve, result_args(a), model::to_json(o),
                     fmt::format("attn train --task {} --pe {}: {} steps, eval accuracy "
                                 "{:.3f}",
                                 a.task, a.pe, trainer.step(), history.last("eval_accuracy"))});
  print(run_summary(history, run, a.checkpoint));
}

}  // namespace

std::vector<Command> add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto given = std::make_shared<std::map<std::string, CLI::Option*>>();
  TrainArgs& a = *args;
  CLI::App* sub = app.add_subcommand(
      "train",
      "Train a Transformer encoder (d2l 11.7) with a classification or tagging head: on a "
      "generated order task (shift: tag each token with the one before it; sorted: is the "
      "sequence non-decreasing) or on your data (TSV text<TAB>label; CoNLL-U part-of-speech); "
      "or a Transformer encoder-decoder (n -> m) on a generated task (dates: dates in words to "
      "ISO order; copy; reverse) or a source<TAB>target file (translate). Live progress on stderr, "
      "metrics, learning curve, atomic checkpoints, bit-identical "
      "--resume.");
  auto add = [&](const std::string& name, auto& field, const std::string& help) {
    CLI::Option* opt = sub->add_option("--" + name, field, help)->capture_default_str();
    (*given)[name] = opt;
    return opt;
  };
  add("task", a.task,
      "encoder: shift | sorted (generated) or tsv | conllu (with --data); encoder-decoder: "
      "dates | copy | reverse (generated) or translate (with --data, source<TAB>target)")
      ->check(CLI::IsMember(
          {"shift", "sorted", "tsv", "conllu", "translate", "dates", "copy", "reverse"}));
  add("data", a.data, "training file for --task tsv|conllu|translate")->type_name("FILE");
  add("eval-data", a.eval_data,
      "evaluation file (default: 10% of --data held out by a seeded shuffle)")
      ->type_name("FILE");
  add("tag-column", a.tag_column, "CoNLL-U tag column: upos or xpos");
  add("length", a.length, "generated tasks: longest training sequence (lengths length/2..length)");
  add("symbols", a.symbols, "generated tasks: number of distinct symbols");
  add("max-len", a.max_len,
      "user data: sequences are cut to this many tokens (encoder-decoder: d2l's num_steps, "
      "<eos> included)");
  add("min-freq", a.min_freq, "user data: rarer words map to <unk>");
  add("pe", a.pe, "positional encoding: none, sinusoidal, learned, rotary, alibi");
  add("num-hiddens", a.num_hiddens, "model width E");
  add("ffn-num-hiddens", a.ffn_num_hiddens, "feed-forward width");
  add("num-heads", a.num_heads, "attention heads (must divide E)");
  add("num-blks", a.num_blks, "encoder blocks (encoder-decoder: of each)");
  add("dropout", a.dropout, "dropout probability (d2l's three sites)");
  sub->add_option("--steps", a.steps, "train until this step (counting resumed steps)")
      ->capture_default_str();
  add("batch-size", a.batch_size, "sequences per step");
  add("lr", a.lr, "AdamW learning rate");
  add("weight-decay", a.weight_decay, "AdamW decoupled weight decay");
  add("clip", a.clip, "clip the global gradient norm to this (0: off)");
  add("seed", a.seed, "seeds the parameters, the data order and dropout");
  add("eval-examples", a.eval_examples, "generated tasks: size of the evaluation set");
  sub->add_option("--bucket", a.bucket,
                  fmt::format("generated encoder tasks: sort N batches' worth of sequences by "
                              "length and hand them out as N batches of similar lengths, less "
                              "padding (1: off; default {} for shift and sorted, else 1)",
                              TrainArgs::kDefaultBucket));
  (*given)["bucket"] = sub->get_option("--bucket");
  sub->add_option("--threads", a.threads, "threads (0: all); results do not depend on it")
      ->capture_default_str();
  add_device_option(sub, "train", &a.device);
  sub->add_option_function<std::string>(
         "--precision",
         [&a](const std::string& p) {
           a.precision = p;
           a.precision_given = true;
         },
         "fp32, or bf16: mixed precision (linear layers and attention in bfloat16, float32 "
         "master weights, AdamW state, LayerNorm and loss; the encoder-decoder tasks decode in "
         "fp32); default fp32, or the resumed run's")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  sub->add_option("--eval-every", a.eval_every, "evaluate every N steps (0: only at the end)")
      ->capture_default_str();
  sub->add_option("--metrics", a.metrics, "write the evaluation history (.csv or .json)")
      ->type_name("FILE");
  sub->add_option("--curve", a.curve, "write the learning curve (SVG)")->type_name("FILE");
  sub->add_option("--checkpoint", a.checkpoint, "write a checkpoint at the end (safetensors)")
      ->type_name("FILE");
  sub->add_option("--checkpoint-every", a.checkpoint_every, "also write it every N steps")
      ->capture_default_str();
  sub->add_option("--resume", a.resume, "continue the run saved in this checkpoint")
      ->type_name("FILE");
  auto run = [args, given] { run_train(*args, *given); };
  return {{sub, run}};
}

}  // namespace attn::cli
