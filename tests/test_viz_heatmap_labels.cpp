// Heatmaps with named rows and columns (the tour's alignment and embedding figures): the names
// are drawn instead of index ticks, a count that does not match the panel is an Error, and the
// SVG stays well-formed (viz/xml_check).
#include "attn/core/error.hpp"
#include "viz/chart.hpp"
#include "viz/xml_check.hpp"

#include <gtest/gtest.h>

namespace attn::viz {
namespace {

TEST(HeatmapLabels, NamesReplaceIndexTicks) {
  Matrix m{2, 3, {0.1, 0.2, 0.7, 0.5, 0.25, 0.25}};
  HeatmapOptions o;
  o.row_labels = {"2005", "<eos>"};
  o.col_labels = {"march", "the", "fifth"};
  const std::string svg = heatmap_svg(m, o);
  for (const char* name : {"2005", "&lt;eos&gt;", "march", "the", "fifth"})
    EXPECT_NE(svg.find(name), std::string::npos) << name;
  EXPECT_NE(svg.find("rotate(-90"), std::string::npos);  // column names written upwards
  std::string why;
  EXPECT_TRUE(xml_well_formed(svg, &why)) << why;

  o.col_labels = {"march", "the"};
  EXPECT_THROW(heatmap_svg(m, o), Error);
  o.col_labels.clear();
  o.row_labels = {"a", "b", "c"};
  EXPECT_THROW(heatmap_svg(m, o), Error);
}

}  // namespace
}  // namespace attn::viz
