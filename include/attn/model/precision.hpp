// The precision a trainer computes in (model::Trainer, model::Seq2SeqTrainer).
#pragma once

#include <cstdint>
#include <string>

namespace attn::model {

// kBFloat16 is mixed precision (PyTorch's CPU autocast): linear layers and the attention core in
// bfloat16 (Context::autocast_bf16), while parameters (the float32 master weights), gradients,
// AdamW state, LayerNorm, softmax statistics and the loss stay float32. Checkpoints hold the
// float32 parameters either way, so a checkpoint of one precision loads into a trainer of the
// other; the precision is not part of a trainer's to_json(options) (a checkpoint records it as
// the informative metadata "attn.precision").
enum class Precision : uint8_t { kFloat32, kBFloat16 };
const char* precision_name(Precision p);             // "fp32", "bf16"
Precision parse_precision(const std::string& name);  // Error("precision") for other names

}  // namespace attn::model
