// libFuzzer target for the attn command line's argument handling: the input is split into argv
// words (one per line; '\n' or NUL ends a word) and handed to attn::cli::run(), the function
// main() calls. The contract under test (tools/attn/main.cpp): every argument list ends with
// exit status 0 (success, --help, --version) or 2 (a bad flag or value, an unknown subcommand: one
// line on stderr); status 1 ("internal error": an exception other than attn::Error), another
// status, an escaping exception, a crash or a sanitizer report is a bug.
//
// Keeping it harmless and fast:
//   - the command runs in a private temporary directory and every '/' in a word becomes '_',
//     so a flag naming a file (--weights-svg, --curves, --heatmap, --svg) writes a plain name in
//     that directory, which is emptied after each run;
//   - inputs naming the subcommands `tour`, `train`, `experiment`, `compare` or `bench` are
//     skipped: they run every demonstration, train models or time kernels (seconds to minutes
//     per call), which would stall the fuzzer; their argument handling needs a fuzzer of its own
//     with a step budget;
//   - an input whose numbers exceed 1024, or multiply to more than 2^16, is skipped: the
//     commands accept sizes up to 2^26 elements by design, and one such run takes seconds under
//     the sanitizers. The validation of large values is covered by the CLI's own tests.
// scripts/fuzz.sh runs it with -close_fd_mask=3 (fuzz/cli_args.flags): the commands' stdout and
// error lines would flood the log. Replay an artifact without that flag to see them.
#include "tools/attn/commands.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr size_t kMaxWords = 32;
constexpr double kMaxNumber = 1024, kMaxProduct = 65536;

std::filesystem::path g_dir;  // the work directory of the commands (absolute)
int g_home = -1;              // the fuzzer's own working directory: corpus, artifacts

// Words of the input: split at '\n' or NUL; '/' becomes '_'.
std::vector<std::string> split_words(const uint8_t* data, size_t size) {
  std::vector<std::string> words(1);
  for (size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\n' || c == '\0') {
      words.emplace_back();
    } else {
      words.back().push_back(c == '/' ? '_' : c);
    }
  }
  if (words.back().empty()) words.pop_back();
  return words;
}

// False when the words would make a run slow: a heavy subcommand or large numbers. Numbers are
// read with strtod from every digit or '.' that starts one, so "1e9", "0x7fffffff", "--dim=99999"
// and "3 2000" are all seen.
bool cheap(const std::vector<std::string>& words) {
  double product = 1;
  for (const std::string& w : words) {
    if (w == "tour" || w == "train" || w == "experiment" || w == "compare" || w == "bench")
      return false;
    const char* s = w.c_str();
    for (size_t i = 0; i < w.size();) {
      if (!std::isdigit(static_cast<unsigned char>(s[i])) && s[i] != '.') {
        ++i;
        continue;
      }
      char* end = nullptr;
      const double v = std::strtod(s + i, &end);
      const size_t used = static_cast<size_t>(end - (s + i));
      if (used == 0) {
        ++i;
        continue;
      }
      if (!(std::abs(v) <= kMaxNumber)) return false;  // also rejects inf
      product *= std::max(1.0, std::abs(v));
      if (product > kMaxProduct) return false;
      i += used;
    }
  }
  return true;
}

void empty_work_dir() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(g_dir, ec))
    std::filesystem::remove_all(entry.path(), ec);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "attn_fuzz_cli_XXXXXX").string();
  g_home = open(".", O_RDONLY | O_DIRECTORY);
  if (mkdtemp(tmpl.data()) == nullptr || g_home < 0) {
    std::perror("fuzz_cli_args: cannot make its work directory");
    std::abort();
  }
  g_dir = tmpl;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(g_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> words = split_words(data, size);
  if (words.size() > kMaxWords || !cheap(words)) return -1;  // -1: keep out of the corpus
  words.insert(words.begin(), "attn");
  std::vector<char*> argv;
  for (std::string& w : words)
    argv.push_back(w.data());
  argv.push_back(nullptr);
  // Only the command runs in the work directory: libFuzzer reads and writes its corpus relative
  // to its own (scripts/fuzz.sh passes an absolute -artifact_prefix for crashes inside run()).
  if (chdir(g_dir.c_str()) != 0) std::abort();
  const int status = attn::cli::run(static_cast<int>(words.size()), argv.data());
  std::fflush(stdout);
  if (fchdir(g_home) != 0) std::abort();
  empty_work_dir();
  if (status != 0 && status != 2) {
    std::fprintf(stderr, "fuzz_cli_args: exit status %d (expected 0 or 2)\n", status);
    std::abort();
  }
  return 0;
}
