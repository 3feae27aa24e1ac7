// UTF-8 decoding and Python's str.lower() (see model/data/unicode_lower.hpp).
#include "model/data/unicode_lower.hpp"

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace attn::model::detail {

namespace {

// A run of capitals first, first + stride, ..., last whose lower case is cp + delta.
struct LowerRun {
  uint32_t first, last;
  uint8_t stride;
  int32_t delta;
};

constexpr LowerRun kLowerRuns[] = {
#include "model/data/unicode_lower_table.inc"
};

bool continuation(unsigned char c) {
  return (c & 0xC0) == 0x80;
}

}  // namespace

size_t decode_utf8(std::string_view s, size_t pos, char32_t& cp) {
  const size_t n = s.size() - pos;
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[pos + i]); };
  const unsigned char c = b(0);
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  size_t len = 0;
  char32_t min = 0;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;  // a continuation byte or 0xF8..0xFF where a sequence should start
  }
  if (n < len) return 0;
  for (size_t i = 1; i < len; ++i) {
    if (!continuation(b(i))) return 0;
    cp = (cp << 6) | (b(i) & 0x3F);
  }
  // Overlong forms, UTF-16 surrogates and values past Unicode are not UTF-8 (RFC 3629).
  if (cp < min || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return 0;
  return len;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t find_invalid_utf8(std::string_view s) {
  size_t pos = 0;
  char32_t cp = 0;
  while (pos < s.size()) {
    const size_t len = decode_utf8(s, pos, cp);
    if (len == 0) return pos;
    pos += len;
  }
  return std::string_view::npos;
}

char32_t lower_code_point(char32_t cp) {
  // The last run starting at or before cp is the only one that can hold it (runs are disjoint).
  const auto it = std::upper_bound(std::begin(kLowerRuns), std::end(kLowerRuns), cp,
                                   [](char32_t c, const LowerRun& r) { return c < r.first; });
  if (it == std::begin(kLowerRuns)) return cp;
  const LowerRun& r = *std::prev(it);
  if (cp > r.last || (cp - r.first) % r.stride != 0) return cp;
  return static_cast<char32_t>(static_cast<int64_t>(cp) + r.delta);
}

std::string utf8_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    char32_t cp = 0;
    const size_t len = decode_utf8(s, pos, cp);
    if (len == 0) {  // not UTF-8: copied as it is
      out.push_back(s[pos++]);
      continue;
    }
    if (cp < 0x80) {
      out.push_back(cp >= 'A' && cp <= 'Z' ? static_cast<char>(cp + 32) : static_cast<char>(cp));
    } else if (cp == 0x130) {  // Python: "i" + combining dot above (two code points)
      out.push_back('i');
      append_utf8(out, 0x307);
    } else {
      append_utf8(out, lower_code_point(cp));
    }
    pos += len;
  }
  return out;
}

}  // namespace attn::model::detail
