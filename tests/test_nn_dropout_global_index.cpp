// Dropout masks follow the global sample (Context::dropout_first_sample, attn/core/rng.hpp): a
// batch cut into shards, each run with its first sample's global index as the Context's sample
// window, gives bit for bit the outputs and input gradients of the whole batch, at every dropout
// site: the dropout op (SIMD and reference), scaled dot-product attention (fused fp32, fused
// bf16 native and through its fp32 fallback, the reference with and without kept weights),
// MultiHeadAttention (fused heads path and d2l's head copies, fp32 and bf16) and a Transformer
// encoder block. This is what lets N data-parallel ranks train the 1-rank model with dropout
// (tests/mpi/test_mpi_trainer.cpp). Parameter gradients are sums over samples, so the shards'
// sum matches the whole batch's up to float32 rounding, not bitwise.
#include "attn/core/context.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/dropout.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attn {
namespace {

using testing::random_tensor;

constexpr uint64_t kOffset = 11;  // the stream offset every run starts from

// Sample windows [lo, hi) of a batch of 5: uneven, so that some index bases are not multiples
// of 4 (the SIMD draws' block size).
const std::vector<std::pair<int64_t, int64_t>> kShards = {{0, 1}, {1, 3}, {3, 5}};
constexpr int64_t kB = 5;

Tensor rows(const Tensor& t, int64_t lo, int64_t hi) {
  return t.slice(0, lo, hi).contiguous();
}

::testing::AssertionResult same_bits(const Tensor& shard, const Tensor& whole, int64_t lo,
                                     int64_t hi) {
  return testing::close(shard, rows(whole, lo, hi), 0.0, 0.0);
}

// Runs `run` on the whole batch (window 0) and on each shard (window lo), each from kOffset.
// `run(ctx, lo, hi)` returns the tensors to compare, each with the batch as outermost axis.
void expect_shards_match(
    Context ctx, const std::function<std::vector<Tensor>(Context&, int64_t, int64_t)>& run) {
  ctx.set_dropout_offset(kOffset);
  ctx.dropout_first_sample = 0;
  const std::vector<Tensor> whole = run(ctx, 0, kB);
  for (const auto& [lo, hi] : kShards) {
    ctx.set_dropout_offset(kOffset);
    ctx.dropout_first_sample = static_cast<uint64_t>(lo);
    const std::vector<Tensor> shard = run(ctx, lo, hi);
    ASSERT_EQ(shard.size(), whole.size());
    for (size_t i = 0; i < shard.size(); ++i)
      EXPECT_TRUE(same_bits(shard[i], whole[i], lo, hi))
          << "tensor " << i << " of shard [" << lo << ", " << hi << ")";
  }
  // Without the window the second shard draws the first samples' masks: different bits.
  ctx.set_dropout_offset(kOffset);
  ctx.dropout_first_sample = 0;
  const std::vector<Tensor> local = run(ctx, 1, 3);
  EXPECT_FALSE(same_bits(local[0], whole[0], 1, 3)) << "the window made no difference";
}

// ---------------------------------------------------------------------------------------------
// The dropout op

void check_dropout_op(Backend backend, DType dtype) {
  Context ctx;
  ctx.backend = backend;
  ctx.seed = 3;
  // 13 * 11 = 143 elements per sample: shards start at stream indices that are not multiples
  // of 4, and are long enough for the SIMD loop.
  const Tensor x = random_tensor({kB, 13, 11}, dtype, 1);
  const Tensor dy = random_tensor({kB, 13, 11}, dtype, 2);
  expect_shards_match(ctx, [&](Context& c, int64_t lo, int64_t hi) {
    const uint64_t off = c.next_dropout_offset();
    return std::vector<Tensor>{dropout(c, rows(x, lo, hi), 0.4, c.seed, off),
                               dropout_backward(c, rows(dy, lo, hi), 0.4, c.seed, off)};
  });
}

TEST(DropoutGlobalIndex, DropoutOpSimd) {
  check_dropout_op(Backend::kCpu, DType::F32);
}

TEST(DropoutGlobalIndex, DropoutOpReference) {
  check_dropout_op(Backend::kReference, DType::F32);
  check_dropout_op(Backend::kReference, DType::F64);
}

TEST(DropoutGlobalIndex, DefaultWindowIsTheSingleProcessStream) {
  // Base 0: the Context op draws what the Context-free op (always the single-process stream)
  // draws, so single-process masks are unchanged.
  Context ctx;
  ctx.seed = 9;
  const Tensor x = random_tensor({3, 37}, DType::F32, 4);
  EXPECT_TRUE(testing::close(dropout(ctx, x, 0.3, 9, 5), dropout(x, 0.3, 9, 5), 0.0, 0.0));
}

// ---------------------------------------------------------------------------------------------
// Scaled dot-product attention

struct SdpaCase {
  DType dtype = DType::F32;
  Backend backend = Backend::kAuto;
  bool need_weights = false;
  bool force_bf16_fallback = false;
  int64_t T = 7, S = 12, D = 8;
  bool causal = false;
};

void check_sdpa(const SdpaCase& c) {
  Context ctx;
  ctx.seed = 21;
  ctx.threads = 1;
  ctx.backend = c.backend;
  ctx.force_bf16_fallback = c.force_bf16_fallback;
  const Tensor q = random_tensor({kB, c.T, c.D}, DType::F32, 1).to(c.dtype);
  const Tensor k = random_tensor({kB, c.S, c.D}, DType::F32, 2).to(c.dtype);
  const Tensor v = random_tensor({kB, c.S, c.D}, DType::F32, 3).to(c.dtype);
  const Tensor dout = random_tensor({kB, c.T, c.D}, DType::F32, 4).to(c.dtype);
  std::vector<int64_t> len_values;
  for (int64_t b = 0; b < kB; ++b)
    len_values.push_back(b == 2 ? 0 : (b * 5) % c.S + 1);  // a fully masked batch row too
  const Tensor lens = Tensor::from_vector(len_values, {kB});
  expect_shards_match(ctx, [&](Context& cx, int64_t lo, int64_t hi) {
    AttentionOptions o;
    o.dropout = 0.3;
    o.training = true;
    o.need_weights = c.need_weights;
    o.mask.causal = c.causal;
    o.mask.valid_lens = rows(lens, lo, hi);
    const Tensor qs = rows(q, lo, hi), ks = rows(k, lo, hi), vs = rows(v, lo, hi);
    const AttentionResult r = scaled_dot_product_attention(cx, qs, ks, vs, o);
    const AttentionGrads g =
        scaled_dot_product_attention_backward(cx, rows(dout, lo, hi), qs, ks, vs, r, o);
    return std::vector<Tensor>{r.output, g.dq, g.dk, g.dv};
  });
}

TEST(DropoutGlobalIndex, SdpaFusedFp32) {
  for (int64_t S : {12, 13, 70})  // vectorized draws across queries (S % 4 == 0) and scalar ones
    for (bool causal : {false, true})
      check_sdpa({DType::F32, Backend::kAuto, false, false, 9, S, 8, causal});
}

TEST(DropoutGlobalIndex, SdpaFusedBf16) {
  for (bool fallback : {false, true})
    for (int64_t S : {12, 13, 70})
      check_sdpa({DType::BF16, Backend::kAuto, false, fallback, 9, S, 8, false});
}

TEST(DropoutGlobalIndex, SdpaReference) {
  for (DType dt : {DType::F32, DType::F64, DType::BF16})
    check_sdpa({dt, Backend::kReference, false, false, 7, 13, 8, false});
  // Kept weights on kAuto: the reference masked softmax and dropout.
  check_sdpa({DType::F32, Backend::kAuto, true, false, 7, 12, 8, false});
}

// ---------------------------------------------------------------------------------------------
// Modules

// Runs a module's forward and backward on the whole batch and on each shard (a fresh module of
// the same seed each time, so the same parameters); compares outputs and input gradients
// bitwise and the shards' summed parameter gradients with the whole batch's (rounding only).
template <class M>
void check_module(const std::function<std::unique_ptr<M>()>& make, const Tensor& X,
                  const Tensor& lens,
                  const std::function<Tensor(Context&, M&, const Tensor&, const Tensor&)>& fwd,
                  const std::function<Tensor(Context&, M&, const Tensor&)>& bwd,
                  bool param_grads = true) {
  Context ctx;
  ctx.seed = 17;
  ctx.threads = 1;
  const Tensor dout = random_tensor(X.shape(), DType::F32, 99).to(X.dtype());
  auto run = [&](M& m, Context& cx, int64_t lo, int64_t hi) {
    const Tensor out = fwd(cx, m, rows(X, lo, hi), rows(lens, lo, hi));
    const Tensor dX = bwd(cx, m, rows(dout, lo, hi));
    return std::vector<Tensor>{out, dX};
  };
  expect_shards_match(ctx, [&](Context& cx, int64_t lo, int64_t hi) {
    const std::unique_ptr<M> m = make();
    return run(*m, cx, lo, hi);
  });
  if (!param_grads) return;
  const std::unique_ptr<M> whole = make(), sum = make();
  ctx.set_dropout_offset(kOffset);
  ctx.dropout_first_sample = 0;
  run(*whole, ctx, 0, kB);
  for (const auto& [lo, hi] : kShards) {  // the shards' gradients accumulate in `sum`
    ctx.set_dropout_offset(kOffset);
    ctx.dropout_first_sample = static_cast<uint64_t>(lo);
    run(*sum, ctx, lo, hi);
  }
  auto a = sum->named_parameters(), b = whole->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(testing::close(a[i].second->grad, b[i].second->grad, 1e-4, 1e-6)) << a[i].first;
}

void check_mha(DType dtype, bool need_weights, int64_t T) {
  const Tensor X = random_tensor({kB, T, 16}, DType::F32, 5).to(dtype);
  const Tensor lens = Tensor::from_vector(std::vector<int64_t>{3, T, 1, 0, 5}, {kB});
  check_module<nn::MultiHeadAttention>(
      [&] {
        auto m = std::make_unique<nn::MultiHeadAttention>(16, 2, 0.3, /*bias=*/true, dtype, 8);
        m->attention.need_weights = need_weights;
        // dX in one GEMM, as the encoder runs it (the three separate input terms go through a
        // strided-weight GEMM whose rounding depends on the row count, dropout or not).
        m->self_attention_input_grad = true;
        m->train();
        return m;
      },
      X, lens,
      [](Context& c, nn::MultiHeadAttention& m, const Tensor& x, const Tensor& l) {
        return m.forward(c, x, x, x, l);
      },
      [](Context& c, nn::MultiHeadAttention& m, const Tensor& d) {
        return m.backward(c, d).dqueries;  // the whole dX (self_attention_input_grad)
      },
      dtype == DType::F32);
}

TEST(DropoutGlobalIndex, MultiHeadAttentionFusedHeads) {
  for (int64_t T : {6, 8})
    check_mha(DType::F32, /*need_weights=*/false, T);
  check_mha(DType::BF16, false, 8);
}

TEST(DropoutGlobalIndex, MultiHeadAttentionHeadCopies) {
  // need_weights: d2l's (B*H, T, D) head copies through SDPA with lens_repeat = H.
  for (int64_t T : {6, 8})
    check_mha(DType::F32, /*need_weights=*/true, T);
  check_mha(DType::BF16, true, 8);
}

TEST(DropoutGlobalIndex, TransformerEncoderBlock) {
  // Attention weights, both AddNorms' dropout: every dropout site of a block.
  for (bool need_weights : {false, true}) {
    const Tensor X = random_tensor({kB, 8, 16}, DType::F32, 6);
    const Tensor lens = Tensor::from_vector(std::vector<int64_t>{8, 2, 5, 1, 7}, {kB});
    check_module<nn::TransformerEncoderBlock>(
        [&] {
          auto m = std::make_unique<nn::TransformerEncoderBlock>(16, 24, 2, 0.25,
                                                                 /*use_bias=*/true, DType::F32, 4);
          m->attention.attention.need_weights = need_weights;
          m->train();
          return m;
        },
        X, lens,
        [](Context& c, nn::TransformerEncoderBlock& m, const Tensor& x, const Tensor& l) {
          return m.forward(c, x, l);
        },
        [](Context& c, nn::TransformerEncoderBlock& m, const Tensor& d) {
          return m.backward(c, d);
        });
  }
}

}  // namespace
}  // namespace attn
