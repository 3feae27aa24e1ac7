// Optimisers and gradient clipping: SGD (momentum, dampening, Nesterov, weight decay), AdamW and
// clip_grad_norm against PyTorch 1.13's numbers, state dicts that resume bit-identically, a small
// training run that learns, and bad input.
//
// The expected values come from Debian's python3-torch 1.13 (float64):
//   p = torch.tensor([1.0, -2.0, 0.3], requires_grad=True)
//   opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01)      # or SGD(...) as below
//   for g in [[0.5, 0.1, -0.2], [-0.3, 0.4, 0.0], [0.2, 0.2, 1.5]]:
//       p.grad = torch.tensor(g); opt.step()
//   print([repr(x) for x in p.tolist()])
#include "attn/nn/optim.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/loss.hpp"
#include "kernels/cpu/parallel.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace attn::nn {
namespace {

const std::vector<std::vector<double>> kGrads = {
    {0.5, 0.1, -0.2}, {-0.3, 0.4, 0.0}, {0.2, 0.2, 1.5}};

// Runs the three steps above on p = [1, -2, 0.3] and returns p.
template <typename Opt, typename Options>
std::vector<double> three_steps(const Options& o, DType dtype = DType::F64) {
  Parameter p;
  p.value = Tensor::from_vector(std::vector<double>{1.0, -2.0, 0.3}, {3}, dtype);
  p.grad = Tensor::zeros({3}, dtype);
  Opt opt({{"p", &p}}, o);
  for (const auto& g : kGrads) {
    p.grad.copy_from(Tensor::from_vector(g, {3}, DType::F64));
    opt.step();
  }
  return p.value.to_vector();
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST(SGD, PlainStepByHand) {
  // p = p - lr * (g + wd * p)
  SGDOptions o;
  o.lr = 0.5;
  o.weight_decay = 0.1;
  Parameter p;
  p.value = Tensor::from_vector(std::vector<double>{2.0}, {1}, DType::F64);
  p.grad = Tensor::from_vector(std::vector<double>{1.0}, {1}, DType::F64);
  SGD opt({{"p", &p}}, o);
  opt.step();
  EXPECT_DOUBLE_EQ(p.value.flat(0), 2.0 - 0.5 * (1.0 + 0.1 * 2.0));
  EXPECT_TRUE(opt.state_dict().empty());  // no momentum, no state
}

TEST(SGD, MomentumDampeningWeightDecayMatchPyTorch) {
  // torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05)
  SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.dampening = 0.1;
  o.weight_decay = 0.05;
  expect_near_all(three_steps<SGD>(o), {0.8720381362499999, -2.0601785, 0.21091009962499999},
                  1e-15);
  // torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)
  SGDOptions n;
  n.lr = 0.1;
  n.momentum = 0.9;
  n.nesterov = true;
  expect_near_all(three_steps<SGD>(n), {0.87135, -2.18079, 0.08377999999999992}, 1e-15);
  // float32 parameters: the same within float32 rounding.
  expect_near_all(three_steps<SGD>(o, DType::F32),
                  {0.8720381362499999, -2.0601785, 0.21091009962499999}, 1e-6);
}

TEST(AdamW, MatchesPyTorch) {
  // torch.optim.AdamW([p], lr=0.1, weight_decay=0.01), betas (0.9, 0.999), eps 1e-8
  AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.01;
  const std::vector<double> want = {0.8433294795899422, -2.2715493671916107, 0.40935650430178394};
  expect_near_all(three_steps<AdamW>(o), want, 1e-15);
  expect_near_all(three_steps<AdamW>(o, DType::F32), want, 1e-6);
}

// The float32 update is vectorised per SIMD target (nn/optim.cpp); every lane must give the
// scalar loop's bits: the loop as it was, copied here (compiled for the baseline target: no FMA),
// on a length with vector tails, values of both signs and of many magnitudes, 3 steps.
TEST(AdamW, Float32UpdateIsTheScalarLoopBitForBit) {
  const int64_t n = 1037;
  AdamWOptions o;
  o.lr = 3e-3;
  o.weight_decay = 0.05;
  Parameter p;
  p.value = testing::random_tensor({n}, DType::F32, 41);
  p.grad = Tensor::zeros({n}, DType::F32);
  std::vector<float> w(p.value.data<float>(), p.value.data<float>() + n), m(n, 0.0f), v(n, 0.0f);
  AdamW opt({{"p", &p}}, o);
  for (int t = 1; t <= 3; ++t) {
    const Tensor g = testing::random_tensor({n}, DType::F32, 50 + static_cast<uint64_t>(t));
    float* gp = g.data<float>();
    for (int64_t j = 0; j < n; j += 5)
      gp[j] *= static_cast<float>(std::pow(10.0, static_cast<double>(j % 13) - 6.0));
    p.grad.copy_from(g);
    opt.step();
    const double bias_correction1 = 1.0 - std::pow(o.beta1, t);
    const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, t));
    const double step_size = o.lr / bias_correction1;
    for (int64_t j = 0; j < n; ++j) {
      const double gj = gp[j];
      const double wj = static_cast<float>(w[j] * (1.0 - o.lr * o.weight_decay));
      m[j] = static_cast<float>(o.beta1 * m[j] + (1.0 - o.beta1) * gj);
      v[j] = static_cast<float>(o.beta2 * v[j] + (1.0 - o.beta2) * gj * gj);
      const double denom = std::sqrt(static_cast<double>(v[j])) / bias_correction2_sqrt + o.eps;
      w[j] = static_cast<float>(wj - step_size * m[j] / denom);
    }
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(std::memcmp(&w[j], p.value.data<float>() + j, 4), 0)
          << "step " << t << " element " << j << ": " << w[j] << " vs " << p.value.data<float>()[j];
  }
}

