// State dicts: round trips, PyTorch nn.MultiheadAttention names, atomic failure on missing,
// unexpected and misshaped tensors, non-strict loads, dtype conversion, lazy parameters.
#include "attn/nn/attention.hpp"
#include "attn/nn/positional.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <string>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::random_tensor;

// Every value of two state dicts, bit for bit.
void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_EQ(t.shape(), b.at(name).shape()) << name;
    EXPECT_EQ(t.to_vector(), b.at(name).to_vector()) << name;
  }
}

// Expects `load` to throw an Error whose message contains every string of `needles`.
template <typename F>
void expect_error(F load, std::initializer_list<const char*> needles) {
  try {
    load();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const char* n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' missing from: " << e.what();
  }
}

// A materialised MHA(E = 8, H = 2) with bias, queries/keys/values of width 8.
struct Fixture {
  Context ctx;
  Tensor q = random_tensor({2, 3, 8}, DType::F64, 1), kv = random_tensor({2, 5, 8}, DType::F64, 2);
  Tensor valid = Tensor::from_vector(std::vector<int64_t>{4, 2}, {2});
  Tensor run(MultiHeadAttention& m) { return m.forward(ctx, q, kv, kv, valid); }
};

TEST(StateDict, RoundTripIntoALazyModule) {
  Fixture f;
  MultiHeadAttention a(8, 2, 0.0, true, DType::F64, 1);
  Tensor out = f.run(a);
  StateDict sd = a.state_dict();
  const char* names[] = {"W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
                         "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias"};
  ASSERT_EQ(sd.size(), 8u);
  for (const char* n : names)
    EXPECT_TRUE(sd.count(n)) << n;
  EXPECT_EQ(sd.at("W_q.weight").shape(), (Shape{8, 8}));
  // The dict holds copies: changing the module later does not change it.
  StateDict copy = a.state_dict();

  MultiHeadAttention b(8, 2, 0.0, true, DType::F64, 2);  // different init, still lazy
  EXPECT_EQ(b.num_parameters(), 0);
  b.load_state_dict(sd);
  EXPECT_EQ(b.W_q.in_features(), 8);
  EXPECT_EQ(b.num_parameters(), a.num_parameters());
  EXPECT_TRUE(close(f.run(b), out, 0, 0));
  expect_same(b.state_dict(), copy);
  a.W_q.weight.value.set({0, 0}, 5.0);
  expect_same(sd, copy);
}

// torch.nn.MultiheadAttention's names: in_proj_weight stacks [W_q; W_k; W_v] by rows.
StateDict to_torch_names(const StateDict& d2l, int64_t E, bool separate) {
  StateDict t;
  if (separate) {
    t["q_proj_weight"] = d2l.at("W_q.weight");
    t["k_proj_weight"] = d2l.at("W_k.weight");
    t["v_proj_weight"] = d2l.at("W_v.weight");
  } else {
    Tensor w = Tensor::empty({3 * E, d2l.at("W_q.weight").dim(1)}, d2l.at("W_q.weight").dtype());
    w.slice(0, 0, E).copy_from(d2l.at("W_q.weight"));
    w.slice(0, E, 2 * E).copy_from(d2l.at("W_k.weight"));
    w.slice(0, 2 * E, 3 * E).copy_from(d2l.at("W_v.weight"));
    t["in_proj_weight"] = w;
  }
  if (d2l.count("W_q.bias")) {
    Tensor b = Tensor::empty({3 * E}, d2l.at("W_q.bias").dtype());
    b.slice(0, 0, E).copy_from(d2l.at("W_q.bias"));
    b.slice(0, E, 2 * E).copy_from(d2l.at("W_k.bias"));
    b.slice(0, 2 * E, 3 * E).copy_from(d2l.at("W_v.bias"));
    t["in_proj_bias"] = b;
    t["out_proj.bias"] = d2l.at("W_o.bias");
  }
  t["out_proj.weight"] = d2l.at("W_o.weight");
  return t;
}

