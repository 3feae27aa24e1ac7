// oneDNN GEMM (kernels/cpu/matmul) and the linear op's fast path against plain-loop references.
//
// Tolerances come from the precision, not from what happened to pass. For an f32 dot product of
// length K computed in any order (blocked, FMA or not), Higham's bound (Accuracy and Stability
// of Numerical Algorithms, Thm 3.1 and section 3.1) gives
//   |c - c_exact| <= gamma_n * sum_k |a_k b_k|,   gamma_n = n u / (1 - n u),  u = 2^-24,
// with n = K plus one term each for the bias add, the accumulate add and the final rounding of
// the reference to f32. We check exactly that bound element by element, so a wrong index or a
// dropped term (errors of order |c|) fails, while any legitimate summation order passes.
// bf16 inputs: a product of two bf16 numbers is exact in f32, so against a float64 reference of
// the *rounded* inputs the same f32 bound holds; against the unrounded f32 inputs the error is
// dominated by rounding the inputs to 8 significant bits (relative 2^-9 each), and we check
// ||C - C_exact||_F <= 1e-2 ||C_exact||_F, as DESIGN.md states for bf16.
#include "attn/ops/linear.hpp"
#include "kernels/cpu/gemm_rows.hpp"
#include "kernels/cpu/matmul.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu/task_shares.hpp"
#include "testing.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace attn {
namespace {

// Every kernel forks as far as a test asks, whatever the size (kernels/cpu/parallel.hpp), so that
// the thread-count comparisons below run the parallel paths on these small shapes too.
const bool kForkAtAnySize = (attn::cpu::set_min_flops_per_thread(0), true);

using attn::testing::random_tensor;

constexpr double kU32 = 1.0 / (1 << 24);  // unit roundoff of f32
double gamma_n(int64_t n) {
  return n * kU32 / (1.0 - n * kU32);
}

// A GEMM problem in the layouts of matmul.hpp, with its own buffers. Every matrix lives at an
// odd element offset inside a larger buffer (misaligned) and rows may be padded (strided); the
// padding of C holds a sentinel that must survive.
struct Problem {
  int64_t M, N, K;
  bool trans_a, trans_b, bias, accumulate;
  int64_t pad;  // extra elements per row of A, B and C
  static constexpr float kSentinel = 1234.5f;

  Problem(int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool with_bias, bool acc, int64_t pd)
      : M(m), N(n), K(k), trans_a(ta), trans_b(tb), bias(with_bias), accumulate(acc), pad(pd) {}

  std::vector<float> a, b, c, bias_v, c_old;
  int64_t lda = 0, ldb = 0, ldc = 0;
  static constexpr int64_t kOffset = 1;  // misalign every matrix by one float

  void fill(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    lda = a_cols + pad;
    ldb = b_cols + pad;
    ldc = N + pad;
    a.assign(kOffset + a_rows * lda, 0.f);
    b.assign(kOffset + b_rows * ldb, 0.f);
    c.assign(kOffset + M * ldc, kSentinel);
    for (int64_t r = 0; r < a_rows; ++r)
      for (int64_t j = 0; j < a_cols; ++j)
        a[kOffset + r * lda + j] = u(rng);
    for (int64_t r = 0; r < b_rows; ++r)
      for (int64_t j = 0; j < b_cols; ++j)
        b[kOffset + r * ldb + j] = u(rng);
    bias_v.assign(N, 0.f);
    if (bias)
      for (auto& v : bias_v)
        v = u(rng);
    if (accumulate)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n)
          c[kOffset + m * ldc + n] = u(rng);
    c_old = c;
  }
  float A(int64_t m, int64_t k) const { return a[kOffset + (trans_a ? k * lda + m : m * lda + k)]; }
  float B(int64_t k, int64_t n) const { return b[kOffset + (trans_b ? n * ldb + k : k * ldb + n)]; }
  cpu::GemmArgs args(float* out) const {
    cpu::GemmArgs g;
    g.M = M, g.N = N, g.K = K;
    g.A = a.data() + kOffset, g.lda = lda, g.trans_a = trans_a;
    g.B = b.data() + kOffset, g.ldb = ldb, g.trans_b = trans_b;
    g.C = out + kOffset, g.ldc = ldc;
    g.bias = bias ? bias_v.data() : nullptr;
    g.accumulate = accumulate;
    return g;
  }
  // The same A and B as bfloat16 bits (same layout and offsets), and args that read them.
  struct Bf16 {
    std::vector<uint16_t> a, b;
  };
  Bf16 as_bf16() const {
    Bf16 m{std::vector<uint16_t>(a.size()), std::vector<uint16_t>(b.size())};
    for (size_t j = 0; j < a.size(); ++j)
      m.a[j] = float_to_bf16(a[j]);
    for (size_t j = 0; j < b.size(); ++j)
      m.b[j] = float_to_bf16(b[j]);
    return m;
  }
  cpu::GemmArgs bf16_args(const Bf16& m, float* out) const {
    cpu::GemmArgs g = args(out);
    g.type = cpu::GemmType::kBF16;
    g.A = m.a.data() + kOffset;
    g.B = m.b.data() + kOffset;
    return g;
  }
  std::string name() const {
    return fmt::format("M={} N={} K={} trans_a={} trans_b={} bias={} accumulate={} pad={}", M, N, K,
                       trans_a, trans_b, bias, accumulate, pad);
  }

