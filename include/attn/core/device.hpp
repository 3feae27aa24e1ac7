// Device: where a tensor's memory lives and where an op runs.
//
// The CPU is the default everywhere; CUDA exists only in builds configured with
// -DATTN_WITH_CUDA=ON (docs/gpu.md). This header carries no CUDA include, so a CPU build and its
// users never see the toolkit: CUDA streams travel as opaque pointers (Context::cuda_stream).
#pragma once

#include <cstdint>
#include <string>

namespace attn {

enum class Device : uint8_t {
  kCpu,
  kCuda,  // the current CUDA device of the calling thread
};

const char* device_name(Device d);
// Parses "cpu" or "cuda"; throws Error for other names, and for "cuda" in a build without CUDA
// (naming the build option), so that a CLI flag fails with one clear line.
Device parse_device(const std::string& name);
// True when this library was built with the CUDA backend (ATTN_WITH_CUDA).
bool cuda_built();

}  // namespace attn
