// A record of every OpenMP parallel region a process runs, for finding where threads wait.
//
// Preloaded into a run (LD_PRELOAD=libattn_omp_trace.so ATTN_OMP_TRACE=out.txt attn train ...),
// it stands in front of libgomp's GOMP_parallel, the one call through which GCC's code (attn's and
// oneDNN's) starts a region, and GOMP_barrier and GOMP_loop_end, the barriers inside one. Per
// region it keeps the start and end on the calling thread, the team libgomp formed, the caller's
// address, and each team member's busy time: its share of the body less the time it spent at
// barriers inside the region. At exit it writes one line per region to $ATTN_OMP_TRACE:
//
//   start_ns end_ns team caller_object caller_offset busy_ns_0 ... busy_ns_{team-1}
//     late_ns_0 ... late_ns_{team-1}
//
// where late is the time from the region's start on the caller to the member entering the body
// (for the workers: libgomp's wake-up and hand-off).
//
// bench/omp_trace.py turns that into the time the threads spent idle inside regions (the end
// barrier: imbalance) and between them (the calling thread's serial code, while the others wait
// in libgomp), by caller. perf sees both only as anonymous libgomp addresses.
//
// Costs ~0.1 us per region. Nested regions and regions past the first 2^20 run untraced.
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>

namespace {

constexpr int kMaxTeam = 16;
constexpr size_t kMaxRegions = size_t{1} << 20;

struct Region {
  uint64_t start, end;
  const void* caller;
  uint32_t team;
  uint32_t busy[kMaxTeam];  // ns; a region longer than 4 s saturates
  uint32_t late[kMaxTeam];  // ns from the region's start to this member entering the body
};

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
using BarrierFn = void (*)();

std::atomic<size_t> used{0};
Region* regions = nullptr;  // allocated at the first region; pages touched as used
thread_local int depth = 0;
thread_local uint64_t barrier_ns = 0;  // this thread's time at explicit barriers so far

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

template <class F>
F next_symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

struct Body {
  void (*fn)(void*);
  void* data;
  Region* region;
};

// Runs on every team member: the region's body, timed, less its barriers inside the region.
void timed_body(void* p) {
  const Body& b = *static_cast<const Body*>(p);
  const uint64_t barriers_before = barrier_ns, t0 = now_ns();
  const uint64_t late = t0 > b.region->start ? t0 - b.region->start : 0;
  ++depth;
  b.fn(b.data);
  --depth;
  const uint64_t busy = now_ns() - t0 - (barrier_ns - barriers_before);
  const int id = omp_get_thread_num();
  if (id == 0) b.region->team = static_cast<uint32_t>(omp_get_num_threads());
  if (id < kMaxTeam) {
    b.region->busy[id] = static_cast<uint32_t>(std::min<uint64_t>(busy, UINT32_MAX));
    b.region->late[id] = static_cast<uint32_t>(std::min<uint64_t>(late, UINT32_MAX));
  }
}

}  // namespace

extern "C" {

void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) {
  static const ParallelFn real = next_symbol<ParallelFn>("GOMP_parallel");
  static Region* const storage = [] {
    regions = static_cast<Region*>(std::calloc(kMaxRegions, sizeof(Region)));
    return regions;
  }();
  size_t slot = kMaxRegions;
  if (depth == 0 && storage != nullptr) slot = used.fetch_add(1, std::memory_order_relaxed);
  if (slot >= kMaxRegions) return real(fn, data, num_threads, flags);
  Region& r = storage[slot];
  r.caller = __builtin_return_address(0);
  Body body{fn, data, &r};
  r.start = now_ns();
  real(timed_body, &body, num_threads, flags);
  r.end = now_ns();
}

void GOMP_barrier() {
  static const BarrierFn real = next_symbol<BarrierFn>("GOMP_barrier");
  const uint64_t t0 = now_ns();
  real();
  barrier_ns += now_ns() - t0;
}

// The barrier that ends a worksharing loop inside a region (`omp for` without nowait).
void GOMP_loop_end() {
  static const BarrierFn real = next_symbol<BarrierFn>("GOMP_loop_end");
  const uint64_t t0 = now_ns();
  real();
  barrier_ns += now_ns() - t0;
}

}  // extern "C"

namespace {

__attribute__((destructor)) void write_trace() {
  const char* path = std::getenv("ATTN_OMP_TRACE");
  if (path == nullptr || regions == nullptr) return;
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(path, "w"), std::fclose);
  if (!out) return;
  const size_t n = std::min(used.load(), kMaxRegions);
  for (size_t i = 0; i < n; ++i) {
    const Region& r = regions[i];
    if (r.end == 0) continue;  // still running when the process exited
    Dl_info info{};
    const bool known = dladdr(r.caller, &info) != 0 && info.dli_fname != nullptr;
    const auto offset = reinterpret_cast<uintptr_t>(r.caller) -
                        (known ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0);
    std::fprintf(out.get(), "%llu %llu %u %s %llx", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.team, known ? info.dli_fname : "?",
                 static_cast<unsigned long long>(offset));
    const uint32_t team = std::min<uint32_t>(r.team, kMaxTeam);
    for (uint32_t t = 0; t < team; ++t)
      std::fprintf(out.get(), " %u", r.busy[t]);
    for (uint32_t t = 0; t < team; ++t)
      std::fprintf(out.get(), " %u", r.late[t]);
    std::fputc('\n', out.get());
  }
}

}  // namespace
