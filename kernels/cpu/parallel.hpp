// How many threads a piece of work is worth.
//
// Starting a parallel region and meeting at its barrier costs a few microseconds per region when
// the waiting threads spin, and tens when they sleep (OMP_WAIT_POLICY=passive, or a machine whose
// cores are busy with other work). A decoder step of a small translation model is a few hundred
// thousand flops per op: split over two threads, `attn translate` spent more than half its time at
// barriers and ran slower than on one thread. So every kernel that forks asks for one thread per
// kMinFlopsPerThread of its arithmetic (about 40-80 us of one core's work), rounded to nearest,
// and never more than the caller allows. (Rounded down, a training step's 7-MFLOP products ran on
// one thread while the other waited: +1.2% tokens/s on a padded `attn train` at 2 threads with
// nearest, in three alternating rounds.) The answer depends on the shape only, so a result that
// does not depend on the thread count keeps not depending on it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::cpu {

inline constexpr double kMinFlopsPerThread = double(int64_t{1} << 22);

// The work per thread threads_for asks for: kMinFlopsPerThread unless changed. Tests of thread
// count independence set 0, so that every kernel forks as far as the caller allows and their
// parallel paths run at any size; a relaxed atomic, read once per call.
double min_flops_per_thread();
void set_min_flops_per_thread(double flops);

// threads >= 1 (Context::threads resolved); flops: the op's multiply-adds times 2.
inline int threads_for(double flops, int threads) {
  const double per_thread = min_flops_per_thread();
  if (per_thread <= 0 || flops / per_thread >= threads) return std::max(1, threads);
  return std::max(1, static_cast<int>(flops / per_thread + 0.5));
}

}  // namespace attn::cpu
