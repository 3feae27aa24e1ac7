// `attn bench ring` on one process (tools/attn/cmd_bench_ring.cpp): the JSON that
// scripts/bench-ring.sh reads, for the ring on 1 rank and for --single, and its flag errors
// (exit status 2, one line). Its runs under mpirun are scripts/bench-ring.sh's.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Result {
  int status;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

Result run(const std::string& args) {
  // One folder per process: ctest runs this file's tests as concurrent processes.
  const fs::path dir =
      fs::temp_directory_path() / ("attn_test_cli_bench_ring_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path o = dir / "stdout", e = dir / "stderr";
  const std::string cmd = "OMP_WAIT_POLICY=PASSIVE '" + std::string(ATTN_CLI_PATH) + "' " + args +
                          " > '" + o.string() + "' 2> '" + e.string() + "'";
  const int raw = std::system(cmd.c_str());
  Result r{WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, slurp(o), slurp(e)};
  fs::remove_all(dir);
  return r;
}

TEST(CliBenchRing, JsonOfTheRingAndOfTheSingleProcessKernel) {
  if (std::string(ATTN_CLI_PATH).empty()) GTEST_SKIP() << "attn CLI not built";
  for (const char* mode : {"", " --single", " --causal --dtype bf16"}) {
    const Result r = run(std::string("bench ring --seq 64 --head-dim 16 --batch-heads 2 "
                                     "--repeats 1 --warmup 0 --threads 1 --json") +
                         mode);
    ASSERT_EQ(r.status, 0) << mode << "\n" << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["op"], std::string(mode) == " --single" ? "single" : "ring");
    EXPECT_EQ(j["ranks"], 1);
    EXPECT_EQ(j["seq"], 64);
    EXPECT_GT(j["forward_s"].get<double>(), 0.0);
    EXPECT_GT(j["backward_gflops"].get<double>(), 0.0);
    EXPECT_EQ(j["peak_rss_mib"].size(), 1u);
  }
}

TEST(CliBenchRing, BadFlagsAreOneLineErrors) {
  if (std::string(ATTN_CLI_PATH).empty()) GTEST_SKIP() << "attn CLI not built";
  for (const char* args :
       {"bench ring --seq 7 --causal", "bench ring --dtype f16", "bench ring --layout diagonal",
        "bench ring --seq 1", "bench ring --repeats 0"}) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(r.out, "") << args;
    EXPECT_EQ(r.err.rfind("attn: ", 0), 0u) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

}  // namespace
