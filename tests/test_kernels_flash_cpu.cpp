// The float32 flash kernel (kernels/cpu/flash_attention) beyond the case table
// (test_attention_cases.cpp, which runs the sweep over sizes, masks, dropout, views, targets and
// threads on every implementation): finite differences of the oracle and of the kernel, dropout
// p = 1, large and jumping scores, short rows with many items, and the ops dispatch against
// Backend::kReference. Oracle: kernels/ref on the same problem (tests/attention_harness.hpp).
//
// Tolerances. The kernel accumulates in fp32 (unit roundoff u = 6e-8) over K = D (scores) or S
// (weighted sum) terms; a dot product's error is bounded by K u sum|terms| and behaves like
// sqrt(K) u in practice: ~1e-6 for K = 256. Outputs and lse are compared with atol = rtol = 2e-6
// (observed max 1.9e-7 over the sweep, all targets). Gradients chain three such products (dP, dS,
// dQ/dK) and the lse round trip, so they use 1e-5 relative to the largest gradient entry
// (observed max 7e-7).
#include "kernels/cpu/flash_attention.hpp"

#include "attention_harness.hpp"
#include "attn/ops/attention.hpp"
#include "kernels/cpu/parallel.hpp"
#include "testing.hpp"

#include "attn/core/rng.hpp"

#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace attn::cpu {
namespace {

// Every kernel forks as far as a test asks, whatever the size (kernels/cpu/parallel.hpp), so that
// the thread-count comparisons below run the parallel paths on these small shapes too.
const bool kForkAtAnySize = (attn::cpu::set_min_flops_per_thread(0), true);

// Views, guards, cases and key limits: tests/attention_harness.hpp.
using View = testing::HarnessView<float>;
using Case = testing::KernelCase;
using testing::guard_damage;
using testing::Lens;

// A case's arguments (with the weights asked for) and the oracle: tests/attention_harness.hpp.
struct Problem : testing::KernelProblem<float> {
  explicit Problem(const Case& c) : KernelProblem(c) { with_weights(); }
};
using Reference = testing::Expected;
Reference reference(const Problem& pr, bool backward) {
  return testing::oracle(pr, backward);
}
using testing::max_abs;

// max |got - want| <= atol + rtol |want| over a view; reports the first offender.
::testing::AssertionResult close_view(const char* what, const View& got,
                                      const std::vector<double>& want, double rtol, double atol) {
  for (int64_t b = 0; b < got.B; ++b)
    for (int64_t n = 0; n < got.N; ++n)
      for (int64_t c = 0; c < got.C; ++c) {
        const double w = want[(b * got.N + n) * got.C + c], x = got.at(b, n, c);
        if (!(std::abs(x - w) <= atol + rtol * std::abs(w)))
          return ::testing::AssertionFailure()
                 << what << "[" << b << "," << n << "," << c << "] = " << x << ", want " << w;
      }
  if (int64_t bad = guard_damage(got))
    return ::testing::AssertionFailure() << what << ": " << bad << " writes outside the tensor";
  return ::testing::AssertionSuccess();
}

// The sweep over sizes, masks, dropout, layouts, targets and threads is the case table's
// (test_attention_cases.cpp); what follows is specific to the float32 kernel.

// The oracle's backward (kernels/ref) is itself checked by central differences of its forward, in
// double, on the kernels' problem description (masks, dropout stream).
TEST(FlashReference, BackwardMatchesFiniteDifferences) {
  for (Case c : {Case{1, 5, 7, 3, 4, Lens::k2D, true, false, 0.3f, 0},
                 Case{2, 4, 6, 5, 3, Lens::k1D, false, false, 0.0f, 0}}) {
    Problem pr(c);
    const Reference r = reference(pr, true);
    auto loss = [&] {
      const Reference f = reference(pr, false);
      double L = 0;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < c.T; ++t)
          for (int64_t e = 0; e < c.Dv; ++e)
            L += f.out[(b * c.T + t) * c.Dv + e] * pr.dout.at(b, t, e);
      return L;
    };
    auto check = [&](View& x, const std::vector<double>& grad, const char* name) {
      for (int64_t b = 0; b < x.B; ++b)
        for (int64_t n = 0; n < x.N; ++n)
          for (int64_t e = 0; e < x.C; ++e) {
            // The views are float, so perturb by a float-representable step and difference in
            // double: eps = 2^-10 gives truncation ~1e-7 and rounding ~1e-13.
            const float orig = x.at(b, n, e), eps = 1.0f / 1024;
            x.at(b, n, e) = orig + eps;
            const double up = loss();
            x.at(b, n, e) = orig - eps;
            const double down = loss();
            x.at(b, n, e) = orig;
            const double fd = (up - down) / (2.0 * double(eps));
            EXPECT_NEAR(grad[(b * x.N + n) * x.C + e], fd, 1e-5) << name << " " << c.name();
          }
    };
    check(pr.q, r.dq, "dq");
    check(pr.k, r.dk, "dk");
    check(pr.v, r.dv, "dv");
  }
}

