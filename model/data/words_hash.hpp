// The hash the generated tasks split their examples on (internal to model/): seq2seq_tasks.cpp
// (copy, reverse, dates) and text_tasks.cpp (month-day, compare) hold out an example when the hash
// of its words falls in bucket 0 of their kHeldOutBuckets, so no text is in both splits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attn::model::detail {

// FNV-1a over the words (a 0 byte after each), then a splitmix64 finaliser so that the bucket
// (hash % buckets) depends on every bit. Fixed: the split is the same on every machine and for
// every seed.
inline uint64_t words_hash(const std::vector<std::string>& tokens) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& t : tokens) {
    for (char c : t)
      h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
    h = (h ^ 0u) * 0x100000001B3ull;
  }
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 31;
  return h;
}

}  // namespace attn::model::detail
