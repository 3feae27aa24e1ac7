// The block cache behind attn::Tensor (attn/core/memory.hpp): large blocks come back to tensors of
// about the same size, within the limit, and nothing is shared between live tensors.
#include "attn/core/memory.hpp"
#include "attn/core/tensor.hpp"
#include "attn/ops/attention.hpp"

#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

namespace attn {
namespace {

// Each test starts from an empty cache with a known limit and restores the default after.
class MemoryCache : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = memory_cache_stats().limit_bytes;
    set_memory_cache_limit(size_t{64} << 20);
    release_cached_memory();
  }
  void TearDown() override {
    release_cached_memory();
    set_memory_cache_limit(saved_);
  }
  size_t saved_ = 0;
};

constexpr int64_t kMiB = 1 << 18;  // floats per MiB

TEST_F(MemoryCache, FreedBlockServesTheNextTensorOfItsSize) {
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({4 * kMiB});
    first = a.raw_data();
  }
  EXPECT_EQ(memory_cache_stats().cached_blocks, 1u);
  EXPECT_GE(memory_cache_stats().cached_bytes, size_t{4} << 20);
  const uint64_t hits = memory_cache_stats().hits;
  Tensor b = Tensor::zeros({4 * kMiB});
  EXPECT_EQ(b.raw_data(), first);
  EXPECT_EQ(memory_cache_stats().hits, hits + 1);
  EXPECT_EQ(memory_cache_stats().cached_blocks, 0u);
  EXPECT_EQ(b.data<float>()[4 * kMiB - 1], 0.0f);  // zeros() still zeroes a reused block
}

TEST_F(MemoryCache, SizesMustBeClose) {
  { Tensor a = Tensor::empty({4 * kMiB}); }
  const MemoryCacheStats before = memory_cache_stats();
  Tensor small = Tensor::empty({2 * kMiB});  // the 4 MiB block is more than 1/8 too large
  Tensor large = Tensor::empty({5 * kMiB});  // and too small
  EXPECT_EQ(memory_cache_stats().hits, before.hits);
  EXPECT_EQ(memory_cache_stats().cached_blocks, 1u);
  {
    Tensor close = Tensor::empty({4 * kMiB - 1000});  // within 1/8: reused
    EXPECT_EQ(memory_cache_stats().hits, before.hits + 1);
    EXPECT_EQ(memory_cache_stats().cached_bytes, 0u);
  }
  // It goes back with its own size, not the smaller tensor's (the limit counts real memory).
  EXPECT_EQ(memory_cache_stats().cached_bytes, size_t{4} << 20);
}

TEST_F(MemoryCache, SmallBlocksStayWithTheirThread) {
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({1000});
    first = a.raw_data();
  }
  EXPECT_EQ(memory_cache_stats().cached_blocks, 0u);  // not in the shared cache of large blocks
  {
    Tensor b = Tensor::full({900}, 2.0);  // 3600 bytes: the same 4 KiB class
    EXPECT_EQ(b.raw_data(), first);
    EXPECT_EQ(b.data<float>()[899], 2.0f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.raw_data()) % 64, 0u);
    Tensor live = Tensor::empty({1000});  // b is live: another block
    EXPECT_NE(live.raw_data(), b.raw_data());
  }
  // Another thread's allocations never take this thread's free blocks.
  std::thread([first] {
    Tensor c = Tensor::empty({1000});
    EXPECT_NE(c.raw_data(), first);
  }).join();
  set_memory_cache_limit(0);  // off: small blocks are not kept either
  { Tensor d = Tensor::empty({1000}); }
  Tensor e = Tensor::zeros({1000});
  EXPECT_EQ(e.data<float>()[999], 0.0f);
}

TEST_F(MemoryCache, ManySmallTensorsLiveTogether) {
  std::vector<Tensor> live;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 100; ++i)
      live.push_back(Tensor::full({int64_t{1} + i * 37}, double(i)));
    for (int i = 0; i < 100; ++i)
      ASSERT_EQ(live[static_cast<size_t>(i)].data<float>()[i * 37], float(i));
    live.clear();
  }
}

