// PyTorch parity: attn's ops and modules against fixtures that tests/fixtures/generate.py wrote by
// running the d2l attention code (restated in tests/fixtures/d2l_reference.py) and
// torch.nn.MultiheadAttention on PyTorch 1.13, float32, with gradients by autograd.
//
// A fixture file holds many cases; tensor "<case>.<name>" belongs to <case>. In each case
// G is the upstream gradient and grad.<x> = d sum(output * G) / dx. Every case runs three ways:
//   float32 on the reference backend (plain loops, double accumulation) and on kAuto (the fast
//   path when there is one), against torch's float32 at rtol 1e-5 / atol 1e-6, the float32
//   tolerance of DESIGN.md;
//   float64 on the reference backend, against torch's float64 run of the same inputs
//   ("exact.<x>", stored rounded to float32) at rtol 1e-6 / atol 1e-8: a check of the math
//   itself, 10x tighter than float32 rounding allows.
//
// Vocabulary: B batch, T queries, S keys/values, H heads, D head dim, E = H*D.
#include "attn/core/context.hpp"
#include "attn/core/safetensors.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/positional.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "attn/ops/masked_softmax.hpp"
#include "attn/ops/positional.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace attn {
namespace {

constexpr const char* kRegenerate =
    "regenerate with: python3 tests/fixtures/generate.py --out tests/fixtures";

// One way of running a case. float32 against PyTorch: both sides round differently (torch's
// softmax, exp and GEMM are not correctly rounded; our reference accumulates in double), so
// equality is to a few ulp of the largest terms, not bitwise. float64 against torch's float64:
// the only error left is the float32 rounding of the stored value, 2^-24 relative.
struct RunConfig {
  Backend backend;
  DType dtype;
  double rtol, atol;
  std::string name() const {
    return fmt::format("{} {}", backend_name(backend), dtype_name(dtype));
  }
  // The fixture key holding torch's result for this run.
  std::string expected(const std::string& key) const {
    return dtype == DType::F64 ? "exact." + key : key;
  }
};
constexpr double kRtol = 1e-5, kAtol = 1e-6;
const RunConfig kF32Reference{Backend::kReference, DType::F32, kRtol, kAtol};
const std::vector<RunConfig> kRuns = {kF32Reference,
                                      {Backend::kAuto, DType::F32, kRtol, kAtol},
                                      {Backend::kReference, DType::F64, 1e-6, 1e-8}};

// One fixture file, loaded once per process. A missing or unreadable file fails the test that
// asked for it, with the regeneration hint, instead of aborting the executable.
const SafetensorsFile* fixture(const std::string& family) {
  static std::map<std::string, std::optional<SafetensorsFile>> cache;
  auto it = cache.find(family);
  if (it == cache.end()) {
    const std::string path = std::string(ATTN_FIXTURE_DIR) + "/" + family + ".safetensors";
    std::optional<SafetensorsFile> file;
    try {
      file = load_safetensors(path);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "cannot load fixture " << path << ": " << e.what() << "\n" << kRegenerate;
    }
    it = cache.emplace(family, std::move(file)).first;
  }
  return it->second ? &*it->second : nullptr;
}

// The tensors of one case: at("output") is "<case>.output".
class Case {
 public:
  Case(const SafetensorsFile& file, std::string family, std::string name)
      : file_(file), family_(std::move(family)), name_(std::move(name)) {
    auto d = file.metadata.find("case." + name_);
    description_ = d == file.metadata.end() ? "" : d->second;
  }

  const std::string& name() const { return name_; }
  // "multi_head_attention/d2l_h2_d4_nobias_lens_1d (D = 4, ...)", for messages.
  std::string label() const { return family_ + "/" + name_ + " (" + description_ + ")"; }

