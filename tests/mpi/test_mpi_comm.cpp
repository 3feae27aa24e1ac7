// The MPI Communicator under `mpirun -np N` (N = 2 or 4; tests/mpi/CMakeLists.txt runs it over
// shared memory and over TCP loopback). Every rank runs every test; the tests are collective, so
// each one makes the same calls on every rank in the same order.
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

namespace attn {
namespace {

Communicator& world() {
  static std::shared_ptr<Communicator> w = world_communicator();
  return *w;
}

template <typename T>
std::span<const std::byte> cbytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}
template <typename T>
std::span<std::byte> bytes(std::vector<T>& v) {
  return std::as_writable_bytes(std::span<T>(v));
}

TEST(MpiComm, RankAndSize) {
  Communicator& c = world();
  EXPECT_STREQ(c.name(), "mpi");
  EXPECT_EQ(c.size(), launcher_world_size());
  EXPECT_GE(c.size(), 2) << "run under mpirun -np 2 or more";
  EXPECT_GE(c.rank(), 0);
  EXPECT_LT(c.rank(), c.size());
}

TEST(MpiComm, AllreduceInPlace) {
  Communicator& c = world();
  const int N = c.size(), r = c.rank();
  // Sum of rank + 1 + i over ranks: N (N + 1) / 2 + N i, exact in float for these sizes.
  std::vector<float> f(1000);
  std::iota(f.begin(), f.end(), static_cast<float>(r + 1));
  c.allreduce(std::span<float>(f));
  for (size_t i = 0; i < f.size(); ++i)
    ASSERT_EQ(f[i], static_cast<float>(N * (N + 1) / 2 + N * static_cast<int>(i))) << i;
  std::vector<double> d = {0.5 * r, -1.0 * r};
  c.allreduce(std::span<double>(d), ReduceOp::kMax);
  EXPECT_EQ(d[0], 0.5 * (N - 1));
  EXPECT_EQ(d[1], 0.0);
  std::vector<int64_t> i64 = {r, -r};
  c.allreduce(std::span<int64_t>(i64), ReduceOp::kMin);
  EXPECT_EQ(i64[0], 0);
  EXPECT_EQ(i64[1], -(N - 1));
}

TEST(MpiComm, NonBlockingAllreduceOverlapsWork) {
  Communicator& c = world();
  const int N = c.size();
  std::vector<double> a(1 << 16, 1.0), b(1 << 10, 2.0);
  Request ra = c.iallreduce(std::span<double>(a));
  Request rb = c.iallreduce(std::span<double>(b));
  double busy = 0;  // some work while the reductions are in flight
  for (int i = 0; i < 100000; ++i) {
    busy += 1.0 / (1.0 + i);
    if (i % 10000 == 0) ra.test();
  }
  EXPECT_GT(busy, 0.0);
  rb.wait();
  ra.wait();
  EXPECT_FALSE(ra.pending());
  EXPECT_EQ(a.front(), N);
  EXPECT_EQ(a.back(), N);
  EXPECT_EQ(b[7], 2.0 * N);
}

TEST(MpiComm, BroadcastAndBarrier) {
  Communicator& c = world();
  const int root = c.size() - 1;
  std::vector<int64_t> v = {c.rank(), 42};
  c.broadcast(v.data(), static_cast<int64_t>(v.size() * sizeof(int64_t)), root);
  EXPECT_EQ(v[0], root);
  EXPECT_EQ(v[1], 42);
  c.barrier();
  EXPECT_THROW(c.broadcast(v.data(), 8, c.size()), Error);  // no such root (checked locally)
}

TEST(MpiComm, RingWithSendrecvAndNonBlocking) {
  Communicator& c = world();
  const int N = c.size(), r = c.rank();
  const int next = (r + 1) % N, prev = (r + N - 1) % N;
  // One step of a ring: send mine to the next rank, receive the previous rank's.
  std::vector<float> mine(257, static_cast<float>(r)), got(257, -1.0f);
  c.sendrecv(cbytes(mine), next, bytes(got), prev, 3);
  EXPECT_EQ(got[0], static_cast<float>(prev));
  EXPECT_EQ(got[256], static_cast<float>(prev));
  // The same step with isend / irecv, both in flight at once.
  std::vector<float> got2(257, -1.0f);
  Request rr = c.irecv(bytes(got2), prev, 4);
  Request rs = c.isend(cbytes(mine), next, 4);
  std::vector<Request> all;
  all.push_back(std::move(rr));
  all.push_back(std::move(rs));
  wait_all(all);
  EXPECT_EQ(got2[100], static_cast<float>(prev));
  // Blocking send / recv between ranks 0 and 1 (rank 0 sends first).
  std::vector<int64_t> msg = {7, 8, 9}, in(3);
  if (r == 0) c.send(cbytes(msg), 1, 5);
  if (r == 1) {
    c.recv(bytes(in), 0, 5);
    EXPECT_EQ(in, msg);
  }
}

TEST(MpiComm, WrongMessageLengthIsAnError) {
  Communicator& c = world();
  const int r = c.rank();
  std::vector<float> four(4, 1.0f), two(2), eight(8);
  // Rank 0 sends 16 bytes twice; rank 1 receives them into 8 bytes (truncation: MPI's error)
  // and into 32 bytes (short: our check).
  if (r == 0) {
    c.send(cbytes(four), 1, 6);
    c.send(cbytes(four), 1, 7);
  } else if (r == 1) {
    try {
      c.recv(bytes(two), 0, 6);
      ADD_FAILURE() << "a 16-byte message into an 8-byte buffer was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "recv");
      EXPECT_NE(std::string(e.what()).find("MPI_Recv failed"), std::string::npos) << e.what();
    }
    try {
      c.recv(bytes(eight), 0, 7);
      ADD_FAILURE() << "a 16-byte message into a 32-byte buffer was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("has 16 bytes, the receive buffer 32"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(c.send(cbytes(four), c.size(), 0), Error);  // no such rank
  c.barrier();
}

TEST(MpiComm, MismatchedShapesAreReportedOnEveryRank) {
  Communicator& c = world();
  const std::vector<int64_t> same = {8, 16, 32};
  c.check_same("test", "shape", same);  // agrees: no throw
  // Rank 1 holds (8, 17, 32): every rank must throw, naming the dimension.
  const std::vector<int64_t> shape = {8, c.rank() == 1 ? 17 : 16, 32};
  try {
    c.check_same("test", "the batch shape", shape);
    ADD_FAILURE() << "rank " << c.rank() << ": mismatch not detected";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("the batch shape differs across ranks: value 1 of 3 lies between 16 and 17"),
        std::string::npos)
        << what;
  }
  // The non-blocking form: started, work in between, decided at finish().
  const std::vector<int64_t> step = {42, c.rank() == c.size() - 1 ? 8 : 9};
  SameCheck pending(c, "test", "the step", step);
  std::vector<double> work(1000, 1.0);
  c.allreduce(std::span<double>(work));  // other collectives may run meanwhile
  EXPECT_THROW(pending.finish(), Error);
  // A different number of values (rank 0 has 2 dims, the others 3) is reported too.
  const std::vector<int64_t> ragged(c.rank() == 0 ? 2 : 3, 1);
  EXPECT_THROW(c.check_same("test", "rank of the tensor", ragged), Error);
  c.barrier();
}

}  // namespace
}  // namespace attn
