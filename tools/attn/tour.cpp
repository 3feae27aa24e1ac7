// attn tour: runs the chapter's demonstrations and writes DIR/index.html (see tour.hpp).
#include "tools/attn/tour.hpp"

#include "attn/core/error.hpp"
#include "attn/ops/positional.hpp"
#include "tools/attn/commands.hpp"
#include "viz/io.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <system_error>

namespace attn::cli {

std::string Tour::write(const std::string& name, const std::string& content) {
  viz::write_file_atomic((dir / name).string(), content);
  files.push_back(name);
  return name;
}

const std::vector<TourSection>& tour_sections() {
  static const std::vector<TourSection> sections = {
      {"self-attention", tour_self_attention},
      {"encoding-matrix", tour_encoding_matrix},
      {"absolute-position", tour_absolute_position},
      {"relative-position", tour_relative_position},
      {"pe-requirements", tour_pe_requirements},
      {"positional-experiment", tour_positional_experiment},
      {"cnn-rnn-attention", tour_cnn_rnn_attention},
      {"seq2seq", tour_seq2seq},
      // Append later sections here.
  };
  return sections;
}

// --- self-attention --------------------------------------------------------------------------

void tour_self_attention(Tour& tour) {
  viz::Section& s = tour.report.section("self-attention", "Self-attention");
  s.paragraph(
      "In self-attention the queries, keys and values all come from the same sequence. Given "
      "tokens x_1, ..., x_n with every x_i in R^d, the output is a sequence of the same length, "
      "y_i = f(x_i, (x_1, x_1), ..., (x_n, x_n)) in R^d, where f is attention pooling: every "
      "token is a query that attends to all tokens of its sequence as key-value pairs.");

  SelfAttentionArgs args;  // the chapter's example: defaults of `attn self-attention`
  const SelfAttentionResult r = run_self_attention(args);
  s.paragraph(
      "The chapter's example computes self-attention with multi-head attention: "
      "`MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5)` in eval mode, "
      "X = ones of shape (batch_size, num_queries, num_hiddens) = (2, 4, 100), "
      "valid_lens = [3, 2]. The output has the input's shape:");
  s.preformatted(fmt::format("$ attn self-attention\n{}", shape_str(r.output.shape())));
  s.figure(tour.write("self_attention_weights.svg",
                      attention_weights_svg(r, args.num_heads,
                                            "Attention weights, X = ones, valid_lens = [3, 2]")),
           "Attention weights per head (a row per sequence, a column per head; queries down, "
           "keys across). Every token of X is the same vector, so all scores of a query tie and "
           "the weights are uniform over the valid keys: 1/3 on keys 0-2 of sequence 0 (valid "
           "length 3), 1/2 on keys 0-1 of sequence 1 (valid length 2). Masked keys get exactly "
           "0.");

  SelfAttentionArgs random = args;
  random.input = "random";
  const SelfAttentionResult rr = run_self_attention(random);
  s.figure(tour.write("self_attention_weights_random.svg",
                      attention_weights_svg(rr, random.num_heads,
                                            "Attention weights, X random, valid_lens = [3, 2]")),
           "The same layer on a standard normal X (`attn self-attention --input random "
           "--weights-svg w.svg`): each head projects the tokens with its own slice of W_q and "
           "W_k, so the heads attend differently, and still no weight falls on a masked key.");

  s.paragraph(
      "The chapter compares the layers that map a sequence of n tokens (d-dimensional each) to "
      "another such sequence: a convolution with kernel size k, a recurrent layer and "
      "self-attention. Sequential operations prevent parallel computation; a short path between "
      "any two positions makes long-range dependencies easier to learn.");
  s.table({{"layer", "computational complexity", "sequential operations", "maximum path length"},
           {{"CNN", "O(k n d^2)", "O(1)", "O(n/k)"},
            {"RNN", "O(n d^2)", "O(n)", "O(n)"},
            {"self-attention", "O(n^2 d)", "O(1)", "O(1)"}},
           "CNN, RNN and self-attention (from the chapter)"});
  s.paragraph(
      "CNNs and self-attention both compute in parallel and self-attention has the shortest "
      "maximum path length, but its cost grows quadratically with the sequence length, which "
      "makes it slow for very long sequences.");
}

// --- the encoding matrix ---------------------------------------------------------------------

void tour_encoding_matrix(Tour& tour) {
  viz::Section& s = tour.report.section("encoding-matrix", "Positional encoding");
  s.paragraph(
      "Unlike an RNN, which processes tokens one after another, self-attention gives up "
      "sequential operations for parallel computation and so knows nothing of the order of its "
      "inputs. Positional encoding injects absolute or relative position information into the "
      "input: for a sequence X in R^(n x d) the layer outputs X + P, with a positional "
      "embedding matrix P of the same shape, here fixed (not learned):");
  s.preformatted(
      "P[i, 2j]   = sin(i / 10000^(2j/d))\n"
      "P[i, 2j+1] = cos(i / 10000^(2j/d))        i: position (row), 2j, 2j+1: dimension (column)");
  PeArgs args;  // 60 positions, d = 32, columns 6..9: the chapter's figure
  const Tensor P = encoding(args);
  s.figure(tour.write("pe_curves.svg", curves_svg(P, args.columns)),
           "Columns 6 to 9 of P over 60 positions, d = 32 (`attn pe --curves pe_curves.svg`). "
           "Columns 6 and 7 oscillate at a higher frequency than columns 8 and 9; 6 and 7 (and "
           "likewise 8 and 9) are offset from each other because sines and cosines alternate.");
  s.paragraph(fmt::format(
      "The numbers behind the figure are in `{}` (`attn pe --positions 60 --dim 32 --format "
      "csv`: one row per position). They are computed in float32 with d2l's own order of "
      "operations; `--precision exact` computes angles and sin/cos in float64, which differs by "
      "up to ~3e-5 at position 1000 (float32 rounds the angle i / 10000^(2j/d)).",
      tour.write("pe_60x32.csv", encoding_csv(P))));
}

// --- absolute position -----------------------------------------------------------------------

void tour_absolute_position(Tour& tour) {
  viz::Section& s = tour.report.section("absolute-position", "Absolute positional information");
  s.paragraph(
      "Why do frequencies that fall along the encoding dimension carry absolute position? Write "
      "0..7 in binary: the lowest bit alternates with every number, the second lowest every two "
      "numbers and the third every four. Higher bits alternate less often.");
  s.table(binary_table());
  s.table(frequency_table(32));
  s.figure(tour.write("pe_binary.svg", binary_svg(32)),
           "The bits of 0..7 (lowest bit first) beside rows 0..7 of P (`attn pe binary --svg "
           "pe_binary.svg`; blue 1, white 0, red -1): like the lowest bits, the first columns of "
           "P change fastest from row to row, and the later columns barely change over 8 rows.");
  PeArgs args;
  const Tensor P = encoding(args);
  s.figure(tour.write("pe_heatmap.svg",
                      heatmap_svg(P, "Positional encoding P (60 positions x 32 dimensions)")),
           "P as a heatmap, positions down and encoding dimensions across (`attn pe --heatmap "
           "pe_heatmap.svg`). The frequency decreases along the encoding dimension, as it does "
           "from lower to higher bits; being continuous (floats rather than bits) the encoding "
           "is also more space-efficient than a binary representation.");
}

// --- relative position -----------------------------------------------------------------------

void tour_relative_position(Tour& tour) {
  viz::Section& s = tour.report.section("relative-position", "Relative positional information");
  s.paragraph(
      "Besides absolute position, the encoding lets a model attend by relative position: for "
      "any fixed offset delta, the encoding at position i + delta is a linear projection of the "
      "encoding at position i. With omega_j = 1/10000^(2j/d), every column pair maps as");
  s.preformatted(
      "[ cos(delta w_j)  sin(delta w_j)] [p(i, 2j)  ]   [p(i+delta, 2j)  ]\n"
      "[-sin(delta w_j)  cos(delta w_j)] [p(i, 2j+1)] = [p(i+delta, 2j+1)]");
  s.paragraph(
      "by the angle-sum identities, and the 2x2 projection matrix does not depend on the "
      "position i. `attn pe relative --delta K` checks this numerically for every pair j and "
      "every i with i + K < N (here d = 32, N = 1000), in three precisions: float64 throughout; "
      "float32 with d2l's matrix and a float32 rotation; float32 with the matrix and the "
      "rotation each rounded once from float64.");

  constexpr int64_t kDim = 32, kPositions = 1000;
  // Offsets spaced evenly on the figure's log axis (24 per decade), plus those the table lists.
  std::vector<int64_t> deltas = {1, 5, 50, 500, 999};
  for (int k = 0; k < 72; ++k)
    deltas.push_back(std::llround(std::pow(10.0, k / 24.0)));
  std::sort(deltas.begin(), deltas.end());
  deltas.erase(std::unique(deltas.begin(), deltas.end()), deltas.end());
  const std::vector<RelativeCheck> checks = relative_checks(deltas, kDim, kPositions);
  const auto at_delta = [&](int64_t k) -> const RelativeCheck& {
    return *std::find_if(checks.begin(), checks.end(),
                         [k](const RelativeCheck& c) { return c.delta == k; });
  };

  viz::Table t;
  t.caption = "Max |error| of the rotation over all pairs j and positions i (d = 32, N = 1000)";
  t.header = {"delta", "float64", "float32 (d2l's P)", "float32 (rounded once)"};
  for (int64_t k : {1, 5, 50, 500, 999}) {
    const RelativeCheck& c = at_delta(k);
    t.rows.push_back({fmt::format("{}", k), fmt::format("{:.3g}", c.max_f64),
                      fmt::format("{:.3g}", c.max_f32_d2l),
                      fmt::format("{:.3g}", c.max_f32_exact)});
  }
  s.table(std::move(t));

  viz::Series f64{"float64", {}, {}, "", "", false};
  viz::Series f32{"float32, d2l's P", {}, {}, "", "", false};
  viz::Series f32e{"float32, rounded once", {}, {}, "", "", false};
  for (const RelativeCheck& c : checks) {
    const double k = static_cast<double>(c.delta);
    f64.x.push_back(k), f64.y.push_back(c.max_f64);
    f32.x.push_back(k), f32.y.push_back(c.max_f32_d2l);
    f32e.x.push_back(k), f32e.y.push_back(c.max_f32_exact);
  }
  viz::LineChartOptions o;
  o.title = "Rotation check: max error vs offset (d = 32, N = 1000)";
  o.xlabel = "offset delta";
  o.ylabel = "max |error|";
  o.xscale = viz::Scale::kLog;
  o.yscale = viz::Scale::kLog;
  o.height = 300;
  s.figure(tour.write("pe_relative_error.svg", viz::line_chart_svg({f64, f32, f32e}, o)),
           "The identity holds up to rounding, for every offset: in float64 the error stays "
           "around 1e-13, eight orders of magnitude below 1e-5. In float32, d2l's matrix carries "
           "the rounding of its float32 angles (up to about i x 6e-8 radians at position i), "
           "which shows as errors of a few 1e-5; a matrix rounded once from exact values keeps "
           "float32 at its own resolution, about 1e-7.");
  s.preformatted("$ attn pe relative --delta 5\n" + relative_text(at_delta(5)));
}

// --- driver ----------------------------------------------------------------------------------

std::filesystem::path run_tour(const std::filesystem::path& dir,
                               const std::vector<std::string>& skip) {
  for (const std::string& name : skip) {
    bool known = false;
    for (const TourSection& section : tour_sections())
      known |= name == section.id;
    check(known, "tour", "--skip {}: no such section", name);
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  check(!ec, "tour", "cannot create directory '{}': {}", dir.string(), ec.message());
  check(std::filesystem::is_directory(dir), "tour", "'{}' is not a directory", dir.string());

  Tour tour;
  tour.dir = dir;
  tour.report.intro(
      "Every number and figure on this page was computed just now by `attn tour`, with the attn "
      "C++ library, following the chapter \"Self-attention and positional encoding\" of Dive "
      "into Deep Learning (d2l, 11.6). Each section names the `attn` command that reproduces "
      "its part.");
  for (const TourSection& section : tour_sections())
    if (std::find(skip.begin(), skip.end(), section.id) == skip.end()) section.build(tour);
  const std::filesystem::path index = dir / "index.html";
  // index.html last: it only appears once every file it references exists.
  tour.report.write(index.string());
  return index;
}

std::vector<Command> add_tour_command(CLI::App& app) {
  auto out = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "tour",
      "Run every demonstration (self-attention, encoding curves and heatmap, binary analogy, "
      "relative-position check) into DIR and write DIR/index.html explaining each.");
  sub->add_option("--out,-o", *out, "output directory (created if missing)")
      ->required()
      ->type_name("DIR")
      ->check(kNonEmptyPath);
  auto skip = std::make_shared<std::vector<std::string>>();
  sub->add_option("--skip", *skip,
                  "leave out a section by name (repeatable): self-attention, encoding-matrix, "
                  "absolute-position, relative-position, pe-requirements, positional-experiment "
                  "(trains models, about a minute), cnn-rnn-attention, seq2seq (trains an "
                  "encoder-decoder, under a minute)")
      ->type_name("SECTION");
  auto run = [out, skip] {
    const auto start = std::chrono::steady_clock::now();
    const std::filesystem::path index = run_tour(*out, *skip);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    print(fmt::format("wrote {} ({} sections) in {:.2f} s\n", index.string(),
                      tour_sections().size(), seconds));
  };
  return {{sub, run}};
}

}  // namespace attn::cli
