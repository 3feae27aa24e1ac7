// Heatmap grids (d2l.show_heatmaps): matrices as coloured cells, one shared colour scale and
// colour bar, panel titles, x labels under the last row and y labels left of the first column.
#include "viz/chart.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attn::viz {

Matrix Matrix::from_tensor(const Tensor& t) {
  check(t.defined() && t.ndim() == 2, "Matrix::from_tensor", "expected a 2-D tensor, got {}",
        t.defined() ? shape_str(t.shape()) : std::string("an undefined tensor"));
  return Matrix{t.dim(0), t.dim(1), t.to_vector()};
}

namespace {

// Integer ticks (cell indices) for an axis of n cells spanning `pixels`.
std::vector<Tick> index_ticks(int64_t n, double pixels) {
  if (n <= 1) return {{0, "0"}};
  std::vector<Tick> ticks;
  // Cells wide enough for their own label: label every index.
  if (pixels / static_cast<double>(n) >= text_width(std::to_string(n - 1), 12) + 6) {
    for (int64_t i = 0; i < n; ++i)
      ticks.push_back({static_cast<double>(i), std::to_string(i)});
    return ticks;
  }
  for (Tick& t :
       linear_ticks(0, static_cast<double>(n - 1), std::max(2, static_cast<int>(pixels / 36)))) {
    if (t.value == std::floor(t.value)) ticks.push_back({t.value, fmt::format("{}", t.value)});
  }
  return ticks;
}

constexpr const char* kNanPattern =
    "    <pattern id=\"nan-hatch\" width=\"4\" height=\"4\" patternUnits=\"userSpaceOnUse\">"
    "<rect width=\"4\" height=\"4\" fill=\"#ffffff\"/>"
    "<path d=\"M0,4 L4,0\" stroke=\"#888888\" stroke-width=\"1\"/></pattern>";

}  // namespace

