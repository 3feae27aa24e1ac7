// attn compare: the chapter's CNN / RNN / self-attention table (d2l 11.6.2), measured on attn's
// own layers (attn/model/compare.hpp defines every column): FLOPs counted by the layers, wall
// time and the fitted exponents of n and d, sequential operations (critical path of the forward)
// and maximum path lengths (gradient connectivity of stacked layers), beside the chapter's
// O(k n d^2), O(n d^2), O(n^2 d) columns; --svg draws time against n on log-log axes. Also the
// tour's section "CNN vs RNN vs self-attention, measured".
#include "attn/core/error.hpp"
#include "attn/model/compare.hpp"
#include "tools/attn/commands.hpp"
#include "tools/attn/tour.hpp"
#include "viz/io.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>

namespace attn::cli {

using model::CompareOptions;
using model::CompareResult;
using model::SequenceLayer;

struct CompareArgs {
  int64_t n_max = 1024, d = 64, k = 3;
  int repeats = 5;
  bool json = false, quick = false;
  std::string svg;
};

namespace {

constexpr const char* kOp = "compare";

struct Theory {
  const char* complexity;
  const char* sequential;
  const char* path;
};

Theory theory(SequenceLayer layer) {
  switch (layer) {
    case SequenceLayer::kCnn:
      return {"O(k n d^2)", "O(1)", "O(n/k)"};
    case SequenceLayer::kRnn:
      return {"O(n d^2)", "O(n)", "O(n)"};
    case SequenceLayer::kSelfAttention:
      return {"O(n^2 d)", "O(1)", "O(1)"};
  }
  return {"", "", ""};
}

std::string label(SequenceLayer layer, int64_t k) {
  if (layer == SequenceLayer::kCnn) return fmt::format("CNN (k={})", k);
  return model::layer_name(layer);
}

// The path measurement of `layer` (CNN: kernel k) at the largest n measured.
const model::PathPoint* longest_path(const CompareResult& r, SequenceLayer layer, int64_t k) {
  const model::PathPoint* best = nullptr;
  for (const auto& p : r.paths)
    if (p.layer == layer && (layer != SequenceLayer::kCnn || p.k == k) && (!best || p.n > best->n))
      best = &p;
  return best;
}

}  // namespace

CompareOptions compare_options(const CompareArgs& a) {
  check(a.n_max >= 32, kOp,
        "--n-max must be at least 32 (the sweep 16, 32, ... needs two points), "
        "got {}",
        a.n_max);
  check(a.n_max <= 8192, kOp,
        "--n-max {} is above 8192 (self-attention's reference kernel is "
        "O(n^2 d); the sweep would take hours)",
        a.n_max);
  check(a.d >= 4 && a.d <= 1024, kOp, "--d must be in 4..1024, got {}", a.d);
  check(a.k >= 3 && a.k % 2 == 1 && a.k <= 63, kOp, "--k must be odd in 3..63, got {}", a.k);
  check(a.repeats >= 1 && a.repeats <= 1000, kOp, "--repeats must be in 1..1000, got {}",
        a.repeats);
  CompareOptions o;
  o.ns.clear();
  for (int64_t n = 16; n <= a.n_max; n *= 2)
    o.ns.push_back(n);
  o.d = a.d;
  o.ds.clear();
  for (int64_t d = std::max<int64_t>(a.d / 8, 2); d <= 4 * a.d; d *= 2)
    o.ds.push_back(d);
  o.n_for_d = std::min<int64_t>(128, a.n_max);
  o.k = a.k;
  o.path_ks = {3, 5, 9};
  if (std::find(o.path_ks.begin(), o.path_ks.end(), a.k) == o.path_ks.end())
    o.path_ks.push_back(a.k);
  std::sort(o.path_ks.begin(), o.path_ks.end());
  o.path_ns.clear();
  for (int64_t n = 16; n <= a.n_max; n *= 4)
    o.path_ns.push_back(n);
  o.repeats = a.repeats;
  model::validate(o);
  return o;
}

// The chapter's table with the measured columns beside each theoretical one.
viz::Table compare_table(const CompareResult& r) {
  const CompareOptions& o = r.options;
  viz::Table t;
  t.caption = fmt::format(
      "Measured: n = {}..{} at d = {}, d = {}..{} at n = {}; float32 reference kernels, median of "
      "{}; exponents fitted on log-log (time: larger half of each sweep); paths at n = {}",
      o.ns.front(), o.ns.back(), o.d, o.ds.front(), o.ds.back(), o.n_for_d, o.repeats,
      o.path_ns.back());
  // FLOPs: exponents of n and d (exact power laws); time: wall / thread-CPU exponents of n and d.
  t.header = {"layer",
              "complexity",
              "FLOPs ~ n^a d^b",
              "wall time ~ n^a d^b",
              "cpu time ~ n^a d^b",
              "sequential ops",
              "measured",
              "max path",
              "measured: layers / steps"};
  auto pair = [](double a, double b) { return fmt::format("a={:.2f} b={:.2f}", a, b); };
  for (const model::LayerSweep& s : r.layers) {
    const Theory th = theory(s.layer);
    const model::PathPoint* p = longest_path(r, s.layer, o.k);
    t.rows.push_back(
        {label(s.layer, o.k), th.complexity, pair(s.flops_exponent_n, s.flops_exponent_d),
         pair(s.time_exponent_n, s.time_exponent_d),
         pair(s.cpu_time_exponent_n, s.cpu_time_exponent_d), th.sequential,
         fmt::format("{} at n={}, {} at n={}", s.by_n.front().sequential_ops, s.by_n.front().n,
                     s.by_n.back().sequential_ops, s.by_n.back().n),
         th.path, p ? fmt::format("{} / {} at n={}", p->layers, p->steps, p->n) : "-"});
  }
  return t;
}

viz::Table sweep_table(const CompareResult& r) {
  viz::Table t;
  t.caption = fmt::format(
      "FLOPs counted by each layer's forward, median wall and thread-CPU time (d = {}, k = {})",
      r.options.d, r.options.k);
  t.header = {"n"};
  for (const auto& s : r.layers)
    t.header.push_back("GFLOP " + label(s.layer, r.options.k));
  for (const auto& s : r.layers)
    t.header.push_back("ms " + label(s.layer, r.options.k));
  for (const auto& s : r.layers)
    t.header.push_back("cpu ms " + label(s.layer, r.options.k));
  for (size_t i = 0; i < r.options.ns.size(); ++i) {
    std::vector<std::string> row = {fmt::format("{}", r.options.ns[i])};
    for (const auto& s : r.layers)
      row.push_back(fmt::format("{:.4g}", s.by_n[i].flops * 1e-9));
    for (const auto& s : r.layers)
      row.push_back(fmt::format("{:.3g}", s.by_n[i].seconds * 1e3));
    for (const auto& s : r.layers)
      row.push_back(fmt::format("{:.3g}", s.by_n[i].cpu_seconds * 1e3));
    t.rows.push_back(std::move(row));
  }
  return t;
}

viz::Table path_table(const CompareResult& r) {
  viz::Table t;
  t.caption = fmt::format(
      "Path from input 1 to output n (stacks of width {}): layers = fewest stacked layers with "
      "d y_n / d x_1 != 0 (backward of a one-hot gradient); steps = fewest dependent steps on a "
      "path in that stack; CNN theory: ceil((n-1) / ((k-1)/2)) layers",
      r.options.path_d);
  t.header = {"layer", "n", "layers", "steps", "CNN theory"};
  for (const auto& p : r.paths) {
    const int64_t half = (p.k - 1) / 2;
    t.rows.push_back({label(p.layer, p.k), fmt::format("{}", p.n), fmt::format("{}", p.layers),
                      fmt::format("{}", p.steps),
                      p.layer == SequenceLayer::kCnn
                          ? fmt::format("{}", (p.n - 1 + half - 1) / half)
                          : std::string("-")});
  }
  return t;
}

std::string compare_text(const CompareResult& r) {
  return text_table(compare_table(r)) + "\n" + text_table(sweep_table(r)) + "\n" +
         text_table(path_table(r));
}

std::string compare_json(const CompareResult& r) {
  const CompareOptions& o = r.options;
  nlohmann::json j;
  j["options"] = {{"ns", o.ns},           {"d", o.d},           {"ds", o.ds},
                  {"n_for_d", o.n_for_d}, {"k", o.k},           {"path_ks", o.path_ks},
                  {"path_ns", o.path_ns}, {"path_d", o.path_d}, {"repeats", o.repeats}};
  j["layers"] = nlohmann::json::array();
  for (const auto& s : r.layers) {
    const Theory th = theory(s.layer);
    // Sequential operations are measured along the n sweep only.
    auto points = [](const std::vector<model::SweepPoint>& pts, bool with_sequential) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& p : pts) {
        nlohmann::json e = {{"n", p.n},
                            {"d", p.d},
                            {"flops", p.flops},
                            {"seconds", p.seconds},
                            {"cpu_seconds", p.cpu_seconds}};
        if (with_sequential) e["sequential_ops"] = p.sequential_ops;
        a.push_back(std::move(e));
      }
      return a;
    };
    j["layers"].push_back({{"layer", model::layer_name(s.layer)},
                           {"theory",
                            {{"complexity", th.complexity},
                             {"sequential_ops", th.sequential},
                             {"max_path", th.path}}},
                           {"flops_exponent_n", s.flops_exponent_n},
                           {"flops_exponent_d", s.flops_exponent_d},
                           {"time_exponent_n", s.time_exponent_n},
                           {"time_exponent_d", s.time_exponent_d},
                           {"cpu_time_exponent_n", s.cpu_time_exponent_n},
                           {"cpu_time_exponent_d", s.cpu_time_exponent_d},
                           {"by_n", points(s.by_n, true)},
                           {"by_d", points(s.by_d, false)}});
  }
  j["paths"] = nlohmann::json::array();
  for (const auto& p : r.paths)
    j["paths"].push_back({{"layer", model::layer_name(p.layer)},
                          {"k", p.k},
                          {"n", p.n},
                          {"layers", p.layers},
                          {"steps", p.steps}});
  return j.dump(2) + "\n";
}

