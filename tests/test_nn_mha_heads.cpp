// MultiHeadAttention's fast path: the fused kernel on (B, T, H*D) projections with head strides
// (kernels::AttentionProblem::heads, ops/attention_heads.hpp) instead of d2l's (B*H, T, D) copies.
//
// 1. Op level, bitwise: the head-strided kernel reads exactly the values the copying path reads
//    (d2l's transpose_qkv -> scaled_dot_product_attention on Backend::kCpu -> transpose_output),
//    so output, logsumexp and every gradient must be identical bit for bit, for every mask kind,
//    dropout, tails around the tiles, inputs that are misaligned column slices of one (B, T, 3E)
//    buffer, every SIMD target and 1 or 2 threads. Writes outside the gradient slices are caught
//    by a sentinel.
// 2. Module level: the fused path (need_weights = false) against the d2l path (need_weights =
//    true: the reference kernels, double accumulation) within the fp32 tolerances of
//    tests/test_kernels_flash_cpu.cpp (outputs 2e-6, gradients 1e-5 of the largest entry), and
//    bitwise equal for 1 and 2 threads. W_q, W_k and W_v stacked by a self-attention forward
//    against the same layers created apart, bitwise, and after a caller replaces a parameter.
#include "attention_harness.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/optim.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "ops/attention_heads.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

constexpr float kSentinel = -768.0f;  // exact in bfloat16 too

using testing::bitwise_equal;
using testing::Lens;
using testing::merge_heads;
using testing::split_heads;
using Case = testing::KernelCase;  // H heads of (B, T, H*D) inputs

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i)
    m = std::max(m, std::abs(t.flat(i)));
  return m;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // Sizes straddling the tiles (forward query block 192/96, key tile 64/32, backward query tile
  // 96/48), D odd and 64, Dv != D, one head and several.
  for (auto [B, H, T, S, D, Dv] : std::vector<std::array<int64_t, 6>>{{2, 3, 37, 37, 8, 8},
                                                                      {1, 4, 200, 70, 16, 5},
                                                                      {2, 2, 65, 300, 17, 24},
                                                                      {1, 1, 50, 50, 64, 64},
                                                                      {2, 8, 97, 97, 64, 64}})
    for (Lens lens : {Lens::kNone, Lens::k1D, Lens::k2D})
      for (bool causal : {false, true})
        out.push_back({B, T, S, D, Dv, lens, causal, lens == Lens::k2D && causal,
                       (lens == Lens::k1D && !causal) || (B == 2 && H == 2) ? 0.2f : 0.0f,
                       /*layout=*/0, H});
  return out;
}

struct Outcome {
  Tensor out, lse, dq, dk, dv;
};

// Kernel switches of a run (Context::kernel_targets, Context::force_bf16_fallback).
struct Switches {
  int64_t targets = 0;
  bool bf16_fallback = false;
};

Context make_context(int threads, const Switches& sw) {
  Context ctx;
  ctx.threads = threads;
  ctx.seed = 99;
  ctx.kernel_targets = sw.targets;
  ctx.force_bf16_fallback = sw.bf16_fallback;
  return ctx;
}

// The case's (B, T|S, H*D) inputs as column slices of one (B, L, 2E + Ev + 3) buffer per input
// (offset 1, so every row is misaligned), and the output gradient.
struct Inputs {
  Tensor q, k, v, dout;
};
Inputs make_inputs(const Case& c, DType dt) {
  const int64_t E = c.H * c.D, Ev = c.H * c.Dv;
  const Tensor qbuf = random_tensor({c.B, c.T, 2 * E + Ev + 3}, DType::F32, 1).to(dt);
  const Tensor kvbuf = random_tensor({c.B, c.S, 2 * E + Ev + 3}, DType::F32, 2).to(dt);
  return {qbuf.slice(2, 1, 1 + E), kvbuf.slice(2, 1 + E, 1 + 2 * E),
          kvbuf.slice(2, 1 + 2 * E, 1 + 2 * E + Ev),
          random_tensor({c.B, c.T, Ev}, DType::F32, 3).to(dt)};
}

