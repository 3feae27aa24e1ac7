// The chapter's comparison of CNN, RNN and self-attention, measured on attn's own layers.
//
// The chapter (d2l 11.6.2) compares layers that map n tokens of width d to n tokens of width d:
//
//   layer           computational complexity   sequential operations   maximum path length
//   CNN (kernel k)  O(k n d^2)                 O(1)                    O(n/k)
//   RNN             O(n d^2)                   O(n)                    O(n)
//   self-attention  O(n^2 d)                   O(1)                    O(1)
//
// Each column is measured here, and defined as follows (docs/compare.md has the long form):
//   FLOPs           what the layer's forward counted: 2 per multiply-accumulate of its kernel
//                   (nn::Conv1d::flops, nn::RNN::flops; for self-attention 4 n^2 d, the two
//                   products of the reference attention kernel, as DESIGN.md counts attention).
//   time            median wall time of the forward over `repeats` runs (batch 1, float32, the
//                   reference kernels of all three layers, one thread), and the median CPU time
//                   of the calling thread (robust to other processes sharing the cores).
//   exponent        least-squares slope of log(FLOPs or time) against log(n) (or log(d)).
//   sequential ops  the longest chain of dependent steps in one forward (its critical path),
//                   measured by running the layer's kernel on ref::PathTracer values: a step is
//                   one stored result (an output element, a hidden state, a softmax weight).
//   path length     (a) layers: the smallest L such that, in a stack of L layers,
//                   d output_n / d input_1 != 0, found with the modules' backward from a one-hot
//                   upstream gradient at position n; (b) steps: the fewest dependent steps on a
//                   path from input 1 to output n in that stack (PathTracer's shortest path).
//                   For the RNN one layer connects everything, but through n steps.
//
// Layers: CNN = nn::Conv1d(d, d, k) with 'same' padding, RNN = nn::RNN(d, d) (tanh),
// self-attention = nn::DotProductAttention with queries = keys = values = X, no projections:
// exactly the layer whose cost the chapter analyses (an n x d by d x n product and an n x n by
// n x d product).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attn::model {

enum class SequenceLayer { kCnn, kRnn, kSelfAttention };

const char* layer_name(SequenceLayer layer);  // "CNN", "RNN", "self-attention"
const std::vector<SequenceLayer>& sequence_layers();

struct CompareOptions {
  std::vector<int64_t> ns = {16, 32, 64, 128, 256, 512, 1024};  // n sweep, at width d
  int64_t d = 64;
  std::vector<int64_t> ds = {8, 16, 32, 64, 128, 256};  // d sweep, at length n_for_d
  int64_t n_for_d = 128;
  int64_t k = 3;  // CNN kernel size of the sweeps
  std::vector<int64_t> path_ks = {3, 5, 9};
  std::vector<int64_t> path_ns = {16, 64, 256, 1024};
  int64_t path_d = 4;  // width of the stacks whose connectivity is measured
  int repeats = 5;
  uint64_t seed = 0;
};

// Throws attn::Error("compare", ...) for empty sweeps, sizes < 1, an even or non-positive k,
// repeats < 1.
void validate(const CompareOptions& options);

struct SweepPoint {
  int64_t n = 0, d = 0;
  double flops = 0;        // counted by the layer's forward
  double seconds = 0;      // median forward wall time
  double cpu_seconds = 0;  // median forward CPU time of the calling thread
  int64_t sequential_ops = 0;
};

struct LayerSweep {
  SequenceLayer layer;
  std::vector<SweepPoint> by_n, by_d;
  double flops_exponent_n = 0, time_exponent_n = 0;
  double flops_exponent_d = 0, time_exponent_d = 0;
  double cpu_time_exponent_n = 0, cpu_time_exponent_d = 0;
};

struct PathPoint {
  SequenceLayer layer;
  int64_t k = 0;  // CNN kernel size (0 for the others)
  int64_t n = 0;
  int64_t layers = 0;  // fewest stacked layers connecting input 1 to output n (gradient)
  int64_t steps = 0;   // fewest dependent steps from input 1 to output n in that stack
};

struct CompareResult {
  CompareOptions options;
  std::vector<LayerSweep> layers;  // in sequence_layers() order
  std::vector<PathPoint> paths;
};

// Runs every measurement. Time grows with max(ns)^2 d (self-attention).
CompareResult run_compare(const CompareOptions& options);

// --- the measurements, one at a time (each builds its own layers, seeded) --------------------

// Least-squares slope of log y against log x (all values > 0, at least two distinct x).
double fit_exponent(const std::vector<double>& x, const std::vector<double>& y);
// FLOPs one forward of the layer counts for a (1, n, d) input.
int64_t forward_flops(SequenceLayer layer, int64_t n, int64_t d, int64_t k);
struct ForwardTime {
  double wall = 0, cpu = 0;  // seconds, medians
};
// Median wall and thread-CPU seconds of `repeats` forwards (after one warm-up) on a (1, n, d)
// float32 input.
ForwardTime forward_time(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int repeats,
                         uint64_t seed = 0);
// Longest chain of dependent steps in one forward on (1, n, d) (PathTracer critical path).
int64_t sequential_operations(SequenceLayer layer, int64_t n, int64_t d, int64_t k);
// Smallest L <= max_layers such that a stack of L layers (float64, width d, random weights) has
// d output_n / d input_1 != 0; 0 when even max_layers do not connect them.
int64_t layers_to_connect(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int64_t max_layers,
                          uint64_t seed = 0);
// Fewest dependent steps from input 1 to output n in a stack of `layers` layers (PathTracer);
// 0 when there is no path.
int64_t path_steps(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int64_t layers);

}  // namespace attn::model
