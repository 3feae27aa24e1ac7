// Conv1d and RNN (the CNN and RNN of the chapter's comparison) and GRU: hand-computed forwards,
// FLOP counters, PyTorch's names and init bounds, finite-difference gradchecks in float64 of every
// input and parameter, the validation errors, and PyTorch parity (Conv1d and RNN through a
// python3-torch subprocess, GRU through a fixture of tests/fixtures/generate.py).
#include "attn/core/safetensors.hpp"
#include "attn/nn/sequence.hpp"
#include "attn/ops/conv1d.hpp"
#include "attn/ops/rnn.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

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
// GRU

double sigmoid(double a) {
  return 1.0 / (1.0 + std::exp(-a));
}

TEST(GruOp, ScalarRecurrenceByHand) {
  Context ctx;
  // H = I = 1: the rows of W_ih, W_hh, b_ih, b_hh are the gates r, z, n in that order.
  const std::vector<double> wi{0.7, -0.4, 1.1}, wh{-1.3, 0.6, 0.9}, bi{0.1, 0.2, -0.3},
      bh{-0.2, 0.5, 0.4};
  const double h0 = 0.4;
  const Tensor x = Tensor::from_vector(std::vector<double>{0.5, -1.0, 2.0}, {1, 3, 1}, DType::F64);
  const GruResult r =
      gru(ctx, x, Tensor::full({1, 1}, h0, DType::F64), Tensor::from_vector(wi, {3, 1}, DType::F64),
          Tensor::from_vector(wh, {3, 1}, DType::F64), Tensor::from_vector(bi, {3}, DType::F64),
          Tensor::from_vector(bh, {3}, DType::F64));
  double h = h0;
  for (int t = 0; t < 3; ++t) {
    const double xt = x.at({0, t, 0});
    const double rg = sigmoid(wi[0] * xt + bi[0] + wh[0] * h + bh[0]);
    const double zg = sigmoid(wi[1] * xt + bi[1] + wh[1] * h + bh[1]);
    const double ng = std::tanh(wi[2] * xt + bi[2] + rg * (wh[2] * h + bh[2]));
    h = (1 - zg) * ng + zg * h;
    EXPECT_NEAR(r.output.at({0, t, 0}), h, 1e-15) << "t = " << t;
  }
  EXPECT_EQ(r.h_n.shape(), Shape({1, 1}));
  EXPECT_EQ(r.h_n.at({0, 0}), r.output.at({0, 2, 0}));
  EXPECT_EQ(r.flops, 2 * 3 * 3 * 1 * (1 + 1));
}