  // Checks `c` against the float64 product with the Higham bound; `round` maps an input value
  // to what the kernel multiplied (identity for f32, bf16 rounding for the bf16 path).
  ::testing::AssertionResult verify(const std::vector<float>& out,
                                    float (*round)(float) = nullptr) const {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double exact = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          double p = static_cast<double>(round ? round(A(m, k)) : A(m, k)) *
                     (round ? round(B(k, n)) : B(k, n));
          exact += p;
          mag += std::abs(p);
        }
        const double old = accumulate ? c_old[kOffset + m * ldc + n] : 0.0;
        exact += bias_v[n] + old;
        mag += std::abs(bias_v[n]) + std::abs(old);
        const double got = out[kOffset + m * ldc + n];
        const double bound = gamma_n(K + 2) * mag;
        if (!(std::abs(got - exact) <= bound))
          return ::testing::AssertionFailure()
                 << name() << ": C[" << m << "," << n << "] = " << got << ", exact " << exact
                 << ", |diff| " << std::abs(got - exact) << " > bound " << bound;
      }
      for (int64_t n = N; n < ldc; ++n)
        if (out[kOffset + m * ldc + n] != kSentinel)
          return ::testing::AssertionFailure() << name() << ": wrote into the padding of row " << m;
    }
    if (out[0] != kSentinel) return ::testing::AssertionFailure() << name() << ": wrote before C";
    return ::testing::AssertionSuccess();
  }
};

// Sizes around oneDNN's register blocks (16 floats per zmm, 8..32-row micro-tiles) and odd ones.
const std::vector<int64_t> kSizes = {1,  2,  3,  5,  7,  8,  15,  16,  17,  31, 32,
                                     33, 48, 63, 64, 65, 97, 127, 128, 129, 130};

TEST(GemmCpu, EveryLayoutAndFlagOnFixedShapes) {
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                         {1, 130, 7},
                         {130, 1, 65},
                         {17, 33, 1},
                         {65, 31, 129}}) {
    for (int flags = 0; flags < 16; ++flags) {
      for (int64_t pad : {0, 5}) {
        Problem p{M, N, K, bool(flags & 1), bool(flags & 2), bool(flags & 4), bool(flags & 8), pad};
        p.fill(1000 + flags);
        std::vector<float> out = p.c;
        cpu::gemm(p.args(out.data()), 2);
        ASSERT_TRUE(p.verify(out));
      }
    }
  }
}

TEST(GemmCpu, RandomSweepOfShapes) {
  // 400 problems drawn from the size list with every flag; a seeded draw keeps failures
  // reproducible (the message prints the case).
  std::mt19937_64 rng(42);
  auto pick = [&rng] { return kSizes[rng() % kSizes.size()]; };
  for (int i = 0; i < 400; ++i) {
    Problem p{
        pick(),          pick(),          pick(),          bool(rng() & 1),
        bool(rng() & 1), bool(rng() & 1), bool(rng() & 1), static_cast<int64_t>(rng() % 3) * 7};
    p.fill(i);
    std::vector<float> out = p.c;
    cpu::gemm(p.args(out.data()), 1 + static_cast<int>(rng() & 1));
    ASSERT_TRUE(p.verify(out));
  }
}

TEST(GemmCpu, EmptyContractionGivesBiasPlusOld) {
  for (bool accumulate : {false, true}) {
    Problem p{3, 5, 0, false, true, true, accumulate, 2};
    p.fill(7);
    std::vector<float> out = p.c;
    cpu::gemm(p.args(out.data()), 2);
    EXPECT_TRUE(p.verify(out));
  }
}

// A few rows times a small weight go through sgemm instead of the primitive (matmul.cpp): the
// linear layout with and without bias, accumulating, strided rows; other layouts of few rows and
// products too large for it stay on the primitive. Every one against the plain loops.
TEST(GemmCpu, FewRowsAgreeWithTheReference) {
  for (int64_t m : {1, 4, 5})
    for (int64_t n : {1, 7, 64, 236})
      for (int64_t k : {1, 16, 64, 130})
        for (bool ta : {false, true})
          for (bool tb : {false, true})
            for (bool bias : {false, true})
              for (bool acc : {false, true})
                for (int64_t pad : {0, 3}) {
                  Problem p{m, n, k, ta, tb, bias, acc, pad};
                  p.fill(static_cast<uint64_t>(n * 131 + k));
                  std::vector<float> out = p.c;
                  cpu::gemm(p.args(out.data()), 2);
                  EXPECT_TRUE(p.verify(out))
                      << "M " << m << " N " << n << " K " << k << " ta " << ta << " tb " << tb
                      << " bias " << bias << " acc " << acc;
                }
  cpu::gemm_cache_clear();
  Problem big{1, 512, 128, false, true, true, false, 0};  // 2^16 multiply-adds: the primitive
  big.fill(5);
  std::vector<float> out = big.c;
  cpu::gemm(big.args(out.data()), 1);
  EXPECT_TRUE(big.verify(out));
  // Where attn's row-exact kernel computes f32 (no AVX-512), no primitive is made.
  EXPECT_EQ(cpu::gemm_cache_size(), cpu::gemm_rows_preferred() ? 0u : 1u);
}

