// The bfloat16 flash kernels (kernels/cpu/flash_bf16) beyond the case table
// (test_attention_cases.cpp, which runs the sweep over sizes, masks, dropout, views and threads on
// every implementation, native and fp32 fallback included): huge logits, long rows, a pack larger
// than the kept buffer, jumping scores, fully masked rows, non-finite inputs, long queries, and the
// ops layer (Backend::kCpu against kReference). The bf16 tolerance model (bounds derived from
// bf16's unit roundoff, computed beside the exact values): tests/attention_bf16_bounds.hpp.
#include "kernels/cpu/flash_bf16.hpp"

#include "attention_bf16_bounds.hpp"
#include "attention_harness.hpp"
#include "attn/core/dtype.hpp"
#include "attn/core/rng.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/cpu/parallel.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace attn::cpu {
namespace {

// Every kernel forks as far as a test asks, whatever the size (kernels/cpu/parallel.hpp), so that
// the thread-count comparisons below run the parallel paths on these small shapes too.
const bool kForkAtAnySize = (attn::cpu::set_min_flops_per_thread(0), true);

constexpr uint16_t kSentinel = testing::kHarnessSentinel<uint16_t>;  // a NaN payload

// Views, guards, cases and key limits: tests/attention_harness.hpp; the bounds:
// tests/attention_bf16_bounds.hpp.
using View = testing::HarnessView<uint16_t>;
using Case = testing::KernelCase;
using testing::guard_damage;
using testing::Lens;
using Problem = testing::KernelProblem<uint16_t>;
using testing::max_abs;
using testing::bf16::check_grads;
using testing::bf16::close_view;
using testing::bf16::kU;
using testing::bf16::native_bound;
using testing::bf16::Reference;
using testing::bf16::reference;

// The paths to test: p.force_bf16_fallback (Context::force_bf16_fallback in the ops) false
// (native, if this CPU has it) and true.
std::vector<bool> modes() {
  if (flash_bf16_native()) return {false, true};
  return {true};
}

// The forward's recorded dropout decisions (FlashBf16Params::dropout_keep), read by the backward
// instead of the stream: the same bits as drawing them again, 1 and 2 threads, two stream bases.
void ExpectKeptDropoutEqualsDrawn(const Case& c, bool fallback) {
  for (const uint64_t base : {uint64_t{0}, uint64_t{12}})  // a data-parallel shard's base
    for (const int threads : {1, 2}) {
      Problem drawn(c), kept(c);
      std::vector<uint16_t> keep(static_cast<size_t>(dropout_keep_words(kept.p)), 0xdead);
      kept.p.dropout_keep = keep.data();
      for (Problem* x : {&drawn, &kept}) {
        x->p.force_bf16_fallback = fallback;
        x->p.threads = threads;
        x->p.dropout_index_base = base;
        flash_attention_forward_bf16(x->p);
        flash_attention_backward_bf16(x->p, x->g);
      }
      SCOPED_TRACE("base " + std::to_string(base) + ", threads " + std::to_string(threads));
      EXPECT_EQ(drawn.out.buf, kept.out.buf);
      EXPECT_EQ(drawn.dq.buf, kept.dq.buf);
      EXPECT_EQ(drawn.dk.buf, kept.dk.buf);
      EXPECT_EQ(drawn.dv.buf, kept.dv.buf);
    }
}

// Logits up to +-1e4 (q, k in [-100, 100], D = 16, scale 1/4): the online softmax subtracts the
// running max, so nothing overflows and no NaN appears; the softmax is then nearly one-hot, so
// out stays inside the range of v and matches the reference. fp32 scores of that size carry
// ~1e4 * 2^-24 * D = 1e-2 absolute error, i.e. weights of near-tied keys may move by ~1e-2.
TEST(FlashBf16, HugeLogitsNeverNaN) {
  for (bool fallback : modes()) {
    for (bool causal : {false, true}) {
      Case c{2, 70, 150, 16, 16, Lens::k2D, causal, false, 0.0f, 0};
      Problem pr(c, 100.0);
      pr.p.force_bf16_fallback = fallback;
      const Reference ref = reference(pr);
      flash_attention_forward_bf16(pr.p);
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < c.T; ++t) {
          EXPECT_FALSE(std::isnan(pr.lse[b * c.T + t]));
          for (int64_t e = 0; e < c.Dv; ++e) {
            const double x = pr.out.at(b, t, e);
            ASSERT_TRUE(std::isfinite(x)) << b << "," << t << "," << e;
            EXPECT_LE(std::abs(x), 1.0);
            EXPECT_NEAR(x, ref.out[(b * c.T + t) * c.Dv + e], 0.05);
          }
        }
    }
  }
}

