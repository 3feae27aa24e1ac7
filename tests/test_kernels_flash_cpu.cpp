// kernels/cpu flash attention against a float64 reference written here as the formulas (and,
// through the ops layer, against kernels/ref): every mask kind, dropout, odd head dims, tails
// around the tiles, strided and misaligned views, every SIMD target this CPU runs, 1 vs 2 threads
// bitwise, and finite differences through the fast path.
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
#include "testing.hpp"

#include "attn/core/rng.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace attn::cpu {
namespace {

constexpr float kSentinel = testing::kHarnessSentinel<float>;  // every non-element slot

// Views, guards, cases and key limits: tests/attention_harness.hpp.
using View = testing::HarnessView<float>;
using Case = testing::KernelCase;
using testing::guard_damage;
using testing::Lens;

View make_view(int64_t B, int64_t N, int64_t C, int layout, uint64_t seed, bool fill,
               double range = 1.0) {
  return testing::make_harness_view<float>(B, N, C, layout, seed, fill, range);
}

struct Problem {
  Case cs;
  View q, k, v, out, dout, dq, dk, dv, weights;
  std::vector<float> lse;
  std::vector<int32_t> key_limit;
  FlashParams p;
  FlashGrads g;

  explicit Problem(const Case& c) : cs(c) {
    const int L = c.layout;
    q = make_view(c.B, c.T, c.D, L, 1, true);
    k = make_view(c.B, c.S, c.D, (L + 1) % 3, 2, true);
    v = make_view(c.B, c.S, c.Dv, (L + 2) % 3, 3, true);
    dout = make_view(c.B, c.T, c.Dv, L, 4, true);
    out = make_view(c.B, c.T, c.Dv, L, 0, false);
    dq = make_view(c.B, c.T, c.D, (L + 1) % 3, 0, false);
    dk = make_view(c.B, c.S, c.D, L, 0, false);
    dv = make_view(c.B, c.S, c.Dv, (L + 1) % 3, 0, false);
    weights = make_view(c.B, c.T, c.S, L % 2, 0, false);  // unit stride along S
    lse.assign(c.B * c.T, 0.0f);
    key_limit = testing::case_key_limits(c);
    p.B = c.B, p.T = c.T, p.S = c.S, p.D = c.D, p.Dv = c.Dv;
    p.q = q.input_view();
    p.k = k.input_view();
    p.v = v.input_view();
    p.out = out.kernel_view();
    p.lse = lse.data();
    p.weights = weights.ptr(), p.w_sb = weights.sb, p.w_st = weights.sn;
    p.kept_keys = key_limit.empty() ? nullptr : key_limit.data();
    p.causal = c.causal;
    p.masked_rows = c.masked_rows();
    p.scale = float(1.0 / std::sqrt(double(c.D)));
    p.dropout = c.dropout;
    p.seed = 1234;
    p.offset = 5;
    p.threads = 1;
    g.dout = dout.input_view();
    g.dq = dq.kernel_view();
    g.dk = dk.kernel_view();
    g.dv = dv.kernel_view();
  }
};

int64_t row_limit(const Problem& pr, int64_t b, int64_t t) {
  return testing::case_row_limit(pr.cs, pr.key_limit, b, t);
}

// The reference, in double, straight from the formulas (full T x S matrices).
struct Reference {
  std::vector<double> out, lse, weights, dq, dk, dv;  // contiguous (B, T, Dv), (B, T), ...
};

Reference reference(const Problem& pr, bool backward) {
  const Case& c = pr.cs;
  const double scale = pr.p.scale;
  Reference r;
  r.out.assign(c.B * c.T * c.Dv, 0.0);
  r.lse.assign(c.B * c.T, -std::numeric_limits<double>::infinity());
  r.weights.assign(c.B * c.T * c.S, 0.0);
  r.dq.assign(c.B * c.T * c.D, 0.0);
  r.dk.assign(c.B * c.S * c.D, 0.0);
  r.dv.assign(c.B * c.S * c.Dv, 0.0);
  const double keep_scale = c.dropout < 1 ? 1.0 / (1.0 - c.dropout) : 0.0;
  std::vector<double> P(c.S), Z(c.S), dP(c.S);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t lim = row_limit(pr, b, t);
      for (int64_t s = 0; s < c.S; ++s) {
        const uint64_t i = uint64_t((b * c.T + t) * c.S + s);
        Z[s] = c.dropout > 0 ? (dropout_keep(pr.p.seed, pr.p.offset, i, c.dropout) ? keep_scale : 0)
                             : 1.0;
      }
      if (lim == 0) {  // masked row: uniform 1/S (d2l) or zero
        for (int64_t s = 0; s < c.S; ++s)
          P[s] = c.zero_rows ? 0.0 : 1.0 / double(c.S);
      } else {
        double mx = -INFINITY;
        for (int64_t s = 0; s < lim; ++s) {
          double x = 0;
          for (int64_t d = 0; d < c.D; ++d)
            x += double(pr.q.at(b, t, d)) * pr.k.at(b, s, d);
          P[s] = x * scale;
          mx = std::max(mx, P[s]);
        }
        double sum = 0;
        for (int64_t s = 0; s < lim; ++s)
          sum += std::exp(P[s] - mx);
        for (int64_t s = 0; s < c.S; ++s)
          P[s] = s < lim ? std::exp(P[s] - mx) / sum : 0.0;
        r.lse[b * c.T + t] = mx + std::log(sum);
      }
      for (int64_t s = 0; s < c.S; ++s)
        r.weights[(b * c.T + t) * c.S + s] = P[s];
      for (int64_t s = 0; s < c.S; ++s)
        for (int64_t e = 0; e < c.Dv; ++e)
          r.out[(b * c.T + t) * c.Dv + e] += P[s] * Z[s] * pr.v.at(b, s, e);
      if (!backward) continue;
      // dV_s += P Z dO_t; dP = Z dO_t . V_s; dS = P (dP - sum_s P dP); dQ, dK = scale dS (K, Q).
      double Dt = 0;
      for (int64_t s = 0; s < c.S; ++s) {
        double x = 0;
        for (int64_t e = 0; e < c.Dv; ++e) {
          const double go = pr.dout.at(b, t, e);
          r.dv[(b * c.S + s) * c.Dv + e] += P[s] * Z[s] * go;
          x += go * pr.v.at(b, s, e);
        }
        dP[s] = Z[s] * x;
        Dt += P[s] * dP[s];
      }
      if (lim == 0) continue;  // constant weights: no gradient to q or k
      for (int64_t s = 0; s < lim; ++s) {
        const double dS = P[s] * (dP[s] - Dt) * scale;
        for (int64_t d = 0; d < c.D; ++d) {
          r.dq[(b * c.T + t) * c.D + d] += dS * pr.k.at(b, s, d);
          r.dk[(b * c.S + s) * c.D + d] += dS * pr.q.at(b, t, d);
        }
      }
    }
  }
  return r;
}

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

