// MultiHeadAttention on the CPU: inference and a training step, and where their time goes.
//
// Shapes of the issue: B = 4, E = 512, H = 8 (D = 64), self-attention X (B, T, E) with
// T = S in {512, 2048}, projections with bias (as PyTorch's nn.MultiheadAttention default, the
// baseline in bench/torch_mha.py), no dropout, no attention weights kept (need_weights = false,
// as the baseline's), fp32 (and bf16: the *Bf16 benchmarks), ATTN_THREADS threads (default 2).
//
// FLOPs (FlashAttention convention, DESIGN.md; softmax and bias adds not counted):
//   projections  2 * rows * E * E each; W_q, W_k, W_v on B*T rows, W_o on B*T rows
//   attention    4 * B * H * T * S * D                 (Q K^T and P V)
//   training     forward + backward = 3 * projections + 3.5 * attention
//                (a linear's backward is two GEMMs, dx and dW; attention's is 2.5x its forward)
// Padded inference (BM_MhaInferencePadded, BM_MhaInferencePaddedBf16): the same module and T, B
// sequences with valid lengths uniform in [T/2, T] (seeded), X padded to the longest of them,
// d2l's valid_lens (B,). Their GFLOP/s count the valid work only: the projections of the valid
// rows and the attention of valid queries over valid keys (4 * H * D * sum_b len_b^2). Counters:
// valid_fraction = sum_b len_b / (B * width); rows_bound = the valid work over the work done when
// every row, padded or not, goes through the projections and every query attends to its
// sequence's valid keys: padded / full GFLOP/s at rows_bound means padding costs its own rows'
// arithmetic and nothing more; at 1.0, nothing at all.
// Breakdown benchmarks time the parts alone on the same shapes: one projection forward and
// backward (ops::linear), the attention core forward and backward (ops SDPA on (B*H, T, D)),
// and a 2048^3 oneDNN GEMM as the f32 peak a real GEMM reaches; the register-only FMA peak of
// the same threads goes into the JSON context (fma_peak_GFLOPS).
//
//   build/<dir>/bench/bench_mha --benchmark_repetitions=5      (bench/run_mha.sh runs it)
#include "attn/nn/attention.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "bench/fma_peak.hpp"
#include "kernels/cpu/matmul.hpp"
#include "ops/attention_heads.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t kB = 4, kE = 512, kH = 8, kD = kE / kH;

