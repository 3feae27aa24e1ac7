// PyTorch parity of the Transformer encoder-decoder: d2l's EncoderDecoder(TransformerEncoder,
// TransformerDecoder) against tests/fixtures/transformer_seq2seq.safetensors, which
// tests/fixtures/generate.py wrote by running d2l's code (d2l_reference.py) in PyTorch 1.13.
//
// What is compared, in float32, at rtol 1e-4 (as the classifier's parity test): the teacher-forced
// logits (d2l's train-mode forward, dropout 0: causal self-attention), d2l 1.0's masked
// cross-entropy (mean over labels != <pad>), the gradient of every parameter, the loss before each
// of 10 steps of clip_grad_norm + AdamW, and greedy prediction: d2l's predict_step with the
// positional-encoding row fixed to the step (d2l adds row 0 at every step), whose tokens cut
// before the first <eos> must equal attn's greedy_search (with the cache) and whose step logits
// must match up to each sequence's <eos>. Each runs on the reference backend (the oracle) and on
// kAuto (the fast paths), on 1 and 2 threads.
#include "attn/core/context.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/model/generation.hpp"
#include "attn/nn/optim.hpp"
#include "attn/ops/loss.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace attn {
namespace {

constexpr const char* kFamily = "transformer_seq2seq";
constexpr const char* kRegenerate =
    "regenerate with: python3 tests/fixtures/generate.py --out tests/fixtures";
constexpr double kRtol = 1e-4, kAtol = 1e-6;

class Seq2SeqFixture {
 public:
  Seq2SeqFixture() {
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
      throw Error("test_model_parity_seq2seq",
                  "fixture case " + c + " has no tensor '" + key + "'\n" + kRegenerate);
    return it->second;
  }
  // "<case>.<prefix><name>" as a state dict.
  nn::StateDict parameters(const std::string& c, const std::string& prefix) const {
    nn::StateDict out;
    const std::string full = c + "." + prefix;
    for (const auto& [key, t] : file_.tensors)
      if (key.compare(0, full.size(), full) == 0) out.emplace(key.substr(full.size()), t);
    return out;
  }
  const SafetensorsFile& file() const { return file_; }

