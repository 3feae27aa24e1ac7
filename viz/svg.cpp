#include "viz/svg.hpp"

#include "attn/core/error.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

namespace attn::viz {

// ---------------------------------------------------------------------------------------------
// Text

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is malformed (overlong
// forms, surrogates and code points above U+10FFFF included), so the output always parses.
size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  size_t n;
  uint32_t cp;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) {
    n = 2, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  constexpr std::array<uint32_t, 5> kMinimum = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinimum[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    switch (c) {
      case '&':
        out += "&amp;";
        ++i;
        continue;
      case '<':
        out += "&lt;";
        ++i;
        continue;
      case '>':
        out += "&gt;";
        ++i;
        continue;
      case '"':
        out += "&quot;";
        ++i;
        continue;
      case '\'':
        out += "&#39;";
        ++i;
        continue;
      default:
        break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 && c != '\t' && c != '\n' && c != '\r') {
      out += kReplacement;  // XML 1.0 forbids these characters even escaped
      ++i;
      continue;
    }
    const size_t n = utf8_sequence_length(text, i);
    if (n == 0) {
      out += kReplacement;
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string svg_number(double v) {
  check(std::isfinite(v), "svg", "non-finite coordinate {} (a chart must skip such values)", v);
  std::string s = fmt::format("{:.2f}", v);
  // Trim "12.50" -> "12.5", "3.00" -> "3", and "-0" -> "0".
  while (s.back() == '0')
    s.pop_back();
  if (s.back() == '.') s.pop_back();
  if (s == "-0") s = "0";
  return s;
}

double text_width(std::string_view text, double size) {
  // Count code points, not bytes, so "ω" is one character wide.
  size_t chars = 0;
  for (char c : text)
    chars += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return 0.6 * size * static_cast<double>(chars);
}

// ---------------------------------------------------------------------------------------------
// Document

SvgDocument::SvgDocument(double width, double height, std::string_view title)
    : width_(width), height_(height) {
  check(std::isfinite(width) && std::isfinite(height) && width > 0 && height > 0, "svg",
        "document size {} x {} must be positive", width, height);
  if (!title.empty()) body_ += fmt::format("  <title>{}</title>\n", xml_escape(title));
  // An opaque background, so the figure reads the same on dark pages and in image viewers.
  body_ += fmt::format("  <rect width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", svg_number(width),
                       svg_number(height));
}

void SvgDocument::indent() {
  body_.append(static_cast<size_t>(2 * (open_groups_ + 1)), ' ');
}

void SvgDocument::defs(std::string_view markup) {
  defs_ += markup;
  if (!markup.empty() && markup.back() != '\n') defs_ += '\n';
}

void SvgDocument::begin_group(std::string_view css_class, std::string_view extra_attributes) {
  indent();
  body_ += fmt::format("<g class=\"{}\"", xml_escape(css_class));
  if (!extra_attributes.empty()) body_ += fmt::format(" {}", extra_attributes);
  body_ += ">\n";
  ++open_groups_;
}

void SvgDocument::end_group() {
  check(open_groups_ > 0, "svg", "end_group without a matching begin_group");
  --open_groups_;
  indent();
  body_ += "</g>\n";
}

namespace {

std::string stroke_attributes(const Stroke& s) {
  std::string a =
      fmt::format("stroke=\"{}\" stroke-width=\"{}\"", xml_escape(s.color), svg_number(s.width));
  if (!s.dash.empty()) a += fmt::format(" stroke-dasharray=\"{}\"", xml_escape(s.dash));
  return a;
}

}  // namespace

void SvgDocument::rect(double x, double y, double w, double h, std::string_view fill,
                       const Stroke* stroke) {
  indent();
  body_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"",
                       svg_number(x), svg_number(y), svg_number(std::max(w, 0.0)),
                       svg_number(std::max(h, 0.0)), xml_escape(fill));
  if (stroke != nullptr) body_ += " " + stroke_attributes(*stroke);
  body_ += "/>\n";
}

void SvgDocument::line(double x1, double y1, double x2, double y2, const Stroke& stroke) {
  indent();
  body_ += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" {}/>\n", svg_number(x1),
                       svg_number(y1), svg_number(x2), svg_number(y2), stroke_attributes(stroke));
}

void SvgDocument::polyline(const std::vector<double>& xs, const std::vector<double>& ys,
                           const Stroke& stroke) {
  check(xs.size() == ys.size() && xs.size() >= 2, "svg",
        "polyline needs as many x as y values and at least 2 points (got {} and {})", xs.size(),
        ys.size());
  indent();
  body_ += "<polyline points=\"";
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i > 0) body_ += ' ';
    body_ += svg_number(xs[i]);
    body_ += ',';
    body_ += svg_number(ys[i]);
  }
  body_ +=
      fmt::format("\" fill=\"none\" stroke-linejoin=\"round\" {}/>\n", stroke_attributes(stroke));
}