// The fused op on make_inputs' slices, gradients into slices of a sentinel-filled buffer.
Outcome run_heads(const Case& c, int threads, const AttentionOptions& opts, DType dt = DType::F32,
                  const Switches& sw = {}) {
  Context ctx = make_context(threads, sw);
  const int64_t E = c.H * c.D, Ev = c.H * c.Dv;
  const auto [q, k, v, dout] = make_inputs(c, dt);
  AttentionResult r = detail::multi_head_attention_forward(ctx, q, k, v, c.H, opts);
  Tensor gq = Tensor::full({c.B, c.T, E + 2}, kSentinel, dt),
         gkv = Tensor::full({c.B, c.S, E + Ev + 2}, kSentinel, dt);
  Tensor dq = gq.slice(2, 1, 1 + E), dk = gkv.slice(2, 1, 1 + E),
         dv = gkv.slice(2, 1 + E, 1 + E + Ev);
  detail::multi_head_attention_backward(ctx, dout, q, k, v, r, c.H, opts, dq, dk, dv);
  // Guards: the columns around the slices keep the sentinel.
  for (const Tensor* buf : {&gq, &gkv})
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t l = 0; l < buf->dim(1); ++l) {
        EXPECT_EQ(buf->at({b, l, 0}), kSentinel);
        EXPECT_EQ(buf->at({b, l, buf->dim(2) - 1}), kSentinel);
      }
  return {r.output, r.logsumexp, dq, dk, dv};
}

// d2l's copying path on make_inputs' values: split the heads, sdpa on ctx's backend, merge.
Outcome run_split_sdpa(Context& ctx, const Case& c, const AttentionOptions& opts, DType dt) {
  const Inputs in = make_inputs(c, dt);
  const Tensor q = split_heads(in.q, c.H), k = split_heads(in.k, c.H), v = split_heads(in.v, c.H);
  AttentionResult r = scaled_dot_product_attention(ctx, q, k, v, opts);
  const Tensor dout = split_heads(in.dout, c.H);
  AttentionGrads g = scaled_dot_product_attention_backward(ctx, dout, q, k, v, r, opts);
  return {merge_heads(r.output, c.H), r.logsumexp, merge_heads(g.dq, c.H), merge_heads(g.dk, c.H),
          merge_heads(g.dv, c.H)};
}

// The copying path on the same values: split, sdpa on kCpu (the fused kernel), merge.
Outcome run_split(const Case& c, int threads, const AttentionOptions& heads_opts,
                  DType dt = DType::F32, const Switches& sw = {}) {
  Context ctx = make_context(threads, sw);
  ctx.backend = Backend::kCpu;
  AttentionOptions opts = heads_opts;
  opts.mask.lens_repeat = c.H;
  return run_split_sdpa(ctx, c, opts, dt);
}

// The case's mask, masked-row policy and dropout, in training mode.
AttentionOptions case_options(const Case& c) {
  AttentionOptions opts;
  opts.mask.valid_lens = testing::case_valid_lens_tensor(c);
  opts.mask.causal = c.causal;
  opts.mask.masked_rows = c.zero_rows ? MaskedRowPolicy::kZero : MaskedRowPolicy::kUniform;
  opts.dropout = c.dropout;
  opts.training = true;
  return opts;
}

class MhaHeadsOp : public ::testing::TestWithParam<Case> {};

TEST_P(MhaHeadsOp, BitwiseEqualToCopyingPathOnEveryTargetAndThreadCount) {
  const Case c = GetParam();
  const AttentionOptions opts = case_options(c);
  for (int64_t target : cpu::flash_attention_targets()) {
    const Switches sw{target, false};
    const Outcome want = run_split(c, 1, opts, DType::F32, sw);
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(cpu::flash_attention_target_name(target)) + " threads " +
                   std::to_string(threads));
      const Outcome got = run_heads(c, threads, opts, DType::F32, sw);
      EXPECT_TRUE(bitwise_equal(got.out, want.out)) << max_abs_diff(got.out, want.out);
      EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
      EXPECT_TRUE(bitwise_equal(got.dq, want.dq)) << max_abs_diff(got.dq, want.dq);
      EXPECT_TRUE(bitwise_equal(got.dk, want.dk)) << max_abs_diff(got.dk, want.dk);
      EXPECT_TRUE(bitwise_equal(got.dv, want.dv)) << max_abs_diff(got.dv, want.dv);
    }
  }
}

