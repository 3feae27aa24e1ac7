// Communicator: how the processes of one run talk to each other (data-parallel training today,
// ring attention later). A small interface with two implementations:
//
//   single process (the default, always built): rank 0 of 1. Collectives are the identity and a
//     message sent to oneself waits in a mailbox until received, so code written for N ranks
//     runs unchanged on one.
//   MPI (built with -DATTN_WITH_MPI=ON): MPI_COMM_WORLD through Open MPI (or any MPI-3 library),
//     for runs started by `mpirun -np N`. Only core/comm_mpi.cpp includes <mpi.h>: nothing in
//     nn/, ops/ or the public headers sees MPI.
//
// Vocabulary: N ranks numbered 0..N-1; a message is a byte range plus (peer, tag); a collective
// is a call every rank makes in the same order with the same counts.
//
// Errors are attn::Error naming the operation and what was wrong (a rank out of range, a count
// that differs across ranks, an MPI failure with MPI's own message). Faults: a rank that throws
// must make the others stop rather than wait forever in a collective; abort() ends every rank
// of the run (MPI_Abort), and the CLI calls it on any error when N > 1. A rank that dies is
// detected by the launcher (mpirun), which ends the others.
//
// Threads: only the thread that created the communicator calls it (MPI_THREAD_FUNNELED); the
// compute kernels run on OpenMP threads in between.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace attn {

enum class ReduceOp : uint8_t { kSum, kMin, kMax };
const char* reduce_op_name(ReduceOp op);

// The element types collectives and typed messages accept.
enum class CommType : uint8_t { kF32, kF64, kI64, kByte };
size_t comm_type_size(CommType t);

// A pending non-blocking operation. wait() blocks until it completes (and rethrows its error);
// test() is true once it has completed and also lets the library progress it (call it between
// pieces of work so a non-blocking collective advances while compute runs). Destroying a
// Request that has not completed waits for it: buffers must outlive their requests.
class Request {
 public:
  struct State {
    virtual ~State() = default;
    virtual void wait() = 0;
    virtual bool test() = 0;
  };
  Request() = default;
  explicit Request(std::unique_ptr<State> state) : state_(std::move(state)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept;
  ~Request();

  bool pending() const { return state_ != nullptr; }
  void wait();
  bool test();

 private:
  std::unique_ptr<State> state_;
};

// Waits for every request (all of them, even when one fails; the first error is rethrown).
void wait_all(std::vector<Request>& requests);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;  // "single" or "mpi"

  // --- point to point: `bytes` raw bytes to/from rank `peer` with a tag in [0, 32767] -------
  // recv's buffer must be exactly as long as the message, else Error (truncation or short).
  virtual void send(std::span<const std::byte> data, int peer, int tag) = 0;
  virtual void recv(std::span<std::byte> data, int peer, int tag) = 0;
  // Sends `out` to `dest` while receiving `in` from `source` (a ring step without deadlock).
  virtual void sendrecv(std::span<const std::byte> out, int dest, std::span<std::byte> in,
                        int source, int tag) = 0;
  virtual Request isend(std::span<const std::byte> data, int peer, int tag) = 0;
  virtual Request irecv(std::span<std::byte> data, int peer, int tag) = 0;

  // --- collectives -------------------------------------------------------------------------
  // In place: data[i] = op over ranks of data[i]. Every rank passes the same count and type.
  virtual void allreduce(void* data, int64_t count, CommType type, ReduceOp op) = 0;
  virtual Request iallreduce(void* data, int64_t count, CommType type, ReduceOp op) = 0;
  // data on every rank becomes root's.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Ends every rank of the run with `code` (MPI_Abort); the single process just exits.
  [[noreturn]] virtual void abort(int code) = 0;

  // Typed conveniences over the calls above.
  void allreduce(std::span<float> data, ReduceOp op = ReduceOp::kSum);
  void allreduce(std::span<double> data, ReduceOp op = ReduceOp::kSum);
  void allreduce(std::span<int64_t> data, ReduceOp op = ReduceOp::kSum);
  Request iallreduce(std::span<float> data, ReduceOp op = ReduceOp::kSum);
  Request iallreduce(std::span<double> data, ReduceOp op = ReduceOp::kSum);

  // Collective check that every rank holds the same `values` (shapes, counts, a step number):
  // one allreduce of their minima and maxima. Throws Error(op, "<what> differs across ranks:
  // ...") on every rank when they differ, so mismatched shapes are reported, not deadlocked on
  // or silently mixed.
  void check_same(const char* op, const std::string& what, std::span<const int64_t> values);
};

// check_same without its own round trip, for a number of values every rank's code fixes (the
// fields of a struct, not a shape's rank): the constructor starts the reduction (non-blocking),
// finish() waits for it and throws as check_same does. Collective: every rank constructs one.
// The trainer checks each step's batch this way, while the step computes, and before the update.
class SameCheck {
 public:
  SameCheck(Communicator& comm, const char* op, std::string what, std::span<const int64_t> values);
  SameCheck(const SameCheck&) = delete;
  SameCheck& operator=(const SameCheck&) = delete;
  void finish();

 private:
  Communicator* comm_;
  const char* op_;
  std::string what_;
  std::vector<int64_t> values_, extremes_;
  Request request_;
};

// The process's communicator for the whole run: MPI_COMM_WORLD when attn was built with MPI and
// the process was started by an MPI launcher (mpirun sets OMPI_COMM_WORLD_SIZE / PMI_SIZE /
// PMIX_RANK), else the single-process one. Created on first call (MPI_Init_thread then; MPI is
// finalized at exit). Started by a launcher with N > 1 but built without MPI is an Error: N
// independent copies of one run would overwrite each other's files.
std::shared_ptr<Communicator> world_communicator();
// When world_communicator() has been created with N > 1 ranks: abort() it, ending every rank of
// the run with `code` (an error handler's last step, so no rank is left waiting in a collective).
// Otherwise returns.
void abort_world_if_parallel(int code);
// A fresh single-process communicator (tests, and the trainer's default).
std::shared_ptr<Communicator> single_process_communicator();
// True when this build has the MPI implementation.
bool mpi_available();
// The size an MPI launcher announced in the environment (1 when there is none).
int launcher_world_size();

}  // namespace attn
