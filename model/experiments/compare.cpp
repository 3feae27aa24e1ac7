// The chapter's CNN / RNN / self-attention comparison, measured (see attn/model/compare.hpp).
//
// Vocabulary: n sequence length, d width (d_in = d_out = d), k CNN kernel size, L stacked layers.
#include "attn/model/compare.hpp"

#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"
#include "attn/nn/attention.hpp"
#include "attn/nn/sequence.hpp"
#include "kernels/ref/conv1d.hpp"
#include "kernels/ref/path_tracer.hpp"
#include "kernels/ref/rnn.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <memory>

namespace attn::model {

using ref::PathTracer;

const char* layer_name(SequenceLayer layer) {
  switch (layer) {
    case SequenceLayer::kCnn:
      return "CNN";
    case SequenceLayer::kRnn:
      return "RNN";
    case SequenceLayer::kSelfAttention:
      return "self-attention";
  }
  return "?";
}

const std::vector<SequenceLayer>& sequence_layers() {
  static const std::vector<SequenceLayer> layers = {SequenceLayer::kCnn, SequenceLayer::kRnn,
                                                    SequenceLayer::kSelfAttention};
  return layers;
}

void validate(const CompareOptions& o) {
  constexpr const char* op = "compare";
  check(!o.ns.empty() && !o.ds.empty(), op, "the n and d sweeps must not be empty");
  for (int64_t n : o.ns)
    check(n >= 1, op, "sequence length {} in the n sweep, expected >= 1", n);
  for (int64_t d : o.ds)
    check(d >= 1, op, "width {} in the d sweep, expected >= 1", d);
  check(o.d >= 1 && o.n_for_d >= 1 && o.path_d >= 1, op,
        "d ({}), n for the d sweep ({}) and the path width ({}) must be >= 1", o.d, o.n_for_d,
        o.path_d);
  for (int64_t k : o.path_ks)
    check(k >= 3 && k % 2 == 1, op, "kernel size {} for the path lengths, expected odd >= 3", k);
  for (int64_t n : o.path_ns)
    check(n >= 2, op, "sequence length {} for the path lengths, expected >= 2", n);
  check(o.k >= 1 && o.k % 2 == 1, op, "kernel size k = {}, expected odd and positive", o.k);
  check(o.repeats >= 1, op, "repeats = {}, expected >= 1", o.repeats);
}

namespace {

// One layer of the comparison behind a common face: (1, n, d) -> (1, n, d), forward and backward.
class Probe {
 public:
  virtual ~Probe() = default;
  virtual Tensor forward(Context& ctx, const Tensor& x) = 0;
  virtual Tensor backward(Context& ctx, const Tensor& dy) = 0;
  virtual int64_t flops() const = 0;  // counted by the forwards so far
};

class CnnProbe : public Probe {
 public:
  CnnProbe(int64_t d, int64_t k, bool bias, DType dtype, uint64_t seed)
      : conv_(d, d, k, bias, dtype, seed) {}
  Tensor forward(Context& ctx, const Tensor& x) override { return conv_.forward(ctx, x); }
  Tensor backward(Context& ctx, const Tensor& dy) override { return conv_.backward(ctx, dy); }
  int64_t flops() const override { return conv_.flops(); }

 private:
  nn::Conv1d conv_;
};

class RnnProbe : public Probe {
 public:
  RnnProbe(int64_t d, bool bias, DType dtype, uint64_t seed) : rnn_(d, d, bias, dtype, seed) {}
  Tensor forward(Context& ctx, const Tensor& x) override { return rnn_.forward(ctx, x); }
  Tensor backward(Context& ctx, const Tensor& dy) override { return rnn_.backward(ctx, dy).dx; }
  int64_t flops() const override { return rnn_.flops(); }
  nn::RNN& rnn() { return rnn_; }

 private:
  nn::RNN rnn_;
};

// Self-attention with queries = keys = values = X and no projections.
class AttentionProbe : public Probe {
 public:
  explicit AttentionProbe(DType dtype) : attention_(0.0, dtype) {
    attention_.eval();
    attention_.need_weights = false;
  }
  Tensor forward(Context& ctx, const Tensor& x) override {
    // The reference kernel forms Q K^T (B n n d multiply-accumulates) and weights V (B n n d):
    // 4 B n^2 d FLOPs, DESIGN.md's attention convention (softmax not counted).
    flops_ += 4 * x.dim(0) * x.dim(1) * x.dim(1) * x.dim(2);
    return attention_.forward(ctx, x, x, x);
  }
  Tensor backward(Context& ctx, const Tensor& dy) override {
    // X feeds queries, keys and values: its gradient is the sum of the three.
    nn::AttentionInputGrads g = attention_.backward(ctx, dy);
    Tensor dx = g.dqueries.clone();
    for (int64_t i = 0; i < dx.numel(); ++i)
      dx.set_flat(i, dx.flat(i) + g.dkeys.flat(i) + g.dvalues.flat(i));
    return dx;
  }
  int64_t flops() const override { return flops_; }

