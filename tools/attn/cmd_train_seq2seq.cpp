// attn train --task translate|dates|copy|reverse: a Transformer encoder-decoder (d2l 11.7) on a
// "source<TAB>target" file or a generated n -> m task, with the same live progress, metrics,
// learning curve, atomic checkpoints and bit-identical --resume as the encoder tasks
// (cmd_train.cpp parses the flags, merges a resumed run's arguments and calls in here).
//
// Data: --task translate reads --data with d2l's preprocessing (lower case, space before
// , . ! ?), builds both vocabularies from it (--min-freq) and holds out 10% (or reads
// --eval-data); the generated tasks draw batch s from the seed and step and evaluate on
// --eval-examples pairs of their held-out split. Sources and targets are cut to --max-len tokens
// with <eos> (d2l's num_steps; for the generated tasks the longest pair + 1 when smaller).
#include "attn/core/error.hpp"
#include "attn/model/seq2seq_tasks.hpp"
#include "attn/model/seq2seq_trainer.hpp"
#include "attn/model/tasks.hpp"
#include "tools/attn/commands.hpp"
#include "tools/attn/train_history.hpp"
#include "tools/attn/train_progress.hpp"

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <numeric>

namespace attn::cli {

namespace {

constexpr const char* kOp = "train";
using nlohmann::json;

struct Seq2SeqSource {
  model::Vocabulary src_vocab{model::Reserved::kSeq2Seq}, tgt_vocab{model::Reserved::kSeq2Seq};
  int64_t num_steps = 0;
  model::TextPreprocess preprocess;
  std::function<model::Seq2SeqBatch(int64_t)> batch;
  model::Seq2SeqDataset eval;
  std::string eval_name, summary;
};

Seq2SeqSource generated_source(const TrainArgs& a) {
  model::Seq2SeqTaskOptions t;
  t.task = model::parse_seq2seq_task(a.task);
  t.num_symbols = a.symbols;
  t.min_len = std::max<int64_t>(1, a.length / 2);
  t.max_len = a.length;
  model::validate(t);
  Seq2SeqSource s;
  s.src_vocab = model::seq2seq_task_source_vocabulary(t);
  s.tgt_vocab = model::seq2seq_task_target_vocabulary(t);
  const auto [src_len, tgt_len] = model::seq2seq_task_max_lengths(t);
  s.num_steps = std::min(a.max_len, std::max(src_len, tgt_len) + 1);
  const int64_t B = a.batch_size, T = s.num_steps;
  const uint64_t seed = a.seed;
  const auto sv = std::make_shared<model::Vocabulary>(s.src_vocab),
             tv = std::make_shared<model::Vocabulary>(s.tgt_vocab);
  s.batch = [t, B, T, seed, sv, tv](int64_t step) {
    const model::Seq2SeqDataset d =
        model::encode_seq2seq(model::generate_seq2seq_task(t, B, seed, static_cast<uint64_t>(step),
                                                           model::TaskSplit::kTrain),
                              *sv, *tv);
    std::vector<int64_t> idx(static_cast<size_t>(B));
    std::iota(idx.begin(), idx.end(), 0);
    return model::make_seq2seq_batch(d, idx, {T, true});
  };
  // The same held-out pairs for every seed.
  s.eval = model::encode_seq2seq(
      model::generate_seq2seq_task(t, a.eval_examples, 0, model::eval_stream(0),
                                   model::TaskSplit::kHeldOut),
      s.src_vocab, s.tgt_vocab);
  s.eval_name = fmt::format("{} held-out pairs (never drawn for training)", a.eval_examples);
  s.summary = t.task == model::Seq2SeqTask::kDates
                  ? "task dates (dates in words -> ISO order)"
                  : fmt::format("task {}, {} symbols, lengths {}..{}", a.task, a.symbols, t.min_len,
                                t.max_len);
  s.summary += fmt::format(", vocabularies {} -> {}, num_steps {}", s.src_vocab.size(),
                           s.tgt_vocab.size(), s.num_steps);
  return s;
}

Seq2SeqSource file_source(const TrainArgs& a) {
  Seq2SeqSource s;
  s.preprocess = model::TextPreprocess::d2l();
  s.num_steps = a.max_len;
  const auto examples = model::read_seq2seq_tsv(a.data, s.preprocess);
  std::tie(s.src_vocab, s.tgt_vocab) = model::build_seq2seq_vocabularies(examples, a.min_freq);
  model::Seq2SeqDataset train = model::encode_seq2seq(examples, s.src_vocab, s.tgt_vocab);
  if (a.eval_data.empty()) {
    check(train.size() >= 2, kOp,
          "{}: {} pair(s); need 2 or more to hold out an evaluation set (or give --eval-data)",
          a.data, train.size());
    std::tie(train, s.eval) = model::split_holdout(train, 0.1, a.seed);
    s.eval_name = fmt::format("{} pairs held out of {}", s.eval.size(), a.data);
  } else {
    s.eval = model::encode_seq2seq(model::read_seq2seq_tsv(a.eval_data, s.preprocess), s.src_vocab,
                                   s.tgt_vocab);
    s.eval_name = fmt::format("{} pairs of {}", s.eval.size(), a.eval_data);
  }
  s.summary = fmt::format("{}: {} training pairs, vocabularies {} -> {}, num_steps {}", a.data,
                          train.size(), s.src_vocab.size(), s.tgt_vocab.size(), s.num_steps);
  auto data = std::make_shared<model::Seq2SeqDataset>(std::move(train));
  auto sampler = std::make_shared<model::EpochSampler>(data->size(), a.batch_size, a.seed);
  const int64_t T = s.num_steps;
  s.batch = [data, sampler, T](int64_t step) {
    return model::make_seq2seq_batch(*data, sampler->indices(step), {T, true});
  };
  return s;
}

std::string join(const std::vector<std::string>& tokens) {
  std::string out;
  for (const auto& t : tokens)
    out += (out.empty() ? "" : " ") + t;
  return out;
}

}  // namespace

bool is_seq2seq_task(const std::string& task) {
  return task == "translate" || task == "dates" || task == "copy" || task == "reverse";
}

void run_seq2seq_train(const TrainArgs& a, const std::string& args_json) {
  check(a.pe == "sinusoidal", kOp,
        "--task {} trains an encoder-decoder with d2l's sinusoidal encoding; --pe {} is for the "
        "encoder tasks",
        a.task, a.pe);
  Seq2SeqSource src = a.task == "translate" ? file_source(a) : generated_source(a);

  model::Seq2SeqTrainOptions o;
  o.model.src_vocab_size = src.src_vocab.size();
  o.model.tgt_vocab_size = src.tgt_vocab.size();
  o.model.num_hiddens = a.num_hiddens;
  o.model.ffn_num_hiddens = a.ffn_num_hiddens;
  o.model.num_heads = a.num_heads;
  o.model.num_enc_blks = a.num_blks;
  o.model.num_dec_blks = a.num_blks;
  o.model.dropout = a.dropout;
  o.num_steps = src.num_steps;
  o.preprocess = src.preprocess;
  o.adamw.lr = a.lr;
  o.adamw.weight_decay = a.weight_decay;
  o.clip_norm = a.clip;
  o.seed = a.seed;
  o.threads = a.threads;
  o.precision = model::parse_precision(a.precision);
  model::Seq2SeqTrainer trainer(o, src.src_vocab, src.tgt_vocab);

  TrainHistory history(
      {{"bleu", "BLEU", "eval BLEU"}, {"exact_match", "exact match", "eval exact match"}},
      "loss / score");
  if (!a.resume.empty()) {
    auto extra = trainer.load_checkpoint(a.resume);
    resume_history(history, extra, a.resume, trainer.step(), a.steps);
  }
  auto save = [&](const std::string& path) {
    trainer.save_checkpoint(
        path, {{"train.args", args_json}, {"train.history", history.to_json().dump()}});
  };

  Progress progress(a.steps);
  progress.line(fmt::format("attn train: {}", src.summary));
  progress.line(fmt::format(
      "model: encoder-decoder E={} F={} H={} blocks={}+{} dropout={}, {} parameters; AdamW lr={} "
      "wd={}, clip {}; seed {}; precision {}{}",
      a.num_hiddens, a.ffn_num_hiddens, a.num_heads, a.num_blks, a.num_blks, a.dropout,
      trainer.model().num_parameters(), a.lr, a.weight_decay, a.clip, a.seed, a.precision,
      a.resume.empty() ? "" : fmt::format("; resumed at step {}", trainer.step())));
  if (o.precision != model::Precision::kFloat32) {
    if (!cpu_bf16_native()) progress.line(kNoBf16Note);
    progress.line(
        "precision bf16: the training steps and the evaluation loss; greedy decoding "
        "(BLEU, exact match) runs in float32 on the float32 parameters");
  }
  progress.line(fmt::format("evaluation: {}, greedy decoding with the KV cache", src.eval_name));

  const LoopResult run = run_train_loop(
      history, progress, {a.steps, a.eval_every, a.checkpoint_every}, trainer.step(),
      [&] {
        const model::Seq2SeqStepStats st = trainer.train_step(src.batch(trainer.step()));
        return LoopStep{st.step, st.tokens, st.loss};
      },
      [&] {
        const model::Seq2SeqEvalStats e = trainer.evaluate(src.eval);
        return LoopEval{e.loss, {e.bleu, e.exact_match}};
      },
      [&] { save(a.checkpoint); });

  // Three held-out pairs, as the model translates them now.
  const int64_t shown = std::min<int64_t>(3, src.eval.size());
  const auto pred = trainer.greedy_ids(std::vector<std::vector<int64_t>>(
      src.eval.sources.begin(), src.eval.sources.begin() + shown));
  for (int64_t i = 0; i < shown; ++i) {
    std::vector<std::string> source, target;
    for (int64_t id : src.eval.sources[static_cast<size_t>(i)])
      source.push_back(src.src_vocab.token(id));
    for (int64_t id : src.eval.targets[static_cast<size_t>(i)])
      target.push_back(src.tgt_vocab.token(id));
    progress.line(fmt::format(
        "  {} => {}  (target: {})", join(source),
        join(model::ids_to_tokens(pred[static_cast<size_t>(i)], src.tgt_vocab)), join(target)));
  }

  if (!a.checkpoint.empty()) save(a.checkpoint);
  write_run_outputs(history,
                    {a.metrics, a.curve, json::parse(args_json), model::to_json(o),
                     fmt::format("attn train --task {}: {} steps, exact match {:.3f}", a.task,
                                 history.back().step, history.last("exact_match"))});
  print(run_summary(history, run, a.checkpoint));
}

}  // namespace attn::cli
