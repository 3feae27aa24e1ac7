// A minimal XML well-formedness check, enough for the SVG this project writes: one root
// element, properly nested and closed tags, quoted attributes without duplicates, known entity
// references, no '<' or stray '&' in text, and a leading <?xml ...?> declaration and comments
// allowed. Used by the tests (and by anyone who wants to assert a figure is valid) without
// depending on an XML library.
#pragma once

#include <string>
#include <string_view>

namespace attn::viz {

// True when `xml` is well-formed; otherwise false with the first problem (and its byte offset)
// in *why.
bool xml_well_formed(std::string_view xml, std::string* why = nullptr);

}  // namespace attn::viz
