// Numeric robustness of the attention ops and modules: large logits, bf16-rounded inputs, fully
// masked rows under both policies, NaN in masked and in valid positions, impossible shapes,
// NaN in state dicts and empty batches (B, T or S = 0).
//
// The promises under test (docs/semantics.md, attn/ops/masked_softmax.hpp):
//   - masking never produces NaN, in any op, precision or backend;
//   - a masked key is never read, so NaN/Inf in padding (scores, keys, values) cannot reach an
//     output or an input gradient (PyTorch's SDPA lets it through: pytorch#101967);
//   - NaN in a position that counts propagates (we hide nothing);
//   - sizes that cannot be represented or allocated end in attn::Error, not a crash;
//   - an empty dimension gives an empty (or, for S = 0, zero) result, as PyTorch does.
#include "attn/core/safetensors.hpp"
#include "attn/nn/attention.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/masked_softmax.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "testing.hpp"

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr Backend kBackends[] = {Backend::kReference, Backend::kCpu, Backend::kAuto};
constexpr MaskedRowPolicy kPolicies[] = {MaskedRowPolicy::kUniform, MaskedRowPolicy::kZero};

const char* policy_name(MaskedRowPolicy p) {
  return p == MaskedRowPolicy::kUniform ? "uniform" : "zero";
}

// Index of the first non-finite element, or -1.
int64_t first_non_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.flat(i))) return i;
  return -1;
}

::testing::AssertionResult all_finite(const Tensor& t) {
  const int64_t i = first_non_finite(t);
  if (i < 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << i << " of " << shape_str(t.shape()) << " is " << t.flat(i);
}

// Row t of batch b of a (B, T, X) tensor as a vector.
std::vector<double> row(const Tensor& t, int64_t b, int64_t i) {
  std::vector<double> r;
  for (int64_t j = 0; j < t.dim(2); ++j)
    r.push_back(t.at({b, i, j}));
  return r;
}

// Writes NaN into x[b, s, :] for every s >= lens[b] (the keys a length mask hides).
void poison_padding(Tensor& x, const std::vector<int64_t>& lens) {
  for (int64_t b = 0; b < x.dim(0); ++b)
    for (int64_t s = lens[static_cast<size_t>(b)]; s < x.dim(1); ++s)
      for (int64_t j = 0; j < x.dim(2); ++j)
        x.set({b, s, j}, kNaN);
}

// The same values in float64 (exactly representable: F32 -> F64 is lossless).
Tensor f64(const Tensor& t) {
  return t.to(DType::F64);
}

// ---- Large logits -------------------------------------------------------------------------

// Scores of +-1e4 in float32: the max-subtracted softmax must stay finite and agree with float64
// on the very same (float32-representable) inputs.
TEST(LargeLogits, MaskedSoftmaxF32AgreesWithF64) {
  Tensor X = random_tensor({3, 4, 19}, DType::F32, 3, -1e4, 1e4);
  for (int64_t s = 0; s < 19; ++s)
    X.set({0, 1, s}, 1e4);  // a tie at the top: uniform row
  X.set({1, 2, 0}, -1e4);
  for (MaskedRowPolicy policy : kPolicies) {
    MaskOptions m;
    m.valid_lens = Tensor::from_vector(std::vector<int64_t>{19, 7, 0}, {3});
    m.masked_rows = policy;
    Context ctx;
    const Tensor y32 = masked_softmax(ctx, X, m);
    const Tensor y64 = masked_softmax(ctx, f64(X), m);
    EXPECT_TRUE(all_finite(y32)) << policy_name(policy);
    EXPECT_TRUE(testing::close(f64(y32), y64, 1e-5, 1e-7)) << policy_name(policy);
    EXPECT_NEAR(y32.at({0, 1, 5}), 1.0 / 19, 1e-7);
    const Tensor dy = random_tensor({3, 4, 19}, DType::F32, 4);
    const Tensor dx32 = masked_softmax_backward(ctx, dy, y32, m);
    const Tensor dx64 = masked_softmax_backward(ctx, f64(dy), y64, m);
    EXPECT_TRUE(all_finite(dx32));
    EXPECT_TRUE(testing::close(f64(dx32), dx64, 1e-4, 1e-6));
  }
}

// q.k * scale reaches +-1e4. float32 accumulation of a dot product of that size is off by
// ~1e4 * 2^-24 * D ~ 3e-3 in the score, which moves near-tied weights by that much relatively;
// hence atol 5e-3 on outputs whose |v| <= 1 (the float64 run is the oracle, not a bound on bits).
TEST(LargeLogits, AttentionF32AllBackendsAndBf16Inputs) {
  const int64_t B = 2, T = 5, S = 9, D = 4;
  for (bool bf16 : {false, true}) {
    Tensor q = random_tensor({B, T, D}, DType::F32, 5, -100, 100);
    Tensor k = random_tensor({B, S, D}, DType::F32, 6, -100, 100);
    Tensor v = random_tensor({B, S, D}, DType::F32, 7);
    if (bf16) {  // what a bf16 checkpoint or activation gives after conversion to float32
      q = q.to(DType::BF16).to(DType::F32);
      k = k.to(DType::BF16).to(DType::F32);
      v = v.to(DType::BF16).to(DType::F32);
    }
    const Tensor dout = random_tensor({B, T, D}, DType::F32, 8);
    for (MaskedRowPolicy policy : kPolicies) {
      AttentionOptions o;
      o.scale = 1.0 / 2.0;  // |score| up to 4 * 1e4 / 2 = 2e4
      o.need_weights = true;
      o.mask.masked_rows = policy;
      o.mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{6, 0}, {B});
      Context c64;
      c64.backend = Backend::kReference;
      const AttentionResult r64 = scaled_dot_product_attention(c64, f64(q), f64(k), f64(v), o);
      const AttentionGrads g64 =
          scaled_dot_product_attention_backward(c64, f64(dout), f64(q), f64(k), f64(v), r64, o);
      for (Backend be : kBackends) {
        SCOPED_TRACE(std::string(backend_name(be)) + " " + policy_name(policy) +
                     (bf16 ? " bf16" : " f32"));
        Context ctx;
        ctx.backend = be;
        const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
        EXPECT_TRUE(all_finite(r.output));
        EXPECT_TRUE(all_finite(r.weights));
        EXPECT_TRUE(testing::close(f64(r.output), r64.output, 0, 5e-3));
        EXPECT_TRUE(testing::close(f64(r.weights), r64.weights, 0, 5e-3));
        const AttentionGrads g = scaled_dot_product_attention_backward(ctx, dout, q, k, v, r, o);
        for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
          EXPECT_TRUE(all_finite(*t));
        // dv is a weighted sum of dout (no large factor); dq, dk carry scale * |k| ~ 50.
        EXPECT_TRUE(testing::close(f64(g.dv), g64.dv, 0, 5e-3));
        EXPECT_TRUE(testing::close(f64(g.dq), g64.dq, 0, 0.5));
        EXPECT_TRUE(testing::close(f64(g.dk), g64.dk, 0, 0.5));
      }
    }
  }
}