// Large enough for a primitive and for two threads (kernels/cpu/parallel.hpp: one thread per
// 2^22 flops), so that the thread count reaches the key.
TEST(GemmCpu, CachesOnePrimitivePerConfiguration) {
  if (cpu::gemm_rows_preferred())
    GTEST_SKIP() << "no oneDNN primitive on this CPU: its f32 products run on attn's row-exact "
                    "kernel (GemmRows tests)";
  cpu::gemm_cache_clear();
  Problem p{256, 128, 130, false, true, true, false, 0};
  p.fill(3);
  std::vector<float> out = p.c;
  cpu::gemm(p.args(out.data()), 2);
  cpu::gemm(p.args(out.data()), 2);  // same configuration, other call: reused
  EXPECT_EQ(cpu::gemm_cache_size(), 1u);
  cpu::gemm(p.args(out.data()), 1);  // thread count is part of the key
  EXPECT_EQ(cpu::gemm_cache_size(), 2u);
  Problem q = p;
  q.pad = 4;  // other strides: another primitive
  q.fill(3);
  std::vector<float> out2 = q.c;
  cpu::gemm(q.args(out2.data()), 2);
  EXPECT_EQ(cpu::gemm_cache_size(), 3u);
  EXPECT_TRUE(q.verify(out2));
}

// oneDNN fixes its thread partition when a primitive is created. For the products of
// MultiHeadAttention's projections it splits rows and columns, never the contraction, so 1 and
// 2 threads agree bitwise. (On its own threads it splits K of the weight-grad product dy^T x when
// the output is small next to the contraction, e.g. (M, N, K) = (512, 64, 4096), and thread
// counts differ in the last bits; attn cuts such products into chunks of K itself, which
// matmul.hpp documents; a fixed thread count stays reproducible either way.)
TEST(GemmCpu, ThreadCountBitwiseOnLinearShapes) {
  struct Shape3 {
    int64_t M, N, K;
    bool trans_a, trans_b;
  };
  // MHA at B=4, T=512, E=512: forward (x W^T), input grad (dy W), weight grad (dy^T x); then
  // odd sizes.
  for (auto s : {Shape3{2048, 512, 512, false, true}, Shape3{2048, 512, 512, false, false},
                 Shape3{512, 512, 2048, true, false}, Shape3{130, 97, 129, false, true},
                 Shape3{97, 130, 1000, true, false}}) {
    Problem p{s.M, s.N, s.K, s.trans_a, s.trans_b, true, false, 0};
    p.fill(11);
    std::vector<float> one = p.c, two = p.c;
    cpu::gemm(p.args(one.data()), 1);
    cpu::gemm(p.args(two.data()), 2);
    EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0)
        << p.name() << ": 1 and 2 threads differ";
  }
}

TEST(GemmCpu, FixedThreadCountIsReproducibleEvenWithKSplit) {
  Problem p{512, 64, 4096, true, false, false, false, 0};  // oneDNN splits K on 2 threads
  p.fill(12);
  std::vector<float> first = p.c, second = p.c;
  cpu::gemm(p.args(first.data()), 2);
  cpu::gemm(p.args(second.data()), 2);
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  EXPECT_TRUE(p.verify(first));
}

float round_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}

// gemm_panels: the same product in panels of output rows on a dynamic schedule. Every layout
// and flag, M around the panel cut (16-row multiples, ~16 panels), strided and misaligned;
// the result is within the bound and the same bits for 1, 2 and 3 threads (the cut depends on M
// alone).
TEST(GemmCpu, PanelsMatchTheBoundAndAnyThreadCount) {
  for (int64_t M : {1, 15, 16, 17, 255, 256, 257, 300, 1030}) {
    for (int flags = 0; flags < 16; ++flags) {
      Problem p{M, 33, 65, bool(flags & 1), bool(flags & 2), bool(flags & 4), bool(flags & 8), 3};
      p.fill(500 + M + flags);
      std::vector<float> one = p.c, two = p.c, three = p.c;
      cpu::gemm_panels(p.args(one.data()), 1);
      cpu::gemm_panels(p.args(two.data()), 2);
      cpu::gemm_panels(p.args(three.data()), 3);
      ASSERT_TRUE(p.verify(two));
      ASSERT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0)
          << p.name() << ": 1 and 2 threads differ";
      ASSERT_EQ(std::memcmp(one.data(), three.data(), one.size() * sizeof(float)), 0)
          << p.name() << ": 1 and 3 threads differ";
    }
  }
  // bfloat16 inputs (2-byte rows: the panel offsets in elements of the input type), f32 and bf16
  // outputs.
  for (int flags = 0; flags < 4; ++flags) {
    Problem p{300, 40, 70, bool(flags & 1), bool(flags & 2), true, false, 1};
    p.fill(900 + flags);
    const Problem::Bf16 m16 = p.as_bf16();
    std::vector<float> out = p.c;
    cpu::GemmArgs g = p.bf16_args(m16, out.data());
    cpu::gemm_panels(g, 2);
    ASSERT_TRUE(p.verify(out, round_bf16));
    std::vector<uint16_t> out16(p.c.size(), 0);
    g.C = nullptr;
    g.C_bf16 = out16.data() + Problem::kOffset;
    cpu::gemm_panels(g, 2);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        const size_t i = Problem::kOffset + m * p.ldc + n;
        ASSERT_LE(std::abs(bf16_to_float(out16[i]) - out[i]), std::abs(out[i]) / 128.0f + 1e-6f)
            << p.name() << ": bf16 output (" << m << ", " << n << ")";
      }
  }
}

