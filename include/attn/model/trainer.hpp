// Training a Transformer encoder with a classification or tagging head: the model, one step of
// AdamW with gradient clipping, evaluation, and checkpoints that resume bit for bit.
//
// Vocabulary: B batch, T positions, E = num_hiddens, C classes (or tags), V vocabulary.
//
//   logits = head(TransformerEncoder(ids, valid_lens))      (B, C) or (B, T, C)
//   loss   = softmax_cross_entropy(logits, targets)         mean over kept positions
//   grads  = backward; clip_grad_norm(max_norm); AdamW step
//
// Reproducibility: a step is a pure function of (parameters, optimiser state, batch, dropout
// offset). Parameters are initialised from the seed, the kernels give the same bits for any
// thread count, and a checkpoint stores the parameters, the AdamW state, the step and the
// Context's dropout offset exactly, so "train 100 steps, save, load, train 100 more" gives the
// same losses as 200 steps in one go. (Batches must come from the step number, as the generated
// tasks and EpochSampler do; the trainer does not own the data.)
//
// Data parallel (a Communicator with N > 1 ranks, attn/core/comm.hpp; `mpirun -np N attn
// train`): every rank passes the same global batch of B sequences to train_step and computes
// only its shard, rows [r*B/N, (r+1)*B/N). The loss is the global batch's: each rank sums its
// kept positions' losses and scales its gradients by 1 / (kept positions of the global batch),
// so the sum of the ranks' gradients is the 1-rank gradient. That sum is reduced in buckets, one
// per encoder block (plus the head, plus the embeddings), each started with a non-blocking
// allreduce as soon as that block's backward has finished, and waited for before clipping and
// the AdamW step; every rank then takes the same step. So N ranks train the model 1 rank trains
// at the same global batch, up to float32 rounding of the reduction order (losses agree within
// 1e-5 relative after 20 steps; tests/mpi/test_mpi_trainer.cpp), with dropout too: each step
// sets the Context's sample window (Context::dropout_first_sample) to the rank's first global
// sample, and every dropout site draws its masks at the global sample's stream index, so a
// sample's masks do not depend on the rank that holds it. Rank 0 writes checkpoints
// (atomically); every rank loads them.
#pragma once

#include "attn/core/comm.hpp"
#include "attn/core/context.hpp"
#include "attn/core/device.hpp"
#include "attn/model/data.hpp"
#include "attn/model/precision.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/transformer.hpp"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace attn::model {

namespace detail {
class DeviceTrainStep;  // model/training/device_step.hpp
}

struct ModelConfig {
  TaskType type = TaskType::kTagging;
  int64_t vocab_size = 0, num_classes = 0;
  int64_t num_hiddens = 32, ffn_num_hiddens = 64, num_heads = 2, num_blks = 2;
  double dropout = 0.0;
  nn::PositionalKind positional = nn::PositionalKind::kSinusoidal;
  int64_t max_len = 1000;  // learned table size / sinusoidal cache (see TransformerEncoder)
  bool operator==(const ModelConfig&) const = default;
};

struct TrainOptions {
  ModelConfig model;
  nn::AdamWOptions adamw;  // lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01
  double clip_norm = 1.0;  // global L2 norm of the gradients; 0 turns clipping off
  uint64_t seed = 0;       // parameter initialisation and the dropout stream
  int threads = 0;         // 0: all hardware threads; results do not depend on it
  Precision precision = Precision::kFloat32;  // not in to_json (see Precision)
  // Where the steps run: kCuda keeps the parameters, gradients and AdamW state on the GPU
  // (float32, one process; docs/gpu.md) and copies them back for evaluation and checkpoints,
  // which are the same files as the CPU's. Not in to_json: a GPU run resumes on the CPU.
  Device device = Device::kCpu;
};

// JSON text of the options (what a checkpoint stores) and back. threads is not stored: it does
// not change results. Error("TrainOptions") for malformed text.
std::string to_json(const TrainOptions& options);
TrainOptions train_options_from_json(const std::string& json);

// Encoder + head as one module. State dict names: "encoder.<d2l names>", "head.dense.weight",
// "head.dense.bias".
class SequenceModel : public nn::Module {
 public:
  SequenceModel(const ModelConfig& config, uint64_t seed);
  std::vector<std::pair<std::string, nn::Parameter*>> named_parameters() override;
  void train(bool on = true) override;
  // ids (B, T), valid_lens (B,) -> logits (B, C) for classification, (B, T, C) for tagging.
  Tensor forward(Context& ctx, const Tensor& ids, const Tensor& valid_lens);
  void backward(Context& ctx, const Tensor& dlogits);  // accumulates every parameter gradient