 private:
  nn::DotProductAttention attention_;
  int64_t flops_ = 0;
};

std::unique_ptr<Probe> make_probe(SequenceLayer layer, int64_t d, int64_t k, bool bias, DType dtype,
                                  uint64_t seed) {
  switch (layer) {
    case SequenceLayer::kCnn:
      return std::make_unique<CnnProbe>(d, k, bias, dtype, seed);
    case SequenceLayer::kRnn:
      return std::make_unique<RnnProbe>(d, bias, dtype, seed);
    case SequenceLayer::kSelfAttention:
      return std::make_unique<AttentionProbe>(dtype);
  }
  return nullptr;
}

Tensor random_input(int64_t n, int64_t d, DType dtype, uint64_t seed, double scale) {
  Tensor x = Tensor::empty({1, n, d}, dtype);
  Rng rng(seed, 0xc0ffee);
  for (int64_t i = 0; i < x.numel(); ++i)
    x.set_flat(i, scale * rng.uniform(-1.0, 1.0));
  return x;
}

// Weights, biases and padding are constants to the tracer: ready at step 0, not connected.
std::vector<PathTracer> constants(int64_t count) {
  return std::vector<PathTracer>(static_cast<size_t>(count));
}

// The three steps of the reference attention kernel (kernels/ref/attention.cpp) for
// q = k = v = x (n, d), on tracer values:
//   scores  s_ij = x_i . x_j                      one stored score per (i, j)
//   weights a_ij = softmax_j(s_i.)                needs the whole row i (its max and its sum)
//   output  o_ic = sum_j a_ij x_jc
std::vector<PathTracer> trace_self_attention(const std::vector<PathTracer>& x, int64_t n,
                                             int64_t d) {
  std::vector<PathTracer> scores(static_cast<size_t>(n * n)), out(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      PathTracer acc;
      for (int64_t c = 0; c < d; ++c)
        acc += x[i * d + c] * x[j * d + c];
      scores[i * n + j] = acc.step();
    }
  for (int64_t i = 0; i < n; ++i) {
    PathTracer row;  // max and sum over the row
    for (int64_t j = 0; j < n; ++j)
      row += scores[i * n + j];
    for (int64_t j = 0; j < n; ++j)
      scores[i * n + j] = (row + scores[i * n + j]).step();  // the weight a_ij
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) {
      PathTracer acc;
      for (int64_t j = 0; j < n; ++j)
        acc += scores[i * n + j] * x[j * d + c];
      out[i * d + c] = acc.step();
    }
  return out;
}

// One layer's forward on tracer values x (n, d), through the same kernels the layers run.
std::vector<PathTracer> trace_layer(SequenceLayer layer, const std::vector<PathTracer>& x,
                                    int64_t n, int64_t d, int64_t k) {
  std::vector<PathTracer> y(static_cast<size_t>(n * d));
  switch (layer) {
    case SequenceLayer::kCnn: {
      const auto W = constants(d * d * k), b = constants(d);
      ref::conv1d_forward<PathTracer>(x.data(), W.data(), b.data(), y.data(), 1, n, d, d, k);
      break;
    }
    case SequenceLayer::kRnn: {
      const auto W_ih = constants(d * d), W_hh = constants(d * d), b = constants(d);
      ref::rnn_tanh_forward<PathTracer>(x.data(), nullptr, W_ih.data(), W_hh.data(), b.data(),
                                        b.data(), y.data(), 1, n, d, d);
      break;
    }
    case SequenceLayer::kSelfAttention:
      y = trace_self_attention(x, n, d);
      break;
  }
  return y;
}

// CPU time of the calling thread: unlike wall time it does not count the time other processes
// hold the core (the reference kernels are single-threaded).
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

double fit_exponent(const std::vector<double>& x, const std::vector<double>& y) {
  check(x.size() == y.size() && x.size() >= 2, "fit_exponent",
        "need at least two (x, y) points of equal count, got {} and {}", x.size(), y.size());
  // Ordinary least squares of log y = a log x + c: a = cov(log x, log y) / var(log x).
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    check(x[i] > 0 && y[i] > 0, "fit_exponent", "point ({}, {}) is not positive", x[i], y[i]);
    mx += std::log(x[i]);
    my += std::log(y[i]);
  }
  mx /= static_cast<double>(x.size());
  my /= static_cast<double>(x.size());
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double dx = std::log(x[i]) - mx;
    sxy += dx * (std::log(y[i]) - my);
    sxx += dx * dx;
  }
  check(sxx > 0, "fit_exponent", "all x are equal ({}): no slope to fit", x[0]);
  return sxy / sxx;
}