// gemm() on 2+ threads cuts the plain and trans_b products into slices of rows, one
// single-thread primitive each (matmul.cpp, gemm_slices). Every flag, strided and misaligned, f32
// and bf16 inputs, f32 and bf16 outputs: within the bound, and the bits of the single-thread
// product for 2 and 3 threads, at row counts around the cuts (16-row multiples, at least 32 rows a
// slice) and below them (few rows with many columns stay with oneDNN's threads: same bits too).
TEST(GemmCpu, SlicedProductsAreTheSingleThreadBits) {
  struct Shape3 {
    int64_t M, N, K;
  };
  for (const Shape3 s :
       {Shape3{3040, 128, 128}, Shape3{97, 130, 129}, Shape3{64, 40, 65}, Shape3{63, 40, 65},
        Shape3{100, 33, 300}, Shape3{8, 130, 700}, Shape3{16, 96, 64}}) {
    for (int flags = 0; flags < 8; ++flags) {
      Problem p{s.M,
                s.N,
                s.K,
                false,
                bool(flags & 1),
                bool(flags & 2),
                bool(flags & 4),
                (flags & 1) ? 3 : 0};
      p.fill(700 + s.M + flags);
      std::vector<float> one = p.c, two = p.c, three = p.c;
      cpu::gemm(p.args(one.data()), 1);
      cpu::gemm(p.args(two.data()), 2);
      cpu::gemm(p.args(three.data()), 3);
      ASSERT_TRUE(p.verify(two));
      ASSERT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0)
          << p.name() << ": 1 and 2 threads differ";
      ASSERT_EQ(std::memcmp(one.data(), three.data(), one.size() * sizeof(float)), 0)
          << p.name() << ": 1 and 3 threads differ";
      // bfloat16 inputs, f32 then bf16 output.
      const Problem::Bf16 m16 = p.as_bf16();
      std::vector<float> one16 = p.c, two16 = p.c;
      cpu::gemm(p.bf16_args(m16, one16.data()), 1);
      cpu::gemm(p.bf16_args(m16, two16.data()), 2);
      ASSERT_TRUE(p.verify(two16, round_bf16));
      ASSERT_EQ(std::memcmp(one16.data(), two16.data(), one16.size() * sizeof(float)), 0)
          << p.name() << ": bf16 inputs, 1 and 2 threads differ";
      std::vector<uint16_t> c_one(p.c.size(), 0), c_two(p.c.size(), 0);
      std::vector<float> unused = p.c;
      cpu::GemmArgs g = p.bf16_args(m16, unused.data());
      g.C = nullptr;
      g.C_bf16 = c_one.data() + Problem::kOffset;
      cpu::gemm(g, 1);
      g.C_bf16 = c_two.data() + Problem::kOffset;
      cpu::gemm(g, 2);
      ASSERT_EQ(c_one, c_two) << p.name() << ": bf16 output, 1 and 2 threads differ";
    }
  }
}

// gemm_then: the task runs once for each of its parts (once as (0, 1) when the product is not
// cut), after the product; column_sum_part over all parts is column_sum's bits.
TEST(GemmCpu, TaskSharesTheRegionAndColumnSumPartsAreColumnSum) {
  for (const int64_t M : {8, 100, 3040}) {
    for (const int threads : {1, 2, 3}) {
      Problem p{M, 70, 33, false, true, true, false, 0};
      p.fill(40 + M);
      std::vector<float> out = p.c, alone = p.c;
      struct Seen {
        std::array<std::atomic<int>, 64> parts{};
        std::atomic<int> count{0};
      } seen;
      cpu::RegionTask task{[](void* data, int part, int parts) {
                             auto& s = *static_cast<Seen*>(data);
                             ++s.parts[part];
                             s.count = parts;
                           },
                           &seen};
      cpu::gemm_then(p.args(out.data()), threads, task);
      cpu::gemm(p.args(alone.data()), 1);
      EXPECT_EQ(out, alone) << p.name() << " threads " << threads;
      ASSERT_GE(seen.count, 1);
      ASSERT_LE(seen.count, 64);
      for (int part = 0; part < seen.count; ++part)
        EXPECT_EQ(seen.parts[part], 1) << "part " << part << " of " << seen.count;
      if (M < 64 || threads == 1) {
        EXPECT_EQ(seen.count, 1) << "M " << M;
      }
    }
  }
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (const int64_t N : {1, 31, 32, 33, 200}) {
    const int64_t M = 57, ld = N + 3;
    std::vector<float> dy(M * ld);
    for (auto& v : dy)
      v = u(rng);
    std::vector<uint16_t> dy16(dy.size());
    for (size_t i = 0; i < dy.size(); ++i)
      dy16[i] = float_to_bf16(dy[i]);
    for (const bool accumulate : {false, true}) {
      std::vector<float> whole(N, 0.25f), whole16(N, 0.25f);
      cpu::column_sum(dy.data(), M, N, ld, whole.data(), accumulate, 1);
      cpu::column_sum(dy16.data(), M, N, ld, whole16.data(), accumulate, 1);
      for (const int parts : {1, 2, 3, 7, 12}) {
        std::vector<float> cut(N, 0.25f), cut16(N, 0.25f);
        for (int part = 0; part < parts; ++part) {
          cpu::column_sum_part(dy.data(), M, N, ld, cut.data(), accumulate, part, parts);
          cpu::column_sum_part(dy16.data(), M, N, ld, cut16.data(), accumulate, part, parts);
        }
        EXPECT_EQ(cut, whole) << "N " << N << " parts " << parts;
        EXPECT_EQ(cut16, whole16) << "N " << N << " parts " << parts << " (bf16)";
      }
    }
  }
}

