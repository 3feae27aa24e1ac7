// The caching pool behind CUDA tensors: cudaMalloc and cudaFree synchronise the device and cost
// tens of microseconds, and a training step allocates hundreds of temporaries; so freed blocks are
// kept, by size class and stream, and handed to later requests of the same class on the same
// stream (stream order makes that safe without events: work queued on that stream after the free
// runs after the work that used the block). Another stream never gets a cached block; when the
// device is out of memory the pool synchronises, returns every cached block and retries once.
//
// Plain C++ over an allocate/free pair, so the bookkeeping is tested on the CPU with malloc
// (tests/cuda/test_cuda_host.cpp); kernels/cuda/runtime.cpp instantiates it over cudaMalloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

namespace attn::cuda {

struct PoolStats {
  size_t limit_bytes = 0;   // the most the cache holds beyond live blocks
  size_t cached_bytes = 0;  // held, unused
  size_t live_bytes = 0;    // handed out, not yet released
  size_t cached_blocks = 0;
  uint64_t hits = 0, misses = 0;
  uint64_t flushes = 0;  // out-of-memory retries that emptied the cache
};

class BlockPool {
 public:
  using AllocateFn = std::function<void*(size_t)>;  // nullptr when out of memory
  using FreeFn = std::function<void(void*)>;
  using SyncFn = std::function<void()>;  // waits for all queued work (before freeing on OOM)

  BlockPool(AllocateFn allocate, FreeFn free, SyncFn sync, size_t limit_bytes);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // The size class of a request: 512-byte granules up to 1 MiB, then 2 MiB granules (large
  // blocks of nearly the same size share one class, as in PyTorch's allocator).
  static size_t round_size(size_t bytes);

  // A block of round_size(bytes) bytes for `stream`; nullptr when the device has no memory even
  // after the cache was emptied. `bytes` 0 gives nullptr without allocating.
  void* acquire(size_t bytes, const void* stream);
  // Returns a block from acquire (same bytes and stream) to the cache, or frees it past the limit.
  void release(void* p, size_t bytes, const void* stream);
  // Frees every cached block.
  void release_cached();
  void set_limit(size_t bytes);
  PoolStats stats() const;

 private:
  using Key = std::pair<const void*, size_t>;  // (stream, size class)
  AllocateFn allocate_;
  FreeFn free_;
  SyncFn sync_;
  mutable std::mutex mu_;
  std::multimap<Key, void*> cache_;
  PoolStats stats_;

  void trim_locked(size_t target);
};

}  // namespace attn::cuda
