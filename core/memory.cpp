#include "attn/core/memory.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
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

// Small blocks (at most kMaxSmall bytes, rounded up to a power of two from kAlign) are kept per
// thread: a decode step or a small training step allocates and frees a few hundred tensors of a
// few KiB each, and glibc's memalign path (with the consolidation its fastbins trigger) cost a
// fifth of `attn translate`'s time. A thread keeps at most kSmallPerClass blocks of each size.
constexpr size_t kMaxSmall = size_t{64} << 10;
constexpr int kSmallClasses = 11;  // 64 B .. 64 KiB
constexpr uint32_t kSmallPerClass = 32;
static_assert(kAlign << (kSmallClasses - 1) == kMaxSmall);

int small_class(size_t bytes) {  // bytes <= kMaxSmall
  return std::bit_width((std::max(bytes, kAlign) - 1) / kAlign);
}

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

  // Whether caching is on (limit > 0), read without the lock by the small-block lists.
  bool enabled() {
    const int e = enabled_.load(std::memory_order_relaxed);
    if (e >= 0) return e == 1;
    std::lock_guard<std::mutex> lock(mu_);
    return limit() > 0;
  }

  void set_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = bytes;
    limit_set_ = true;
    enabled_.store(bytes > 0 ? 1 : 0, std::memory_order_relaxed);
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
      enabled_.store(limit_ > 0 ? 1 : 0, std::memory_order_relaxed);
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
  std::atomic<int> enabled_{-1};  // -1: the limit is not read yet
  uint64_t hits_ = 0, misses_ = 0;
};

// Never destroyed: tensors in static storage may be freed after any other static object.
BlockCache& cache() {
  static BlockCache* c = new BlockCache;
  return *c;
}

// The calling thread's small blocks: one singly linked list per size class, the link stored in
// the free block itself. Trivially destructible so that it can be used (and then bypassed) after
// the thread's destructors ran: a tensor in static storage may be freed after them.
struct SmallLists {
  void* head[kSmallClasses];
  uint32_t count[kSmallClasses];
  bool registered, dead;
};
thread_local SmallLists small_lists{};

void free_small(SmallLists& l) {
  for (int c = 0; c < kSmallClasses; ++c) {
    while (l.head[c] != nullptr) {
      void* p = l.head[c];
      l.head[c] = *static_cast<void**>(p);
      std::free(p);
    }
    l.count[c] = 0;
  }
}

// Frees the thread's small blocks when it ends.
struct SmallListsOwner {
  ~SmallListsOwner() {
    free_small(small_lists);
    small_lists.dead = true;
  }
};
thread_local SmallListsOwner small_lists_owner;

void* acquire_small(size_t bytes, size_t* size) {
  const int c = small_class(bytes);
  *size = kAlign << c;
  SmallLists& l = small_lists;
  if (void* p = l.head[c]) {
    l.head[c] = *static_cast<void**>(p);
    --l.count[c];
    return p;
  }
  return std::aligned_alloc(kAlign, *size);
}

void release_small(void* p, size_t size) {
  SmallLists& l = small_lists;
  const int c = small_class(size);
  if (l.dead || l.count[c] >= kSmallPerClass || !cache().enabled()) return std::free(p);
  if (!l.registered) {
    (void)&small_lists_owner;  // constructs it, so that its destructor runs at thread exit
    l.registered = true;
  }
  *static_cast<void**>(p) = l.head[c];
  l.head[c] = p;
  ++l.count[c];
}

// Sizes of cacheable blocks are rounded to whole pages, so that tensors of nearly equal sizes
// share blocks; smaller ones to the alignment (the small lists round further, to powers of two).
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
  free_small(small_lists);
}

void set_memory_cache_limit(size_t bytes) {
  cache().set_limit(bytes);
  if (bytes == 0) free_small(small_lists);
}

namespace detail {

void* acquire_block(size_t bytes, size_t* size) {
  const size_t b = block_bytes(bytes);
  if (b <= kMaxSmall) return acquire_small(b, size);
  return cache().acquire(b, size);
}

void release_block(void* p, size_t size) {
  if (size <= kMaxSmall) return release_small(p, size);
  cache().release(p, size);
}

}  // namespace detail
}  // namespace attn
