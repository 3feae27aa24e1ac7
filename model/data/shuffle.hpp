// The seeded example orders of the datasets (internal to model/): the permutation behind
// EpochSampler and both split_holdout functions (data.cpp, seq2seq_data.cpp), each on its own
// Philox stream.
#pragma once

#include <cstdint>
#include <vector>

namespace attn::model::detail {

// A permutation of 0..n-1: Fisher-Yates with the library's Philox generator Rng(seed, stream)
// (std::shuffle's result differs between standard libraries; this one is the same everywhere).
std::vector<int64_t> shuffled(int64_t n, uint64_t seed, uint64_t stream);

// The order of a seeded hold-out split of n items: order[0, n - held) train, the rest are held
// out, held = clamp(int(fraction * n), 1, n - 1). Error("split_holdout") unless n >= 2 (naming the
// items `what`: "examples", "pairs") and 0 < fraction < 1.
struct HoldoutOrder {
  std::vector<int64_t> order;
  int64_t held = 0;
};
HoldoutOrder holdout_order(int64_t n, double fraction, uint64_t seed, uint64_t stream,
                           const char* what);

}  // namespace attn::model::detail