double max_abs(const std::vector<double>& x) {
  double m = 1e-30;
  for (double e : x)
    m = std::max(m, std::abs(e));
  return m;
}

std::vector<Case> sweep() {
  std::vector<Case> cases;
  // Sizes straddle the tiles (query block 96 / 48 / 32 rows, key tile 64 / 32 / 4 keys on
  // AVX-512 / AVX2 / scalar), T != S, odd and large head dims; S % 4 == 0 (64, 128, 140) takes
  // the vectorized dropout draw, other S the scalar one.
  const int64_t sizes[][5] = {{1, 1, 1, 16, 16},     {2, 7, 5, 17, 17},     {1, 97, 65, 33, 33},
                              {2, 64, 64, 64, 64},   {1, 200, 130, 64, 48}, {1, 96, 193, 128, 128},
                              {1, 33, 17, 256, 256}, {1, 5, 140, 3, 7},     {2, 100, 128, 32, 32}};
  int layout = 0;
  for (const auto& sz : sizes) {
    for (Lens lens : {Lens::kNone, Lens::k1D, Lens::k2D}) {
      for (bool causal : {false, true}) {
        for (float p : {0.0f, 0.3f}) {
          const bool zero = (layout % 2) == 1;
          cases.push_back({sz[0], sz[1], sz[2], sz[3], sz[4], lens, causal, zero, p, layout % 3});
          ++layout;
        }
      }
    }
  }
  return cases;
}

class FlashSweep : public ::testing::TestWithParam<Case> {};

