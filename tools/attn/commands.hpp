// The `attn` command line: one function per subcommand, plus the computations they share with
// `attn tour` (which calls the same functions and collects their figures into an HTML page).
//
// Error convention: a bad flag or value throws attn::Error; main() prints "attn: <what>" as one
// line on stderr and exits with status 2. Files are written atomically (viz::write_file_atomic)
// after everything else succeeded, so a failed run leaves no output file.
#pragma once

#include "attn/core/tensor.hpp"
#include "viz/chart.hpp"
#include "viz/report.hpp"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace attn::cli {

// A registered subcommand and what to run when it is the one given. Nested subcommands come
// before their parent in the lists below, so main() runs the deepest one parsed.
struct Command {
  CLI::App* app;
  std::function<void()> run;
};

// --- attn self-attention ---------------------------------------------------------------------

struct SelfAttentionArgs {
  int64_t batch_size = 2, num_queries = 4, num_hiddens = 100, num_heads = 5;
  std::string valid_lens = "3 2";  // "3 2" (B,), "1 2 3 4; 4 3 2 1" (B, T), or "none"
  double dropout = 0.5;
  uint64_t seed = 0;
  std::string input = "ones";  // ones | random (standard normal, seeded)
  bool train = false;          // d2l calls attention.eval(); --train makes dropout act
  std::string weights_svg;
};

struct SelfAttentionResult {
  Tensor X;           // (B, T, E) the input, used as queries, keys and values
  Tensor valid_lens;  // undefined, (B,) or (B, T)
  Tensor output;      // (B, T, E)
  Tensor weights;     // (B*H, T, T) pre-dropout, batch index b*H + h
};

void validate(const SelfAttentionArgs& args);
SelfAttentionResult run_self_attention(const SelfAttentionArgs& args);
// Heatmap grid of the weights: one row of panels per batch element, one column per head.
std::string attention_weights_svg(const SelfAttentionResult& result, int64_t num_heads,
                                  const std::string& title);
std::vector<Command> add_self_attention_command(CLI::App& app);

// --device cpu|cuda on a subcommand. Only cpu runs today: cuda fails at parse time with one line,
// naming the build option in a build without CUDA, and saying what is missing in one with it
// (docs/gpu.md).
// --device cpu|cuda. With `device` null, cuda stops with one line (the command's GPU path is not
// written); else the name is stored there for the command to use.
void add_device_option(CLI::App* sub, const std::string& command, std::string* device = nullptr);

// --- attn pe -------------------------------------------------------------------------------

struct PeArgs {
  int64_t positions = 60, dim = 32;
  std::string format;  // "", csv, json
  std::vector<int64_t> columns = {6, 7, 8, 9};
  std::string curves, heatmap;
  std::string precision = "d2l";  // d2l: float32 as d2l computes it; exact: float64
};

void validate(const PeArgs& args);
// (positions, dim): F32 in d2l mode, F64 in exact mode.
Tensor encoding(const PeArgs& args);
std::string encoding_csv(const Tensor& P);
std::string encoding_json(const Tensor& P, const std::string& precision);
// The chapter's first figure: the chosen columns of P over the positions.
std::string curves_svg(const Tensor& P, const std::vector<int64_t>& columns);
// The chapter's heatmap: positions down, encoding dimensions across.
std::string heatmap_svg(const Tensor& P, const std::string& title);

// --- attn pe binary --------------------------------------------------------------------------

// The text tables: 0..7 in binary with each bit's period, and the period of each column pair
// of a d-wide encoding.
std::string binary_tables_text(int64_t dim);
viz::Table binary_table();
viz::Table frequency_table(int64_t dim);
// Side by side: the bits of 0..7 (lowest bit first) and rows 0..7 of P.
std::string binary_svg(int64_t dim);

// --- attn pe relative ------------------------------------------------------------------------

struct RelativeCheck {
  int64_t delta = 0, dim = 0, positions = 0;
  struct Pair {
    int64_t j;
    double omega;
    double err_f64, err_f32_d2l, err_f32_exact;
  };
  std::vector<Pair> pairs;
  double max_f64 = 0, max_f32_d2l = 0, max_f32_exact = 0;
};

// For each frequency w_j applies [[cos(K w_j), sin(K w_j)], [-sin(K w_j), cos(K w_j)]] to
// (P[i, 2j], P[i, 2j+1]) and measures the distance to (P[i+K, 2j], P[i+K, 2j+1]) over every i
// with 0 <= i, i + K < N. Three precisions: float64 throughout; float32 with d2l's P; float32
// with P rounded once from exact values.
RelativeCheck relative_check(int64_t delta, int64_t dim, int64_t positions);
std::string relative_text(const RelativeCheck& check);
std::string relative_json(const RelativeCheck& check);

// relative_check for several offsets, computing the three encodings once.
std::vector<RelativeCheck> relative_checks(const std::vector<int64_t>& deltas, int64_t dim,
                                           int64_t positions);

