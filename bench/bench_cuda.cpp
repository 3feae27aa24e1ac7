// CUDA benchmarks of attn for scripts/gpu-check.sh: the fused attention forward and backward at
// the shapes (bf16 forward also through the SIMT kernel: op "fwd_simt"), the decode step,
// and cuBLASLt GEMMs as the same run's peak. One JSON object a line on stdout ({"op", "shape",
// "dtype", "ms", "tflops" or "us"}), read by bench/gpu_table.py. FLOP convention (FlashAttention
// papers): forward 4*B*H*T*S*D, backward 2.5x forward.
//
// Usage: bench_cuda [--quick | --train-only]   (--quick: fewer iterations, for a smoke run;
// --train-only: the training steps alone, e.g. with ATTN_CUDA_STEP_PROFILE=1)
#include "attn/cuda/runtime.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/flash_mma.hpp"
#include "kernels/cuda/kernels.hpp"

#include "attn/core/rng.hpp"
#include "attn/model/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace attn;
using Clock = std::chrono::steady_clock;

// Median over `reps` of (the time of `inner` back-to-back calls) / inner, synchronised around
// each rep: small kernels are timed as a stream of launches, as a training step issues them.
double time_ms(const std::function<void()>& fn, int reps, int inner) {
  fn();
  cuda::synchronize(nullptr);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = Clock::now();
    for (int i = 0; i < inner; ++i)
      fn();
    cuda::synchronize(nullptr);
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count() / inner);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor random_device(int64_t n, DType dt, uint64_t seed) {
  Rng rng(seed);
  Tensor h = Tensor::empty({n}, dt);
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(rng.uniform(-1, 1));
    if (dt == DType::BF16)
      static_cast<uint16_t*>(h.raw_data())[i] = cuda::bf16_round(x);
    else
      h.data<float>()[i] = x;
  }
  return cuda::to_device(h);
}

void emit(const std::string& op, const std::string& shape, const char* dtype, double ms,
          double flops) {
  if (flops > 0)
    std::printf(
        "{\"impl\": \"attn\", \"op\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", "
        "\"ms\": %.4f, \"us\": %.1f, \"tflops\": %.1f}\n",
        op.c_str(), shape.c_str(), dtype, ms, ms * 1e3, flops / ms / 1e9);
  else
    std::printf(
        "{\"impl\": \"attn\", \"op\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", "
        "\"ms\": %.4f, \"us\": %.1f}\n",
        op.c_str(), shape.c_str(), dtype, ms, ms * 1e3);
  std::fflush(stdout);
}

template <class E>
void bench_attention(int64_t batch, int64_t heads, int64_t N, int64_t D, bool causal, bool backward,
                     int reps, int inner) {
  const bool bf16 = !std::is_same_v<E, float>;
  const DType dt = bf16 ? DType::BF16 : DType::F32;
  const int64_t B = batch * heads, n = B * N * D;
  Tensor q = random_device(n, dt, 1), k = random_device(n, dt, 2), v = random_device(n, dt, 3),
         dout = random_device(n, dt, 4);
  Tensor out = cuda::empty({n}, dt), lse = cuda::empty({B * N}, DType::F32);
  Tensor dq = cuda::empty({n}, dt), dk = cuda::empty({n}, dt), dv = cuda::empty({n}, dt),
         delta = cuda::empty({B * N}, DType::F32);
  kernels::AttentionArgs<E> a;
  a.B = B;
  a.T = a.S = N;
  a.D = a.Dv = D;
  a.causal = causal;
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto view = [&](const Tensor& t) {
    kernels::StridedView<E> s;
    s.data = static_cast<E*>(t.raw_data());
    s.sb = N * D;
    s.st = D;
    return s;
  };
  auto cview = [&](const Tensor& t) {
    kernels::StridedView<const E> s;
    s.data = static_cast<const E*>(t.raw_data());
    s.sb = N * D;
    s.st = D;
    return s;
  };
  a.q = cview(q);
  a.k = cview(k);
  a.v = cview(v);
  a.out = view(out);
  a.lse = static_cast<float*>(lse.raw_data());
  kernels::AttentionGradArgs<E> g;
  g.dout = cview(dout);
  g.dq = view(dq);
  g.dk = view(dk);
  g.dv = view(dv);
  const double flops = 4.0 * B * N * N * D / (causal ? 2 : 1);
  const std::string shape = "(" + std::to_string(batch) + "," + std::to_string(heads) + "," +
                            std::to_string(N) + "," + std::to_string(D) + ")" +
                            (causal ? " causal" : "");
  const char* dts = bf16 ? "bf16" : "f32";
  const double fwd = time_ms([&] { cuda::flash_attention_forward(a, nullptr); }, reps, inner);
  emit("sdpa_fwd", shape, dts, fwd, flops);
  if (bf16) {
    // The SIMT kernel on the same problem, to see what the tensor-core forward buys.
    cuda::flash_mma_set_simt_only(true);
    const double simt = time_ms([&] { cuda::flash_attention_forward(a, nullptr); }, reps, inner);
    cuda::flash_mma_set_simt_only(false);
    emit("fwd_simt", shape, dts, simt, flops);
  }
  if (backward) {
    const double bwd = time_ms(
        [&] {
          cuda::flash_attention_backward(a, g, static_cast<float*>(delta.raw_data()), nullptr);
        },
        reps, inner);
    emit("sdpa_bwd", shape, dts, bwd, 2.5 * flops);
  }
}