// bfloat16 q, k, v (kernels/cpu/flash_bf16 with head strides): the native AVX512-BF16 kernels
// where the CPU has them and the fp32 conversion fallback, 1 and 2 threads.
TEST_P(MhaHeadsOp, Bf16BitwiseEqualToCopyingPath) {
  const Case c = GetParam();
  const AttentionOptions opts = case_options(c);
  for (bool fallback : {false, true}) {
    const Switches sw{0, fallback};
    const Outcome want = run_split(c, 1, opts, DType::BF16, sw);
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(fallback ? "fallback" : "native if available") + " threads " +
                   std::to_string(threads));
      const Outcome got = run_heads(c, threads, opts, DType::BF16, sw);
      EXPECT_EQ(got.out.dtype(), DType::BF16);
      EXPECT_TRUE(bitwise_equal(got.out, want.out)) << max_abs_diff(got.out, want.out);
      EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
      EXPECT_TRUE(bitwise_equal(got.dq, want.dq)) << max_abs_diff(got.dq, want.dq);
      EXPECT_TRUE(bitwise_equal(got.dk, want.dk)) << max_abs_diff(got.dk, want.dk);
      EXPECT_TRUE(bitwise_equal(got.dv, want.dv)) << max_abs_diff(got.dv, want.dv);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MhaHeadsOp, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& tp) { return tp.param.name(); });

// The dropout bits the forward records for the backward cost B T S / 8 bytes; past the memory
// of q, k, v and the output (here T = S = 1024 with D = 2) they are not kept, and the backward
// draws the mask again: the same results either way.
TEST(MhaHeadsOp, DropoutBitsAreKeptOnlyWithinTheActivationsMemory) {
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Case c{1, 1024, 1024, 2, 2, Lens::kNone, false, false, 0.3f, /*layout=*/0, /*H=*/1};
    const AttentionOptions opts = case_options(c);
    Context ctx = make_context(2, {});
    const auto [q, k, v, dout] = make_inputs(c, dt);
    const AttentionResult r = detail::multi_head_attention_forward(ctx, q, k, v, c.H, opts);
    EXPECT_FALSE(r.dropout_keep.defined());
    const Outcome got = run_heads(c, 2, opts, dt);
    const Outcome want = run_split(c, 1, opts, dt);
    EXPECT_TRUE(bitwise_equal(got.out, want.out));
    EXPECT_TRUE(bitwise_equal(got.dq, want.dq)) << max_abs_diff(got.dq, want.dq);
    EXPECT_TRUE(bitwise_equal(got.dk, want.dk)) << max_abs_diff(got.dk, want.dk);
    EXPECT_TRUE(bitwise_equal(got.dv, want.dv)) << max_abs_diff(got.dv, want.dv);
  }
}

// Long rows (T * (D + Dv) > 2^20 floats) make the backward pack q and dO per query tile instead
// of once per item (flash_attention.cpp, PackWholeRows); both against the reference kernels.
TEST(MhaHeadsOp, PerTileAndWholeRowPackingMatchTheReference) {
  for (int64_t T : {int64_t{300}, int64_t{8200}}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const Case c{1, T, 40, 64, 64, Lens::kNone, true, false, 0.0f, /*layout=*/0, /*H=*/2};
    AttentionOptions opts;
    opts.mask.causal = true;
    const Outcome got = run_heads(c, 2, opts);
    AttentionOptions ref_opts = opts;
    ref_opts.mask.lens_repeat = c.H;
    Context ctx;
    ctx.backend = Backend::kReference;
    const Outcome want_all = run_split_sdpa(ctx, c, ref_opts, DType::F32);
    EXPECT_TRUE(testing::close(got.out, want_all.out, 2e-6, 2e-6));
    for (auto [got_g, want] :
         {std::pair{got.dq, want_all.dq}, {got.dk, want_all.dk}, {got.dv, want_all.dv}})
      EXPECT_TRUE(testing::close(got_g, want, 0.0, 1e-5 * max_abs(want)));
  }
}

TEST(MhaHeadsOp, RejectsBadInput) {
  Context ctx;
  const Tensor q = random_tensor({2, 5, 12}, DType::F32), k = random_tensor({2, 7, 12}, DType::F32);
  AttentionOptions opts;
  EXPECT_THROW(detail::multi_head_attention_forward(ctx, q, k, k, 5, opts), Error);  // 12 % 5
  EXPECT_THROW(detail::multi_head_attention_forward(ctx, q, k.slice(1, 0, 6), k, 3, opts), Error);
  const Tensor strided = random_tensor({2, 5, 12, 2}, DType::F32).select(3, 0);  // stride 2
  EXPECT_THROW(detail::multi_head_attention_forward(ctx, strided, k, k, 3, opts), Error);
  opts.need_weights = true;
  EXPECT_THROW(detail::multi_head_attention_forward(ctx, q, k, k, 3, opts), Error);
}

