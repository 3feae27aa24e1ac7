#include "attn/core/memory.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ATTN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTN_ASAN 1
#endif
#endif

namespace attn {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kMinCached = size_t{128} << 10;  // below this glibc reuses its own heap
constexpr size_t kPage = 4096;

size_t default_limit() {
#if defined(ATTN_ASAN)
  return 0;
#else
  constexpr size_t kDefaultMiB = 1024;
  if (const char* env = std::getenv("ATTN_MEMORY_CACHE_MIB")) {
    char* end = nullptr;
    const unsigned long long mib = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0' && env[0] != '-' && mib <= (size_t{1} << 40))
      return static_cast<size_t>(mib) << 20;
    // Not an error: an allocation is no place to fail on a tuning knob. Said once, on stderr.
    std::fprintf(stderr,
                 "attn: ATTN_MEMORY_CACHE_MIB='%s' is not a whole number of MiB (0 turns the "
                 "cache off); using %zu\n",
                 env, kDefaultMiB);
  }
  return kDefaultMiB << 20;
#endif
}

// Blocks are kept in the order they were freed; a request takes the smallest block that fits
// within 1/8, and when the limit is reached the oldest blocks are freed first. A few dozen
// blocks at most in practice, so a vector and linear scans.
class BlockCache {
 public:
  void* acquire(size_t bytes, size_t* size) {
    *size = bytes;
    if (bytes >= kMinCached) {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {
        const size_t have = blocks_[i].bytes;
        if (have >= bytes && have - bytes <= bytes / 8 &&
            (best == blocks_.size() || have < blocks_[best].bytes))
          best = i;
      }
      if (best < blocks_.size()) {
        void* p = blocks_[best].p;
        *size = blocks_[best].bytes;
        cached_ -= blocks_[best].bytes;
        blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(best));
        ++hits_;
        return p;
      }
      ++misses_;
    }
    return std::aligned_alloc(kAlign, bytes);
  }

  void release(void* p, size_t bytes) {
    if (bytes >= kMinCached) {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes <= limit()) {
        while (cached_ + bytes > limit_)
          free_oldest();
        blocks_.push_back({p, bytes});
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  MemoryCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {limit(), cached_, blocks_.size(), hits_, misses_};
  }

  void set_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = bytes;
    limit_set_ = true;
    while (cached_ > limit_)
      free_oldest();
  }

  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!blocks_.empty())
      free_oldest();
  }

 private:
  struct Block {
    void* p;
    size_t bytes;
  };
  size_t limit() {  // under mu_
    if (!limit_set_) {
      limit_ = default_limit();
      limit_set_ = true;
    }
    return limit_;
  }
  void free_oldest() {  // under mu_
    std::free(blocks_.front().p);
    cached_ -= blocks_.front().bytes;
    blocks_.erase(blocks_.begin());
  }

  std::mutex mu_;
  std::vector<Block> blocks_;
  size_t cached_ = 0, limit_ = 0;
  bool limit_set_ = false;
  uint64_t hits_ = 0, misses_ = 0;
};

// Never destroyed: tensors in static storage may be freed after any other static object.
BlockCache& cache() {
  static BlockCache* c = new BlockCache;
  return *c;
}

// Sizes of cacheable blocks are rounded to whole pages, so that tensors of nearly equal sizes
// share blocks; smaller ones to the alignment.
size_t block_bytes(size_t bytes) {
  const size_t unit = bytes >= kMinCached ? kPage : kAlign;
  return (std::max<size_t>(bytes, 1) + unit - 1) / unit * unit;
}

}  // namespace

MemoryCacheStats memory_cache_stats() {
  return cache().stats();
}

void release_cached_memory() {
  cache().release_all();
}

void set_memory_cache_limit(size_t bytes) {
  cache().set_limit(bytes);
}

namespace detail {

void* acquire_block(size_t bytes, size_t* size) {
  return cache().acquire(block_bytes(bytes), size);
}

void release_block(void* p, size_t size) {
  cache().release(p, size);
}

}  // namespace detail
}  // namespace attn
