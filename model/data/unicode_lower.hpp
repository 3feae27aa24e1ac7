// UTF-8 helpers of the text readers (internal to model/): validation, decoding, and Python's
// str.lower(), which d2l's `_preprocess` applies to machine-translation text.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace attn::model::detail {

// The code point at s[pos] and its length in bytes (1..4), or length 0 when the bytes there are
// not valid UTF-8 (a stray continuation byte, a truncated or overlong sequence, a surrogate, a
// value above U+10FFFF).
size_t decode_utf8(std::string_view s, size_t pos, char32_t& cp);
void append_utf8(std::string& out, char32_t cp);
// The offset of the first byte that does not start valid UTF-8, or npos.
size_t find_invalid_utf8(std::string_view s);

// Python 3.11's chr(cp).lower() when that is one code point (Unicode 14, a generated table:
// scripts/gen_unicode_lower.py); cp itself for everything else, including U+0130.
char32_t lower_code_point(char32_t cp);

// Python's str.lower() on valid UTF-8 (invalid bytes are copied unchanged), with one departure:
// capital sigma always becomes U+03C3, where Python writes the final form U+03C2 at a word's end.
// U+0130 (capital I with dot) becomes "i" + U+0307 as in Python.
std::string utf8_lower(std::string_view s);

}  // namespace attn::model::detail
