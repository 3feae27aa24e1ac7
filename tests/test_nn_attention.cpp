// nn attention modules: Linear, DotProductAttention, AdditiveAttention, MultiHeadAttention.
// Forward against hand-built compositions of the ops and d2l's own formulation, backward against
// central finite differences in float64 (inputs and every parameter), train/eval behaviour.
#include "attn/nn/attention.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

namespace attn::nn {
namespace {

using attn::testing::close;
using attn::testing::dot;
using attn::testing::gradcheck;
using attn::testing::random_tensor;

Tensor lens1(std::vector<int64_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n});
}

// Checks d(sum(out * R))/d(input) and /d(parameter) for every input and parameter of a module.
// `run` does one forward from fixed inputs (and must reset the dropout offset if it drops);
// `backward` returns the input gradients of the last forward for dout = R, in `inputs` order.
void check_module_grads(Module& m, const std::function<Tensor()>& run,
                        const std::function<std::vector<Tensor>(const Tensor&)>& backward,
                        const std::vector<Tensor>& inputs, const char* what) {
  Tensor out = run();
  Tensor R = random_tensor(out.shape(), DType::F64, 4242);
  m.zero_grad();
  std::vector<Tensor> grads = backward(R);
  ASSERT_EQ(grads.size(), inputs.size());
  auto loss = [&] { return dot(run(), R); };
  for (size_t i = 0; i < inputs.size(); ++i)
    EXPECT_TRUE(gradcheck(loss, inputs[i], grads[i])) << what << ": input " << i;
  auto params = m.named_parameters();
  for (auto& [name, p] : params) {
    // Copy the analytic gradient: gradcheck's forwards must not see it change.
    Tensor analytic = p->grad.clone();
    EXPECT_TRUE(gradcheck(loss, p->value, analytic)) << what << ": parameter " << name;
  }
}

// ----------------------------------------------------------------------------------------------
// Linear

TEST(Linear, PyTorchInitBoundsAndStreams) {
  Linear a(16, 9, true, DType::F64, 3), b(16, 9, true, DType::F64, 3),
      c(16, 9, true, DType::F64, 4);
  const double bound = 1.0 / 3.0;  // 1/sqrt(in)
  double lo = 1, hi = -1;
  for (double w : a.weight.value.to_vector())
    lo = std::min(lo, w), hi = std::max(hi, w);
  for (double w : a.bias.value.to_vector())
    lo = std::min(lo, w), hi = std::max(hi, w);
  EXPECT_GE(lo, -bound);
  EXPECT_LT(hi, bound);
  EXPECT_LT(lo, -0.8 * bound);  // 160 draws fill the interval
  EXPECT_GT(hi, 0.8 * bound);
  EXPECT_EQ(max_abs_diff(a.weight.value, b.weight.value), 0.0);  // same seed, same values
  EXPECT_GT(max_abs_diff(a.weight.value, c.weight.value), 0.0);
  // weight and bias draw from different streams: the bias is not the start of the weight.
  EXPECT_GT(max_abs_diff(a.bias.value.slice(0, 0, 9), a.weight.value.select(0, 0)), 0.0);
  EXPECT_EQ(a.num_parameters(), 16 * 9 + 16);
}

TEST(Linear, LazyMaterialisesAtFirstForward) {
  Context ctx;
  Linear lin(4, 0, true, DType::F64, 1);
  EXPECT_EQ(lin.in_features(), 0);
  EXPECT_FALSE(lin.weight.value.defined());
  EXPECT_EQ(lin.num_parameters(), 0);
  EXPECT_TRUE(lin.state_dict().empty());
  Tensor x = random_tensor({2, 3, 5});
  Tensor y = lin.forward(ctx, x);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(lin.in_features(), 5);
  EXPECT_EQ(lin.weight.value.shape(), (Shape{4, 5}));
  EXPECT_TRUE(close(y, linear(ctx, x, lin.weight.value, lin.bias.value), 0, 1e-15));
  // The width is now fixed.
  EXPECT_THROW(lin.forward(ctx, random_tensor({2, 3, 6})), Error);
  EXPECT_THROW(lin.forward(ctx, random_tensor({2, 3, 5}, DType::F32)), Error);
  // Same seed, same lazy init regardless of when it happens.
  Linear eager(4, 5, true, DType::F64, 1);
  EXPECT_EQ(max_abs_diff(eager.weight.value, lin.weight.value), 0.0);
}

