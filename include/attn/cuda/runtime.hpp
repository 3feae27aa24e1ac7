// The CUDA runtime of attn: devices, streams, device tensors and copies. Available in builds
// configured with -DATTN_WITH_CUDA=ON (attn::cuda_built() says so at run time); docs/gpu.md.
// No CUDA header here: streams are opaque `void*` (a cudaStream_t), so this header compiles
// without the toolkit.
//
// Device tensors come from a caching pool (kernels/cuda/block_pool.hpp): freed blocks are reused
// by later tensors of the same size class on the same stream. A tensor made for one stream must
// only be used on that stream (or after synchronising it).
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::cuda {

// Number of CUDA devices; 0 without a driver or a GPU (never throws).
int device_count();
// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB" of the current device; throws without one.
std::string device_description();
// Compute capability of the current device as major * 10 + minor (90 for an H100).
int compute_capability();

// An owned CUDA stream (non-blocking). attach() points a Context at it: ctx.device = kCuda and
// ctx.cuda_stream = handle(); every CUDA op given that Context queues work on this stream.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return stream_; }
  void synchronize() const;
  void attach(Context& ctx) const;

 private:
  void* stream_ = nullptr;
};

// Waits for all work queued on `stream` (null: the default stream).
void synchronize(void* stream);

// Uninitialised contiguous device tensor from the pool, for use on `stream`.
Tensor empty(const Shape& shape, DType dtype, void* stream = nullptr);
Tensor zeros(const Shape& shape, DType dtype, void* stream = nullptr);
// A contiguous device copy of a host tensor (any strides); the copy is queued on `stream`, and
// the host tensor may be changed once it returns (the copy goes through a staging buffer).
Tensor to_device(const Tensor& host, void* stream = nullptr);
// A host copy of a contiguous device tensor; waits for `stream` first.
Tensor to_host(const Tensor& device, void* stream = nullptr);
// Copies between two contiguous tensors of the same shape and dtype on any devices.
void copy(const Tensor& dst, const Tensor& src, void* stream = nullptr);

struct DeviceMemoryStats {
  size_t limit_bytes = 0, cached_bytes = 0, live_bytes = 0, cached_blocks = 0;
  uint64_t hits = 0, misses = 0, flushes = 0;
};
DeviceMemoryStats memory_stats();
void release_cached_memory();
// The most device memory the pool keeps cached beyond live tensors (ATTN_CUDA_CACHE_MIB at first
// use, default 4096).
void set_memory_cache_limit(size_t bytes);

}  // namespace attn::cuda
