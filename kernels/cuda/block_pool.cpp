#include "kernels/cuda/block_pool.hpp"

namespace attn::cuda {

BlockPool::BlockPool(AllocateFn allocate, FreeFn free, SyncFn sync, size_t limit_bytes)
    : allocate_(std::move(allocate)), free_(std::move(free)), sync_(std::move(sync)) {
  stats_.limit_bytes = limit_bytes;
}

BlockPool::~BlockPool() {
  release_cached();
}

size_t BlockPool::round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20, kSmallLimit = size_t{1} << 20;
  if (bytes <= kSmallLimit) return (bytes + kSmall - 1) / kSmall * kSmall;
  return (bytes + kLarge - 1) / kLarge * kLarge;
}

void* BlockPool::acquire(size_t bytes, const void* stream) {
  if (bytes == 0) return nullptr;
  const size_t size = round_size(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(Key{stream, size});
    if (it != cache_.end()) {
      void* p = it->second;
      cache_.erase(it);
      stats_.cached_bytes -= size;
      stats_.cached_blocks -= 1;
      stats_.live_bytes += size;
      stats_.hits += 1;
      return p;
    }
    stats_.misses += 1;
  }
  void* p = allocate_(size);
  if (p == nullptr) {
    // Out of memory: queued kernels may still read cached blocks, so wait for them, then return
    // every cached block to the device and try once more.
    sync_();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.flushes += 1;
      trim_locked(0);
    }
    p = allocate_(size);
    if (p == nullptr) return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.live_bytes += size;
  return p;
}

void BlockPool::release(void* p, size_t bytes, const void* stream) {
  if (p == nullptr) return;
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.live_bytes -= size;
  if (stats_.cached_bytes + size > stats_.limit_bytes) {
    free_(p);
    return;
  }
  cache_.emplace(Key{stream, size}, p);
  stats_.cached_bytes += size;
  stats_.cached_blocks += 1;
}

void BlockPool::trim_locked(size_t target) {
  // From the end of the map: within a stream the largest classes go first.
  auto it = cache_.end();
  while (stats_.cached_bytes > target && it != cache_.begin()) {
    --it;
    free_(it->second);
    stats_.cached_bytes -= it->first.second;
    stats_.cached_blocks -= 1;
    it = cache_.erase(it);
  }
}

void BlockPool::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  trim_locked(0);
}

void BlockPool::set_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.limit_bytes = bytes;
  trim_locked(bytes);
}

PoolStats BlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace attn::cuda