int bench_threads() {
  const char* env = std::getenv("ATTN_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

attn::Context make_context() {
  attn::Context ctx;
  ctx.threads = bench_threads();
  ctx.backend = attn::Backend::kAuto;
  return ctx;
}

attn::Tensor random(const attn::Shape& shape, uint64_t seed) {
  attn::Tensor t = attn::Tensor::empty(shape, attn::DType::F32);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = u(rng);
  return t;
}

double projection_flops(int64_t T) {
  return 4.0 * 2.0 * kB * T * kE * kE;
}
double attention_flops(int64_t T) {
  return 4.0 * kB * kH * T * T * kD;
}

void set_counters(benchmark::State& state, double flops) {
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = bench_threads();
}

void BM_MhaInference(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::nn::MultiHeadAttention mha(kE, kH, 0.0, /*bias=*/true, attn::DType::F32, /*seed=*/1);
  mha.eval();
  // As PyTorch's need_weights=False: no (B*H, T, S) weights (d2l's default keeps them, which
  // also routes the core to the reference loops that compute them in double).
  mha.attention.need_weights = false;
  attn::Tensor X = random({kB, T, kE}, 2);
  for (auto _ : state) {
    attn::Tensor out = mha.forward(ctx, X, X, X);
    benchmark::DoNotOptimize(out.raw_data());
  }
  set_counters(state, projection_flops(T) + attention_flops(T));
}

void BM_MhaTraining(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::nn::MultiHeadAttention mha(kE, kH, 0.0, /*bias=*/true, attn::DType::F32, /*seed=*/1);
  mha.train();
  mha.attention.need_weights = false;
  // The gradient of X as one tensor, as PyTorch's xg.grad (not d2l's three terms to be summed).
  mha.self_attention_input_grad = true;
  attn::Tensor X = random({kB, T, kE}, 2);
  attn::Tensor dout = random({kB, T, kE}, 3);
  for (auto _ : state) {
    // One step: forward, then backward of <out, dout>; parameter grads accumulate (no
    // zero_grad), as in the PyTorch loop of torch_mha.py.
    attn::Tensor out = mha.forward(ctx, X, X, X);
    attn::nn::AttentionInputGrads g = mha.backward(ctx, dout);  // g.dqueries = dX
    benchmark::DoNotOptimize(g.dqueries.raw_data());
  }
  set_counters(state, 3.0 * projection_flops(T) + 3.5 * attention_flops(T));
}

// Padded inference in `dt` (see the header): lengths from a fixed seed, X (B, longest, E).
void run_inference_padded(benchmark::State& state, attn::DType dt) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::nn::MultiHeadAttention mha(kE, kH, 0.0, /*bias=*/true, dt, /*seed=*/1);
  mha.eval();
  mha.attention.need_weights = false;
  std::mt19937_64 rng(static_cast<uint64_t>(T));
  std::vector<int64_t> lens(kB);
  int64_t width = 0;
  double rows = 0, pairs = 0;
  for (int64_t& l : lens) {
    l = T / 2 + static_cast<int64_t>(rng() % static_cast<uint64_t>(T / 2 + 1));
    width = std::max(width, l);
    rows += static_cast<double>(l);
    pairs += static_cast<double>(l) * static_cast<double>(l);
  }
  const double valid_flops = 4.0 * 2.0 * rows * kE * kE + 4.0 * kH * pairs * kD;
  const double w = static_cast<double>(width);
  const double row_flops = 4.0 * 2.0 * kB * w * kE * kE + 4.0 * kH * w * rows * kD;
  const attn::Tensor valid = attn::Tensor::from_vector(lens, {kB});
  const attn::Tensor X = random({kB, width, kE}, 2).to(dt);
  for (auto _ : state) {
    attn::Tensor out = mha.forward(ctx, X, X, X, valid);
    benchmark::DoNotOptimize(out.raw_data());
  }
  set_counters(state, valid_flops);
  state.counters["valid_fraction"] = rows / (kB * w);
  state.counters["rows_bound"] = valid_flops / row_flops;
}

void BM_MhaInferencePadded(benchmark::State& state) {
  run_inference_padded(state, attn::DType::F32);
}

void BM_MhaInferencePaddedBf16(benchmark::State& state) {
  run_inference_padded(state, attn::DType::BF16);
}

// The same two in bfloat16 (the module, its weights, X and dout all BF16; as PyTorch's
// nn.MultiheadAttention(...).to(torch.bfloat16)): bf16 GEMMs with f32 accumulation and the bf16
// attention kernels on head copies (nn/multihead_attention.cpp).
void BM_MhaInferenceBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::nn::MultiHeadAttention mha(kE, kH, 0.0, /*bias=*/true, attn::DType::BF16, /*seed=*/1);
  mha.eval();
  mha.attention.need_weights = false;
  attn::Tensor X = random({kB, T, kE}, 2).to(attn::DType::BF16);
  for (auto _ : state) {
    attn::Tensor out = mha.forward(ctx, X, X, X);
    benchmark::DoNotOptimize(out.raw_data());
  }
  set_counters(state, projection_flops(T) + attention_flops(T));
}

void BM_MhaTrainingBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::nn::MultiHeadAttention mha(kE, kH, 0.0, /*bias=*/true, attn::DType::BF16, /*seed=*/1);
  mha.train();
  mha.attention.need_weights = false;
  mha.self_attention_input_grad = true;
  attn::Tensor X = random({kB, T, kE}, 2).to(attn::DType::BF16);
  attn::Tensor dout = random({kB, T, kE}, 3).to(attn::DType::BF16);
  for (auto _ : state) {
    attn::Tensor out = mha.forward(ctx, X, X, X);
    attn::nn::AttentionInputGrads g = mha.backward(ctx, dout);
    benchmark::DoNotOptimize(g.dqueries.raw_data());
  }
  set_counters(state, 3.0 * projection_flops(T) + 3.5 * attention_flops(T));
}

// One projection (B*T, E) x (E, E)^T + b, forward.
void BM_ProjectionForward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor x = random({kB, T, kE}, 4), W = random({kE, kE}, 5), b = random({kE}, 6);
  for (auto _ : state) {
    attn::Tensor y = attn::linear(ctx, x, W, b);
    benchmark::DoNotOptimize(y.raw_data());
  }
  set_counters(state, projection_flops(T) / 4);
}