// Parameters updated side by side (Optimizer::threads > 1, forking at any size) end bit for bit
// where one thread ends: every element's update is the same arithmetic on any thread.
TEST(AdamW, ThreadsChangeNoBit) {
  const double saved = cpu::min_flops_per_thread();
  cpu::set_min_flops_per_thread(0);
  const std::vector<Shape> shapes = {{37, 5}, {211}, {3, 4, 5}, {1}, {64, 9}};
  auto run = [&](int threads) {
    std::vector<Parameter> ps(shapes.size());
    NamedParameters named;
    for (size_t i = 0; i < shapes.size(); ++i) {
      ps[i].value = testing::random_tensor(shapes[i], DType::F32, 70 + i);
      ps[i].grad = Tensor::zeros(shapes[i], DType::F32);
      named.push_back({"p" + std::to_string(i), &ps[i]});
    }
    AdamWOptions o;
    o.lr = 1e-2;
    AdamW opt(named, o);
    opt.threads = threads;
    for (uint64_t t = 0; t < 3; ++t) {
      for (size_t i = 0; i < shapes.size(); ++i)
        ps[i].grad.copy_from(testing::random_tensor(shapes[i], DType::F32, 90 + 10 * t + i));
      opt.step();
    }
    std::vector<Tensor> out;
    for (const Parameter& p : ps)
      out.push_back(p.value.clone());
    for (const auto& [name, t] : opt.state_dict())
      out.push_back(t.clone());
    return out;
  };
  const std::vector<Tensor> one = run(1), three = run(3);
  cpu::set_min_flops_per_thread(saved);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_EQ(std::memcmp(one[i].raw_data(), three[i].raw_data(), one[i].nbytes()), 0) << i;
}

