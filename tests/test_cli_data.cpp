// End-to-end test of `attn data` (the built binary, ATTN_CLI_PATH): it writes DIR/train.tsv and
// DIR/eval.tsv, the same bytes for the same seed, that `attn train --task tsv` trains on in
// either precision; bad arguments exit 2 with one line on stderr and write nothing.
#include "testing.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace attn {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count_lines(const std::string& text) {
  size_t n = 0;
  for (char c : text)
    n += c == '\n';
  return n;
}

class CliData : public ::testing::Test {
 protected:
  fs::path root;

  void SetUp() override {
    if (std::string(ATTN_CLI_PATH).empty())
      GTEST_SKIP() << "attn CLI not built (ATTN_BUILD_CLI=OFF)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root = attn::testing::temp_path(std::string("attn_test_cli_data_") + info->name());
    fs::remove_all(root);
    fs::create_directories(root / "capture");
  }
  void TearDown() override {
    if (!root.empty()) fs::remove_all(root);
  }

  struct Result {
    int status;
    std::string out, err;
  };
  Result run(const std::string& args) {
    const fs::path o = root / "capture" / "stdout", e = root / "capture" / "stderr";
    const std::string cmd = "'" + std::string(ATTN_CLI_PATH) + "' " + args + " > '" + o.string() +
                            "' 2> '" + e.string() + "'";
    const int raw = std::system(cmd.c_str());
    return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_file(o), read_file(e)};
  }
};

TEST_F(CliData, WritesTsvFilesThatTrainInBothPrecisions) {
  for (const char* task : {"month-day", "compare"}) {
    const fs::path a = root / (std::string(task) + "_a"), b = root / (std::string(task) + "_b");
    for (const auto& dir : {a, b}) {
      const Result r = run(std::string("data --task ") + task + " --train 64 --eval 16 --seed 3 " +
                           "--out '" + dir.string() + "'");
      ASSERT_EQ(r.status, 0) << r.err;
      EXPECT_NE(r.out.find("train.tsv"), std::string::npos) << r.out;
    }
    const std::string train = read_file(a / "train.tsv"), eval = read_file(a / "eval.tsv");
    EXPECT_EQ(count_lines(train), 64u);
    EXPECT_EQ(count_lines(eval), 16u);
    EXPECT_EQ(train, read_file(b / "train.tsv"));
    EXPECT_EQ(eval, read_file(b / "eval.tsv"));
    for (const char* precision : {"fp32", "bf16"}) {
      const Result t = run("train --task tsv --data '" + (a / "train.tsv").string() +
                           "' --eval-data '" + (a / "eval.tsv").string() +
                           "' --pe rotary --steps 3 --batch-size 8 --num-hiddens 16 "
                           "--ffn-num-hiddens 16 --num-blks 1 --threads 1 --precision " +
                           precision);
      EXPECT_EQ(t.status, 0) << t.err;
      EXPECT_NE(t.out.find("step 3:"), std::string::npos) << t.out;
      EXPECT_NE(t.err.find("2 labels"), std::string::npos) << t.err;
    }
  }
}

TEST_F(CliData, BadArgumentsExitTwoAndWriteNothing) {
  const fs::path dir = root / "out";
  for (const std::string args : {"--task sorted", "--train 0", "--eval 0"}) {
    const Result r = run("data " + args + " --out '" + dir.string() + "'");
    EXPECT_EQ(r.status, 2) << args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1u) << r.err;
    EXPECT_FALSE(fs::exists(dir / "train.tsv")) << args;
  }
}

}  // namespace
}  // namespace attn
