// What model::Trainer and model::Seq2SeqTrainer do alike with the options they share (internal to
// model/): the AdamW, clip_norm and seed entries of the options JSON, reading that JSON with one
// error convention, naming the first difference between two option sets, the checks of clip_norm
// and threads, and the clip_norm and loss conventions of a training step. Each trainer keeps its
// own "model" entry (and, for seq2seq, num_steps and preprocess).
#pragma once

#include "attn/nn/optim.hpp"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <string>

namespace attn::model::detail {

// Sets j["adamw"] (lr, beta1, beta2, eps, weight_decay), j["clip_norm"] and j["seed"] (a string:
// JSON numbers are doubles to many readers, and a seed is 64 bits).
void write_shared_options(nlohmann::json& j, const nn::AdamWOptions& adamw, double clip_norm,
                          uint64_t seed);

// Parses `text`, calls read_own(j) for the trainer's own entries, then reads adamw, clip_norm and
// seed (in that order, so a missing key is named as before). An attn::Error thrown inside passes
// through; any other failure is Error(op, "malformed options JSON: <what>").
void read_options_json(const char* op, const std::string& text,
                       const std::function<void(const nlohmann::json&)>& read_own,
                       nn::AdamWOptions& adamw, double& clip_norm, uint64_t& seed);

// "<JSON pointer> is <saved value> in the checkpoint, <current value> here" for the first
// difference between two options JSON texts ("?" when there is none).
std::string first_difference(const std::string& saved_json, const std::string& current_json);

// Error(op) unless clip_norm is finite and >= 0 and threads >= 0.
void check_shared_options(const char* op, double clip_norm, int threads);

// nn::clip_grad_norm over `params` with max_norm clip_norm, or none (infinity) when clip_norm is 0;
// returns the norm before clipping.
double clip_gradients(const nn::NamedParameters& params, double clip_norm, int threads);

// Error("train") when the loss of step `step` (counting from 1) is not finite.
void check_loss_finite(double loss, int64_t step, double lr);

}  // namespace attn::model::detail
