// attn bench ring: ring attention (attn/ops/ring_attention.hpp) on a sequence of --seq tokens
// split over the ranks of `mpirun -np N`, forward and backward, and with --single the
// single-process fused kernel (scaled_dot_product_attention) on the same whole problem, for the
// comparison scripts/bench-ring.sh prints.
//
//   mpirun -np 2 attn bench ring --seq 32768 --head-dim 64 --batch-heads 1 --threads 1
//   attn bench ring --single --seq 32768 --head-dim 64 --batch-heads 1 --threads 2
//
// Each timed pass starts after a barrier; its time is the slowest rank's (wall clock), and the
// CPU seconds are summed over ranks. FLOPs as `attn bench attention`: forward 4*BH*pairs*D with
// pairs = T*T (causal T(T+1)/2), backward 2.5x. Memory: every rank's peak RSS, and the bytes of
// the shard's inputs and outputs. Rank 0 prints (text or one JSON object).
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/ring_attention.hpp"
#include "tools/attn/commands.hpp"

#include <fmt/format.h>
#include <sys/resource.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <memory>
#include <vector>

namespace attn::cli {

namespace {

constexpr const char* kOp = "bench ring";

struct BenchRingArgs {
  int64_t seq = 32768, head_dim = 64, batch_heads = 1;
  bool causal = false, single = false, json = false;
  std::string dtype = "f32", layout = "auto";
  int threads = 1, repeats = 3, warmup = 1;
};

double wall() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double cpu() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor uniform(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::F32);
  Rng rng(seed, 0xbe9c);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = static_cast<float>(rng.uniform(-1.0, 1.0));
  return t.to(dtype);
}

struct Pass {
  double wall_s = 0, cpu_s = 0;  // median wall (slowest rank), CPU seconds summed over ranks
};

struct BenchRingResult {
  int ranks = 1;
  Pass fwd, bwd;
  double flops_fwd = 0, io_mib = 0;
  std::vector<double> rss_mib;  // per rank
};

BenchRingResult run_bench_ring(const BenchRingArgs& a, Communicator& comm) {
  const int N = comm.size(), r = comm.rank();
  check(a.seq >= 2 && a.head_dim >= 1 && a.batch_heads >= 1 && a.threads >= 0 && a.repeats >= 1 &&
            a.warmup >= 0,
        kOp,
        "--seq {} --head-dim {} --batch-heads {} --threads {} --repeats {} --warmup {}: expected "
        "positive sizes, threads >= 0, repeats >= 1, warmup >= 0",
        a.seq, a.head_dim, a.batch_heads, a.threads, a.repeats, a.warmup);
  check(a.dtype == "f32" || a.dtype == "bf16", kOp, "--dtype {}: expected f32 or bf16", a.dtype);
  check(a.layout == "auto" || a.layout == "contiguous" || a.layout == "zigzag", kOp,
        "--layout {}: expected auto, contiguous or zigzag", a.layout);
  check(!a.single || N == 1, kOp,
        "--single times the single-process kernel: run it without mpirun (got {} ranks)", N);
  const DType dt = a.dtype == "bf16" ? DType::BF16 : DType::F32;
  RingOptions ro;
  ro.causal = a.causal;
  if (a.layout != "auto")
    ro.layout = a.layout == "zigzag" ? RingLayout::kZigzag : RingLayout::kContiguous;
  const int64_t parts = ro.resolved_layout() == RingLayout::kZigzag ? 2 * N : N;
  check(a.seq % parts == 0, kOp,
        "--seq {} does not divide into {} equal parts ({} layout on {} ranks): expected a "
        "multiple of {}",
        a.seq, parts, ring_layout_name(ro.resolved_layout()), N, parts);

  Context ctx;
  ctx.threads = a.threads;
  ctx.backend = Backend::kCpu;
  const int64_t BH = a.batch_heads, L = a.seq / N, D = a.head_dim;
  const uint64_t seed = 100 + 10 * static_cast<uint64_t>(r);
  const Tensor q = uniform({BH, L, D}, dt, seed), k = uniform({BH, L, D}, dt, seed + 1),
               v = uniform({BH, L, D}, dt, seed + 2), dout = uniform({BH, L, D}, dt, seed + 3);
  AttentionOptions so;
  so.mask.causal = a.causal;

  BenchRingResult res;
  res.ranks = N;
  const double T = static_cast<double>(a.seq);
  res.flops_fwd =
      4.0 * static_cast<double>(BH) * (a.causal ? T * (T + 1) / 2 : T * T) * static_cast<double>(D);
  // q, k, v, out, dout, dq, dk, dv of the shard (and lse).
  res.io_mib = static_cast<double>(BH * L) *
               (8.0 * static_cast<double>(D) * static_cast<double>(dtype_size(dt)) + 4.0) /
               (1024.0 * 1024.0);

  std::vector<double> fw, fc, bw, bc;
  for (int i = 0; i < a.warmup + a.repeats; ++i) {
    double t[4];
    comm.barrier();
    double w0 = wall(), c0 = cpu();
    AttentionResult f = a.single ? scaled_dot_product_attention(ctx, q, k, v, so)
                                 : ring_attention(ctx, comm, q, k, v, {}, ro);
    t[0] = wall() - w0, t[1] = cpu() - c0;
    comm.barrier();
    w0 = wall(), c0 = cpu();
    AttentionGrads g = a.single ? scaled_dot_product_attention_backward(ctx, dout, q, k, v, f, so)
                                : ring_attention_backward(ctx, comm, dout, q, k, v, {}, f, ro);
    t[2] = wall() - w0, t[3] = cpu() - c0;
    double worst[2] = {t[0], t[2]}, sum[2] = {t[1], t[3]};
    comm.allreduce(std::span<double>(worst), ReduceOp::kMax);
    comm.allreduce(std::span<double>(sum), ReduceOp::kSum);
    if (i < a.warmup) continue;
    fw.push_back(worst[0]), bw.push_back(worst[1]), fc.push_back(sum[0]), bc.push_back(sum[1]);
  }
  res.fwd = {median(fw), median(fc)};
  res.bwd = {median(bw), median(bc)};
  res.rss_mib.assign(static_cast<size_t>(N), 0.0);
  res.rss_mib[static_cast<size_t>(r)] = peak_rss_mib();
  comm.allreduce(std::span<double>(res.rss_mib), ReduceOp::kSum);
  return res;
}

std::string text(const BenchRingArgs& a, const BenchRingResult& r) {
  const double gf = r.flops_fwd / 1e9;
  std::string s = fmt::format(
      "attn bench ring: {} on {} rank(s) x {} thread(s); T = {} ({} per rank), D = {}, B*H = "
      "{}, {}{}\n",
      a.single ? "single-process fused kernel" : "ring attention", r.ranks, a.threads, a.seq,
      a.seq / r.ranks, a.head_dim, a.batch_heads, a.dtype, a.causal ? ", causal" : "");
  s += fmt::format("  forward   {:9.3f} s  {:8.1f} GFLOP/s  CPU {:8.3f} s (all ranks)\n",
                   r.fwd.wall_s, gf / r.fwd.wall_s, r.fwd.cpu_s);
  s += fmt::format("  backward  {:9.3f} s  {:8.1f} GFLOP/s  CPU {:8.3f} s (all ranks)\n",
                   r.bwd.wall_s, 2.5 * gf / r.bwd.wall_s, r.bwd.cpu_s);
  s += fmt::format("  memory: shard inputs/outputs {:.1f} MiB per rank; peak RSS per rank:",
                   r.io_mib);
  for (double m : r.rss_mib)
    s += fmt::format(" {:.1f}", m);
  return s + " MiB\n";
}

std::string json(const BenchRingArgs& a, const BenchRingResult& r) {
  nlohmann::ordered_json j;
  j["op"] = a.single ? "single" : "ring";
  j["ranks"] = r.ranks;
  j["threads"] = a.threads;
  j["seq"] = a.seq;
  j["head_dim"] = a.head_dim;
  j["batch_heads"] = a.batch_heads;
  j["dtype"] = a.dtype;
  j["causal"] = a.causal;
  j["forward_s"] = r.fwd.wall_s;
  j["backward_s"] = r.bwd.wall_s;
  j["forward_cpu_s"] = r.fwd.cpu_s;
  j["backward_cpu_s"] = r.bwd.cpu_s;
  j["forward_gflops"] = r.flops_fwd / 1e9 / r.fwd.wall_s;
  j["backward_gflops"] = 2.5 * r.flops_fwd / 1e9 / r.bwd.wall_s;
  j["io_mib_per_rank"] = r.io_mib;
  j["peak_rss_mib"] = r.rss_mib;
  return j.dump();
}

}  // namespace

