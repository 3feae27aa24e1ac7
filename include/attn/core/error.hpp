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

namespace detail {
// Formats and throws Error(op, message): kept out of line and marked cold so that a check on a hot
// path compiles to one compare and a branch to here, and no text exists until an error is thrown.
[[noreturn, gnu::cold, gnu::noinline]] void throw_error(const char* op, fmt::string_view format,
                                                        fmt::format_args args);
}  // namespace detail

// Throws Error(op, formatted message) unless `condition` holds. The message is only formatted on
// failure, but the arguments are evaluated on every call: pass values and cheap views
// (shape_arg(t) from tensor.hpp, dtype_name), never a std::string built for the message.
template <typename... Args>
inline void check(bool condition, const char* op, fmt::format_string<Args...> format,
                  Args&&... args) {
  if (!condition) [[unlikely]] {
    detail::throw_error(op, format, fmt::make_format_args(args...));
  }
}

}  // namespace attn
