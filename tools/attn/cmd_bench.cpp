// attn bench attention: times scaled dot-product attention (forward, or backward with
// --backward) through the library's public op on one shape, and reports GFLOP/s beside the
// machine's FP32 FMA peak measured in the same run, the median time and the peak memory. --json
// prints one object, so that scripts can drive it (bench/ has the side-by-side comparisons).
//
// FLOPs follow the FlashAttention papers: forward 4 * BH * pairs * D (two products of 2*D FLOPs
// per query-key pair: q.k and p*v), backward 2.5x the forward. `pairs` counts the pairs the mask
// keeps: T*S without a mask, sum_t min(t + 1, S) when causal (about half for T = S).
#include "attn/core/context.hpp"
#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "attn/ops/attention.hpp"
#include "bench/fma_peak.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "tools/attn/commands.hpp"

#ifdef ATTN_WITH_CUDA  // CMakeLists.txt defines it for this file in CUDA builds
#include "attn/cuda/runtime.hpp"
#include "kernels/cuda/kernels.hpp"
#endif

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace attn::cli {

namespace {

constexpr const char* kOp = "bench attention";

struct BenchAttentionArgs {
  int64_t batch_heads = 16, queries = 1024, keys = 0, head_dim = 64;
  std::string dtype = "f32";
  bool causal = false, backward = false, json = false;
  int threads = 0, repeats = 10, warmup = 2;
  double warmup_seconds = 1.0;
  std::string backend = "auto";
  std::string device = "cpu";  // cuda: the CUDA kernels (builds with -DATTN_WITH_CUDA=ON)
};

// Resident set now and at its peak, in MiB (Linux: /proc/self/statm and getrusage).
double rss_now_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0.0;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

double rss_peak_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return DType::F32;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "f64" || name == "float64") return DType::F64;
  throw Error(kOp, fmt::format("--dtype {}: expected f32, bf16 or f64", name));
}

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "cpu") return Backend::kCpu;
  if (name == "reference") return Backend::kReference;
  throw Error(kOp, fmt::format("--backend {}: expected auto, cpu or reference", name));
}

// Uniform [-1, 1) values from the library's generator, converted to `dtype`.
Tensor random_tensor(const Shape& shape, DType dtype, Rng& gen) {
  int64_t n = 1;
  for (int64_t e : shape)
    n *= e;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values)
    x = static_cast<float>(gen.uniform(-1.0, 1.0));
  return Tensor::from_vector(values, shape).to(dtype);
}

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  return n % 2 ? xs[n / 2] : 0.5 * (xs[n / 2 - 1] + xs[n / 2]);
}

struct BenchResult {
  BenchAttentionArgs args;
  int64_t keys = 0, threads = 0;
  double flops = 0, median_ms = 0, min_ms = 0, gflops = 0, peak_gflops = 0;
  double rss_before_mib = 0, peak_rss_mib = 0, io_mib = 0;
  std::string peak_target, kernel_target;
  int warmup_runs = 0;
  std::string gpu;  // the GPU's description with --device cuda (no FMA peak then)
};

