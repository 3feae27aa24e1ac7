// Conv1d and RNN (the CNN and RNN of the chapter's comparison): hand-computed forwards, FLOP
// counters, PyTorch's names and init bounds, finite-difference gradchecks in float64 of every
// input and parameter, and the validation errors.
#include "attn/nn/sequence.hpp"
#include "attn/ops/conv1d.hpp"
#include "attn/ops/rnn.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

void gradcheck_parameters(Module& m, const std::function<double()>& loss) {
  for (auto& [name, p] : m.named_parameters())
    EXPECT_TRUE(gradcheck(loss, p->value, p->grad.clone())) << name;
}

// ----------------------------------------------------------------------------------------------
// Conv1d

TEST(Conv1dOp, SamePaddingByHand) {
  Context ctx;
  // x = [1, 2, 3] (one channel), W = [1, 10, 100] (taps j = 0, 1, 2 read t-1, t, t+1), b = 0.5:
  //   y0 = 0*1 + 1*10 + 2*100 + 0.5,  y1 = 1 + 20 + 300 + 0.5,  y2 = 2 + 30 + 0*100 + 0.5
  const Tensor x = Tensor::from_vector(std::vector<double>{1, 2, 3}, {1, 3, 1}, DType::F64);
  const Tensor W = Tensor::from_vector(std::vector<double>{1, 10, 100}, {1, 1, 3}, DType::F64);
  const Tensor b = Tensor::from_vector(std::vector<double>{0.5}, {1}, DType::F64);
  int64_t flops = 0;
  const Tensor y = conv1d(ctx, x, W, b, &flops);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{210.5, 321.5, 32.5}));
  EXPECT_EQ(flops, 2 * 3 * 3);  // padded taps are multiplied too: n * k MACs
}

TEST(Conv1dOp, MatchesDirectSumWithChannels) {
  Context ctx;
  const int64_t B = 2, n = 6, Ci = 3, Co = 4, k = 5, p = 2;
  const Tensor x = random_tensor({B, n, Ci}, DType::F64, 1);
  const Tensor W = random_tensor({Co, Ci, k}, DType::F64, 2);
  const Tensor y = conv1d(ctx, x, W);
  for (int64_t bb = 0; bb < B; ++bb)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t o = 0; o < Co; ++o) {
        double want = 0;
        for (int64_t j = 0; j < k; ++j)
          for (int64_t i = 0; i < Ci; ++i)
            if (t + j - p >= 0 && t + j - p < n) want += W.at({o, i, j}) * x.at({bb, t + j - p, i});
        EXPECT_NEAR(y.at({bb, t, o}), want, 1e-12);
      }
  // float32 agrees with float64 from the same values.
  EXPECT_TRUE(close(conv1d(ctx, x.to(DType::F32), W.to(DType::F32)), y.to(DType::F32), 1e-5, 1e-6));
}

TEST(Conv1dModule, NamesInitAndFlops) {
  Conv1d conv(3, 5, 3, true, DType::F32, 4);
  const StateDict sd = conv.state_dict();
  ASSERT_EQ(sd.size(), 2u);
  EXPECT_EQ(sd.at("weight").shape(), Shape({5, 3, 3}));
  EXPECT_EQ(sd.at("bias").shape(), Shape({5}));
  const double bound = 1.0 / std::sqrt(9.0);
  for (const auto& [name, t] : sd)
    for (double v : t.to_vector())
      EXPECT_LE(std::abs(v), bound) << name;
  EXPECT_EQ(Conv1d(3, 5, 3, false).state_dict().size(), 1u);
  Context ctx;
  conv.forward(ctx, random_tensor({2, 7, 3}, DType::F32));
  EXPECT_EQ(conv.flops(), 2 * 2 * 7 * 5 * 3 * 3);
  conv.forward(ctx, random_tensor({1, 4, 3}, DType::F32));
  EXPECT_EQ(conv.flops(), 2 * 2 * 7 * 5 * 3 * 3 + 2 * 4 * 5 * 3 * 3);
  conv.reset_flops();
  EXPECT_EQ(conv.flops(), 0);
}