template <class E>
void bench_decode(int64_t batch, int64_t heads, int64_t S, int64_t D, int reps, int inner) {
  const DType dt = std::is_same_v<E, float> ? DType::F32 : DType::BF16;
  const int64_t B = batch * heads;
  Tensor q = random_device(B * D, dt, 5), k = random_device(B * S * D, dt, 6),
         v = random_device(B * S * D, dt, 7), out = cuda::empty({B * D}, dt);
  kernels::AttentionArgs<E> a;
  a.B = B;
  a.T = 1;
  a.S = S;
  a.D = a.Dv = D;
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  a.q = {static_cast<const E*>(q.raw_data()), D, 0, D, 1};
  a.k = {static_cast<const E*>(k.raw_data()), S * D, 0, D, 1};
  a.v = {static_cast<const E*>(v.raw_data()), S * D, 0, D, 1};
  a.out = {static_cast<E*>(out.raw_data()), D, 0, D, 1};
  const double ms = time_ms([&] { cuda::flash_attention_decode(a, nullptr); }, reps, inner);
  // The step reads the whole cache once: report bandwidth as "tflops" would mislead, so GB/s.
  const double bytes = 2.0 * B * S * D * (std::is_same_v<E, float> ? 4 : 2);
  std::printf(
      "{\"impl\": \"attn\", \"op\": \"decode\", \"shape\": \"(%lld,%lld,1x%lld,%lld)\", "
      "\"dtype\": \"%s\", \"ms\": %.4f, \"us\": %.1f, \"gbps\": %.0f}\n",
      static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(S),
      static_cast<long long>(D), std::is_same_v<E, float> ? "f32" : "bf16", ms, ms * 1e3,
      bytes / ms / 1e6);
  std::fflush(stdout);
}

void bench_gemm(cuda::GemmType type, int64_t M, int64_t N, int64_t K, int reps) {
  const DType dt = type == cuda::GemmType::kF32 ? DType::F32 : DType::BF16;
  Tensor A = random_device(M * K, dt, 8), B = random_device(K * N, dt, 9),
         C = cuda::empty({M * N}, dt);
  cuda::GemmArgs g;
  g.type = type;
  g.M = M;
  g.N = N;
  g.K = K;
  g.A = A.raw_data();
  g.B = B.raw_data();
  g.C = C.raw_data();
  g.lda = K;
  g.ldb = N;
  g.ldc = N;
  const double ms = time_ms([&] { cuda::gemm(g, nullptr); }, reps, 1);
  emit("gemm", std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K),
       dt == DType::F32 ? "f32" : "bf16", ms, 2.0 * M * N * K);
}