TEST(AdamW, FirstStepByHand) {
  // At t = 1 the bias corrections cancel (1 - b1) and (1 - b2): the step is lr * g / (|g| + eps'),
  // eps' = eps, after the decoupled decay p * (1 - lr * wd).
  Parameter p;
  p.value = Tensor::from_vector(std::vector<double>{1.0, -1.0}, {2}, DType::F64);
  p.grad = Tensor::from_vector(std::vector<double>{0.25, -4.0}, {2}, DType::F64);
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.5;
  AdamW opt({{"p", &p}}, o);
  opt.step();
  EXPECT_NEAR(p.value.flat(0), 1.0 * (1 - 0.005) - 0.01 * 0.25 / (0.25 + 1e-8), 1e-15);
  EXPECT_NEAR(p.value.flat(1), -1.0 * (1 - 0.005) + 0.01 * 4.0 / (4.0 + 1e-8), 1e-15);
  StateDict s = opt.state_dict();
  EXPECT_EQ(s.at("p.step").flat(0), 1.0);
  EXPECT_NEAR(s.at("p.exp_avg").flat(1), (1.0 - 0.9) * -4.0, 1e-16);
  EXPECT_NEAR(s.at("p.exp_avg_sq").flat(1), (1.0 - 0.999) * 16.0, 1e-16);
}

// ---- bfloat16 parameters ----------------------------------------------------------------------

// The bf16 value nearest to x, ties to the even bit pattern, by search (independent of the
// library's rounding): the two bf16 neighbours of x bracket it.
double nearest_bf16(double x) {
  uint16_t lo = float_to_bf16(static_cast<float>(x));
  double best = bf16_to_float(lo);
  for (int delta : {-1, 1}) {
    const uint16_t c = static_cast<uint16_t>(lo + delta);
    const double v = bf16_to_float(c);
    const double d = std::abs(v - x), db = std::abs(best - x);
    if (d < db || (d == db && (c & 1) == 0)) best = v, lo = c;
  }
  return best;
}

TEST(Bf16Parameters, SgdStepRoundsEachStoredValueOnce) {
  Rng rng(5, 1);
  std::vector<double> w, g;
  for (int i = 0; i < 2000; ++i) {
    w.push_back(nearest_bf16(rng.uniform() * 4.0 - 2.0));
    g.push_back(nearest_bf16((rng.uniform() - 0.5) * 1e-2));
  }
  SGDOptions o;
  o.lr = 0.3;
  o.weight_decay = 0.01;
  Parameter p;
  p.value = Tensor::from_vector(w, {2000}, DType::BF16);
  p.grad = Tensor::from_vector(g, {2000}, DType::BF16);
  SGD opt({{"p", &p}}, o);
  opt.step();
  const std::vector<double> got = p.value.to_vector();
  // d = g + wd * w is held in the parameter's dtype, as torch's d_p tensor (SGD::step).
  for (size_t i = 0; i < w.size(); ++i)
    ASSERT_EQ(got[i], nearest_bf16(w[i] - 0.3 * nearest_bf16(g[i] + 0.01 * w[i]))) << i;
  EXPECT_EQ(p.value.dtype(), DType::BF16);

  // A double just above the midpoint of two bf16 values whose float is the midpoint itself:
  // double -> float -> bf16 would round to even (1.0); once from double gives 1.0078125.
  Parameter t;
  t.value = Tensor::from_vector(std::vector<double>{1.0078125}, {1}, DType::BF16);
  t.grad = Tensor::from_vector(std::vector<double>{0.00390625}, {1}, DType::BF16);
  SGDOptions tie;
  tie.lr = 1.0 - std::ldexp(1.0, -30);  // w - lr * g = 1.00390625 + 2^-38
  SGD tie_opt({{"t", &t}}, tie);
  tie_opt.step();
  EXPECT_EQ(t.value.flat(0), 1.0078125);
}