// TaskShares (kernels/cpu/task_shares.hpp): every task runs exactly once, whatever the team
// (as many threads as shares, fewer, one) and the claims' grain, and a thread stalled at the start
// of its share has its tasks taken by the others.
TEST(TaskShares, EveryTaskRunsOnceAndAStalledShareIsTaken) {
  for (const int64_t n : {0, 1, 2, 7, 64, 1000}) {
    for (const int parts : {1, 2, 3, 8, 12}) {  // 12: more shares than kept inline
      for (const int team : {1, 2, parts}) {
        const int64_t grain = 1 + n % 5;  // 1, 2, 3 or 5
        cpu::TaskShares shares(n, parts, grain);
        std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
        std::vector<std::thread> threads;
        for (int t = 0; t < team; ++t)
          threads.emplace_back([&, t] { shares.run(t, [&](int64_t i) { ++runs[i]; }); });
        for (auto& th : threads)
          th.join();
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(runs[i], 1) << "task " << i << " of " << n << ", " << parts << " shares, team "
                                << team << ", grain " << grain;
      }
    }
  }
  // Thread 1 waits before claiming anything until thread 0 is done: thread 0 runs all 100 tasks.
  cpu::TaskShares shares(100, 2);
  std::atomic<bool> done{false};
  std::vector<int> ran_by(100, -1);
  std::thread slow([&] {
    while (!done.load())
      std::this_thread::yield();
    shares.run(1, [&](int64_t i) { ran_by[i] = 1; });
  });
  shares.run(0, [&](int64_t i) { ran_by[i] = 0; });
  done = true;
  slow.join();
  EXPECT_EQ(std::count(ran_by.begin(), ran_by.end(), 0), 100);
}

TEST(GemmCpu, Bf16InputsF32Output) {
  std::mt19937_64 rng(5);
  auto pick = [&rng] { return kSizes[rng() % kSizes.size()]; };
  for (int i = 0; i < 60; ++i) {
    Problem p{
        pick(),          pick(),          pick(),          bool(rng() & 1),
        bool(rng() & 1), bool(rng() & 1), bool(rng() & 1), static_cast<int64_t>(rng() % 2) * 3};
    p.fill(100 + i);
    const Problem::Bf16 m16 = p.as_bf16();
    std::vector<float> out = p.c;
    cpu::GemmArgs g = p.bf16_args(m16, out.data());
    cpu::gemm(g, 2);
    // Exact f32 arithmetic on the rounded inputs: the f32 bound.
    ASSERT_TRUE(p.verify(out, round_bf16));
    // Against the unrounded inputs: relative Frobenius error of bf16.
    double err2 = 0, ref2 = 0;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        double exact = p.bias_v[n] + (p.accumulate ? p.c_old[Problem::kOffset + m * p.ldc + n] : 0);
        for (int64_t k = 0; k < p.K; ++k)
          exact += static_cast<double>(p.A(m, k)) * p.B(k, n);
        const double d = out[Problem::kOffset + m * p.ldc + n] - exact;
        err2 += d * d;
        ref2 += exact * exact;
      }
    EXPECT_LE(std::sqrt(err2), 1e-2 * std::sqrt(ref2)) << p.name();
  }
}

// Where oneDNN has no bf16 matmul (below AVX-512) a bf16 product is the f32 product of the
// widened inputs: bitwise what gemm() computes on f32 copies of them, on 1 and 2 threads (cut
// into the same slices), in every layout, with the bias and the old C; a bf16 output is that
// f32 value (plus the old bf16 value, with accumulate) rounded once. Forced on here, so that CPUs
// with native bf16 test the path too; both ways of widening: inside the row-exact kernel's pieces
// (CPUs with AVX2) and the whole inputs first (gemm_widened, CPUs without AVX2).
TEST(GemmCpu, WidenedBf16IsTheF32ProductOfTheWidenedInputs) {
  std::mt19937_64 rng(9);
  auto pick = [&rng] { return kSizes[rng() % kSizes.size()]; };
  cpu::gemm_force_widened_bf16(true);
  for (int i = 0; i < 40; ++i) {
    cpu::gemm_force_widened_whole_bf16(i % 2 == 1);
    Problem p{pick(),
              pick(),
              pick() * (i % 4 == 0 ? 8 : 1),
              bool(rng() & 1),
              bool(rng() & 1),
              bool(rng() & 1),
              bool(rng() & 1),
              static_cast<int64_t>(rng() % 2) * 3};
    p.fill(300 + i);
    const Problem::Bf16 m16 = p.as_bf16();
    Problem wide = p;  // the same problem on the widened values, in f32
    for (size_t j = 0; j < p.a.size(); ++j)
      wide.a[j] = bf16_to_float(m16.a[j]);
    for (size_t j = 0; j < p.b.size(); ++j)
      wide.b[j] = bf16_to_float(m16.b[j]);
    // The f32 products to compare with run on the kernel the widened path takes: attn's
    // row-exact one where it widens inside the pieces (on AVX-512 CPUs f32 products otherwise go
    // to oneDNN, whose bits differ: the GPU host's AMX Xeon failed this test so, session 24).
    const bool pieces = i % 2 == 0 && cpu::gemm_rows_supported();
    cpu::gemm_set_f32_kernel(pieces ? cpu::GemmF32Kernel::kRows : cpu::GemmF32Kernel::kAuto);
    for (int threads : {1, 2}) {
      std::vector<float> got = p.c, want = p.c;
      cpu::gemm(p.bf16_args(m16, got.data()), threads);
      cpu::gemm(wide.args(want.data()), threads);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
          << p.name() << " threads " << threads << (i % 2 == 1 ? " (whole inputs widened)" : "");
      // A bf16 output: the f32 result (with the old value added in f32) rounded once.
      std::vector<uint16_t> c16(p.c.size());
      for (size_t j = 0; j < c16.size(); ++j)
        c16[j] = float_to_bf16(p.c[j]);
      const std::vector<uint16_t> c16_old = c16;
      cpu::GemmArgs g = p.bf16_args(m16, nullptr);
      g.C = nullptr, g.C_bf16 = c16.data() + Problem::kOffset;
      cpu::gemm(g, threads);
      std::vector<float> product = p.c;  // without the old C
      cpu::GemmArgs w = wide.args(product.data());
      w.accumulate = false;
      cpu::gemm(w, threads);
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t n = 0; n < p.ldc; ++n) {
          const size_t j = static_cast<size_t>(Problem::kOffset + m * p.ldc + n);
          const float old = bf16_to_float(c16_old[j]);
          const uint16_t expect =
              n >= p.N ? c16_old[j] : float_to_bf16(p.accumulate ? old + product[j] : product[j]);
          ASSERT_EQ(c16[j], expect) << p.name() << " threads " << threads << " at " << m << "," << n
                                    << (i % 2 == 1 ? " (whole inputs widened)" : "");
        }
    }
  }
  cpu::gemm_force_widened_whole_bf16(false);
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kAuto);
  cpu::gemm_force_widened_bf16(false);
}