TEST_F(MemoryCache, LimitFreesOldestFirst) {
  set_memory_cache_limit(size_t{10} << 20);
  void* second = nullptr;
  {
    Tensor a = Tensor::empty({4 * kMiB});
    Tensor b = Tensor::empty({4 * kMiB});
    Tensor c = Tensor::empty({4 * kMiB});
    second = b.raw_data();
    a = Tensor();  // freed first: the oldest
    b = Tensor();
  }  // c freed last: 12 MiB > 10, so a's block goes
  EXPECT_EQ(memory_cache_stats().cached_blocks, 2u);
  EXPECT_LE(memory_cache_stats().cached_bytes, size_t{10} << 20);
  Tensor x = Tensor::empty({4 * kMiB});
  Tensor y = Tensor::empty({4 * kMiB});
  EXPECT_TRUE(x.raw_data() == second || y.raw_data() == second);

  set_memory_cache_limit(0);  // off: frees what is held, keeps nothing
  EXPECT_EQ(memory_cache_stats().cached_bytes, 0u);
  x = Tensor();
  EXPECT_EQ(memory_cache_stats().cached_blocks, 0u);
}

TEST_F(MemoryCache, LiveTensorsNeverShare) {
  std::vector<Tensor> live;
  for (int i = 0; i < 4; ++i) {
    live.push_back(Tensor::full({kMiB}, double(i)));
    live.pop_back();
    live.push_back(Tensor::full({kMiB}, double(i)));
  }
  Tensor other = Tensor::full({kMiB}, -1.0);
  EXPECT_NE(other.raw_data(), live.back().raw_data());
  EXPECT_EQ(live.back().data<float>()[kMiB - 1], 3.0f);
}

TEST_F(MemoryCache, ThreadsAllocateAndFreeConcurrently) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 50; ++i) {
        Tensor a = Tensor::full({kMiB / 2 + t * 1000}, double(t));
        ASSERT_EQ(a.data<float>()[0], float(t));
        ASSERT_EQ(a.data<float>()[kMiB / 2 - 1], float(t));
      }
    });
  for (auto& th : threads)
    th.join();
  EXPECT_LE(memory_cache_stats().cached_bytes, size_t{64} << 20);
}

// The attention kernels take their scratch from the same cache (kernels/cpu/scratch.hpp): a
// repeated call is served from it without a miss, and release_cached_memory() frees it all.
TEST_F(MemoryCache, KernelScratchComesFromTheCache) {
  std::mt19937 gen(7);
  std::normal_distribution<float> dist;
  const auto random = [&](Shape shape) {
    Tensor t = Tensor::empty(std::move(shape));
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = dist(gen);
    return t;
  };
  // B = 2 < 4: the fp32 backward splits the keys and keeps (T, D) dQ shares per item (~1 MiB).
  const Tensor q = random({2, 1024, 64}), k = random({2, 1024, 64}), v = random({2, 1024, 64});
  const Tensor dout = random({2, 1024, 64});
  for (DType dtype : {DType::F32, DType::BF16}) {
    Context ctx;
    ctx.backend = Backend::kCpu;
    ctx.threads = 2;
    const Tensor qd = q.to(dtype), kd = k.to(dtype), vd = v.to(dtype), dod = dout.to(dtype);
    const auto step = [&] {
      const AttentionResult fwd = scaled_dot_product_attention(ctx, qd, kd, vd);
      const AttentionGrads g = scaled_dot_product_attention_backward(ctx, dod, qd, kd, vd, fwd);
      ASSERT_EQ(g.dq.shape(), q.shape());
    };
    step();
    // Freed by now: out, dq, dk, dv (4 x 2 x 1024 x 64 elements; lse is below the cache's
    // 128 KiB). The rest of what the cache holds is kernel scratch, at least the backward's
    // per-item dQ shares (B * 2 key splits * T * D floats = 1 MiB).
    const MemoryCacheStats warm = memory_cache_stats();
    const size_t tensors = 4 * q.numel() * dtype_size(dtype);
    EXPECT_GE(warm.cached_bytes, tensors + (size_t{1} << 20)) << dtype_name(dtype);
    step();
    const MemoryCacheStats again = memory_cache_stats();
    EXPECT_EQ(again.misses, warm.misses) << dtype_name(dtype) << ": scratch was allocated anew";
    EXPECT_GT(again.hits, warm.hits) << dtype_name(dtype);
    release_cached_memory();
    EXPECT_EQ(memory_cache_stats().cached_bytes, 0u);
    EXPECT_EQ(memory_cache_stats().cached_blocks, 0u);
  }
}

}  // namespace
}  // namespace attn