  bool has(const std::string& key) const { return file_.tensors.count(name_ + "." + key) != 0; }
  // Undefined when absent (no valid_lens means "no mask", as in d2l).
  Tensor get(const std::string& key) const {
    auto it = file_.tensors.find(name_ + "." + key);
    return it == file_.tensors.end() ? Tensor() : it->second;
  }
  Tensor at(const std::string& key) const {
    Tensor t = get(key);
    if (!t.defined())
      throw Error("test_nn_parity",
                  "fixture " + label() + " has no tensor '" + key + "'\n" + kRegenerate);
    return t;
  }
  // A float input of the fixture in the run's precision (float32 values widen exactly).
  Tensor input(const std::string& key, const RunConfig& run) const { return at(key).to(run.dtype); }
  int64_t config(const std::string& key) const {
    return static_cast<int64_t>(at("config." + key).flat(0));
  }
  // Tensors named "<prefix><rest>", keyed by <rest>, converted to `dtype`: with_prefix("param.")
  // is a state dict.
  std::map<std::string, Tensor> with_prefix(const std::string& prefix,
                                            DType dtype = DType::F32) const {
    std::map<std::string, Tensor> out;
    const std::string full = name_ + "." + prefix;
    for (const auto& [key, t] : file_.tensors)
      if (key.compare(0, full.size(), full) == 0) out.emplace(key.substr(full.size()), t.to(dtype));
    return out;
  }

 private:
  const SafetensorsFile& file_;
  std::string family_, name_, description_;
};

// The cases of a family in name order; fails when the file has fewer than `at_least` (a
// truncated fixture must not pass vacuously) or when metadata and tensors disagree.
std::vector<Case> cases_of(const std::string& family, size_t at_least) {
  const SafetensorsFile* file = fixture(family);
  if (!file) return {};
  std::set<std::string> names;
  for (const auto& [key, t] : file->tensors)
    names.insert(key.substr(0, key.find('.')));
  for (const auto& [key, value] : file->metadata) {
    if (key.rfind("case.", 0) != 0) continue;
    EXPECT_TRUE(names.count(key.substr(5)))
        << family << ": metadata names case '" << key.substr(5) << "' without tensors\n"
        << kRegenerate;
  }
  EXPECT_GE(names.size(), at_least) << family << " has too few cases\n" << kRegenerate;
  EXPECT_TRUE(file->metadata.count("torch_version")) << family << ": no torch_version";
  std::vector<Case> out;
  for (const auto& n : names)
    out.emplace_back(*file, family, n);
  return out;
}

bool close_at(double a, double b, double rtol, double atol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::abs(a - b) <= atol + rtol * std::abs(b);
}

// attn's `actual` against torch's result for `key` in case `c`, element by element, at the run's
// rtol / atol. float64 runs compare with torch's float64 ("exact.<key>"); float32 runs with
// torch's float32, and with one exception, for rounding in torch itself: an element also passes
// when it is within the same tolerance of torch's float64 result. torch's float32 result can sit
// near the edge of the tolerance, or beyond it, where cancellation costs it digits; attn's
// reference backend accumulates in double and lands on the float64 value. Each such element is
// printed as a "note:" line. Cases that need it (torch 1.13, x86-64): the key-bias gradient is 0
// in exact arithmetic (adding q . b_k to every score of a row leaves the softmax unchanged) and
// torch's float32 gives noise up to ~1.3e-6: d2l_self_h4_d4_bias grad.W_k.bias[11] is 2e-15 in
// float64, 1.19e-6 in torch's float32, -1.1e-8 in attn; and elements of weight gradients summed
// from larger terms: d2l_self_h4_d4_bias grad.W_q.weight[129] (float64 6.4675e-05, torch
// 6.3658e-05, attn 6.4731e-05) and torch_packed_bias_h4_d4_no_mask grad.in_proj_weight[390]
// (float64 0.13721189, torch 0.13721441, attn 0.13721182).
::testing::AssertionResult matches(const Case& c, const std::string& key, const Tensor& actual,
                                   const RunConfig& run = kF32Reference) {
  const Tensor expected = c.get(run.expected(key));
  const Tensor exact = run.dtype == DType::F32 ? c.get("exact." + key) : Tensor();
  const double rtol = run.rtol, atol = run.atol;
  auto failure = [&] {
    return ::testing::AssertionFailure() << "case " << c.label() << " (" << run.name()
                                         << "), tensor '" << run.expected(key) << "': ";
  };
  if (!expected.defined()) return failure() << "not in the fixture\n" << kRegenerate;
  if (!actual.defined()) return failure() << "attn returned no tensor";
  if (actual.shape() != expected.shape())
    return failure() << "attn shape " << shape_str(actual.shape()) << ", torch shape "
                     << shape_str(expected.shape());
  if (exact.defined() && exact.shape() != expected.shape())
    return failure() << "exact." << key << " has the wrong shape\n" << kRegenerate;
  int64_t bad = 0, first_bad = -1;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = actual.flat(i), t = expected.flat(i);
    if (close_at(a, t, rtol, atol)) continue;
    if (exact.defined() && close_at(a, exact.flat(i), rtol, atol)) {
      // torch's float32 rounding, not a difference (see above); said, not hidden.
      std::printf(
          "note: %s (%s), tensor '%s'[%lld]: attn %.9g is off torch's float32 %.9g but "
          "on its float64 %.9g\n",
          c.label().c_str(), run.name().c_str(), key.c_str(), static_cast<long long>(i), a, t,
          exact.flat(i));
      continue;
    }
    if (bad++ == 0) first_bad = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  auto result = failure();
  result << bad << " of " << actual.numel()
         << " elements differ; max |attn - torch| = " << max_abs_diff(actual, expected) << " (rtol "
         << rtol << ", atol " << atol << "); first at row-major index " << first_bad << ": attn "
         << actual.flat(first_bad) << ", torch " << expected.flat(first_bad);
  if (exact.defined()) result << ", torch float64 " << exact.flat(first_bad);
  return result << "\n" << kRegenerate;
}

// Rows of `a`, `b` and `c` stacked along dim 0 (PyTorch's packed in_proj).
Tensor stack3(const Tensor& a, const Tensor& b, const Tensor& c) {
  Shape shape = a.shape();
  shape[0] = a.dim(0) + b.dim(0) + c.dim(0);
  Tensor out = Tensor::empty(shape, a.dtype());
  int64_t row = 0;
  for (const Tensor* t : {&a, &b, &c}) {
    out.slice(0, row, row + t->dim(0)).copy_from(*t);
    row += t->dim(0);
  }
  return out;
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = a.clone();
  for (int64_t i = 0; i < out.numel(); ++i)
    out.set_flat(i, a.flat(i) + b.flat(i));
  return out;
}

Context make_context(const RunConfig& run) {
  Context ctx;
  ctx.backend = run.backend;
  return ctx;
}

// ---------------------------------------------------------------------------------------------
// masked_softmax: lengths none / (B,) / (B, T), int64, int32 and float, 0, negative, NaN, >= S.

TEST(Parity, MaskedSoftmax) {
  for (const Case& c : cases_of("masked_softmax", 10)) {
    for (const RunConfig& run : kRuns) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      MaskOptions mask;
      mask.valid_lens = c.get("valid_lens");  // as stored: int64, int32 or float32
      Tensor Y = masked_softmax(ctx, c.input("X", run), mask);
      EXPECT_TRUE(matches(c, "Y", Y, run));
      // torch's dX is exactly 0 where d2l overwrote the score with -1e6, and in whole rows
      // without a kept key; attn's backward promises the same.
      EXPECT_TRUE(matches(c, "dX", masked_softmax_backward(ctx, c.input("G", run), Y, mask), run));
    }
    // The d2l-shaped call, masked_softmax(X, valid_lens).
    EXPECT_TRUE(matches(c, "Y", masked_softmax(c.at("X"), c.get("valid_lens"))));
  }
}

