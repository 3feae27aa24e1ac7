// SequenceModel (encoder + head), the training step, evaluation and checkpoints (see
// attn/model/trainer.hpp).
#include "attn/model/trainer.hpp"

#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/ops/loss.hpp"
#include "model/training/checkpoint_io.hpp"
#include "model/training/device_step.hpp"
#include "model/training/eval_scope.hpp"
#include "model/training/train_options.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <exception>
#include <functional>
#include <span>

namespace attn::model {

namespace {

constexpr const char* kFormat = "attn-checkpoint/1";

}  // namespace

// ----------------------------------------------------------------------------------------------
// Options as JSON

const char* precision_name(Precision p) {
  return p == Precision::kBFloat16 ? "bf16" : "fp32";
}

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::kFloat32;
  if (name == "bf16") return Precision::kBFloat16;
  throw Error("precision", fmt::format("unknown precision '{}', expected fp32 or bf16", name));
}

std::string to_json(const TrainOptions& o) {
  const ModelConfig& m = o.model;
  nlohmann::json j = {
      {"model",
       {{"type", task_type_name(m.type)},
        {"vocab_size", m.vocab_size},
        {"num_classes", m.num_classes},
        {"num_hiddens", m.num_hiddens},
        {"ffn_num_hiddens", m.ffn_num_hiddens},
        {"num_heads", m.num_heads},
        {"num_blks", m.num_blks},
        {"dropout", m.dropout},
        {"positional", nn::positional_kind_name(m.positional)},
        {"max_len", m.max_len}}},
  };
  detail::write_shared_options(j, o.adamw, o.clip_norm, o.seed);
  return j.dump();
}

TrainOptions train_options_from_json(const std::string& text) {
  const char* op = "TrainOptions";
  TrainOptions o;
  auto read_model = [&](const nlohmann::json& j) {
    const auto& m = j.at("model");
    const std::string type = m.at("type").get<std::string>();
    check(type == "classification" || type == "tagging", op, "unknown task type '{}'", type);
    o.model.type = type == "tagging" ? TaskType::kTagging : TaskType::kClassification;
    o.model.vocab_size = m.at("vocab_size").get<int64_t>();
    o.model.num_classes = m.at("num_classes").get<int64_t>();
    o.model.num_hiddens = m.at("num_hiddens").get<int64_t>();
    o.model.ffn_num_hiddens = m.at("ffn_num_hiddens").get<int64_t>();
    o.model.num_heads = m.at("num_heads").get<int64_t>();
    o.model.num_blks = m.at("num_blks").get<int64_t>();
    o.model.dropout = m.at("dropout").get<double>();
    o.model.positional = nn::parse_positional_kind(m.at("positional").get<std::string>());
    o.model.max_len = m.at("max_len").get<int64_t>();
  };
  detail::read_options_json(op, text, read_model, o.adamw, o.clip_norm, o.seed);
  return o;
}

// ----------------------------------------------------------------------------------------------
// Trainer

Trainer::Trainer(const TrainOptions& options, std::shared_ptr<Communicator> comm)
    : options_(options), comm_(comm ? std::move(comm) : single_process_communicator()) {
  const char* op = "Trainer";
  detail::check_shared_options(op, options.clip_norm, options.threads);
  ctx_.threads = options.threads;
  ctx_.seed = options.seed;
  ctx_.autocast_bf16 = options.precision == Precision::kBFloat16;
  model_ = std::make_unique<SequenceModel>(options.model, options.seed);
  // The FFN's first layer is lazy (d2l's LazyLinear): one eval-mode forward on a single token
  // creates it now, so the optimiser and every checkpoint see all parameters from step 0. It
  // draws no dropout offset (eval mode) and its initial values come from the seed alone.
  model_->eval();
  model_->forward(ctx_, Tensor::zeros({1, 1}, DType::I64),
                  Tensor::from_vector(std::vector<int64_t>{1}, {1}));
  model_->train();
  optimizer_ = std::make_unique<nn::AdamW>(model_->named_parameters(), options.adamw);
  if (options.device == Device::kCuda) {
    check(comm_->size() == 1, op,
          "--device cuda trains in one process; data-parallel training on GPUs is not written yet");
    device_ = detail::make_cuda_train_step(*model_, *optimizer_, options);
  }
  if (comm_->size() == 1) return;

  // Every rank must build the same model: the same options (a hash of their JSON; threads are
  // not in it) and the same parameter shapes.
  const std::vector<int64_t> options_hash = {
      static_cast<int64_t>(std::hash<std::string>{}(to_json(options_)) & 0x7fffffffffffffff)};
  comm_->check_same(op, "the training options (a hash of their JSON)", options_hash);
  std::vector<int64_t> sizes;
  for (const auto& [name, p] : optimizer_->parameters()) {
    sizes.push_back(p->value.numel());
    check(p->grad.dtype() == DType::F32, op,
          "parameter {} is {}, data-parallel training reduces "
          "float32 gradients",
          name, dtype_name(p->grad.dtype()));
  }
  comm_->check_same(op, "the parameter sizes (numel of each, in order)", sizes);
  buckets_.resize(static_cast<size_t>(model_->num_stages()));
  for (const auto& [name, p] : optimizer_->parameters())
    buckets_[static_cast<size_t>(model_->stage_of(name))].params.push_back(p);
  for (Bucket& b : buckets_) {
    size_t n = 0;
    for (const nn::Parameter* p : b.params)
      n += static_cast<size_t>(p->grad.numel());
    b.buffer.resize(n);
  }
}

