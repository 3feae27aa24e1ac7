// Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
// counter-based generator. Any element's random number is a pure function of (key, counter), so
// the reference, the SIMD kernels and CUDA draw the same dropout mask without sharing state.
//
// Dropout convention used everywhere in attn (the "dropout stream"):
//   key     = (lo32(seed), hi32(seed))
//   counter = (lo32(i / 4), hi32(i / 4), lo32(offset), hi32(offset))
//   u_i     = (philox(key, counter)[i % 4] >> 8) * 2^-24          uniform in [0, 1)
//   element i is kept iff u_i >= p, and then scaled by 1 / (1 - p) (inverted dropout).
// i is the element's row-major index in the tensor being dropped (for attention weights
// (B, T, S): (b * T + t) * S + s), plus an index base: the tensor's first sample's global index
// times the elements per sample at that site (Context::dropout_index_base; 0 in a single
// process), so that a data-parallel rank holding samples [s0, s0 + B) of a global batch draws
// the masks one process draws for them. `offset` identifies the call: Context hands out a fresh
// one per dropout site and step (Context::next_dropout_offset).
#pragma once

#include <array>
#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__
#else
#define ATTN_HOST_DEVICE
#endif

namespace attn {

using Philox4x32 = std::array<uint32_t, 4>;

ATTN_HOST_DEVICE inline void philox4x32_10(const uint32_t key_in[2], const uint32_t ctr_in[4],
                                           uint32_t out[4]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  uint32_t k0 = key_in[0], k1 = key_in[1];
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// The uniform in [0, 1) that the dropout stream assigns to element `i` (see the file comment).
ATTN_HOST_DEVICE inline float dropout_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const uint64_t block = i >> 2;
  const uint32_t ctr[4] = {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                           static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  uint32_t out[4];
  philox4x32_10(key, ctr, out);
  return static_cast<float>(out[i & 3] >> 8) * (1.0f / 16777216.0f);
}

// True when the dropout stream keeps element i at drop probability p.
ATTN_HOST_DEVICE inline bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t i, float p) {
  return dropout_uniform(seed, offset, i) >= p;
}

// Sequential generator for parameter initialisation and data: Philox in counter mode.
class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  uint32_t next_u32();
  double uniform();                      // [0, 1), 53 bits
  double uniform(double lo, double hi);  // [lo, hi)
  double normal();                       // standard normal (Box-Muller)
  uint64_t below(uint64_t n);            // uniform integer in [0, n)

 private:
  uint64_t seed_, stream_, counter_ = 0;
  uint32_t buffer_[4] = {};
  int used_ = 4;
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace attn
