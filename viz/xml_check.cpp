#include "viz/xml_check.hpp"

#include <fmt/format.h>

#include <cctype>
#include <set>
#include <vector>

namespace attn::viz {

namespace {

bool name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
         (static_cast<unsigned char>(c) & 0x80);
}
bool name_char(char c) {
  return name_start(c) || std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.';
}

class Checker {
 public:
  explicit Checker(std::string_view s) : s_(s) {}

  bool run(std::string* why) {
    const bool ok = document();
    if (!ok && why != nullptr) *why = fmt::format("{} at byte {}", error_, pos_);
    return ok;
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  std::string error_;

  bool fail(std::string message) {
    error_ = std::move(message);
    return false;
  }
  bool at(std::string_view prefix) const { return s_.substr(pos_, prefix.size()) == prefix; }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_])))
      ++pos_;
  }
  bool skip_past(std::string_view end, const char* what) {
    const size_t e = s_.find(end, pos_);
    if (e == std::string_view::npos) return fail(fmt::format("unterminated {}", what));
    pos_ = e + end.size();
    return true;
  }
  bool name(std::string* out) {
    if (pos_ >= s_.size() || !name_start(s_[pos_])) return fail("expected a name");
    const size_t start = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_]))
      ++pos_;
    *out = std::string(s_.substr(start, pos_ - start));
    return true;
  }
  // &amp; &lt; &gt; &quot; &apos; &#123; &#x1F;
  bool entity() {
    const size_t semi = s_.find(';', pos_);
    if (semi == std::string_view::npos || semi - pos_ > 12) return fail("bad '&' (unescaped?)");
    const std::string_view ref = s_.substr(pos_ + 1, semi - pos_ - 1);
    bool ok = ref == "amp" || ref == "lt" || ref == "gt" || ref == "quot" || ref == "apos";
    if (!ok && ref.size() >= 2 && ref[0] == '#') {
      const bool hex = ref[1] == 'x';
      const std::string_view digits = ref.substr(hex ? 2 : 1);
      ok = !digits.empty();
      for (char c : digits)
        ok = ok && (hex ? std::isxdigit(static_cast<unsigned char>(c)) != 0
                        : std::isdigit(static_cast<unsigned char>(c)) != 0);
    }
    if (!ok) return fail(fmt::format("unknown entity '&{};'", ref));
    pos_ = semi + 1;
    return true;
  }
  // Comments, processing instructions and whitespace between elements.
  bool misc() {
    for (;;) {
      skip_space();
      if (at("<!--")) {
        if (!skip_past("-->", "comment")) return false;
      } else if (at("<?")) {
        if (!skip_past("?>", "processing instruction")) return false;
      } else {
        return true;
      }
    }
  }
  bool element() {
    if (!at("<")) return fail("expected '<'");
    ++pos_;
    std::string tag;
    if (!name(&tag)) return false;
    std::set<std::string> attributes;
    for (;;) {
      const size_t before = pos_;
      skip_space();
      if (at("/>")) {
        pos_ += 2;
        return true;
      }
      if (at(">")) {
        ++pos_;
        break;
      }
      if (pos_ == before) return fail(fmt::format("expected whitespace in <{}>", tag));
      std::string attr;
      if (!name(&attr)) return false;
      if (!attributes.insert(attr).second) return fail(fmt::format("duplicate attribute {}", attr));
      skip_space();
      if (!at("=")) return fail(fmt::format("attribute {} without '='", attr));
      ++pos_;
      skip_space();
      if (pos_ >= s_.size() || (s_[pos_] != '"' && s_[pos_] != '\''))
        return fail(fmt::format("attribute {} not quoted", attr));
      const char quote = s_[pos_++];
      while (pos_ < s_.size() && s_[pos_] != quote) {
        if (s_[pos_] == '<') return fail(fmt::format("'<' in attribute {}", attr));
        if (s_[pos_] == '&') {
          if (!entity()) return false;
        } else {
          ++pos_;
        }
      }
      if (pos_ >= s_.size()) return fail(fmt::format("unterminated attribute {}", attr));
      ++pos_;
    }
    // Content: text, entities, child elements, comments; then the matching end tag.
    for (;;) {
      if (pos_ >= s_.size()) return fail(fmt::format("<{}> is never closed", tag));
      if (at("</")) {
        pos_ += 2;
        std::string end;
        if (!name(&end)) return false;
        if (end != tag) return fail(fmt::format("</{}> closes <{}>", end, tag));
        skip_space();
        if (!at(">")) return fail(fmt::format("malformed </{}>", end));
        ++pos_;
        return true;
      }
      if (at("<!--")) {
        if (!skip_past("-->", "comment")) return false;
      } else if (at("<![CDATA[")) {
        if (!skip_past("]]>", "CDATA section")) return false;
      } else if (at("<?")) {
        if (!skip_past("?>", "processing instruction")) return false;
      } else if (at("<")) {
        if (!element()) return false;
      } else if (at("&")) {
        if (!entity()) return false;
      } else {
        ++pos_;
      }
    }
  }
  bool document() {
    if (at("\xEF\xBB\xBF")) pos_ += 3;  // UTF-8 byte order mark
    if (!misc()) return false;
    if (at("<!DOCTYPE")) {
      if (!skip_past(">", "DOCTYPE")) return false;
      if (!misc()) return false;
    }
    if (!element()) return false;
    if (!misc()) return false;
    if (pos_ != s_.size()) return fail("content after the root element");
    return true;
  }
};

}  // namespace

bool xml_well_formed(std::string_view xml, std::string* why) {
  return Checker(xml).run(why);
}

}  // namespace attn::viz