// `attn pe` and, under it, `binary` and `relative` (pe_theory.cpp).
std::vector<Command> add_pe_command(CLI::App& app);
std::vector<Command> add_pe_theory_commands(CLI::App& pe);

// A table as aligned text columns (for the terminal).
std::string text_table(const viz::Table& table);

// --- attn train, attn experiment positional (cmd_train.cpp, cmd_experiment.cpp) ------------

std::vector<Command> add_train_command(CLI::App& app);
std::vector<Command> add_experiment_command(CLI::App& app);
// attn data (cmd_data.cpp): the generated text tasks written as TSV files for --task tsv.
std::vector<Command> add_data_command(CLI::App& app);

// --- attn train --task translate|dates|copy|reverse (cmd_train_seq2seq.cpp) -----------------

// The flags of `attn train` (cmd_train.cpp parses them and merges a resumed run's arguments), for
// the encoder tasks and the sequence-to-sequence ones alike; a sequence-to-sequence run reads all
// but tag_column and precision, and its max_len is num_steps (d2l): the model's length limit.
struct TrainArgs {
  std::string task = "shift";  // shift | sorted | tsv | conllu
  std::string device = "cpu";  // cpu | cuda (encoder tasks)
  std::string data, eval_data;
  std::string tag_column = "upos";
  int64_t length = 16, symbols = 8, max_len = 256, min_freq = 1;
  std::string pe = "sinusoidal";
  int64_t num_hiddens = 32, ffn_num_hiddens = 64, num_heads = 2, num_blks = 2;
  double dropout = 0.0;
  int64_t steps = 1000, batch_size = 32;
  double lr = 3e-3, weight_decay = 0.01, clip = 1.0;
  uint64_t seed = 0;
  int threads = 0;
  int64_t eval_every = 100, eval_examples = 512, checkpoint_every = 0;
  // Generated encoder tasks: draw `bucket` batches' worth of sequences at once and hand them out
  // sorted by length, so that each batch pads to little more than its own lengths (1: off). The
  // CLI's default is kDefaultBucket for shift and sorted, 1 for the other tasks.
  int64_t bucket = 1;
  static constexpr int64_t kDefaultBucket = 8;
  std::string metrics, curve, checkpoint, resume;
  // Not among the result arguments: a checkpoint holds float32 parameters in either precision,
  // so a run may resume in the other one. A resume without --precision keeps the checkpoint's.
  std::string precision = "fp32";
  bool precision_given = false;
};

bool is_seq2seq_task(const std::string& task);

// What `attn train --precision bf16` prints on a CPU without AVX512-BF16 (cpu_bf16_native()).
inline constexpr const char* kNoBf16Note =
    "note: this CPU has no bfloat16 arithmetic (AVX512-BF16): bf16's products run as float32 "
    "products of the rounded values, with its precision but no faster than fp32";
// args_json: the run's result arguments, its checkpoints' "train.args" (what a resume compares).
void run_seq2seq_train(const TrainArgs& args, const std::string& args_json);

// --- attn translate, attn predict (cmd_translate.cpp) ------------------------------------------

std::vector<Command> add_translate_command(CLI::App& app);
std::vector<Command> add_predict_command(CLI::App& app);

// --- attn tour -------------------------------------------------------------------------------

// --- attn compare (cmd_compare.cpp) ------------------------------------------------------------

// The chapter's CNN / RNN / self-attention table, measured (attn/model/compare.hpp).
std::vector<Command> add_compare_command(CLI::App& app);

std::vector<Command> add_tour_command(CLI::App& app);

// --- attn bench attention (cmd_bench.cpp) ------------------------------------------------------

// Times attn::scaled_dot_product_attention on one shape: GFLOP/s, % of the FMA peak measured
// in the same run, median time, peak memory; --json for scripts.
std::vector<Command> add_bench_command(CLI::App& app);
// attn bench comm (tools/attn/cmd_bench_comm.cpp), a subcommand of `bench`.
std::vector<Command> add_bench_comm_command(CLI::App& bench);
// attn bench ring (tools/attn/cmd_bench_ring.cpp), a subcommand of `bench`.
std::vector<Command> add_bench_ring_command(CLI::App& bench);

// The whole command line (app.cpp): parses argv, runs the chosen subcommand and returns the exit
// status (0 success or --help, 2 bad flag or value with one line on stderr, 1 internal error).
// Keeps no state between calls.
int run(int argc, char** argv);

// CLI11 check for file and directory flags: an explicitly empty name is a mistake, not "none".
inline const CLI::Validator kNonEmptyPath(
    [](std::string& value) { return value.empty() ? std::string("needs a non-empty path") : ""; },
    "", "non-empty path");

// Prints `text` to stdout; used by the commands after their files are written.
void print(const std::string& text);

}  // namespace attn::cli