TEST(Linear, GradcheckLazy) {
  for (bool bias : {true, false}) {
    Context ctx;
    Linear lin(3, 0, bias, DType::F64, 5);
    Tensor x = random_tensor({2, 4, 5}, DType::F64, 6);
    check_module_grads(
        lin, [&] { return lin.forward(ctx, x); },
        [&](const Tensor& R) { return std::vector<Tensor>{lin.backward(ctx, R)}; }, {x},
        bias ? "Linear(bias)" : "Linear(no bias)");
  }
}

TEST(Linear, BackwardAccumulatesUntilZeroGrad) {
  Context ctx;
  Linear lin(3, 4, true, DType::F64, 5);
  Tensor x = random_tensor({2, 4}), R = random_tensor({2, 3}, DType::F64, 9);
  lin.forward(ctx, x);
  lin.backward(ctx, R);
  Tensor once = lin.weight.grad.clone();
  lin.backward(ctx, R);
  Tensor twice = lin.weight.grad.clone();
  for (int64_t i = 0; i < once.numel(); ++i)
    EXPECT_NEAR(twice.flat(i), 2 * once.flat(i), 1e-14);
  lin.zero_grad();
  EXPECT_EQ(max_abs_diff(lin.weight.grad, Tensor::zeros({3, 4}, DType::F64)), 0.0);
  EXPECT_EQ(max_abs_diff(lin.bias.grad, Tensor::zeros({3}, DType::F64)), 0.0);
}

// ----------------------------------------------------------------------------------------------
// DotProductAttention and AdditiveAttention

// The old edition's deterministic example: all keys equal, so all scores tie and the weights are
// uniform over the valid keys whatever the queries and weights are.
TEST(ScoringModules, BookExampleUniformOverValidKeys) {
  Context ctx;
  Tensor keys = Tensor::full({2, 10, 2}, 1.0);
  std::vector<double> vals;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 40; ++i)
      vals.push_back(i);
  Tensor values = Tensor::from_vector(vals, {2, 10, 4}, DType::F32);
  Tensor valid = lens1({2, 6});
  Tensor expected = Tensor::from_vector(std::vector<double>{2, 3, 4, 5, 10, 11, 12, 13}, {2, 1, 4});

  AdditiveAttention add(8, 0.1, DType::F32, 1);
  add.eval();
  Tensor out = add.forward(ctx, random_tensor({2, 1, 20}, DType::F32), keys, values, valid);
  EXPECT_TRUE(close(out, expected, 1e-6, 1e-6));
  EXPECT_EQ(add.attention_weights().shape(), (Shape{2, 1, 10}));
  EXPECT_NEAR(add.attention_weights().at({1, 0, 5}), 1.0 / 6, 1e-7);
  EXPECT_EQ(add.attention_weights().at({1, 0, 6}), 0.0);
  EXPECT_EQ(add.W_q.weight.value.shape(), (Shape{8, 20}));
  EXPECT_EQ(add.W_k.weight.value.shape(), (Shape{8, 2}));
  EXPECT_EQ(add.w_v.weight.value.shape(), (Shape{1, 8}));

  DotProductAttention dpa(0.5);
  dpa.eval();
  out = dpa.forward(ctx, random_tensor({2, 1, 2}, DType::F32), keys, values, valid);
  EXPECT_TRUE(close(out, expected, 1e-6, 1e-6));
}

