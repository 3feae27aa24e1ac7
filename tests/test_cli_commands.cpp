// End-to-end tests of the `attn` binary (ATTN_CLI_PATH): output formats, numbers against the
// library, the tour's page and figures, and the error contract (exit status 2, one line on
// stderr, no output file).
#include "attn/core/device.hpp"
#include "attn/ops/positional.hpp"
#include "testing.hpp"
#include "viz/xml_check.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
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

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string l; std::getline(ss, l);)
    out.push_back(l);
  return out;
}

// A fresh directory per test, removed afterwards: `out` for files the command may write,
// `capture` for its stdout and stderr.
class Cli : public ::testing::Test {
 protected:
  fs::path root, out;

  void SetUp() override {
    if (std::string(ATTN_CLI_PATH).empty())
      GTEST_SKIP() << "attn CLI not built (ATTN_BUILD_CLI=OFF)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root = attn::testing::temp_path(std::string("attn_test_cli_") + info->test_suite_name() + "_" +
                                    info->name());
    fs::remove_all(root);
    out = root / "out";
    fs::create_directories(out);
    fs::create_directories(root / "capture");
  }
  void TearDown() override {
    if (!root.empty()) fs::remove_all(root);
  }

  struct Result {
    int status;
    std::string out, err;
  };
  // Runs `attn <args>` through the shell (args are shell words: quote as needed).
  Result run(const std::string& args) {
    const fs::path o = root / "capture" / "stdout", e = root / "capture" / "stderr";
    const std::string cmd = "'" + std::string(ATTN_CLI_PATH) + "' " + args + " > '" + o.string() +
                            "' 2> '" + e.string() + "'";
    const int raw = std::system(cmd.c_str());
    return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_file(o), read_file(e)};
  }
  std::string path(const std::string& name) const { return "'" + (out / name).string() + "'"; }
  size_t files_in_out() const {
    return static_cast<size_t>(std::distance(fs::recursive_directory_iterator(out), {}));
  }
};

// Well-formed by our checker and, where python3 is around, by a real XML parser too (one
// python3 process for all files: starting it is the slow part).
::testing::AssertionResult SvgParses(const std::vector<fs::path>& files) {
  std::string list;
  for (const fs::path& file : files) {
    if (!fs::exists(file)) return ::testing::AssertionFailure() << file << " does not exist";
    std::string why;
    if (!viz::xml_well_formed(read_file(file), &why))
      return ::testing::AssertionFailure() << file << ": " << why;
    list += " '" + file.string() + "'";
  }
  static const bool have_python =
      std::system("python3 -c 'import xml.dom.minidom' > /dev/null 2>&1") == 0;
  if (have_python) {
    const std::string cmd =
        "python3 -c 'import sys, xml.dom.minidom as m; [m.parse(f) for f in sys.argv[1:]]'" + list +
        " > /dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0)
      return ::testing::AssertionFailure() << "python3's XML parser rejects one of" << list;
  }
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult SvgParses(const fs::path& file) {
  return SvgParses(std::vector<fs::path>{file});
}

// --- self-attention --------------------------------------------------------------------------

TEST_F(Cli, SelfAttentionPrintsTheChapterShape) {
  const Result r = run("self-attention");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  ASSERT_FALSE(lines(r.out).empty());
  EXPECT_EQ(lines(r.out)[0], "(2, 4, 100)");
}

TEST_F(Cli, SelfAttentionFlagsChangeTheShape) {
  Result r =
      run("self-attention --batch-size 3 --num-queries 5 --num-hiddens 64 --num-heads 8 "
          "--valid-lens '1 2 3'");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines(r.out)[0], "(3, 5, 64)");
  // 2-D valid lengths (B, T), random input, training mode with dropout.
  r =
      run("self-attention --num-queries 2 --num-hiddens 12 --num-heads 3 --valid-lens '1 2; 2 1' "
          "--input random --seed 7 --train --dropout 0.3");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines(r.out)[0], "(2, 2, 12)");
  r = run("self-attention --valid-lens none --batch-size 1");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines(r.out)[0], "(1, 4, 100)");
}

