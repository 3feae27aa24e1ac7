// Host-side logic of the CUDA backend, on any machine (no GPU needed): the per-thread arithmetic of
// the kernels (kernels/cuda/device_math.hpp) against the CPU paths, the caching pool's
// bookkeeping, launch configurations, the GEMM plan key and its row-major -> column-major mapping,
// device tensors' host guards and the device flag; the tensor-core attention kernels' warps
// emulated (ldmatrix and mma from their PTX layouts) against double.
#include "attn/core/device.hpp"
#include "attn/core/dtype.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/tensor.hpp"
#include "attn/cuda/graph.hpp"
#include "attn/nn/optim.hpp"
#include "kernels/cuda/block_pool.hpp"
#include "kernels/cuda/device_math.hpp"
#include "kernels/cuda/flash_mma.hpp"
#include "kernels/cuda/gemm_plan.hpp"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma_layout.hpp"
#include "kernels/ref/dropout.hpp"
#include "kernels/ref/layer_norm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <vector>

namespace attn::cuda {
namespace {

TEST(CudaHostMath, Bf16RoundingMatchesTheCpuBitForBit) {
  Rng rng(7);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               1.00390625f,
                               1.005859375f,
                               65504.0f,
                               3.4e38f,
                               1e-40f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  for (int i = 0; i < 100000; ++i) {
    uint32_t u = rng.next_u32();
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  for (float f : values) {
    ASSERT_EQ(bf16_round(f), float_to_bf16(f)) << f;
    const uint16_t h = float_to_bf16(f);
    const float a = bf16_widen(h), b = bf16_to_float(h);
    ASSERT_EQ(std::memcmp(&a, &b, 4), 0);
  }
}

TEST(CudaHostMath, DropoutFactorIsTheCpuStream) {
  // The reference's DropoutSpec (kernels/ref/dropout.hpp) is what every CPU path checks against.
  for (double p : {0.0, 0.1, 0.5, 0.9, 1.0}) {
    ref::DropoutSpec spec;
    spec.active = p > 0;
    spec.p = p;
    spec.seed = 0x123456789abcdefull;
    spec.offset = 42;
    spec.index_base = 1000;
    for (uint64_t i = 0; i < 4096; ++i) {
      const float z =
          dropout_factor(spec.seed, spec.offset, spec.index_base + i, static_cast<float>(p));
      const double want = spec.factor(i);
      ASSERT_EQ(z == 0.0f, want == 0.0) << "p " << p << " i " << i;
      if (want != 0.0) {
        ASSERT_FLOAT_EQ(z, static_cast<float>(want)) << "p " << p << " i " << i;
      }
    }
  }
}

TEST(CudaHostMath, DropoutIndexAndRowLimitMatchTheProblem) {
  kernels::AttentionProblem pr;
  pr.B = 3;
  pr.T = 5;
  pr.S = 7;
  pr.dropout_index_base = 99;
  std::vector<int32_t> kept = {0, 1, 7, 3, 9, 2, 2, 0, 5, 6, 7, 1, 4, 4, 4};
  for (int window = 0; window < 2; ++window) {
    if (window) pr.dropout_window = {11, 13, 2, 4};
    for (int causal = 0; causal < 2; ++causal)
      for (int use_kept = 0; use_kept < 2; ++use_kept) {
        pr.causal = causal;
        pr.kept_keys = use_kept ? kept.data() : nullptr;
        DropoutIndexer ix{pr.dropout_index_base,
                          pr.T,
                          pr.S,
                          pr.dropout_window.rows,
                          pr.dropout_window.cols,
                          pr.dropout_window.t0,
                          pr.dropout_window.s0};
        for (int64_t b = 0; b < pr.B; ++b)
          for (int64_t t = 0; t < pr.T; ++t) {
            ASSERT_EQ(row_limit(pr.kept_keys, pr.causal, b, t, pr.T, pr.S), pr.row_limit(b, t));
            for (int64_t s = 0; s < pr.S; ++s)
              ASSERT_EQ(ix(b, t, s), pr.dropout_index(b, t, s));
          }
      }
  }
}

TEST(CudaHostMath, OnlineSoftmaxMergeEqualsOnePass) {
  Rng rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng.below(300));
    const int cut = static_cast<int>(rng.below(static_cast<uint64_t>(n + 1)));
    std::vector<float> x(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      x[i] = static_cast<float>(rng.uniform(-30, 30));
      v[i] = static_cast<float>(rng.uniform(-1, 1));
      if (rng.below(10) == 0) x[i] = -INFINITY;  // masked scores
    }
    // Two halves accumulated separately, as two warps do, then merged.
    SoftmaxState a, b;
    float oa = 0, ob = 0;
    for (int i = 0; i < n; ++i) {
      SoftmaxState& st = i < cut ? a : b;
      float& o = i < cut ? oa : ob;
      if (x[i] == -INFINITY) continue;
      const float m_new = std::max(st.m, x[i]);
      o = o * SoftmaxState::rescale(st.m, m_new) + std::exp(x[i] - m_new) * v[i];
      st.add(x[i]);
    }
    float wa, wb;
    const SoftmaxState r = SoftmaxState::merge(a, b, &wa, &wb);
    double m = -INFINITY, l = 0, o = 0;
    for (float xi : x)
      m = std::max<double>(m, xi);
    for (int i = 0; i < n; ++i)
      if (x[i] != -INFINITY) {
        l += std::exp(x[i] - m);
        o += std::exp(x[i] - m) * v[i];
      }
    if (m == -INFINITY) {
      EXPECT_EQ(r.lse(), -INFINITY);
      continue;
    }
    EXPECT_NEAR(r.lse(), m + std::log(l), 1e-4 * std::max(1.0, std::abs(m)));
    EXPECT_NEAR((wa * oa + wb * ob) / r.l, o / l, 1e-5);
  }
}

TEST(CudaHostMath, WelfordStatisticsMatchTheReferenceLayerNorm) {
  Rng rng(5);
  for (int64_t E : {1, 7, 32, 33, 128, 1000}) {
    std::vector<float> x(static_cast<size_t>(E)), y(static_cast<size_t>(E));
    for (auto& xi : x)
      xi = static_cast<float>(rng.uniform(-3, 5));
    float mean_ref, rstd_ref;
    ref::layer_norm_forward<float>(x.data(), nullptr, nullptr, y.data(), &mean_ref, &rstd_ref, 1, E,
                                   1e-5);
    // The kernel's order: 32 lanes each fold a strided share, then a butterfly combine.
    WelfordState lanes[32];
    for (int64_t e = 0; e < E; ++e)
      lanes[e % 32].add(x[e]);
    for (int o = 16; o > 0; o >>= 1) {
      WelfordState next[32];
      for (int l = 0; l < 32; ++l)
        next[l] = WelfordState::combine(lanes[l], lanes[l ^ o]);
      for (int l = 0; l < 32; ++l)
        lanes[l] = next[l];
    }
    EXPECT_NEAR(lanes[0].mean, mean_ref, 1e-5) << "E " << E;
    EXPECT_NEAR(1.0f / std::sqrt(lanes[0].variance() + 1e-5f), rstd_ref, 1e-4 * rstd_ref)
        << "E " << E;
  }
}

TEST(CudaHostMath, AdamWElementIsTheCpuOptimiserBitForBit) {
  Rng rng(11);
  const int64_t n = 1000;
  std::vector<double> w0(n), grads[3];
  for (auto& w : w0)
    w = rng.uniform(-1, 1);
  for (auto& g : grads) {
    g.resize(n);
    for (auto& gi : g)
      gi = rng.uniform(-0.1, 0.1);
  }
  nn::Parameter p;
  p.value = Tensor::from_vector(w0, {n});
  p.grad = Tensor::zeros({n});
  nn::AdamWOptions o;
  nn::AdamW cpu({{"w", &p}}, o);
  std::vector<float> w(w0.begin(), w0.end()), m(n, 0.0f), v(n, 0.0f);
  for (int step = 1; step <= 3; ++step) {
    for (int64_t j = 0; j < n; ++j)
      p.grad.data<float>()[j] = static_cast<float>(grads[step - 1][j]);
    cpu.step();
    AdamWElement u{o.lr,
                   o.beta1,
                   o.beta2,
                   o.eps,
                   o.weight_decay,
                   o.lr / (1.0 - std::pow(o.beta1, step)),
                   std::sqrt(1.0 - std::pow(o.beta2, step))};
    for (int64_t j = 0; j < n; ++j)
      u(&w[j], p.grad.data<float>()[j], &m[j], &v[j]);
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(w[j], p.value.data<float>()[j]) << "step " << step << " element " << j;
  }
}

TEST(CudaHostPool, ReusesBlocksBySizeClassAndStream) {
  int allocs = 0, frees = 0;
  BlockPool pool(
      [&](size_t n) {
        ++allocs;
        return std::malloc(n);
      },
      [&](void* p) {
        ++frees;
        std::free(p);
      },
      [] {}, size_t{64} << 20);
  int s1 = 0, s2 = 0;
  EXPECT_EQ(BlockPool::round_size(1), 512u);
  EXPECT_EQ(BlockPool::round_size(513), 1024u);
  EXPECT_EQ(BlockPool::round_size((1u << 20) + 1), size_t{2} << 20);
  EXPECT_EQ(pool.acquire(0, &s1), nullptr);
  void* a = pool.acquire(1000, &s1);
  pool.release(a, 1000, &s1);
  void* b = pool.acquire(1024, &s1);  // same class (1024), same stream: the cached block
  EXPECT_EQ(a, b);
  pool.release(b, 1024, &s1);
  void* c = pool.acquire(1000, &s2);  // another stream never gets it
  EXPECT_NE(c, a);
  PoolStats st = pool.stats();
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.misses, 2u);
  EXPECT_EQ(st.cached_bytes, 1024u);
  EXPECT_EQ(st.live_bytes, 1024u);
  pool.release(c, 1000, &s2);
  pool.release_cached();
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  EXPECT_EQ(allocs, frees);
}