TEST(DotProductAttention, MatchesTheOp) {
  Context ctx;
  Tensor q = random_tensor({2, 3, 4}, DType::F64, 1), k = random_tensor({2, 5, 4}, DType::F64, 2),
         v = random_tensor({2, 5, 3}, DType::F64, 3);
  Tensor valid = lens1({2, 5});
  DotProductAttention dpa(0.0, DType::F64);
  Tensor out = dpa.forward(ctx, q, k, v, valid);
  AttentionOptions o;
  o.mask.valid_lens = valid;
  o.need_weights = true;
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
  EXPECT_TRUE(close(out, r.output, 0, 1e-15));
  EXPECT_TRUE(close(dpa.attention_weights(), r.weights, 0, 1e-15));
  EXPECT_THROW(DotProductAttention(1.5), Error);
  EXPECT_THROW(dpa.forward(ctx, q, random_tensor({2, 5, 3}), v), Error);  // D differs
  EXPECT_THROW(dpa.forward(ctx, q, k, v, lens1({1, 2, 3})), Error);       // lens (3) vs B = 2
}

// A BF16 layer is the op in BF16 (forward and backward, bit for bit), for the fused kernel
// (need_weights false) and the reference (need_weights true), with and without a causal mask.
TEST(DotProductAttention, Bfloat16IsTheOp) {
  struct Case {
    bool need_weights, causal;
  };
  for (const Case& c :
       {Case{false, false}, Case{false, true}, Case{true, false}, Case{true, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "need_weights " << c.need_weights << " causal " << c.causal);
    Context ctx;
    Tensor q = random_tensor({2, 6, 8}, DType::BF16, 1),
           k = random_tensor({2, 6, 8}, DType::BF16, 2),
           v = random_tensor({2, 6, 4}, DType::BF16, 3),
           dout = random_tensor({2, 6, 4}, DType::BF16, 4);
    Tensor valid = lens1({6, 3});
    DotProductAttention dpa(0.0, DType::BF16);
    dpa.need_weights = c.need_weights;
    dpa.causal = c.causal;
    Tensor out = dpa.forward(ctx, q, k, v, valid);
    AttentionInputGrads g = dpa.backward(ctx, dout);
    AttentionOptions o;
    o.mask.valid_lens = valid;
    o.mask.causal = c.causal;
    o.need_weights = c.need_weights;
    AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
    AttentionGrads want = scaled_dot_product_attention_backward(ctx, dout, q, k, v, r, o);
    EXPECT_EQ(out.dtype(), DType::BF16);
    EXPECT_EQ(g.dqueries.dtype(), DType::BF16);
    EXPECT_TRUE(close(out, r.output, 0, 0));
    EXPECT_TRUE(close(g.dqueries, want.dq, 0, 0));
    EXPECT_TRUE(close(g.dkeys, want.dk, 0, 0));
    EXPECT_TRUE(close(g.dvalues, want.dv, 0, 0));
    EXPECT_EQ(dpa.attention_weights().defined(), c.need_weights);
    if (c.need_weights) {
      EXPECT_EQ(dpa.attention_weights().dtype(), DType::F32);
    }
    // The layer's dtype is the inputs' dtype: float32 inputs are an error, as for F32/F64 layers.
    EXPECT_THROW(dpa.forward(ctx, q.to(DType::F32), k, v), Error);
  }
  EXPECT_THROW(DotProductAttention(0.0, DType::F16), Error);
}

TEST(DotProductAttention, Gradcheck) {
  for (double p : {0.0, 0.4}) {
    Context ctx;
    ctx.seed = 17;
    Tensor q = random_tensor({2, 3, 4}, DType::F64, 1), k = random_tensor({2, 5, 4}, DType::F64, 2),
           v = random_tensor({2, 5, 3}, DType::F64, 3);
    Tensor valid = Tensor::from_vector(std::vector<double>{1, 3, 5, 2, 0, 4}, {2, 3}, DType::F64);
    DotProductAttention dpa(p, DType::F64);
    check_module_grads(
        dpa,
        [&] {
          ctx.set_dropout_offset(3);
          return dpa.forward(ctx, q, k, v, valid);
        },
        [&](const Tensor& R) {
          auto g = dpa.backward(ctx, R);
          return std::vector<Tensor>{g.dqueries, g.dkeys, g.dvalues};
        },
        {q, k, v}, "DotProductAttention");
  }
}

TEST(AdditiveAttention, Gradcheck) {
  for (double p : {0.0, 0.3}) {
    Context ctx;
    ctx.seed = 5;
    Tensor q = random_tensor({2, 3, 5}, DType::F64, 1), k = random_tensor({2, 4, 2}, DType::F64, 2),
           v = random_tensor({2, 4, 3}, DType::F64, 3);
    AdditiveAttention add(6, p, DType::F64, 9);
    check_module_grads(
        add,
        [&] {
          ctx.set_dropout_offset(8);
          return add.forward(ctx, q, k, v, lens1({2, 4}));
        },
        [&](const Tensor& R) {
          auto g = add.backward(ctx, R);
          return std::vector<Tensor>{g.dqueries, g.dkeys, g.dvalues};
        },
        {q, k, v}, "AdditiveAttention");
    EXPECT_EQ(add.named_parameters().size(), 3u);
  }
}

// ----------------------------------------------------------------------------------------------
// MultiHeadAttention

// d2l's chapter example (11.6): self-attention on ones(2, 4, 100), valid_lens [3, 2].
TEST(MultiHeadAttention, ChapterExample) {
  Context ctx;
  MultiHeadAttention mha(100, 5, 0.5);
  mha.eval();
  Tensor X = Tensor::full({2, 4, 100}, 1.0);
  Tensor valid = lens1({3, 2});
  Tensor out = mha.forward(ctx, X, X, X, valid);
  EXPECT_EQ(out.shape(), (Shape{2, 4, 100}));
  const Tensor& w = mha.attention_weights();
  ASSERT_EQ(w.shape(), (Shape{10, 4, 4}));
  // All tokens are equal, so every head's weights are uniform over its batch's valid keys.
  for (int64_t bh = 0; bh < 10; ++bh) {
    const int64_t len = bh / 5 == 0 ? 3 : 2;
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t s = 0; s < 4; ++s)
        EXPECT_NEAR(w.at({bh, t, s}), s < len ? 1.0 / len : 0.0, 1e-6)
            << bh << " " << t << " " << s;
  }
  EXPECT_THROW(MultiHeadAttention(100, 3, 0.5), Error);
  EXPECT_THROW(MultiHeadAttention(0, 1, 0.5), Error);
}

