// The library called from several threads at once: results equal those of one caller.
//
// History: two trainings in two std::threads used to crash inside oneDNN's JIT code, because the
// cached matmul primitives (kernels/cpu/matmul.cpp) ran with oneDNN's library-managed scratchpad,
// which is one buffer for all primitives and only allows a primitive to run in the thread that
// created it. The plans now take a per-thread user scratchpad. These tests call the shared
// kernels from several threads at once, many times, so a regression shows up as a crash (or a
// sanitizer report in the ASan run) or as a wrong number.
#include "attn/core/context.hpp"
#include "attn/model/experiment.hpp"
#include "attn/nn/attention.hpp"
#include "kernels/cpu/matmul.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

namespace attn {
namespace {

std::vector<float> pattern(int64_t n, float scale) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[static_cast<size_t>(i)] = scale * static_cast<float>((i * 37 + 11) % 97 - 48) / 48.0f;
  return x;
}

// The same GEMM plan (one shape, so one cached primitive) executed by 4 threads at once, 50
// times each, with and without the accumulate post-op: every result equals the single-threaded
// one bit for bit (same primitive, same thread count inside it).
TEST(Threads, SharedGemmPlansRunConcurrently) {
  const int64_t M = 96, N = 80, K = 72;
  const std::vector<float> A = pattern(M * K, 1.0f), B = pattern(K * N, 0.5f);
  auto product = [&](bool accumulate, std::vector<float>& C) {
    cpu::GemmArgs g;
    g.M = M, g.N = N, g.K = K;
    g.A = A.data(), g.lda = K;
    g.B = B.data(), g.ldb = N;
    g.C = C.data(), g.ldc = N;
    g.accumulate = accumulate;
    cpu::gemm(g, 1);
  };
  for (bool accumulate : {false, true}) {
    std::vector<float> expected(static_cast<size_t>(M * N), 1.0f);
    product(accumulate, expected);
    std::vector<int> mismatches(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int rep = 0; rep < 50; ++rep) {
          std::vector<float> C(static_cast<size_t>(M * N), 1.0f);
          product(accumulate, C);
          if (C != expected) ++mismatches[static_cast<size_t>(t)];
        }
      });
    }
    for (auto& th : threads)
      th.join();
    for (int t = 0; t < 4; ++t)
      EXPECT_EQ(mismatches[static_cast<size_t>(t)], 0)
          << "thread " << t << " accumulate " << accumulate;
  }
}

// Multi-head attention modules (projections through oneDNN, fused attention kernel) forward and
// backward in 3 threads at once, each with its own module and Context: the same outputs and
// gradients as one thread alone.
TEST(Threads, IndependentModulesInParallel) {
  const int64_t B = 2, T = 12, E = 16, H = 2;
  Tensor X = Tensor::from_vector(pattern(B * T * E, 1.0f), {B, T, E});
  Tensor dY = Tensor::from_vector(pattern(B * T * E, 0.25f), {B, T, E});
  auto run = [&](std::vector<float>& out, std::vector<float>& dx) {
    Context ctx;
    ctx.threads = 1;
    ctx.seed = 7;
    nn::MultiHeadAttention mha(E, H, 0.0, /*bias=*/true, DType::F32, /*seed=*/3);
    mha.attention.need_weights = false;
    for (int rep = 0; rep < 20; ++rep) {
      const Tensor y = mha.forward(ctx, X, X, X);
      const nn::AttentionInputGrads g = mha.backward(ctx, dY);
      out.assign(y.data<float>(), y.data<float>() + y.numel());
      const Tensor dx_sum = g.dqueries.contiguous();
      dx.assign(dx_sum.data<float>(), dx_sum.data<float>() + dx_sum.numel());
    }
  };
  std::vector<float> out1, dx1;
  run(out1, dx1);
  std::vector<std::vector<float>> outs(3), dxs(3);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 3; ++t)
    threads.emplace_back([&, t] { run(outs[t], dxs[t]); });
  for (auto& th : threads)
    th.join();
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(outs[t], out1) << "thread " << t;
    EXPECT_EQ(dxs[t], dx1) << "thread " << t;
  }
}

// The positional experiment with 2 runs at a time reports exactly what it reports with one.
TEST(Threads, ExperimentJobsDoNotChangeResults) {
  model::PositionalExperimentOptions o;
  o.seeds = 1;
  o.steps = 25;
  o.eval_examples = 16;
  o.length_factors = {1, 2};
  o.variants = {nn::PositionalKind::kNone, nn::PositionalKind::kSinusoidal,
                nn::PositionalKind::kLearned};
  o.jobs = 1;
  const auto serial = model::run_positional_experiment(o);
  o.jobs = 2;
  const auto parallel = model::run_positional_experiment(o);
  ASSERT_EQ(serial.size(), parallel.size());
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_EQ(serial[i].positional, parallel[i].positional);
    EXPECT_EQ(serial[i].accuracy, parallel[i].accuracy) << "run " << i;
    EXPECT_EQ(serial[i].final_loss, parallel[i].final_loss) << "run " << i;
  }
}

}  // namespace
}  // namespace attn