// ---------------------------------------------------------------------------------------------
// Scaled dot-product attention, as an op and as d2l's DotProductAttention module (eval).

TEST(Parity, DotProductAttentionOp) {
  for (const Case& c : cases_of("dot_product_attention", 6)) {
    for (const RunConfig& run : kRuns) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      const Tensor q = c.input("queries", run), k = c.input("keys", run),
                   v = c.input("values", run);
      AttentionOptions opts;
      opts.mask.valid_lens = c.get("valid_lens");
      opts.need_weights = true;
      AttentionResult fwd = scaled_dot_product_attention(ctx, q, k, v, opts);
      EXPECT_TRUE(matches(c, "output", fwd.output, run));
      EXPECT_TRUE(matches(c, "attention_weights", fwd.weights, run));
      AttentionGrads grads =
          scaled_dot_product_attention_backward(ctx, c.input("G", run), q, k, v, fwd, opts);
      EXPECT_TRUE(matches(c, "grad.queries", grads.dq, run));
      EXPECT_TRUE(matches(c, "grad.keys", grads.dk, run));
      EXPECT_TRUE(matches(c, "grad.values", grads.dv, run));
    }
  }
}

// d2l has no causal flag: its decoder passes (B, T) lengths arange(1, T + 1). attn's causal mask
// (query t sees keys 0..t) must give the same numbers without lengths.
TEST(Parity, CausalFlagEqualsD2lDecoderLengths) {
  const SafetensorsFile* file = fixture("dot_product_attention");
  ASSERT_NE(file, nullptr);
  const Case c(*file, "dot_product_attention", "causal_lens_2d");
  ASSERT_TRUE(c.has("output")) << kRegenerate;
  for (const RunConfig& run : kRuns) {
    SCOPED_TRACE(run.name());
    Context ctx = make_context(run);
    const Tensor q = c.input("queries", run), k = c.input("keys", run), v = c.input("values", run);
    AttentionOptions opts;
    opts.mask.causal = true;
    opts.need_weights = true;
    AttentionResult fwd = scaled_dot_product_attention(ctx, q, k, v, opts);
    EXPECT_TRUE(matches(c, "output", fwd.output, run));
    EXPECT_TRUE(matches(c, "attention_weights", fwd.weights, run));
    AttentionGrads grads =
        scaled_dot_product_attention_backward(ctx, c.input("G", run), q, k, v, fwd, opts);
    EXPECT_TRUE(matches(c, "grad.queries", grads.dq, run));
    EXPECT_TRUE(matches(c, "grad.keys", grads.dk, run));
    EXPECT_TRUE(matches(c, "grad.values", grads.dv, run));
  }
}