TEST(LargeLogits, AdditiveAttentionStaysFinite) {
  // w_v . tanh(..) is bounded by |w_v|_1: w_v of 1e3 gives scores near +-1e4.
  const Tensor qp = random_tensor({2, 3, 10}, DType::F32, 9, -3, 3);
  const Tensor kp = random_tensor({2, 6, 10}, DType::F32, 10, -3, 3);
  const Tensor w_v = random_tensor({10}, DType::F32, 11, -1e3, 1e3);
  const Tensor v = random_tensor({2, 6, 3}, DType::F32, 12);
  AttentionOptions o;
  o.mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{4, 6}, {2});
  Context ctx;
  const AdditiveResult r = additive_attention(ctx, qp, kp, w_v, v, o);
  EXPECT_TRUE(all_finite(r.output));
  EXPECT_TRUE(all_finite(r.weights));
  const AdditiveGrads g = additive_attention_backward(ctx, random_tensor({2, 3, 3}, DType::F32, 13),
                                                      qp, kp, w_v, v, r, o);
  for (const Tensor* t : {&g.dqp, &g.dkp, &g.dw_v, &g.dv})
    EXPECT_TRUE(all_finite(*t));
}

// bf16 keeps NaN a NaN (a truncating conversion can turn a NaN whose payload sits in the low
// bits into Inf), Inf an Inf and the sign of zero; values past bf16's range round to Inf.
TEST(Bf16, RoundTripKeepsSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan_low_payload = std::bit_cast<float>(uint32_t{0x7f800001});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = Tensor::from_vector(
      std::vector<float>{nan_low_payload, nan, inf, -inf, -0.0f, 1e4f, -1e4f, 3.4e38f}, {8});
  const Tensor y = x.to(DType::BF16).to(DType::F32);
  EXPECT_TRUE(std::isnan(y.flat(0)));
  EXPECT_TRUE(std::isnan(y.flat(1)));
  EXPECT_EQ(y.flat(2), inf);
  EXPECT_EQ(y.flat(3), -inf);
  EXPECT_TRUE(std::signbit(y.flat(4)) && y.flat(4) == 0.0);
  EXPECT_NEAR(y.flat(5), 1e4, 1e4 * std::ldexp(1.0, -8));  // 8 significant bits
  EXPECT_NEAR(y.flat(6), -1e4, 1e4 * std::ldexp(1.0, -8));
  EXPECT_EQ(y.flat(7), inf);  // above bf16's max 3.3895e38 rounds to Inf, as torch does
}

// ---- Fully masked rows --------------------------------------------------------------------

