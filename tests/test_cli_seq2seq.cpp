// End-to-end tests of `attn train --task translate|dates|copy|reverse`, `attn translate` and
// `attn predict` (the built binary, ATTN_CLI_PATH): training writes a checkpoint that translate
// applies; --resume repeats an uninterrupted run bit for bit; and issue 14's "Bad input": unknown
// tokens -> <unk>, an empty line -> an empty line, a long source cut with one warning naming its
// line, and a checkpoint of the other kind, a corrupt one, --beam 0 or a TSV line without a tab
// -> exit 2, one line on stderr, nothing written.
#include "attn/core/safetensors.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
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

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string l; std::getline(ss, l);)
    out.push_back(l);
  return out;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
}

// A tiny model: a second or so per run, even under ASan.
constexpr const char* kTiny =
    "--num-hiddens 16 --ffn-num-hiddens 16 --num-heads 2 --num-blks 1 --batch-size 8 "
    "--eval-examples 8 --threads 1";

// Both checkpoints hold the same tensors, bit for bit.
void expect_same_tensors(const SafetensorsFile& s, const SafetensorsFile& m) {
  ASSERT_EQ(s.tensors.size(), m.tensors.size());
  for (const auto& [name, t] : s.tensors) {
    ASSERT_TRUE(m.tensors.count(name)) << name;
    const Tensor& u = m.tensors.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()), 0) << name << " differs";
  }
}

class CliSeq2Seq : public ::testing::Test {
 protected:
  fs::path root, out;

  void SetUp() override {
    if (std::string(ATTN_CLI_PATH).empty())
      GTEST_SKIP() << "attn CLI not built (ATTN_BUILD_CLI=OFF)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root = attn::testing::temp_path(std::string("attn_test_cli_seq2seq_") + info->name());
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
  Result run(const std::string& args) {
    const fs::path o = root / "capture" / "stdout", e = root / "capture" / "stderr";
    const std::string cmd = "'" + std::string(ATTN_CLI_PATH) + "' " + args + " > '" + o.string() +
                            "' 2> '" + e.string() + "'";
    const int raw = std::system(cmd.c_str());
    return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_file(o), read_file(e)};
  }
  std::string path(const std::string& name) const { return "'" + (out / name).string() + "'"; }
  std::string input(const std::string& name, const std::string& text) const {
    const fs::path p = root / name;
    std::ofstream(p, std::ios::binary) << text;
    return "'" + p.string() + "'";
  }
  // exit 2, exactly one line on stderr holding every part, nothing on stdout, no file written.
  void expect_refused(const std::string& args, const std::vector<std::string>& parts,
                      size_t files_before) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << "attn " << args << "\n" << r.err;
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    for (const auto& p : parts)
      EXPECT_NE(r.err.find(p), std::string::npos) << "'" << p << "' not in: " << r.err;
    EXPECT_EQ(static_cast<size_t>(std::distance(fs::directory_iterator(out), {})), files_before)
        << "attn " << args << " left a file behind";
  }
};