#ifdef ATTN_WITH_CUDA
// --device cuda: the fused CUDA kernels on (B*H, T|S, D) device tensors, one head per row. Each
// timed run is `inner` back-to-back calls (at least ~1 ms in all, as a stream of launches), so
// that microsecond kernels are not timed by a synchronisation each.
template <class E>
void run_bench_cuda(const BenchAttentionArgs& a, DType dtype, BenchResult& r) {
  const int64_t BH = a.batch_heads, T = a.queries, S = r.keys, D = a.head_dim;
  Rng gen(42);
  auto dev = [&](int64_t rows, int64_t len) {
    return cuda::to_device(random_tensor({rows, len, D}, dtype, gen));
  };
  const Tensor q = dev(BH, T), k = dev(BH, S), v = dev(BH, S), dout = dev(BH, T);
  const Tensor out = cuda::empty({BH, T, D}, dtype), dq = cuda::empty({BH, T, D}, dtype),
               dk = cuda::empty({BH, S, D}, dtype), dv = cuda::empty({BH, S, D}, dtype),
               lse = cuda::empty({BH * T}, DType::F32), delta = cuda::empty({BH * T}, DType::F32);
  auto view = [](const Tensor& t, int64_t len, int64_t width) {
    return kernels::StridedView<E>{static_cast<E*>(t.raw_data()), len * width, 0, width, 1};
  };
  kernels::AttentionArgs<E> args;
  args.B = BH;
  args.T = T;
  args.S = S;
  args.D = D;
  args.Dv = D;
  args.causal = a.causal;
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  args.q = {static_cast<const E*>(q.raw_data()), T * D, 0, D, 1};
  args.k = {static_cast<const E*>(k.raw_data()), S * D, 0, D, 1};
  args.v = {static_cast<const E*>(v.raw_data()), S * D, 0, D, 1};
  args.out = view(out, T, D);
  args.lse = static_cast<float*>(lse.raw_data());
  const kernels::AttentionGradArgs<E> grads{
      {static_cast<const E*>(dout.raw_data()), T * D, 0, D, 1},
      view(dq, T, D),
      view(dk, S, D),
      view(dv, S, D)};
  auto call = [&] {
    if (a.backward)
      cuda::flash_attention_backward(args, grads, static_cast<float*>(delta.raw_data()), nullptr);
    else
      cuda::flash_attention_forward(args, nullptr);
  };
  cuda::flash_attention_forward(args, nullptr);  // the backward reads its out and lse
  auto timed = [&](int inner) {
    cuda::synchronize(nullptr);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < inner; ++i)
      call();
    cuda::synchronize(nullptr);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
               .count() /
           inner;
  };
  double warmed_ms = 0.0;
  int warmup_runs = 0;
  double one = timed(1);
  const int inner = static_cast<int>(std::clamp(std::ceil(1.0 / std::max(one, 1e-4)), 1.0, 1000.0));
  while (warmup_runs < a.warmup || (warmed_ms < 1e3 * a.warmup_seconds && warmup_runs < 1000)) {
    warmed_ms += timed(inner) * inner;
    ++warmup_runs;
  }
  std::vector<double> ms;
  for (int i = 0; i < a.repeats; ++i)
    ms.push_back(timed(inner));
  r.warmup_runs = warmup_runs;
  r.median_ms = median(ms);
  r.min_ms = *std::min_element(ms.begin(), ms.end());
  r.gflops = r.flops / (r.median_ms * 1e6);
  r.gpu = cuda::device_description();
  r.kernel_target = "cuda";
}
#endif