 private:
  SafetensorsFile file_;
  std::map<std::string, int> cases_;
};

const Seq2SeqFixture& fixture() {
  static const Seq2SeqFixture f;
  return f;
}

// attn's `actual` against torch's float32 `key`, element by element; an element within the
// tolerance of torch's float64 run ("exact.<key>") passes with a note (torch's float32 rounding).
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
          "note: %s (%s) '%s'[%lld]: attn %.9g off torch's float32 %.9g, on its float64 %.9g\n",
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

struct BackendRun {
  Backend backend;
  int threads;
  std::string name() const { return fmt::format("{}, {} threads", backend_name(backend), threads); }
};
const std::vector<BackendRun> kRuns = {
    {Backend::kReference, 1}, {Backend::kAuto, 1}, {Backend::kAuto, 2}};

nn::Seq2SeqConfig config_of(const std::string& c) {
  const Tensor shape = fixture().get(c, "config.shape");
  auto at = [&](int64_t i) { return static_cast<int64_t>(shape.flat(i)); };
  nn::Seq2SeqConfig config;
  config.src_vocab_size = at(0);
  config.tgt_vocab_size = at(1);
  config.num_hiddens = at(2);
  config.ffn_num_hiddens = at(3);
  config.num_heads = at(4);
  config.num_enc_blks = at(5);
  config.num_dec_blks = at(6);
  config.dropout = 0.0;  // torch's dropout stream is not attn's; p = 0 draws nothing
  return config;
}

struct Tokens {
  int64_t pad, bos, eos, num_steps;
};
Tokens tokens_of(const std::string& c) {
  const Tensor t = fixture().get(c, "config.tokens");
  auto at = [&](int64_t i) { return static_cast<int64_t>(t.flat(i)); };
  return {at(0), at(1), at(2), at(3)};
}

CrossEntropyOptions masked_loss(const std::string& c) {
  CrossEntropyOptions o;  // d2l 1.0 Seq2Seq.loss: the mean over labels that are not <pad>
  o.ignore_index = tokens_of(c).pad;
  return o;
}

TEST(ParitySeq2Seq, FixtureHasTheCase) {
  EXPECT_GE(fixture().cases().size(), 1u) << kRegenerate;
  EXPECT_TRUE(fixture().file().metadata.count("torch_version"));
}

// Teacher-forced logits, the masked loss and every parameter gradient at the fixture's weights.
TEST(ParitySeq2Seq, LogitsLossAndEveryGradient) {
  for (const std::string& c : fixture().cases()) {
    for (const BackendRun& run : kRuns) {
      SCOPED_TRACE(c + " on " + run.name());
      Context ctx;
      ctx.backend = run.backend;
      ctx.threads = run.threads;
      nn::EncoderDecoder model(config_of(c));
      const nn::StateDict params = fixture().parameters(c, "param.");
      ASSERT_EQ(params.size(), model.named_parameters().size()) << kRegenerate;
      model.load_state_dict(params);
      const Tensor src = fixture().get(c, "src"), lens = fixture().get(c, "src_valid_len"),
                   dec_in = fixture().get(c, "dec_in"), label = fixture().get(c, "label");
      const Tensor logits = model.forward(ctx, src, dec_in, lens);
      EXPECT_TRUE(matches(c, "logits", logits, run.name()));
      const CrossEntropyResult loss = softmax_cross_entropy(ctx, logits, label, masked_loss(c));
      EXPECT_TRUE(matches(c, "loss", Tensor::full({1}, loss.loss, DType::F32), run.name()));
      model.zero_grad();
      model.backward(ctx, softmax_cross_entropy_backward(ctx, logits, label, masked_loss(c)));
      int64_t compared = 0;
      for (auto& [name, p] : model.named_parameters()) {
        EXPECT_TRUE(matches(c, "grad." + name, p->grad, run.name()));
        ++compared;
      }
      EXPECT_EQ(compared, static_cast<int64_t>(params.size()));
    }
  }
}

// Ten steps of zero_grad, forward, loss, backward, clip_grad_norm, AdamW against torch's.
TEST(ParitySeq2Seq, TenAdamWSteps) {
  for (const std::string& c : fixture().cases()) {
    const Tensor expected = fixture().get(c, "train.loss");
    const Tensor adamw = fixture().get(c, "config.adamw");
    for (const BackendRun& run : kRuns) {
      SCOPED_TRACE(c + " on " + run.name());
      Context ctx;
      ctx.backend = run.backend;
      ctx.threads = run.threads;
      nn::EncoderDecoder model(config_of(c));
      model.load_state_dict(fixture().parameters(c, "param."));
      nn::AdamWOptions o;
      o.lr = adamw.flat(0);
      o.beta1 = adamw.flat(1);
      o.beta2 = adamw.flat(2);
      o.eps = adamw.flat(3);
      o.weight_decay = adamw.flat(4);
      const double clip = adamw.flat(5);
      nn::AdamW optimizer(model.named_parameters(), o);
      const Tensor src = fixture().get(c, "src"), lens = fixture().get(c, "src_valid_len"),
                   dec_in = fixture().get(c, "dec_in"), label = fixture().get(c, "label");
      Tensor losses = Tensor::empty({expected.numel()}, DType::F32);
      for (int64_t s = 0; s < expected.numel(); ++s) {
        optimizer.zero_grad();
        const Tensor logits = model.forward(ctx, src, dec_in, lens);
        losses.set_flat(s, softmax_cross_entropy(ctx, logits, label, masked_loss(c)).loss);
        model.backward(ctx, softmax_cross_entropy_backward(ctx, logits, label, masked_loss(c)));
        nn::clip_grad_norm(optimizer.parameters(), clip);
        optimizer.step();
      }
      EXPECT_TRUE(matches(c, "train.loss", losses, run.name()));
    }
  }
}

// d2l's predict_step with the PE row fixed to the step = attn's greedy search with the cache.
TEST(ParitySeq2Seq, GreedyMatchesD2lPredictionWithThePositionFixed) {
  for (const std::string& c : fixture().cases()) {
    const Tokens tk = tokens_of(c);
    const Tensor d2l_tokens = fixture().get(c, "greedy.tokens");  // (B, num_steps)
    const Tensor d2l_logits = fixture().get(c, "greedy.logits");  // (B, num_steps, V)
    const Tensor exact_logits = fixture().get(c, "exact.greedy.logits");
    const int64_t B = d2l_tokens.dim(0), V = d2l_logits.dim(2);
    // d2l runs num_steps tokens; attn stops a sequence at its <eos>.
    std::vector<std::vector<int64_t>> want(static_cast<size_t>(B));
    std::vector<bool> ended(static_cast<size_t>(B), false);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < tk.num_steps && !ended[b]; ++t) {
        const auto tok = static_cast<int64_t>(d2l_tokens.at({b, t}));
        if (tok == tk.eos)
          ended[b] = true;
        else
          want[static_cast<size_t>(b)].push_back(tok);
      }
    }
    for (const BackendRun& run : kRuns) {
      SCOPED_TRACE(c + " on " + run.name());
      Context ctx;
      ctx.backend = run.backend;
      ctx.threads = run.threads;
      nn::EncoderDecoder model(config_of(c));
      model.load_state_dict(fixture().parameters(c, "greedy.param."));
      model::GenerationOptions o;
      o.bos = tk.bos;
      o.eos = tk.eos;
      o.max_len = tk.num_steps;
      o.keep_logits = true;
      const model::Generation g = model::greedy_search(ctx, model, fixture().get(c, "src"),
                                                       fixture().get(c, "src_valid_len"), o);
      EXPECT_EQ(g.tokens, want);
      EXPECT_EQ(g.ended, ended);
      // Each row's logits up to its <eos> (afterwards d2l feeds its argmax, attn <eos>).
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = static_cast<int64_t>(want[static_cast<size_t>(b)].size()) +
                          (ended[static_cast<size_t>(b)] ? 1 : 0);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t v = 0; v < V; ++v) {
            const double a = g.logits.at({b, t, v}), e = exact_logits.at({b, t, v});
            EXPECT_NEAR(a, d2l_logits.at({b, t, v}), kAtol + kRtol * std::abs(e) + 1e-6)
                << "row " << b << " step " << t << " token " << v << " (torch float64 " << e << ")";
          }
      }
    }
  }
}

}  // namespace
}  // namespace attn