std::string compare_svg(const CompareResult& r) {
  // Wall time solid with markers; the thread's CPU time dashed in the same colour.
  static const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c"};
  std::vector<viz::Series> series;
  for (size_t i = 0; i < r.layers.size(); ++i) {
    const auto& s = r.layers[i];
    viz::Series wall{label(s.layer, r.options.k) + " (wall)", {}, {}, kColors[i % 3], "", true};
    viz::Series cpu{label(s.layer, r.options.k) + " (cpu)", {}, {}, kColors[i % 3], "5,4", false};
    for (const auto& p : s.by_n) {
      wall.x.push_back(static_cast<double>(p.n));
      wall.y.push_back(p.seconds * 1e3);
      cpu.x.push_back(static_cast<double>(p.n));
      cpu.y.push_back(p.cpu_seconds * 1e3);
    }
    series.push_back(std::move(wall));
    series.push_back(std::move(cpu));
  }
  viz::LineChartOptions o;
  o.title = fmt::format("Forward time vs sequence length (d = {}, float32 reference kernels)",
                        r.options.d);
  o.xlabel = "sequence length n";
  o.ylabel = "median time (ms)";
  o.xscale = viz::Scale::kLog;
  o.yscale = viz::Scale::kLog;
  o.height = 300;
  return viz::line_chart_svg(series, o);
}

