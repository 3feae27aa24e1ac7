// The encoder's training step on the GPU (`attn train --device cuda`) against the same Trainer on
// the CPU: the same model, batches and dropout masks, so the losses, gradient norms and parameters
// agree to float32 rounding, through the eager first step, the captured second and the replays.
#include "cuda_testing.hpp"

#include "attn/core/safetensors.hpp"
#include "attn/model/trainer.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace attn::cuda {
namespace {

using model::Batch;
using model::TaskType;
using model::TrainOptions;

TrainOptions options(TaskType type, double dropout, nn::PositionalKind pe) {
  TrainOptions o;
  o.model.type = type;
  o.model.vocab_size = 11;
  o.model.num_classes = type == TaskType::kTagging ? 7 : 3;
  o.model.num_hiddens = 32;
  o.model.ffn_num_hiddens = 48;
  o.model.num_heads = 2;
  o.model.num_blks = 2;
  o.model.dropout = dropout;
  o.model.positional = pe;
  o.model.max_len = 64;
  o.adamw.lr = 3e-3;
  o.clip_norm = 1.0;
  o.seed = 5;
  o.threads = 1;
  return o;
}

// B sequences of T positions, lengths T/2..T, padding id 0, tags -100 past each length.
Batch batch(TaskType type, int64_t B, int64_t T, uint64_t seed, int64_t classes) {
  Rng rng(seed);
  Batch b;
  b.ids = Tensor::zeros({B, T}, DType::I64);
  b.valid_lens = Tensor::zeros({B}, DType::I64);
  b.targets = type == TaskType::kTagging ? Tensor::full({B, T}, -100.0, DType::I64)
                                         : Tensor::zeros({B}, DType::I64);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len =
        T / 2 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(T - T / 2 + 1)));
    b.valid_lens.data<int64_t>()[i] = len;
    b.tokens += len;
    for (int64_t t = 0; t < len; ++t) {
      b.ids.data<int64_t>()[i * T + t] = 1 + static_cast<int64_t>(rng.below(10));
      if (type == TaskType::kTagging)
        b.targets.data<int64_t>()[i * T + t] = static_cast<int64_t>(rng.below(classes));
    }
    if (type == TaskType::kClassification)
      b.targets.data<int64_t>()[i] = static_cast<int64_t>(rng.below(classes));
  }
  return b;
}

struct ParamDiff {
  double max_abs = 0;
  int64_t far = 0, total = 0;  // elements more than 1e-5 apart
};
ParamDiff compare_parameters(model::Trainer& a, model::Trainer& b) {
  ParamDiff d;
  auto pa = a.model().named_parameters(), pb = b.model().named_parameters();
  EXPECT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size() && i < pb.size(); ++i) {
    const Tensor x = pa[i].second->value.contiguous(), y = pb[i].second->value.contiguous();
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double e = std::abs(static_cast<double>(x.data<float>()[j]) - y.data<float>()[j]);
      d.max_abs = std::max(d.max_abs, e);
      d.far += e > 1e-5;
      ++d.total;
    }
  }
  return d;
}

void run_case(const char* name, TaskType type, double dropout, nn::PositionalKind pe) {
  TrainOptions o = options(type, dropout, pe);
  model::Trainer cpu(o);
  o.device = Device::kCuda;
  model::Trainer gpu(o);
  // Three steps of one shape (eager, captured, replayed), one of another, one more of the first.
  const int64_t shapes[5][2] = {{4, 12}, {4, 12}, {4, 12}, {3, 20}, {4, 12}};
  for (int s = 0; s < 5; ++s) {
    const Batch b = batch(type, shapes[s][0], shapes[s][1], 100 + s, o.model.num_classes);
    const model::StepStats c = cpu.train_step(b), g = gpu.train_step(b);
    std::printf("  %-26s step %d (B%lld T%lld): loss cpu %.7f gpu %.7f, norm cpu %.6f gpu %.6f\n",
                name, s + 1, static_cast<long long>(shapes[s][0]),
                static_cast<long long>(shapes[s][1]), c.loss, g.loss, c.grad_norm, g.grad_norm);
    EXPECT_NEAR(g.loss, c.loss, 1e-5 * std::max(1.0, std::abs(c.loss))) << name << " step " << s;
    EXPECT_NEAR(g.grad_norm, c.grad_norm, 1e-4 * std::max(1.0, c.grad_norm))
        << name << " step " << s;
    EXPECT_EQ(gpu.context().dropout_offset(), cpu.context().dropout_offset()) << name;
  }
  // Adam moves every parameter by about lr a step whatever its gradient's size, so a wrong
  // gradient shows as many elements ~lr apart; rounding leaves almost all within 1e-5.
  const ParamDiff d = compare_parameters(gpu, cpu);
  std::printf("  %-26s parameters after 5 steps: max |gpu - cpu| %.3g, %lld of %lld over 1e-5\n",
              name, d.max_abs, static_cast<long long>(d.far), static_cast<long long>(d.total));
  EXPECT_LE(d.far, d.total / 1000) << name;
  EXPECT_LE(d.max_abs, 2 * o.adamw.lr * 5) << name;

  // The GPU run's checkpoint resumes on the CPU with the GPU's parameters and AdamW state.
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("attn_gpu_{}.safetensors", name))
          .string();
  gpu.save_checkpoint(path);
  o.device = Device::kCpu;
  model::Trainer resumed(o);
  resumed.load_checkpoint(path);
  const ParamDiff same = compare_parameters(resumed, gpu);
  EXPECT_EQ(same.max_abs, 0.0) << name << ": the checkpoint holds the GPU's parameters";
  EXPECT_EQ(resumed.step(), gpu.step());
  // And back onto the GPU: a CUDA trainer loading that file continues like the CPU one.
  o.device = Device::kCuda;
  model::Trainer back(o);
  back.load_checkpoint(path);
  const Batch b = batch(type, 4, 12, 999, o.model.num_classes);
  const model::StepStats c = resumed.train_step(b), g = back.train_step(b);
  std::printf("  %-26s resumed step: loss cpu %.7f gpu %.7f\n", name, c.loss, g.loss);
  EXPECT_NEAR(g.loss, c.loss, 1e-5 * std::max(1.0, std::abs(c.loss))) << name;
  std::filesystem::remove(path);
}