TEST(Bf16Parameters, AdamWKeepsBf16StateAndFollowsTheRule) {
  AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.01;
  // The rule of optim.hpp with every stored value rounded once to bf16.
  std::vector<double> w = {1.0, -2.0, nearest_bf16(0.3)}, m(3, 0.0), v(3, 0.0);
  for (size_t t = 1; t <= kGrads.size(); ++t) {
    const double bc1 = 1.0 - std::pow(0.9, double(t)), bc2 = std::sqrt(1.0 - std::pow(0.999, t));
    for (size_t j = 0; j < 3; ++j) {
      const double gj = nearest_bf16(kGrads[t - 1][j]);
      const double wj = nearest_bf16(w[j] * (1.0 - 0.1 * 0.01));
      m[j] = nearest_bf16(0.9 * m[j] + 0.1 * gj);
      v[j] = nearest_bf16(0.999 * v[j] + 0.001 * gj * gj);
      w[j] = nearest_bf16(wj - 0.1 / bc1 * m[j] / (std::sqrt(v[j]) / bc2 + 1e-8));
    }
  }
  const std::vector<double> got = three_steps<AdamW>(o, DType::BF16);
  EXPECT_EQ(got, w);
  // PyTorch's float64 result (AdamW.MatchesPyTorch) within bf16 rounding of the path.
  expect_near_all(got, {0.8433294795899422, -2.2715493671916107, 0.40935650430178394}, 2e-2);

  Parameter p;
  p.value = Tensor::from_vector(std::vector<double>{1.0}, {1}, DType::BF16);
  p.grad = Tensor::from_vector(std::vector<double>{0.5}, {1}, DType::BF16);
  AdamW opt({{"p", &p}}, o);
  opt.step();
  const StateDict st = opt.state_dict();
  EXPECT_EQ(st.at("p.exp_avg").dtype(), DType::BF16);
  EXPECT_EQ(st.at("p.exp_avg_sq").dtype(), DType::BF16);
  EXPECT_EQ(st.at("p.step").dtype(), DType::F64);
  // Resuming from the state dict (saved as BF16, loaded from F32 too) repeats bit for bit.
  Parameter q = p;
  q.value = p.value.clone(), q.grad = p.grad.clone();
  AdamW a({{"p", &p}}, o), b({{"p", &q}}, o);
  a.load_state_dict(st);
  StateDict st32;
  for (const auto& [k, t] : st)
    st32.emplace(k, t.to(k == "p.step" ? DType::F64 : DType::F32));
  b.load_state_dict(st32);
  a.step();
  b.step();
  EXPECT_EQ(p.value.to_vector(), q.value.to_vector());
}

// A bf16 MultiHeadAttention trains with AdamW: the loss falls (no master weights, as PyTorch).
TEST(Bf16Parameters, MultiHeadAttentionLearns) {
  Context ctx;
  ctx.threads = 1;
  MultiHeadAttention mha(16, 2, 0.0, true, DType::BF16);
  const Tensor x = testing::random_tensor({4, 6, 16}, DType::F32, 3).to(DType::BF16);
  const Tensor target = testing::random_tensor({4, 6, 16}, DType::F32, 4).to(DType::BF16);
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.0;
  std::unique_ptr<AdamW> opt;
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const Tensor y = mha.forward(ctx, x, x, x, Tensor());
    // Loss 0.5 * mean (y - target)^2 and its gradient, in double.
    const std::vector<double> yv = y.to_vector(), tv = target.to_vector();
    std::vector<double> dy(yv.size());
    double loss = 0;
    for (size_t i = 0; i < yv.size(); ++i) {
      loss += 0.5 * (yv[i] - tv[i]) * (yv[i] - tv[i]) / double(yv.size());
      dy[i] = (yv[i] - tv[i]) / double(yv.size());
    }
    if (step == 0) {
      first = loss;
      opt = std::make_unique<AdamW>(mha.named_parameters(), o);
    }
    last = loss;
    opt->zero_grad();
    mha.backward(ctx, Tensor::from_vector(dy, y.shape(), DType::BF16));
    opt->step();
  }
  EXPECT_LT(last, 0.5 * first) << "first " << first << ", last " << last;
}

