// PyTorch parity of a whole training step, like llm.c's test_gpt2: d2l's TransformerEncoder (2
// blocks, dropout 0) with attn's classification head (masked mean over the valid positions, then a
// Linear), softmax cross-entropy, clip_grad_norm and AdamW, against
// tests/fixtures/transformer_classifier.safetensors, which tests/fixtures/generate.py wrote by
// running the same model in PyTorch 1.13 (d2l_reference.py: EncoderClassifier).
//
// What is compared, in float32, at rtol 1e-4: the logits, the mean loss, the gradient of every
// parameter at the initial weights, and the loss before each of 10 training steps taken by
// model::Trainer (zero_grad, forward, loss, backward, clip_grad_norm, AdamW step), which is the
// code `attn train` runs. Each runs on the reference backend (the oracle) and on kAuto (the fast
// paths the trainer uses), on 1 and 2 threads.
//
// Vocabulary: B batch, T positions, E = num_hiddens, F = ffn_num_hiddens, H heads, C classes.
#include "attn/core/context.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/model/trainer.hpp"
#include "attn/ops/loss.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace attn {
namespace {

constexpr const char* kFamily = "transformer_classifier";
constexpr const char* kRegenerate =
    "regenerate with: python3 tests/fixtures/generate.py --out tests/fixtures";
constexpr double kRtol = 1e-4, kAtol = 1e-6;

class ClassifierFixture {
 public:
  ClassifierFixture() {
    const std::string path = std::string(ATTN_FIXTURE_DIR) + "/" + kFamily + ".safetensors";
    file_ = load_safetensors(path);
    for (const auto& [key, t] : file_.tensors)
      cases_.insert({key.substr(0, key.find('.')), 0});
  }
  std::vector<std::string> cases() const {
    std::vector<std::string> out;
    for (const auto& [name, unused] : cases_)
      out.push_back(name);
    return out;
  }
  Tensor get(const std::string& c, const std::string& key) const {
    auto it = file_.tensors.find(c + "." + key);
    if (it == file_.tensors.end())
      throw Error("test_model_parity_classifier",
                  "fixture case " + c + " has no tensor '" + key + "'\n" + kRegenerate);
    return it->second;
  }
  // "<case>.param.<name>" as a state dict.
  nn::StateDict parameters(const std::string& c) const {
    nn::StateDict out;
    const std::string prefix = c + ".param.";
    for (const auto& [key, t] : file_.tensors)
      if (key.compare(0, prefix.size(), prefix) == 0) out.emplace(key.substr(prefix.size()), t);
    return out;
  }
  const SafetensorsFile& file() const { return file_; }

