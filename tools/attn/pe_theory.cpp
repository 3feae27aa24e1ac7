// attn pe binary and attn pe relative: the chapter's two arguments for the sinusoidal design.
//
// Absolute position (binary analogy): in 0..7 written in binary, bit 0 flips every number,
// bit 1 every 2, bit 2 every 4; higher bits alternate less often. Column pair j of P turns at
// omega_j = 1 / 10000^(2j/d) radians per position, so the frequency falls along the encoding
// dimension the same way, continuously instead of in 0/1 steps.
//
// Relative position: with omega_j fixed, for any offset K
//   [ cos(K w)  sin(K w)] [p_{i,2j}  ]   [sin(i w)cos(K w) + cos(i w)sin(K w)]   [p_{i+K,2j}  ]
//   [-sin(K w)  cos(K w)] [p_{i,2j+1}] = [cos(i w)cos(K w) - sin(i w)sin(K w)] = [p_{i+K,2j+1}]
// by the angle-sum identities: the 2x2 projection does not depend on the position i.
#include "attn/core/error.hpp"
#include "attn/ops/positional.hpp"
#include "tools/attn/commands.hpp"
#include "viz/io.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>

namespace attn::cli {

std::string text_table(const viz::Table& t) {
  std::vector<size_t> width(t.header.size(), 0);
  const auto chars = [](const std::string& s) {
    size_t n = 0;
    for (char c : s)
      n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;  // code points
    return n;
  };
  for (size_t k = 0; k < t.header.size(); ++k)
    width[k] = chars(t.header[k]);
  for (const auto& row : t.rows) {
    for (size_t k = 0; k < row.size() && k < width.size(); ++k)
      width[k] = std::max(width[k], chars(row[k]));
  }
  std::string out;
  if (!t.caption.empty()) out += t.caption + "\n";
  const auto line = [&](const std::vector<std::string>& cells) {
    std::string l = " ";
    for (size_t k = 0; k < cells.size(); ++k) {
      l += ' ' + cells[k];
      if (k + 1 < cells.size()) l.append(width[k] - chars(cells[k]) + 1, ' ');
    }
    out += l + "\n";
  };
  line(t.header);
  for (const auto& row : t.rows)
    line(row);
  return out;
}

// --- binary ----------------------------------------------------------------------------------

viz::Table binary_table() {
  viz::Table t;
  t.caption = "0..7 in binary: bit k flips every 2^k numbers (one full cycle every 2^(k+1))";
  t.header = {"i", "binary", "bit 0 (flips every 1)", "bit 1 (every 2)", "bit 2 (every 4)"};
  for (int i = 0; i < 8; ++i) {
    t.rows.push_back({fmt::format("{}", i), fmt::format("{:03b}", i), fmt::format("{}", i & 1),
                      fmt::format("{}", (i >> 1) & 1), fmt::format("{}", (i >> 2) & 1)});
  }
  return t;
}

viz::Table frequency_table(int64_t dim) {
  viz::Table t;
  t.caption = fmt::format(
      "Encoding with d = {}: column pair j turns at omega_j = 1/10000^(2j/d) radians per "
      "position, one cycle every 2*pi/omega_j positions",
      dim);
  t.header = {"j", "columns", "omega_j", "period (positions)"};
  for (int64_t j = 0; 2 * j < dim; ++j) {
    const double w = sinusoidal_frequency(j, dim);
    const std::string columns =
        2 * j + 1 < dim ? fmt::format("{}, {}", 2 * j, 2 * j + 1) : fmt::format("{}", 2 * j);
    t.rows.push_back({fmt::format("{}", j), columns, fmt::format("{:.6g}", w),
                      fmt::format("{:.4g}", 2 * std::numbers::pi / w)});
  }
  return t;
}

std::string binary_tables_text(int64_t dim) {
  return text_table(binary_table()) + "\n" + text_table(frequency_table(dim)) +
         "\nLower bits flip fastest, higher bits slowest; likewise the first columns of P "
         "oscillate "
         "fastest and the frequency falls along the encoding dimension.\n";
}

std::string binary_svg(int64_t dim) {
  viz::Matrix bits{8, 3, {}};
  for (int i = 0; i < 8; ++i) {
    for (int k = 0; k < 3; ++k)
      bits.values.push_back((i >> k) & 1);  // lowest bit first
  }
  const Tensor P = sinusoidal_encoding(8, dim);
  viz::HeatmapOptions o;
  o.title = "Bits of 0..7 (lowest first) beside rows 0..7 of P";
  o.xlabel = "Column (bit / encoding dimension)";
  o.ylabel = "Row (number / position)";
  o.vmin = -1.0;
  o.vmax = 1.0;
  o.cell_size = 16;
  // Diverging: 0 bits and P = 0 white, 1 bits and P = 1 blue, P = -1 red.
  o.colormap = viz::Colormap::kRdBu;
  return viz::heatmap_grid_svg(
      {{{bits, "i in binary"},
        {viz::Matrix::from_tensor(P), fmt::format("P[0:8, :], d = {}", dim)}}},
      o);
}

// --- relative --------------------------------------------------------------------------------

std::vector<RelativeCheck> relative_checks(const std::vector<int64_t>& deltas, int64_t dim,
                                           int64_t positions) {
  const char* op = "pe relative";
  check(dim >= 2, op, "--dim must be at least 2 (one sine/cosine pair), got {}", dim);
  check(positions >= 2, op, "--positions must be at least 2, got {}", positions);
  check(positions <= (int64_t{1} << 26) / dim, op, "--positions {} x --dim {} is too large",
        positions, dim);
  const Tensor p64 = sinusoidal_encoding(positions, dim, DType::F64, SinusoidalMode::kExact);
  const Tensor p32 = sinusoidal_encoding(positions, dim, DType::F32, SinusoidalMode::kMatchD2l);
  const Tensor p32e = sinusoidal_encoding(positions, dim, DType::F32, SinusoidalMode::kExact);
  const double* P64 = p64.contiguous().data<double>();
  const Tensor c32 = p32.contiguous(), c32e = p32e.contiguous();
  const float* P32 = c32.data<float>();
  const float* P32e = c32e.data<float>();

  std::vector<RelativeCheck> out;
  for (int64_t K : deltas) {
    check(K > -positions && K < positions, op,
          "--delta {} leaves no position pair: need |delta| < --positions {}", K, positions);
    RelativeCheck r;
    r.delta = K, r.dim = dim, r.positions = positions;
    const int64_t i0 = std::max<int64_t>(0, -K), i1 = positions - std::max<int64_t>(0, K);
    for (int64_t j = 0; 2 * j + 1 < dim; ++j) {
      const int64_t c = 2 * j;
      const double w = sinusoidal_frequency(j, dim);
      // float64: the rotation by K*w applied to exact values.
      const double cs = std::cos(static_cast<double>(K) * w),
                   sn = std::sin(static_cast<double>(K) * w);
      // float32 as d2l would: angle K / 10000^(2j/d) in float32, products in float32.
      const float den = std::pow(10000.0f, static_cast<float>(c) / static_cast<float>(dim));
      const float angle = static_cast<float>(K) / den;
      const float cs32 = std::cos(angle), sn32 = std::sin(angle);
      // float32 from exact values: the rotation rounded once, products in float32.
      const float cs32e = static_cast<float>(cs), sn32e = static_cast<float>(sn);
      double e64 = 0, e32 = 0, e32e = 0;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t a = i * dim + c, b = (i + K) * dim + c;
        e64 = std::max({e64, std::abs(cs * P64[a] + sn * P64[a + 1] - P64[b]),
                        std::abs(-sn * P64[a] + cs * P64[a + 1] - P64[b + 1])});
        const float x = cs32 * P32[a] + sn32 * P32[a + 1], y = -sn32 * P32[a] + cs32 * P32[a + 1];
        e32 = std::max({e32, static_cast<double>(std::abs(x - P32[b])),
                        static_cast<double>(std::abs(y - P32[b + 1]))});
        const float xe = cs32e * P32e[a] + sn32e * P32e[a + 1];
        const float ye = -sn32e * P32e[a] + cs32e * P32e[a + 1];
        e32e = std::max({e32e, static_cast<double>(std::abs(xe - P32e[b])),
                         static_cast<double>(std::abs(ye - P32e[b + 1]))});
      }
      r.pairs.push_back({j, w, e64, e32, e32e});
      r.max_f64 = std::max(r.max_f64, e64);
      r.max_f32_d2l = std::max(r.max_f32_d2l, e32);
      r.max_f32_exact = std::max(r.max_f32_exact, e32e);
    }
    out.push_back(std::move(r));
  }
  return out;
}