int64_t forward_flops(SequenceLayer layer, int64_t n, int64_t d, int64_t k) {
  Context ctx;
  auto probe = make_probe(layer, d, k, true, DType::F32, 0);
  probe->forward(ctx, random_input(n, d, DType::F32, 0, 1.0));
  return probe->flops();
}

ForwardTime forward_time(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int repeats,
                         uint64_t seed) {
  Context ctx;
  ctx.threads = 1;
  // The reference kernels for all three layers: with Backend::kAuto self-attention would run the
  // fused SIMD kernel (kernels/cpu) against plain loops for the other two.
  ctx.backend = Backend::kReference;
  auto probe = make_probe(layer, d, k, true, DType::F32, seed);
  const Tensor x = random_input(n, d, DType::F32, seed, 1.0);
  probe->forward(ctx, x);  // warm-up: first-touch of the output and caches
  std::vector<double> wall, cpu;
  for (int r = 0; r < repeats; ++r) {
    const double cpu_start = thread_cpu_seconds();
    const auto start = std::chrono::steady_clock::now();
    probe->forward(ctx, x);
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    cpu.push_back(thread_cpu_seconds() - cpu_start);
  }
  return {median(wall), median(cpu)};
}

int64_t sequential_operations(SequenceLayer layer, int64_t n, int64_t d, int64_t k) {
  // Every input is ready at step 0; the answer is the step at which the last output is ready.
  const std::vector<PathTracer> y = trace_layer(layer, constants(n * d), n, d, k);
  int64_t longest = 0;
  for (const PathTracer& v : y)
    longest = std::max(longest, v.longest);
  return longest;
}

int64_t path_steps(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int64_t layers) {
  // The source is input position 1 (index 0), all of its features.
  std::vector<PathTracer> x = constants(n * d);
  for (int64_t c = 0; c < d; ++c)
    x[c] = PathTracer::source();
  for (int64_t l = 0; l < layers; ++l)
    x = trace_layer(layer, x, n, d, k);
  int64_t best = PathTracer::kUnreached;
  for (int64_t c = 0; c < d; ++c)
    best = std::min(best, x[(n - 1) * d + c].shortest);
  return best < PathTracer::kUnreached ? best : 0;
}

int64_t layers_to_connect(SequenceLayer layer, int64_t n, int64_t d, int64_t k, int64_t max_layers,
                          uint64_t seed) {
  Context ctx;
  // Stacks of growing height (1, 2, 4, ... max_layers). One forward through all L layers, then
  // the backward from a one-hot upstream gradient at position n: after the backward of the top l
  // layers, g holds d output_n / d (input of the top-l stack). The first l at which position 1
  // is nonzero is the answer.
  for (int64_t cap = 1;; cap = std::min(2 * cap, max_layers)) {
    std::vector<std::unique_ptr<Probe>> stack;
    for (int64_t l = 0; l < cap; ++l) {
      // No biases and a small input keep every tanh in its linear range (tanh' ~ 1).
      stack.push_back(make_probe(layer, d, k, false, DType::F64, seed + 7919 * l));
      if (layer == SequenceLayer::kRnn) {
        // A tanh RNN's gradient shrinks geometrically along the chain (the vanishing gradient);
        // at PyTorch's init it underflows to exactly 0 in float64 for n in the hundreds, which
        // would read as "not connected". An orthogonal W_hh (Gram-Schmidt of the random one)
        // keeps its norm, so what is measured is the connectivity.
        Tensor& W = static_cast<RnnProbe&>(*stack.back()).rnn().weight_hh_l0.value;
        double* w = W.data<double>();
        for (int64_t r = 0; r < d; ++r) {
          for (int64_t q = 0; q < r; ++q) {
            double dot = 0;
            for (int64_t c = 0; c < d; ++c)
              dot += w[r * d + c] * w[q * d + c];
            for (int64_t c = 0; c < d; ++c)
              w[r * d + c] -= dot * w[q * d + c];
          }
          double norm = 0;
          for (int64_t c = 0; c < d; ++c)
            norm += w[r * d + c] * w[r * d + c];
          for (int64_t c = 0; c < d; ++c)
            w[r * d + c] /= std::sqrt(norm);
        }
      }
    }
    Tensor h = random_input(n, d, DType::F64, seed, 1e-2);
    for (auto& layer_probe : stack)
      h = layer_probe->forward(ctx, h);
    Tensor g = Tensor::zeros({1, n, d}, DType::F64);
    for (int64_t c = 0; c < d; ++c)
      g.set({0, n - 1, c}, 1.0);
    for (int64_t l = 1; l <= cap; ++l) {
      g = stack[static_cast<size_t>(cap - l)]->backward(ctx, g);
      // Rescale each position to max |g| = 1: a positive factor per position changes no zero
      // into a nonzero or back, but keeps the far edge of a deep CNN's receptive field (a
      // product of hundreds of small weights) from underflowing.
      double* p = g.data<double>();
      for (int64_t t = 0; t < n; ++t) {
        double m = 0;
        for (int64_t c = 0; c < d; ++c)
          m = std::max(m, std::abs(p[t * d + c]));
        if (m > 0)
          for (int64_t c = 0; c < d; ++c)
            p[t * d + c] /= m;
      }
      for (int64_t c = 0; c < d; ++c)
        if (p[c] != 0.0) return l;
    }
    if (cap == max_layers) return 0;
  }
}

