// The tolerance model of the bfloat16 flash kernels (kernels/cpu/flash_bf16): the exact values in
// double on the bf16 inputs beside per-element error bounds, shared by the case table
// (test_attention_cases.cpp) and the bf16 kernel tests (test_kernels_flash_bf16.cpp). The values
// agree with the oracle (kernels/ref, tests/attention_harness.hpp oracle()); the bounds are what
// this file adds.
//
// Tolerances, from bf16's unit roundoff u = 2^-8 (8 significant bits, round to nearest even).
// The native forward computes each score from exact products (bf16 x bf16 fits in fp32) summed
// in fp32 (error ~ D 2^-24 |q||k|, 1e-5 relative at D = 256), each weight by a degree-4 exp2
// (4.2e-5 relative), then rounds every weight P_s Z_s to bf16 (relative error <= u) before the
// P V product, and rounds the output to bf16. Per element (t, e), with A = sum_s P_s Z_s |v_s e|:
//   |out - ref| <= u |ref| (final rounding) + u A (weights' rounding) + ~1e-4 A (the rest),
// which is the bound checked (A computed by the reference), times 1.05 for the final rounding
// of the perturbed value. The fp32 fallback meets it with room to spare. lse is fp32 throughout:
// sum of weights with relative error 1e-4 at most -> 2e-4 absolute, plus the scores' fp32 error.
// The backward runs the fp32 kernel on the bf16 values, except that D_t = dO_t . out_t uses the
// bf16-rounded out, whose error (bounded above) enters dS = P (dP - D_t); grads are rounded to
// bf16. Checked: |g - ref| <= u |ref| + 1.05 * scale * E_t * sum_s P |x| + 1e-4 * max|grad|, with
// E_t = sum_e |dO_te| * bound(out_te) (computed in reference()). That is the fallback's bound.
// The native backward (AVX512-BF16) also rounds the operands of its products to bf16: P Z for
// dV (each term's relative error <= u) and dS for dK and dQ (<= u each). Its inputs carry errors
// of their own, all relative to P: the degree-3 exp2 (7.5e-5), the forward's lse (<= 2e-4
// absolute, so <= 2e-4 relative in P = exp(score - lse)) and the fp32 scores (~1e-5); 5e-4
// covers their sum. With the reference's sums of absolute terms
//   Adv_se = sum_t P Z |dO_te|,  Adq_td = scale sum_s |dS_ts| |k_sd|,  Adk_sd = scale sum_t
//   |dS_ts| |q_td|
// the native checks add (u + 5e-4) times them to the fallback's bounds:
//   |dv - ref| <= u |ref| + 1.05 (u + 5e-4) Adv + 1e-4 max|grad|, and likewise dq (Adq), dk (Adk)
// (u |ref| the final rounding, 1.05 for the rounding of the perturbed value). The fp32 sums
// (exact bf16 products, fp32 accumulation over <= 256 features or 96-query tiles) add
// ~1e-6 relative, far below. Observed (AVX512-BF16 machine, ATTN_BF16_VERBOSE=1 prints the worst
// error / tolerance per check): out <= 0.69 of its bound (native) and <= 0.44 (fallback); dq, dk
// <= 0.46 and dv <= 0.95 (fallback); native backward: see docs/notes/bf16-kernel.md.
#pragma once

#include "attention_harness.hpp"

#include "attn/core/rng.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace attn::testing::bf16 {

constexpr double kU = 1.0 / 256;  // bf16 unit roundoff 2^-8
using Problem = KernelProblem<uint16_t>;
using View = HarnessView<uint16_t>;
using Case = KernelCase;

inline int64_t row_limit(const Problem& pr, int64_t b, int64_t t) {
  return case_row_limit(pr.cs, pr.key_limit, b, t);
}

// The formulas in double on the bf16 values, with the error bounds of the header comment.
struct Reference {
  std::vector<double> out, out_bound, lse, dq, dk, dv, dq_bound, dk_bound;
  std::vector<double> dq_abs, dk_abs, dv_abs;  // Adq, Adk, Adv of the header
};