// The packed self-attention projection X [W_q; W_k; W_v]^T + b: (B*T, E) x (E, 3E).
void BM_ProjectionQkvForward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor x = random({kB, T, kE}, 4), W = random({3 * kE, kE}, 5), b = random({3 * kE}, 6);
  for (auto _ : state) {
    attn::Tensor y = attn::linear(ctx, x, W, b);
    benchmark::DoNotOptimize(y.raw_data());
  }
  set_counters(state, 3 * projection_flops(T) / 4);
}

// One projection's backward: dx = dy W and dW = dy^T x (db too).
void BM_ProjectionBackward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor x = random({kB, T, kE}, 4), W = random({kE, kE}, 5), dy = random({kB, T, kE}, 7);
  for (auto _ : state) {
    attn::LinearGrads g = attn::linear_backward(ctx, dy, x, W, true);
    benchmark::DoNotOptimize(g.dW.raw_data());
  }
  set_counters(state, 2 * projection_flops(T) / 4);
}

// bf16 parts: the packed projection forward (f32 accumulation + one rounding), one projection's
// backward, and the bf16 attention core on head copies (B*H, T, D).
void BM_ProjectionQkvForwardBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  const attn::DType bf16 = attn::DType::BF16;
  attn::Tensor x = random({kB, T, kE}, 4).to(bf16), W = random({3 * kE, kE}, 5).to(bf16),
               b = random({3 * kE}, 6).to(bf16);
  for (auto _ : state) {
    attn::Tensor y = attn::linear(ctx, x, W, b);
    benchmark::DoNotOptimize(y.raw_data());
  }
  set_counters(state, 3 * projection_flops(T) / 4);
}

void BM_ProjectionBackwardBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  const attn::DType bf16 = attn::DType::BF16;
  attn::Tensor x = random({kB, T, kE}, 4).to(bf16), W = random({kE, kE}, 5).to(bf16),
               dy = random({kB, T, kE}, 7).to(bf16);
  for (auto _ : state) {
    attn::LinearGrads g = attn::linear_backward(ctx, dy, x, W, true);
    benchmark::DoNotOptimize(g.dW.raw_data());
  }
  set_counters(state, 2 * projection_flops(T) / 4);
}

void BM_AttentionCoreForwardBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  const attn::DType bf16 = attn::DType::BF16;
  attn::Tensor q = random({kB * kH, T, kD}, 8).to(bf16), k = random({kB * kH, T, kD}, 9).to(bf16),
               v = random({kB * kH, T, kD}, 10).to(bf16);
  attn::AttentionOptions o;
  o.need_weights = false;
  for (auto _ : state) {
    attn::AttentionResult r = attn::scaled_dot_product_attention(ctx, q, k, v, o);
    benchmark::DoNotOptimize(r.output.raw_data());
  }
  set_counters(state, attention_flops(T));
}

void BM_AttentionCoreBackwardBf16(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  const attn::DType bf16 = attn::DType::BF16;
  attn::Tensor q = random({kB * kH, T, kD}, 8).to(bf16), k = random({kB * kH, T, kD}, 9).to(bf16),
               v = random({kB * kH, T, kD}, 10).to(bf16),
               dout = random({kB * kH, T, kD}, 11).to(bf16);
  attn::AttentionOptions o;
  o.need_weights = false;
  attn::AttentionResult fwd = attn::scaled_dot_product_attention(ctx, q, k, v, o);
  for (auto _ : state) {
    attn::AttentionGrads g =
        attn::scaled_dot_product_attention_backward(ctx, dout, q, k, v, fwd, o);
    benchmark::DoNotOptimize(g.dq.raw_data());
  }
  set_counters(state, 2.5 * attention_flops(T));
}

// The attention core alone: softmax(Q K^T / sqrt(D)) V per (b, h), (B*H, T, D).
void BM_AttentionCoreForward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor q = random({kB * kH, T, kD}, 8), k = random({kB * kH, T, kD}, 9),
               v = random({kB * kH, T, kD}, 10);
  for (auto _ : state) {
    attn::AttentionResult r = attn::scaled_dot_product_attention(ctx, q, k, v);
    benchmark::DoNotOptimize(r.output.raw_data());
  }
  set_counters(state, attention_flops(T));
}