Trainer::~Trainer() = default;

std::string Trainer::device_description() const {
  return device_ ? device_->description() : "cpu";
}

void Trainer::sync_host() const {
  if (!device_ || !host_stale_) return;
  device_->download();
  host_stale_ = false;
}

StepStats Trainer::train_step(const Batch& batch) {
  if (device_) {
    const detail::DeviceStepResult r = device_->step(batch, ctx_.dropout_offset());
    ctx_.set_dropout_offset(ctx_.dropout_offset() + device_->offsets_per_step());
    host_stale_ = true;
    ++step_;
    return {step_, r.loss, r.grad_norm, batch.tokens};
  }
  if (comm_->size() > 1) return train_step_parallel(batch);
  model_->train();
  optimizer_->zero_grad();
  CrossEntropyOptions ce;  // ignore_index = kIgnoreTag: padding and untargeted positions
  static_assert(kIgnoreTag == -100);
  Tensor logits = model_->forward(ctx_, batch.ids, batch.valid_lens);
  CrossEntropyWithGrad ce_step = softmax_cross_entropy_with_grad(ctx_, logits, batch.targets, ce);
  const CrossEntropyResult loss = ce_step.result;
  detail::check_loss_finite(loss.loss, step_ + 1, options_.adamw.lr);
  model_->backward(ctx_, ce_step.dlogits);
  const double norm =
      detail::clip_gradients(optimizer_->parameters(), options_.clip_norm, ctx_.resolved_threads());
  optimizer_->threads = ctx_.resolved_threads();
  optimizer_->step();
  ++step_;
  return {step_, loss.loss, norm, batch.tokens};
}

// Packs the stage's gradients into its buffer and starts their sum over the ranks.
void Trainer::start_bucket(Bucket& bucket) {
  float* out = bucket.buffer.data();
  for (const nn::Parameter* p : bucket.params) {
    const Tensor g = p->grad.contiguous();
    std::copy_n(g.data<float>(), g.numel(), out);
    out += g.numel();
  }
  if (!bucket.buffer.empty()) bucket.request = comm_->iallreduce(std::span<float>(bucket.buffer));
}

