// The floor of OpenMP's fork and join on this machine: what a perfectly balanced loop of parallel
// regions loses outside its bodies, by region length.
//
// Every thread of every region runs the same body: a dependent chain of multiply-adds on its own
// registers, no memory traffic, calibrated on one thread to last `us` microseconds. So the work is
// equal by construction and any time a thread spends outside its body (waiting at the end barrier
// for the other thread, being woken for the next region, libgomp's own bookkeeping) is the cost of
// the region itself, not of an uneven split. That share is what `perf record -e cpu-clock` shows
// as libgomp in a training run whose regions have these lengths (scripts/profile.sh), so it is the
// least share any program cut into regions of that length can show on this host.
//
//   omp_floor [threads=2] [seconds_per_length=2] [lengths_us=10,30,100,300,1000] [gap_us=0]
//
// gap_us: serial work on the calling thread between two regions (as a training loop's serial code
// between its kernels), while the others wait for the next region.
//
// Prints per length: regions run, wall time per region (gap included), the body's mean time, the
// mean time from a region's start to the last thread's entry into its body (the wake-up), and the
// share of the threads' time outside the body and outside the gap (mean over the threads, and the
// worst thread).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// `steps` dependent multiply-adds; the result is returned so the chain is not removed.
// noipa: without it GCC proves chain() pure and moves the timed calls out of the timing.
__attribute__((noipa)) double chain(long steps, double seed) {
  double x = seed;
  for (long i = 0; i < steps; ++i)
    x = x * 0.9999999 + 1e-9;
  return x;
}

// Steps of chain() that take `us` microseconds on one thread (the median of 5 timings).
long calibrate(double us) {
  long steps = 1 << 16;
  for (;;) {
    const auto t0 = Clock::now();
    volatile double sink = chain(steps, 1.0);
    (void)sink;
    const double took = seconds_since(t0);
    if (took > 2e-3) {
      std::vector<double> times;
      for (int r = 0; r < 5; ++r) {
        const auto t1 = Clock::now();
        volatile double s = chain(steps, 1.0);
        (void)s;
        times.push_back(seconds_since(t1));
      }
      std::sort(times.begin(), times.end());
      return std::max(1L, static_cast<long>(static_cast<double>(steps) * us * 1e-6 / times[2]));
    }
    steps *= 2;
  }
}

struct alignas(64) ThreadTotals {
  double body = 0;  // seconds inside the body
  double sink = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 2.0;
  const double gap_us = argc > 4 ? std::atof(argv[4]) : 0.0;
  std::vector<double> lengths;
  {
    std::stringstream list(argc > 3 ? argv[3] : "10,30,100,300,1000");
    std::string item;
    while (std::getline(list, item, ','))
      lengths.push_back(std::atof(item.c_str()));
  }
  if (threads < 2 || seconds <= 0 || lengths.empty()) {
    std::fprintf(stderr,
                 "usage: omp_floor [threads>=2] [seconds_per_length] [lengths_us,...] [gap_us]\n");
    return 2;
  }
  const long gap_steps = gap_us > 0 ? calibrate(gap_us) : 0;
  std::printf("threads %d, OpenMP regions of equal bodies, %.0f us of serial work between two\n",
              threads, gap_us);
  std::printf("(share: the threads' time outside the body and the gap / their time)\n");
  std::printf("%10s %10s %12s %12s %12s %12s %12s\n", "body_us", "regions", "wall_us", "body_mean",
              "wake_us", "share_mean", "share_worst");
  for (const double us : lengths) {
    const long steps = calibrate(us);
    const long regions = std::max(10L, static_cast<long>(seconds * 1e6 / us));
    std::vector<ThreadTotals> totals(static_cast<size_t>(threads));
    // One warm-up region so that the team exists before timing starts.
#pragma omp parallel num_threads(threads)
    totals[static_cast<size_t>(omp_get_thread_num())].sink += chain(steps, 1.0);
    for (auto& t : totals)
      t.body = 0;
    double wake = 0, serial = 0;
    const auto t0 = Clock::now();
    for (long r = 0; r < regions; ++r) {
      const auto start = Clock::now();
      std::atomic<int64_t> last_entry{0};
#pragma omp parallel num_threads(threads)
      {
        ThreadTotals& mine = totals[static_cast<size_t>(omp_get_thread_num())];
        const auto b0 = Clock::now();
        const int64_t entered =
            std::chrono::duration_cast<std::chrono::nanoseconds>(b0 - start).count();
        int64_t seen = last_entry.load(std::memory_order_relaxed);
        while (entered > seen && !last_entry.compare_exchange_weak(seen, entered)) {
        }
        mine.sink += chain(steps, 1.0 + 1e-3 * omp_get_thread_num());
        mine.body += seconds_since(b0);
      }
      wake += 1e-9 * static_cast<double>(last_entry.load());
      if (gap_steps > 0) {
        const auto g0 = Clock::now();
        totals[0].sink += chain(gap_steps, 2.0);
        serial += seconds_since(g0);
      }
    }
    const double wall = seconds_since(t0) - serial;
    double body_sum = 0, body_min = totals[0].body, sink = 0;
    for (const auto& t : totals) {
      body_sum += t.body;
      body_min = std::min(body_min, t.body);
      sink += t.sink;
    }
    const double share_mean = 1.0 - body_sum / (threads * wall);
    const double share_worst = 1.0 - body_min / wall;
    std::printf("%10.0f %10ld %12.2f %12.2f %12.2f %11.2f%% %11.2f%%%s\n", us, regions,
                1e6 * (wall + serial) / regions, 1e6 * body_sum / threads / regions,
                1e6 * wake / regions, 100 * share_mean, 100 * share_worst,
                sink == 12345.0 ? " " : "");
  }
  return 0;
}