std::vector<Command> add_compare_command(CLI::App& app) {
  auto args = std::make_shared<CompareArgs>();
  CLI::App* sub = app.add_subcommand(
      "compare",
      "The chapter's CNN / RNN / self-attention table, measured: FLOPs counted by the layers, "
      "wall time and fitted exponents of n and d, sequential operations and maximum path "
      "lengths, beside O(k n d^2), O(n d^2), O(n^2 d). Definitions: docs/compare.md.");
  CLI::Option* n_max = sub->add_option("--n-max", args->n_max,
                                       "largest n of the sweep 16, 32, ... (paths at 16, 64, ...)")
                           ->capture_default_str();
  CLI::Option* d = sub->add_option("--d", args->d,
                                   "width d of the n sweep (the d sweep spans "
                                   "d/8..4d)")
                       ->capture_default_str();
  sub->add_option("--k", args->k, "CNN kernel size (odd); paths also for k = 3, 5, 9")
      ->capture_default_str();
  CLI::Option* repeats =
      sub->add_option("--repeats", args->repeats, "timed forwards per point (median)")
          ->capture_default_str();
  sub->add_flag("--json", args->json, "print the measurements as JSON instead of tables");
  sub->add_option("--svg", args->svg, "write time vs n on log-log axes (SVG)")->type_name("FILE");
  sub->add_flag("--quick", args->quick,
                "small settings for a run of a few seconds: --n-max 256 --d 32 --repeats 5 "
                "(flags given explicitly win)");
  auto run = [args, n_max, d, repeats] {
    CompareArgs a = *args;
    if (a.quick) {
      if (n_max->count() == 0) a.n_max = 256;
      if (d->count() == 0) a.d = 32;
      if (repeats->count() == 0) a.repeats = 5;
    }
    const CompareResult r = model::run_compare(compare_options(a));
    if (!a.svg.empty()) viz::write_file_atomic(a.svg, compare_svg(r));
    print(a.json ? compare_json(r) : compare_text(r));
  };
  return {{sub, run}};
}