// ----------------------------------------------------------------------------------------------
// Module level

struct ModuleRun {
  Tensor out, dX;
  std::vector<Tensor> param_grads;
  bool weights_defined;
};

// kD2l: need_weights = true (d2l's default, the reference kernels); kFused: need_weights = false
// on forward(X, X, X), which also packs the three projections into one; kSeparate: the same on
// three distinct copies of X (three projections); kSelfGrad: kFused with
// self_attention_input_grad (the full dX in dqueries).
enum class Path { kD2l, kFused, kSeparate, kSelfGrad };

ModuleRun run_module(Path path, int threads, bool causal, const Tensor& lens,
                     Shape shape = {2, 37, 48}, int64_t heads = 4) {
  Context ctx;
  ctx.threads = threads;
  nn::MultiHeadAttention mha(shape[2], heads, 0.0, /*bias=*/true, DType::F32, /*seed=*/5);
  mha.attention.need_weights = path == Path::kD2l;
  mha.attention.causal = causal;
  mha.self_attention_input_grad = path == Path::kSelfGrad;
  const Tensor X = random_tensor(shape, DType::F32, 7);
  const Tensor dout = random_tensor(shape, DType::F32, 8);
  ModuleRun r;
  r.out = path == Path::kSeparate ? mha.forward(ctx, X, X.clone(), X.clone(), lens)
                                  : mha.forward(ctx, X, X, X, lens);
  r.weights_defined = mha.attention_weights().defined();
  nn::AttentionInputGrads g = mha.backward(ctx, dout);
  if (path == Path::kSelfGrad) {
    EXPECT_FALSE(g.dkeys.defined());
    EXPECT_FALSE(g.dvalues.defined());
    r.dX = g.dqueries;
  } else {
    r.dX = Tensor::empty(X.shape());
    for (int64_t i = 0; i < X.numel(); ++i)
      r.dX.set_flat(i, g.dqueries.flat(i) + g.dkeys.flat(i) + g.dvalues.flat(i));
  }
  for (auto& [name, p] : mha.named_parameters())
    r.param_grads.push_back(p->grad);
  return r;
}

// |got - want| <= tol * max(max|want|, floor) everywhere. The floor matters for W_k.bias: its
// gradient is exactly 0 in exact arithmetic (softmax ignores a shift q . b_k common to all keys),
// so both sides hold rounding noise of the size of the other weight gradients.
::testing::AssertionResult close_scaled(const Tensor& got, const Tensor& want, double tol,
                                        double floor = 0.0) {
  return testing::close(got, want, 0.0, tol * std::max({max_abs(want), floor, 1e-30}));
}

TEST(MhaHeadsModule, FusedPathMatchesD2lPathAndIsThreadCountInvariant) {
  const std::vector<Tensor> lens_options = {
      Tensor(), Tensor::from_vector(std::vector<int64_t>{20, 37}, {2}),
      Tensor::from_vector(std::vector<int64_t>(74, 9), {2, 37})};
  for (const Tensor& lens : lens_options)
    for (bool causal : {false, true}) {
      SCOPED_TRACE(std::string("lens ") + (lens.defined() ? shape_str(lens.shape()) : "none") +
                   (causal ? " causal" : ""));
      const ModuleRun ref = run_module(Path::kD2l, 1, causal, lens);
      EXPECT_TRUE(ref.weights_defined);
      double grad_scale = 0;
      for (const Tensor& g : ref.param_grads)
        grad_scale = std::max(grad_scale, max_abs(g));
      for (Path path : {Path::kFused, Path::kSeparate, Path::kSelfGrad}) {
        SCOPED_TRACE("path " + std::to_string(int(path)));
        const ModuleRun one = run_module(path, 1, causal, lens);
        const ModuleRun two = run_module(path, 2, causal, lens);
        EXPECT_FALSE(one.weights_defined);
        EXPECT_TRUE(testing::close(one.out, ref.out, 2e-6, 2e-6));
        EXPECT_TRUE(close_scaled(one.dX, ref.dX, 1e-5));
        ASSERT_EQ(one.param_grads.size(), ref.param_grads.size());
        for (size_t i = 0; i < ref.param_grads.size(); ++i)
          EXPECT_TRUE(close_scaled(one.param_grads[i], ref.param_grads[i], 1e-5, grad_scale)) << i;
        EXPECT_TRUE(bitwise_equal(one.out, two.out));
        EXPECT_TRUE(bitwise_equal(one.dX, two.dX));
        for (size_t i = 0; i < one.param_grads.size(); ++i)
          EXPECT_TRUE(bitwise_equal(one.param_grads[i], two.param_grads[i])) << i;
      }
    }
}