BenchResult run_bench(const BenchAttentionArgs& a) {
  check(a.batch_heads >= 1 && a.queries >= 1 && a.keys >= 0 && a.head_dim >= 1, kOp,
        "--batch-heads {} --queries {} --keys {} --head-dim {}: expected sizes >= 1", a.batch_heads,
        a.queries, a.keys, a.head_dim);
  check(a.repeats >= 1 && a.warmup >= 0 && a.threads >= 0 && a.warmup_seconds >= 0.0, kOp,
        "--repeats {} --warmup {} --warmup-seconds {} --threads {}: expected repeats >= 1, "
        "warmup >= 0, warmup-seconds >= 0 and threads >= 0 (0: all hardware threads)",
        a.repeats, a.warmup, a.warmup_seconds, a.threads);
  const DType dtype = parse_dtype(a.dtype);
  BenchResult r;
  r.args = a;
  r.keys = a.keys > 0 ? a.keys : a.queries;
  const int64_t BH = a.batch_heads, T = a.queries, S = r.keys, D = a.head_dim;

  // FLOPs of the kept pairs; inputs and outputs of the pass timed: q, k, v, out (+ lse) and for
  // the backward dout and the three gradients (memory beyond them is the kernel's).
  double pairs = 0;
  for (int64_t t = 0; t < T; ++t)
    pairs += static_cast<double>(a.causal ? std::min(t + 1, S) : S);
  r.flops = 4.0 * static_cast<double>(BH) * pairs * static_cast<double>(D);
  if (a.backward) r.flops *= 2.5;
  const double bytes = static_cast<double>(dtype_size(dtype));
  const double qkvo = static_cast<double>(BH) * static_cast<double>(2 * T * D + 2 * S * D) * bytes;
  r.io_mib = (a.backward ? 2.0 * qkvo : qkvo) / (1024.0 * 1024.0);
  if (a.device == "cuda") {
#ifdef ATTN_WITH_CUDA
    check(dtype != DType::F64, kOp, "--device cuda: --dtype f32 or bf16 (no f64 kernels)");
    check(a.backend == "auto", kOp, "--device cuda: --backend {} is a CPU choice", a.backend);
    r.rss_before_mib = rss_now_mib();
    if (dtype == DType::BF16)
      run_bench_cuda<uint16_t>(a, dtype, r);
    else
      run_bench_cuda<float>(a, dtype, r);
    r.peak_rss_mib = rss_peak_mib();
    return r;
#else
    throw Error(kOp, "--device cuda needs an attn built with -DATTN_WITH_CUDA=ON (docs/gpu.md)");
#endif
  }

  Context ctx;
  ctx.threads = a.threads;
  ctx.backend = parse_backend(a.backend);
  r.threads = ctx.resolved_threads();
  r.peak_gflops = bench::measure_fma_peak_gflops(static_cast<int>(r.threads));
  r.peak_target = bench::fma_peak_target();
  r.kernel_target = cpu::flash_attention_target();

  Rng gen(42);
  const Tensor q = random_tensor({BH, T, D}, dtype, gen);
  const Tensor k = random_tensor({BH, S, D}, dtype, gen);
  const Tensor v = random_tensor({BH, S, D}, dtype, gen);
  const Tensor dout = a.backward ? random_tensor({BH, T, D}, dtype, gen) : Tensor();
  AttentionOptions opts;
  opts.mask.causal = a.causal;
  opts.need_weights = false;

  r.rss_before_mib = rss_now_mib();
  std::vector<double> ms;
  AttentionResult fwd;
  AttentionGrads grads;
  if (a.backward) fwd = scaled_dot_product_attention(ctx, q, k, v, opts);
  // Untimed runs first: at least --warmup of them and at least --warmup-seconds in all (at most
  // 1000 runs). Each call allocates its results; until the allocator's heap stops growing, a call
  // writes to fresh pages whose first-touch faults inflate the first calls' times.
  double warmed_ms = 0.0;
  int warmup_runs = 0;
  while (static_cast<int>(ms.size()) < a.repeats) {
    // The previous results are released before the clock starts, so that the allocator can hand
    // their memory to this call, as in a loop that drops each result before the next step.
    if (a.backward) {
      grads = AttentionGrads();
    } else {
      fwd = AttentionResult();
    }
    const auto start = std::chrono::steady_clock::now();
    if (a.backward) {
      grads = scaled_dot_product_attention_backward(ctx, dout, q, k, v, fwd, opts);
    } else {
      fwd = scaled_dot_product_attention(ctx, q, k, v, opts);
    }
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const bool warming =
        warmup_runs < a.warmup || (warmed_ms < 1e3 * a.warmup_seconds && warmup_runs < 1000);
    if (warming) {
      warmed_ms += elapsed;
      ++warmup_runs;
    } else {
      ms.push_back(elapsed);
    }
  }
  r.warmup_runs = warmup_runs;
  r.median_ms = median(ms);
  r.min_ms = *std::min_element(ms.begin(), ms.end());
  r.gflops = r.flops / (r.median_ms * 1e6);
  r.peak_rss_mib = rss_peak_mib();
  // The peak is measured again after the timed runs and the higher value kept: a peak taken
  // while a shared core is briefly slowed reads far below the machine's.
  r.peak_gflops =
      std::max(r.peak_gflops, bench::measure_fma_peak_gflops(static_cast<int>(r.threads)));
  return r;
}

std::string bench_json(const BenchResult& r) {
  const BenchAttentionArgs& a = r.args;
  nlohmann::ordered_json j;
  j["op"] = "attention";
  j["device"] = a.device;
  if (!r.gpu.empty()) j["gpu"] = r.gpu;
  j["pass"] = a.backward ? "backward" : "forward";
  j["dtype"] = a.dtype;
  j["backend"] = a.backend;
  j["batch_heads"] = a.batch_heads;
  j["queries"] = a.queries;
  j["keys"] = r.keys;
  j["head_dim"] = a.head_dim;
  j["causal"] = a.causal;
  j["threads"] = r.threads;
  j["repeats"] = a.repeats;
  j["warmup_runs"] = r.warmup_runs;
  j["flops"] = r.flops;
  j["median_ms"] = r.median_ms;
  j["min_ms"] = r.min_ms;
  j["gflops"] = r.gflops;
  j["peak_gflops"] = r.peak_gflops;  // 0 on the GPU: no FMA peak is measured there
  j["percent_of_peak"] = r.peak_gflops > 0 ? 100.0 * r.gflops / r.peak_gflops : 0.0;
  j["peak_rss_mib"] = r.peak_rss_mib;
  j["rss_before_mib"] = r.rss_before_mib;
  j["inputs_outputs_mib"] = r.io_mib;
  j["simd_target"] = r.kernel_target;
  j["peak_simd_target"] = r.peak_target;
  return j.dump(2);
}