TEST_F(Cli, SelfAttentionWeightsFigure) {
  const Result r = run("self-attention --input random --weights-svg " + path("w.svg"));
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_TRUE(SvgParses(out / "w.svg"));
  const std::string svg = read_file(out / "w.svg");
  size_t panels = 0;
  for (size_t p = svg.find("class=\"panel\""); p != std::string::npos;
       p = svg.find("class=\"panel\"", p + 1))
    ++panels;
  EXPECT_EQ(panels, 10u);  // 2 sequences x 5 heads
  EXPECT_NE(svg.find("batch 1, head 4"), std::string::npos);
}

// --- pe --------------------------------------------------------------------------------------

TEST_F(Cli, PeCsvMatchesTheLibrary) {
  const Result r = run("pe --positions 60 --dim 32 --format csv");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto rows = lines(r.out);
  ASSERT_EQ(rows.size(), 60u);
  const Tensor P = sinusoidal_encoding(60, 32);
  for (int64_t i = 0; i < 60; ++i) {
    std::stringstream ss(rows[static_cast<size_t>(i)]);
    std::string field;
    int64_t k = 0;
    while (std::getline(ss, field, ',')) {
      ASSERT_LT(k, 32) << "row " << i << " has more than 32 columns";
      // Printed as the shortest text that reads back to the same float32.
      EXPECT_EQ(std::strtof(field.c_str(), nullptr), static_cast<float>(P.at({i, k})))
          << "P[" << i << ", " << k << "] printed as " << field;
      ++k;
    }
    ASSERT_EQ(k, 32) << "row " << i;
  }
}

TEST_F(Cli, PeExactPrecisionIsFloat64) {
  const Result r = run("pe --positions 1000 --dim 8 --precision exact");  // csv by default
  ASSERT_EQ(r.status, 0) << r.err;
  const auto rows = lines(r.out);
  ASSERT_EQ(rows.size(), 1000u);
  const Tensor P = sinusoidal_encoding(1000, 8, DType::F64, SinusoidalMode::kExact);
  std::stringstream ss(rows[999]);
  std::string field;
  for (int64_t k = 0; std::getline(ss, field, ','); ++k)
    EXPECT_EQ(std::strtod(field.c_str(), nullptr), P.at({999, k}));
}

TEST_F(Cli, PeJsonParses) {
  const Result r = run("pe --positions 10 --dim 6 --format json");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["shape"], nlohmann::json({10, 6}));
  EXPECT_EQ(doc["precision"], "d2l");
  EXPECT_EQ(doc["dtype"], "float32");
  ASSERT_EQ(doc["data"].size(), 10u);
  const Tensor P = sinusoidal_encoding(10, 6);
  for (int64_t i = 0; i < 10; ++i) {
    ASSERT_EQ(doc["data"][i].size(), 6u);
    for (int64_t k = 0; k < 6; ++k)
      EXPECT_EQ(static_cast<float>(doc["data"][i][k].get<double>()),
                static_cast<float>(P.at({i, k})));
  }
}