// Checks the rows of `w` (B, T, S) and `out` (B, T, Dv) for batch b (every row fully masked).
void expect_masked_batch(const Tensor& w, const Tensor& out, int64_t b, MaskedRowPolicy policy) {
  const int64_t S = w.dim(2);
  for (int64_t t = 0; t < w.dim(1); ++t)
    for (int64_t s = 0; s < S; ++s)
      EXPECT_NEAR(w.at({b, t, s}), policy == MaskedRowPolicy::kUniform ? 1.0 / S : 0.0, 1e-7)
          << "w " << b << " " << t << " " << s;
  if (policy == MaskedRowPolicy::kZero && out.defined()) {
    for (int64_t t = 0; t < out.dim(1); ++t)
      for (double x : row(out, b, t))
        EXPECT_EQ(x, 0.0);
  }
}

TEST(FullyMaskedRows, EveryOpBothPoliciesBothDtypes) {
  const int64_t B = 3, T = 4, S = 5, D = 6;
  for (DType dt : {DType::F32, DType::F64}) {
    for (MaskedRowPolicy policy : kPolicies) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + policy_name(policy));
      MaskOptions m;
      m.masked_rows = policy;
      // Batch 0: length 0; batch 1: negative float length; batch 2: NaN length. All fully masked.
      m.valid_lens = Tensor::from_vector(std::vector<double>{0, -2.5, kNaN}, {B}, DType::F32);
      Context ctx;
      const Tensor X = random_tensor({B, T, S}, dt, 20, -1e4, 1e4);
      const Tensor Y = masked_softmax(ctx, X, m);
      EXPECT_TRUE(all_finite(Y));
      for (int64_t b = 0; b < B; ++b)
        expect_masked_batch(Y, Tensor(), b, policy);
      const Tensor dX = masked_softmax_backward(ctx, random_tensor({B, T, S}, dt, 21), Y, m);
      for (int64_t i = 0; i < dX.numel(); ++i)
        EXPECT_EQ(dX.flat(i), 0.0);

      AttentionOptions o;
      o.mask = m;
      o.need_weights = true;
      const Tensor q = random_tensor({B, T, D}, dt, 22), k = random_tensor({B, S, D}, dt, 23);
      const Tensor v = random_tensor({B, S, D}, dt, 24), dout = random_tensor({B, T, D}, dt, 25);
      for (Backend be : kBackends) {
        ctx.backend = be;
        const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
        EXPECT_TRUE(all_finite(r.output)) << backend_name(be);
        for (int64_t b = 0; b < B; ++b)
          expect_masked_batch(r.weights, r.output, b, policy);
        for (int64_t i = 0; i < r.logsumexp.numel(); ++i)
          EXPECT_EQ(r.logsumexp.flat(i), -std::numeric_limits<double>::infinity());
        const AttentionGrads g = scaled_dot_product_attention_backward(ctx, dout, q, k, v, r, o);
        for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
          EXPECT_TRUE(all_finite(*t));
        // The weights of a fully masked row are constants: nothing flows to q or k.
        for (int64_t i = 0; i < g.dq.numel(); ++i)
          EXPECT_EQ(g.dq.flat(i), 0.0);
        for (int64_t i = 0; i < g.dk.numel(); ++i)
          EXPECT_EQ(g.dk.flat(i), 0.0);
      }

      const AdditiveResult a = additive_attention(ctx, q, k, random_tensor({D}, dt, 26), v, o);
      EXPECT_TRUE(all_finite(a.output));
      for (int64_t b = 0; b < B; ++b)
        expect_masked_batch(a.weights, a.output, b, policy);
      const AdditiveGrads ag =
          additive_attention_backward(ctx, dout, q, k, random_tensor({D}, dt, 26), v, a, o);
      for (const Tensor* t : {&ag.dqp, &ag.dkp, &ag.dw_v, &ag.dv})
        EXPECT_TRUE(all_finite(*t));
    }
  }
}

// Causal and a length mask together: query t of batch 0 sees keys [0, min(t + 1, 0)) = none.
TEST(FullyMaskedRows, CausalWithZeroLength) {
  for (MaskedRowPolicy policy : kPolicies) {
    AttentionOptions o;
    o.mask.causal = true;
    o.mask.masked_rows = policy;
    o.mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{0, 3}, {2});
    o.need_weights = true;
    const Tensor q = random_tensor({2, 4, 8}, DType::F32, 30);
    const Tensor k = random_tensor({2, 4, 8}, DType::F32, 31);
    const Tensor v = random_tensor({2, 4, 8}, DType::F32, 32);
    for (Backend be : kBackends) {
      Context ctx;
      ctx.backend = be;
      const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
      EXPECT_TRUE(all_finite(r.output)) << backend_name(be) << " " << policy_name(policy);
      expect_masked_batch(r.weights, r.output, 0, policy);
    }
  }
}

