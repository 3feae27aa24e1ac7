// Ring attention (attn/ops/ring_attention.hpp) under `mpirun -np N` (N = 2 or 4, over shared
// memory and TCP loopback; tests/mpi/CMakeLists.txt): every case of tests/ring_harness.hpp
// against the single-process fused SDPA on the gathered sequence, and the faults that must be
// reported on every rank instead of hanging the ring.
#include "attn/core/error.hpp"
#include "ring_harness.hpp"

#include <gtest/gtest.h>

#include <string>

namespace attn {
namespace {

using testing::random_tensor;

Communicator& world() {
  static std::shared_ptr<Communicator> w = world_communicator();
  return *w;
}

TEST(MpiRing, EqualsSingleProcessFusedSdpa) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  for (const testing::RingCase& c : testing::ring_cases())
    testing::check_ring_case(world(), c);
}

TEST(MpiRing, DropoutDrawsTheSingleProcessMask) {
  // Every block's kernel call draws the gathered problem's mask (p = 0.1 and 0.5, both layouts,
  // causal zigzag, valid_lens, bf16, a data-parallel sample window).
  for (const testing::RingCase& c : testing::ring_dropout_cases())
    testing::check_ring_case(world(), c);
}

TEST(MpiRing, MultiHeadAttentionWithDropoutEqualsSingleProcess) {
  for (double p : {0.1, 0.5})
    for (bool causal : {false, true})
      testing::check_ring_mha(world(), causal, testing::Lens::kPerQuery, p);
  for (testing::Lens l : {testing::Lens::kPerBatch, testing::Lens::kPerQuery})
    testing::check_ring_mha(world(), true, l, 0.5, 1);  // data-parallel sample window
}

TEST(MpiRing, DropoutStreamMismatchIsAnErrorOnEveryRank) {
  // One rank's data-parallel window differs: the ranks would draw different masks.
  Context ctx;
  ctx.threads = 1;
  ctx.dropout_first_sample = world().rank() == 1 ? 1 : 0;
  RingOptions o;
  o.training = true, o.dropout = 0.1;
  const Tensor q = random_tensor({1, 6, 4}, DType::F32);
  std::string e = "no error";
  try {
    ring_attention(ctx, world(), q, q, q, {}, o);
  } catch (const Error& err) {
    e = err.what();
  }
  EXPECT_NE(e.find("differs across ranks"), std::string::npos) << e;
  EXPECT_NE(e.find("dropout_first_sample"), std::string::npos) << e;
}

TEST(MpiRing, LongerSequenceWithTwoThreads) {
  // Several kernel pieces per block (more than 256 rows per chunk on 2 ranks) and two threads.
  testing::RingCase c;
  c.B = 2, c.T = 1056 * world().size() / 2, c.D = 32, c.Dv = 32, c.causal = true;
  c.layout = RingLayout::kZigzag, c.lens = testing::Lens::kPerQuery;
  if (c.T % (2 * world().size()) != 0) c.T = 2 * world().size() * 264;
  testing::check_ring_case(world(), c, 2);
}

TEST(MpiRing, MultiHeadAttentionEqualsSingleProcess) {
  for (testing::Lens l : {testing::Lens::kPerBatch, testing::Lens::kPerQuery})
    for (bool causal : {false, true})
      testing::check_ring_mha(world(), causal, l);
}

std::string error_on_this_rank(const Tensor& q, const Tensor& k, const RingOptions& o = {}) {
  Context ctx;
  ctx.threads = 1;
  try {
    ring_attention(ctx, world(), q, k, k, {}, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(MpiRing, ShapeMismatchIsAnErrorOnEveryRank) {
  // Rank 1 holds a longer shard than the others: each rank's input is fine on its own.
  const int64_t T = world().rank() == 1 ? 8 : 6;
  const Tensor q = random_tensor({1, T, 4}, DType::F32);
  const std::string e = error_on_this_rank(q, q);
  EXPECT_NE(e.find("ring_attention"), std::string::npos) << e;
  EXPECT_NE(e.find("differs across ranks"), std::string::npos) << e;
}

TEST(MpiRing, OneRanksBadInputIsAnErrorOnEveryRank) {
  // Rank 0 passes float64: it reports its own error, the others that the ranks differ.
  const DType dt = world().rank() == 0 ? DType::F64 : DType::F32;
  const Tensor q = random_tensor({1, 6, 4}, dt);
  const std::string e = error_on_this_rank(q, q);
  EXPECT_NE(e.find("ring_attention"), std::string::npos) << e;
  EXPECT_NE(e.find(world().rank() == 0 ? "expected F32 or BF16" : "differs across ranks"),
            std::string::npos)
      << e;
  // Options differ too: causal on one rank only.
  RingOptions o;
  o.causal = world().rank() == world().size() - 1;
  const Tensor q6 = random_tensor({1, 6, 4}, DType::F32);
  const std::string e2 = error_on_this_rank(q6, q6, o);
  EXPECT_NE(e2.find("differs across ranks"), std::string::npos) << e2;
  // After the errors the ring still works (no message was left in flight).
  testing::check_ring_case(world(), testing::RingCase{});
}

}  // namespace
}  // namespace attn