TEST_F(Cli, PeFigures) {
  const Result r = run("pe --curves " + path("c.svg") + " --heatmap " + path("h.svg"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "");  // figures only: no matrix on stdout unless --format asks for it
  EXPECT_TRUE(SvgParses({out / "c.svg", out / "h.svg"}));
  EXPECT_NE(read_file(out / "c.svg").find("Col 9"), std::string::npos);
  const Result r2 = run("pe --dim 8 --columns 0,3 --curves " + path("c2.svg") + " --format json");
  ASSERT_EQ(r2.status, 0) << r2.err;
  EXPECT_TRUE(nlohmann::json::accept(r2.out));
  EXPECT_NE(read_file(out / "c2.svg").find("Col 3"), std::string::npos);
  // Small widths fall back to the columns that exist.
  EXPECT_EQ(run("pe --dim 4 --curves " + path("c3.svg")).status, 0);
}

TEST_F(Cli, PeBinaryTable) {
  const Result r = run("pe binary --dim 32 --svg " + path("b.svg"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("111"), std::string::npos);
  EXPECT_NE(r.out.find("omega_j"), std::string::npos);
  // 0..7 with 3 bits, and 16 frequencies for d = 32.
  EXPECT_NE(r.out.find("  7  111"), std::string::npos);
  EXPECT_NE(r.out.find("  15  30, 31"), std::string::npos);
  EXPECT_TRUE(SvgParses(out / "b.svg"));
}

TEST_F(Cli, PeRelativeRotationHolds) {
  const Result r = run("pe relative --delta 5 --dim 32 --positions 1000");
  ASSERT_EQ(r.status, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(max error float64: (\S+))"))) << r.out;
  EXPECT_LT(std::stod(m[1]), 1e-5);
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(max error float32: (\S+))"))) << r.out;
  EXPECT_LT(std::stod(m[1]), 1e-3);

  for (const char* delta : {"1", "500", "-3", "999"}) {
    const Result j = run(std::string("pe relative --json --delta ") + delta);
    ASSERT_EQ(j.status, 0) << j.err;
    const auto doc = nlohmann::json::parse(j.out);
    EXPECT_LT(doc["max_error_float64"].get<double>(), 1e-5) << "delta " << delta;
    EXPECT_LT(doc["max_error_float32"].get<double>(), 1e-3) << "delta " << delta;
    EXPECT_LT(doc["max_error_float32_exact"].get<double>(), 1e-6) << "delta " << delta;
    EXPECT_EQ(doc["pairs"].size(), 16u);
  }
}

// --- tour ------------------------------------------------------------------------------------

TEST_F(Cli, TourWritesAPageWhoseFilesExist) {
  // The trained-model sections take about a minute each (several minutes under the
  // sanitizers); the trainers have their own tests, so this one leaves them out.
  const Result r =
      run("tour --out " + path("tour") + " --skip positional-experiment --skip seq2seq");
  ASSERT_EQ(r.status, 0) << r.err;
  const fs::path dir = out / "tour";
  const std::string html = read_file(dir / "index.html");
  ASSERT_FALSE(html.empty());
  EXPECT_NE(html.find("(2, 4, 100)"), std::string::npos);

  // Every src="..." and every named file exists; every SVG parses.
  std::set<std::string> referenced;
  const std::regex src(R"re(src="([^"]+)")re");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), src); it != std::sregex_iterator();
       ++it)
    referenced.insert((*it)[1]);
  EXPECT_GE(referenced.size(), 6u);
  EXPECT_NE(html.find("pe_60x32.csv"), std::string::npos);
  referenced.insert("pe_60x32.csv");
  std::vector<fs::path> svgs;
  for (const std::string& f : referenced) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
    if (f.ends_with(".svg")) svgs.push_back(dir / f);
  }
  // Two weight grids, curves, heatmap, binary table, relative error, the CNN/RNN/attention times,
  // the positional-encoding requirements' P P^T and dot products against the offset.
  EXPECT_EQ(svgs.size(), 9u);
  EXPECT_TRUE(referenced.count("compare_time.svg"));
  EXPECT_TRUE(referenced.count("pe_gram.svg"));
  EXPECT_TRUE(SvgParses(svgs));
  for (const char* section :
       {"id=\"self-attention\"", "id=\"encoding-matrix\"", "id=\"absolute-position\"",
        "id=\"relative-position\"", "id=\"pe-requirements\""})
    EXPECT_NE(html.find(section), std::string::npos) << section;
  // Preformatted text fits the page: ~930 px inside the block at ~7.8 px per 13 px monospace
  // character is 118 characters (issue 14 asked it of `attn compare --quick`'s block).
  const std::regex pre(R"re(<pre>([\s\S]*?)</pre>)re");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), pre); it != std::sregex_iterator();
       ++it)
    for (const std::string& l : lines((*it)[1]))
      EXPECT_LE(l.size(), 118u) << l;
}

// --- errors ----------------------------------------------------------------------------------

