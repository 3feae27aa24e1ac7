// Reading a text data file (internal to model/): what the readers of data.cpp (TSV, CoNLL-U)
// and seq2seq_data.cpp (source<TAB>target) share: the whole file, its lines, blank lines and the
// "file:line: " prefix of every error they throw.
#pragma once

#include "attn/core/error.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace attn::model::detail {

// The bytes of `path`; Error(op) naming the path when it cannot be opened or read.
std::string read_text_file(const char* op, const std::string& path);

// Calls f(line, line_number) for every line; '\n' ends a line, a trailing '\r' is dropped.
template <typename F>
void for_each_line(std::string_view text, F&& f) {
  int64_t number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(line, ++number);
    pos = end + 1;
  }
}

// Whether the line holds nothing but spaces and tabs.
inline bool blank(std::string_view s) {
  return s.find_first_not_of(" \t") == std::string_view::npos;
}

// A throw with the file:line prefix every reader error carries.
template <typename... Args>
[[noreturn]] void fail_at(const char* op, const std::string& file, int64_t line,
                          fmt::format_string<Args...> format, Args&&... args) {
  throw Error(
      op, fmt::format("{}:{}: {}", file, line, fmt::format(format, std::forward<Args>(args)...)));
}

}  // namespace attn::model::detail
