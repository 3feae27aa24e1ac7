// The encoder tasks' training step on CUDA (model/training/device_step.hpp): d2l's
// TransformerEncoder with a classification or tagging head, forward, cross-entropy, backward,
// gradient clipping and AdamW, as the CPU modules compute them (nn/transformer.cpp and its
// layers), float32, with the same dropout masks (the CPU's stream offsets in the CPU's order).
//
// Each batch shape (B, T) gets a Plan: its activations and scratch on the device and a pinned
// staging buffer for the batch's inputs. Its first step runs eagerly (cuBLASLt plans are made
// then); the second captures the whole step as one CUDA graph, and every later step of that shape
// replays it: one copy of the inputs in, one graph launch, one copy of the loss and norm out. What
// changes from step to step (dropout offset, AdamW's bias corrections, the loss's 1 / n_kept, the
// masks) lives in device memory, so the replayed kernels read each step's values.
//
// The parameters, gradients and AdamW moments are each one contiguous device arena in the order
// of SequenceModel::named_parameters (W_q, W_k, W_v adjacent: one stacked (3E, E) projection), so
// clipping and AdamW are one launch each. The host model holds a copy, refreshed by download().
//
// Glossary: B sequences, T positions, N = B T tokens, E width, F FFN width, H heads, D = E / H,
// C classes, L blocks, R rows of the head (B for classification, N for tagging).
#include "attn/core/error.hpp"
#include "attn/cuda/graph.hpp"
#include "attn/cuda/runtime.hpp"
#include "kernels/cuda/check.hpp"
#include "kernels/cuda/kernels.hpp"
#include "model/training/device_step.hpp"
#include "ops/mask.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <utility>
#include <vector>

