// Scratch memory of a kernel call, from attn's block cache (attn/core/memory.hpp).
//
// Fresh pages cost a fault each, and glibc hands large freed blocks back to the system, so
// scratch allocated per call with malloc is faulted in again on every call: a visible share of the
// bf16 forward at long sequences (its packed K and V are tens of MiB); the fp32 backward's
// per-thread row packs and dQ shares are megabytes per thread per call. Blocks of 128 KiB or more
// come back from the cache that attn::Tensor uses, already faulted in; they count against its limit
// (ATTN_MEMORY_CACHE_MIB), show in memory_cache_stats() and are freed by release_cached_memory().
//
// Per-thread scratch of a parallel region is one block with a part per thread, acquired before
// the region: an allocation failure is then an attn::Error on the calling thread, not an
// exception inside OpenMP (which would terminate).
#pragma once

#include "attn/core/error.hpp"
#include "attn/core/memory.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace attn::cpu {

template <typename T>
class Scratch {
  static_assert(64 % sizeof(T) == 0, "parts are aligned to whole elements");

 public:
  Scratch() = default;
  // n elements for each of `parts` users (threads), each part 64-byte aligned and a whole number
  // of 4 KiB pages from the previous one (no two threads write into one page, as with separate
  // allocations). Contents are unspecified (a cached block holds what its last user left) unless
  // `zero`.
  Scratch(const char* op, size_t n, size_t parts = 1, bool zero = false)
      : stride_((n * sizeof(T) + 4095) / 4096 * 4096 / sizeof(T)) {
    const size_t bytes = std::max<size_t>(stride_ * parts, 1) * sizeof(T);
    p_ = static_cast<T*>(detail::acquire_block(bytes, &size_));
    check(p_ != nullptr, op, "cannot allocate {} bytes of scratch memory", bytes);
    if (zero) std::memset(static_cast<void*>(p_), 0, bytes);
  }
  Scratch(Scratch&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), stride_(o.stride_), size_(o.size_) {}
  Scratch& operator=(Scratch&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(stride_, o.stride_);
    std::swap(size_, o.size_);
    return *this;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (p_ != nullptr) detail::release_block(p_, size_);
  }

  T* get(size_t part = 0) const { return p_ + part * stride_; }

 private:
  T* p_ = nullptr;
  size_t stride_ = 0, size_ = 0;
};

// Room for n elements in `buffer` (a thread_local vector of the caller's: kernels called many
// times a step keep their small buffers), grown to the largest n asked for, 64-byte aligned so
// that no vector load of a packed row splits a cache line. Contents are kept while it does not
// grow.
template <typename T>
T* grown_aligned(std::vector<T>& buffer, size_t n) {
  static_assert(64 % sizeof(T) == 0, "aligned to whole elements");
  constexpr size_t kSpare = 64 / sizeof(T);
  if (buffer.size() < n + kSpare) buffer.resize(n + kSpare);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - address % 64) % 64 / sizeof(T);
}

}  // namespace attn::cpu