TEST(FullyMaskedRows, MultiHeadAttentionBothPolicies) {
  const int64_t B = 2, T = 3, E = 8, H = 2;
  for (MaskedRowPolicy policy : kPolicies) {
    nn::MultiHeadAttention mha(E, H, 0.0, /*bias=*/true, DType::F32, 3);
    mha.eval();
    mha.attention.masked_rows = policy;
    Context ctx;
    const Tensor X = random_tensor({B, T, E}, DType::F32, 40, -30, 30);
    const Tensor lens = Tensor::from_vector(std::vector<int64_t>{0, 2}, {B});
    const Tensor out = mha.forward(ctx, X, X, X, lens);
    EXPECT_TRUE(all_finite(out)) << policy_name(policy);
    EXPECT_TRUE(all_finite(mha.attention_weights()));
    if (policy == MaskedRowPolicy::kZero) {
      // Zero attention output: W_o maps it to W_o's bias.
      const Tensor bias = mha.W_o.bias.value;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e)
          EXPECT_FLOAT_EQ(out.at({0, t, e}), bias.flat(e));
    }
    const nn::AttentionInputGrads g = mha.backward(ctx, random_tensor({B, T, E}, DType::F32, 41));
    for (const Tensor* t : {&g.dqueries, &g.dkeys, &g.dvalues})
      EXPECT_TRUE(all_finite(*t));
    for (auto& [name, p] : mha.named_parameters())
      EXPECT_TRUE(all_finite(p->grad)) << name;
  }
}

// ---- NaN in masked positions never leaks ---------------------------------------------------

TEST(NaNInPadding, MaskedSoftmaxScores) {
  Tensor X = random_tensor({2, 3, 6}, DType::F32, 50);
  const std::vector<int64_t> lens{4, 1};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t s = lens[b]; s < 6; ++s)
        X.set({b, t, s}, kNaN);
  MaskOptions m;
  m.valid_lens = Tensor::from_vector(lens, {2});
  Context ctx;
  const Tensor Y = masked_softmax(ctx, X, m);
  EXPECT_TRUE(all_finite(Y));
  EXPECT_EQ(Y.at({0, 0, 5}), 0.0);
  EXPECT_FLOAT_EQ(Y.at({1, 2, 0}), 1.0f);
  const Tensor dX = masked_softmax_backward(ctx, random_tensor({2, 3, 6}, DType::F32, 51), Y, m);
  EXPECT_TRUE(all_finite(dX));
}

// Keys and values of padded positions are NaN; every row keeps at least one key. Outputs,
// weights and all three gradients stay finite; padded keys get exactly zero gradient.
TEST(NaNInPadding, AttentionKeysAndValuesAllBackends) {
  const int64_t B = 3, T = 4, S = 7, D = 5;
  const std::vector<int64_t> lens{7, 3, 1};
  for (DType dt : {DType::F32, DType::F64}) {
    const Tensor q = random_tensor({B, T, D}, dt, 60);
    Tensor k = random_tensor({B, S, D}, dt, 61), v = random_tensor({B, S, D}, dt, 62);
    poison_padding(k, lens);
    poison_padding(v, lens);
    const Tensor dout = random_tensor({B, T, D}, dt, 63);
    for (MaskedRowPolicy policy : kPolicies) {
      for (bool causal : {false, true}) {
        AttentionOptions o;
        o.mask.valid_lens = Tensor::from_vector(lens, {B});
        o.mask.masked_rows = policy;
        o.mask.causal = causal;
        o.need_weights = true;
        for (Backend be : kBackends) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " " + backend_name(be) + " " +
                       policy_name(policy) + (causal ? " causal" : ""));
          Context ctx;
          ctx.backend = be;
          const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
          EXPECT_TRUE(all_finite(r.output));
          EXPECT_TRUE(all_finite(r.weights));
          EXPECT_TRUE(all_finite(r.logsumexp));
          const AttentionGrads g = scaled_dot_product_attention_backward(ctx, dout, q, k, v, r, o);
          EXPECT_TRUE(all_finite(g.dq));
          EXPECT_TRUE(all_finite(g.dk));
          EXPECT_TRUE(all_finite(g.dv));
          for (int64_t b = 0; b < B; ++b)
            for (int64_t s = lens[b]; s < S; ++s)
              for (int64_t d = 0; d < D; ++d) {
                EXPECT_EQ(g.dk.at({b, s, d}), 0.0);
                EXPECT_EQ(g.dv.at({b, s, d}), 0.0);
              }
        }
        Context actx;
        const Tensor w_v = random_tensor({D}, dt, 64);
        const AdditiveResult a = additive_attention(actx, q, k, w_v, v, o);
        EXPECT_TRUE(all_finite(a.output));
        EXPECT_TRUE(all_finite(a.weights));
        const AdditiveGrads ag = additive_attention_backward(actx, dout, q, k, w_v, v, a, o);
        for (const Tensor* t : {&ag.dqp, &ag.dkp, &ag.dw_v, &ag.dv})
          EXPECT_TRUE(all_finite(*t));
      }
    }
  }
}

