// Unit tests of viz/: escaping, number formatting, ticks, colours, well-formed SVG from the line
// chart and heatmaps (including NaN data), the HTML report and atomic file writes.
#include "attn/core/error.hpp"
#include "viz/chart.hpp"
#include "viz/io.hpp"
#include "viz/report.hpp"
#include "viz/svg.hpp"
#include "viz/xml_check.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

namespace attn::viz {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

::testing::AssertionResult WellFormed(const std::string& xml) {
  std::string why;
  if (xml_well_formed(xml, &why)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + 1))
    ++n;
  return n;
}

// No "nan" or "inf" may reach a coordinate, a size or a colour (text such as ">NaN<" and ids
// such as "nan-hatch" are fine).
void ExpectNoNonFiniteNumbers(const std::string& svg) {
  static const std::regex kNonFinite(R"((^|[\s",(])[-+]?(nan|inf)($|[\s",)]))", std::regex::icase);
  std::smatch m;
  EXPECT_FALSE(std::regex_search(svg, m, kNonFinite)) << "found '" << m.str() << "'";
}

// A scratch directory removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("attn_test_viz_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  size_t entries() const {
    return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(path), {}));
  }
};

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// --- text ----------------------------------------------------------------------------------

TEST(VizText, EscapesMarkupCharacters) {
  EXPECT_EQ(xml_escape("<a & 'b' \"c\">"), "&lt;a &amp; &#39;b&#39; &quot;c&quot;&gt;");
  EXPECT_EQ(xml_escape("plain"), "plain");
  EXPECT_EQ(xml_escape(""), "");
}

TEST(VizText, KeepsValidUtf8AndReplacesWhatXmlForbids) {
  EXPECT_EQ(xml_escape("ω_j δ"), "ω_j δ");
  EXPECT_EQ(xml_escape("tab\tnewline\n"), "tab\tnewline\n");
  EXPECT_EQ(xml_escape(std::string("a\x01z")), "a\xEF\xBF\xBDz");              // control character
  EXPECT_EQ(xml_escape(std::string("a\xC3z")), "a\xEF\xBF\xBDz");              // truncated sequence
  EXPECT_EQ(xml_escape(std::string("\xC0\xAF")), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong '/'
  EXPECT_EQ(xml_escape(std::string("\xED\xA0\x80")),                           // UTF-16 surrogate
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(VizText, NumbersAreShortAndFinite) {
  EXPECT_EQ(svg_number(12.5), "12.5");
  EXPECT_EQ(svg_number(3.0), "3");
  EXPECT_EQ(svg_number(-0.001), "0");
  EXPECT_EQ(svg_number(1.005), "1");  // 2 decimals at most
  EXPECT_EQ(svg_number(-7.25), "-7.25");
  EXPECT_THROW(svg_number(kNaN), Error);
  EXPECT_THROW(svg_number(kInf), Error);
}

TEST(VizText, CompactNumbers) {
  EXPECT_EQ(compact_number(0), "0");
  EXPECT_EQ(compact_number(0.001), "0.001");
  EXPECT_EQ(compact_number(1000), "1000");
  EXPECT_EQ(compact_number(1e6), "1e6");
  EXPECT_EQ(compact_number(2.5e-5), "2.5e-5");
  EXPECT_EQ(compact_number(-1e-7), "-1e-7");
}

// --- ticks and colours -----------------------------------------------------------------------

TEST(VizTicks, LinearTicksAreNiceAndInside) {
  const auto ticks = linear_ticks(0, 59, 6);
  ASSERT_EQ(ticks.size(), 6u);
  for (size_t i = 0; i < ticks.size(); ++i) {
    EXPECT_DOUBLE_EQ(ticks[i].value, 10.0 * static_cast<double>(i));
    EXPECT_EQ(ticks[i].label, std::to_string(10 * i));
  }
  const auto sym = linear_ticks(-1.1, 1.1, 5);
  std::vector<std::string> labels;
  for (const auto& t : sym)
    labels.push_back(t.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"-1.0", "-0.5", "0.0", "0.5", "1.0"}));
  EXPECT_EQ(linear_ticks(2, 2).size(), 1u);
  EXPECT_THROW(linear_ticks(kNaN, 1), Error);
  EXPECT_THROW(linear_ticks(2, 1), Error);
}

TEST(VizTicks, LogTicksAtDecades) {
  std::vector<std::string> labels;
  for (const auto& t : log_ticks(1, 1e6))
    labels.push_back(t.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"1", "10", "100", "1000", "10000", "1e5", "1e6"}));
  // A narrow range gets the 2x and 5x ticks too.
  labels.clear();
  for (const auto& t : log_ticks(1, 100))
    labels.push_back(t.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"1", "2", "5", "10", "20", "50", "100"}));
  EXPECT_THROW(log_ticks(0, 10), Error);
}