// One head at a time, on column slices of the projections: what "head h owns features
// [h*D, (h+1)*D)" means, written without any transpose.
Tensor per_head_composition(Context& ctx, MultiHeadAttention& mha, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& valid) {
  auto proj = [&](Linear& l, const Tensor& x) {
    return linear(ctx, x, l.weight.value, l.has_bias() ? l.bias.value : Tensor());
  };
  Tensor Q = proj(mha.W_q, q), K = proj(mha.W_k, k), V = proj(mha.W_v, v);
  const int64_t E = mha.num_hiddens(), D = E / mha.num_heads();
  Tensor concat = Tensor::empty({q.dim(0), q.dim(1), E}, q.dtype());
  for (int64_t h = 0; h < mha.num_heads(); ++h) {
    AttentionOptions o;
    o.mask.valid_lens = valid;
    AttentionResult r = scaled_dot_product_attention(ctx, Q.slice(2, h * D, (h + 1) * D),
                                                     K.slice(2, h * D, (h + 1) * D),
                                                     V.slice(2, h * D, (h + 1) * D), o);
    concat.slice(2, h * D, (h + 1) * D).copy_from(r.output);
  }
  return proj(mha.W_o, concat);
}

// d2l's transpose_qkv / repeat_interleave / transpose_output, with Tensor reshape and permute.
Tensor transpose_qkv(const Tensor& X, int64_t H) {
  return X.reshape({X.dim(0), X.dim(1), H, -1})
      .permute({0, 2, 1, 3})
      .reshape({-1, X.dim(1), X.dim(2) / H});
}
Tensor transpose_output(const Tensor& X, int64_t H) {
  Tensor Y = X.reshape({-1, H, X.dim(1), X.dim(2)}).permute({0, 2, 1, 3});
  return Y.reshape({Y.dim(0), Y.dim(1), -1});
}
Tensor repeat_interleave(const Tensor& lens, int64_t H) {
  Shape shape = lens.shape();
  shape[0] *= H;
  Tensor out = Tensor::empty(shape, lens.dtype());
  const int64_t row = lens.numel() / lens.dim(0);
  for (int64_t i = 0; i < out.numel(); ++i)
    out.set_flat(i, lens.flat((i / row) / H * row + i % row));
  return out;
}
Tensor d2l_formulation(Context& ctx, MultiHeadAttention& mha, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& valid, Tensor* weights) {
  auto proj = [&](Linear& l, const Tensor& x) {
    return linear(ctx, x, l.weight.value, l.has_bias() ? l.bias.value : Tensor());
  };
  const int64_t H = mha.num_heads();
  DotProductAttention dpa(0.0, mha.dtype());
  Tensor out = dpa.forward(ctx, transpose_qkv(proj(mha.W_q, q), H),
                           transpose_qkv(proj(mha.W_k, k), H), transpose_qkv(proj(mha.W_v, v), H),
                           valid.defined() ? repeat_interleave(valid, H) : Tensor());
  *weights = dpa.attention_weights();
  return proj(mha.W_o, transpose_output(out, H));
}