// A long row spans 47 key tiles: the running sum is rescaled once per tile, so any bias of the
// rescale factor would compound (a 7.5e-5 bias per tile gave 2e-4 in lse after 3 tiles).
TEST(FlashBf16, LongRowsKeepLseAccurate) {
  for (bool fallback : modes()) {
    Case c{1, 20, 3000, 16, 16, Lens::kNone, false, false, 0.0f, 0};
    Problem pr(c, 2.0);
    pr.p.force_bf16_fallback = fallback;
    const Reference ref = reference(pr);
    flash_attention_forward_bf16(pr.p);
    EXPECT_TRUE(close_view("out", pr.out, ref.out, &ref.out_bound, 0.0, 0.0));
    for (int64_t t = 0; t < c.T; ++t)
      EXPECT_NEAR(pr.lse[t], ref.lse[t], 2e-4 + 1e-5 * std::abs(ref.lse[t])) << t;
  }
}

// Packed K and V of 67.6 MB (S = 66000, D = 256) and then a small call: scratch comes from the
// block cache, whose blocks hold what their last user left; stale contents must not leak into a
// later call (tiles of the sweep reuse blocks shape after shape too).
TEST(FlashBf16, PackLargerThanKeptBuffer) {
  for (const Case& c : {Case{1, 3, 66000, 256, 256, Lens::kNone, false, false, 0.0f, 0},
                        Case{2, 5, 70, 256, 256, Lens::kNone, false, false, 0.0f, 0}}) {
    Problem pr(c);
    const Reference ref = reference(pr);
    flash_attention_forward_bf16(pr.p);
    EXPECT_TRUE(close_view("out", pr.out, ref.out, &ref.out_bound, 0.0, 0.0)) << c.name();
  }
}

// Key tiles scaled up and down by turns: the running max jumps at some tiles and stays put at
// others, so the online softmax rescales l and O^T (Exp2Accurate) by factors far from 1, native
// and fallback; one and two threads give the same bits.
TEST(FlashBf16, RisingAndFallingScoresMatchReference) {
  const float gain[] = {1.0f, 1.5f, 6.0f, 0.5f, 1.0f, 12.0f, 2.0f, 0.1f, 20.0f, 1.0f};
  for (bool fallback : modes()) {
    for (bool causal : {false, true}) {
      const Case c{2, 37, 640, 16, 24, Lens::kNone, causal, false, 0.0f, 0};
      Problem pr(c);
      pr.p.force_bf16_fallback = fallback;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t s = 0; s < c.S; ++s)
          for (int64_t d = 0; d < c.D; ++d)
            pr.k.raw(b, s, d) = float_to_bf16(static_cast<float>(pr.k.at(b, s, d)) * 3.0f *
                                              gain[(s / 16 + b) % 10]);
      const Reference ref = reference(pr);
      SCOPED_TRACE(std::string(fallback ? "fallback" : "native") + (causal ? " causal" : ""));
      flash_attention_forward_bf16(pr.p);
      EXPECT_TRUE(close_view("out", pr.out, ref.out, &ref.out_bound, 0.0, 0.0));
      for (int64_t i = 0; i < c.B * c.T; ++i)
        EXPECT_NEAR(pr.lse[i], ref.lse[i], 2e-4 + 1e-5 * std::abs(ref.lse[i]))
            << "lse[" << i << "]";
      Problem pr2(c);
      pr2.p.force_bf16_fallback = fallback;
      pr2.k.buf = pr.k.buf;
      pr2.p.k.data = pr2.k.ptr();
      pr2.p.threads = 2;
      flash_attention_forward_bf16(pr2.p);
      EXPECT_EQ(pr.out.buf, pr2.out.buf);
    }
  }
}