RelativeCheck relative_check(int64_t delta, int64_t dim, int64_t positions) {
  return relative_checks({delta}, dim, positions).front();
}

std::string relative_text(const RelativeCheck& r) {
  viz::Table t;
  t.caption = fmt::format(
      "P[i+K] = R(K omega_j) P[i] for every column pair j: K = {}, d = {}, N = {} ({} positions "
      "i); max |error| per pair",
      r.delta, r.dim, r.positions, r.positions - std::abs(r.delta));
  t.header = {"j", "omega_j", "float64", "float32 (d2l)", "float32 (exact)"};
  for (const auto& p : r.pairs) {
    t.rows.push_back({fmt::format("{}", p.j), fmt::format("{:.6g}", p.omega),
                      fmt::format("{:.3g}", p.err_f64), fmt::format("{:.3g}", p.err_f32_d2l),
                      fmt::format("{:.3g}", p.err_f32_exact)});
  }
  return text_table(t) +
         fmt::format(
             "max error float64: {:.3g}\n"
             "max error float32: {:.3g} (d2l's float32 P and a float32 rotation)\n"
             "max error float32 exact: {:.3g} (P and rotation rounded once from float64)\n",
             r.max_f64, r.max_f32_d2l, r.max_f32_exact);
}

std::string relative_json(const RelativeCheck& r) {
  nlohmann::json pairs = nlohmann::json::array();
  for (const auto& p : r.pairs) {
    pairs.push_back({{"j", p.j},
                     {"omega", p.omega},
                     {"float64", p.err_f64},
                     {"float32", p.err_f32_d2l},
                     {"float32_exact", p.err_f32_exact}});
  }
  nlohmann::json doc = {{"delta", r.delta},
                        {"dim", r.dim},
                        {"positions", r.positions},
                        {"max_error_float64", r.max_f64},
                        {"max_error_float32", r.max_f32_d2l},
                        {"max_error_float32_exact", r.max_f32_exact},
                        {"pairs", std::move(pairs)}};
  return doc.dump(2) + "\n";
}