TEST(CudaHostPool, LimitAndOutOfMemoryRetry) {
  int live_allocs = 0, syncs = 0;
  const int capacity = 3;  // the "device" holds three blocks
  BlockPool pool(
      [&](size_t n) -> void* {
        if (live_allocs == capacity) return nullptr;
        ++live_allocs;
        return std::malloc(n);
      },
      [&](void* p) {
        --live_allocs;
        std::free(p);
      },
      [&] { ++syncs; }, size_t{8} << 20);
  int s = 0;
  void* x = pool.acquire(size_t{4} << 20, &s);
  void* y = pool.acquire(size_t{4} << 20, &s);
  pool.release(x, size_t{4} << 20, &s);
  pool.release(y, size_t{4} << 20, &s);          // cache holds 8 MiB: at its limit
  void* z = pool.acquire(size_t{6} << 20, &s);   // new class: the device has one slot left
  void* w = pool.acquire(size_t{10} << 20, &s);  // none left: sync, flush, retry succeeds
  EXPECT_NE(z, nullptr);
  EXPECT_NE(w, nullptr);
  EXPECT_EQ(syncs, 1);
  EXPECT_EQ(pool.stats().flushes, 1u);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  pool.release(z, size_t{6} << 20, &s);
  pool.set_limit(0);  // frees past the limit
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  pool.release(w, size_t{10} << 20, &s);
  EXPECT_EQ(live_allocs, 0);
}

TEST(CudaHostLaunch, GridsCoverTheProblem) {
  for (int64_t T : {1, 15, 16, 17, 128, 8192})
    for (int64_t D : {1, 32, 64, 128, 256}) {
      const LaunchConfig f = flash_forward_config(64, T, D, D, false);
      EXPECT_GE(int64_t{f.grid.x} * kRowsPerBlock, T);
      EXPECT_LT(int64_t{f.grid.x - 1} * kRowsPerBlock, T);
      EXPECT_EQ(f.grid.y, 64u);
      EXPECT_EQ(f.block.x, unsigned(kWarp * kWarpsPerBlock));
      // Within what an sm_80 block may opt into (163 KiB), for every kernel.
      EXPECT_LE(f.smem_bytes, size_t{163} << 10);
      EXPECT_LE(flash_forward_smem(D, D, true), size_t{163} << 10);
      EXPECT_LE(flash_dkdv_smem(D, D), size_t{163} << 10);
      EXPECT_LE(flash_decode_smem(D, D), size_t{48} << 10);
    }
  EXPECT_EQ(rows_config(1).grid.x, 1u);
  EXPECT_EQ(rows_config(kRowWarps + 1).grid.x, 2u);
  EXPECT_EQ(elementwise_config(0).grid.x, 1u);
  EXPECT_EQ(elementwise_config(int64_t{1} << 40).grid.x, 65535u * 8);
}