// Every row fully masked: d2l's policy gives the mean of v (weights 1/S, here with dropout),
// PyTorch's gives zeros; lse is -inf; dq and dk are zero.
TEST(FlashBf16, FullyMaskedRows) {
  for (bool fallback : modes()) {
    for (bool zero : {false, true}) {
      Case c{2, 9, 75, 16, 24, Lens::k1D, false, zero, 0.2f, 1};
      Problem pr(c);
      pr.p.force_bf16_fallback = fallback;
      std::fill(pr.key_limit.begin(), pr.key_limit.end(), 0);
      const Reference ref = reference(pr);
      flash_attention_forward_bf16(pr.p);
      flash_attention_backward_bf16(pr.p, pr.g);
      EXPECT_TRUE(close_view("out", pr.out, ref.out, &ref.out_bound, 0.0, 0.0));
      for (float l : pr.lse)
        EXPECT_TRUE(std::isinf(l) && l < 0);
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t d = 0; d < c.D; ++d)
          EXPECT_EQ(pr.dq.at(1, t, d), 0.0);
      EXPECT_TRUE(close_view("dv", pr.dv, ref.dv, nullptr, kU, 1e-5));
    }
  }
}

// A NaN in v or an Inf in k of a key that a query masks never reaches that query (the native
// kernel multiplies masked weights, exact zeros, by whole rows of V); causal: key 20 is masked
// for the rows t < 20, which must stay finite and exact, while rows t >= 20 keep it.
TEST(FlashBf16, NonFiniteMaskedKeysStayOut) {
  for (bool fallback : modes()) {
    for (int64_t S : {100, 21}) {  // 21: the poisoned key is also a pair's padded second half
      Case c{1, 40, S, 32, 32, Lens::kNone, true, false, 0.0f, 0};
      Problem pr(c);
      pr.p.force_bf16_fallback = fallback;
      pr.v.raw(0, 20, 3) = 0x7fc0;  // NaN
      pr.k.raw(0, 20, 5) = 0x7f80;  // +Inf
      const Reference ref = reference(pr);
      flash_attention_forward_bf16(pr.p);
      for (int64_t t = 0; t < 20; ++t)
        for (int64_t e = 0; e < c.Dv; ++e) {
          const int64_t i = t * c.Dv + e;
          ASSERT_TRUE(std::isfinite(pr.out.at(0, t, e))) << t << "," << e;
          EXPECT_NEAR(pr.out.at(0, t, e), ref.out[i], 1.05 * ref.out_bound[i]) << t << "," << e;
        }
      for (int64_t t = 20; t < c.T; ++t)
        EXPECT_FALSE(std::isfinite(pr.out.at(0, t, 3))) << t;  // as the reference: NaN
    }
  }
}

// The native backward packs q and dO once per work item when T (D + Dv) <= 2^21 and per query
// tile beyond (the long-sequence case): T = 8300 with D = Dv = 128 takes the second way. Also
// dropout with S % 4 != 0 and a 2-D length mask.
TEST(FlashBf16, LongQueriesBackward) {
  Case c{1, 8300, 42, 128, 128, Lens::k2D, false, false, 0.2f, 1};
  const Problem ref_pr(c);
  const Reference ref = reference(ref_pr);
  const double gscale = std::max({max_abs(ref.dq), max_abs(ref.dk), max_abs(ref.dv)});
  for (bool fallback : modes()) {
    SCOPED_TRACE(fallback ? "fp32 fallback" : "native AVX512-BF16");
    Problem pr(c);
    pr.p.force_bf16_fallback = fallback;
    flash_attention_forward_bf16(pr.p);
    flash_attention_backward_bf16(pr.p, pr.g);
    check_grads(pr, ref, !fallback, 1e-4 * gscale);
    Problem pr2(c);
    pr2.p.force_bf16_fallback = fallback;
    pr2.p.threads = 2;
    flash_attention_forward_bf16(pr2.p);
    flash_attention_backward_bf16(pr2.p, pr2.g);
    EXPECT_EQ(pr.dq.buf, pr2.dq.buf);
    EXPECT_EQ(pr.dk.buf, pr2.dk.buf);
    EXPECT_EQ(pr.dv.buf, pr2.dv.buf);

    // The forward's recorded dropout decisions, read by the backward instead of the stream.
    if (flash_bf16_keeps_dropout(pr.p)) ExpectKeptDropoutEqualsDrawn(c, fallback);
  }
}