 private:
  SafetensorsFile file_;
  std::map<std::string, int> cases_;
};

const ClassifierFixture& fixture() {
  static const ClassifierFixture f;
  return f;
}

// attn's `actual` against torch's float32 `key`, element by element. An element also passes when
// it is within the tolerance of torch's float64 run ("exact.<key>"): that is torch's float32
// rounding, not a difference (the note says so).
::testing::AssertionResult matches(const std::string& c, const std::string& key,
                                   const Tensor& actual, const std::string& run) {
  const Tensor expected = fixture().get(c, key), exact = fixture().get(c, "exact." + key);
  auto failure = [&] {
    return ::testing::AssertionFailure()
           << kFamily << "/" << c << " (" << run << "), tensor '" << key << "': ";
  };
  if (!actual.defined()) return failure() << "attn returned no tensor";
  if (actual.numel() != expected.numel())
    return failure() << "attn shape " << shape_str(actual.shape()) << ", torch shape "
                     << shape_str(expected.shape());
  auto close = [](double a, double b) {
    return std::isfinite(a) && std::abs(a - b) <= kAtol + kRtol * std::abs(b);
  };
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = actual.flat(i), t = expected.flat(i), e = exact.flat(i);
    if (close(a, t)) continue;
    if (close(a, e)) {
      std::printf(
          "note: %s (%s) '%s'[%lld]: attn %.9g off torch's float32 %.9g, on its float64 "
          "%.9g\n",
          c.c_str(), run.c_str(), key.c_str(), static_cast<long long>(i), a, t, e);
      continue;
    }
    if (bad++ == 0) first = i;
    worst = std::max(worst, std::abs(a - t));
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure() << bad << " of " << actual.numel() << " elements differ (rtol " << kRtol
                   << ", atol " << kAtol << "), max |attn - torch| " << worst << "; first at "
                   << first << ": attn " << actual.flat(first) << ", torch " << expected.flat(first)
                   << ", torch float64 " << exact.flat(first) << "\n"
                   << kRegenerate;
}

struct TrainRun {
  Backend backend;
  int threads;
  std::string name() const { return fmt::format("{}, {} threads", backend_name(backend), threads); }
};

model::TrainOptions options_of(const std::string& c) {
  const Tensor shape = fixture().get(c, "config.shape"), adamw = fixture().get(c, "config.adamw");
  auto at = [](const Tensor& t, int64_t i) { return static_cast<int64_t>(t.flat(i)); };
  model::TrainOptions o;
  o.model.type = model::TaskType::kClassification;
  o.model.vocab_size = at(shape, 0);
  o.model.num_hiddens = at(shape, 1);
  o.model.ffn_num_hiddens = at(shape, 2);
  o.model.num_heads = at(shape, 3);
  o.model.num_blks = at(shape, 4);
  o.model.num_classes = at(shape, 5);
  o.model.dropout = 0.0;  // torch's dropout stream is not attn's; p = 0 draws nothing
  o.model.positional = nn::PositionalKind::kSinusoidal;
  o.adamw.lr = adamw.flat(0);
  o.adamw.beta1 = adamw.flat(1);
  o.adamw.beta2 = adamw.flat(2);
  o.adamw.eps = adamw.flat(3);
  o.adamw.weight_decay = adamw.flat(4);
  o.clip_norm = adamw.flat(5);
  return o;
}

const std::vector<TrainRun> kRuns = {
    {Backend::kReference, 1}, {Backend::kAuto, 1}, {Backend::kAuto, 2}};

TEST(ParityClassifier, FixtureHasTheCase) {
  EXPECT_GE(fixture().cases().size(), 1u) << kRegenerate;
  EXPECT_TRUE(fixture().file().metadata.count("torch_version"));
}

// Logits, loss and every parameter gradient at the fixture's weights.
TEST(ParityClassifier, LogitsLossAndEveryGradient) {
  for (const std::string& c : fixture().cases()) {
    for (const TrainRun& run : kRuns) {
      SCOPED_TRACE(c + " on " + run.name());
      model::TrainOptions options = options_of(c);
      options.threads = run.threads;
      model::Trainer trainer(options);
      trainer.context().backend = run.backend;
      model::SequenceModel& m = trainer.model();
      const nn::StateDict params = fixture().parameters(c);
      ASSERT_EQ(params.size(), m.named_parameters().size()) << kRegenerate;
      m.load_state_dict(params);

      const Tensor ids = fixture().get(c, "ids"), lens = fixture().get(c, "valid_lens"),
                   targets = fixture().get(c, "targets");
      Context& ctx = trainer.context();
      m.eval();
      trainer.optimizer().zero_grad();
      const Tensor logits = m.forward(ctx, ids, lens);
      EXPECT_TRUE(matches(c, "logits", logits, run.name()));
      const CrossEntropyResult loss = softmax_cross_entropy(ctx, logits, targets);
      Tensor loss_t = Tensor::full({1}, loss.loss, DType::F32);
      EXPECT_TRUE(matches(c, "loss", loss_t, run.name()));
      m.backward(ctx, softmax_cross_entropy_backward(ctx, logits, targets));
      int64_t compared = 0;
      for (auto& [name, p] : m.named_parameters()) {
        EXPECT_TRUE(matches(c, "grad." + name, p->grad, run.name()));
        ++compared;
      }
      EXPECT_EQ(compared, 1 + 12 * options.model.num_blks + 2)
          << "embedding, 12 tensors per block, head weight and bias";
    }
  }
}

// Ten steps of attn's trainer (clip_grad_norm + AdamW) against torch's, loss before each step.
TEST(ParityClassifier, TenAdamWSteps) {
  for (const std::string& c : fixture().cases()) {
    const Tensor expected = fixture().get(c, "train.loss");
    for (const TrainRun& run : kRuns) {
      SCOPED_TRACE(c + " on " + run.name());
      model::TrainOptions options = options_of(c);
      options.threads = run.threads;
      model::Trainer trainer(options);
      trainer.context().backend = run.backend;
      trainer.model().load_state_dict(fixture().parameters(c));
      model::Batch batch;
      batch.ids = fixture().get(c, "ids");
      batch.valid_lens = fixture().get(c, "valid_lens");
      batch.targets = fixture().get(c, "targets");
      Tensor losses = Tensor::empty({expected.numel()}, DType::F32);
      for (int64_t s = 0; s < expected.numel(); ++s)
        losses.set_flat(s, trainer.train_step(batch).loss);
      EXPECT_TRUE(matches(c, "train.loss", losses, run.name()));
    }
  }
}

}  // namespace
}  // namespace attn
