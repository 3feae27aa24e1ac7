// One case table, every attention implementation (ggml's test-backend-ops is the model). A case is
// a testing::KernelCase (tests/attention_harness.hpp: shapes, lengths, causal, masked-row policy,
// dropout, view layout) with a printable name; an implementation is one row of implementations()
// below: a name, the cases it serves, how it runs one, and its tolerance. Every case runs on the
// oracle (kernels/ref on the kernels' own problem description: testing::oracle) and on every
// implementation that serves it, at 1 thread against the oracle and at 2, 3 and 7 threads bitwise
// against 1 (the results contract of kernels/attention_problem.hpp). A new kernel is tested by
// adding one row.
//
// The inputs are bfloat16 values (exact in float32 too), so one oracle run serves the float32 and
// the bfloat16 implementations. Tolerances: float32 kernels as in test_kernels_flash_cpu.cpp
// (atol = rtol = 2e-6 for out, lse and weights; 1e-5 of the largest gradient), bfloat16 ones from
// their error bounds (tests/attention_bf16_bounds.hpp), the decode kernel and the ring's merge by
// log-sum-exp a little looser (their sums run in another order).
#include "attention_bf16_bounds.hpp"
#include "attention_harness.hpp"

#include "attn/core/comm.hpp"
#include "attn/core/context.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/ring_attention.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"
#include "kernels/cpu/parallel.hpp"
#include "ops/attention_decode.hpp"
#include "ops/attention_heads.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace attn::testing {
namespace {

// Every kernel forks as far as a test asks, whatever the size (kernels/cpu/parallel.hpp), so that
// the thread-count comparisons below run the parallel paths on these small shapes too.
const bool kForkAtAnySize = (attn::cpu::set_min_flops_per_thread(0), true);

using Case = KernelCase;

// What an implementation returns, in the oracle's contiguous layouts; empty vectors for what it
// does not compute (weights: only the float32 kernel; gradients: not the decode kernel).
struct Result {
  std::vector<double> out, lse, weights, dq, dk, dv;
};

// How one run is made: threads, the SIMD target (0: the best), whether the forward records its
// dropout decisions for the backward, and the dropout stream's index base.
struct RunSpec {
  int threads = 1;
  int64_t target = 0;
  bool record_dropout = false;
  uint64_t index_base = 0;
};

enum class Tol { kFp32, kBf16Native, kBf16Fallback, kFp32Reordered, kBf16Reordered };

struct Impl {
  std::string name;
  Tol tol;
  std::function<bool(const Case&)> serves;
  std::function<Result(const Case&, const RunSpec&)> run;
  // The kernels' own rows at their best target also run 3 and 7 threads (more threads than
  // cores: uneven splits) and the recorded dropout decisions; every row runs 2 threads.
  bool kernel_row = false;
};

// ---- Kernel rows: the fused kernels on the harness's strided views ---------------------------

template <class E>
Result kernel_result(const KernelProblem<E>& pr, bool grads) {
  EXPECT_EQ(0, guard_damage(pr.out)) << "out written outside the tensor";
  Result r;
  r.out = contiguous_values(pr.out);
  r.lse.assign(pr.lse.begin(), pr.lse.end());
  if (pr.p.weights != nullptr) r.weights = contiguous_values(pr.weights);
  if (grads) {
    EXPECT_EQ(0, guard_damage(pr.dq) + guard_damage(pr.dk) + guard_damage(pr.dv))
        << "gradients written outside their tensors";
    r.dq = contiguous_values(pr.dq), r.dk = contiguous_values(pr.dk);
    r.dv = contiguous_values(pr.dv);
  }
  return r;
}

// The float32 kernel on SIMD target `target` (the weights asked for at 1 thread only: the output
// must not depend on them).
Result run_fp32(const Case& c, const RunSpec& run) {
  KernelProblem<float> pr(c);
  // The same random numbers as the bf16 rows' views, rounded as theirs are (elements only: the
  // other slots keep the sentinel).
  for (HarnessView<float>* v : {&pr.q, &pr.k, &pr.v, &pr.dout})
    for (int64_t b = 0; b < v->B; ++b)
      for (int64_t n = 0; n < v->N; ++n)
        for (int64_t e = 0; e < v->C; ++e)
          v->raw(b, n, e) = bf16_to_float(float_to_bf16(v->raw(b, n, e)));
  pr.p.simd_targets = run.target;
  pr.p.threads = run.threads;
  pr.p.dropout_index_base = run.index_base;
  if (run.threads == 1) pr.with_weights();
  std::vector<uint16_t> keep;
  if (run.record_dropout && cpu::flash_attention_keeps_dropout(pr.p)) {
    keep.assign(static_cast<size_t>(cpu::flash_dropout_keep_words(pr.p)), 0xdead);
    pr.p.dropout_keep = keep.data();
  }
  cpu::flash_attention_forward(pr.p);
  cpu::flash_attention_backward(pr.p, pr.g);
  return kernel_result(pr, true);
}

Result run_bf16(const Case& c, const RunSpec& run, bool fallback) {
  KernelProblem<uint16_t> pr(c);
  pr.p.force_bf16_fallback = fallback;
  pr.p.threads = run.threads;
  pr.p.dropout_index_base = run.index_base;
  std::vector<uint16_t> keep;
  if (run.record_dropout && cpu::flash_bf16_keeps_dropout(pr.p)) {
    keep.assign(static_cast<size_t>(cpu::dropout_keep_words(pr.p)), 0xdead);
    pr.p.dropout_keep = keep.data();
  }
  cpu::flash_attention_forward_bf16(pr.p);
  cpu::flash_attention_backward_bf16(pr.p, pr.g);
  return kernel_result(pr, true);
}

// ---- Op rows: the same values as Tensors through the ops layer --------------------------------

// A view's values as a contiguous (B, N, C) tensor of dtype.
Tensor tensor_of(const HarnessView<uint16_t>& v, DType dtype) {
  std::vector<float> x(static_cast<size_t>(v.B * v.N * v.C));
  for (int64_t b = 0; b < v.B; ++b)
    for (int64_t n = 0; n < v.N; ++n)
      for (int64_t c = 0; c < v.C; ++c)
        x[(b * v.N + n) * v.C + c] = bf16_to_float(v.raw(b, n, c));
  return Tensor::from_vector(x, {v.B, v.N, v.C}).to(dtype);
}

struct OpInputs {
  KernelProblem<uint16_t> pr;
  Tensor q, k, v, dout, lens;
  AttentionOptions opts;
  Context ctx;
  OpInputs(const Case& c, DType dtype, int threads) : pr(c) {
    q = tensor_of(pr.q, dtype), k = tensor_of(pr.k, dtype), v = tensor_of(pr.v, dtype);
    dout = tensor_of(pr.dout, dtype);
    lens = case_valid_lens_tensor(c);
    opts.mask.valid_lens = lens;
    opts.mask.causal = c.causal;
    opts.mask.masked_rows = c.zero_rows ? MaskedRowPolicy::kZero : MaskedRowPolicy::kUniform;
    opts.dropout = c.dropout;
    opts.training = c.dropout > 0;
    ctx.seed = pr.p.seed;
    ctx.set_dropout_offset(pr.p.offset);  // the op takes the kernel rows' offset
    ctx.threads = threads;
  }
};

std::vector<double> values(const Tensor& t) {
  return t.to_vector();
}

// nn::MultiHeadAttention's fast path (ops/attention_heads.cpp) with one head per batch row.
Result run_heads(const Case& c, const RunSpec& run, DType dtype) {
  OpInputs in(c, dtype, run.threads);
  const AttentionResult f =
      detail::multi_head_attention_forward(in.ctx, in.q, in.k, in.v, 1, in.opts);
  Tensor dq = Tensor::empty(in.q.shape(), dtype), dk = Tensor::empty(in.k.shape(), dtype),
         dv = Tensor::empty(in.v.shape(), dtype);
  detail::multi_head_attention_backward(in.ctx, in.dout, in.q, in.k, in.v, f, 1, in.opts, dq, dk,
                                        dv);
  return {values(f.output), values(f.logsumexp), {}, values(dq), values(dk), values(dv)};
}

// The decode kernel (ops/attention_decode.cpp): float32 queries, a float32 or bfloat16 cache.
Result run_decode(const Case& c, const RunSpec& run, DType cache) {
  OpInputs in(c, cache, run.threads);
  const Tensor q = in.q.to(DType::F32);
  const AttentionResult f = detail::multi_head_decode_attention(in.ctx, q, in.k, in.v, 1, in.opts);
  return {values(f.output), values(f.logsumexp), {}, {}, {}, {}};
}
bool decode_serves(const Case& c) {
  return c.T <= 8 && c.dropout == 0.0f;
}

// Ring attention (ops/ring_attention.cpp) on one rank: every block one kernel call per piece,
// merged by log-sum-exp.
Result run_ring(const Case& c, const RunSpec& run, DType dtype) {
  OpInputs in(c, dtype, run.threads);
  auto comm = single_process_communicator();
  RingOptions o;
  o.causal = c.causal;
  o.masked_rows = in.opts.mask.masked_rows;
  o.layout = RingLayout::kContiguous;
  o.dropout = c.dropout;
  o.training = c.dropout > 0;
  const AttentionResult f = ring_attention(in.ctx, *comm, in.q, in.k, in.v, in.lens, o);
  const AttentionGrads g =
      ring_attention_backward(in.ctx, *comm, in.dout, in.q, in.k, in.v, in.lens, f, o);
  return {values(f.output), values(f.logsumexp), {}, values(g.dq), values(g.dk), values(g.dv)};
}
bool ring_serves(const Case& c) {
  return !c.causal || c.T == c.S;  // a causal ring shards queries and keys alike
}

bool always(const Case&) {
  return true;
}

// The table. Rows of the float32 kernel per SIMD target this CPU runs, of the bf16 kernel per
// path (native where the CPU has AVX512-BF16, and the fp32 fallback).
std::vector<Impl> implementations() {
  std::vector<Impl> rows;
  const std::vector<int64_t> targets = cpu::flash_attention_targets();  // best first
  for (int64_t target : targets)
    rows.push_back({std::string("fp32 ") + cpu::flash_attention_target_name(target), Tol::kFp32,
                    always,
                    [target](const Case& c, const RunSpec& r) {
                      RunSpec rt = r;
                      rt.target = target;
                      return run_fp32(c, rt);
                    },
                    target == targets.front()});
  if (cpu::flash_bf16_native())
    rows.push_back({"bf16 native", Tol::kBf16Native, always,
                    [](const Case& c, const RunSpec& r) { return run_bf16(c, r, false); }, true});
  rows.push_back({"bf16 fallback", Tol::kBf16Fallback, always,
                  [](const Case& c, const RunSpec& r) { return run_bf16(c, r, true); }});
  rows.push_back({"heads fp32", Tol::kFp32, always,
                  [](const Case& c, const RunSpec& r) { return run_heads(c, r, DType::F32); }});
  rows.push_back({"heads bf16", cpu::flash_bf16_native() ? Tol::kBf16Native : Tol::kBf16Fallback,
                  always,
                  [](const Case& c, const RunSpec& r) { return run_heads(c, r, DType::BF16); }});
  rows.push_back({"decode fp32 cache", Tol::kFp32Reordered, decode_serves,
                  [](const Case& c, const RunSpec& r) { return run_decode(c, r, DType::F32); }});
  rows.push_back({"decode bf16 cache", Tol::kFp32Reordered, decode_serves,
                  [](const Case& c, const RunSpec& r) { return run_decode(c, r, DType::BF16); }});
  rows.push_back({"ring fp32, 1 rank", Tol::kFp32Reordered, ring_serves,
                  [](const Case& c, const RunSpec& r) { return run_ring(c, r, DType::F32); }});
  rows.push_back({"ring bf16, 1 rank", Tol::kBf16Reordered, ring_serves,
                  [](const Case& c, const RunSpec& r) { return run_ring(c, r, DType::BF16); }});
  return rows;
}

// ---- Checks ----------------------------------------------------------------------------------

// |got - want| <= atol + rtol |want| element-wise; -inf (lse of a row without keys) must match.
::testing::AssertionResult close(const char* what, const std::vector<double>& got,
                                 const std::vector<double>& want, double rtol, double atol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " values, want " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    if (!(std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i])))
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << got[i] << ", want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