// Under kZero a fully masked row reads no key at all, so NaN padding cannot reach it either.
// (Under kUniform it averages every value, padding included, as d2l does: NaN values there
// propagate by design.)
TEST(NaNInPadding, ZeroPolicyFullyMaskedRowReadsNothing) {
  const Tensor q = random_tensor({1, 2, 4}, DType::F32, 70);
  Tensor k = random_tensor({1, 3, 4}, DType::F32, 71), v = random_tensor({1, 3, 4}, DType::F32, 72);
  poison_padding(k, {0});
  poison_padding(v, {0});
  AttentionOptions o;
  o.mask.valid_lens = Tensor::from_vector(std::vector<int64_t>{0}, {1});
  o.mask.masked_rows = MaskedRowPolicy::kZero;
  for (Backend be : kBackends) {
    Context ctx;
    ctx.backend = be;
    const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
    for (int64_t i = 0; i < r.output.numel(); ++i)
      EXPECT_EQ(r.output.flat(i), 0.0);
    const AttentionGrads g = scaled_dot_product_attention_backward(
        ctx, random_tensor({1, 2, 4}, DType::F32, 73), q, k, v, r, o);
    for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
      EXPECT_TRUE(all_finite(*t)) << backend_name(be);
  }
}

// The fused CPU kernel, called directly (whether or not ops/ dispatches to it for a Backend):
// padded keys past key_limit hold NaN.
TEST(NaNInPadding, FlashCpuKernel) {
  const int64_t B = 2, T = 70, S = 130, D = 16;  // more than one key tile, ragged
  const std::vector<int64_t> lens{65, 1};
  const Tensor q = random_tensor({B, T, D}, DType::F32, 80);
  const Tensor dout = random_tensor({B, T, D}, DType::F32, 83);
  // NaN in the padded keys only, the padded values only, or both: a failure says which leaks.
  for (const char* poisoned : {"k", "v", "k+v"}) {
    Tensor k = random_tensor({B, S, D}, DType::F32, 81),
           v = random_tensor({B, S, D}, DType::F32, 82);
    if (poisoned[0] == 'k') poison_padding(k, lens);
    if (std::string(poisoned).back() == 'v') poison_padding(v, lens);
    for (bool zero_rows : {false, true}) {
      SCOPED_TRACE(std::string("NaN in padded ") + poisoned + (zero_rows ? ", zero rows" : ""));
      Tensor out = Tensor::empty({B, T, D}), lse = Tensor::empty({B, T});
      Tensor dq = Tensor::empty({B, T, D}), dk = Tensor::empty({B, S, D}),
             dv = Tensor::empty({B, S, D});
      std::vector<int32_t> limit;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          limit.push_back(static_cast<int32_t>(lens[b]));
      cpu::FlashParams p;
      p.B = B, p.T = T, p.S = S, p.D = D, p.Dv = D;
      p.q = {q.data<float>(), T * D, 0, D, 1};
      p.k = {k.data<float>(), S * D, 0, D, 1};
      p.v = {v.data<float>(), S * D, 0, D, 1};
      p.out = {out.data<float>(), T * D, 0, D, 1};
      p.lse = lse.data<float>();
      p.kept_keys = limit.data();
      p.masked_rows = zero_rows ? kernels::MaskedRows::kZero : kernels::MaskedRows::kUniform;
      p.scale = 0.25f;
      p.threads = 2;
      cpu::flash_attention_forward(p);
      EXPECT_TRUE(all_finite(out));
      EXPECT_TRUE(all_finite(lse));
      cpu::FlashGrads g;
      g.dout = {dout.data<float>(), T * D, 0, D, 1};
      g.dq = {dq.data<float>(), T * D, 0, D, 1};
      g.dk = {dk.data<float>(), S * D, 0, D, 1};
      g.dv = {dv.data<float>(), S * D, 0, D, 1};
      cpu::flash_attention_backward(p, g);
      EXPECT_TRUE(all_finite(dq));
      EXPECT_TRUE(all_finite(dk));
      EXPECT_TRUE(all_finite(dv));
    }
  }
}

// Padded key/value positions of NaN through MultiHeadAttention: the projections are per position,
// so the NaN stays in the padded rows of K and V, which attention never reads.
TEST(NaNInPadding, MultiHeadAttentionOutputsAndInputGrads) {
  const int64_t B = 2, T = 3, S = 5, E = 8, H = 2;
  nn::MultiHeadAttention mha(E, H, 0.0, false, DType::F32, 4);
  mha.eval();
  const std::vector<int64_t> lens{5, 2};
  const Tensor queries = random_tensor({B, T, E}, DType::F32, 90);
  Tensor keys = random_tensor({B, S, E}, DType::F32, 91);
  Tensor values = random_tensor({B, S, E}, DType::F32, 92);
  poison_padding(keys, lens);
  poison_padding(values, lens);
  Context ctx;
  const Tensor out = mha.forward(ctx, queries, keys, values, Tensor::from_vector(lens, {B}));
  EXPECT_TRUE(all_finite(out));
  EXPECT_TRUE(all_finite(mha.attention_weights()));
  const nn::AttentionInputGrads g = mha.backward(ctx, random_tensor({B, T, E}, DType::F32, 93));
  EXPECT_TRUE(all_finite(g.dqueries));
  EXPECT_TRUE(all_finite(g.dkeys));
  EXPECT_TRUE(all_finite(g.dvalues));
  EXPECT_TRUE(all_finite(mha.W_q.weight.grad));
  EXPECT_TRUE(all_finite(mha.W_o.weight.grad));
}