void SvgDocument::circle(double cx, double cy, double r, std::string_view fill) {
  indent();
  body_ += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{}\"/>\n", svg_number(cx),
                       svg_number(cy), svg_number(r), xml_escape(fill));
}

void SvgDocument::text(double x, double y, std::string_view content, const TextStyle& style) {
  static constexpr std::array<const char*, 3> kAnchor = {"start", "middle", "end"};
  // Vertical alignment by moving the baseline ourselves: renderers disagree on
  // dominant-baseline (librsvg ignores "hanging"). Digits and capitals of a sans-serif font
  // span about 0.72 em above the baseline.
  double baseline_y = y;
  if (style.baseline == "middle") {
    baseline_y = y + 0.36 * style.size;
  } else if (style.baseline == "hanging") {
    baseline_y = y + 0.75 * style.size;
  } else {
    check(style.baseline == "auto", "svg", "unknown text baseline '{}'", style.baseline);
  }
  indent();
  body_ += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"{}\"", svg_number(x),
                       svg_number(baseline_y), svg_number(style.size));
  const auto anchor = static_cast<size_t>(style.anchor);
  if (anchor != 0) body_ += fmt::format(" text-anchor=\"{}\"", kAnchor[anchor]);
  if (style.bold) body_ += " font-weight=\"bold\"";
  if (style.fill != "#222") body_ += fmt::format(" fill=\"{}\"", xml_escape(style.fill));
  if (style.rotate != 0)
    body_ += fmt::format(" transform=\"rotate({} {} {})\"", svg_number(style.rotate), svg_number(x),
                         svg_number(baseline_y));
  body_ += fmt::format(">{}</text>\n", xml_escape(content));
}

std::string SvgDocument::str() const {
  check(open_groups_ == 0, "svg", "{} group(s) still open", open_groups_);
  std::string out = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" "
      "fill=\"#222\">\n",
      svg_number(width_), svg_number(height_));
  if (!defs_.empty()) out += "  <defs>\n" + defs_ + "  </defs>\n";
  out += body_;
  out += "</svg>\n";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Ticks

std::string compact_number(double v) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  if (a >= 1e-3 && a < 1e5) {
    std::string s = fmt::format("{:.6f}", v);
    while (s.back() == '0')
      s.pop_back();
    if (s.back() == '.') s.pop_back();
    return s;
  }
  // 3 significant digits in scientific form, without fmt's "e+06" padding: "1e6", "2.5e-5".
  const int exponent = static_cast<int>(std::floor(std::log10(a)));
  double mantissa = v / std::pow(10.0, exponent);
  std::string m = fmt::format("{:.2f}", mantissa);
  while (m.back() == '0')
    m.pop_back();
  if (m.back() == '.') m.pop_back();
  return fmt::format("{}e{}", m, exponent);
}