std::string heatmap_grid_svg(const std::vector<std::vector<HeatmapPanel>>& grid,
                             const HeatmapOptions& options) {
  const char* op = "heatmap";
  check(!grid.empty() && !grid[0].empty(), op, "no panels to draw");
  const size_t grid_rows = grid.size(), grid_cols = grid[0].size();
  int64_t max_rows = 0, max_cols = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  bool has_invalid = false, any_title = false;
  for (size_t r = 0; r < grid_rows; ++r) {
    check(grid[r].size() == grid_cols, op, "panel row {} has {} panels, row 0 has {}", r,
          grid[r].size(), grid_cols);
    for (const HeatmapPanel& p : grid[r]) {
      const Matrix& m = p.matrix;
      check(m.rows > 0 && m.cols > 0 && static_cast<int64_t>(m.values.size()) == m.rows * m.cols,
            op, "matrix of {} x {} holds {} values, expected {}", m.rows, m.cols, m.values.size(),
            m.rows * m.cols);
      max_rows = std::max(max_rows, m.rows);
      max_cols = std::max(max_cols, m.cols);
      any_title = any_title || !p.title.empty();
      for (double v : m.values) {
        if (!std::isfinite(v)) {
          has_invalid = true;
          continue;
        }
        lo = std::min(lo, v), hi = std::max(hi, v);
      }
    }
  }

  // Colour scale: the options', else the finite data's range; a constant gets a unit window.
  if (lo > hi) lo = 0, hi = 1;  // nothing finite
  double vmin = options.vmin.value_or(lo), vmax = options.vmax.value_or(hi);
  check(std::isfinite(vmin) && std::isfinite(vmax) && vmin <= vmax, op,
        "colour scale [{}, {}] must be finite and ordered", vmin, vmax);
  if (vmin == vmax) vmin -= 0.5, vmax += 0.5;

  // Geometry. Square cells sized so the largest matrix fits about 320 x 360 pixels.
  double cell = options.cell_size;
  if (cell <= 0) {
    cell = std::min(320.0 / static_cast<double>(max_cols), 360.0 / static_cast<double>(max_rows));
    cell = std::clamp(cell, 1.0, grid_cols * grid_rows > 1 ? 28.0 : 40.0);
  }
  constexpr double kFont = 12, kTick = 4, kGap = 14;
  // Each grid column is as wide as its widest panel, each grid row as tall as its tallest, so
  // panels of different shapes (bits beside an encoding) pack without wasted space.
  std::vector<double> col_w(grid_cols, 0), row_h(grid_rows, 0);
  for (size_t gr = 0; gr < grid_rows; ++gr) {
    for (size_t gc = 0; gc < grid_cols; ++gc) {
      col_w[gc] = std::max(col_w[gc], cell * static_cast<double>(grid[gr][gc].matrix.cols));
      row_h[gr] = std::max(row_h[gr], cell * static_cast<double>(grid[gr][gc].matrix.rows));
    }
  }
  const double title_h = any_title ? 18 : 0;
  for (const auto& row : grid)
    for (const HeatmapPanel& p : row)
      check((options.row_labels.empty() ||
             static_cast<int64_t>(options.row_labels.size()) == p.matrix.rows) &&
                (options.col_labels.empty() ||
                 static_cast<int64_t>(options.col_labels.size()) == p.matrix.cols),
            "heatmap", "{} row and {} column labels for a {} x {} panel", options.row_labels.size(),
            options.col_labels.size(), p.matrix.rows, p.matrix.cols);
  // Ticks of an axis: the given names at every cell, or indices.
  const auto ticks = [](const std::vector<std::string>& labels, int64_t n, double pixels) {
    if (labels.empty()) return index_ticks(n, pixels);
    std::vector<Tick> out;
    for (size_t i = 0; i < labels.size(); ++i)
      out.push_back({static_cast<double>(i), labels[i]});
    return out;
  };
  double ytick_w = 0;
  for (const Tick& t : ticks(options.row_labels, max_rows, cell * static_cast<double>(max_rows)))
    ytick_w = std::max(ytick_w, text_width(t.label, kFont));
  double xtick_h = 16;  // index labels: one line; names: written upwards
  for (const std::string& l : options.col_labels)
    xtick_h = std::max(xtick_h, text_width(l, kFont) + 4);
  const double left = 10 + (options.ylabel.empty() ? 0 : 20) + ytick_w + kTick + 3;
  const double top = (options.title.empty() ? 8 : 32) + title_h;
  std::vector<double> col_x(grid_cols), row_y(grid_rows);
  double grid_w = 0, grid_h = 0;
  for (size_t gc = 0; gc < grid_cols; ++gc) {
    col_x[gc] = left + grid_w;
    // A panel title wider than its panel needs room too.
    double w = col_w[gc];
    for (size_t gr = 0; gr < grid_rows; ++gr)
      w = std::max(w, text_width(grid[gr][gc].title, kFont) + 4);
    grid_w += w + (gc + 1 < grid_cols ? kGap : 0);
  }
  for (size_t gr = 0; gr < grid_rows; ++gr) {
    row_y[gr] = top + grid_h;
    grid_h += row_h[gr] + (gr + 1 < grid_rows ? kGap + title_h + 4 : 0);
  }
  const double bottom = 10 + kTick + xtick_h + (options.xlabel.empty() ? 0 : 20);

  // Colour bar geometry: right of the grid, 80% of its height (at least 100 px).
  const double bar_w = 14, bar_h = std::max(100.0, 0.8 * grid_h);
  const double bar_x = left + grid_w + 18;
  const double bar_y = top + std::max(0.0, (grid_h - bar_h) / 2);
  const std::vector<Tick> bar_ticks =
      linear_ticks(vmin, vmax, std::max(2, static_cast<int>(bar_h / 40)));
  double bar_label_w = 0;
  for (const Tick& t : bar_ticks)
    bar_label_w = std::max(bar_label_w, text_width(t.label, kFont));
  const double content_w =
      bar_x + bar_w + kTick + 4 + bar_label_w + (options.colorbar_label.empty() ? 0 : 22) + 10;
  // A title wider than the panels widens the document rather than being cut off.
  const double width = std::max(content_w, text_width(options.title, 14) + 20);
  const double nan_legend_h = has_invalid ? 24 : 0;
  const double height = std::max(top + grid_h + bottom, bar_y + bar_h + nan_legend_h + 10);

  SvgDocument svg(width, height, options.title.empty() ? "heatmap" : options.title);
  if (has_invalid) svg.defs(kNanPattern);
  const Stroke frame{"#444", 1, ""}, tick{"#444", 1, ""};
  const auto cell_color = [&](double v) -> std::string {
    if (!std::isfinite(v)) return "url(#nan-hatch)";
    return colormap_color(options.colormap, (v - vmin) / (vmax - vmin));
  };

  for (size_t gr = 0; gr < grid_rows; ++gr) {
    for (size_t gc = 0; gc < grid_cols; ++gc) {
      const HeatmapPanel& p = grid[gr][gc];
      const Matrix& m = p.matrix;
      const double x0 = col_x[gc], y0 = row_y[gr];
      const double w = cell * static_cast<double>(m.cols), h = cell * static_cast<double>(m.rows);
      svg.begin_group("panel", "shape-rendering=\"crispEdges\"");
      for (int64_t r = 0; r < m.rows; ++r) {
        for (int64_t c = 0; c < m.cols; ++c) {
          svg.rect(x0 + cell * static_cast<double>(c), y0 + cell * static_cast<double>(r), cell,
                   cell, cell_color(m.at(r, c)));
        }
      }
      svg.rect(x0, y0, w, h, "none", &frame);
      svg.end_group();
      if (!p.title.empty())
        svg.text(x0 + w / 2, y0 - 6, p.title, {.size = kFont, .anchor = TextAnchor::kMiddle});
      // Tick labels on the outer panels only (matplotlib's shared axes); ticks at cell centres.
      for (const Tick& t : ticks(options.col_labels, m.cols, w)) {
        const double x = x0 + cell * (t.value + 0.5);
        svg.line(x, y0 + h, x, y0 + h + kTick, tick);
        if (gr + 1 == grid_rows && options.col_labels.empty())
          svg.text(x, y0 + h + kTick + 2, t.label,
                   {.size = kFont, .anchor = TextAnchor::kMiddle, .baseline = "hanging"});
        else if (gr + 1 == grid_rows)
          svg.text(
              x, y0 + h + kTick + 2, t.label,
              {.size = kFont, .anchor = TextAnchor::kEnd, .rotate = -90, .baseline = "middle"});
      }
      for (const Tick& t : ticks(options.row_labels, m.rows, h)) {
        const double y = y0 + cell * (t.value + 0.5);
        svg.line(x0 - kTick, y, x0, y, tick);
        if (gc == 0)
          svg.text(x0 - kTick - 3, y, t.label,
                   {.size = kFont, .anchor = TextAnchor::kEnd, .baseline = "middle"});
      }
    }
  }

  // Axis labels: xlabel centred under the grid, ylabel centred left of it (as d2l puts them on
  // the last row and first column).
  if (!options.xlabel.empty())
    svg.text(left + grid_w / 2, top + grid_h + kTick + xtick_h + 18, options.xlabel,
             {.size = kFont, .anchor = TextAnchor::kMiddle});
  if (!options.ylabel.empty())
    svg.text(16, top + grid_h / 2, options.ylabel,
             {.size = kFont, .anchor = TextAnchor::kMiddle, .rotate = -90});
  if (!options.title.empty())
    svg.text(width / 2, 20, options.title,
             {.size = 14, .anchor = TextAnchor::kMiddle, .bold = true});

  // Colour bar: a vertical gradient sampled from the map (17 stops reproduce the 9 anchors'
  // piecewise-linear ramp closely), vmin at the bottom.
  std::string gradient = "    <linearGradient id=\"colorbar\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (int k = 0; k <= 16; ++k) {
    const double t = k / 16.0;
    gradient += fmt::format("<stop offset=\"{}\" stop-color=\"{}\"/>", svg_number(t),
                            colormap_color(options.colormap, t));
  }
  gradient += "</linearGradient>";
  svg.defs(gradient);
  svg.begin_group("colorbar");
  svg.rect(bar_x, bar_y, bar_w, bar_h, "url(#colorbar)", &frame);
  for (const Tick& t : bar_ticks) {
    const double y = bar_y + bar_h - (t.value - vmin) / (vmax - vmin) * bar_h;
    svg.line(bar_x + bar_w, y, bar_x + bar_w + kTick, y, tick);
    svg.text(bar_x + bar_w + kTick + 3, y, t.label, {.size = kFont, .baseline = "middle"});
  }
  if (!options.colorbar_label.empty())
    svg.text(bar_x + bar_w + kTick + 4 + bar_label_w + 14, bar_y + bar_h / 2,
             options.colorbar_label, {.size = kFont, .anchor = TextAnchor::kMiddle, .rotate = 90});
  if (has_invalid) {
    svg.rect(bar_x, bar_y + bar_h + 10, bar_w, bar_w, "url(#nan-hatch)", &frame);
    svg.text(bar_x + bar_w + 5, bar_y + bar_h + 10 + bar_w / 2, "NaN",
             {.size = kFont, .baseline = "middle"});
  }
  svg.end_group();
  return svg.str();
}

std::string heatmap_svg(const Matrix& matrix, const HeatmapOptions& options) {
  return heatmap_grid_svg({{HeatmapPanel{matrix, ""}}}, options);
}

}  // namespace attn::viz