namespace attn::cuda {
namespace {

using model::Batch;
using model::SequenceModel;
using model::TrainOptions;
using model::detail::DeviceStepResult;

constexpr const char* kOp = "train";

// Pinned host memory (copies from it are asynchronous and can be captured in a graph).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    ATTN_CUDA_CHECK(kOp, cudaHostAlloc(&data_, bytes > 0 ? bytes : 1, cudaHostAllocDefault));
  }
  ~PinnedBuffer() { (void)cudaFreeHost(data_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* data() const { return static_cast<char*>(data_); }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Byte offsets of the per-step inputs inside one staging buffer (host) and its device copy.
struct InputLayout {
  size_t scalars = 0, ids = 0, targets = 0, keep = 0, kept = 0, counts = 0, bytes = 0;
};
// Read by the kernels on the device; filled by the host before each step.
struct StepScalars {
  uint64_t dropout_offset = 0;
  uint64_t pad = 0;
  AdamWElement adam{};
};

size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}

float* f32(const Tensor& t) {
  return static_cast<float*>(t.raw_data());
}

// One block's parameter pointers inside the arenas (value, gradient).
struct BlockParams {
  size_t wqkv, wo, ln1_w, ln1_b, w1, b1, w2, b2, ln2_w, ln2_b;
  double eps1, eps2;
};

// The step's device buffers, sized for the largest shape seen so far (tokens N, scores B H T T):
// every batch shape's plan uses them (its prefixes), so bucketed batches of 65 lengths cost the
// memory of the longest, not of all.
struct Buffers {
  std::vector<Tensor> X, QKV, O, lse, S1, Y, mean1, rstd1, H1, Rl, S2, mean2, rstd2;
  // Attention as batched GEMMs (gemm_attention): per layer the heads of Q, K, V (3, B H, T, D)
  // and the softmax P (B H, T, T); scratch for the scores, dropped P and their gradients.
  std::vector<Tensor> heads, P, Pd;  // Pd: P after dropout (only with p > 0)
  Tensor scores, dPd, Oh, dheads;
  Tensor tmpE, tmpE2, pooled, logits, loss_rows, dlogits, dpooled, dX, dS, dF, dR, dH, dY, dO, dQKV,
      delta, ones;
};

// A batch shape: its inputs' staging buffer and device copy, and whether its graph exists.
struct Plan : Buffers {
  int64_t B = 0, T = 0;
  InputLayout layout;
  std::unique_ptr<PinnedBuffer> staging;
  Tensor inputs;  // device copy of the staging buffer
  bool gemm_attention = false;
  int runs = 0;  // eager runs so far (the second run captures)
};

class CudaEncoderStep final : public model::detail::DeviceTrainStep {
 public:
  CudaEncoderStep(SequenceModel& model, nn::AdamW& optimizer, const TrainOptions& options)
      : model_(model), optimizer_(optimizer), options_(options), graphs_(stream_.handle()) {
    const model::ModelConfig& c = options.model;
    check(options.precision == model::Precision::kFloat32, kOp,
          "--device cuda trains in fp32 (--precision {} on the GPU is not written yet)",
          model::precision_name(options.precision));
    check(c.positional == nn::PositionalKind::kSinusoidal ||
              c.positional == nn::PositionalKind::kLearned ||
              c.positional == nn::PositionalKind::kNone,
          kOp, "--device cuda supports --pe sinusoidal, learned or none, not {}",
          nn::positional_kind_name(c.positional));
    E_ = c.num_hiddens;
    F_ = c.ffn_num_hiddens;
    H_ = c.num_heads;
    L_ = c.num_blks;
    C_ = c.num_classes;
    D_ = E_ / H_;
    classification_ = c.type == model::TaskType::kClassification;
    p_ = c.dropout;
    max_len_ = c.max_len;
    lay_out_parameters();
    // Device arenas: values, gradients, AdamW moments; the sinusoidal table; clipping scratch.
    value_ = empty({total_}, DType::F32, stream());
    grad_ = zeros({total_}, DType::F32, stream());
    m_ = zeros({total_}, DType::F32, stream());
    v_ = zeros({total_}, DType::F32, stream());
    reduce_ = zeros({kSumSquaresScratch + 4}, DType::F64, stream());
    ln_scratch_ = empty({2 * kLayerNormChunks * E_}, DType::F32, stream());
    results_ = std::make_unique<PinnedBuffer>(4 * sizeof(double));
    if (c.positional == nn::PositionalKind::kSinusoidal) {
      table_ = empty({max_len_, E_}, DType::F32, stream());
      sinusoidal_encoding(f32(table_), max_len_, E_, stream());
    }
    upload();
  }

  ~CudaEncoderStep() override {
    if (!profile_ || profiled_steps_ == 0) return;
    // ATTN_CUDA_STEP_PROFILE=1: the eager step's phases, in milliseconds a step (all blocks).
    std::string line;
    double total = 0;
    for (const auto& [name, ms] : phase_ms_) {
      line += fmt::format(" {} {:.3f}", name, ms / profiled_steps_);
      total += ms / profiled_steps_;
    }
    std::fprintf(stderr, "[attn cuda step profile, %lld steps, ms a step] total %.3f:%s\n",
                 static_cast<long long>(profiled_steps_), total, line.c_str());
    for (auto& [name, e] : marks_)
      (void)cudaEventDestroy(e);
  }

  std::string description() const override { return device_description(); }

  uint64_t offsets_per_step() const override {
    return p_ > 0.0 ? static_cast<uint64_t>(1 + 3 * L_) : 0;
  }

  void upload() override {
    std::vector<float> host(static_cast<size_t>(total_));
    for (const Slot& s : slots_)
      std::memcpy(host.data() + s.offset, s.p->value.data<float>(), s.numel * sizeof(float));
    copy_in(value_, host);
    // AdamW's moments and step count, or zeros before the first step.
    const nn::StateDict state = optimizer_.state_dict();
    std::vector<float> m(static_cast<size_t>(total_), 0.0f), v(m);
    adam_step_ = -1;
    for (const Slot& s : slots_) {
      const auto step = state.find(s.name + ".step");
      const int64_t t = step == state.end() ? 0 : static_cast<int64_t>(step->second.flat(0));
      check(adam_step_ < 0 || adam_step_ == t, kOp,
            "AdamW state: parameter {} is at step {}, the others at {}; the GPU step keeps one "
            "count for all",
            s.name, t, adam_step_);
      adam_step_ = t;
      if (t == 0) continue;
      const Tensor em = state.at(s.name + ".exp_avg").contiguous();
      const Tensor ev = state.at(s.name + ".exp_avg_sq").contiguous();
      std::memcpy(m.data() + s.offset, em.data<float>(), s.numel * sizeof(float));
      std::memcpy(v.data() + s.offset, ev.data<float>(), s.numel * sizeof(float));
    }
    if (adam_step_ < 0) adam_step_ = 0;
    copy_in(m_, m);
    copy_in(v_, v);
    stream_.synchronize();
  }

  void download() override {
    const std::vector<float> w = copy_out(value_), m = copy_out(m_), v = copy_out(v_);
    nn::StateDict state;
    for (const Slot& s : slots_) {
      std::memcpy(s.p->value.data<float>(), w.data() + s.offset, s.numel * sizeof(float));
      if (adam_step_ == 0) continue;
      Tensor em = Tensor::empty(s.p->value.shape(), DType::F32);
      Tensor ev = Tensor::empty(s.p->value.shape(), DType::F32);
      std::memcpy(em.data<float>(), m.data() + s.offset, s.numel * sizeof(float));
      std::memcpy(ev.data<float>(), v.data() + s.offset, s.numel * sizeof(float));
      Tensor step = Tensor::zeros({1}, DType::F64);
      step.data<double>()[0] = static_cast<double>(adam_step_);
      state[s.name + ".step"] = step;
      state[s.name + ".exp_avg"] = em;
      state[s.name + ".exp_avg_sq"] = ev;
    }
    if (adam_step_ > 0) optimizer_.load_state_dict(state);
  }

  DeviceStepResult step(const Batch& batch, uint64_t dropout_offset) override {
    const int64_t B = batch.size();
    check(batch.ids.defined() && batch.ids.ndim() == 2 && B > 0, kOp,
          "the batch's ids have shape {}, expected (B, T) with B >= 1", shape_arg(batch.ids));
    const int64_t T = batch.ids.dim(1);
    check(T >= 1 && T <= max_len_, kOp, "the batch is {} positions long, the model's max_len is {}",
          T, max_len_);
    Plan& plan = plan_for(B, T);
    stage_inputs(plan, batch, dropout_offset);
    const size_t results_bytes = 2 * sizeof(double);
    auto body = [&] {
      ATTN_CUDA_CHECK(kOp, cudaMemcpyAsync(plan.inputs.raw_data(), plan.staging->data(),
                                           plan.layout.bytes, cudaMemcpyHostToDevice, as_stream()));
      mark("start");
      forward(plan);
      backward(plan);
      optimize(plan);
      mark("optimizer");
      ATTN_CUDA_CHECK(kOp, cudaMemcpyAsync(results_->data(), reduce_.raw_data(), results_bytes,
                                           cudaMemcpyDeviceToHost, as_stream()));
    };
    if (plan.runs < 1 || profile_) {
      body();  // eagerly: cuBLASLt's plans for these shapes are made now, outside any capture
      ++plan.runs;
    } else {
      graphs_.run({"encoder_step", {B, T}}, body);
    }
    stream_.synchronize();
    if (profile_) collect_marks();
    DeviceStepResult r;
    std::memcpy(&r.loss, results_->data(), sizeof(double));
    std::memcpy(&r.grad_norm, results_->data() + sizeof(double), sizeof(double));
    if (!std::isfinite(r.loss)) {
      // AdamW skipped its update on the device (it reads the loss first); nothing changed.
      throw Error(kOp, fmt::format("loss is {} at step {} (the learning rate {} may be too high)",
                                   r.loss, adam_step_ + 1, options_.adamw.lr));
    }
    ++adam_step_;
    return r;
  }

 private:
  struct Slot {
    std::string name;
    nn::Parameter* p;
    size_t offset, numel;
  };

  // Profiling (ATTN_CUDA_STEP_PROFILE set: every step runs eagerly with an event after each phase).
  void mark(const char* name) {
    if (!profile_) return;
    cudaEvent_t e = nullptr;
    ATTN_CUDA_CHECK(kOp, cudaEventCreate(&e));
    ATTN_CUDA_CHECK(kOp, cudaEventRecord(e, as_stream()));
    marks_.emplace_back(name, e);
  }
  void collect_marks() {
    for (size_t i = 1; i < marks_.size(); ++i) {
      float ms = 0;
      ATTN_CUDA_CHECK(kOp, cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second));
      phase_ms_[marks_[i].first] += ms;
    }
    for (auto& [name, e] : marks_)
      (void)cudaEventDestroy(e);
    marks_.clear();
    ++profiled_steps_;
  }

  void* stream() const { return stream_.handle(); }
  cudaStream_t as_stream() const { return static_cast<cudaStream_t>(stream_.handle()); }

  // Offsets of every parameter in the arenas, in named_parameters order, and each block's.
  void lay_out_parameters() {
    std::map<const nn::Parameter*, size_t> where;
    for (auto& [name, p] : model_.named_parameters()) {
      check(p->value.defined() && p->value.dtype() == DType::F32 && p->value.is_contiguous(), kOp,
            "parameter {} is not a contiguous float32 tensor", name);
      const size_t n = static_cast<size_t>(p->value.numel());
      slots_.push_back({name, p, static_cast<size_t>(total_), n});
      where[p] = static_cast<size_t>(total_);
      total_ += static_cast<int64_t>(n);
    }
    auto at = [&](const nn::Parameter& p, const char* what) {
      const auto it = where.find(&p);
      check(it != where.end(), kOp, "the model has no parameter {} where the GPU step expects one",
            what);
      return it->second;
    };
    nn::TransformerEncoder& enc = model_.encoder;
    embedding_ = at(enc.embedding.weight, "embedding.weight");
    if (enc.learned_pos) {
      learned_ = true;
      learned_pos_ = at(enc.learned_pos->weight, "pos_encoding.weight");
      check(enc.learned_pos->weight.value.dim(0) == max_len_, kOp,
            "the learned position table has {} rows, max_len is {}",
            enc.learned_pos->weight.value.dim(0), max_len_);
    }
    vocab_ = enc.embedding.weight.value.dim(0);
    for (auto& blk : enc.blks) {
      nn::MultiHeadAttention& a = blk->attention;
      check(!a.W_q.has_bias() && !a.W_o.has_bias(), kOp,
            "the GPU step covers d2l's attention without biases (use_bias = false)");
      BlockParams b{};
      b.wqkv = at(a.W_q.weight, "W_q.weight");
      const size_t ee = static_cast<size_t>(E_ * E_);
      check(at(a.W_k.weight, "W_k.weight") == b.wqkv + ee &&
                at(a.W_v.weight, "W_v.weight") == b.wqkv + 2 * ee,
            kOp, "W_q, W_k and W_v are not adjacent in the parameter order");
      b.wo = at(a.W_o.weight, "W_o.weight");
      b.ln1_w = at(blk->addnorm1.ln.weight, "addnorm1.ln.weight");
      b.ln1_b = at(blk->addnorm1.ln.bias, "addnorm1.ln.bias");
      b.w1 = at(blk->ffn.dense1.weight, "ffn.dense1.weight");
      b.b1 = at(blk->ffn.dense1.bias, "ffn.dense1.bias");
      b.w2 = at(blk->ffn.dense2.weight, "ffn.dense2.weight");
      b.b2 = at(blk->ffn.dense2.bias, "ffn.dense2.bias");
      b.ln2_w = at(blk->addnorm2.ln.weight, "addnorm2.ln.weight");
      b.ln2_b = at(blk->addnorm2.ln.bias, "addnorm2.ln.bias");
      b.eps1 = blk->addnorm1.ln.eps;
      b.eps2 = blk->addnorm2.ln.eps;
      blocks_.push_back(b);
    }
    nn::Linear& head = classification_ ? model_.classifier->dense : model_.tagger->dense;
    check(head.has_bias(), kOp, "the GPU step expects the head's Linear to have a bias");
    head_w_ = at(head.weight, "head.dense.weight");
    head_b_ = at(head.bias, "head.dense.bias");
    check(static_cast<int64_t>(blocks_.size()) == L_ && E_ % H_ == 0, kOp,
          "the model has {} blocks of width {} and {} heads, the options say {} blocks",
          blocks_.size(), E_, H_, L_);
  }

  void copy_in(const Tensor& dev, const std::vector<float>& host) {
    ATTN_CUDA_CHECK(kOp, cudaMemcpyAsync(dev.raw_data(), host.data(), host.size() * sizeof(float),
                                         cudaMemcpyHostToDevice, as_stream()));
    stream_.synchronize();  // `host` may go out of scope
  }
  std::vector<float> copy_out(const Tensor& dev) {
    std::vector<float> host(static_cast<size_t>(dev.numel()));
    ATTN_CUDA_CHECK(kOp, cudaMemcpyAsync(host.data(), dev.raw_data(), host.size() * sizeof(float),
                                         cudaMemcpyDeviceToHost, as_stream()));
    stream_.synchronize();
    return host;
  }

  float* w(size_t offset) const { return f32(value_) + offset; }
  float* g(size_t offset) const { return f32(grad_) + offset; }

  Plan& plan_for(int64_t B, int64_t T) {
    auto key = std::make_pair(B, T);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan& p = plans_[key];
    p.B = B;
    p.T = T;
    const int64_t N = B * T, R = classification_ ? B : N;
    InputLayout& l = p.layout;
    size_t at = 0;
    l.scalars = at;
    at = align_up(at + sizeof(StepScalars));
    l.ids = at;
    at = align_up(at + static_cast<size_t>(N) * 8);
    l.targets = at;
    at = align_up(at + static_cast<size_t>(R) * 8);
    l.keep = at;
    at = align_up(at + static_cast<size_t>(R));
    l.kept = at;
    at = align_up(at + static_cast<size_t>(B * H_ * T) * 4);
    l.counts = at;
    at = align_up(at + static_cast<size_t>(B) * 4);
    l.bytes = at;
    p.staging = std::make_unique<PinnedBuffer>(l.bytes);
    std::memset(p.staging->data(), 0, l.bytes);
    p.inputs = empty({static_cast<int64_t>(l.bytes / 4)}, DType::I32, stream());
    // Batched GEMMs and a softmax pass beat the fused SIMT kernel at d2l's short sequences; past
    // 64 MB of scores a layer (or with ATTN_CUDA_TRAIN_ATTENTION=flash) the fused kernel runs.
    const int64_t score_elems = B * H_ * T * T;
    const char* force = std::getenv("ATTN_CUDA_TRAIN_ATTENTION");
    p.gemm_attention = score_elems * 4 <= (int64_t{64} << 20) &&
                       !(force != nullptr && std::string(force) == "flash");
    const int64_t want_scores = p.gemm_attention ? score_elems : 0;
    if (N > cap_tokens_ || want_scores > cap_scores_) {
      // Larger buffers: every plan's graph pointed at the old ones, so all are captured again.
      cap_tokens_ = std::max(cap_tokens_, N);
      cap_scores_ = std::max(cap_scores_, want_scores);
      allocate(cap_tokens_, cap_scores_);
      graphs_.clear();
      for (auto& [shape, other] : plans_) {
        static_cast<Buffers&>(other) = work_;
        other.runs = 0;
      }
    }
    static_cast<Buffers&>(p) = work_;
    return p;
  }

  // work_ for up to `tokens` positions and `score_elems` attention weights per layer.
  void allocate(int64_t tokens, int64_t score_elems) {
    stream_.synchronize();  // the old buffers may still be read by queued work
    work_ = Buffers{};
    Buffers& w = work_;
    const int64_t N = tokens;
    auto f = [&](Shape shape) { return empty(shape, DType::F32, stream()); };
    for (int64_t i = 0; i <= L_; ++i)
      w.X.push_back(f({N, E_}));
    for (int64_t i = 0; i < L_; ++i) {
      w.QKV.push_back(f({N, 3 * E_}));
      w.O.push_back(f({N, E_}));
      w.lse.push_back(f({N * H_}));
      w.S1.push_back(f({N, E_}));
      w.Y.push_back(f({N, E_}));
      w.mean1.push_back(f({N}));
      w.rstd1.push_back(f({N}));
      w.H1.push_back(f({N, F_}));
      w.Rl.push_back(f({N, F_}));
      w.S2.push_back(f({N, E_}));
      w.mean2.push_back(f({N}));
      w.rstd2.push_back(f({N}));
    }
    if (score_elems > 0) {
      for (int64_t i = 0; i < L_; ++i) {
        w.heads.push_back(f({3 * N * E_}));
        w.P.push_back(f({score_elems}));
        if (p_ > 0.0) w.Pd.push_back(f({score_elems}));
      }
      w.scores = f({score_elems});
      w.dPd = f({score_elems});
      w.Oh = f({N * E_});
      w.dheads = f({3 * N * E_});
    }
    // The head's rows: B (classification) or N (tagging), at most N.
    w.tmpE = f({N, E_});
    w.tmpE2 = f({N, E_});
    w.pooled = f({N, E_});
    w.logits = f({N, C_});
    w.loss_rows = f({N});
    w.dlogits = f({N, C_});
    w.dpooled = f({N, E_});
    w.dX = f({N, E_});
    w.dS = f({N, E_});
    w.dF = f({N, E_});
    w.dR = f({N, F_});
    w.dH = f({N, F_});
    w.dY = f({N, E_});
    w.dO = f({N, E_});
    w.dQKV = f({N, 3 * E_});
    w.delta = f({N * H_});
    w.ones = to_device(Tensor::full({N}, 1.0), stream());
  }

  // The batch's inputs into the plan's staging buffer: ids, targets and their keep flags, the
  // attention's kept-key counts per (b, h, t), the head's position counts, and this step's scalars.
  void stage_inputs(Plan& plan, const Batch& batch, uint64_t dropout_offset) {
    const int64_t B = plan.B, T = plan.T, N = B * T, R = classification_ ? B : N;
    const InputLayout& l = plan.layout;
    char* base = plan.staging->data();
    StepScalars sc;
    sc.dropout_offset = dropout_offset;
    AdamWStep a;
    a.lr = options_.adamw.lr;
    a.beta1 = options_.adamw.beta1;
    a.beta2 = options_.adamw.beta2;
    a.eps = options_.adamw.eps;
    a.weight_decay = options_.adamw.weight_decay;
    a.step = adam_step_ + 1;
    sc.adam = adamw_element(a);
    std::memcpy(base + l.scalars, &sc, sizeof sc);
    const Tensor ids = batch.ids.contiguous();
    check(ids.dtype() == DType::I64, kOp, "the batch's ids are {}, expected int64",
          dtype_name(ids.dtype()));
    int64_t* id = reinterpret_cast<int64_t*>(base + l.ids);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t v = ids.data<int64_t>()[i];
      check(v >= 0 && v < vocab_, kOp, "token id {} at position {} is outside [0, {})", v, i,
            vocab_);
      id[i] = v;
    }
    const Tensor targets = batch.targets.contiguous();
    check(targets.defined() && targets.dtype() == DType::I64 && targets.numel() == R, kOp,
          "the batch's targets have shape {}, expected {} int64 values", shape_arg(batch.targets),
          R);
    int64_t* tg = reinterpret_cast<int64_t*>(base + l.targets);
    uint8_t* keep = reinterpret_cast<uint8_t*>(base + l.keep);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = targets.data<int64_t>()[r];
      keep[r] = t != model::kIgnoreTag;
      check(!keep[r] || (t >= 0 && t < C_), kOp, "target {} at row {} is outside [0, {})", t, r,
            C_);
      tg[r] = keep[r] ? t : 0;
    }
    check(batch.valid_lens.defined() && batch.valid_lens.numel() == B, kOp,
          "the batch's valid_lens have shape {}, expected ({})", shape_arg(batch.valid_lens), B);
    int32_t* kept = reinterpret_cast<int32_t*>(base + l.kept);
    int32_t* counts = reinterpret_cast<int32_t*>(base + l.counts);
    for (int64_t b = 0; b < B; ++b) {
      const int32_t n =
          static_cast<int32_t>(attn::detail::keys_kept_by_length(batch.valid_lens.flat(b), T));
      counts[b] = n;
      for (int64_t i = 0; i < H_ * T; ++i)
        kept[b * H_ * T + i] = n;
    }
  }

  template <class Tp>
  Tp* in(const Plan& p, size_t offset) const {
    return reinterpret_cast<Tp*>(static_cast<char*>(p.inputs.raw_data()) + offset);
  }
  const uint64_t* offset_base(const Plan& p) const {
    return in<const uint64_t>(p, p.layout.scalars + offsetof(StepScalars, dropout_offset));
  }

  // One row-major float32 product (kernels.hpp's GemmArgs): C (M, N) = alpha op(A) op(B) + beta C
  // (+ bias), A (M, K) or stored (K, M) when ta, B (K, N) or stored (N, K) when tb.
  struct Product {
    const float *A = nullptr, *B = nullptr, *bias = nullptr;
    float* C = nullptr;
    bool ta = false, tb = false;
    int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
    float alpha = 1.0f, beta = 0.0f;
    int64_t batch = 1, sa = 0, sb = 0, sc = 0;  // strided batch (per (b, h) attention)
  };
  void run(const Product& q) {
    GemmArgs a;
    a.M = q.M;
    a.N = q.N;
    a.K = q.K;
    a.trans_a = q.ta;
    a.trans_b = q.tb;
    a.A = q.A;
    a.B = q.B;
    a.C = q.C;
    a.bias = q.bias;
    a.lda = q.lda;
    a.ldb = q.ldb;
    a.ldc = q.ldc;
    a.alpha = q.alpha;
    a.beta = q.beta;
    a.batch = q.batch;
    a.stride_a = q.sa;
    a.stride_b = q.sb;
    a.stride_c = q.sc;
    gemm(a, stream());
  }
  // y (rows, out) = x (rows, in) W^T (+ bias); W stored (out, in).
  void linear(const float* x, const float* W, const float* bias, float* y, int64_t rows,
              int64_t in_f, int64_t out_f) {
    run({.A = x,
         .B = W,
         .bias = bias,
         .C = y,
         .tb = true,
         .M = rows,
         .N = out_f,
         .K = in_f,
         .lda = in_f,
         .ldb = in_f,
         .ldc = out_f});
  }
  // The column sums of x (rows, n) into out (n): 1^T x, one GEMM against p.ones.
  void column_sums(const Plan& p, const float* x, float* out, int64_t rows, int64_t n) {
    run({.A = f32(p.ones),
         .B = x,
         .C = out,
         .M = 1,
         .N = n,
         .K = rows,
         .lda = rows,
         .ldb = n,
         .ldc = n});
  }
  // dW (out, in) = dy^T x; db (out) = 1^T dy when db is non-null; dx (rows, in) = dy W (+ dx
  // itself when accumulate).
  void linear_backward(const Plan& p, const float* dy, const float* x, const float* W, float* dW,
                       float* db, float* dx, int64_t rows, int64_t in_f, int64_t out_f,
                       bool accumulate = false) {
    run({.A = dy,
         .B = x,
         .C = dW,
         .ta = true,
         .M = out_f,
         .N = in_f,
         .K = rows,
         .lda = out_f,
         .ldb = in_f,
         .ldc = in_f});
    if (db != nullptr) column_sums(p, dy, db, rows, out_f);
    if (dx != nullptr)
      run({.A = dy,
           .B = W,
           .C = dx,
           .M = rows,
           .N = in_f,
           .K = out_f,
           .lda = out_f,
           .ldb = in_f,
           .ldc = in_f,
           .beta = accumulate ? 1.0f : 0.0f});
  }
  // LayerNorm's backward: dx, then dgamma and dbeta over row chunks side by side.
  void layer_norm_grads(const float* dy, const float* x, const float* gamma, const float* mean,
                        const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t rows) {
    layer_norm_backward(dy, x, gamma, mean, rstd, dx, nullptr, nullptr, rows, E_, stream());
    layer_norm_param_grads(dy, x, mean, rstd, dgamma, dbeta, rows, E_, f32(ln_scratch_), stream());
  }

  // Per (b, h): C (M, N) = alpha op(A) op(B), each operand's matrices `stride` elements apart.
  void batched(const float* A, bool ta, int64_t lda, int64_t sa, const float* Bm, bool tb,
               int64_t ldb, int64_t sb, float* C, int64_t ldc, int64_t sc, int64_t M, int64_t N,
               int64_t K, int64_t batch, float alpha) {
    run({.A = A,
         .B = Bm,
         .C = C,
         .ta = ta,
         .tb = tb,
         .M = M,
         .N = N,
         .K = K,
         .lda = lda,
         .ldb = ldb,
         .ldc = ldc,
         .alpha = alpha,
         .batch = batch,
         .sa = sa,
         .sb = sb,
         .sc = sc});
  }

  // Attention of layer l as batched GEMMs: scores = scale Q K^T, P = masked softmax, dropout,
  // O = P V, each (b, h) a matrix of the batch. The same masks and dropout stream elements as
  // the fused kernel: weight (b h, t, s) is element (b h T + t) T + s of the (B H T, T) scores.
  void attention_forward_gemm(Plan& p, int64_t l) {
    const size_t i = static_cast<size_t>(l);
    const int64_t B = p.B, T = p.T, BH = B * H_, hd = BH * T * D_, tt = T * T;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D_)));
    float* q = f32(p.heads[i]);
    float *k = q + hd, *v = q + 2 * hd;
    to_heads(f32(p.QKV[i]), q, B, T, H_, D_, 3, stream());
    batched(q, false, D_, T * D_, k, true, D_, T * D_, f32(p.scores), T, tt, T, T, D_, BH, scale);
    softmax_dropout_forward(f32(p.scores), f32(p.P[i]), p_ > 0.0 ? f32(p.Pd[i]) : nullptr,
                            in<const int32_t>(p, p.layout.kept), kernels::MaskedRows::kUniform,
                            BH * T, T, static_cast<float>(p_), options_.seed, offset_base(p),
                            1 + 3 * static_cast<uint64_t>(l), stream());
    const float* Pd = p_ > 0.0 ? f32(p.Pd[i]) : f32(p.P[i]);
    batched(Pd, false, T, tt, v, false, D_, T * D_, f32(p.Oh), D_, T * D_, T, D_, T, BH, 1.0f);
    from_heads(f32(p.Oh), f32(p.O[i]), B, T, H_, D_, 1, stream());
  }
  // Its backward into the stacked dQKV (N, 3E).
  void attention_backward_gemm(Plan& p, int64_t l) {
    const size_t i = static_cast<size_t>(l);
    const int64_t B = p.B, T = p.T, BH = B * H_, hd = BH * T * D_, tt = T * T;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D_)));
    const uint64_t site = 1 + 3 * static_cast<uint64_t>(l);
    const float* q = f32(p.heads[i]);
    const float *k = q + hd, *v = q + 2 * hd;
    float* dq = f32(p.dheads);
    float *dk = dq + hd, *dv = dq + 2 * hd;
    float* dOh = f32(p.Oh);
    to_heads(f32(p.dO), dOh, B, T, H_, D_, 1, stream());
    const float* Pd = p_ > 0.0 ? f32(p.Pd[i]) : f32(p.P[i]);
    batched(Pd, true, T, tt, dOh, false, D_, T * D_, dv, D_, T * D_, T, D_, T, BH, 1.0f);
    batched(dOh, false, D_, T * D_, v, true, D_, T * D_, f32(p.dPd), T, tt, T, T, D_, BH, 1.0f);
    softmax_dropout_backward(f32(p.dPd), f32(p.P[i]), f32(p.scores),
                             in<const int32_t>(p, p.layout.kept), BH * T, T, static_cast<float>(p_),
                             options_.seed, offset_base(p), site, stream());
    batched(f32(p.scores), false, T, tt, k, false, D_, T * D_, dq, D_, T * D_, T, D_, T, BH, scale);
    batched(f32(p.scores), true, T, tt, q, false, D_, T * D_, dk, D_, T * D_, T, D_, T, BH, scale);
    from_heads(dq, f32(p.dQKV), B, T, H_, D_, 3, stream());
  }

  // x * Z (dropout site `site` of this step) into y; a plain copy of the pointer when p = 0.
  const float* drop(const Plan& p, const float* x, float* y, int64_t n, uint64_t site,
                    float scale = 1.0f) {
    if (p_ <= 0.0 && scale == 1.0f) return x;
    dropout_at(x, y, n, static_cast<float>(p_), options_.seed, offset_base(p), site, 0, scale,
               stream());
    return y;
  }

  kernels::AttentionArgs<float> attention_args(const Plan& p, int64_t l) {
    const int64_t T = p.T;
    kernels::AttentionArgs<float> a;
    a.B = p.B * H_;
    a.T = T;
    a.S = T;
    a.D = D_;
    a.Dv = D_;
    a.heads = H_;
    a.kept_keys = in<const int32_t>(p, p.layout.kept);
    a.causal = false;
    a.masked_rows = kernels::MaskedRows::kUniform;  // d2l's masked softmax
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D_)));
    a.dropout = static_cast<float>(p_);
    a.seed = options_.seed;
    a.offset = 1 + 3 * static_cast<uint64_t>(l);  // after the input's site and earlier blocks'
    a.dropout_offset_device = offset_base(p);
    const float* qkv = f32(p.QKV[static_cast<size_t>(l)]);
    const int64_t ld = 3 * E_;
    a.q = {qkv, T * ld, D_, ld, 1};
    a.k = {qkv + E_, T * ld, D_, ld, 1};
    a.v = {qkv + 2 * E_, T * ld, D_, ld, 1};
    a.out = {f32(p.O[static_cast<size_t>(l)]), T * E_, D_, E_, 1};
    a.lse = f32(p.lse[static_cast<size_t>(l)]);
    return a;
  }

  // The positions' table: sinusoidal, learned (a parameter), or none (null).
  const float* positions() const {
    if (table_.defined()) return f32(table_);
    return learned_ ? w(learned_pos_) : nullptr;
  }
  // y = tmpE * sqrt(E) + P[t].
  float* add_table(const Plan& p, float* y, float factor) {
    add_positional(f32(p.tmpE), positions(), y, p.B, p.T, E_, factor, stream());
    return y;
  }

  void forward(Plan& p) {
    const int64_t B = p.B, T = p.T, N = B * T, R = classification_ ? B : N;
    const float factor = static_cast<float>(std::sqrt(static_cast<double>(E_)));
    // X = dropout(embedding(ids) * sqrt(E) + P[t]): site 0.
    embedding_forward(in<const int64_t>(p, p.layout.ids), w(embedding_), f32(p.tmpE), N, E_,
                      stream());
    float* X0 = f32(p.X[0]);
    if (positions() == nullptr)
      dropout_at(f32(p.tmpE), X0, N * E_, static_cast<float>(p_), options_.seed, offset_base(p), 0,
                 0, factor, stream());
    else if (p_ > 0.0)
      drop(p, add_table(p, f32(p.tmpE2), factor), X0, N * E_, 0);
    else
      add_table(p, X0, factor);
    mark("fwd.embedding");
    for (int64_t l = 0; l < L_; ++l) {
      const BlockParams& b = blocks_[static_cast<size_t>(l)];
      const size_t i = static_cast<size_t>(l);
      const float* X = f32(p.X[i]);
      // Self-attention: the stacked projection, the fused kernel on head views (site 1 + 3l).
      linear(X, w(b.wqkv), nullptr, f32(p.QKV[i]), N, E_, 3 * E_);
      mark("fwd.qkv");
      if (p.gemm_attention)
        attention_forward_gemm(p, l);
      else
        flash_attention_forward(attention_args(p, l), stream());
      mark("fwd.attention");
      linear(f32(p.O[i]), w(b.wo), nullptr, f32(p.tmpE), N, E_, E_);
      // Y = LayerNorm(dropout(A) + X) (site 2 + 3l).
      const float* Ad = drop(p, f32(p.tmpE), f32(p.tmpE2), N * E_, 2 + 3 * l);
      layer_norm_forward(Ad, X, f32(p.S1[i]), w(b.ln1_w), w(b.ln1_b), f32(p.Y[i]), f32(p.mean1[i]),
                         f32(p.rstd1[i]), N, E_, static_cast<float>(b.eps1), stream());
      mark("fwd.wo+addnorm1");
      // FFN: dense2(relu(dense1(Y))).
      linear(f32(p.Y[i]), w(b.w1), w(b.b1), f32(p.H1[i]), N, E_, F_);
      relu_forward(f32(p.H1[i]), f32(p.Rl[i]), N * F_, stream());
      linear(f32(p.Rl[i]), w(b.w2), w(b.b2), f32(p.tmpE), N, F_, E_);
      mark("fwd.ffn");
      // X' = LayerNorm(dropout(F) + Y) (site 3 + 3l).
      const float* Fd = drop(p, f32(p.tmpE), f32(p.tmpE2), N * E_, 3 + 3 * l);
      layer_norm_forward(Fd, f32(p.Y[i]), f32(p.S2[i]), w(b.ln2_w), w(b.ln2_b), f32(p.X[i + 1]),
                         f32(p.mean2[i]), f32(p.rstd2[i]), N, E_, static_cast<float>(b.eps2),
                         stream());
      mark("fwd.addnorm2");
    }
    const float* Z = f32(p.X[static_cast<size_t>(L_)]);
    if (classification_) {
      masked_mean_forward(Z, in<const int32_t>(p, p.layout.counts), f32(p.pooled), B, T, E_,
                          stream());
      Z = f32(p.pooled);
    }
    linear(Z, w(head_w_), w(head_b_), f32(p.logits), R, E_, C_);
    const int64_t* targets = in<const int64_t>(p, p.layout.targets);
    const uint8_t* keep = in<const uint8_t>(p, p.layout.keep);
    cross_entropy_forward(f32(p.logits), targets, keep, f32(p.loss_rows), R, C_, stream());
    // reduce_[0] = mean loss (double); the float after the norm slot = 1 / n_kept.
    double* r = static_cast<double*>(reduce_.raw_data());
    loss_mean(f32(p.loss_rows), keep, R, r, reinterpret_cast<float*>(r + 2), stream());
    mark("fwd.head+loss");
  }

  void backward(Plan& p) {
    const int64_t B = p.B, T = p.T, N = B * T, R = classification_ ? B : N;
    double* r = static_cast<double*>(reduce_.raw_data());
    cross_entropy_backward(f32(p.logits), in<const int64_t>(p, p.layout.targets),
                           in<const uint8_t>(p, p.layout.keep), f32(p.dlogits), R, C_,
                           reinterpret_cast<const float*>(r + 2), stream());
    if (classification_) {
      linear_backward(p, f32(p.dlogits), f32(p.pooled), w(head_w_), g(head_w_), g(head_b_),
                      f32(p.dpooled), B, E_, C_);
      masked_mean_backward(f32(p.dpooled), in<const int32_t>(p, p.layout.counts), f32(p.dX), B, T,
                           E_, stream());
    } else {
      linear_backward(p, f32(p.dlogits), f32(p.X[static_cast<size_t>(L_)]), w(head_w_), g(head_w_),
                      g(head_b_), f32(p.dX), N, E_, C_);
    }
    mark("bwd.loss+head");
    for (int64_t l = L_ - 1; l >= 0; --l) {
      const BlockParams& b = blocks_[static_cast<size_t>(l)];
      const size_t i = static_cast<size_t>(l);
      // addnorm2: dS = LayerNorm backward of dX; the FFN output's gradient is dropout(dS).
      layer_norm_grads(f32(p.dX), f32(p.S2[i]), w(b.ln2_w), f32(p.mean2[i]), f32(p.rstd2[i]),
                       f32(p.dS), g(b.ln2_w), g(b.ln2_b), N);
      const float* dF = drop(p, f32(p.dS), f32(p.dF), N * E_, 3 + 3 * l);
      mark("bwd.addnorm2");
      // FFN backward; dY = dS (residual) + the FFN's input gradient.
      linear_backward(p, dF, f32(p.Rl[i]), w(b.w2), g(b.w2), g(b.b2), f32(p.dR), N, F_, E_);
      relu_backward(f32(p.dR), f32(p.H1[i]), f32(p.dH), N * F_, stream());
      copy_async(f32(p.dY), f32(p.dS), N * E_);
      linear_backward(p, f32(p.dH), f32(p.Y[i]), w(b.w1), g(b.w1), g(b.b1), f32(p.dY), N, E_, F_,
                      true);
      mark("bwd.ffn");
      // addnorm1.
      layer_norm_grads(f32(p.dY), f32(p.S1[i]), w(b.ln1_w), f32(p.mean1[i]), f32(p.rstd1[i]),
                       f32(p.dS), g(b.ln1_w), g(b.ln1_b), N);
      const float* dA = drop(p, f32(p.dS), f32(p.dF), N * E_, 2 + 3 * l);
      mark("bwd.addnorm1");
      linear_backward(p, dA, f32(p.O[i]), w(b.wo), g(b.wo), nullptr, f32(p.dO), N, E_, E_);
      mark("bwd.wo");
      // Attention backward into the stacked (N, 3E) gradient of Q, K, V.
      const float* dqkv = f32(p.dQKV);
      if (p.gemm_attention) {
        attention_backward_gemm(p, l);
      } else {
        const int64_t ld = 3 * E_;
        kernels::AttentionGradArgs<float> ga{{f32(p.dO), T * E_, D_, E_, 1},
                                             {f32(p.dQKV), T * ld, D_, ld, 1},
                                             {f32(p.dQKV) + E_, T * ld, D_, ld, 1},
                                             {f32(p.dQKV) + 2 * E_, T * ld, D_, ld, 1}};
        flash_attention_backward(attention_args(p, l), ga, f32(p.delta), stream());
      }
      mark("bwd.attention");
      // dX = dS (residual) + dQKV [W_q; W_k; W_v].
      copy_async(f32(p.dX), f32(p.dS), N * E_);
      linear_backward(p, dqkv, f32(p.X[i]), w(b.wqkv), g(b.wqkv), nullptr, f32(p.dX), N, E_, 3 * E_,
                      true);
      mark("bwd.qkv");
    }
    // The input: dropout (site 0) and the sqrt(E) scale, then the embedding's scatter-add.
    const float factor = static_cast<float>(std::sqrt(static_cast<double>(E_)));
    if (learned_) {
      // forward: dropout(X * sqrt(E) + W[t]): W.grad[t] = sum over b of the dropped gradient.
      dropout_at(f32(p.dX), f32(p.dF), N * E_, static_cast<float>(p_), options_.seed,
                 offset_base(p), 0, 0, 1.0f, stream());
      ATTN_CUDA_CHECK(
          kOp, cudaMemsetAsync(g(learned_pos_), 0,
                               static_cast<size_t>(max_len_ * E_) * sizeof(float), as_stream()));
      column_sums(p, f32(p.dF), g(learned_pos_), B, T * E_);
      dropout_at(f32(p.dF), f32(p.dS), N * E_, 0.0f, options_.seed, offset_base(p), 0, 0, factor,
                 stream());
    } else {
      dropout_at(f32(p.dX), f32(p.dS), N * E_, static_cast<float>(p_), options_.seed,
                 offset_base(p), 0, 0, factor, stream());
    }
    const size_t emb = static_cast<size_t>(vocab_ * E_) * sizeof(float);
    ATTN_CUDA_CHECK(kOp, cudaMemsetAsync(g(embedding_), 0, emb, as_stream()));
    embedding_backward(f32(p.dS), in<const int64_t>(p, p.layout.ids), g(embedding_), N, E_,
                       stream());
    mark("bwd.embedding");
  }

  // Clipping by the global norm, then AdamW over the whole arena (skipped on a non-finite loss).
  void optimize(const Plan& p) {
    double* r = static_cast<double*>(reduce_.raw_data());
    const double max_norm =
        options_.clip_norm > 0.0 ? options_.clip_norm : std::numeric_limits<double>::infinity();
    sum_squares(f32(grad_), total_, r + 3, r + 4, stream());
    clip_by_norm(f32(grad_), total_, r + 3, max_norm, r + 1, stream());
    adamw_update(f32(value_), f32(grad_), f32(m_), f32(v_), total_,
                 in<const AdamWElement>(p, p.layout.scalars + offsetof(StepScalars, adam)), r,
                 stream());
  }

  void copy_async(float* dst, const float* src, int64_t n) {
    ATTN_CUDA_CHECK(kOp, cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                         cudaMemcpyDeviceToDevice, as_stream()));
  }

  SequenceModel& model_;
  nn::AdamW& optimizer_;
  TrainOptions options_;
  Stream stream_;
  GraphCache graphs_;
  int64_t E_ = 0, F_ = 0, H_ = 0, L_ = 0, C_ = 0, D_ = 0, max_len_ = 0, vocab_ = 0;
  bool classification_ = false;
  double p_ = 0.0;
  std::vector<Slot> slots_;
  std::vector<BlockParams> blocks_;
  size_t embedding_ = 0, head_w_ = 0, head_b_ = 0, learned_pos_ = 0;
  bool learned_ = false;  // --pe learned: the table is the parameter at learned_pos_
  int64_t total_ = 0;
  Tensor value_, grad_, m_, v_, reduce_, table_, ln_scratch_;
  std::unique_ptr<PinnedBuffer> results_;
  std::map<std::pair<int64_t, int64_t>, Plan> plans_;
  Buffers work_;  // shared by the plans (plan_for)
  int64_t cap_tokens_ = 0, cap_scores_ = 0;
  int64_t adam_step_ = 0;
  const bool profile_ = std::getenv("ATTN_CUDA_STEP_PROFILE") != nullptr;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  std::map<std::string, double> phase_ms_;
  int64_t profiled_steps_ = 0;
};

}  // namespace
}  // namespace attn::cuda

namespace attn::model::detail {

std::unique_ptr<DeviceTrainStep> make_cuda_train_step(SequenceModel& model, nn::AdamW& optimizer,
                                                      const TrainOptions& options) {
  check(cuda::device_count() > 0, "train",
        "--device cuda: no CUDA device is visible (no driver or no GPU)");
  return std::make_unique<cuda::CudaEncoderStep>(model, optimizer, options);
}

}  // namespace attn::model::detail
