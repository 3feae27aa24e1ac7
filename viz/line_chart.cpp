// Line chart (d2l.plot): several series over shared axes, linear or log scales, grid, legend.
//
// Layout, in pixels: [ylabel][y tick labels][plot area][legend], title above, x tick labels and
// xlabel below. Data coordinates map to the plot area through t(v) = v or log10(v).
#include "viz/chart.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace attn::viz {

namespace {

struct StyleSlot {
  const char* color;
  const char* dash;
};
// d2l.plot's fmts ('-', 'm--', 'g-.', 'r:') in matplotlib's colours, then solid Tableau 10.
constexpr std::array<StyleSlot, 10> kStyleCycle = {{{"#1f77b4", ""},
                                                    {"#bf00bf", "6,3"},
                                                    {"#008000", "7,3,1.5,3"},
                                                    {"#ff0000", "1.5,2.5"},
                                                    {"#ff7f0e", ""},
                                                    {"#2ca02c", ""},
                                                    {"#d62728", ""},
                                                    {"#9467bd", ""},
                                                    {"#8c564b", ""},
                                                    {"#17becf", ""}}};

// One axis: its data range in transformed units (log10 for a log axis) and pixel span.
struct Axis {
  Scale scale;
  double lo = 0, hi = 1;  // transformed limits
  double p0 = 0, p1 = 1;  // pixels of lo and hi (p1 < p0 for y, which grows downwards)

  static double transform(Scale s, double v) { return s == Scale::kLog ? std::log10(v) : v; }
  bool drawable(double v) const { return std::isfinite(v) && (scale == Scale::kLinear || v > 0); }
  double pixel(double v) const {
    const double p = p0 + (transform(scale, v) - lo) / (hi - lo) * (p1 - p0);
    // Far outside the axis the clip path hides the line anyway; clamping keeps it finite.
    return std::clamp(p, -1e6, 1e6);
  }
};

// Sets the axis limits from the data range [lo, hi] (raw units) and the options.
void fit_axis(Axis& axis, double lo, double hi, std::optional<double> user_lo,
              std::optional<double> user_hi, double margin, const char* name) {
  const bool log = axis.scale == Scale::kLog;
  for (const auto& limit : {user_lo, user_hi}) {
    check(!limit || (std::isfinite(*limit) && (!log || *limit > 0)), "line_chart",
          "{} limit {} is not usable on a {} axis", name, limit.value_or(0),
          log ? "log" : "linear");
  }
  double a = Axis::transform(axis.scale, user_lo.value_or(lo));
  double b = Axis::transform(axis.scale, user_hi.value_or(hi));
  check(a <= b, "line_chart", "{} axis: lower limit {} above upper limit {}", name,
        user_lo.value_or(lo), user_hi.value_or(hi));
  if (a == b) {  // a single value: centre it in a unit-wide (or one-decade) window
    const double half = log ? 0.5 : std::max(0.5, std::abs(a) * 0.1);
    a -= half, b += half;
  }
  const double pad = margin * (b - a);
  if (!user_lo) a -= pad;
  if (!user_hi) b += pad;
  axis.lo = a, axis.hi = b;
}

// About one tick per `spacing` pixels (labels need more room across than up).
std::vector<Tick> axis_ticks(const Axis& axis, double pixels, double spacing) {
  if (axis.scale == Scale::kLog) return log_ticks(std::pow(10.0, axis.lo), std::pow(10.0, axis.hi));
  return linear_ticks(axis.lo, axis.hi, std::max(2, static_cast<int>(pixels / spacing)));
}

}  // namespace