// The projections' weight gradients, W_k.grad += dK^T keys: dK is exactly 0 on padded rows, but
// 0 * NaN is NaN, so a NaN in padded *inputs* would reach W_k.grad and W_v.grad if padded rows
// entered that product (PyTorch's Linear sees every row). MultiHeadAttention keeps padding that
// no query reads out of its projections.
TEST(NaNInPadding, MultiHeadAttentionProjectionGrads) {
  const int64_t B = 2, T = 3, S = 5, E = 8, H = 2;
  nn::MultiHeadAttention mha(E, H, 0.0, false, DType::F32, 4);
  mha.eval();
  const std::vector<int64_t> lens{5, 2};
  Tensor keys = random_tensor({B, S, E}, DType::F32, 91);
  Tensor values = random_tensor({B, S, E}, DType::F32, 92);
  poison_padding(keys, lens);
  poison_padding(values, lens);
  Context ctx;
  mha.forward(ctx, random_tensor({B, T, E}, DType::F32, 90), keys, values,
              Tensor::from_vector(lens, {B}));
  mha.backward(ctx, random_tensor({B, T, E}, DType::F32, 93));
  EXPECT_TRUE(all_finite(mha.W_k.weight.grad));
  EXPECT_TRUE(all_finite(mha.W_v.weight.grad));
}

// A key that is in the future for some queries (causal) holds NaN: the queries that cannot see
// it must stay finite, in the output and in dq, although their tile shares keys with queries
// that do see it (the fused kernel processes 64-key tiles and blocks of queries together).
TEST(NaNInPadding, CausalFutureKeyStaysOutOfEarlierRows) {
  const int64_t T = 80, D = 8, bad = 40;
  for (DType dt : {DType::F32, DType::F64}) {
    const Tensor q = random_tensor({1, T, D}, dt, 140);
    Tensor k = random_tensor({1, T, D}, dt, 141), v = random_tensor({1, T, D}, dt, 142);
    for (int64_t d = 0; d < D; ++d) {
      k.set({0, bad, d}, kNaN);
      v.set({0, bad, d}, kNaN);
    }
    AttentionOptions o;
    o.mask.causal = true;
    for (Backend be : kBackends) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + backend_name(be));
      Context ctx;
      ctx.backend = be;
      const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
      const AttentionGrads g = scaled_dot_product_attention_backward(
          ctx, random_tensor({1, T, D}, dt, 143), q, k, v, r, o);
      // Rows that see the NaN key are NaN (it propagates); the rows before it are finite.
      std::vector<int64_t> wrong_out, wrong_dq;
      for (int64_t t = 0; t < T; ++t) {
        for (double x : row(r.output, 0, t))
          if (std::isfinite(x) != (t < bad)) {
            wrong_out.push_back(t);
            break;
          }
        for (double x : row(g.dq, 0, t))
          if (std::isfinite(x) != (t < bad)) {
            wrong_dq.push_back(t);
            break;
          }
      }
      EXPECT_TRUE(wrong_out.empty()) << wrong_out.size() << " output rows wrong, first "
                                     << (wrong_out.empty() ? -1 : wrong_out.front());
      EXPECT_TRUE(wrong_dq.empty()) << wrong_dq.size() << " dq rows wrong, first "
                                    << (wrong_dq.empty() ? -1 : wrong_dq.front());
    }
  }
}

// ---- NaN in valid positions propagates ----------------------------------------------------

TEST(NaNInValidPositions, Propagates) {
  Tensor X = random_tensor({1, 2, 4}, DType::F32, 100);
  X.set({0, 0, 1}, kNaN);
  Context ctx;
  const Tensor Y = masked_softmax(ctx, X, MaskOptions{});
  for (double y : row(Y, 0, 0))
    EXPECT_TRUE(std::isnan(y));
  for (double y : row(Y, 0, 1))
    EXPECT_TRUE(std::isfinite(y));  // other rows untouched

  const int64_t B = 1, T = 3, S = 4, D = 4;
  for (Backend be : kBackends) {
    SCOPED_TRACE(backend_name(be));
    ctx.backend = be;
    Tensor q = random_tensor({B, T, D}, DType::F32, 101);
    Tensor k = random_tensor({B, S, D}, DType::F32, 102);
    const Tensor v = random_tensor({B, S, D}, DType::F32, 103);
    q.set({0, 1, 2}, kNaN);  // query 1 only
    AttentionOptions o;
    AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
    for (double x : row(r.output, 0, 1))
      EXPECT_TRUE(std::isnan(x));
    for (double x : row(r.output, 0, 0))
      EXPECT_TRUE(std::isfinite(x));
    // A NaN key that query 0 sees only under no mask: causal hides key 3 from queries 0..2.
    q = random_tensor({B, T, D}, DType::F32, 101);
    k.set({0, 3, 0}, kNaN);
    o.mask.causal = true;
    r = scaled_dot_product_attention(ctx, q, k, v, o);
    EXPECT_TRUE(all_finite(r.output));
    o.mask.causal = false;
    r = scaled_dot_product_attention(ctx, q, k, v, o);
    for (int64_t t = 0; t < T; ++t)
      for (double x : row(r.output, 0, t))
        EXPECT_TRUE(std::isnan(x));
  }
}