TEST_F(Cli, BadInputExitsTwoWithOneLineAndNoFile) {
  // A regular file where the tour wants a directory.
  std::ofstream(root / "a_file") << "x";
  const std::string file_in_the_way = "'" + (root / "a_file" / "tour").string() + "'";
  const std::vector<std::string> cases = {
      "self-attention --bogus --weights-svg " + path("w.svg"),
      "self-attention --num-heads 3 --num-hiddens 100 --weights-svg " + path("w.svg"),
      "self-attention --valid-lens 3 --weights-svg " + path("w.svg"),
      "self-attention --valid-lens '3 x' --weights-svg " + path("w.svg"),
      "self-attention --valid-lens '1 2; 3' --weights-svg " + path("w.svg"),
      "self-attention --dropout 1.5 --weights-svg " + path("w.svg"),
      "self-attention --batch-size 0",
      "self-attention --input zeros",
      "self-attention --num-hiddens abc",
      "pe --positions -1 --curves " + path("c.svg"),
      "pe --dim 0 --heatmap " + path("h.svg"),
      "pe --format xml --curves " + path("c.svg"),
      "pe --precision float16 --curves " + path("c.svg"),
      "pe --columns 40 --curves " + path("c.svg"),
      "pe --curves " + path("missing_dir/c.svg"),  // unwritable: no such directory
      "pe --positions 100000000 --dim 100000000",
      "pe --curves ''",
      "pe binary --dim 0 --svg " + path("b.svg"),
      "pe relative",
      "pe relative --delta 1000",
      "pe relative --delta 2 --dim 1",
      "tour",
      "tour --out " + file_in_the_way,
      "bench",
      "bench attention --queries 0",
      "bench attention --repeats 0",
      "bench attention --warmup-seconds -1",
      "bench attention --dtype f16",
      "bench attention --backend gpu",
      "bench attention --head-dim x",
      "",
      "no-such-command",
  };
  for (const std::string& args : cases) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << "attn " << args;
    EXPECT_EQ(r.out, "") << "attn " << args;
    const auto err = lines(r.err);
    ASSERT_EQ(err.size(), 1u) << "attn " << args << "\nstderr:\n" << r.err;
    EXPECT_EQ(err[0].rfind("attn: ", 0), 0u) << err[0];
    EXPECT_GT(err[0].size(), 8u) << "attn " << args;
    EXPECT_EQ(files_in_out(), 0u) << "attn " << args << " left a file behind";
  }
}

// --- bench -----------------------------------------------------------------------------------

// The JSON that scripts read: the fields the issue names, consistent with each other. (No timing
// is asserted: tests check what the benchmark reports, not how fast it is.)
TEST_F(Cli, BenchAttentionJson) {
  for (const std::string flags : {"", " --backward", " --causal --backward", " --keys 40"}) {
    const Result r =
        run("bench attention --batch-heads 2 --queries 24 --head-dim 16 --threads 1 "
            "--repeats 3 --warmup 0 --warmup-seconds 0 --json" +
            flags);
    ASSERT_EQ(r.status, 0) << flags << ": " << r.err;
    const auto doc = nlohmann::json::parse(r.out);
    for (const char* key : {"gflops", "peak_gflops", "median_ms", "peak_rss_mib", "flops"}) {
      ASSERT_TRUE(doc.contains(key)) << key;
      EXPECT_GT(doc[key].get<double>(), 0.0) << key;
    }
    EXPECT_EQ(doc["pass"], flags.find("--backward") != std::string::npos ? "backward" : "forward");
    EXPECT_EQ(doc["threads"], 1);
    EXPECT_EQ(doc["warmup_runs"], 0);  // --warmup 0 --warmup-seconds 0
    const double S = doc["keys"].get<double>();
    EXPECT_EQ(S, flags.find("--keys") != std::string::npos ? 40 : 24);
    // FLOPs: 4 * BH * pairs * D, backward 2.5x; causal keeps sum_t (t + 1) of T = S = 24 pairs.
    const double pairs = flags.find("--causal") != std::string::npos ? 24.0 * 25.0 / 2.0 : 24.0 * S;
    const double factor = flags.find("--backward") != std::string::npos ? 2.5 : 1.0;
    EXPECT_DOUBLE_EQ(doc["flops"].get<double>(), 4.0 * 2.0 * pairs * 16.0 * factor);
    EXPECT_NEAR(doc["gflops"].get<double>(),
                doc["flops"].get<double>() / (doc["median_ms"].get<double>() * 1e6), 1e-9);
  }
  const Result text = run(
      "bench attention --batch-heads 1 --queries 8 --head-dim 8 --repeats 1 --warmup-seconds 0");
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("GFLOP/s"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("% of peak"), std::string::npos) << text.out;
}