// Backward: a NaN in q or dO of a query reaches only the keys that query keeps, and an Inf in k
// or a NaN in v of a key only the queries that keep it (the products multiply masked weights,
// exact zeros, by whole rows). Causal, so row t keeps keys 0..t. Case 0: q row 5 and dO row 7
// are poisoned, so dq of the other rows and dk, dv of keys >= 8 stay finite. Case 1: k and v of
// key 150 are poisoned, so dq of rows < 150 stays finite. Two query tiles and three key blocks,
// so clean tiles and blocks stay on the fast path beside the poisoned ones.
TEST(FlashBf16, NonFiniteInputsStayOutOfGradients) {
  for (bool fallback : modes()) {
    SCOPED_TRACE(fallback ? "fp32 fallback" : "native AVX512-BF16");
    for (int poison : {0, 1})
      for (int64_t T : {200, 201}) {
        SCOPED_TRACE("case " + std::to_string(poison) + " T " + std::to_string(T));
        Case c{1, T, 170, 32, 24, Lens::kNone, true, false, 0.0f, 0};
        Problem pr(c);
        pr.p.force_bf16_fallback = fallback;
        if (poison == 0) {
          pr.q.raw(0, 5, 3) = 0x7fc0;     // NaN
          pr.dout.raw(0, 7, 2) = 0x7fc0;  // NaN
        } else {
          pr.k.raw(0, 150, 4) = 0x7f80;  // +Inf
          pr.v.raw(0, 150, 1) = 0x7fc0;  // NaN
        }
        const Reference ref = reference(pr);
        flash_attention_forward_bf16(pr.p);
        flash_attention_backward_bf16(pr.p, pr.g);
        const std::vector<double> bq = native_bound(&ref.dq_bound, ref.dq_abs);
        const std::vector<double> bk = native_bound(&ref.dk_bound, ref.dk_abs);
        const std::vector<double> bv = native_bound(nullptr, ref.dv_abs);
        const int64_t rows = poison == 0 ? T : 150, keys_from = poison == 0 ? 8 : c.S;
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t d = 0; d < c.D; ++d) {
            const int64_t i = t * c.D + d;
            if (poison == 0 && (t == 5 || t == 7)) continue;  // their own inputs are NaN
            ASSERT_TRUE(std::isfinite(pr.dq.at(0, t, d))) << "dq " << t << "," << d;
            EXPECT_NEAR(pr.dq.at(0, t, d), ref.dq[i],
                        kU * std::abs(ref.dq[i]) + 1.05 * bq[i] + 1e-4)
                << "dq " << t << "," << d;
          }
        for (int64_t s = keys_from; s < c.S; ++s) {
          for (int64_t d = 0; d < c.D; ++d) {
            const int64_t i = s * c.D + d;
            ASSERT_TRUE(std::isfinite(pr.dk.at(0, s, d))) << "dk " << s << "," << d;
            EXPECT_NEAR(pr.dk.at(0, s, d), ref.dk[i],
                        kU * std::abs(ref.dk[i]) + 1.05 * bk[i] + 1e-4)
                << "dk " << s << "," << d;
          }
          for (int64_t e = 0; e < c.Dv; ++e) {
            const int64_t i = s * c.Dv + e;
            ASSERT_TRUE(std::isfinite(pr.dv.at(0, s, e))) << "dv " << s << "," << e;
            EXPECT_NEAR(pr.dv.at(0, s, e), ref.dv[i],
                        kU * std::abs(ref.dv[i]) + 1.05 * bv[i] + 1e-4)
                << "dv " << s << "," << e;
          }
        }
      }
  }
}

