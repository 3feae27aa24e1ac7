// The single-process Communicator (attn/core/comm.hpp): rank 0 of 1, collectives are the
// identity, messages to oneself go through a mailbox, and every misuse is an attn::Error. The
// MPI implementation has its own tests under mpirun (tests/mpi/).
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

namespace attn {
namespace {

std::span<std::byte> bytes_of(std::vector<float>& v) {
  return std::as_writable_bytes(std::span<float>(v));
}

TEST(SingleProcessComm, RankSizeAndCollectivesAreIdentity) {
  auto comm = single_process_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_STREQ(comm->name(), "single");
  std::vector<float> f = {1.5f, -2.0f};
  comm->allreduce(std::span<float>(f));
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f}));
  std::vector<double> d = {3.0};
  Request r = comm->iallreduce(std::span<double>(d), ReduceOp::kMax);
  r.wait();
  EXPECT_EQ(d[0], 3.0);
  comm->broadcast(f.data(), 8, 0);
  comm->barrier();
  const std::vector<int64_t> shape = {2, 3, 4};
  comm->check_same("test", "shape", shape);  // one rank always agrees with itself
}

TEST(SingleProcessComm, MessagesToSelf) {
  auto comm = single_process_communicator();
  std::vector<float> out = {1, 2, 3}, in(3);
  comm->send(std::as_bytes(std::span<const float>(out)), 0, 7);
  comm->recv(bytes_of(in), 0, 7);
  EXPECT_EQ(in, out);

  std::vector<float> ring(3);
  comm->sendrecv(bytes_of(out), 0, bytes_of(ring), 0, 1);
  EXPECT_EQ(ring, out);

  // irecv posted before the matching isend completes when the send arrives.
  std::vector<float> late(3);
  Request rr = comm->irecv(bytes_of(late), 0, 9);
  EXPECT_TRUE(rr.pending());
  EXPECT_FALSE(rr.test());
  Request rs = comm->isend(bytes_of(out), 0, 9);
  rs.wait();
  EXPECT_TRUE(rr.test());
  EXPECT_EQ(late, out);

  // Tags keep messages apart; the oldest of a tag comes first.
  std::vector<float> a = {1}, b = {2}, got(1);
  comm->send(bytes_of(a), 0, 1);
  comm->send(bytes_of(b), 0, 2);
  comm->recv(bytes_of(got), 0, 2);
  EXPECT_EQ(got[0], 2.0f);
  comm->recv(bytes_of(got), 0, 1);
  EXPECT_EQ(got[0], 1.0f);
}

TEST(SingleProcessComm, MisuseIsAnError) {
  auto comm = single_process_communicator();
  std::vector<float> v(2), w(3);
  EXPECT_THROW(comm->send(bytes_of(v), 1, 0), Error);    // no rank 1
  EXPECT_THROW(comm->send(bytes_of(v), 0, -1), Error);   // bad tag
  EXPECT_THROW(comm->broadcast(v.data(), 8, 2), Error);  // no root 2
  EXPECT_THROW(comm->recv(bytes_of(v), 0, 3), Error);    // nothing sent: would wait forever
  comm->send(bytes_of(v), 0, 4);
  try {
    comm->recv(bytes_of(w), 0, 4);  // 8 bytes sent, 12 expected
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("8 bytes"), std::string::npos) << e.what();
  }
  Request pending = comm->irecv(bytes_of(v), 0, 5);
  EXPECT_THROW(pending.wait(), Error);
}

TEST(SingleProcessComm, WaitAllCollectsEveryRequest) {
  auto comm = single_process_communicator();
  std::vector<float> a = {1}, b(1), c(1);
  std::vector<Request> rs;
  rs.push_back(comm->irecv(bytes_of(b), 0, 1));
  rs.push_back(comm->irecv(bytes_of(c), 0, 2));
  comm->send(bytes_of(a), 0, 1);
  EXPECT_THROW(wait_all(rs), Error);  // tag 2 never arrives
  EXPECT_EQ(b[0], 1.0f);              // tag 1 completed all the same
}

TEST(SingleProcessComm, WorldWithoutLauncherIsSingle) {
  if (launcher_world_size() != 1) GTEST_SKIP() << "run under an MPI launcher";
  auto world = world_communicator();
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world.get(), world_communicator().get());  // one per process
}

}  // namespace
}  // namespace attn
