// attn pe: the sinusoidal positional encoding matrix P of d2l's PositionalEncoding,
//   P[i, 2j] = sin(i / 10000^(2j/d)),  P[i, 2j+1] = cos(i / 10000^(2j/d)),
// printed (CSV, JSON) and drawn as the chapter draws it: columns 6-9 over 60 positions, and the
// positions x dimensions heatmap. The subcommands `binary` and `relative` (pe_theory.cpp) show
// why the design carries absolute and relative position.
#include "attn/core/error.hpp"
#include "attn/ops/positional.hpp"
#include "tools/attn/commands.hpp"
#include "viz/io.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>

namespace attn::cli {

namespace {

constexpr const char* kOp = "pe";
constexpr int64_t kMaxElements = int64_t{1} << 26;

// Shortest text that reads back as the same value: 9 significant digits at most for float32,
// 17 for float64.
std::string number_text(const Tensor& P, int64_t i) {
  const double v = P.flat(i);
  if (P.dtype() == DType::F32) return fmt::format("{}", static_cast<float>(v));
  return fmt::format("{}", v);
}

}  // namespace

void validate(const PeArgs& a) {
  check(a.positions >= 1, kOp, "--positions must be at least 1, got {}", a.positions);
  check(a.dim >= 1, kOp, "--dim must be at least 1, got {}", a.dim);
  check(a.positions <= kMaxElements / a.dim, kOp, "--positions {} x --dim {} exceeds {} elements",
        a.positions, a.dim, kMaxElements);
  check(a.format.empty() || a.format == "csv" || a.format == "json", kOp,
        "--format must be csv or json, got '{}'", a.format);
  check(a.precision == "d2l" || a.precision == "exact", kOp,
        "--precision must be d2l or exact, got '{}'", a.precision);
  check(!a.columns.empty(), kOp, "--columns needs at least one column");
  for (int64_t c : a.columns) {
    check(c >= 0 && c < a.dim, kOp, "--columns: column {} is outside 0..{} (--dim {})", c,
          a.dim - 1, a.dim);
  }
}

Tensor encoding(const PeArgs& a) {
  validate(a);
  if (a.precision == "d2l") {
    return sinusoidal_encoding(a.positions, a.dim, DType::F32, SinusoidalMode::kMatchD2l);
  }
  return sinusoidal_encoding(a.positions, a.dim, DType::F64, SinusoidalMode::kExact);
}

std::string encoding_csv(const Tensor& P) {
  std::string out;
  const int64_t n = P.dim(0), d = P.dim(1);
  out.reserve(static_cast<size_t>(n * d * 12));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < d; ++k) {
      if (k > 0) out += ',';
      out += number_text(P, i * d + k);
    }
    out += '\n';
  }
  return out;
}

std::string encoding_json(const Tensor& P, const std::string& precision) {
  const int64_t n = P.dim(0), d = P.dim(1);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t i = 0; i < n; ++i) {
    nlohmann::json row = nlohmann::json::array();
    // Through the shortest text, so a float32 prints as 0.84147096, not 0.8414709568023682.
    for (int64_t k = 0; k < d; ++k)
      row.push_back(std::stod(number_text(P, i * d + k)));
    rows.push_back(std::move(row));
  }
  nlohmann::json doc = {
      {"positions", n},         {"dim", d},
      {"precision", precision}, {"dtype", P.dtype() == DType::F32 ? "float32" : "float64"},
      {"shape", {n, d}},        {"data", std::move(rows)}};
  return doc.dump() + "\n";
}

std::string curves_svg(const Tensor& P, const std::vector<int64_t>& columns) {
  const int64_t n = P.dim(0);
  std::vector<viz::Series> series;
  for (int64_t c : columns) {
    viz::Series s;
    s.name = fmt::format("Col {}", c);
    for (int64_t i = 0; i < n; ++i) {
      s.x.push_back(static_cast<double>(i));
      s.y.push_back(P.at({i, c}));
    }
    series.push_back(std::move(s));
  }
  viz::LineChartOptions o;
  o.title = fmt::format("Positional encoding: columns {} over {} positions (d = {})",
                        fmt::join(columns, ", "), n, P.dim(1));
  o.xlabel = "Row (position)";
  o.height = 280;
  return viz::line_chart_svg(series, o);
}