// |got - want| <= u |want| + 1.05 bound + atol (the bf16 model; `bound` may be null).
::testing::AssertionResult within_bound(const char* what, const std::vector<double>& got,
                                        const std::vector<double>& want,
                                        const std::vector<double>* bound, double atol) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double tol = bf16::kU * std::abs(want[i]) + (bound ? 1.05 * (*bound)[i] : 0.0) + atol;
    if (!(std::abs(got[i] - want[i]) <= tol))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", want "
                                           << want[i] << " (tol " << tol << ")";
  }
  return ::testing::AssertionSuccess();
}

void expect_same_bits(const char* what, const std::vector<double>& a,
                      const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (a.empty()) return;  // not computed by this row (memcmp takes no null pointers)
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double))) << what;
}

void expect_same_result(const Result& a, const Result& b) {
  expect_same_bits("out", a.out, b.out);
  expect_same_bits("lse", a.lse, b.lse);
  expect_same_bits("dq", a.dq, b.dq);
  expect_same_bits("dk", a.dk, b.dk);
  expect_same_bits("dv", a.dv, b.dv);
}

void check_against_oracle(const Impl& impl, const Case& c, const Result& got, const Expected& want,
                          const bf16::Reference& model) {
  const double gscale = std::max({max_abs(want.dq), max_abs(want.dk), max_abs(want.dv)});
  const bool grads = !got.dq.empty();
  switch (impl.tol) {
    case Tol::kFp32:
    case Tol::kFp32Reordered: {
      const double t = impl.tol == Tol::kFp32 ? 2e-6 : 2e-5;
      EXPECT_TRUE(close("out", got.out, want.out, t, t));
      EXPECT_TRUE(close("lse", got.lse, want.lse, t, t));
      if (!got.weights.empty()) {
        EXPECT_TRUE(close("weights", got.weights, want.weights, t, t));
      }
      const double g = (impl.tol == Tol::kFp32 ? 1e-5 : 1e-4) * gscale;
      if (grads) {
        EXPECT_TRUE(close("dq", got.dq, want.dq, 0, g));
        EXPECT_TRUE(close("dk", got.dk, want.dk, 0, g));
        EXPECT_TRUE(close("dv", got.dv, want.dv, 0, g));
      }
      break;
    }
    case Tol::kBf16Native:
    case Tol::kBf16Fallback: {
      EXPECT_TRUE(within_bound("out", got.out, want.out, &model.out_bound, 0.0));
      for (size_t i = 0; i < got.lse.size(); ++i)
        if (!std::isinf(want.lse[i]) || got.lse[i] != want.lse[i]) {
          EXPECT_NEAR(got.lse[i], want.lse[i], 2e-4 + 1e-5 * std::abs(want.lse[i])) << i;
        }
      const double atol = 1e-4 * gscale;
      if (impl.tol == Tol::kBf16Native) {
        const auto bq = bf16::native_bound(&model.dq_bound, model.dq_abs);
        const auto bk = bf16::native_bound(&model.dk_bound, model.dk_abs);
        const auto bv = bf16::native_bound(nullptr, model.dv_abs);
        EXPECT_TRUE(within_bound("dq", got.dq, want.dq, &bq, atol));
        EXPECT_TRUE(within_bound("dk", got.dk, want.dk, &bk, atol));
        EXPECT_TRUE(within_bound("dv", got.dv, want.dv, &bv, atol));
      } else {
        EXPECT_TRUE(within_bound("dq", got.dq, want.dq, &model.dq_bound, atol));
        EXPECT_TRUE(within_bound("dk", got.dk, want.dk, &model.dk_bound, atol));
        EXPECT_TRUE(within_bound("dv", got.dv, want.dv, nullptr, atol));
      }
      break;
    }
    case Tol::kBf16Reordered: {  // as tests/ring_harness.hpp: relative to the largest value
      EXPECT_TRUE(close("out", got.out, want.out, 0, 2e-2 * std::max(1.0, max_abs(want.out))));
      EXPECT_TRUE(close("lse", got.lse, want.lse, 1e-3, 1e-3));
      const double g = 3e-2 * std::max(1.0, gscale);
      EXPECT_TRUE(close("dq", got.dq, want.dq, 0, g));
      EXPECT_TRUE(close("dk", got.dk, want.dk, 0, g));
      EXPECT_TRUE(close("dv", got.dv, want.dv, 0, g));
      break;
    }
  }
  (void)c;
}

