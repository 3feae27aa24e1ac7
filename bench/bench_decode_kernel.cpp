// The decode kernel alone (kernels/cpu/decode_attention): T = 1..4 queries per (batch, head) row
// against a cache of S = 4k..64k keys, fp32 and bf16, H = 8 heads of D = 64 (the decoder of
// issue 14). Reports the cache read rate (K and V bytes of the kept keys / time) and its share of
// a streaming-read bandwidth measured in the same run, same threads: the kernel is memory-bound,
// so that share is its efficiency. Rounds alternate probe and kernel so load drifts hit both.
//
// The cache (batch, S, H*D) is sized to >= 256 MiB (batch raised at short S) so it does not fit
// the last-level cache; the probe reads its own 512 MiB buffer.
//
//   OMP_WAIT_POLICY=PASSIVE build/<dir>/bench/bench_decode_kernel [rounds [fp32|bf16 [T]]]
//   ATTN_THREADS (2); the optional dtype and T run only those cells (a profile of one case).
//   ATTN_BENCH_S=256 ATTN_BENCH_BATCH=1 ATTN_BENCH_REPEAT=200 ATTN_THREADS=1: one cache length and
//   batch, the kernel called 200 times per round: a 512 KiB bf16 cache then stays in L2 and the
//   kernel's rate per CPU second is its compute bound (ns per key = 2 * H * D * bytes / rate).
// PASSIVE: on a machine shared with other processes, OpenMP threads spinning at the end of a
// parallel region take turns from the threads still working (the kernel's ratio at T = 1 went
// from ~60% to ~85% of the probe at load 10 on 2 cores).
// Output: one line per (dtype, S, T): median GB/s of the kernel, of the probe, their ratio; and
// the same per CPU second of the process (what the ratio is where other processes take turns on
// the cores: a loaded machine inflates the wall times of the kernel and of the probe unequally).
#include "attn/core/dtype.hpp"
#include "kernels/cpu/decode_attention.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