// The d2l encoder classifier's training step (`attn train --device cuda`'s Trainer: one CUDA
// graph per batch shape, the loss and norm copied back every step): E 128, 4 heads, 2 blocks, FFN
// 256, vocabulary 1000, 2 classes, dropout 0.1, AdamW lr 1e-3, clip 1 (bench/torch_cuda.py's
// model). Full-length batches, or `padded`: lengths uniform in [T/2, T] (the graph shape stays
// (B, T)). Reported in microseconds a step, with tokens/s (B * T / step: the padded positions
// count, as PyTorch computes them too).
void bench_train(int64_t B, int64_t T, bool padded, int steps) {
  model::TrainOptions o;
  o.model.type = model::TaskType::kClassification;
  o.model.vocab_size = 1000;
  o.model.num_classes = 2;
  o.model.num_hiddens = 128;
  o.model.ffn_num_hiddens = 256;
  o.model.num_heads = 4;
  o.model.num_blks = 2;
  o.model.dropout = 0.1;
  o.model.max_len = std::max<int64_t>(T, 1000);
  o.adamw.lr = 1e-3;
  o.clip_norm = 1.0;
  o.device = Device::kCuda;
  model::Trainer trainer(o);
  Rng rng(11);
  model::Batch b;
  b.ids = Tensor::zeros({B, T}, DType::I64);
  b.valid_lens = Tensor::zeros({B}, DType::I64);
  b.targets = Tensor::zeros({B}, DType::I64);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len =
        padded ? T / 2 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(T / 2 + 1))) : T;
    b.valid_lens.data<int64_t>()[i] = len;
    b.tokens += len;
    for (int64_t t = 0; t < len; ++t)
      b.ids.data<int64_t>()[i * T + t] = 2 + static_cast<int64_t>(rng.below(998));
    b.targets.data<int64_t>()[i] = static_cast<int64_t>(rng.below(2));
  }
  for (int i = 0; i < 3; ++i)  // eager, captured, replayed
    trainer.train_step(b);
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    const auto a = Clock::now();
    for (int i = 0; i < steps; ++i)
      trainer.train_step(b);
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count() / steps);
  }
  std::sort(t.begin(), t.end());
  const double ms = t[t.size() / 2];
  std::printf(
      "{\"impl\": \"attn\", \"op\": \"train_step\", \"shape\": \"B%lldxT%lld%s\", "
      "\"dtype\": \"f32\", \"ms\": %.4f, \"us\": %.1f, \"tokens_per_s\": %.0f}\n",
      static_cast<long long>(B), static_cast<long long>(T), padded ? " padded" : "", ms, ms * 1e3,
      static_cast<double>(B * T) / ms * 1e3);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 1 && std::strcmp(argv[1], "--train-only") == 0) {
    // With ATTN_CUDA_STEP_PROFILE=1 each Trainer prints its phases on stderr (eager steps).
    bench_train(32, 128, false, 10);
    bench_train(256, 128, false, 5);
    return 0;
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_cuda: no CUDA device\n");
    return 1;
  }
  std::fprintf(stderr, "bench_cuda on %s\n", cuda::device_description().c_str());
  const int reps = quick ? 3 : 7;
  bench_gemm(cuda::GemmType::kBF16, 8192, 8192, 8192, reps);
  bench_gemm(cuda::GemmType::kF32, 4096, 4096, 4096, reps);
  bench_attention<uint16_t>(2, 16, 8192, 128, false, true, quick ? 1 : 3, 1);
  bench_attention<uint16_t>(32, 4, 128, 32, false, true, reps, 50);
  bench_attention<float>(32, 4, 128, 32, false, true, reps, 50);
  bench_attention<uint16_t>(2, 16, 2048, 128, true, true, reps, 1);
  bench_decode<uint16_t>(1, 4, 2048, 32, reps, 100);
  bench_decode<uint16_t>(32, 4, 2048, 32, reps, 100);
  bench_decode<float>(32, 4, 2048, 32, reps, 100);
  bench_train(32, 128, false, quick ? 20 : 50);
  bench_train(32, 128, true, quick ? 20 : 50);
  bench_train(256, 128, false, quick ? 10 : 20);
  return 0;
}