TEST(VizColour, BluesEndpointsAndClamping) {
  EXPECT_EQ(colormap_color(Colormap::kBlues, 0), "#f7fbff");
  EXPECT_EQ(colormap_color(Colormap::kBlues, 1), "#08306b");
  EXPECT_EQ(colormap_color(Colormap::kBlues, 7), "#08306b");
  EXPECT_EQ(colormap_color(Colormap::kBlues, -3), "#f7fbff");
  EXPECT_EQ(colormap_color(Colormap::kBlues, kNaN), "#f7fbff");
  EXPECT_EQ(colormap_color(Colormap::kRdBu, 0.5), "#f7f7f7");
  EXPECT_EQ(parse_colormap("rdbu"), Colormap::kRdBu);
  EXPECT_THROW(parse_colormap("jet"), Error);
}

// --- the XML checker itself --------------------------------------------------------------------

TEST(VizXml, CheckerAcceptsAndRejects) {
  EXPECT_TRUE(WellFormed("<?xml version=\"1.0\"?>\n<a x=\"1\"><b/>t &amp; &#916;<!-- c --></a>\n"));
  EXPECT_FALSE(xml_well_formed("<a><b></a></b>"));
  EXPECT_FALSE(xml_well_formed("<a x=1/>"));
  EXPECT_FALSE(xml_well_formed("<a x=\"1\" x=\"2\"/>"));
  EXPECT_FALSE(xml_well_formed("<a>x & y</a>"));
  EXPECT_FALSE(xml_well_formed("<a>x < y</a>"));
  EXPECT_FALSE(xml_well_formed("<a/><b/>"));
  EXPECT_FALSE(xml_well_formed("<a>"));
  EXPECT_FALSE(xml_well_formed(""));
}

// --- SVG documents ---------------------------------------------------------------------------

TEST(VizSvg, DocumentIsWellFormedAndEscapesText) {
  SvgDocument svg(200, 100, "title <&>");
  svg.begin_group("g");
  svg.text(10, 20, "a < b & \"c\"", {.size = 12, .anchor = TextAnchor::kMiddle, .rotate = -90});
  Stroke s{"#123456", 1.5, "4,2"};
  svg.line(0, 0, 10, 10, s);
  svg.rect(1, 2, 3, 4, "#fff", &s);
  svg.polyline({0, 1, 2}, {3, 4, 5}, s);
  svg.end_group();
  const std::string out = svg.str();
  EXPECT_TRUE(WellFormed(out));
  EXPECT_NE(out.find("a &lt; b &amp; &quot;c&quot;"), std::string::npos);
  EXPECT_NE(out.find("<title>title &lt;&amp;&gt;</title>"), std::string::npos);
  EXPECT_NE(out.find("stroke-dasharray=\"4,2\""), std::string::npos);
}

TEST(VizSvg, RejectsMisuse) {
  EXPECT_THROW(SvgDocument(0, 10), Error);
  SvgDocument svg(10, 10);
  EXPECT_THROW(svg.end_group(), Error);
  EXPECT_THROW(svg.line(0, kNaN, 1, 1, Stroke{}), Error);
  EXPECT_THROW(svg.polyline({0}, {0}, Stroke{}), Error);
  svg.begin_group("open");
  EXPECT_THROW(svg.str(), Error);  // a group left open
}

TEST(VizLineChart, SeriesLegendTitleAndLabels) {
  Series a{"sin <x>", {}, {}, "", "", false}, b{"cos & x", {}, {}, "", "", false};
  for (int i = 0; i < 60; ++i) {
    a.x.push_back(i), a.y.push_back(std::sin(i * 0.1));
    b.x.push_back(i), b.y.push_back(std::cos(i * 0.1));
  }
  LineChartOptions o;
  o.title = "P & friends";
  o.xlabel = "Row (position)";
  o.ylabel = "value";
  const std::string svg = line_chart_svg({a, b}, o);
  EXPECT_TRUE(WellFormed(svg));
  ExpectNoNonFiniteNumbers(svg);
  EXPECT_EQ(count(svg, "<polyline"), 2u);
  EXPECT_NE(svg.find("sin &lt;x&gt;"), std::string::npos);
  EXPECT_NE(svg.find("cos &amp; x"), std::string::npos);
  EXPECT_NE(svg.find("P &amp; friends"), std::string::npos);
  EXPECT_NE(svg.find("Row (position)"), std::string::npos);
  // The second series takes d2l's dashed magenta.
  EXPECT_NE(svg.find("stroke=\"#bf00bf\""), std::string::npos);
}