TEST_F(CliSeq2Seq, TrainCopyThenTranslateWithBadLines) {
  const Result t = run(std::string("train --task copy --symbols 4 --length 4 --steps 30 ") + kTiny +
                       " --checkpoint " + path("copy.safetensors") + " --metrics " + path("m.csv"));
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("exact match"), std::string::npos) << t.out;
  EXPECT_NE(read_file(out / "m.csv").find("step,train_loss,eval_loss,bleu,exact_match"),
            std::string::npos);
  // copy --length 4: sources of 2..4 letters, num_steps 5. Line 4 (8 tokens) is cut; line 2 is
  // empty; line 3 holds a word the vocabulary lacks (-> <unk>).
  const std::string src = input("src.txt", "a b c\n\na zebra b\na b c d a b c d\nd c\n");
  for (const std::string beam : {"1", "3"}) {
    const Result r =
        run("translate --checkpoint " + path("copy.safetensors") + " --beam " + beam + " " + src);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto got = lines(r.out);
    ASSERT_EQ(got.size(), 5u) << r.out;
    EXPECT_TRUE(got[1].empty()) << "an empty source gives an empty translation";
    EXPECT_EQ(count(r.err, "warning"), 1u) << r.err;
    EXPECT_NE(r.err.find("src.txt:4:"), std::string::npos) << r.err;
    for (const auto& l : got)
      EXPECT_LE(count(l, " ") + 1, 5u) << l;  // at most num_steps tokens
  }
  // stdin and "-" read the same.
  const Result a = run("translate --checkpoint " + path("copy.safetensors") + " < " + src);
  const Result b = run("translate --checkpoint " + path("copy.safetensors") + " - < " + src);
  EXPECT_EQ(a.status, 0);
  EXPECT_EQ(a.out, b.out);
  // Unknown words give what <unk> gives.
  const Result u1 = run("translate --checkpoint " + path("copy.safetensors") + " " +
                        input("u1.txt", "a zebra b\n"));
  const Result u2 = run("translate --checkpoint " + path("copy.safetensors") + " " +
                        input("u2.txt", "a <unk> b\n"));
  EXPECT_EQ(u1.out, u2.out);
}

