// Scratch memory that a thread keeps between kernel calls. Fresh pages cost a fault each (about
// 6 us per 4 KiB on the VM kind this project measures on), and glibc hands large freed blocks
// back to the system, so a buffer allocated per call is faulted in again on every call: at
// T = S = 4096, D = 128, B*H = 16 that was ~10% of the bf16 forward (its packed K and V, 33 MiB),
// and the fp32 backward's per-thread row packs and dQ shares are 1-3 MiB per thread per call.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace attn::cpu {

struct FreeDeleter {
  void operator()(void* x) const { std::free(x); }
};

// n elements, 64-byte aligned (at least 64 bytes).
template <typename T>
std::unique_ptr<T[], FreeDeleter> alloc_aligned(size_t n) {
  const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
  return std::unique_ptr<T[], FreeDeleter>(
      static_cast<T*>(std::aligned_alloc(64, bytes < 64 ? 64 : bytes)));
}

// One per use, so that buffers that are live at the same time never share.
enum class KeptSlot {
  kBf16Pack,
  kBf16Scratch,
  kFp32FwdScratch,
  kFp32BwdScratch,
  kFp32BwdPart,
  kFp32BwdParts
};

// n elements (64-byte aligned, contents unspecified: callers write before they read) of a buffer
// the calling thread keeps for `slot` between calls, up to 64 MiB; a larger request gets a buffer
// of its own in `own`, freed with it. Each OpenMP worker keeps its own.
template <KeptSlot slot, typename T>
T* kept_buffer(size_t n, std::unique_ptr<T[], FreeDeleter>& own) {
  constexpr size_t kKeepBytes = size_t{64} << 20;
  thread_local std::unique_ptr<T[], FreeDeleter> kept;
  thread_local size_t kept_n = 0;
  if (n * sizeof(T) > kKeepBytes) {
    own = alloc_aligned<T>(n);
    return own.get();
  }
  if (kept_n < n) {
    kept.reset();  // the old block first: the peak holds the new one only
    kept = alloc_aligned<T>(n);
    kept_n = n;
  }
  return kept.get();
}

}  // namespace attn::cpu
