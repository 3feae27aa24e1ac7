// The flash driver's shape-only decisions (flash_driver.hpp).
#include "kernels/cpu/flash_driver.hpp"

namespace attn::cpu {

std::vector<int64_t> backward_key_splits(int64_t B, int64_t T, int64_t S, bool causal) {
  constexpr int64_t kGrain = 64;
  const int64_t grains = (S + kGrain - 1) / kGrain;
  int64_t splits = B >= kBackwardItems ? 1 : (kBackwardItems + B - 1) / B;
  splits = std::max<int64_t>(1, std::min(splits, grains / 4));
  std::vector<double> work(grains);
  double total = 0;
  for (int64_t gi = 0; gi < grains; ++gi) {
    const double s_mid = (gi + 0.5) * kGrain;
    work[gi] = causal ? std::max(1.0, double(T) - s_mid) : 1.0;
    total += work[gi];
  }
  std::vector<int64_t> bounds{0};
  double acc = 0;
  for (int64_t gi = 0; gi < grains; ++gi) {
    acc += work[gi];
    const int64_t j = static_cast<int64_t>(bounds.size());
    if (j < splits && acc >= total * double(j) / double(splits))
      bounds.push_back(std::min(S, (gi + 1) * kGrain));
  }
  while (static_cast<int64_t>(bounds.size()) <= splits)
    bounds.push_back(S);
  bounds.back() = S;
  return bounds;
}

std::vector<int64_t> rows_longest_first(const kernels::AttentionProblem& p) {
  if (p.kept_keys == nullptr || p.T <= 0 || p.B <= 1) return {};
  std::vector<int64_t> order(static_cast<size_t>(p.B));
  for (int64_t b = 0; b < p.B; ++b)
    order[static_cast<size_t>(b)] = b;
  const auto keys = [&](int64_t b) { return p.kept_keys[b * p.T + p.T - 1]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys(a) > keys(b); });
  return order;
}

}  // namespace attn::cpu