struct MhaCase {
  const char* name;
  DType dtype;
  bool bias;
  int64_t T, S, dq, dk, dv;
  int lens;  // 0 none, 1 (B,), 2 (B, T)
};

TEST(MultiHeadAttention, EqualsPerHeadCompositionAndD2lFormulation) {
  const MhaCase cases[] = {
      {"f64 self-shaped", DType::F64, false, 4, 4, 12, 12, 12, 1},
      {"f64 T != S, widths differ, bias", DType::F64, true, 3, 5, 7, 4, 9, 1},
      {"f64 2-D lens", DType::F64, true, 3, 5, 12, 12, 12, 2},
      {"f64 no lens", DType::F64, false, 2, 6, 5, 5, 3, 0},
      {"f32 widths differ", DType::F32, false, 3, 5, 7, 4, 9, 1},
      {"f32 bias 2-D lens", DType::F32, true, 4, 2, 12, 6, 12, 2},
  };
  for (const MhaCase& c : cases) {
    SCOPED_TRACE(c.name);
    Context ctx;
    const int64_t B = 2, E = 12, H = 3;
    MultiHeadAttention mha(E, H, 0.0, c.bias, c.dtype, 21);
    mha.eval();
    Tensor q = random_tensor({B, c.T, c.dq}, c.dtype, 1),
           k = random_tensor({B, c.S, c.dk}, c.dtype, 2),
           v = random_tensor({B, c.S, c.dv}, c.dtype, 3);
    Tensor valid;
    if (c.lens == 1) valid = lens1({c.S - 1, 2});
    if (c.lens == 2) {
      valid = Tensor::empty({B, c.T}, DType::I32);
      for (int64_t i = 0; i < valid.numel(); ++i)
        valid.set_flat(i, 1 + i % c.S);
    }
    Tensor out = mha.forward(ctx, q, k, v, valid);
    ASSERT_EQ(out.shape(), (Shape{B, c.T, E}));
    const double tol = c.dtype == DType::F64 ? 1e-13 : 2e-6;
    EXPECT_TRUE(close(out, per_head_composition(ctx, mha, q, k, v, valid), tol, tol));
    Tensor w;
    EXPECT_TRUE(close(out, d2l_formulation(ctx, mha, q, k, v, valid, &w), tol, tol));
    EXPECT_TRUE(close(mha.attention_weights(), w, tol, tol));
    EXPECT_EQ(mha.W_q.weight.value.shape(), (Shape{E, c.dq}));
    EXPECT_EQ(mha.W_k.weight.value.shape(), (Shape{E, c.dk}));
    EXPECT_EQ(mha.W_v.weight.value.shape(), (Shape{E, c.dv}));
    EXPECT_EQ(mha.W_o.weight.value.shape(), (Shape{E, E}));
    EXPECT_EQ(mha.W_o.bias.value.defined(), c.bias);
  }
}

