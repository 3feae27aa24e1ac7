// attn self-attention: d2l's example of self-attention with multi-head attention.
//
//   attention = MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5); attention.eval()
//   X = ones(2, 4, 100); valid_lens = [3, 2]
//   attention(X, X, X, valid_lens).shape  ->  (2, 4, 100)
//
// Queries, keys and values are all X: every token attends to every (unmasked) token of its own
// sequence, y_i = f(x_i, (x_1, x_1), ..., (x_n, x_n)), and the output has the input's shape.
#include "attn/core/context.hpp"
#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "attn/nn/attention.hpp"
#include "tools/attn/commands.hpp"
#include "viz/io.hpp"

#include <fmt/ranges.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>

namespace attn::cli {

namespace {

constexpr const char* kOp = "self-attention";
// Keeps a typo ("--batch-size 1000000") from allocating gigabytes: 64 Mi elements per tensor.
constexpr int64_t kMaxElements = int64_t{1} << 26;

// Parses "3 2" (B,), "3,2", "1 2 3 4; 4 3 2 1" (B, T) rows separated by ';', or "none".
Tensor parse_valid_lens(const std::string& text, int64_t B, int64_t T) {
  std::string trimmed = text;
  trimmed.erase(0, trimmed.find_first_not_of(" \t"));
  trimmed.erase(trimmed.find_last_not_of(" \t") + 1);
  if (trimmed.empty() || trimmed == "none") return {};

  std::vector<std::vector<double>> rows;
  std::stringstream by_row(trimmed);
  std::string row_text;
  while (std::getline(by_row, row_text, ';')) {
    for (char& c : row_text) {
      if (c == ',') c = ' ';
    }
    std::vector<double> row;
    std::stringstream by_value(row_text);
    std::string token;
    while (by_value >> token) {
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(token, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      check(used == token.size() && !std::isnan(v), kOp,
            "--valid-lens: '{}' is not a number (expected e.g. \"3 2\" or \"1 2 3 4; 4 3 2 1\")",
            token);
      row.push_back(v);
    }
    rows.push_back(std::move(row));
  }
  bool integral = true;
  std::vector<double> flat;
  for (const auto& r : rows) {
    for (double v : r) {
      integral = integral && v == std::floor(v) && std::abs(v) < 1e15;
      flat.push_back(v);
    }
  }
  const DType dtype = integral ? DType::I64 : DType::F32;
  if (rows.size() == 1) {
    check(static_cast<int64_t>(flat.size()) == B, kOp,
          "--valid-lens has {} value(s) ({}) but --batch-size is {}: give one length per "
          "sequence, {} rows of --num-queries lengths separated by ';', or 'none'",
          flat.size(), trimmed, B, B);
    return Tensor::from_vector(flat, {B}, dtype);
  }
  check(static_cast<int64_t>(rows.size()) == B, kOp,
        "--valid-lens has {} rows but --batch-size is {} (2-D lengths are (B, T))", rows.size(), B);
  for (const auto& r : rows) {
    check(static_cast<int64_t>(r.size()) == T, kOp,
          "--valid-lens row '{}' has {} value(s), expected --num-queries = {}",
          fmt::format("{}", fmt::join(r, " ")), r.size(), T);
  }
  return Tensor::from_vector(flat, {B, T}, dtype);
}

}  // namespace

void validate(const SelfAttentionArgs& a) {
  check(a.batch_size >= 1, kOp, "--batch-size must be at least 1, got {}", a.batch_size);
  check(a.num_queries >= 1, kOp, "--num-queries must be at least 1, got {}", a.num_queries);
  check(a.num_hiddens >= 1, kOp, "--num-hiddens must be at least 1, got {}", a.num_hiddens);
  check(a.num_heads >= 1, kOp, "--num-heads must be at least 1, got {}", a.num_heads);
  check(a.num_hiddens % a.num_heads == 0, kOp,
        "--num-hiddens {} is not divisible by --num-heads {} (each head gets num_hiddens / "
        "num_heads features)",
        a.num_hiddens, a.num_heads);
  check(a.dropout >= 0 && a.dropout <= 1, kOp, "--dropout must be in [0, 1], got {}", a.dropout);
  // Products checked by division so they cannot overflow.
  check(a.num_hiddens <= kMaxElements / a.num_queries / a.batch_size, kOp,
        "--batch-size {} x --num-queries {} x --num-hiddens {} exceeds {} elements", a.batch_size,
        a.num_queries, a.num_hiddens, kMaxElements);
  check(a.num_queries <= kMaxElements / a.num_queries / a.num_heads / a.batch_size, kOp,
        "attention weights of {} x {} heads x {} x {} exceed {} elements", a.batch_size,
        a.num_heads, a.num_queries, a.num_queries, kMaxElements);
  parse_valid_lens(a.valid_lens, a.batch_size, a.num_queries);
}

SelfAttentionResult run_self_attention(const SelfAttentionArgs& a) {
  validate(a);
  const int64_t B = a.batch_size, T = a.num_queries, E = a.num_hiddens;
  Context ctx;
  ctx.seed = a.seed;

  SelfAttentionResult r;
  r.valid_lens = parse_valid_lens(a.valid_lens, B, T);
  if (a.input == "ones") {
    r.X = Tensor::full({B, T, E}, 1.0);
  } else {
    check(a.input == "random", kOp, "--input must be ones or random, got '{}'", a.input);
    r.X = Tensor::empty({B, T, E});
    Rng rng(a.seed, /*stream=*/1);  // stream 0 is left to parameter initialisation
    for (int64_t i = 0; i < r.X.numel(); ++i)
      r.X.set_flat(i, rng.normal());
  }

  nn::MultiHeadAttention attention(E, a.num_heads, a.dropout, /*bias=*/false, DType::F32, a.seed);
  attention.train(a.train);
  // Self-attention: queries, keys and values are the same tensor.
  r.output = attention.forward(ctx, r.X, r.X, r.X, r.valid_lens);
  r.weights = attention.attention_weights();
  return r;
}

std::string attention_weights_svg(const SelfAttentionResult& r, int64_t num_heads,
                                  const std::string& title) {
  check(r.weights.defined() && r.weights.ndim() == 3, kOp, "no attention weights to draw");
  const int64_t B = r.weights.dim(0) / num_heads;
  std::vector<std::vector<viz::HeatmapPanel>> grid(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < num_heads; ++h) {
      // d2l's weights are (B*H, T, S) with batch index b*H + h.
      grid[static_cast<size_t>(b)].push_back(
          {viz::Matrix::from_tensor(r.weights.select(0, b * num_heads + h)),
           fmt::format("batch {}, head {}", b, h)});
    }
  }
  viz::HeatmapOptions o;
  o.title = title;
  o.xlabel = "Keys";
  o.ylabel = "Queries";
  o.colorbar_label = "attention weight";
  o.vmin = 0.0;
  return viz::heatmap_grid_svg(grid, o);
}

std::vector<Command> add_self_attention_command(CLI::App& app) {
  auto args = std::make_shared<SelfAttentionArgs>();
  CLI::App* sub = app.add_subcommand(
      "self-attention",
      "Run d2l's self-attention example: MultiHeadAttention(num_hiddens, num_heads, dropout) in "
      "eval mode on X (batch, queries, num_hiddens) with queries = keys = values = X; prints the "
      "output shape, e.g. (2, 4, 100).");
  sub->add_option("--batch-size", args->batch_size, "sequences per batch (B)")
      ->capture_default_str();
  sub->add_option("--num-queries", args->num_queries, "tokens per sequence (T)")
      ->capture_default_str();
  sub->add_option("--num-hiddens", args->num_hiddens, "model width E = heads x head dim")
      ->capture_default_str();
  sub->add_option("--num-heads", args->num_heads, "attention heads H (must divide E)")
      ->capture_default_str();
  sub->add_option("--valid-lens", args->valid_lens,
                  "keys each sequence may attend to: B values (\"3 2\"), B rows of T values "
                  "separated by ';' (\"1 2 3 4; 4 3 2 1\"), or none")
      ->capture_default_str();
  sub->add_option("--dropout", args->dropout,
                  "dropout on the attention weights (acts only with --train)")
      ->capture_default_str();
  sub->add_option("--seed", args->seed, "seeds the parameters, the random input and dropout")
      ->capture_default_str();
  sub->add_option("--input", args->input, "X: ones (as d2l) or random (standard normal)")
      ->check(CLI::IsMember({"ones", "random"}))
      ->capture_default_str();
  sub->add_flag("--train", args->train,
                "training mode: dropout acts on the weights (d2l's example uses eval mode)");
  sub->add_option("--weights-svg", args->weights_svg,
                  "write the attention weights as heatmaps: a row per sequence, a column per head")
      ->type_name("FILE")
      ->check(kNonEmptyPath);

  auto run = [args] {
    const SelfAttentionArgs& a = *args;
    SelfAttentionResult r = run_self_attention(a);
    if (!a.weights_svg.empty()) {
      viz::write_file_atomic(
          a.weights_svg,
          attention_weights_svg(
              r, a.num_heads,
              fmt::format("Attention weights ({} input, valid_lens {})", a.input, a.valid_lens)));
    }
    print(fmt::format("{}\n", shape_str(r.output.shape())));
    print(fmt::format(
        "self-attention: X {} is queries, keys and values of MultiHeadAttention(num_hiddens={}, "
        "num_heads={}, dropout={}) in {} mode; the output has the input's shape; weights {}\n",
        shape_str(r.X.shape()), a.num_hiddens, a.num_heads, a.dropout, a.train ? "train" : "eval",
        shape_str(r.weights.shape())));
    if (!a.weights_svg.empty()) print(fmt::format("wrote {}\n", a.weights_svg));
  };
  return {{sub, run}};
}

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
}

}  // namespace attn::cli
