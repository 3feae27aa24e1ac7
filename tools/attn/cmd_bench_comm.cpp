// attn bench comm: per-message latency and bandwidth between ranks 0 and 1 (ping-pong), and the
// time of an in-place allreduce over all ranks, for message sizes from 8 B to --max-bytes
// (powers of 4). Run it under `mpirun -np 2` (or more: the ping-pong uses ranks 0 and 1, the
// allreduce all of them); the transport is mpirun's choice or `--mca btl self,vader` (shared
// memory) / `--mca btl self,tcp --mca btl_tcp_if_include lo` (TCP loopback).
//
// One-way time = half the median round trip of --repeats ping-pongs; bandwidth = bytes / one-way
// time (decimal GB/s). Rank 0 prints the table (or, with --json, one JSON object).
#include "attn/core/comm.hpp"
#include "attn/core/error.hpp"
#include "tools/attn/commands.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

namespace attn::cli {

namespace {

constexpr const char* kOp = "bench comm";

struct BenchCommArgs {
  int64_t max_bytes = int64_t{16} << 20;
  int repeats = 50;
  bool json = false;
};

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  int64_t bytes;
  double one_way_us, gbps, allreduce_us;
};

std::vector<Row> run_bench_comm(const BenchCommArgs& a, Communicator& c) {
  check(c.size() >= 2, kOp,
        "needs at least 2 ranks, got {}: run it as `mpirun -np 2 attn bench "
        "comm` (attn built with -DATTN_WITH_MPI=ON)",
        c.size());
  check(a.max_bytes >= 8 && a.repeats >= 1, kOp, "--max-bytes must be >= 8 and --repeats >= 1");
  const int r = c.rank();
  std::vector<std::byte> buffer(static_cast<size_t>(a.max_bytes));
  std::vector<float> reduce(static_cast<size_t>(a.max_bytes / 4));
  std::vector<Row> rows;
  for (int64_t bytes = 8; bytes <= a.max_bytes; bytes *= 4) {
    const std::span<std::byte> msg(buffer.data(), static_cast<size_t>(bytes));
    // Fewer repeats for the big messages (each moves up to 16 MiB twice).
    const int repeats = bytes >= (1 << 20) ? std::max(3, a.repeats / 2) : a.repeats;
    std::vector<double> trips;
    for (int i = -2; i < repeats; ++i) {  // two untimed round trips first
      c.barrier();
      const double t0 = now_seconds();
      if (r == 0) {
        c.send(msg, 1, 1);
        c.recv(msg, 1, 2);
      } else if (r == 1) {
        c.recv(msg, 0, 1);
        c.send(msg, 0, 2);
      }
      if (i >= 0) trips.push_back(now_seconds() - t0);
    }
    double one_way = median(trips) / 2;
    const std::span<float> values(reduce.data(),
                                  static_cast<size_t>(std::max<int64_t>(1, bytes / 4)));
    std::vector<double> reduces;
    for (int i = -2; i < repeats; ++i) {
      c.barrier();
      const double t0 = now_seconds();
      c.allreduce(values);
      if (i >= 0) reduces.push_back(now_seconds() - t0);
    }
    double allreduce = median(reduces);
    // Rank 0's figures are what it measured; the slowest rank's allreduce is the step's cost.
    c.broadcast(&one_way, sizeof one_way, 0);
    double worst[1] = {allreduce};
    c.allreduce(std::span<double>(worst), ReduceOp::kMax);
    rows.push_back(
        {bytes, one_way * 1e6, static_cast<double>(bytes) / one_way / 1e9, worst[0] * 1e6});
  }
  return rows;
}

}  // namespace

std::vector<Command> add_bench_comm_command(CLI::App& bench) {
  auto args = std::make_shared<BenchCommArgs>();
  CLI::App* sub = bench.add_subcommand(
      "comm",
      "Message latency and bandwidth between ranks 0 and 1 (ping-pong) and allreduce time over "
      "all ranks, 8 B to --max-bytes; run under `mpirun -np 2` (needs attn built with MPI).");
  sub->add_option("--max-bytes", args->max_bytes, "largest message")->capture_default_str();
  sub->add_option("--repeats", args->repeats, "timed round trips per size (median reported)")
      ->capture_default_str();
  sub->add_flag("--json", args->json, "print one JSON object");
  auto run = [args] {
    auto comm = world_communicator();
    const std::vector<Row> rows = run_bench_comm(*args, *comm);
    if (comm->rank() != 0) return;
    if (args->json) {
      nlohmann::json j = {{"ranks", comm->size()}, {"rows", nlohmann::json::array()}};
      for (const Row& row : rows)
        j["rows"].push_back({{"bytes", row.bytes},
                             {"one_way_us", row.one_way_us},
                             {"gbps", row.gbps},
                             {"allreduce_us", row.allreduce_us}});
      print(j.dump() + "\n");
      return;
    }
    std::string out = fmt::format(
        "attn bench comm: {} ranks; ping-pong ranks 0<->1 (one way = half the median round "
        "trip), allreduce over all ranks (median, slowest rank)\n{:>10}  {:>12}  {:>10}  {:>14}\n",
        comm->size(), "bytes", "one-way us", "GB/s", "allreduce us");
    for (const Row& row : rows)
      out += fmt::format("{:>10}  {:>12.2f}  {:>10.3f}  {:>14.2f}\n", row.bytes, row.one_way_us,
                         row.gbps, row.allreduce_us);
    print(out);
  };
  return {{sub, run}};
}

}  // namespace attn::cli