TEST(StateDict, PyTorchPackedNamesGiveTheSameOutput) {
  for (bool bias : {true, false}) {
    Fixture f;
    MultiHeadAttention a(8, 2, 0.0, bias, DType::F64, 1);
    Tensor out = f.run(a);
    StateDict torch = to_torch_names(a.state_dict(), 8, false);
    EXPECT_EQ(torch.size(), bias ? 4u : 2u);
    MultiHeadAttention b(8, 2, 0.0, bias, DType::F64, 3);
    b.load_state_dict(torch);
    EXPECT_TRUE(close(f.run(b), out, 0, 0));
    // state_dict() always speaks d2l.
    expect_same(b.state_dict(), a.state_dict());
  }
}

// kdim/vdim != E: torch stores q_proj_weight (E, E), k_proj_weight (E, kdim), v_proj_weight
// (E, vdim) and still one in_proj_bias (3E).
TEST(StateDict, PyTorchSeparateProjectionNames) {
  Context ctx;
  Tensor q = random_tensor({2, 3, 8}, DType::F64, 1), k = random_tensor({2, 4, 6}, DType::F64, 2),
         v = random_tensor({2, 4, 5}, DType::F64, 3);
  MultiHeadAttention a(8, 4, 0.0, true, DType::F64, 1);
  Tensor out = a.forward(ctx, q, k, v);
  StateDict torch = to_torch_names(a.state_dict(), 8, true);
  EXPECT_EQ(torch.at("k_proj_weight").shape(), (Shape{8, 6}));
  MultiHeadAttention b(8, 4, 0.0, true, DType::F64, 2);
  b.load_state_dict(torch);
  EXPECT_TRUE(close(b.forward(ctx, q, k, v), out, 0, 0));
}

TEST(StateDict, FailedLoadsChangeNothing) {
  Fixture f;
  MultiHeadAttention m(8, 2, 0.0, true, DType::F64, 1);
  Tensor out = f.run(m);
  const StateDict before = m.state_dict();
  MultiHeadAttention src(8, 2, 0.0, true, DType::F64, 9);
  f.run(src);
  const StateDict good = src.state_dict();  // differs from m's values everywhere

  // Missing: every other entry is valid and would have been loaded first.
  StateDict missing = good;
  missing.erase("W_v.bias");
  expect_error([&] { m.load_state_dict(missing); }, {"MultiHeadAttention", "missing", "W_v.bias"});
  expect_same(m.state_dict(), before);

  // Unexpected.
  StateDict extra = good;
  extra["W_x.weight"] = Tensor::zeros({8, 8}, DType::F64);
  expect_error([&] { m.load_state_dict(extra); },
               {"MultiHeadAttention", "unexpected", "W_x.weight"});
  expect_same(m.state_dict(), before);

  // Misshaped, late in name order so earlier names passed validation.
  StateDict bad = good;
  bad["W_v.weight"] = Tensor::zeros({8, 7}, DType::F64);
  expect_error([&] { m.load_state_dict(bad); },
               {"MultiHeadAttention", "W_v.weight", "(8, 7)", "(8, 8)"});
  expect_same(m.state_dict(), before);
  EXPECT_TRUE(close(f.run(m), out, 0, 0));

  // A wrong row count of a packed torch tensor is reported under its own name.
  StateDict torch = to_torch_names(good, 8, false);
  torch["in_proj_weight"] = Tensor::zeros({16, 8}, DType::F64);
  expect_error([&] { m.load_state_dict(torch); }, {"in_proj_weight", "(16, 8)", "24"});
  torch = to_torch_names(good, 8, false);
  torch["in_proj_bias"] = Tensor::zeros({24, 1}, DType::F64);
  expect_error([&] { m.load_state_dict(torch); }, {"in_proj_bias", "(24, 1)"});
  // Both spellings of one parameter are ambiguous.
  torch = to_torch_names(good, 8, false);
  torch["W_q.weight"] = good.at("W_q.weight");
  expect_error([&] { m.load_state_dict(torch); }, {"W_q.weight", "in_proj_weight"});
  // torch's extra parameters have no d2l counterpart.
  torch = to_torch_names(good, 8, false);
  torch["bias_k"] = Tensor::zeros({1, 1, 8}, DType::F64);
  expect_error([&] { m.load_state_dict(torch); }, {"unexpected", "bias_k", "in_proj_weight"});
  // Integer tensors are not weights.
  StateDict ints = good;
  ints["W_o.bias"] = Tensor::zeros({8}, DType::I64);
  expect_error([&] { m.load_state_dict(ints); }, {"W_o.bias", "I64"});
  expect_same(m.state_dict(), before);
}