// The sweep: sizes straddle every tile (fp32 query block 192 / key tile 64 on AVX-512, 96 / 32
// on AVX2, scalar 4-key tiles; bf16 query block 192, key tile 64, backward key block 64 and
// query tile 96) from 1 to 2x, T != S, odd T and S (a padded pair in bf16), odd and large head
// widths, Dv != D. The schedule (kernels/cpu/flash_driver.hpp) halves the forward's query
// blocks and splits each row's keys over several backward items (dQ shares summed in order)
// when B is small, as it is in every size but {16, 200, 64}, which keeps whole blocks and one
// backward item per row. S % 4 == 0 cases take the vectorized dropout draw and record its
// decisions. Every size runs with no lengths, 1-D and 2-D lengths (zeros included), causal or
// not, dropout 0 and 0.3, both masked-row policies and the three view layouts, in turns.
std::vector<Case> cases() {
  const int64_t sizes[][5] = {
      {1, 1, 1, 16, 16},     {2, 7, 5, 17, 17},      {1, 97, 65, 33, 33},     {2, 64, 64, 64, 64},
      {1, 200, 130, 64, 48}, {1, 96, 193, 128, 128}, {1, 193, 129, 128, 128}, {1, 33, 17, 256, 256},
      {1, 5, 140, 3, 7},     {2, 100, 128, 32, 32},  {1, 385, 70, 80, 80},    {2, 131, 520, 24, 40},
      {1, 250, 96, 40, 24},  {16, 200, 64, 16, 16}};
  std::vector<Case> out;
  int layout = 0;
  for (const auto& sz : sizes)
    for (Lens lens : {Lens::kNone, Lens::k1D, Lens::k2D})
      for (bool causal : {false, true})
        for (float p : {0.0f, 0.3f}) {
          const bool zero = (layout % 2) == 1;
          out.push_back({sz[0], sz[1], sz[2], sz[3], sz[4], lens, causal, zero, p, layout % 3});
          ++layout;
        }
  return out;
}

