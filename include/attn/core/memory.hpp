// Memory behind attn::Tensor: large blocks are kept for reuse after their tensors are freed.
//
// A block that glibc hands back to the system comes back as fresh pages, and every fresh page
// costs a fault on first touch: without reuse, MultiHeadAttention at long sequences spends much
// of its time faulting each step's temporaries (tens of MiB) in again. PyTorch users set
// GLIBC_TUNABLES for the same reason; attn keeps freed blocks of at least 128 KiB itself, up to a
// limit, and hands them to later tensors of about the same size (at most 1/8 larger). Blocks of at
// most 64 KiB are rounded up to a power of two and kept per thread (at most 32 of each size, in
// the thread that freed them): a decode step allocates a few hundred of them, and glibc's aligned
// allocation cost a fifth of its time. The CPU attention kernels take their scratch (per-thread
// tiles, packed K and V, dQ shares) from the same cache, so the limit, the statistics and
// release_cached_memory() cover all of attn's large temporary memory.
//
// The limit is the memory the cache may hold beyond live tensors: ATTN_MEMORY_CACHE_MIB at the
// first allocation (default 1024; 0 turns the cache off), or set_memory_cache_limit. Builds with
// AddressSanitizer start with the cache off, so that a use after free of a tensor's memory is
// still reported.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn {

struct MemoryCacheStats {
  size_t limit_bytes = 0;   // the most the cache holds
  size_t cached_bytes = 0;  // held now, not used by any tensor
  size_t cached_blocks = 0;
  uint64_t hits = 0;    // allocations served from the cache
  uint64_t misses = 0;  // allocations of cacheable size that went to the system
};

MemoryCacheStats memory_cache_stats();

// Frees every cached large block and the calling thread's small ones (tensors alive are not
// affected; other threads free their small blocks when they end).
void release_cached_memory();

// New limit in bytes on the large blocks; blocks beyond it are freed now. 0 turns caching off,
// of small blocks too.
void set_memory_cache_limit(size_t bytes);

namespace detail {
// 64-byte aligned block of at least `bytes` bytes (cached or fresh); nullptr when the system has
// no memory. *size receives the block's own size (a cached block may be up to 1/8 larger), which
// release_block takes back (for blocks of at most 64 KiB the size asked for does as well).
void* acquire_block(size_t bytes, size_t* size);
void release_block(void* p, size_t size);
}  // namespace detail

}  // namespace attn