TEST_P(FlashSweep, MatchesReferenceOnEveryTarget) {
  const Case c = GetParam();
  Problem ref_pr(c);
  const Reference ref = reference(ref_pr, /*backward=*/true);
  const double gscale = std::max({max_abs(ref.dq), max_abs(ref.dk), max_abs(ref.dv)});
  for (int64_t target : flash_attention_targets()) {
    SCOPED_TRACE(std::string("target ") + flash_attention_target_name(target));
    Problem pr(c);
    pr.p.simd_targets = target;
    flash_attention_forward(pr.p);
    EXPECT_TRUE(close_view("out", pr.out, ref.out, 2e-6, 2e-6));
    EXPECT_TRUE(close_view("weights", pr.weights, ref.weights, 2e-6, 2e-6));
    for (int64_t i = 0; i < c.B * c.T; ++i) {
      if (std::isinf(ref.lse[i])) {
        EXPECT_TRUE(std::isinf(pr.lse[i]) && pr.lse[i] < 0) << "lse[" << i << "]";
      } else {
        EXPECT_NEAR(pr.lse[i], ref.lse[i], 2e-6 * (1 + std::abs(ref.lse[i]))) << "lse[" << i << "]";
      }
    }
    flash_attention_backward(pr.p, pr.g);
    EXPECT_TRUE(close_view("dq", pr.dq, ref.dq, 0, 1e-5 * gscale));
    EXPECT_TRUE(close_view("dk", pr.dk, ref.dk, 0, 1e-5 * gscale));
    EXPECT_TRUE(close_view("dv", pr.dv, ref.dv, 0, 1e-5 * gscale));

    // Two threads give the same bits (work items do not depend on the thread count).
    Problem pr2(c);
    pr2.p.simd_targets = target;
    pr2.p.threads = 2;
    pr2.p.weights = nullptr;  // the output must not depend on whether weights are written
    flash_attention_forward(pr2.p);
    flash_attention_backward(pr2.p, pr2.g);
    EXPECT_EQ(pr.out.buf, pr2.out.buf);
    EXPECT_EQ(0, std::memcmp(pr.lse.data(), pr2.lse.data(), pr.lse.size() * sizeof(float)));
    EXPECT_EQ(pr.dq.buf, pr2.dq.buf);
    EXPECT_EQ(pr.dk.buf, pr2.dk.buf);
    EXPECT_EQ(pr.dv.buf, pr2.dv.buf);

    // The forward's recorded dropout decisions (AttentionArgs::dropout_keep), read by the
    // backward instead of the stream: the same bits as drawing them again, 1 and 2 threads.
    if (!flash_attention_keeps_dropout(pr.p)) continue;
    for (const uint64_t base : {uint64_t{0}, uint64_t{12}})  // a data-parallel shard's base
      for (const int threads : {1, 2}) {
        Problem drawn(c), kept(c);
        std::vector<uint16_t> keep(static_cast<size_t>(flash_dropout_keep_words(kept.p)), 0xdead);
        kept.p.dropout_keep = keep.data();
        for (Problem* x : {&drawn, &kept}) {
          x->p.simd_targets = target;
          x->p.threads = threads;
          x->p.dropout_index_base = base;
          flash_attention_forward(x->p);
          flash_attention_backward(x->p, x->g);
        }
        SCOPED_TRACE("base " + std::to_string(base) + ", threads " + std::to_string(threads));
        EXPECT_EQ(drawn.out.buf, kept.out.buf);
        EXPECT_EQ(drawn.dq.buf, kept.dq.buf);
        EXPECT_EQ(drawn.dk.buf, kept.dk.buf);
        EXPECT_EQ(drawn.dv.buf, kept.dv.buf);
      }
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& param_info) {
  return param_info.param.name();
}
INSTANTIATE_TEST_SUITE_P(Cases, FlashSweep, ::testing::ValuesIn(sweep()), case_name);

// The reference backward above is itself checked by central differences of its forward, in
// double, so the sweep's oracle for gradients is not just a second copy of the same algebra.
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
      Problem ref_pr(c);
      const Reference ref = reference(ref_pr, /*backward=*/true);
      const double gscale = std::max({max_abs(ref.dq), max_abs(ref.dk), max_abs(ref.dv)});
      for (int64_t target : flash_attention_targets()) {
        SCOPED_TRACE(std::string("target ") + flash_attention_target_name(target));
        std::vector<Problem> runs;
        runs.reserve(2);  // no reallocation: p and g point into each Problem's buffers
        for (const int threads : {1, 2}) {
          Problem& pr = runs.emplace_back(c);
          pr.p.simd_targets = target;
          pr.p.threads = threads;
          pr.p.weights = nullptr;
          std::vector<uint16_t> keep;
          if (flash_attention_keeps_dropout(pr.p)) {
            keep.assign(static_cast<size_t>(flash_dropout_keep_words(pr.p)), 0xdead);
            pr.p.dropout_keep = keep.data();
          }
          flash_attention_forward(pr.p);
          flash_attention_backward(pr.p, pr.g);
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
  }
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