StepStats Trainer::train_step_parallel(const Batch& batch) {
  const char* op = "train";
  const int N = comm_->size(), r = comm_->rank();
  const int64_t B = batch.size();
  check(B >= N, op, "the global batch has {} sequences, fewer than the {} ranks", B, N);
  const int64_t T = batch.ids.dim(1);
  // The same step and global batch everywhere, or the summed gradients would be nonsense. The
  // check travels while the step computes (the buckets have the same sizes on every rank
  // whatever the batch, so a mismatch cannot deadlock them) and is decided before the update.
  const std::vector<int64_t> agree = {step_, B, T, batch.tokens,
                                      static_cast<int64_t>(ctx_.dropout_offset())};
  SameCheck same_batch(*comm_, op,
                       "the step or the global batch (step, B, T, tokens, dropout offset)", agree);
  // This rank's rows; padded to the global T so positions mean the same on every rank.
  const int64_t lo = B * r / N, hi = B * (r + 1) / N;
  const Tensor ids = batch.ids.slice(0, lo, hi), valid_lens = batch.valid_lens.slice(0, lo, hi),
               targets = batch.targets.slice(0, lo, hi);
  // The 1-rank loss is the mean over the global batch's kept positions; each rank sums its own
  // and divides by that global count, so the ranks' gradients add up to the 1-rank gradient.
  const Tensor all_targets = batch.targets.contiguous();
  int64_t kept = 0;
  for (int64_t i = 0; i < all_targets.numel(); ++i)
    kept += all_targets.data<int64_t>()[i] != kIgnoreTag;

  model_->train();
  optimizer_->zero_grad();
  CrossEntropyOptions ce;
  ce.reduction = Reduction::kSum;
  // Dropout masks follow the global sample: this rank's rows are samples [lo, hi) of the global
  // batch, so every dropout site draws the masks the 1-rank step draws for them
  // (Context::dropout_first_sample), in the forward and again in the backward.
  struct SampleWindow {
    Context& ctx;
    ~SampleWindow() { ctx.dropout_first_sample = 0; }
  } window{ctx_};
  ctx_.dropout_first_sample = static_cast<uint64_t>(lo);
  Tensor logits = model_->forward(ctx_, ids, valid_lens);
  const double scale = kept > 0 ? 1.0 / static_cast<double>(kept) : 0.0;
  CrossEntropyWithGrad local = softmax_cross_entropy_with_grad(ctx_, logits, targets, ce, scale);
  double loss_sum[1] = {local.result.loss};
  Request loss_request = comm_->iallreduce(std::span<double>(loss_sum));
  // Each stage's bucket starts as soon as its gradients are final; testing the earlier ones
  // between stages lets MPI progress them while backward computes.
  model_->backward(ctx_, local.dlogits, [&](int64_t stage) {
    start_bucket(buckets_[static_cast<size_t>(stage)]);
    for (int64_t s = 0; s < stage; ++s)
      buckets_[static_cast<size_t>(s)].request.test();
  });
  loss_request.wait();
  for (Bucket& b : buckets_)
    b.request.wait();
  same_batch.finish();  // throws with nothing in flight and no parameter changed
  for (Bucket& b : buckets_) {
    const float* in = b.buffer.data();
    for (nn::Parameter* p : b.params) {
      check(p->grad.is_contiguous(), op, "a gradient is not contiguous");
      std::copy_n(in, p->grad.numel(), p->grad.data<float>());
      in += p->grad.numel();
    }
  }
  const double loss = kept > 0 ? loss_sum[0] / static_cast<double>(kept) : std::nan("");
  detail::check_loss_finite(loss, step_ + 1, options_.adamw.lr);
  const double norm =
      detail::clip_gradients(optimizer_->parameters(), options_.clip_norm, ctx_.resolved_threads());
  optimizer_->threads = ctx_.resolved_threads();
  optimizer_->step();
  ++step_;
  return {step_, loss, norm, batch.tokens};
}

namespace {

// Argmax over the last dim of contiguous logits (N, C) -> N ids (first maximum wins).
template <typename T>
void argmax_rows(const T* logits, int64_t N, int64_t C, int64_t* out) {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * C;
    int64_t best = 0;
    for (int64_t c = 1; c < C; ++c)
      if (row[c] > row[best]) best = c;
    out[n] = best;
  }
}

}  // namespace

Tensor Trainer::predict(const Batch& batch) {
  sync_host();
  Tensor logits;
  {
    detail::EvalScope scope(*model_, ctx_);  // must not shift the training dropout stream
    logits = model_->forward(ctx_, batch.ids, batch.valid_lens).contiguous();
  }
  const int64_t C = logits.dim(-1);
  Shape shape = logits.shape();
  shape.pop_back();
  Tensor pred = Tensor::empty(shape, DType::I64);
  if (logits.dtype() == DType::F32)
    argmax_rows(logits.data<float>(), pred.numel(), C, pred.data<int64_t>());
  else
    argmax_rows(logits.data<double>(), pred.numel(), C, pred.data<int64_t>());
  return pred;
}