// ---- Impossible shapes --------------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__)
#define ATTN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTN_ASAN 1
#endif
#endif

TEST(HugeShapes, OverflowAndUnaddressableAreErrors) {
  const int64_t big = int64_t{1} << 40;
  EXPECT_THROW(Tensor::empty({big, big}), Error);          // product overflows int64
  EXPECT_THROW(Tensor::empty({-1, 4}), Error);             // negative dimension
  EXPECT_THROW(Tensor::empty({int64_t{1} << 55}), Error);  // 2^57 bytes: beyond any address space
  EXPECT_THROW(shape_numel({big, big, 0, big}), Error);    // overflows before the 0 is reached
  float cell = 0;
  EXPECT_THROW(Tensor::wrap(&cell, {big, big}, DType::F32, {0, 0}), Error);
  EXPECT_EQ(shape_numel({big, 0, big}), 0);
}

// Views of 2^40+ elements over one float (stride 0) handed to the ops: they must end in
// attn::Error when the op needs a contiguous copy, an output or a T x S matrix it cannot
// allocate, never in a crash, std::bad_alloc or an endless loop. The sizes ask for terabytes,
// which the allocator refuses; AddressSanitizer aborts on such requests instead of returning
// null (unless ASAN_OPTIONS=allocator_may_return_null=1), so the test skips there.
TEST(HugeShapes, OpsOnHugeBroadcastViews) {
#ifdef ATTN_ASAN
  GTEST_SKIP() << "AddressSanitizer aborts on multi-terabyte allocation requests";
#endif
  float cell = 0.5f;
  const int64_t big = int64_t{1} << 40;
  auto view = [&](const Shape& s) {
    return Tensor::wrap(&cell, s, DType::F32, Strides(s.size(), 0));
  };
  Context ctx;
  EXPECT_THROW(masked_softmax(ctx, view({1, 1 << 20, 1 << 20}), MaskOptions{}), Error);
  for (Backend be : kBackends) {
    ctx.backend = be;
    // Long queries: the output (B, T, Dv) alone is 4 TB.
    EXPECT_THROW(
        scaled_dot_product_attention(ctx, view({1, big, 1}), view({1, 2, 1}), view({1, 2, 1})),
        Error);
    // Long keys: one query, 2^40 keys; the op copies k and v contiguous (4 TB each).
    EXPECT_THROW(
        scaled_dot_product_attention(ctx, view({1, 1, 1}), view({1, big, 1}), view({1, big, 1})),
        Error);
    AttentionOptions o;
    o.need_weights = true;  // (1, 2^20, 2^20) weights: 4 TB
    EXPECT_THROW(scaled_dot_product_attention(ctx, view({1, 1 << 20, 1}), view({1, 1 << 20, 1}),
                                              view({1, 1 << 20, 1}), o),
                 Error);
  }
  EXPECT_THROW(additive_attention(ctx, view({1, 1 << 20, 1}), view({1, 1 << 20, 1}), view({1}),
                                  view({1, 1 << 20, 1})),
               Error);
}

// ---- State dicts with NaN -----------------------------------------------------------------

// Loading does no hidden validation of values: a diverged checkpoint must load so it can be
// inspected. NaN bits survive the file round trip.
TEST(StateDict, NaNAndInfLoad) {
  nn::MultiHeadAttention mha(4, 2, 0.0, true);
  Context ctx;
  mha.forward(ctx, random_tensor({1, 2, 4}, DType::F32, 110),
              random_tensor({1, 2, 4}, DType::F32, 111), random_tensor({1, 2, 4}, DType::F32, 112));
  nn::StateDict sd = mha.state_dict();
  sd.at("W_q.weight").set({0, 0}, kNaN);
  sd.at("W_o.bias").set({1}, std::numeric_limits<double>::infinity());
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("attn_robust_" + std::to_string(getpid()) + ".safetensors"))
                               .string();
  save_safetensors(path, sd);
  const SafetensorsFile f = load_safetensors(path);
  std::remove(path.c_str());
  nn::MultiHeadAttention other(4, 2, 0.0, true);
  EXPECT_NO_THROW(other.load_state_dict(f.tensors));
  EXPECT_TRUE(std::isnan(other.W_q.weight.value.at({0, 0})));
  EXPECT_EQ(other.W_o.bias.value.at({1}), std::numeric_limits<double>::infinity());
}

