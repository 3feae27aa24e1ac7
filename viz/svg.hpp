// A small SVG writer: the primitives the charts need (rectangles, lines, paths, text, groups),
// with escaping done in one place and every coordinate checked finite, so a chart can never
// emit "nan" into an attribute or an unescaped '<' into text.
//
// Coordinates are SVG user units (pixels at 100%): x to the right, y downwards.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace attn::viz {

// Escapes &, <, >, " and ' for use in XML text and attribute values; control characters other
// than tab and newline (not allowed in XML 1.0) become U+FFFD.
std::string xml_escape(std::string_view text);

// Formats a coordinate with at most 2 decimals and no trailing zeros ("12.5", "3", "-0.25").
// Throws attn::Error("svg") for NaN or infinity: a chart bug, never valid output.
std::string svg_number(double v);

enum class TextAnchor { kStart, kMiddle, kEnd };

struct TextStyle {
  double size = 12;
  TextAnchor anchor = TextAnchor::kStart;
  bool bold = false;
  double rotate = 0;  // degrees, around the text's anchor point
  std::string fill = "#222";
  // "auto" (baseline at y), "middle" (centred on y) or "hanging" (top at y); done by moving the
  // baseline, not with dominant-baseline, which renderers handle differently.
  std::string baseline = "auto";
};

// A line's look: colour, width and dash pattern ("" solid, else an SVG stroke-dasharray).
struct Stroke {
  std::string color = "#222";
  double width = 1;
  std::string dash;
};

class SvgDocument {
 public:
  // `title` becomes the <title> element (shown as a tooltip, read by screen readers).
  SvgDocument(double width, double height, std::string_view title = {});

  // Trusted markup for <defs> content built by the charts (gradients, patterns, clip paths).
  void defs(std::string_view markup);
  // <g class="..."> with optional extra attributes, already formatted (e.g. clip-path="...").
  void begin_group(std::string_view css_class, std::string_view extra_attributes = {});
  void end_group();

  void rect(double x, double y, double w, double h, std::string_view fill,
            const Stroke* stroke = nullptr);
  void line(double x1, double y1, double x2, double y2, const Stroke& stroke);
  // An open polyline through the points (at least 2).
  void polyline(const std::vector<double>& xs, const std::vector<double>& ys, const Stroke& stroke);
  void circle(double cx, double cy, double r, std::string_view fill);
  void text(double x, double y, std::string_view content, const TextStyle& style = {});

  double width() const { return width_; }
  double height() const { return height_; }
  // The finished document. Throws attn::Error if a group is still open.
  std::string str() const;

 private:
  double width_, height_;
  std::string body_, defs_;
  int open_groups_ = 0;
  void indent();
};

// Rough width of `text` in pixels at font size `size` (sans-serif averages ~0.6 em per
// character), used for layout: margins, legends, colour-bar labels.
double text_width(std::string_view text, double size);

// --- axes ------------------------------------------------------------------------------------

struct Tick {
  double value;
  std::string label;
};

// "Nice" ticks (steps of 1, 2 or 5 times a power of ten) covering [lo, hi], about `target` of
// them, labelled with the decimals the step needs.
std::vector<Tick> linear_ticks(double lo, double hi, int target = 6);
// Ticks at powers of ten in [lo, hi] (lo > 0); with fewer than 3 decades also at 2x and 5x.
std::vector<Tick> log_ticks(double lo, double hi);
// Compact label of a number: "0.001".."10000" plainly, else "1e6"-style with 3 significant
// digits.
std::string compact_number(double v);

// --- colours ---------------------------------------------------------------------------------

enum class Colormap {
  kBlues,  // white to dark blue (d2l's show_heatmaps uses matplotlib's 'Blues')
  kRdBu,   // diverging red - white - blue, for signed data centred at 0
};

// Parses "blues" or "rdbu"; throws attn::Error otherwise.
Colormap parse_colormap(std::string_view name);
// "#rrggbb" for t in [0, 1] (clamped), linear interpolation between the map's anchor colours.
std::string colormap_color(Colormap map, double t);

}  // namespace attn::viz
