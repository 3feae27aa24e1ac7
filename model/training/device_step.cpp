// make_cuda_train_step in builds without the CUDA backend (kernels/cuda/encoder_step.cpp defines
// it with one). CMakeLists.txt defines ATTN_WITH_CUDA for this file alone, as for core/device.cpp.
#include "model/training/device_step.hpp"

#include "attn/core/error.hpp"

namespace attn::model::detail {

#ifndef ATTN_WITH_CUDA
std::unique_ptr<DeviceTrainStep> make_cuda_train_step(SequenceModel&, nn::AdamW&,
                                                      const TrainOptions&) {
  throw Error("train",
              "--device cuda needs an attn built with -DATTN_WITH_CUDA=ON (see docs/gpu.md)");
}
#endif

}  // namespace attn::model::detail
