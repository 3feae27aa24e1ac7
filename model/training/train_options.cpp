// The options handling both trainers share (see model/training/train_options.hpp).
#include "model/training/train_options.hpp"

#include "attn/core/error.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <exception>
#include <limits>

namespace attn::model::detail {

void write_shared_options(nlohmann::json& j, const nn::AdamWOptions& adamw, double clip_norm,
                          uint64_t seed) {
  j["adamw"] = {{"lr", adamw.lr},
                {"beta1", adamw.beta1},
                {"beta2", adamw.beta2},
                {"eps", adamw.eps},
                {"weight_decay", adamw.weight_decay}};
  j["clip_norm"] = clip_norm;
  j["seed"] = std::to_string(seed);
}

void read_options_json(const char* op, const std::string& text,
                       const std::function<void(const nlohmann::json&)>& read_own,
                       nn::AdamWOptions& adamw, double& clip_norm, uint64_t& seed) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    read_own(j);
    const auto& a = j.at("adamw");
    adamw.lr = a.at("lr").get<double>();
    adamw.beta1 = a.at("beta1").get<double>();
    adamw.beta2 = a.at("beta2").get<double>();
    adamw.eps = a.at("eps").get<double>();
    adamw.weight_decay = a.at("weight_decay").get<double>();
    clip_norm = j.at("clip_norm").get<double>();
    seed = std::stoull(j.at("seed").get<std::string>());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(op, fmt::format("malformed options JSON: {}", e.what()));
  }
}

std::string first_difference(const std::string& saved_json, const std::string& current_json) {
  const nlohmann::json ja = nlohmann::json::parse(saved_json),
                       jb = nlohmann::json::parse(current_json);
  const nlohmann::json patch = nlohmann::json::diff(ja, jb);
  if (patch.empty()) return "?";
  const std::string where = patch[0].value("path", "?");
  const nlohmann::json::json_pointer ptr(where);
  return fmt::format("{} is {} in the checkpoint, {} here", where,
                     ja.contains(ptr) ? ja.at(ptr).dump() : "absent",
                     jb.contains(ptr) ? jb.at(ptr).dump() : "absent");
}

void check_shared_options(const char* op, double clip_norm, int threads) {
  check(clip_norm >= 0.0 && std::isfinite(clip_norm), op,
        "clip_norm must be finite and >= 0, got {}", clip_norm);
  check(threads >= 0, op, "threads must be >= 0, got {}", threads);
}

double clip_gradients(const nn::NamedParameters& params, double clip_norm, int threads) {
  return nn::clip_grad_norm(
      params, clip_norm > 0.0 ? clip_norm : std::numeric_limits<double>::infinity(), 2.0, threads);
}

void check_loss_finite(double loss, int64_t step, double lr) {
  check(std::isfinite(loss), "train",
        "loss is {} at step {} (the learning rate {} may be too high)", loss, step, lr);
}

}  // namespace attn::model::detail