// ---- Empty batches ------------------------------------------------------------------------
// PyTorch: softmax over an empty axis is empty; attention over S = 0 keys sums nothing (zeros).

TEST(EmptyDims, MaskedSoftmax) {
  Context ctx;
  for (const Shape& s : {Shape{0, 3, 4}, Shape{2, 0, 4}, Shape{2, 3, 0}}) {
    SCOPED_TRACE(shape_str(s));
    const Tensor X = Tensor::zeros(s);
    MaskOptions m;
    m.valid_lens = Tensor::zeros({s[0]}, DType::I64);
    const Tensor Y = masked_softmax(ctx, X, m);
    EXPECT_EQ(Y.shape(), s);
    EXPECT_EQ(masked_softmax_backward(ctx, X, Y, m).shape(), s);
  }
}

TEST(EmptyDims, Attention) {
  struct Case {
    int64_t B, T, S;
  };
  for (const Case c : {Case{0, 3, 4}, Case{2, 0, 4}, Case{2, 3, 0}}) {
    for (MaskedRowPolicy policy : kPolicies) {
      for (Backend be : kBackends) {
        SCOPED_TRACE(shape_str({c.B, c.T, c.S}) + " " + backend_name(be) + " " +
                     policy_name(policy));
        const int64_t D = 4, Dv = 3;
        const Tensor q = random_tensor({c.B, c.T, D}, DType::F32, 120);
        const Tensor k = random_tensor({c.B, c.S, D}, DType::F32, 121);
        const Tensor v = random_tensor({c.B, c.S, Dv}, DType::F32, 122);
        AttentionOptions o;
        o.need_weights = true;
        o.mask.masked_rows = policy;
        o.mask.valid_lens = Tensor::full({c.B}, 2, DType::I64);
        Context ctx;
        ctx.backend = be;
        const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, o);
        ASSERT_EQ(r.output.shape(), (Shape{c.B, c.T, Dv}));
        EXPECT_EQ(r.weights.shape(), (Shape{c.B, c.T, c.S}));
        for (int64_t i = 0; i < r.output.numel(); ++i)
          EXPECT_EQ(r.output.flat(i), 0.0);
        const AttentionGrads g = scaled_dot_product_attention_backward(
            ctx, random_tensor({c.B, c.T, Dv}, DType::F32, 123), q, k, v, r, o);
        EXPECT_EQ(g.dq.shape(), q.shape());
        EXPECT_EQ(g.dk.shape(), k.shape());
        EXPECT_EQ(g.dv.shape(), v.shape());
        for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
          EXPECT_TRUE(all_finite(*t));
        for (int64_t i = 0; i < g.dq.numel(); ++i)
          EXPECT_EQ(g.dq.flat(i), 0.0);

        const Tensor w_v = random_tensor({D}, DType::F32, 124);
        const AdditiveResult a = additive_attention(ctx, q, k, w_v, v, o);
        ASSERT_EQ(a.output.shape(), (Shape{c.B, c.T, Dv}));
        for (int64_t i = 0; i < a.output.numel(); ++i)
          EXPECT_EQ(a.output.flat(i), 0.0);
        const AdditiveGrads ag = additive_attention_backward(
            ctx, random_tensor({c.B, c.T, Dv}, DType::F32, 125), q, k, w_v, v, a, o);
        EXPECT_EQ(ag.dkp.shape(), k.shape());
        for (const Tensor* t : {&ag.dqp, &ag.dkp, &ag.dw_v, &ag.dv})
          EXPECT_TRUE(all_finite(*t));
      }
    }
  }
}

TEST(EmptyDims, MultiHeadAttention) {
  struct Case {
    int64_t B, T, S;
  };
  const int64_t E = 8;
  for (const Case c : {Case{0, 3, 4}, Case{2, 0, 4}, Case{2, 3, 0}}) {
    SCOPED_TRACE(shape_str({c.B, c.T, c.S}));
    nn::MultiHeadAttention mha(E, 2, 0.0, true);
    mha.eval();
    Context ctx;
    const Tensor queries = random_tensor({c.B, c.T, E}, DType::F32, 130);
    const Tensor kv = random_tensor({c.B, c.S, E}, DType::F32, 131);
    Tensor out;
    ASSERT_NO_THROW(out = mha.forward(ctx, queries, kv, kv));
    EXPECT_EQ(out.shape(), (Shape{c.B, c.T, E}));
    EXPECT_TRUE(all_finite(out));
    nn::AttentionInputGrads g;
    ASSERT_NO_THROW(g = mha.backward(ctx, random_tensor({c.B, c.T, E}, DType::F32, 132)));
    EXPECT_EQ(g.dqueries.shape(), queries.shape());
    EXPECT_EQ(g.dkeys.shape(), kv.shape());
    for (auto& [name, p] : mha.named_parameters())
      EXPECT_TRUE(all_finite(p->grad)) << name;
  }
}

}  // namespace
}  // namespace attn