// Finite differences through the fast fp32 kernel itself (loss = sum(out * dout)).
TEST(FlashCpu, BackwardMatchesFiniteDifferencesOfKernel) {
  const Case c{1, 9, 11, 6, 5, Lens::k2D, true, false, 0.25f, 1};
  Problem pr(c);
  flash_attention_forward(pr.p);
  flash_attention_backward(pr.p, pr.g);
  auto loss = [&] {
    flash_attention_forward(pr.p);
    double L = 0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t e = 0; e < c.Dv; ++e)
        L += double(pr.out.at(0, t, e)) * pr.dout.at(0, t, e);
    return L;
  };
  // fp32 outputs carry ~1e-7 relative noise; with eps = 1e-2 the central difference has
  // rounding error ~1e-5 and truncation ~1e-4 * third derivative, so compare to 2e-3.
  auto check = [&](View& x, const View& grad, const char* name) {
    for (int64_t n = 0; n < x.N; ++n)
      for (int64_t e = 0; e < x.C; ++e) {
        const float orig = x.at(0, n, e), eps = 1e-2f;
        x.at(0, n, e) = orig + eps;
        const double up = loss();
        x.at(0, n, e) = orig - eps;
        const double down = loss();
        x.at(0, n, e) = orig;
        EXPECT_NEAR(grad.at(0, n, e), (up - down) / (2.0 * double(eps)), 2e-3)
            << name << "[" << n << "," << e << "]";
      }
  };
  check(pr.q, pr.dq, "dq");
  check(pr.k, pr.dk, "dk");
  check(pr.v, pr.dv, "dv");
}

// Dropout with p = 1 drops everything: zero output, finite lse, zero dV.
TEST(FlashCpu, DropoutOneGivesZeros) {
  Problem pr(Case{1, 10, 12, 8, 8, Lens::kNone, false, false, 1.0f, 0});
  flash_attention_forward(pr.p);
  flash_attention_backward(pr.p, pr.g);
  for (int64_t t = 0; t < 10; ++t) {
    EXPECT_TRUE(std::isfinite(pr.lse[t]));
    for (int64_t e = 0; e < 8; ++e)
      EXPECT_EQ(pr.out.at(0, t, e), 0.0f);
  }
  for (int64_t s = 0; s < 12; ++s)
    for (int64_t e = 0; e < 8; ++e)
      EXPECT_EQ(pr.dv.at(0, s, e), 0.0f);
}

// Large scores (no overflow in the online softmax: running max subtraction) and a long row that
// spans many key tiles with the max in a late tile (exercises the rescale of the accumulator).
// Scores reach ~1e3 here, and fp32 rounds q.k to ~1e3 u = 6e-5 absolute, hence 3e-5 relative.
TEST(FlashCpu, LargeScoresAndLateMaximum) {
  Case c{1, 3, 700, 16, 16, Lens::kNone, false, false, 0.0f, 0};
  Problem pr(c);
  for (int64_t s = 0; s < c.S; ++s)
    for (int64_t d = 0; d < c.D; ++d)
      pr.k.at(0, s, d) *= s == 650 ? 400.0f : 30.0f;
  const Reference ref = reference(pr, false);
  flash_attention_forward(pr.p);
  EXPECT_TRUE(close_view("out", pr.out, ref.out, 3e-5, 3e-5));
  for (int t = 0; t < 3; ++t)
    EXPECT_NEAR(pr.lse[t], ref.lse[t], 3e-5 * std::abs(ref.lse[t]));
}