// The equations written out with the gate blocks sliced by hand (r rows [0, H), z [H, 2H),
// n [2H, 3H)), against the op, without and with bias and h0; float32 against float64.
TEST(GruOp, MatchesEquationsInPyTorchGateOrder) {
  Context ctx;
  const int64_t B = 2, n = 4, I = 3, H = 5;
  const Tensor x = random_tensor({B, n, I}, DType::F64, 31);
  const Tensor W_ih = random_tensor({3 * H, I}, DType::F64, 32);
  const Tensor W_hh = random_tensor({3 * H, H}, DType::F64, 33);
  const Tensor b_ih = random_tensor({3 * H}, DType::F64, 34);
  const Tensor b_hh = random_tensor({3 * H}, DType::F64, 35);
  const Tensor h0 = random_tensor({B, H}, DType::F64, 36);
  for (bool with_bias : {false, true})
    for (bool with_h0 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "bias " << with_bias << ", h0 " << with_h0);
      const Tensor bi = with_bias ? b_ih : Tensor(), bh = with_bias ? b_hh : Tensor();
      const Tensor hinit = with_h0 ? h0 : Tensor();
      const GruResult r = gru(ctx, x, hinit, W_ih, W_hh, bi, bh);
      for (int64_t b = 0; b < B; ++b) {
        std::vector<double> h(H, 0.0);
        if (with_h0)
          for (int64_t j = 0; j < H; ++j)
            h[j] = h0.at({b, j});
        for (int64_t t = 0; t < n; ++t) {
          // a(gate, j) = row gate*H + j of x_t W_ih^T + b_ih, and of h W_hh^T + b_hh.
          auto in = [&](int64_t gate, int64_t j) {
            double s = with_bias ? b_ih.at({gate * H + j}) : 0.0;
            for (int64_t i = 0; i < I; ++i)
              s += W_ih.at({gate * H + j, i}) * x.at({b, t, i});
            return s;
          };
          auto hid = [&](int64_t gate, int64_t j) {
            double s = with_bias ? b_hh.at({gate * H + j}) : 0.0;
            for (int64_t i = 0; i < H; ++i)
              s += W_hh.at({gate * H + j, i}) * h[i];
            return s;
          };
          std::vector<double> next(H);
          for (int64_t j = 0; j < H; ++j) {
            const double rg = sigmoid(in(0, j) + hid(0, j));
            const double zg = sigmoid(in(1, j) + hid(1, j));
            const double ng = std::tanh(in(2, j) + rg * hid(2, j));
            next[j] = (1 - zg) * ng + zg * h[j];
          }
          h = next;
          for (int64_t j = 0; j < H; ++j)
            EXPECT_NEAR(r.output.at({b, t, j}), h[j], 1e-14) << b << " " << t << " " << j;
        }
        for (int64_t j = 0; j < H; ++j)
          EXPECT_EQ(r.h_n.at({b, j}), r.output.at({b, n - 1, j}));
      }
      auto f32 = [](const Tensor& t) { return t.defined() ? t.to(DType::F32) : Tensor(); };
      const GruResult r32 = gru(ctx, f32(x), f32(hinit), f32(W_ih), f32(W_hh), f32(bi), f32(bh));
      EXPECT_EQ(r32.output.dtype(), DType::F32);
      EXPECT_TRUE(close(r32.output, r.output.to(DType::F32), 1e-5, 1e-6));
    }
}

TEST(GruOp, EmptySequence) {
  // n = 0: no output rows, h_n is h0 (zeros without it) and dh0 = dh_n, as PyTorch.
  Context ctx;
  const int64_t B = 2, I = 3, H = 4;
  const Tensor x = Tensor::zeros({B, 0, I}, DType::F64);
  const Tensor W_ih = random_tensor({3 * H, I}, DType::F64, 1);
  const Tensor W_hh = random_tensor({3 * H, H}, DType::F64, 2);
  const Tensor h0 = random_tensor({B, H}, DType::F64, 3);
  const GruResult r = gru(ctx, x, h0, W_ih, W_hh);
  EXPECT_EQ(r.output.shape(), Shape({B, 0, H}));
  EXPECT_TRUE(close(r.h_n, h0, 0, 0));
  EXPECT_TRUE(close(gru(ctx, x, {}, W_ih, W_hh).h_n, Tensor::zeros({B, H}, DType::F64), 0, 0));
  const Tensor dh_n = random_tensor({B, H}, DType::F64, 4);
  const GruGrads g = gru_backward(ctx, Tensor::zeros({B, 0, H}, DType::F64), dh_n, x, h0, W_ih,
                                  W_hh, {}, {}, r.output);
  EXPECT_TRUE(close(g.dh0, dh_n, 0, 0));
  EXPECT_TRUE(close(g.dW_hh, Tensor::zeros({3 * H, H}, DType::F64), 0, 0));
}

