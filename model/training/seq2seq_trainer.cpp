// The encoder-decoder's training step, evaluation, translation and checkpoints (see
// attn/model/seq2seq_trainer.hpp).
#include "attn/model/seq2seq_trainer.hpp"

#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/ops/loss.hpp"
#include "kernels/cpu/matmul.hpp"
#include "model/training/checkpoint_io.hpp"
#include "model/training/eval_scope.hpp"
#include "model/training/train_options.hpp"

#include <omp.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <exception>
#include <mutex>

namespace attn::model {

namespace {

using detail::EvalScope;

constexpr const char* kKind = "an attn sequence-to-sequence checkpoint";

const std::string& meta_at(const SafetensorsFile& f, const std::string& path, const char* key) {
  return detail::meta_at(f, path, key, kKind);
}

std::string format_of(const SafetensorsFile& f, const std::string& path) {
  auto it = f.metadata.find("attn.format");
  check(it != f.metadata.end(), "checkpoint",
        "{}: no 'attn.format' metadata: a safetensors file, but not an attn checkpoint", path);
  return it->second;
}

// The seq2seq checkpoint of `path`, or Error naming what the file is instead.
SafetensorsFile load_seq2seq_file(const std::string& path) {
  SafetensorsFile f = load_safetensors(path);
  const std::string format = format_of(f, path);
  check(format != kEncoderCheckpointFormat, "load_checkpoint",
        "{} is a checkpoint of an encoder task (classification or tagging: use `attn predict`), "
        "not of a sequence-to-sequence model",
        path);
  check(format == kSeq2SeqCheckpointFormat, "load_checkpoint", "{}: format '{}', expected '{}'",
        path, format, kSeq2SeqCheckpointFormat);
  return f;
}

Tensor ids_tensor(const std::vector<int64_t>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

// A model for another decoding thread: `model`'s configuration with its parameter values shared,
// not copied; what a forward keeps (activations, attention weights) is the replica's own, so two
// threads never write to one module.
std::unique_ptr<nn::EncoderDecoder> replica_of(nn::EncoderDecoder& model) {
  auto replica = std::make_unique<nn::EncoderDecoder>(model.config());
  const auto from = model.named_parameters();
  const auto to = replica->named_parameters();
  check(from.size() == to.size(), "translate", "a replica of the model has {} parameters, not {}",
        to.size(), from.size());
  for (size_t i = 0; i < from.size(); ++i) {
    check(from[i].first == to[i].first, "translate", "replica parameter {} is '{}', not '{}'", i,
          to[i].first, from[i].first);
    to[i].second->value = from[i].second->value;
    to[i].second->grad = Tensor();  // decoding takes no gradients
  }
  replica->eval();
  return replica;
}

// decode(ctx, model, i) for every batch i < n. With more than one batch and more than one thread,
// batches run side by side, one per thread, each thread on its own replica of the model with
// single-threaded ops: a decoder step of a small model is too little work to split, and a batch's
// translation does not depend on which thread decodes it or with how many threads. Otherwise
// batches run in order on `ctx` and `model`, whose ops use ctx's threads. `model` is in eval mode.
// Decoding is float32 whatever the training precision (Seq2SeqTrainOptions::precision): every
// context handed to `decode` is a copy of `trainer_ctx` with autocast off.
template <class Decode>
void decode_batches(const Context& trainer_ctx, nn::EncoderDecoder& model, size_t n,
                    Decode&& decode) {
  Context ctx = trainer_ctx;
  ctx.autocast_bf16 = false;
  int workers = static_cast<int>(
      std::min<size_t>(n, static_cast<size_t>(std::max(1, ctx.resolved_threads()))));
  // A lazy layer not materialised yet would draw its own weights in each replica.
  for (const auto& [name, p] : model.named_parameters())
    if (!p->value.defined()) workers = 1;
  if (workers <= 1) {
    cpu::GemmFixedPackingScope packings;  // the weights' GEMM packings kept across batches
    for (size_t i = 0; i < n; ++i)
      decode(ctx, model, i);
    return;
  }
  std::vector<std::unique_ptr<nn::EncoderDecoder>> replicas;
  for (int w = 1; w < workers; ++w)
    replicas.push_back(replica_of(model));
  std::vector<Context> contexts(static_cast<size_t>(workers), ctx);
  for (Context& c : contexts)
    c.threads = 1;
  std::exception_ptr error;
  std::mutex error_mu;
#pragma omp parallel num_threads(workers)
  {
    cpu::GemmFixedPackingScope packings;  // each thread's packings, kept across its batches
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
      const int w = omp_get_thread_num();
      try {
        decode(contexts[static_cast<size_t>(w)],
               w == 0 ? model : *replicas[static_cast<size_t>(w - 1)], static_cast<size_t>(i));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

std::string checkpoint_format(const std::string& path) {
  return format_of(load_safetensors(path), path);
}

// ----------------------------------------------------------------------------------------------
// Options as JSON

std::string to_json(const Seq2SeqTrainOptions& o) {
  const nn::Seq2SeqConfig& m = o.model;
  nlohmann::json j = {
      {"model",
       {{"type", "seq2seq"},
        {"src_vocab_size", m.src_vocab_size},
        {"tgt_vocab_size", m.tgt_vocab_size},
        {"num_hiddens", m.num_hiddens},
        {"ffn_num_hiddens", m.ffn_num_hiddens},
        {"num_heads", m.num_heads},
        {"num_enc_blks", m.num_enc_blks},
        {"num_dec_blks", m.num_dec_blks},
        {"dropout", m.dropout},
        {"use_bias", m.use_bias},
        {"max_len", m.max_len}}},
      {"num_steps", o.num_steps},
      {"preprocess",
       {{"nbsp_to_space", o.preprocess.nbsp_to_space},
        {"lowercase", o.preprocess.lowercase},
        {"space_before_punct", o.preprocess.space_before_punct}}},
  };
  detail::write_shared_options(j, o.adamw, o.clip_norm, o.seed);
  return j.dump();
}

Seq2SeqTrainOptions seq2seq_train_options_from_json(const std::string& text) {
  const char* op = "Seq2SeqTrainOptions";
  Seq2SeqTrainOptions o;
  auto read_own = [&](const nlohmann::json& j) {
    const auto& m = j.at("model");
    const std::string type = m.at("type").get<std::string>();
    check(type == "seq2seq", op, "model type '{}', expected 'seq2seq'", type);
    o.model.src_vocab_size = m.at("src_vocab_size").get<int64_t>();
    o.model.tgt_vocab_size = m.at("tgt_vocab_size").get<int64_t>();
    o.model.num_hiddens = m.at("num_hiddens").get<int64_t>();
    o.model.ffn_num_hiddens = m.at("ffn_num_hiddens").get<int64_t>();
    o.model.num_heads = m.at("num_heads").get<int64_t>();
    o.model.num_enc_blks = m.at("num_enc_blks").get<int64_t>();
    o.model.num_dec_blks = m.at("num_dec_blks").get<int64_t>();
    o.model.dropout = m.at("dropout").get<double>();
    o.model.use_bias = m.at("use_bias").get<bool>();
    o.model.max_len = m.at("max_len").get<int64_t>();
    o.num_steps = j.at("num_steps").get<int64_t>();
    const auto& p = j.at("preprocess");
    o.preprocess.nbsp_to_space = p.at("nbsp_to_space").get<bool>();
    o.preprocess.lowercase = p.at("lowercase").get<bool>();
    o.preprocess.space_before_punct = p.at("space_before_punct").get<bool>();
  };
  detail::read_options_json(op, text, read_own, o.adamw, o.clip_norm, o.seed);
  return o;
}

// ----------------------------------------------------------------------------------------------
// Trainer

Seq2SeqTrainer::Seq2SeqTrainer(const Seq2SeqTrainOptions& options, Vocabulary src_vocab,
                               Vocabulary tgt_vocab)
    : options_(options), src_vocab_(std::move(src_vocab)), tgt_vocab_(std::move(tgt_vocab)) {
  const char* op = "Seq2SeqTrainer";
  detail::check_shared_options(op, options.clip_norm, options.threads);
  check(options.num_steps >= 2, op, "num_steps must be >= 2 (a token and <eos>), got {}",
        options.num_steps);
  check(options.model.dtype == DType::F32, op, "the model dtype must be float32");
  check(src_vocab_.reserved() == Reserved::kSeq2Seq && tgt_vocab_.reserved() == Reserved::kSeq2Seq,
        op, "both vocabularies must reserve <pad> <unk> <bos> <eos> (Reserved::kSeq2Seq)");
  check(src_vocab_.size() == options.model.src_vocab_size &&
            tgt_vocab_.size() == options.model.tgt_vocab_size,
        op,
        "vocabulary sizes {} and {} differ from the model's src_vocab_size {} and "
        "tgt_vocab_size {}",
        src_vocab_.size(), tgt_vocab_.size(), options.model.src_vocab_size,
        options.model.tgt_vocab_size);
  options_.model.seed = options.seed;
  ctx_.threads = options.threads;
  ctx_.seed = options.seed;
  ctx_.autocast_bf16 = options.precision == Precision::kBFloat16;
  model_ = std::make_unique<nn::EncoderDecoder>(options_.model);
  // The feed-forward layers are lazy (d2l's LazyLinear): one eval-mode forward on a single token
  // creates them now, so the optimiser and every checkpoint see all parameters from step 0.
  {
    EvalScope scope(*model_, ctx_);
    const Tensor one = Tensor::from_vector(std::vector<int64_t>{Vocabulary::kEos}, {1, 1});
    model_->forward(ctx_, one, one, ids_tensor({1}));
  }
  optimizer_ = std::make_unique<nn::AdamW>(model_->named_parameters(), options.adamw);
}

Seq2SeqStepStats Seq2SeqTrainer::train_step(const Seq2SeqBatch& batch) {
  check(batch.size() > 0, "train", "empty batch");
  model_->train();
  optimizer_->zero_grad();
  // d2l 1.0 Seq2Seq.loss: CE over the labels that are not <pad>, i.e. t < tgt_valid_lens[b].
  CrossEntropyOptions ce;
  ce.valid_lens = batch.tgt_valid_lens;
  Tensor logits = model_->forward(ctx_, batch.src, batch.dec_input, batch.src_valid_lens);
  CrossEntropyWithGrad ce_step = softmax_cross_entropy_with_grad(ctx_, logits, batch.labels, ce);
  const CrossEntropyResult loss = ce_step.result;
  detail::check_loss_finite(loss.loss, step_ + 1, options_.adamw.lr);
  model_->backward(ctx_, ce_step.dlogits);
  const double norm =
      detail::clip_gradients(optimizer_->parameters(), options_.clip_norm, ctx_.resolved_threads());
  optimizer_->threads = ctx_.resolved_threads();
  optimizer_->step();
  ++step_;
  return {step_, loss.loss, norm, loss.kept};
}

std::vector<std::vector<int64_t>> Seq2SeqTrainer::greedy_ids(
    const std::vector<std::vector<int64_t>>& sources, int64_t batch_size) {
  check(batch_size >= 1, "translate", "batch_size must be >= 1, got {}", batch_size);
  EvalScope scope(*model_, ctx_);
  std::vector<std::vector<int64_t>> out;
  GenerationOptions g;
  g.bos = Vocabulary::kBos;
  g.eos = Vocabulary::kEos;
  g.max_len = options_.num_steps;
  const Seq2SeqBatchOptions bo{options_.num_steps, true};
  const size_t step = static_cast<size_t>(batch_size);
  out.resize(sources.size());
  decode_batches(
      ctx_, *model_, (sources.size() + step - 1) / step,
      [&](Context& ctx, nn::EncoderDecoder& model, size_t i) {
        const size_t first = i * step, last = std::min(sources.size(), first + step);
        const SourceBatch b = make_source_batch(
            std::vector<std::vector<int64_t>>(sources.begin() + static_cast<std::ptrdiff_t>(first),
                                              sources.begin() + static_cast<std::ptrdiff_t>(last)),
            bo);
        Generation gen = greedy_search(ctx, model, b.src, b.valid_lens, g);
        for (size_t r = first; r < last; ++r)
          out[r] = std::move(gen.tokens[r - first]);
      });
  return out;
}

Seq2SeqEvalStats Seq2SeqTrainer::evaluate(const Seq2SeqDataset& data, int64_t batch_size) {
  check(data.size() > 0, "evaluate", "empty evaluation set");
  check(data.src_vocab_size == src_vocab_.size() && data.tgt_vocab_size == tgt_vocab_.size(),
        "evaluate", "the data's vocabulary sizes ({}, {}) differ from the model's ({}, {})",
        data.src_vocab_size, data.tgt_vocab_size, src_vocab_.size(), tgt_vocab_.size());
  Seq2SeqEvalStats s;
  {
    EvalScope scope(*model_, ctx_);
    double loss_sum = 0;
    CrossEntropyOptions ce;
    ce.reduction = Reduction::kSum;
    for (const Seq2SeqBatch& b :
         make_seq2seq_batches(data, batch_size, {options_.num_steps, true})) {
      ce.valid_lens = b.tgt_valid_lens;
      const Tensor logits = model_->forward(ctx_, b.src, b.dec_input, b.src_valid_lens);
      const CrossEntropyResult r = softmax_cross_entropy(ctx_, logits, b.labels, ce);
      loss_sum += r.loss;
      s.tokens += r.kept;
    }
    s.loss = s.tokens > 0 ? loss_sum / static_cast<double>(s.tokens) : 0.0;
  }
  const std::vector<std::vector<int64_t>> pred = greedy_ids(data.sources, batch_size);
  std::vector<std::vector<std::string>> preds, labels;
  for (size_t i = 0; i < pred.size(); ++i) {
    preds.push_back(ids_to_tokens(pred[i], tgt_vocab_));
    std::vector<std::string> label;
    for (int64_t id : data.targets[i])
      label.push_back(tgt_vocab_.token(id));
    labels.push_back(std::move(label));
  }
  s.examples = data.size();
  s.bleu = mean_bleu(preds, labels, 4);
  s.exact_match = exact_match(preds, labels);
  return s;
}

Translations Seq2SeqTrainer::translate(const std::vector<std::vector<std::string>>& sources,
                                       const TranslateOptions& options) {
  const char* op = "translate";
  check(options.beam_size >= 1, op, "beam size must be >= 1, got {}", options.beam_size);
  check(options.max_len >= 0, op, "max_len must be >= 0 (0: num_steps), got {}", options.max_len);
  check(options.batch_size >= 1, op, "batch_size must be >= 1, got {}", options.batch_size);
  Translations out;
  out.tokens.resize(sources.size());
  // Empty sources keep their empty translation; the others are decoded batch_size at a time.
  std::vector<size_t> rows;
  for (size_t i = 0; i < sources.size(); ++i)
    if (!sources[i].empty()) rows.push_back(i);
  EvalScope scope(*model_, ctx_);
  GenerationOptions g;
  g.bos = Vocabulary::kBos;
  g.eos = Vocabulary::kEos;
  g.max_len = options.max_len > 0 ? options.max_len : options_.num_steps;
  g.beam_size = options.beam_size;
  g.length_penalty = options.length_penalty;
  const Seq2SeqBatchOptions bo{options_.num_steps, true};
  const size_t step = static_cast<size_t>(options.batch_size);
  const size_t batches = (rows.size() + step - 1) / step;
  std::vector<std::vector<int64_t>> cuts(batches);  // per batch, so threads never share a vector
  decode_batches(ctx_, *model_, batches, [&](Context& ctx, nn::EncoderDecoder& model, size_t i) {
    const size_t first = i * step, last = std::min(rows.size(), first + step);
    std::vector<std::vector<int64_t>> ids;
    for (size_t r = first; r < last; ++r)
      ids.push_back(encode_seq2seq_tokens(sources[rows[r]], src_vocab_));
    const SourceBatch b = make_source_batch(ids, bo);
    for (int64_t c : b.cut)
      cuts[i].push_back(static_cast<int64_t>(rows[first + static_cast<size_t>(c)]));
    const Generation gen = options.beam_size == 1
                               ? greedy_search(ctx, model, b.src, b.valid_lens, g)
                               : beam_search(ctx, model, b.src, b.valid_lens, g);
    for (size_t r = first; r < last; ++r) {
      auto& dst = out.tokens[rows[r]];
      for (int64_t id : gen.tokens[r - first])
        dst.push_back(tgt_vocab_.token(id));
    }
  });
  for (const auto& c : cuts)
    out.cut.insert(out.cut.end(), c.begin(), c.end());
  return out;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints

void Seq2SeqTrainer::save_checkpoint(const std::string& path,
                                     const std::map<std::string, std::string>& extra) const {
  detail::save_checkpoint_file(path, *model_, *optimizer_, extra,
                               {{"attn.format", kSeq2SeqCheckpointFormat},
                                {"attn.options", to_json(options_)},
                                {"attn.src_vocab", src_vocab_.to_json()},
                                {"attn.tgt_vocab", tgt_vocab_.to_json()},
                                // Informative: a checkpoint loads in either precision.
                                {"attn.precision", precision_name(options_.precision)}},
                               step_, ctx_.dropout_offset());
}

std::map<std::string, std::string> Seq2SeqTrainer::load_checkpoint(const std::string& path) {
  const char* op = "load_checkpoint";
  const SafetensorsFile f = load_seq2seq_file(path);
  const Seq2SeqTrainOptions saved =
      seq2seq_train_options_from_json(meta_at(f, path, "attn.options"));
  check(to_json(saved) == to_json(options_), op,
        "{}: the checkpoint was trained with other options: {}", path,
        detail::first_difference(to_json(saved), to_json(options_)));
  check(meta_at(f, path, "attn.src_vocab") == src_vocab_.to_json() &&
            meta_at(f, path, "attn.tgt_vocab") == tgt_vocab_.to_json(),
        op, "{}: the checkpoint's vocabularies differ from this trainer's", path);
  detail::RestoredState r = detail::restore_checkpoint(f, path, *model_, *optimizer_, kKind);
  step_ = r.step;
  ctx_.set_dropout_offset(r.dropout_offset);
  return std::move(r.extra);
}

std::unique_ptr<Seq2SeqTrainer> Seq2SeqTrainer::from_checkpoint(const std::string& path,
                                                                int threads) {
  const SafetensorsFile f = load_seq2seq_file(path);
  Seq2SeqTrainOptions o = seq2seq_train_options_from_json(meta_at(f, path, "attn.options"));
  o.threads = threads;
  // Checkpoints written before the precision was recorded were float32 runs.
  if (auto it = f.metadata.find("attn.precision"); it != f.metadata.end())
    o.precision = parse_precision(it->second);
  Vocabulary src = Vocabulary::from_json(meta_at(f, path, "attn.src_vocab"), Reserved::kSeq2Seq);
  Vocabulary tgt = Vocabulary::from_json(meta_at(f, path, "attn.tgt_vocab"), Reserved::kSeq2Seq);
  auto trainer = std::make_unique<Seq2SeqTrainer>(o, std::move(src), std::move(tgt));
  trainer->load_checkpoint(path);
  return trainer;
}

}  // namespace attn::model