TEST(CudaTrainStep, MatchesTheCpuTrainer) {
  ATTN_SKIP_WITHOUT_GPU();
  run_case("tagging_dropout", TaskType::kTagging, 0.1, nn::PositionalKind::kSinusoidal);
  run_case("tagging_no_dropout", TaskType::kTagging, 0.0, nn::PositionalKind::kSinusoidal);
  run_case("classification_dropout", TaskType::kClassification, 0.2,
           nn::PositionalKind::kSinusoidal);
  run_case("classification_pe_none", TaskType::kClassification, 0.1, nn::PositionalKind::kNone);
  run_case("tagging_pe_learned", TaskType::kTagging, 0.1, nn::PositionalKind::kLearned);
  // The fused attention kernel instead of the batched GEMMs (what long sequences take).
  setenv("ATTN_CUDA_TRAIN_ATTENTION", "flash", 1);
  run_case("tagging_dropout_flash", TaskType::kTagging, 0.1, nn::PositionalKind::kSinusoidal);
  run_case("classification_flash", TaskType::kClassification, 0.2, nn::PositionalKind::kSinusoidal);
  unsetenv("ATTN_CUDA_TRAIN_ATTENTION");
}

// A step whose loss is not finite throws, as on the CPU, and changes no parameter: AdamW reads the
// loss on the device and skips its update.
TEST(CudaTrainStep, NonFiniteLossChangesNothing) {
  ATTN_SKIP_WITHOUT_GPU();
  TrainOptions o = options(TaskType::kTagging, 0.0, nn::PositionalKind::kSinusoidal);
  o.device = Device::kCuda;
  o.adamw.lr = 1e30;  // the first update makes the weights huge, the next loss infinite or NaN
  model::Trainer t(o);
  const Batch b = batch(TaskType::kTagging, 4, 12, 7, o.model.num_classes);
  int64_t steps = 0;
  bool threw = false;
  std::vector<float> before;
  for (; steps < 5 && !threw; ++steps) {
    before.clear();
    for (auto& [name, p] : t.model().named_parameters())
      for (int64_t j = 0; j < p->value.numel(); ++j)
        before.push_back(p->value.contiguous().data<float>()[j]);
    try {
      t.train_step(b);
    } catch (const Error& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("loss is"), std::string::npos) << e.what();
    }
  }
  ASSERT_TRUE(threw) << "the loss stayed finite for " << steps << " steps";
  std::vector<float> after;
  for (auto& [name, p] : t.model().named_parameters())
    for (int64_t j = 0; j < p->value.numel(); ++j)
      after.push_back(p->value.contiguous().data<float>()[j]);
  ASSERT_EQ(after.size(), before.size());
  int64_t changed = 0;
  for (size_t i = 0; i < after.size(); ++i)
    changed += std::memcmp(&after[i], &before[i], sizeof(float)) != 0;
  EXPECT_EQ(changed, 0) << "parameters changed by the step that threw";
  EXPECT_EQ(t.step(), steps - 1);
}

TEST(CudaTrainStep, RefusesWhatItDoesNotCover) {
  ATTN_SKIP_WITHOUT_GPU();
  TrainOptions o = options(TaskType::kTagging, 0.1, nn::PositionalKind::kRotary);
  o.device = Device::kCuda;
  EXPECT_THROW(model::Trainer t(o), Error);
  o = options(TaskType::kTagging, 0.1, nn::PositionalKind::kSinusoidal);
  o.device = Device::kCuda;
  o.precision = model::Precision::kBFloat16;
  EXPECT_THROW(model::Trainer t(o), Error);
}

}  // namespace
}  // namespace attn::cuda
