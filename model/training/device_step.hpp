// The training step on a device other than the CPU (`attn train --device cuda`): the Trainer keeps
// its model, optimiser, data order and dropout stream on the host and hands each step to a
// DeviceTrainStep, which holds the parameters, gradients and AdamW state on the device and copies
// them back when the host needs them (evaluation, checkpoints). Internal to the library.
#pragma once

#include "attn/model/trainer.hpp"

#include <cstdint>
#include <memory>
#include <string>

namespace attn::model::detail {

struct DeviceStepResult {
  double loss = 0.0;       // mean cross-entropy of the batch's kept positions
  double grad_norm = 0.0;  // the global gradient norm before clipping
};

class DeviceTrainStep {
 public:
  virtual ~DeviceTrainStep() = default;
  // One step on the device: forward, loss, backward, clipping, AdamW. Dropout draws the stream at
  // offsets dropout_offset, dropout_offset + 1, ... in the CPU's order; returns the loss and the
  // norm. Throws Error("train") when the loss is not finite; the parameters are then unchanged.
  virtual DeviceStepResult step(const Batch& batch, uint64_t dropout_offset) = 0;
  // Stream offsets one step draws (the CPU model's count for the same options).
  virtual uint64_t offsets_per_step() const = 0;
  // The device's parameters and AdamW state into the host model and optimiser.
  virtual void download() = 0;
  // The host model's parameters and optimiser state onto the device (after a checkpoint load).
  virtual void upload() = 0;
  // "NVIDIA H200, sm_90, ..." for the run's header.
  virtual std::string description() const = 0;
};

// The CUDA step of the encoder tasks (float32). Error("train") in a build without CUDA, without a
// device, or for options the GPU path does not cover (it names them).
std::unique_ptr<DeviceTrainStep> make_cuda_train_step(SequenceModel& model, nn::AdamW& optimizer,
                                                      const TrainOptions& options);

}  // namespace attn::model::detail