// attn's row-exact f32 kernel (gemm_rows.hpp; what CPUs without AVX-512 run, forced on here where
// the CPU has AVX2): within the f32 bound in every layout, and a row's bits are the same however
// the rows are cut (pieces of 1, 2, 3, 7, 8, 16, 97 rows, as slices, tail pieces or the shards of
// a data-parallel batch cut them) and on 1, 2 and 3 threads, trans_a included.
TEST(GemmRows, RowsAreTheSameInAnyPieceAndOnAnyThreadCount) {
  if (!cpu::gemm_rows_supported()) GTEST_SKIP() << "no AVX2 + FMA";
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kRows);
  std::mt19937_64 rng(11);
  auto pick = [&rng] { return kSizes[rng() % kSizes.size()]; };
  for (int i = 0; i < 48; ++i) {
    Problem p{pick() * (i % 3 == 0 ? 3 : 1),
              pick(),
              pick() * (i % 5 == 0 ? 4 : 1),
              bool(rng() & 1),
              bool(rng() & 1),
              bool(rng() & 1),
              bool(rng() & 1),
              static_cast<int64_t>(rng() % 2) * 3};
    p.fill(700 + i);
    std::vector<float> whole = p.c;
    cpu::gemm(p.args(whole.data()), 1);
    ASSERT_TRUE(p.verify(whole));
    // The kernel's contract, bit for bit: one fused multiply-add chain over k from 0, + bias,
    // then + the old C.
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        float acc = 0.0f;
        for (int64_t k = 0; k < p.K; ++k)
          acc = std::fma(p.A(m, k), p.B(k, n), acc);
        if (p.bias) acc += p.bias_v[n];
        const size_t at = Problem::kOffset + m * p.ldc + n;
        if (p.accumulate) acc = p.c_old[at] + acc;
        ASSERT_EQ(0, std::memcmp(&acc, &whole[at], sizeof(float)))
            << p.name() << " at " << m << "," << n << ": " << acc << " vs " << whole[at];
      }
    for (int threads : {2, 3}) {
      std::vector<float> out = p.c;
      cpu::gemm(p.args(out.data()), threads);
      ASSERT_EQ(0, std::memcmp(whole.data(), out.data(), out.size() * sizeof(float)))
          << p.name() << " threads " << threads;
    }
    for (int64_t piece : {1, 2, 3, 7, 8, 16, 97}) {
      std::vector<float> out = p.c;
      for (int64_t m0 = 0; m0 < p.M; m0 += piece) {
        cpu::GemmArgs g = p.args(out.data());
        g.M = std::min(piece, p.M - m0);
        g.A = p.a.data() + Problem::kOffset + (p.trans_a ? m0 : m0 * p.lda);
        g.C = out.data() + Problem::kOffset + m0 * p.ldc;
        cpu::gemm(g, 1);
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), out.data(), out.size() * sizeof(float)))
          << p.name() << " in pieces of " << piece << " rows";
    }
  }
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kAuto);
}

