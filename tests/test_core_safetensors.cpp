// safetensors: round trips of every dtype and layout, byte-exact output against the spec, and
// every way a file can be corrupt (each must end in attn::Error naming the file, never a crash).
#include "attn/core/safetensors.hpp"
#include "testing.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

namespace attn {
namespace {

namespace fs = std::filesystem;
using Bytes = std::string;  // file contents

Bytes read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// The 8-byte little-endian length field.
Bytes u64le(uint64_t v) {
  Bytes b(8, '\0');
  for (int i = 0; i < 8; ++i)
    b[i] = static_cast<char>(v >> (8 * i));
  return b;
}

// A file made of `header` (unpadded) and `data_bytes` bytes of data (values 0, 1, 2, ...).
Bytes make_file(const std::string& header, size_t data_bytes) {
  Bytes b = u64le(header.size()) + header;
  for (size_t i = 0; i < data_bytes; ++i)
    b += static_cast<char>(i);
  return b;
}

// Same dtype, shape and bytes (bitwise, so NaN and -0 count).
::testing::AssertionResult same_tensor(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape())
    return ::testing::AssertionFailure()
           << "got " << dtype_name(got.dtype()) << " " << shape_str(got.shape()) << ", want "
           << dtype_name(want.dtype()) << " " << shape_str(want.shape());
  Tensor w = want.contiguous();
  // Compared with contiguous_strides rather than is_contiguous(), which (at the time of writing)
  // calls an empty (2, 0) tensor strided.
  if (got.strides() != contiguous_strides(got.shape()))
    return ::testing::AssertionFailure() << "loaded tensor is strided";
  if (w.nbytes() && std::memcmp(got.raw_data(), w.raw_data(), w.nbytes()) != 0)
    return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("attn_st_" + std::to_string(getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Both readers (file and in-memory) must reject `bytes` with an Error from safetensors::load
  // whose message names the file and contains every string in `needles`.
  void expect_rejected(const Bytes& bytes, std::initializer_list<std::string> needles) {
    const std::string file = path("bad.safetensors");
    write_file(file, bytes);
    for (int reader = 0; reader < 2; ++reader) {
      SCOPED_TRACE(reader == 0 ? "load_safetensors" : "parse_safetensors");
      try {
        if (reader == 0)
          load_safetensors(file);
        else
          parse_safetensors(bytes.data(), bytes.size(), file);
        ADD_FAILURE() << "accepted a corrupt file";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.op(), "safetensors::load");
        EXPECT_NE(msg.find(file), std::string::npos) << msg;
        for (const std::string& n : needles)
          EXPECT_NE(msg.find(n), std::string::npos) << msg;
      }
    }
  }
  void expect_rejected(const std::string& header, size_t data_bytes,
                       std::initializer_list<std::string> needles) {
    SCOPED_TRACE(header);
    expect_rejected(make_file(header, data_bytes), needles);
  }

  fs::path dir_;
};

constexpr DType kAllDtypes[] = {DType::F32, DType::F64, DType::BF16,
                                DType::F16, DType::I32, DType::I64};

TEST_F(Safetensors, RoundTripEveryDtypeAndLayout) {
  std::map<std::string, Tensor> in;
  uint64_t seed = 1;
  for (DType t : kAllDtypes) {
    const std::string d(dtype_name(t));
    in[d + "_3d"] = testing::random_tensor({2, 3, 4}, t, seed++, -100, 100);
    in[d + "_strided"] = testing::random_tensor({3, 5}, t, seed++, -100, 100).transpose(0, 1);
    in[d + "_sliced"] = testing::random_tensor({4, 6}, t, seed++, -100, 100).slice(1, 1, 4);
    in[d + "_scalar"] = Tensor::full({}, 42, t);
    in[d + "_empty"] = Tensor::zeros({0, 3}, t);
    in[d + "_empty_last"] = Tensor::zeros({2, 0}, t);
  }
  ASSERT_FALSE(in["F32_strided"].is_contiguous());
  const std::string file = path("all.safetensors");
  save_safetensors(file, in);
  SafetensorsFile out = load_safetensors(file);
  Bytes bytes = read_file(file);
  SafetensorsFile parsed = parse_safetensors(bytes.data(), bytes.size(), file);
  ASSERT_EQ(out.tensors.size(), in.size());
  EXPECT_TRUE(out.metadata.empty());
  for (const auto& [name, t] : in) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(out.tensors.count(name));
    EXPECT_TRUE(same_tensor(out.tensors.at(name), t));
    EXPECT_TRUE(same_tensor(parsed.tensors.at(name), t));
    EXPECT_TRUE(out.tensors.at(name).owns_memory());
  }
  EXPECT_EQ(out.tensors.at("F64_scalar").at({}), 42.0);
}

TEST_F(Safetensors, SpecialValuesSurviveBitExactly) {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor t = Tensor::from_vector(std::vector<double>{-0.0, inf, -inf, NAN, 1e-310, 5e-324}, {6},
                                 DType::F64);
  save_safetensors(path("s.safetensors"), {{"x", t}});
  EXPECT_TRUE(same_tensor(load_safetensors(path("s.safetensors")).tensors.at("x"), t));
}

TEST_F(Safetensors, MetadataRoundTrip) {
  std::map<std::string, std::string> meta = {{"format", "pt"},
                                             {"quote\"back\\slash", "line\nbreak\ttab"},
                                             {"utf8", "\xc3\xa9t\xc3\xa9"},
                                             {"", "empty key"},
                                             {"empty value", ""}};
  save_safetensors(path("m.safetensors"), {{"w", Tensor::zeros({2})}}, meta);
  EXPECT_EQ(load_safetensors(path("m.safetensors")).metadata, meta);
  // Metadata without tensors is a valid file too.
  save_safetensors(path("only.safetensors"), {}, meta);
  SafetensorsFile f = load_safetensors(path("only.safetensors"));
  EXPECT_EQ(f.metadata, meta);
  EXPECT_TRUE(f.tensors.empty());
}

TEST_F(Safetensors, DeterministicBytesAndAlignedData) {
  auto make = [] {
    std::map<std::string, Tensor> m;
    m["z"] = testing::random_tensor({3, 7}, DType::F32, 5);
    m["a"] = testing::random_tensor({5}, DType::I64, 6, -1000, 1000);
    m["m"] = testing::random_tensor({2, 2}, DType::BF16, 7);
    return m;
  };
  save_safetensors(path("1.safetensors"), make(), {{"k", "v"}});
  save_safetensors(path("2.safetensors"), make(), {{"k", "v"}});
  Bytes a = read_file(path("1.safetensors"));
  EXPECT_EQ(a, read_file(path("2.safetensors")));
  ASSERT_GE(a.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = n << 8 | static_cast<unsigned char>(a[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data area must start 8-byte aligned";
  // Sorted by name, offsets packed in that order.
  std::string header = a.substr(8, n);
  EXPECT_LT(header.find("\"a\""), header.find("\"m\""));
  EXPECT_LT(header.find("\"m\""), header.find("\"z\""));
  EXPECT_NE(header.find("\"a\":{\"dtype\":\"I64\",\"shape\":[5],\"data_offsets\":[0,40]}"),
            std::string::npos)
      << header;
}

// The exact bytes the spec prescribes, written out by hand: __metadata__ first, tensors sorted
// by name with packed offsets, the header padded with spaces to a multiple of 8 bytes.
TEST_F(Safetensors, MatchesHandBuiltFileByteForByte) {
  const std::string header = R"({"__metadata__":{"k":"v"},)"
                             R"("a":{"dtype":"I32","shape":[],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})"
                             "    ";  // 132 bytes of JSON + 4 spaces = 136 = 0x88
  const unsigned char length[8] = {0x88, 0, 0, 0, 0, 0, 0, 0};
  const unsigned char data[12] = {0x07, 0x00, 0x00, 0x00,   // a = int32 7
                                  0x00, 0x00, 0x80, 0x3f,   // b[0] = 1.0f
                                  0x00, 0x00, 0x00, 0xc0};  // b[1] = -2.0f
  const Bytes expected = Bytes(reinterpret_cast<const char*>(length), 8) + header +
                         Bytes(reinterpret_cast<const char*>(data), 12);
  ASSERT_EQ(header.size(), 136u);

  Tensor a = Tensor::full({}, 7, DType::I32);
  Tensor b = Tensor::from_vector(std::vector<float>{1.0f, -2.0f}, {2});
  save_safetensors(path("h.safetensors"), {{"b", b}, {"a", a}}, {{"k", "v"}});
  EXPECT_EQ(read_file(path("h.safetensors")), expected);

  SafetensorsFile f = parse_safetensors(expected.data(), expected.size(), "hand-built");
  EXPECT_TRUE(same_tensor(f.tensors.at("a"), a));
  EXPECT_TRUE(same_tensor(f.tensors.at("b"), b));
  EXPECT_EQ(f.metadata.at("k"), "v");
}

TEST_F(Safetensors, AcceptsOtherWritersLayouts) {
  // Unpadded header, __metadata__ last, entries out of offset order, empty tensors anywhere on
  // a boundary, keys in any order: all valid per the spec.
  const std::string h =
      R"({"y":{"data_offsets":[4,8],"shape":[1],"dtype":"I32"},"e":{"dtype":"F16","shape":[0],)"
      R"("data_offsets":[4,4]},"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},)"
      R"("__metadata__":{"a":"b"}}  )";
  Bytes b = make_file(h, 8);
  SafetensorsFile f = parse_safetensors(b.data(), b.size(), "other");
  EXPECT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors.at("e").numel(), 0);
  EXPECT_EQ(f.metadata.at("a"), "b");
  // An empty file is "{}" plus nothing.
  Bytes empty = make_file("{}", 0);
  EXPECT_TRUE(parse_safetensors(empty.data(), empty.size(), "empty").tensors.empty());
}

TEST_F(Safetensors, RejectsBadFraming) {
  expect_rejected(Bytes("\x02\x00\x00", 3), {"3 bytes", "shorter than the 8-byte"});
  expect_rejected(u64le(100) + "{}", {"header length 100", "exceeds"});
  expect_rejected(u64le(200'000'000) + "{}", {"header length 200000000", "limit"});
  expect_rejected(u64le(~uint64_t{0}) + "{}", {"exceeds"});
  expect_rejected("", 0, {"must start with '{'"});
  expect_rejected(" {}", 0, {"must start with '{'"});
  expect_rejected("[1, 2]", 0, {"must start with '{'"});
  expect_rejected(R"({"a":)", 0, {"not valid JSON"});
  expect_rejected(R"({} x)", 0, {"not valid JSON"});
  expect_rejected(std::string("{}\0", 3), 0, {"NUL byte at offset 2"});
  expect_rejected(std::string("{}\0garbage", 10), 0, {"NUL byte"});
  expect_rejected("{\"\xff\":1}", 0, {"not valid JSON"});  // invalid UTF-8
  std::string deep;
  for (int i = 0; i < 20; ++i)
    deep += R"({"a":)";
  expect_rejected(deep + "1" + std::string(20, '}'), 0, {"deeper than"});
  expect_rejected(R"({"a":[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]})", 0, {"deeper than"});
}

TEST_F(Safetensors, RejectsBadEntries) {
  const std::string ok_tail = R"("shape":[2],"data_offsets":[0,8]}})";
  expect_rejected(R"({"w":3})", 0, {"tensor 'w'", "must be an object", "number"});
  expect_rejected(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8, {"'w'", "missing key 'dtype'"});
  expect_rejected(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8,
                  {"'w'", "missing key 'shape'"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[2]}})", 8, {"'w'", "missing key 'data_offsets'"});
  expect_rejected(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8,
                  {"'w'", "unexpected key 'x'"});
  expect_rejected(R"({"w":{"dtype":5,)" + ok_tail, 8, {"'w'", "dtype must be a string"});
  expect_rejected(R"({"w":{"dtype":"F33",)" + ok_tail, 8, {"'w'", "unknown dtype 'F33'"});
  expect_rejected(R"({"w":{"dtype":"U8",)" + ok_tail, 8, {"'w'", "unsupported dtype 'U8'"});
  expect_rejected(R"({"w":{"dtype":"f32",)" + ok_tail, 8, {"'w'", "unknown dtype 'f32'"});
  // Shapes.
  auto entry = [](const std::string& shape, const std::string& offsets) {
    return R"({"w":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
  };
  expect_rejected(entry("\"2\"", "[0,8]"), 8, {"'w'", "shape must be an array", "string"});
  expect_rejected(entry("[-1]", "[0,8]"), 8, {"'w'", "dimension -1", "non-negative integer"});
  expect_rejected(entry("[1.5]", "[0,8]"), 8, {"'w'", "dimension 1.5"});
  expect_rejected(entry("[2.0]", "[0,8]"), 8, {"'w'", "dimension 2.0"});
  expect_rejected(entry("[true]", "[0,8]"), 8, {"'w'", "dimension true"});
  expect_rejected(entry("[[2]]", "[0,8]"), 8, {"'w'", "dimension [2]"});
  expect_rejected(entry("[9223372036854775808]", "[0,8]"), 8, {"'w'", "below 2^63"});
  expect_rejected(entry("[4294967296,4294967296]", "[0,8]"), 8, {"'w'", "more elements than fit"});
  // An empty tensor whose strides would overflow is rejected too.
  expect_rejected(entry("[0,4611686018427387904,4]", "[0,0]"), 0, {"'w'", "more elements"});
  // Offsets.
  expect_rejected(entry("[2]", "\"0\""), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[0]"), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[0,8,8]"), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[-8,0]"), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[0,8.0]"), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[8,0]"), 8, {"'w'", "begin > end"});
  expect_rejected(entry("[2]", "[0,16]"), 8, {"'w'", "[0, 16]", "beyond the data area of 8"});
  expect_rejected(entry("[2]", "[0,18446744073709551615]"), 8, {"'w'", "expected [begin, end]"});
  expect_rejected(entry("[2]", "[0,4]"), 4, {"'w'", "span 4 bytes", "(2) of F32"});
  expect_rejected(entry("[2]", "[0,9]"), 9, {"'w'", "span 9 bytes"});
  expect_rejected(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8,
                  {"'w'", "span 8 bytes", "(3) of BF16"});
}