// --- tour section ----------------------------------------------------------------------------

void tour_cnn_rnn_attention(Tour& tour) {
  viz::Section& s =
      tour.report.section("cnn-rnn-attention", "CNN vs RNN vs self-attention, measured");
  s.paragraph(
      "The chapter's comparison table, measured on attn's own layers: a convolution with kernel "
      "size k and 'same' padding (`Conv1d`), a tanh RNN (`RNN`) and self-attention (queries = "
      "keys = values = X, no projections), each mapping n tokens of width d to n tokens of width "
      "d. FLOPs are counted by the layers' kernels (2 per multiply-accumulate); exponents are "
      "least-squares slopes on log-log axes. Sequential operations are the longest chain of "
      "dependent steps in one forward, found by running the layer's kernel on values that track "
      "dependencies instead of numbers. Maximum path length: the fewest stacked layers after "
      "which output n depends on input 1 (the backward of a one-hot gradient at position n), and "
      "the fewest dependent steps on that path.");
  CompareArgs args;
  args.quick = true;
  args.n_max = 256;
  args.d = 32;
  args.repeats = 5;
  const CompareResult r = model::run_compare(compare_options(args));
  s.table(compare_table(r));
  s.figure(tour.write("compare_time.svg", compare_svg(r)),
           "Forward time against n on log-log axes (`attn compare --quick --svg "
           "compare_time.svg`): the CNN and the RNN grow linearly (slope 1), self-attention "
           "quadratically (slope 2), so self-attention, cheapest per token at short lengths when "
           "d is large, falls behind as n grows.");
  s.table(path_table(r));
  s.paragraph(
      "The RNN is connected by one layer, but only through n tanh steps (h_1 -> h_2 -> ... -> "
      "h_n), and they must run one after another: n sequential operations. The CNN's steps run "
      "in parallel, but a path from input 1 to output n needs ceil((n-1)/((k-1)/2)) layers: "
      "O(n/k). Self-attention connects every pair of positions in one layer and one step, at "
      "O(n^2 d) cost. `attn compare` runs the full sweep (n up to 1024, d = 64); its "
      "definitions are in docs/compare.md.");
  // The sweep's nine columns in three blocks of three (FLOPs, wall time, CPU time): one table of
  // all of them is ~150 characters wide, wider than the page.
  const viz::Table sweep = sweep_table(r);
  const size_t L = r.layers.size();
  std::string text = "$ attn compare --quick   (its sweep table, in three parts)\n";
  for (size_t part = 0; part < 3; ++part) {
    viz::Table t;
    t.caption = part == 0 ? sweep.caption : "";
    t.header = {sweep.header[0]};
    for (size_t c = 0; c < L; ++c)
      t.header.push_back(sweep.header[1 + part * L + c]);
    for (const auto& row : sweep.rows) {
      std::vector<std::string> cells = {row[0]};
      for (size_t c = 0; c < L; ++c)
        cells.push_back(row[1 + part * L + c]);
      t.rows.push_back(std::move(cells));
    }
    text += (part ? "\n" : "") + text_table(t);
  }
  s.preformatted(text);
}

}  // namespace attn::cli
