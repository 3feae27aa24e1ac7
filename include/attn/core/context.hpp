// Context: the execution state passed explicitly down every call (no hidden globals).
//
// It carries the thread count, the seed of the dropout stream and the per-call stream offset,
// and which backend runs the ops. Parallel work is partitioned statically from the problem shape
// (never from the thread count), so results are bitwise identical for any `threads`.
#pragma once

#include "attn/core/device.hpp"

#include <cstdint>
#include <string>

namespace attn {

enum class Backend : uint8_t {
  kAuto,       // the fastest available path for the inputs (falls back to reference)
  kReference,  // kernels/ref: plain loops, double accumulation; the oracle
  kCpu,        // kernels/cpu: SIMD + threads
};

const char* backend_name(Backend b);

// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16: oneDNN's bf16 matmul and the
// fused attention's bf16 kernels). Without it mixed precision keeps its contract (bf16 inputs,
// float32 sums, one rounding) by widening to float32: the same results' precision, no faster
// than float32, so `attn train --precision bf16` says so.
bool cpu_bf16_native();
// Parses "auto", "reference"/"ref", "cpu"; throws Error otherwise.
Backend parse_backend(const std::string& name);

struct Context {
  int threads = 0;    // 0: all hardware threads (OpenMP's default)
  uint64_t seed = 0;  // seeds the dropout stream and parameter initialisation
  Backend backend = Backend::kAuto;
  // Mixed precision (PyTorch's torch.autocast(dtype=torch.bfloat16) on CPU): float32 modules run
  // their linear layers and their attention core in bfloat16 (inputs and weights rounded to bf16,
  // products accumulated in f32, results rounded once), while parameters, their gradients, the
  // optimiser, LayerNorm, softmax statistics and the loss stay float32. A weight's gradient is
  // the bf16 product widened to float32, as autocast's is. Modules of other dtypes ignore it.
  bool autocast_bf16 = false;

  // Where ops run (builds with ATTN_WITH_CUDA only; see docs/gpu.md). `cuda_stream` is this
  // context's cudaStream_t, opaque here so that CPU builds see no CUDA header; null means the
  // CUDA backend's default stream (attn::cuda::Stream makes and owns one per context).
  Device device = Device::kCpu;
  void* cuda_stream = nullptr;

  // Test and benchmark switches of the fused CPU attention kernels, so that one machine tests
  // every path: restrict their SIMD dispatch to these Highway target bits (0: the best this CPU
  // supports; the list comes from cpu::flash_attention_targets()), and run the bfloat16 kernels
  // through their float32 conversion path even on a CPU with AVX512-BF16.
  int64_t kernel_targets = 0;
  bool force_bf16_fallback = false;

  // Each dropout site takes a fresh stream offset per call, so two calls never reuse a mask while
  // a run stays reproducible from `seed` alone. See attn/core/rng.hpp for the stream.
  uint64_t next_dropout_offset() { return dropout_offset_++; }
  uint64_t dropout_offset() const { return dropout_offset_; }
  void set_dropout_offset(uint64_t offset) { dropout_offset_ = offset; }

  // Data parallelism: the global index of the first sample (the outermost axis of every dropped
  // tensor; for attention weights (batch * heads, T, S) the batch) that this process holds; rank
  // r of a run that splits a global batch by samples holds [dropout_first_sample,
  // dropout_first_sample + B_local). Every dropout site draws element i of its tensor at stream
  // index dropout_index_base(elements per sample) + i (attn/core/rng.hpp), so a shard draws
  // exactly the masks the whole batch draws for its samples. 0 (the default) is the stream of a
  // single process. model::Trainer sets it per step; a forward and its backward must see the same.
  uint64_t dropout_first_sample = 0;
  uint64_t dropout_index_base(uint64_t elements_per_sample) const {
    return dropout_first_sample * elements_per_sample;
  }

  // Threads to use for a parallel region (resolves 0 to the hardware count).
  int resolved_threads() const;

 private:
  uint64_t dropout_offset_ = 0;
};

}  // namespace attn