TEST(Conv1dModule, Gradcheck) {
  Context ctx;
  // k = 3 and k = 5 on n = 3 (the kernel wider than the sequence: every output sees padding).
  for (int64_t k : {3, 5}) {
    Conv1d conv(3, 4, k, true, DType::F64, 11);
    Tensor x = random_tensor({2, 3, 3}, DType::F64, 5);
    const Tensor w = random_tensor({2, 3, 4}, DType::F64, 6);
    conv.forward(ctx, x);
    conv.zero_grad();
    const Tensor dx = conv.backward(ctx, w);
    auto loss = [&] { return dot(conv.forward(ctx, x), w); };
    EXPECT_TRUE(gradcheck(loss, x, dx)) << "k = " << k;
    gradcheck_parameters(conv, loss);
  }
}

TEST(Conv1dModule, BadInput) {
  Context ctx;
  EXPECT_THROW(Conv1d(3, 4, 2), Error);  // even k
  EXPECT_THROW(Conv1d(0, 4, 3), Error);
  EXPECT_THROW(Conv1d(3, 4, 3, true, DType::I64), Error);
  Conv1d conv(3, 4, 3);
  EXPECT_THROW(conv.backward(ctx, Tensor::zeros({1, 2, 4})), Error);             // before forward
  EXPECT_THROW(conv.forward(ctx, Tensor::zeros({1, 2, 5})), Error);              // wrong width
  EXPECT_THROW(conv.forward(ctx, Tensor::zeros({2, 3})), Error);                 // not (B, n, d)
  EXPECT_THROW(conv.forward(ctx, Tensor::zeros({1, 2, 3}, DType::F64)), Error);  // dtype
  conv.forward(ctx, Tensor::zeros({1, 2, 3}));
  EXPECT_THROW(conv.backward(ctx, Tensor::zeros({1, 2, 3})), Error);  // dy width
  try {
    conv1d(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({4, 3, 4}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("odd"), std::string::npos) << e.what();
    EXPECT_EQ(e.op(), "conv1d");
  }
  EXPECT_THROW(conv1d(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({4, 3, 3}), Tensor::zeros({3})),
               Error);  // bias length
}

// ----------------------------------------------------------------------------------------------
// RNN

TEST(RnnOp, ScalarRecurrenceByHand) {
  Context ctx;
  const double wi = 0.7, wh = -1.3, bi = 0.1, bh = -0.2, h0 = 0.4;
  const Tensor x = Tensor::from_vector(std::vector<double>{0.5, -1.0, 2.0}, {1, 3, 1}, DType::F64);
  auto scalar = [](double v) {
    return Tensor::from_vector(std::vector<double>{v}, {1}, DType::F64);
  };
  const RnnResult r =
      rnn_tanh(ctx, x, Tensor::full({1, 1}, h0, DType::F64), Tensor::full({1, 1}, wi, DType::F64),
               Tensor::full({1, 1}, wh, DType::F64), scalar(bi), scalar(bh));
  double h = h0;
  for (int t = 0; t < 3; ++t) {
    h = std::tanh(x.at({0, t, 0}) * wi + bi + h * wh + bh);
    EXPECT_NEAR(r.output.at({0, t, 0}), h, 1e-15) << "t = " << t;
  }
  EXPECT_EQ(r.h_n.shape(), Shape({1, 1}));
  EXPECT_EQ(r.h_n.at({0, 0}), r.output.at({0, 2, 0}));
  EXPECT_EQ(r.flops, 2 * 3 * 1 * (1 + 1));
}

TEST(RnnModule, NamesInitAndFlops) {
  RNN rnn(3, 5, true, DType::F32, 2);
  const StateDict sd = rnn.state_dict();
  ASSERT_EQ(sd.size(), 4u);
  EXPECT_EQ(sd.at("weight_ih_l0").shape(), Shape({5, 3}));
  EXPECT_EQ(sd.at("weight_hh_l0").shape(), Shape({5, 5}));
  EXPECT_EQ(sd.at("bias_ih_l0").shape(), Shape({5}));
  EXPECT_EQ(sd.at("bias_hh_l0").shape(), Shape({5}));
  for (const auto& [name, t] : sd)
    for (double v : t.to_vector())
      EXPECT_LE(std::abs(v), 1.0 / std::sqrt(5.0)) << name;
  EXPECT_EQ(RNN(3, 5, false).state_dict().size(), 2u);
  Context ctx;
  rnn.forward(ctx, random_tensor({2, 7, 3}, DType::F32));
  EXPECT_EQ(rnn.flops(), 2 * 2 * 7 * 5 * (3 + 5));
  // A loaded state dict round-trips.
  RNN other(3, 5, true, DType::F32, 99);
  other.load_state_dict(sd);
  const Tensor x = random_tensor({1, 4, 3}, DType::F32, 3);
  EXPECT_TRUE(close(other.forward(ctx, x), rnn.forward(ctx, x), 0, 0));
}

TEST(RnnModule, GradcheckThroughTime) {
  Context ctx;
  for (bool with_h0 : {false, true}) {
    RNN rnn(3, 4, true, DType::F64, 21);
    Tensor x = random_tensor({2, 5, 3}, DType::F64, 7);
    Tensor h0 = with_h0 ? random_tensor({2, 4}, DType::F64, 8) : Tensor();
    const Tensor w = random_tensor({2, 5, 4}, DType::F64, 9);
    const Tensor wn = random_tensor({2, 4}, DType::F64, 10);
    // loss = <output, w> + <h_n, wn>: both of PyTorch's outputs carry gradient.
    auto loss = [&] {
      const Tensor out = rnn.forward(ctx, x, h0);
      return dot(out, w) + dot(rnn.h_n(), wn);
    };
    loss();
    rnn.zero_grad();
    const RNN::InputGrads g = rnn.backward(ctx, w, wn);
    EXPECT_TRUE(gradcheck(loss, x, g.dx)) << "h0 given: " << with_h0;
    if (with_h0) {
      EXPECT_TRUE(gradcheck(loss, h0, g.dh0));
    }
    gradcheck_parameters(rnn, loss);
  }
}

TEST(RnnModule, BadInput) {
  Context ctx;
  EXPECT_THROW(RNN(0, 4), Error);
  RNN rnn(3, 4);
  EXPECT_THROW(rnn.backward(ctx, Tensor::zeros({1, 2, 4})), Error);  // before forward
  EXPECT_THROW(rnn.forward(ctx, Tensor::zeros({1, 2, 5})), Error);   // wrong input size
  EXPECT_THROW(rnn.forward(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({2, 4})), Error);  // h0 B
  EXPECT_THROW(rnn.forward(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({1, 5})), Error);  // h0 H
  rnn.forward(ctx, Tensor::zeros({1, 2, 3}));
  EXPECT_THROW(rnn.backward(ctx, Tensor::zeros({1, 3, 4})), Error);  // dout length
  const Tensor W = Tensor::zeros({4, 3}), U = Tensor::zeros({4, 4}), b = Tensor::zeros({4});
  EXPECT_THROW(rnn_tanh(ctx, Tensor::zeros({1, 2, 3}), {}, W, U, b, {}), Error);  // one bias
  EXPECT_THROW(rnn_tanh(ctx, Tensor::zeros({1, 2, 3}), {}, W, Tensor::zeros({4, 3})), Error);
  try {
    rnn_tanh(ctx, Tensor::zeros({1, 2, 3}), {}, W, U, Tensor::zeros({5}), Tensor::zeros({5}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "rnn_tanh");
    EXPECT_NE(std::string(e.what()).find("(5)"), std::string::npos) << e.what();
  }
}

// ----------------------------------------------------------------------------------------------
// PyTorch parity: torch.nn.Conv1d / torch.nn.RNN on the same deterministic values (float64),
// outputs and every gradient of sum(out * w). Skipped where Debian's python3-torch is missing.

// t[i] = sin(a (i + 1)): the same values in C++ and in the Python script below.
Tensor sin_tensor(const Shape& shape, double a) {
  Tensor t = Tensor::empty(shape, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set_flat(i, std::sin(a * static_cast<double>(i + 1)));
  return t;
}

constexpr const char* kTorchScript = R"(
import math, torch
torch.set_default_dtype(torch.float64)
def t(shape, a):
    n = math.prod(shape)
    return torch.tensor([math.sin(a * (i + 1)) for i in range(n)]).reshape(shape)
def emit(*ts):
    for x in ts:
        print(' '.join(repr(v) for v in x.detach().flatten().tolist()))
x = t((2, 5, 3), 0.7).requires_grad_()
conv = torch.nn.Conv1d(3, 4, 3, padding=1)
conv.weight.data, conv.bias.data = t((4, 3, 3), 1.3), t((4,), 2.1)
y = conv(x.transpose(1, 2)).transpose(1, 2)
(y * t((2, 5, 4), 0.2)).sum().backward()
emit(y, x.grad, conv.weight.grad, conv.bias.grad)
x.grad = None
rnn = torch.nn.RNN(3, 4, batch_first=True)
rnn.load_state_dict({'weight_ih_l0': t((4, 3), 0.9), 'weight_hh_l0': t((4, 4), 0.4),
                     'bias_ih_l0': t((4,), 1.7), 'bias_hh_l0': t((4,), 0.3)})
h0 = t((1, 2, 4), 0.5).requires_grad_()
out, hn = rnn(x, h0)
((out * t((2, 5, 4), 0.2)).sum() + (hn * t((1, 2, 4), 0.6)).sum()).backward()
emit(out, x.grad, h0.grad, rnn.weight_ih_l0.grad, rnn.weight_hh_l0.grad, rnn.bias_ih_l0.grad,
     rnn.bias_hh_l0.grad)
)";

TEST(SequenceLayersTorch, MatchesPyTorch) {
  const std::string script = ::testing::TempDir() + "attn_sequence_torch.py";
  std::ofstream(script) << kTorchScript;
  const std::string command = "/usr/bin/python3 " + script + " 2>/dev/null";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string text;
  char buffer[4096];
  while (size_t got = fread(buffer, 1, sizeof buffer, pipe))
    text.append(buffer, got);
  if (pclose(pipe) != 0 || text.empty()) GTEST_SKIP() << "python3 with torch is not available";
  std::istringstream lines(text);
  auto next = [&](const Shape& shape) {
    std::string line;
    std::getline(lines, line);
    std::istringstream values(line);
    std::vector<double> v;
    for (double d; values >> d;)
      v.push_back(d);
    return Tensor::from_vector(v, shape, DType::F64);
  };
  Context ctx;
  const Tensor x = sin_tensor({2, 5, 3}, 0.7), w = sin_tensor({2, 5, 4}, 0.2);

  Conv1d conv(3, 4, 3, true, DType::F64);
  conv.weight.value.copy_from(sin_tensor({4, 3, 3}, 1.3));
  conv.bias.value.copy_from(sin_tensor({4}, 2.1));
  EXPECT_TRUE(close(conv.forward(ctx, x), next({2, 5, 4}), 1e-12, 1e-12));
  EXPECT_TRUE(close(conv.backward(ctx, w), next({2, 5, 3}), 1e-12, 1e-12));
  EXPECT_TRUE(close(conv.weight.grad, next({4, 3, 3}), 1e-12, 1e-12));
  EXPECT_TRUE(close(conv.bias.grad, next({4}), 1e-12, 1e-12));

  RNN rnn(3, 4, true, DType::F64);
  rnn.weight_ih_l0.value.copy_from(sin_tensor({4, 3}, 0.9));
  rnn.weight_hh_l0.value.copy_from(sin_tensor({4, 4}, 0.4));
  rnn.bias_ih_l0.value.copy_from(sin_tensor({4}, 1.7));
  rnn.bias_hh_l0.value.copy_from(sin_tensor({4}, 0.3));
  const Tensor h0 = sin_tensor({2, 4}, 0.5);
  EXPECT_TRUE(close(rnn.forward(ctx, x, h0), next({2, 5, 4}), 1e-12, 1e-12));
  const RNN::InputGrads g = rnn.backward(ctx, w, sin_tensor({2, 4}, 0.6));
  EXPECT_TRUE(close(g.dx, next({2, 5, 3}), 1e-12, 1e-12));
  EXPECT_TRUE(close(g.dh0, next({2, 4}), 1e-12, 1e-12));
  EXPECT_TRUE(close(rnn.weight_ih_l0.grad, next({4, 3}), 1e-12, 1e-12));
  EXPECT_TRUE(close(rnn.weight_hh_l0.grad, next({4, 4}), 1e-12, 1e-12));
  EXPECT_TRUE(close(rnn.bias_ih_l0.grad, next({4}), 1e-12, 1e-12));
  EXPECT_TRUE(close(rnn.bias_hh_l0.grad, next({4}), 1e-12, 1e-12));
}

}  // namespace
}  // namespace attn::nn