// A bf16 problem both tensor-core kernels take: B 2, T = S = 64, D = Dv = 64, contiguous rows of
// one 16-byte aligned buffer (only addresses and strides are looked at).
alignas(16) uint16_t mma_buf[64];
kernels::AttentionArgs<uint16_t> mma_problem() {
  kernels::AttentionArgs<uint16_t> a;
  a.B = 2;
  a.T = a.S = 64;
  a.D = a.Dv = 64;
  a.q = {mma_buf, 4096, 0, 64, 1};
  a.k = {mma_buf, 4096, 0, 64, 1};
  a.v = {mma_buf, 4096, 0, 64, 1};
  a.out = {mma_buf, 4096, 0, 64, 1};
  return a;
}

TEST(CudaHostLaunch, TensorCoreForwardTakesOnlyWhatItSupports) {
  uint16_t* buf = mma_buf;
  const kernels::AttentionArgs<uint16_t> a = mma_problem();
  EXPECT_TRUE(flash_mma_supports(a));
  for (int64_t D : {32, 128}) {
    kernels::AttentionArgs<uint16_t> b = a;
    b.D = b.Dv = D;
    EXPECT_TRUE(flash_mma_supports(b)) << D;
  }
  // Two buffers of a K and a V tile, 64 rows of D + 8 bf16 each (D 128: past 48 KB, opted in).
  EXPECT_EQ(flash_mma_smem(32), size_t{2 * 2 * 64 * 40 * 2});
  EXPECT_EQ(flash_mma_smem(128), size_t{2 * 2 * 64 * 136 * 2});
  kernels::AttentionArgs<uint16_t> b = a;
  b.D = b.Dv = 48;
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.Dv = 32;
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.k.sd = 2;
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.v.st = 65;  // odd row stride: bf16 pairs would straddle 4-byte words
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.q.data = buf + 1;
  EXPECT_FALSE(flash_mma_supports(b));

  // K and V rows by 16-byte copies; Q and the output only need 4-byte words.
  b = a;
  b.q.data = buf + 2;
  EXPECT_TRUE(flash_mma_supports(b));
  b = a;
  b.k.data = buf + 2;
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.v.st = 68;  // 136-byte rows: not whole 16-byte pieces
  EXPECT_FALSE(flash_mma_supports(b));
  b = a;
  b.k.sh = 4;
  EXPECT_FALSE(flash_mma_supports(b));
}

// The tensor-core backward: what the forward takes, plus Q and dO by 16-byte copies and the
// gradients as bf16 pairs.
TEST(CudaHostLaunch, TensorCoreBackwardTakesOnlyWhatItSupports) {
  uint16_t* buf = mma_buf;
  const kernels::AttentionArgs<uint16_t> a = mma_problem();
  kernels::AttentionGradArgs<uint16_t> g;
  g.dout = {buf, 4096, 0, 64, 1};
  g.dq = {buf, 4096, 0, 64, 1};
  g.dk = {buf, 4096, 0, 64, 1};
  g.dv = {buf, 4096, 0, 64, 1};
  EXPECT_TRUE(flash_mma_backward_supports(a, g));
  kernels::AttentionArgs<uint16_t> b = a;
  b.D = b.Dv = 48;  // not the forward's either
  EXPECT_FALSE(flash_mma_backward_supports(b, g));
  b = a;
  b.q.data = buf + 2;  // enough for the forward's 4-byte loads, not for 16-byte copies
  EXPECT_TRUE(flash_mma_supports(b));
  EXPECT_FALSE(flash_mma_backward_supports(b, g));
  b = a;
  b.q.st = 68;
  EXPECT_FALSE(flash_mma_backward_supports(b, g));
  kernels::AttentionGradArgs<uint16_t> h = g;
  h.dout.data = buf + 2;
  EXPECT_FALSE(flash_mma_backward_supports(a, h));
  h = g;
  h.dout.sh = 4;
  EXPECT_FALSE(flash_mma_backward_supports(a, h));
  h = g;
  h.dq.data = buf + 1;
  EXPECT_FALSE(flash_mma_backward_supports(a, h));
  h = g;
  h.dk.st = 65;
  EXPECT_FALSE(flash_mma_backward_supports(a, h));
  h = g;
  h.dv.sd = 2;
  EXPECT_FALSE(flash_mma_backward_supports(a, h));
  h = g;
  h.dq.data = buf + 2;  // 4-byte words are enough for the gradients
  EXPECT_TRUE(flash_mma_backward_supports(a, h));
  b = a;
  b.S = int64_t{1} << 31;  // limits kept as 32-bit integers
  EXPECT_FALSE(flash_mma_backward_supports(b, g));
}

TEST(CudaHostMma, FragmentLayoutsAreBijections) {
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane) {
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const FragPos p = mma_a_pos(lane, reg, half);
        EXPECT_TRUE(p.row >= 0 && p.row < 16 && p.col >= 0 && p.col < 16);
        a.insert({p.row, p.col});
      }
    for (int reg = 0; reg < 2; ++reg)
      for (int half = 0; half < 2; ++half) {
        const FragPos p = mma_b_pos(lane, reg, half);
        EXPECT_TRUE(p.row >= 0 && p.row < 16 && p.col >= 0 && p.col < 8);
        b.insert({p.row, p.col});
      }
    for (int e = 0; e < 4; ++e) {
      const FragPos p = mma_c_pos(lane, e);
      EXPECT_TRUE(p.row >= 0 && p.row < 16 && p.col >= 0 && p.col < 8);
      c.insert({p.row, p.col});
      // The accumulator of key tile n lands where the next product's A fragment wants it.
      for (int n = 0; n < 2; ++n) {
        const FragPos q = mma_a_pos(lane, p_reg_of(n, e), e % 2);
        EXPECT_EQ(q.row, p.row);
        EXPECT_EQ(q.col, p.col + 8 * n);
      }
    }
  }
  EXPECT_EQ(a.size(), 256u);
  EXPECT_EQ(b.size(), 128u);
  EXPECT_EQ(c.size(), 128u);
}