// ---- Through the ops layer -------------------------------------------------------------------

Tensor bf16_slice(const Shape& wide, int64_t lo, int64_t hi, uint64_t seed) {
  return testing::random_tensor(wide, DType::F32, seed).to(DType::BF16).slice(2, lo, hi);
}

TEST(FlashBf16, OpsCpuMatchesReferenceBackend) {
  struct OpsCase {
    int64_t B, T, S, D, Dv;
    int lens;
    bool causal, zero_rows, need_weights;
    double dropout;
  };
  const OpsCase cases[] = {
      {2, 70, 130, 16, 16, 0, false, false, true, 0.0},
      {3, 97, 65, 33, 20, 1, false, false, false, 0.0},
      {2, 50, 50, 64, 64, 2, true, false, false, 0.2},
      {2, 40, 90, 24, 8, 2, false, true, true, 0.0},
      {1, 200, 200, 128, 128, 0, true, true, false, 0.1},
  };
  for (bool fallback : modes()) {
    for (const OpsCase& c : cases) {
      SCOPED_TRACE("B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " S" +
                   std::to_string(c.S) + " D" + std::to_string(c.D) +
                   (fallback ? " fallback" : " native"));
      const Tensor q = bf16_slice({c.B, c.T, 3 * c.D}, c.D, 2 * c.D, 11);
      const Tensor k = bf16_slice({c.B, c.S, 3 * c.D}, 2 * c.D, 3 * c.D, 12);
      const Tensor v = bf16_slice({c.B, c.S, 3 * c.Dv}, c.Dv, 2 * c.Dv, 13);
      const Tensor dout = testing::random_tensor({c.B, c.T, c.Dv}, DType::F32, 14).to(DType::BF16);
      AttentionOptions o;
      if (c.lens == 1) {
        std::vector<int64_t> lens;
        for (int64_t b = 0; b < c.B; ++b)
          lens.push_back(b == 0 ? 0 : (b * 37) % (c.S + 5));
        o.mask.valid_lens = Tensor::from_vector(lens, {c.B});
      } else if (c.lens == 2) {
        o.mask.valid_lens = testing::random_tensor({c.B, c.T}, DType::F32, 15, -2.0, c.S + 3.0);
      }
      o.mask.causal = c.causal;
      o.mask.masked_rows = c.zero_rows ? MaskedRowPolicy::kZero : MaskedRowPolicy::kUniform;
      o.need_weights = c.need_weights;
      o.dropout = c.dropout;
      o.training = c.dropout > 0;
      Context ref_ctx, cpu_ctx;
      cpu_ctx.force_bf16_fallback = fallback;
      ref_ctx.backend = Backend::kReference;
      cpu_ctx.backend = Backend::kCpu;
      cpu_ctx.threads = 2;
      ref_ctx.seed = cpu_ctx.seed = 77;
      const AttentionResult r = scaled_dot_product_attention(ref_ctx, q, k, v, o);
      const AttentionResult f = scaled_dot_product_attention(cpu_ctx, q, k, v, o);
      EXPECT_EQ(f.output.dtype(), DType::BF16);
      EXPECT_EQ(r.output.dtype(), DType::BF16);
      EXPECT_EQ(f.logsumexp.dtype(), DType::F32);
      EXPECT_EQ(r.dropout_offset, f.dropout_offset);
      // Both are bf16 roundings of values within the kernel bound (|out| <= max|v| = 1, weights'
      // error <= u sum P Z |v| <= u / (1 - p)): 2 u (1 + 1/(1 - p)) covers both roundings.
      const double tol = 2 * kU * (1 + 1 / (1 - c.dropout));
      EXPECT_TRUE(testing::close(f.output, r.output, 0, tol));
      for (int64_t i = 0; i < r.logsumexp.numel(); ++i) {
        const double want = r.logsumexp.flat(i), got = f.logsumexp.flat(i);
        if (std::isinf(want)) {
          EXPECT_EQ(got, want) << "lse " << i;
        } else {
          EXPECT_NEAR(got, want, 2e-4 + 1e-5 * std::abs(want)) << "lse " << i;
        }
      }
      if (c.need_weights) {
        EXPECT_EQ(f.weights.dtype(), DType::F32);
        EXPECT_TRUE(testing::close(f.weights, r.weights, 2e-6, 2e-6));
      }
      const AttentionGrads gr = scaled_dot_product_attention_backward(ref_ctx, dout, q, k, v, r, o);
      const AttentionGrads gf = scaled_dot_product_attention_backward(cpu_ctx, dout, q, k, v, f, o);
      EXPECT_EQ(gf.dq.dtype(), DType::BF16);
      EXPECT_EQ(gr.dk.dtype(), DType::BF16);
      double scale = 1e-30;
      for (const Tensor* t : {&gr.dq, &gr.dk, &gr.dv})
        for (int64_t i = 0; i < t->numel(); ++i)
          scale = std::max(scale, std::abs(t->flat(i)));
      // bf16 rounding of each (2 u relative) plus the out-error term of the header, which the
      // random dO keeps below ~1e-2 of the largest gradient at these sizes.
      EXPECT_TRUE(testing::close(gf.dq, gr.dq, 2 * kU, 2e-2 * scale));
      EXPECT_TRUE(testing::close(gf.dk, gr.dk, 2 * kU, 2e-2 * scale));
      // dv: both roundings (2 u relative), and the native kernel's bf16 weights: per element
      // (u + 5e-4) sum_t P Z |dO| (the sweep's header), P from the reference's weights and
      // Z <= 1 / (1 - p).
      o.need_weights = true;
      const AttentionResult rw = scaled_dot_product_attention(ref_ctx, q, k, v, o);
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t s = 0; s < c.S; ++s)
          for (int64_t e = 0; e < c.Dv; ++e) {
            double adv = 0;
            for (int64_t t = 0; t < c.T; ++t)
              adv += rw.weights.flat((b * c.T + t) * c.S + s) *
                     std::abs(dout.flat((b * c.T + t) * c.Dv + e));
            adv /= 1 - c.dropout;
            const int64_t i = (b * c.S + s) * c.Dv + e;
            const double want = gr.dv.flat(i), got = gf.dv.flat(i);
            EXPECT_NEAR(got, want,
                        2 * kU * std::abs(want) + 1.05 * (kU + 5e-4) * adv + 1e-3 * scale)
                << "dv " << b << "," << s << "," << e;
          }
    }
  }
}

