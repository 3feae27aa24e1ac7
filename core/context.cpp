#include "attn/core/context.hpp"

#include "attn/core/error.hpp"

#include <thread>

namespace attn {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto:
      return "auto";
    case Backend::kReference:
      return "reference";
    case Backend::kCpu:
      return "cpu";
  }
  return "?";
}

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "reference" || name == "ref") return Backend::kReference;
  if (name == "cpu") return Backend::kCpu;
  throw Error("parse_backend", "unknown backend '" + name + "', expected auto, reference or cpu");
}

int Context::resolved_threads() const {
  if (threads > 0) return threads;
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

}  // namespace attn