// The pipelined forward's ldmatrix loads (flash_mma.cu), emulated from the PTX layout: each x4
// from the K tile yields exactly the B fragments of K^T that mma_b_pos prescribes for two key
// tiles, and each x4.trans from the V tile those of V for two dim tiles.
TEST(CudaHostMma, LdmatrixAddressesGiveTheMmaBFragments) {
  constexpr int kLd = 24;  // a padded row of 16 dims + 8
  uint16_t tile[16][kLd];  // 16 keys x 16 dims, each element its own value
  for (int key = 0; key < 16; ++key)
    for (int d = 0; d < kLd; ++d)
      tile[key][d] = static_cast<uint16_t>(key * 100 + d);
  // ldmatrix x4: lane l's address is row l % 8 of matrix l / 8; register i of a lane gets the
  // pair ldmatrix_pos names from the 8 x 8 matrix whose rows the lanes 8i..8i+7 addressed.
  auto ldsm = [&](bool trans, FragPos (*row_of)(int), uint32_t out[32][4]) {
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        uint16_t v[2];
        for (int half = 0; half < 2; ++half) {
          const FragPos e = ldmatrix_pos(lane, trans, half);  // (row, col) in matrix i
          const FragPos at = row_of(8 * i + e.row);           // the row's address, (key, dim)
          v[half] = tile[at.row][at.col + e.col];
        }
        out[lane][i] = uint32_t(v[0]) | uint32_t(v[1]) << 16;
      }
  };
  uint32_t k[32][4], v[32][4];
  ldsm(false, ldsm_k_row, k);
  ldsm(true, ldsm_v_row, v);
  for (int lane = 0; lane < 32; ++lane)
    for (int half_tile = 0; half_tile < 2; ++half_tile)
      for (int reg = 0; reg < 2; ++reg)
        for (int half = 0; half < 2; ++half) {
          const FragPos b = mma_b_pos(lane, reg, half);  // (k, n) of a 16 x 8 B
          const int shift = 16 * half;
          // K^T: B(k = dim, n = key) of keys 8 half_tile..; V: B(k = key, n = dim) of dims 8 ht...
          EXPECT_EQ((k[lane][2 * half_tile + reg] >> shift) & 0xffff,
                    tile[8 * half_tile + b.col][b.row])
              << "K lane " << lane << " reg " << reg << " half " << half;
          EXPECT_EQ((v[lane][2 * half_tile + reg] >> shift) & 0xffff,
                    tile[b.row][8 * half_tile + b.col])
              << "V lane " << lane << " reg " << reg << " half " << half;
        }
}

// The backward's A operands from shared memory (flash_mma.cu's dK/dV kernel: its keys' K and V
// rows): an x4 load without .trans at ldsm_a_row's addresses yields exactly the A fragment of the
// 16 x 16 block that mma_a_pos prescribes.
TEST(CudaHostMma, LdmatrixAddressesGiveTheMmaAFragments) {
  constexpr int kLd = 24;
  uint16_t tile[16][kLd];  // 16 rows x 16 columns (+ padding), each element its own value
  for (int row = 0; row < 16; ++row)
    for (int col = 0; col < kLd; ++col)
      tile[row][col] = static_cast<uint16_t>(row * 100 + col);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i)
      for (int half = 0; half < 2; ++half) {
        const FragPos e = ldmatrix_pos(lane, false, half);  // (row, col) in matrix i
        const FragPos at = ldsm_a_row(8 * i + e.row);       // the address of that row
        const FragPos want = mma_a_pos(lane, i, half);
        EXPECT_EQ(tile[at.row][at.col + e.col], tile[want.row][want.col])
            << "lane " << lane << " reg " << i << " half " << half;
      }
}

// Two bf16 in one 32-bit register, the low one first.
uint32_t pair_of(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// mma.sync.m16n8k16 (bf16 in, f32 accumulate) of a whole warp on the host: C(16x8) += A(16x16)
// B(16x8), each lane's registers read and written at the fragment positions of mma_layout.hpp.
void mma_emulated(float c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
  auto lo = [](uint32_t r) { return bf16_widen(static_cast<uint16_t>(r)); };
  auto hi = [](uint32_t r) { return bf16_widen(static_cast<uint16_t>(r >> 16)); };
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    for (int r = 0; r < 4; ++r) {
      FragPos p0 = mma_a_pos(l, r, 0), p1 = mma_a_pos(l, r, 1);
      A[p0.row][p0.col] = lo(a[l][r]);
      A[p1.row][p1.col] = hi(a[l][r]);
    }
    for (int r = 0; r < 2; ++r) {
      FragPos p0 = mma_b_pos(l, r, 0), p1 = mma_b_pos(l, r, 1);
      B[p0.row][p0.col] = lo(b[l][r]);
      B[p1.row][p1.col] = hi(b[l][r]);
    }
  }
  for (int l = 0; l < 32; ++l)
    for (int e = 0; e < 4; ++e) {
      const FragPos p = mma_c_pos(l, e);
      for (int k = 0; k < 16; ++k)
        c[l][e] += A[p.row][k] * B[k][p.col];
    }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans] of a whole warp on the host, from a row-major bf16 tile
// whose rows are `ld` apart: lane l addresses row `row0 + addr(l).row`, column `col0 + addr(l).col`
// (row l % 8 of matrix l / 8), and register i of every lane gets the pair ldmatrix_pos names in
// matrix i.
void ldsm_emulated(uint32_t out[32][4], const uint16_t* tile, int ld, int row0, int col0,
                   FragPos (*addr)(int), bool trans) {
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      uint16_t v[2];
      for (int half = 0; half < 2; ++half) {
        const FragPos e = ldmatrix_pos(lane, trans, half);
        const FragPos at = addr(8 * i + e.row);
        v[half] = tile[(row0 + at.row) * ld + col0 + at.col + e.col];
      }
      out[lane][i] = pair_of(v[0], v[1]);
    }
}

