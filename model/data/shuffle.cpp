// The seeded example orders of the datasets (see model/data/shuffle.hpp).
#include "model/data/shuffle.hpp"

#include "attn/core/error.hpp"
#include "attn/core/rng.hpp"

#include <algorithm>
#include <numeric>
#include <utility>

namespace attn::model::detail {

std::vector<int64_t> shuffled(int64_t n, uint64_t seed, uint64_t stream) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  Rng rng(seed, stream);
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(p[static_cast<size_t>(i)],
              p[static_cast<size_t>(rng.below(static_cast<uint64_t>(i) + 1))]);
  return p;
}

HoldoutOrder holdout_order(int64_t n, double fraction, uint64_t seed, uint64_t stream,
                           const char* what) {
  const char* op = "split_holdout";
  check(n >= 2, op, "need at least 2 {} to hold some out, got {}", what, n);
  check(fraction > 0.0 && fraction < 1.0, op, "fraction must be in (0, 1), got {}", fraction);
  HoldoutOrder h;
  h.held = std::clamp<int64_t>(static_cast<int64_t>(fraction * static_cast<double>(n)), 1, n - 1);
  h.order = shuffled(n, seed, stream);
  return h;
}

}  // namespace attn::model::detail
