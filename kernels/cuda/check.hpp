// Error checks of CUDA calls, usable from .cu files: the message is built in check.cpp (plain
// C++, attn::Error), so nvcc never compiles fmt. A failed call throws attn::Error naming the op,
// the call and the CUDA error; a launch is checked with cudaGetLastError right after it.
#pragma once

namespace attn::cuda {

[[noreturn]] void throw_cuda_error(const char* op, const char* call, int code, const char* what);
// Throws attn::Error(op, message) unless `ok` (for shape checks inside .cu host wrappers).
void require(bool ok, const char* op, const char* message);

}  // namespace attn::cuda

// `call` is a cudaError_t expression.
#define ATTN_CUDA_CHECK(op, call)                                                 \
  do {                                                                            \
    const cudaError_t attn_cuda_err_ = (call);                                    \
    if (attn_cuda_err_ != cudaSuccess)                                            \
      ::attn::cuda::throw_cuda_error(op, #call, static_cast<int>(attn_cuda_err_), \
                                     cudaGetErrorString(attn_cuda_err_));         \
  } while (0)

// After a kernel launch: configuration errors show up here, not at the launch.
#define ATTN_CUDA_CHECK_LAUNCH(op) ATTN_CUDA_CHECK(op, cudaGetLastError())
