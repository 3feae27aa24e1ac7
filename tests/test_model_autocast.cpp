// Mixed precision (Context::autocast_bf16, PyTorch's CPU autocast): a float32 Linear or
// MultiHeadAttention under autocast computes exactly what the bfloat16 module computes on the
// same (rounded) weights, with float32 parameters and gradients; a Trainer in bf16 learns,
// resumes bit for bit, and its checkpoints load into a float32 trainer and back.
//
// Why exact equality holds: under autocast the float32 module rounds its input and weights to
// bf16 and runs the bf16 ops, so every product is the one the BF16 module runs on the same
// values; the results differ only by a widening to float32, which is exact. The parameter
// gradients are the bf16 module's widened (PyTorch autocast's are too: the bf16 product's
// gradient cast to the float32 leaf).
#include "attn/model/experiment.hpp"
#include "attn/model/tasks.hpp"
#include "attn/model/trainer.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/module.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numeric>

namespace attn {
namespace {

using testing::random_tensor;

// Exact equality of two tensors' values (any dtypes), with the first difference in the message.
void expect_same_values(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(x[i], y[i]) << what << ": first difference at flat index " << i;
}

// A float32 copy of `m16`'s state dict (bf16 values widened exactly) loaded into `m32`.
template <typename M>
void load_widened(M& m32, M& m16) {
  nn::StateDict d;
  for (auto& [name, t] : m16.state_dict())
    d.emplace(name, t.to(DType::F32));
  m32.load_state_dict(d);
}

TEST(Autocast, LinearIsTheBf16LinearWithFloat32GradsAndInputDtype) {
  Context ctx;
  ctx.threads = 1;
  nn::Linear l16(24, 40, true, DType::BF16, 3), l32(24, 40, true, DType::F32, 4);
  load_widened(l32, l16);
  const Tensor x = random_tensor({2, 5, 40}, DType::F32, 7);  // not bf16-valued: autocast rounds
  const Tensor dy = random_tensor({2, 5, 24}, DType::F32, 8);

  const Tensor y16 = l16.forward(ctx, x.to(DType::BF16));
  const Tensor dx16 = l16.backward(ctx, dy.to(DType::BF16));

  ctx.autocast_bf16 = true;
  const Tensor y = l32.forward(ctx, x);
  EXPECT_EQ(y.dtype(), DType::F32);  // the input's dtype
  expect_same_values(y, y16, "y");
  const Tensor dx = l32.backward(ctx, dy);
  EXPECT_EQ(dx.dtype(), DType::F32);
  expect_same_values(dx, dx16, "dx");
  EXPECT_EQ(l32.weight.grad.dtype(), DType::F32);
  expect_same_values(l32.weight.grad, l16.weight.grad, "dW");
  expect_same_values(l32.bias.grad, l16.bias.grad, "db");
  // The parameters stay float32 and untouched.
  EXPECT_EQ(l32.weight.value.dtype(), DType::F32);

  // A bf16 input gives a bf16 output (the chain inside a module stays in bf16).
  const Tensor yb = l32.forward(ctx, x.to(DType::BF16));
  EXPECT_EQ(yb.dtype(), DType::BF16);
  expect_same_values(yb, y16, "y from a bf16 input");
  EXPECT_EQ(l32.backward(ctx, dy).dtype(), DType::BF16);
}

TEST(Autocast, ReferenceBackendAndOtherDtypesIgnoreIt) {
  Context ctx;
  ctx.threads = 1;
  ctx.autocast_bf16 = true;
  nn::Linear l64(6, 5, true, DType::F64, 1);
  const Tensor x64 = random_tensor({3, 5}, DType::F64, 2);
  EXPECT_EQ(l64.forward(ctx, x64).dtype(), DType::F64);
  // The oracle stays in float32 on the reference backend.
  nn::Linear a(6, 5, true, DType::F32, 1), b(6, 5, true, DType::F32, 1);
  const Tensor x = random_tensor({3, 5}, DType::F32, 2);
  ctx.backend = Backend::kReference;
  const Tensor ya = a.forward(ctx, x);
  ctx.autocast_bf16 = false;
  expect_same_values(ya, b.forward(ctx, x), "reference backend under autocast");
}

struct MhaCase {
  bool self_attention;
  bool lens;
  bool causal;
  bool input_grad_sum;  // self_attention_input_grad
};

class AutocastMha : public ::testing::TestWithParam<MhaCase> {};

TEST_P(AutocastMha, IsTheBf16ModuleWithFloat32Parameters) {
  const MhaCase c = GetParam();
  const int64_t B = 2, T = 7, S = c.self_attention ? 7 : 9, E = 32, H = 4;
  Context ctx;
  ctx.threads = 1;
  nn::MultiHeadAttention m16(E, H, 0.0, true, DType::BF16, 5), m32(E, H, 0.0, true, DType::F32, 6);
  for (auto* m : {&m16, &m32}) {
    m->attention.need_weights = false;  // the fused core, as the Trainer runs it
    m->attention.causal = c.causal;
    m->self_attention_input_grad = c.input_grad_sum;
  }
  // Materialise the lazy projections, then give the float32 module the bf16 weights.
  const Tensor q = random_tensor({B, T, E}, DType::F32, 11);
  const Tensor kv = c.self_attention ? q : random_tensor({B, S, E}, DType::F32, 12);
  m16.forward(ctx, q.to(DType::BF16), kv.to(DType::BF16), kv.to(DType::BF16));
  m16.zero_grad();
  m32.forward(ctx, q, kv, kv);
  load_widened(m32, m16);
  const Tensor lens = c.lens ? Tensor::from_vector(std::vector<int64_t>{S - 2, 3}, {B}) : Tensor();
  const Tensor dout = random_tensor({B, T, E}, DType::F32, 13);

  // The bf16 module on the rounded inputs; self-attention passes one tensor three times.
  const Tensor q16 = q.to(DType::BF16), kv16 = c.self_attention ? q16 : kv.to(DType::BF16);
  const Tensor y16 = m16.forward(ctx, q16, kv16, kv16, lens);
  const nn::AttentionInputGrads g16 = m16.backward(ctx, dout.to(DType::BF16));

  ctx.autocast_bf16 = true;
  const Tensor y = m32.forward(ctx, q, kv, kv, lens);
  ASSERT_EQ(y.dtype(), DType::F32);
  expect_same_values(y, y16, "output");
  const nn::AttentionInputGrads g = m32.backward(ctx, dout);
  expect_same_values(g.dqueries, g16.dqueries, "dqueries");
  if (g16.dkeys.defined()) {
    expect_same_values(g.dkeys, g16.dkeys, "dkeys");
    expect_same_values(g.dvalues, g16.dvalues, "dvalues");
  }
  auto p16 = m16.named_parameters(), p32 = m32.named_parameters();
  ASSERT_EQ(p16.size(), p32.size());
  for (size_t i = 0; i < p16.size(); ++i) {
    EXPECT_EQ(p32[i].second->grad.dtype(), DType::F32) << p32[i].first;
    expect_same_values(p32[i].second->grad, p16[i].second->grad, p32[i].first + ".grad");
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AutocastMha,
                         ::testing::Values(MhaCase{true, false, false, false},
                                           MhaCase{true, true, true, false},
                                           MhaCase{true, true, false, true},
                                           MhaCase{false, true, false, false},
                                           MhaCase{false, false, true, false}),
                         [](const auto& param_info) {
                           const MhaCase& c = param_info.param;
                           return std::string(c.self_attention ? "Self" : "Cross") +
                                  (c.lens ? "Lens" : "") + (c.causal ? "Causal" : "") +
                                  (c.input_grad_sum ? "SummedInputGrad" : "");
                         });

// --- Trainer ------------------------------------------------------------------------------------

namespace fs = std::filesystem;

struct Tiny {
  model::TaskOptions task;
  model::TrainOptions options;
  int64_t batch_size = 8;

  explicit Tiny(model::Precision precision) {
    task.task = model::GeneratedTask::kShift;
    task.num_symbols = 3;
    task.min_len = 3;
    task.max_len = 6;
    options.model.type = model::task_type(task.task);
    options.model.vocab_size = model::task_vocab_size(task);
    options.model.num_classes = model::task_num_classes(task);
    options.model.num_hiddens = 16;
    options.model.ffn_num_hiddens = 16;
    options.model.num_heads = 2;
    options.model.num_blks = 1;
    options.model.dropout = 0.1;
    options.model.positional = nn::PositionalKind::kLearned;
    options.model.max_len = 8;
    options.adamw.lr = 1e-2;
    options.seed = 11;
    options.threads = 1;
    options.precision = precision;
  }
  model::Batch batch(int64_t step) const {
    std::vector<int64_t> idx(static_cast<size_t>(batch_size));
    std::iota(idx.begin(), idx.end(), 0);
    return model::make_batch(
        model::generate_task(task, batch_size, options.seed, static_cast<uint64_t>(step)), idx);
  }
  std::vector<double> run(model::Trainer& t, int64_t stop) const {
    std::vector<double> losses;
    while (t.step() < stop)
      losses.push_back(t.train_step(batch(t.step())).loss);
    return losses;
  }
};

TEST(AutocastTrainer, LearnsLikeFp32WithFloat32Masters) {
  // As test_model_trainer's LossFallsOnATinyTask, in both precisions.
  for (model::Precision precision : {model::Precision::kFloat32, model::Precision::kBFloat16}) {
    Tiny tiny(precision);
    tiny.options.model.dropout = 0.0;
    tiny.batch_size = 32;
    model::Trainer t(tiny.options);
    const std::vector<double> losses = tiny.run(t, 150);
    const double first = std::accumulate(losses.begin(), losses.begin() + 10, 0.0) / 10;
    const double last = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
    const char* name = model::precision_name(precision);
    EXPECT_LT(last, 0.2 * first) << name << ": first 10 steps " << first << ", last 10 " << last;
    model::TaskOptions eval = tiny.task;
    eval.min_len = eval.max_len = 6;
    const model::EvalStats s = t.evaluate(
        model::make_batches(model::generate_task(eval, 64, 1, model::eval_stream(6)), 32));
    EXPECT_GT(s.accuracy, 0.9) << name;  // chance is 1/3
    for (auto& [pname, p] : t.optimizer().parameters()) {
      EXPECT_EQ(p->value.dtype(), DType::F32) << pname;
      EXPECT_EQ(p->grad.dtype(), DType::F32) << pname;
    }
  }
}

TEST(AutocastTrainer, ResumesBitForBitAndCheckpointsLoadInEitherPrecision) {
  const fs::path dir = attn::testing::temp_path("attn_test_autocast");
  fs::create_directories(dir);
  const std::string ck = (dir / "bf16.safetensors").string();
  Tiny bf(model::Precision::kBFloat16);
  model::Trainer whole(bf.options);
  const std::vector<double> all = bf.run(whole, 20);

  model::Trainer first(bf.options);
  bf.run(first, 10);
  first.save_checkpoint(ck);
  EXPECT_EQ(model::Trainer::checkpoint_options(ck).precision, model::Precision::kBFloat16);
  model::Trainer second(bf.options);
  second.load_checkpoint(ck);
  const std::vector<double> rest = bf.run(second, 20);
  EXPECT_EQ(std::vector<double>(all.begin() + 10, all.end()), rest);

  // The float32 masters load into a float32 trainer (same parameters), and back.
  Tiny fp(model::Precision::kFloat32);
  model::Trainer f32(fp.options);
  f32.load_checkpoint(ck);
  EXPECT_EQ(f32.step(), 10);
  nn::StateDict a = first.model().state_dict(), b = f32.model().state_dict();
  for (auto& [name, t] : a)
    expect_same_values(t, b.at(name), name);
  const std::string ck32 = (dir / "fp32.safetensors").string();
  f32.save_checkpoint(ck32);
  model::Trainer back(bf.options);
  back.load_checkpoint(ck32);
  EXPECT_EQ(bf.run(back, 20), rest);  // same masters and state: the same bf16 run
  fs::remove_all(dir);
}

TEST(AutocastTrainer, PrecisionNames) {
  EXPECT_EQ(model::parse_precision("bf16"), model::Precision::kBFloat16);
  EXPECT_STREQ(model::precision_name(model::Precision::kFloat32), "fp32");
  EXPECT_THROW(model::parse_precision("fp16"), Error);
}

// `attn experiment --precision bf16`: the positional experiment's runs train in mixed precision
// (the switch reaches the Trainer, and the runs differ from fp32's but still learn something).
TEST(AutocastTrainer, PositionalExperimentRunsInEitherPrecision) {
  model::PositionalExperimentOptions o;
  o.seeds = 1;
  o.steps = 20;
  o.eval_examples = 16;
  o.length_factors = {1};
  o.variants = {nn::PositionalKind::kSinusoidal};
  EXPECT_EQ(
      model::positional_run_options(o, model::GeneratedTask::kShift, o.variants[0], 0).precision,
      model::Precision::kFloat32);
  const auto fp32 = model::run_positional_experiment(o);
  o.precision = model::Precision::kBFloat16;
  EXPECT_EQ(
      model::positional_run_options(o, model::GeneratedTask::kShift, o.variants[0], 0).precision,
      model::Precision::kBFloat16);
  const auto bf16 = model::run_positional_experiment(o);
  ASSERT_EQ(fp32.size(), 1u);
  ASSERT_EQ(bf16.size(), 1u);
  EXPECT_TRUE(std::isfinite(bf16[0].final_loss));
  EXPECT_NE(bf16[0].final_loss, fp32[0].final_loss);
  EXPECT_NEAR(bf16[0].final_loss, fp32[0].final_loss, 0.5);
}

}  // namespace
}  // namespace attn
