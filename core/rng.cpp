#include "attn/core/rng.hpp"

#include <cmath>

namespace attn {

uint32_t Rng::next_u32() {
  if (used_ == 4) {
    const uint32_t key[2] = {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)};
    const uint32_t ctr[4] = {static_cast<uint32_t>(counter_), static_cast<uint32_t>(counter_ >> 32),
                             static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)};
    philox4x32_10(key, ctr, buffer_);
    ++counter_;
    used_ = 0;
  }
  return buffer_[used_++];
}

double Rng::uniform() {
  uint64_t hi = next_u32() >> 5, lo = next_u32() >> 6;  // 27 + 26 = 53 bits
  return (static_cast<double>(hi) * 67108864.0 + static_cast<double>(lo)) *
         (1.0 / 9007199254740992.0);
}

double Rng::uniform(double lo, double hi) {
  return lo + (hi - lo) * uniform();
}

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2.0 * M_PI * u2);
  has_spare_ = true;
  return r * std::cos(2.0 * M_PI * u2);
}

uint64_t Rng::below(uint64_t n) {
  // Rejection sampling on 64 bits keeps the draw exactly uniform.
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  for (;;) {
    uint64_t x = (static_cast<uint64_t>(next_u32()) << 32) | next_u32();
    if (x < limit) return x % n;
  }
}

}  // namespace attn