std::string line_chart_svg(const std::vector<Series>& series, const LineChartOptions& options) {
  check(options.width >= 100 && options.height >= 80, "line_chart",
        "chart size {} x {} too small (at least 100 x 80)", options.width, options.height);
  Axis xa{options.xscale}, ya{options.yscale};

  // Data range over the drawable points of every series.
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (const Series& s : series) {
    check(s.x.size() == s.y.size(), "line_chart", "series '{}' has {} x values and {} y values",
          s.name, s.x.size(), s.y.size());
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!xa.drawable(s.x[i]) || !ya.drawable(s.y[i])) continue;
      xlo = std::min(xlo, s.x[i]), xhi = std::max(xhi, s.x[i]);
      ylo = std::min(ylo, s.y[i]), yhi = std::max(yhi, s.y[i]);
    }
  }
  check(xlo <= xhi, "line_chart",
        "no drawable point in {} series (every value is NaN, infinite or <= 0 on a log axis)",
        series.size());
  fit_axis(xa, xlo, xhi, options.xmin, options.xmax, options.x_margin, "x");
  fit_axis(ya, ylo, yhi, options.ymin, options.ymax, options.y_margin, "y");

  // Margins from the text they hold.
  constexpr double kFont = 12, kTickLength = 4;
  const double top = options.title.empty() ? 12 : 32;
  const double bottom = 26 + (options.xlabel.empty() ? 0 : 18);
  const std::vector<Tick> yticks = axis_ticks(ya, options.height - top - bottom, 40);
  double ylabel_width = 0;
  for (const Tick& t : yticks)
    ylabel_width = std::max(ylabel_width, text_width(t.label, kFont));
  const double left = 14 + ylabel_width + kTickLength + (options.ylabel.empty() ? 0 : 20);
  const double right = 14;
  double legend_width = 0;
  std::vector<size_t> legend_entries;
  if (options.legend) {
    for (size_t i = 0; i < series.size(); ++i) {
      if (series[i].name.empty()) continue;
      legend_entries.push_back(i);
      legend_width = std::max(legend_width, text_width(series[i].name, kFont));
    }
    if (!legend_entries.empty()) legend_width += 30 + 6 + 16 + 8;  // sample, gap, padding, gap
  }
  const double height = options.height;
  // A title wider than the chart widens the document rather than being cut off.
  const double width = std::max(options.width + legend_width, text_width(options.title, 14) + 20);
  const double plot_x0 = left, plot_x1 = options.width - right;
  const double plot_y0 = top, plot_y1 = height - bottom;
  check(plot_x1 - plot_x0 > 20 && plot_y1 - plot_y0 > 20, "line_chart",
        "chart size {} x {} leaves no room for the plot", options.width, options.height);
  xa.p0 = plot_x0, xa.p1 = plot_x1;
  ya.p0 = plot_y1, ya.p1 = plot_y0;
  const std::vector<Tick> xticks = axis_ticks(xa, plot_x1 - plot_x0, 80);

  SvgDocument svg(width, height, options.title.empty() ? "line chart" : options.title);
  svg.defs(fmt::format(
      "    <clipPath id=\"plot-area\"><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>"
      "</clipPath>",
      svg_number(plot_x0), svg_number(plot_y0), svg_number(plot_x1 - plot_x0),
      svg_number(plot_y1 - plot_y0)));

  // Grid and ticks.
  const Stroke grid{"#e3e3e3", 1, ""}, tick{"#444", 1, ""};
  svg.begin_group("axes");
  for (const Tick& t : xticks) {
    const double x = xa.pixel(t.value);
    if (options.grid) svg.line(x, plot_y0, x, plot_y1, grid);
    svg.line(x, plot_y1, x, plot_y1 + kTickLength, tick);
    svg.text(x, plot_y1 + kTickLength + 2, t.label,
             {.size = kFont, .anchor = TextAnchor::kMiddle, .baseline = "hanging"});
  }
  for (const Tick& t : yticks) {
    const double y = ya.pixel(t.value);
    if (options.grid) svg.line(plot_x0, y, plot_x1, y, grid);
    svg.line(plot_x0 - kTickLength, y, plot_x0, y, tick);
    svg.text(plot_x0 - kTickLength - 3, y, t.label,
             {.size = kFont, .anchor = TextAnchor::kEnd, .baseline = "middle"});
  }
  svg.end_group();

  // Series: polylines broken at undrawable points; a lone point between gaps becomes a dot.
  svg.begin_group("series", "clip-path=\"url(#plot-area)\"");
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    const StyleSlot slot = kStyleCycle[i % kStyleCycle.size()];
    const Stroke stroke{s.color.empty() ? slot.color : s.color, 1.5,
                        s.color.empty() ? slot.dash : s.dash};
    std::vector<double> xs, ys;
    const auto flush = [&] {
      if (xs.size() >= 2) svg.polyline(xs, ys, stroke);
      if (xs.size() == 1 && !s.markers) svg.circle(xs[0], ys[0], 2, stroke.color);
      xs.clear(), ys.clear();
    };
    for (size_t k = 0; k < s.x.size(); ++k) {
      if (!xa.drawable(s.x[k]) || !ya.drawable(s.y[k])) {
        flush();
        continue;
      }
      xs.push_back(xa.pixel(s.x[k]));
      ys.push_back(ya.pixel(s.y[k]));
      if (s.markers) svg.circle(xs.back(), ys.back(), 2.5, stroke.color);
    }
    flush();
  }
  svg.end_group();

  // Frame, labels, title.
  const Stroke frame{"#444", 1, ""};
  svg.rect(plot_x0, plot_y0, plot_x1 - plot_x0, plot_y1 - plot_y0, "none", &frame);
  if (!options.xlabel.empty())
    svg.text((plot_x0 + plot_x1) / 2, height - 8, options.xlabel,
             {.size = kFont, .anchor = TextAnchor::kMiddle});
  if (!options.ylabel.empty())
    svg.text(16, (plot_y0 + plot_y1) / 2, options.ylabel,
             {.size = kFont, .anchor = TextAnchor::kMiddle, .rotate = -90});
  if (!options.title.empty())
    svg.text((plot_x0 + plot_x1) / 2, 20, options.title,
             {.size = 14, .anchor = TextAnchor::kMiddle, .bold = true});

  // Legend, right of the plot, top-aligned: a line sample in the series' style, then its name.
  if (!legend_entries.empty()) {
    const double lx = options.width - right + 8, ly = plot_y0;
    const double row = 18;
    const Stroke box{"#bbb", 1, ""};
    svg.begin_group("legend");
    svg.rect(lx, ly, legend_width - 8, 8 + row * static_cast<double>(legend_entries.size()),
             "#ffffff", &box);
    for (size_t n = 0; n < legend_entries.size(); ++n) {
      const size_t i = legend_entries[n];
      const Series& s = series[i];
      const StyleSlot slot = kStyleCycle[i % kStyleCycle.size()];
      const Stroke stroke{s.color.empty() ? slot.color : s.color, 1.5,
                          s.color.empty() ? slot.dash : s.dash};
      const double y = ly + 4 + row * (static_cast<double>(n) + 0.5);
      svg.line(lx + 8, y, lx + 38, y, stroke);
      if (s.markers) svg.circle(lx + 23, y, 2.5, stroke.color);
      svg.text(lx + 44, y, s.name, {.size = kFont, .baseline = "middle"});
    }
    svg.end_group();
  }
  return svg.str();
}

}  // namespace attn::viz
