// bench/omp_trace.cpp (preloaded into `attn train`) and bench/omp_trace.py, which reads its
// record: every region is written with sane times, one busy time and one lateness per team
// member, and the report splits the run's waits as scripts/profile.sh shows them.
#include "testing.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace attn {
namespace {

namespace fs = std::filesystem;

int shell(const std::string& cmd) {
  const int raw = std::system(cmd.c_str());
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

TEST(OmpTrace, RecordsEveryRegionOfATrainingRun) {
  if (std::string(ATTN_CLI_PATH).empty() || std::string(ATTN_OMP_TRACE_LIB).empty())
    GTEST_SKIP() << "needs the attn CLI and bench/omp_trace.cpp (not built under sanitizers)";
  const fs::path dir = attn::testing::temp_path("attn_test_omp_trace");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path trace = dir / "regions.txt", report = dir / "report.txt";
  const std::string train = "env LD_PRELOAD='" + std::string(ATTN_OMP_TRACE_LIB) +
                            "' ATTN_OMP_TRACE='" + trace.string() + "' '" +
                            std::string(ATTN_CLI_PATH) +
                            "' train --task shift --length 64 --symbols 8 --num-hiddens 64"
                            " --ffn-num-hiddens 128 --num-heads 2 --batch-size 32 --steps 3"
                            " --eval-every 0 --eval-examples 8 --threads 2 > /dev/null 2>&1";
  ASSERT_EQ(shell(train), 0) << train;

  std::ifstream in(trace);
  int regions = 0, teams_of_two = 0;
  for (std::string line; std::getline(in, line); ++regions) {
    std::istringstream fields(line);
    uint64_t start = 0, end = 0;
    unsigned team = 0;
    std::string object, offset;
    ASSERT_TRUE(fields >> start >> end >> team >> object >> offset) << line;
    EXPECT_LE(start, end) << line;
    EXPECT_GE(team, 1u) << line;
    EXPECT_LE(team, 2u) << line;  // --threads 2
    teams_of_two += team == 2;
    // Each member's busy time, then its lateness (region start to entering the body).
    unsigned numbers = 0;
    for (uint64_t ns; fields >> ns; ++numbers)
      EXPECT_LE(ns, end - start) << line;
    EXPECT_EQ(numbers, 2 * team) << line;
  }
  EXPECT_GT(regions, 10);
  EXPECT_GT(teams_of_two, 0);

  const std::string analyse = "python3 '" + std::string(ATTN_SOURCE_DIR) +
                              "/bench/omp_trace.py' '" + trace.string() + "' > '" +
                              report.string() + "' 2>&1";
  ASSERT_EQ(shell(analyse), 0) << analyse;
  std::stringstream text;
  text << std::ifstream(report).rdbuf();
  for (const char* part : {"gaps between regions:", "thread 0 idle in regions:", "largest gaps",
                           "idle inside regions, by the caller"})
    EXPECT_NE(text.str().find(part), std::string::npos) << part << " missing from\n" << text.str();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace attn