// The benchmark's shape class (E = 512, H = 8; T shortened): 1 and 2 threads agree bit for bit
// through oneDNN's projections (whose weight-gradient product may split its contraction by
// thread count on other shapes, kernels/cpu/matmul.hpp) and the fused kernel.
TEST(MhaHeadsModule, BenchmarkShapeIsThreadCountInvariant) {
  for (Path path : {Path::kFused, Path::kSelfGrad}) {
    const ModuleRun one = run_module(path, 1, false, {}, {4, 256, 512}, 8);
    const ModuleRun two = run_module(path, 2, false, {}, {4, 256, 512}, 8);
    EXPECT_TRUE(bitwise_equal(one.out, two.out));
    EXPECT_TRUE(bitwise_equal(one.dX, two.dX));
    for (size_t i = 0; i < one.param_grads.size(); ++i)
      EXPECT_TRUE(bitwise_equal(one.param_grads[i], two.param_grads[i])) << i;
  }
}

// A forward that keeps weights after one that took the fused path (and the other way round):
// attention_weights() follows the latest forward.
TEST(MhaHeadsModule, AttentionWeightsFollowTheLatestForward) {
  Context ctx;
  nn::MultiHeadAttention mha(16, 2, 0.0, false, DType::F32, 1);
  const Tensor X = random_tensor({1, 5, 16}, DType::F32, 2);
  mha.forward(ctx, X, X, X);
  ASSERT_TRUE(mha.attention_weights().defined());
  EXPECT_EQ(mha.attention_weights().shape(), Shape({2, 5, 5}));
  mha.attention.need_weights = false;
  mha.forward(ctx, X, X, X);
  EXPECT_FALSE(mha.attention_weights().defined());
  mha.attention.need_weights = true;
  mha.forward(ctx, X, X, X);
  EXPECT_TRUE(mha.attention_weights().defined());
}

// A self-attention forward creates W_q, W_k and W_v as row slices of one stacked tensor (values,
// gradients, biases), read in place by the packed projection and summed into in place by its
// backward. Against a twin whose three layers were created apart before its first forward (so
// copied per forward, as before the stacking): the same bits through forward, backward and three
// AdamW steps, in float32, under bf16 autocast and in a bfloat16 module, with and without bias.
TEST(MhaHeadsModule, StackedProjectionsChangeNoBit) {
  struct Variant {
    DType dtype;
    bool autocast, bias;
  };
  for (const Variant v : {Variant{DType::F32, false, true}, Variant{DType::F32, false, false},
                          Variant{DType::F32, true, true}, Variant{DType::BF16, false, true}}) {
    SCOPED_TRACE(std::string(dtype_name(v.dtype)) + (v.autocast ? " autocast" : "") +
                 (v.bias ? " bias" : ""));
    Context ctx;
    ctx.threads = 2;
    ctx.autocast_bf16 = v.autocast;
    const int64_t E = 32;
    nn::MultiHeadAttention stacked(E, 4, 0.0, v.bias, v.dtype, 7),
        apart(E, 4, 0.0, v.bias, v.dtype, 7);
    for (nn::Linear* l : {&apart.W_q, &apart.W_k, &apart.W_v})
      l->materialize(24, "test");
    stacked.attention.need_weights = apart.attention.need_weights = false;  // the fused path
    const Tensor lens = Tensor::from_vector(std::vector<int64_t>{9, 40}, {2});
    nn::AdamW opt_s(stacked.named_parameters()), opt_a(apart.named_parameters());
    for (int step = 0; step < 3; ++step) {
      const Tensor X = random_tensor({2, 40, 24}, v.dtype, 11 + static_cast<uint64_t>(step));
      const Tensor dY = random_tensor({2, 40, E}, v.dtype, 21 + static_cast<uint64_t>(step));
      const Tensor ys = stacked.forward(ctx, X, X, X, lens), ya = apart.forward(ctx, X, X, X, lens);
      if (step == 0) {
        // Stacked: W_k's rows follow W_q's in memory; apart: three allocations.
        const auto* q = static_cast<const std::byte*>(stacked.W_q.weight.value.raw_data());
        EXPECT_EQ(stacked.W_k.weight.value.raw_data(), q + E * 24 * dtype_size(v.dtype));
        EXPECT_NE(apart.W_k.weight.value.raw_data(),
                  static_cast<const std::byte*>(apart.W_q.weight.value.raw_data()) +
                      E * 24 * dtype_size(v.dtype));
      }
      EXPECT_TRUE(bitwise_equal(ys, ya)) << "step " << step;
      opt_s.zero_grad();
      opt_a.zero_grad();
      const nn::AttentionInputGrads gs = stacked.backward(ctx, dY), ga = apart.backward(ctx, dY);
      EXPECT_TRUE(bitwise_equal(gs.dqueries, ga.dqueries)) << "step " << step;
      const auto ps = stacked.named_parameters(), pa = apart.named_parameters();
      ASSERT_EQ(ps.size(), pa.size());
      for (size_t i = 0; i < ps.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(ps[i].second->grad, pa[i].second->grad)) << ps[i].first;
        EXPECT_TRUE(bitwise_equal(ps[i].second->value, pa[i].second->value)) << ps[i].first;
      }
      opt_s.step();
      opt_a.step();
    }
  }
}