TEST(ClipGradNorm, GlobalL2NormAsPyTorch) {
  // clip_grad_norm_([pa, pb], 6.5) with grads [3, 4] and [12]: norm 13, scale 6.5 / (13 + 1e-6)
  Parameter a, b, lazy;
  a.value = Tensor::zeros({2}, DType::F64);
  a.grad = Tensor::from_vector(std::vector<double>{3, 4}, {2}, DType::F64);
  b.value = Tensor::zeros({1}, DType::F32);
  b.grad = Tensor::from_vector(std::vector<double>{12}, {1}, DType::F32);
  NamedParameters params = {{"a", &a}, {"b", &b}, {"lazy", &lazy}};  // lazy: skipped
  EXPECT_DOUBLE_EQ(clip_grad_norm(params, 6.5), 13.0);
  EXPECT_NEAR(a.grad.flat(0), 1.4999998846153937, 1e-15);
  EXPECT_NEAR(a.grad.flat(1), 1.9999998461538582, 1e-15);
  EXPECT_NEAR(b.grad.flat(0), 5.999999538461575, 1e-6);
  // Under the limit nothing changes.
  const double n = clip_grad_norm(params, 100.0);
  EXPECT_NEAR(n, 6.5, 1e-5);
  EXPECT_NEAR(a.grad.flat(0), 1.4999998846153937, 1e-15);
  // The infinity norm is the largest |g|.
  EXPECT_NEAR(clip_grad_norm(params, 100.0, INFINITY), 5.999999538461575, 1e-6);
  EXPECT_THROW(clip_grad_norm(params, -1.0), Error);
  EXPECT_THROW(clip_grad_norm(params, 1.0, 1.0), Error);
}

// The data of the toy task: 8 sequences of length 5; label 1 iff token 1 occurs.
void toy_data(Tensor& ids, Tensor& lens, Tensor& labels) {
  ids = Tensor::from_vector(
      std::vector<int64_t>{2, 3, 1, 4, 0, 5, 6, 7, 8,  0,  1,  2, 2, 0, 0, 9, 9, 3, 0, 0,
                           4, 5, 6, 1, 0, 7, 8, 9, 10, 11, 11, 1, 0, 0, 0, 3, 3, 3, 3, 3},
      {8, 5});
  lens = Tensor::from_vector(std::vector<int64_t>{4, 4, 3, 3, 4, 5, 2, 5}, {8});
  labels = Tensor::from_vector(std::vector<int64_t>{1, 0, 1, 0, 1, 0, 1, 0}, {8});
}

double train_step(Context& ctx, TransformerEncoder& enc, ClassificationHead& head, Optimizer& opt,
                  const Tensor& ids, const Tensor& lens, const Tensor& labels) {
  opt.zero_grad();
  Tensor X = enc.forward(ctx, ids, lens);
  Tensor logits = head.forward(ctx, X, lens);
  const double loss = softmax_cross_entropy(ctx, logits, labels).loss;
  enc.backward(ctx, head.backward(ctx, softmax_cross_entropy_backward(ctx, logits, labels)));
  clip_grad_norm(opt.parameters(), 1.0);
  opt.step();
  return loss;
}

NamedParameters all_parameters(TransformerEncoder& enc, ClassificationHead& head) {
  NamedParameters out;
  append_parameters(out, "encoder", enc);
  append_parameters(out, "head", head);
  return out;
}

