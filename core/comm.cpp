// The Communicator's shared parts and the single-process implementation (attn/core/comm.hpp).
// The MPI implementation is core/comm_mpi.cpp, compiled only with ATTN_WITH_MPI.
#include "attn/core/comm.hpp"

#include "attn/core/error.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>

namespace attn {

#ifdef ATTN_WITH_MPI
// core/comm_mpi.cpp: MPI_COMM_WORLD (initialising MPI on first use).
std::shared_ptr<Communicator> make_mpi_world_communicator();
#endif

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::kF32:
      return 4;
    case CommType::kF64:
    case CommType::kI64:
      return 8;
    case CommType::kByte:
      return 1;
  }
  return 0;
}

// ----------------------------------------------------------------------------------------------
// Request

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    if (state_) {
      try {
        state_->wait();
      } catch (...) {  // a destructor-like path: the error was the caller's to collect
      }
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

Request::~Request() {
  if (!state_) return;
  try {
    state_->wait();  // the buffers may go away right after: never leave MPI writing into them
  } catch (...) {
  }
}

void Request::wait() {
  if (!state_) return;
  std::unique_ptr<State> s = std::move(state_);
  s->wait();
}

bool Request::test() {
  if (!state_) return true;
  if (!state_->test()) return false;
  state_.reset();
  return true;
}

void wait_all(std::vector<Request>& requests) {
  std::exception_ptr first;
  for (Request& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// ----------------------------------------------------------------------------------------------
// Typed conveniences and the shape check

void Communicator::allreduce(std::span<float> data, ReduceOp op) {
  allreduce(data.data(), static_cast<int64_t>(data.size()), CommType::kF32, op);
}
void Communicator::allreduce(std::span<double> data, ReduceOp op) {
  allreduce(data.data(), static_cast<int64_t>(data.size()), CommType::kF64, op);
}
void Communicator::allreduce(std::span<int64_t> data, ReduceOp op) {
  allreduce(data.data(), static_cast<int64_t>(data.size()), CommType::kI64, op);
}
Request Communicator::iallreduce(std::span<float> data, ReduceOp op) {
  return iallreduce(data.data(), static_cast<int64_t>(data.size()), CommType::kF32, op);
}
Request Communicator::iallreduce(std::span<double> data, ReduceOp op) {
  return iallreduce(data.data(), static_cast<int64_t>(data.size()), CommType::kF64, op);
}

void Communicator::check_same(const char* op, const std::string& what,
                              std::span<const int64_t> values) {
  if (size() == 1) return;
  // The count itself first: a rank with more values would otherwise make the next allreduce's
  // counts differ, which MPI cannot report.
  int64_t n[2] = {static_cast<int64_t>(values.size()), -static_cast<int64_t>(values.size())};
  allreduce(n, 2, CommType::kI64, ReduceOp::kMax);
  check(n[0] == -n[1], op,
        "{} differs across ranks: {} values on rank {}, between {} and {} on "
        "the others",
        what, values.size(), rank(), -n[1], n[0]);
  SameCheck(*this, op, what, values).finish();
}

namespace {

// [min..., -max...] of `values` after an allreduce(min) of [values..., -values...]:
// min(-x) = -max(x), so one reduction gives both.
std::vector<int64_t> with_negatives(std::span<const int64_t> values) {
  std::vector<int64_t> v(values.begin(), values.end());
  for (int64_t x : values)
    v.push_back(-x);
  return v;
}

}  // namespace

SameCheck::SameCheck(Communicator& comm, const char* op, std::string what,
                     std::span<const int64_t> values)
    : comm_(&comm),
      op_(op),
      what_(std::move(what)),
      values_(values.begin(), values.end()),
      extremes_(with_negatives(values)) {
  if (comm.size() > 1)
    request_ = comm.iallreduce(extremes_.data(), static_cast<int64_t>(extremes_.size()),
                               CommType::kI64, ReduceOp::kMin);
}

void SameCheck::finish() {
  if (comm_->size() == 1) return;
  request_.wait();
  const size_t m = values_.size();
  for (size_t i = 0; i < m; ++i) {
    const int64_t lo = extremes_[i], hi = -extremes_[m + i];
    if (lo != hi) {
      std::string mine;
      for (size_t j = 0; j < m; ++j)
        mine += (j ? ", " : "") + std::to_string(values_[j]);
      throw Error(op_, fmt::format("{} differs across ranks: value {} of {} lies between {} and "
                                   "{} over the {} ranks; rank {} has ({})",
                                   what_, i, m, lo, hi, comm_->size(), comm_->rank(), mine));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Single process: rank 0 of 1

namespace {

void check_self(const char* op, int peer) {
  check(peer == 0, op,
        "peer rank {} does not exist: the single-process communicator has rank 0 "
        "only",
        peer);
}

void check_tag(const char* op, int tag) {
  check(tag >= 0 && tag <= 32767, op, "tag {} is outside [0, 32767] (MPI's guaranteed range)", tag);
}

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "single"; }

  void send(std::span<const std::byte> data, int peer, int tag) override {
    check_self("send", peer);
    check_tag("send", tag);
    post(data, tag);
  }
  void recv(std::span<std::byte> data, int peer, int tag) override {
    check_self("recv", peer);
    check_tag("recv", tag);
    check(take(data, tag, "recv"), "recv",
          "no message with tag {} was sent to this rank: a single process would wait forever", tag);
  }
  void sendrecv(std::span<const std::byte> out, int dest, std::span<std::byte> in, int source,
                int tag) override {
    send(out, dest, tag);
    recv(in, source, tag);
  }
  Request isend(std::span<const std::byte> data, int peer, int tag) override {
    send(data, peer, tag);  // the copy in the mailbox (or the waiting receive) completes it
    return {};
  }
  Request irecv(std::span<std::byte> data, int peer, int tag) override {
    check_self("irecv", peer);
    check_tag("irecv", tag);
    if (take(data, tag, "irecv")) return {};
    auto pending = std::make_shared<PendingRecv>(PendingRecv{data, tag, false});
    waiting_.push_back(pending);
    return Request(std::make_unique<RecvState>(pending));
  }

  void allreduce(void*, int64_t count, CommType, ReduceOp) override {
    check(count >= 0, "allreduce", "count {} is negative", count);
  }
  Request iallreduce(void*, int64_t count, CommType, ReduceOp) override {
    check(count >= 0, "iallreduce", "count {} is negative", count);
    return {};
  }
  void broadcast(void*, int64_t bytes, int root) override {
    check_self("broadcast", root);
    check(bytes >= 0, "broadcast", "byte count {} is negative", bytes);
  }
  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::exit(code); }

 private:
  struct Message {
    int tag;
    std::vector<std::byte> bytes;
  };
  struct PendingRecv {
    std::span<std::byte> data;
    int tag;
    bool done;
  };
  struct RecvState final : Request::State {
    explicit RecvState(std::shared_ptr<PendingRecv> p) : pending(std::move(p)) {}
    void wait() override {
      check(pending->done, "wait",
            "irecv with tag {} has no matching send in this process: a "
            "single process would wait forever",
            pending->tag);
    }
    bool test() override { return pending->done; }
    std::shared_ptr<PendingRecv> pending;
  };

  static void check_length(const char* op, size_t want, size_t got, int tag) {
    check(want == got, op, "message with tag {} has {} bytes, the receive buffer {}", tag, got,
          want);
  }

  // Hands the message to the oldest receive waiting for its tag, else queues it.
  void post(std::span<const std::byte> data, int tag) {
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if ((*it)->tag != tag) continue;
      check_length("send", (*it)->data.size(), data.size(), tag);
      std::copy(data.begin(), data.end(), (*it)->data.begin());
      (*it)->done = true;
      waiting_.erase(it);
      return;
    }
    mailbox_.push_back({tag, std::vector<std::byte>(data.begin(), data.end())});
  }
  // The oldest queued message with `tag` into `data`; false when there is none.
  bool take(std::span<std::byte> data, int tag, const char* op) {
    for (auto it = mailbox_.begin(); it != mailbox_.end(); ++it) {
      if (it->tag != tag) continue;
      check_length(op, data.size(), it->bytes.size(), tag);
      std::copy(it->bytes.begin(), it->bytes.end(), data.begin());
      mailbox_.erase(it);
      return true;
    }
    return false;
  }

  std::deque<Message> mailbox_;
  std::deque<std::shared_ptr<PendingRecv>> waiting_;
};

}  // namespace

std::shared_ptr<Communicator> single_process_communicator() {
  return std::make_shared<SingleProcess>();
}

bool mpi_available() {
#ifdef ATTN_WITH_MPI
  return true;
#else
  return false;
#endif
}

int launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* v = std::getenv(var)) {
      const int n = std::atoi(v);
      if (n >= 1) return n;
    }
  }
  return 1;
}

namespace {
std::mutex world_mutex;
std::shared_ptr<Communicator> world;
}  // namespace

std::shared_ptr<Communicator> world_communicator() {
  std::lock_guard<std::mutex> lock(world_mutex);
  if (world) return world;
  [[maybe_unused]] const int launched = launcher_world_size();
  [[maybe_unused]] const bool under_launcher =
      std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
#ifdef ATTN_WITH_MPI
  if (under_launcher) world = make_mpi_world_communicator();
#else
  check(launched == 1, "world_communicator",
        "started by an MPI launcher with {} processes, but this attn was built without MPI "
        "(configure with -DATTN_WITH_MPI=ON); refusing to run {} independent copies",
        launched, launched);
#endif
  if (!world) world = single_process_communicator();
  return world;
}

void abort_world_if_parallel(int code) {
  std::shared_ptr<Communicator> w;
  {
    std::lock_guard<std::mutex> lock(world_mutex);
    w = world;
  }
  if (w && w->size() > 1) w->abort(code);
}

}  // namespace attn