TEST_F(Safetensors, RejectsBadTiling) {
  auto two = [](const std::string& a, const std::string& b) {
    return R"({"a":{"dtype":"I32","shape":[1],"data_offsets":)" + a +
           R"(},"b":{"dtype":"I32","shape":[1],"data_offsets":)" + b + "}}";
  };
  expect_rejected(two("[0,4]", "[0,4]"), 4, {"overlap"});
  expect_rejected(two("[0,4]", "[2,6]"), 8, {"tensor 'b'", "overlap tensor 'a'"});
  expect_rejected(two("[0,4]", "[8,12]"), 12, {"tensor 'b'", "gap of 4 bytes at offset 4"});
  expect_rejected(two("[4,8]", "[8,12]"), 12, {"tensor 'a'", "gap of 4 bytes at offset 0"});
  expect_rejected(two("[0,4]", "[4,8]"), 9, {"cover 8 bytes of the 9-byte data area"});
  expect_rejected(R"({"a":{"dtype":"I32","shape":[0],"data_offsets":[2,2]},)"
                  R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                  4, {"'a'", "overlap"});
  expect_rejected("{}", 1, {"cover 0 bytes of the 1-byte"});
}

TEST_F(Safetensors, RejectsDuplicatesAndBadMetadata) {
  const std::string e = R"({"dtype":"I32","shape":[1],"data_offsets":[0,4]})";
  expect_rejected(R"({"w":)" + e + R"(,"w":)" + e + "}", 4, {"tensor 'w'", "duplicate name"});
  expect_rejected(R"({"w":{"dtype":"I32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})", 4,
                  {"tensor 'w'", "duplicate key 'dtype'"});
  expect_rejected(R"({"__metadata__":{},"__metadata__":{}})", 0, {"duplicate"});
  expect_rejected(R"({"__metadata__":{"k":1}})", 0, {"__metadata__ 'k'", "expected a string"});
  expect_rejected(R"({"__metadata__":{"k":null}})", 0, {"__metadata__ 'k'", "null"});
  expect_rejected(R"({"__metadata__":{"k":"a","k":"b"}})", 0, {"duplicate key 'k'"});
  expect_rejected(R"({"__metadata__":["k"]})", 0, {"__metadata__ is array"});
}