class AttentionCases : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCases, EveryImplementationMatchesTheOracle) {
  const Case c = GetParam();
  const KernelProblem<uint16_t> inputs(c);  // the bf16 values every row sees
  const Expected want = oracle(inputs, /*backward=*/true);
  const bf16::Reference model = bf16::reference(inputs);
  const bool timing = std::getenv("ATTN_CASES_TIMING") != nullptr;  // per-row milliseconds
  for (const Impl& impl : implementations()) {
    if (!impl.serves(c)) continue;
    SCOPED_TRACE(impl.name);
    const auto start = std::chrono::steady_clock::now();
    const Result one = impl.run(c, RunSpec{});
    check_against_oracle(impl, c, one, want, model);
    // Any thread count gives the same bits (static work items, fixed merge orders).
    for (int threads : impl.kernel_row ? std::vector<int>{2, 3, 7} : std::vector<int>{2}) {
      SCOPED_TRACE(std::to_string(threads) + " threads");
      Result again = impl.run(c, RunSpec{threads});
      again.weights.clear();
      Result first = one;
      first.weights.clear();
      expect_same_result(first, again);
    }
    // The forward's recorded dropout decisions, read by the backward instead of the stream: the
    // same bits as drawing them again, at 1 thread and stream base 0, and at 2 threads with
    // another base (a data-parallel shard's).
    if (impl.kernel_row && c.dropout > 0)
      for (const RunSpec& drawn_spec : {RunSpec{1, 0, false, 0}, RunSpec{2, 0, false, 12}}) {
        SCOPED_TRACE("recorded dropout, base " + std::to_string(drawn_spec.index_base));
        RunSpec kept_spec = drawn_spec;
        kept_spec.record_dropout = true;
        Result drawn = drawn_spec.index_base == 0 ? one : impl.run(c, drawn_spec);
        Result kept = impl.run(c, kept_spec);
        drawn.weights.clear(), kept.weights.clear();
        expect_same_result(drawn, kept);
      }
    if (timing)
      std::printf(
          "%-20s %8.1f ms\n", impl.name.c_str(),
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name();
}
INSTANTIATE_TEST_SUITE_P(Sweep, AttentionCases, ::testing::ValuesIn(cases()), case_name);

// The table itself: every row serves the cases it claims, and the rows a reader expects exist.
TEST(AttentionCases, TableHasEveryImplementation) {
  std::vector<std::string> names;
  for (const Impl& impl : implementations())
    names.push_back(impl.name);
  for (const char* want : {"bf16 fallback", "heads fp32", "heads bf16", "decode fp32 cache",
                           "decode bf16 cache", "ring fp32, 1 rank", "ring bf16, 1 rank"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  EXPECT_GE(names.size(), 8u);
}

}  // namespace
}  // namespace attn::testing