TEST(VizLineChart, NaNAndInfinityBreakTheLine) {
  Series s{"gappy", {0, 1, 2, 3, 4, 5, 6}, {0, 1, kNaN, 3, 4, kInf, 6}, "", "", false};
  const std::string svg = line_chart_svg({s}, {});
  EXPECT_TRUE(WellFormed(svg));
  ExpectNoNonFiniteNumbers(svg);
  // [0, 1] and [3, 4] are lines; 6 alone between a gap and the end is a dot.
  EXPECT_EQ(count(svg, "<polyline"), 2u);
  EXPECT_EQ(count(svg, "<circle"), 1u);
}

TEST(VizLineChart, LogAxesSkipNonPositiveValues) {
  Series s{"flops", {1, 10, 100, 1000, 0, -5}, {1e3, 1e5, 0, 1e9, 7, 7}, "", "", true};
  LineChartOptions o;
  o.xscale = o.yscale = Scale::kLog;
  const std::string svg = line_chart_svg({s}, o);
  EXPECT_TRUE(WellFormed(svg));
  ExpectNoNonFiniteNumbers(svg);
  EXPECT_NE(svg.find(">1e9<"), std::string::npos);  // decade labels
  EXPECT_EQ(count(svg, "<circle"), 3u + 1u);        // markers of 3 drawable points + legend
}

TEST(VizLineChart, RejectsBadInput) {
  Series ragged{"r", {1, 2}, {1}, "", "", false};
  EXPECT_THROW(line_chart_svg({ragged}, {}), Error);
  Series nothing{"n", {kNaN}, {1}, "", "", false};
  EXPECT_THROW(line_chart_svg({nothing}, {}), Error);
  EXPECT_THROW(line_chart_svg({}, {}), Error);
  Series ok{"ok", {1, 2}, {1, 2}, "", "", false};
  LineChartOptions o;
  o.xmin = 3;
  o.xmax = 1;
  EXPECT_THROW(line_chart_svg({ok}, o), Error);
  LineChartOptions tiny;
  tiny.width = 10;
  EXPECT_THROW(line_chart_svg({ok}, tiny), Error);
}

TEST(VizLineChart, ConstantSeriesStillDraws) {
  Series flat{"flat", {0, 1, 2}, {5, 5, 5}, "", "", false};
  const std::string svg = line_chart_svg({flat}, {});
  EXPECT_TRUE(WellFormed(svg));
  EXPECT_EQ(count(svg, "<polyline"), 1u);
}

TEST(VizHeatmap, CellsColourBarAndLabels) {
  Matrix m{3, 4, {}};
  for (int i = 0; i < 12; ++i)
    m.values.push_back(i);
  HeatmapOptions o;
  o.title = "P <heat>";
  o.xlabel = "Column";
  o.ylabel = "Row";
  const std::string svg = heatmap_svg(m, o);
  EXPECT_TRUE(WellFormed(svg));
  ExpectNoNonFiniteNumbers(svg);
  EXPECT_NE(svg.find("P &lt;heat&gt;"), std::string::npos);
  EXPECT_NE(svg.find("linearGradient id=\"colorbar\""), std::string::npos);
  // Lowest value gets the map's low end, highest its high end.
  EXPECT_NE(svg.find("fill=\"#f7fbff\""), std::string::npos);
  EXPECT_NE(svg.find("fill=\"#08306b\""), std::string::npos);
  EXPECT_EQ(svg.find("nan-hatch"), std::string::npos);
}

TEST(VizHeatmap, NaNCellsAreHatchedAndOutOfTheScale) {
  Matrix m{2, 2, {0, kNaN, 1, kInf}};
  const std::string svg = heatmap_svg(m, {});
  EXPECT_TRUE(WellFormed(svg));
  ExpectNoNonFiniteNumbers(svg);
  EXPECT_EQ(count(svg, "fill=\"url(#nan-hatch)\""), 2u + 1u);  // two cells + the legend swatch
  EXPECT_NE(svg.find(">NaN<"), std::string::npos);
  // The scale spans the finite values 0..1, so 1 is the darkest colour.
  EXPECT_NE(svg.find("fill=\"#08306b\""), std::string::npos);
  // All cells invalid: still a valid figure.
  EXPECT_TRUE(WellFormed(heatmap_svg(Matrix{1, 2, {kNaN, kNaN}}, {})));
}

