// The CUDA runtime of attn (attn/cuda/runtime.hpp): devices, streams, the caching pool behind
// device tensors, copies. Host code compiled by the C++ compiler against cuda_runtime.h.
#include "attn/cuda/runtime.hpp"

#include "kernels/cuda/block_pool.hpp"
#include "kernels/cuda/check.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace attn::cuda {

[[noreturn]] void throw_cuda_error(const char* op, const char* call, int code, const char* what) {
  throw Error(op, fmt::format("CUDA call {} failed: error {} ({})", call, code, what));
}

void require(bool ok, const char* op, const char* message) {
  if (!ok) throw Error(op, message);
}

namespace {

size_t initial_cache_limit() {
  const char* env = std::getenv("ATTN_CUDA_CACHE_MIB");
  const long long mib = env ? std::atoll(env) : 4096;
  return static_cast<size_t>(mib < 0 ? 0 : mib) << 20;
}

BlockPool& pool() {
  // Leaked on purpose: tensors freed during static destruction must still find the pool, and the
  // driver may already be shutting down then, so its blocks are left to process exit.
  static BlockPool* p = new BlockPool(
      [](size_t bytes) -> void* {
        void* q = nullptr;
        if (cudaMalloc(&q, bytes) != cudaSuccess) {
          (void)cudaGetLastError();  // clear the sticky-free out-of-memory error
          return nullptr;
        }
        return q;
      },
      [](void* q) { (void)cudaFree(q); }, [] { (void)cudaDeviceSynchronize(); },
      initial_cache_limit());
  return *p;
}

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int compute_capability() {
  int dev = 0;
  ATTN_CUDA_CHECK("cuda::compute_capability", cudaGetDevice(&dev));
  cudaDeviceProp p{};
  ATTN_CUDA_CHECK("cuda::compute_capability", cudaGetDeviceProperties(&p, dev));
  return p.major * 10 + p.minor;
}

std::string device_description() {
  int dev = 0;
  ATTN_CUDA_CHECK("cuda::device_description", cudaGetDevice(&dev));
  cudaDeviceProp p{};
  ATTN_CUDA_CHECK("cuda::device_description", cudaGetDeviceProperties(&p, dev));
  return fmt::format("{}, sm_{}{}, {} SMs, {:.1f} GiB", p.name, p.major, p.minor,
                     p.multiProcessorCount, static_cast<double>(p.totalGlobalMem) / (1 << 30));
}

Stream::Stream() {
  cudaStream_t s = nullptr;
  ATTN_CUDA_CHECK("cuda::Stream", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

Stream::~Stream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(as_stream(stream_));
}

void Stream::synchronize() const {
  cuda::synchronize(stream_);
}

void Stream::attach(Context& ctx) const {
  ctx.device = Device::kCuda;
  ctx.cuda_stream = stream_;
}

void synchronize(void* stream) {
  ATTN_CUDA_CHECK("cuda::synchronize", cudaStreamSynchronize(as_stream(stream)));
}

Tensor empty(const Shape& shape, DType dtype, void* stream) {
  const int64_t n = shape_numel(shape, "cuda::empty");
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  void* p = pool().acquire(bytes, stream);
  check(p != nullptr || bytes == 0, "cuda::empty", "cannot allocate {} bytes on the device for {}",
        bytes, shape_str(shape));
  std::shared_ptr<std::byte> storage(static_cast<std::byte*>(p), [bytes, stream](std::byte* q) {
    pool().release(q, bytes, stream);
  });
  return Tensor::adopt(std::move(storage), shape, dtype, Device::kCuda);
}

Tensor zeros(const Shape& shape, DType dtype, void* stream) {
  Tensor t = empty(shape, dtype, stream);
  if (t.nbytes() > 0)
    ATTN_CUDA_CHECK("cuda::zeros", cudaMemsetAsync(t.raw_data(), 0, t.nbytes(), as_stream(stream)));
  return t;
}

Tensor to_device(const Tensor& host, void* stream) {
  check(host.defined() && host.device() == Device::kCpu, "cuda::to_device",
        "expected a defined host tensor");
  Tensor src = host.contiguous();
  Tensor dst = empty(src.shape(), src.dtype(), stream);
  if (src.nbytes() == 0) return dst;
  // Pinned staging: the copy is asynchronous, and the caller may free or change `host` at once.
  void* staging = nullptr;
  ATTN_CUDA_CHECK("cuda::to_device", cudaMallocHost(&staging, src.nbytes()));
  std::memcpy(staging, src.raw_data(), src.nbytes());
  ATTN_CUDA_CHECK("cuda::to_device", cudaMemcpyAsync(dst.raw_data(), staging, src.nbytes(),
                                                     cudaMemcpyHostToDevice, as_stream(stream)));
  ATTN_CUDA_CHECK("cuda::to_device", cudaStreamSynchronize(as_stream(stream)));
  ATTN_CUDA_CHECK("cuda::to_device", cudaFreeHost(staging));
  return dst;
}

Tensor to_host(const Tensor& device, void* stream) {
  check(device.defined() && device.device() == Device::kCuda && device.is_contiguous(),
        "cuda::to_host", "expected a contiguous device tensor, got shape {} on {}",
        shape_str(device.shape()), device_name(device.device()));
  Tensor dst = Tensor::empty(device.shape(), device.dtype());
  if (dst.nbytes() == 0) return dst;
  ATTN_CUDA_CHECK("cuda::to_host", cudaMemcpyAsync(dst.raw_data(), device.raw_data(), dst.nbytes(),
                                                   cudaMemcpyDeviceToHost, as_stream(stream)));
  ATTN_CUDA_CHECK("cuda::to_host", cudaStreamSynchronize(as_stream(stream)));
  return dst;
}

void copy(const Tensor& dst, const Tensor& src, void* stream) {
  check(dst.shape() == src.shape() && dst.dtype() == src.dtype() && dst.is_contiguous() &&
            src.is_contiguous(),
        "cuda::copy", "expected contiguous tensors of one shape and dtype, got {} {} and {} {}",
        shape_str(dst.shape()), dtype_name(dst.dtype()), shape_str(src.shape()),
        dtype_name(src.dtype()));
  if (src.nbytes() == 0) return;
  ATTN_CUDA_CHECK("cuda::copy", cudaMemcpyAsync(dst.raw_data(), src.raw_data(), src.nbytes(),
                                                cudaMemcpyDefault, as_stream(stream)));
  if (dst.device() == Device::kCpu || src.device() == Device::kCpu)
    ATTN_CUDA_CHECK("cuda::copy", cudaStreamSynchronize(as_stream(stream)));
}

DeviceMemoryStats memory_stats() {
  const PoolStats s = pool().stats();
  DeviceMemoryStats r;
  r.limit_bytes = s.limit_bytes;
  r.cached_bytes = s.cached_bytes;
  r.live_bytes = s.live_bytes;
  r.cached_blocks = s.cached_blocks;
  r.hits = s.hits;
  r.misses = s.misses;
  r.flushes = s.flushes;
  return r;
}

void release_cached_memory() {
  pool().release_cached();
}
void set_memory_cache_limit(size_t bytes) {
  pool().set_limit(bytes);
}

}  // namespace attn::cuda
