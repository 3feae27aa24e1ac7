// The MPI Communicator (attn/core/comm.hpp): MPI_COMM_WORLD through MPI's C API. Compiled only
// with -DATTN_WITH_MPI=ON; the only file of attn that includes <mpi.h>.
//
// MPI is initialised with MPI_THREAD_FUNNELED (only the thread that made the communicator calls
// MPI; OpenMP threads compute in between) and finalized at exit. The world communicator's error
// handler is MPI_ERRORS_RETURN, so a failing call comes back here as an attn::Error naming the
// operation and MPI's message, instead of MPI's default of aborting without context.
#include "attn/core/comm.hpp"

#include "attn/core/error.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>

namespace attn {

namespace {

void check_mpi(int rc, const char* op, const char* call) {
  if (rc == MPI_SUCCESS) [[likely]]
    return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(op, fmt::format("{} failed: {}", call, std::string(text, static_cast<size_t>(len))));
}

int to_int_count(const char* op, int64_t count) {
  check(count >= 0 && count <= INT_MAX, op, "count {} is outside [0, {}] (MPI counts are int)",
        count, INT_MAX);
  return static_cast<int>(count);
}

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::kF32:
      return MPI_FLOAT;
    case CommType::kF64:
      return MPI_DOUBLE;
    case CommType::kI64:
      return MPI_INT64_T;
    case CommType::kByte:
      return MPI_BYTE;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_SUM;
}

void finalize_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

// A received message must fill the buffer exactly (MPI reports a longer one as truncation and
// accepts a shorter one silently; we reject both).
void check_received(const char* op, const MPI_Status& status, size_t want, int peer, int tag) {
  int got = 0;
  MPI_Get_count(&status, MPI_BYTE, &got);
  check(static_cast<size_t>(got) == want, op,
        "message from rank {} with tag {} has {} bytes, the receive buffer {}", peer, tag, got,
        want);
}

struct MpiRequest final : Request::State {
  MpiRequest(const char* o, size_t expect, int p, int t)
      : op(o), expected(expect), peer(p), tag(t) {}
  ~MpiRequest() override {
    if (request != MPI_REQUEST_NULL) MPI_Wait(&request, MPI_STATUS_IGNORE);
  }
  void wait() override {
    MPI_Status status;
    check_mpi(MPI_Wait(&request, &status), op, "MPI_Wait");
    finish(status);
  }
  bool test() override {
    int flag = 0;
    MPI_Status status;
    check_mpi(MPI_Test(&request, &flag, &status), op, "MPI_Test");
    if (flag) finish(status);
    return flag != 0;
  }
  void finish(const MPI_Status& status) {
    if (is_recv) check_received(op, status, expected, peer, tag);
  }

  const char* op;
  size_t expected;
  int peer, tag;
  bool is_recv = false;
  MPI_Request request = MPI_REQUEST_NULL;
};

class MpiWorld final : public Communicator {
 public:
  MpiWorld() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "mpi",
                "MPI_Init_thread");
      std::atexit(finalize_at_exit);
    }
    check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "mpi",
              "MPI_Comm_set_errhandler");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  void send(std::span<const std::byte> data, int peer, int tag) override {
    check_peer("send", peer, tag);
    check_mpi(MPI_Send(data.data(), to_int_count("send", static_cast<int64_t>(data.size())),
                       MPI_BYTE, peer, tag, MPI_COMM_WORLD),
              "send", "MPI_Send");
  }
  void recv(std::span<std::byte> data, int peer, int tag) override {
    check_peer("recv", peer, tag);
    MPI_Status status;
    check_mpi(MPI_Recv(data.data(), to_int_count("recv", static_cast<int64_t>(data.size())),
                       MPI_BYTE, peer, tag, MPI_COMM_WORLD, &status),
              "recv", "MPI_Recv");
    check_received("recv", status, data.size(), peer, tag);
  }
  void sendrecv(std::span<const std::byte> out, int dest, std::span<std::byte> in, int source,
                int tag) override {
    check_peer("sendrecv", dest, tag);
    check_peer("sendrecv", source, tag);
    MPI_Status status;
    check_mpi(MPI_Sendrecv(out.data(), to_int_count("sendrecv", static_cast<int64_t>(out.size())),
                           MPI_BYTE, dest, tag, in.data(),
                           to_int_count("sendrecv", static_cast<int64_t>(in.size())), MPI_BYTE,
                           source, tag, MPI_COMM_WORLD, &status),
              "sendrecv", "MPI_Sendrecv");
    check_received("sendrecv", status, in.size(), source, tag);
  }
  Request isend(std::span<const std::byte> data, int peer, int tag) override {
    check_peer("isend", peer, tag);
    auto s = std::make_unique<MpiRequest>("isend", data.size(), peer, tag);
    check_mpi(MPI_Isend(data.data(), to_int_count("isend", static_cast<int64_t>(data.size())),
                        MPI_BYTE, peer, tag, MPI_COMM_WORLD, &s->request),
              "isend", "MPI_Isend");
    return Request(std::move(s));
  }
  Request irecv(std::span<std::byte> data, int peer, int tag) override {
    check_peer("irecv", peer, tag);
    auto s = std::make_unique<MpiRequest>("irecv", data.size(), peer, tag);
    s->is_recv = true;
    check_mpi(MPI_Irecv(data.data(), to_int_count("irecv", static_cast<int64_t>(data.size())),
                        MPI_BYTE, peer, tag, MPI_COMM_WORLD, &s->request),
              "irecv", "MPI_Irecv");
    return Request(std::move(s));
  }

  void allreduce(void* data, int64_t count, CommType type, ReduceOp op) override {
    check(type != CommType::kByte, "allreduce", "bytes cannot be reduced; use F32, F64 or I64");
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, data, to_int_count("allreduce", count), mpi_type(type),
                            mpi_op(op), MPI_COMM_WORLD),
              "allreduce", "MPI_Allreduce");
  }
  Request iallreduce(void* data, int64_t count, CommType type, ReduceOp op) override {
    check(type != CommType::kByte, "iallreduce", "bytes cannot be reduced; use F32, F64 or I64");
    auto s = std::make_unique<MpiRequest>("iallreduce", 0, 0, 0);
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, to_int_count("iallreduce", count), mpi_type(type),
                             mpi_op(op), MPI_COMM_WORLD, &s->request),
              "iallreduce", "MPI_Iallreduce");
    return Request(std::move(s));
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    check(root >= 0 && root < size_, "broadcast", "root {} is outside [0, {})", root, size_);
    check_mpi(MPI_Bcast(data, to_int_count("broadcast", bytes), MPI_BYTE, root, MPI_COMM_WORLD),
              "broadcast", "MPI_Bcast");
  }
  void barrier() override { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "barrier", "MPI_Barrier"); }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; this keeps the promise if it ever does
  }

 private:
  void check_peer(const char* op, int peer, int tag) const {
    check(peer >= 0 && peer < size_, op, "peer rank {} is outside [0, {})", peer, size_);
    check(tag >= 0 && tag <= 32767, op, "tag {} is outside [0, 32767] (MPI's guaranteed range)",
          tag);
  }

  int rank_ = 0, size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_world_communicator() {
  return std::make_shared<MpiWorld>();
}

}  // namespace attn
