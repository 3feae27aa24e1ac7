#include "viz/io.hpp"

#include "attn/core/error.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace attn::viz {

namespace {

// Distinguishes temporary names when one process writes several files at once.
std::atomic<unsigned> g_temp_counter{0};

}  // namespace

void write_file_atomic(const std::string& path, std::string_view content) {
  check(!path.empty(), "write_file", "empty output path");
  const std::string temp =
      fmt::format("{}.tmp-{}-{}", path, static_cast<long>(::getpid()), g_temp_counter++);

  std::FILE* f = std::fopen(temp.c_str(), "wb");
  if (f == nullptr) {
    const int err = errno;
    throw Error("write_file", fmt::format("cannot write '{}': {}", path, std::strerror(err)));
  }
  const bool written = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  const int write_err = errno;
  // fclose flushes the stdio buffer, so its failure (a full disk) is a write failure too.
  const bool closed = std::fclose(f) == 0;
  const int close_err = errno;
  if (!written || !closed) {
    std::remove(temp.c_str());
    throw Error("write_file", fmt::format("cannot write '{}': {}", path,
                                          std::strerror(written ? close_err : write_err)));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(temp.c_str());
    throw Error("write_file", fmt::format("cannot write '{}': {}", path, std::strerror(err)));
  }
}

}  // namespace attn::viz