std::vector<Command> add_bench_ring_command(CLI::App& bench) {
  auto args = std::make_shared<BenchRingArgs>();
  CLI::App* sub = bench.add_subcommand(
      "ring",
      "Ring attention over the ranks of `mpirun -np N` (sequence split across ranks): forward "
      "and backward time, GFLOP/s, CPU time, peak RSS per rank; --single times the "
      "single-process fused kernel on the same whole problem (scripts/bench-ring.sh compares).");
  sub->add_option("--seq", args->seq, "T: total sequence length (all ranks)")
      ->capture_default_str();
  sub->add_option("--head-dim", args->head_dim, "D")->capture_default_str();
  sub->add_option("--batch-heads", args->batch_heads, "B*H")->capture_default_str();
  sub->add_flag("--causal", args->causal, "causal mask");
  sub->add_option("--dtype", args->dtype, "f32 or bf16")->capture_default_str();
  sub->add_option("--layout", args->layout, "auto (zigzag when causal), contiguous or zigzag")
      ->capture_default_str();
  sub->add_option("--threads", args->threads, "threads per rank")->capture_default_str();
  sub->add_option("--repeats", args->repeats, "timed passes (median)")->capture_default_str();
  sub->add_option("--warmup", args->warmup, "untimed passes first")->capture_default_str();
  sub->add_flag("--single", args->single,
                "time scaled_dot_product_attention on the whole sequence in this one process");
  sub->add_flag("--json", args->json, "print one JSON object");
  auto run = [args] {
    auto comm = world_communicator();
    const BenchRingResult r = run_bench_ring(*args, *comm);
    if (comm->rank() == 0) print(args->json ? json(*args, r) + "\n" : text(*args, r));
  };
  return {{sub, run}};
}

}  // namespace attn::cli
