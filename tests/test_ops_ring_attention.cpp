// Ring attention on one process (the single-process Communicator, N = 1: every block is the
// rank's own, the gradient sums travel through the mailbox), the sharding helpers for N ranks,
// and the errors. The N = 2 and 4 runs are tests/mpi/test_mpi_ring.cpp (same harness).
#include "attn/core/error.hpp"
#include "ring_harness.hpp"

#include <gtest/gtest.h>

namespace attn {
namespace {

using testing::check_ring_case;
using testing::Lens;
using testing::random_tensor;
using testing::RingCase;

TEST(RingAttention, SingleProcessEqualsFusedSdpa) {
  auto comm = single_process_communicator();
  for (const RingCase& c : testing::ring_cases())
    check_ring_case(*comm, c);
}

TEST(RingAttention, LongShardIsCutIntoPieces) {
  // 600 queries per segment: three kernel calls of <= 256 rows per block, merged.
  auto comm = single_process_communicator();
  RingCase c;
  c.B = 1, c.T = 600, c.D = 16, c.Dv = 16, c.causal = true, c.lens = Lens::kPerQuery;
  check_ring_case(*comm, c, 2);
  c.layout = RingLayout::kZigzag, c.T = 1200, c.lens = Lens::kPerBatch, c.causal = false;
  check_ring_case(*comm, c, 2);
}

TEST(RingAttention, MultiHeadAttentionOnOneRankEqualsTheModule) {
  auto comm = single_process_communicator();
  for (Lens l : {Lens::kPerBatch, Lens::kPerQuery})
    for (bool causal : {false, true})
      testing::check_ring_mha(*comm, causal, l);
}

TEST(RingAttention, DropoutDrawsTheSingleProcessMask) {
  auto comm = single_process_communicator();
  for (const RingCase& c : testing::ring_dropout_cases())
    check_ring_case(*comm, c);
}

TEST(RingAttention, DropoutAcrossPiecesAndTwoThreads) {
  // Several kernel pieces per block: each piece's window starts at its own global query row.
  auto comm = single_process_communicator();
  RingCase c;
  c.B = 1, c.T = 600, c.D = 16, c.Dv = 16, c.causal = true, c.lens = Lens::kPerQuery;
  c.dropout = 0.1;
  check_ring_case(*comm, c, 2);
  c.dtype = DType::BF16, c.T = 1200, c.layout = RingLayout::kZigzag, c.lens = Lens::kNone;
  check_ring_case(*comm, c, 2);
  // A global key count that is not a multiple of 4: no row starts on a Philox block, the
  // kernels draw row by row (only N <= 2 can shard it; the MPI cases keep 4 | S).
  for (DType dt : {DType::F32, DType::BF16}) {
    RingCase odd;
    odd.T = 18, odd.dropout = 0.5, odd.dtype = dt, odd.lens = Lens::kPerQuery;
    check_ring_case(*comm, odd);
  }
}

TEST(RingAttention, DropoutIsActuallyDrawn) {
  // p = 0.5 changes the output (the mask is applied, not skipped), eval mode does not.
  auto comm = single_process_communicator();
  Context ctx;
  const Tensor q = random_tensor({1, 16, 8}, DType::F32, 3);
  RingOptions o;
  o.dropout = 0.5;
  const Tensor eval = ring_attention(ctx, *comm, q, q, q, {}, o).output;
  EXPECT_EQ(max_abs_diff(eval, ring_attention(ctx, *comm, q, q, q, {}, {}).output), 0.0);
  o.training = true;
  EXPECT_GT(max_abs_diff(ring_attention(ctx, *comm, q, q, q, {}, o).output, eval), 1e-3);
}

TEST(RingAttention, MultiHeadAttentionWithDropoutEqualsTheModule) {
  auto comm = single_process_communicator();
  for (double p : {0.1, 0.5})
    for (bool causal : {false, true})
      testing::check_ring_mha(*comm, causal, Lens::kPerQuery, p);
  // With the data-parallel sample window: sample 1 of a batch of 2 draws its own masks.
  for (Lens l : {Lens::kPerBatch, Lens::kPerQuery})
    testing::check_ring_mha(*comm, true, l, 0.5, 1);
}

TEST(RingAttention, ShardAndUnshardAreInverse) {
  const Tensor g = random_tensor({2, 24, 3}, DType::F32, 5);
  for (RingLayout layout : {RingLayout::kContiguous, RingLayout::kZigzag})
    for (int N : {1, 2, 3, 4}) {
      std::vector<Tensor> parts;
      for (int r = 0; r < N; ++r)
        parts.push_back(ring_shard(g, r, N, layout));
      EXPECT_EQ(parts[0].shape(), (Shape{2, 24 / N, 3}));
      EXPECT_EQ(max_abs_diff(ring_unshard(parts, layout), g), 0.0);
    }
}

TEST(RingAttention, ZigzagHoldsChunksRAnd2NMinus1MinusR) {
  std::vector<double> pos(8);
  for (int i = 0; i < 8; ++i)
    pos[i] = i;
  const Tensor g = Tensor::from_vector(pos, {1, 8}, DType::F32);
  EXPECT_EQ(ring_shard(g, 0, 2, RingLayout::kZigzag).to_vector(),
            (std::vector<double>{0, 1, 6, 7}));
  EXPECT_EQ(ring_shard(g, 1, 2, RingLayout::kZigzag).to_vector(),
            (std::vector<double>{2, 3, 4, 5}));
  EXPECT_EQ(ring_shard(g, 1, 2, RingLayout::kContiguous).to_vector(),
            (std::vector<double>{4, 5, 6, 7}));
}

TEST(RingAttention, DefaultLayoutIsZigzagWhenCausal) {
  RingOptions o;
  EXPECT_EQ(o.resolved_layout(), RingLayout::kContiguous);
  o.causal = true;
  EXPECT_EQ(o.resolved_layout(), RingLayout::kZigzag);
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(RingAttention, ErrorsNameTheOpAndTheExpectation) {
  auto comm = single_process_communicator();
  Context ctx;
  const Tensor q = random_tensor({1, 6, 4}, DType::F32);
  RingOptions o;
  o.training = true, o.dropout = 1.5;
  std::string e = error_of([&] { ring_attention(ctx, *comm, q, q, q, {}, o); });
  EXPECT_NE(e.find("ring_attention"), std::string::npos) << e;
  EXPECT_NE(e.find("dropout is 1.5, expected in [0, 1]"), std::string::npos) << e;

  e = error_of([&] { ring_shard(q, 0, 4, RingLayout::kContiguous); });
  EXPECT_NE(e.find("ring_shard"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of 4"), std::string::npos) << e;
  e = error_of([&] { ring_shard(q, 0, 2, RingLayout::kZigzag); });
  EXPECT_NE(e.find("multiple of 4"), std::string::npos) << e;

  RingOptions z;
  z.layout = RingLayout::kZigzag;
  const Tensor odd = random_tensor({1, 5, 4}, DType::F32);
  e = error_of([&] { ring_attention(ctx, *comm, odd, odd, odd, {}, z); });
  EXPECT_NE(e.find("even local lengths"), std::string::npos) << e;

  RingOptions causal;
  causal.causal = true;
  const Tensor k8 = random_tensor({1, 8, 4}, DType::F32);
  e = error_of([&] { ring_attention(ctx, *comm, q, k8, k8, {}, causal); });
  EXPECT_NE(e.find("T_local == S_local"), std::string::npos) << e;

  const Tensor d64 = random_tensor({1, 6, 4}, DType::F64);
  e = error_of([&] { ring_attention(ctx, *comm, d64, d64, d64, {}, {}); });
  EXPECT_NE(e.find("expected F32 or BF16"), std::string::npos) << e;

  const Tensor r = ring_attention(ctx, *comm, q, q, q, {}, {}).output;
  AttentionResult fwd;
  fwd.output = r;
  e = error_of([&] { ring_attention_backward(ctx, *comm, r, q, q, q, {}, fwd, {}); });
  EXPECT_NE(e.find("ring_attention_backward"), std::string::npos) << e;
  EXPECT_NE(e.find("logsumexp"), std::string::npos) << e;
}

}  // namespace
}  // namespace attn