// Key tiles scaled up and down by turns: the running max jumps by tens (log2 units) at some tiles
// and stays put at others, so the online softmax rescales l and O^T by factors far below 2^-8, on
// every target (whose key tiles are 64, 32 or 4 keys), with one and two threads giving the same
// bits.
TEST(FlashCpu, RisingAndFallingScoresMatchReference) {
  const float gain[] = {1.0f, 1.5f, 6.0f, 0.5f, 1.0f, 12.0f, 2.0f, 0.1f, 20.0f, 1.0f};
  for (bool causal : {false, true}) {
    const Case c{2, 37, 640, 16, 24, Lens::kNone, causal, false, 0.0f, 0};
    Problem ref_pr(c);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.S; ++s)
        for (int64_t d = 0; d < c.D; ++d)
          ref_pr.k.at(b, s, d) *= 3.0f * gain[(s / 16 + b) % 10];
    const Reference ref = reference(ref_pr, false);
    for (int64_t target : flash_attention_targets()) {
      SCOPED_TRACE(std::string("target ") + flash_attention_target_name(target) +
                   (causal ? " causal" : ""));
      for (int threads : {1, 2}) {
        Problem pr(c);
        pr.p.simd_targets = target;
        std::copy(ref_pr.k.buf.begin(), ref_pr.k.buf.end(), pr.k.buf.begin());
        pr.p.threads = threads;
        flash_attention_forward(pr.p);
        EXPECT_TRUE(close_view("out", pr.out, ref.out, 3e-5, 3e-5));
        EXPECT_TRUE(close_view("weights", pr.weights, ref.weights, 3e-5, 3e-6));
        for (int64_t i = 0; i < c.B * c.T; ++i)
          EXPECT_NEAR(pr.lse[i], ref.lse[i], 3e-5 * (1 + std::abs(ref.lse[i])))
              << "lse[" << i << "]";
      }
    }
  }
}

// Case c's forward and backward on every target, on 1 and 2 threads (so of different next items),
// with the forward's dropout keep bits where the kernel keeps them: out and the gradients within
// the bounds of the reference `ref` (the gradients relative to its largest entry), and the two
// thread counts' bits equal. `fill(pr)` sets a run's inputs; `after(pr, what)` runs after each
// kernel call ("forward", then "backward").
template <class Fill, class After>
void check_targets_and_threads(const Case& c, const Reference& ref, Fill&& fill, After&& after) {
  const double gscale = std::max({max_abs(ref.dq), max_abs(ref.dk), max_abs(ref.dv)});
  for (int64_t target : flash_attention_targets()) {
    SCOPED_TRACE(std::string("target ") + flash_attention_target_name(target));
    std::vector<Problem> runs;
    runs.reserve(2);  // no reallocation: p and g point into each Problem's buffers
    for (const int threads : {1, 2}) {
      Problem& pr = runs.emplace_back(c);
      fill(pr);
      pr.p.simd_targets = target;
      pr.p.threads = threads;
      std::vector<uint16_t> keep;
      if (flash_attention_keeps_dropout(pr.p)) {
        keep.assign(static_cast<size_t>(flash_dropout_keep_words(pr.p)), 0xdead);
        pr.p.dropout_keep = keep.data();
      }
      flash_attention_forward(pr.p);
      after(pr, "forward");
      flash_attention_backward(pr.p, pr.g);
      after(pr, "backward");
      pr.p.dropout_keep = nullptr;
    }
    const Problem& pr = runs[0];
    EXPECT_TRUE(close_view("out", pr.out, ref.out, 2e-6, 2e-6));
    EXPECT_TRUE(close_view("dq", pr.dq, ref.dq, 0, 1e-5 * gscale));
    EXPECT_TRUE(close_view("dk", pr.dk, ref.dk, 0, 1e-5 * gscale));
    EXPECT_TRUE(close_view("dv", pr.dv, ref.dv, 0, 1e-5 * gscale));
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_EQ(pr.out.buf, runs[i].out.buf);
      EXPECT_EQ(0, std::memcmp(pr.lse.data(), runs[i].lse.data(), pr.lse.size() * 4));
      EXPECT_EQ(pr.dq.buf, runs[i].dq.buf);
      EXPECT_EQ(pr.dk.buf, runs[i].dk.buf);
      EXPECT_EQ(pr.dv.buf, runs[i].dv.buf);
    }
  }
}

