// libFuzzer target for the safetensors reader: any byte string must either parse or end in
// attn::Error. Anything else (a crash, a sanitizer report, another exception type, a leak, an
// allocation beyond -rss_limit_mb) is a bug. Inputs that parse are also written back with
// save_safetensors and re-read, which must reproduce every tensor and metadata entry exactly:
// this exercises the writer on whatever names and shapes the mutator invents (escapes, UTF-8,
// empty tensors). Run with scripts/fuzz.sh.
#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace {

bool same(const attn::Tensor& a, const attn::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

void round_trip(const attn::SafetensorsFile& f) {
  static const std::string path = (std::filesystem::temp_directory_path() /
                                   ("attn_fuzz_" + std::to_string(getpid()) + ".safetensors"))
                                      .string();
  attn::save_safetensors(path, f.tensors, f.metadata);
  attn::SafetensorsFile g = attn::load_safetensors(path);
  std::remove(path.c_str());
  bool ok = g.metadata == f.metadata && g.tensors.size() == f.tensors.size();
  for (const auto& [name, t] : f.tensors) {
    auto it = g.tensors.find(name);
    ok = ok && it != g.tensors.end() && same(it->second, t);
  }
  if (!ok) {
    std::fprintf(stderr, "save_safetensors + load_safetensors changed a parsed file\n");
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::SafetensorsFile f;
  try {
    f = attn::parse_safetensors(data, size, "fuzz-input");
  } catch (const attn::Error&) {
    return 0;  // rejected input: the expected outcome for almost every mutation
  }
  round_trip(f);  // an attn::Error here (a valid file the writer refuses) escapes: a bug
  return 0;
}