CompareResult run_compare(const CompareOptions& options) {
  validate(options);
  CompareResult result;
  result.options = options;
  for (SequenceLayer layer : sequence_layers()) {
    LayerSweep s;
    s.layer = layer;
    const int64_t k = options.k;
    std::vector<double> ns, fn, tn, ds, fd, td;
    for (int64_t n : options.ns) {
      SweepPoint p{n, options.d, 0, 0, 0, 0};
      p.flops = static_cast<double>(forward_flops(layer, n, options.d, k));
      const ForwardTime t = forward_time(layer, n, options.d, k, options.repeats, options.seed);
      p.seconds = t.wall;
      p.cpu_seconds = t.cpu;
      p.sequential_ops = sequential_operations(layer, n, options.d, k);
      s.by_n.push_back(p);
    }
    for (int64_t d : options.ds) {
      SweepPoint p{options.n_for_d, d, 0, 0, 0, 0};
      p.flops = static_cast<double>(forward_flops(layer, options.n_for_d, d, k));
      const ForwardTime t =
          forward_time(layer, options.n_for_d, d, k, options.repeats, options.seed);
      p.seconds = t.wall;
      p.cpu_seconds = t.cpu;
      s.by_d.push_back(p);
    }
    // FLOP exponents over the whole sweep; time exponents over its larger half, where fixed
    // per-call costs (allocation, validation) no longer hide the growth.
    enum What { kFlops, kWall, kCpu };
    auto fit = [](const std::vector<SweepPoint>& pts, bool by_n, What what, bool upper_half) {
      std::vector<double> x, y;
      const size_t first = upper_half && pts.size() >= 4 ? pts.size() / 2 : 0;
      for (size_t i = first; i < pts.size(); ++i) {
        x.push_back(static_cast<double>(by_n ? pts[i].n : pts[i].d));
        y.push_back(what == kFlops  ? pts[i].flops
                    : what == kWall ? std::max(pts[i].seconds, 1e-9)
                                    : std::max(pts[i].cpu_seconds, 1e-9));
      }
      return x.size() >= 2 ? fit_exponent(x, y) : 0.0;
    };
    s.flops_exponent_n = fit(s.by_n, true, kFlops, false);
    s.time_exponent_n = fit(s.by_n, true, kWall, true);
    s.cpu_time_exponent_n = fit(s.by_n, true, kCpu, true);
    s.flops_exponent_d = fit(s.by_d, false, kFlops, false);
    s.time_exponent_d = fit(s.by_d, false, kWall, true);
    s.cpu_time_exponent_d = fit(s.by_d, false, kCpu, true);
    result.layers.push_back(std::move(s));
  }
  for (int64_t n : options.path_ns) {
    for (SequenceLayer layer : sequence_layers()) {
      const std::vector<int64_t> ks =
          layer == SequenceLayer::kCnn ? options.path_ks : std::vector<int64_t>{0};
      for (int64_t k : ks) {
        PathPoint p{layer, k, n, 0, 0};
        // A CNN with 'same' padding p = (k-1)/2 reaches p positions further per layer, so n
        // layers always suffice; the search stops there.
        p.layers = layers_to_connect(layer, n, options.path_d, k == 0 ? 3 : k, n, options.seed);
        if (p.layers > 0) p.steps = path_steps(layer, n, options.path_d, k == 0 ? 3 : k, p.layers);
        result.paths.push_back(p);
      }
    }
  }
  return result;
}

}  // namespace attn::model