std::string heatmap_svg(const Tensor& P, const std::string& title) {
  viz::HeatmapOptions o;
  o.title = title;
  o.xlabel = "Column (encoding dimension)";
  o.ylabel = "Row (position)";
  o.colormap = viz::Colormap::kBlues;  // as d2l's show_heatmaps(cmap='Blues')
  return viz::heatmap_svg(viz::Matrix::from_tensor(P), o);
}

std::vector<Command> add_pe_command(CLI::App& app) {
  auto args = std::make_shared<PeArgs>();
  CLI::App* pe = app.add_subcommand(
      "pe",
      "Sinusoidal positional encoding P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(...): "
      "print it (--format csv|json; csv when no figure is asked for) and draw it (--curves, "
      "--heatmap). Subcommands: binary, relative.");
  pe->require_subcommand(0, 1);
  pe->add_option("--positions", args->positions, "rows of P (positions 0..N-1)")
      ->capture_default_str();
  pe->add_option("--dim", args->dim, "columns of P (encoding dimension d; odd d ends with a sine)")
      ->capture_default_str();
  pe->add_option("--format", args->format,
                 "print P: csv (one row per position, no header) or json (an object with "
                 "positions, dim, precision, dtype, shape and data)")
      ->check(CLI::IsMember({"csv", "json"}));
  CLI::Option* columns =
      pe->add_option("--columns", args->columns,
                     "columns drawn by --curves, comma-separated (default 6,7,8,9 as the "
                     "chapter; those below --dim, else the first 4)")
          ->delimiter(',');
  pe->add_option("--curves", args->curves, "write the chosen columns over the positions (SVG)")
      ->type_name("FILE")
      ->check(kNonEmptyPath);
  pe->add_option("--heatmap", args->heatmap, "write P as a positions x dimensions heatmap (SVG)")
      ->type_name("FILE")
      ->check(kNonEmptyPath);
  pe->add_option("--precision", args->precision,
                 "d2l: float32 computed op for op as d2l does; exact: float64 angles and sin/cos")
      ->check(CLI::IsMember({"d2l", "exact"}))
      ->capture_default_str();

  auto run_pe = [args, columns] {
    if (columns->count() == 0) {
      // Not chosen: the chapter's 6..9 where they exist, else the first columns.
      std::vector<int64_t> chosen;
      for (int64_t c : {6, 7, 8, 9}) {
        if (c < args->dim) chosen.push_back(c);
      }
      for (int64_t c = 0; chosen.empty() && c < std::min<int64_t>(4, args->dim); ++c)
        chosen.push_back(c);
      if (!chosen.empty()) args->columns = chosen;
    }
    const PeArgs& a = *args;
    const Tensor P = encoding(a);
    // Everything is computed before any file is written, and files before stdout.
    const std::string curves = a.curves.empty() ? "" : curves_svg(P, a.columns);
    const std::string heat =
        a.heatmap.empty()
            ? ""
            : heatmap_svg(P, fmt::format("Positional encoding P ({} positions x {} dimensions)",
                                         a.positions, a.dim));
    if (!a.curves.empty()) viz::write_file_atomic(a.curves, curves);
    if (!a.heatmap.empty()) viz::write_file_atomic(a.heatmap, heat);
    const bool figures = !a.curves.empty() || !a.heatmap.empty();
    if (a.format == "json") {
      print(encoding_json(P, a.precision));
    } else if (a.format == "csv" || !figures) {
      print(encoding_csv(P));
    }
  };

  std::vector<Command> commands = add_pe_theory_commands(*pe);
  commands.push_back({pe, run_pe});
  return commands;
}

}  // namespace attn::cli