// The kernels' ldsm_x4 followed by two mma: the load's two B fragments (two 8-column tiles) times
// one A fragment, into c0 and c1.
void mma_x4_emulated(float c0[32][4], float c1[32][4], const uint32_t a[32][4],
                     const uint16_t* tile, int ld, int row0, int col0, FragPos (*addr)(int),
                     bool trans) {
  uint32_t r[32][4], b0[32][2], b1[32][2];
  ldsm_emulated(r, tile, ld, row0, col0, addr, trans);
  for (int l = 0; l < 32; ++l) {
    b0[l][0] = r[l][0], b0[l][1] = r[l][1];
    b1[l][0] = r[l][2], b1[l][1] = r[l][3];
  }
  mma_emulated(c0, a, b0);
  mma_emulated(c1, a, b1);
}

// One warp of flash_mma.cu's forward on the host: 16 query rows against S keys in tiles of 64,
// each mma emulated from the fragment layouts, the registers filled and read exactly as the
// kernel does (mma_layout.hpp). Checks the index arithmetic that a GPU run would otherwise be
// the first to see.
TEST(CudaHostMma, WarpForwardEmulationMatchesTheReference) {
  constexpr int D = 32, kKeys = 64, kChunks = D / 16, kOut = D / 8, kTiles = kKeys / 8;
  const int S = 100;
  Rng rng(21);
  auto bf = [&](double lo, double hi) {
    return bf16_round(static_cast<float>(rng.uniform(lo, hi)));
  };
  std::vector<uint16_t> Q(16 * D), K(S * D), V(S * D);
  for (auto& x : Q)
    x = bf(-1, 1);
  for (auto& x : K)
    x = bf(-1, 1);
  for (auto& x : V)
    x = bf(-1, 1);
  auto pair = pair_of;
  auto mma = mma_emulated;
  const float scale = 1.0f / std::sqrt(float(D));
  uint32_t qa[kChunks][32][4];
  for (int kc = 0; kc < kChunks; ++kc)
    for (int l = 0; l < 32; ++l)
      for (int r = 0; r < 4; ++r) {
        const FragPos p = mma_a_pos(l, r, 0);
        qa[kc][l][r] = pair(Q[p.row * D + kc * 16 + p.col], Q[p.row * D + kc * 16 + p.col + 1]);
      }
  float o[kOut][32][4] = {}, m[32][2], l_[32][2] = {};
  for (int l = 0; l < 32; ++l)
    m[l][0] = m[l][1] = -INFINITY;
  for (int s0 = 0; s0 < S; s0 += kKeys) {
    std::vector<uint16_t> ks(kKeys * D, 0), vts(D * kKeys, 0);  // K tile, V tile transposed
    for (int key = 0; key < kKeys && s0 + key < S; ++key)
      for (int d = 0; d < D; ++d) {
        ks[key * D + d] = K[(s0 + key) * D + d];
        vts[d * kKeys + key] = V[(s0 + key) * D + d];
      }
    float sc[kTiles][32][4] = {};
    for (int n = 0; n < kTiles; ++n)
      for (int kc = 0; kc < kChunks; ++kc) {
        uint32_t b[32][2];
        for (int l = 0; l < 32; ++l)
          for (int r = 0; r < 2; ++r) {
            const FragPos p = mma_b_pos(l, r, 0);
            const uint16_t* at = &ks[(n * 8 + p.col) * D + kc * 16 + p.row];
            b[l][r] = pair(at[0], at[1]);
          }
        mma(sc[n], qa[kc], b);
      }
    float alpha[32][2], row_max[32][2], row_sum[32][2] = {};
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 2; ++i)
        row_max[l][i] = -INFINITY;
    for (int n = 0; n < kTiles; ++n)
      for (int l = 0; l < 32; ++l)
        for (int e = 0; e < 4; ++e) {
          const int s = s0 + n * 8 + mma_c_pos(l, e).col;
          sc[n][l][e] = s < S ? sc[n][l][e] * scale : -INFINITY;
          row_max[l][e >> 1] = std::max(row_max[l][e >> 1], sc[n][l][e]);
        }
    auto group_reduce = [](float v[32][2], bool is_max) {  // __shfl_xor 1 then 2
      for (int off : {1, 2}) {
        float next[32][2];
        for (int l = 0; l < 32; ++l)
          for (int i = 0; i < 2; ++i)
            next[l][i] = is_max ? std::max(v[l][i], v[l ^ off][i]) : v[l][i] + v[l ^ off][i];
        std::memcpy(v, next, sizeof(next));
      }
    };
    group_reduce(row_max, true);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 2; ++i) {
        const float m_new = std::max(m[l][i], row_max[l][i]);
        alpha[l][i] = SoftmaxState::rescale(m[l][i], m_new);
        m[l][i] = m_new;
      }
    uint32_t pa[kKeys / 16][32][4];
    for (int n = 0; n < kTiles; ++n)
      for (int l = 0; l < 32; ++l) {
        float pe[4];
        for (int e = 0; e < 4; ++e) {
          const float x = sc[n][l][e];
          pe[e] = x == -INFINITY ? 0.0f : std::exp(x - m[l][e >> 1]);
          row_sum[l][e >> 1] += pe[e];
        }
        pa[n / 2][l][p_reg_of(n, 0)] = pair(bf16_round(pe[0]), bf16_round(pe[1]));
        pa[n / 2][l][p_reg_of(n, 2)] = pair(bf16_round(pe[2]), bf16_round(pe[3]));
      }
    group_reduce(row_sum, false);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 2; ++i)
        l_[l][i] = l_[l][i] * alpha[l][i] + row_sum[l][i];
    for (int n = 0; n < kOut; ++n) {
      for (int l = 0; l < 32; ++l)
        for (int e = 0; e < 4; ++e)
          o[n][l][e] *= alpha[l][e >> 1];
      for (int kc = 0; kc < kKeys / 16; ++kc) {
        uint32_t b[32][2];
        for (int l = 0; l < 32; ++l)
          for (int r = 0; r < 2; ++r) {
            const FragPos p = mma_b_pos(l, r, 0);
            const uint16_t* at = &vts[(n * 8 + p.col) * kKeys + kc * 16 + p.row];
            b[l][r] = pair(at[0], at[1]);
          }
        mma(o[n], pa[kc], b);
      }
    }
  }
  // The reference in double on the same bf16 inputs.
  double max_err = 0;
  for (int n = 0; n < kOut; ++n)
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < 4; ++e) {
        const FragPos p = mma_c_pos(l, e);
        const int t = p.row, d = n * 8 + p.col;
        std::vector<double> w(S);
        double mx = -INFINITY, sum = 0, out = 0;
        for (int s = 0; s < S; ++s) {
          double dot = 0;
          for (int k = 0; k < D; ++k)
            dot += double(bf16_widen(Q[t * D + k])) * bf16_widen(K[s * D + k]);
          w[s] = dot * scale;
          mx = std::max(mx, w[s]);
        }
        for (int s = 0; s < S; ++s)
          sum += std::exp(w[s] - mx);
        for (int s = 0; s < S; ++s)
          out += std::exp(w[s] - mx) / sum * bf16_widen(V[s * D + d]);
        max_err = std::max(max_err, std::abs(o[n][l][e] / l_[l][e >> 1] - out));
      }
  EXPECT_LT(max_err, 1e-2);  // P rounded to bf16 before the second product
  std::printf("  emulated warp forward: max err %.3g\n", max_err);
}