std::string bench_text(const BenchResult& r) {
  const BenchAttentionArgs& a = r.args;
  std::string s = fmt::format(
      "attention {} {}, B*H={} T={} S={} D={}{}, {} thread{}, backend {} ({})\n",
      a.backward ? "backward" : "forward", a.dtype, a.batch_heads, a.queries, r.keys, a.head_dim,
      a.causal ? " causal" : "", r.threads, r.threads == 1 ? "" : "s", a.backend, r.kernel_target);
  s += fmt::format("  median {:.3f} ms (min {:.3f}) over {} runs: {:.1f} GFLOP/s\n", r.median_ms,
                   r.min_ms, a.repeats, r.gflops);
  if (!r.gpu.empty())
    s += fmt::format("  on {}\n", r.gpu);
  else
    s += fmt::format("  FMA peak measured now: {:.1f} GFLOP/s ({}) -> {:.1f}% of peak\n",
                     r.peak_gflops, r.peak_target, 100.0 * r.gflops / r.peak_gflops);
  s += fmt::format(
      "  memory: peak RSS {:.1f} MiB; {:.1f} MiB before the first call; inputs and "
      "outputs {:.1f} MiB\n",
      r.peak_rss_mib, r.rss_before_mib, r.io_mib);
  return s;
}

}  // namespace

std::vector<Command> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Time attn's kernels on this machine: GFLOP/s, % of the FMA peak measured in the "
      "same run, memory. See docs/performance.md for the side-by-side tables.");
  bench->require_subcommand(1);

  auto args = std::make_shared<BenchAttentionArgs>();
  CLI::App* sub = bench->add_subcommand(
      "attention",
      "Scaled dot-product attention (q, k, v of shape (B*H, T|S, D), uniform [-1, 1) values) "
      "through attn::scaled_dot_product_attention: forward, or the backward with --backward. "
      "FLOPs: forward 4*B*H*T*S*D, backward 2.5x, causal counts only the kept pairs.");
  sub->add_option("--batch-heads", args->batch_heads, "B*H: batch times heads")
      ->capture_default_str();
  sub->add_option("--queries", args->queries, "T: queries per head")->capture_default_str();
  sub->add_option("--keys", args->keys, "S: keys per head (default: T)");
  sub->add_option("--head-dim", args->head_dim, "D: width of q, k and v per head")
      ->capture_default_str();
  sub->add_option("--dtype", args->dtype, "f32, bf16 or f64 (inputs; accumulation in f32/f64)")
      ->capture_default_str();
  sub->add_flag("--causal", args->causal, "causal mask (query t sees keys 0..t)");
  sub->add_flag("--backward", args->backward,
                "time the backward (dq, dk, dv from dout) instead of the forward");
  sub->add_option("--threads", args->threads, "threads (0: all hardware threads)")
      ->capture_default_str();
  sub->add_option("--repeats", args->repeats, "timed runs (the median is reported)")
      ->capture_default_str();
  sub->add_option("--warmup", args->warmup, "untimed runs first (at least this many)")
      ->capture_default_str();
  sub->add_option("--warmup-seconds", args->warmup_seconds,
                  "untimed runs first for at least this long (at most 1000 runs)")
      ->capture_default_str();
  sub->add_option("--backend", args->backend,
                  "auto, cpu (fused kernels) or reference (the plain-loop oracle: slow)")
      ->capture_default_str();
  add_device_option(sub, "bench attention", &args->device);
  sub->add_flag("--json", args->json,
                "print one JSON object (gflops, peak_gflops, median_ms, peak_rss_mib, ...)");
  auto run = [args] {
    const BenchResult r = run_bench(*args);
    print(args->json ? bench_json(r) + "\n" : bench_text(r));
  };
  std::vector<Command> commands = {{sub, run}};
  for (auto& c : add_bench_comm_command(*bench))
    commands.push_back(std::move(c));
  for (auto& c : add_bench_ring_command(*bench))
    commands.push_back(std::move(c));
  commands.push_back({bench, [] {}});
  return commands;
}

}  // namespace attn::cli