inline Reference reference(const Problem& pr) {
  const Case& c = pr.cs;
  const double scale = pr.p.scale;
  Reference r;
  r.out.assign(c.B * c.T * c.Dv, 0.0);
  r.out_bound.assign(c.B * c.T * c.Dv, 0.0);
  r.lse.assign(c.B * c.T, -std::numeric_limits<double>::infinity());
  r.dq.assign(c.B * c.T * c.D, 0.0);
  r.dk.assign(c.B * c.S * c.D, 0.0);
  r.dv.assign(c.B * c.S * c.Dv, 0.0);
  r.dq_bound.assign(c.B * c.T * c.D, 0.0);
  r.dk_bound.assign(c.B * c.S * c.D, 0.0);
  r.dq_abs.assign(c.B * c.T * c.D, 0.0);
  r.dk_abs.assign(c.B * c.S * c.D, 0.0);
  r.dv_abs.assign(c.B * c.S * c.Dv, 0.0);
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
      if (lim == 0) {
        for (int64_t s = 0; s < c.S; ++s)
          P[s] = c.zero_rows ? 0.0 : 1.0 / double(c.S);
      } else {
        double mx = -INFINITY;
        for (int64_t s = 0; s < lim; ++s) {
          double x = 0;
          for (int64_t d = 0; d < c.D; ++d)
            x += pr.q.at(b, t, d) * pr.k.at(b, s, d);
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
      const int64_t o = (b * c.T + t) * c.Dv;
      for (int64_t s = 0; s < c.S; ++s)
        for (int64_t e = 0; e < c.Dv && P[s] != 0; ++e) {  // masked keys take no part
          r.out[o + e] += P[s] * Z[s] * pr.v.at(b, s, e);
          r.out_bound[o + e] += P[s] * Z[s] * std::abs(pr.v.at(b, s, e));  // A
        }
      double Et = 0;  // bound on |dO . (out_kernel - out)|
      for (int64_t e = 0; e < c.Dv; ++e) {
        const double A = r.out_bound[o + e];
        r.out_bound[o + e] = 1.05 * (kU * std::abs(r.out[o + e]) + (kU + 1e-4) * A) + 1e-7;
        Et += std::abs(pr.dout.at(b, t, e)) * r.out_bound[o + e];
      }
      double Dt = 0;
      for (int64_t s = 0; s < c.S; ++s) {
        double x = 0;
        for (int64_t e = 0; e < c.Dv; ++e) {
          const double go = pr.dout.at(b, t, e);
          if (P[s] != 0) {  // masked keys take no part (a NaN in dO stays out of them)
            r.dv[(b * c.S + s) * c.Dv + e] += P[s] * Z[s] * go;
            if (lim > 0) r.dv_abs[(b * c.S + s) * c.Dv + e] += P[s] * Z[s] * std::abs(go);
          }
          x += go * pr.v.at(b, s, e);
        }
        dP[s] = Z[s] * x;
        if (P[s] != 0) Dt += P[s] * dP[s];
      }
      if (lim == 0) continue;
      for (int64_t s = 0; s < lim; ++s) {
        const double dS = P[s] * (dP[s] - Dt) * scale;
        for (int64_t d = 0; d < c.D; ++d) {
          r.dq[(b * c.T + t) * c.D + d] += dS * pr.k.at(b, s, d);
          r.dk[(b * c.S + s) * c.D + d] += dS * pr.q.at(b, t, d);
          r.dq_bound[(b * c.T + t) * c.D + d] += P[s] * Et * scale * std::abs(pr.k.at(b, s, d));
          r.dk_bound[(b * c.S + s) * c.D + d] += P[s] * Et * scale * std::abs(pr.q.at(b, t, d));
          r.dq_abs[(b * c.T + t) * c.D + d] += std::abs(dS * pr.k.at(b, s, d));
          r.dk_abs[(b * c.S + s) * c.D + d] += std::abs(dS * pr.q.at(b, t, d));
        }
      }
    }
  }
  return r;
}

// |got - want| <= rel |want| + bound[i] + atol over a view; reports the first offender.
inline ::testing::AssertionResult close_view(const char* what, const View& got,
                                             const std::vector<double>& want,
                                             const std::vector<double>* bound, double rel,
                                             double atol) {
  double worst = 0;
  for (int64_t b = 0; b < got.B; ++b)
    for (int64_t n = 0; n < got.N; ++n)
      for (int64_t c = 0; c < got.C; ++c) {
        const int64_t i = (b * got.N + n) * got.C + c;
        const double w = want[i], x = got.at(b, n, c);
        const double tol = rel * std::abs(w) + (bound ? 1.05 * (*bound)[i] : 0.0) + atol;
        if (!(std::abs(x - w) <= tol))
          return ::testing::AssertionFailure()
                 << what << "[" << b << "," << n << "," << c << "] = " << x << ", want " << w
                 << " (tol " << tol << ")";
        worst = std::max(worst, std::abs(x - w) / tol);
      }
  if (int64_t bad = guard_damage(got))
    return ::testing::AssertionFailure() << what << ": " << bad << " writes outside the tensor";
  if (std::getenv("ATTN_BF16_VERBOSE"))
    std::fprintf(stderr, "%s worst err/tol %.3f\n", what, worst);
  return ::testing::AssertionSuccess();
}

// The native backward's bound: the fallback's (`base`, or none) plus (u + 5e-4) times the sum of
// absolute terms (header).
inline std::vector<double> native_bound(const std::vector<double>* base,
                                        const std::vector<double>& abs) {
  std::vector<double> b(abs.size());
  for (size_t i = 0; i < abs.size(); ++i)
    b[i] = (base ? (*base)[i] : 0.0) + (kU + 5e-4) * abs[i];
  return b;
}

// The backward's three checks, with the native bounds when `native`.
inline void check_grads(const Problem& pr, const Reference& ref, bool native, double atol) {
  if (native) {
    const std::vector<double> bq = native_bound(&ref.dq_bound, ref.dq_abs);
    const std::vector<double> bk = native_bound(&ref.dk_bound, ref.dk_abs);
    const std::vector<double> bv = native_bound(nullptr, ref.dv_abs);
    EXPECT_TRUE(close_view("dq (native)", pr.dq, ref.dq, &bq, kU, atol));
    EXPECT_TRUE(close_view("dk (native)", pr.dk, ref.dk, &bk, kU, atol));
    EXPECT_TRUE(close_view("dv (native)", pr.dv, ref.dv, &bv, kU, atol));
  } else {
    EXPECT_TRUE(close_view("dq", pr.dq, ref.dq, &ref.dq_bound, kU, atol));
    EXPECT_TRUE(close_view("dk", pr.dk, ref.dk, &ref.dk_bound, kU, atol));
    EXPECT_TRUE(close_view("dv", pr.dv, ref.dv, nullptr, kU, atol));
  }
}

}  // namespace attn::testing::bf16
