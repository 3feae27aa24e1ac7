// The threshold behind threads_for (see parallel.hpp).
#include "kernels/cpu/parallel.hpp"

#include <atomic>

namespace attn::cpu {
namespace {
std::atomic<double> min_flops{kMinFlopsPerThread};
}  // namespace

double min_flops_per_thread() {
  return min_flops.load(std::memory_order_relaxed);
}

void set_min_flops_per_thread(double flops) {
  min_flops.store(flops, std::memory_order_relaxed);
}

}  // namespace attn::cpu
