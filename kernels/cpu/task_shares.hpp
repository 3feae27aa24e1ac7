// TaskShares: the tasks of one parallel region, a static schedule with stealing. No OpenMP here
// (tests include it); kernels/cpu/parallel_for.hpp runs it on OpenMP threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace attn::cpu {

// Tasks [0, n) shared out among the `parts` threads of a parallel region as a static schedule
// would (part p owns [n p / parts, n (p + 1) / parts)), with stealing: a thread runs its own
// share's tasks in order, then takes the next unclaimed tasks of the other shares. Each task runs
// exactly once, on whichever thread claims it, so the tasks must not depend on which thread runs
// them (an elementwise task or one with its own output rows: the bits do not change).
//
// Why: the threads of a region finish their equal shares tens of microseconds apart, and a thread
// sometimes runs 15-25% slower than the other for a whole stretch of a training step (the VM's
// other vCPU busy with something else, a cache warm on one core only). With a static schedule the
// other threads wait that long at the region's end barrier (bench/omp_trace.py: 2% of a padded
// `attn train` run's wall time idle at the end barriers at 2 threads); here they take the slow
// thread's last tasks. A thread's own share comes first, so its rows stay the ones it wrote in the
// previous region, as under the static schedule.
//
// A claim takes `grain` consecutive tasks (one atomic operation each), so that many tiny tasks
// (an embedding row each) do not pay an atomic apiece.
class TaskShares {
 public:
  TaskShares(int64_t n, int parts, int64_t grain = 1)
      : n_(n), grain_(std::max<int64_t>(1, grain)), parts_(std::max(1, parts)) {
    if (parts_ > kInline) {
      heap_.reset(new Next[parts_]);
      next_ = heap_.get();
    }
    for (int p = 0; p < parts_; ++p)
      next_[p].task.store(begin(p), std::memory_order_relaxed);
  }
  TaskShares(const TaskShares&) = delete;  // next_ may point into the object itself
  TaskShares& operator=(const TaskShares&) = delete;

  // Called by every thread of the region, with its thread number; returns when no task is left
  // unclaimed. A team smaller than `parts` is fine: the shares of absent threads are stolen.
  template <class F>
  void run(int thread, F&& f) {
    const int own = thread % parts_;
    for (int k = 0; k < parts_; ++k) {
      const int p = (own + k) % parts_;
      const int64_t end = begin(p + 1);
      for (int64_t i; (i = next_[p].task.fetch_add(grain_, std::memory_order_relaxed)) < end;)
        for (const int64_t stop = std::min(end, i + grain_); i < stop; ++i)
          f(i);
    }
  }

 private:
  struct alignas(64) Next {  // one cache line each: the owner's claims do not slow the others'
    std::atomic<int64_t> task{0};
  };
  int64_t begin(int p) const { return n_ * p / parts_; }

  // Up to kInline shares live in the object (a region per parallel_for call: no allocation on
  // the hot path); more on the heap.
  static constexpr int kInline = 8;
  int64_t n_, grain_;
  int parts_;
  Next inline_[kInline];
  std::unique_ptr<Next[]> heap_;
  Next* next_ = inline_;
};

}  // namespace attn::cpu
