// What model::Trainer and model::Seq2SeqTrainer checkpoints share (internal to model/): the
// tensors ("model.*" parameters, "optimizer.*" AdamW state), the trainer's "attn.*" metadata
// beside the caller's own, and an all-or-nothing restore. Each trainer adds its own format name,
// options and (for seq2seq) vocabularies.
#pragma once

#include "attn/core/safetensors.hpp"
#include "attn/nn/module.hpp"
#include "attn/nn/optim.hpp"

#include <cstdint>
#include <map>
#include <string>

namespace attn::model::detail {

// Writes path atomically: model.* and optimizer.* tensors; `extra` (names must not start with
// "attn.": Error("save_checkpoint")) plus `meta` (the trainer's own attn.* entries), attn.step
// and attn.dropout_offset.
void save_checkpoint_file(const std::string& path, nn::Module& model,
                          const nn::Optimizer& optimizer,
                          const std::map<std::string, std::string>& extra,
                          std::map<std::string, std::string> meta, int64_t step,
                          uint64_t dropout_offset);

// f.metadata[key], or Error("load_checkpoint") naming the file and `kind` ("an attn checkpoint").
const std::string& meta_at(const SafetensorsFile& f, const std::string& path, const char* key,
                           const char* kind = "an attn checkpoint");

// The training state read back by restore_checkpoint.
struct RestoredState {
  int64_t step = 0;
  uint64_t dropout_offset = 0;
  std::map<std::string, std::string> extra;  // the metadata not starting with "attn."
};

// Loads model.* into `model` and optimizer.* into `optimizer`, all or nothing (a failure leaves
// both as they were), and reads attn.step and attn.dropout_offset. Error("load_checkpoint").
RestoredState restore_checkpoint(const SafetensorsFile& f, const std::string& path,
                                 nn::Module& model, nn::Optimizer& optimizer,
                                 const char* kind = "an attn checkpoint");

}  // namespace attn::model::detail
