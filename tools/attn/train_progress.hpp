// The live progress of `attn train` (encoder and sequence-to-sequence runs alike): a bar redrawn
// in place on a terminal, whole lines only on a pipe or file.
#pragma once

#include "model/training/train_loop.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace attn::cli {

// "0:42" or "1:02:03".
inline std::string clock(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// The live line on a terminal: "step 120/1000 [####......] loss 1.234  12.3k tok/s  ETA 0:42".
// Redrawn in place (\r) at most 10 times a second; on a pipe or file nothing but whole lines.
class Progress {
 public:
  // `enabled` false (ranks other than 0 of a data-parallel run): prints nothing.
  explicit Progress(int64_t total, bool enabled = true)
      : total_(total), tty_(isatty(fileno(stderr)) != 0), enabled_(enabled) {}
  void update(int64_t step, double loss, double tokens_per_second, double eta) {
    if (!tty_ || !enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (step != total_ && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    constexpr int kWidth = 24;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : kWidth;
    std::fprintf(stderr, "\r\033[Kstep %lld/%lld [%s%s] loss %.4f  %s tok/s  ETA %s",
                 static_cast<long long>(step), static_cast<long long>(total_),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), loss,
                 model::format_rate(tokens_per_second).c_str(), clock(eta).c_str());
    std::fflush(stderr);
  }
  // A whole line (evaluation results), above the bar on a terminal.
  void line(const std::string& text) {
    if (!enabled_) return;
    std::fprintf(stderr, "%s%s\n", tty_ ? "\r\033[K" : "", text.c_str());
    std::fflush(stderr);
  }

 private:
  int64_t total_;
  bool tty_, enabled_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace attn::cli