TEST_F(CliSeq2Seq, ResumeRepeatsAnUninterruptedRunBitForBit) {
  const std::string common =
      std::string("train --task reverse --symbols 4 --length 4 --dropout 0.1 --eval-every 3 ") +
      kTiny;
  ASSERT_EQ(run(common + " --steps 8 --checkpoint " + path("straight.safetensors")).status, 0);
  ASSERT_EQ(run(common + " --steps 5 --checkpoint " + path("half.safetensors")).status, 0);
  const Result r = run("train --resume " + path("half.safetensors") +
                       " --steps 8 --threads 2 --checkpoint " + path("resumed.safetensors"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("resumed at step 5"), std::string::npos) << r.err;
  const SafetensorsFile s = load_safetensors((out / "straight.safetensors").string());
  const SafetensorsFile m = load_safetensors((out / "resumed.safetensors").string());
  EXPECT_EQ(s.metadata.at("attn.step"), "8");
  EXPECT_EQ(m.metadata.at("attn.step"), "8");
  EXPECT_EQ(s.metadata.at("attn.dropout_offset"), m.metadata.at("attn.dropout_offset"));
  expect_same_tensors(s, m);
  // A resume that changes the model is refused.
  expect_refused("train --resume " + path("half.safetensors") + " --steps 8 --num-hiddens 32",
                 {"--num-hiddens"}, 3);
}

// --precision bf16 trains the encoder-decoder in mixed precision; a resume without --precision
// keeps it (the checkpoint's attn.precision) and repeats the uninterrupted run bit for bit; the
// checkpoint translates.
TEST_F(CliSeq2Seq, Bf16TrainsResumesAndTranslates) {
  const std::string common = std::string(
                                 "train --task reverse --symbols 4 --length 4 --dropout 0.1 "
                                 "--eval-every 3 --precision bf16 ") +
                             kTiny;
  const Result a = run(common + " --steps 6 --checkpoint " + path("straight.safetensors"));
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_NE(a.err.find("precision bf16"), std::string::npos) << a.err;
  ASSERT_EQ(run(common + " --steps 4 --checkpoint " + path("half.safetensors")).status, 0);
  const Result r = run("train --resume " + path("half.safetensors") +
                       " --steps 6 --threads 2 --checkpoint " + path("resumed.safetensors"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("precision bf16; resumed at step 4"), std::string::npos) << r.err;
  const SafetensorsFile s = load_safetensors((out / "straight.safetensors").string());
  const SafetensorsFile m = load_safetensors((out / "resumed.safetensors").string());
  EXPECT_EQ(s.metadata.at("attn.precision"), "bf16");
  EXPECT_EQ(m.metadata.at("attn.precision"), "bf16");
  expect_same_tensors(s, m);
  const Result t = run("translate --checkpoint " + path("straight.safetensors") + " " +
                       input("src.txt", "a b c\n\nd a\n"));
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_EQ(lines(t.out).size(), 3u) << t.out;
}

TEST_F(CliSeq2Seq, TrainTranslateOnATsvFile) {
  std::string tsv;
  for (int i = 0; i < 6; ++i)
    tsv += "Go.\tVa !\nHi.\tSalut !\nRun!\tCours !\nWho?\tQui ?\n";
  const std::string data = input("fra.tsv", tsv);
  const Result t = run("train --task translate --data " + data + " --steps 5 " + kTiny +
                       " --checkpoint " + path("fra.safetensors"));
  ASSERT_EQ(t.status, 0) << t.err;
  // Read as training read it: "Go." -> "go ."; the tab and target of a TSV line are ignored.
  const Result r = run("translate --checkpoint " + path("fra.safetensors") + " " +
                       input("in.tsv", "Go.\tVa !\nHI.\n"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines(r.out).size(), 2u);
  EXPECT_TRUE(r.err.empty()) << r.err;

  // A line without a tab: refused, naming file and line, and no checkpoint written.
  const std::string bad = input("bad.tsv", "Go.\tVa !\nHi. Salut !\n");
  expect_refused("train --task translate --data " + bad + " --steps 2 " + kTiny + " --checkpoint " +
                     path("bad.safetensors"),
                 {"bad.tsv:2", "tab"}, 1);
}

TEST_F(CliSeq2Seq, PredictAppliesAnEncoderCheckpoint) {
  std::string tsv;
  for (int i = 0; i < 8; ++i)
    tsv += "a good film\tpos\nvery bad acting\tneg\n";
  ASSERT_EQ(run("train --task tsv --data " + input("s.tsv", tsv) + " --steps 5 " + kTiny +
                " --checkpoint " + path("cls.safetensors"))
                .status,
            0);
  const Result c = run("predict --checkpoint " + path("cls.safetensors") + " " +
                       input("c.txt", "a good film\n\nunheard of words\n"));
  ASSERT_EQ(c.status, 0) << c.err;
  const auto got = lines(c.out);
  ASSERT_EQ(got.size(), 3u) << c.out;
  EXPECT_TRUE(got[0] == "pos" || got[0] == "neg") << got[0];
  EXPECT_TRUE(got[1].empty());
  EXPECT_TRUE(got[2] == "pos" || got[2] == "neg") << got[2];

  // shift (tagging over symbols 0..7): one tag per token; --max-len 1000 is the limit.
  ASSERT_EQ(run(std::string("train --task shift --steps 3 ") + kTiny + " --checkpoint " +
                path("tag.safetensors"))
                .status,
            0);
  const Result g = run("predict --checkpoint " + path("tag.safetensors") + " " +
                       input("g.txt", "0 1 2 3 7\n5 x 5\n"));
  ASSERT_EQ(g.status, 0) << g.err;
  const auto tags = lines(g.out);
  ASSERT_EQ(tags.size(), 2u);
  EXPECT_EQ(count(tags[0], " "), 4u);
  EXPECT_EQ(count(tags[1], " "), 2u);  // "x" is <unk>, still tagged
}

TEST_F(CliSeq2Seq, BadInputExitsTwoWithOneLineAndNothingWritten) {
  ASSERT_EQ(run(std::string("train --task dates --steps 1 ") + kTiny + " --checkpoint " +
                path("dates.safetensors"))
                .status,
            0);
  ASSERT_EQ(run(std::string("train --task sorted --steps 1 ") + kTiny + " --checkpoint " +
                path("enc.safetensors"))
                .status,
            0);
  const std::string src = input("src.txt", "the third of march two thousand and five\n");
  const std::string corrupt = input("corrupt.safetensors", "not a checkpoint at all");
  expect_refused("translate --checkpoint " + path("dates.safetensors") + " --beam 0 " + src,
                 {"--beam"}, 2);
  expect_refused("translate --checkpoint " + path("enc.safetensors") + " " + src,
                 {"enc.safetensors", "encoder task", "attn predict"}, 2);
  expect_refused("predict --checkpoint " + path("dates.safetensors") + " " + src,
                 {"dates.safetensors", "attn translate"}, 2);
  expect_refused("translate --checkpoint " + corrupt + " " + src, {"corrupt.safetensors"}, 2);
  expect_refused("predict --checkpoint " + corrupt + " " + src, {"corrupt.safetensors"}, 2);
  expect_refused("translate --checkpoint " + path("missing.safetensors") + " " + src,
                 {"missing.safetensors"}, 2);
  expect_refused("train --task dates --pe learned --steps 1 " + std::string(kTiny), {"--pe"}, 2);
  expect_refused("train --task translate --steps 1", {"--data"}, 2);
}

// --bucket (generated encoder tasks): batches drawn from a length-sorted pool are still a function
// of the step, so a resumed run repeats the uninterrupted one bit for bit; it changes the data
// (another run than without it), and it is refused where it has no meaning.
TEST_F(CliSeq2Seq, BucketByLengthResumesBitForBit) {
  const std::string common =
      std::string(
          "train --task shift --symbols 4 --length 12 --dropout 0.1 --eval-every 3 "
          "--bucket 3 ") +
      kTiny;
  ASSERT_EQ(run(common + " --steps 7 --checkpoint " + path("straight.safetensors")).status, 0);
  ASSERT_EQ(run(common + " --steps 4 --checkpoint " + path("half.safetensors")).status, 0);
  const Result r = run("train --resume " + path("half.safetensors") +
                       " --steps 7 --threads 2 --checkpoint " + path("resumed.safetensors"));
  ASSERT_EQ(r.status, 0) << r.err;
  const SafetensorsFile s = load_safetensors((out / "straight.safetensors").string());
  const SafetensorsFile m = load_safetensors((out / "resumed.safetensors").string());
  expect_same_tensors(s, m);
  const size_t files = static_cast<size_t>(std::distance(fs::directory_iterator(out), {}));
  expect_refused("train --task reverse --steps 1 --bucket 4", {"--bucket", "reverse"}, files);
  expect_refused("train --task shift --steps 1 --bucket 0", {"--bucket"}, files);
}

// Bucketing is the default for the generated encoder tasks: a run without --bucket is the run
// with --bucket 8, bit for bit, and --bucket 1 (off) trains on other batches.
TEST_F(CliSeq2Seq, BucketByLengthIsTheDefaultForShift) {
  const std::string common =
      std::string("train --task shift --symbols 4 --length 12 --steps 3 --eval-every 0 ") + kTiny;
  ASSERT_EQ(run(common + " --checkpoint " + path("default.safetensors")).status, 0);
  ASSERT_EQ(run(common + " --bucket 8 --checkpoint " + path("eight.safetensors")).status, 0);
  ASSERT_EQ(run(common + " --bucket 1 --checkpoint " + path("off.safetensors")).status, 0);
  const SafetensorsFile d = load_safetensors((out / "default.safetensors").string());
  const SafetensorsFile e = load_safetensors((out / "eight.safetensors").string());
  const SafetensorsFile o = load_safetensors((out / "off.safetensors").string());
  EXPECT_EQ(d.metadata.at("train.args"), e.metadata.at("train.args"));
  EXPECT_NE(d.metadata.at("train.args"), o.metadata.at("train.args"));
  size_t differ_from_off = 0;
  for (const auto& [name, t] : d.tensors) {
    const Tensor& u = e.tensors.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()), 0) << name << " differs";
    differ_from_off += std::memcmp(t.raw_data(), o.tensors.at(name).raw_data(), t.nbytes()) != 0;
  }
  EXPECT_GT(differ_from_off, 0u);
}

}  // namespace
}  // namespace attn
