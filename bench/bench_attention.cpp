// Fused CPU attention (kernels/cpu flash_attention and flash_bf16), fp32 and bf16, forward and
// backward, with the machine's FP32 FMA peak measured in the same run so that every result reads
// as % of peak. BM_FlashBf16Speedup runs fp32 and bf16 alternately and reports their time ratio.
//
// Shapes of the issue: B*H = 16, D in {64, 128}, T = S in {1024, 4096}, non-causal and causal;
// and one long sequence, T = S = 65536, D = 64, B*H = 1, forward + backward once, reporting the
// memory the kernels use beyond their inputs and outputs (peak RSS growth).
// FLOPs (FlashAttention convention): forward 4*BH*T*S*D, backward 2.5x, causal halves both.
// Threads: ATTN_THREADS (default 2). bench/run_cpu.sh runs this next to PyTorch and writes
// docs/performance.md.
#include "bench/fma_peak.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_bf16.hpp"

#include "attn/core/dtype.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace {

int bench_threads() {
  const char* env = std::getenv("ATTN_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

double peak_gflops() {
  static const double peak = attn::bench::measure_fma_peak_gflops(bench_threads());
  return peak;
}

// 64-byte aligned storage, as attn::Tensor and torch tensors have. std::vector's default
// allocator gives 16-byte alignment for large blocks (glibc's mmap chunks start 16 bytes into a
// page), so every 64-byte row load would straddle two cache lines: a case the kernels handle
// (tests cover it) but not the one users' tensors present.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const {
    return true;
  }
};
template <class T>
using AlignedVec = std::vector<T, Aligned64<T>>;

// Contiguous q, k, v, out, dout, grads of one shape, filled with uniform [-1, 1).
struct Buffers {
  int64_t BH, T, S, D;
  AlignedVec<float> q, k, v, out, lse, dout, dq, dk, dv;
  attn::cpu::FlashParams p;
  attn::cpu::FlashGrads g;
  Buffers(int64_t bh, int64_t t, int64_t d, bool causal, bool grads) : BH(bh), T(t), S(t), D(d) {
    std::mt19937 gen(42);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](AlignedVec<float>& x, int64_t n) {
      x.resize(n);
      for (auto& e : x)
        e = u(gen);
    };
    fill(q, BH * T * D);
    fill(k, BH * S * D);
    fill(v, BH * S * D);
    out.assign(BH * T * D, 0.0f);
    lse.assign(BH * T, 0.0f);
    if (grads) {
      fill(dout, BH * T * D);
      dq.assign(BH * T * D, 0.0f);
      dk.assign(BH * S * D, 0.0f);
      dv.assign(BH * S * D, 0.0f);
    }
    p.B = BH, p.T = T, p.S = S, p.D = D, p.Dv = D;
    p.q = {q.data(), T * D, 0, D, 1};
    p.k = {k.data(), S * D, 0, D, 1};
    p.v = {v.data(), S * D, 0, D, 1};
    p.out = {out.data(), T * D, 0, D, 1};
    p.lse = lse.data();
    p.causal = causal;
    p.scale = 1.0f / std::sqrt(float(D));
    p.threads = bench_threads();
    g.dout = {dout.data(), T * D, 0, D, 1};
    g.dq = {dq.data(), T * D, 0, D, 1};
    g.dk = {dk.data(), S * D, 0, D, 1};
    g.dv = {dv.data(), S * D, 0, D, 1};
  }
};

double forward_flops(int64_t bh, int64_t t, int64_t d, bool causal) {
  return 4.0 * double(bh) * double(t) * double(t) * double(d) * (causal ? 0.5 : 1.0);
}

