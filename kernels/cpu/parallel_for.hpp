// parallel_for: a loop over tasks on OpenMP threads that does not enter the runtime for one.
// Include only from files compiled with OpenMP (the library's); kernels/cpu/parallel.hpp has the
// thread-count rule, which tests include too.
#pragma once

#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu/task_shares.hpp"

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace attn::cpu {

// f(i) for i in [0, n) on up to `threads` OpenMP threads, a static schedule with stealing
// (TaskShares). With one thread or one task it runs in the caller without entering the OpenMP
// runtime: a parallel region whose if() clause is false still builds a team of one in libgomp (an
// allocation and a free per call, a few percent of a small decode step).
template <class F>
void parallel_for(int64_t n, int threads, F&& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i)
      f(i);
    return;
  }
  threads = static_cast<int>(std::min<int64_t>(threads, n));
  // About 16 claims per share: many tiny tasks are claimed in runs, not one atomic each.
  TaskShares shares(n, threads, n / (int64_t{16} * threads));
#pragma omp parallel num_threads(threads)
  shares.run(omp_get_thread_num(), f);
}

}  // namespace attn::cpu
