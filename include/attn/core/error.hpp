// attn::Error: the one exception type for user mistakes (bad shapes, bad values, bad files).
//
// Every message names the operation, the shapes involved and what was expected, e.g.
//   "masked_softmax: valid_lens has shape (3), expected (B) = (2) or (B, T) = (2, 4)"
// The CLI prints what() on one line of stderr and exits with status 2.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace attn {

class Error : public std::invalid_argument {
 public:
  Error(std::string op, const std::string& message)
      : std::invalid_argument(op + ": " + message), op_(std::move(op)) {}
  // The operation that rejected its input ("masked_softmax", "safetensors::load", ...).
  const std::string& op() const noexcept { return op_; }

 private:
  std::string op_;
};

// Throws Error(op, formatted message) unless `condition` holds. The message is only formatted on
// failure, so checks on hot-but-not-inner paths cost a branch.
template <typename... Args>
inline void check(bool condition, const char* op, fmt::format_string<Args...> format,
                  Args&&... args) {
  if (!condition) [[unlikely]] {
    throw Error(op, fmt::format(format, std::forward<Args>(args)...));
  }
}

}  // namespace attn