TEST(MultiHeadAttention, ProjectionsStartDifferent) {
  MultiHeadAttention mha(8, 2, 0.0, true, DType::F64, 0);
  Context ctx;
  Tensor X = random_tensor({1, 3, 8});
  mha.forward(ctx, X, X, X);
  EXPECT_GT(max_abs_diff(mha.W_q.weight.value, mha.W_k.weight.value), 0.0);
  EXPECT_GT(max_abs_diff(mha.W_v.weight.value, mha.W_o.weight.value), 0.0);
  EXPECT_EQ(mha.num_parameters(), 4 * (8 * 8 + 8));
}

TEST(MultiHeadAttention, BadInputsNameTheModule) {
  Context ctx;
  MultiHeadAttention mha(8, 2, 0.0, false, DType::F64);
  Tensor q = random_tensor({2, 3, 8}), kv = random_tensor({2, 4, 8});
  try {
    mha.forward(ctx, q, random_tensor({3, 4, 8}), random_tensor({3, 4, 8}));
    FAIL() << "batch mismatch accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "MultiHeadAttention");
    EXPECT_NE(std::string(e.what()).find("(3, 4, 8)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mha.forward(ctx, q, kv, random_tensor({2, 5, 8})), Error);  // S differs
  EXPECT_THROW(mha.forward(ctx, q.to(DType::F32), kv, kv), Error);         // dtype
  EXPECT_THROW(mha.forward(ctx, q, kv, kv, lens1({1, 2, 3})), Error);      // lens (3)
  EXPECT_THROW(mha.backward(ctx, random_tensor({2, 3, 8})), Error);        // no forward yet
}

void mha_gradcheck(double p, int lens, bool bias, const char* what) {
  Context ctx;
  ctx.seed = 1234;
  const int64_t B = 2, T = 3, S = 4, E = 6, H = 2;
  MultiHeadAttention mha(E, H, p, bias, DType::F64, 77);
  Tensor q = random_tensor({B, T, 5}, DType::F64, 11), k = random_tensor({B, S, 4}, DType::F64, 12),
         v = random_tensor({B, S, 3}, DType::F64, 13);
  Tensor valid;
  if (lens == 1) valid = lens1({3, 2});
  if (lens == 2)
    valid = Tensor::from_vector(std::vector<double>{1, 4, 2, 0, 3, 2}, {B, T}, DType::F64);
  check_module_grads(
      mha,
      [&] {
        ctx.set_dropout_offset(40);  // the same dropout mask on every forward
        return mha.forward(ctx, q, k, v, valid);
      },
      [&](const Tensor& R) {
        auto g = mha.backward(ctx, R);
        return std::vector<Tensor>{g.dqueries, g.dkeys, g.dvalues};
      },
      {q, k, v}, what);
}

TEST(MultiHeadAttention, GradcheckNoMask) {
  mha_gradcheck(0.0, 0, false, "no mask");
}
TEST(MultiHeadAttention, GradcheckLens1D) {
  mha_gradcheck(0.0, 1, true, "1-D lens, bias");
}
TEST(MultiHeadAttention, GradcheckLens2D) {
  mha_gradcheck(0.0, 2, false, "2-D lens");
}
TEST(MultiHeadAttention, GradcheckDropoutTrain) {
  mha_gradcheck(0.3, 1, true, "dropout 0.3");
}

// Self-attention (X, X, X): dL/dX is the sum of the three input gradients.
TEST(MultiHeadAttention, GradcheckSelfAttentionSummed) {
  Context ctx;
  ctx.seed = 3;
  MultiHeadAttention mha(6, 3, 0.2, true, DType::F64, 8);
  Tensor X = random_tensor({2, 4, 6}, DType::F64, 5);
  Tensor valid = lens1({4, 2});
  auto run = [&] {
    ctx.set_dropout_offset(9);
    return mha.forward(ctx, X, X, X, valid);
  };
  Tensor R = random_tensor(run().shape(), DType::F64, 6);
  auto g = mha.backward(ctx, R);
  Tensor dX = g.dqueries.clone();
  for (int64_t i = 0; i < dX.numel(); ++i)
    dX.set_flat(i, dX.flat(i) + g.dkeys.flat(i) + g.dvalues.flat(i));
  EXPECT_TRUE(gradcheck([&] { return dot(run(), R); }, X, dX));
}

TEST(MultiHeadAttention, DropoutOnlyInTraining) {
  Context ctx;
  ctx.seed = 99;
  MultiHeadAttention mha(8, 2, 0.5, false, DType::F64, 4);
  Tensor X = random_tensor({2, 5, 8}, DType::F64, 1);
  Tensor valid = lens1({5, 3});
  // Train (the default mode, as in PyTorch): each forward takes one dropout offset.
  ASSERT_TRUE(mha.training());
  const uint64_t before = ctx.dropout_offset();
  Tensor t1 = mha.forward(ctx, X, X, X, valid);
  Tensor w_train = mha.attention_weights().clone();
  Tensor t2 = mha.forward(ctx, X, X, X, valid);
  EXPECT_EQ(ctx.dropout_offset(), before + 2);
  EXPECT_GT(max_abs_diff(t1, t2), 1e-6);  // fresh masks
  ctx.set_dropout_offset(before);
  EXPECT_EQ(max_abs_diff(t1, mha.forward(ctx, X, X, X, valid)), 0.0);  // same offset, same mask

  mha.eval();
  EXPECT_FALSE(mha.attention.training());
  const uint64_t eval_offset = ctx.dropout_offset();
  Tensor e1 = mha.forward(ctx, X, X, X, valid);
  Tensor e2 = mha.forward(ctx, X, X, X, valid);
  EXPECT_EQ(ctx.dropout_offset(), eval_offset);  // no dropout, no offset taken
  EXPECT_EQ(max_abs_diff(e1, e2), 0.0);
  EXPECT_GT(max_abs_diff(e1, t1), 1e-6);
  // attention_weights are pre-dropout: the same in train and eval.
  EXPECT_TRUE(close(mha.attention_weights(), w_train, 0, 1e-15));
  // Eval equals a p = 0 module with the same weights.
  MultiHeadAttention plain(8, 2, 0.0, false, DType::F64, 4);
  EXPECT_TRUE(close(plain.forward(ctx, X, X, X, valid), e1, 0, 1e-15));
}

// Without stored weights (the path for long sequences) the output and gradients are the same.
TEST(MultiHeadAttention, WithoutStoredWeights) {
  Context ctx;
  MultiHeadAttention a(8, 2, 0.0, true, DType::F64, 4), b(8, 2, 0.0, true, DType::F64, 4);
  b.attention.need_weights = false;
  Tensor q = random_tensor({2, 3, 8}, DType::F64, 1), kv = random_tensor({2, 6, 8}, DType::F64, 2);
  Tensor valid = lens1({6, 2});
  Tensor out = a.forward(ctx, q, kv, kv, valid);
  EXPECT_TRUE(close(b.forward(ctx, q, kv, kv, valid), out, 0, 1e-14));
  EXPECT_TRUE(a.attention_weights().defined());
  EXPECT_FALSE(b.attention_weights().defined());
  Tensor R = random_tensor(out.shape(), DType::F64, 3);
  auto ga = a.backward(ctx, R);
  auto gb = b.backward(ctx, R);
  EXPECT_TRUE(close(gb.dqueries, ga.dqueries, 0, 1e-14));
  EXPECT_TRUE(close(gb.dkeys, ga.dkeys, 0, 1e-14));
  EXPECT_TRUE(close(b.W_q.weight.grad, a.W_q.weight.grad, 0, 1e-14));
}

// float32 forward and backward agree with float64 from the same weights and inputs.
TEST(MultiHeadAttention, Float32MatchesFloat64) {
  Context ctx;
  MultiHeadAttention m64(12, 3, 0.0, true, DType::F64, 6), m32(12, 3, 0.0, true, DType::F32, 7);
  Tensor q = random_tensor({2, 4, 7}, DType::F64, 1), kv = random_tensor({2, 5, 9}, DType::F64, 2);
  Tensor valid =
      Tensor::from_vector(std::vector<double>{1, 5, 3, 2, 4, 5, 0, 2}, {2, 4}, DType::F32);
  Tensor out64 = m64.forward(ctx, q, kv, kv, valid);
  m32.load_state_dict(m64.state_dict());
  Tensor q32 = q.to(DType::F32), kv32 = kv.to(DType::F32);
  Tensor out32 = m32.forward(ctx, q32, kv32, kv32, valid);
  EXPECT_EQ(out32.dtype(), DType::F32);
  EXPECT_TRUE(close(out32, out64, 1e-5, 1e-6));
  Tensor R = random_tensor(out64.shape(), DType::F64, 3);
  auto g64 = m64.backward(ctx, R);
  auto g32 = m32.backward(ctx, R.to(DType::F32));
  EXPECT_TRUE(close(g32.dqueries, g64.dqueries, 1e-5, 1e-6));
  EXPECT_TRUE(close(g32.dkeys, g64.dkeys, 1e-5, 1e-6));
  EXPECT_TRUE(close(g32.dvalues, g64.dvalues, 1e-5, 1e-6));
  auto p64 = m64.named_parameters(), p32 = m32.named_parameters();
  for (size_t i = 0; i < p64.size(); ++i)
    EXPECT_TRUE(close(p32[i].second->grad, p64[i].second->grad, 1e-5, 1e-5)) << p64[i].first;
}

// attention.causal equals d2l's decoder mask, 2-D valid_lens [[1, 2, ..., T]] per batch.
TEST(MultiHeadAttention, CausalEqualsD2lTrainingLengths) {
  Context ctx;
  MultiHeadAttention a(8, 2, 0.0, false, DType::F64, 3), b(8, 2, 0.0, false, DType::F64, 3);
  a.attention.causal = true;
  Tensor X = random_tensor({2, 5, 8}, DType::F64, 1);
  Tensor lens = Tensor::empty({2, 5}, DType::I64);
  for (int64_t i = 0; i < 10; ++i)
    lens.set_flat(i, 1 + i % 5);
  EXPECT_TRUE(close(a.forward(ctx, X, X, X), b.forward(ctx, X, X, X, lens), 0, 1e-14));
  EXPECT_TRUE(close(a.attention_weights(), b.attention_weights(), 0, 1e-14));
  EXPECT_EQ(a.attention_weights().at({3, 1, 2}), 0.0);  // query 1 does not see key 2
}

}  // namespace
}  // namespace attn::nn