// flash_mma.cu's backward on the host, every warp of one block of each kernel: the dK/dV kernel
// (64 keys, 4 warps of 16, their K and V rows as A operands by ldmatrix at ldsm_a_row; queries in
// tiles of 64, Q^T and dO^T as B operands at ldsm_k_row, dO and Q by .trans at ldsm_v_row; P Z
// and dS^T from the accumulators into A fragments by p_reg_of) and the dQ kernel (a warp's 16
// rows against key tiles of 64), each mma and ldmatrix emulated, against double. No masks or
// dropout here (the GPU sweep has them); T and S ragged against the tiles.
TEST(CudaHostMma, WarpBackwardEmulationMatchesTheReference) {
  constexpr int D = 32, ld = D + 8, kChunks = D / 16, kOut = D / 8, QT = 64, kQTiles = QT / 8;
  const int T = 100, S = 40;
  const float scale = 1.0f / std::sqrt(float(D));
  Rng rng(22);
  auto bf = [&](double lo, double hi) {
    return bf16_round(static_cast<float>(rng.uniform(lo, hi)));
  };
  // Row-major bf16 matrices padded to whole tiles (zeros past T or S) with rows ld apart, as the
  // kernels' shared memory holds them.
  const int Tp = 128, Sp = 64;
  std::vector<uint16_t> Q(Tp * ld, 0), G(Tp * ld, 0), K(Sp * ld, 0), V(Sp * ld, 0);
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < D; ++d) {
      Q[t * ld + d] = bf(-1, 1);
      G[t * ld + d] = bf(-1, 1);
    }
  for (int s = 0; s < S; ++s)
    for (int d = 0; d < D; ++d) {
      K[s * ld + d] = bf(-1, 1);
      V[s * ld + d] = bf(-1, 1);
    }
  auto w = [](uint16_t x) { return double(bf16_widen(x)); };
  // The reference: P, lse, delta = rowsum(dO * O), and the gradients, in double.
  std::vector<double> P(T * S), lse(T), delta(T, 0.0), dq(T * D, 0.0), dk(S * D, 0.0),
      dv(S * D, 0.0);
  for (int t = 0; t < T; ++t) {
    double mx = -INFINITY, sum = 0;
    for (int s = 0; s < S; ++s) {
      double dot = 0;
      for (int d = 0; d < D; ++d)
        dot += w(Q[t * ld + d]) * w(K[s * ld + d]);
      P[t * S + s] = dot * scale;
      mx = std::max(mx, P[t * S + s]);
    }
    for (int s = 0; s < S; ++s)
      sum += std::exp(P[t * S + s] - mx);
    lse[t] = mx + std::log(sum);
    for (int s = 0; s < S; ++s)
      P[t * S + s] = std::exp(P[t * S + s] - lse[t]);
    for (int d = 0; d < D; ++d) {
      double o = 0;
      for (int s = 0; s < S; ++s)
        o += P[t * S + s] * w(V[s * ld + d]);
      delta[t] += o * w(G[t * ld + d]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) {
      double dp = 0;
      for (int d = 0; d < D; ++d)
        dp += w(G[t * ld + d]) * w(V[s * ld + d]);
      const double ds = P[t * S + s] * (dp - delta[t]);
      for (int d = 0; d < D; ++d) {
        dq[t * D + d] += scale * ds * w(K[s * ld + d]);
        dk[s * D + d] += scale * ds * w(Q[t * ld + d]);
        dv[s * D + d] += P[t * S + s] * w(G[t * ld + d]);
      }
    }
  auto max_abs = [](const std::vector<double>& v) {
    double m = 0;
    for (double x : v)
      m = std::max(m, std::abs(x));
    return m;
  };

  // dK and dV: each warp of the block, every query tile.
  double err_k = 0, err_v = 0;
  for (int warp = 0; warp < 4; ++warp) {
    float dkf[kOut][32][4] = {}, dvf[kOut][32][4] = {};
    for (int t0 = 0; t0 < T; t0 += QT) {
      const uint16_t* qs = &Q[t0 * ld];
      const uint16_t* gs = &G[t0 * ld];
      float sc[kQTiles][32][4] = {}, dp[kQTiles][32][4] = {};
      for (int kc = 0; kc < kChunks; ++kc) {
        uint32_t ka[32][4], va[32][4];
        ldsm_emulated(ka, K.data(), ld, warp * 16, kc * 16, ldsm_a_row, false);
        ldsm_emulated(va, V.data(), ld, warp * 16, kc * 16, ldsm_a_row, false);
        for (int np = 0; np < kQTiles / 2; ++np) {
          mma_x4_emulated(sc[2 * np], sc[2 * np + 1], ka, qs, ld, np * 16, kc * 16, ldsm_k_row,
                          false);
          mma_x4_emulated(dp[2 * np], dp[2 * np + 1], va, gs, ld, np * 16, kc * 16, ldsm_k_row,
                          false);
        }
      }
      uint32_t pa[QT / 16][32][4], da[QT / 16][32][4];
      for (int n = 0; n < kQTiles; ++n)
        for (int l = 0; l < 32; ++l) {
          float pe[4], de[4];
          for (int e = 0; e < 4; ++e) {
            const int t = t0 + n * 8 + mma_c_pos(l, e).col;
            const int s = warp * 16 + mma_c_pos(l, e).row;
            pe[e] = de[e] = 0.0f;
            if (t < T && s < S) {
              const float pv = std::exp(sc[n][l][e] * scale - float(lse[t]));
              pe[e] = pv;
              de[e] = pv * (dp[n][l][e] - float(delta[t]));
            }
          }
          pa[n / 2][l][p_reg_of(n, 0)] = pair_of(bf16_round(pe[0]), bf16_round(pe[1]));
          pa[n / 2][l][p_reg_of(n, 2)] = pair_of(bf16_round(pe[2]), bf16_round(pe[3]));
          da[n / 2][l][p_reg_of(n, 0)] = pair_of(bf16_round(de[0]), bf16_round(de[1]));
          da[n / 2][l][p_reg_of(n, 2)] = pair_of(bf16_round(de[2]), bf16_round(de[3]));
        }
      for (int np = 0; np < kOut / 2; ++np)
        for (int kc = 0; kc < QT / 16; ++kc) {
          mma_x4_emulated(dvf[2 * np], dvf[2 * np + 1], pa[kc], gs, ld, kc * 16, np * 16,
                          ldsm_v_row, true);
          mma_x4_emulated(dkf[2 * np], dkf[2 * np + 1], da[kc], qs, ld, kc * 16, np * 16,
                          ldsm_v_row, true);
        }
    }
    for (int n = 0; n < kOut; ++n)
      for (int l = 0; l < 32; ++l)
        for (int e = 0; e < 4; ++e) {
          const int s = warp * 16 + mma_c_pos(l, e).row, d = n * 8 + mma_c_pos(l, e).col;
          if (s >= S) continue;
          err_k = std::max(err_k, std::abs(dkf[n][l][e] * scale - dk[s * D + d]));
          err_v = std::max(err_v, std::abs(dvf[n][l][e] - dv[s * D + d]));
        }
  }

  // dQ: each warp's 16 rows of the two query blocks, against the key tile(s).
  double err_q = 0;
  for (int t0 = 0; t0 < T; t0 += 16) {
    uint32_t qa[kChunks][32][4], ga[kChunks][32][4];
    for (int kc = 0; kc < kChunks; ++kc)
      for (int l = 0; l < 32; ++l)
        for (int r = 0; r < 4; ++r) {
          const FragPos p = mma_a_pos(l, r, 0);
          const uint16_t* q = &Q[(t0 + p.row) * ld + kc * 16 + p.col];
          const uint16_t* g = &G[(t0 + p.row) * ld + kc * 16 + p.col];
          qa[kc][l][r] = pair_of(q[0], q[1]);
          ga[kc][l][r] = pair_of(g[0], g[1]);
        }
    float dqf[kOut][32][4] = {};
    for (int s0 = 0; s0 < S; s0 += 64) {
      float sc[8][32][4] = {}, dp[8][32][4] = {};
      for (int np = 0; np < 4; ++np)
        for (int kc = 0; kc < kChunks; ++kc) {
          mma_x4_emulated(sc[2 * np], sc[2 * np + 1], qa[kc], &K[s0 * ld], ld, np * 16, kc * 16,
                          ldsm_k_row, false);
          mma_x4_emulated(dp[2 * np], dp[2 * np + 1], ga[kc], &V[s0 * ld], ld, np * 16, kc * 16,
                          ldsm_k_row, false);
        }
      uint32_t dsa[4][32][4];
      for (int n = 0; n < 8; ++n)
        for (int l = 0; l < 32; ++l) {
          float de[4];
          for (int e = 0; e < 4; ++e) {
            const int t = t0 + mma_c_pos(l, e).row, s = s0 + n * 8 + mma_c_pos(l, e).col;
            de[e] = 0.0f;
            if (t < T && s < S)
              de[e] =
                  std::exp(sc[n][l][e] * scale - float(lse[t])) * (dp[n][l][e] - float(delta[t]));
          }
          dsa[n / 2][l][p_reg_of(n, 0)] = pair_of(bf16_round(de[0]), bf16_round(de[1]));
          dsa[n / 2][l][p_reg_of(n, 2)] = pair_of(bf16_round(de[2]), bf16_round(de[3]));
        }
      for (int np = 0; np < kOut / 2; ++np)
        for (int kc = 0; kc < 4; ++kc) {
          mma_x4_emulated(dqf[2 * np], dqf[2 * np + 1], dsa[kc], &K[s0 * ld], ld, kc * 16, np * 16,
                          ldsm_v_row, true);
        }
    }
    for (int n = 0; n < kOut; ++n)
      for (int l = 0; l < 32; ++l)
        for (int e = 0; e < 4; ++e) {
          const int t = t0 + mma_c_pos(l, e).row, d = n * 8 + mma_c_pos(l, e).col;
          if (t < T) err_q = std::max(err_q, std::abs(dqf[n][l][e] * scale - dq[t * D + d]));
        }
  }
  // P Z and dS rounded to bf16 before their products: 1e-2 of each gradient's largest element.
  EXPECT_LT(err_q, 1e-2 * max_abs(dq)) << "max |dq| " << max_abs(dq);
  EXPECT_LT(err_k, 1e-2 * max_abs(dk)) << "max |dk| " << max_abs(dk);
  EXPECT_LT(err_v, 1e-2 * max_abs(dv)) << "max |dv| " << max_abs(dv);
  std::printf(
      "  emulated warp backward: max err dq %.3g dk %.3g dv %.3g (max |ref| %.3g %.3g %.3g)\n",
      err_q, err_k, err_v, max_abs(dq), max_abs(dk), max_abs(dv));
}

// A column-major GEMM on the host, as cuBLASLt reads its operands: checks that the row-major ->
// column-major mapping (gemm_plan.hpp) computes row-major C = op(A) op(B) for every transpose.
TEST(CudaHostGemm, ColumnMajorMappingComputesTheRowMajorProduct) {
  Rng rng(2);
  const int64_t M = 5, N = 3, K = 4;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      GemmArgs g;
      g.M = M;
      g.N = N;
      g.K = K;
      g.trans_a = ta;
      g.trans_b = tb;
      g.lda = (ta ? M : K) + 2;  // padded rows
      g.ldb = (tb ? K : N) + 1;
      g.ldc = N;
      std::vector<double> A((ta ? K : M) * g.lda), B((tb ? N : K) * g.ldb);
      for (auto& a : A)
        a = rng.uniform(-1, 1);
      for (auto& b : B)
        b = rng.uniform(-1, 1);
      auto a_at = [&](int64_t m, int64_t k) { return ta ? A[k * g.lda + m] : A[m * g.lda + k]; };
      auto b_at = [&](int64_t k, int64_t n) { return tb ? B[n * g.ldb + k] : B[k * g.ldb + n]; };
      const ColumnMajorGemm c = column_major(g);
      // Column-major element (r, col) of a stored matrix with leading dimension ld: p[col*ld + r].
      auto first = [&](int64_t r, int64_t k) {  // op(first) (m, k)
        return c.trans_first ? B[r * g.ldb + k] : B[k * g.ldb + r];
      };
      auto second = [&](int64_t k, int64_t col) {  // op(second) (k, n)
        return c.trans_second ? A[k * g.lda + col] : A[col * g.lda + k];
      };
      EXPECT_EQ(c.trans_first ? c.first_cols : c.first_rows, c.m);
      EXPECT_EQ(c.trans_second ? c.second_rows : c.second_cols, c.n);
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double d = 0, want = 0;
          for (int64_t k = 0; k < c.k; ++k)
            d += first(i, k) * second(k, j);
          // D (m, n) column-major is row-major C (n = M rows, m = N cols): C[j][i].
          for (int64_t k = 0; k < K; ++k)
            want += a_at(j, k) * b_at(k, i);
          EXPECT_NEAR(d, want, 1e-12) << "ta " << ta << " tb " << tb;
        }
    }
}

