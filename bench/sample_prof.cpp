// A sampling profile for machines without perf (the GPU machine's host runs in a gVisor sandbox:
// no perf_event_open), to find which functions take a run's CPU time there.
//
// Preloaded into a run (LD_PRELOAD=libattn_sample_prof.so ATTN_SAMPLE_PROF=out.txt attn train
// ...), it starts a timer of the process's CPU time (ITIMER_PROF: every thread's time counts)
// that raises SIGPROF ATTN_SAMPLE_HZ times a CPU second (default 997; the kernel's tick bounds
// it: ~250 a second with HZ=250), and on each signal keeps the interrupted instruction's address
// and the time. At exit it writes, for every address seen, how often it was seen in the whole run
// and past the run's first fifth (from the first sample to the exit: without the first steps,
// which create oneDNN's primitives for each new shape, as scripts/profile.sh's `--time
// 20%-100%`), the object it lies in and the address within that object (dladdr, as
// bench/omp_trace.cpp names callers; "[no object]" for generated code):
//
//   # samples N late L hz H dropped D
//   count<TAB>late count<TAB>object path<TAB>address in the object (hex)
//
// bench/sample_prof.py turns the addresses into symbols with the same binaries on the build machine
// and prints the top symbols, as scripts/profile.sh does with perf. The leaf address only: time a
// function spends in what it calls counts for the callee (as `perf report --no-children`).
//
// A program that sets its own SIGPROF handler or ITIMER_PROF takes them over. Samples past the
// first 2^22 are dropped (counted).
#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>

namespace {

constexpr size_t kMaxSamples = size_t{1} << 22;

// mmap'ed at start (nothing to allocate in the handler): addresses, then their times (ns).
uint64_t* samples = nullptr;
uint64_t* times = nullptr;
std::atomic<size_t> taken{0};
const char* out_path = nullptr;
int hz = 997;

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

void on_sigprof(int, siginfo_t*, void* context) {
  const size_t i = taken.fetch_add(1, std::memory_order_relaxed);
  if (i >= kMaxSamples) return;
  times[i] = now_ns();
#if defined(__x86_64__)
  samples[i] = static_cast<uint64_t>(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
  samples[i] = static_cast<uint64_t>(static_cast<ucontext_t*>(context)->uc_mcontext.pc);
#else
  samples[i] = 0;
#endif
}

__attribute__((constructor)) void start() {
  out_path = std::getenv("ATTN_SAMPLE_PROF");
  if (out_path == nullptr || *out_path == '\0') return;
  if (const char* h = std::getenv("ATTN_SAMPLE_HZ"); h != nullptr && std::atoi(h) > 0)
    hz = std::atoi(h);
  void* m = mmap(nullptr, 2 * kMaxSamples * sizeof(uint64_t), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "sample_prof: no memory for the samples; not sampling\n");
    out_path = nullptr;
    return;
  }
  samples = static_cast<uint64_t*>(m);
  times = samples + kMaxSamples;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigprof;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPROF, &sa, nullptr);
  const long usec = std::max(1L, 1000000L / hz);
  itimerval t{{usec / 1000000, usec % 1000000}, {usec / 1000000, usec % 1000000}};
  if (setitimer(ITIMER_PROF, &t, nullptr) != 0) {
    std::fprintf(stderr, "sample_prof: setitimer(ITIMER_PROF) failed; not sampling\n");
    out_path = nullptr;
  }
}

__attribute__((destructor)) void finish() {
  if (out_path == nullptr) return;
  const itimerval off{};
  setitimer(ITIMER_PROF, &off, nullptr);
  signal(SIGPROF, SIG_IGN);
  const size_t n = std::min(taken.load(), kMaxSamples);
  // A process that took no samples (a wrapper such as timeout that inherited the preload) leaves
  // the file to the one that did.
  if (n == 0) return;
  // Samples are stored in the order they were taken, up to a few in flight at once: the first
  // one's time starts the run.
  const uint64_t t0 = times[0], t_late = t0 + (now_ns() - t0) / 5;
  struct Count {
    uint64_t all = 0, late = 0;
  };
  std::unordered_map<uint64_t, Count> counts;
  size_t late = 0;
  for (size_t i = 0; i < n; ++i) {
    Count& c = counts[samples[i]];
    ++c.all;
    if (times[i] >= t_late) ++c.late, ++late;
  }
  // Written whole to a temporary file, then renamed: a partial profile never appears.
  const std::string tmp = std::string(out_path) + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "sample_prof: cannot write %s\n", tmp.c_str());
    return;
  }
  std::fprintf(f, "# samples %zu late %zu hz %d dropped %zu\n", n, late, hz, taken.load() - n);
  for (const auto& [pc, count] : counts) {
    // The object and the address within it, as bench/omp_trace.cpp names a caller (dladdr: what
    // addr2line and nm read for a position-independent object); none for generated code.
    Dl_info info{};
    const bool known = dladdr(reinterpret_cast<void*>(pc), &info) != 0 && info.dli_fname != nullptr;
    std::fprintf(f, "%" PRIu64 "\t%" PRIu64 "\t%s\t%" PRIx64 "\n", count.all, count.late,
                 known ? info.dli_fname : "[no object]",
                 pc - (known ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0));
  }
  std::fclose(f);
  std::rename(tmp.c_str(), out_path);
}

}  // namespace