TEST(Training, AdamWLearnsAToyTaskAndResumesBitIdentically) {
  Tensor ids, lens, labels;
  toy_data(ids, lens, labels);
  TransformerEncoderOptions eo;
  eo.seed = 5;
  TransformerEncoder enc(12, 8, 16, 2, 1, 0.1, false, eo);
  ClassificationHead head(2, 8, DType::F32, 6);
  AdamWOptions ao;
  ao.lr = 0.01;
  AdamW opt(all_parameters(enc, head), ao);
  Context ctx;
  ctx.seed = 42;
  const double first = train_step(ctx, enc, head, opt, ids, lens, labels);
  for (int i = 0; i < 60; ++i)
    train_step(ctx, enc, head, opt, ids, lens, labels);
  const double later = train_step(ctx, enc, head, opt, ids, lens, labels);
  EXPECT_LT(later, 0.5 * first) << "first " << first << ", after 61 steps " << later;

  // Checkpoint: module parameters, optimiser state and the dropout offset.
  StateDict model_state = enc.state_dict(), head_state = head.state_dict();
  StateDict opt_state = opt.state_dict();
  const uint64_t offset = ctx.dropout_offset();
  std::vector<double> losses;
  for (int i = 0; i < 3; ++i)
    losses.push_back(train_step(ctx, enc, head, opt, ids, lens, labels));

  // Resume into fresh objects built with other seeds: the same three losses, bit for bit.
  eo.seed = 77;
  TransformerEncoder enc2(12, 8, 16, 2, 1, 0.1, false, eo);
  ClassificationHead head2(2, 8, DType::F32, 78);
  enc2.load_state_dict(model_state);
  head2.load_state_dict(head_state);
  AdamW opt2(all_parameters(enc2, head2), ao);
  opt2.load_state_dict(opt_state);
  Context ctx2;
  ctx2.seed = 42;
  ctx2.set_dropout_offset(offset);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(train_step(ctx2, enc2, head2, opt2, ids, lens, labels), losses[i]) << "step " << i;
  EXPECT_EQ(enc2.state_dict().at("embedding.weight").to_vector(),
            enc.state_dict().at("embedding.weight").to_vector());
}

TEST(Optimizer, StateDictValidationIsAtomic) {
  Parameter p;
  p.value = Tensor::zeros({2, 2}, DType::F32);
  p.grad = Tensor::full({2, 2}, 1.0, DType::F32);
  SGDOptions so;
  so.momentum = 0.5;
  SGD sgd({{"w", &p}}, so);
  sgd.step();
  StateDict s = sgd.state_dict();
  ASSERT_EQ(s.count("w.momentum_buffer"), 1u);
  StateDict bad = s;
  bad["w.momentum_buffer"] = Tensor::zeros({3});
  EXPECT_THROW(sgd.load_state_dict(bad), Error);  // shape
  bad = s;
  bad["v.momentum_buffer"] = Tensor::zeros({2, 2});
  EXPECT_THROW(sgd.load_state_dict(bad), Error);  // unknown name
  EXPECT_EQ(sgd.state_dict().at("w.momentum_buffer").to_vector(),
            s.at("w.momentum_buffer").to_vector());  // unchanged after the failures
  AdamW adam({{"w", &p}});
  StateDict as;
  as["w.exp_avg"] = Tensor::zeros({2, 2});
  as["w.step"] = Tensor::zeros({2});
  EXPECT_THROW(adam.load_state_dict(as), Error);  // step must be (1)
}

TEST(Optimizer, BadArguments) {
  Parameter p;
  p.value = Tensor::zeros({1});
  p.grad = Tensor::zeros({1});
  SGDOptions so;
  so.lr = -1;
  EXPECT_THROW(SGD({{"p", &p}}, so), Error);
  so.lr = 0.1;
  so.nesterov = true;  // without momentum
  EXPECT_THROW(SGD({{"p", &p}}, so), Error);
  AdamWOptions ao;
  ao.beta1 = 1.0;
  EXPECT_THROW(AdamW({{"p", &p}}, ao), Error);
  EXPECT_THROW(AdamW({{"p", &p}, {"p", &p}}), Error);  // listed twice
  // A lazy parameter without a value is skipped by step().
  Parameter lazy;
  AdamW ok({{"lazy", &lazy}, {"p", &p}});
  EXPECT_NO_THROW(ok.step());
}

}  // namespace
}  // namespace attn::nn