// pct_peak divides by the FMA peak measured right after the timed loop (about 0.2 s): on a
// shared host the speed drifts by 10-20% over minutes, and a peak read once at the start of a
// long run no longer describes the machine that ran a later benchmark.
void set_counters(benchmark::State& state, double flops) {
  const double peak = attn::bench::measure_fma_peak_gflops(bench_threads());
  state.counters["GFLOPS"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_peak"] = benchmark::Counter(flops * 1e-9 / peak * 100.0,
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOPS"] = peak;
  state.counters["threads"] = bench_threads();
}

// Args: BH, T (= S), D, causal.
void BM_FlashForward(benchmark::State& state) {
  const bool causal = state.range(3) != 0;
  Buffers buf(state.range(0), state.range(1), state.range(2), causal, false);
  for (auto _ : state) {
    attn::cpu::flash_attention_forward(buf.p);
    benchmark::DoNotOptimize(buf.out.data());
  }
  set_counters(state, forward_flops(buf.BH, buf.T, buf.D, causal));
}

void BM_FlashBackward(benchmark::State& state) {
  const bool causal = state.range(3) != 0;
  Buffers buf(state.range(0), state.range(1), state.range(2), causal, true);
  attn::cpu::flash_attention_forward(buf.p);
  for (auto _ : state) {
    attn::cpu::flash_attention_backward(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
  }
  set_counters(state, 2.5 * forward_flops(buf.BH, buf.T, buf.D, causal));
}

// The float32 training step with dropout (p = 0.1): forward, then backward, which redraws the
// mask (bench/ab_bf16_dropout.sh with FILTER=BM_FlashDropoutStep). Args: BH, T (= S), D.
void BM_FlashDropoutStep(benchmark::State& state) {
  Buffers buf(state.range(0), state.range(1), state.range(2), false, true);
  buf.p.dropout = 0.1f;
  buf.p.seed = 7;
  buf.p.offset = 3;
  for (auto _ : state) {
    attn::cpu::flash_attention_forward(buf.p);
    attn::cpu::flash_attention_backward(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
  }
  set_counters(state, 3.5 * forward_flops(buf.BH, buf.T, buf.D, false));
}
BENCHMARK(BM_FlashDropoutStep)
    ->Args({16, 1024, 64})
    ->ArgNames({"BH", "T", "D"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// d2l's PyTorch training loop with attn's MultiheadAttention swapped in (issue 17;
// bench/torch_swap_breakdown.py): batch 32, T = S = 128, E = 128 in 4 heads (D = 32), q, k, v read
// in place through head strides from one (B, T, 3E) in-projection, half the batch padded to
// valid_len 96, dropout 0.1 with the forward's keep bits read by the backward. Args: dropout
// (0/1), what (0: forward, 1: backward, 2: forward + backward).
struct SmallHeadBuffers {
  static constexpr int64_t kBatch = 32, kHeads = 4, kT = 128, kD = 32, kE = kHeads * kD;
  AlignedVec<float> qkv, out, lse, dout, dqkv;
  std::vector<int32_t> kept;
  std::vector<uint16_t> keep;
  attn::cpu::FlashParams p;
  attn::cpu::FlashGrads g;
  explicit SmallHeadBuffers(bool dropout) {
    std::mt19937 gen(42);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    qkv.resize(kBatch * kT * 3 * kE);
    for (auto& e : qkv)
      e = u(gen);
    dout.resize(kBatch * kT * kE);
    for (auto& e : dout)
      e = u(gen);
    out.assign(kBatch * kT * kE, 0.0f);
    dqkv.assign(qkv.size(), 0.0f);
    lse.assign(kBatch * kHeads * kT, 0.0f);
    for (int64_t b = 0; b < kBatch * kHeads; ++b)
      for (int64_t t = 0; t < kT; ++t)
        kept.push_back(b / kHeads < kBatch / 2 ? kT : 96);
    p.B = kBatch * kHeads, p.T = kT, p.S = kT, p.D = kD, p.Dv = kD, p.heads = kHeads;
    const int64_t sb = kT * 3 * kE, st = 3 * kE;
    p.q = {qkv.data(), sb, kD, st, 1};
    p.k = {qkv.data() + kE, sb, kD, st, 1};
    p.v = {qkv.data() + 2 * kE, sb, kD, st, 1};
    p.out = {out.data(), kT * kE, kD, kE, 1};
    p.lse = lse.data();
    p.kept_keys = kept.data();
    p.scale = 1.0f / std::sqrt(float(kD));
    p.threads = bench_threads();
    if (dropout) {
      p.dropout = 0.1f, p.seed = 7, p.offset = 3;
      if (attn::cpu::flash_attention_keeps_dropout(p)) {
        keep.assign(attn::cpu::flash_dropout_keep_words(p), 0);
        p.dropout_keep = keep.data();
      }
    }
    g.dout = {dout.data(), kT * kE, kD, kE, 1};
    g.dq = {dqkv.data(), sb, kD, st, 1};
    g.dk = {dqkv.data() + kE, sb, kD, st, 1};
    g.dv = {dqkv.data() + 2 * kE, sb, kD, st, 1};
  }
};

void BM_FlashSmallHeads(benchmark::State& state) {
  SmallHeadBuffers buf(state.range(0) != 0);
  const int64_t what = state.range(1);
  attn::cpu::flash_attention_forward(buf.p);
  for (auto _ : state) {
    if (what != 1) attn::cpu::flash_attention_forward(buf.p);
    if (what != 0) attn::cpu::flash_attention_backward(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dqkv.data());
    benchmark::DoNotOptimize(buf.out.data());
  }
  const double fwd = forward_flops(buf.p.B, buf.p.T, buf.p.D, false);
  set_counters(state, what == 0 ? fwd : what == 1 ? 2.5 * fwd : 3.5 * fwd);
}
BENCHMARK(BM_FlashSmallHeads)
    ->ArgsProduct({{0, 1}, {0, 1, 2}})
    ->ArgNames({"dropout", "what"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void IssueShapes(benchmark::internal::Benchmark* b) {
  for (int64_t t : {1024, 4096})
    for (int64_t d : {64, 128})
      for (int64_t causal : {0, 1})
        b->Args({16, t, d, causal});
  // d2l's training shape (bench/run_train.sh: B = 32, 4 heads, T = 128, D = 32), and few heads
  // of a long sequence, where the items are too few to fill the threads unless split.
  b->Args({128, 128, 32, 0});
  for (int64_t bh : {2, 3, 4})
    b->Args({bh, 1024, 64, 0});
  b->ArgNames({"BH", "T", "D", "causal"})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_FlashForward)->Apply(IssueShapes);
BENCHMARK(BM_FlashBackward)->Apply(IssueShapes);

// ---- bfloat16 inputs (kernels/cpu/flash_bf16), same shapes and FLOP convention ----------------

// The fp32 buffers above rounded to bf16, with the bf16 kernels' parameters on them.
struct Bf16Buffers {
  Buffers f;
  AlignedVec<uint16_t> q, k, v, out, dout, dq, dk, dv;
  AlignedVec<float> lse;
  attn::cpu::FlashBf16Params p;
  attn::cpu::FlashBf16Grads g;
  static AlignedVec<uint16_t> round(const AlignedVec<float>& x) {
    AlignedVec<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      y[i] = attn::float_to_bf16(x[i]);
    return y;
  }
  Bf16Buffers(int64_t bh, int64_t t, int64_t d, bool causal, bool grads)
      : f(bh, t, d, causal, grads) {
    q = round(f.q), k = round(f.k), v = round(f.v), out = round(f.out), lse = f.lse;
    dout = round(f.dout), dq = round(f.dq), dk = round(f.dk), dv = round(f.dv);
    const int64_t T = f.T, S = f.S, D = f.D;
    p.B = f.BH, p.T = T, p.S = S, p.D = D, p.Dv = D;
    p.q = {q.data(), T * D, 0, D, 1};
    p.k = {k.data(), S * D, 0, D, 1};
    p.v = {v.data(), S * D, 0, D, 1};
    p.out = {out.data(), T * D, 0, D, 1};
    p.lse = lse.data();
    p.causal = causal;
    p.scale = f.p.scale;
    p.threads = f.p.threads;
    g.dout = {dout.data(), T * D, 0, D, 1};
    g.dq = {dq.data(), T * D, 0, D, 1};
    g.dk = {dk.data(), S * D, 0, D, 1};
    g.dv = {dv.data(), S * D, 0, D, 1};
  }
};

void BM_FlashBf16Forward(benchmark::State& state) {
  const bool causal = state.range(3) != 0;
  Bf16Buffers buf(state.range(0), state.range(1), state.range(2), causal, false);
  for (auto _ : state) {
    attn::cpu::flash_attention_forward_bf16(buf.p);
    benchmark::DoNotOptimize(buf.out.data());
  }
  set_counters(state, forward_flops(buf.f.BH, buf.f.T, buf.f.D, causal));
}

void BM_FlashBf16Backward(benchmark::State& state) {
  const bool causal = state.range(3) != 0;
  Bf16Buffers buf(state.range(0), state.range(1), state.range(2), causal, true);
  attn::cpu::flash_attention_forward_bf16(buf.p);
  for (auto _ : state) {
    attn::cpu::flash_attention_backward_bf16(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
  }
  set_counters(state, 2.5 * forward_flops(buf.f.BH, buf.f.T, buf.f.D, causal));
}
BENCHMARK(BM_FlashBf16Forward)->Apply(IssueShapes);
BENCHMARK(BM_FlashBf16Backward)->Apply(IssueShapes);

// A training step of the bf16 core with dropout (p = 0.1 on the weights): forward, then
// backward, which redraws the mask; the Philox draws' share of the time shows here.
// bench/ab_bf16_dropout.sh compares two builds on it. Args: BH, T (= S), D.
void BM_FlashBf16DropoutStep(benchmark::State& state) {
  Bf16Buffers buf(state.range(0), state.range(1), state.range(2), false, true);
  buf.p.dropout = 0.1f;
  buf.p.seed = 7;
  buf.p.offset = 3;
  for (auto _ : state) {
    attn::cpu::flash_attention_forward_bf16(buf.p);
    attn::cpu::flash_attention_backward_bf16(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
  }
  set_counters(state, 3.5 * forward_flops(buf.f.BH, buf.f.T, buf.f.D, false));
}
BENCHMARK(BM_FlashBf16DropoutStep)
    ->Args({128, 128, 32})  // bench/run_train.sh's attention: B = 32, 4 heads, T = 128, D = 32
    ->Args({16, 1024, 64})
    ->Args({16, 1024, 128})
    ->ArgNames({"BH", "T", "D"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// fp32 and bf16 alternately in each iteration, so both see the same machine load (this machine
// is shared): fp32_ms and bf16_ms are the medians over iterations, speedup the median of the
// per-iteration ratios fp32 time / bf16 time (wall clock), speedup_cpu the same ratio of the
// process CPU time of both threads (robust to time slicing under load; run with
// OMP_WAIT_POLICY=PASSIVE so that threads waiting at barriers do not spin). Args: BH, T (= S), D,
// causal, backward.
void BM_FlashBf16Speedup(benchmark::State& state) {
  const bool causal = state.range(3) != 0, backward = state.range(4) != 0;
  Bf16Buffers buf(state.range(0), state.range(1), state.range(2), causal, backward);
  // One untimed call of each first (the forward's results are the backward's inputs): a first
  // call faults in its scratch, and at T = 4096 a run may time a single iteration.
  attn::cpu::flash_attention_forward(buf.f.p);
  attn::cpu::flash_attention_forward_bf16(buf.p);
  if (backward) {
    attn::cpu::flash_attention_backward(buf.f.p, buf.f.g);
    attn::cpu::flash_attention_backward_bf16(buf.p, buf.g);
  }
  using clock = std::chrono::steady_clock;
  auto cpu_ms = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
  };
  std::vector<double> t32, t16, ratio, ratio_cpu;
  for (auto _ : state) {
    const double ca = cpu_ms();
    const auto a = clock::now();
    if (backward) {
      attn::cpu::flash_attention_backward(buf.f.p, buf.f.g);
    } else {
      attn::cpu::flash_attention_forward(buf.f.p);
    }
    const auto b = clock::now();
    const double cb = cpu_ms();
    if (backward) {
      attn::cpu::flash_attention_backward_bf16(buf.p, buf.g);
    } else {
      attn::cpu::flash_attention_forward_bf16(buf.p);
    }
    const auto c = clock::now();
    const double cc = cpu_ms();
    ratio_cpu.push_back((cb - ca) / (cc - cb));
    t32.push_back(std::chrono::duration<double, std::milli>(b - a).count());
    t16.push_back(std::chrono::duration<double, std::milli>(c - b).count());
    ratio.push_back(t32.back() / t16.back());
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.empty() ? 0.0 : x[x.size() / 2];
  };
  state.counters["fp32_ms"] = median(t32);
  state.counters["bf16_ms"] = median(t16);
  state.counters["speedup"] = median(ratio);
  state.counters["speedup_cpu"] = median(ratio_cpu);
  state.counters["native_bf16"] = attn::cpu::flash_bf16_native() ? 1 : 0;
}
BENCHMARK(BM_FlashBf16Speedup)
    ->ArgsProduct({{16}, {1024, 4096}, {64, 128}, {0}, {0, 1}})
    ->ArgNames({"BH", "T", "D", "causal", "backward"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Resident-set high-water mark (VmHWM) in bytes; reset_peak() sets it to the current RSS.
int64_t read_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::string(key).size());
  return -1;
}
void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

// T = S = 65536, D = 64, one head: forward then backward, once. extra_MiB is the growth of the
// peak RSS over the RSS with all inputs and outputs allocated and touched.
void BM_FlashLongForwardBackward(benchmark::State& state) {
  const int64_t t = state.range(0);
  Buffers buf(1, t, 64, false, true);
  double extra_mib = 0;
  for (auto _ : state) {
    reset_peak();
    const int64_t base_kb = read_status_kb("VmRSS:");
    attn::cpu::flash_attention_forward(buf.p);
    attn::cpu::flash_attention_backward(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
    extra_mib = double(read_status_kb("VmHWM:") - base_kb) / 1024.0;
  }
  set_counters(state, 3.5 * forward_flops(1, t, 64, false));
  state.counters["extra_MiB"] = extra_mib;
}
BENCHMARK(BM_FlashLongForwardBackward)
    ->Arg(65536)
    ->ArgName("T")
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();

// The same with bfloat16 inputs (the native kernels where the CPU has AVX512-BF16).
void BM_FlashBf16LongForwardBackward(benchmark::State& state) {
  const int64_t t = state.range(0);
  Bf16Buffers buf(1, t, 64, false, true);
  double extra_mib = 0;
  for (auto _ : state) {
    reset_peak();
    const int64_t base_kb = read_status_kb("VmRSS:");
    attn::cpu::flash_attention_forward_bf16(buf.p);
    attn::cpu::flash_attention_backward_bf16(buf.p, buf.g);
    benchmark::DoNotOptimize(buf.dq.data());
    extra_mib = double(read_status_kb("VmHWM:") - base_kb) / 1024.0;
  }
  set_counters(state, 3.5 * forward_flops(1, t, 64, false));
  state.counters["extra_MiB"] = extra_mib;
  state.counters["native_bf16"] = attn::cpu::flash_bf16_native() ? 1 : 0;
}
BENCHMARK(BM_FlashBf16LongForwardBackward)
    ->Arg(65536)
    ->ArgName("T")
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("flash_target", attn::cpu::flash_attention_target());
  benchmark::AddCustomContext("fma_peak_target", attn::bench::fma_peak_target());
  benchmark::AddCustomContext("fma_peak_GFLOPS", std::to_string(peak_gflops()));
  benchmark::AddCustomContext("threads", std::to_string(bench_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