// After a caller replaces one stacked parameter (its value or its gradient tensor), the module
// reads the new value and adds into the new gradient: the stack is no longer used. A load keeps
// the stack (values are copied in place).
TEST(MhaHeadsModule, ReplacedParametersLeaveTheStack) {
  Context ctx;
  const int64_t E = 16;
  nn::MultiHeadAttention mha(E, 2, 0.0, true, DType::F32, 3), twin(E, 2, 0.0, true, DType::F32, 3);
  for (nn::Linear* l : {&twin.W_q, &twin.W_k, &twin.W_v})
    l->materialize(E, "test");
  mha.attention.need_weights = twin.attention.need_weights = false;
  const Tensor X = random_tensor({1, 6, E}, DType::F32, 4),
               dY = random_tensor({1, 6, E}, DType::F32, 5);
  mha.forward(ctx, X, X, X);  // stacks
  twin.forward(ctx, X, X, X);
  ASSERT_EQ(mha.W_k.weight.value.raw_data(),
            static_cast<const std::byte*>(mha.W_q.weight.value.raw_data()) + E * E * 4);
  // A load copies into the stacked slices: both modules then hold the loaded values.
  const Tensor loaded = random_tensor({E, E}, DType::F32, 6);
  for (nn::MultiHeadAttention* m : {&mha, &twin}) {
    nn::StateDict dict = m->state_dict();
    dict["W_v.weight"] = loaded;
    m->load_state_dict(dict);
  }
  EXPECT_TRUE(bitwise_equal(mha.forward(ctx, X, X, X), twin.forward(ctx, X, X, X)));
  // Replaced tensors.
  for (nn::MultiHeadAttention* m : {&mha, &twin}) {
    m->W_k.weight.value = random_tensor({E, E}, DType::F32, 7);
    m->W_q.weight.grad = Tensor::zeros({E, E}, DType::F32);
    m->W_v.bias.grad = Tensor::zeros({E}, DType::F32);
  }
  EXPECT_TRUE(bitwise_equal(mha.forward(ctx, X, X, X), twin.forward(ctx, X, X, X)));
  for (nn::MultiHeadAttention* m : {&mha, &twin})
    m->zero_grad();
  mha.backward(ctx, dY);
  twin.backward(ctx, dY);
  const auto pm = mha.named_parameters(), pt = twin.named_parameters();
  for (size_t i = 0; i < pm.size(); ++i)
    EXPECT_TRUE(bitwise_equal(pm[i].second->grad, pt[i].second->grad)) << pm[i].first;
  double sum = 0;
  for (int64_t i = 0; i < E * E; ++i)
    sum += std::abs(mha.W_q.weight.grad.flat(i));
  EXPECT_GT(sum, 0.0);  // the new gradient tensor received the sum
}

}  // namespace
}  // namespace attn
