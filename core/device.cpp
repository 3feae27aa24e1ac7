#include "attn/core/device.hpp"

#include "attn/core/error.hpp"

namespace attn {

const char* device_name(Device d) {
  switch (d) {
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
  }
  return "?";
}

bool cuda_built() {
#ifdef ATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") {
    if (!cuda_built())
      throw Error("parse_device",
                  "device 'cuda' requested, but this attn was built without CUDA "
                  "(configure with -DATTN_WITH_CUDA=ON; see docs/gpu.md)");
    return Device::kCuda;
  }
  throw Error("parse_device", "unknown device '" + name + "', expected cpu or cuda");
}

}  // namespace attn