TEST_F(Cli, HelpExitsZero) {
  for (const char* args : {"--help", "self-attention --help", "pe --help", "pe binary --help",
                           "pe relative --help", "tour --help", "bench attention --help"}) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 0) << args;
    EXPECT_EQ(r.err, "") << args;
    EXPECT_NE(r.out.find("--help"), std::string::npos) << args;
  }
  EXPECT_NE(run("pe relative --help").out.find("--delta"), std::string::npos);
  EXPECT_NE(run("self-attention --help").out.find("--num-heads"), std::string::npos);
}

// An unknown subcommand is named (with the ones that exist), at every level, also when --help
// follows it: `attn foo --help` must not print the top-level help and exit 0 as if foo existed.
TEST_F(Cli, UnknownSubcommandIsNamed) {
  // clang-format off
  const struct {
    const char* args;
    const char* names;  // the command the word was looked up in
    const char* lists;  // one subcommand the message offers
  } cases[] = {
      {"foo", "`attn`", "self-attention"},
      {"foo --help", "`attn`", "bench"},
      {"foo --version", "`attn`", "tour"},
      {"bench foo", "`attn bench`", "attention"},
      {"bench foo --help", "`attn bench`", "ring"},
      {"pe foo", "`attn pe`", "relative"},
  };
  // clang-format on
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.status, 2) << "attn " << c.args;
    EXPECT_EQ(r.out, "") << "attn " << c.args;
    const auto err = lines(r.err);
    ASSERT_EQ(err.size(), 1u) << "attn " << c.args << "\nstderr:\n" << r.err;
    EXPECT_EQ(err[0].rfind("attn: unknown subcommand 'foo' for " + std::string(c.names), 0), 0u)
        << err[0];
    EXPECT_NE(err[0].find(c.lists), std::string::npos) << err[0];
  }
  // Words after a flag are values or positionals, not subcommands: CLI11 judges them.
  const Result value = run("pe --format foo");
  EXPECT_EQ(value.status, 2);
  EXPECT_EQ(value.err.find("unknown subcommand"), std::string::npos) << value.err;
}

// `attn --version` prints the project version of the top-level CMakeLists.txt.
TEST_F(Cli, VersionPrintsTheProjectVersion) {
  const std::string cmake = read_file(fs::path(ATTN_FIXTURE_DIR) / ".." / ".." / "CMakeLists.txt");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(cmake, m, std::regex(R"(project\(attn VERSION ([0-9.]+))")));
  const Result r = run("--version");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "attn " + m[1].str() + "\n");
  EXPECT_EQ(r.err, "");
  EXPECT_NE(run("--help").out.find("--version"), std::string::npos);
}

// --device cuda (train, bench attention): a CPU build names the build option; a CUDA build
// without a GPU says so; the encoder-decoder tasks say their GPU path is not written. One line,
// exit 2, no file either way.
TEST_F(Cli, TrainDeviceCudaIsOneLineWithoutAGpu) {
  const std::string ckpt = path("c.safetensors");
  Result r =
      run("train --task shift --length 8 --steps 2 --eval-every 0 --eval-examples 8 "
          "--device cuda --checkpoint " +
          ckpt);
  EXPECT_EQ(r.status, 2) << r.err;
  const bool built = attn::cuda_built();
  EXPECT_NE(r.err.find(built ? "no CUDA device" : "-DATTN_WITH_CUDA=ON"), std::string::npos)
      << r.err;
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  r = run("bench attention --queries 16 --device cuda");
  EXPECT_EQ(r.status, 2) << r.err;
  if (!built) {
    EXPECT_NE(r.err.find("-DATTN_WITH_CUDA=ON"), std::string::npos) << r.err;
  }
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  if (built) {
    r = run("train --task dates --steps 2 --device cuda");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.err.find("encoder-decoder (dates) on the GPU is not written yet"),
              std::string::npos)
        << r.err;
  }
  EXPECT_EQ(files_in_out(), 0u);
}

}  // namespace
}  // namespace attn