TEST(GruModule, NamesInitAndFlops) {
  GRU gru_layer(3, 5, true, DType::F32, 2);
  const StateDict sd = gru_layer.state_dict();
  ASSERT_EQ(sd.size(), 4u);
  EXPECT_EQ(sd.at("weight_ih_l0").shape(), Shape({15, 3}));
  EXPECT_EQ(sd.at("weight_hh_l0").shape(), Shape({15, 5}));
  EXPECT_EQ(sd.at("bias_ih_l0").shape(), Shape({15}));
  EXPECT_EQ(sd.at("bias_hh_l0").shape(), Shape({15}));
  for (const auto& [name, t] : sd) {
    double largest = 0;
    for (double v : t.to_vector()) {
      EXPECT_LE(std::abs(v), 1.0 / std::sqrt(5.0)) << name;
      largest = std::max(largest, std::abs(v));
    }
    EXPECT_GT(largest, 0.25) << name;  // the whole range is used, not a narrower one
  }
  EXPECT_EQ(gru_layer.input_size(), 3);
  EXPECT_EQ(gru_layer.hidden_size(), 5);
  EXPECT_EQ(GRU(3, 5, false).state_dict().size(), 2u);
  Context ctx;
  gru_layer.forward(ctx, random_tensor({2, 7, 3}, DType::F32));
  EXPECT_EQ(gru_layer.flops(), 2 * 2 * 7 * 3 * 5 * (3 + 5));
  gru_layer.reset_flops();
  EXPECT_EQ(gru_layer.flops(), 0);
  // A loaded state dict round-trips.
  GRU other(3, 5, true, DType::F32, 99);
  other.load_state_dict(sd);
  const Tensor x = random_tensor({1, 4, 3}, DType::F32, 3);
  EXPECT_TRUE(close(other.forward(ctx, x), gru_layer.forward(ctx, x), 0, 0));
  // An RNN's state dict has the same names but a third of the rows.
  EXPECT_THROW(other.load_state_dict(RNN(3, 5).state_dict()), Error);
}

TEST(GruModule, GradcheckThroughTime) {
  Context ctx;
  for (bool with_bias : {true, false})
    for (bool with_h0 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "bias " << with_bias << ", h0 " << with_h0);
      GRU gru_layer(3, 4, with_bias, DType::F64, 21);
      Tensor x = random_tensor({2, 5, 3}, DType::F64, 7);
      Tensor h0 = with_h0 ? random_tensor({2, 4}, DType::F64, 8) : Tensor();
      const Tensor w = random_tensor({2, 5, 4}, DType::F64, 9);
      const Tensor wn = random_tensor({2, 4}, DType::F64, 10);
      // loss = <output, w> + <h_n, wn>: both of PyTorch's outputs carry gradient.
      auto loss = [&] {
        const Tensor out = gru_layer.forward(ctx, x, h0);
        return dot(out, w) + dot(gru_layer.h_n(), wn);
      };
      loss();
      gru_layer.zero_grad();
      const GRU::InputGrads g = gru_layer.backward(ctx, w, wn);
      EXPECT_TRUE(gradcheck(loss, x, g.dx));
      if (with_h0) {
        EXPECT_TRUE(gradcheck(loss, h0, g.dh0));
      }
      gradcheck_parameters(gru_layer, loss);
    }
  // Without dh_n (only the outputs carry gradient) and with a single step.
  GRU gru_layer(2, 3, true, DType::F64, 5);
  Tensor x = random_tensor({3, 1, 2}, DType::F64, 11);
  Tensor h0 = random_tensor({3, 3}, DType::F64, 12);
  const Tensor w = random_tensor({3, 1, 3}, DType::F64, 13);
  auto loss = [&] { return dot(gru_layer.forward(ctx, x, h0), w); };
  loss();
  gru_layer.zero_grad();
  const GRU::InputGrads g = gru_layer.backward(ctx, w);
  EXPECT_TRUE(gradcheck(loss, x, g.dx));
  EXPECT_TRUE(gradcheck(loss, h0, g.dh0));
  gradcheck_parameters(gru_layer, loss);
}