TEST(VizHeatmap, GridOfPanelsWithTitles) {
  std::vector<std::vector<HeatmapPanel>> grid(2);
  for (int b = 0; b < 2; ++b) {
    for (int h = 0; h < 3; ++h)
      grid[b].push_back({Matrix{4, 4, std::vector<double>(16, 0.25 * (b + 1))},
                         "batch " + std::to_string(b) + ", head " + std::to_string(h)});
  }
  HeatmapOptions o;
  o.xlabel = "Keys";
  o.ylabel = "Queries";
  o.vmin = 0.0;
  const std::string svg = heatmap_grid_svg(grid, o);
  EXPECT_TRUE(WellFormed(svg));
  EXPECT_EQ(count(svg, "class=\"panel\""), 6u);
  EXPECT_EQ(count(svg, ">Keys<"), 1u);  // one xlabel, one ylabel, one colour bar
  EXPECT_EQ(count(svg, ">Queries<"), 1u);
  EXPECT_EQ(count(svg, "id=\"colorbar\""), 1u);
  EXPECT_NE(svg.find("batch 1, head 2"), std::string::npos);
}

TEST(VizHeatmap, RejectsBadGrids) {
  EXPECT_THROW(heatmap_grid_svg({}, {}), Error);
  Matrix ok{1, 1, {1}};
  EXPECT_THROW(heatmap_grid_svg({{{ok, ""}, {ok, ""}}, {{ok, ""}}}, {}), Error);  // ragged
  EXPECT_THROW(heatmap_svg(Matrix{2, 2, {1, 2, 3}}, {}), Error);                  // short data
  HeatmapOptions o;
  o.vmin = 1;
  o.vmax = 0;
  EXPECT_THROW(heatmap_svg(ok, o), Error);
}

TEST(VizHeatmap, MatrixFromTensorHonoursStrides) {
  Tensor t = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});
  const Matrix m = Matrix::from_tensor(t.transpose(0, 1));  // (3, 2) view
  EXPECT_EQ(m.rows, 3);
  EXPECT_EQ(m.cols, 2);
  EXPECT_EQ(m.values, (std::vector<double>{1, 4, 2, 5, 3, 6}));
  EXPECT_THROW(Matrix::from_tensor(Tensor::zeros({2, 2, 2})), Error);
}

// --- report ----------------------------------------------------------------------------------

TEST(VizReport, EscapesTextAndRendersBlocks) {
  Report r("Tour <1>");
  r.intro("Intro with `code & more`.");
  Section& s = r.section("self-attention", "Self-attention & co");
  s.paragraph("x < y and `a<b>` done").figure("w.svg", "weights <per head>");
  s.table({{"a", "b"}, {{"1", "<2>"}}, "cap"});
  s.preformatted("(2, 4, 100)\n<end>");
  const std::string html = r.html();
  EXPECT_NE(html.find("<title>Tour &lt;1&gt;</title>"), std::string::npos);
  EXPECT_NE(html.find("<code>code &amp; more</code>"), std::string::npos);
  EXPECT_NE(html.find("x &lt; y and <code>a&lt;b&gt;</code> done"), std::string::npos);
  EXPECT_NE(html.find("<img src=\"w.svg\""), std::string::npos);
  EXPECT_NE(html.find("<td>&lt;2&gt;</td>"), std::string::npos);
  EXPECT_NE(html.find("<pre>(2, 4, 100)\n&lt;end&gt;</pre>"), std::string::npos);
  EXPECT_NE(html.find("href=\"#self-attention\""), std::string::npos);
  EXPECT_EQ(r.sections().front().figure_sources(), std::vector<std::string>{"w.svg"});
}

TEST(VizReport, RejectsBadStructure) {
  Report r("t");
  r.section("a", "A");
  EXPECT_THROW(r.section("a", "again"), Error);
  EXPECT_THROW(r.section("Bad Id", "x"), Error);
  EXPECT_THROW(r.section("b", "B").table({{"one", "two"}, {{"only one"}}, ""}), Error);
  EXPECT_EQ(inline_markup("unmatched ` tick"), "unmatched ` tick");
}

// --- files -----------------------------------------------------------------------------------

TEST(VizIo, WritesAtomicallyAndReplaces) {
  TempDir dir;
  const auto path = dir.path / "f.svg";
  write_file_atomic(path.string(), "first");
  write_file_atomic(path.string(), "second");
  EXPECT_EQ(read_file(path), "second");
  EXPECT_EQ(dir.entries(), 1u);  // no temporary file left behind
}

TEST(VizIo, FailureLeavesNothing) {
  TempDir dir;
  const auto missing = dir.path / "no_such_dir" / "f.svg";
  try {
    write_file_atomic(missing.string(), "x");
    FAIL() << "expected attn::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "write_file");
    EXPECT_NE(std::string(e.what()).find("no_such_dir"), std::string::npos);
  }
  // A directory in the way: the rename fails, the temporary file is removed.
  std::filesystem::create_directories(dir.path / "taken");
  EXPECT_THROW(write_file_atomic((dir.path / "taken").string(), "x"), Error);
  EXPECT_EQ(dir.entries(), 1u);
  EXPECT_THROW(write_file_atomic("", "x"), Error);
}

}  // namespace
}  // namespace attn::viz