TEST(FlashBf16, OpsRejectsMixedDtypes) {
  Context ctx;
  const Tensor q = testing::random_tensor({1, 4, 8}, DType::F32, 1).to(DType::BF16);
  const Tensor k32 = testing::random_tensor({1, 5, 8}, DType::F32, 2);
  const Tensor v = testing::random_tensor({1, 5, 8}, DType::F32, 3).to(DType::BF16);
  try {
    scaled_dot_product_attention(ctx, q, k32, v);
    FAIL() << "expected attn::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("scaled_dot_product_attention"), std::string::npos) << msg;
    EXPECT_NE(msg.find("BF16"), std::string::npos) << msg;
    EXPECT_NE(msg.find("F32"), std::string::npos) << msg;
  }
  const Tensor k = k32.to(DType::BF16);
  const AttentionResult r = scaled_dot_product_attention(ctx, q, k, v);
  const Tensor dout32 = Tensor::zeros({1, 4, 8});
  EXPECT_THROW(scaled_dot_product_attention_backward(ctx, dout32, q, k, v, r), Error);
  EXPECT_THROW(
      scaled_dot_product_attention(ctx, q.to(DType::F16), k.to(DType::F16), v.to(DType::F16)),
      Error);
}

}  // namespace
}  // namespace attn::cpu