// The weight gradient on oneDNN (WgradCut): a product with trans_a on oneDNN's threads or in
// chunks of 512 rows of the contraction (partials summed in chunk order) is within the bound for
// every flag; the chunks (K > 512) give the same bits on 1, 2 and 3 threads (up to one a chunk);
// a bf16 output is the float output rounded once. oneDNN's f32 kernel forced, so that any CPU
// runs them.
TEST(GemmCpu, WeightGradientCutsAreWithinTheBound) {
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kOneDnn);
  struct Shape3 {
    int64_t M, N, K;
  };
  for (const cpu::WgradCut cut : {cpu::WgradCut::kOneDnn, cpu::WgradCut::kChunksOfK}) {
    cpu::gemm_set_wgrad_cut(cut);
    for (const Shape3 s :
         {Shape3{33, 48, 513}, Shape3{5, 40, 2049}, Shape3{64, 97, 1537}, Shape3{40, 33, 511}}) {
      for (const bool trans_b : {false, true})
        for (const bool bias : {false, true})
          for (const bool accumulate : {false, true}) {
            Problem p{s.M, s.N, s.K, true, trans_b, bias, accumulate, 3};
            p.fill(1300 + s.K + trans_b + 2 * bias + 4 * accumulate);
            std::vector<std::vector<float>> out(3, p.c);
            for (int threads = 1; threads <= 3; ++threads) {
              cpu::gemm(p.args(out[threads - 1].data()), threads);
              EXPECT_TRUE(p.verify(out[threads - 1]))
                  << "cut " << static_cast<int>(cut) << ", threads " << threads;
            }
            // (K of at most one chunk takes oneDNN's threads: 511 checks that it still does.)
            // (and up to as many threads as chunks: more take oneDNN's threads).
            const int64_t chunks = cut == cpu::WgradCut::kChunksOfK ? (s.K + 511) / 512 : 0;
            for (int threads = 2; threads <= std::min<int64_t>(3, chunks); ++threads) {
              EXPECT_EQ(0, std::memcmp(out[0].data(), out[threads - 1].data(),
                                       out[0].size() * sizeof(float)))
                  << p.name() << ": 1 and " << threads << " threads differ";
            }
            if (!cpu::gemm_bf16_native() || accumulate) continue;
            // bf16 inputs, a float and a bf16 output (the same product rounded once).
            const Problem::Bf16 m = p.as_bf16();
            std::vector<float> f = p.c;
            cpu::gemm(p.bf16_args(m, f.data()), 2);
            EXPECT_TRUE(p.verify(f, round_bf16)) << "bf16, cut " << static_cast<int>(cut);
            std::vector<uint16_t> h(p.c.size(), 0);
            cpu::GemmArgs g = p.bf16_args(m, nullptr);
            g.C_bf16 = h.data() + Problem::kOffset;
            cpu::gemm(g, 2);
            for (int64_t r = 0; r < p.M; ++r)
              for (int64_t n = 0; n < p.N; ++n) {
                const int64_t i = Problem::kOffset + r * p.ldc + n;
                ASSERT_EQ(h[i], float_to_bf16(f[i]))
                    << p.name() << " bf16 output at " << r << "," << n;
              }
          }
    }
  }
  cpu::gemm_set_wgrad_cut(cpu::WgradCut::kChunksOfK);
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kAuto);
}

// Inside a GemmFixedPackingScope a product marked b_fixed keeps op(B)'s packing from call to call
// (on 1 and 2 threads: the whole product, column tasks and row slices): the same bits as without
// the scope; a B changed in place behind the scope's back (which its contract forbids) is still
// multiplied as packed first, which shows the packing was kept; after the scope, packed anew.
TEST(GemmRows, FixedPackingScopeKeepsAWeightsPackingUntilItEnds) {
  if (!cpu::gemm_rows_supported()) GTEST_SKIP() << "no AVX2 + FMA";
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kRows);
  for (int64_t M : {1, 5, 200}) {
    for (int threads : {1, 2}) {
      Problem p{M, 40, 33, false, true, true, false, 0};
      p.fill(900 + M);
      cpu::GemmArgs g = p.args(nullptr);
      g.b_fixed = true;
      std::vector<float> plain = p.c, first = p.c, again = p.c, after = p.c, changed = p.c;
      g.C = plain.data() + Problem::kOffset;
      cpu::gemm(g, threads);
      const std::vector<float> b_before = p.b;
      {
        cpu::GemmFixedPackingScope scope;
        cpu::GemmFixedPackingScope nested;  // nestable: the outer one's end frees
        g.C = first.data() + Problem::kOffset;
        cpu::gemm(g, threads);
        ASSERT_EQ(0, std::memcmp(plain.data(), first.data(), plain.size() * sizeof(float)))
            << p.name() << " threads " << threads;
        for (float& v : p.b)
          v *= 2.0f;
        g.C = again.data() + Problem::kOffset;
        cpu::gemm(g, threads);
        ASSERT_EQ(0, std::memcmp(plain.data(), again.data(), plain.size() * sizeof(float)))
            << p.name() << " threads " << threads << ": the packing was not kept";
      }
      g.C = after.data() + Problem::kOffset;
      cpu::gemm(g, threads);
      g.b_fixed = false;
      g.C = changed.data() + Problem::kOffset;
      cpu::gemm(g, threads);
      ASSERT_EQ(0, std::memcmp(after.data(), changed.data(), after.size() * sizeof(float)))
          << p.name() << " threads " << threads << ": the packing outlived its scope";
      ASSERT_NE(0, std::memcmp(plain.data(), after.data(), plain.size() * sizeof(float)));
      p.b = b_before;
    }
  }
  cpu::gemm_set_f32_kernel(cpu::GemmF32Kernel::kAuto);
}

// ---- The linear op: backend kCpu (oneDNN) against kReference (double accumulation) ----------

// Element-wise |x| as float64, for the error bounds.
Tensor abs64(const Tensor& t) {
  Tensor r = Tensor::empty(t.shape(), DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i)
    r.set_flat(i, std::abs(t.flat(i)));
  return r;
}

// |got - want| <= gamma_n * mag element-wise (mag holds sum |a_k b_k| per element).
::testing::AssertionResult within_bound(const Tensor& got, const Tensor& want, const Tensor& mag,
                                        int64_t n, const std::string& what) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure()
           << what << ": shape " << shape_str(got.shape()) << " vs " << shape_str(want.shape());
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double bound = gamma_n(n) * mag.flat(i);
    if (!(std::abs(got.flat(i) - want.flat(i)) <= bound))
      return ::testing::AssertionFailure() << what << " element " << i << ": " << got.flat(i)
                                           << " vs " << want.flat(i) << " (bound " << bound << ")";
  }
  return ::testing::AssertionSuccess();
}