std::vector<Tick> linear_ticks(double lo, double hi, int target) {
  check(std::isfinite(lo) && std::isfinite(hi) && lo <= hi, "linear_ticks",
        "invalid range [{}, {}]", lo, hi);
  if (lo == hi) return {{lo, compact_number(lo)}};
  // Step = 1, 2 or 5 times a power of ten, the first not below (hi - lo) / target.
  const double raw = (hi - lo) / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double normalized = raw / magnitude;
  const double step = (normalized <= 1   ? 1
                       : normalized <= 2 ? 2
                       : normalized <= 5 ? 5
                                         : 10) *
                      magnitude;
  // Decimals the labels need: none for steps >= 1, else enough for the step's first digit.
  const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
  const bool scientific = std::max(std::abs(lo), std::abs(hi)) >= 1e5 || step < 1e-4;
  std::vector<Tick> ticks;
  const double first = std::ceil(lo / step - 1e-9);
  for (double k = first;; k += 1) {
    const double v = k * step;
    if (v > hi + step * 1e-9) break;
    const double value = std::abs(v) < step * 1e-9 ? 0.0 : v;
    std::string label =
        scientific ? compact_number(value) : fmt::format("{:.{}f}", value, decimals);
    if (label == "-0") label = "0";
    ticks.push_back({value, std::move(label)});
  }
  return ticks;
}

std::vector<Tick> log_ticks(double lo, double hi) {
  check(std::isfinite(lo) && std::isfinite(hi) && lo > 0 && lo <= hi, "log_ticks",
        "invalid range [{}, {}] for a log axis", lo, hi);
  const int first = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  const int last = static_cast<int>(std::ceil(std::log10(hi) - 1e-9));
  const bool dense = last - first < 3;
  // Long ranges: label every decade, or every 2nd/3rd one when there are too many.
  const int every = std::max(1, (last - first + 7) / 8);
  std::vector<Tick> ticks;
  for (int e = first; e <= last; ++e) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m != 1 && !dense) continue;
      if (m == 1 && (e - first) % every != 0) continue;
      const double v = m * std::pow(10.0, e);
      if (v < lo * (1 - 1e-9) || v > hi * (1 + 1e-9)) continue;
      ticks.push_back({v, compact_number(v)});
    }
  }
  return ticks;
}

// ---------------------------------------------------------------------------------------------
// Colours

namespace {

struct Rgb {
  double r, g, b;
};

// ColorBrewer's 9-class sequential Blues and diverging RdBu (Cynthia Brewer, colorbrewer2.org),
// the schemes matplotlib's 'Blues' and 'RdBu' are built from.
constexpr std::array<Rgb, 9> kBlues = {{{247, 251, 255},
                                        {222, 235, 247},
                                        {198, 219, 239},
                                        {158, 202, 225},
                                        {107, 174, 214},
                                        {66, 146, 198},
                                        {33, 113, 181},
                                        {8, 81, 156},
                                        {8, 48, 107}}};
constexpr std::array<Rgb, 9> kRdBu = {{{178, 24, 43},
                                       {214, 96, 77},
                                       {244, 165, 130},
                                       {253, 219, 199},
                                       {247, 247, 247},
                                       {209, 229, 240},
                                       {146, 197, 222},
                                       {67, 147, 195},
                                       {33, 102, 172}}};

}  // namespace

Colormap parse_colormap(std::string_view name) {
  if (name == "blues") return Colormap::kBlues;
  if (name == "rdbu") return Colormap::kRdBu;
  throw Error("colormap", fmt::format("unknown colour map '{}', expected blues or rdbu", name));
}

std::string colormap_color(Colormap map, double t) {
  const auto& anchors = map == Colormap::kBlues ? kBlues : kRdBu;
  if (!(t >= 0)) t = 0;  // also maps NaN to the low end; callers draw NaN cells separately
  if (t > 1) t = 1;
  const double position = t * (anchors.size() - 1);
  const size_t i = std::min(static_cast<size_t>(position), anchors.size() - 2);
  const double f = position - static_cast<double>(i);
  const auto mix = [&](double a, double b) {
    return static_cast<int>(std::lround(a + (b - a) * f));
  };
  return fmt::format("#{:02x}{:02x}{:02x}", mix(anchors[i].r, anchors[i + 1].r),
                     mix(anchors[i].g, anchors[i + 1].g), mix(anchors[i].b, anchors[i + 1].b));
}

}  // namespace attn::viz
