// parallel_for: a loop over tasks on OpenMP threads that does not enter the runtime for one.
// Include only from files compiled with OpenMP (the library's); kernels/cpu/parallel.hpp has the
// thread-count rule, which tests include too.
#pragma once

#include "kernels/cpu/parallel.hpp"

#include <cstdint>

namespace attn::cpu {

// f(i) for i in [0, n) on up to `threads` OpenMP threads, a static schedule (so a thread's share
// is fixed by n and the thread count). With one thread or one task it runs in the caller without
// entering the OpenMP runtime: a parallel region whose if() clause is false still builds a team
// of one in libgomp (an allocation and a free per call, a few percent of a small decode step).
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