void BM_AttentionCoreBackward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor q = random({kB * kH, T, kD}, 8), k = random({kB * kH, T, kD}, 9),
               v = random({kB * kH, T, kD}, 10), dout = random({kB * kH, T, kD}, 11);
  attn::AttentionResult fwd = attn::scaled_dot_product_attention(ctx, q, k, v);
  for (auto _ : state) {
    attn::AttentionGrads g = attn::scaled_dot_product_attention_backward(ctx, dout, q, k, v, fwd);
    benchmark::DoNotOptimize(g.dq.raw_data());
  }
  set_counters(state, 2.5 * attention_flops(T));
}

// The attention core as MultiHeadAttention's fast path runs it: heads read in place from the
// (B, T, 3E) packed projection (row stride 3E) through head strides, output (B, T, E).
void BM_AttentionHeadsForward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor qkv = random({kB, T, 3 * kE}, 8);
  const attn::Tensor q = qkv.slice(2, 0, kE), k = qkv.slice(2, kE, 2 * kE),
                     v = qkv.slice(2, 2 * kE, 3 * kE);
  for (auto _ : state) {
    attn::AttentionResult r = attn::detail::multi_head_attention_forward(ctx, q, k, v, kH, {});
    benchmark::DoNotOptimize(r.output.raw_data());
  }
  set_counters(state, attention_flops(T));
}

void BM_AttentionHeadsBackward(benchmark::State& state) {
  const int64_t T = state.range(0);
  attn::Context ctx = make_context();
  attn::Tensor qkv = random({kB, T, 3 * kE}, 8), dout = random({kB, T, kE}, 11);
  const attn::Tensor q = qkv.slice(2, 0, kE), k = qkv.slice(2, kE, 2 * kE),
                     v = qkv.slice(2, 2 * kE, 3 * kE);
  attn::AttentionResult fwd = attn::detail::multi_head_attention_forward(ctx, q, k, v, kH, {});
  attn::Tensor dqkv = attn::Tensor::empty({kB, T, 3 * kE});
  attn::Tensor dq = dqkv.slice(2, 0, kE), dk = dqkv.slice(2, kE, 2 * kE),
               dv = dqkv.slice(2, 2 * kE, 3 * kE);
  for (auto _ : state) {
    attn::detail::multi_head_attention_backward(ctx, dout, q, k, v, fwd, kH, {}, dq, dk, dv);
    benchmark::DoNotOptimize(dqkv.raw_data());
  }
  set_counters(state, 2.5 * attention_flops(T));
}

// The f32 peak this machine reaches in practice: a 2048^3 oneDNN GEMM on the same threads.
void BM_GemmPeak(benchmark::State& state) {
  const int64_t n = state.range(0);
  attn::Tensor a = random({n, n}, 12), b = random({n, n}, 13), c = attn::Tensor::empty({n, n});
  attn::cpu::GemmArgs g;
  g.M = g.N = g.K = n;
  g.A = a.raw_data(), g.lda = n;
  g.B = b.raw_data(), g.ldb = n, g.trans_b = true;
  g.C = c.data<float>(), g.ldc = n;
  for (auto _ : state) {
    attn::cpu::gemm(g, bench_threads());
    benchmark::DoNotOptimize(c.raw_data());
  }
  set_counters(state, 2.0 * n * n * n);
}

