// The CNN / RNN / self-attention comparison (attn/model/compare.hpp): the measured FLOP
// exponents, sequential operations and path lengths equal the chapter's table.
#include "attn/model/compare.hpp"

#include "attn/core/error.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace attn::model {
namespace {

constexpr SequenceLayer kCnn = SequenceLayer::kCnn, kRnn = SequenceLayer::kRnn,
                        kAttention = SequenceLayer::kSelfAttention;

TEST(Compare, FitExponent) {
  EXPECT_NEAR(fit_exponent({1, 2, 4, 8}, {3, 12, 48, 192}), 2.0, 1e-12);
  EXPECT_NEAR(fit_exponent({10, 100}, {5, 5}), 0.0, 1e-12);
  EXPECT_THROW(fit_exponent({1}, {1}), Error);
  EXPECT_THROW(fit_exponent({2, 2}, {1, 3}), Error);
  EXPECT_THROW(fit_exponent({1, 2}, {0, 3}), Error);
}

TEST(Compare, FlopsCountedByTheLayersFollowTheTheory) {
  const int64_t d = 8, k = 3;
  std::vector<double> ns = {4, 8, 16, 32}, ds = {2, 4, 8, 16};
  for (SequenceLayer layer : sequence_layers()) {
    std::vector<double> fn, fd;
    for (double n : ns)
      fn.push_back(static_cast<double>(forward_flops(layer, static_cast<int64_t>(n), d, k)));
    for (double w : ds)
      fd.push_back(static_cast<double>(forward_flops(layer, 16, static_cast<int64_t>(w), k)));
    // O(k n d^2), O(n d^2), O(n^2 d): exact power laws, so the fit is exact.
    const double en = layer == kAttention ? 2.0 : 1.0, ed = layer == kAttention ? 1.0 : 2.0;
    EXPECT_NEAR(fit_exponent(ns, fn), en, 1e-12) << layer_name(layer);
    EXPECT_NEAR(fit_exponent(ds, fd), ed, 1e-12) << layer_name(layer);
  }
  // The constants: 2 FLOPs per multiply-accumulate.
  EXPECT_EQ(forward_flops(kCnn, 10, 4, 5), 2 * 5 * 10 * 4 * 4);
  EXPECT_EQ(forward_flops(kRnn, 10, 4, 3), 2 * 10 * (4 * 4 + 4 * 4));
  EXPECT_EQ(forward_flops(kAttention, 10, 4, 3), 4 * 10 * 10 * 4);
}

TEST(Compare, SequentialOperations) {
  for (int64_t n : {1, 7, 64}) {
    EXPECT_EQ(sequential_operations(kCnn, n, 3, 3), 1) << n;
    EXPECT_EQ(sequential_operations(kCnn, n, 3, 9), 1) << n;
    EXPECT_EQ(sequential_operations(kRnn, n, 3, 3), n) << n;
    // scores, softmax weights, weighted sum: three steps whatever n.
    EXPECT_EQ(sequential_operations(kAttention, n, 3, 3), 3) << n;
  }
}

TEST(Compare, MaximumPathLength) {
  for (int64_t n : {2, 16, 33}) {
    for (int64_t k : {3, 5, 9}) {
      // 'same' padding p = (k-1)/2 moves the receptive field p positions per layer.
      const int64_t p = (k - 1) / 2, expected = (n - 1 + p - 1) / p;
      const int64_t layers = layers_to_connect(kCnn, n, 3, k, n);
      EXPECT_EQ(layers, expected) << "n " << n << " k " << k;
      EXPECT_EQ(path_steps(kCnn, n, 3, k, layers), layers);
      if (layers > 1) {
        EXPECT_EQ(path_steps(kCnn, n, 3, k, layers - 1), 0);  // no path yet
      }
    }
    EXPECT_EQ(layers_to_connect(kRnn, n, 3, 3, n), 1);
    EXPECT_EQ(path_steps(kRnn, n, 3, 3, 1), n);  // x_1 -> h_1 -> ... -> h_n: n tanh steps
    EXPECT_EQ(layers_to_connect(kAttention, n, 3, 3, n), 1);
    EXPECT_EQ(path_steps(kAttention, n, 3, 3, 1), 1);  // y_n weights v_1 = x_1 directly
  }
  // A CNN stack too short to connect: 0.
  EXPECT_EQ(layers_to_connect(kCnn, 20, 2, 3, 4), 0);
}

TEST(Compare, LongRnnStaysConnectedDespiteVanishingGradients) {
  // 300 tanh steps: the probe's orthogonal W_hh keeps d h_n / d x_1 representable.
  EXPECT_EQ(layers_to_connect(kRnn, 300, 4, 3, 4), 1);
  EXPECT_EQ(layers_to_connect(kCnn, 300, 2, 3, 300), 299);
}

TEST(Compare, RunCompareSmall) {
  CompareOptions o;
  o.ns = {8, 16, 32, 64};
  o.d = 4;
  o.ds = {2, 4, 8, 16};
  o.n_for_d = 8;
  o.path_ns = {9};
  o.path_ks = {3, 5};
  o.repeats = 1;
  const CompareResult r = run_compare(o);
  ASSERT_EQ(r.layers.size(), 3u);
  EXPECT_NEAR(r.layers[0].flops_exponent_n, 1.0, 1e-12);
  EXPECT_NEAR(r.layers[1].flops_exponent_n, 1.0, 1e-12);
  EXPECT_NEAR(r.layers[2].flops_exponent_n, 2.0, 1e-12);
  EXPECT_NEAR(r.layers[0].flops_exponent_d, 2.0, 1e-12);
  EXPECT_NEAR(r.layers[2].flops_exponent_d, 1.0, 1e-12);
  EXPECT_EQ(r.layers[1].by_n.back().sequential_ops, 64);
  for (const SweepPoint& p : r.layers[0].by_n)
    EXPECT_GT(p.seconds, 0.0);
  ASSERT_EQ(r.paths.size(), 4u);  // CNN k = 3, 5; RNN; self-attention
  EXPECT_EQ(r.paths[0].layers, 8);
  EXPECT_EQ(r.paths[1].layers, 4);
  EXPECT_EQ(r.paths[2].layers, 1);
  EXPECT_EQ(r.paths[2].steps, 9);
  EXPECT_EQ(r.paths[3].steps, 1);

  CompareOptions bad = o;
  bad.k = 4;
  EXPECT_THROW(run_compare(bad), Error);
  bad = o;
  bad.ns = {};
  EXPECT_THROW(run_compare(bad), Error);
  bad = o;
  bad.repeats = 0;
  EXPECT_THROW(validate(bad), Error);
}

}  // namespace
}  // namespace attn::model