TEST_F(Safetensors, EveryTruncationOrExtensionThrows) {
  std::map<std::string, Tensor> m = {{"a", testing::random_tensor({2, 3}, DType::F32, 1)},
                                     {"b", Tensor::full({}, 3, DType::I64)},
                                     {"c", Tensor::zeros({0}, DType::F16)}};
  save_safetensors(path("v.safetensors"), m, {{"k", "v"}});
  const Bytes full = read_file(path("v.safetensors"));
  ASSERT_NO_THROW(parse_safetensors(full.data(), full.size(), "v"));
  for (size_t len = 0; len < full.size(); ++len) {
    SCOPED_TRACE("prefix of " + std::to_string(len) + " bytes");
    // A heap copy of exactly `len` bytes, so AddressSanitizer sees any read past the end.
    std::vector<char> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len));
    EXPECT_THROW(parse_safetensors(prefix.data(), prefix.size(), "v"), Error);
    write_file(path("t.safetensors"), full.substr(0, len));
    EXPECT_THROW(load_safetensors(path("t.safetensors")), Error);
  }
  expect_rejected(full + '\0', {"data area"});
}

TEST_F(Safetensors, LoadErrorsNameTheFile) {
  expect_rejected(Bytes(), {"0 bytes"});
  try {
    load_safetensors(path("missing.safetensors"));
    ADD_FAILURE() << "loaded a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors: cannot open"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(load_safetensors(dir_.string()), Error);  // a directory
}

TEST_F(Safetensors, FailedSaveLeavesNothingBehind) {
  auto expect_save_error = [&](const std::string& file, const std::map<std::string, Tensor>& m,
                               const std::map<std::string, std::string>& meta,
                               const std::string& needle) {
    SCOPED_TRACE(file);
    try {
      save_safetensors(file, m, meta);
      ADD_FAILURE() << "save succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "safetensors::save");
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(file + ".tmp"));
  };
  const std::map<std::string, Tensor> ok = {{"w", Tensor::zeros({2})}};

  const std::string in_missing_dir = path("no/such/dir/w.safetensors");
  expect_save_error(in_missing_dir, ok, {}, "cannot create");
  EXPECT_FALSE(fs::exists(in_missing_dir));

  // The temp file is written, then the rename onto an existing directory fails.
  const std::string onto_dir = path("is_a_dir");
  fs::create_directory(onto_dir);
  expect_save_error(onto_dir, ok, {}, "cannot rename");
  EXPECT_TRUE(fs::is_directory(onto_dir));

  const std::string file = path("w.safetensors");
  expect_save_error(file, {{"w", Tensor()}}, {}, "'w' is undefined");
  expect_save_error(file, {{"__metadata__", Tensor::zeros({1})}}, {}, "reserved");
  expect_save_error(file, {{"bad\xff", Tensor::zeros({1})}}, {}, "not valid UTF-8");
  expect_save_error(file, ok, {{"k", "\xc3"}}, "not valid UTF-8");
  EXPECT_FALSE(fs::exists(file));

  // A failed save does not disturb an existing file at the same path.
  save_safetensors(file, ok);
  const Bytes before = read_file(file);
  expect_save_error(file, {{"w", Tensor()}}, {}, "undefined");
  EXPECT_EQ(read_file(file), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator{}), 2);
}

}  // namespace
}  // namespace attn