TEST(StateDict, LazyModuleStaysLazyAfterAFailedLoad) {
  MultiHeadAttention m(8, 2, 0.0, false, DType::F64, 1);
  Fixture f;
  MultiHeadAttention src(8, 2, 0.0, false, DType::F64, 2);
  f.run(src);
  StateDict bad = src.state_dict();
  bad["W_o.weight"] = Tensor::zeros({7, 8}, DType::F64);  // out must be E = 8
  expect_error([&] { m.load_state_dict(bad); }, {"W_o.weight", "(7, 8)", "(8, any)"});
  EXPECT_EQ(m.num_parameters(), 0);
  EXPECT_FALSE(m.W_q.weight.value.defined());
}

TEST(StateDict, NonStrictIgnoresExtrasAndKeepsMissing) {
  Fixture f;
  MultiHeadAttention m(8, 2, 0.0, true, DType::F64, 1);
  f.run(m);
  const StateDict before = m.state_dict();
  MultiHeadAttention src(8, 2, 0.0, true, DType::F64, 9);
  f.run(src);
  StateDict partial = src.state_dict();
  partial.erase("W_o.weight");
  partial["unused.weight"] = Tensor::zeros({3}, DType::F64);
  m.load_state_dict(partial, /*strict=*/false);
  StateDict now = m.state_dict();
  EXPECT_EQ(now.at("W_o.weight").to_vector(), before.at("W_o.weight").to_vector());
  EXPECT_EQ(now.at("W_q.weight").to_vector(), src.state_dict().at("W_q.weight").to_vector());
  // Shapes are checked in non-strict mode too.
  partial["W_k.weight"] = Tensor::zeros({8, 3}, DType::F64);
  EXPECT_THROW(m.load_state_dict(partial, false), Error);
  // PyTorch names, non-strict: the extra bias_k is ignored.
  StateDict torch = to_torch_names(src.state_dict(), 8, false);
  torch["bias_k"] = Tensor::zeros({1, 1, 8}, DType::F64);
  m.load_state_dict(torch, false);
  expect_same(m.state_dict(), src.state_dict());
}

TEST(StateDict, ConvertsToTheModuleDtype) {
  Fixture f;
  MultiHeadAttention a(8, 2, 0.0, true, DType::F64, 1);
  Tensor out = f.run(a);
  StateDict f32;
  for (const auto& [n, t] : a.state_dict())
    f32[n] = t.to(DType::F32);
  MultiHeadAttention b(8, 2, 0.0, true, DType::F64, 5);
  b.load_state_dict(f32);
  EXPECT_EQ(b.W_q.weight.value.dtype(), DType::F64);
  EXPECT_EQ(b.W_q.weight.grad.dtype(), DType::F64);
  EXPECT_TRUE(close(f.run(b), out, 1e-6, 1e-6));
  // And the other way: a float32 module from float64 weights.
  MultiHeadAttention c(8, 2, 0.0, true, DType::F32, 5);
  c.load_state_dict(a.state_dict());
  EXPECT_EQ(c.W_o.bias.value.dtype(), DType::F32);
}