namespace {

constexpr int64_t kH = 8, kD = 64;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU seconds of the process (all threads): on a loaded machine the wall time counts the time
// other processes held the cores; GB per CPU second does not (OpenMP's spinning counts, though).
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Rate {
  double wall_gbs, cpu_gbs;  // GB per wall second, GB per CPU second
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Streaming read: each thread sums its contiguous share of buf with 8 independent accumulators
// (the compiler vectorises them); GB/s of bytes read.
Rate probe_gbs(const std::vector<float>& buf, int threads) {
  const int64_t n = static_cast<int64_t>(buf.size());
  double sink = 0;
  const double t0 = now(), c0 = cpu_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t lo = n * id / nt / 64 * 64, hi = id + 1 == nt ? n : n * (id + 1) / nt / 64 * 64;
    float acc[16] = {};
    for (int64_t i = lo; i + 16 <= hi; i += 16)
      for (int j = 0; j < 16; ++j)
        acc[j] += buf[static_cast<size_t>(i + j)];
    for (float a : acc)
      sink += a;
  }
  const double dt = now() - t0, dc = cpu_now() - c0;
  if (sink == 12345.678) std::printf("#");  // keep the sum alive
  const double gb = static_cast<double>(n) * sizeof(float) / 1e9;
  return {gb / dt, gb / dc};
}

template <class KV>
Rate kernel_gbs(int64_t batch, int64_t S, int64_t T, const std::vector<KV>& k,
                const std::vector<KV>& v, const std::vector<float>& q, std::vector<float>& out,
                int threads) {
  attn::cpu::DecodeArgs<KV> a;
  a.B = batch * kH, a.T = T, a.S = S, a.D = kD, a.Dv = kD, a.heads = kH;
  a.scale = 0.125f;
  a.threads = threads;
  a.q = {q.data(), T * kH * kD, kD, kH * kD, 1};
  a.k = {k.data(), S * kH * kD, kD, kH * kD, 1};
  a.v = {v.data(), S * kH * kD, kD, kH * kD, 1};
  a.out = {out.data(), T * kH * kD, kD, kH * kD, 1};
  const double t0 = now(), c0 = cpu_now();
  // ATTN_BENCH_REPEAT calls back to back (1 by default): with a cache that fits L2, all but the
  // first read it from L2.
  const char* rep = std::getenv("ATTN_BENCH_REPEAT");
  const int repeat = rep != nullptr ? std::max(1, std::atoi(rep)) : 1;
  for (int i = 0; i < repeat; ++i)
    attn::cpu::decode_attention(a);
  const double dt = now() - t0, dc = cpu_now() - c0;
  const double gb = repeat * 2.0 * static_cast<double>(batch * S * kH * kD) * sizeof(KV) / 1e9;
  return {gb / dt, gb / dc};
}

template <class KV>
void run(const char* dtype, int64_t S, int rounds, int threads, const std::vector<float>& probe,
         int64_t only_T) {
  const int64_t row_bytes = 2 * kH * kD * static_cast<int64_t>(sizeof(KV));
  const char* mib = std::getenv("ATTN_BENCH_CACHE_MIB");  // e.g. 8: in L3, the compute bound
  const int64_t cache_bytes =
      (mib != nullptr ? std::max(1, std::atoi(mib)) : 256) * (int64_t{1} << 20);
  const char* fixed_batch = std::getenv("ATTN_BENCH_BATCH");  // e.g. 1 with ATTN_BENCH_S=256
  const int64_t batch = fixed_batch != nullptr
                            ? std::max(1, std::atoi(fixed_batch))
                            : std::max<int64_t>(1, cache_bytes / (S * row_bytes));
  std::vector<KV> k(static_cast<size_t>(batch * S * kH * kD)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    const float x = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    if constexpr (sizeof(KV) == 2)
      k[i] = attn::float_to_bf16(x), v[i] = attn::float_to_bf16(-x);
    else
      k[i] = x, v[i] = -x;
  }
  for (int64_t T = 1; T <= 4; ++T) {
    if (only_T != 0 && T != only_T) continue;
    std::vector<float> q(static_cast<size_t>(batch * T * kH * kD), 0.01f), out(q.size());
    std::vector<double> ks, ps, kc, pc;
    kernel_gbs(batch, S, T, k, v, q, out, threads);  // warm-up (scratch, pages)
    for (int r = 0; r < rounds; ++r) {
      const Rate p = probe_gbs(probe, threads);
      const Rate kr = kernel_gbs(batch, S, T, k, v, q, out, threads);
      ps.push_back(p.wall_gbs), pc.push_back(p.cpu_gbs);
      ks.push_back(kr.wall_gbs), kc.push_back(kr.cpu_gbs);
    }
    const double kg = median(ks), pg = median(ps), kcg = median(kc), pcg = median(pc);
    std::printf(
        "%-5s S=%-6lld T=%lld batch=%-3lld cache %4lld MiB  kernel %6.2f GB/s  probe %6.2f "
        "GB/s  %5.1f%%  per CPU s: kernel %6.2f probe %6.2f  %5.1f%%\n",
        dtype, static_cast<long long>(S), static_cast<long long>(T), static_cast<long long>(batch),
        static_cast<long long>(batch * S * row_bytes >> 20), kg, pg, 100.0 * kg / pg, kcg, pcg,
        100.0 * kcg / pcg);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  const char* env = std::getenv("ATTN_THREADS");
  const int threads = env != nullptr ? std::max(1, std::atoi(env)) : 2;
  const std::string only_dtype = argc > 2 ? argv[2] : "";
  const int64_t only_T = argc > 3 ? std::atoi(argv[3]) : 0;
  std::vector<float> probe(static_cast<size_t>(128) << 20, 1.0f);  // 512 MiB
  std::printf("decode kernel, H=%lld D=%lld, %d threads, %d rounds, target %s\n",
              static_cast<long long>(kH), static_cast<long long>(kD), threads, rounds,
              attn::cpu::decode_attention_target());
  std::vector<int64_t> lengths = {4096, 16384, 65536};
  if (const char* only_S = std::getenv("ATTN_BENCH_S")) lengths = {std::max(1, std::atoi(only_S))};
  for (int64_t S : lengths) {
    if (only_dtype.empty() || only_dtype == "fp32")
      run<float>("fp32", S, rounds, threads, probe, only_T);
    if (only_dtype.empty() || only_dtype == "bf16")
      run<uint16_t>("bf16", S, rounds, threads, probe, only_T);
  }
  return 0;
}