// The linear layers' products of the d2l encoder's training step (B 32 x T 128 = 4096 tokens,
// E 128, FFN 256, Q/K/V fused: 384) and the seq2seq step's output layer, on either f32 kernel:
// range(1) the shape, range(0) the kernel (1 oneDNN, 2 attn's row-exact one, gemm_rows.hpp; what
// CPUs without AVX-512 run). Each pair runs back to back, so the two share the host's state of the
// moment.
void BM_GemmLinear(benchmark::State& state) {
  struct Product {
    const char* name;
    int64_t M, N, K;
    bool trans_a, trans_b;
  };
  static constexpr Product kProducts[] = {
      {"fwd_qkv", 4096, 384, 128, false, true},
      {"fwd_128", 4096, 128, 128, false, true},
      {"fwd_ffn1", 4096, 256, 128, false, true},
      {"fwd_ffn2", 4096, 128, 256, false, true},
      {"dx_qkv", 4096, 128, 384, false, false},
      {"dx_128", 4096, 128, 128, false, false},
      {"dW_qkv", 384, 128, 4096, true, false},
      {"dW_128", 128, 128, 4096, true, false},
      // The seq2seq `long` shape's output layer (B 32 x T 64 tokens, E 128, vocabulary 1000).
      {"fwd_vocab", 2048, 1000, 128, false, true},
      {"dx_vocab", 2048, 128, 1000, false, false},
      {"dW_vocab", 1000, 128, 2048, true, false}};
  const Product& p = kProducts[state.range(1)];
  const auto kernel =
      state.range(0) == 1 ? attn::cpu::GemmF32Kernel::kOneDnn : attn::cpu::GemmF32Kernel::kRows;
  attn::Tensor a = random({p.trans_a ? p.K : p.M, p.trans_a ? p.M : p.K}, 14);
  attn::Tensor b = random({p.trans_b ? p.N : p.K, p.trans_b ? p.K : p.N}, 15);
  attn::Tensor c = attn::Tensor::empty({p.M, p.N});
  attn::cpu::GemmArgs g;
  g.M = p.M, g.N = p.N, g.K = p.K;
  g.A = a.raw_data(), g.lda = a.dim(1), g.trans_a = p.trans_a;
  g.B = b.raw_data(), g.ldb = b.dim(1), g.trans_b = p.trans_b;
  g.C = c.data<float>(), g.ldc = p.N;
  attn::cpu::gemm_set_f32_kernel(kernel);
  for (auto _ : state) {
    attn::cpu::gemm(g, bench_threads());
    benchmark::DoNotOptimize(c.raw_data());
  }
  attn::cpu::gemm_set_f32_kernel(attn::cpu::GemmF32Kernel::kAuto);
  state.SetLabel(std::string(p.name) + (state.range(0) == 1 ? " oneDNN" : " attn_rows"));
  set_counters(state, 2.0 * static_cast<double>(p.M * p.N * p.K));
}

// Real time decides; the CPU time reported is the whole process's (all OpenMP threads), which on
// a shared machine, with OMP_WAIT_POLICY=PASSIVE, is a load-robust second estimate.
#define ATTN_MHA_BENCH(fn)            \
  BENCHMARK(fn)                       \
      ->Arg(512)                      \
      ->Arg(2048)                     \
      ->Unit(benchmark::kMillisecond) \
      ->UseRealTime()                 \
      ->MeasureProcessCPUTime()

ATTN_MHA_BENCH(BM_MhaInference);
ATTN_MHA_BENCH(BM_MhaTraining);
ATTN_MHA_BENCH(BM_MhaInferenceBf16);
ATTN_MHA_BENCH(BM_MhaTrainingBf16);
ATTN_MHA_BENCH(BM_MhaInferencePadded);
ATTN_MHA_BENCH(BM_MhaInferencePaddedBf16);
ATTN_MHA_BENCH(BM_ProjectionForward);
ATTN_MHA_BENCH(BM_ProjectionBackward);
ATTN_MHA_BENCH(BM_ProjectionQkvForward);
ATTN_MHA_BENCH(BM_AttentionCoreForward);
ATTN_MHA_BENCH(BM_AttentionCoreBackward);
ATTN_MHA_BENCH(BM_AttentionHeadsForward);
ATTN_MHA_BENCH(BM_AttentionHeadsBackward);
ATTN_MHA_BENCH(BM_ProjectionQkvForwardBf16);
ATTN_MHA_BENCH(BM_ProjectionBackwardBf16);
ATTN_MHA_BENCH(BM_AttentionCoreForwardBf16);
ATTN_MHA_BENCH(BM_AttentionCoreBackwardBf16);
BENCHMARK(BM_GemmLinear)
    ->ArgsProduct({{1, 2}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();
BENCHMARK(BM_GemmPeak)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // The register-only FMA peak on the same threads, so "% of peak" needs no outside number.
  benchmark::AddCustomContext(
      "fma_peak_GFLOPS", std::to_string(attn::bench::measure_fma_peak_gflops(bench_threads())));
  benchmark::AddCustomContext("fma_peak_target", attn::bench::fma_peak_target());
  benchmark::AddCustomContext("attn_threads", std::to_string(bench_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
