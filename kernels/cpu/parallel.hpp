// How many threads a piece of work is worth.
//
// Starting a parallel region and meeting at its barrier costs a few microseconds per region when
// the waiting threads spin, and tens when they sleep (OMP_WAIT_POLICY=passive, or a machine whose
// cores are busy with other work). A decoder step of a small translation model is a few hundred
// thousand flops per op: split over two threads, `attn translate` spent more than half its time at
// barriers and ran slower than on one thread. So every kernel that forks asks for at most one
// thread per kMinFlopsPerThread of its arithmetic (about 40-80 us of one core's work), and never
// more than the caller allows. The answer depends on the shape only, so a result that does not
// depend on the thread count keeps not depending on it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::cpu {

inline constexpr double kMinFlopsPerThread = double(int64_t{1} << 22);

// threads >= 1 (Context::threads resolved); flops: the op's multiply-adds times 2.
inline int threads_for(double flops, int threads) {
  const double worth = flops / kMinFlopsPerThread;
  if (worth >= threads) return std::max(1, threads);
  return std::max(1, static_cast<int>(worth));
}

}  // namespace attn::cpu

namespace attn::cpu {

// f(i) for i in [0, n) on up to `threads` OpenMP threads, a static schedule (so a thread's share
// is fixed by n and the thread count). With one thread or one task it runs in the caller without
// entering the OpenMP runtime: a parallel region whose if() clause is false still builds a team
// of one in libgomp (an allocation and a free per call, a few percent of a small decode step).
// Include only from files compiled with OpenMP.
template <class F>
void parallel_for(int64_t n, int threads, F&& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i)
      f(i);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i)
    f(i);
}

}  // namespace attn::cpu