TEST(CudaHostGemm, PlanKeysSeparateWhatTheHeuristicSees) {
  alignas(16) float buf[64];
  GemmArgs g;
  g.M = 4;
  g.N = 4;
  g.K = 4;
  g.lda = g.ldb = g.ldc = 4;
  g.A = buf;
  g.B = buf;
  g.C = buf;
  std::set<size_t> hashes;
  const GemmKey base = gemm_key(g);
  hashes.insert(GemmKeyHash{}(base));
  GemmArgs h = g;
  h.A = buf + 16;  // other pointer, same alignment: the same plan
  EXPECT_EQ(gemm_key(h), base);
  h.A = buf + 1;  // misaligned: another plan
  EXPECT_FALSE(gemm_key(h) == base);
  h = g;
  h.trans_b = true;
  EXPECT_FALSE(gemm_key(h) == base);
  hashes.insert(GemmKeyHash{}(gemm_key(h)));
  h = g;
  h.beta = 1.0f;
  EXPECT_FALSE(gemm_key(h) == base);
  hashes.insert(GemmKeyHash{}(gemm_key(h)));
  h = g;
  h.type = GemmType::kBF16;
  EXPECT_FALSE(gemm_key(h) == base);
  hashes.insert(GemmKeyHash{}(gemm_key(h)));
  // A strided batch is another plan, and so is each stride; without a batch the strides are moot.
  h = g;
  h.stride_a = 99;
  EXPECT_EQ(gemm_key(h), base);
  h.batch = 8;
  h.stride_a = h.stride_b = h.stride_c = 16;
  const GemmKey batched = gemm_key(h);
  EXPECT_FALSE(batched == base);
  hashes.insert(GemmKeyHash{}(batched));
  h.stride_c = 32;
  EXPECT_FALSE(gemm_key(h) == batched);
  hashes.insert(GemmKeyHash{}(gemm_key(h)));
  EXPECT_EQ(hashes.size(), 6u);
}

