// Checkpoint plumbing shared by the trainers (see model/training/checkpoint_io.hpp).
#include "model/training/checkpoint_io.hpp"

#include "attn/core/error.hpp"

#include <exception>

namespace attn::model::detail {
namespace {

constexpr const char* kModelPrefix = "model.";
constexpr const char* kOptimizerPrefix = "optimizer.";

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

uint64_t parse_u64(const std::string& text, const std::string& path, const char* key) {
  try {
    size_t used = 0;
    const uint64_t v = std::stoull(text, &used);
    if (used == text.size() && !text.empty() && text[0] != '-') return v;
  } catch (const std::exception&) {
  }
  throw Error(
      "load_checkpoint",
      fmt::format("{}: metadata '{}' is '{}', expected an unsigned integer", path, key, text));
}

}  // namespace

void save_checkpoint_file(const std::string& path, nn::Module& model,
                          const nn::Optimizer& optimizer,
                          const std::map<std::string, std::string>& extra,
                          std::map<std::string, std::string> meta, int64_t step,
                          uint64_t dropout_offset) {
  std::map<std::string, Tensor> tensors;
  for (auto& [name, t] : model.state_dict())
    tensors.emplace(kModelPrefix + name, t);
  for (auto& [name, t] : optimizer.state_dict())
    tensors.emplace(kOptimizerPrefix + name, t);
  for (const auto& [k, v] : extra) {
    check(!starts_with(k, "attn."), "save_checkpoint",
          "metadata name '{}' is reserved (names starting with 'attn.' are the trainer's)", k);
    meta.emplace(k, v);
  }
  meta["attn.step"] = std::to_string(step);
  meta["attn.dropout_offset"] = std::to_string(dropout_offset);
  save_safetensors(path, tensors, meta);
}

const std::string& meta_at(const SafetensorsFile& f, const std::string& path, const char* key,
                           const char* kind) {
  auto it = f.metadata.find(key);
  check(it != f.metadata.end(), "load_checkpoint", "{}: no '{}' metadata (not {})", path, key,
        kind);
  return it->second;
}

RestoredState restore_checkpoint(const SafetensorsFile& f, const std::string& path,
                                 nn::Module& model, nn::Optimizer& optimizer, const char* kind) {
  const char* op = "load_checkpoint";
  RestoredState r;
  r.step = static_cast<int64_t>(parse_u64(meta_at(f, path, "attn.step", kind), path, "attn.step"));
  r.dropout_offset =
      parse_u64(meta_at(f, path, "attn.dropout_offset", kind), path, "attn.dropout_offset");
  nn::StateDict model_state, optimizer_state;
  for (const auto& [name, t] : f.tensors) {
    if (starts_with(name, kModelPrefix))
      model_state.emplace(name.substr(std::string(kModelPrefix).size()), t);
    else if (starts_with(name, kOptimizerPrefix))
      optimizer_state.emplace(name.substr(std::string(kOptimizerPrefix).size()), t);
    else
      throw Error(op, fmt::format("{}: unexpected tensor '{}' (expected model.* or optimizer.*)",
                                  path, name));
  }
  // Both loads are all-or-nothing; if the optimiser's fails after the model's succeeded, the
  // previous parameters go back, so a failed load changes nothing.
  const nn::StateDict previous = model.state_dict();
  try {
    model.load_state_dict(model_state, true);
    optimizer.load_state_dict(optimizer_state);
  } catch (const Error& e) {
    model.load_state_dict(previous, true);
    throw Error(op, fmt::format("{}: {}", path, e.what()));
  }
  for (const auto& [k, v] : f.metadata)
    if (!starts_with(k, "attn.")) r.extra.emplace(k, v);
  return r;
}

}  // namespace attn::model::detail