TEST(StateDict, OtherModules) {
  Context ctx;
  // AdditiveAttention: d2l's names, lazy W_q/W_k, (1, h) w_v.
  AdditiveAttention a(6, 0.0, DType::F64, 1);
  Tensor q = random_tensor({2, 1, 5}, DType::F64, 1), k = random_tensor({2, 4, 3}, DType::F64, 2),
         v = random_tensor({2, 4, 2}, DType::F64, 3);
  Tensor valid = Tensor::from_vector(std::vector<int64_t>{2, 3}, {2});
  Tensor out = a.forward(ctx, q, k, v, valid);
  StateDict sd = a.state_dict();
  EXPECT_EQ(sd.size(), 3u);
  EXPECT_EQ(sd.at("W_q.weight").shape(), (Shape{6, 5}));
  EXPECT_EQ(sd.at("W_k.weight").shape(), (Shape{6, 3}));
  EXPECT_EQ(sd.at("w_v.weight").shape(), (Shape{1, 6}));
  AdditiveAttention b(6, 0.0, DType::F64, 2);
  b.load_state_dict(sd);
  EXPECT_TRUE(close(b.forward(ctx, q, k, v, valid), out, 0, 0));
  sd["w_v.weight"] = Tensor::zeros({6}, DType::F64);
  expect_error([&] { b.load_state_dict(sd); },
               {"AdditiveAttention", "w_v.weight", "(6)", "(1, 6)"});

  // Linear on its own: names "weight" and "bias".
  Linear lin(3, 4, true, DType::F32, 7);
  StateDict ls = lin.state_dict();
  EXPECT_EQ(ls.size(), 2u);
  Linear lin2(3, 0, true, DType::F32, 8);
  lin2.load_state_dict(ls);
  EXPECT_EQ(lin2.in_features(), 4);
  expect_same(lin2.state_dict(), ls);
  expect_error(
      [&] {
        lin2.load_state_dict({{"weight", ls.at("weight")}});
      },
      {"Linear", "missing", "bias"});

  // LearnedPositionalEmbedding: "weight" (max_len, E).
  LearnedPositionalEmbedding e1(5, 4, 0.0, DType::F64, 1), e2(5, 4, 0.0, DType::F64, 2);
  e2.load_state_dict(e1.state_dict());
  expect_same(e2.state_dict(), e1.state_dict());
  expect_error(
      [&] {
        e2.load_state_dict({{"weight", Tensor::zeros({6, 4}, DType::F64)}});
      },
      {"LearnedPositionalEmbedding", "(6, 4)", "(5, 4)"});

  // Parameterless modules: empty dicts, and strict loads reject any name.
  PositionalEncoding pe(4, 0.1);
  EXPECT_TRUE(pe.state_dict().empty());
  pe.load_state_dict({});
  EXPECT_THROW(pe.load_state_dict({{"P", Tensor::zeros({4, 4})}}), Error);
}

TEST(StateDict, ZeroGradAndParameterCounts) {
  Fixture f;
  MultiHeadAttention m(8, 2, 0.0, true, DType::F64, 1);
  Tensor out = f.run(m);
  EXPECT_EQ(m.num_parameters(), 4 * (8 * 8 + 8));
  m.backward(f.ctx, random_tensor(out.shape(), DType::F64, 3));
  bool nonzero = false;
  for (auto& [n, p] : m.named_parameters())
    for (double g : p->grad.to_vector())
      nonzero |= g != 0.0;
  EXPECT_TRUE(nonzero);
  m.zero_grad();
  for (auto& [n, p] : m.named_parameters())
    for (double g : p->grad.to_vector())
      EXPECT_EQ(g, 0.0) << n;
  // A loaded lazy parameter gets a zero gradient of its shape.
  MultiHeadAttention lazy(8, 2, 0.0, true, DType::F64, 2);
  lazy.load_state_dict(m.state_dict());
  for (auto& [n, p] : lazy.named_parameters())
    EXPECT_EQ(p->grad.shape(), p->value.shape()) << n;
}

}  // namespace
}  // namespace attn::nn
