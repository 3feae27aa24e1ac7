// Charts as SVG text: line charts (d2l.plot) and heatmap grids (d2l.show_heatmaps).
//
// Both return the document as a string; write it with viz::write_file_atomic. Non-finite data
// never reaches the SVG: a line breaks at NaN/inf (and at values <= 0 on a log axis), a heatmap
// draws such cells hatched and keeps them out of the colour scale.
#pragma once

#include "attn/core/tensor.hpp"
#include "viz/svg.hpp"

#include <optional>
#include <string>
#include <vector>

namespace attn::viz {

// --- line chart ------------------------------------------------------------------------------

struct Series {
  std::string name;  // legend label ("" keeps the series out of the legend)
  std::vector<double> x, y;
  // Empty: the style cycle below. Otherwise "#rrggbb" (or any SVG colour) and a dash pattern.
  std::string color;
  std::string dash;
  bool markers = false;  // draw a dot at every point (measurements, sparse data)
};

enum class Scale { kLinear, kLog };

struct LineChartOptions {
  std::string title, xlabel, ylabel;
  Scale xscale = Scale::kLinear, yscale = Scale::kLinear;
  // Overall size in pixels. d2l's figsize (6, 2.5) inches at 100 dpi is 600 x 250; the legend
  // adds its own width on the right.
  double width = 600, height = 250;
  // Axis limits; unset: the data's range, widened by the margin (a fraction of the range).
  std::optional<double> xmin, xmax, ymin, ymax;
  double x_margin = 0.0, y_margin = 0.05;
  bool legend = true;
  bool grid = true;
};

// Series without a colour take, in order, d2l.plot's default formats ('-', 'm--', 'g-.', 'r:':
// solid blue, dashed magenta, dash-dot green, dotted red), then solid Tableau colours.
// Throws attn::Error for x/y of different lengths, or when no point is drawable.
std::string line_chart_svg(const std::vector<Series>& series, const LineChartOptions& options);

// --- heatmaps --------------------------------------------------------------------------------

// A dense row-major matrix of doubles: what a heatmap draws.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> values;
  double at(int64_t r, int64_t c) const { return values[static_cast<size_t>(r * cols + c)]; }
  // Copies a 2-D tensor of any dtype and strides.
  static Matrix from_tensor(const Tensor& t);
};

struct HeatmapPanel {
  Matrix matrix;
  std::string title;  // drawn above the panel ("" for none)
};

struct HeatmapOptions {
  std::string title;           // above the whole figure
  std::string xlabel, ylabel;  // xlabel under the last row, ylabel left of column 0 (as d2l)
  std::string colorbar_label;
  Colormap colormap = Colormap::kBlues;
  // Colour scale shared by all panels (one colour bar); unset: min/max of the finite values.
  std::optional<double> vmin, vmax;
  // Side of one cell in pixels; 0: chosen so a panel is at most about 320 x 360 (cells stay
  // square, as matplotlib's imshow draws them).
  double cell_size = 0;
  // Names of the rows and columns (tokens of an alignment figure) instead of index ticks: every
  // panel must then have that many rows (columns). Column names are written upwards.
  std::vector<std::string> row_labels, col_labels;
};

// A grid of heatmaps, grid[row][column], all panels of one row having the same count. Row index
// of a matrix goes down, column index to the right, like imshow. Throws attn::Error for an empty
// grid, ragged rows, or matrices whose values do not match rows * cols.
std::string heatmap_grid_svg(const std::vector<std::vector<HeatmapPanel>>& grid,
                             const HeatmapOptions& options);
// One heatmap: a 1 x 1 grid.
std::string heatmap_svg(const Matrix& matrix, const HeatmapOptions& options);

}  // namespace attn::viz