TEST(Parity, DotProductAttentionModule) {
  for (const Case& c : cases_of("dot_product_attention", 6)) {
    for (const RunConfig& run : kRuns) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      nn::DotProductAttention attention(0.5, run.dtype);  // the fixture's dropout, off in eval
      attention.eval();
      Tensor out = attention.forward(ctx, c.input("queries", run), c.input("keys", run),
                                     c.input("values", run), c.get("valid_lens"));
      EXPECT_TRUE(matches(c, "output", out, run));
      EXPECT_TRUE(matches(c, "attention_weights", attention.attention_weights(), run));
      nn::AttentionInputGrads grads = attention.backward(ctx, c.input("G", run));
      EXPECT_TRUE(matches(c, "grad.queries", grads.dqueries, run));
      EXPECT_TRUE(matches(c, "grad.keys", grads.dkeys, run));
      EXPECT_TRUE(matches(c, "grad.values", grads.dvalues, run));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// d2l AdditiveAttention (eval): W_q.weight, W_k.weight, w_v.weight loaded from the fixture.

TEST(Parity, AdditiveAttention) {
  for (const Case& c : cases_of("additive_attention", 5)) {
    for (const RunConfig& run : kRuns) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      nn::AdditiveAttention attention(c.config("num_hiddens"), 0.1, run.dtype);
      attention.load_state_dict(c.with_prefix("param.", run.dtype));
      attention.eval();
      Tensor out = attention.forward(ctx, c.input("queries", run), c.input("keys", run),
                                     c.input("values", run), c.get("valid_lens"));
      EXPECT_TRUE(matches(c, "output", out, run));
      EXPECT_TRUE(matches(c, "attention_weights", attention.attention_weights(), run));
      nn::AttentionInputGrads grads = attention.backward(ctx, c.input("G", run));
      EXPECT_TRUE(matches(c, "grad.queries", grads.dqueries, run));
      EXPECT_TRUE(matches(c, "grad.keys", grads.dkeys, run));
      EXPECT_TRUE(matches(c, "grad.values", grads.dvalues, run));
      for (auto& [name, p] : attention.named_parameters())
        EXPECT_TRUE(matches(c, "grad." + name, p->grad, run));
    }
  }
}

// The additive op alone, on projections computed by attn's linear: the same numbers.
TEST(Parity, AdditiveAttentionOp) {
  for (const Case& c : cases_of("additive_attention", 5)) {
    SCOPED_TRACE(c.label());
    Context ctx;
    Tensor qp = linear(ctx, c.at("queries"), c.at("param.W_q.weight"));
    Tensor kp = linear(ctx, c.at("keys"), c.at("param.W_k.weight"));
    AttentionOptions opts;
    opts.mask.valid_lens = c.get("valid_lens");
    AdditiveResult fwd =
        additive_attention(ctx, qp, kp, c.at("param.w_v.weight"), c.at("values"), opts);
    EXPECT_TRUE(matches(c, "output", fwd.output));
    EXPECT_TRUE(matches(c, "attention_weights", fwd.weights));
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-head attention: d2l's module with d2l names, and torch.nn.MultiheadAttention's weights
// (packed in_proj_weight or q/k/v_proj_weight, in_proj_bias, out_proj.*) loaded into the same
// module. torch's key_padding_mask = arange(S) >= valid_lens is d2l's valid_lens; the fixtures
// have no fully masked row there (torch gives NaN, d2l uniform weights).

Tensor named_grad(nn::Module& module, const std::string& name) {
  for (auto& [n, p] : module.named_parameters())
    if (n == name) return p->grad;
  return {};
}

// The fixture's gradient of a PyTorch-named parameter, assembled from attn's d2l-named ones.
Tensor torch_named_grad(nn::MultiHeadAttention& mha, const std::string& name) {
  if (name == "in_proj_weight")
    return stack3(mha.W_q.weight.grad, mha.W_k.weight.grad, mha.W_v.weight.grad);
  if (name == "in_proj_bias")
    return stack3(mha.W_q.bias.grad, mha.W_k.bias.grad, mha.W_v.bias.grad);
  if (name == "q_proj_weight") return mha.W_q.weight.grad;
  if (name == "k_proj_weight") return mha.W_k.weight.grad;
  if (name == "v_proj_weight") return mha.W_v.weight.grad;
  if (name == "out_proj.weight") return mha.W_o.weight.grad;
  if (name == "out_proj.bias") return mha.W_o.bias.grad;
  return {};
}

TEST(Parity, MultiHeadAttention) {
  int d2l_cases = 0, torch_cases = 0;
  for (const Case& c : cases_of("multi_head_attention", 10)) {
    const bool torch_names = c.has("param.out_proj.weight");
    (torch_names ? torch_cases : d2l_cases)++;
    const bool bias = c.has("param.W_q.bias") || c.has("param.in_proj_bias");
    const bool self_attention = c.config("self_attention") != 0;
    for (const RunConfig& run : kRuns) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      const nn::StateDict params = c.with_prefix("param.", run.dtype);
      const Tensor G = c.input("G", run);
      const int64_t E = G.dim(-1);
      nn::MultiHeadAttention mha(E, c.config("num_heads"), 0.2, bias, run.dtype);
      mha.load_state_dict(params);
      mha.eval();

      const Tensor q = c.input("queries", run);
      // Self-attention passes one tensor three times, as torch's `query is key is value`.
      const Tensor k = self_attention ? q : c.input("keys", run);
      const Tensor v = self_attention ? q : c.input("values", run);
      Tensor out = mha.forward(ctx, q, k, v, c.get("valid_lens"));
      EXPECT_TRUE(matches(c, "output", out, run));
      EXPECT_TRUE(matches(c, "attention_weights", mha.attention_weights(), run));  // (B*H, T, S)

      nn::AttentionInputGrads grads = mha.backward(ctx, G);
      if (self_attention && !c.has("keys")) {
        // torch saw one tensor: its gradient is the sum of the three paths.
        EXPECT_TRUE(
            matches(c, "grad.queries", add(add(grads.dqueries, grads.dkeys), grads.dvalues), run));
      } else {
        EXPECT_TRUE(matches(c, "grad.queries", grads.dqueries, run));
        EXPECT_TRUE(matches(c, "grad.keys", grads.dkeys, run));
        EXPECT_TRUE(matches(c, "grad.values", grads.dvalues, run));
      }
      for (const auto& [name, value] : params)
        EXPECT_TRUE(matches(c, "grad." + name,
                            torch_names ? torch_named_grad(mha, name) : named_grad(mha, name),
                            run));
      if (torch_names) {
        // Loading PyTorch names is a pure renaming: the d2l state dict holds the same values.
        nn::StateDict d2l = mha.state_dict();
        if (params.count("in_proj_weight")) {
          const Tensor& w = params.at("in_proj_weight");
          EXPECT_EQ(max_abs_diff(d2l.at("W_q.weight"), w.slice(0, 0, E)), 0.0);
          EXPECT_EQ(max_abs_diff(d2l.at("W_k.weight"), w.slice(0, E, 2 * E)), 0.0);
          EXPECT_EQ(max_abs_diff(d2l.at("W_v.weight"), w.slice(0, 2 * E, 3 * E)), 0.0);
        }
        EXPECT_EQ(max_abs_diff(d2l.at("W_o.weight"), params.at("out_proj.weight")), 0.0);
      }
    }
  }
  EXPECT_GE(d2l_cases, 5) << kRegenerate;
  EXPECT_GE(torch_cases, 5) << kRegenerate;
}

// ---------------------------------------------------------------------------------------------
// Sinusoidal positional encoding: d2l's float32 table, and the module's forward and backward.

// d2l's table is sin/cos of angle = float32(i) / den_j, den_j = pow(10000, f32(2j) / f32(d)) in
// float32. kMatchD2l replays that chain with a correctly rounded powf; torch's vectorised pow is
// sometimes 1 ulp off (P_d100, j = 2: den 1.4454398 in float32, torch one ulp away), and then
// the float32 angles differ by up to one ulp of the angle, ~6e-5 at i = 999. So each element is
// allowed atol 1e-6 PLUS |torch's angle - the correctly rounded chain's angle|, computed here
// exactly from the fixture's den: 0 for every column where torch's pow is correctly rounded.
// kExact (angles in double) is held to 1e-6 plus |torch's float32 angle - the true angle|.
TEST(Parity, SinusoidalEncodingMatchesD2l) {
  int tables = 0;
  for (const Case& c : cases_of("positional_encoding", 4)) {
    if (!c.has("P")) continue;
    ++tables;
    SCOPED_TRACE(c.label());
    const Tensor expected = c.at("P");  // (rows, d): P[positions[r]]
    const Tensor positions = c.at("positions");
    const Tensor torch_den = c.at("den");  // (ceil(d / 2),)
    const int64_t d = expected.dim(1);
    ASSERT_EQ(torch_den.numel(), (d + 1) / 2);
    const Tensor matched = sinusoidal_encoding(1000, d, DType::F32, SinusoidalMode::kMatchD2l);
    const Tensor exact = sinusoidal_encoding(1000, d, DType::F32, SinusoidalMode::kExact);
    EXPECT_EQ(max_abs_diff(sinusoidal_encoding(1000, d), matched), 0.0)
        << "kMatchD2l should be the float32 default";

    int64_t bad_matched = 0, bad_exact = 0, shifted_columns = 0;
    std::string first_bad;
    for (int64_t j = 0; 2 * j < d; ++j) {
      const float e = static_cast<float>(2 * j) / static_cast<float>(d);
      const float den_rounded = static_cast<float>(std::pow(10000.0, static_cast<double>(e)));
      const float den_torch = static_cast<float>(torch_den.flat(j));
      const double true_den = std::pow(10000.0, 2.0 * static_cast<double>(j) / d);
      shifted_columns += den_rounded != den_torch;
      for (int64_t r = 0; r < positions.numel(); ++r) {
        const int64_t i = static_cast<int64_t>(positions.flat(r));
        const float angle_torch = static_cast<float>(i) / den_torch;
        const float angle_rounded = static_cast<float>(i) / den_rounded;
        const double tol_matched = 1e-6 + std::abs(double{angle_torch} - double{angle_rounded});
        const double tol_exact = 1e-6 + std::abs(double{angle_torch} - i / true_den);
        for (int64_t col = 2 * j; col < std::min(2 * j + 2, d); ++col) {
          const double t = expected.at({r, col});
          const double m = matched.at({i, col}), x = exact.at({i, col});
          if (std::abs(m - t) > tol_matched && bad_matched++ == 0)
            first_bad = fmt::format("kMatchD2l P[{}, {}] = {}, torch {} (allowed {})", i, col, m, t,
                                    tol_matched);
          if (std::abs(x - t) > tol_exact && bad_exact++ == 0 && first_bad.empty())
            first_bad = fmt::format("kExact P[{}, {}] = {}, torch {} (allowed {})", i, col, x, t,
                                    tol_exact);
        }
      }
    }
    EXPECT_EQ(bad_matched + bad_exact, 0)
        << "case " << c.label() << ", tensor 'P': " << bad_matched << " kMatchD2l and " << bad_exact
        << " kExact elements out of tolerance; first: " << first_bad
        << " (torch's pow differs from the correctly rounded one in " << shifted_columns
        << " column pairs)\n"
        << kRegenerate;
  }
  EXPECT_EQ(tables, 3) << "expected P for d = 4, 32, 100\n" << kRegenerate;
}

// float32 only: in float64 attn's table is kExact, not d2l's float32 chain.
TEST(Parity, PositionalEncodingModule) {
  bool found = false;
  for (const Case& c : cases_of("positional_encoding", 4)) {
    if (!c.has("X")) continue;
    found = true;
    SCOPED_TRACE(c.label());
    Context ctx;
    const Tensor X = c.at("X");
    nn::PositionalEncoding encoding(X.dim(-1), 0.1);
    encoding.eval();
    EXPECT_TRUE(matches(c, "output", encoding.forward(ctx, X)));
    EXPECT_TRUE(matches(c, "grad.X", encoding.backward(ctx, c.at("G"))));
  }
  EXPECT_TRUE(found) << "no forward case in positional_encoding\n" << kRegenerate;
}

// ---------------------------------------------------------------------------------------------
// d2l's TransformerEncoder (embedding * sqrt(E) + P, post-norm blocks): forward, every parameter
// gradient, then a few SGD steps (momentum 0.9) on sum(output * G), comparing each step's loss
// and the parameters after the last step. Dropout is 0 (torch's dropout stream is not ours).
//
// float32 only: d2l adds its float32 P table even to float64 inputs, while attn's float64
// encoder uses the exact table (see SinusoidalEncodingMatchesD2l), so a float64 comparison
// would measure that choice, ~1e-7 at these positions, not the encoder.
TEST(Parity, TransformerEncoder) {
  const std::vector<RunConfig> runs = {kRuns[0], kRuns[1]};
  for (const Case& c : cases_of("transformer_encoder", 2)) {
    const Tensor shape = c.at("config.shape"), sgd_config = c.at("config.sgd");
    const int64_t V = static_cast<int64_t>(shape.flat(0)), E = static_cast<int64_t>(shape.flat(1)),
                  F = static_cast<int64_t>(shape.flat(2)), H = static_cast<int64_t>(shape.flat(3)),
                  blocks = static_cast<int64_t>(shape.flat(4));
    for (const RunConfig& run : runs) {
      SCOPED_TRACE(c.label() + " on " + run.name());
      Context ctx = make_context(run);
      nn::TransformerEncoderOptions options;
      options.dtype = run.dtype;
      auto make_encoder = [&] {
        auto encoder =
            std::make_unique<nn::TransformerEncoder>(V, E, F, H, blocks, 0.0, false, options);
        encoder->load_state_dict(c.with_prefix("param.", run.dtype));
        return encoder;
      };
      const Tensor ids = c.at("ids"), lens = c.get("valid_lens"), G = c.input("G", run);

      auto encoder = make_encoder();
      encoder->eval();
      EXPECT_TRUE(matches(c, "output", encoder->forward(ctx, ids, lens), run));
      for (int64_t i = 0; i < blocks; ++i)
        EXPECT_TRUE(matches(c, fmt::format("attention_weights.block{}", i),
                            encoder->attention_weights(i), run));
      encoder->backward(ctx, G);
      for (auto& [name, p] : encoder->named_parameters())
        EXPECT_TRUE(matches(c, "grad." + name, p->grad, run));

      // Training: torch.optim.SGD(lr, momentum), zero_grad / forward / backward / step.
      auto trained = make_encoder();
      trained->train();
      nn::SGDOptions sgd_options;
      sgd_options.lr = sgd_config.flat(0);
      sgd_options.momentum = sgd_config.flat(1);
      nn::SGD sgd(trained->named_parameters(), sgd_options);
      const int64_t steps = static_cast<int64_t>(sgd_config.flat(2));
      Tensor losses = Tensor::empty({steps}, DType::F32);
      for (int64_t step = 0; step < steps; ++step) {
        sgd.zero_grad();
        const Tensor out = trained->forward(ctx, ids, lens);
        losses.set_flat(step, testing::dot(out, G));
        trained->backward(ctx, G);
        sgd.step();
      }
      EXPECT_TRUE(matches(c, "train.loss", losses, run));
      for (auto& [name, p] : trained->named_parameters())
        EXPECT_TRUE(matches(c, "train.param." + name, p->value, run));
    }
  }
}

}  // namespace
}  // namespace attn