TEST(GruModule, BadInput) {
  Context ctx;
  EXPECT_THROW(GRU(0, 4), Error);
  EXPECT_THROW(GRU(3, 0), Error);
  EXPECT_THROW(GRU(3, 4, true, DType::I64), Error);
  GRU gru_layer(3, 4);
  EXPECT_THROW(gru_layer.backward(ctx, Tensor::zeros({1, 2, 4})), Error);  // before forward
  EXPECT_THROW(gru_layer.forward(ctx, Tensor::zeros({1, 2, 5})), Error);   // wrong input size
  EXPECT_THROW(gru_layer.forward(ctx, Tensor::zeros({1, 2, 3}, DType::F64)), Error);  // dtype
  EXPECT_THROW(gru_layer.forward(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({2, 4})),
               Error);  // h0 B
  EXPECT_THROW(gru_layer.forward(ctx, Tensor::zeros({1, 2, 3}), Tensor::zeros({1, 5})),
               Error);  // h0 H
  gru_layer.forward(ctx, Tensor::zeros({1, 2, 3}));
  EXPECT_THROW(gru_layer.backward(ctx, Tensor::zeros({1, 3, 4})), Error);  // dout length
  EXPECT_THROW(gru_layer.backward(ctx, Tensor::zeros({1, 2, 4}), Tensor::zeros({1, 3})),
               Error);  // dh_n width

  const Tensor x = Tensor::zeros({1, 2, 3}), W = Tensor::zeros({12, 3}), U = Tensor::zeros({12, 4}),
               b = Tensor::zeros({12});
  EXPECT_THROW(gru(ctx, x, {}, W, U, b, {}), Error);                                   // one bias
  EXPECT_THROW(gru(ctx, x, {}, Tensor::zeros({4, 3}), Tensor::zeros({4, 4})), Error);  // 1 gate
  EXPECT_THROW(gru(ctx, x, {}, W, Tensor::zeros({12, 12})), Error);          // W_hh (3H, 3H)
  EXPECT_THROW(gru(ctx, x, {}, W.to(DType::F64), U.to(DType::F64)), Error);  // dtype
  EXPECT_THROW(gru(ctx, Tensor::zeros({2, 3}), {}, W, U), Error);            // x not 3-D
  auto expect_error = [](const std::function<void()>& f, const char* op, const char* text) {
    try {
      f();
      ADD_FAILURE() << "expected an error from " << op;
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), op) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  // The RNN's biases are (H); the GRU's (3H).
  expect_error([&] { gru(ctx, x, {}, W, U, Tensor::zeros({4}), Tensor::zeros({4})); }, "gru",
               "(3H) = (12)");
  expect_error([&] { gru(ctx, x, {}, Tensor::zeros({10, 3}), U); }, "gru", "3 gates");
  const Tensor out = gru(ctx, x, {}, W, U, b, b).output;
  expect_error(
      [&] {
        gru_backward(ctx, Tensor::zeros({1, 2, 5}), {}, x, {}, W, U, b, b, out);
      },
      "gru_backward", "dout");
  expect_error(
      [&] {
        gru_backward(ctx, Tensor::zeros({1, 2, 4}), {}, x, {}, W, U, b, {}, out);
      },
      "gru_backward", "both biases");
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

// torch.nn.GRU parity through tests/fixtures/gru.safetensors, written by generate.py's gru family:
// torch's float32 run and its float64 run of the same float32 inputs ("exact.<x>", stored rounded
// to float32), loss sum(output * G) + sum(h_n * G_h_n). attn runs every case in float32 against
// torch's float32 (rtol 1e-5 / atol 1e-6, DESIGN.md's float32 tolerance; an element also passes
// within that tolerance of torch's float64 result, printed as a note, as in test_nn_parity.cpp) and
// in float64 against torch's float64 (rtol 1e-6 / atol 1e-8). The parameters go in through
// load_state_dict under PyTorch's names.
constexpr const char* kRegenerate =
    "regenerate with: python3 tests/fixtures/generate.py --out tests/fixtures";

::testing::AssertionResult matches_fixture(const SafetensorsFile& f, const std::string& c,
                                           const std::string& key, const Tensor& actual,
                                           DType dtype) {
  auto find = [&](const std::string& name) {
    auto it = f.tensors.find(c + "." + name);
    return it == f.tensors.end() ? Tensor() : it->second;
  };
  const std::string expected_key = dtype == DType::F64 ? "exact." + key : key;
  const Tensor expected = find(expected_key);
  const Tensor exact = dtype == DType::F32 ? find("exact." + key) : Tensor();
  const double rtol = dtype == DType::F64 ? 1e-6 : 1e-5, atol = dtype == DType::F64 ? 1e-8 : 1e-6;
  auto failure = [&] {
    return ::testing::AssertionFailure()
           << "gru/" << c << " (" << dtype_name(dtype) << "), tensor '" << expected_key << "': ";
  };
  if (!expected.defined()) return failure() << "not in the fixture\n" << kRegenerate;
  if (!actual.defined()) return failure() << "attn returned no tensor";
  if (actual.shape() != expected.shape() || (exact.defined() && exact.shape() != actual.shape()))
    return failure() << "attn shape " << shape_str(actual.shape()) << ", torch shape "
                     << shape_str(expected.shape());
  auto near = [&](double a, double b) { return std::abs(a - b) <= atol + rtol * std::abs(b); };
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = actual.flat(i), t = expected.flat(i);
    if (near(a, t)) continue;
    if (exact.defined() && near(a, exact.flat(i))) {
      std::printf(
          "note: gru/%s (F32), tensor '%s'[%lld]: attn %.9g is off torch's float32 %.9g "
          "but on its float64 %.9g\n",
          c.c_str(), key.c_str(), static_cast<long long>(i), a, t, exact.flat(i));
      continue;
    }
    if (bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure() << bad << " of " << actual.numel() << " elements differ (rtol " << rtol
                   << ", atol " << atol << "); first at index " << first << ": attn "
                   << actual.flat(first) << ", torch " << expected.flat(first) << "\n"
                   << kRegenerate;
}

TEST(GruTorch, MatchesFixture) {
  const std::string path = std::string(ATTN_FIXTURE_DIR) + "/gru.safetensors";
  SafetensorsFile f;
  try {
    f = load_safetensors(path);
  } catch (const std::exception& e) {
    FAIL() << "cannot load fixture " << path << ": " << e.what() << "\n" << kRegenerate;
  }
  std::set<std::string> cases;
  for (const auto& [key, t] : f.tensors)
    cases.insert(key.substr(0, key.find('.')));
  ASSERT_GE(cases.size(), 5u) << "too few cases in " << path << "\n" << kRegenerate;
  bool saw_no_h0 = false, saw_no_bias = false;
  for (const std::string& c : cases) {
    SCOPED_TRACE("gru/" + c + " (" + f.metadata["case." + c] + ")");
    auto at = [&](const std::string& key) {
      auto it = f.tensors.find(c + "." + key);
      if (it == f.tensors.end())
        throw Error("GruTorch", "fixture case " + c + " has no '" + key + "'\n" + kRegenerate);
      return it->second;
    };
    StateDict params;
    const std::string prefix = c + ".param.";
    for (const auto& [key, t] : f.tensors)
      if (key.rfind(prefix, 0) == 0) params.emplace(key.substr(prefix.size()), t);
    const bool bias = params.count("bias_ih_l0") != 0;
    const bool with_h0 = f.tensors.count(c + ".h0") != 0;
    saw_no_h0 |= !with_h0;
    saw_no_bias |= !bias;
    const Tensor x = at("x");
    const int64_t H = at("param.weight_hh_l0").dim(1);
    for (DType dtype : {DType::F32, DType::F64}) {
      Context ctx;
      GRU layer(x.dim(2), H, bias, dtype, 7);
      layer.load_state_dict(params);  // strict: every name PyTorch has, no other
      const Tensor h0 = with_h0 ? at("h0").to(dtype) : Tensor();
      const Tensor out = layer.forward(ctx, x.to(dtype), h0);
      EXPECT_TRUE(matches_fixture(f, c, "output", out, dtype));
      EXPECT_TRUE(matches_fixture(f, c, "h_n", layer.h_n(), dtype));
      layer.zero_grad();
      const GRU::InputGrads g = layer.backward(ctx, at("G").to(dtype), at("G_h_n").to(dtype));
      EXPECT_TRUE(matches_fixture(f, c, "grad.x", g.dx, dtype));
      if (with_h0) {
        EXPECT_TRUE(matches_fixture(f, c, "grad.h0", g.dh0, dtype));
      }
      for (auto& [name, p] : layer.named_parameters())
        EXPECT_TRUE(matches_fixture(f, c, "grad." + name, p->grad, dtype));
    }
  }
  EXPECT_TRUE(saw_no_h0 && saw_no_bias) << "the fixture lost its no-h0 or no-bias case";
}

}  // namespace
}  // namespace attn::nn