EvalStats Trainer::evaluate(const std::vector<Batch>& batches) {
  sync_host();
  EvalStats s;
  double loss_sum = 0;
  CrossEntropyOptions ce;
  ce.reduction = Reduction::kSum;
  const size_t ranks = static_cast<size_t>(comm_->size());
  {
    detail::EvalScope scope(*model_, ctx_);  // back to training before the collective below
    for (size_t i = static_cast<size_t>(comm_->rank()); i < batches.size(); i += ranks) {
      const Batch& b = batches[i];
      Tensor logits = model_->forward(ctx_, b.ids, b.valid_lens).contiguous();
      const CrossEntropyResult r = softmax_cross_entropy(ctx_, logits, b.targets, ce);
      loss_sum += r.loss;
      const int64_t C = logits.dim(-1), N = logits.numel() / C;
      std::vector<int64_t> pred(static_cast<size_t>(N));
      if (logits.dtype() == DType::F32)
        argmax_rows(logits.data<float>(), N, C, pred.data());
      else
        argmax_rows(logits.data<double>(), N, C, pred.data());
      const Tensor targets = b.targets.contiguous();
      const int64_t* t = targets.data<int64_t>();
      for (int64_t n = 0; n < N; ++n) {
        if (t[n] == kIgnoreTag) continue;
        ++s.count;
        s.correct += pred[static_cast<size_t>(n)] == t[n];
      }
    }
  }
  if (ranks > 1) {
    // Sums of up to 2^53 counts are exact in double.
    double sums[3] = {loss_sum, static_cast<double>(s.correct), static_cast<double>(s.count)};
    comm_->allreduce(std::span<double>(sums));
    loss_sum = sums[0];
    s.correct = static_cast<int64_t>(sums[1]);
    s.count = static_cast<int64_t>(sums[2]);
  }
  if (s.count > 0) {
    s.loss = loss_sum / static_cast<double>(s.count);
    s.accuracy = static_cast<double>(s.correct) / static_cast<double>(s.count);
  }
  return s;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints

namespace {

// Runs `fn` on rank 0 only, then hands its outcome to every rank: all return, or all throw rank
// 0's Error (so a failed write stops every rank, not just the writer).
template <typename F>
void on_rank0_collectively(Communicator& comm, const char* op, F&& fn) {
  std::string message;
  if (comm.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      message = e.what();
      if (message.empty()) message = "failed";
    }
  }
  if (comm.size() == 1) {
    if (!message.empty()) throw Error(op, message);
    return;
  }
  int64_t length = static_cast<int64_t>(message.size());
  comm.broadcast(&length, sizeof length, 0);
  message.resize(static_cast<size_t>(length));
  comm.broadcast(message.data(), length, 0);
  if (length > 0) throw Error(op, fmt::format("on rank 0: {}", message));
}

// Runs `fn` on every rank; when it fails on any, every rank throws (its own error, or one naming
// how many ranks failed), so no rank goes on alone into the next collective.
template <typename F>
auto on_every_rank_collectively(Communicator& comm, const char* op, F&& fn) {
  std::exception_ptr error;
  decltype(fn()) result{};
  try {
    result = fn();
  } catch (...) {
    error = std::current_exception();
  }
  if (comm.size() > 1) {
    int64_t failed[1] = {error ? 1 : 0};
    comm.allreduce(std::span<int64_t>(failed));
    if (!error && failed[0] > 0)
      throw Error(op, fmt::format("failed on {} of the {} ranks (see their messages)", failed[0],
                                  comm.size()));
  }
  if (error) std::rethrow_exception(error);
  return result;
}

}  // namespace

void Trainer::save_checkpoint(const std::string& path,
                              const std::map<std::string, std::string>& extra) const {
  on_rank0_collectively(*comm_, "save_checkpoint", [&] { save_checkpoint_local(path, extra); });
}

void Trainer::save_checkpoint_local(const std::string& path,
                                    const std::map<std::string, std::string>& extra) const {
  sync_host();
  detail::save_checkpoint_file(path, *model_, *optimizer_, extra,
                               {{"attn.format", kFormat},
                                {"attn.options", to_json(options_)},
                                // Informative: a checkpoint loads in either precision.
                                {"attn.precision", precision_name(options_.precision)}},
                               step_, ctx_.dropout_offset());
}

namespace {

using detail::meta_at;

SafetensorsFile load_checked(const std::string& path) {
  SafetensorsFile f = load_safetensors(path);
  const std::string& format = meta_at(f, path, "attn.format");
  check(format == kFormat, "load_checkpoint", "{}: format '{}', expected '{}'", path, format,
        kFormat);
  return f;
}

}  // namespace

TrainOptions Trainer::checkpoint_options(const std::string& path) {
  const SafetensorsFile f = load_checked(path);
  TrainOptions o = train_options_from_json(meta_at(f, path, "attn.options"));
  // Checkpoints written before the precision was recorded were float32 runs.
  if (auto it = f.metadata.find("attn.precision"); it != f.metadata.end())
    o.precision = parse_precision(it->second);
  return o;
}

std::map<std::string, std::string> Trainer::load_checkpoint(const std::string& path) {
  auto extra = on_every_rank_collectively(*comm_, "load_checkpoint",
                                          [&] { return load_checkpoint_local(path); });
  const std::vector<int64_t> state = {step_, static_cast<int64_t>(ctx_.dropout_offset())};
  comm_->check_same("load_checkpoint",
                    fmt::format("the step and dropout offset read from {}", path), state);
  return extra;
}

std::map<std::string, std::string> Trainer::load_checkpoint_local(const std::string& path) {
  const char* op = "load_checkpoint";
  const SafetensorsFile f = load_checked(path);
  const TrainOptions saved = train_options_from_json(meta_at(f, path, "attn.options"));
  // Compared through their JSON, which leaves out threads (results do not depend on it).
  check(to_json(saved) == to_json(options_), op,
        "{}: the checkpoint was trained with other options: {}", path,
        detail::first_difference(to_json(saved), to_json(options_)));
  detail::RestoredState r = detail::restore_checkpoint(f, path, *model_, *optimizer_);
  step_ = r.step;
  ctx_.set_dropout_offset(r.dropout_offset);
  if (device_) {
    device_->upload();
    host_stale_ = false;
  }
  return std::move(r.extra);
}

}  // namespace attn::model