struct LinearCase {
  Shape lead;  // leading dims of x
  int64_t in, out;
  bool bias;
  int64_t x_pad;  // x is a slice [1, 1 + in) of a wider last dim (strided rows, misaligned)
};

void check_linear(const LinearCase& c, uint64_t seed) {
  Shape wide = c.lead;
  wide.push_back(c.in + c.x_pad);
  Tensor x_full = random_tensor(wide, DType::F32, seed);
  Tensor x = c.x_pad > 0 ? x_full.slice(static_cast<int>(wide.size()) - 1, 1, 1 + c.in) : x_full;
  Tensor W = random_tensor({c.out, c.in}, DType::F32, seed + 1);
  Tensor b = c.bias ? random_tensor({c.out}, DType::F32, seed + 2) : Tensor();
  Shape y_shape = c.lead;
  y_shape.push_back(c.out);
  Tensor dy = random_tensor(y_shape, DType::F32, seed + 3);
  const std::string name = fmt::format("x {} (pad {}), W {}, bias {}", shape_str(x.shape()),
                                       c.x_pad, shape_str(W.shape()), c.bias);

  Context ref_ctx;
  ref_ctx.backend = Backend::kReference;
  Context fast_ctx;
  fast_ctx.backend = Backend::kCpu;
  fast_ctx.threads = 2;

  // Magnitudes for the bounds, in float64 through the reference op.
  Tensor ax = abs64(x), aW = abs64(W), ady = abs64(dy);
  Tensor y_mag = linear(ref_ctx, ax, aW, c.bias ? abs64(b) : Tensor());
  LinearGrads g_mag = linear_backward(ref_ctx, ady, ax, aW, c.bias);

  Tensor y_ref = linear(ref_ctx, x, W, b);
  Tensor y = linear(fast_ctx, x, W, b);
  ASSERT_EQ(y.dtype(), DType::F32);
  // K products + bias, + the reference's own rounding to f32.
  ASSERT_TRUE(within_bound(y, y_ref, y_mag, c.in + 2, "y: " + name));

  LinearGrads g_ref = linear_backward(ref_ctx, dy, x, W, c.bias);
  LinearGrads g = linear_backward(fast_ctx, dy, x, W, c.bias);
  const int64_t rows = shape_numel(c.lead);
  ASSERT_TRUE(within_bound(g.dx, g_ref.dx, g_mag.dx, c.out + 1, "dx: " + name));
  ASSERT_TRUE(within_bound(g.dW, g_ref.dW, g_mag.dW, rows + 1, "dW: " + name));
  ASSERT_EQ(g.db.defined(), c.bias) << name;
  if (c.bias) {
    ASSERT_TRUE(within_bound(g.db, g_ref.db, g_mag.db, rows + 1, "db: " + name));
  }
}

TEST(LinearCpu, MatchesReferenceOverShapes) {
  std::mt19937_64 rng(9);
  auto pick = [&rng] { return kSizes[rng() % kSizes.size()]; };
  uint64_t seed = 1;
  for (int i = 0; i < 80; ++i) {
    LinearCase c{{pick()}, pick(), pick(), bool(rng() & 1), static_cast<int64_t>(rng() % 2) * 3};
    SCOPED_TRACE(i);
    check_linear(c, seed += 10);
  }
}

TEST(LinearCpu, LeadingDimsAndSlices) {
  uint64_t seed = 500;
  for (const LinearCase& c :
       {LinearCase{{2, 3}, 5, 7, true, 0}, LinearCase{{4, 17}, 33, 9, false, 2},
        LinearCase{{1}, 1, 1, true, 0}, LinearCase{{2, 1, 3}, 130, 65, true, 5},
        LinearCase{{3, 65}, 64, 128, true, 1}}) {
    check_linear(c, seed += 10);
  }
}

TEST(LinearCpu, TransposedInputView) {
  // x as a transposed view (unit stride on the wrong axis) still gives the right answer.
  Tensor base = random_tensor({6, 5}, DType::F32, 77);
  Tensor x = base.transpose(0, 1);  // (5, 6), strides (1, 5)
  Tensor W = random_tensor({4, 6}, DType::F32, 78);
  Context ref_ctx;
  ref_ctx.backend = Backend::kReference;
  Context fast_ctx;
  fast_ctx.backend = Backend::kCpu;
  EXPECT_TRUE(attn::testing::close(linear(fast_ctx, x, W), linear(ref_ctx, x, W), 1e-5, 1e-6));
}

TEST(LinearCpu, AutoAndCpuAgreeBitwiseAcrossThreads) {
  Tensor x = random_tensor({4, 33, 64}, DType::F32, 31);
  Tensor W = random_tensor({48, 64}, DType::F32, 32);
  Tensor b = random_tensor({48}, DType::F32, 33);
  Context one, two;
  one.threads = 1;
  two.threads = 2;
  Tensor y1 = linear(one, x, W, b), y2 = linear(two, x, W, b);
  EXPECT_EQ(max_abs_diff(y1, y2), 0.0);
}

TEST(LinearCpu, Float64StaysOnTheReference) {
  // kAuto with float64 runs the reference loops: bitwise the reference result.
  Tensor x = random_tensor({7, 9}, DType::F64, 3);
  Tensor W = random_tensor({5, 9}, DType::F64, 4);
  Context ref_ctx;
  ref_ctx.backend = Backend::kReference;
  Context auto_ctx;
  EXPECT_EQ(max_abs_diff(linear(auto_ctx, x, W), linear(ref_ctx, x, W)), 0.0);
}

}  // namespace
}  // namespace attn
