// libFuzzer target for the safetensors reader: any byte string must either parse or end in
// attn::Error. Anything else (a crash, a sanitizer report, another exception type, a leak, an
// allocation beyond -rss_limit_mb) is a bug. Run with scripts/fuzz.sh.
#include "attn/core/error.hpp"
#include "attn/core/safetensors.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    attn::SafetensorsFile f = attn::parse_safetensors(data, size, "fuzz-input");
    // Touch what was parsed so that a tensor claiming bytes it does not own shows up under
    // AddressSanitizer here rather than in a later user.
    for (const auto& [name, t] : f.tensors) {
      const auto* p = static_cast<const volatile unsigned char*>(t.raw_data());
      unsigned char sink = 0;
      for (size_t i = 0; i < t.nbytes(); ++i)
        sink ^= p[i];
      (void)sink;
    }
  } catch (const attn::Error&) {
    // Rejected input: the expected outcome for almost every mutation.
  }
  return 0;
}