TEST(CudaHostGraph, CapturesOncePerKeyAndReplays) {
  int captured = 0, launched = 0, destroyed = 0, body_runs = 0;
  std::vector<int> handles;
  handles.reserve(8);
  GraphCacheCore cache(GraphOps{[&](const std::function<void()>& body) -> void* {
                                  body();  // recording runs the body once
                                  handles.push_back(++captured);
                                  return &handles.back();
                                },
                                [&](void*) { ++launched; }, [&](void*) { ++destroyed; }});
  auto step = [&] { ++body_runs; };
  for (int i = 0; i < 3; ++i)
    cache.run({"step", {32, 128}}, step);
  cache.run({"step", {32, 64}}, step);    // another shape: another graph
  cache.run({"other", {32, 128}}, step);  // another name: another graph
  cache.run({"step", {32, 128}}, step);
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(cache.captures(), 3u);
  EXPECT_EQ(cache.launches(), 6u);
  EXPECT_EQ(body_runs, 3);
  EXPECT_EQ(launched, 6);
  EXPECT_NE(GraphKeyHash{}({"step", {32, 128}}), GraphKeyHash{}({"step", {128, 32}}));
  cache.clear();
  EXPECT_EQ(destroyed, 3);
  EXPECT_EQ(cache.size(), 0u);
}

TEST(CudaHostDevice, DeviceTensorsRefuseHostAccessAndTheFlagParses) {
  EXPECT_TRUE(cuda_built());
  EXPECT_EQ(parse_device("cpu"), Device::kCpu);
  EXPECT_EQ(parse_device("cuda"), Device::kCuda);
  EXPECT_THROW(parse_device("tpu"), Error);
  // A host block adopted as if it were device memory: element access must refuse it.
  std::shared_ptr<std::byte> storage(new std::byte[16], [](std::byte* p) { delete[] p; });
  Tensor t = Tensor::adopt(storage, {4}, DType::F32, Device::kCuda);
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_THROW(t.to_vector(), Error);
  EXPECT_THROW(t.at({0}), Error);
  EXPECT_THROW(t.fill(1.0), Error);
  EXPECT_EQ(t.slice(0, 1, 3).device(), Device::kCuda);
  EXPECT_EQ(Tensor::zeros({2}).device(), Device::kCpu);
}

}  // namespace
}  // namespace attn::cuda