  const ModelConfig& config() const { return config_; }
  // Keep every block's attention weights (d2l's encoder.attention_weights, for inspection) on
  // the next forward. Off by default: training and scoring never read them, and keeping them
  // sends the attention to the kernel that writes the (B*H, T, T) matrix (the reference loops
  // on Backend::kAuto) instead of the fused one. Results are the same either way up to float32
  // rounding.
  bool need_weights = false;
  // backward with a hook: `stage_done(s)` is called as soon as the parameters of stage s have
  // their final gradients, in order s = 0 (the head), 1..num_blks (block num_blks-1 down to
  // block 0), num_blks + 1 (embedding and positional table). stage_of() names a parameter's.
  void backward(Context& ctx, const Tensor& dlogits,
                const std::function<void(int64_t)>& stage_done);
  // The backward stage (see above) of the parameter named `name` in named_parameters().
  int64_t stage_of(const std::string& name) const;
  int64_t num_stages() const { return encoder.num_blks() + 2; }
  nn::TransformerEncoder encoder;
  std::unique_ptr<nn::ClassificationHead> classifier;  // exactly one of the two heads exists
  std::unique_ptr<nn::TaggingHead> tagger;

 private:
  ModelConfig config_;
  Tensor valid_lens_;
};

struct StepStats {
  int64_t step = 0;      // the step just taken, counting from 1
  double loss = 0;       // the batch's mean loss before the update
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // unpadded tokens in the batch
};

struct EvalStats {
  double loss = 0;      // mean over every kept position (or sequence) of the set
  double accuracy = 0;  // correct / count
  int64_t correct = 0, count = 0;
};

class Trainer {
 public:
  // `comm`: the ranks that train together (null: this process alone). Collective: every rank
  // constructs its Trainer with the same options (checked: Error("Trainer") otherwise).
  explicit Trainer(const TrainOptions& options, std::shared_ptr<Communicator> comm = nullptr);
  ~Trainer();

  // One optimisation step on the global `batch` (with N ranks, each computes its shard; see the
  // file comment). Throws Error("train") when the loss is not finite, when the ranks' batches
  // differ in step or shape, or when B < N.
  StepStats train_step(const Batch& batch);
  // Loss and accuracy over `batches` in eval mode (no dropout); the training state is unchanged.
  // With N ranks, rank r evaluates batches r, r + N, ... and the sums are reduced (collective).
  EvalStats evaluate(const std::vector<Batch>& batches);
  // Argmax predictions (B,) or (B, T) I64 for one batch, in eval mode.
  Tensor predict(const Batch& batch);

  // Writes model parameters ("model.*"), AdamW state ("optimizer.*"), and as metadata the step,
  // the dropout offset and to_json(options), plus `extra` (names must not start with "attn.").
  // Atomic: a temporary file renamed over `path` (attn::save_safetensors). With N ranks it is
  // collective: rank 0 writes (the ranks hold the same state), and every rank returns once the
  // file is complete, or throws rank 0's error.
  void save_checkpoint(const std::string& path,
                       const std::map<std::string, std::string>& extra = {}) const;
  // Restores everything save_checkpoint wrote; the checkpoint's options must equal this
  // trainer's (threads aside), else Error("load_checkpoint") naming the difference. Nothing
  // changes when anything is wrong. Returns the `extra` metadata. With N ranks it is collective:
  // every rank reads `path` (a file system all ranks see), and when any rank fails, all throw.
  std::map<std::string, std::string> load_checkpoint(const std::string& path);
  // The options stored in a checkpoint (to build a Trainer that can load it), with the precision
  // the checkpoint was trained in.
  static TrainOptions checkpoint_options(const std::string& path);

  int64_t step() const { return step_; }
  const TrainOptions& options() const { return options_; }
  // "cpu", or the GPU's description with --device cuda.
  std::string device_description() const;
  // The host model and optimiser (with --device cuda, refreshed from the GPU first).
  SequenceModel& model() {
    sync_host();
    return *model_;
  }
  Context& context() { return ctx_; }
  nn::AdamW& optimizer() {
    sync_host();
    return *optimizer_;
  }
  Communicator& communicator() { return *comm_; }

 private:
  // The gradients of one backward stage, packed for one non-blocking allreduce.
  struct Bucket {
    std::vector<nn::Parameter*> params;
    std::vector<float> buffer;
    Request request;
  };
  StepStats train_step_parallel(const Batch& batch);
  // With a device step: copies the device's parameters and AdamW state into the host model and
  // optimiser when steps ran since the last copy.
  void sync_host() const;
  void save_checkpoint_local(const std::string& path,
                             const std::map<std::string, std::string>& extra) const;
  std::map<std::string, std::string> load_checkpoint_local(const std::string& path);
  void start_bucket(Bucket& bucket);

  TrainOptions options_;
  std::shared_ptr<Communicator> comm_;
  Context ctx_;
  std::unique_ptr<SequenceModel> model_;
  std::unique_ptr<nn::AdamW> optimizer_;
  std::vector<Bucket> buckets_;  // by stage (SequenceModel::backward); only with N > 1
  std::unique_ptr<detail::DeviceTrainStep> device_;  // --device cuda
  mutable bool host_stale_ = false;                  // device steps since the last sync_host
  int64_t step_ = 0;
};

}  // namespace attn::model