std::vector<Command> add_pe_theory_commands(CLI::App& pe) {
  struct BinaryArgs {
    int64_t dim = 32;
    std::string svg;
  };
  auto bargs = std::make_shared<BinaryArgs>();
  CLI::App* binary = pe.add_subcommand(
      "binary",
      "Absolute position: 0..7 in binary (higher bits alternate less often) beside the "
      "frequency of each column pair of P (falling along the encoding dimension).");
  binary->add_option("--dim", bargs->dim, "encoding dimension d")->capture_default_str();
  binary->add_option("--svg", bargs->svg, "write the bits of 0..7 beside rows 0..7 of P (SVG)")
      ->type_name("FILE")
      ->check(kNonEmptyPath);
  auto run_binary = [bargs] {
    check(bargs->dim >= 1 && bargs->dim <= 4096, "pe binary", "--dim must be in 1..4096, got {}",
          bargs->dim);
    const std::string text = binary_tables_text(bargs->dim);
    if (!bargs->svg.empty()) viz::write_file_atomic(bargs->svg, binary_svg(bargs->dim));
    print(text);
  };

  struct RelativeArgs {
    int64_t delta = 0, dim = 32, positions = 1000;
    bool json = false;
  };
  auto rargs = std::make_shared<RelativeArgs>();
  CLI::App* relative = pe.add_subcommand(
      "relative",
      "Relative position: check that the 2x2 rotation by K*omega_j maps (P[i,2j], P[i,2j+1]) to "
      "(P[i+K,2j], P[i+K,2j+1]) for every i; prints the max error in float64 and float32.");
  relative->add_option("--delta,-K", rargs->delta, "the offset K")->required();
  relative->add_option("--dim", rargs->dim, "encoding dimension d")->capture_default_str();
  relative->add_option("--positions", rargs->positions, "positions N")->capture_default_str();
  relative->add_flag("--json", rargs->json, "print the result as JSON");
  auto run_relative = [rargs] {
    const RelativeCheck r = relative_check(rargs->delta, rargs->dim, rargs->positions);
    print(rargs->json ? relative_json(r) : relative_text(r));
  };
  return {{binary, run_binary}, {relative, run_relative}};
}

}  // namespace attn::cli