// Short rows with many batch rows, as d2l's PyTorch loop calls the kernel (T = S = 128, D = 32,
// padded lengths, dropout 0.1 with the forward's keep bits): every item prefetches the rows of
// the one its thread runs next (ShortRows), the backward's products stop at the last kept key of
// a block, and D_t is summed 16 rows at once. Against the reference, with the bits of 1 and 2
// threads (so of different next items) equal, on every target.
TEST(FlashCpu, ShortRowsManyItemsMatchReference) {
  for (const int64_t t : {100, 128}) {
    for (const bool causal : {false, true}) {
      const Case c{8, t, t, 32, 32, Lens::k1D, causal, false, 0.1f, int(t % 3)};
      SCOPED_TRACE(c.name());
      const Reference ref = reference(Problem(c), /*backward=*/true);
      check_targets_and_threads(
          c, ref, [](Problem& pr) { pr.p.weights = nullptr; }, [](const Problem&, const char*) {});
    }
  }
}

// Subnormal weights (kernels/cpu/denormals.hpp): keys whose scores sit 87-103 nats below their
// row's maximum have weights below 2^-126, which the kernels flush to zero (an Intel core stalls
// on every vector instruction with a subnormal operand: the d2l step ran 3.6x slower on a Xeon).
// Scores here step down by 2.5 from the row's maximum to -117.5, so each row has several such
// keys, and those keys' values are 1e20 so that their terms are as large as they can be. Forward
// and backward stay within the bounds of the reference (which keeps them), on every target and on
// 1 and 2 threads with the same bits; the caller's floating-point mode is the same after each
// call; and a term that only a subnormal weight carries comes out 0.
TEST(FlashCpu, SubnormalWeightsAreFlushedWithinTheBoundAndTheCallersModeKept) {
  const Case c{2, 24, 96, 16, 16, Lens::kNone, false, false, 0.0f, 0};
  Problem ref_pr(c);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t d = 0; d < c.D; ++d)
        ref_pr.q.at(b, t, d) = d == 0 ? 1.0f : 0.0f;
    for (int64_t s = 0; s < c.S; ++s) {
      // score = 0.25 k[s][0] (scale 1/sqrt(16)): 0, -2.5, ..., -117.5, then again.
      for (int64_t d = 0; d < c.D; ++d)
        ref_pr.k.at(b, s, d) = d == 0 ? -10.0f * static_cast<float>(s % 48) : 0.0f;
      const float score = -2.5f * static_cast<float>(s % 48);
      if (score < -87.0f && score > -104.0f)
        for (int64_t d = 0; d < c.Dv; ++d)
          ref_pr.v.at(b, s, d) = 1e20f;
    }
  }
  const Reference ref = reference(ref_pr, /*backward=*/true);
  // The weight of key 40 (score -100: e^-100 = 3.7e-44, subnormal) is positive in the reference.
  ASSERT_GT(ref.weights[40], 0.0);
#if defined(__x86_64__)
  const unsigned mode = _mm_getcsr() & ~0x8040u;  // FTZ and DAZ off, as C++ programs start
  _mm_setcsr(mode);
#endif
  check_targets_and_threads(
      c, ref,
      [&ref_pr](Problem& pr) {
        // Copied into the problem's own buffers (its kernel views point into them).
        std::copy(ref_pr.q.buf.begin(), ref_pr.q.buf.end(), pr.q.buf.begin());
        std::copy(ref_pr.k.buf.begin(), ref_pr.k.buf.end(), pr.k.buf.begin());
        std::copy(ref_pr.v.buf.begin(), ref_pr.v.buf.end(), pr.v.buf.begin());
      },
      [&](const Problem& pr, const char* what) {
#if defined(__x86_64__)
        EXPECT_EQ(_mm_getcsr(), mode) << "the " << what << " changed the caller's MXCSR";
#endif
        if (std::strcmp(what, "forward") == 0) {
          EXPECT_EQ(pr.weights.at(0, 0, 40), 0.0f);
        }
      });
}

// ---- Through the ops layer: Backend::kCpu (this kernel) against Backend::kReference ----------

namespace ops_check {

struct OpsCase {
  int64_t B, T, S, D, Dv;
  int lens;  // 0 none, 1 (B,) ints, 2 (B, T) floats
  bool causal, zero_rows, need_weights;
  double dropout;
};

TEST(FlashCpu, OpsDispatchMatchesReferenceBackend) {
  const OpsCase cases[] = {
      {2, 70, 130, 16, 16, 0, false, false, true, 0.0},
      {3, 97, 65, 33, 20, 1, false, false, true, 0.0},
      {2, 50, 50, 64, 64, 2, true, false, false, 0.2},
      {2, 40, 90, 24, 8, 2, false, true, true, 0.0},
      {1, 200, 200, 128, 128, 0, true, true, false, 0.1},
  };
  for (const OpsCase& c : cases) {
    SCOPED_TRACE("B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " S" +
                 std::to_string(c.S) + " D" + std::to_string(c.D));
    // q, k, v as head slices of wider (B, N, 3 * width) activations: strided, misaligned views.
    Tensor qa = testing::random_tensor({c.B, c.T, 3 * c.D}, DType::F32, 11);
    Tensor ka = testing::random_tensor({c.B, c.S, 3 * c.D}, DType::F32, 12);
    Tensor va = testing::random_tensor({c.B, c.S, 3 * c.Dv}, DType::F32, 13);
    Tensor q = qa.slice(2, c.D, 2 * c.D), k = ka.slice(2, 2 * c.D, 3 * c.D);
    Tensor v = va.slice(2, c.Dv, 2 * c.Dv);
    Tensor dout = testing::random_tensor({c.B, c.T, c.Dv}, DType::F32, 14);
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
    ref_ctx.backend = Backend::kReference;
    cpu_ctx.backend = Backend::kCpu;
    cpu_ctx.threads = 2;
    ref_ctx.seed = cpu_ctx.seed = 77;
    const AttentionResult r = scaled_dot_product_attention(ref_ctx, q, k, v, o);
    const AttentionResult f = scaled_dot_product_attention(cpu_ctx, q, k, v, o);
    EXPECT_EQ(r.dropout_offset, f.dropout_offset);
    EXPECT_TRUE(testing::close(f.output, r.output, 2e-6, 2e-6));
    for (int64_t i = 0; i < r.logsumexp.numel(); ++i) {  // -inf (rows without keys) must match
      const double want = r.logsumexp.flat(i), got = f.logsumexp.flat(i);
      if (std::isinf(want)) {
        EXPECT_EQ(got, want) << "lse " << i;
      } else {
        EXPECT_NEAR(got, want, 2e-6 * (1 + std::abs(want))) << "lse " << i;
      }
    }
    if (c.need_weights) {
      EXPECT_TRUE(testing::close(f.weights, r.weights, 2e-6, 2e-6));
    }
    const AttentionGrads gr = scaled_dot_product_attention_backward(ref_ctx, dout, q, k, v, r, o);
    const AttentionGrads gf = scaled_dot_product_attention_backward(cpu_ctx, dout, q, k, v, f, o);
    double scale = 1e-30;
    for (const Tensor* t : {&gr.dq, &gr.dk, &gr.dv})
      for (int64_t i = 0; i < t->numel(); ++i)
        scale = std::max(scale, std::abs(t->flat(i)));
    EXPECT_TRUE(testing::close(gf.dq, gr.dq, 0, 1e-5 * scale));
    EXPECT_TRUE(testing::close(gf.dk, gr.dk, 0, 1e-5 * scale));
    EXPECT_TRUE(testing::close(gf.dv, gr.dv, 0, 1e-5 * scale));
  }
}

}  // namespace ops_check

}  // namespace
}  // namespace attn::cpu
